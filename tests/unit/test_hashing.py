"""Pure properties of the block hashes (equality with vLLM itself: test_hashing_vllm.py)."""

from __future__ import annotations

import hashlib
import pickle

import pytest
from pydantic import ValidationError

from cluster.hashing import (
    DEFAULT_NONE_HASH_SEED,
    BlockHasher,
    HashAlignmentError,
    HashConfig,
    HashMode,
    check_alignment,
    low64,
)

TOKENS = list(range(1000, 1000 + 40))


def hasher(**kw: object) -> BlockHasher:
    return BlockHasher(HashConfig(block_size=8, **kw))  # type: ignore[arg-type]


def test_first_block_is_sha256_of_pickled_triple_with_none_hash() -> None:
    h = hasher()
    none = hashlib.sha256(pickle.dumps(DEFAULT_NONE_HASH_SEED, protocol=5)).digest()
    expect = hashlib.sha256(pickle.dumps((none, tuple(TOKENS[:8]), None), protocol=5)).digest()
    assert h.none_hash == none
    assert h.block_digests(TOKENS)[0] == expect


def test_only_full_blocks_are_hashed_and_chain_depends_on_prefix() -> None:
    h = hasher()
    assert len(h.prefix_hashes(TOKENS)) == 5
    assert len(h.prefix_hashes(TOKENS[:15])) == 1
    other = [7] + TOKENS[1:]
    a, b = h.prefix_hashes(TOKENS), h.prefix_hashes(other)
    # a change in block 0 changes every later hash, although blocks 1.. have equal tokens
    assert all(x != y for x, y in zip(a, b, strict=True))
    # a shared prefix gives shared leading hashes
    assert h.prefix_hashes(TOKENS[:24] + [1] * 16)[:3] == a[:3]


def test_salt_enters_first_block_only_but_changes_the_chain() -> None:
    h = hasher()
    plain, salted = h.block_digests(TOKENS), h.block_digests(TOKENS, cache_salt="A")
    assert plain[0] != salted[0]
    assert h.extra_keys(0, "A", None) == (("cache_salt", "A"),)
    assert h.extra_keys(1, "A", None) is None
    assert h.hash_block(salted[0], TOKENS[8:16]) == salted[1]
    assert h.block_digests(TOKENS, cache_salt="") == plain  # vLLM ignores an empty salt


def test_lora_key_precedes_salt_and_tokens_mode_uses_event_form() -> None:
    h = hasher()
    assert h.extra_keys(0, "s", ("ad", "/p")) == (("lora", "ad", "/p"), ("cache_salt", "s"))
    assert h.extra_keys(3, "s", ("ad", "/p")) == (("lora", "ad", "/p"),)
    t = BlockHasher(HashConfig(block_size=8), HashMode.TOKENS)
    assert t.extra_keys(0, "s", ("ad", "/p")) == ("ad", "s")
    assert t.extra_keys(1, "s", None) is None


def test_seed_and_algorithm_change_the_root() -> None:
    roots = {
        hasher().none_hash,
        hasher(seed="1").none_hash,
        hasher(seed="2").none_hash,
        hasher(algo="sha256_cbor").none_hash,
    }
    assert len(roots) == 4


def test_low64_is_low_bits_big_endian() -> None:
    assert low64(bytes(24) + (5).to_bytes(8, "big")) == 5
    assert low64(b"\xff" * 32) == (1 << 64) - 1
    h = hasher()
    assert h.prefix_hashes(TOKENS) == [low64(d) for d in h.block_digests(TOKENS)]


def test_unseeded_xxhash_is_refused_naming_the_seed() -> None:
    with pytest.raises(ValidationError, match="seed"):
        HashConfig(algo="xxhash")
    with pytest.raises(ValidationError, match="block_size"):
        HashConfig(block_size=0)


def test_from_env_reads_pythonhashseed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "42")
    assert HashConfig.from_env().seed == "42"
    monkeypatch.delenv("PYTHONHASHSEED")
    assert HashConfig.from_env().seed is None


def test_check_alignment_names_the_block_and_settings() -> None:
    cfg = HashConfig(block_size=8)
    ours = BlockHasher(cfg).prefix_hashes(TOKENS)
    check_alignment(ours, ours, cfg)
    bad = BlockHasher(HashConfig(block_size=8, seed="9")).prefix_hashes(TOKENS)
    with pytest.raises(HashAlignmentError, match="block 0.*PYTHONHASHSEED"):
        check_alignment(ours, bad, cfg)
    with pytest.raises(HashAlignmentError, match="block_size"):
        check_alignment(ours, ours[:2], cfg)
    with pytest.raises(HashAlignmentError, match="no block hashes"):
        check_alignment(ours, [], cfg)
