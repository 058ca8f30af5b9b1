"""A prefill replica's side of the prefix index: its KV events, the hash probe, the Redis feed.

In a request's path the index is read before routing: the ingress asks it which prefill
replica already holds a prompt's blocks (:mod:`deployments.prefix`). It is written from the
prefill engines' KV events (vLLM's ``kv_events``: blocks stored and evicted), which each
engine publishes at the endpoints :meth:`IndexWriter.endpoints` reports, by one writer for
both backends, :class:`cluster.feed.KVEventFeed`; the backends differ only in where it runs:

- ``redis``: here, one writer per replica (:attr:`IndexWriter.feed`) into the app's shared
  index; the replica's entries go when it shuts down (:meth:`IndexWriter.drop`).
- ``memory``: in the ingress, whose index lives in its own process
  (:class:`deployments.prefix.IndexView` follows every prefill replica's endpoints); here a
  feed runs only for the start-up probe, against a scratch index, and is then closed.

At start, with either backend, the writer checks that the engine hashes blocks as the
ingress does (:func:`cluster.probe.probe_hash_mode`): a mismatch refuses the replica or
switches it to token re-hashing (``hashing.on_mismatch``). The mode goes into the replica's
load report (``hash_mode``), so the ingress hashes its prompts alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from deployments.config import AppConfig
from deployments.telemetry import CounterPublisher

#: sends one request with these prompt token ids and cache salt through the engine
ProbeSend = Callable[[list[int], str | None], Awaitable[None]]


class IndexWriter:
    """One replica's KV-event endpoints and index feed (see the module docstring)."""

    def __init__(self, cfg: AppConfig, app_name: str, replica_id: str, kv_launch: Any) -> None:
        self.cfg = cfg
        self.app_name = app_name
        self.replica_id = replica_id
        #: where this replica publishes its KV events (made once: its ipc folder, its ports)
        self._kv_launch = kv_launch
        #: how the engine's block hashes are read: ``engine`` (aligned) or ``tokens``
        self.hash_mode = "engine"
        #: the Redis backend's feed of this replica's own events; ``None`` otherwise
        self.feed: Any = None

    def _index(self) -> Any:
        """Redis: the app's shared index; memory: a scratch one only the start-up probe reads."""
        from cluster.index import make_index

        return make_index(self.cfg.index.cluster_config(self.app_name, role="prefill"))

    async def start(self, send: ProbeSend, vocab: int) -> None:
        """Probe this engine's block hashes against ours (``send`` runs one probe request
        through the engine; ``vocab`` is its vocabulary size); with Redis, keep feeding them."""
        from cluster.feed import KVEventFeed
        from cluster.hashing import BlockHasher, HashAlignmentError, HashMode
        from cluster.probe import probe_hash_mode

        hasher = BlockHasher(self.cfg.hashing.hash_config())
        feed = KVEventFeed(self._index(), heartbeat_s=self.cfg.index.heartbeat_s)
        await self._follow(feed, HashMode.ENGINE)
        await feed.wait_for(self.replica_id, lambda rf: rf.connected, 30.0)
        try:
            mode = await probe_hash_mode(
                feed,
                self.replica_id,
                send,
                hasher,
                vocab=vocab,
                allow_fallback=self.cfg.hashing.on_mismatch == "tokens",
            )
        except HashAlignmentError as e:
            await feed.close()
            raise RuntimeError(f"hashing.on_mismatch=refuse: {e}") from e
        self.hash_mode = mode.value
        if self.cfg.index.backend != "redis":
            await feed.close()  # the ingress follows this replica's events itself
            return
        if mode is not HashMode.ENGINE:
            await feed.remove_replica(self.replica_id)
            await self._follow(feed, mode)
        self.feed = feed

    async def _follow(self, feed: Any, mode: Any) -> None:
        from cluster.events import tracker_for

        pub, replay = self.endpoints("127.0.0.1")
        assert pub is not None
        await feed.add_replica(
            self.replica_id,
            pub,
            replay_endpoint=replay,
            tracker=tracker_for(mode, self.cfg.hashing.block_size),
            topic=self.cfg.prefill.kv_events.topic,
        )

    def endpoints(self, host: str) -> tuple[str | None, str | None]:
        """Where a feed connects to this replica's KV events (``host``: its node's address,
        for the TCP transport); ``(None, None)`` when it publishes none."""
        launch = self._kv_launch
        return launch.endpoints(host) if launch is not None else (None, None)

    # -- what the replica reports ------------------------------------------------------------
    def publish(self, events: CounterPublisher) -> None:
        """The Redis feed's counters as metrics (``pdserve_index_feed_events``)."""
        if self.feed is not None:
            for rid, rf in list(self.feed.replicas.items()):
                events.publish(rf.stats, replica=rid)
                events.publish(rf.tracker.stats, replica=rid)

    def tracked_blocks(self) -> int | None:
        """The blocks this replica's feed holds for the Redis index (bounded by the KV cache:
        a load test checks it stays so); ``None`` without a feed."""
        if self.feed is None:
            return None
        return sum(len(rf.tracker.blocks) for rf in list(self.feed.replicas.values()))

    def feed_stats(self) -> dict[str, Any] | None:
        """This replica's feed counters (Redis backend), or ``None``."""
        if self.feed is None:
            return None
        rf = self.feed.replicas.get(self.replica_id)
        return None if rf is None else dict(rf.stats.__dict__)

    # -- shutdown ----------------------------------------------------------------------------
    def drop(self) -> None:
        """Remove this replica's entries from the Redis index now (on its own loop and
        connection: the replica's loop may be gone), bounded to 2 s; then no feed."""
        if self.feed is None:
            return

        def run() -> None:
            async def drop() -> None:
                idx = self._index()
                try:
                    await asyncio.wait_for(idx.drop_replica(self.replica_id), 2.0)
                finally:
                    await idx.close()

            with contextlib.suppress(Exception):
                asyncio.run(drop())

        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(3.0)
        self.feed = None
