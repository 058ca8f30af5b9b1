"""The KV-event feed: subscribes to each engine's vLLM KV-event publisher and keeps the index.

Per replica: a ZMQ SUB socket connected to the engine's ``kv_events_config.endpoint`` (the
engine binds, e.g. ``tcp://*:5557``; the feed connects to ``tcp://<host>:5557``), an optional
DEALER to its ``replay_endpoint``, and a socket monitor. Life cycle:

- publisher connected: ``index.register(replica)`` (a new, clean epoch); with a replay
  endpoint the feed asks for every buffered batch from seq 0, which also covers batches sent
  before the subscription took effect.
- batch: :class:`cluster.events.ReplicaTracker` applies it; a sequence gap is first filled
  from the replay endpoint when there is one, otherwise (or when replay cannot fill it) the
  replica gets a new epoch and the index is rebuilt from the tracker's block set. So are a
  publisher restart (seq back to 0) and ``AllBlocksCleared``.
- writes: everything received before the next await is applied to the tracker first and then
  written as net changes, in chunks of up to ``IndexConfig.write_batch`` blocks per round trip.
  A write answered "not live" (Redis restarted, or the replica was dropped elsewhere) makes the
  feed re-register and re-record the whole block set (``stats.resyncs``).
- publisher disconnected (engine stopped or crashed): ``index.drop_replica`` (O(1)); the socket
  reconnects by itself and a restarted engine starts a new epoch.
- while connected, ``index.heartbeat`` every ``heartbeat_s`` (for ``liveness_ttl_s``); a
  heartbeat answered "not live", or a failed write before it, rebuilds the replica's entries
  without waiting for the next event.

``wait_for(replica, predicate, timeout_s)`` lets tests and start-up code await a state without
sleeping.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from cluster.events import (
    END_SEQ,
    Delta,
    KVEventBatch,
    LeanKVEventBatch,
    ReplicaTracker,
    decode_batch,
    decode_seq,
)
from cluster.index import PrefixIndex

log = logging.getLogger(__name__)


@dataclass
class FeedStats:
    """Counters of one replica's feed (every fallback is counted)."""

    connects: int = 0
    disconnects: int = 0
    epochs: int = 0
    resyncs: int = 0
    replays: int = 0
    replay_failures: int = 0
    discarded: int = 0
    index_errors: int = 0
    ingest_errors: int = 0
    bad_payloads: int = 0
    write_round_trips: int = 0
    written_blocks: int = 0


@dataclass
class ReplicaFeed:
    """State of one subscribed replica (owned by :class:`KVEventFeed`)."""

    replica: str
    endpoint: str
    replay_endpoint: str | None
    tracker: ReplicaTracker
    topic: bytes = b""
    connected: bool = False
    epoch: int | None = None
    stats: FeedStats = field(default_factory=FeedStats)
    sub: Any = None
    monitor: Any = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    dirty: bool = False
    observers: list[Callable[[KVEventBatch | LeanKVEventBatch], None]] = field(default_factory=list)


