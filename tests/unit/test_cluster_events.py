"""The KV-event decoder and the pure per-replica tracker."""

from __future__ import annotations

import pytest

from cluster.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    LeanBlockStored,
    ReplicaTracker,
    decode_batch,
    encode_batch,
    stored_hashes,
)
from cluster.hashing import BlockHasher, HashConfig, HashMode, low64


def stored(hashes: list[int], parent: int | None = None, **kw: object) -> BlockStored:
    return BlockStored(
        block_hashes=hashes,  # type: ignore[arg-type]
        parent_block_hash=parent,
        token_ids=kw.pop("token_ids", list(range(4 * len(hashes)))),  # type: ignore[arg-type]
        block_size=4,
        **kw,  # type: ignore[arg-type]
    )


def batch(*events: object) -> KVEventBatch:
    return KVEventBatch(ts=0.0, events=list(events))  # type: ignore[arg-type]


def test_round_trip_and_vllm_layout() -> None:
    b = batch(stored([1, 2], medium="GPU"), BlockRemoved(block_hashes=[1]), AllBlocksCleared())
    raw = encode_batch(b)
    assert decode_batch(raw) == b
    import msgspec

    plain = msgspec.msgpack.decode(raw)
    assert isinstance(plain, list) and plain[0] == 0.0  # array-like batch, as vLLM's
    assert [e["type"] for e in plain[1]] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]


def test_unknown_fields_are_ignored_and_bytes_hashes_become_low64() -> None:
    import msgspec

    h = bytes(range(32))
    raw = msgspec.msgpack.encode(
        [1.0, [{"type": "BlockRemoved", "block_hashes": [h], "medium": "GPU", "locality": "X"}]]
    )
    t = ReplicaTracker()
    t.blocks[low64(h)] = low64(h)
    d = t.apply(0, decode_batch(raw))
    assert d.touched == {low64(h): False}


def test_net_effect_of_a_batch() -> None:
    t = ReplicaTracker()
    d = t.apply(0, batch(stored([1, 2, 3]), BlockRemoved(block_hashes=[2]), stored([2])))
    assert d.touched == {1: True, 2: True, 3: True} and not d.reset
    d = t.apply(1, batch(BlockRemoved(block_hashes=[3, 99])))
    assert d.touched == {3: False}
    assert sorted(t.held()) == [1, 2]
    assert t.stats.block_events == 7


def test_sequence_gap_restart_and_duplicate() -> None:
    t = ReplicaTracker()
    t.apply(5, batch(stored([1])))  # the first batch seen sets the position
    assert t.apply(5, batch(stored([7]))).touched == {}  # duplicate
    assert t.stats.duplicates == 1
    d = t.apply(7, batch(stored([2])))  # seq 6 lost
    assert d.reset and t.held() == [2] and t.stats.gaps == 1
    with pytest.raises(LookupError, match="expected seq 8"):
        t.apply(9, batch(), allow_gap=False)
    d = t.apply(0, batch(stored([3])))  # a new publisher
    assert d.reset and t.held() == [3] and t.stats.restarts == 1


def test_all_cleared_resets_and_later_events_count() -> None:
    t = ReplicaTracker()
    t.apply(0, batch(stored([1, 2])))
    d = t.apply(1, batch(stored([3]), AllBlocksCleared(), stored([4])))
    assert d.reset and t.held() == [4]


def test_other_groups_and_mediums_are_filtered() -> None:
    t = ReplicaTracker()
    d = t.apply(0, batch(stored([1], group_idx=1), stored([2], medium="CPU"), stored([3])))
    assert d.touched == {3: True} and t.stats.filtered == 2


def test_tokens_mode_rehashes_event_tokens_like_the_ingress() -> None:
    """The fallback: the feed's hashes of the event tokens equal the ingress's prompt hashes."""
    cfg = HashConfig(algo="sha256_cbor", block_size=4, seed="x")
    ingress = BlockHasher(cfg, HashMode.TOKENS)
    prompt = list(range(100, 112))
    want = ingress.prefix_hashes(prompt, cache_salt="A")
    t = ReplicaTracker(HashMode.TOKENS, BlockHasher(cfg, HashMode.TOKENS))
    # engine hashes are unrelated ints; the first event carries block 0, the second 1..2
    t.apply(0, batch(stored([901], token_ids=prompt[:4], extra_keys=[("A",)])))
    t.apply(1, batch(stored([902, 903], parent=901, token_ids=prompt[4:], extra_keys=None)))
    assert sorted(t.held()) == sorted(want)
    d = t.apply(2, batch(BlockRemoved(block_hashes=[903])))
    assert d.touched == {want[2]: False}
    # a child whose parent this tracker never saw cannot be chained
    t.apply(3, batch(stored([905], parent=777)))
    assert t.stats.unchained == 1


def test_tokens_mode_needs_a_tokens_hasher() -> None:
    with pytest.raises(ValueError, match="hasher"):
        ReplicaTracker(HashMode.TOKENS, BlockHasher(HashConfig()))


def test_stored_hashes_in_order() -> None:
    bs = [batch(stored([5, 6]), BlockRemoved(block_hashes=[1])), batch(stored([7]))]
    assert stored_hashes(bs) == [5, 6, 7]


def test_lean_decoding_keeps_everything_but_the_tokens() -> None:
    b = batch(
        stored([1, 2], medium="GPU", extra_keys=[("A",), None]), BlockRemoved(block_hashes=[1])
    )
    raw = encode_batch(b)
    lean = decode_batch(raw, lean=True)
    full = decode_batch(raw)
    ev, fe = lean.events[0], full.events[0]
    assert isinstance(ev, LeanBlockStored) and isinstance(fe, BlockStored)
    assert (ev.block_hashes, ev.extra_keys, ev.medium) == (fe.block_hashes, fe.extra_keys, "GPU")
    t1, t2 = ReplicaTracker(), ReplicaTracker()
    assert t1.apply(0, lean).touched == t2.apply(0, full).touched == {1: False, 2: True}
