"""The pure autoscaling policy (controllers.autoscale): sizing, pairing, keep-alive, hysteresis."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from controllers.autoscale import (
    AutoscaleConfig,
    AutoscaleState,
    RoleBounds,
    RoleDemand,
    decide,
    decode_need,
    prefill_need,
)

CFG = AutoscaleConfig(
    enabled=True,
    prefill=RoleBounds(min_replicas=0, max_replicas=8),
    decode=RoleBounds(min_replicas=0, max_replicas=8),
    target_utilization=0.8,
    prefill_drain_s=4.0,
    prefill_tokens_per_s=1000.0,
    expected_prompt_tokens=1000,
    idle_to_zero_s=60.0,
    downscale_delay_s=10.0,
    cold_start_s=0.0,
)


def idle(running: int = 1, target: int | None = None) -> RoleDemand:
    return RoleDemand(running=running, target=running if target is None else target)


def test_prefill_need_worked_example() -> None:
    # 1,600 uncached tokens/s at 1,000 tokens/s per replica and 80% utilisation: 2 replicas;
    # 4,000 tokens queued to drain in 4 s: one more.
    d = RoleDemand(running=2, target=2, queued_uncached_tokens=4000, tokens_per_s=1000.0)
    assert prefill_need(d, inflow=1600.0, cold_start_s=0.0, cfg=CFG) == pytest.approx(3.0)


def test_a_long_cold_start_scales_prefill_up_earlier() -> None:
    # inflow 1,500 tokens/s beyond one replica's 1,000: while a new replica starts the backlog
    # grows by 500 tokens per second of cold start
    d = RoleDemand(running=1, target=1, tokens_per_s=1000.0)
    short = prefill_need(d, 1500.0, cold_start_s=0.0, cfg=CFG)
    long = prefill_need(d, 1500.0, cold_start_s=40.0, cfg=CFG)
    assert long - short == pytest.approx(500 * 40 / (1000 * 4.0))
    # the same demand with capacity to spare gains nothing from the cold start
    spare = RoleDemand(running=3, target=3, tokens_per_s=1000.0)
    assert prefill_need(spare, 1500.0, 40.0, CFG) == prefill_need(spare, 1500.0, 0.0, CFG)


def test_decode_need_takes_the_larger_of_window_and_kv() -> None:
    d = RoleDemand(running=1, target=1, token_load=1600, window_tokens=1000)
    assert decode_need(d, CFG) == pytest.approx(2.0)
    # a full window with requests waiting for admission asks for what the waiting need too,
    # not one step at a time (admitted load alone can never pass the windows)
    full = RoleDemand(
        running=1,
        target=1,
        token_load=1000,
        window_tokens=1000,
        queued_window_tokens=2000,
        handle_queued=4,
    )
    cfg = CFG.model_copy(update={"expected_output_tokens": 250})
    assert decode_need(full, cfg) == pytest.approx((1000 + 2000 + 1000) / 800)
    kv = RoleDemand(running=1, target=1, used_kv_blocks=2700, kv_blocks_per_replica=1000)
    assert decode_need(kv, CFG) == pytest.approx(3.0)


def test_scale_from_zero_starts_both_roles_at_once() -> None:
    demand = {
        "prefill": RoleDemand(running=0, target=0, handle_queued=1, ongoing=1),
        "decode": RoleDemand(running=0, target=0),
    }
    _, out = decide(AutoscaleState(), demand, CFG, now=100.0)
    assert out["prefill"].replicas == 1 and out["prefill"].reason == "scale_from_zero"
    assert out["decode"].replicas == 1 and out["decode"].reason == "scale_from_zero"
    # unpaired (colocated), only the role with the waiting request starts
    _, solo = decide(AutoscaleState(), {"prefill": demand["prefill"]}, CFG, 100.0, paired=False)
    assert solo["prefill"].replicas == 1


def test_decode_is_never_at_zero_while_prefill_is_not() -> None:
    demand = {
        "prefill": RoleDemand(running=1, target=1, ongoing=3, queued_uncached_tokens=500),
        "decode": RoleDemand(running=0, target=0),
    }
    _, out = decide(AutoscaleState(), demand, CFG, now=5.0)
    assert out["prefill"].replicas >= 1
    assert out["decode"].replicas == 1 and out["decode"].reason == "paired_with_prefill"


def test_keep_alive_then_both_roles_to_zero_together() -> None:
    busy = {"prefill": RoleDemand(1, 1, ongoing=1), "decode": RoleDemand(1, 1, ongoing=1)}
    state, _ = decide(AutoscaleState(), busy, CFG, now=0.0)
    quiet = {"prefill": idle(), "decode": idle()}
    state, out = decide(state, quiet, CFG, now=59.0)  # within the keep-alive
    assert out["prefill"].replicas == 1 and out["decode"].replicas == 1
    state, out = decide(state, quiet, CFG, now=60.5)
    assert {k: (v.replicas, v.reason) for k, v in out.items()} == {
        "prefill": (0, "idle_to_zero"),
        "decode": (0, "idle_to_zero"),
    }
    # min_replicas wins over the keep-alive
    floor = CFG.model_copy(update={"prefill": RoleBounds(min_replicas=1, max_replicas=8)})
    _, out = decide(state, quiet, floor, now=61.0)
    assert out["prefill"].replicas == 1 and out["prefill"].reason == "bounds"


def test_the_warm_pool_keeps_idle_replicas_while_active() -> None:
    pooled = CFG.model_copy(update={"warm_pool": 2})
    demand = {
        "prefill": RoleDemand(1, 1, ongoing=1, tokens_per_s=1000.0, queued_uncached_tokens=100),
        "decode": RoleDemand(1, 1, ongoing=1, token_load=100, window_tokens=1000),
    }
    _, plain = decide(AutoscaleState(), demand, CFG, now=1.0)
    _, out = decide(AutoscaleState(), demand, pooled, now=1.0)
    assert plain["prefill"].replicas == 1
    assert out["prefill"].replicas == 3 and out["prefill"].reason == "demand"
    assert out["decode"].replicas == plain["decode"].replicas + 2


def test_hysteresis_scales_down_after_the_delay_to_the_windows_peak() -> None:
    def load(tokens: float, target: int) -> dict[str, RoleDemand]:
        return {
            "prefill": RoleDemand(target, target, ongoing=1, queued_uncached_tokens=tokens),
            "decode": RoleDemand(1, 1, ongoing=1),
        }

    state, out = decide(AutoscaleState(), load(16000, 1), CFG, now=0.0)
    assert out["prefill"].replicas == 4 and out["prefill"].reason == "demand"  # up at once
    t = 1.0
    wanted = []
    for tokens in (3000, 7000, 3000, 7000, 3000):  # wants 1, 2, 1, 2, 1
        state, out = decide(state, load(tokens, 4), CFG, now=t)
        wanted.append(out["prefill"].replicas)
        t += 2.0
    assert wanted == [4] * 5  # held while inside the delay: no flapping
    assert out["prefill"].reason == "hold_downscale"
    state, out = decide(state, load(3000, 4), CFG, now=11.5)
    assert out["prefill"].replicas == 2  # the largest count wanted in the window, not 1


def test_a_measured_cold_start_replaces_the_estimate() -> None:
    cfg = CFG.model_copy(update={"cold_start_s": 5.0})
    pre = RoleDemand(0, 0, handle_queued=1, ongoing=1)
    state, out = decide(AutoscaleState(), {"prefill": pre, "decode": idle(0)}, cfg, now=10.0)
    assert out["prefill"].replicas == 1
    assert state.cold_start_s(cfg) == 5.0
    starting = {"prefill": RoleDemand(0, 1, handle_queued=1, ongoing=1), "decode": idle(0, 1)}
    state, _ = decide(state, starting, cfg, now=20.0)
    up = {"prefill": RoleDemand(1, 1, ongoing=1), "decode": RoleDemand(1, 1)}
    state, _ = decide(state, up, cfg, now=31.0)
    assert state.cold_start_s(cfg) == pytest.approx(21.0)


def test_inflow_is_measured_from_cumulative_counts_and_a_drop_restarts_it() -> None:
    cfg = CFG.model_copy(update={"inflow_window_s": 1e-6})  # no smoothing: the last sample
    state = AutoscaleState()
    for t, total in ((0.0, 0), (1.0, 1500), (2.0, 3000)):
        d = RoleDemand(1, 1, ongoing=1, uncached_tokens_total=total, tokens_per_s=1000.0)
        state, out = decide(state, {"prefill": d, "decode": RoleDemand(1, 1)}, cfg, now=t)
    assert state.inflow_tokens_per_s == pytest.approx(1500.0)
    assert out["prefill"].replicas == 2  # 1500 / (1000 * 0.8)
    d = RoleDemand(1, 1, ongoing=1, uncached_tokens_total=10, tokens_per_s=1000.0)
    state, _ = decide(state, {"prefill": d, "decode": RoleDemand(1, 1)}, cfg, now=3.0)
    assert state.inflow_tokens_per_s == pytest.approx(1500.0)  # not a negative sample


def test_the_inflow_average_follows_a_lasting_load_not_one_seconds_count() -> None:
    cfg = CFG.model_copy(update={"inflow_window_s": 10.0})
    state, total = AutoscaleState(), 0.0
    for t in range(0, 61):  # 1,000 tokens/s for a minute, then one second of 20,000
        d = RoleDemand(1, 1, ongoing=1, uncached_tokens_total=total)
        state, _ = decide(state, {"prefill": d}, cfg, now=float(t), paired=False)
        total += 1000
    assert state.inflow_tokens_per_s == pytest.approx(1000.0, rel=0.01)
    total += 19000
    d = RoleDemand(1, 1, ongoing=1, uncached_tokens_total=total)
    state, _ = decide(state, {"prefill": d}, cfg, now=61.0, paired=False)
    # one second of a 20x spike moves the average by about 1/10 of the gap
    assert 2500 < state.inflow_tokens_per_s < 3000


def test_state_round_trips_through_json() -> None:
    demand = {"prefill": RoleDemand(0, 0, handle_queued=2, ongoing=2, uncached_tokens_total=7)}
    state, _ = decide(AutoscaleState(), demand | {"decode": idle(0)}, CFG, now=3.0)
    again = AutoscaleState.from_dict(json.loads(json.dumps(state.to_dict())))
    assert again == state


def test_bounds_are_validated_with_the_field_named() -> None:
    with pytest.raises(ValidationError, match="min_replicas"):
        RoleBounds(min_replicas=3, max_replicas=2)
    with pytest.raises(ValidationError, match="initial_replicas"):
        RoleBounds(min_replicas=0, max_replicas=2, initial_replicas=5)
    with pytest.raises(ValidationError, match="target_utilization"):
        AutoscaleConfig(target_utilization=0)


def test_a_target_serve_raised_itself_is_timed_as_a_cold_start_too() -> None:
    # Serve's own fast path raises a target at zero when a request waits, before the policy
    starting = {"prefill": RoleDemand(0, 1, handle_queued=1, ongoing=1), "decode": idle(0, 1)}
    state, _ = decide(AutoscaleState(), starting, CFG, now=100.0)
    up = {"prefill": RoleDemand(1, 1, ongoing=1), "decode": RoleDemand(1, 1, ongoing=1)}
    state, _ = decide(state, up, CFG, now=125.0)
    assert state.role("prefill").cold_starts == (25.0,)
    assert state.role("decode").cold_starts == (25.0,)
