"""Cached prefix per waiting request, read from vLLM's KV cache manager without side effects.

vLLM's own admission path calls ``kv_cache_manager.get_computed_blocks`` and then
``record_prefix_cache_stats``; we call only the coordinator's ``find_longest_cache_hit``
(dictionary look-ups over ``request.block_hashes``): no reference is taken, no block is
touched, no prefix-cache statistic or KV event is recorded.

A look-up is repeated only when it can have changed: for a request seen for the first time
(or whose block hashes grew, e.g. after preemption), or when the block pool inserted or
evicted a block whose hash is among the request's hashes since the last step. To know that,
the pool's ``cached_block_hash_to_block`` map is given a subclass that records the hashes it
inserts or pops (same behaviour otherwise); a map replaced by ``reset_prefix_cache`` is
detected by identity and everything is recomputed.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from vllm.v1.core.block_pool import BlockHashToBlockMap
from vllm.v1.core.kv_cache_utils import get_block_hash


class RecordingBlockHashMap(BlockHashToBlockMap):
    """``BlockHashToBlockMap`` that remembers which block hashes changed (insert or pop)."""

    changed: set[bytes]
    pops: int = 0  # cached blocks removed (eviction or reset)

    def insert(self, key: Any, block: Any) -> None:
        super().insert(key, block)
        self.changed.add(get_block_hash(key))

    def pop(self, key: Any, block_id: int) -> Any:
        out = super().pop(key, block_id)
        if out is not None:
            self.changed.add(get_block_hash(key))
            self.pops += 1
        return out


class PrefixProbe:
    """Keeps ``cached_tokens[request_id]`` for the waiting requests, refreshed per step."""

    def __init__(self, kv_cache_manager: Any) -> None:
        self.kvm = kv_cache_manager
        self.cached_tokens: dict[str, int] = {}
        self._nhashes: dict[str, int] = {}
        self._index: dict[bytes, set[str]] = {}
        self._hashes: dict[str, tuple[bytes, ...]] = {}
        self._map: RecordingBlockHashMap | None = None
        self.lookups = 0
        self._install()

    def _install(self) -> bool:
        """Make sure the live map records changes; True if it was (re)installed."""
        pool = getattr(self.kvm, "block_pool", None)
        if pool is None:
            return False
        m = pool.cached_block_hash_to_block
        if m is self._map:
            return False
        if not isinstance(m, RecordingBlockHashMap):
            m.__class__ = RecordingBlockHashMap
        m.changed = set()
        self._map = m
        return True

    @property
    def evictions(self) -> int:
        """Cached blocks the pool removed since the probe was installed on this map."""
        return self._map.pops if self._map is not None else 0

    def _lookup(self, request: Any) -> int:
        self.lookups += 1
        if not self.kvm.prefix_cache_lookup_enabled(request):
            return 0
        _, n, _ = self.kvm.coordinator.find_longest_cache_hit(
            request.block_hashes, request.num_tokens - 1
        )
        return int(n)

    def _forget(self, rid: str) -> None:
        for h in self._hashes.pop(rid, ()):
            s = self._index.get(h)
            if s is not None:
                s.discard(rid)
                if not s:
                    del self._index[h]
        self._nhashes.pop(rid, None)
        self.cached_tokens.pop(rid, None)

    def refresh(self, waiting: Iterable[Any]) -> dict[str, int]:
        """Update and return ``cached_tokens`` for exactly the requests in ``waiting``."""
        reinstalled = self._install()
        affected: set[str] = set()
        if self._map is not None and self._map.changed:
            index = self._index
            for h in self._map.changed:
                s = index.get(h)
                if s:
                    affected |= s
            self._map.changed = set()
        present: set[str] = set()
        for r in waiting:
            rid = r.request_id
            present.add(rid)
            hashes = r.block_hashes
            if rid not in self.cached_tokens or self._nhashes[rid] != len(hashes):
                self._forget(rid)
                hs = tuple(hashes)
                self._hashes[rid] = hs
                self._nhashes[rid] = len(hs)
                for h in hs:
                    self._index.setdefault(h, set()).add(rid)
                self.cached_tokens[rid] = self._lookup(r)
            elif reinstalled or rid in affected:
                self.cached_tokens[rid] = self._lookup(r)
        if len(present) != len(self.cached_tokens):
            for rid in [k for k in self.cached_tokens if k not in present]:
                self._forget(rid)
        return self.cached_tokens
