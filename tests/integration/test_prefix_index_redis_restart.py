"""A Redis restart loses the index; the feed rebuilds it from its in-memory block sets,
including a block stored while Redis was down."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import zmq.asyncio

from cluster.feed import KVEventFeed, ReplicaFeed
from cluster.index import IndexConfig
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
