"""The pure parts of ``pdserve bench multinode`` (bench/live/multinode.py)."""

from __future__ import annotations

from typing import Any

from bench.live.multinode import (
    FakeAutoscalingCluster,
    autoscale_args,
    layout_ratios,
    new_events,
    pinned,
    summarize_layout,
)
from bench.live.routing import Result, app_args
from deployments.config import load_app_config


def test_the_pinned_app_reserves_each_roles_resource_and_publishes_events_over_tcp() -> None:
    base = app_args("test", 2, None)
    args = pinned(base)
    cfg = load_app_config(args, environ={})
    assert cfg.prefill.resources == {"pdserve_prefill": 1}
    assert cfg.decode.resources == {"pdserve_decode": 1}
    assert cfg.ingress.resources == {"pdserve_ingress": 1}
    # the memory index's ingress may run on another node: TCP at the node's address
    assert cfg.prefill.kv_events.transport == "tcp"
    assert "resources" not in base["prefill"]  # the one-node layout's args are untouched
    one = load_app_config(base, environ={})
    assert one.prefill.kv_events.transport == "ipc"


def test_the_autoscaled_app_sizes_decode_between_one_and_two() -> None:
    cfg = load_app_config(autoscale_args(app_args("test", 2, None), 10.0), environ={})
    a = cfg.autoscaling
    assert a.enabled and a.downscale_delay_s == 10.0
    assert (a.decode.min_replicas, a.decode.max_replicas) == (1, 2)
    assert (a.prefill.min_replicas, a.prefill.max_replicas) == (1, 1)


def test_layout_summary_and_ratios() -> None:
    ok = [Result(True, 0.1 * k, 0.1 * k + 1.5, 100, 50) for k in range(1, 11)]
    s = summarize_layout([*ok, Result(False, 0, 0, error="HTTP 503")], max_tokens=16)
    assert s["requests"] == 11 and s["errors"] == 1 and s["error_samples"] == ["HTTP 503"]
    assert s["cached_token_ratio"] == 0.5
    assert abs(s["itl"]["p50"] - 0.1) < 1e-9  # (e2e - TTFT) / 15 = 1.5 / 15
    one = {"ttft": {"p50": 0.5, "p99": 2.0}, "itl": {"p50": 0.1, "p99": 0.2}}
    multi = {"ttft": {"p50": 0.6, "p99": 1.0}, "itl": {"p50": 0.1, "p99": None}}
    r = layout_ratios({"layouts": {"one_node": one, "multi_node": multi}})
    assert r["ttft_p50"] == 0.6 / 0.5 and r["ttft_p99"] == 0.5
    assert r["itl_p50"] == 1.0 and r["itl_p99"] is None


def _x(wanted: int, running: int, nodes: int, served: dict[str, int]) -> dict[str, Any]:
    return {"wanted": wanted, "running": running, "nodes": nodes, "served": served}


def test_the_autoscaling_timeline_orders_its_events() -> None:
    seen: dict[str, float] = {}
    first = {"d1"}

    def step(x: dict[str, Any]) -> list[str]:
        names = new_events(seen, x, first)
        for n in names:
            seen[n] = float(len(seen))
        return names

    assert step(_x(1, 1, 1, {"d1": 3})) == []
    assert step(_x(2, 1, 1, {"d1": 4})) == ["policy_wants_2"]
    assert step(_x(2, 1, 2, {"d1": 5})) == ["node_joined"]
    # a new replica that served before Serve counts it running is not yet "served"
    assert step(_x(2, 1, 2, {"d1": 5, "d2": 1})) == []
    assert step(_x(2, 2, 2, {"d1": 6, "d2": 0})) == ["replica_running"]
    assert step(_x(2, 2, 2, {"d1": 6, "d2": 2})) == ["new_replica_served"]
    # the replica gone before the node; nothing repeats
    assert step(_x(1, 1, 2, {"d1": 6})) == ["replica_gone"]
    assert step(_x(1, 1, 1, {"d1": 6})) == ["node_terminated"]
    assert step(_x(2, 2, 2, {"d1": 6, "d2": 9})) == []
    # the node going first is not its termination: the replica must have gone
    assert new_events({}, _x(1, 1, 1, {}), first) == []


def test_the_fake_providers_config_names_its_gcs_and_node_types() -> None:
    c = FakeAutoscalingCluster(
        head_resources={"CPU": 4, "pdserve_prefill": 1},
        worker_types={
            "pdserve.decode": {
                "resources": {"CPU": 1, "pdserve_decode": 1},
                "node_config": {},
                "min_workers": 1,
                "max_workers": 2,
            }
        },
        idle_timeout_s=15,
    )
    cfg = c.config("192.0.2.1:40000")
    assert cfg["provider"]["type"] == "fake_multinode"
    assert cfg["provider"]["gcs_address"] == "192.0.2.1:40000"
    assert cfg["provider"]["use_node_id_as_ip"] is True
    head = cfg["available_node_types"]["ray.head.default"]
    assert head["resources"] == {"CPU": 4, "pdserve_prefill": 1} and head["max_workers"] == 0
    assert cfg["available_node_types"]["pdserve.decode"]["max_workers"] == 2
    assert cfg["idle_timeout_minutes"] == 0.25 and cfg["max_workers"] == 2
    assert c.processes() == []  # not started: no port, nothing of its own
