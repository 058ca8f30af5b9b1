"""Fairway across steps (``fairway_xstep``): a bypass allowance per request that persists
between scheduling steps instead of a ledger that resets every step.

The paper's Fairway bounds the work placed ahead of the oldest request *within one step*
(a quarter of its work plus one overshoot); over a long backlog that bound is granted again
at every step, so the Fast lane keeps a steady share of every step (the paper's third
limitation). This variant keeps Fairway's unit of fairness (work in uncached tokens, the
paper's ``c_r``) and its Fast lane (``s_r = reuse_ratio + relative_wait``), but charges
every bypass to the requests it passes, for as long as they wait.

Quantities, per request ``r`` (first seen by :func:`xstep_order` at ``t0_r``):

- ``ahead_r``: the uncached work queued ahead of ``r`` at ``t0_r`` (older waiting requests,
  plus the unfinished work of requests in flight): what FCFS would still do before ``r``.
- ``allowance_r = share_r * (ahead_r + c_r)``, fixed at ``t0_r``, with ``share_r =
  bypass_share + cached_share * h_r / prompt_r`` (``cached_share = 0`` by default: one share
  for all; above 0, misses keep the strict share and cached requests may be passed more).
- ``bypass_r``: uncached tokens scheduled for requests *younger* than ``r`` while ``r``
  waited (learned from :func:`xstep_observe`, i.e. what the engine actually ran).
- ``committed_r = bypass_r + `` the remaining work of younger requests already in flight.

Order at each step: the Fair lane is arrival order; the Fast lane is Fairway's score order.
At each slot the Fast lane's next request ``f`` is placed if every not-yet-placed request
older than ``f`` still has ``allowance - committed - (work placed ahead of it in this
order) >= c_f``; otherwise the Fair lane places its oldest unplaced request. Once the
placed work reaches ``plan_horizon_tokens``, the rest follows in arrival order (which
passes nobody), so a step costs O(placements x queue) at most.

Guarantee (property-tested, the analogue of the paper's quarter-plus-overshoot bound):
for every request ``r``, the uncached work of younger requests scheduled while ``r`` waits
never exceeds ``allowance_r = share_r * (ahead_r + c_r)``, summed over *all* the
steps of its wait, with no overshoot term. In every order, the younger work placed ahead of
``r`` is at most ``max(0, allowance_r - committed_r)``. The one slack is the mechanism's:
if eviction raises a request's uncached work between the view and its admission, the
extra tokens count in ``bypass_r`` after the fact. ``bypass_share = 0`` is FCFS;
``bypass_share -> inf`` is Fairway's Fast lane alone (``fairway_nofair``).

Registered names: ``fairway_xstep`` (the paper's Fast-lane score, one share 0.08 for all)
and ``fairway_xstep_reuse`` (Fast lane by reuse ratio alone, ``bypass_share`` 0.08 for
misses, ``cached_share`` 10 so near-full hits may be passed freely among themselves; the
wait term is not needed against starvation once every miss's allowance is bounded).

Without :func:`xstep_observe` (a mechanism that never reports steps) nothing is charged
across steps and only the in-order accounting remains.

Choices where nothing dictates them:

- Age is ``(arrival_s, first-seen sequence)``; requests first seen together are ranked by
  their position in the view (the paper's Fair lane tie rule).
- Scheduled ids the state never saw (or already finished) are ignored.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from controllers.config import FairwayConfig
from controllers.prefill.base import PrefillQueueView, PrefillRequestView
from controllers.prefill.fairway import FAIR, FAST, fast_lane_scores

Rank = tuple[float, int]


class XStepConfig(BaseModel):
    """Parameters of ``fairway_xstep`` (the Fast-lane score comes from :class:`FairwayConfig`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    bypass_share: float = Field(
        default=0.08,
        ge=0,
        description="Allowance = bypass_share x (work queued ahead at arrival + own work), "
        "in uncached tokens, for the whole wait: 0 = FCFS, large = Fast lane only.",
    )
    cached_share: float = Field(
        default=0.0,
        ge=0,
        description="Extra share for cached requests: allowance = (bypass_share + cached_share"
        " x cached_tokens / prompt_tokens) x (ahead + own work), so misses keep the strict "
        "bound and hits may be passed more (0 = one share for all).",
    )
    fast_score: Literal["fairway", "cached", "reuse"] = Field(
        default="fairway",
        description="Fast-lane rank: 'fairway' = reuse_ratio + relative_wait (the paper's), "
        "'cached' = cached prefix tokens (LPM's), 'reuse' = reuse_ratio alone (RAGCache's).",
    )
    plan_horizon_tokens: int = Field(
        default=16_384,
        ge=1,
        description="Placed work (uncached tokens) after which the rest of the order is "
        "arrival order (bounds the per-step cost; keep it above the step's token budget).",
    )


@dataclass(frozen=True, slots=True)
class XStepEntry:
    """What the state remembers about one waiting request."""

    rank: Rank
    allowance: float
    bypass: float
    work: float  # c_r as of the latest view


@dataclass(frozen=True, slots=True)
class XStepCounters:
    """Totals over the run: placements per lane and Fast candidates refused by an allowance."""

    fast_placed: int = 0
    fair_placed: int = 0
    refused: int = 0


@dataclass(frozen=True)
class XStepState:
    """Everything ``fairway_xstep`` carries between steps. Replaced, never mutated.

    ``waiting``: entries of requests seen in the latest view. ``inflight``: requests the
    engine has started, as ``rank`` and remaining uncached work. ``seq``: next first-seen
    sequence number.
    """

    seq: int = 0
    waiting: Mapping[str, XStepEntry] = field(default_factory=dict)
    inflight: Mapping[str, tuple[Rank, float]] = field(default_factory=dict)
    counters: XStepCounters = XStepCounters()


@dataclass(frozen=True)
class XStepPlan:
    """An order, the lane that placed each request, and the remaining allowance used.

    ``room``: for each request of the view (by id), ``allowance - committed`` before this
    order (may be negative when earlier bypasses already used it up).
    """

    order: list[str]
    lanes: list[int]
    room: dict[str, float]


def _younger_sum(sorted_ranks: list[Rank], suffix: list[float], rank: Rank) -> float:
    """Sum of the values whose rank is strictly younger than ``rank``."""
    return suffix[bisect.bisect_right(sorted_ranks, rank)]


def _suffix(items: Sequence[tuple[Rank, float]]) -> tuple[list[Rank], list[float]]:
    srt = sorted(items)
    ranks = [r for r, _ in srt]
    suf = [0.0] * (len(srt) + 1)
    for k in range(len(srt) - 1, -1, -1):
        suf[k] = suf[k + 1] + srt[k][1]
    return ranks, suf


def _share(r: PrefillRequestView, config: XStepConfig) -> float:
    if config.cached_share == 0.0:
        return config.bypass_share
    frac = min(1.0, r.cached_tokens / r.prompt_tokens) if r.prompt_tokens > 0 else 0.0
    return config.bypass_share + config.cached_share * frac


def _entries(
    state: XStepState, reqs: tuple[PrefillRequestView, ...], config: XStepConfig
) -> tuple[list[XStepEntry], int]:
    """Entries for the view in view order: known ones kept, new ones ranked and allotted."""
    seq = state.seq
    ranks: list[Rank] = []
    for r in reqs:
        known = state.waiting.get(r.request_id)
        if known is not None:
            ranks.append(known.rank)
        else:
            ranks.append((r.arrival_s, seq))
            seq += 1
    inflight_work = sum(rem for _, rem in state.inflight.values())
    fair = sorted(range(len(reqs)), key=lambda i: ranks[i])
    out: list[XStepEntry | None] = [None] * len(reqs)
    ahead = inflight_work
    for i in fair:
        r = reqs[i]
        work = float(r.work)
        known = state.waiting.get(r.request_id)
        if known is not None:
            out[i] = replace(known, work=work)
        else:
            out[i] = XStepEntry(ranks[i], _share(r, config) * (ahead + work), 0.0, work)
        ahead += work
    return [e for e in out if e is not None], seq


def xstep_order(
    state: XStepState,
    queue: PrefillQueueView,
    now: float,
    config: XStepConfig,
    fairway: FairwayConfig,
) -> tuple[XStepState, XStepPlan]:
    """Order ``queue`` (a permutation of its ids) and return the state that remembers it.

    Pure: ``state`` and ``queue`` are not modified. See the module docstring for the rule
    and the guarantee.
    """
    reqs = queue.requests
    n = len(reqs)
    entries, seq = _entries(state, reqs, config)
    new_state = replace(
        state, seq=seq, waiting={r.request_id: e for r, e in zip(reqs, entries, strict=True)}
    )
    if n == 0:
        return new_state, XStepPlan([], [], {})
    fl_ranks, fl_suffix = _suffix(list(state.inflight.values()))
    fair = sorted(range(n), key=lambda i: entries[i].rank)
    pos = [0] * n  # position of each view index in the Fair lane
    for p, i in enumerate(fair):
        pos[i] = p
    room = np.empty(n, dtype=np.float64)  # by Fair-lane position
    for p, i in enumerate(fair):
        e = entries[i]
        room[p] = e.allowance - e.bypass - _younger_sum(fl_ranks, fl_suffix, e.rank)
    scores = _fast_scores(reqs, now, config, fairway)
    fast = sorted(range(n), key=lambda i: (-scores[i], pos[i]))
    order, lanes, counters = _merge(fast, fair, pos, [e.work for e in entries], room.copy(), config)
    c = state.counters
    new_state = replace(
        new_state,
        counters=XStepCounters(
            c.fast_placed + counters[0], c.fair_placed + counters[1], c.refused + counters[2]
        ),
    )
    plan = XStepPlan(
        [reqs[i].request_id for i in order],
        lanes,
        {reqs[i].request_id: float(room[pos[i]]) for i in range(n)},
    )
    return new_state, plan


def _fast_scores(
    reqs: tuple[PrefillRequestView, ...], now: float, config: XStepConfig, fw: FairwayConfig
) -> list[float]:
    if config.fast_score == "cached":
        return [float(r.cached_tokens) for r in reqs]
    if config.fast_score == "reuse":
        return [r.cached_tokens / r.work for r in reqs]
    return fast_lane_scores(reqs, now, fw.relative_wait)


def _merge(
    fast: list[int],
    fair: list[int],
    pos: list[int],
    work: list[float],
    room: np.ndarray,
    config: XStepConfig,
) -> tuple[list[int], list[int], tuple[int, int, int]]:
    """Place Fast candidates while every older unplaced request has room for them."""
    n = len(fair)
    placed = np.zeros(n, dtype=bool)  # by Fair-lane position
    order: list[int] = []
    lanes: list[int] = []
    fi = ai = 0
    placed_work = 0.0
    n_fast = n_fair = refused = 0
    while len(order) < n and placed_work < config.plan_horizon_tokens:
        while placed[pos[fast[fi]]]:
            fi += 1
        while placed[ai]:
            ai += 1
        f = fast[fi]
        pf = pos[f]
        take, lane = fair[ai], FAIR
        if pf == ai:
            take, lane = f, FAST  # the oldest unplaced is the Fast lane's choice too
        else:
            older = room[ai:pf][~placed[ai:pf]]
            if older.min() >= work[f]:
                room[ai:pf] -= work[f]
                take, lane = f, FAST
            else:
                refused += 1
        placed[pos[take]] = True
        order.append(take)
        lanes.append(lane)
        placed_work += work[take]
        if lane == FAST:
            n_fast += 1
        else:
            n_fair += 1
    for p in range(ai, n):  # beyond the horizon: arrival order passes nobody
        if not placed[p]:
            order.append(fair[p])
            lanes.append(FAIR)
            n_fair += 1
    return order, lanes, (n_fast, n_fair, refused)


def xstep_observe(
    state: XStepState, scheduled: Sequence[tuple[str, int]], now: float
) -> XStepState:
    """Charge one step's scheduled tokens: start/advance in-flight work, and add the tokens
    of younger requests to the ``bypass`` of every request that is still waiting.

    ``scheduled``: ``(request_id, tokens)`` pairs of the step (running and admitted).
    """
    inflight = dict(state.inflight)
    waiting = dict(state.waiting)
    charged: list[tuple[Rank, float]] = []
    for rid, tokens in scheduled:
        if rid in waiting:
            e = waiting.pop(rid)
            inflight[rid] = (e.rank, e.work)
        if rid not in inflight:
            continue
        rank, rem = inflight[rid]
        charged.append((rank, float(tokens)))
        rem -= tokens
        if rem <= 0:
            del inflight[rid]
        else:
            inflight[rid] = (rank, rem)
    # A started request that this step did not schedule has finished early (the view's work
    # was stale), been aborted, or been preempted (it returns through the waiting queue):
    # forget it, or its phantom work would inflate every later arrival's allowance. A
    # running request skipped only because the budget ran out is forgotten too; that
    # shrinks later allowances, which keeps the bound.
    seen = {rid for rid, _ in scheduled}
    inflight = {rid: v for rid, v in inflight.items() if rid in seen}
    if charged and waiting:
        ranks, suffix = _suffix(charged)
        waiting = {
            rid: replace(e, bypass=e.bypass + _younger_sum(ranks, suffix, e.rank))
            for rid, e in waiting.items()
        }
    return replace(state, waiting=waiting, inflight=inflight)


class FairwayXStep:
    """``fairway_xstep``: holds an :class:`XStepState` and exposes the policy interface.

    ``order`` advances the state's first-seen bookkeeping; ``observe_step`` (called by the
    simulator and engine plug-ins after each step) charges what was actually scheduled.
    """

    def __init__(
        self,
        config: XStepConfig | None = None,
        fairway: FairwayConfig | None = None,
        name: str = "fairway_xstep",
    ) -> None:
        self.config = config or XStepConfig()
        self.fairway = fairway or FairwayConfig()
        self.name = name
        self.state = XStepState()

    def plan(self, queue: PrefillQueueView, now: float) -> XStepPlan:
        self.state, plan = xstep_order(self.state, queue, now, self.config, self.fairway)
        return plan

    def order(self, queue: PrefillQueueView, now: float) -> list[str]:
        return self.plan(queue, now).order

    def observe_step(self, scheduled: list[tuple[str, int]], now: float) -> None:
        self.state = xstep_observe(self.state, scheduled, now)
