"""``pdserve bench compare`` (bench.live.compare): the peer's config is Ray Serve LLM's own schema
with pdserve's engines, each pdserve variant is a valid app config with its schedulers and
routing, text prompts re-encode token for token, and the ratios and goal follow the rows.
The side-by-side run itself brings whole clusters up; its figures are in the issue's note."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from bench.live.compare import (
    SYSTEMS,
    as_text,
    goal,
    pdserve_config,
    peer_config,
    prometheus_sum,
    ratios,
    with_preset,
    word_tokens,
)
from bench.workloads.replay import LiveRequest, scenario_requests
from deployments.config import engine_launch, load_app_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def base(tiny_model_dir: Path) -> dict[str, Any]:
    raw = yaml.safe_load((ROOT / "configs/pd_cluster.yaml").read_text())
    raw["applications"][0]["args"]["model"]["path"] = str(tiny_model_dir)
    return raw


def test_the_peer_config_is_ray_serve_llms_pd_schema_on_pdservers_engines(
    base: dict[str, Any],
) -> None:
    from ray.llm._internal.serve.serving_patterns.prefill_decode.builder import PDServingArgs

    cfg = load_app_config(base["applications"][0]["args"])
    for name, module_path in (("peer", None), ("peer-connector", "engines.nixl_connector")):
        raw = peer_config(base, SYSTEMS[name])
        app = raw["applications"][0]
        assert app["import_path"] == "ray.serve.llm:build_pd_openai_app"
        pd = PDServingArgs.model_validate(app["args"])  # Ray Serve LLM's own validation
        for role, llm in (("prefill", pd.prefill_config), ("decode", pd.decode_config)):
            ours = engine_launch(cfg, role, _ports())
            kw = llm.engine_kwargs
            assert llm.model_id == cfg.model.served_name
            assert (kw["dtype"], kw["block_size"], kw["max_model_len"]) == (
                ours.dtype,
                ours.block_size,
                ours.max_model_len,
            )
            assert kw["prefix_caching_hash_algo"] == cfg.hashing.algo
            assert "scheduler_cls" not in kw  # the peer runs vLLM's stock scheduler
            ktc = kw["kv_transfer_config"]
            assert ktc["kv_connector"] == "NixlConnector"
            assert ktc.get("kv_connector_module_path") == module_path
            if module_path:  # like for like: pdserve's connector with pdserve's pacing
                assert ktc["kv_connector_extra_config"] == {
                    "nixl_progress_thread": False,
                    "nixl_progress_poll_us": cfg.engine(role).nixl_progress_poll_us,
                    "nixl_core_pin": False,  # its engines on their cores, as pdserve's
                }
            env = app["args"][f"{role}_config"]["runtime_env"]["env_vars"]
            assert env["VLLM_CPU_OMP_THREADS_BIND"] == cfg.engine(role).cpu_bind
            assert env["VLLM_CPU_KVCACHE_SPACE"] == str(cfg.engine(role).kv_cache_gib)
            assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env  # the peer's AsyncLLM runtime
            dep = app["args"][f"{role}_config"]["deployment_config"]
            assert dep["num_replicas"] == cfg.engine(role).num_replicas
            assert dep["request_router_config"]["request_router_class"].endswith(
                "PrefixCacheAffinityRouter"
            )
    assert peer_config(base, SYSTEMS["peer"])["http_options"]["port"] == 8000
    # the before of issue 39's before/after: vLLM's pin kept, on both sides alike
    pinned = peer_config(base, SYSTEMS["peer-connector-pinned"])["applications"][0]["args"]
    for role in ("prefill", "decode"):
        extra = pinned[f"{role}_config"]["engine_kwargs"]["kv_transfer_config"]
        assert extra["kv_connector_extra_config"]["nixl_core_pin"] is True
    mine = pdserve_config(base, SYSTEMS["pdserve-pinned"])["applications"][0]["args"]
    assert mine["prefill"]["nixl_core_pin"] is mine["decode"]["nixl_core_pin"] is True
    assert (
        "nixl_core_pin"
        not in pdserve_config(base, SYSTEMS["pdserve"])["applications"][0]["args"]["decode"]
    )


def _ports() -> Any:
    from deployments.config import ReplicaPorts

    return ReplicaPorts("127.0.0.1", 20000, None, None)


@pytest.mark.parametrize(
    ("name", "prefill", "decode", "routing"),
    [
        ("pdserve", "FairwayScheduler", "TWPScheduler", "prefix_load"),
        ("pdserve-fcfs-rr", None, None, "round_robin"),
        ("pdserve-fairway", "FairwayScheduler", None, "prefix_load"),
        ("pdserve-twp", None, "TWPScheduler", "prefix_load"),
        ("pdserve-async", "FairwayScheduler", "TWPScheduler", "prefix_load"),
    ],
)
def test_each_pdserve_variant_is_a_valid_app_with_its_schedulers_and_routing(
    base: dict[str, Any], name: str, prefill: str | None, decode: str | None, routing: str
) -> None:
    raw = pdserve_config(base, SYSTEMS[name])
    cfg = load_app_config(raw["applications"][0]["args"])
    got = [
        (c.rsplit(".", 1)[-1] if c else None)
        for c in (cfg.prefill.scheduler_cls, cfg.decode.scheduler_cls)
    ]
    assert got == [prefill, decode]
    assert cfg.routing.policy == routing
    assert cfg.prefill.num_replicas == 2  # the base's replica counts stay
    runtime = "async_llm" if name == "pdserve-async" else "in_process"  # CPU: auto is in_process
    assert cfg.prefill.resolved_runtime == cfg.decode.resolved_runtime == runtime
    # the base config is left as it was
    assert base["applications"][0]["args"]["prefill"]["scheduler_cls"] == (
        "engines.scheduler.FairwayScheduler"
    )


def test_with_preset_points_the_model_at_the_built_preset(base: dict[str, Any]) -> None:
    m = with_preset(base, "bench")["applications"][0]["args"]["model"]
    assert (m["served_name"], m["build_preset"]) == ("bench", "bench")
    assert m["path"].endswith("/models/bench")
    assert with_preset(base, None) == base


def test_text_prompts_reencode_token_for_token_and_keep_shared_prefixes(
    tiny_model_dir: Path,
) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    words = word_tokens(tok)
    assert len(words) >= 64
    reqs = scenario_requests("rag", 1000, seed=0, max_tokens=4)[:12]
    texts = as_text(reqs, tok)
    for r, t in zip(reqs, texts, strict=True):
        assert t.text is not None and t.ids == r.ids
        enc = tok.encode(t.text).ids
        assert len(enc) == len(r.ids)  # exactly one token per prompt id
    # two requests on one document share their prefix as text and as tokens
    by_doc: dict[str, list[int]] = {}
    for i, r in enumerate(reqs):
        by_doc.setdefault(r.label, []).append(i)
    i, j = next(v for v in by_doc.values() if len(v) > 1)[:2]
    shared = next(k for k in range(len(reqs[i].ids)) if reqs[i].ids[k] != reqs[j].ids[k])
    a, b = (tok.encode(texts[k].text or "").ids for k in (i, j))
    assert shared >= 128 and a[:shared] == b[:shared]
    # equal ids give equal words, other ids other words
    x, y = as_text([LiveRequest(0.0, (11, 12, 13), 1), LiveRequest(0.0, (11, 12, 14), 1)], tok)
    assert x.text is not None and y.text is not None
    assert x.text.split()[:2] == y.text.split()[:2] and x.text.split()[2] != y.text.split()[2]


def test_prometheus_sum_adds_the_matching_labelled_samples() -> None:
    text = "\n".join(
        [
            "# HELP ray_vllm_prefix_cache_hits_total hits",
            'ray_vllm_prefix_cache_hits_total{ReplicaId="p1",model_name="bench"} 384.0',
            'ray_vllm_prefix_cache_hits_total{ReplicaId="p2",model_name="bench"} 128.0',
            'ray_vllm_prefix_cache_hits_total{ReplicaId="d1",model_name="bench"} 999.0',
            'ray_vllm_prefix_cache_queries_total{ReplicaId="p1",model_name="bench"} 1e3',
        ]
    )

    def prefill(labels: dict[str, str]) -> bool:
        return labels.get("ReplicaId") in {"p1", "p2"}

    assert prometheus_sum(text, "ray_vllm_prefix_cache_hits_total", prefill) == 512.0
    assert prometheus_sum(text, "ray_vllm_prefix_cache_queries_total", prefill) == 1000.0
    assert prometheus_sum(text, "ray_vllm_missing_total", prefill) == 0.0


def _row(ttft50: float, ttft99: float, tps: float, rss: int) -> dict[str, Any]:
    return {
        "summary": {
            "ttft": {"p50": ttft50, "p99": ttft99},
            "itl": {"p99": 0.02},
            "throughput_tps": tps,
            "cached_token_ratio": 0.5,
        },
        "rss_idle_bytes": rss,
        "rss_peak_bytes": rss,
        "deploy_to_first_token_s": 60.0,
    }


def test_ratios_are_over_the_reference_and_the_goal_reads_them() -> None:
    rows = {
        "pdserve": _row(0.4, 2.0, 110.0, 8),
        "peer-connector": _row(1.0, 2.0, 100.0, 10),
        "peer": {"error": "TimeoutError: no first token"},
    }
    r = ratios(rows)
    assert set(r) == {"pdserve", "peer"}
    assert r["pdserve"]["ttft_p50"] == pytest.approx(0.4)
    assert r["pdserve"]["ttft_p99"] == pytest.approx(1.0)
    assert r["pdserve"]["throughput"] == pytest.approx(1.1)
    assert r["peer"]["ttft_p50"] is None  # a failed system has no ratios
    g = goal(r["pdserve"])
    assert g == {
        "throughput >= 1.0x": True,
        "ttft_p50 <= 0.8x": True,
        "ttft_p99 <= 0.8x": False,
        "memory < 1.0x": True,
    }
    assert ratios({"pdserve": rows["pdserve"]}) == {}  # no reference: no ratios


def test_the_cli_refuses_unknown_systems_and_presets_with_the_option_named() -> None:
    from pdserve.cli import app

    runner = CliRunner()
    r = runner.invoke(app, ["bench", "compare", "--out", "x", "--systems", "pdserve,vllm"])
    assert r.exit_code == 2 and "--systems" in r.output and "vllm" in r.output
    r = runner.invoke(app, ["bench", "compare", "--out", "x", "--preset", "huge"])
    assert r.exit_code == 2 and "--preset" in r.output
    r = runner.invoke(app, ["bench", "compare", "--out", "x", "--rate", "2", "--concurrency", "2"])
    assert r.exit_code == 2 and "at most one" in r.output


def test_the_report_tables_every_system_names_the_failed_one_and_plots(tmp_path: Path) -> None:
    import json

    from bench.live.compare import report

    lag = {"p50_ms": 0.2, "p99_ms": 3.5, "max_ms": 9.0}
    replicas = {
        "decode": [{"id": "abcdefgh123", "runtime": "async_llm", "rss_mb": 812.5, "loop_lag": lag}],
        "prefill": [{"id": "ijklmnop456", "runtime": "in_process", "engine_cpus": [0]}],
    }
    rows = {
        "pdserve": _row(0.4, 2.0, 110.0, 8 * 2**30) | {"idle_cpu_percent": 1.5},
        "peer-connector": _row(1.0, 2.0, 100.0, 10 * 2**30) | {"idle_cpu_percent": 2.0},
        "peer": {"error": "TimeoutError: no first token after 900 s"},
    }
    for n in ("pdserve", "peer-connector"):
        (tmp_path / n).mkdir()
        (tmp_path / n / "ttft.json").write_text(json.dumps([0.1, 0.2, 0.4]))
    r = ratios(rows)
    res = {
        "workload": "rag",
        "requests": 3,
        "model": "test",
        "prefill_replicas": 2,
        "decode_replicas": 1,
        "reference": "peer-connector",
        "systems": rows,
        "ratios": r,
        "goal": goal(r["pdserve"]),
    }
    rows["pdserve"]["summary"] |= {"replicas": replicas, "itl": {"p50": 0.0123, "p99": 0.02}}
    files = report(res, tmp_path)
    text = (tmp_path / "report.md").read_text()
    assert (
        "| pdserve | decode | abcdefgh | async_llm | - | 812.5 | 0.2 / 3.5 / 9.0 | 12.3 |" in text
    )
    assert "| pdserve | prefill | ijklmnop | in_process | 0 | - | - / - / - | 12.3 |" in text
    assert "| pdserve | 400 | 2000 | 20 | 110.0 | 0.50 | - | 60.0 | 8.00 | 8.00 | 1.5 |" in text
    assert "| peer | failed: TimeoutError: no first token" in text
    assert "| pdserve | 0.40 | 1.00 | 1.00 | 1.10 |" in text
    assert "- ttft_p99 <= 0.8x: not met" in text and "- ttft_p50 <= 0.8x: met" in text
    assert all(f.exists() and f.stat().st_size > 0 for f in files)
    assert {f.name for f in files} == {"report.md", "compare.png", "ttft_cdf.png"}


def test_process_kind_names_ray_roles_engines_and_programs() -> None:
    from bench.live.compare import process_kind

    assert process_kind(["ray::ServeReplica:pdserve:Prefill", ""]) == (
        "ray::ServeReplica:pdserve:Prefill"
    )
    assert process_kind(["VLLM::EngineCore"]) == "VLLM::EngineCore"
    assert process_kind(["/opt/ray/core/src/ray/raylet/raylet", "--x=1"]) == "raylet"
    assert process_kind(["/venv/bin/python3", "-u", "/x/ray/_private/log_monitor.py"]) == (
        "python log_monitor.py"
    )
    assert process_kind(["python", "-m", "ray.dashboard.agent"]) == "python -m ray.dashboard.agent"
    assert process_kind([]) == "?"


def test_cpu_by_kind_counts_only_the_time_spent_between_snapshots() -> None:
    from bench.live.compare import cpu_by_kind, cpu_by_process

    before = {1: ("raylet", 10.0), 2: ("VLLM::EngineCore", 100.0), 3: ("gone", 5.0)}
    after = {
        1: ("raylet", 12.5),
        2: ("VLLM::EngineCore", 160.0),
        4: ("VLLM::EngineCore", 7.0),  # started in between: all of its time counts
        5: ("raylet", 1.0),  # a recycled pid of another kind would count from zero
    }
    got = cpu_by_kind(before, after)
    assert got == {"VLLM::EngineCore": 67.0, "raylet": 3.5}
    assert list(got) == ["VLLM::EngineCore", "raylet"]  # largest first
    # per process, two engines of one kind stay apart
    assert cpu_by_process(before, after, top=3) == [
        ["VLLM::EngineCore", 60.0],
        ["VLLM::EngineCore", 7.0],
        ["raylet", 2.5],
    ]


def test_write_requests_keeps_one_line_per_request_in_order(tmp_path: Path) -> None:
    import json

    from bench.live.compare import write_requests
    from bench.live.replay import LiveResult

    reqs = [LiveRequest(0.0, (1, 2), 4, label="doc:3"), LiveRequest(0.5, (1,), 4)]
    res = [
        LiveResult(0.01, True, ttft_s=0.2, e2e_s=0.5, prompt_tokens=2, cached_tokens=1),
        LiveResult(0.52, False, error="HTTP 400: " + "x" * 500),
    ]
    res[0].prefill_replica, res[0].decode_replica = "p1", "d1"
    path = tmp_path / "requests.jsonl"
    write_requests(path, reqs, res)
    rows = [json.loads(ln) for ln in path.read_text().splitlines()]
    assert [r["label"] for r in rows] == ["doc:3", ""]
    assert rows[0]["cached_tokens"] == 1 and rows[0]["ttft_s"] == 0.2 and rows[0]["sent_s"] == 0.01
    assert rows[1]["ok"] is False and len(rows[1]["error"]) == 200
    assert (rows[0]["prefill_replica"], rows[0]["decode_replica"]) == ("p1", "d1")
    assert "prefill_replica" not in rows[1]  # not named (the peer's): left out


@contextlib.contextmanager
def _stats_server(body: Callable[[bool], dict[str, Any]]) -> Iterator[str]:
    """A stand-in ingress answering ``/v1/pdserve/stats`` with ``body(ok)``: 200 with the
    operator's key (``sk-op``), else 401; yields its URL."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Stats(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server hook's name
            ok = self.headers.get("Authorization") == "Bearer sk-op"
            self.send_response(200 if ok else 401)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(json.dumps(body(ok)).encode())

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Stats)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


