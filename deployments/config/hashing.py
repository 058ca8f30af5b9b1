"""``hashing``: how KV blocks are hashed, by the engines and the ingress alike."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from deployments.config.common import _Strict
from engines.launch import HashAlgo


class HashingConfig(_Strict):
    """How KV blocks are hashed: given to every engine and to the ingress alike (one field)."""

    algo: HashAlgo = Field(
        default="sha256", description="vLLM's prefix_caching_hash_algo, on every engine."
    )
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
    def _seed(self) -> HashingConfig:
        if self.seed is not None and int(self.seed) > 4294967295:
            raise ValueError(f"hashing.seed: {self.seed} is above 4294967295")
        if self.algo.startswith("xxhash") and self.seed is None:
            raise ValueError(
                f"hashing.seed: algo={self.algo!r} needs a seed (unseeded xxhash engines get a "
                "random NONE_HASH per process)"
            )
        return self

    def hash_config(self) -> Any:
        """The :class:`cluster.hashing.HashConfig` of these settings."""
        from cluster.hashing import HashConfig

        return HashConfig(algo=self.algo, block_size=self.block_size, seed=self.seed)
