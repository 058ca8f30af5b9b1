"""Telemetry pieces without a cluster: spans through the file exporter with W3C propagation,
config errors that name the field, metrics as no-ops outside Ray, the dashboard's queries
against the declared series, and ``pdserve status``'s rendering."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from deployments.config import AppConfig
from deployments.telemetry import SERIES, child, extract, inject, metrics, set_attrs, tracer

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "configs" / "grafana" / "pdserve.json"


def spans_in(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(ln) for f in sorted(folder.glob("spans-*.jsonl")) for ln in f.open()]


def test_spans_follow_a_client_traceparent_across_a_carrier(tmp_path: Path) -> None:
    cfg = {"exporter": "file", "path": str(tmp_path)}
    ingress, engine = tracer(cfg, "ut-ingress"), tracer(cfg, "ut-engine")
    client = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    root = ingress.start_span("pdserve.request", context=extract({"traceparent": client}))
    call = child(ingress, "pdserve.prefill", root, replica="r1", ignored=None)
    carrier = inject(call)  # what crosses to the engine replica in EngineRequest.trace
    assert carrier["traceparent"].split("-")[1] == "0af7651916cd43dd8448eb211c80319c"
    remote = engine.start_span("engine.prefill", context=extract(carrier))
    set_attrs(remote, {"admission.lane": "fast"})
    for s in (remote, call, root):
        s.end()
    by_name = {s["name"]: s for s in spans_in(tmp_path)}
    assert set(by_name) == {"pdserve.request", "pdserve.prefill", "engine.prefill"}
    assert {s["context"]["trace_id"] for s in by_name.values()} == {
        "0x0af7651916cd43dd8448eb211c80319c"
    }
    assert by_name["pdserve.request"]["parent_id"] == "0xb7ad6b7169203331"
    assert (
        by_name["engine.prefill"]["parent_id"] == by_name["pdserve.prefill"]["context"]["span_id"]
    )
    assert by_name["pdserve.prefill"]["attributes"] == {"pdserve.replica": "r1"}
    assert by_name["engine.prefill"]["attributes"]["admission.lane"] == "fast"


def test_the_file_exporter_needs_a_folder_named_in_the_error() -> None:
    with pytest.raises(ValidationError, match=r"observability\.tracing\.path"):
        AppConfig.model_validate({"observability": {"tracing": {"exporter": "file"}}})
    with pytest.raises(ValidationError, match="exporter"):
        AppConfig.model_validate({"observability": {"tracing": {"exporter": "zipkin"}}})


def test_metrics_are_no_ops_outside_ray() -> None:
    m = metrics()
    m.inc("pdserve_requests", tenant="a", endpoint="chat", status="200")
    m.observe("pdserve_ttft_seconds", 0.1, tenant="a")
    m.set("pdserve_engine_waiting", None, role="prefill", replica="x")  # None: not set


def _exported(name: str) -> str:
    kind = SERIES[name][0]
    return f"ray_{name}" + {"counter": "_total", "histogram": "_bucket", "gauge": ""}[kind]


def test_every_dashboard_query_names_a_declared_series() -> None:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = set(re.findall(r"\bray_pdserve_[a-z0-9_]+", " ".join(exprs)))
    exported = {_exported(n) for n in SERIES}
    assert used and used <= exported, used - exported
    # and the dashboard shows every series the app declares
    assert {re.sub(r"_(total|bucket)$", "", u) for u in used} == {f"ray_{n}" for n in SERIES}
    assert all(p["datasource"]["uid"] == "${datasource}" for p in dash["panels"])


def test_status_renders_a_stats_body() -> None:
    from rich.console import Console

    from pdserve.commands.status import render

    body = {
        "replicas": {
            "prefill": [
                {"id": "p-1", "node_ip": "127.0.0.2", "routed": 3, "waiting": 1, "kv_usage": 0.25}
            ],
            "decode": [{"id": "d-1", "routed": 3, "window_tokens": 4096, "token_load": 100}],
        },
        "totals": {"prefill": {"prompt_tokens": 400, "cached_tokens": 100}},
        "router": {"policy": "prefix_load", "fallbacks": {"hotspot": 2}},
        "index": {"backend": "memory", "lookups": 3},
        "ingress": {"requests": 3, "refused": 0, "overhead_s": {"p50": 0.004, "p99": 0.02}},
    }
    con = Console(record=True, width=160)
    con.print(render(body))
    text = con.export_text()
    for want in ("p-1", "127.0.0.2", "d-1", "25%", "4,096", "hotspot=2", "25.0%", "prefix_load"):
        assert want in text, want


def test_admission_records_are_found_under_vllms_internal_ids() -> None:
    from types import SimpleNamespace

    from engines.engine_rpc import call

    adm = {"decode-r-1-abcdefgh": {"lane": None}, "decode-r-zyxwvuts": {"lane": "fast"}}
    sched = SimpleNamespace(admissions=adm)
    assert call(sched, "pop_admission", ["decode-r"]) == {"lane": "fast"}  # not -1's
    assert call(sched, "pop_admission", ["decode-r-1"]) == {"lane": None}
    assert adm == {} and call(sched, "pop_admission", ["decode-r"]) is None


def test_span_ids_do_not_follow_pythons_seeded_random(tmp_path: Path) -> None:
    """vLLM seeds ``random`` alike in every engine process: ids must not come from it."""
    import random

    t = tracer({"exporter": "file", "path": str(tmp_path)}, "ut-seeded")
    ids = []
    for _ in range(2):
        random.seed(0)  # as two engine processes would be
        span = t.start_span("x")
        ids.append((span.get_span_context().trace_id, span.get_span_context().span_id))
        span.end()
    assert ids[0][0] != ids[1][0] and ids[0][1] != ids[1][1]


def test_counter_publisher_sends_each_fields_increase_once(monkeypatch: Any) -> None:
    from controllers.decode.twp import TWPCounters
    from deployments import telemetry

    sent: list[tuple[str, float, dict[str, str]]] = []

    class Recorder:
        def inc(self, name: str, value: float = 1.0, **tags: str) -> None:
            sent.append((name, value, tags))

    monkeypatch.setattr(telemetry, "_METRICS", Recorder())
    pub = telemetry.CounterPublisher("pdserve_twp_events")
    pub.publish(TWPCounters(admitted=3, closed_by_window=1), replica="d1")
    pub.publish(TWPCounters(admitted=5, closed_by_window=1), replica="d1")
    pub.publish(TWPCounters(admitted=1), replica="d2")  # another replica counts apart
    assert sent == [
        ("pdserve_twp_events", 3, {"event": "admitted", "replica": "d1"}),
        ("pdserve_twp_events", 1, {"event": "closed_by_window", "replica": "d1"}),
        ("pdserve_twp_events", 2, {"event": "admitted", "replica": "d1"}),
        ("pdserve_twp_events", 1, {"event": "admitted", "replica": "d2"}),
    ]


def test_loop_lag_sees_a_blocked_loop() -> None:
    """A coroutine that holds the loop for 0.2 s makes the next timer at least that late;
    the report's max says so and the window keeps its samples."""
    import asyncio

    from deployments.telemetry import LoopLag

    async def go() -> dict[str, float | int]:
        lag = LoopLag(period_s=0.01)
        lag.start()
        await asyncio.sleep(0.05)
        time.sleep(0.2)  # holds the loop, as a step loop holding the GIL would
        await asyncio.sleep(0.05)
        lag.stop()
        return lag.report()

    rep = asyncio.run(go())
    assert rep["samples"] >= 2
    assert rep["max_ms"] >= 150 and rep["max_since_start_ms"] >= 150
    assert rep["p50_ms"] <= rep["p99_ms"] <= rep["max_ms"]
    assert LoopLag().report() == {"samples": 0}
