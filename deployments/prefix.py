"""The ingress's view of the prefix index, behind one small interface.

:class:`PrefixLookup` is what the ingress calls on the hot path: ``lookup(token_ids, salt)``
hashes the prompt's full blocks (vLLM's own hashes, via :mod:`cluster.hashing`) and asks the
index how many leading blocks each prefill replica holds. Every failure degrades to "no
information" (``None``) and is counted: a time-out or an error never fails a request.

:class:`ClusterPrefixLookup` is the embedded default: an in-memory index fed by the prefill
engines' KV events (:mod:`cluster.feed`). :class:`NoPrefixLookup` is the ``index.backend: none``
choice.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

log = logging.getLogger(__name__)


@dataclass
class LookupStats:
    """Counters of the ingress's prefix-index calls (named fallbacks, pattern 8)."""

    lookups: int = 0
    timeouts: int = 0
    errors: int = 0
    blocks_queried: int = 0
    blocks_matched: int = 0


@dataclass(frozen=True)
class PrefixMatch:
    """Leading blocks each replica holds for one prompt, and the prompt's block count."""

    num_blocks: int
    by_replica: dict[str, int]

    @property
    def best(self) -> int:
        return max(self.by_replica.values(), default=0)


class PrefixLookup(Protocol):
    """What the ingress needs from the prefix index."""

    stats: LookupStats

    async def start(self) -> None:
        """Connect feeds; called once when the ingress starts (may be a no-op)."""

    async def lookup(self, token_ids: Sequence[int], cache_salt: str | None) -> PrefixMatch | None:
        """The match for this prompt, or ``None`` when the index gave no answer in time."""

    async def close(self) -> None:
        """Release sockets and tasks."""


class NoPrefixLookup:
    """No index: every lookup answers ``None``."""

    def __init__(self) -> None:
        self.stats = LookupStats()

    async def start(self) -> None:
        return None

    async def lookup(self, token_ids: Sequence[int], cache_salt: str | None) -> PrefixMatch | None:
        return None

    async def close(self) -> None:
        return None


class ClusterPrefixLookup:
    """In-memory prefix index fed by the engines' KV events; hashes as vLLM does.

    ``publishers`` maps replica names to the ZMQ endpoints their engines bind (``tcp://*:N``);
    the feed connects to ``tcp://<host>:N``. ``timeout_s`` bounds one ``match`` call.
    """

    def __init__(
        self,
        publishers: dict[str, tuple[str, str | None, str]],
        *,
        host: str = "127.0.0.1",
        block_size: int = 128,
        timeout_s: float = 0.05,
    ) -> None:
        from cluster.hashing import BlockHasher, HashConfig
        from cluster.index import IndexConfig, MemoryPrefixIndex

        self.stats = LookupStats()
        self.hasher = BlockHasher(HashConfig.from_env(block_size=block_size))
        self.index = MemoryPrefixIndex(IndexConfig(backend="memory"))
        self.publishers = publishers
        self.host = host
        self.timeout_s = timeout_s
        self.feed: Any = None

    def _connect_address(self, bind: str) -> str:
        return bind.replace("*", self.host)

    async def start(self) -> None:
        from cluster.events import ReplicaTracker
        from cluster.feed import KVEventFeed

        self.feed = KVEventFeed(self.index)
        for name, (endpoint, replay, topic) in self.publishers.items():
            await self.feed.add_replica(
                name,
                self._connect_address(endpoint),
                replay_endpoint=self._connect_address(replay) if replay else None,
                tracker=ReplicaTracker(mediums=("GPU", "CPU", None)),
                topic=topic,
            )

    async def lookup(self, token_ids: Sequence[int], cache_salt: str | None) -> PrefixMatch | None:
        self.stats.lookups += 1
        try:
            hashes = self.hasher.prefix_hashes(token_ids, cache_salt)
            self.stats.blocks_queried += len(hashes)
            by_replica = await asyncio.wait_for(self.index.match(hashes), self.timeout_s)
        except TimeoutError:
            self.stats.timeouts += 1
            return None
        except Exception:  # the index is advisory: never fail a request on it
            self.stats.errors += 1
            log.exception("prefix index lookup failed")
            return None
        m = PrefixMatch(len(hashes), dict(by_replica))
        self.stats.blocks_matched += m.best
        return m

    async def close(self) -> None:
        if self.feed is not None:
            await self.feed.close()
