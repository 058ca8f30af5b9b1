"""Pure parts of engines/: profile fits, plug-in config validation, state channel, spike."""

from __future__ import annotations

import pytest

from bench.engine.spike import block_chain, make_spike
from engines.config import EngineSchedulerConfig, engine_config_from_vllm
from engines.profiler import fit_decode, fit_step_cost
from engines.scheduler_names import scheduler_cls_name
from engines.state_channel import StatePublisher, StateReader


def test_fit_decode_recovers_a_piecewise_line() -> None:
    batches = [1, 2, 4, 8, 16, 32]
    secs = [0.010 + 0.001 * max(0, b - 4) for b in batches]
    d = fit_decode(batches, secs)
    assert d.b0 == 4
    assert d.l_min_s == pytest.approx(0.010)
    assert d.alpha_s == pytest.approx(0.001)


def test_fit_decode_flat_curve_has_no_slope() -> None:
    d = fit_decode([1, 2, 4, 8], [0.02, 0.02, 0.02, 0.02])
    assert d.alpha_s == 0.0 and d.l_min_s == pytest.approx(0.02)


def test_fit_step_cost_recovers_coefficients_and_never_goes_negative() -> None:
    truth = (0.004, 2e-5, 1e-9)
    pts = []
    for c, p in [(128, 0), (256, 0), (512, 0), (1024, 0), (2048, 0), (2048, 2048), (1000, 4096)]:
        s = truth[0] + truth[1] * c + truth[2] * (c * p + c * (c + 1) / 2)
        pts.append((c, p, s))
    sc = fit_step_cost(pts)
    assert sc.fixed_s == pytest.approx(truth[0], rel=1e-6)
    assert sc.per_token_s == pytest.approx(truth[1], rel=1e-6)
    assert sc.attn_per_ctx_token_s == pytest.approx(truth[2], rel=1e-6)
    # Decreasing times would need a negative slope: the fit drops that term instead.
    sc2 = fit_step_cost([(100, 0, 0.05), (200, 0, 0.04), (400, 0, 0.03)])
    assert min(sc2.fixed_s, sc2.per_token_s, sc2.attn_per_ctx_token_s) >= 0


def test_bad_plugin_config_is_a_clear_error_naming_the_field() -> None:
    with pytest.raises(ValueError, match="prefill_policy: unknown prefill policy 'nope'"):
        engine_config_from_vllm({"pdserve": {"prefill_policy": "nope"}})
    with pytest.raises(ValueError, match="publish_every_steps"):
        engine_config_from_vllm({"pdserve": {"publish_every_steps": 0}})
    with pytest.raises(ValueError, match="gaet"):
        engine_config_from_vllm({"pdserve": {"gaet": "twp"}})
    with pytest.raises(ValueError, match="fast_lane_weight"):
        engine_config_from_vllm({"pdserve": {"fairway": {"fast_lane_weight": -1}}})
    assert engine_config_from_vllm({}) == EngineSchedulerConfig()


def test_scheduler_class_names_per_mode() -> None:
    assert scheduler_cls_name("prefill") == "engines.scheduler.FairwayScheduler"
    assert (
        scheduler_cls_name("decode", async_scheduling=True) == "engines.scheduler.AsyncTWPScheduler"
    )
    with pytest.raises(ValueError, match="unknown engine mode 'x'"):
        scheduler_cls_name("x")


def test_state_channel_delivers_the_newest_snapshot(tmp_path) -> None:
    endpoint = f"ipc://{tmp_path}/state.sock"
    pub = StatePublisher(endpoint)
    rd = StateReader(endpoint)
    try:
        got = None
        for i in range(200):  # a SUB connects asynchronously: publish until it hears
            pub.publish({"engine": "e", "step": i})
            got = rd.latest(timeout_s=0.01)
            if got is not None:
                break
        assert got is not None and got["engine"] == "e"
        for i in range(1000, 1005):
            pub.publish({"engine": "e", "step": i})
        # a non-blocking publish into a conflated queue may be dropped (EAGAIN) while the
        # queue's one slot is in flight; the engine publishes again at its next step, which
        # is what this loop does: snapshots never go backwards, and the newest arrives
        seen: list[int] = []
        for _ in range(200):
            last = rd.latest(timeout_s=0.01)
            if last is not None:
                seen.append(last["step"])
            if seen and seen[-1] == 1004:
                break
            pub.publish({"engine": "e", "step": 1004})
        assert seen and seen[-1] == 1004
        assert seen == sorted(seen)
    finally:
        rd.close()
        pub.close()


def test_spike_is_deterministic_and_mixes_shared_and_unshared() -> None:
    a, b = make_spike(40, seed=3), make_spike(40, seed=3)
    assert a == b and make_spike(40, seed=4) != a
    labels = {r.label for r in a.requests}
    assert labels == {"shared", "unshared"}
    shared = [r for r in a.requests if r.label == "shared"]
    chains = [block_chain(r.tokens, 128) for r in shared]
    # Requests on the same prefix share their leading block hashes; others do not.
    assert any(c1[:6] == c2[:6] for c1 in chains for c2 in chains if c1 is not c2)
    u = [r for r in a.requests if r.label == "unshared"][0]
    assert block_chain(u.tokens, 128)[0] not in {c[0] for c in chains}


def test_fit_over_batched_steps_sums_the_chunks() -> None:
    from engines.profiler import fit_step_cost_steps

    truth = (0.01, 1e-4, 2e-9)

    def cost(ch: list[tuple[int, int]]) -> float:
        return (
            truth[0]
            + truth[1] * sum(c for c, _ in ch)
            + truth[2] * sum(c * p + c * (c + 1) / 2 for c, p in ch)
        )

    shapes = [[(2048, 0)], [(512, 0)] * 4, [(128, 0)] * 16, [(128, 1024)] * 8, [(1000, 0)]]
    sc = fit_step_cost_steps([(ch, cost(ch)) for ch in shapes])
    assert sc.fixed_s == pytest.approx(truth[0], rel=1e-6)
    assert sc.per_token_s == pytest.approx(truth[1], rel=1e-6)
    assert sc.attn_per_ctx_token_s == pytest.approx(truth[2], rel=1e-6)
