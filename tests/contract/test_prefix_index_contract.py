"""One contract suite over both prefix-index backends (in-memory and a real redis-server)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster.index import IndexConfig, MemoryPrefixIndex, PrefixIndex, make_index


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


Factory = Callable[..., PrefixIndex]


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.integration)])
def factory(request: pytest.FixtureRequest) -> Factory:
    """Builds an index of the parametrised backend in a fresh namespace; call it in the loop."""
    backend = request.param
    url = request.getfixturevalue("redis_url") if backend == "redis" else "redis://unused"

    def make(clock: FakeClock | None = None, **kw: Any) -> PrefixIndex:
        cfg = IndexConfig(backend=backend, redis_url=url, app="t" + uuid.uuid4().hex[:10], **kw)
        return make_index(cfg, clock=clock or FakeClock())

    return make


def run(factory: Factory, body: Callable[[PrefixIndex], Awaitable[None]], **kw: Any) -> None:
    async def main() -> None:
        ix = factory(**kw)
        try:
            await body(ix)
        finally:
            await ix.close()

    asyncio.run(main())


H = [0x1111, 0x2222, 0x3333, 0x4444, (1 << 64) - 1]


def test_is_a_prefix_index(factory: Factory) -> None:
    async def body(ix: PrefixIndex) -> None:
        assert isinstance(ix, PrefixIndex)

    run(factory, body)


def test_match_counts_leading_blocks_and_stops_at_gaps(factory: Factory) -> None:
    async def body(ix: PrefixIndex) -> None:
        for r in "abc":
            await ix.register(r)
        assert await ix.record("a", H[:3])
        assert await ix.record("b", [H[0], H[2], H[3]])  # gap at H[1]
        assert await ix.record("c", H[1:])  # lacks the first block
        assert await ix.match(H) == {"a": 3, "b": 1}
        assert await ix.match(H[:1]) == {"a": 1, "b": 1}
        assert await ix.match(H[1:]) == {"a": 2, "c": 4}
        assert await ix.match([]) == {}
        assert await ix.match([0x9999, *H]) == {}

    run(factory, body)


def test_full_match_and_idempotent_writes(factory: Factory) -> None:
    async def body(ix: PrefixIndex) -> None:
        await ix.register("a")
        assert await ix.record("a", H)
        assert await ix.record("a", H)
        assert await ix.match(H) == {"a": len(H)}
        assert await ix.evict("a", [H[2]])
        assert await ix.evict("a", [H[2], 0x7777])
        assert await ix.match(H) == {"a": 2}

    run(factory, body)


def test_drop_hides_entries_and_blocks_late_writes(factory: Factory) -> None:
    async def body(ix: PrefixIndex) -> None:
        await ix.register("a")
        await ix.register("b")
        await ix.record("a", H)
        await ix.record("b", H[:2])
        await ix.drop_replica("a")
        assert await ix.match(H) == {"b": 2}
        assert await ix.live_replicas() == {"b": 1}
        assert not await ix.record("a", H)
        assert not await ix.evict("a", H)
        assert not await ix.heartbeat("a")
        await ix.drop_replica("never-registered")

    run(factory, body)


def test_new_epoch_starts_clean_and_old_entries_are_freed(factory: Factory) -> None:
    async def body(ix: PrefixIndex) -> None:
        e1 = await ix.register("a")
        await ix.record("a", H)
        await ix.drop_replica("a")
        e2 = await ix.register("a")  # restarted replica
        assert e2 > e1
        assert await ix.match(H) == {}
        await ix.record("a", H[:1])
        assert await ix.match(H) == {"a": 1}
        e3 = await ix.register("a")  # e.g. a gap in the event stream
        assert e3 > e2
        assert await ix.match(H) == {}
        await ix.record("a", H[1:3])
        assert await ix.match(H[1:]) == {"a": 2}
        assert await entries(ix) == 2  # nothing left of the epochs before
        await ix.drop_replica("a")
        assert await entries(ix) == 0

    run(factory, body)


async def entries(ix: PrefixIndex) -> int:
    """Stored entries of live epochs, after checking that nothing of a dead epoch is left
    (memory: freed at once; Redis: once the sweep has run to the end)."""
    if isinstance(ix, MemoryPrefixIndex):
        return ix.entry_count()
    from cluster.redis_index import RedisPrefixIndex

    assert isinstance(ix, RedisPrefixIndex)
    await sweep_all(ix)
    n = await ix.entry_count()
    assert await ix.stored_entries() == n  # no bit of a dead epoch is left
    return n


async def sweep_all(ix: Any, limit: int = 100) -> None:
    """Runs the Redis backend's sweep until no retired slot is left (bounded)."""
    for _ in range(limit):
        if await ix.sweep(count=16):
            return
    raise AssertionError("the sweep did not finish")


