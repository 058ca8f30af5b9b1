"""fairway_xstep: the per-request bypass allowance that persists across steps."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from controllers.config import FairwayConfig
from controllers.prefill import Fairway, make_prefill_policy
from controllers.prefill.fairway import FAIR, FAST
from controllers.prefill.xstep import (
    FairwayXStep,
    XStepConfig,
    XStepEntry,
    XStepState,
    xstep_observe,
    xstep_order,
)
from tests.helpers import queue, req

FW = FairwayConfig()


def _random_reqs(rng: random.Random, n: int, t_max: float = 10.0) -> list:
    out = []
    for i in range(n):
        cached = rng.choice([0, 0, rng.randrange(0, 8000)])
        out.append(
            req(
                f"r{i}",
                arrival=round(rng.uniform(0, t_max), 1),  # ties in arrival happen
                cached=cached,
                uncached=rng.randrange(0, 6000),
                patience=rng.uniform(1, 5),
            )
        )
    return out


def test_registered_and_named() -> None:
    pol = make_prefill_policy("fairway_xstep")
    assert isinstance(pol, FairwayXStep) and pol.name == "fairway_xstep"
    assert pol.config.bypass_share == 0.08
    reuse = make_prefill_policy("fairway_xstep_reuse")
    assert isinstance(reuse, FairwayXStep) and reuse.name == "fairway_xstep_reuse"
    assert (reuse.config.fast_score, reuse.config.cached_share) == ("reuse", 10.0)


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ValidationError, match="bypass_share"):
        XStepConfig(bypass_share=-0.1)
    with pytest.raises(ValidationError, match="plan_horizon_tokens"):
        XStepConfig(plan_horizon_tokens=0)
    with pytest.raises(ValidationError, match="extra"):
        XStepConfig(bypass=1.0)  # type: ignore[call-arg]


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 30), st.integers(0, 10_000))
def test_zero_share_is_fcfs(n: int, seed: int) -> None:
    reqs = _random_reqs(random.Random(seed), n)
    q = queue(*reqs)
    _, plan = xstep_order(XStepState(), q, 12.0, XStepConfig(bypass_share=0.0), FW)
    assert plan.order == make_prefill_policy("fcfs").order(q, 12.0)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 30), st.integers(0, 10_000))
def test_unbounded_share_is_the_fast_lane_alone(n: int, seed: int) -> None:
    reqs = _random_reqs(random.Random(seed), n)
    q = queue(*reqs)
    cfg = XStepConfig(bypass_share=1e12, plan_horizon_tokens=10**9)
    _, plan = xstep_order(XStepState(), q, 12.0, cfg, FW)
    assert plan.order == Fairway(FairwayConfig(fair_lane=False)).order(q, 12.0)


def test_flood_example_by_hand() -> None:
    """M1, M2: 6,000 uncached each at t=0; hits of 300. Share 1/4.

    Allowances: M1 = 0.25 x 6,000 = 1,500; M2 = 0.25 x (6,000 + 6,000) = 3,000.
    Order: five hits use M1's 1,500; M1; five more use M2's remaining 1,500; M2; the rest.
    """
    m = [req("M1", arrival=0.0, uncached=6000), req("M2", arrival=0.0, uncached=6000)]
    hits = [req(f"H{i}", arrival=0.1 * i, cached=6000, uncached=300) for i in range(1, 13)]
    cfg = XStepConfig(bypass_share=0.25)
    state, plan = xstep_order(XStepState(), queue(*m, *hits), 2.0, cfg, FW)
    five = [f"H{i}" for i in range(1, 6)]
    assert plan.order[:13] == [*five, "M1", *[f"H{i}" for i in range(6, 11)], "M2", "H11"]
    assert plan.lanes[:6] == [FAST] * 5 + [FAIR]
    assert state.waiting["M1"].allowance == 1500 and state.waiting["M2"].allowance == 3000

    # The engine runs the five hits and the first 548 tokens of M1.
    state = xstep_observe(state, [*[(h, 300) for h in five], ("M1", 548)], 2.1)
    assert state.waiting["M2"].bypass == 1500  # younger hits charged to M2; M1 is older
    assert state.inflight["M1"][1] == 6000 - 548
    # Next step: M1 continues (older than M2: not charged). M2 has 1,500 left, less
    # M1's remaining work? No: M1 is older, so its remaining work is not committed to M2.
    state = xstep_observe(state, [("M1", 2048)], 2.2)
    rest = [h for h in hits if h.request_id not in five]
    state, plan = xstep_order(state, queue(m[1], *rest), 2.3, cfg, FW)
    assert plan.room["M2"] == 1500
    assert plan.order[:6] == [f"H{i}" for i in range(6, 11)] + ["M2"]
    # Across steps: after those five ran, M2 has no room left; it goes first from now on,
    # where the paper's Fairway would again let a quarter of its work pass in every step.
    state = xstep_observe(state, [(f"H{i}", 300) for i in range(6, 11)], 2.4)
    state, plan = xstep_order(state, queue(m[1], *hits[10:]), 2.5, cfg, FW)
    assert plan.room["M2"] == 0 and plan.order[0] == "M2"
    assert Fairway().order(queue(m[1], *hits[10:]), 2.5)[0] != "M2"


def test_inputs_are_not_modified() -> None:
    reqs = _random_reqs(random.Random(3), 20)
    q = queue(*reqs)
    s0 = XStepState()
    s1, _ = xstep_order(s0, q, 11.0, XStepConfig(), FW)
    assert s0 == XStepState() and len(s1.waiting) == 20
    s2 = xstep_observe(s1, [("r0", 10), ("unknown", 99)], 11.5)
    assert "r0" not in s1.inflight and s1.waiting["r0"].bypass == 0.0
    assert "unknown" not in s2.inflight and "unknown" not in s2.waiting


def test_finished_requests_leave_the_state() -> None:
    q = queue(req("a", uncached=100), req("b", uncached=50, arrival=1.0))
    state, _ = xstep_order(XStepState(), q, 2.0, XStepConfig(), FW)
    state = xstep_observe(state, [("a", 100), ("b", 20)], 2.1)
    assert "a" not in state.inflight and state.inflight["b"][1] == 30
    state = xstep_observe(state, [("b", 30)], 2.2)
    assert not state.inflight and not state.waiting
    state, plan = xstep_order(state, queue(), 3.0, XStepConfig(), FW)
    assert plan.order == [] and not state.waiting


def test_aborted_requests_do_not_inflate_later_allowances() -> None:
    """A request started and then never scheduled again (aborted, or done early because the
    view's work was stale) leaves the in-flight table at the next step."""
    cfg = XStepConfig()
    state = XStepState()
    for k in range(50):
        state, _ = xstep_order(state, queue(req(f"gone{k}", uncached=1000, arrival=k)), k, cfg, FW)
        state = xstep_observe(state, [(f"gone{k}", 200)], k + 0.1)  # 800 tokens left ...
    # ... and none of them is scheduled again: at most the last one is still in flight.
    assert len(state.inflight) <= 1
    state, _ = xstep_order(state, queue(req("new", uncached=1000, arrival=100.0)), 100.0, cfg, FW)
    fresh, _ = xstep_order(
        XStepState(), queue(req("new", uncached=1000, arrival=100.0)), 100.0, cfg, FW
    )
    assert state.waiting["new"].allowance <= fresh.waiting["new"].allowance + cfg.bypass_share * 800


def _state_strategy() -> st.SearchStrategy:
    return st.lists(st.tuples(st.floats(0, 20_000), st.floats(0, 20_000)), min_size=0, max_size=30)


@settings(max_examples=150, deadline=None)
@given(
    st.integers(1, 30),
    st.integers(0, 10_000),
    _state_strategy(),
    st.lists(st.floats(1, 8000), max_size=5),
    st.sampled_from([0.05, 0.1, 0.25, 1.0]),
)
def test_order_never_places_more_younger_work_than_the_room(
    n: int,
    seed: int,
    prior: list[tuple[float, float]],
    inflight: list[float],
    share: float,
) -> None:
    """In one order, younger work placed ahead of r <= max(0, allowance - committed)."""
    rng = random.Random(seed)
    reqs = _random_reqs(rng, n)
    waiting = {}
    for k, (allowance, bypass) in enumerate(prior[:n]):
        r = reqs[k]
        waiting[r.request_id] = XStepEntry((r.arrival_s, 1000 + k), allowance, bypass, 1.0)
    flight = {f"i{k}": ((rng.uniform(0, 10), 500 + k), rem) for k, rem in enumerate(inflight)}
    state = XStepState(seq=0, waiting=waiting, inflight=flight)
    cfg = XStepConfig(bypass_share=share, plan_horizon_tokens=rng.choice([1, 3000, 10**9]))
    new, plan = xstep_order(state, queue(*reqs), 12.0, cfg, FW)
    assert sorted(plan.order) == sorted(r.request_id for r in reqs)
    by_id = {r.request_id: r for r in reqs}
    rank = {rid: e.rank for rid, e in new.waiting.items()}
    for rid, e in new.waiting.items():
        committed = e.bypass + sum(rem for rk, rem in flight.values() if rk > e.rank)
        room = e.allowance - committed
        assert plan.room[rid] == pytest.approx(room)
        before = plan.order[: plan.order.index(rid)]
        younger = sum(by_id[o].work for o in before if rank[o] > e.rank)
        assert younger <= max(0.0, room) + 1e-6 * max(1.0, room)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 40),
    st.integers(0, 10**6),
    st.sampled_from([0.0, 0.05, 0.1, 0.25]),
    st.sampled_from([256, 2048]),
)
def test_bound_holds_across_steps_in_a_budget_loop(
    n: int, seed: int, share: float, budget: int
) -> None:
    """A toy engine (arrivals, running first, chunked admission to a token budget, no
    eviction): the younger work scheduled while r waits never exceeds r's allowance,
    summed over all the steps of its wait. Loads are dense enough that queues build."""
    rng = random.Random(seed)
    arrivals = [
        (round(rng.uniform(0, 30), 1), rng.randrange(0, 8000), rng.randrange(0, 6000))
        for _ in range(n)
    ]
    reqs = [
        req(f"r{k}", arrival=a, cached=c, uncached=u, patience=1.0 + k % 3)
        for k, (a, c, u) in enumerate(sorted(arrivals, key=lambda x: x[0]))
    ]
    pol = FairwayXStep(XStepConfig(bypass_share=share))
    waiting: list = []
    running: dict[str, int] = {}
    youngest_ahead: dict[str, float] = {}  # r -> younger tokens scheduled while r waited
    allowance: dict[str, float] = {}
    order_of = {r.request_id: k for k, r in enumerate(reqs)}  # arrival rank
    now, i, steps = 0.0, 0, 0
    while (i < len(reqs) or waiting or running) and steps < 10_000:
        while i < len(reqs) and reqs[i].arrival_s <= now:
            waiting.append(reqs[i])
            i += 1
        if not waiting and not running:
            now = reqs[i].arrival_s
            continue
        order = pol.order(queue(*waiting), now)
        for rid, e in pol.state.waiting.items():
            allowance.setdefault(rid, e.allowance)
        left, sched = budget, []
        for rid in list(running):
            c = min(running[rid], left)
            if c <= 0:
                break
            sched.append((rid, c))
            left -= c
        by_id = {r.request_id: r for r in waiting}
        for rid in order:
            if left <= 0:
                break
            work = by_id[rid].work
            c = min(work, left)
            running[rid] = work
            sched.append((rid, c))
            left -= c
        admitted = {rid for rid, _ in sched}
        waiting = [r for r in waiting if r.request_id not in admitted]
        for r in waiting:
            younger = sum(c for rid, c in sched if order_of[rid] > order_of[r.request_id])
            youngest_ahead[r.request_id] = youngest_ahead.get(r.request_id, 0.0) + younger
        for rid, c in sched:
            running[rid] -= c
            if running[rid] <= 0:
                del running[rid]
        pol.observe_step(sched, now + 0.1)
        now += 0.1
        steps += 1
    assert not waiting and not running and i == len(reqs)
    for rid, y in youngest_ahead.items():
        assert y <= allowance[rid] + 1e-6, (rid, y, allowance[rid])


