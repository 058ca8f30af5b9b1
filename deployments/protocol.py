"""The narrow value types that cross the ingress -> engine replica boundary (pickled by Serve)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: ``kv_transfer_params`` a prefill request carries so the producer keeps its KV for a remote
#: decode (vLLM's NIXL protocol; the same dict vLLM's own PD proxy sends).
PREFILL_KV_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


@dataclass(frozen=True)
class Sampling:
    """The sampling parameters the PD path honours (an OpenAI request's subset)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def to_vllm_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``vllm.SamplingParams``."""
        return {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "stop": list(self.stop) or None,
            "ignore_eos": self.ignore_eos,
        }


@dataclass(frozen=True)
class RouteHint:
    """What the ingress learned about a request before routing it (read by the routers in
    :mod:`deployments.router`; the replicas ignore it).

    ``matches`` maps a prefill replica id (Serve's replica id) to the prompt tokens of the
    leading blocks it holds, by the prefix index; ``None`` when the index gave no answer in
    time (the router then routes by load and counts ``index_unavailable``). ``block_hashes``
    are the prompt's block hashes, so the router can count the blocks it has sent to a replica
    that the index does not show yet (:class:`controllers.routing.InflightPrefixes`). ``pin``
    forces a replica (tests); when it is gone the router counts ``pinned_replica_gone`` and
    routes as usual.
    """

    prompt_tokens: int
    matches: dict[str, int] | None = None
    expected_output_tokens: int = 1
    pin: str | None = None
    block_hashes: tuple[int, ...] = ()


@dataclass(frozen=True)
class EngineRequest:
    """One request to an engine replica.

    ``prompt_token_ids`` are already tokenized by the ingress; ``cache_salt`` isolates a tenant's
    prefix cache; ``kv_transfer_params`` is the prefill's output for a decode request and ``None``
    for a prefill request (the replica adds :data:`PREFILL_KV_PARAMS`).
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: Sampling
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    route: RouteHint | None = None


@dataclass(frozen=True)
class EngineChunk:
    """One streamed piece of an engine's output (deltas), or a prefill's whole result.

    ``num_cached_tokens`` is the engine's local prefix-cache hit (0 on the decode side of a
    transfer); ``engine_s`` is the time the replica spent from receiving the request to emitting
    this chunk (monotonic seconds), which lets the ingress measure its own overhead;
    ``replica_id`` is the Serve replica id of the replica that produced it.
    """

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    engine_s: float
    kv_transfer_params: dict[str, Any] | None = None
    stop_reason: str | int | None = None
    replica_id: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
