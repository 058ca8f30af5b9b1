"""A Redis restart loses the index; the feed rebuilds it from its in-memory block sets,
including a block stored while Redis was down. Lookups survive what a connection meets: a
killed connection, a flushed script cache, callers that give up, a password and a database
number."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import zmq.asyncio

from cluster.feed import KVEventFeed, ReplicaFeed
from cluster.index import IndexConfig, match_within
from cluster.redis_index import RedisPrefixIndex
from cluster.redis_server import RedisNotFound, start_redis, stop_redis
from tests.unit.test_cluster_feed import Publisher, T, applied, free_port, stored

pytestmark = pytest.mark.integration


def test_feed_rebuilds_redis_after_a_restart(tmp_path: Path) -> None:
    try:
        proc, port = start_redis(tmp_path)
    except RedisNotFound as e:
        pytest.skip(str(e))

    async def main() -> None:
        nonlocal proc
        ctx = zmq.asyncio.Context()
        cfg = IndexConfig(backend="redis", redis_url=f"redis://127.0.0.1:{port}/0", app="rs")
        ix = RedisPrefixIndex(cfg)
        # heartbeats find a lost index without waiting for the next event
        feed = KVEventFeed(ix, write_batch=64, heartbeat_s=0.05, context=ctx)
        try:
            pport = free_port()
            pub = Publisher(ctx, pport, None)
            await feed.add_replica("A", f"tcp://127.0.0.1:{pport}")
            await pub.subscribed()
            await feed.wait_for("A", lambda rf: rf.epoch is not None, T)
            s = await pub.send(stored(*range(1, 101)))
            await feed.wait_for("A", applied(s), T)
            assert await ix.match(list(range(1, 101))) == {"A": 100}

            stop_redis(proc)  # Redis goes away with everything in it ...
            s = await pub.send(stored(101, parent=100))  # ... a write fails meanwhile
            rf: ReplicaFeed = await feed.wait_for("A", applied(s), T)
            assert rf.dirty and rf.stats.index_errors >= 1
            proc, _ = start_redis(tmp_path, port=port)  # ... and comes back empty
            rf = await feed.wait_for("A", lambda rf: not rf.dirty, T)  # rebuilt, no new event
            assert await ix.match(list(range(1, 103))) == {"A": 101}
            s = await pub.send(stored(102, parent=101))
            await feed.wait_for("A", applied(s), T)
            assert await ix.match(list(range(1, 103))) == {"A": 102}
        finally:
            await feed.close()
            await ix.close()
            ctx.destroy(linger=0)

    try:
        asyncio.run(main())
    finally:
        stop_redis(proc)


H = [0x1111, 0x2222, 0x3333, 0x4444, (1 << 64) - 1]


def test_lookups_survive_kills_flushes_and_callers_giving_up(tmp_path: Path) -> None:
    try:
        proc, port = start_redis(tmp_path)
    except RedisNotFound as e:
        pytest.skip(str(e))

    async def main() -> None:
        cfg = IndexConfig(backend="redis", redis_url=f"redis://127.0.0.1:{port}/0", app="ch")
        ix = RedisPrefixIndex(cfg)
        try:
            await ix.register("a")
            assert await ix.record("a", H)
            assert await ix.match(H) == {"a": 5}
            # A caller that gives up leaves its reply behind; the next caller must not get it.
            await ix._r.execute_command("CLIENT", "PAUSE", 300, "ALL")
            assert await match_within(ix, H, 0.02) is None
            assert await ix.match(H[:2]) == {"a": 2}  # answered once the pause is over
            # Concurrent callers each get their own answer.
            got = await asyncio.gather(*(ix.match(H[:n]) for n in range(1, 6)))
            assert got == [{"a": n} for n in range(1, 6)]
            # A flushed script cache (or a restarted Redis) answers NOSCRIPT: EVAL, then cached.
            await ix._r.script_flush()
            assert await ix.match(H) == {"a": 5}
            assert await ix.match(H[:3]) == {"a": 3}
            # A killed connection fails at most the call in flight; the next one reconnects.
            await ix._r.client_kill_filter(_type="normal", skipme=True)
            first = await match_within(ix, H, 1.0)
            assert first in (None, {"a": 5})
            assert await ix.match(H) == {"a": 5}
        finally:
            await ix.close()

    try:
        asyncio.run(main())
    finally:
        stop_redis(proc)


def test_lookups_authenticate_and_select_the_database(tmp_path: Path) -> None:
    import redis

    try:
        proc, port = start_redis(tmp_path)
    except RedisNotFound as e:
        pytest.skip(str(e))
    admin = redis.Redis(port=port)
    admin.config_set("requirepass", "s3cret")
    admin.close()

    async def main() -> None:
        cfg = IndexConfig(backend="redis", redis_url=f"redis://:s3cret@127.0.0.1:{port}/2", app="a")
        ix = RedisPrefixIndex(cfg)
        bad = RedisPrefixIndex(
            cfg.model_copy(update={"redis_url": cfg.redis_url.replace("s3", "x")})
        )
        try:
            await ix.register("a")
            assert await ix.record("a", H)
            assert await ix.match(H) == {"a": 5}  # lookups read db 2, where the writes went
            db2 = redis.Redis(port=port, password="s3cret", db=2)
            assert db2.exists(cfg.namespace + "blocks")
            db2.close()
            assert await match_within(bad, H, 1.0) is None  # refused: degrades, no answer
        finally:
            await ix.close()
            await bad.close()

    try:
        asyncio.run(main())
    finally:
        stop_redis(proc)
