"""Prefix-cache block hashes that equal vLLM's own (vLLM 0.32, ``vllm/v1/core/kv_cache_utils.py``).

vLLM hashes a prompt in full blocks of ``block_size`` tokens (a trailing partial block is not
hashed). Block ``i`` gets::

    h_i = H((h_{i-1} or NONE_HASH, tuple(tokens[i*B:(i+1)*B]), extra_keys_i))

where ``H`` is ``prefix_caching_hash_algo`` applied to that Python tuple:

==============  ==============================================  ===================
algorithm       serialisation then digest                       digest
==============  ==============================================  ===================
``sha256``      ``pickle.dumps(obj, HIGHEST_PROTOCOL)``, SHA-256  32 bytes (default)
``sha256_cbor`` ``cbor2.dumps(obj, canonical=True)``, SHA-256    32 bytes
``xxhash``      pickle, then ``xxh3_128``                        16 bytes
``xxhash_cbor`` canonical CBOR, then ``xxh3_128``                16 bytes
==============  ==============================================  ===================

``NONE_HASH = H(seed)`` where ``seed`` is the string in ``PYTHONHASHSEED`` when the engine
process has it set; otherwise ``"vllm-none-hash"`` for the SHA-256 algorithms and 32 random
bytes (hex) per process for the xxhash ones. An unseeded xxhash engine therefore cannot be
matched by anyone: :class:`HashConfig` refuses that combination.

``extra_keys_i`` is ``None`` or a tuple of tagged keys in vLLM's order: the LoRA key
``("lora", name, path)`` on every block, then ``("cache_salt", salt)`` on block 0 only (a
non-empty salt). Multimodal and prompt-embedding keys are not supported here (text prompts
only). KV events carry the low 64 bits of each digest (``int.from_bytes(h, "big") & (2**64-1)``,
vLLM's ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`` default), so that is the form the index uses:
:meth:`BlockHasher.prefix_hashes` returns those ints.

Two modes (:class:`HashMode`):

- ``engine``: the ingress computes the engines' own hashes (same algorithm, same seed, same
  block size); the index is keyed by the 64-bit hashes in the events. Checked at start-up by
  :func:`check_alignment` against a probe prompt's hashes reported by an engine.
- ``tokens`` (fallback, as llm-d does): the feed re-hashes the ``token_ids`` carried in each
  ``BlockStored`` event with :data:`TOKENS_MODE_CONFIG` (SHA-256 over canonical CBOR, fixed
  seed, no Python dependence), chaining through the engine's parent hashes it has seen, and
  the ingress hashes prompts the same way. Extra keys there are the untagged per-block form
  that events publish (LoRA name, then the salt on block 0).

The same extra-key limitation holds in both modes. Pickle memoises repeated string objects,
so a salt or LoRA name that is the *same object* as another string in the key would
serialise differently; with distinct salt strings (the normal case) this does not arise.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Sequence
from enum import StrEnum
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

HashAlgo = Literal["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]
"""The values of vLLM's ``prefix_caching_hash_algo`` (``engines.launch.HashAlgo`` lists them too:
neither layer may import the other; a unit test keeps the two lists equal)."""

SUPPORTED_ALGOS: tuple[str, ...] = get_args(HashAlgo)
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
"""vLLM's seed of ``NONE_HASH`` for SHA-256 when ``PYTHONHASHSEED`` is unset."""

MASK64 = (1 << 64) - 1

ExtraKeys = tuple[Any, ...] | None


class HashMode(StrEnum):
    """Which hashes key the index (see the module docstring)."""

    ENGINE = "engine"
    TOKENS = "tokens"


class HashConfig(BaseModel):
    """How block hashes are computed; must equal the engines' settings in ``engine`` mode.

    The one definition of the hashing parameters: the app's ``hashing`` section
    (:class:`deployments.config.hashing.HashingConfig`) is this model narrowed to what a
    deployment gives its engines, and the engines receive the same values as
    :class:`engines.launch.EngineLaunch`'s ``hash_algo``, ``hash_seed`` and ``block_size``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    algo: HashAlgo = Field(
        default="sha256", description="vLLM's prefix_caching_hash_algo of every engine."
    )
    block_size: int = Field(
        default=128, ge=1, le=1 << 16, description="Tokens per KV block (the engines' block size)."
    )
    seed: str | None = Field(
        default=None,
        description=(
            "PYTHONHASHSEED of the engines (None: unset). Required for xxhash algorithms, "
            "whose unseeded NONE_HASH is random per process."
        ),
    )

    @model_validator(mode="after")
    def _seed_for_xxhash(self) -> HashConfig:
        if self.algo.startswith("xxhash") and self.seed is None:
            raise ValueError(
                f"seed: algo={self.algo!r} without PYTHONHASHSEED gives every vLLM process a "
                "random NONE_HASH, so no one can reproduce its hashes; set PYTHONHASHSEED on "
                "every engine and the ingress (and pass it as seed), or use sha256"
            )
        return self

    @classmethod
    def from_env(cls, algo: HashAlgo = "sha256", block_size: int = 128) -> HashConfig:
        """The config of a process whose engines share this process's ``PYTHONHASHSEED``."""
        return cls(algo=algo, block_size=block_size, seed=os.environ.get("PYTHONHASHSEED"))

    @property
    def none_hash_seed(self) -> str:
        return self.seed if self.seed is not None else DEFAULT_NONE_HASH_SEED


