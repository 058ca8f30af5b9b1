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


def test_preble_rotates_buckets_by_weight() -> None:
    hi = [req(f"hi{i}", arrival=float(i), cached=950, uncached=50) for i in range(12)]  # bucket 9
    lo = [req(f"lo{i}", arrival=float(i), cached=0, uncached=100) for i in range(3)]  # bucket 0
    out = make_prefill_policy("preble").order(queue(*lo, *hi), 20.0)
    # Round 1: bucket 9 takes 10 (weight 10), bucket 0 takes 1; round 2: 2 hi, 1 lo; then 1 lo.
    assert out[:11] == [f"hi{i}" for i in range(10)] + ["lo0"]
    assert out[11:] == ["hi10", "hi11", "lo1", "lo2"]


def test_peek_ranks_by_prefill_time_saved() -> None:
    from tests.unit.test_fairway_paper import _profile

    prof = _profile()  # 0.1 s at 1,000 tokens, 1.5 s at 8,000: superlinear
    pol = make_prefill_policy("peek", profile=prof)
    q = queue(
        # 7,000 cached of 8,000 saves 1.5 - 0.1 = 1.4 s
        req("long_head", arrival=0.0, cached=7000, uncached=1000, prompt=8000),
        # 7,500 cached of 16,000 saves T(16k) - T(8.5k) = 1.5 s
        req("longer", arrival=1.0, cached=7500, uncached=8500, prompt=16000),
    )
    assert pol.order(q, 2.0) == ["longer", "long_head"]


def test_fairway_orders_hits_first_when_queue_is_short() -> None:
    out = make_prefill_policy("fairway").order(_mixed(), 4.1)
    assert out[0] == "cheap_hit"
    # old_miss has waited long relative to its patience: the Fair lane places it early.
    assert out.index("old_miss") <= 2


def test_views_are_frozen() -> None:
    r = PrefillRequestView("a", 0.0, 10, 1.0, 0, 10)
    with pytest.raises(AttributeError):
        r.cached_tokens = 5  # type: ignore[misc]
