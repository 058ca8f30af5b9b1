"""The KV-event feed over real ZMQ loopback sockets, against the in-memory index.

The test publisher is an XPUB (so the test can await the feed's subscription instead of
sleeping) framing batches exactly as vLLM's ``ZmqEventPublisher`` does, plus an optional
replay ROUTER answering like vLLM's.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable

import zmq
import zmq.asyncio

from cluster.events import BlockRemoved, BlockStored, KVEventBatch, encode_batch
from cluster.feed import KVEventFeed, ReplicaFeed
from cluster.index import MemoryPrefixIndex

T = 5.0  # generous bound on each awaited state; tests never sleep


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stored(*hashes: int, parent: int | None = None) -> BlockStored:
    return BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=parent,
        token_ids=[0] * (4 * len(hashes)),
        block_size=4,
        medium="GPU",
    )


class Publisher:
    def __init__(self, ctx: zmq.asyncio.Context, port: int, replay_port: int | None) -> None:
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(f"tcp://127.0.0.1:{port}")
        self.router = None
        if replay_port is not None:
            self.router = ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.router.bind(f"tcp://127.0.0.1:{replay_port}")
        self.seq = 0
        self.buffer: list[tuple[int, bytes]] = []

    async def subscribed(self) -> None:
        async with asyncio.timeout(T):
            msg = await self.pub.recv()
        assert msg[:1] == b"\x01"

    async def send(self, *events: object, seq: int | None = None, drop: bool = False) -> int:
        seq = self.seq if seq is None else seq
        self.seq = seq + 1
        payload = encode_batch(KVEventBatch(ts=0.0, events=list(events)))  # type: ignore[arg-type]
        self.buffer.append((seq, payload))
        if not drop:
            await self.pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
        return seq

    async def serve_replay(self) -> None:
        assert self.router is not None
        async with asyncio.timeout(T):
            ident, _, start = await self.router.recv_multipart()
        for seq, buf in self.buffer:
            if seq >= int.from_bytes(start, "big"):
                await self.router.send_multipart([ident, b"", b"", seq.to_bytes(8, "big"), buf])
        await self.router.send_multipart(
            [ident, b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
        )

    def close(self) -> None:
        self.pub.close(linger=0)
        if self.router is not None:
            self.router.close(linger=0)


def run(
    body: Callable[[KVEventFeed, MemoryPrefixIndex, zmq.asyncio.Context], Awaitable[None]],
) -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        ix = MemoryPrefixIndex()
        feed = KVEventFeed(ix, write_batch=64, heartbeat_s=3600, context=ctx)
        try:
            await body(feed, ix, ctx)
        finally:
            await feed.close()
            ctx.destroy(linger=0)

    asyncio.run(main())


def applied(seq: int) -> Callable[[ReplicaFeed], bool]:
    return lambda rf: rf.tracker.next_seq is not None and rf.tracker.next_seq > seq


def test_events_reach_the_index_and_disconnect_drops_the_replica() -> None:
    async def body(feed: KVEventFeed, ix: MemoryPrefixIndex, ctx: zmq.asyncio.Context) -> None:
        port = free_port()
        pub = Publisher(ctx, port, None)
        await feed.add_replica("A", f"tcp://127.0.0.1:{port}")
        await pub.subscribed()
        await feed.wait_for("A", lambda rf: rf.connected and rf.epoch is not None, T)
        await pub.send(stored(1, 2, 3))
        s = await pub.send(BlockRemoved(block_hashes=[3], medium="GPU"), stored(4, parent=2))
        rf = await feed.wait_for("A", applied(s), T)
        assert await ix.match([1, 2, 3]) == {"A": 2}
        assert await ix.match([1, 2, 4]) == {"A": 3}
        assert rf.stats.epochs == 1
        pub.close()  # the engine goes away
        await feed.wait_for("A", lambda rf: not rf.connected, T)
        assert await ix.match([1, 2, 4]) == {}
        assert await ix.live_replicas() == {}
        assert ix.entry_count() == 0  # freed with the drop

    run(body)


def test_gap_without_replay_starts_a_new_epoch() -> None:
    async def body(feed: KVEventFeed, ix: MemoryPrefixIndex, ctx: zmq.asyncio.Context) -> None:
        port = free_port()
        pub = Publisher(ctx, port, None)
        await feed.add_replica("A", f"tcp://127.0.0.1:{port}")
        await pub.subscribed()
        await feed.wait_for("A", lambda rf: rf.epoch is not None, T)
        await pub.send(stored(1, 2))
        await pub.send(stored(9), drop=True)  # lost on the wire
        s = await pub.send(stored(5))
        rf = await feed.wait_for("A", applied(s), T)
        assert rf.tracker.stats.gaps == 1 and rf.stats.epochs == 2
        assert await ix.match([1]) == {}  # what A held before the gap is unknown now
        assert await ix.match([5]) == {"A": 1}

    run(body)


def test_gap_is_filled_from_the_replay_socket() -> None:
    async def body(feed: KVEventFeed, ix: MemoryPrefixIndex, ctx: zmq.asyncio.Context) -> None:
        port, rport = free_port(), free_port()
        pub = Publisher(ctx, port, rport)
        await feed.add_replica(
            "A", f"tcp://127.0.0.1:{port}", replay_endpoint=f"tcp://127.0.0.1:{rport}"
        )
        await pub.subscribed()
        await pub.serve_replay()  # the catch-up replay after connecting (empty buffer)
        await feed.wait_for(
            "A", lambda rf: rf.stats.replays == 1 and not feed.replicas["A"].lock.locked(), T
        )
        await pub.send(stored(1, 2))
        await pub.send(stored(3, parent=2), drop=True)
        s = await pub.send(stored(4, parent=3))
        await pub.serve_replay()
        rf = await feed.wait_for("A", applied(s), T)
        assert rf.stats.replays == 2 and rf.stats.replay_failures == 0
        assert rf.stats.epochs == 1 and rf.tracker.stats.gaps == 0
        assert await ix.match([1, 2, 3, 4]) == {"A": 4}

    run(body)


def test_lost_index_state_is_rebuilt_from_the_tracker() -> None:
    """What a Redis restart looks like to the feed: the replica is suddenly not live."""

    async def body(feed: KVEventFeed, ix: MemoryPrefixIndex, ctx: zmq.asyncio.Context) -> None:
        port = free_port()
        pub = Publisher(ctx, port, None)
        await feed.add_replica("A", f"tcp://127.0.0.1:{port}")
        await pub.subscribed()
        await feed.wait_for("A", lambda rf: rf.epoch is not None, T)
        s = await pub.send(stored(*range(1, 201)))
        await feed.wait_for("A", applied(s), T)
        ix._live.clear()  # the index lost its state
        ix._sets.clear()
        s = await pub.send(stored(201, parent=200))
        rf = await feed.wait_for("A", applied(s), T)
        assert rf.stats.resyncs == 1
        assert await ix.match(list(range(1, 202))) == {"A": 201}
        assert rf.stats.write_round_trips >= 4  # 200 blocks in chunks of 64

    run(body)
