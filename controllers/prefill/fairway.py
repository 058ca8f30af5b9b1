"""Fairway: a Fast lane scored by reuse ratio plus relative wait, an arrival-ordered
Fair lane, merged by work charges (paper: shared seeds ``000_*``).

Quantities, named as in the paper, per waiting request ``r``:

- ``h_r``: cached prefix tokens; ``c_r = max(1, uncached tokens)``: work still to compute.
- ``reuse_ratio = h_r / c_r``; ``relative_wait = wait_r / SLO_r`` with ``SLO_r`` the
  request's patience (:func:`controllers.prefill.base.patience_s`).
- Fast-lane score ``s_r = reuse_ratio + relative_wait``; higher goes first.

Merge by work charges, once per scheduling step (the ledgers reset every step):
each lane's ledger starts at the work of its front request (the Fast lane's counted
``fast_lane_weight`` times); the lane with the smaller ledger places its next
not-yet-placed request and adds that request's work (weighted for the Fast lane);
a tie goes to the Fast lane; a request already placed by the other lane is skipped
at no charge.

Guarantee (the paper's bound, property-tested): the work placed ahead of the oldest
request is at most ``work(oldest) / fast_lane_weight`` plus the work of one request
(the overshoot of the last placement).

Choices where the paper is silent:

- Ties inside the Fast lane go to the older request, then to the earlier position in
  the view, so the order is deterministic.
- ``now - arrival_s`` below zero (clock skew between a caller and the view) counts as 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from controllers.config import FairwayConfig
from controllers.prefill.base import PrefillQueueView, PrefillRequestView

FAST = 0
FAIR = 1


def _columns(reqs: tuple[PrefillRequestView, ...]) -> tuple[np.ndarray, ...]:
    n = len(reqs)
    cached = np.fromiter([r.cached_tokens for r in reqs], np.float64, n)
    work = np.maximum(np.fromiter([r.uncached_tokens for r in reqs], np.float64, n), 1.0)
    arrival = np.fromiter([r.arrival_s for r in reqs], np.float64, n)
    patience = np.fromiter([r.patience_s for r in reqs], np.float64, n)
    return cached, work, arrival, patience


def _scores(cols: tuple[np.ndarray, ...], now: float, relative_wait: bool) -> np.ndarray:
    cached, work, arrival, patience = cols
    wait = np.maximum(now - arrival, 0.0)
    reuse_ratio = cached / work
    relative_wait_term = wait / np.maximum(patience, 1e-9) if relative_wait else wait
    return reuse_ratio + relative_wait_term


def fast_lane_scores(
    reqs: tuple[PrefillRequestView, ...], now: float, relative_wait: bool = True
) -> list[float]:
    """``s_r = h_r / c_r + wait_r / SLO_r`` (or ``wait_r / 1 s`` when ``relative_wait`` is off)."""
    return _scores(_columns(reqs), now, relative_wait).tolist()


def merge_by_work_charges(
    fast: list[int], fair: list[int], work: list[float] | list[int], fast_lane_weight: float
) -> tuple[list[int], list[int]]:
    """Merge two orders of the same indices by the paper's work-charge ledgers.

    Returns ``(order, lanes)``: the merged indices and, for each, the lane (FAST or
    FAIR) that placed it.
    """
    n = len(fast)
    if n == 0:
        return [], []
    placed = bytearray(n)
    order: list[int] = []
    lanes: list[int] = []
    put, mark = order.append, lanes.append
    fi = ai = 0
    fast_ledger = fast_lane_weight * work[fast[0]]
    fair_ledger = float(work[fair[0]])
    for _ in range(n):
        if fast_ledger <= fair_ledger:  # a tie goes to the Fast lane
            i = fast[fi]
            while placed[i]:  # placed by the other lane: skipped at no charge
                fi += 1
                i = fast[fi]
            fast_ledger += fast_lane_weight * work[i]
            mark(FAST)
        else:
            i = fair[ai]
            while placed[i]:
                ai += 1
                i = fair[ai]
            fair_ledger += work[i]
            mark(FAIR)
        placed[i] = 1
        put(i)
    return order, lanes


@dataclass(frozen=True)
class FairwayPlan:
    """An order plus, for each placed request, the lane that placed it (for telemetry)."""

    order: list[str]
    lanes: list[int] = field(default_factory=list)

    @property
    def fast_placed(self) -> int:
        return sum(1 for lane in self.lanes if lane == FAST)


class Fairway:
    """The paper's Fairway and its ablation variants (by config switches).

    ``fairway``: relative wait + Fair lane. ``fairway_abs``: wait / 1 s.
    ``fairway_nofair``: Fast lane only. ``fairway_abs_nofair``: both.
    """

    def __init__(self, config: FairwayConfig | None = None, name: str | None = None) -> None:
        self.config = config or FairwayConfig()
        if name is None:
            name = "fairway" + ("" if self.config.relative_wait else "_abs")
            name += "" if self.config.fair_lane else "_nofair"
        self.name = name

    def plan(self, queue: PrefillQueueView, now: float) -> FairwayPlan:
        reqs = queue.requests
        n = len(reqs)
        if n == 0:
            return FairwayPlan([], [])
        cols = _columns(reqs)
        scores = _scores(cols, now, self.config.relative_wait)
        # Fair lane: arrival, then position. Fast lane: score descending over the
        # arrival order with a stable sort, so ties go to the older, then earlier, request.
        fair_np = np.argsort(cols[2], kind="stable")
        fast = fair_np[np.argsort(-scores[fair_np], kind="stable")].tolist()
        if not self.config.fair_lane:
            return FairwayPlan([reqs[i].request_id for i in fast], [FAST] * n)
        fair = fair_np.tolist()
        idx, lanes = merge_by_work_charges(
            fast, fair, cols[1].tolist(), self.config.fast_lane_weight
        )
        return FairwayPlan([reqs[i].request_id for i in idx], lanes)

    def order(self, queue: PrefillQueueView, now: float) -> list[str]:
        return self.plan(queue, now).order

    def order_with_lanes(self, queue: PrefillQueueView, now: float) -> tuple[list[str], list[str]]:
        """The order and each request's lane, ``fast`` or ``fair`` (:class:`LanedPolicy`)."""
        plan = self.plan(queue, now)
        return plan.order, ["fast" if lane == FAST else "fair" for lane in plan.lanes]
