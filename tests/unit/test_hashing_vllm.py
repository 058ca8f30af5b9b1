"""Our block hashes equal vLLM's own, computed by vLLM's request block hasher.

Imports vLLM (about 10 s), hence slow + integration.
"""

from __future__ import annotations

import random

import pytest

from cluster.hashing import BlockHasher, HashConfig, low64

pytestmark = [pytest.mark.slow, pytest.mark.integration]

BLOCK = 16


def _vllm_hashes(
    algo: str, tokens: list[int], salt: str | None, lora: tuple[str, str] | None = None
) -> list[bytes]:
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.request import Request

    fn = get_hash_fn_by_name(algo)
    kv_cache_utils.init_none_hash(fn)  # reads PYTHONHASHSEED, as an engine does at start
    req = Request(
        request_id="r",
        prompt_token_ids=tokens,
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        cache_salt=salt,
        lora_request=LoRARequest(lora[0], 1, lora[1]) if lora else None,
        block_hasher=kv_cache_utils.get_request_block_hasher(BLOCK, fn),
    )
    return list(req.block_hashes)


PROMPTS = [
    [random.Random(s).randrange(0, 32000) for _ in range(n)]
    for s, n in [(0, 16), (1, 100), (2, 16 * 9 + 3), (3, 400)]
]


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
@pytest.mark.parametrize("seed", [None, "0", "1234"])
@pytest.mark.parametrize("salt", [None, "tenant-A", "B"])
def test_hashes_equal_vllm(
    monkeypatch: pytest.MonkeyPatch, algo: str, seed: str | None, salt: str | None
) -> None:
    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    ours = BlockHasher(HashConfig(algo=algo, block_size=BLOCK, seed=seed))  # type: ignore[arg-type]
    for tokens in PROMPTS:
        theirs = _vllm_hashes(algo, tokens, salt)
        assert ours.block_digests(tokens, cache_salt=salt) == theirs
        assert ours.prefix_hashes(tokens, cache_salt=salt) == [low64(h) for h in theirs]


def test_lora_hashes_equal_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    ours = BlockHasher(HashConfig(block_size=BLOCK))
    tokens = PROMPTS[3]
    lora = ("adapter", "/models/adapter")
    assert ours.block_digests(tokens, "s", lora) == _vllm_hashes("sha256", tokens, "s", lora)


def test_mismatched_seed_differs_from_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "1")
    ours = BlockHasher(HashConfig(block_size=BLOCK, seed="2"))
    assert ours.block_digests(PROMPTS[1], None) != _vllm_hashes("sha256", PROMPTS[1], None)


@pytest.mark.parametrize("algo", ["xxhash", "xxhash_cbor"])
def test_xxhash_equal_vllm_when_installed(monkeypatch: pytest.MonkeyPatch, algo: str) -> None:
    pytest.importorskip("xxhash")
    monkeypatch.setenv("PYTHONHASHSEED", "5")
    ours = BlockHasher(HashConfig(algo=algo, block_size=BLOCK, seed="5"))  # type: ignore[arg-type]
    assert ours.block_digests(PROMPTS[2], "A") == _vllm_hashes(algo, PROMPTS[2], "A")
