"""SLO sizing of the autoscaler (controllers.slo_sizing, autoscaling.slo): worked examples.

Every number below is computed by hand in the comments (Erlang B by its recursion
``B(k) = a B(k-1) / (k + a B(k-1))``, ``C = n B / (n - a (1 - B))``), so a wrong formula fails.
"""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from controllers.autoscale import (
    AutoscaleConfig,
    AutoscaleState,
    RoleBounds,
    RoleDemand,
    decide,
)
from controllers.profile import DecodeProfile
from controllers.slo_sizing import (
    FORECAST_WINDOW_S,
    SloConfig,
    erlang_c,
    forecast,
    keep_alive_s,
    max_batch,
    prefill_replicas,
    prefill_ttft_p99,
)

STEP = DecodeProfile(l_min_s=0.024, b0=32, alpha_s=0.0004)  # the A6000 8B profile's curve


def slo_cfg(**slo: float) -> AutoscaleConfig:
    targets = {"ttft_p99_s": 3.0, "itl_p99_s": 0.05, "max_cold_fraction": 0.03} | slo
    return AutoscaleConfig(
        enabled=True,
        prefill=RoleBounds(min_replicas=0, max_replicas=16),
        decode=RoleBounds(min_replicas=0, max_replicas=16),
        prefill_tokens_per_s=1000.0,
        expected_prompt_tokens=1000,
        cold_start_s=5.0,
        slo=SloConfig(**targets, decode_step=STEP),  # type: ignore[arg-type]
    )


def test_erlang_c_worked_values() -> None:
    # M/M/1: P(wait) = rho; M/M/2 at a = 1: B(1) = 1/2, B(2) = 0.5/2.5 = 0.2,
    # C = 2 * 0.2 / (2 - 0.8) = 1/3
    assert erlang_c(1, 0.5) == pytest.approx(0.5)
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)
    assert erlang_c(2, 2.0) == 1.0 and erlang_c(3, 0.0) == 0.0


def test_prefill_ttft_p99_worked_example_picks_the_smallest_pool_within_target() -> None:
    # mu 1,000 tok/s, lam 1,500 tok/s, Poisson arrivals of exponential prompts of mean 1,000
    # (dispersion D = 2 m = 2,000, D/2 = 1,000), so E[S] = 1 s; p99 prompt 2,000 (S99 = 2 s).
    # TTFT99 = E[W] + E[S] + sqrt((W99 - E[W])^2 + (S99 - E[S])^2), W's scale 1000/(n mu - lam)
    # n = 2: B(1) = 0.6, B(2) = 0.9/2.9 = 0.31034, C = 0.62069 / 0.96552 = 0.64286; scale 2 s:
    #   E[W] = 1.2857, W99 = ln(64.286) * 2 = 8.3266; 1.2857 + 1 + sqrt(7.0409^2 + 1) = 9.397
    # n = 3: B(3) = 0.46552/3.46552 = 0.13433, C = 0.40299 / 1.70149 = 0.23684; scale 0.6667:
    #   E[W] = 0.15789, W99 = ln(23.684) * 0.6667 = 2.1099; 1.15789 + sqrt(1.9520^2 + 1) = 3.351
    # n = 4: B(4) = 0.20149/4.20149 = 0.047957, C = 0.19183 / 2.57194 = 0.074585; scale 0.4:
    #   E[W] = 0.029834, W99 = ln(7.4585) * 0.4 = 0.80374; 1.02983 + sqrt(0.77391^2 + 1) = 2.294
    # n = 5: B(5) = 0.014183, C = 0.020139; scale 0.28571: E[W] = 0.005754,
    #   W99 = ln(2.0139) * 0.28571 = 0.20002; 1.00575 + sqrt(0.19427^2 + 1) = 2.024
    # (the plain sum W99 + S99 would say 4.110 s and 2.804 s at n = 3 and 4)
    args = dict(
        lam=1500.0, mu=1000.0, dispersion=2000.0, backlog=0.0, prompt_mean=1000.0, prompt_p99=2000.0
    )
    assert prefill_ttft_p99(2, l_min=0.0, **args) == pytest.approx(9.397, abs=1e-3)
    assert prefill_ttft_p99(3, l_min=0.0, **args) == pytest.approx(3.351, abs=1e-3)
    assert prefill_ttft_p99(4, l_min=0.0, **args) == pytest.approx(2.294, abs=1e-3)
    assert prefill_ttft_p99(5, l_min=0.0, **args) == pytest.approx(2.024, abs=1e-3)
    assert prefill_ttft_p99(4, l_min=0.024, **args) == pytest.approx(2.318, abs=1e-3)
    assert prefill_ttft_p99(1, l_min=0.0, **args) == math.inf  # lam >= n mu
    assert prefill_replicas(ttft_p99_s=3.0, max_replicas=8, l_min=0.0, **args) == (4, True)
    assert prefill_replicas(ttft_p99_s=2.2, max_replicas=8, l_min=0.0, **args) == (5, True)
    # a backlog of 8,000 tokens adds 8000 / (n mu): n = 6 -> 1.333 + 2.001 = 3.334 s (C =
    # 0.0047 < 0.01: W99 = 0, E[W] = 0.001), n = 7 -> 1.143 + 2.000 = 3.143 s <= 3.2: 7
    backlogged = args | {"backlog": 8000.0}
    assert prefill_replicas(ttft_p99_s=3.2, max_replicas=16, l_min=0.0, **backlogged) == (7, True)
    # a target below the p99 prompt's own prefill (2 s) cannot be met by replicas: flagged, and
    # sized for twice that prefill (4 s: n = 3's 3.351 s is within)
    assert prefill_replicas(ttft_p99_s=1.5, max_replicas=8, l_min=0.0, **args) == (3, False)
    # no load, no backlog: none
    assert prefill_replicas(0.0, 1000.0, 2000.0, 0.0, 1000.0, 2000.0, 0.0, 3.0, 8) == (0, True)