TOKENS_MODE_CONFIG = HashConfig(algo="sha256_cbor", block_size=128, seed="pdserve-tokens")
"""Hash settings of the ``tokens`` fallback mode (block size is replaced by the engines')."""


def tokens_hasher(block_size: int) -> BlockHasher:
    """The ``tokens``-mode hasher for engines of ``block_size``-token blocks."""
    return BlockHasher(
        TOKENS_MODE_CONFIG.model_copy(update={"block_size": block_size}), HashMode.TOKENS
    )


def _pickle(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _cbor(obj: Any) -> bytes:
    import cbor2

    return bytes(cbor2.dumps(obj, canonical=True))


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _xxh3_128(data: bytes) -> bytes:
    try:
        import xxhash
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ModuleNotFoundError(
            "the xxhash algorithms need the 'xxhash' package (pip install xxhash)"
        ) from e
    return bytes(xxhash.xxh3_128_digest(data))


def hash_function(algo: HashAlgo) -> Callable[[Any], bytes]:
    """The object hash vLLM uses for ``algo`` (serialise, then digest)."""
    serialise = _cbor if algo.endswith("_cbor") else _pickle
    digest = _xxh3_128 if algo.startswith("xxhash") else _sha256
    return lambda obj: digest(serialise(obj))


def low64(block_hash: bytes) -> int:
    """The low 64 bits of a digest, as KV events carry it."""
    return int.from_bytes(block_hash, "big") & MASK64


class BlockHasher:
    """Computes vLLM's chained block hashes for token-id prompts.

    Pure and thread-safe; one instance per process is enough.
    """

    def __init__(self, config: HashConfig, mode: HashMode = HashMode.ENGINE) -> None:
        self.config = config
        self.mode = mode
        self.block_size = config.block_size
        self._h = hash_function(config.algo)
        self.none_hash: bytes = self._h(config.none_hash_seed)

    def hash_block(
        self, parent: bytes | None, tokens: Sequence[int], extra_keys: ExtraKeys = None
    ) -> bytes:
        """One block's digest: ``H((parent or NONE_HASH, tuple(tokens), extra_keys))``."""
        return self._h((parent or self.none_hash, tuple(tokens), extra_keys))

    def extra_keys(
        self, block_index: int, cache_salt: str | None, lora: tuple[str, str] | None
    ) -> ExtraKeys:
        """Extra keys of block ``block_index``: vLLM's tagged form in ``engine`` mode, the
        untagged event form in ``tokens`` mode. ``lora`` is ``(name, path)``."""
        keys: list[Any] = []
        if self.mode is HashMode.ENGINE:
            if lora is not None:
                keys.append(("lora", lora[0], lora[1]))
            if block_index == 0 and cache_salt:
                keys.append(("cache_salt", cache_salt))
        else:
            if lora is not None:
                keys.append(lora[0])
            if block_index == 0 and cache_salt:
                keys.append(cache_salt)
        return tuple(keys) if keys else None

    def block_digests(
        self,
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        lora: tuple[str, str] | None = None,
    ) -> list[bytes]:
        """Full digests of every full block of ``token_ids``."""
        out: list[bytes] = []
        parent: bytes | None = None
        b = self.block_size
        for i in range(len(token_ids) // b):
            parent = self.hash_block(
                parent, token_ids[i * b : (i + 1) * b], self.extra_keys(i, cache_salt, lora)
            )
            out.append(parent)
        return out

    def prefix_hashes(
        self,
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        lora: tuple[str, str] | None = None,
    ) -> list[int]:
        """The 64-bit hashes of every full block, in prompt order: what ``match()`` takes."""
        return [low64(h) for h in self.block_digests(token_ids, cache_salt, lora)]


class HashAlignmentError(RuntimeError):
    """Our hashes of the probe prompt differ from the engine's: the ingress must not start."""


def check_alignment(ours: Sequence[int], engine: Sequence[int], config: HashConfig) -> None:
    """Compare our 64-bit hashes of a probe prompt with the engine's own, block by block.

    Raises :class:`HashAlignmentError` with a message naming the first differing block and
    the settings that must agree. ``engine`` may be shorter than ``ours`` only if it is
    empty (then nothing can be checked, which is also an error).
    """
    if not engine:
        raise HashAlignmentError(
            "the engine reported no block hashes for the probe prompt (is prefix caching on and "
            f"the probe at least block_size={config.block_size} tokens long?)"
        )
    for i, (a, b) in enumerate(zip(ours, engine, strict=False)):
        if a != b:
            raise HashAlignmentError(
                f"block hash mismatch at block {i}: ours {a:#018x}, engine {b:#018x}. "
                f"The ingress uses prefix_caching_hash_algo={config.algo!r}, "
                f"block_size={config.block_size}, PYTHONHASHSEED={config.seed!r}; every engine "
                "must use the same three (and receive prompt_token_ids, not text), or run the "
                "index in 'tokens' mode"
            )
    if len(ours) != len(engine):
        raise HashAlignmentError(
            f"the probe has {len(ours)} full blocks by our count but the engine reported "
            f"{len(engine)}: block_size={config.block_size} differs from the engine's"
        )
