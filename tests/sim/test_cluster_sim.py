"""The cluster simulation: N prefill replicas behind the routing policy (simulated)."""

from __future__ import annotations

from functools import cache

import pytest

from bench.sim.cluster import ClusterRun, simulate_cluster
from bench.sim.prefill import EngineConfig, SimRequest
from bench.sim.profiles import load_profile
from bench.workloads.prefill_scenarios import Workload, build_scenario
from controllers.profile import EngineProfile

pytestmark = pytest.mark.slow


@cache
def _work() -> tuple[EngineProfile, Workload]:
    prof = load_profile("a6000_llama31_8b")
    return prof, build_scenario("sec-spike", seed=0, quick=True, profile=prof)


def _run(routing: str, policy: str = "fairway", replicas: int = 4) -> ClusterRun:
    prof, work = _work()
    reqs = [
        SimRequest(q.request_id, q.arrival_s / replicas, q.prompt_tokens, q.block_hashes, q.labels)
        for q in work.requests
    ]
    return simulate_cluster(
        reqs,
        replicas,
        routing,
        policy,
        prof,
        work.cache_blocks,
        config=EngineConfig(token_budget=prof.token_budget, block_size=work.block_size),
        warm=work.warm,
    )


def test_every_request_finishes_and_work_is_accounted() -> None:
    run = _run("prefix_load")
    _, work = _work()
    assert run.unfinished == 0 and len(run.finished) == len(work.requests)
    uncached = sum(f.prompt_tokens - f.cached_tokens for f in run.finished)
    assert sum(run.work_per_replica) == uncached


def test_deterministic() -> None:
    assert _run("prefix_load").summary() == _run("prefix_load").summary()


def test_prefix_only_makes_a_hot_spot_and_prefix_load_does_not() -> None:
    only, ours = _run("prefix_only").summary(), _run("prefix_load").summary()
    assert only["imbalance"] > 2.0
    assert ours["imbalance"] < 1.5
    assert ours["ttft"]["p99"] < only["ttft"]["p99"]


def test_prefix_load_hits_more_than_load_only_routing() -> None:
    ours, rr = _run("prefix_load").summary(), _run("round_robin").summary()
    ll = _run("least_loaded").summary()
    assert ours["hit_rate"] > rr["hit_rate"] and ours["hit_rate"] > ll["hit_rate"]
    assert ours["ttft"]["p50"] < rr["ttft"]["p50"]


def test_bad_arguments_are_clear_errors() -> None:
    prof, work = _work()
    with pytest.raises(ValueError, match="replicas"):
        simulate_cluster(work.requests, 0, "prefix_load", "fcfs", prof, work.cache_blocks)
    with pytest.raises(ValueError, match="policy"):
        simulate_cluster(work.requests, 2, "random", "fcfs", prof, work.cache_blocks)