def test_max_batch_from_the_step_curve() -> None:
    # l(b) = 0.024 + 0.0004 (b - 32): within 50 ms up to b = 32 + 0.026 / 0.0004 = 97
    assert max_batch(STEP, 0.05) == (97, True)
    assert STEP.step_latency_s(97) <= 0.05 < STEP.step_latency_s(98)
    assert max_batch(STEP, 0.02) == (32, False)  # below l_min: infeasible


def test_forecast_level_spread_and_upper_quantile() -> None:
    # windows alternating 1,000 and 3,000 tok/s: mean 2,000, sample variance
    # 12 * 1000^2 / 11 = 1.0909e6 (sigma 1044.5), dispersion 1.0909e6 * 5 / 2000 = 2727.3
    f = forecast((1000.0, 3000.0) * 6, ewma=0.0, min_dispersion=1000.0)
    assert f.rate == pytest.approx(2000.0)
    assert f.sigma == pytest.approx(1044.466, abs=1e-3)
    assert f.dispersion == pytest.approx(2727.27, abs=0.01)
    # z(0.97) = 1.8808; horizon 5 s = one window: 2000 + 1.8808 * 1044.5 = 3964.4
    assert f.upper(5.0, 0.03) == pytest.approx(3964.42, abs=0.05)
    # a 20 s horizon averages 4 windows: sigma / 2
    assert f.upper(20.0, 0.03) == pytest.approx(2000 + 1.8808 * 1044.466 / 2, abs=0.05)
    # a rise shows in the recent level at once; the dispersion has its floor
    rising = forecast((1000.0,) * 10 + (5000.0, 5000.0), ewma=0.0, min_dispersion=1000.0)
    assert rising.rate == pytest.approx(5000.0)
    flat = forecast((1000.0,) * 12, ewma=0.0, min_dispersion=1000.0)
    assert flat.sigma == 0.0 and flat.dispersion == 1000.0


