"""Prefix-index benchmark: event ingest throughput and lookup latency (measured, not simulated).

Population (that is the ingest measurement): ``blocks`` distinct block hashes in chains of
``prompt_blocks`` (64) blocks. Every 16th chain is *hot* (held by all replicas); each other
chain is held by 1-3 replicas chosen at random. Each replica's holdings arrive as vLLM would
send them: msgpack ``KVEventBatch`` payloads (one ``BlockStored`` of 16 blocks, 128 tokens per
block, per batch), fed through :meth:`cluster.feed.KVEventFeed.ingest` in bursts of about
``burst`` batches, so the timed path is decode, tracker, and index writes in chunks of up to
``write_batch`` blocks (the payloads are encoded untimed, as the engine's side). A churn phase
then removes and re-stores random chain tails. ``ingest_events_per_s`` = block events (one
hash stored or removed) / seconds inside ``ingest`` over both phases.

Lookups: ``lookups`` sequential ``match()`` calls on 64-block prompts, alternating *hot*
(a hot chain: every block held by every replica, the most work one lookup can do) and
*typical* (a random chain, so mostly 1-3 holders, cut after a random depth with an unseen
tail), timed around the awaited call. ``lookup_ms`` summarises all of them; ``lookup_ms_hot``
and ``lookup_ms_typical`` each half. For Redis, ``lookup_server_us_mean`` is Redis's own time
per script call over the lookups (``INFO commandstats``), so ``p50 - server time`` is roughly
what the client and the loopback add; ``index_memory_mb`` is Redis's ``used_memory`` after the
ingest (the server is the benchmark's own unless ``--redis-url`` is given).
"""

from __future__ import annotations

import asyncio
import gc
import random
import time
import uuid
from collections.abc import Callable
from typing import Any

from tqdm import tqdm

from bench.report.stats import summarize
from cluster.events import BlockRemoved, BlockStored, KVEventBatch, encode_batch
from cluster.feed import KVEventFeed, ReplicaFeed
from cluster.index import IndexConfig, PrefixIndex, make_index

BLOCKS_PER_EVENT = 16
TOKENS_PER_BLOCK = 128


def _payload(hashes: list[int], parent: int | None, rng: random.Random) -> bytes:
    ev = BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=parent,
        token_ids=[rng.randrange(32000)] * (TOKENS_PER_BLOCK * len(hashes)),
        block_size=TOKENS_PER_BLOCK,
        medium="GPU",
    )
    return encode_batch(KVEventBatch(ts=0.0, events=[ev]))


def _removal(hashes: list[int]) -> bytes:
    bh: list[int | bytes] = list(hashes)
    return encode_batch(KVEventBatch(ts=0.0, events=[BlockRemoved(block_hashes=bh, medium="GPU")]))


