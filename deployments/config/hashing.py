"""``hashing``: how KV blocks are hashed, by the engines and the ingress alike."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from cluster.hashing import HashConfig


class HashingConfig(HashConfig):
    """How KV blocks are hashed: given to every engine and to the ingress alike (one field).

    The hasher's parameters (``algo``, ``block_size``, ``seed``) are
    :class:`cluster.hashing.HashConfig`'s, defined there once; the section narrows them to what
    a deployment can give its engines (a seed by default, since every engine gets one as its
    ``PYTHONHASHSEED``; a block size vLLM takes) and adds ``on_mismatch``.
    """

    seed: str | None = Field(
        default="0",
        pattern=r"^\d{1,10}$",
        description="PYTHONHASHSEED every engine runs with (vLLM seeds its NONE_HASH with it) "
        "and the ingress hashes with: an integer in [0, 4294967295] as a string (Python "
        "refuses other values in the subprocesses vLLM starts); null: unset on the engines "
        "(vLLM's fixed sha256 seed).",
    )
    block_size: int = Field(default=128, ge=16, le=4096, description="Tokens per KV block.")
    on_mismatch: Literal["tokens", "refuse"] = Field(
        default="tokens",
        description="What a prefill replica does when its start-up probe finds its engine's "
        "block hashes differ from ours: 'tokens' re-hashes the token ids its KV events carry "
        "(the index keeps working, counted in hash_fallbacks), 'refuse' fails the replica.",
    )

    @model_validator(mode="after")
    def _seed_for_xxhash(self) -> HashingConfig:
        """Replaces :class:`~cluster.hashing.HashConfig`'s check of the same name (pydantic
        runs the subclass's), naming the section's field."""
        if self.seed is not None and int(self.seed) > 4294967295:
            raise ValueError(f"hashing.seed: {self.seed} is above 4294967295")
        if self.algo.startswith("xxhash") and self.seed is None:
            raise ValueError(
                f"hashing.seed: algo={self.algo!r} needs a seed (unseeded xxhash engines get a "
                "random NONE_HASH per process)"
            )
        return self

    def hash_config(self) -> HashConfig:
        """The plain :class:`cluster.hashing.HashConfig` of these settings (``on_mismatch`` is
        the replica's business, not the hasher's)."""
        return HashConfig(algo=self.algo, block_size=self.block_size, seed=self.seed)