@pytest.mark.parametrize(("fast_score", "same_as"), [("cached", "lpm"), ("reuse", "ragcache")])
@settings(max_examples=40, deadline=None)
@given(st.integers(0, 30), st.integers(0, 10_000))
def test_fast_score_options_rank_like_their_baselines(
    fast_score: str, same_as: str, n: int, seed: int
) -> None:
    """With an unbounded share the Fast lane alone orders: LPM's or RAGCache's rank."""
    q = queue(*_random_reqs(random.Random(seed), n))
    cfg = XStepConfig.model_validate(
        {"bypass_share": 1e12, "plan_horizon_tokens": 10**9, "fast_score": fast_score}
    )
    _, plan = xstep_order(XStepState(), q, 12.0, cfg, FW)
    assert plan.order == make_prefill_policy(same_as).order(q, 12.0)
    # The allowance still binds with a finite share: share 0 is FCFS whatever the rank.
    _, plan0 = xstep_order(XStepState(), q, 12.0, cfg.model_copy(update={"bypass_share": 0}), FW)
    assert plan0.order == make_prefill_policy("fcfs").order(q, 12.0)


def test_cached_share_loosens_only_cached_requests() -> None:
    """share_r = bypass_share + cached_share x h/prompt: the miss keeps 0.1, the hit gets
    0.1 + 2 x 0.9 = 1.9 of (ahead + own work)."""
    q = queue(
        req("miss", arrival=0.0, cached=0, uncached=1000),
        req("hit", arrival=1.0, cached=900, uncached=100),
    )
    cfg = XStepConfig(bypass_share=0.1, cached_share=2.0)
    state, _ = xstep_order(XStepState(), q, 2.0, cfg, FW)
    assert state.waiting["miss"].allowance == pytest.approx(0.1 * 1000)
    assert state.waiting["hit"].allowance == pytest.approx(1.9 * (1000 + 100))
    with pytest.raises(ValidationError, match="cached_share"):
        XStepConfig(cached_share=-1)
