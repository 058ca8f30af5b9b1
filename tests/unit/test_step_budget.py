"""The step budget from a step-time target (controllers.step_budget): its fixed point, its
clamps and the steps it does not measure."""

from __future__ import annotations

import pytest

from controllers import step_budget as sb


def _saturated(b: sb.StepBudget, a: float, per_token: float, steps: int) -> sb.StepBudget:
    """Full steps (each schedules the whole budget) on an engine whose step takes
    ``a + per_token * n`` seconds."""
    for _ in range(steps):
        b = sb.observe(b, b.tokens, a + per_token * b.tokens)
    return b


def test_full_steps_converge_to_a_step_of_the_target_from_either_side() -> None:
    # the bench model on half a core: 5 ms a token, 0.1 s fixed; a 2.5 s target is a step of
    # (2.5 - 0.1) / 0.005 = 480 tokens
    down = _saturated(sb.start(2.5, floor=64, ceiling=4096), 0.1, 0.005, 60)
    assert down.tokens == pytest.approx(480, abs=2)
    up = _saturated(sb.StepBudget(2.5, 64, 4096, tokens=64), 0.1, 0.005, 200)
    assert up.tokens == pytest.approx(480, abs=2)
    # the first full step alone takes the budget most of the way: 2.5 / (0.1/4096 + 0.005)
    first = sb.observe(sb.start(2.5, 64, 4096), 4096, 0.1 + 0.005 * 4096)
    assert first.tokens == 497


def test_the_clamps_a_fast_engine_keeps_its_ceiling_a_slow_one_falls_to_the_floor() -> None:
    gpu = _saturated(sb.start(0.5, 64, 4096), 0.01, 2e-5, 20)  # 4096 tokens in 92 ms
    assert gpu.tokens == 4096
    slow = _saturated(sb.start(0.5, 64, 4096), 1.0, 0.005, 20)  # the fixed cost alone > 0.5 s
    assert slow.tokens == 64


def test_steps_below_the_floor_or_without_a_duration_are_not_measured() -> None:
    b = sb.observe(sb.start(2.5, 64, 4096), 4096, 20.0)
    assert b.tokens == 512
    assert sb.observe(b, 8, 5.0) == b  # 8 decode-sized tokens in 5 s: not a per-token cost
    assert sb.observe(b, 500, 0.0) == b
    # a partial step (light load) lowers the budget, by its fixed cost over its tokens
    lighter = sb.observe(b, 100, 0.1 + 0.005 * 100)
    assert lighter.tokens < b.tokens


def test_the_start_and_its_refusals() -> None:
    b = sb.start(1.0, floor=64, ceiling=512)
    assert b.tokens == 512 and b.per_token_s is None
    assert sb.start(1.0, floor=64, ceiling=32).floor == 32  # a ceiling below the floor wins
    for bad in ({"target_s": 0.0}, {"alpha": 0.0}, {"floor": 0}):
        kw = {"target_s": 1.0, "floor": 64, "ceiling": 512, "alpha": 0.3} | bad
        with pytest.raises(ValueError):
            sb.StepBudget(**kw)  # type: ignore[arg-type]