class KVEventFeed:
    """Feeds a :class:`~cluster.index.PrefixIndex` from the KV events of several engines."""

    def __init__(
        self,
        index: PrefixIndex,
        *,
        write_batch: int = 1024,
        heartbeat_s: float = 1.0,
        replay_timeout_s: float = 2.0,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.index = index
        self.write_batch = write_batch
        self.heartbeat_s = heartbeat_s
        self.replay_timeout_s = replay_timeout_s
        self._ctx = context or zmq.asyncio.Context.instance()
        self.replicas: dict[str, ReplicaFeed] = {}
        self._changed = asyncio.Condition()

    # -- public -------------------------------------------------------------------------------
    async def add_replica(
        self,
        replica: str,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        tracker: ReplicaTracker | None = None,
        topic: str = "",
    ) -> ReplicaFeed:
        """Subscribe to one engine's publisher. ``endpoint`` is a connect address."""
        if replica in self.replicas:
            raise ValueError(f"replica: {replica!r} is already fed")
        rf = ReplicaFeed(
            replica, endpoint, replay_endpoint, tracker or ReplicaTracker(), topic.encode()
        )
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, rf.topic)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        rf.monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sub.connect(endpoint)
        rf.sub = sub
        self.replicas[replica] = rf
        rf.tasks = [
            asyncio.create_task(self._watch(rf), name=f"kv-monitor-{replica}"),
            asyncio.create_task(self._receive(rf), name=f"kv-feed-{replica}"),
            asyncio.create_task(self._beat(rf), name=f"kv-heartbeat-{replica}"),
        ]
        return rf

    async def add_offline_replica(
        self, replica: str, tracker: ReplicaTracker | None = None
    ) -> ReplicaFeed:
        """A replica without sockets, fed only through :meth:`ingest` (benchmarks, replays).
        It is registered at once, as if its publisher had just connected."""
        if replica in self.replicas:
            raise ValueError(f"replica: {replica!r} is already fed")
        rf = ReplicaFeed(replica, "", None, tracker or ReplicaTracker())
        self.replicas[replica] = rf
        async with rf.lock:
            await self._on_connect(rf)
        return rf

    async def remove_replica(self, replica: str) -> None:
        """Stop feeding the replica and drop it from the index."""
        rf = self.replicas.pop(replica)
        await self._stop(rf)
        await self.index.drop_replica(replica)
        await self._notify()

    async def close(self) -> None:
        """Stop every subscription (the index entries stay; the replicas stay live)."""
        for rf in list(self.replicas.values()):
            await self._stop(rf)
        self.replicas.clear()

    async def wait_for(
        self, replica: str, predicate: Callable[[ReplicaFeed], bool], timeout_s: float
    ) -> ReplicaFeed:
        """Wait until ``predicate(feed state)`` holds after an applied change."""
        rf = self.replicas[replica]
        async with asyncio.timeout(timeout_s), self._changed:
            await self._changed.wait_for(lambda: predicate(rf))
        return rf

    # -- tasks --------------------------------------------------------------------------------
    async def _stop(self, rf: ReplicaFeed) -> None:
        if rf.sub is None:
            return
        for t in rf.tasks:
            t.cancel()
        for t in rf.tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        rf.sub.disable_monitor()
        rf.monitor.close(linger=0)
        rf.sub.close(linger=0)

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def _watch(self, rf: ReplicaFeed) -> None:
        while True:
            msg = parse_monitor_message(await rf.monitor.recv_multipart())
            async with rf.lock:
                if msg["event"] == zmq.EVENT_CONNECTED:
                    await self._on_connect(rf)
                elif msg["event"] == zmq.EVENT_DISCONNECTED:
                    await self._on_disconnect(rf)
            await self._notify()

    async def _on_connect(self, rf: ReplicaFeed) -> None:
        rf.stats.connects += 1
        rf.connected = True
        rf.tracker.clear()
        rf.tracker.expect(None)
        await self._guarded(rf, self._rebuild(rf))
        if rf.replay_endpoint is not None:
            delta = await self._replay(rf, None)
            if delta is not None:
                await self._write(rf, delta)
            if rf.tracker.next_seq is None:
                # Nothing published yet: the first batch is seq 0, so a batch lost to the
                # subscription not being in place yet shows as a gap and is replayed.
                rf.tracker.expect(0)

    async def _on_disconnect(self, rf: ReplicaFeed) -> None:
        rf.stats.disconnects += 1
        rf.connected = False
        rf.epoch = None
        rf.tracker.clear()
        rf.tracker.expect(None)
        await self._guarded(rf, self.index.drop_replica(rf.replica))

    async def _beat(self, rf: ReplicaFeed) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)  # a period, not a synchronisation
            if not rf.connected:
                continue
            alive = rf.epoch is not None and await self._guarded(
                rf, self.index.heartbeat(rf.replica)
            )
            if rf.dirty or not alive:  # the index lost us (restart, outage): rebuild now
                async with rf.lock:
                    rf.stats.resyncs += 1
                    await self._guarded(rf, self._rebuild(rf))
                await self._notify()

    async def _guarded(self, rf: ReplicaFeed, op: Any) -> Any:
        """Await an index call; an outage is logged and counted, never kills the feed."""
        try:
            return await op
        except Exception:
            rf.stats.index_errors += 1
            log.warning("index call for %s failed", rf.replica, exc_info=True)
            return None

    async def _receive(self, rf: ReplicaFeed) -> None:
        while True:
            frames = [await rf.sub.recv_multipart()]
            while len(frames) < 4096:  # drain what is already queued: one batched write
                try:
                    frames.append(await rf.sub.recv_multipart(flags=zmq.NOBLOCK))
                except zmq.Again:
                    break
            try:
                await self.ingest(rf, frames)
            except Exception:  # a bug on one burst must not stop the replica's feed
                rf.stats.ingest_errors += 1
                log.exception("KV-event burst from %s failed; starting a new epoch", rf.replica)
                async with rf.lock:
                    rf.tracker.clear()
                    rf.tracker.expect(None)
                    await self._guarded(rf, self._rebuild(rf))

    async def ingest(self, rf: ReplicaFeed, frames: list[list[bytes]]) -> Delta:
        """Apply frames ``(topic, seq, payload)`` in order, then write their net effect.

        What the receive loop does with each drained burst; public for replays of recorded
        events and for ``pdserve bench index``."""
        delta = Delta()
        async with rf.lock:
            if not rf.connected:  # only data between connect and disconnect counts
                rf.stats.discarded += len(frames)
                return delta
            for frame in frames:
                d = await self._apply_frame(rf, frame)
                if d is not None:
                    delta.merge(d)
            await self._write(rf, delta)
        await self._notify()
        return delta

    async def _apply_frame(self, rf: ReplicaFeed, frame: list[bytes]) -> Delta | None:
        if len(frame) != 3:
            rf.stats.bad_payloads += 1
            return None
        seq = decode_seq(frame[1])
        try:
            batch = decode_batch(frame[2], lean=rf.tracker.lean)
        except Exception:
            rf.stats.bad_payloads += 1
            log.warning("undecodable KV-event payload from %s (seq %d)", rf.replica, seq)
            return None
        for observe in rf.observers:
            observe(batch)
        if rf.tracker.check_seq(seq) == "gap" and rf.replay_endpoint is not None:
            replayed = await self._replay(rf, rf.tracker.next_seq)
            if replayed is not None:
                replayed.merge(rf.tracker.apply(seq, batch))
                return replayed
        return rf.tracker.apply(seq, batch)

    async def _replay(self, rf: ReplicaFeed, start: int | None) -> Delta | None:
        """Apply the publisher's buffered batches from ``start`` (None: all of them, after a
        connect). ``None`` when a gap cannot be filled: the buffer no longer reaches back to
        ``start``, or the replay failed or timed out; the tracker then starts a new epoch."""
        assert rf.replay_endpoint is not None
        rf.stats.replays += 1
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        delta = Delta()
        try:
            dealer.connect(rf.replay_endpoint)
            await dealer.send_multipart([b"", (start or 0).to_bytes(8, "big")])
            async with asyncio.timeout(self.replay_timeout_s):
                while True:
                    frame = await dealer.recv_multipart()
                    if len(frame) != 4 or decode_seq(frame[2]) == END_SEQ:
                        return delta
                    seq = decode_seq(frame[2])
                    # a gap fill must start exactly at ``start``; later frames are in order
                    delta.merge(
                        rf.tracker.apply(
                            seq, decode_batch(frame[3], lean=rf.tracker.lean), allow_gap=False
                        )
                    )
        except Exception:
            rf.stats.replay_failures += 1
            log.warning("replay from %s (seq %s) failed", rf.replica, start, exc_info=True)
            return None if start is not None else delta
        finally:
            dealer.close(linger=0)

    # -- index writes -------------------------------------------------------------------------
    async def _new_epoch(self, rf: ReplicaFeed) -> None:
        rf.epoch = await self.index.register(rf.replica)
        rf.stats.epochs += 1

    async def _write(self, rf: ReplicaFeed, delta: Delta) -> None:
        """Write a delta; rebuild the replica's entries under a new epoch when the delta says
        so, when the index lost the replica (answers "not live") or after a failed write."""
        if not rf.connected:
            return
        try:
            if delta.reset or rf.epoch is None or rf.dirty:
                await self._rebuild(rf)
                return
            add = [h for h, present in delta.touched.items() if present]
            rem = [h for h, present in delta.touched.items() if not present]
            ok = await self._chunks(self.index.evict, rf, rem)
            if not (ok and await self._chunks(self.index.record, rf, add)):
                rf.stats.resyncs += 1
                await self._rebuild(rf)
        except Exception:
            # The tracker keeps the truth; the next write rebuilds the index from it.
            rf.dirty = True
            rf.stats.index_errors += 1
            log.warning("index write for %s failed; will rebuild", rf.replica, exc_info=True)

    async def _rebuild(self, rf: ReplicaFeed) -> None:
        rf.dirty = True
        await self._new_epoch(rf)
        await self._chunks(self.index.record, rf, rf.tracker.held())
        rf.dirty = False

    async def _chunks(self, op: Any, rf: ReplicaFeed, hashes: list[int]) -> bool:
        for i in range(0, len(hashes), self.write_batch):
            part = hashes[i : i + self.write_batch]
            rf.stats.write_round_trips += 1
            rf.stats.written_blocks += len(part)
            if not await op(rf.replica, part):
                return False
        return True


def kv_events_config(port: int, replay_port: int | None = None, topic: str = "") -> dict[str, Any]:
    """The engine side: vLLM ``kv_events_config`` that binds where the feed connects.

    vLLM binds only when the endpoint contains ``*`` (see PLATFORM notes)."""
    cfg: dict[str, Any] = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{port}",
        "topic": topic,
    }
    if replay_port is not None:
        cfg["replay_endpoint"] = f"tcp://*:{replay_port}"
    return cfg


__all__ = ["FeedStats", "KVEventBatch", "KVEventFeed", "ReplicaFeed", "kv_events_config"]
