"""One request inside the ingress: what ``prepare`` found (fixed for the request's life) and
what changes as it runs (its spans, phase times, reservation, queue slot, pending KV).

:class:`Prepared` is frozen: who sent it, its tokens and sampling, its block hashes, how its
response is shaped, its deadline. Its :class:`RunState` (``prep.run``) is the only part a
phase writes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from controllers.tenants import Bucket
from deployments.ingress.auth import ANONYMOUS
from deployments.ingress.openai_requests import usage
from deployments.ingress.openai_responses import LogprobFormat
from deployments.ingress.parsing import ChatParsing
from deployments.protocol import EngineChunk, RouteHint, Sampling

if TYPE_CHECKING:
    from deployments.ingress.responses_api import ResponsesRequest


@dataclass
class RunState:
    """What changes while a request runs; settled when it ends
    (:meth:`deployments.ingress.core.IngressCore._settle`)."""

    #: wall seconds per phase (filled as the request goes; see ``StatsView.phases``)
    timing: dict[str, float] = field(default_factory=dict)
    #: when the decode's last chunk arrived (monotonic; the ``respond`` phase starts there)
    last_chunk_at: float | None = None
    #: when the decode's first chunk arrived (monotonic): the ingress's time to first token
    first_chunk_at: float | None = None
    #: the request's root span (``pdserve.request``), ended with the response (by the first
    #: prompt of a batch only)
    span: Any = None
    #: the span its phase spans go under (the root; a batch's prompts share it)
    parent: Any = None
    #: the tenant's tokens bucket and the output tokens reserved in it (given back unused)
    reserved: tuple[Bucket, int] | None = None
    #: uncached prompt tokens this request counts in the ingress's prefill queue while its
    #: prefill runs (None: not counted)
    queued_tokens: int | None = None
    #: the index's answer for the prompt (colocated mode routes the whole request by it)
    hint: RouteHint | None = None
    #: prompt tokens the engine that computed the prompt found cached, when that was the
    #: decode (or colocated) engine rather than a prefill replica
    local_cached: int | None = None
    #: output tokens that reached the response so far (the reservation's used part)
    produced: int = 0
    #: a streamed response holds this request: its close settles it, not the handler's end
    stream_owned: bool = False
    #: the prefill's result while no decode call has taken its KV (released if none will)
    kv_pending: EngineChunk | None = None
    #: decode replicas its decode call must not go to (a migration's lost ones)
    avoid: tuple[str, ...] = ()


@dataclass(frozen=True)
class Prepared:
    """A request after the ``prepare`` phase: who sent it, its tokens, sampling and hashes,
    how its response is to be shaped, and its deadline. Fixed; ``run`` is what changes."""

    rid: str
    chat: bool
    tenant: str
    ids: tuple[int, ...]
    sampling: Sampling
    hashes: dict[str, list[int]]
    stream: bool
    with_usage: bool
    t0: float
    #: the request's deadline (monotonic seconds): ``ingress.request_timeout_s`` from its
    #: arrival, or less when the client asked (``X-Request-Timeout``)
    deadline: float = math.inf
    #: the engines' cache namespace: the tenant, plus the request's own ``cache_salt``
    salt: str = ANONYMOUS
    #: the engines' request id (unique even when a client reuses ``request_id``)
    engine_rid: str = ""
    #: log-probabilities asked for, and in which form
    fmt: LogprobFormat | None = None
    #: text the response starts with (``echo``): the prompt, or chat's last assistant message
    echo: str | None = None
    #: completions ``echo`` with ``max_tokens`` 0: the prompt back, no decode
    echo_only: bool = False
    #: ``return_token_ids``: token ids in each choice (and the prompt's)
    token_ids: bool = False
    #: top-level response fields vLLM adds on request (``prompt_text``, ...)
    extra: dict[str, Any] = field(default_factory=dict)
    #: a chat's tool-call and reasoning parsing (``None``: the server runs no parser)
    parsing: ChatParsing | None = None
    #: a Responses API request (``/v1/responses``) as the client sent it: it runs as the chat
    #: it became, and its response is laid out from it (``None``: completions or chat)
    responses: ResponsesRequest | None = None
    #: what changes as the request runs
    run: RunState = field(default_factory=RunState)


def cached_tokens(prep: Prepared, pre: EngineChunk) -> int:
    """Prompt tokens found cached by the engine that computed the prompt."""
    return prep.run.local_cached if prep.run.local_cached is not None else pre.num_cached_tokens


def endpoint_of(prep: Prepared) -> str:
    if prep.responses is not None:
        return "responses"
    return "chat" if prep.chat else "completions"


class Tally:
    """Per part of a response (one prompt of a batch) its tokens out and last chunk, as the
    merged chunks go by; part ``k`` owns choices ``k*n .. k*n+n-1``."""

    def __init__(self, parts: list[tuple[Prepared, EngineChunk]]) -> None:
        self.parts = parts
        self.n = parts[0][0].sampling.n
        self.n_out = [0] * len(parts)
        self.last: list[EngineChunk | None] = [None] * len(parts)

    def take(self, ch: EngineChunk) -> tuple[Prepared, EngineChunk]:
        """Count ``ch``; its part's ``(prep, prefill result)``."""
        k = ch.index // self.n
        self.n_out[k] += len(ch.token_ids)
        self.last[k] = ch
        self.parts[k][0].run.produced += len(ch.token_ids)
        return self.parts[k]

    def usage(self) -> Any:
        """The response's usage, summed over the parts."""
        return usage(
            sum(pre.num_prompt_tokens for _, pre in self.parts),
            sum(self.n_out),
            sum(cached_tokens(prep, pre) for prep, pre in self.parts),
        )
