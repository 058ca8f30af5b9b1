"""The narrow value types that cross the ingress -> engine replica boundary (pickled by Serve)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# The engine's refusal of a request's parameters is raised by the engine runtimes
# (engines/, which may not import deployments); it crosses this boundary as one of its types.
from engines.refusal import EngineDown as EngineDown
from engines.refusal import EngineRefused as EngineRefused

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


#: Keys of vLLM's ``SamplingParams.extra_args`` that vLLM itself reads (the KV and encoder
#: cache hand-offs): the engine replicas set them, a request never does.
ENGINE_EXTRA_ARGS = frozenset({"kv_transfer_params", "ec_transfer_params"})


def engine_extra_args(
    asked: Mapping[str, Any] | None, kv_params: Mapping[str, Any] | None
) -> dict[str, Any] | None:
    """The ``extra_args`` an engine call runs with: the request's own (its ``vllm_xargs``,
    which the ingress let through its allow-list) without any of :data:`ENGINE_EXTRA_ARGS`,
    plus this call's own KV hand-off (``kv_params``: a prefill's :data:`PREFILL_KV_PARAMS`,
    a decode's pull of the prefill's output, or nothing when the engine computes the prompt
    itself). Used on every path, so no request field can steer a transfer."""
    out = {k: v for k, v in (asked or {}).items() if k not in ENGINE_EXTRA_ARGS}
    if kv_params:
        out["kv_transfer_params"] = dict(kv_params)
    return out or None


@dataclass(frozen=True)
class Sampling:
    """A request's sampling: a summary the ingress and the routers read, and ``params``, the
    keyword arguments of the whole ``vllm.SamplingParams`` the ingress built with vLLM's own
    OpenAI request models (penalties, ``top_k``, ``logprobs``, structured output, ...).

    ``params`` is ``None`` for internal requests (probes, benchmarks), which the summary
    fields describe completely. The engine replicas derive each role's parameters from it:
    the prefill keeps ``prompt_logprobs`` and runs one token; the decode keeps the rest and
    runs ``n`` sequences (``seed + i`` for sequence ``i``, as vLLM's parallel sampling does).
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    params: dict[str, Any] | None = None

    def to_vllm_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``vllm.SamplingParams`` (the whole request's, ``n`` included)."""
        if self.params is not None:
            return dict(self.params)
        return {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "stop": list(self.stop) or None,
            "ignore_eos": self.ignore_eos,
            "n": self.n,
            "logprobs": self.logprobs,
            "prompt_logprobs": self.prompt_logprobs,
        }


@dataclass(frozen=True)
class TokenLogprob:
    """One position's log-probabilities: the token there and the engine's candidates
    ``(token_id, text, logprob, rank)`` in vLLM's order (the token itself first, then the top
    ones). ``logprob`` is ``None`` for a prompt's first token, which has none."""

    token_id: int
    token: str | None
    logprob: float | None
    top: tuple[tuple[int, str | None, float, int | None], ...] = ()


@dataclass(frozen=True)
class RouteHint:
    """What the ingress learned about a request before routing it (read by the routers in
    :mod:`deployments.router`; the replicas ignore it).

    ``matches`` maps a prefill replica id (Serve's replica id) to the prompt tokens of the
    leading blocks it holds, by the prefix index; ``None`` when the index gave no answer in
    time (the router then routes by load and counts ``index_unavailable``). ``block_hashes``
    are the prompt's block hashes, so the router can count the blocks it has sent to a replica
    that the index does not show yet (:class:`controllers.routing.InflightPrefixes`). ``pin``
    forces a replica, prefill or decode (the ingress's warm-up of each replica pair, tests);
    when it is gone the router counts ``pinned_replica_gone`` and routes as usual. ``avoid``
    names replicas the call must not go to while another can take it (a migrated stream's
    lost decode replicas, whose engine may have failed before Serve's health check noticed),
    counted as ``lost_replica_avoided``.
    """

    prompt_tokens: int
    matches: dict[str, int] | None = None
    expected_output_tokens: int = 1
    pin: str | None = None
    block_hashes: tuple[int, ...] = ()
    avoid: tuple[str, ...] = ()


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
    #: the W3C trace headers of the ingress's call span (the replica's span is its child)
    trace: dict[str, str] | None = None


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
    #: which of the request's ``n`` sequences this chunk belongs to
    index: int = 0
    #: per generated token in this chunk (when ``logprobs`` was asked)
    logprobs: tuple[TokenLogprob, ...] | None = None
    #: per prompt token, ``None`` for the first (a prefill's result, when asked)
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
