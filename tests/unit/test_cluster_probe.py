"""The start-up probe: aligned hashes give engine mode, misaligned ones fall back or refuse."""

from __future__ import annotations

import asyncio
import random

import pytest
import zmq.asyncio

from cluster.events import BlockStored
from cluster.feed import KVEventFeed
from cluster.hashing import BlockHasher, HashAlignmentError, HashConfig, HashMode
from cluster.index import MemoryPrefixIndex
from cluster.probe import probe_hash_mode
from tests.unit.test_cluster_feed import Publisher, T, free_port

BS = 16


def _probe(engine_seed: str | None, allow_fallback: bool) -> HashMode:
    """A fake engine that hashes with ``engine_seed`` answers the probe with its events."""
    ours = BlockHasher(HashConfig(block_size=BS))
    engine = BlockHasher(HashConfig(block_size=BS, seed=engine_seed))

    async def main() -> HashMode:
        ctx = zmq.asyncio.Context()
        feed = KVEventFeed(MemoryPrefixIndex(), heartbeat_s=3600, context=ctx)
        port = free_port()
        pub = Publisher(ctx, port, None)
        try:
            await feed.add_replica("A", f"tcp://127.0.0.1:{port}")
            await pub.subscribed()
            await feed.wait_for("A", lambda rf: rf.epoch is not None, T)

            async def send(ids: list[int], salt: str | None) -> None:
                hs = engine.prefix_hashes(ids, cache_salt=salt)
                ev = BlockStored(
                    block_hashes=list(hs), parent_block_hash=None, token_ids=ids,
                    block_size=BS, medium="GPU",
                )  # fmt: skip
                await pub.send(ev)

            return await probe_hash_mode(
                feed, "A", send, ours, vocab=1000, timeout_s=T,
                allow_fallback=allow_fallback, rng=random.Random(0),
            )  # fmt: skip
        finally:
            await feed.close()
            pub.close()
            ctx.destroy(linger=0)

    return asyncio.run(main())


def test_aligned_engine_gives_engine_mode() -> None:
    assert _probe(None, allow_fallback=False) is HashMode.ENGINE


def test_misaligned_engine_falls_back_to_tokens_mode() -> None:
    assert _probe("123", allow_fallback=True) is HashMode.TOKENS


def test_misaligned_engine_refuses_to_start_without_fallback() -> None:
    with pytest.raises(HashAlignmentError, match="PYTHONHASHSEED"):
        _probe("123", allow_fallback=False)