def _chains(blocks: int, prompt_blocks: int, rng: random.Random) -> list[list[int]]:
    seen: set[int] = set()
    out: list[list[int]] = []
    for _ in range(max(1, blocks // prompt_blocks)):
        chain: list[int] = []
        while len(chain) < prompt_blocks:
            h = rng.getrandbits(64)
            if h not in seen:
                seen.add(h)
                chain.append(h)
        out.append(chain)
    return out


async def _run(
    index: PrefixIndex,
    blocks: int,
    replicas: int,
    lookups: int,
    prompt_blocks: int,
    burst: int,
    write_batch: int,
    seed: int,
    clock: Callable[[], float],
    progress: bool,
) -> dict[str, Any]:
    rng = random.Random(seed)
    names = [f"replica-{i}" for i in range(replicas)]
    chains = _chains(blocks, prompt_blocks, rng)
    hot = [i for i in range(len(chains)) if i % 16 == 0]
    holders: list[list[str]] = [
        names if i % 16 == 0 else rng.sample(names, k=min(replicas, rng.randint(1, 3)))
        for i in range(len(chains))
    ]
    # per replica: what it stores (chain ids), then churn (chain id, cut), in order
    stores: dict[str, list[int]] = {r: [] for r in names}
    for i, hs in enumerate(holders):
        for r in hs:
            stores[r].append(i)
    churn: dict[str, list[tuple[int, int]]] = {r: [] for r in names}
    for _ in range(len(chains) // 4):
        i = rng.randrange(len(chains))
        cut = rng.randrange(1, prompt_blocks)
        for r in holders[i]:
            churn[r].append((i, cut))
    entries = sum(len(c) * len(hs) for c, hs in zip(chains, holders, strict=True))

    def store_payloads(i: int) -> list[bytes]:
        chain, out, parent = chains[i], [], None
        for j in range(0, len(chain), BLOCKS_PER_EVENT):
            part = chain[j : j + BLOCKS_PER_EVENT]
            out.append(_payload(part, parent, rng))
            parent = part[-1]
        return out

    def churn_payloads(i: int, cut: int) -> list[bytes]:
        tail = chains[i][cut:]
        return [_removal(tail), _payload(tail, chains[i][cut - 1], rng)]

    feed = KVEventFeed(index, write_batch=write_batch, heartbeat_s=3600.0)
    rfs: dict[str, ReplicaFeed] = {r: await feed.add_offline_replica(r) for r in names}
    seqs = dict.fromkeys(names, 0)
    total = sum(len(v) for v in stores.values()) + sum(len(v) for v in churn.values())
    bar = tqdm(total=total, desc="ingest", unit="chain", disable=not progress)
    block_events = 0
    ingest_s = 0.0  # only the feed's work: payloads are encoded (the engine's side) untimed

    async def feed_burst(r: str, payloads: list[bytes]) -> None:
        nonlocal block_events, ingest_s
        frames = []
        for p in payloads:
            frames.append([b"", seqs[r].to_bytes(8, "big"), p])
            seqs[r] += 1
        t = clock()
        delta = await feed.ingest(rfs[r], frames)
        ingest_s += clock() - t
        block_events += delta.events

    per_burst = max(1, burst // (prompt_blocks // BLOCKS_PER_EVENT or 1))
    for r in names:
        ids = stores[r]
        for k in range(0, len(ids), per_burst):
            await feed_burst(r, [p for i in ids[k : k + per_burst] for p in store_payloads(i)])
            bar.update(len(ids[k : k + per_burst]))
    for r in names:
        cuts = churn[r]
        for k in range(0, len(cuts), per_burst):
            await feed_burst(
                r, [p for i, c in cuts[k : k + per_burst] for p in churn_payloads(i, c)]
            )
            bar.update(len(cuts[k : k + per_burst]))
    bar.close()

    # The benchmark's own bookkeeping (millions of ints in lists) is no part of the system
    # under test; keep the cyclic GC from walking it during the timed lookups.
    memory = getattr(index, "memory_bytes", None)
    memory_mb = (await memory()) / 2**20 if memory is not None else None
    gc.collect()
    gc.freeze()
    server = getattr(index, "server_stats", None)
    if server is not None:
        await server(reset=True)
    lat: list[float] = []
    lat_hot: list[float] = []
    lat_typical: list[float] = []
    full_hits = 0
    for k in tqdm(range(lookups), desc="lookup", disable=not progress):
        if k % 2 == 0:
            prompt = chains[rng.choice(hot)]
        else:
            chain = chains[rng.randrange(len(chains))]
            cut = rng.randrange(1, prompt_blocks + 1)
            prompt = chain[:cut] + [rng.getrandbits(64) for _ in range(prompt_blocks - cut)]
        t = clock()
        res = await index.match(prompt)
        dt = (clock() - t) * 1e3
        lat.append(dt)
        if k % 2 == 0:
            lat_hot.append(dt)
            full_hits += res == dict.fromkeys(names, prompt_blocks)
        else:
            lat_typical.append(dt)
    if full_hits != len(lat_hot):
        raise AssertionError(f"only {full_hits}/{len(lat_hot)} hot lookups saw every replica")
    server_us = (await server())["usec_per_call"] if server is not None else None
    gc.unfreeze()
    s, s_hot, s_typ = summarize(lat), summarize(lat_hot), summarize(lat_typical)
    return {
        "blocks": len(chains) * prompt_blocks,
        "replicas": replicas,
        "entries": entries,
        "prompt_blocks": prompt_blocks,
        "lookup_ms": {"p50": s["p50"], "p99": s["p99"]},
        "lookup_ms_all": s,
        "lookup_ms_hot": s_hot,
        "lookup_ms_typical": s_typ,
        "lookup_server_us_mean": server_us,
        "index_memory_mb": memory_mb,
        "ingest_events_per_s": block_events / ingest_s if ingest_s > 0 else None,
        "ingest_block_events": block_events,
        "ingest_s": ingest_s,
        "write_round_trips": sum(rf.stats.write_round_trips for rf in rfs.values()),
        "write_batch": write_batch,
        "latencies_ms": lat,
    }


def run(
    backend: str,
    blocks: int,
    replicas: int = 16,
    *,
    redis_url: str | None = None,
    lookups: int = 2000,
    prompt_blocks: int = 64,
    burst: int = 64,
    write_batch: int = 1024,
    seed: int = 0,
    clock: Callable[[], float] = time.perf_counter,
    progress: bool = True,
) -> dict[str, Any]:
    """One benchmark run in a fresh namespace, deleted afterwards. ``redis_url`` is needed
    for the Redis backend (the command starts a private server when none is given)."""
    cfg = IndexConfig(
        backend=backend,  # type: ignore[arg-type]
        redis_url=redis_url or "redis://127.0.0.1:6379/0",
        app=f"bench-{uuid.uuid4().hex[:8]}",
        deployment="prefill",
        write_batch=write_batch,
    )

    async def main() -> dict[str, Any]:
        index = make_index(cfg)
        try:
            return await _run(
                index,
                blocks,
                replicas,
                lookups,
                prompt_blocks,
                burst,
                write_batch,
                seed,
                clock,
                progress,
            )
        finally:
            clear = getattr(index, "clear_namespace", None)
            if clear is not None:
                await clear()
            await index.close()

    res = asyncio.run(main())
    return {"backend": backend, **res}
