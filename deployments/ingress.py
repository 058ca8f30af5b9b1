"""The HTTP ingress: OpenAI's completions and chat completions over the prefill and decode
replicas.

One request goes through named phases (:class:`IngressCore`):

1. ``prepare``: authenticate (API key -> tenant -> cache salt), validate (a 4xx with a reason
   for what the PD path cannot honour), tokenize once and hash the prompt's blocks (in a worker
   thread for long prompts, so the event loop keeps streaming others);
2. ``route``: ask the prefix index which prefill replica holds how much of the prompt (bounded
   by ``index.lookup_timeout_s``; no answer -> routed by load, counted); the answer travels with
   the request as a :class:`~deployments.protocol.RouteHint` that the prefill router
   (:mod:`deployments.router`) weighs against load;
3. ``prefill``: one output token on the chosen prefill replica (NIXL producer);
4. ``decode``: one chunk generator over the decode replica's stream (the decode router picks
   the replica by TWP headroom), shared by both response forms;
5. ``respond``: SSE ending in ``data: [DONE]``, or one JSON body (the ``openai`` package's
   types, laid out as vLLM's server lays them out: ``n`` choices, logprobs, echo).

Each phase is a span of the request's trace, and each request feeds the ``pdserve_*`` metrics
(:mod:`deployments.telemetry`). ``/tokenize`` and ``/detokenize`` are vLLM's routes.

``/health`` is readiness: 200 only when both roles have a replica that served a probe request
and (``ingress.warm_up``) one request has gone through every prefill -> decode replica pair;
every request has a deadline (``ingress.request_timeout_s``, or less by ``X-Request-Timeout``);
``/v1/models`` lists the model. ``/v1/pdserve/stats`` reports every engine replica (its id, the
requests routed to it, prompt and cached tokens, load), the routers' policy and named
fallbacks, the index and the ingress's own overhead. ``/v1/pdserve/route`` explains where a
prompt would go without running it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from opentelemetry import context as otel_context
from opentelemetry import trace as otel_trace
from opentelemetry.trace import Link, SpanKind, Status, StatusCode
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from vllm.exceptions import VLLMClientError

from cluster.tenants import OPERATOR, TENANT_PATTERN, Charge, KeyStore, RateLimiter, hash_key
from controllers.overload import CompletionRate, expected_wait_s, refuse_for
from controllers.tenants import Bucket
from deployments.auth import (
    ANONYMOUS,
    AuthFailures,
    AuthGuard,
    Gate,
    Principal,
    principal_of,
)
from deployments.auth import configure as configure_gate
from deployments.config import (
    AppConfig,
    IngressLiveConfig,
    LiveConfigError,
    parse_live_config,
)
from deployments.http_guard import BodyGuard, configure
from deployments.openai_api import (
    FINISH_REASONS,
    Bounds,
    ChatCompletionRequest,
    ChoiceOut,
    CompletionRequest,
    DetokenizeRequest,
    LogprobFormat,
    RequestError,
    Resolved,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    chat_logprobs,
    check_bounds,
    completion_body,
    completion_logprobs,
    include_usage,
    is_batch,
    new_id,
    prompt_logprobs_json,
    refuse_unsupported,
    sampling_of,
    single_prompt,
    stream_chunk,
    usage,
)
from deployments.prefix import IndexView
from deployments.protocol import (
    EngineChunk,
    EngineRefused,
    EngineRequest,
    RouteHint,
    Sampling,
    TokenLogprob,
)
from deployments.router_registry import (
    directory,
    handle_waits,
    hold_routing,
    router_stats,
    set_routing,
)
from deployments.telemetry import (
    CounterPublisher,
    child,
    extract,
    inject,
    metrics,
    set_attrs,
    tracer,
)
from deployments.template_sandbox import SandboxBusy, SandboxTimeout, TemplateSandbox

log = logging.getLogger(__name__)

api = FastAPI(title="pdserve", description="OpenAI-compatible prefill/decode serving")
api.add_middleware(BodyGuard)
api.add_middleware(AuthGuard)  # added last: runs first, before the body is read
#: the request header by which a client asks for a shorter deadline (seconds)
TIMEOUT_HEADER = "X-Request-Timeout"


def _error(e: RequestError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers or None)


@api.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Starlette's and FastAPI's own errors (unknown route, wrong method, a body FastAPI cannot
    parse) in OpenAI's envelope."""
    return _error(RequestError(str(exc.detail), None, status=exc.status_code))


@api.exception_handler(RequestValidationError)
async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    errs = exc.errors()
    first = errs[0] if errs else {}
    if first.get("type") == "json_invalid":
        pos = next((p for p in first.get("loc", ()) if isinstance(p, int)), None)
        ctx = first.get("ctx") or {}
        where = f" at character {pos}" if pos is not None else ""
        return _error(RequestError(f"the body is not valid JSON{where}: {ctx.get('error', '')}"))
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if not loc and first.get("type") in ("model_attributes_type", "dict_type", "missing"):
        got = type(first.get("input")).__name__
        return _error(RequestError(f"the body must be a JSON object (got {got})"))
    ctx = first.get("ctx") or {}
    param = ".".join(loc) or (ctx.get("param") if isinstance(ctx, dict) else None)
    text = str(first.get("msg") or "invalid request body")
    msg = text if not loc else f"{param}: {text}"
    return _error(RequestError(msg[:1000], param))


@api.exception_handler(VLLMClientError)
async def _vllm_client_error(_: Request, exc: VLLMClientError) -> JSONResponse:
    """vLLM's request models raise their own error from some validators (pydantic passes it
    through): a 400 naming the parameter, as vLLM's server answers it."""
    param = getattr(exc, "parameter", None)
    return _error(RequestError(str(exc).strip()[:500] or "invalid request", param))


def _cancel(call: Any) -> None:
    """Cancel a Serve call left behind by a time-out (Serve does not on an abandoned await)."""
    cancel = getattr(call, "cancel", None)
    if cancel is not None:
        cancel()


def _reason(e: BaseException) -> str:
    """The innermost message of an engine error (Ray wraps the replica's exception)."""
    cause = getattr(e, "cause", None) or e.__cause__ or e
    return str(cause).strip().splitlines()[-1][:300] if str(cause).strip() else type(cause).__name__


def _cause(e: BaseException) -> BaseException:
    """The replica's own exception inside Ray's wrapper."""
    return getattr(e, "cause", None) or e


def _text_of(content: Any, where: str) -> str:
    """A message's content as text: a string, or text parts joined by newlines (vLLM's
    "string" content format); any other part is refused (text-only models)."""
    if content is None or isinstance(content, str):
        return content or ""
    try:
        content = list(content)  # vLLM's Iterable fields validate lazily, here
    except ValidationError as e:
        errs = e.errors()
        msg = errs[0]["msg"] if errs else "invalid content part"
        raise RequestError(f"{where}: {msg}", where) from None
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("text", "input_text", "output_text", "refusal"):
            raise RequestError(
                f"{where}: content part of type {kind!r} is not supported (text only)", where
            )
        text = part.get("refusal") if kind == "refusal" else part.get("text")
        if not isinstance(text, str):
            raise RequestError(f"{where}: a {kind} part needs a string, not {text!r}"[:300], where)
        parts.append(text)
    return "\n".join(parts)


#: ``chat_template_kwargs`` a request may not send: vLLM refuses ``chat_template`` and
#: ``tokenize`` (the template itself, and whether the call returns text); the others are set
#: by the request's own fields or change what HF's ``apply_chat_template`` returns
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "chat_template",
        "tokenize",
        "messages",
        "conversation",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
    }
)


def template_variables(template: str | None) -> frozenset[str]:
    """The variables a chat template reads that it does not set itself (vLLM's
    ``_resolve_chat_template_kwargs``: Jinja's own parser, the template is not run)."""
    if not template:
        return frozenset()
    import jinja2.ext
    import jinja2.meta
    import jinja2.sandbox
    from jinja2.exceptions import TemplateSyntaxError

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(env.parse(template)))
    except TemplateSyntaxError:
        return frozenset()


class Tokenizer:
    """The model's tokenizer and chat template, loaded once per ingress replica (the ingress
    tokenizes once; the engines get token ids)."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(path)
        self.vocab = len(self.tok)
        template = self.tok.chat_template if isinstance(self.tok.chat_template, str) else None
        #: what the model's template reads: the only chat_template_kwargs that reach it
        self.template_vars = template_variables(template)

    def check_ids(self, ids: list[int], where: str) -> list[int]:
        bad = next((t for t in ids if not 0 <= t < self.vocab), None)
        if bad is not None:
            raise RequestError(
                f"{where}: token id {bad} is outside the vocabulary [0, {self.vocab})", where
            )
        return ids

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tok(text, add_special_tokens=add_special_tokens)["input_ids"])

    def decode(self, ids: list[int] | tuple[int, ...], skip_special: bool = False) -> str:
        return str(self.tok.decode(list(ids), skip_special_tokens=skip_special))

    def token_text(self, token_id: int) -> str:
        return self.decode([token_id])

    def completion_prompt(
        self, prompt: Any, add_special_tokens: bool
    ) -> tuple[list[int], str | None]:
        """``(token ids, prompt text)`` of one completion prompt: the text when it came as
        text, ``None`` when it came as token ids (decoded only if ``echo`` needs it)."""
        p = single_prompt(prompt)
        if isinstance(p, list):
            return self.check_ids(p, "prompt"), None
        return self.encode(p, add_special_tokens), p

    def template_job(self, req: Any, template_vars: frozenset[str]) -> dict[str, Any]:
        """What rendering ``req`` takes: its messages (content parts as text) and the
        template's keyword arguments, as vLLM passes them: tools and documents, and those
        ``chat_template_kwargs`` the template reads (``template_vars``; others are dropped,
        as vLLM drops them). A reserved kwarg (:data:`RESERVED_TEMPLATE_KWARGS`) is a 400
        naming it."""
        msgs = []
        for i, m in enumerate(req.messages):
            d = dict(m)
            d["content"] = _text_of(d.get("content"), f"messages.{i}.content")
            msgs.append(d)
        asked: dict[str, Any] = dict(getattr(req, "chat_template_kwargs", None) or {})
        reserved = sorted(set(asked) & RESERVED_TEMPLATE_KWARGS)
        if reserved:
            name = f"chat_template_kwargs.{reserved[0]}"
            raise RequestError(
                f"{name}: may not be set by a request (vLLM refuses it too); "
                + (
                    "a request's own template goes in the 'chat_template' field, and only "
                    "when the operator trusts them (ingress.trust_request_chat_template)"
                    if reserved[0] == "chat_template"
                    else "it is set by the request's own fields or by pdserve"
                ),
                name,
            )
        kwargs = {k: v for k, v in asked.items() if k in template_vars}
        effort = getattr(req, "reasoning_effort", None)
        if effort is not None:
            kwargs.setdefault("reasoning_effort", effort)
        tools = getattr(req, "tools", None)
        documents = getattr(req, "documents", None)
        return {
            "messages": msgs,
            "tools": [t.model_dump(mode="json", exclude_none=True) for t in tools]
            if tools
            else None,
            "documents": documents or None,
            "add_generation_prompt": req.add_generation_prompt,
            "continue_final_message": req.continue_final_message,
            "kwargs": kwargs,
        }

    def render(self, job: dict[str, Any]) -> str:
        """``job`` (:meth:`template_job`) through the model's own chat template."""
        kwargs = dict(job["kwargs"])
        for name in ("tools", "documents"):
            if job.get(name):
                kwargs[name] = job[name]
        try:
            return str(
                self.tok.apply_chat_template(
                    job["messages"],
                    tokenize=False,
                    add_generation_prompt=job["add_generation_prompt"],
                    continue_final_message=job["continue_final_message"],
                    **kwargs,
                )
            )
        except Exception as e:  # the template refuses the conversation (roles, kwargs, ...)
            raise RequestError(f"messages: the chat template refused them: {e}", "messages") from e

    def special_tokens(self) -> dict[str, Any]:
        """The template variables ``apply_chat_template`` adds (``bos_token``, ...), for a
        template rendered elsewhere (:mod:`deployments.template_sandbox`)."""
        return {k: v for k, v in self.tok.special_tokens_map.items() if isinstance(v, str)}