def test_decide_sizes_decode_for_the_itl_target_and_names_it() -> None:
    # no forecast windows yet: lam_hi = lam, so the cold budget adds nothing.
    # 200 sequences at b* = 97 per replica: ceil(200 / 97) = 3 (slo_itl); the window's
    # 10,000 / 16,384 -> 1 and KV 1,000 / (12,160 * 0.9) -> 1 do not bind
    cfg = slo_cfg()
    demand = {
        "prefill": RoleDemand(1, 1, ongoing=1, tokens_per_s=1000.0),
        "decode": RoleDemand(
            1,
            1,
            ongoing=200,
            token_load=10000,
            window_tokens=16384,
            used_kv_blocks=1000,
            kv_blocks_per_replica=12160,
        ),
    }
    _, out = decide(AutoscaleState(), demand, cfg, now=0.0)
    assert (out["decode"].replicas, out["decode"].reason) == (3, "slo_itl")
    # KV nearly full binds instead: 40,000 / (12,160 * 0.9) = 3.65 -> 4 over slo_itl's 3
    kv = {
        **demand,
        "decode": RoleDemand(1, 1, ongoing=200, used_kv_blocks=40000, kv_blocks_per_replica=12160),
    }
    _, out = decide(AutoscaleState(), kv, cfg, now=0.0)
    assert (out["decode"].replicas, out["decode"].reason) == (4, "kv")
    # an ITL target below l_min (24 ms) is infeasible: b0 = 32 per replica, ceil(200/32) = 7
    _, out = decide(AutoscaleState(), demand, slo_cfg(itl_p99_s=0.02), now=0.0)
    assert (out["decode"].replicas, out["decode"].reason) == (7, "slo_itl_infeasible")


def test_decide_keeps_the_warm_pool_the_cold_budget_needs() -> None:
    # the forecast of test_forecast_level_spread_and_upper_quantile (lam 2,000, lam_hi 3,964.4
    # at C = 5 s, D = 2,727.3 so D/2 = 1,363.6), mu 1,000, prompts of mean (expected_prompt_
    # tokens) and p99 1,000 (E[S] = S99 = 1 s: TTFT99 = l_min + 1 + W99 as W99 >= E[W]), one
    # decode step l_min = 0.024 s.
    # Target 10 s: at lam, n = 3: a = 2, B(3) = 0.21053, C = 0.44444, W99 = ln(44.44) * 1363.6
    #   / 1000 = 5.174 s -> 6.20 s <= 10: 3 for the TTFT target; the warm capacity for lam_hi
    #   is ceil(3964.4 / 1000) = 4: one warm replica for the budget (cold_budget).
    # Decode: 150 sequences, b* = 97: 2 for the ITL; scaled by lam_hi / lam = 1.9822:
    #   297.3 / 97 = 3.07 -> 4: cold_budget.
    state = AutoscaleState(windows=(1000.0, 3000.0) * 6, window_start=(100.0, 5000.0))
    demand = {
        "prefill": RoleDemand(
            3,
            3,
            ongoing=3,
            tokens_per_s=1000.0,
            uncached_tokens_total=5000.0,
            prompt_tokens_p99=1000,
        ),
        "decode": RoleDemand(2, 2, ongoing=150),
    }
    _, out = decide(state, demand, slo_cfg(ttft_p99_s=10.0), now=100.5)
    assert (out["prefill"].replicas, out["prefill"].reason) == (4, "cold_budget")
    assert out["prefill"].need == pytest.approx(3.964, abs=1e-3)
    assert (out["decode"].replicas, out["decode"].reason) == (4, "cold_budget")
    # a looser budget (20%: z = 0.8416 -> lam_hi = 2879): ceil(2.879) = 3, the TTFT count
    _, out = decide(state, demand, slo_cfg(ttft_p99_s=10.0, max_cold_fraction=0.2), now=100.5)
    assert (out["prefill"].replicas, out["prefill"].reason) == (3, "slo_ttft")
    # target 3 s: n = 3 (6.20 s) is over, n = 4: B(4) = 0.095238, C = 0.17391, W99 =
    #   ln(17.39) * 1363.6 / 2000 = 1.947 s -> 2.971 s: the TTFT target binds at 4
    _, out = decide(state, demand, slo_cfg(ttft_p99_s=3.0), now=100.5)
    assert (out["prefill"].replicas, out["prefill"].reason) == (4, "slo_ttft")