def test_the_stats_are_read_with_the_operators_key_and_a_refusal_keeps_no_error_body() -> None:
    """An app that needs keys refuses ``/v1/pdserve/stats`` without the operator's; the kept
    stats were then its 401 body (the multi_tenant cells' ``stats.json``). With the key they
    are read; a refusal gives no stats rather than the error as if it were stats."""
    from bench.live.compare import pdserve_stats

    calls = [0]

    def body(ok: bool) -> dict[str, Any]:
        calls[0] += 1  # the two ingress replicas answer in turn
        return {"ingress": {"requests": 3, "replica": f"i{calls[0] % 2}"}} if ok else {"error": "x"}

    with _stats_server(body) as url:
        assert pdserve_stats(url, "sk-op") == {"ingress": {"requests": 3, "replica": "i1"}}
        assert pdserve_stats(url) == {} and pdserve_stats(url, "sk-other") == {}
        # two ingress replicas: read until both were seen, each one's section kept
        both = pdserve_stats(url, "sk-op", ingress_replicas=2)
        assert sorted(both["ingresses"]) == ["i0", "i1"] and both["ingress"]["requests"] == 3


def test_the_benchs_ray_head_gets_a_token_on_a_fresh_machine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``start_ray`` under token authentication makes the cluster token where Ray reads it
    when it is missing (on a fresh machine ``ray start`` refused to start without one, and
    every run of the matrix failed), and keeps an existing token as it is."""
    import stat
    import subprocess

    import bench.live.compare as compare

    started: list[dict[str, str]] = []

    def fake_run(cmd: list[str], env: dict[str, str], **_: Any) -> Any:
        started.append(env)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(compare.subprocess, "run", fake_run)
    token = tmp_path / "ray" / "auth_token"
    env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token), "PATH": "/usr/bin"}
    compare.start_ray(env)
    assert token.exists() and len(token.read_text().strip()) >= 32
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and len(started) == 1
    first = token.read_text()
    compare.start_ray(env)
    assert token.read_text() == first  # an existing token is kept
    other = tmp_path / "none" / "auth_token"
    compare.start_ray({"RAY_AUTH_MODE": "disabled", "RAY_AUTH_TOKEN_PATH": str(other)})
    assert not other.exists()  # no token without token authentication


def test_the_stats_timeline_keeps_each_engines_load_over_the_replay(tmp_path: Path) -> None:
    """While a replay runs, the stats are read every period with the operator's key; each row
    keeps every engine replica's queue and KV fields by role and id (what the cause analysis
    of a wait at the prefill engine needs), and a refused read adds no row."""
    import time

    from bench.live.compare import StatsTimeline, plot_timeline, timeline_row

    report = {
        "id": "p1",
        "waiting": 7,
        "running": 1,
        "kv_usage": 0.9,
        "kv_pinned_requests": 12,
        "rss_mb": 1.0,
    }
    stats = {
        "ingress": {"prefill_queue": {"in_flight": 9}},
        "replicas": {"prefill": [report], "decode": [{"id": "d1", "waiting": 2, "running": 5}]},
    }
    row = timeline_row(stats, 3.14159)
    assert row["t"] == 3.14 and row["prefill_in_flight"] == 9
    p1 = row["replicas"]["prefill"]["p1"]
    assert (p1["waiting"], p1["kv_usage"], p1["kv_pinned_requests"]) == (7, 0.9, 12)
    assert "rss_mb" not in p1 and row["replicas"]["decode"]["d1"]["running"] == 5

    with _stats_server(lambda ok: stats if ok else {"error": "no key"}) as url:
        with StatsTimeline(url, "sk-op", period_s=0.05) as good, StatsTimeline(url, None) as bad:
            deadline = time.monotonic() + 10
            while len(good.rows) < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
        assert len(good.rows) >= 3 and bad.rows == []
        ts = [r["t"] for r in good.rows]
        assert ts == sorted(ts) and good.rows[0]["replicas"] == row["replicas"]
    plot_timeline(good.rows, tmp_path / "e.png", "pdserve")
    assert (tmp_path / "e.png").stat().st_size > 0