def model_defaults(path: str) -> dict[str, Any]:
    """The model's default sampling values (vLLM's ``default_sampling_params``: the keys of
    its ``generation_config.json`` that vLLM's server applies)."""
    f = Path(path) / "generation_config.json"
    if not f.is_file():
        return {}
    cfg = json.loads(f.read_text())
    keys = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p")
    out = {k: cfg[k] for k in keys if cfg.get(k) is not None}
    if cfg.get("max_new_tokens") is not None:
        out["max_tokens"] = cfg["max_new_tokens"]
    return out


@dataclass
class Prepared:
    """A request after the ``prepare`` phase: who sent it, its tokens, sampling and hashes,
    and how its response is to be shaped."""

    rid: str
    chat: bool
    tenant: str
    ids: tuple[int, ...]
    sampling: Sampling
    hashes: dict[str, list[int]]
    stream: bool
    with_usage: bool
    t0: float
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
    #: wall seconds per phase (filled as the request goes; see ``IngressCore.phases``)
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
    #: the request's deadline (monotonic seconds): ``ingress.request_timeout_s`` from its
    #: arrival, or less when the client asked (``X-Request-Timeout``)
    deadline: float = math.inf
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


#: Statistics of the directory reports shown per replica in ``/v1/pdserve/stats``.
_REPORT_KEYS = (
    "warm",
    "first_call",
    "requests",
    "prompt_tokens",
    "cached_tokens",
    "queued_uncached_tokens",
    "waiting",
    "running",
    "kv_usage",
    "free_kv_blocks",
    "kv_pinned_requests",
    "window_tokens",
    "token_load",
    "hash_mode",
    "external_hits",
    "prefix_hits",
    "kv_load_failures",
    "requests_aborted",
    "kv_released",
    "requests_finished",
    "requests_in_flight",
    "total_kv_blocks",
    "tracked_blocks",
    "wedged",
    "runtime",
    "pid",
    "loop_lag",
    "rss_mb",
)