def test_windows_are_counted_from_the_cumulative_inflow() -> None:
    cfg = slo_cfg()
    state = AutoscaleState()
    total = 0.0
    for t in range(0, 16):  # 1,000 tok/s for 15 s, one call a second
        d = RoleDemand(1, 1, ongoing=1, uncached_tokens_total=total)
        state, _ = decide(state, {"prefill": d}, cfg, now=float(t), paired=False)
        total += 1000.0
    assert state.windows == pytest.approx((1000.0, 1000.0, 1000.0))
    assert state.window_start == (15.0, 15000.0)
    # a gap of 12 s between calls is two windows at the gap's mean rate
    d = RoleDemand(1, 1, ongoing=1, uncached_tokens_total=15000.0 + 12 * 500.0)
    state, _ = decide(state, {"prefill": d}, cfg, now=27.0, paired=False)
    assert state.windows[-2:] == pytest.approx((500.0, 500.0))
    assert FORECAST_WINDOW_S == 5.0


def test_the_slo_path_scales_down_after_one_cold_start_not_downscale_delay_s() -> None:
    cfg = slo_cfg().model_copy(update={"downscale_delay_s": 600.0})
    quiet = {
        "prefill": RoleDemand(4, 4, ongoing=1, tokens_per_s=1000.0),
        "decode": RoleDemand(2, 2, ongoing=1),
    }
    state, out = decide(AutoscaleState(), quiet, cfg, now=0.0)
    assert out["prefill"].reason == "hold_downscale"
    _, out = decide(state, quiet, cfg, now=5.0)  # cold start 5 s
    assert out["prefill"].replicas == 1 and out["decode"].replicas == 1


def test_the_decode_replicas_measured_floor_rescales_the_profiles_step_curve() -> None:
    # STEP: l_min 24 ms, b0 32, alpha 0.4 ms; target ITL 50 ms: b* = 32 + floor(26 / 0.4) = 97
    # 150 sequences: ceil(150 / 97) = 2. Measured floor 40 ms (x5/3, alpha 0.667 ms):
    # b* = 32 + floor(10 / 0.6667) = 47 -> ceil(150 / 47) = 4 replicas for the ITL target.
    assert STEP.rescaled(0.040).alpha_s == pytest.approx(0.0004 * 0.040 / 0.024)
    assert STEP.rescaled(0.040).b0 == 32
    assert max_batch(STEP.rescaled(0.040), 0.05) == (47, True)
    cfg = slo_cfg()
    for l_min, want in ((None, 2), (0.040, 4)):
        demand = {
            "prefill": RoleDemand(1, 1, ongoing=1, tokens_per_s=1000.0),
            "decode": RoleDemand(2, 2, ongoing=150, l_min_s=l_min),
        }
        _, out = decide(AutoscaleState(), demand, cfg, now=0.0)
        assert (out["decode"].replicas, out["decode"].reason) == (want, "slo_itl")
    # a measured floor above the target makes the ITL target infeasible, said so
    demand["decode"] = RoleDemand(2, 2, ongoing=150, l_min_s=0.06)
    _, out = decide(AutoscaleState(), demand, cfg, now=0.0)
    assert out["decode"].reason == "slo_itl_infeasible"


def test_keep_alive_worked_examples_from_the_module_docstring() -> None:
    # C = 30 s, eps = 3%, cap 300 s: T = max(C, ln((1 + r C) / eps) / r)
    assert keep_alive_s(1.4, 30.0, 0.03, 300.0) == 30.0  # ln(43 / 0.03) / 1.4 = 5.19 < C
    assert keep_alive_s(0.1, 30.0, 0.03, 300.0) == pytest.approx(math.log(4 / 0.03) / 0.1)
    assert keep_alive_s(0.1, 30.0, 0.03, 300.0) == pytest.approx(48.93, abs=0.01)
    assert keep_alive_s(0.01, 30.0, 0.03, 300.0) == 300.0  # 377 s, capped
    assert keep_alive_s(0.0, 30.0, 0.03, 300.0) == 300.0  # no rate known: the cap
    # the budget holds at the derived T: exp(-r T) (1 + r C) == eps where the log term binds
    r, c, eps = 0.05, 30.0, 0.03
    t = keep_alive_s(r, c, eps, 1e9)
    assert math.exp(-r * t) * (1 + r * c) == pytest.approx(eps)
    # a tighter budget keeps alive longer
    assert keep_alive_s(0.1, 30.0, 0.01, 300.0) > keep_alive_s(0.1, 30.0, 0.03, 300.0)


