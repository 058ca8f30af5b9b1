"""An engine step's token budget from a step-time target, pure.

A request, however short or cached, waits for the engine step in progress and then rides a
step of its own, so its TTFT is at least about 1.5 steps whatever its order
(docs/design/matrix_39_causes.md, the ``multi_tenant`` cell). ``step_tokens`` caps a step in
tokens, which is right for one model on one machine only: 512 tokens are 2.5 s for the
``bench`` model on half a core and a few milliseconds on a GPU. ``step_target_s`` holds the
step's *duration* instead, on any engine: the budget is the target over the measured
seconds per token.

Per step that scheduled ``n`` tokens in ``s`` seconds:

- the seconds per token ``s / n`` enter an exponentially weighted mean (weight ``alpha`` on
  the new step); steps of fewer than ``floor`` tokens are not measured (their fixed cost
  would read as a cost per token);
- the budget is ``target_s / mean``, clamped to ``[floor, ceiling]`` (the ceiling is the
  engine's own budget, or ``step_tokens`` when both are set).

Convergence: with a step of ``a + b n`` seconds (a fixed cost and a cost per token), full
steps iterate the budget ``n' = T n / (a + b n)``, whose fixed point ``n* = (T - a) / b`` is
a step of ``T`` seconds, with slope ``a / T < 1`` there: it converges from either side.
Partial steps (light load) overstate the cost per token by ``a / n`` and so lower the
budget, which binds no step then; when the load comes, full steps bring it back up to
``n*``. When the fixed cost alone passes the target (``a >= T``) the budget falls to the
floor. The choice of a mean of per-token costs over a fit of ``a`` and ``b``: one number to
keep, and the fixed point is the same.

It is meant for prefill engines: a decode token costs far less than a prefill token (one
sequence's step, memory-bound), so the mechanism measures only steps that decoded nothing
(``engines/scheduler.py``); an engine whose every step decodes keeps its ceiling.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class StepBudget:
    """The budget's state: its parameters, the mean seconds per token, the current budget."""

    target_s: float
    floor: int
    ceiling: int
    alpha: float = 0.3
    per_token_s: float | None = None
    tokens: int = 0

    def __post_init__(self) -> None:
        if not self.target_s > 0:
            raise ValueError(f"target_s must be > 0 (got {self.target_s})")
        if not 1 <= self.floor <= self.ceiling:
            raise ValueError(f"need 1 <= floor <= ceiling (got {self.floor}, {self.ceiling})")
        if not 0 < self.alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1] (got {self.alpha})")


def start(target_s: float, floor: int, ceiling: int, alpha: float = 0.3) -> StepBudget:
    """A budget that starts at the ceiling (the engine's own) until steps are measured."""
    floor = min(floor, ceiling)
    return StepBudget(target_s, floor, ceiling, alpha, None, ceiling)


def observe(b: StepBudget, scheduled_tokens: int, step_s: float) -> StepBudget:
    """The budget after a step that scheduled ``scheduled_tokens`` in ``step_s`` seconds."""
    if scheduled_tokens < b.floor or not step_s > 0:
        return b
    spt = step_s / scheduled_tokens
    mean = spt if b.per_token_s is None else b.alpha * spt + (1 - b.alpha) * b.per_token_s
    tokens = max(b.floor, min(b.ceiling, int(b.target_s / mean)))
    return replace(b, per_token_s=mean, tokens=tokens)
