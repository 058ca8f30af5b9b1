"""The live replayer's workloads, shaping and summary (bench.workloads.replay, bench.live.replay); the replay itself runs
against the live app in tests/e2e/test_pd_app.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.live.replay import LiveResult, summarize, write_report
from bench.workloads.replay import LiveRequest, scenario_requests, shape, trace_requests
from bench.workloads.traces import TraceRequest

VOCAB = 1000


def test_mooncake_hash_ids_become_shared_runs_of_512_tokens() -> None:
    a, b, c = trace_requests(
        [
            TraceRequest(0.0, 1200, 4, (7, 8, 9)),
            TraceRequest(1.0, 1100, 4, (7, 8, 5)),
            TraceRequest(2.0, 600, 4, (6, 8)),
        ],
        VOCAB,
    )
    assert (len(a.ids), len(b.ids), len(c.ids)) == (1200, 1100, 600)
    assert a.ids[:1024] == b.ids[:1024]  # blocks 7 and 8 shared
    assert a.ids[1024:1100] != b.ids[1024:1100]  # block 9 against block 5
    assert a.ids[512:1024] != c.ids[512:1024] or a.ids[:512] != c.ids[:512]
    assert c.ids[:512] != a.ids[:512]  # another first block: no shared prefix
    # the same trace gives the same prompts (seeded); another seed other ones
    assert trace_requests([TraceRequest(0.0, 600, 4, (7, 8))], VOCAB)[0].ids == a.ids[:600]
    assert trace_requests([TraceRequest(0.0, 600, 4, (7, 8))], VOCAB, seed=1)[0].ids != a.ids[:600]
    assert all(10 <= t < VOCAB for t in a.ids)


def test_azure_records_share_nothing() -> None:
    a, b = trace_requests([TraceRequest(0.0, 300, 5), TraceRequest(0.5, 300, 5)], VOCAB)
    assert a.ids[:16] != b.ids[:16] and a.max_tokens == 5


def test_shaping_keeps_prefixes_and_counts_cuts() -> None:
    reqs = [LiveRequest(10.0 + i, tuple(range(100 + i, 400 + i)), 40) for i in range(4)]
    out, cut = shape(reqs, limit=3, time_scale=2.0, length_scale=0.5, max_prompt_tokens=140)
    assert [r.at_s for r in out] == [0.0, 2.0, 4.0]
    assert [len(r.ids) for r in out] == [140, 140, 140] and cut == 3
    assert out[1].ids == reqs[1].ids[:140] and out[0].max_tokens == 20
    a, _ = shape(reqs, rate=5.0, seed=3)
    b, _ = shape(reqs, rate=5.0, seed=3)
    assert (
        a == b and a[0].at_s == 0.0 and all(x.at_s < y.at_s for x, y in zip(a, a[1:], strict=False))
    )
    for bad in ({"time_scale": 0.0}, {"length_scale": -1.0}, {"rate": 0.0}):
        with pytest.raises(ValueError):
            shape(reqs, **bad)  # type: ignore[arg-type]


def test_scenarios_keep_shared_documents_shared() -> None:
    rag = scenario_requests("rag", VOCAB, max_tokens=8)
    by_doc: dict[str, list[LiveRequest]] = {}
    for r in rag:
        by_doc.setdefault(r.label, []).append(r)
    doc, same = max(by_doc.items(), key=lambda kv: len(kv[1]))
    assert len(same) > 1 and same[0].ids[:1536] == same[1].ids[:1536]  # 12 blocks of 128
    assert same[0].ids[-96:] != same[1].ids[-96:]  # each its own question
    sec = scenario_requests("sec-spike", VOCAB, quick=True)
    assert len(sec) > 10 and all(r.max_tokens == 16 for r in sec)
    firsts = {r.ids[:128] for r in sec}
    assert len(firsts) < len(sec)  # the shared system prompt and excerpts are shared ids
    with pytest.raises(ValueError, match="unknown scenario 'nope'.*rag"):
        scenario_requests("nope", VOCAB)


def test_summary_follows_the_schema_and_the_report_is_written(tmp_path: Path) -> None:
    results = [
        LiveResult(0.0, True, 0.1, 0.5, [0.02, 0.04], 100, 50, 3),
        LiveResult(0.5, True, 0.3, 0.9, [0.02, 0.02], 100, 0, 3),
        LiveResult(1.0, False, error="HTTP 503: overloaded"),
    ]
    s = summarize("http://x", results, wall_s=2.0)
    assert (s["requests"], s["errors"], s["error_kinds"]) == (3, 1, {"HTTP 503": 1})
    assert s["ttft"]["p50"] == 0.1 and s["ttft"]["p99"] == 0.3
    assert s["ttft"]["mean"] == pytest.approx(0.2)
    assert s["itl"]["mean"] == pytest.approx(0.025) and s["itl"]["p99"] == 0.04
    assert s["itl"]["cv"] == pytest.approx(0.000075**0.5 / 0.025)  # pstdev / mean
    assert s["throughput_tps"] == 3.0 and s["cached_token_ratio"] == 0.25
    assert set(s["e2e"]) == {"p50", "p90", "p99", "mean"}
    assert s["by_prefill_replica"] == {}  # no endpoint named its replicas
    json.dumps(s)
    files = write_report(tmp_path, s, results)
    assert {f.name for f in files} == {"ttft_cdf.png", "ttft_over_time.png", "itl.png", "report.md"}
    assert "| TTFT s | 0.100 |" in (tmp_path / "report.md").read_text()


def test_the_summary_splits_requests_by_the_prefill_replica_that_served_them(
    tmp_path: Path,
) -> None:
    results = [
        LiveResult(0.0, True, 0.1, 0.5, [], 100, 50, 3, prefill_replica="p1"),
        LiveResult(0.5, True, 0.4, 0.9, [], 100, 0, 3, prefill_replica="p2"),
        LiveResult(0.7, True, 0.2, 0.9, [], 300, 300, 3, prefill_replica="p1"),
        LiveResult(0.8, True, 0.9, 0.9, [], 100, 0, 3),  # not named: left out
        LiveResult(1.0, False, error="HTTP 503: overloaded", prefill_replica="p2"),  # failed
    ]
    per = summarize("http://x", results, wall_s=2.0)["by_prefill_replica"]
    assert list(per) == ["p1", "p2"]
    assert per["p1"]["requests"] == 2 and per["p1"]["ttft"]["p99"] == 0.2
    assert per["p1"]["cached_token_ratio"] == 350 / 400
    assert per["p2"]["requests"] == 1 and per["p2"]["cached_token_ratio"] == 0.0
    write_report(tmp_path, summarize("http://x", results, wall_s=2.0), results)
    assert "| p1 | 2 | 0.100 | 0.200 | 0.875 |" in (tmp_path / "report.md").read_text()


def test_a_replay_workload_refuses_what_no_replay_can_run() -> None:
    from bench.workloads.replay import ReplayWorkload

    ReplayWorkload(scenario="rag").check()
    for bad, says in (
        ({}, "exactly one"),
        ({"scenario": "rag", "trace": Path("t.jsonl")}, "exactly one"),
        ({"trace": Path("t.jsonl")}, "--trace-format"),
        ({"scenario": "rag", "rate": 1.0, "concurrency": 2}, "at most one"),
        ({"scenario": "rag", "concurrency": 0}, ">= 1"),
    ):
        with pytest.raises(ValueError, match=says):
            ReplayWorkload(**bad).check()  # type: ignore[arg-type]


def test_every_replay_command_takes_the_options_of_the_one_definition() -> None:
    """``bench live`` and ``bench compare`` take every ReplayWorkload field as an option, and
    hand them on as one ReplayWorkload (an impossible one is refused before any request)."""
    import dataclasses

    from typer.main import get_command
    from typer.testing import CliRunner

    from bench.workloads.replay import ReplayWorkload
    from pdserve.cli import app

    fields = {f.name for f in dataclasses.fields(ReplayWorkload)}
    bench = get_command(app).commands["bench"]  # type: ignore[attr-defined]
    for name in ("live", "compare"):
        assert fields <= {p.name for p in bench.commands[name].params}, name
    r = CliRunner().invoke(app, ["bench", "live", "--endpoint", "http://x", "--out", "o"])
    assert r.exit_code == 2 and "exactly one of --trace or --scenario" in r.output