async def sweep(ix: PrefixIndex, count: int) -> None:
    """One step of the Redis backend's sweep (the memory backend frees at once)."""
    step = getattr(ix, "sweep", None)
    if step is not None:
        await step(count=count)


def test_reused_slots_never_show_entries_of_dead_epochs(factory: Factory) -> None:
    # Enough replicas for bitmaps of several bytes (slots >= 8), all dropped or re-registered,
    # their entries swept, and their slots handed to new epochs: nothing old may show.
    names = [f"r{i}" for i in range(12)]
    blocks = list(range(100, 160))

    async def body(ix: PrefixIndex) -> None:
        for i, r in enumerate(names):
            await ix.register(r)
            assert await ix.record(r, blocks[: 10 + 4 * i])
        assert await ix.match(blocks) == {r: 10 + 4 * i for i, r in enumerate(names)}
        for r in names[::2]:
            await ix.drop_replica(r)
        for r in names[1::2]:
            await ix.register(r)  # a new epoch of a live replica
        assert await ix.match(blocks) == {}
        assert await entries(ix) == 0  # swept (Redis): the old slots are free again
        fresh = [f"s{i}" for i in range(12)]
        for r in fresh:
            await ix.register(r)  # takes the freed slots
        for r in names[::2]:
            assert await ix.register(r) == 2  # dropped at epoch 1
        for b in blocks:
            assert await ix.match([b]) == {}
        assert await ix.record("s7", blocks[:3])
        assert await ix.record("r1", blocks[:1])
        assert await ix.match(blocks) == {"s7": 3, "r1": 1}
        assert await entries(ix) == 4

    run(factory, body)


def test_memory_of_a_dropped_replica_is_freed_by_later_traffic(factory: Factory) -> None:
    blocks = list(range(1, 1001))  # more than a listpack holds (512): swept in steps

    async def body(ix: PrefixIndex) -> None:
        await ix.register("a")
        await ix.register("b")
        assert await ix.record("a", blocks)
        assert await ix.record("b", blocks[:10])
        await ix.drop_replica("a")
        assert await ix.match(blocks) == {"b": 10}
        # no explicit sweep: writes and heartbeats of other replicas carry it
        for i in range(10):
            assert await ix.record("b", [blocks[i]])
            assert await ix.heartbeat("b")
        if hasattr(ix, "stored_entries"):
            assert await ix.stored_entries() == 10
        assert await entries(ix) == 10

    run(factory, body)


@pytest.mark.integration
def test_a_slot_retired_mid_sweep_waits_for_the_next_pass(redis_url: str) -> None:
    """Redis only: a pass that began before a slot was retired may have passed some of its
    blocks already, so that slot must stay retired until a whole later pass has run."""
    from cluster.redis_index import RedisPrefixIndex

    blocks = list(range(1, 1001))  # more than a listpack holds (512): a hash table

    async def main() -> None:
        cfg = IndexConfig(backend="redis", redis_url=redis_url, app="t" + uuid.uuid4().hex[:10])
        ix = RedisPrefixIndex(cfg, clock=FakeClock())
        meta = cfg.namespace + "meta"
        try:
            await ix.register("x")  # slot 0
            await ix.register("a")  # slot 1
            assert await ix.record("a", blocks)
            await ix.drop_replica("x")  # retired before the pass: freed at its end
            assert not await ix.sweep(count=4)  # the pass has begun
            assert await ix._r.hget(meta, "cursor") != b"0"
            await ix.drop_replica("a")  # retired mid-pass: some of its bits were passed
            while await ix._r.hget(meta, "pass") in (None, b"0"):
                assert not await ix.sweep(count=4)  # "a" is left
            assert await ix.stored_entries() > 0  # bits of "a" the pass had already passed
            await ix.register("c")  # gets slot 0
            await ix.register("d")  # must not get slot 1 yet
            for b in blocks:
                assert await ix.match([b]) == {}
            await sweep_all(ix, limit=1000)
            assert await ix.stored_entries() == 0
        finally:
            await ix.clear_namespace()
            await ix.close()

    asyncio.run(main())