class IngressCore:
    """The ingress logic, independent of Serve's decorators (handles are injected).

    ``prefill`` and ``decode`` are Serve deployment handles (or any object with the same
    ``.prefill/.decode/.ready/.stats`` methods returning awaitables / async iterators via
    ``.remote``, and ``.options``). ``app_name`` names the Serve application, whose routers'
    replica directories (:func:`deployments.router_registry.directory`) the index follows;
    ``replica_id`` is this ingress replica's (reported in each non-streamed response's
    ``pdserve`` field with the prefill and decode replicas that served it).
    """

    def __init__(
        self,
        config: dict[str, Any],
        prefill: Any,
        decode: Any,
        app_name: str = "pdserve",
        replica_id: str = "local",
    ) -> None:
        self.cfg = AppConfig.model_validate(config)
        self.app_name = app_name
        self.replica_id = replica_id
        # options() builds each handle's router now, so the directories fill before traffic
        self.prefill = prefill.options()
        self.decode = decode.options()
        self.decode_stream = decode.options(stream=True)
        #: colocated mode: ``decode`` is the one engine deployment, which does both phases
        self.colocated = self.cfg.mode == "colocated"
        self.tokenizer = Tokenizer(str(self.cfg.model.resolved_path()))
        self.defaults = model_defaults(str(self.cfg.model.resolved_path()))
        self.model_name = self.cfg.model.served_name
        self.tracer = tracer(self.cfg.observability.tracing.model_dump(), "ingress")
        self.metrics = metrics()
        self._feed_events = CounterPublisher("pdserve_index_feed_events")
        self.index = IndexView(self.cfg, app_name)
        self.keys, self.limiter = _tenancy(self.cfg, app_name)
        ing = self.cfg.ingress
        self.gate = Gate(
            ing.auth,
            self.keys,
            self.limiter,
            self._bucket_specs,
            AuthFailures(ing.max_auth_failures, ing.auth_failures_per_minute),
            self._refused_by,
        )
        configure_gate(self.gate)
        configure(ing.max_body_bytes, ing.max_json_depth)
        self.bounds = Bounds(
            allowed_vllm_xargs=frozenset(ing.allowed_vllm_xargs),
            max_stop_sequences=ing.max_stop_sequences,
            max_logit_bias=ing.max_logit_bias,
            max_request_id_chars=ing.max_request_id_chars,
        )
        #: rendering and tokenizing of long prompts: two threads of their own, so a burst of
        #: long prompts queues here and never takes the default executor's threads
        self._prep_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="pdserve-prep")
        #: request-supplied chat templates (ingress.trust_request_chat_template only)
        self.sandbox = TemplateSandbox() if ing.trust_request_chat_template else None
        #: prompts refused because rendering or tokenizing passed ingress.render_timeout_s
        self.render_timeouts = 0
        #: output tokens reserved per tenant by requests still running (each reservation is
        #: settled when its request ends, however it ends: 0 once a tenant's requests are done)
        self.reserved_tokens: dict[str, int] = {}
        #: /health: the last answer and when it was made (reused for ingress.health_cache_s),
        #: and the check in flight (concurrent probes wait for the same one)
        self._health: tuple[float, JSONResponse] | None = None
        self._health_task: asyncio.Task[JSONResponse] | None = None
        self._background: set[asyncio.Task[None]] = set()
        self.directories = {
            "prefill": directory(app_name, "prefill"),
            "decode": directory(app_name, "decode"),
        }
        self._sync_task: asyncio.Task[None] | None = None
        self._synced_version = -1
        self.overhead_s: deque[float] = deque(maxlen=4096)
        #: per phase, the last requests' seconds outside the engines: ``prepare`` (auth,
        #: tokenize, hash), ``route`` (index lookup), ``prefill`` (the prefill call's wall
        #: time minus the replica's engine time: routing, transport, queueing in Serve),
        #: ``decode_first`` (the same up to the decode's first chunk), ``decode`` (up to its
        #: last), ``respond`` (after the last chunk until the response is done)
        self.phases: dict[str, deque[float]] = {
            k: deque(maxlen=4096)
            for k in (
                "prepare",
                "route",
                "cold_start",
                "prefill",
                "decode_first",
                "decode",
                "respond",
            )
        }
        #: serverless: a role's calls waited at its handle while it started from zero
        #: (``cold_start`` above: those waits, taken out of ``prefill``/``decode_first``)
        self.autoscaling = self.cfg.autoscaling.enabled
        self.waits = {role: handle_waits(app_name, role) for role in ("prefill", "decode")}
        self.cold_start_waits = {"prefill": 0, "decode": 0}
        self.cold_start_last_s: dict[str, float | None] = {"prefill": None, "decode": None}
        self.requests = 0
        self.refused = 0
        #: overload control: prompts in flight at the prefill from this ingress, their
        #: uncached tokens, the most ever in flight, and the 503s given
        self._inflight_prefill = 0
        self._inflight_uncached = 0
        self.inflight_peak = 0
        #: the engines' completions per second (from their reports), for the wait bound
        self._completions = CompletionRate(window_s=20.0)
        #: the engine replicas the rate was measured over
        self._rate_replicas: frozenset[str] = frozenset()
        #: the last expected queueing time (s; Little's law), None while unknown
        self.expected_wait_s: float | None = None
        #: requests refused because the expected wait passed ingress.max_expected_wait_s
        self.wait_refused = 0
        self.overload_refused = 0
        #: requests answered 504 because their deadline passed (both engines aborted them)
        self.deadline_exceeded = 0
        #: requests sent again after their replica died before the client got anything
        self.replica_retries = {"prefill": 0, "decode": 0}
        #: prefill KV released at once for decode calls withdrawn before any decode replica
        #: took them (:meth:`_release_unsent`): sent, freed by the holder, failed
        self.kv_released = {"sent": 0, "freed": 0, "failed": 0}
        #: requests prefilled on their decode replica (conditional disaggregation)
        self.decode_local = 0
        #: warm-up: (prefill, decode) replica pairs a request has gone through, the task
        #: warming the rest, failures, and seconds per warmed pair
        self._warm: set[tuple[str, str]] = set()
        self._warming: asyncio.Task[None] | None = None
        #: the directories' versions the sync loop last looked for new pairs at
        self._warm_checked: tuple[int, int] | None = None
        self._warm_seq = 0
        self._was_warm = False
        self.warm_up_failures = 0
        self.warm_up_s: list[float] = []
        #: user_config changes applied and refused, and the last refusal
        self.live_applied = 0
        self.live_refused = 0
        self.live_error: str | None = None

    # -- live reconfiguration (Serve's user_config) ------------------------------------------
    def reconfigure(self, user_config: dict[str, Any] | None) -> None:
        """Serve's ``user_config`` of the ingress: routing parameters
        (:class:`~deployments.config.IngressLiveConfig`) for both routers' next decisions, no
        restart. A bad value is refused with the field named (logged, and in
        ``/v1/pdserve/stats`` under ``ingress.live_config``); the old values stay."""
        try:
            live = parse_live_config(IngressLiveConfig, user_config)
            if live.routing is not None:
                old, new = self.cfg.routing, live.routing
                if new.stats_period_s != old.stats_period_s:
                    raise LiveConfigError(
                        "user_config.routing.stats_period_s: Serve's polling period changes "
                        "only with a redeploy (the old values stay)"
                    )
                if (new.policy == "serve_default") != (old.policy == "serve_default"):
                    raise LiveConfigError(
                        f"user_config.routing.policy: {old.policy} -> {new.policy} changes the "
                        "router class, which needs a redeploy (the old values stay)"
                    )
                self.cfg = self.cfg.model_copy(update={"routing": new})
                set_routing(self.app_name, new.model_dump(mode="json"))
        except LiveConfigError as e:
            self.live_error = str(e)
            self.live_refused += 1
            log.error("ingress %s: %s", self.replica_id, e)
            return
        self.live_error = None
        self.live_applied += 1

    # -- background: follow the prefill replicas ---------------------------------------------
    def _ensure_started(self) -> None:
        if self._sync_task is None or self._sync_task.done():
            loop = asyncio.get_running_loop()
            self._sync_task = loop.create_task(self._sync_loop())
            if self.sandbox is not None:  # its child starts now, not on a request
                task = loop.create_task(self.sandbox.start())
                self._background.add(task)
                task.add_done_callback(self._background.discard)

    async def _sync_loop(self, period_s: float = 0.2) -> None:
        _own_serve_request_id(detach=True)  # started from a request, outlives it
        while True:
            await self.sync_index()
            if self.cfg.ingress.warm_up and not self.colocated:
                self._warm_new_pairs()
            feed = self.index.feed  # memory backend: this ingress follows the replicas' events
            if feed is not None:
                for rid, rf in list(feed.replicas.items()):
                    self._feed_events.publish(rf.stats, replica=rid)
                    self._feed_events.publish(rf.tracker.stats, replica=rid)
            await asyncio.sleep(period_s)  # a polling period, not a synchronisation

    async def sync_index(self) -> None:
        """Reconcile the index view with the prefill replicas Serve runs now."""
        d = self.directories["prefill"]
        if d.version != self._synced_version:
            version = d.version
            await self.index.sync(d.snapshot())
            self._synced_version = version

    # -- auth and limits -----------------------------------------------------------------
    async def principal(self, request: Request) -> Principal:
        """Who sent ``request``: what :class:`~deployments.auth.AuthGuard` decided from its
        headers before the body was read, or (a caller that came around the guard) the same
        decision taken now. Raises :class:`RequestError` (401, 403, 429, 503)."""
        who = principal_of(request.scope)
        if who is None:
            client = request.client.host if request.client else None
            headers = {k.lower(): v for k, v in request.headers.items()}
            who = await self.gate.check(request.method, request.url.path, headers, client)
        if who is None:  # an open route: nobody in particular
            return Principal(ANONYMOUS)
        return who

    def _bucket_specs(self, tenant: str) -> dict[str, tuple[float, float]]:
        return self.cfg.tenants.limits(tenant).buckets()

    def _refused_by(self, tenant: str, reason: str) -> None:
        self.metrics.inc("pdserve_auth_refused", tenant=tenant, reason=reason)
        if reason == "rate_limited":
            self.metrics.inc("pdserve_rate_limited", tenant=tenant, limit="requests")

    async def admit(self, prep: Prepared) -> None:
        """Take the request's prompt plus requested output tokens (``max_tokens x n``) from
        its tenant's tokens bucket, or raise 429 with ``Retry-After`` (400 when it could never
        fit). The requests bucket was charged before the body was read
        (:class:`~deployments.auth.Gate`)."""
        spec = self._bucket_specs(prep.tenant).get("tokens")
        if spec is None:
            return
        out = prep.sampling.max_tokens * prep.sampling.n
        bucket = Bucket(*spec)
        cost = float(len(prep.ids) + out)
        if cost > bucket.capacity:
            e = RequestError(
                f"this request needs {int(cost)} tokens (prompt {len(prep.ids)} + "
                f"max_tokens {prep.sampling.max_tokens} x n {prep.sampling.n}), above this "
                f"tenant's tokens_per_minute of {int(bucket.capacity)}: ask for fewer",
                "max_tokens",
            )
            e.tokenized = len(prep.ids)
            raise e
        v = await self.limiter.admit(prep.tenant, [Charge("tokens", bucket, cost)])
        if not v.allowed:
            wait = max(1, math.ceil(v.retry_after_s))
            self.metrics.inc("pdserve_rate_limited", tenant=prep.tenant, limit="tokens")
            e = RequestError(
                f"tenant {prep.tenant!r} is over its tokens per minute limit; retry after {wait} s",
                None,
                status=429,
                headers={"Retry-After": str(wait)},
                code="rate_limit_exceeded",
            )
            e.tokenized = len(prep.ids)
            raise e
        prep.reserved = (bucket, out)
        self.reserved_tokens[prep.tenant] = self.reserved_tokens.get(prep.tenant, 0) + out

    async def charge_tokens(self, tenant: str, tokens: int) -> None:
        """Charge ``tokens`` of work already done (tokenized) to ``tenant``'s tokens bucket,
        however full it is (:meth:`cluster.tenants.RateLimiter.charge`)."""
        spec = self._bucket_specs(tenant).get("tokens")
        if spec is not None and tokens > 0 and tenant != OPERATOR:
            await self.limiter.charge(tenant, "tokens", Bucket(*spec), float(tokens))

    def _give_back(self, prep: Prepared) -> None:
        """Return the reserved output tokens the request did not produce (once)."""
        if prep.reserved is None:
            return
        bucket, out = prep.reserved
        prep.reserved = None
        left = self.reserved_tokens.get(prep.tenant, 0) - out
        if left > 0:
            self.reserved_tokens[prep.tenant] = left
        else:
            self.reserved_tokens.pop(prep.tenant, None)
        produced = prep.produced
        if out > produced:
            task = asyncio.get_running_loop().create_task(
                self.limiter.give_back(prep.tenant, "tokens", bucket, out - produced)
            )
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    def admit_prefill(self, parts: list[tuple[Prepared, RouteHint]]) -> None:
        """Overload control: refuse with 503 and ``Retry-After`` when these prompts would take
        the prefill queue past its bounds (``ingress.max_queued_*_per_replica`` times the
        prefill replicas). The queue is the larger of this ingress's own requests in flight
        at the prefill and what the replicas last reported, so a refusal costs nothing and
        nothing admitted is slowed. Admitted prompts count as in flight until their prefill
        returns (:meth:`run_prefill`); no ``await`` between check and count."""
        self.check_wait()
        add_req = len(parts)
        tokens = [_uncached(prep, hint) for prep, hint in parts]
        add_tok = sum(tokens)
        self._overloaded(add_req, add_tok)
        for (prep, _), n in zip(parts, tokens, strict=True):
            prep.queued_tokens = n
        self._inflight_prefill += add_req
        self._inflight_uncached += add_tok
        self.inflight_peak = max(self.inflight_peak, self._inflight_prefill)

    def check_wait(self) -> None:
        """Overload control in seconds (:mod:`controllers.overload`): refuse with 503 and
        ``Retry-After`` when the requests waiting in the engines (queued, not running, from
        the replicas' reports) over the engines' completion rate pass
        ``ingress.max_expected_wait_s``: the time the queue ahead of a new request takes to
        drain. Running requests do not count: below saturation the completion rate is the
        load, not the capacity, and they made a lone client's request read as a long wait."""
        bound = self.cfg.ingress.max_expected_wait_s
        if not bound:
            return
        decode = self.directories["decode"].snapshot()
        rows = {**self.directories["prefill"].snapshot(), **decode}  # an engine counted once
        done = decode or rows  # a request finishes on its decode engine
        now = time.monotonic()
        replicas = frozenset(rows)
        if replicas != self._rate_replicas:
            # capacity changed (a replica started, left, or the pool came up from zero): the
            # rate measured before says nothing of the new capacity, so it starts afresh (and
            # is unknown, so nothing is refused, until it has been measured again)
            self._rate_replicas = replicas
            self._completions = CompletionRate(window_s=self._completions.window_s)
        self._completions.add(now, sum(int(r.get("requests_finished") or 0) for r in done.values()))
        waiting = sum(int(r.get("waiting") or 0) for r in rows.values())
        wait = expected_wait_s(waiting, self._completions.rate())
        self.expected_wait_s = wait
        retry = refuse_for(wait, bound)
        if retry is None:
            return
        assert wait is not None
        self.wait_refused += 1
        what = (
            f"{waiting} requests waiting in the engines, about {wait:.0f} s to drain "
            f"(bound {bound:g} s)"
        )
        raise self._overload_error(what, retry)

    def _overload_error(self, what: str, retry_after_s: int) -> RequestError:
        """The overload 503 (counted), with ``Retry-After``."""
        self.overload_refused += 1
        return RequestError(
            f"overloaded: {what}; retry after {retry_after_s} s",
            None,
            status=503,
            headers={"Retry-After": str(retry_after_s)},
            code="overloaded",
        )

    def _overloaded(self, add_req: int, add_tok: int) -> None:
        """Raise the overload 503 when ``add_req`` more prompts (``add_tok`` uncached tokens)
        would pass a bound (``add_req=0``: when the request bound is already reached)."""
        ing = self.cfg.ingress
        reports = self.directories["prefill"].snapshot()
        n = max(1, len(reports))
        reported_req = sum(int(r.get("waiting") or 0) for r in reports.values())
        reported_tok = sum(int(r.get("queued_uncached_tokens") or 0) for r in reports.values())
        queued = max(self._inflight_prefill, reported_req)
        tokens = max(self._inflight_uncached, reported_tok)
        cap_req = ing.max_queued_requests_per_replica * n
        cap_tok = ing.max_queued_uncached_tokens_per_replica * n
        what = None
        if queued + max(1, add_req) > cap_req:
            what = f"{queued} requests queued at {n} prefill replica(s) (bound {cap_req})"
        elif add_tok and tokens > 0 and tokens + add_tok > cap_tok:
            what = f"{tokens} uncached prompt tokens queued at {n} prefill replica(s) (bound {cap_tok})"
        if what is not None:
            raise self._overload_error(what, ing.overload_retry_after_s)

    # -- endpoints -----------------------------------------------------------------------
    async def health(self) -> JSONResponse:
        """Readiness: 200 once both roles have a replica that served a probe and (with
        ``ingress.warm_up``) one request has gone from every prefill replica to every decode
        replica, so the NIXL handshakes and the engines' first-use costs are paid before the
        first client's request; 503 ``starting`` or ``warming`` before.

        Open to anyone, so cheap: one answer serves every probe for ``ingress.health_cache_s``
        and concurrent probes share one check, so probes cost the engines at most one
        readiness call per role per that many seconds."""
        self._ensure_started()
        cached = self._health
        if cached is not None and time.monotonic() - cached[0] < self.cfg.ingress.health_cache_s:
            return cached[1]
        if self._health_task is None or self._health_task.done():
            self._health_task = asyncio.get_running_loop().create_task(self._check_health())
        resp = await asyncio.shield(self._health_task)
        self._health = (time.monotonic(), resp)
        return resp

    async def _check_health(self) -> JSONResponse:
        # shared by every probe that comes while it runs: none of them owns its calls (the
        # first one's time-out would have Serve cancel them under the others)
        _own_serve_request_id(detach=True)
        t = self.cfg.ingress.health_timeout_s
        status: dict[str, Any] = {}
        roles = (
            (("prefill", self.prefill),)
            if self.colocated
            else (
                ("prefill", self.prefill),
                ("decode", self.decode),
            )
        )
        at_zero = False
        for role, h in roles:
            if self.autoscaling and not self.directories[role].snapshot():
                # serverless: no replica runs (scaled to zero, or starting). Ready all the
                # same: a request waits for the cold start. No probe either: a probe queued
                # at the handle would start a replica, and the load balancer's probes would
                # keep the pool from ever idling.
                status[role], at_zero = "zero_replicas", True
                continue
            try:
                status[role] = bool(await asyncio.wait_for(h.ready.remote(), t))
            except Exception as e:  # not ready, or not reachable in time
                status[role] = f"not ready: {type(e).__name__}"
        ok = all(v is True or v == "zero_replicas" for v in status.values())
        body: dict[str, Any] = {"status": "ok" if ok else "starting", "engines": status}
        if ok and not at_zero and self.cfg.ingress.warm_up and not self.colocated:
            left = self._pairs_to_warm()
            if left is None or left:
                self._start_warm_up(left or [])
                # once ready, replicas that join later warm in the background: a scale-up
                # must not take the whole endpoint out of its load balancer
                if not self._was_warm:
                    ok = False
                    body["status"] = "warming"
            else:
                self._was_warm = True
            body["warm_up"] = {"pairs_warmed": len(self._warm), "pairs_left": len(left or [])}
        return JSONResponse(body, status_code=200 if ok else 503)

    # -- warm-up: one request through every prefill -> decode pair before ready -------------
    def _pairs_to_warm(self) -> list[tuple[str, str]] | None:
        """The (prefill, decode) replica pairs no request has gone through yet; ``None``
        while the routers have not listed both roles' replicas."""
        pre = sorted(self.directories["prefill"].snapshot())
        dec = sorted(self.directories["decode"].snapshot())
        if not pre or not dec:
            return None
        current = {(p, d) for p in pre for d in dec}
        self._warm &= current  # pairs of replicas that left
        return sorted(current - self._warm)

    def _warm_new_pairs(self) -> None:
        """Warm the pairs of replicas that joined (the autoscaler's, or Serve's replacement of
        a dead one) before clients' requests reach them (the routers send to warm replicas
        first), without waiting for a /health probe. Looks only when a directory changed since
        the last look, or a warm-up failed (a running warm-up is left to finish first)."""
        versions = (self.directories["prefill"].version, self.directories["decode"].version)
        if versions == self._warm_checked or not (self._warming is None or self._warming.done()):
            return
        left = self._pairs_to_warm()
        if left is not None:  # both roles listed: this set of replicas is taken care of
            self._warm_checked = versions
        self._start_warm_up(left or [])

    def _start_warm_up(self, pairs: list[tuple[str, str]]) -> None:
        if not pairs or (self._warming is not None and not self._warming.done()):
            return
        self._warming = asyncio.get_running_loop().create_task(self._warm_up(pairs))

    async def _warm_up(self, pairs: list[tuple[str, str]]) -> None:
        for p, d in pairs:
            t0 = time.monotonic()
            try:
                await asyncio.wait_for(self._warm_pair(p, d), self.cfg.ingress.engine_timeout_s)
            except Exception as e:  # retried at the next /health or sync-loop look
                self.warm_up_failures += 1
                self._warm_checked = None
                log.warning("warm-up of prefill %s -> decode %s failed: %s", p, d, e)
                continue
            self._warm.add((p, d))
            self.warm_up_s.append(time.monotonic() - t0)

    async def _warm_pair(self, p: str, d: str) -> None:
        """One request of two KV blocks, prefilled on ``p`` and decoded on ``d`` (pinned)
        under a salt of its own, so ``d`` pulls it over NIXL instead of finding it cached.
        Its calls carry an id of their own, detached from the request (a /health probe) that
        started the warm-up: a probe's time-out must not cancel them, and one pair's calls must
        not share an id with the next pair's."""
        _own_serve_request_id(detach=True)
        block = self.cfg.hashing.block_size
        vocab = max(16, len(self.tokenizer.tok) - 1)
        ids = tuple(5 + (k * 7) % (vocab - 5) for k in range(2 * block))
        self._warm_seq += 1
        rid = f"warmup-{self._warm_seq}-{self.replica_id}"
        base = EngineRequest(
            rid,
            ids,
            Sampling(max_tokens=2, temperature=0.0, ignore_eos=True),
            cache_salt=f"pdserve-warmup:{p}:{d}",
        )
        try:
            pre: EngineChunk = await self.prefill.prefill.remote(
                replace(base, route=RouteHint(len(ids), None, 2, pin=p))
            )
            dreq = replace(
                base,
                kv_transfer_params=pre.kv_transfer_params,
                route=RouteHint(len(ids), None, 2, pin=d),
            )
            async for _ in self.decode_stream.decode.remote(dreq):
                pass
        finally:  # the routers' placements of both calls (no latency breakdown for these)
            self.waits["prefill"].pop(rid)
            self.waits[self._decode_dep].pop(rid)

    def inject_routing_hold(self, role: str, seconds: float) -> str:
        """Fault injection (``<role>.fault_injection: true`` only): this ingress's router of
        ``role`` places no call for ``seconds`` (``0`` ends it), as when none of its replicas
        can take one: calls wait at the handle. Returns this ingress replica's id."""
        if role not in ("prefill", "decode"):
            raise ValueError(f"role must be 'prefill' or 'decode', not {role!r}")
        if not self.cfg.engine("prefill" if role == "prefill" else "decode").fault_injection:
            raise PermissionError(f"{role}.fault_injection is off")
        hold_routing(self.app_name, role, float(seconds))
        return self.replica_id

    def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "pdserve",
                    "max_model_len": self.cfg.model.max_model_len,
                }
            ],
        }

    async def stats(self, reset: bool = False) -> dict[str, Any]:
        """Replicas (from their last load reports), routers, index and ingress counters;
        ``reset`` starts this ingress's overhead and phase samples afresh after reading (the
        operator's ``POST /v1/pdserve/stats/reset``)."""
        from controllers.stats import summarize

        self._ensure_started()
        replicas: dict[str, list[dict[str, Any]]] = {}
        totals: dict[str, dict[str, Any]] = {}
        for role, d in self.directories.items():
            rows = []
            for rid, rep in sorted(d.snapshot().items()):
                ts = float(rep.get("ts", 0.0) or 0.0)
                rows.append(
                    {"id": rid, "routed": rep.get("requests", 0)}
                    | {k: rep[k] for k in _REPORT_KEYS if k in rep}
                    # when the engine's load was read (wall clock): a report older than a
                    # few periods is stale (a wedged engine's, or one Serve has not polled)
                    | ({"report_ts": ts} if ts else {})
                )
            replicas[role] = rows
            totals[role] = {
                k: sum(r.get(k, 0) or 0 for r in rows)
                for k in ("routed", "prompt_tokens", "cached_tokens", "external_hits")
            }
        routers = {role: router_stats(self.app_name, role) for role in ("prefill", "decode")}
        ingress = {
            "replica": self.replica_id,
            "requests": self.requests,
            "refused": self.refused,
            "overhead_s": summarize(list(self.overhead_s)) if self.overhead_s else None,
            "phases_s": {k: summarize(list(v)) for k, v in self.phases.items() if v},
            "prefill_queue": {
                "in_flight": self._inflight_prefill,
                "uncached_tokens": self._inflight_uncached,
                "peak": self.inflight_peak,
                "overload_refused": self.overload_refused,
                "wait_refused": self.wait_refused,
                "expected_wait_s": self.expected_wait_s,
            },
            "deadline_exceeded": self.deadline_exceeded,
            "replica_retries": dict(self.replica_retries),
            "kv_released": dict(self.kv_released),
            "decode_local": self.decode_local,
            "cold_start_waits": dict(self.cold_start_waits),
            "cold_start_last_s": dict(self.cold_start_last_s),
            "warm_up": {
                "pairs_warmed": sorted(f"{p}->{d}" for p, d in self._warm),
                "failures": self.warm_up_failures,
                "seconds": [round(x, 3) for x in self.warm_up_s[-16:]],
            },
            "live_config": {
                "routing": self.cfg.routing.model_dump(mode="json"),
                "applied": self.live_applied,
                "refused": self.live_refused,
                "error": self.live_error,
            },
            "rate_limits": {"backend": self.limiter.backend}
            | asdict(self.limiter.stats)
            | {"reserved_tokens": dict(sorted(self.reserved_tokens.items())[:256])},
            "keys": asdict(self.keys.stats),
            "auth": {
                "mode": self.cfg.ingress.auth,
                "refused": dict(self.gate.refused),
            },
            "render_timeouts": self.render_timeouts,
            "template_sandbox": self.sandbox.stats() if self.sandbox is not None else None,
        }
        if reset:
            self.overhead_s.clear()
            for v in self.phases.values():
                v.clear()
        fallbacks: dict[str, int] = {}
        for r in routers.values():
            for name, n in r["fallbacks"].items():
                fallbacks[name] = fallbacks.get(name, 0) + n
        return {
            "replicas": replicas,
            "totals": totals,
            "router": {
                "policy": self.cfg.routing.policy,
                "fallbacks": fallbacks,
                "prefill": routers["prefill"],
                "decode": routers["decode"],
            },
            "index": {
                "backend": self.cfg.index.backend,
                **self.index.stats.__dict__,
                "feeds": self.index.feed_stats(),
            },
            "ingress": ingress,
            "autoscaling": await self._autoscaling_stats(),
        }

    async def _autoscaling_stats(self) -> dict[str, Any] | None:
        """The serverless autoscaler's last decisions for this app (with their reasons, the
        demand they saw and the measured cold starts), as its policy published them."""
        if not self.autoscaling:
            return None
        from deployments.autoscaling import read_decisions

        roles = ("prefill",) if self.colocated else ("prefill", "decode")
        app = await asyncio.to_thread(read_decisions, self.app_name)
        if app is None:  # no application-level policy: each role's own
            per_role = {
                r: await asyncio.to_thread(read_decisions, f"{self.app_name}/{r}") for r in roles
            }
            return {"scope": "deployment", "roles": per_role}
        return app

    async def explain(
        self, request: Request, body: CompletionRequest | ChatCompletionRequest, tenant: str
    ) -> Any:
        """Where a request of ``tenant`` (whose cache namespace the prompt is hashed in) would
        be routed: the index's answer, without running it. An operator route: nothing is
        charged to the tenant."""
        self._ensure_started()
        try:
            if not _TENANT_NAME.match(tenant):
                raise RequestError(f"tenant: {tenant[:64]!r} is not a tenant name", "tenant")
            prep = await self.prepare(request, body, charge=False, tenant=tenant)
        except RequestError as e:
            return _error(e)
        hint = await self.route(prep)
        return {
            "tenant": tenant,
            "prompt_tokens": len(prep.ids),
            "blocks": max((len(h) for h in prep.hashes.values()), default=0),
            "matches": hint.matches,
            "policy": self.cfg.routing.policy,
            "prefill_replicas": sorted(self.directories["prefill"].snapshot()),
        }

    def _root_span(self, request: Request) -> Any:
        """The request's root span. A client's W3C ``traceparent`` is linked to it
        (``observability.tracing.client_context: link``, the default), so a client can
        neither force sampling nor choose the trace id; with ``parent`` the span joins the
        client's trace (a gateway you trust sets the header)."""
        client = extract(request.headers)
        if self.cfg.observability.tracing.client_context == "parent":
            return self.tracer.start_span("pdserve.request", context=client, kind=SpanKind.SERVER)
        sc = otel_trace.get_current_span(client).get_span_context()
        links = [Link(sc)] if sc.is_valid else None
        return self.tracer.start_span(
            "pdserve.request", context=otel_context.Context(), kind=SpanKind.SERVER, links=links
        )

    async def complete(
        self, request: Request, body: CompletionRequest | ChatCompletionRequest
    ) -> Any:
        """``prepare -> route -> prefill -> decode -> respond``; errors are 4xx/5xx bodies.

        A stream's response starts once the decode's first chunk is in, so a refusal or a
        failure before any token is an HTTP status, not an error event inside a 200. However
        the request ends (an answer, an error, a deadline, the client gone), its unused
        token reservation goes back to its tenant and any prefill KV no decode took is
        released (:meth:`_settle`); a stream settles when it closes (:class:`_SettlingStream`)."""
        preps: list[Prepared] = []
        try:
            if isinstance(body, CompletionRequest) and is_batch(body.prompt):
                return await self.complete_batch(request, body, preps)
            return await self._complete(request, body, preps)
        finally:
            self._settle(preps)

    async def _complete(
        self,
        request: Request,
        body: CompletionRequest | ChatCompletionRequest,
        preps: list[Prepared],
    ) -> Any:
        self._ensure_started()
        endpoint = "chat" if isinstance(body, ChatCompletionRequest) else "completions"
        root = self._root_span(request)
        set_attrs(root, {"endpoint": endpoint, "model": self.model_name})
        span = child(self.tracer, "pdserve.prepare", root)
        try:
            prep = await self.prepare(request, body)
        except RequestError as e:
            span.end()
            return self._refused(root, endpoint, e)
        preps.append(prep)
        span.end()
        prep.span = prep.parent = root
        set_attrs(
            root,
            {
                "request_id": prep.rid,
                "tenant": prep.tenant,
                "prompt_tokens": len(prep.ids),
                "stream": prep.stream,
                "n": prep.sampling.n,
            },
        )
        self.requests += 1
        span = child(self.tracer, "pdserve.route", root)
        hint = await self.route(prep)
        set_attrs(
            span,
            {
                "policy": self.cfg.routing.policy,
                "index_answered": hint.matches is not None,
                "index_best_tokens": max((hint.matches or {}).values(), default=0),
            },
        )
        span.end()
        prep.hint = hint
        if self.colocated:  # one engine does both: the prompt's slot lasts the whole stream
            try:
                self.admit_prefill([(prep, hint)])
            except RequestError as e:
                return self._failed(prep, e)
            return await self._respond([(prep, _local_prefill(prep))])
        if self._decode_local(prep):
            try:
                self.check_wait()
            except RequestError as e:
                return self._failed(prep, e)
            self.decode_local += 1
            return await self._respond([(prep, _local_prefill(prep))])
        try:
            self.admit_prefill([(prep, hint)])
            pre = await self.run_prefill(prep, hint)
        except RequestError as e:
            return self._failed(prep, e)
        return await self._respond([(prep, pre)])

    def _settle(self, preps: list[Prepared]) -> None:
        """What a request still holds when it ends, given back (each once; a stream's parts
        are settled by the stream when it closes): the tokens reserved and not produced, its
        place in the prefill queue, and the prefill KV that no decode call took."""
        for prep in preps:
            if prep.stream_owned:
                continue
            self._give_back(prep)
            self._release_slot(prep)
            pre, prep.kv_pending = prep.kv_pending, None
            if pre is not None:
                self._release_prefilled(prep.engine_rid, pre)

    def _decode_local(self, prep: Prepared) -> bool:
        """Conditional disaggregation: a prompt shorter than
        ``routing.local_prefill_threshold_tokens`` is prefilled on its decode replica (no
        prefill call, no KV transfer; counted as ``decode_local``): for a short prompt the
        hand-off costs more than the compute. Requests that need the prefill's own output
        (``echo``, prompt logprobs) always go through the prefill replica.

        Weaker than the pure rule (:func:`controllers.routing.route`, which counts the
        uncached part at the best prefill replica): what matters here is the decode
        replica's cache, and decode replicas do not feed the prefix index, so a long prompt
        that is nearly fully cached is not sent decode-local."""
        threshold = self.cfg.routing.local_prefill_threshold_tokens
        if not threshold or len(prep.ids) >= threshold or prep.echo is not None:
            return False
        return prep.sampling.prompt_logprobs is None and not prep.echo_only

    async def _respond(self, parts: list[tuple[Prepared, EngineChunk]]) -> Any:
        """Decode every part (one prompt each) and answer, streamed or as one body."""
        prep0 = parts[0][0]
        n = prep0.sampling.n
        for prep, _ in parts:  # no engine stream for these: their queue slot ends here
            if prep.echo_only:
                self._release_slot(prep)
        streams = [
            _offset(_nothing() if prep.echo_only else self.decode_chunks(prep, pre), k * n)
            for k, (prep, pre) in enumerate(parts)
        ]
        chunks = streams[0] if len(streams) == 1 else _merge([_own(s) for s in streams])
        if prep0.stream:
            try:
                first = await anext(chunks, None)
            except RequestError as e:
                return self._failed(prep0, e, also=[p for p, _ in parts[1:]])
            except BaseException:
                await chunks.aclose()  # type: ignore[attr-defined]
                raise
            tally = _Tally(parts)
            for prep, _ in parts:  # from here the stream settles them, when it closes
                prep.stream_owned = True
            body = _SettlingStream(
                self.respond_sse(parts, _prepend(first, chunks), tally),
                lambda: self._close_stream(parts, chunks),
            )
            return _ClosingStreamingResponse(body, media_type="text/event-stream")
        return await self.respond_json(parts, chunks)

    async def _close_stream(
        self, parts: list[tuple[Prepared, EngineChunk]], chunks: AsyncIterator[EngineChunk]
    ) -> None:
        """A stream's response ended (done, failed, or the client went, also before its
        first byte): its engine streams end (each decode engine aborts what it still runs),
        its trace ends, and its parts settle (:meth:`_settle`)."""
        try:
            await chunks.aclose()  # type: ignore[attr-defined]
        finally:
            prep0 = parts[0][0]
            if prep0.span is not None:  # the client went away mid-stream
                self._finish_span(prep0.span, 499, "client disconnected")
                prep0.span = None
            preps = [p for p, _ in parts]
            for p in preps:
                p.stream_owned = False
            self._settle(preps)

    async def complete_batch(
        self, request: Request, body: CompletionRequest, preps: list[Prepared]
    ) -> Any:
        """A completions request with several prompts (vLLM accepts them): each prompt is
        prepared, routed (to the prefill replica that holds *its* prefix), prefilled and
        decoded on its own, concurrently; prompt ``k``'s choices are ``k*n .. k*n+n-1``, as
        vLLM numbers them; usage sums the prompts. One trace covers the batch. ``preps``
        collects the prompts prepared, which the caller settles (:meth:`complete`): when one
        prompt fails, the others' reservations go back and their prefills' KV is released."""
        self._ensure_started()
        root = self._root_span(request)
        prompts = list(body.prompt or [])
        cap = self.cfg.ingress.max_batch_prompts
        try:
            if len(prompts) > cap:
                raise RequestError(
                    f"prompt: {len(prompts)} prompts; at most {cap} per request", "prompt"
                )
            tenant = (await self.principal(request)).tenant
            self._check_joint(body, len(prompts), tenant)
            set_attrs(root, {"endpoint": "completions", "batch": len(prompts)})
            for p in prompts:
                sub = body.model_copy(update={"prompt": p})
                preps.append(await self.prepare(request, sub, tenant=tenant))
        except RequestError as e:
            return self._refused(root, "completions", e)
        self.requests += len(preps)
        for prep in preps:
            prep.rid = preps[0].rid  # one response id; the engines' ids stay apart
        preps[0].span = root  # ended once, by the first prompt
        for prep in preps:
            prep.parent = root  # every prompt's engine calls are children of the root
        hints = [await self.route(prep) for prep in preps]
        for prep, h in zip(preps, hints, strict=True):
            prep.hint = h
        try:
            self.admit_prefill(list(zip(preps, hints, strict=True)))
        except RequestError as e:
            return self._failed(preps[0], e, also=preps[1:])
        if self.colocated:
            return await self._respond([(prep, _local_prefill(prep)) for prep in preps])

        async def prefill(prep: Prepared, hint: RouteHint) -> EngineChunk:
            _own_serve_request_id()  # this task's calls: this prompt's own request id
            return await self.run_prefill(prep, hint)

        got = await asyncio.gather(
            *(prefill(prep, h) for prep, h in zip(preps, hints, strict=True)),
            return_exceptions=True,
        )
        bad = next((g for g in got if isinstance(g, BaseException)), None)
        if bad is not None:  # the siblings' KV is released as they settle (complete's finally)
            if isinstance(bad, RequestError):
                return self._failed(preps[0], bad, also=preps[1:])
            raise bad
        return await self._respond(list(zip(preps, got, strict=True)))  # type: ignore[arg-type]

    async def tokenize(
        self, request: Request, body: TokenizeCompletionRequest | TokenizeChatRequest
    ) -> Any:
        """vLLM's ``/tokenize``: the prompt's (or the rendered conversation's) token ids. The
        tokens are charged to the tenant's tokens bucket (work done, however full it is)."""
        try:
            who = await self.principal(request)
            self._check_model(body.model)
            if isinstance(body, TokenizeChatRequest):
                for name in ("media_io_kwargs", "mm_processor_kwargs"):
                    if getattr(body, name) is not None:
                        raise RequestError(f"{name} is not supported", name)
                ids = await self._tokenize_chat(body, who.tenant, self._max_chars(who.tenant))
            else:
                ids = await self._tokenize_text(
                    body.prompt, body.add_special_tokens, self._max_chars(who.tenant)
                )
            await self.charge_tokens(who.tenant, len(ids))
        except RequestError as e:
            return _error(e)
        out: dict[str, Any] = {
            "count": len(ids),
            "max_model_len": self.cfg.model.max_model_len,
            "tokens": ids,
        }
        if body.return_token_strs:
            out["token_strs"] = self.tokenizer.tok.convert_ids_to_tokens(ids)
        return out

    async def _tokenize_chat(self, body: Any, tenant: str, max_chars: int) -> list[int]:
        text = await self._render_chat(body, max_chars)
        return await self._tokenize_text(text, body.add_special_tokens, max_chars, "messages")

    async def _tokenize_text(
        self, text: str, add_special_tokens: bool, max_chars: int, where: str = "prompt"
    ) -> list[int]:
        if len(text) > max_chars:
            raise self._too_long(where, len(text), max_chars)
        return await self._off_loop(
            lambda: self.tokenizer.encode(text, add_special_tokens), len(text), where
        )

    async def detokenize(self, request: Request, body: DetokenizeRequest) -> Any:
        """vLLM's ``/detokenize``: the text of token ids (ids outside the vocabulary: 400;
        more ids than the context holds: 400). Charged as tokens, like ``/tokenize``."""
        try:
            who = await self.principal(request)
            self._check_model(body.model)
            cap = self.cfg.model.max_model_len
            if len(body.tokens) > cap:
                raise RequestError(
                    f"tokens: {len(body.tokens)} ids; at most max_model_len={cap}", "tokens"
                )
            ids = self.tokenizer.check_ids(list(body.tokens), "tokens")
            await self.charge_tokens(who.tenant, len(ids))
            text = await self._off_loop(lambda: self.tokenizer.decode(ids), 4 * len(ids), "tokens")
        except RequestError as e:
            return _error(e)
        return {"prompt": text}

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise RequestError(
                f"model {model!r} is not served here; /v1/models lists {self.model_name!r}",
                "model",
                status=404,
            )

    # -- phases --------------------------------------------------------------------------
    async def prepare(
        self,
        request: Request,
        body: CompletionRequest | ChatCompletionRequest,
        charge: bool = True,
        tenant: str | None = None,
    ) -> Prepared:
        """Validation, tokenization, block hashes and (``charge``) the tenant's tokens; raises
        :class:`RequestError`. ``tenant`` is whose cache namespace the prompt is hashed in
        (the caller's own unless an operator names one)."""
        t0 = time.monotonic()
        chat = isinstance(body, ChatCompletionRequest)
        if tenant is None:
            tenant = (await self.principal(request)).tenant
        try:
            timeout_s = self._timeout_of(request)
            prep = await self._prepare(request, body, tenant, t0, chat, charge)
        except RequestError as e:
            e.tenant = tenant
            if charge and e.tokenized:  # refused after the work: the work is charged
                await self.charge_tokens(tenant, e.tokenized)
            raise
        prep.deadline = t0 + timeout_s
        return prep

    def _timeout_of(self, request: Request) -> float:
        """The request's time budget: ``ingress.request_timeout_s``, or less when the client
        sends ``X-Request-Timeout: SECONDS`` (more is held at the server's; not a number or
        not positive: 400 naming the header)."""
        cap = self.cfg.ingress.request_timeout_s
        raw = request.headers.get(TIMEOUT_HEADER)
        if raw is None:
            return cap
        try:
            asked = float(raw)
        except ValueError:
            asked = math.nan
        if not math.isfinite(asked) or asked <= 0:
            raise RequestError(
                f"{TIMEOUT_HEADER}: {raw[:40]!r} is not a positive number of seconds",
                TIMEOUT_HEADER,
            )
        return min(asked, cap)

    def _deadline_error(self, prep: Prepared, phase: str) -> RequestError:
        """The 504 of a request whose deadline passed in ``phase`` (counted)."""
        self.deadline_exceeded += 1
        self.metrics.inc("pdserve_deadline_exceeded", tenant=prep.tenant, phase=phase)
        budget = prep.deadline - prep.t0
        return RequestError(
            f"the request's deadline ({budget:g} s) passed during {phase}",
            None,
            status=504,
            code="deadline_exceeded",
        )

    def _max_chars(self, tenant: str) -> int:
        """The longest text prompt ``tenant`` may send, in characters: its context cap (its
        ``max_context_tokens``, else ``max_model_len``) times
        ``ingress.max_prompt_chars_per_token``. Longer is refused before tokenizing."""
        cap = self.cfg.tenants.limits(tenant).max_context_tokens or self.cfg.model.max_model_len
        cap = min(cap, self.cfg.model.max_model_len)
        return cap * self.cfg.ingress.max_prompt_chars_per_token

    def _too_long(self, where: str, chars: int, max_chars: int) -> RequestError:
        return RequestError(
            f"{where}: {chars} characters, more than any prompt this tenant may send "
            f"({max_chars}: its context of tokens x ingress.max_prompt_chars_per_token)",
            where,
        )

    async def _off_loop(self, fn: Callable[[], Any], size: int, where: str) -> Any:
        """``fn()``: inline when ``size`` (characters) is small, else in the ingress's
        preparation threads within ``ingress.render_timeout_s`` (past it a 413 naming
        ``where``; the thread finishes on its own, bounded by the prompt's size)."""
        if size <= self.cfg.ingress.tokenize_off_loop_chars:
            return fn()
        budget = self.cfg.ingress.render_timeout_s
        fut = asyncio.get_running_loop().run_in_executor(self._prep_pool, fn)
        try:
            return await asyncio.wait_for(fut, budget)
        except TimeoutError:
            self.render_timeouts += 1
            raise RequestError(
                f"{where}: rendering and tokenizing took longer than "
                f"ingress.render_timeout_s={budget:g} s",
                where,
                status=413,
            ) from None

    async def _render_chat(self, body: Any, max_chars: int) -> str:
        """The conversation through the chat template: the model's (in the preparation
        threads when long), or the request's own when the operator trusts them (in the
        template sandbox); at most ``max_chars`` characters (else a 400 before tokenizing)."""
        shown = sum(len(c) for c in _contents(body.messages))
        if shown > max_chars:
            raise self._too_long("messages", shown, max_chars)
        own = getattr(body, "chat_template", None)
        if own is not None and self.sandbox is not None:
            job = self.tokenizer.template_job(body, template_variables(own))
            job.update(template=own, max_chars=max_chars)
            job["kwargs"] = {**self.tokenizer.special_tokens(), **job["kwargs"]}
            budget = self.cfg.ingress.render_timeout_s
            try:
                text = await self.sandbox.render(job, budget)
            except SandboxBusy:
                raise RequestError(
                    "chat_template: the template sandbox is busy with other requests' "
                    "templates; retry",
                    "chat_template",
                    status=503,
                    headers={"Retry-After": str(max(1, math.ceil(budget)))},
                ) from None
            except SandboxTimeout:
                self.render_timeouts += 1
                raise RequestError(
                    f"chat_template: rendering took longer than ingress.render_timeout_s="
                    f"{budget:g} s",
                    "chat_template",
                    status=413,
                ) from None
            except ValueError as e:
                raise RequestError(f"chat_template: {e}", "chat_template") from None
        else:
            job = self.tokenizer.template_job(body, self.tokenizer.template_vars)
            size = _body_size(body)
            text = await self._off_loop(lambda: self.tokenizer.render(job), size, "messages")
        if len(text) > max_chars:
            raise self._too_long("messages", len(text), max_chars)
        return text

    def _check_joint(self, body: Any, prompts: int, tenant: str) -> None:
        """The joint bounds of one request, before any work: ``prompts x n`` sequences and
        ``prompts x n x max_tokens`` output tokens (each cap alone would allow their product;
        a request that sends no ``max_tokens`` counts its default)."""
        ing = self.cfg.ingress
        n = body.n or 1
        seqs = prompts * n
        if seqs > ing.max_request_sequences:
            raise RequestError(
                f"n: {prompts} prompt(s) x n={n} = {seqs} sequences; at most "
                f"ingress.max_request_sequences={ing.max_request_sequences} per request",
                "n",
            )
        if isinstance(body, ChatCompletionRequest):
            asked = body.max_completion_tokens or vars(body).get("max_tokens")
        else:
            asked = body.max_tokens
        cap = self.cfg.tenants.limits(tenant).max_tokens
        default = min(ing.max_tokens_default, cap) if cap else ing.max_tokens_default
        per = asked if asked is not None else default
        total = seqs * per
        if total > ing.max_request_output_tokens:
            raise RequestError(
                f"max_tokens: {seqs} sequences x max_tokens {per} = {total} output tokens; at "
                f"most ingress.max_request_output_tokens={ing.max_request_output_tokens} per "
                "request",
                "max_tokens",
            )

    async def _prepare(
        self,
        request: Request,
        body: CompletionRequest | ChatCompletionRequest,
        tenant: str,
        t0: float,
        chat: bool,
        charge: bool,
    ) -> Prepared:
        if charge:
            self._overloaded(0, 0)  # before tokenizing: a refusal under overload is cheap
        self._check_model(body.model)
        trust = self.cfg.ingress.trust_request_chat_template
        refuse_unsupported(body, trust)  # before tokenizing (a batch of prompts, say)
        check_bounds(body, self.bounds)
        if body.n is not None and body.n > self.cfg.ingress.max_n:
            raise RequestError(
                f"n={body.n} is above this server's limit of {self.cfg.ingress.max_n}", "n"
            )
        self._check_joint(body, 1, tenant)
        limits = self.cfg.tenants.limits(tenant)
        space = f"@{limits.cache_group}" if limits.cache_group else tenant
        salt = space if not body.cache_salt else f"{space}:{body.cache_salt}"
        max_len = self.cfg.model.max_model_len
        max_ctx = limits.max_context_tokens
        max_chars = self._max_chars(tenant)
        colocated = self.colocated
        text: str | None
        if chat:
            text = await self._render_chat(body, max_chars)
        else:
            assert isinstance(body, CompletionRequest)
            p = single_prompt(body.prompt)
            text = p if isinstance(p, str) else None
            if text is not None and len(text) > max_chars:
                raise self._too_long("prompt", len(text), max_chars)

        def tokens() -> tuple[list[int], str | None]:
            if chat:
                assert text is not None
                return self.tokenizer.encode(text, body.add_special_tokens), text
            assert isinstance(body, CompletionRequest)
            return self.tokenizer.completion_prompt(body.prompt, body.add_special_tokens)

        def work() -> tuple[list[int], str | None, Resolved, dict[str, list[int]]]:
            ids, txt = tokens()
            try:
                return checked(ids, txt)
            except RequestError as e:  # refused after tokenizing: its tenant pays the work
                e.tokenized = len(ids)
                raise

        def checked(
            ids: list[int], txt: str | None
        ) -> tuple[list[int], str | None, Resolved, dict[str, list[int]]]:
            if body.truncate_prompt_tokens is not None:
                keep = max_len if body.truncate_prompt_tokens == -1 else body.truncate_prompt_tokens
                if len(ids) > keep:
                    ids = ids[:keep] if body.truncation_side == "right" else ids[len(ids) - keep :]
                    txt = None if not chat else txt  # echo the prompt as truncated
            where = "messages" if chat else "prompt"
            if not ids:
                raise RequestError("the prompt is empty", where)
            if max_ctx is not None and len(ids) > max_ctx:
                raise RequestError(
                    f"{where}: the prompt has {len(ids)} tokens, above this tenant's "
                    f"max_context_tokens of {max_ctx}",
                    where,
                )
            resolved = sampling_of(
                body,
                prompt_tokens=len(ids),
                max_model_len=max_len,
                default_max_tokens=self.cfg.ingress.max_tokens_default,
                defaults=self.defaults,
                max_tokens_cap=limits.max_tokens,
                trust_request_chat_template=trust,
            )
            if colocated and resolved.sampling.prompt_logprobs is not None:
                field = "echo" if getattr(body, "echo", False) else "prompt_logprobs"
                raise RequestError(
                    f"{field}: prompt log-probabilities are not returned in colocated mode "
                    "(they come from a prefill replica in PD mode)",
                    field,
                )
            return ids, txt, resolved, self.index.hashes(ids, salt)

        where = "messages" if chat else "prompt"
        ids, text, resolved, hashes = await self._off_loop(work, _body_size(body), where)
        rid = new_id("chatcmpl" if chat else "cmpl", body.request_id)
        prep = Prepared(
            rid=rid,
            chat=chat,
            tenant=tenant,
            ids=tuple(ids),
            sampling=resolved.sampling,
            hashes=hashes,
            stream=bool(body.stream),
            with_usage=include_usage(body),
            t0=t0,
            salt=salt,
            engine_rid=new_id(rid),
            fmt=LogprobFormat.of(body),
            echo=_echo(body, text, lambda: self.tokenizer.decode(ids)),
            echo_only=resolved.echo_only,
            token_ids=bool(body.return_token_ids),
        )
        if chat and body.return_prompt_text:  # type: ignore[union-attr]
            prep.extra["prompt_text"] = text
        if body.return_token_ids:
            prep.extra["prompt_token_ids"] = list(ids)
        if charge:
            await self.admit(prep)
        prep.timing["prepare"] = time.monotonic() - t0
        return prep

    async def route(self, prep: Prepared) -> RouteHint:
        """The index's answer for the prompt, as the prefill router's hint (never raises)."""
        t = time.monotonic()
        match = await self.index.match(prep.hashes) if prep.hashes else None
        prep.timing["route"] = time.monotonic() - t
        return RouteHint(
            prompt_tokens=len(prep.ids),
            matches=None if match is None else match.by_replica,
            expected_output_tokens=min(
                prep.sampling.max_tokens, self.cfg.routing.expected_output_tokens
            ),
            block_hashes=tuple(prep.hashes.get("engine") or next(iter(prep.hashes.values()), ())),
        )

    async def run_prefill(self, prep: Prepared, hint: RouteHint) -> EngineChunk:
        """One output token on the routed prefill replica; 502/504 as :class:`RequestError`."""
        span = child(self.tracer, "pdserve.prefill", prep.parent)
        try:
            return await self._run_prefill(prep, hint, span)
        finally:
            self._release_slot(prep)

    def _release_slot(self, prep: Prepared) -> None:
        """``prep`` leaves the prefill queue counted by :meth:`admit_prefill` (once)."""
        if prep.queued_tokens is not None:
            self._inflight_prefill -= 1
            self._inflight_uncached -= prep.queued_tokens
            prep.queued_tokens = None

    async def _run_prefill(self, prep: Prepared, hint: RouteHint, span: Any) -> EngineChunk:
        try:
            return await self._prefill_on_a_replica(prep, hint, span)
        except BaseException:  # the call's placements, which _cold_wait takes on success
            rid = prep.engine_rid
            for k in range(self.cfg.ingress.replica_retries + 1):
                self.waits["prefill"].pop(f"{rid}-retry{k}" if k else rid)
            raise
        finally:
            span.end()

    async def _prefill_on_a_replica(
        self, prep: Prepared, hint: RouteHint, span: Any
    ) -> EngineChunk:
        """The prefill call; sent again (``ingress.replica_retries``) when its replica died."""
        req = _engine_request(prep, span, route=hint)
        t = time.monotonic()
        attempt = 0
        while True:
            left = prep.deadline - time.monotonic()
            if left <= 0:
                raise self._deadline_error(prep, "prefill")
            by_deadline = left < self.cfg.ingress.engine_timeout_s
            call = self.prefill.prefill.remote(req)
            try:
                pre: EngineChunk = await asyncio.wait_for(
                    call, min(left, self.cfg.ingress.engine_timeout_s)
                )
            except TimeoutError:
                _cancel(call)  # the replica aborts it: no prefill runs on for nobody
                if by_deadline:
                    raise self._deadline_error(prep, "prefill") from None
                raise RequestError("prefill timed out", None, status=504) from None
            except Exception as e:  # the engine refused (400) or failed: a gateway error
                if _replica_gone(e) and attempt < self.cfg.ingress.replica_retries:
                    attempt += 1  # Serve's router drops the dead replica; another one runs it
                    self.waits["prefill"].pop(req.request_id)
                    req = replace(req, request_id=f"{prep.engine_rid}-retry{attempt}")
                    self._count_retry(prep, "prefill", e)
                    continue
                raise _engine_error("prefill", prep, e) from None
            cold = self._cold_wait(prep, "prefill", req.request_id)
            prep.timing["prefill"] = time.monotonic() - t - pre.engine_s - cold
            set_attrs(
                span,
                {
                    "cold_start_s": cold,
                    "replica": pre.replica_id,
                    "cached_tokens": pre.num_cached_tokens,
                    "engine_s": pre.engine_s,
                    "retries": attempt,
                },
            )
            prep.kv_pending = pre if pre.kv_transfer_params else None
            return pre

    def _cold_wait(self, prep: Prepared, role: str, engine_rid: str) -> float:
        """Seconds ``prep``'s call to ``role`` waited at the handle for a replica (a cold
        start: the role was at zero, or its replicas were gone), noted by the router; it goes
        into the request's ``cold_start`` phase and ``pdserve_cold_start_wait_seconds``,
        never into an error (0.0 when it did not wait)."""
        dep = "prefill" if self.colocated else role
        waited = self.waits[dep].pop(engine_rid)
        if waited is None:
            return 0.0
        prep.timing["cold_start"] = prep.timing.get("cold_start", 0.0) + waited
        self.cold_start_waits[role] += 1
        self.cold_start_last_s[role] = waited
        self.metrics.observe("pdserve_cold_start_wait_seconds", waited, role=role)
        return waited

    def _count_retry(self, prep: Prepared, phase: str, e: BaseException) -> None:
        self.replica_retries[phase] += 1
        self.metrics.inc("pdserve_replica_retries", phase=phase)
        log.warning("%s replica gone for %s (%s): sent again", phase, prep.rid, type(e).__name__)

    async def decode_chunks(self, prep: Prepared, pre: EngineChunk) -> AsyncIterator[EngineChunk]:
        """The decode replica's chunks, for both response forms. Engine failures and time-outs
        (``engine_timeout_s`` from the first chunk request, or the request's deadline when
        sooner) raise :class:`RequestError` (502/504); the stream is cancelled on the way
        out, which aborts the request in the decode engine (its KV blocks come back)."""
        prep.kv_pending = None  # this call takes the KV (or releases it, _release_unsent)
        span = child(self.tracer, "pdserve.decode", prep.parent)
        route = RouteHint(len(prep.ids), None, prep.sampling.max_tokens * prep.sampling.n)
        if self.colocated and prep.hint is not None:  # the prefix index picks the engine
            route = replace(prep.hint, expected_output_tokens=route.expected_output_tokens)
        dreq = _engine_request(prep, span, kv_transfer_params=pre.kv_transfer_params, route=route)
        n_out = 0
        t = time.monotonic()
        stream = self.decode_stream.decode.remote(dreq)
        it = stream.__aiter__()
        now = asyncio.get_running_loop().time()
        left = prep.deadline - time.monotonic()
        by_deadline = left < self.cfg.ingress.engine_timeout_s
        deadline = now + min(left, self.cfg.ingress.engine_timeout_s)
        done = False
        attempt = 0
        cold = 0.0  # seconds the call waited for a decode replica to start
        try:
            while True:
                try:
                    async with asyncio.timeout_at(deadline):
                        ch: EngineChunk = await it.__anext__()
                except StopAsyncIteration:
                    done = True
                    return
                except TimeoutError:
                    if by_deadline:
                        raise self._deadline_error(prep, "decode") from None
                    raise RequestError("decode timed out", None, status=504) from None
                except Exception as e:
                    if (
                        prep.first_chunk_at is None
                        and _replica_gone(e)
                        and attempt < self.cfg.ingress.replica_retries
                    ):
                        # Nothing reached the client: another decode replica computes the
                        # prompt itself (the dead one may have pulled, and so freed, its KV).
                        attempt += 1
                        self._count_retry(prep, "decode", e)
                        _cancel(stream)
                        self.waits[self._decode_dep].pop(dreq.request_id)
                        prep.local_cached = 0  # that engine's cached tokens are the usage's
                        dreq = replace(
                            dreq,
                            request_id=f"{prep.engine_rid}-retry{attempt}",
                            kv_transfer_params=None,
                        )
                        stream = self.decode_stream.decode.remote(dreq)
                        it = stream.__aiter__()
                        continue
                    raise _engine_error("decode", prep, e) from None
                prep.last_chunk_at = time.monotonic()
                if prep.first_chunk_at is None:
                    prep.first_chunk_at = prep.last_chunk_at
                    if prep.local_cached is not None:  # this engine computed the prompt
                        prep.local_cached = ch.num_cached_tokens
                    span.add_event("first_token")
                    cold = self._cold_wait(prep, "decode", dreq.request_id)
                    set_attrs(span, {"replica": ch.replica_id, "cold_start_s": cold})
                n_out += len(ch.token_ids)
                waited = prep.last_chunk_at - t - ch.engine_s - cold  # outside the engine
                prep.timing.setdefault("decode_first", waited)
                prep.timing["decode"] = waited
                if ch.finish_reason is not None and ch.finish_reason not in FINISH_REASONS:
                    raise RequestError(f"decode ended with {ch.finish_reason!r}", None, status=502)
                yield ch
        finally:
            set_attrs(span, {"completion_tokens": n_out, "finished": done})
            span.end()
            self._release_slot(prep)  # colocated: its slot lasted the stream
            if not done:
                _cancel(stream)
            if prep.first_chunk_at is None:  # else _cold_wait took the call's placement
                self._release_unsent(dreq, pre)

    @property
    def _decode_dep(self) -> str:
        return "prefill" if self.colocated else "decode"

    def _release_unsent(self, dreq: EngineRequest, pre: EngineChunk) -> None:
        """The decode call ``dreq`` ended before its first chunk (the client left, a time-out,
        an error). When no router ever placed it (it waited at the handle: decode replicas
        starting from zero, or all full), no decode engine has the request, so none will pull
        or release the prefill's KV pinned for it, which would stay pinned for NIXL's lease
        (30 s). The call is withdrawn (a router will not place it now) and the prefill replica
        that holds the KV is asked to release it at once (:meth:`EngineReplica.release_kv`).
        A call some router placed is left to its decode engine: vLLM's connector tells the
        prefill of a request aborted before its pull, and a release then could free blocks
        that engine is reading."""
        placed = not self.waits[self._decode_dep].withdraw(dreq.request_id)
        if not placed and dreq.kv_transfer_params:
            self._release_prefilled(dreq.request_id, pre)

    def _release_prefilled(self, rid: str, pre: EngineChunk) -> None:
        """Ask the prefill replica that holds ``pre``'s KV (pinned to it) to free it now
        rather than at NIXL's lease: no decode engine has the request (its decode call was
        withdrawn, never made: a batch's sibling failed, the client went between the two
        phases). See :meth:`EngineReplica.release_kv`."""
        params = pre.kv_transfer_params
        if not params or not pre.replica_id:
            return
        rel = EngineRequest(
            f"{rid}-release",
            (),
            Sampling(max_tokens=1),
            kv_transfer_params=dict(params),
            route=RouteHint(0, pin=pre.replica_id),
        )
        self.kv_released["sent"] += 1
        task = asyncio.get_running_loop().create_task(self._send_release(rel))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _send_release(self, rel: EngineRequest) -> None:
        # a task of its own, made while serving the request: its call must not share that
        # request's Serve id with the other prompts' releases (a batch releases several at
        # once), which Serve's and our routers' bookkeeping are keyed by (seen: the second
        # release never completed and every later prefill call waited 10-30 s to be placed)
        _own_serve_request_id(detach=True)
        call = None
        try:
            call = self.prefill.release_kv.remote(rel)
            freed = await asyncio.wait_for(call, self.cfg.ingress.engine_timeout_s)
        except Exception as e:  # noqa: BLE001 - the lease frees the KV anyway
            _cancel(call)
            self.kv_released["failed"] += 1
            log.warning("KV release %s: %s", rel.request_id, _reason(e))
            return
        finally:
            self.waits["prefill"].pop(rel.request_id)
        if freed:
            self.kv_released["freed"] += 1

    def _prompt_entries(self, pre: EngineChunk) -> list[TokenLogprob | None]:
        return list(pre.prompt_logprobs or ())

    def _delta(
        self, prep: Prepared, pre: EngineChunk, ch: EngineChunk, state: dict[int, Any]
    ) -> ChoiceOut:
        """The choice delta of one decode chunk (the echo before a choice's first one);
        ``state`` keeps each choice's text offset for completion logprobs."""
        first = ch.index not in state
        text = ch.text
        entries: list[TokenLogprob | None] = list(ch.logprobs or ())
        if first and prep.echo is not None:
            text = prep.echo + text
            if not prep.chat and prep.fmt is not None:
                entries = self._prompt_entries(pre) + entries
        delta = ChoiceOut(
            index=ch.index,
            text=text,
            finish_reason=ch.finish_reason,
            stop_reason=ch.stop_reason,
            token_ids=list(ch.token_ids),
        )
        if prep.fmt is not None and (ch.logprobs is not None or entries):
            decode = self.tokenizer.token_text
            if prep.chat:
                delta.logprobs = chat_logprobs(
                    [e for e in entries if e is not None], prep.fmt, decode
                )
            else:
                lp = completion_logprobs(entries, prep.fmt, decode, state.get(ch.index, 0))
                delta.logprobs = lp
                state[ch.index] = (lp.text_offset or [0])[-1] + len((lp.tokens or [""])[-1])
        state.setdefault(ch.index, 0)
        return delta

    async def respond_json(
        self, parts: list[tuple[Prepared, EngineChunk]], chunks: AsyncIterator[EngineChunk]
    ) -> JSONResponse:
        """One JSON body over every part's choices: part ``k`` (one prompt of a batch; one
        part unless the request sent several prompts) owns choices ``k*n .. k*n+n-1``."""
        prep0 = parts[0][0]
        n = prep0.sampling.n
        choices: dict[int, ChoiceOut] = {}
        state: dict[int, Any] = {}
        tally = _Tally(parts)
        try:
            async for ch in _with_echo_only(parts, chunks):
                prep, pre = tally.take(ch)
                d = self._delta(prep, pre, ch, state)
                c = choices.setdefault(ch.index, ChoiceOut(index=ch.index))
                c.text += d.text
                c.token_ids += d.token_ids
                c.finish_reason = d.finish_reason or c.finish_reason
                c.stop_reason = d.stop_reason if d.finish_reason else c.stop_reason
                c.logprobs = _merge_logprobs(c.logprobs, d.logprobs)
        except RequestError as e:
            return self._failed(prep0, e)
        total_s, engine_s = self._record_all(tally, 200)[0]
        extra = dict(prep0.extra)
        if not prep0.chat:  # completions carry the prompt's ids in each choice (below)
            extra.pop("prompt_token_ids", None)
        for i, c in choices.items():
            prep, pre = parts[i // n]
            if pre.prompt_logprobs is not None and not prep.chat:
                c.prompt_logprobs = prompt_logprobs_json(pre.prompt_logprobs)
        if prep0.chat and parts[0][1].prompt_logprobs is not None:
            extra["prompt_logprobs"] = prompt_logprobs_json(parts[0][1].prompt_logprobs)
        out = completion_body(
            prep0.rid,
            self.model_name,
            [choices[i] for i in sorted(choices)],
            tally.usage(),
            prep0.chat,
            token_ids=prep0.token_ids,
            extra=extra,
        )
        if not prep0.chat and "prompt_token_ids" in prep0.extra:
            for c in out["choices"]:
                c["prompt_token_ids"] = parts[c["index"] // n][0].extra["prompt_token_ids"]
        last = tally.last
        out["pdserve"] = {
            "ingress_replica": self.replica_id,
            "prefill_replica": parts[0][1].replica_id,
            "decode_replica": last[0].replica_id if last[0] else None,
            "engine_s": engine_s,
            "ingress_s": total_s,
        }
        if len(parts) > 1:  # a batch: every prompt's replicas
            out["pdserve"]["prefill_replicas"] = [pre.replica_id for _, pre in parts]
            out["pdserve"]["decode_replicas"] = [x.replica_id if x else None for x in last]
        return JSONResponse(out)

    async def respond_sse(
        self,
        parts: list[tuple[Prepared, EngineChunk]],
        chunks: AsyncIterator[EngineChunk],
        tally: _Tally,
    ) -> AsyncIterator[str]:
        """The SSE lines of a streamed response (its close, :meth:`_close_stream`, ends its
        trace and settles it when the client goes)."""
        created = int(time.time())
        m = self.model_name
        prep0 = parts[0][0]

        def sse(obj: dict[str, Any]) -> str:
            return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"

        state: dict[int, Any] = {}
        try:
            async for ch in _with_echo_only(parts, chunks):
                prep, pre = tally.take(ch)
                first = ch.index not in state
                d = self._delta(prep, pre, ch, state)
                if d.text or d.finish_reason or first or d.logprobs:
                    body = stream_chunk(
                        prep.rid,
                        m,
                        created,
                        chat=prep.chat,
                        delta=d,
                        role=first,
                        token_ids=prep.token_ids,
                    )
                    if first and prep.extra:
                        body.update(prep.extra)  # vLLM sends them with the first chunk
                    yield sse(body)
        except RequestError as e:  # an error event, then usage and [DONE]: well-formed
            yield sse(e.body())
            status = e.status
        else:
            status = 200
        if prep0.with_usage:
            use = tally.usage()
            yield sse(stream_chunk(prep0.rid, m, created, chat=prep0.chat, use=use))
        yield "data: [DONE]\n\n"
        self._record_all(tally, status)

    def _record_all(self, tally: _Tally, status: int) -> list[tuple[float, float]]:
        """:meth:`_record` for every part; the first (which holds the trace's root span) last,
        so the root ends after every prompt of a batch."""
        parts = tally.parts
        out = [
            self._record(parts[k][0], parts[k][1], tally.last[k], tally.n_out[k], status)
            for k in range(len(parts) - 1, -1, -1)
        ]
        return out[::-1]

    def _record(
        self,
        prep: Prepared,
        pre: EngineChunk,
        last: EngineChunk | None,
        n_out: int = 0,
        status: int = 200,
    ) -> tuple[float, float]:
        """Record one finished request: its overhead (wall time minus both engines' time) and
        phase times (see ``phases``), its metrics, and the end of its trace; returns ``(wall
        seconds, engine seconds)``."""
        now = time.monotonic()
        total_s = now - prep.t0
        engine_s = pre.engine_s + (last.engine_s if last else 0.0)
        self.overhead_s.append(max(0.0, total_s - engine_s))
        for k, v in prep.timing.items():
            self.phases[k].append(max(0.0, v))
        if prep.last_chunk_at is not None:
            self.phases["respond"].append(now - prep.last_chunk_at)
        self._give_back(prep)
        m, tenant = self.metrics, prep.tenant
        m.inc("pdserve_requests", tenant=tenant, endpoint=_endpoint(prep), status=str(status))
        m.observe("pdserve_e2e_seconds", total_s, tenant=tenant)
        m.observe("pdserve_ingress_overhead_seconds", max(0.0, total_s - engine_s))
        m.inc("pdserve_prompt_tokens", len(prep.ids), tenant=tenant)
        m.inc("pdserve_cached_tokens", _cached(prep, pre), tenant=tenant)
        m.inc("pdserve_completion_tokens", n_out, tenant=tenant)
        ttft = None
        if prep.first_chunk_at is not None:
            ttft = prep.first_chunk_at - prep.t0
            m.observe("pdserve_ttft_seconds", ttft, tenant=tenant)
            per_seq = n_out / max(1, prep.sampling.n)
            if prep.last_chunk_at is not None and per_seq > 1:
                itl = (prep.last_chunk_at - prep.first_chunk_at) / (per_seq - 1)
                m.observe("pdserve_itl_seconds", itl, tenant=tenant)
        if prep.span is not None:
            set_attrs(
                prep.span,
                {
                    "prefill_replica": pre.replica_id,
                    "decode_replica": last.replica_id if last else None,
                    "cached_tokens": _cached(prep, pre),
                    "completion_tokens": n_out,
                    "ttft_s": ttft,
                    "engine_s": engine_s,
                },
            )
            self._finish_span(prep.span, status, None)
            prep.span = None
        return total_s, engine_s

    def _refused(self, root: Any, endpoint: str, e: RequestError) -> JSONResponse:
        """A request refused in ``prepare`` (before any engine call): counted, its trace
        ended, its error body."""
        self.refused += 1
        self._finish_span(root, e.status, e.message)
        self.metrics.inc(
            "pdserve_requests", tenant=e.tenant or "-", endpoint=endpoint, status=str(e.status)
        )
        return _error(e)

    def _failed(
        self, prep: Prepared, e: RequestError, also: list[Prepared] | None = None
    ) -> JSONResponse:
        """A request that failed after ``prepare``: its metric and trace end, its error body
        (its reserved output tokens go back to its tenant, and those of the batch's other
        prompts in ``also``)."""
        self._give_back(prep)
        for other in also or ():
            self._give_back(other)
        self.metrics.inc(
            "pdserve_requests", tenant=prep.tenant, endpoint=_endpoint(prep), status=str(e.status)
        )
        if prep.span is not None:
            self._finish_span(prep.span, e.status, e.message)
            prep.span = None
        return _error(e)

    @staticmethod
    def _finish_span(span: Any, status: int, message: str | None) -> None:
        span.set_attribute("http.response.status_code", status)
        if status >= 400:
            span.set_status(Status(StatusCode.ERROR, message))
        span.end()


def _cached(prep: Prepared, pre: EngineChunk) -> int:
    """Prompt tokens found cached by the engine that computed the prompt."""
    return prep.local_cached if prep.local_cached is not None else pre.num_cached_tokens


def _local_prefill(prep: Prepared) -> EngineChunk:
    """The stand-in for a prefill's result when the decode (or colocated) engine computes the
    prompt itself: no KV to pull (``kv_transfer_params`` None). ``prep`` is marked so that
    its cached tokens are the ones that engine reports with its first chunk."""
    prep.local_cached = 0
    return EngineChunk("", (), None, len(prep.ids), 0, 0.0, kv_transfer_params=None)


_TENANT_NAME = re.compile(TENANT_PATTERN)


def _uncached(prep: Prepared, hint: RouteHint) -> int:
    """The prompt tokens the prefill will compute: all but the best prefix the index saw."""
    return max(0, len(prep.ids) - max((hint.matches or {}).values(), default=0))


def _tenancy(cfg: AppConfig, app: str) -> tuple[KeyStore, RateLimiter]:
    """The ingress's key store and rate limiter for ``cfg.tenants`` (Redis where asked)."""
    t = cfg.tenants
    redis_limits = t.limits_backend == "redis" or (
        t.limits_backend == "auto" and cfg.index.backend == "redis"
    )
    client = None
    if t.keys_in_redis or redis_limits:
        import redis.asyncio as aioredis

        timeout = max(0.05, cfg.index.lookup_timeout_s * 5)
        client = aioredis.Redis.from_url(
            cfg.index.redis_url,
            decode_responses=True,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            **cfg.index.redis_credentials("ingress").client_kwargs(),
        )
    hashes = {hash_key(k): v for k, v in cfg.ingress.api_keys.items()}
    hashes.update(t.key_hashes)
    hashes.update({h: OPERATOR for h in t.operator_key_hashes})
    keys = KeyStore(
        hashes,
        file=Path(t.keys_file).expanduser() if t.keys_file else None,
        redis=client if t.keys_in_redis else None,
        app=app,
        cache_s=t.key_cache_s,
    )
    return keys, RateLimiter(client if redis_limits else None, app)


class _Tally:
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
        self.parts[k][0].produced += len(ch.token_ids)
        return self.parts[k]

    def usage(self) -> Any:
        """The response's usage, summed over the parts."""
        return usage(
            sum(pre.num_prompt_tokens for _, pre in self.parts),
            sum(self.n_out),
            sum(_cached(prep, pre) for prep, pre in self.parts),
        )


def _engine_request(prep: Prepared, span: Any, **kw: Any) -> EngineRequest:
    """The engine call of ``prep`` under ``span`` (its W3C context travels with it)."""
    return EngineRequest(
        prep.engine_rid, prep.ids, prep.sampling, cache_salt=prep.salt, trace=inject(span), **kw
    )


def _endpoint(prep: Prepared) -> str:
    return "chat" if prep.chat else "completions"


def _contents(messages: Any) -> list[str]:
    """The string contents of a chat's messages (text parts included), cheaply: before the
    template runs, to refuse a conversation no context could hold."""
    out: list[str] = []
    for m in messages or ():
        c = dict(m).get("content")
        if isinstance(c, str):
            out.append(c)
        elif isinstance(c, list):
            out.extend(
                p.get("text") or ""
                for p in c
                if isinstance(p, dict) and isinstance(p.get("text"), str)
            )
    return out


def _body_size(body: Any) -> int:
    """A cheap size of the work in characters: a chat's contents (and its tools), a prompt's
    text (token ids count as a few each); any request with ``messages`` (``/tokenize``'s too)
    is a chat."""
    if getattr(body, "messages", None) is not None:
        total = sum(len(c) for c in _contents(body.messages))
        total += 64 * (len(body.messages) + len(getattr(body, "tools", None) or ()))
        return total
    p = body.prompt
    if isinstance(p, str):
        return len(p)
    return sum(len(x) if isinstance(x, (str, list)) else 4 for x in p or ())


def _replica_gone(e: BaseException) -> bool:
    """The call failed because its replica died or cannot be reached (not because of the
    request): Ray's actor errors, as Serve raises them to the caller."""
    from ray.exceptions import RayActorError

    return isinstance(e, RayActorError) or isinstance(_cause(e), RayActorError)


def _engine_error(phase: str, prep: Prepared, e: BaseException) -> RequestError:
    """An engine's refusal of the request's parameters is a 400 naming the field; any other
    failure a 502."""
    cause = _cause(e)
    if isinstance(cause, EngineRefused):
        return RequestError(cause.message, cause.param)
    log.warning("%s failed for %s: %s", phase, prep.rid, e)
    return RequestError(f"{phase} failed: {_reason(e)}", None, status=502)


def _echo(
    body: CompletionRequest | ChatCompletionRequest,
    prompt_text: str | None,
    decoded: Callable[[], str],
) -> str | None:
    """What an ``echo`` response starts with: a completion's prompt (``decoded()`` when it
    came as token ids); for chat, the last message's content when it is the assistant's
    (vLLM's rule)."""
    if not body.echo:
        return None
    if isinstance(body, CompletionRequest):
        return prompt_text if prompt_text is not None else decoded()
    if body.messages and dict(body.messages[-1]).get("role") == "assistant":
        return _text_of(dict(body.messages[-1]).get("content"), "messages")
    return None


def _merge_logprobs(acc: Any, new: Any) -> Any:
    """Append one chunk's logprobs to a choice's (chat: lists; completions: the object), in
    place: linear in the tokens (a concatenation per chunk made a long answer quadratic)."""
    if new is None:
        return acc
    if acc is None:
        return new
    if isinstance(acc, list):
        acc.extend(new)
        return acc
    for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        more = getattr(new, name)
        if more:
            if getattr(acc, name) is None:
                setattr(acc, name, [])
            getattr(acc, name).extend(more)
    return acc


async def _nothing() -> AsyncIterator[EngineChunk]:
    return
    yield  # an empty async generator


async def _with_echo_only(
    parts: list[tuple[Prepared, EngineChunk]], chunks: AsyncIterator[EngineChunk]
) -> AsyncIterator[EngineChunk]:
    """``chunks``, after one empty finished chunk per choice of every part that is an
    ``echo`` with ``max_tokens`` 0 (its response is the prompt alone, nothing decoded)."""
    for k, (prep, pre) in enumerate(parts):
        if prep.echo_only:
            n = prep.sampling.n
            for i in range(n):
                yield EngineChunk(
                    "", (), "length", len(prep.ids), pre.num_cached_tokens, 0.0, index=k * n + i
                )
    async for ch in chunks:
        yield ch


def _own_serve_request_id(detach: bool = False) -> None:
    """Give the current task's Serve calls an internal request id of their own. A handle call
    made while serving a request inherits that request's id, so the prefill (or decode) calls
    of a batch's prompts would share one id, which Serve's and our routers' bookkeeping are
    keyed by (seen: the second call never completed). ``detach``: a task that outlives the
    request it was started from (readiness checks, warm-ups, KV releases, the sync loop):
    Serve cancels a request's child calls, keyed by its id, when the request is cancelled (a
    client's time-out), so those calls must neither carry its id nor be cancelled with it. A
    no-op outside a Serve request."""
    try:
        from ray.serve import context as serve_context
        from ray.serve._private.utils import generate_request_id
    except Exception:  # no Serve: unit tests
        return
    cur = serve_context._serve_request_context.get()
    if cur is not None:
        update: dict[str, Any] = {"_internal_request_id": generate_request_id()}
        if detach:
            update["cancel_on_parent_request_cancel"] = False
        serve_context._serve_request_context.set(replace(cur, **update))


async def _own(stream: AsyncIterator[EngineChunk]) -> AsyncIterator[EngineChunk]:
    """``stream``, its Serve calls under their own request id (see
    :func:`_own_serve_request_id`); run in its own task, as :func:`_merge` does."""
    _own_serve_request_id()
    async for ch in stream:
        yield ch


async def _offset(stream: AsyncIterator[EngineChunk], by: int) -> AsyncIterator[EngineChunk]:
    """``stream`` with its chunks' choice index moved up by ``by`` (a batch's prompt ``k``)."""
    async for ch in stream:
        yield replace(ch, index=ch.index + by) if by else ch


async def _merge(streams: list[AsyncIterator[EngineChunk]]) -> AsyncIterator[EngineChunk]:
    """The chunks of several streams as they come; the first error ends all of them."""
    q: asyncio.Queue[Any] = asyncio.Queue()
    done = object()

    async def pump(s: AsyncIterator[EngineChunk]) -> None:
        try:
            async for ch in s:
                q.put_nowait(ch)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            q.put_nowait(e)
        finally:
            q.put_nowait(done)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    live = len(tasks)
    try:
        while live:
            item = await q.get()
            if item is done:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()


async def _prepend(
    first: EngineChunk | None, rest: AsyncIterator[EngineChunk]
) -> AsyncIterator[EngineChunk]:
    if first is not None:
        yield first
    async for ch in rest:
        yield ch


class _SettlingStream:
    """A response body (an async iterator of SSE lines) that runs ``on_close`` exactly once
    when it ends, fails or is closed, also when it was never iterated (the client went
    before the first byte: Starlette then never starts the body)."""

    def __init__(self, lines: AsyncIterator[str], on_close: Callable[[], Any]) -> None:
        self._lines = lines
        self._on_close: Callable[[], Any] | None = on_close

    def __aiter__(self) -> _SettlingStream:
        return self

    async def __anext__(self) -> str:
        try:
            return await self._lines.__anext__()
        except BaseException:
            await self.aclose()
            raise

    async def aclose(self) -> None:
        on_close, self._on_close = self._on_close, None
        if on_close is None:
            return
        try:
            await self._lines.aclose()  # type: ignore[attr-defined]
        finally:
            await on_close()


class _ClosingStreamingResponse(StreamingResponse):
    """Starlette's streaming response, whose body is closed however the response ends
    (Starlette cancels the body on a disconnect without closing it)."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await asyncio.shield(self.body_iterator.aclose())  # type: ignore[attr-defined]
