"""One contract suite over every registered prefill policy."""

from __future__ import annotations

import copy
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controllers.prefill import (
    PrefillQueueView,
    PrefillRequestView,
    ProtectingPolicy,
    make_prefill_policy,
    prefill_policy_names,
)
from tests.helpers import queue, req

POLICIES = prefill_policy_names()


def _random_queue(n: int, seed: int) -> PrefillQueueView:
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        cached = rng.choice([0, 0, rng.randrange(0, 8000)])
        uncached = rng.randrange(0, 6000)
        reqs.append(
            req(
                f"r{i}",
                arrival=rng.uniform(0, 10),
                cached=cached,
                uncached=uncached,
                patience=rng.uniform(1, 5),
                hashes=tuple(rng.randrange(1 << 63) for _ in range(3)),
            )
        )
    return queue(*reqs)


@pytest.mark.parametrize("name", POLICIES)
def test_returns_permutation_and_is_deterministic(name: str) -> None:
    q = _random_queue(60, seed=1)
    a = make_prefill_policy(name).order(q, now=12.0)
    b = make_prefill_policy(name).order(q, now=12.0)
    assert sorted(a) == sorted(r.request_id for r in q.requests)
    assert a == b


@pytest.mark.parametrize("name", POLICIES)
def test_leaves_input_untouched(name: str) -> None:
    q = _random_queue(30, seed=2)
    before = copy.deepcopy(q)
    make_prefill_policy(name).order(q, now=11.0)
    assert q == before


@pytest.mark.parametrize("name", POLICIES)
def test_empty_and_single(name: str) -> None:
    pol = make_prefill_policy(name)
    assert pol.order(PrefillQueueView(()), now=0.0) == []
    assert pol.order(queue(req("only")), now=0.0) == ["only"]


@pytest.mark.parametrize("name", POLICIES)
def test_huge_values(name: str) -> None:
    q = queue(
        req("a", arrival=1e12, cached=10**12, uncached=10**12, patience=1e-12, prompt=2 * 10**12),
        req("b", arrival=0.0, cached=0, uncached=0, patience=1e12),
        req("c", arrival=-1e12, cached=2**62, uncached=1, patience=1.0),
    )
    out = make_prefill_policy(name).order(q, now=1e15)
    assert sorted(out) == ["a", "b", "c"]


@pytest.mark.parametrize("name", POLICIES)
@settings(max_examples=40, deadline=None)
@given(st.integers(0, 25), st.integers(0, 10_000))
def test_permutation_property(name: str, n: int, seed: int) -> None:
    q = _random_queue(n, seed)
    out = make_prefill_policy(name).order(q, now=20.0)
    assert len(out) == len(set(out)) == n


def test_unknown_policy_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown prefill policy 'nope'; known: fcfs"):
        make_prefill_policy("nope")


def test_peek_protects_hashes_of_top_ranked_waiting_requests() -> None:
    pol = make_prefill_policy("peek")
    assert isinstance(pol, ProtectingPolicy)
    q = queue(req("x", cached=100, hashes=(1, 2)), req("y", cached=0, hashes=(3,)))
    assert pol.protected_blocks(q, now=0.0) == frozenset({1, 2, 3})


# --- what each baseline does (a wrong implementation fails these) -------------------


def _mixed() -> PrefillQueueView:
    return queue(
        req("old_miss", arrival=0.0, cached=0, uncached=4000, prompt=4000),
        req("big_partial", arrival=1.0, cached=6000, uncached=3000, prompt=9000),
        req("cheap_hit", arrival=2.0, cached=5000, uncached=100, prompt=5100),
        req("mid", arrival=3.0, cached=1000, uncached=1000, prompt=2000),
        req("new_miss", arrival=4.0, cached=0, uncached=500, prompt=500),
    )


def test_fcfs_is_arrival_order() -> None:
    assert make_prefill_policy("fcfs").order(_mixed(), 5.0) == [
        "old_miss",
        "big_partial",
        "cheap_hit",
        "mid",
        "new_miss",
    ]


def test_lpm_ranks_by_cached_length_with_tie_rules() -> None:
    assert make_prefill_policy("lpm").order(_mixed(), 5.0) == [
        "big_partial",
        "cheap_hit",
        "mid",
        "old_miss",
        "new_miss",
    ]
    assert make_prefill_policy("lpm_newest").order(_mixed(), 5.0)[-2:] == ["new_miss", "old_miss"]


def test_ragcache_ranks_by_reuse_ratio() -> None:
    assert make_prefill_policy("ragcache").order(_mixed(), 5.0)[:3] == [
        "cheap_hit",
        "big_partial",
        "mid",
    ]


def test_klpm_gives_every_kth_slot_to_the_oldest() -> None:
    reqs = [req(f"h{i}", arrival=1.0 + i, cached=1000 - i) for i in range(6)]
    reqs += [req("o1", arrival=0.0), req("o2", arrival=0.5)]
    pol = make_prefill_policy("klpm4")
    out = pol.order(queue(*reqs), 10.0)
    assert out[3] == "o1" and out[7] == "o2"
    assert out[:3] == ["h0", "h1", "h2"]


