"""The ingress's view of the global prefix index: hash a prompt, ask which replica holds it.

:class:`IndexView` is what the ingress calls on the hot path, in two halves so the CPU part can
run off the event loop:

- ``hashes(token_ids, salt)``: the prompt's block hashes (:mod:`cluster.hashing`, vLLM's own
  algorithm, seed and block size from ``AppConfig.hashing``) in each hash mode a live prefill
  replica runs in (``engine``, or ``tokens`` for a replica whose start-up probe found
  misaligned hashes).
- ``match(hashes)``: one bounded index round trip per mode (``cluster.index.match_within``);
  ``None`` when the index gave no answer in time or failed (counted: ``timeouts``, and
  ``errors`` for failures other than a time-out or a connection error; the router
  then routes by load and counts ``index_unavailable``). Never raises.

``sync()`` reconciles the view with the prefill replicas the router knows
(:class:`deployments.router_registry.ReplicaDirectory`), so the index follows replicas as they start,
restart and stop:

- ``memory`` backend: the index lives in this process and a :class:`cluster.feed.KVEventFeed`
  here subscribes to every prefill replica's KV-event publisher (the endpoint it reports); a
  replica that leaves the directory is unsubscribed and dropped from the index at once (the
  feed also drops it the moment its publisher disconnects).
- ``redis`` backend: every prefill replica feeds its own entries; the ingress only reads, and
  drops a replica it saw that Serve no longer lists (idempotent across ingress replicas).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from deployments.config import AppConfig
from deployments.telemetry import metrics

log = logging.getLogger(__name__)


@dataclass
class LookupStats:
    """Counters of the ingress's prefix-index calls (named fallbacks, pattern 8)."""

    lookups: int = 0
    timeouts: int = 0
    errors: int = 0
    blocks_queried: int = 0
    blocks_matched: int = 0
    replicas_followed: int = 0
    replicas_dropped: int = 0
    hash_fallback_replicas: int = 0
    sync_errors: int = 0


@dataclass(frozen=True)
class PrefixMatch:
    """Leading cached tokens each replica holds for one prompt, and the prompt's block count."""

    num_blocks: int
    by_replica: dict[str, int]

    @property
    def best(self) -> int:
        return max(self.by_replica.values(), default=0)


class IndexView:
    """The ingress's index (see the module docstring); ``backend: none`` answers nothing."""

    def __init__(self, cfg: AppConfig, app_name: str) -> None:
        from cluster.hashing import BlockHasher, tokens_hasher

        self.cfg = cfg
        self.backend = cfg.index.backend
        self.app_name = app_name
        self.block_size = cfg.hashing.block_size
        self.stats = LookupStats()
        self.hashers = {
            "engine": BlockHasher(cfg.hashing.hash_config()),
            "tokens": tokens_hasher(self.block_size),
        }
        self.modes: dict[str, str] = {}  # replica -> its hash mode, from its reports
        self._seen: set[str] = set()
        self.index: Any = None
        self.feed: Any = None
        if self.backend == "memory":
            from cluster.feed import KVEventFeed
            from cluster.index import MemoryPrefixIndex

            self.index = MemoryPrefixIndex()
            self.feed = KVEventFeed(self.index, heartbeat_s=cfg.index.heartbeat_s)
        elif self.backend == "redis":
            from cluster.redis_index import RedisPrefixIndex

            self.index = RedisPrefixIndex(
                cfg.index.cluster_config(
                    app_name, socket_timeout_s=max(0.05, cfg.index.lookup_timeout_s * 5)
                )
            )

    # -- the hot path ----------------------------------------------------------------------
    def hashes(self, token_ids: Sequence[int], cache_salt: str | None) -> dict[str, list[int]]:
        """The prompt's block hashes in each mode a live replica uses (CPU only; thread-safe)."""
        if self.index is None:
            return {}
        modes = set(self.modes.values()) or {"engine"}
        return {m: self.hashers[m].prefix_hashes(token_ids, cache_salt) for m in modes}

    async def match(self, hashes: dict[str, list[int]]) -> PrefixMatch | None:
        """Cached tokens per replica (each replica read in its own hash mode), or ``None``."""
        if self.index is None:
            return None
        from cluster.index import match_within

        self.stats.lookups += 1
        n = max((len(h) for h in hashes.values()), default=0)
        self.stats.blocks_queried += n
        found: dict[str, dict[str, int]] = {}
        t0 = time.monotonic()
        for mode, hs in hashes.items():
            try:
                got = await match_within(self.index, hs, self.cfg.index.lookup_timeout_s)
            except Exception:  # advisory: a bug or an odd reply never fails a request
                log.warning("prefix index lookup failed", exc_info=True)
                got = None
                self.stats.errors += 1
            if got is None:
                self.stats.timeouts += 1
                metrics().observe(
                    "pdserve_index_lookup_seconds", time.monotonic() - t0, result="unavailable"
                )
                return None
            found[mode] = got
        answered = "hit" if any(found.values()) else "miss"
        metrics().observe("pdserve_index_lookup_seconds", time.monotonic() - t0, result=answered)
        by_replica: dict[str, int] = {}
        for mode, got in found.items():
            for rid, blocks in got.items():
                if self.modes.get(rid, "engine") == mode:
                    by_replica[rid] = blocks * self.block_size
        m = PrefixMatch(n, by_replica)
        self.stats.blocks_matched += m.best // self.block_size
        return m

    # -- following the replicas ------------------------------------------------------------
    async def sync(self, replicas: dict[str, dict[str, Any]]) -> None:
        """Reconcile with the prefill replicas Serve runs now (``{id: last report}``)."""
        if self.index is None:
            return
        live = {r: s for r, s in replicas.items() if s.get("role", "prefill") == "prefill"}
        # replaced, never mutated: hashes() may read it from a worker thread
        self.modes = {r: str(s.get("hash_mode") or "engine") for r, s in live.items()}
        self.stats.hash_fallback_replicas = sum(1 for m in self.modes.values() if m != "engine")
        try:
            if self.feed is not None:
                await self._sync_feeds(live)
            else:
                for rid in self._seen - set(live):
                    await asyncio.wait_for(self.index.drop_replica(rid), 1.0)
                    self.stats.replicas_dropped += 1
        except Exception:  # the index is advisory: log, count, retry on the next sync
            self.stats.sync_errors += 1
            log.warning("prefix index sync failed", exc_info=True)
            return
        self._seen = set(live)

    async def _sync_feeds(self, live: dict[str, dict[str, Any]]) -> None:
        from cluster.events import tracker_for
        from cluster.hashing import HashMode

        for rid in [r for r in self.feed.replicas if r not in live]:
            await self.feed.remove_replica(rid)
            self.stats.replicas_dropped += 1
        for rid, s in live.items():
            if rid in self.feed.replicas or not s.get("kv_events"):
                continue
            mode = HashMode(self.modes.get(rid, "engine"))
            await self.feed.add_replica(
                rid,
                str(s["kv_events"]),
                replay_endpoint=s.get("kv_replay"),
                tracker=tracker_for(mode, self.block_size),
                topic=str(s.get("kv_topic") or ""),
            )
            self.stats.replicas_followed += 1

    def feed_stats(self) -> dict[str, Any]:
        """Per followed replica: its feed counters (memory backend)."""
        if self.feed is None:
            return {}
        return {r: dict(rf.stats.__dict__) for r, rf in self.feed.replicas.items()}

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            if self.feed is not None:
                await self.feed.close()
            if self.index is not None:
                await self.index.close()
