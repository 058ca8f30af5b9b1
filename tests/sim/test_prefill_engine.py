"""PrefillEngine / simulate: the step loop against hand-computed cost, cache and policy hooks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from bench.sim.prefill import (
    BlockCache,
    EngineConfig,
    PrefillEngine,
    SimRequest,
    fcfs_capacity,
    reusable_blocks,
    simulate,
)
from bench.sim.profiles import load_profile
from controllers.prefill import PrefillQueueView, make_prefill_policy
from controllers.profile import EngineProfile

PROFILE = load_profile("a6000_llama31_8b")
BS = 16


def chain(start: int, n: int) -> tuple[int, ...]:
    return tuple(range(start, start + n))


def req(rid: str, t: float, tokens: int, hashes: tuple[int, ...] = ()) -> SimRequest:
    return SimRequest(rid, t, tokens, hashes[: tokens // BS])


def test_idle_ttft_equals_the_profiles_prefill_table() -> None:
    # The shipped table is the idle-engine time under the same cost model: one request
    # on an idle engine must take exactly that long (two 2,048-token chunks here).
    res = simulate([req("a", 0.0, 4096)], "fcfs", PROFILE, 1000)
    assert res.finished[0].ttft_s == pytest.approx(PROFILE.prefill_seconds(4096), rel=1e-5)
    assert res.steps == 2


def test_step_cost_counts_the_cached_prefix_as_context() -> None:
    sc = PROFILE.step_cost
    h = chain(100, 64)
    res = simulate([req("a", 0.0, 1024, h), req("b", 10.0, 1024, h)], "fcfs", PROFILE, 1000)
    b = next(f for f in res.finished if f.request_id == "b")
    assert b.cached_tokens == 1008  # capped: the last block is recomputed
    c, p = 16, 1008
    expected = sc.fixed_s + sc.per_token_s * c + sc.attn_per_ctx_token_s * (c * p + c * (c + 1) / 2)
    assert b.ttft_s == pytest.approx(expected, rel=1e-9)


def test_cached_prefix_is_re_read_after_eviction() -> None:
    h = chain(1, 8)
    eng = PrefillEngine(
        make_prefill_policy("fcfs"), PROFILE, BlockCache(10), EngineConfig(block_size=BS)
    )
    eng.cache.warm(h)
    w = req("w", 0.0, 129, h)
    assert eng.cached_tokens_for(w) == 128
    eng.submit(req("x", 0.0, 160))  # a 10-block miss evicts the whole warm chain
    eng.step(0.0)
    assert eng.cached_tokens_for(w) == 0


def test_running_requests_continue_before_admissions() -> None:
    eng = PrefillEngine(make_prefill_policy("fcfs"), PROFILE, BlockCache(1000))
    eng.submit(req("long", 0.0, 5000))
    first = eng.step(0.0)
    assert first.scheduled == [("long", 2048)]
    eng.submit(req("new", 0.1, 100))
    second = eng.step(first.end_s)
    assert second.scheduled == [("long", 2048)]
    third = eng.step(second.end_s)
    assert third.scheduled == [("long", 904), ("new", 100)]
    assert [f.request_id for f in third.finished] == ["long", "new"]


def test_kv_capacity_limits_admission() -> None:
    eng = PrefillEngine(
        make_prefill_policy("fcfs"), PROFILE, BlockCache(10), EngineConfig(block_size=BS)
    )
    eng.submit(req("a", 0.0, 100))  # 7 blocks
    eng.submit(req("b", 0.0, 100))  # 7 more do not fit
    s = eng.step(0.0)
    assert s.scheduled == [("a", 100)]
    assert eng.waiting_count == 1
    s2 = eng.step(s.end_s)
    assert s2.scheduled == [("b", 100)]


def test_a_request_larger_than_the_cache_is_rejected_with_its_id() -> None:
    eng = PrefillEngine(
        make_prefill_policy("fcfs"), PROFILE, BlockCache(4), EngineConfig(block_size=BS)
    )
    with pytest.raises(ValueError, match="'big'"):
        eng.submit(req("big", 0.0, 100))


@dataclass
class Spy:
    """Wraps a registry policy and records what the engine calls."""

    inner: object
    name: str = "spy"
    orders: list[int] = field(default_factory=list)
    observed: list[tuple[list[tuple[str, int]], float]] = field(default_factory=list)

    def order(self, queue: PrefillQueueView, now: float) -> list[str]:
        self.orders.append(len(queue))
        return self.inner.order(queue, now)  # type: ignore[attr-defined]

    def observe_step(self, scheduled: list[tuple[str, int]], now: float) -> None:
        self.observed.append((list(scheduled), now))


def test_the_policy_object_itself_is_driven_and_observes_every_step() -> None:
    spy = Spy(make_prefill_policy("fairway", PROFILE))
    reqs = [req(f"r{i}", 0.05 * i, 700 + 50 * i) for i in range(12)]
    res = simulate(reqs, spy, PROFILE, 5000)
    assert len(res.finished) == 12
    assert spy.orders and len(spy.observed) == res.steps
    for scheduled, _ in spy.observed:
        assert sum(n for _, n in scheduled) <= PROFILE.token_budget
    assert sum(n for s, _ in spy.observed for _, n in s) == sum(r.prompt_tokens for r in reqs)
    ends = [t for _, t in spy.observed]
    assert ends == sorted(ends)


class ProtectW:
    """A ProtectingPolicy stub: arrival order, protects the blocks of request 'w'."""

    name = "protect-w"

    def order(self, queue: PrefillQueueView, now: float) -> list[str]:
        return [r.request_id for r in queue.requests]

    def protected_blocks(self, queue: PrefillQueueView, now: float) -> frozenset[int]:
        return frozenset(h for r in queue.requests if r.request_id == "w" for h in r.block_hashes)


@pytest.mark.parametrize("protect", [False, True])
def test_protected_blocks_of_a_protecting_policy_are_honoured(protect: bool) -> None:
    wh, other = chain(1, 4), chain(50, 4)
    pol = ProtectW() if protect else make_prefill_policy("fcfs")
    eng = PrefillEngine(pol, PROFILE, BlockCache(8), EngineConfig(block_size=BS, max_running=1))
    eng.cache.warm(wh)  # least recently used
    eng.cache.warm(other)
    eng.submit(req("x", 0.0, 64))  # a miss that must evict four blocks
    w = req("w", 0.0, 80, wh)
    eng.submit(w)
    eng.step(0.0)  # max_running=1: x runs, w waits
    assert eng.cached_tokens_for(w) == (64 if protect else 0)


def test_peek_is_asked_for_its_protected_blocks() -> None:
    peek = make_prefill_policy("peek", PROFILE)
    eng = PrefillEngine(peek, PROFILE, BlockCache(100), EngineConfig(block_size=BS))
    eng.submit(req("a", 0.0, 100, chain(1, 6)))
    eng.step(0.0)
    assert eng.cache.protected == frozenset(chain(1, 6))


def test_same_prefix_admitted_together_is_computed_twice() -> None:
    h = chain(1, 10)
    res = simulate([req("a", 0.0, 161, h), req("b", 0.0, 161, h)], "fcfs", PROFILE, 100)
    assert [f.cached_tokens for f in res.finished] == [0, 0]
    res2 = simulate([req("a", 0.0, 161, h), req("b", 1.0, 161, h)], "fcfs", PROFILE, 100)
    assert [f.cached_tokens for f in res2.finished] == [0, 160]


def test_lpm_serves_hits_first_and_fcfs_in_arrival_order() -> None:
    h = chain(1, 100)
    warm = [h]
    reqs = [req("miss", 0.0, 1600), req("hit", 0.01, 1616, h)]
    busy = [req("busy", 0.0, 2048)]
    for pol, first in (("fcfs", "miss"), ("lpm", "hit")):
        res = simulate(busy + reqs, pol, PROFILE, 1000, warm=warm)
        order = [f.request_id for f in res.finished if f.request_id != "busy"]
        assert order[0] == first, pol


def test_capacity_and_reusable_content() -> None:
    a = [req(f"a{i}", 0.0, 1024, chain(1, 64)) for i in range(10)]
    b = [req("b", 0.0, 1024, chain(500, 64))]
    assert reusable_blocks(a + b) == 64
    cap_hit = fcfs_capacity(a, PROFILE, 1000)
    cap_miss = fcfs_capacity([req(f"m{i}", 0.0, 1024) for i in range(3)], PROFILE, 1000)
    assert cap_hit > 2 * cap_miss  # a cached mix is served faster


def test_unfinished_requests_are_censored_at_the_horizon() -> None:
    res = simulate([req("a", 0.0, 20_000)], "fcfs", PROFILE, 2000, horizon_s=1.0)
    assert [r.request_id for r in res.unfinished] == ["a"]
    assert res.ttfts() == [pytest.approx(res.horizon_s)]


def test_engine_profile_defaults_config() -> None:
    eng = PrefillEngine(make_prefill_policy("fcfs"), PROFILE, BlockCache(10))
    assert eng.config.token_budget == PROFILE.token_budget == 2048
    assert isinstance(PROFILE, EngineProfile)


def _written_out_cost(sc: Any, ch: list[list[int]]) -> float:
    """The step-cost model written out here, apart from ``StepCost.seconds``."""
    return (
        sc.fixed_s
        + sc.per_token_s * sum(c for c, _ in ch)
        + sc.attn_per_ctx_token_s * sum(c * p + c * (c + 1) / 2 for c, p in ch)
    )


def test_the_step_cost_check_prices_a_replays_steps_and_refits_them() -> None:
    """``bench replay``'s check: a profile that prices every step at twice its measured
    time reads 2.0, the refit recovers the true coefficients, and steps with a chunk
    from a long cached head are grouped apart."""
    from bench.engine.replay import step_cost_check
    from controllers.profile import StepCost

    truth = StepCost(fixed_s=0.004, per_token_s=1.5e-4, attn_per_ctx_token_s=3e-8)
    double = StepCost(fixed_s=0.008, per_token_s=3e-4, attn_per_ctx_token_s=6e-8)

    shapes = [
        [[2048, 0]],
        [[512, 0]] * 4,
        [[256, 4096]] * 4,
        [[300, 5000], [1000, 0]],
        [[128, 1024]] * 8,
        [[1000, 2048]],
    ]
    steps = {
        "fcfs": [[_written_out_cost(truth, ch), ch] for ch in shapes[:3]],
        "lpm": [[_written_out_cost(truth, ch), ch] for ch in shapes[3:]],
    }
    out = step_cost_check(steps, double, long_head=2048)
    g = out["groups"]
    assert g["all"]["steps"] == 6 and g["fcfs"]["steps"] == 3
    assert g["all"]["profile_over_measured"] == pytest.approx(2.0, rel=1e-3)
    assert g["all"]["refit_over_measured"] == pytest.approx(1.0, rel=1e-3)
    assert out["refit"]["per_token_s"] == pytest.approx(truth.per_token_s, rel=1e-4)
    assert out["refit"]["attn_per_ctx_token_s"] == pytest.approx(
        truth.attn_per_ctx_token_s, rel=1e-4
    )
    assert g["long_context"]["steps"] == 3 and g["short_context"]["steps"] == 3
    assert sum(g[f"third_{k}"]["steps"] for k in (1, 2, 3)) == 6


def test_a_replays_refitted_profile_round_trips_as_a_profile_file(tmp_path) -> None:
    """``bench replay --save-profile``: the profile with the replay's refitted step cost,
    loadable by path as ``--profile`` for the next replay."""
    from bench.engine.replay import refit_profile, step_cost_check
    from controllers.profile import StepCost

    prof = load_profile("cpu2core_vllm032_bench")
    truth = StepCost(fixed_s=0.03, per_token_s=1e-4, attn_per_ctx_token_s=3e-8)
    shapes = [[[2048, 0]], [[512, 0]] * 4, [[256, 4096]] * 4, [[300, 5000], [1000, 0]], [[64, 0]]]
    steps = {"fcfs": [[_written_out_cost(truth, ch), ch] for ch in shapes]}
    out = refit_profile(prof, step_cost_check(steps, prof.step_cost), "sec-spike-paper seed 3")
    assert out.step_cost.fixed_s == pytest.approx(truth.fixed_s, rel=1e-4)
    assert out.step_cost.per_token_s == pytest.approx(truth.per_token_s, rel=1e-4)
    assert out.decode == prof.decode and out.prefill == prof.prefill
    assert "sec-spike-paper seed 3" in out.source
    path = tmp_path / "refit.json"
    path.write_text(out.model_dump_json())
    assert load_profile(str(path)) == out


def test_the_prediction_band_brackets_the_simulator_and_widens_with_a_queue() -> None:
    """``bench replay``'s band: the simulator at every step ``rel`` cheaper and dearer. It
    holds the central prediction, is a point at ``rel = 0``, and is wide where a queue
    builds (a 2% dearer step, arrivals faster than the engine serves: every later request
    waits longer) and narrow on an idle engine."""
    from bench.engine.replay import band_coverage, prediction_band
    from bench.report.prefill import policy_report
    from bench.sim.prefill import SimRequest

    # calm: one 1,024-token prompt per second; spike: 40 arriving faster than served
    one = PROFILE.prefill_seconds(1024)
    calm = [SimRequest(f"c{i}", float(i), 1024, (), ("calm",)) for i in range(5)]
    spike = [SimRequest(f"s{i}", 10.0 + i * one * 0.8, 1024, (), ("spike",)) for i in range(40)]
    work = calm + spike

    def predict(prof: EngineProfile, pol: str) -> dict[str, Any]:
        return policy_report(simulate(work, pol, prof, 1000), ["calm", "spike"])

    central = {"fcfs": predict(PROFILE, "fcfs")}
    out = prediction_band(predict, PROFILE, ["fcfs"], central, rel=0.02)
    assert out["six_targets"] is None  # relative to FCFS and LPM: not without LPM
    band = out["policies"]["fcfs"]
    point = prediction_band(predict, PROFILE, ["fcfs"], central, rel=0.0)["policies"]["fcfs"]
    for ph in ("all", "calm", "spike"):
        for stat in ("p50", "p99"):
            lo, hi = band[ph][stat]
            assert lo <= central["fcfs"]["ttft"][ph][stat] <= hi
            assert point[ph][stat][0] == pytest.approx(point[ph][stat][1])
    width = {ph: band[ph]["p99"][1] / band[ph]["p99"][0] - 1 for ph in ("calm", "spike")}
    assert width["calm"] == pytest.approx(0.04 / 0.98, rel=0.05)  # idle: the step's own 2%
    assert width["spike"] > 2 * width["calm"]  # queued: the waits add up
    # the measured figures placed inside, below and above the band
    measured = {"fcfs": {"ttft": {ph: dict(central["fcfs"]["ttft"][ph]) for ph in band}}}
    measured["fcfs"]["ttft"]["spike"]["p99"] = band["spike"]["p99"][1] * 1.5
    measured["fcfs"]["ttft"]["calm"]["p50"] = band["calm"]["p50"][0] * 0.5
    cov = band_coverage(measured, {"fcfs": band})["fcfs"]
    assert cov["cells"] == 6 and cov["inside"] == 4
    assert sorted(cov["outside"]) == ["calm p50 below", "spike p99 above"]
