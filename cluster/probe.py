"""Start-up check that our block hashes equal an engine's, and the choice of hash mode.

The ingress calls :func:`probe_hash_mode` once per deployment before serving: it sends a fresh
random probe prompt (``prompt_token_ids``, never text) to one engine through ``send``, watches
that engine's KV events on the feed, and compares the engine's hashes of the probe's blocks
with ours. Aligned: ``HashMode.ENGINE``. Not aligned: with ``allow_fallback`` the answer is
``HashMode.TOKENS`` (the feed must then be built with tokens-mode trackers and the ingress must
hash with a tokens-mode :class:`~cluster.hashing.BlockHasher`), logged as a warning; without
it :class:`~cluster.hashing.HashAlignmentError` stops the start-up with the reason.
"""

from __future__ import annotations

import contextlib
import logging
import random
from collections.abc import Awaitable, Callable, Sequence

import msgspec

from cluster.events import BlockStored, KVEventBatch, LeanBlockStored, LeanKVEventBatch, as_int
from cluster.feed import KVEventFeed
from cluster.hashing import BlockHasher, HashAlignmentError, HashMode, check_alignment

log = logging.getLogger(__name__)

SendProbe = Callable[[list[int], str | None], Awaitable[object]]


def probe_prompt(blocks: int, block_size: int, vocab: int, rng: random.Random) -> list[int]:
    """``blocks`` full blocks of random token ids (so the engine cannot have cached them)."""
    return [rng.randrange(10, vocab) for _ in range(blocks * block_size)]


def _engine_hashes_of(
    batches: Sequence[KVEventBatch | LeanKVEventBatch], probe: list[int], block_size: int
) -> list[int]:
    """The engine's hashes of the probe's blocks, in order, found by their token ids."""
    found: dict[int, int] = {}
    want = {
        tuple(probe[i : i + block_size]): i // block_size for i in range(0, len(probe), block_size)
    }
    for b in batches:
        for ev in b.events:
            if not isinstance(ev, BlockStored | LeanBlockStored):
                continue
            tokens = (
                msgspec.msgpack.decode(ev.token_ids)
                if isinstance(ev, LeanBlockStored)
                else ev.token_ids
            )
            for j, h in enumerate(ev.block_hashes):
                k = want.get(tuple(tokens[j * ev.block_size : (j + 1) * ev.block_size]))
                if k is not None:
                    found[k] = as_int(h)
    out = []
    for k in range(len(want)):
        if k not in found:
            break
        out.append(found[k])
    return out


async def probe_hash_mode(
    feed: KVEventFeed,
    replica: str,
    send: SendProbe,
    hasher: BlockHasher,
    *,
    vocab: int,
    blocks: int = 2,
    cache_salt: str | None = "pdserve-probe",
    timeout_s: float = 30.0,
    allow_fallback: bool = True,
    rng: random.Random | None = None,
) -> HashMode:
    """Probe ``replica`` (already added to ``feed``) and return the hash mode to run in."""
    rng = rng or random.Random()
    probe = probe_prompt(blocks, hasher.block_size, vocab, rng)
    ours = hasher.prefix_hashes(probe, cache_salt=cache_salt)
    seen: list[KVEventBatch | LeanKVEventBatch] = []
    rf = feed.replicas[replica]
    rf.observers.append(seen.append)
    try:
        await send(probe, cache_salt)
        bs = hasher.block_size
        # on a time-out, check_alignment below reports what is missing
        with contextlib.suppress(TimeoutError):
            await feed.wait_for(
                replica, lambda _: len(_engine_hashes_of(seen, probe, bs)) >= blocks, timeout_s
            )
        engine = _engine_hashes_of(seen, probe, bs)
    finally:
        rf.observers.remove(seen.append)
    try:
        check_alignment(ours, engine, hasher.config)
    except HashAlignmentError as e:
        if not allow_fallback:
            raise
        log.warning("prefix index: hashes not aligned with %s (%s); using mode=tokens", replica, e)
        return HashMode.TOKENS
    log.info("prefix index: hashes aligned with %s; using mode=engine", replica)
    return HashMode.ENGINE
