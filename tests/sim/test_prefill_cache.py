"""BlockCache: LRU order, pinning, protection, duplicates, the leading-hit rule."""

from __future__ import annotations

import pytest

from bench.sim.prefill import BlockCache


def test_hits_count_only_the_leading_run() -> None:
    c = BlockCache(10)
    c.warm([1, 2, 4])
    assert c.hit_blocks([1, 2, 3, 4], 10) == 2
    assert c.hit_blocks([1, 2, 3, 4], 1) == 1
    assert c.hit_blocks([9, 1], 10) == 0


def test_release_puts_the_tail_before_the_head_in_lru_order() -> None:
    c = BlockCache(4)
    c.reserve(4)
    for h in (10, 11, 12, 13):
        assert c.register(h)
    c.release([10, 11, 12, 13], 0)
    c.reserve(2)  # needs two evictions: the tail goes first
    assert 13 not in c and 12 not in c
    assert 10 in c and 11 in c
    assert c.evictions == 2


def test_pinned_blocks_are_never_evicted() -> None:
    c = BlockCache(4)
    c.warm([1, 2, 3, 4])
    c.acquire([1, 2, 3])
    assert c.can_reserve([], 1)
    assert not c.can_reserve([], 2)
    c.reserve(1)
    assert 4 not in c and all(h in c for h in (1, 2, 3))
    with pytest.raises(RuntimeError):
        c.reserve(1)


def test_can_reserve_counts_the_hits_it_will_pin() -> None:
    c = BlockCache(4)
    c.warm([1, 2, 3, 4])
    # pinning 1 and 2 leaves only 3 and 4 evictable
    assert c.can_reserve([1, 2], 2)
    assert not c.can_reserve([1, 2], 3)


def test_protected_blocks_go_only_when_nothing_else_can() -> None:
    c = BlockCache(6)
    c.warm([1, 2, 3, 4, 5, 6])  # 1 is least recently used
    c.protected = frozenset({1, 2})
    c.reserve(3)
    assert 1 in c and 2 in c
    assert 3 not in c and 4 not in c and 5 not in c
    c.reserve(2)  # only 6 is unprotected: then the protected LRU block
    assert 6 not in c and 1 not in c and 2 in c


def test_duplicate_computation_stays_private_and_is_freed() -> None:
    c = BlockCache(4)
    c.reserve(2)
    assert c.register(7)
    assert not c.register(7)  # a second request computed the same block
    assert c.used == 2
    c.release([7], 1)
    assert c.used == 1 and c.evictable == 1 and 7 in c


def test_bad_capacity_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="capacity_blocks"):
        BlockCache(0)