def test_the_slo_path_goes_to_zero_after_the_derived_keep_alive() -> None:
    # cold start 5 s (slo_cfg), windows of 100 tok/s, prompts of mean 1,000: r = 0.1/s ->
    # T = max(5, ln((1 + 0.5) / 0.03) / 0.1) = 39.1 s, not idle_to_zero_s (300 s)
    cfg = slo_cfg()
    state = AutoscaleState(windows=(100.0,) * 12, window_start=(0.0, 0.0))
    busy = {
        "prefill": RoleDemand(1, 1, ongoing=1, tokens_per_s=1000.0, prompt_tokens_mean=1000),
        "decode": RoleDemand(1, 1, ongoing=1),
    }
    state, _ = decide(state, busy, cfg, now=0.0)
    assert state.keep_alive_s == pytest.approx(math.log(1.5 / 0.03) / 0.1)
    idle = {
        "prefill": RoleDemand(1, 1, tokens_per_s=1000.0, prompt_tokens_mean=1000),
        "decode": RoleDemand(1, 1),
    }
    s1, out = decide(state, idle, cfg, now=39.0)
    assert out["prefill"].reason != "idle_to_zero" and out["prefill"].replicas == 1
    s2, out = decide(s1, idle, cfg, now=39.2)
    assert (out["prefill"].replicas, out["prefill"].reason) == (0, "idle_to_zero")
    assert (out["decode"].replicas, out["decode"].reason) == (0, "idle_to_zero")
    # the derived keep-alive survives the state's round trip (the live policy stores it)
    assert AutoscaleState.from_dict(s2.to_dict()).keep_alive_s == state.keep_alive_s
    # without slo, idle_to_zero_s stays the keep-alive
    plain = cfg.model_copy(update={"slo": None})
    s3, _ = decide(AutoscaleState(), busy, plain, now=0.0)
    assert s3.keep_alive_s is None
    _, out = decide(s3, idle, plain, now=39.2)
    assert out["prefill"].reason != "idle_to_zero"


def test_without_slo_the_state_keeps_no_windows() -> None:
    cfg = slo_cfg().model_copy(update={"slo": None})
    d = RoleDemand(1, 1, ongoing=1, uncached_tokens_total=0.0)
    state, _ = decide(AutoscaleState(), {"prefill": d}, cfg, now=0.0, paired=False)
    d = RoleDemand(1, 1, ongoing=1, uncached_tokens_total=50000.0)
    state, out = decide(state, {"prefill": d}, cfg, now=10.0, paired=False)
    assert state.windows == () and state.window_start is None
    assert out["prefill"].reason == "demand"


@pytest.mark.parametrize(
    ("slo", "field"),
    [
        ({"ttft_p99_s": 0, "itl_p99_s": 0.05}, "ttft_p99_s"),
        ({"ttft_p99_s": 2.0, "itl_p99_s": -1}, "itl_p99_s"),
        ({"ttft_p99_s": 2.0, "itl_p99_s": 0.05, "max_cold_fraction": 1.5}, "max_cold_fraction"),
        ({"ttft_p99_s": 2.0, "itl_p99_s": 0.05, "max_cold_fraction": 0}, "max_cold_fraction"),
        ({"itl_p99_s": 0.05}, "ttft_p99_s"),
        ({"ttft_p99_s": 2.0, "itl_p99_s": 0.05, "p95": 1}, "p95"),
        ({"ttft_p99_s": 2.0, "itl_p99_s": 0.05, "decode_step": {"l_min_s": 0}}, "decode_step"),
    ],
)
def test_bad_slo_values_are_refused_naming_the_field(slo: dict[str, object], field: str) -> None:
    with pytest.raises(ValidationError, match=field) as e:
        AutoscaleConfig.model_validate({"slo": slo})
    assert any(err["loc"][0] == "slo" for err in e.value.errors())


def test_prompt_moments_are_the_mean_and_the_nearest_rank_p99() -> None:
    from controllers.slo_sizing import prompt_moments

    assert prompt_moments([]) == (0.0, 0.0)
    # 1..200: the 198th smallest is the p99 (ceil(0.99 * 200)); one long prompt in 100 short
    # ones is the p99 only once it is more than 1% of them
    assert prompt_moments(range(1, 201)) == (100.5, 198.0)
    assert prompt_moments([100] * 99 + [5000]) == (149.0, 100.0)
    assert prompt_moments([100] * 98 + [5000] * 2) == (198.0, 5000.0)