def test_liveness_ttl_hides_silent_replicas(factory: Factory) -> None:
    clock = FakeClock()

    async def body(ix: PrefixIndex) -> None:
        await ix.register("a")
        await ix.register("b")
        await ix.record("a", H)
        await ix.record("b", H)
        clock.t += 6.0
        assert await ix.heartbeat("b")
        clock.t += 6.0  # a: 12 s silent, b: 6 s
        assert await ix.match(H) == {"b": len(H)}
        assert await ix.live_replicas() == {"b": 1}
        assert await ix.heartbeat("a")
        assert await ix.match(H) == {"a": len(H), "b": len(H)}

    run(factory, body, clock=clock, liveness_ttl_s=10.0)


def test_namespaces_do_not_collide(factory: Factory) -> None:
    async def body(ix: PrefixIndex) -> None:
        other = factory()
        try:
            await ix.register("a")
            await ix.record("a", H)
            assert await other.match(H) == {}
            await other.register("a")
            assert await other.match(H) == {}
        finally:
            await other.close()

    run(factory, body)


def test_large_batches_are_written(factory: Factory) -> None:
    many = list(range(1, 3000))

    async def body(ix: PrefixIndex) -> None:
        await ix.register("a")
        assert await ix.record("a", many)
        assert await ix.match(many) == {"a": len(many)}
        assert await ix.evict("a", many[1000:])
        assert await ix.match(many) == {"a": 1000}
        # A prompt longer than one Lua unpack (~8,000 values) still matches in full, and
        # a gap beyond the first slice is found.
        long = list(range(10_001, 20_001))
        assert await ix.record("a", long)
        assert await ix.match(long) == {"a": 10_000}
        assert await ix.evict("a", [long[9_000]])
        assert await ix.match(long) == {"a": 9_000}

    run(factory, body, write_batch=256)


def test_bad_namespace_names_the_field() -> None:
    with pytest.raises(ValueError, match="deployment"):
        IndexConfig(deployment="a:b}")
    with pytest.raises(ValueError, match="write_batch"):
        IndexConfig(write_batch=8)


# A reference model: ops on a few replicas and blocks, then match() on several prompts.
# Ten replica names: with drops and re-registrations, Redis slots pass 8 (multi-byte bitmaps)
# and are reused after a sweep ("sweep" is a no-op for the memory backend).
OPS = st.lists(
    st.tuples(
        st.sampled_from(["register", "record", "evict", "drop", "sweep"]),
        st.sampled_from(list("abcdefghij")),
        st.lists(st.integers(0, 5), max_size=4),
    ),
    max_size=40,
)


def _reference(ops: list[tuple[str, str, list[int]]], prompt: list[int]) -> dict[str, int]:
    held: dict[str, set[int]] = {}
    for op, r, hs in ops:
        if op == "register":
            held[r] = set()
        elif op == "drop":
            held.pop(r, None)
        elif op == "sweep":
            pass
        elif r in held:
            (held[r].update if op == "record" else held[r].difference_update)(hs)
    out = {}
    for r, s in held.items():
        n = 0
        while n < len(prompt) and prompt[n] in s:
            n += 1
        if n:
            out[r] = n
    return out


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=OPS)
def test_matches_reference_model(factory: Factory, ops: list[tuple[str, str, list[int]]]) -> None:
    prompts = [[0, 1, 2, 3], [1, 2], [5, 4, 3, 2, 1, 0]]

    async def body(ix: PrefixIndex) -> None:
        for op, r, hs in ops:
            coro: Coroutine[Any, Any, Any]
            if op == "register":
                coro = ix.register(r)
            elif op == "record":
                coro = ix.record(r, hs)
            elif op == "evict":
                coro = ix.evict(r, hs)
            elif op == "sweep":
                coro = sweep(ix, count=2)
            else:
                coro = ix.drop_replica(r)
            await coro
        for p in prompts:
            assert await ix.match(p) == _reference(ops, p)

    run(factory, body)


def test_match_within_returns_none_on_timeout_and_index_errors() -> None:
    from cluster.index import match_within

    class Stuck(MemoryPrefixIndex):
        async def match(self, hashes: Sequence[int]) -> dict[str, int]:
            await asyncio.Event().wait()  # never answers
            return {}

    class Down(MemoryPrefixIndex):
        async def match(self, hashes: Sequence[int]) -> dict[str, int]:
            raise ConnectionError("index down")

    async def main() -> None:
        ok = MemoryPrefixIndex()
        await ok.register("a")
        await ok.record("a", H)
        assert await match_within(ok, H, 1.0) == {"a": len(H)}
        assert await match_within(Stuck(), H, 0.01) is None
        assert await match_within(Down(), H, 1.0) is None

    asyncio.run(main())
