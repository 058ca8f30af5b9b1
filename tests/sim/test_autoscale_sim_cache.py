"""The autoscaling simulator's prefix cache (profile engine, Mooncake hash blocks; issue 43).

Every figure here is simulated.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import pdserve.cli  # noqa: F401  (registers the commands)
from bench.sim.autoscale import (
    AlwaysOn,
    RoleObs,
    SimParams,
    SimRequest,
    WarmPool,
    Workload,
    azure_workload,
    cached_blocks,
    mooncake_workload,
    pick_prefill,
    register_prefix,
    run_policies,
    simulate,
    slo_config,
    trace_workload,
    warm_pool_config,
)
from bench.sim.prefill import BlockCache
from bench.workloads.traces import TraceRequest
from pdserve.apps import app

MOONCAKE = Path(__file__).resolve().parents[2] / "bench/data/mooncake/synthetic_trace.jsonl"
# the A6000 / Llama-3.1-8B modelled profile: step 0.005 + 0.00019 c + 1e-8 (c p + c (c+1)/2),
# decode l(1) = 0.024
PP = SimParams(engine="profile", cold_start_s=10.0, max_replicas=8)
L1 = 0.024
A = (1, 2, 3)  # three full 512-token blocks: 1,536 tokens
B = (7, 8, 9)


def step_s(*chunks: tuple[int, int]) -> float:
    return 0.005 + sum(0.00019 * c + 1e-8 * (c * p + c * (c + 1) / 2) for c, p in chunks)


def req(t: float, hashes: tuple[int, ...], prompt: int = 1600) -> SimRequest:
    return SimRequest(t, prompt, 4, hashes)


class Recording(AlwaysOn):
    """always_on that keeps what it observed at each tick."""

    def __init__(self, counts: dict[str, int]) -> None:
        super().__init__(counts, 10.0)
        self.seen: list[tuple[float, dict[str, RoleObs]]] = []

    def decide(self, now: float, obs: dict[str, RoleObs]) -> dict[str, int]:
        self.seen.append((now, obs))
        return super().decide(now, obs)


def test_cached_blocks_leave_at_least_one_token_to_compute() -> None:
    cache = BlockCache(8)
    assert cached_blocks(cache, A, 1600, 512) == 0  # cold
    register_prefix(cache, A, 0)
    assert cached_blocks(cache, A, 1600, 512) == 3
    # a prompt of exactly three blocks may reuse two: its last token is computed
    assert cached_blocks(cache, A, 1536, 512) == 2
    assert cached_blocks(cache, (1, 2, 4), 1600, 512) == 2  # the prefix diverges
    assert cached_blocks(None, A, 1600, 512) == 0  # no cache (simple engine, Azure)


def test_register_prefix_releases_pins_and_evicts_lru_tail_first() -> None:
    cache = BlockCache(4)
    register_prefix(cache, A, 0)
    assert cache.evictable == 3  # every reference released
    register_prefix(cache, (5, 6), 0)  # needs one eviction: A's tail (3) goes first
    assert 3 not in cache and 1 in cache and 2 in cache
    assert cached_blocks(cache, A, 1600, 512) == 2


def test_pick_prefill_prefers_the_longest_prefix_then_the_least_load() -> None:
    assert pick_prefill([(0, 0.0), (2, 5000.0), (1, 0.0)]) == 1
    assert pick_prefill([(0, 300.0), (0, 100.0), (0, 100.0)]) == 1
    assert pick_prefill([(0, 0.0)]) == 0


def test_a_held_prefix_is_prefilled_with_only_its_uncached_tokens() -> None:
    # one prefill replica: r0 (1,600 tokens, blocks A) cold, r1 with the same prefix after it
    # finished: its 3 blocks (1,536 tokens) hit, 64 tokens computed from position 1,536
    wl = Workload("two", (req(0.0, A), req(5.0, A)), 30.0)
    run = simulate(wl, AlwaysOn({"prefill": 1, "decode": 1}, 10.0), PP)
    cold, warm = step_s((1600, 0)), step_s((64, 1536))
    assert warm < cold / 5
    assert run.ttft_s == pytest.approx([cold + L1, warm + L1])
    assert run.metrics["cache_hit_ratio"] == pytest.approx(1536 / 3200)
    assert run.metrics["prefix_cache_blocks"] == 380  # the profile's KV in 512-token blocks


def test_a_cache_of_one_block_holds_only_the_head() -> None:
    wl = Workload("two", (req(0.0, A), req(5.0, A)), 30.0)
    p = PP.model_copy(update={"prefix_cache_blocks": 1})
    run = simulate(wl, AlwaysOn({"prefill": 1, "decode": 1}, 10.0), p)
    assert run.ttft_s[1] == pytest.approx(step_s((1088, 512)) + L1)


def test_the_second_request_of_a_prefix_goes_to_its_holder() -> None:
    # two prefill replicas: r0 (A) takes the first, r1 (B) arrives while it steps and takes
    # the second; r2 (B) finds both free: without the cache the first would take it
    wl = Workload("three", (req(0.0, A), req(0.0, B), req(5.0, B)), 30.0)
    run = simulate(wl, AlwaysOn({"prefill": 2, "decode": 1}, 10.0), PP)
    assert run.ttft_s[2] == pytest.approx(step_s((64, 1536)) + L1)
    assert run.metrics["cache_hit_ratio"] == pytest.approx(1536 / 4800)


def test_a_cold_replica_has_no_hits_and_scaling_to_zero_loses_the_cache() -> None:
    # warm_pool from zero: r0 waits on a cold start and fills the new replica's cache; r1
    # (same prefix) comes after the pool went back to zero, to a new, empty replica
    wl = Workload("gap", (req(0.0, A), req(400.0, A)), 500.0)
    cfg = warm_pool_config(PP, idle_to_zero_s=30.0, warm_pool=0)
    run = simulate(wl, WarmPool(cfg, 10.0), PP)
    assert run.metrics["cache_hit_ratio"] == 0.0
    assert run.metrics["scale_ups_by_role"]["prefill"] == 2
    # always_on keeps its replica and its cache: the second one hits
    kept = simulate(wl, AlwaysOn({"prefill": 1, "decode": 1}, 10.0), PP)
    assert kept.metrics["cache_hit_ratio"] == pytest.approx(0.48)


def test_the_policies_observe_uncached_tokens() -> None:
    wl = Workload("two", (req(0.0, A), req(5.0, A)), 30.0)
    pol = Recording({"prefill": 1, "decode": 1})
    simulate(wl, pol, PP)
    now, last = pol.seen[-1]
    pre = last["prefill"]
    assert now > 6.0
    # 1,600 + 64 uncached tokens taken, not 3,200 prompt tokens; nothing queued
    assert pre.tokens_total == pytest.approx(1664.0)
    assert pre.queued_tokens == 0.0
    # prompt_moments of the prefilled prompts' uncached tokens (nearest-rank p99)
    assert pre.prompt_mean == pytest.approx(832.0)
    assert pre.prompt_p99 == pytest.approx(1600.0)


def test_a_queued_request_counts_whole_until_a_replica_matches_it() -> None:
    # r0 (A) fills the cache; r1 (20,000 other tokens, ten steps) holds the only replica;
    # r2 (A) waits in the queue behind it: counted whole (1,600), then as admitted (64)
    C = tuple(range(100, 139))
    wl = Workload("q", (req(0.0, A), req(0.5, C, 20000), req(0.6, A)), 60.0)
    pol = Recording({"prefill": 1, "decode": 1})
    run = simulate(wl, pol, PP)
    at1 = next(o["prefill"] for t, o in pol.seen if t == 1.0)
    assert at1.tokens_total == pytest.approx(1600 + 20000 + 1600)
    assert at1.queued_tokens > 1600
    assert pol.seen[-1][1]["prefill"].tokens_total == pytest.approx(1600 + 20000 + 64)
    assert run.metrics["cache_hit_ratio"] == pytest.approx(1536 / 23200)


def test_mooncake_workload_keeps_full_block_hashes() -> None:
    recs = [TraceRequest(0.0, 1100, 3, (4, 5, 6)), TraceRequest(1.0, 1024, 3, (4, 5))]
    wl = trace_workload(recs, "t")
    assert [r.block_hashes for r in wl.requests] == [(4, 5), (4, 5)]
    moon = mooncake_workload(MOONCAKE, limit=20)
    assert len(moon.requests) == 20 and moon.block_tokens == 512
    assert all(len(r.block_hashes) == r.prompt_tokens // 512 for r in moon.requests)


def test_azure_results_are_unchanged_by_the_cache() -> None:
    # figures of the commit before the prefix cache (e7625c3), same call as
    # `pdserve sim autoscale --trace <azure> --max-requests 1500 --engine profile --loads 2`
    wl = azure_workload(load=2.0, limit=1500)
    assert not any(r.block_hashes for r in wl.requests)
    p = SimParams(engine="profile")
    res, _ = run_policies(wl, ["warm_pool", "slo"], p, warm_pool_config(p), slo_cfg=slo_config(p))
    assert res["slo"]["cold_start_fraction"] == pytest.approx(0.05733333333333333)
    assert res["slo"]["replica_seconds"] == pytest.approx(1214.0660919604334)
    assert res["slo"]["ttft"]["p99"] == pytest.approx(10.5159420881)
    assert res["slo"]["itl_p99_s"] == pytest.approx(0.0672)
    assert res["warm_pool"]["replica_seconds"] == pytest.approx(927.7471888941074)
    assert res["slo"]["cache_hit_ratio"] == 0.0


def test_cli_replays_mooncake_with_the_cache(tmp_path: Path) -> None:
    out = tmp_path / "m.json"
    r = CliRunner().invoke(
        app,
        [
            "sim",
            "autoscale",
            "--trace",
            str(MOONCAKE),
            "--trace-format",
            "mooncake",
            "--engine",
            "profile",
            "--max-requests",
            "60",
            "--policies",
            "always_on,slo",
            "--no-progress",
            "--json",
            str(out),
        ],
    )
    assert r.exit_code == 0, r.output
    assert "prefix cache of 380 blocks of 512 tokens" in r.output and "cache_hit" in r.output
    data = json.loads(out.read_text())
    assert data["simulated"] is True
    assert data["workloads"]["1x"]["name"].startswith("mooncake:")
    for m in data["policies"].values():
        assert 0.0 <= m["cache_hit_ratio"] < 1.0 and m["prefix_cache_blocks"] == 380
    bad = CliRunner().invoke(
        app, ["sim", "autoscale", "--trace", str(MOONCAKE), "--trace-format", "sharegpt"]
    )
    assert bad.exit_code != 0 and "azure or mooncake" in bad.output