def test_klpm_counts_turns_across_steps() -> None:
    """One admission per step: the 4th admission overall goes to the oldest request."""
    pol = make_prefill_policy("klpm4")
    waiting = [req(f"h{i}", arrival=1.0 + i, cached=1000 - i) for i in range(6)]
    waiting.append(req("old", arrival=0.0))
    firsts = []
    for step in range(4):
        out = pol.order(queue(*waiting), 10.0 + step)
        firsts.append(out[0])
        pol.observe_step([(out[0], 100)], 10.1 + step)  # type: ignore[attr-defined]
        waiting = [r for r in waiting if r.request_id != out[0]]
    assert firsts == ["h0", "h1", "h2", "old"]
    # A request that was already running (not offered this step) is not an admission.
    pol2 = make_prefill_policy("klpm4")
    pol2.order(queue(req("a", cached=5)), 0.0)
    pol2.observe_step([("running-before", 2048), ("a", 10)], 0.1)  # type: ignore[attr-defined]
    assert pol2.admitted == 1  # type: ignore[attr-defined]


def test_preble_serves_one_group_per_step_and_rotates() -> None:
    """Released Preble (fcfs-mpq): group ceil(10 r) - 1, one group per step from a pointer
    that persists across steps (9, 8, ..., 0, skipping empty ones), (g + 1) * 10 first."""
    hi = [req(f"hi{i}", arrival=float(i), cached=950, uncached=50) for i in range(12)]  # r .95: 9
    mid = [req(f"mid{i}", arrival=float(i), cached=41, uncached=59) for i in range(2)]  # .41: 4
    lo = [req(f"lo{i}", arrival=float(i), cached=0, uncached=100) for i in range(3)]  # 0: 0
    pol = make_prefill_policy("preble")
    q = queue(*lo, *mid, *hi)
    step1 = pol.order(q, 20.0)  # group 9: up to 100 of it first, oldest first
    assert step1[:12] == [f"hi{i}" for i in range(12)]
    assert step1[12:] == ["mid0", "mid1", "lo0", "lo1", "lo2"]
    step2 = pol.order(q, 20.1)  # the pointer moved on: group 4 (8..5 are empty) heads
    assert step2[:2] == ["mid0", "mid1"] and step2[2:5] == ["lo0", "lo1", "lo2"]
    step3 = pol.order(q, 20.2)  # then group 0, then round to 9 again
    assert step3[:3] == ["lo0", "lo1", "lo2"] and step3[3] == "hi0"
    assert pol.order(q, 20.3)[0] == "hi0"
    # a request keeps the group it was first seen in, though its cache has grown since
    grown = queue(*lo[1:], req("lo0", arrival=0.0, cached=99, uncached=1), *mid, *hi)
    assert pol.order(grown, 20.4)[:2] == ["mid0", "mid1"]  # group 4's turn; lo0 stays in 0
    assert pol.order(grown, 20.5)[:3] == ["lo0", "lo1", "lo2"]


def test_preble_caps_a_groups_turn_at_g_plus_one_times_ten() -> None:
    lo = [req(f"lo{i}", arrival=float(i), cached=0, uncached=100) for i in range(12)]  # group 0
    hi = [req("hi", arrival=99.0, cached=950, uncached=50)]
    pol = make_prefill_policy("preble")
    pol.order(queue(*lo, *hi), 100.0)  # group 9's turn
    out = pol.order(queue(*lo, *hi), 100.1)  # group 0's turn: 10 of it, then the others
    assert out[:10] == [f"lo{i}" for i in range(10)]
    assert out[10:] == ["hi", "lo10", "lo11"]


def test_peek_ranks_by_prefill_time_saved() -> None:
    from tests.unit.test_fairway_paper import _profile

    prof = _profile()  # 0.1 s at 1,000 tokens, 1.5 s at 8,000: superlinear
    pol = make_prefill_policy("peek", profile=prof)
    q = queue(
        # the cached head's own prefill time: T(7,000) < T(7,500), whatever the suffix
        req("long_head", arrival=0.0, cached=7000, uncached=1000, prompt=8000),
        req("longer", arrival=1.0, cached=7500, uncached=8500, prompt=16000),
    )
    assert pol.order(q, 2.0) == ["longer", "long_head"]
    # misses with the same short cached head save the same: arrival order, not longest first
    misses = queue(
        req("old_short", arrival=0.0, cached=64, uncached=1500, prompt=1564),
        req("new_long", arrival=1.0, cached=64, uncached=7000, prompt=7064),
    )
    assert pol.order(misses, 2.0) == ["old_short", "new_long"]


def test_fairway_orders_hits_first_when_queue_is_short() -> None:
    out = make_prefill_policy("fairway").order(_mixed(), 4.1)
    assert out[0] == "cheap_hit"
    # old_miss has waited long relative to its patience: the Fair lane places it early.
    assert out.index("old_miss") <= 2


def test_views_are_frozen() -> None:
    r = PrefillRequestView("a", 0.0, 10, 1.0, 0, 10)
    with pytest.raises(AttributeError):
        r.cached_tokens = 5  # type: ignore[misc]
