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
   types).

``/health`` is readiness: 200 only when both roles have a replica that served a probe request;
``/v1/models`` lists the model. ``/v1/pdserve/stats`` reports every engine replica (its id, the
requests routed to it, prompt and cached tokens, load), the routers' policy and named
fallbacks, the index and the ingress's own overhead. ``/v1/pdserve/route`` explains where a
prompt would go without running it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from deployments.config import AppConfig
from deployments.openai_api import (
    FINISH_REASONS,
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    completion_body,
    include_usage,
    new_id,
    sampling_of,
    stream_chunk,
    usage,
)
from deployments.prefix import IndexView
from deployments.protocol import EngineChunk, EngineRequest, RouteHint, Sampling
from deployments.router_registry import directory, router_stats

log = logging.getLogger(__name__)

api = FastAPI(title="pdserve", description="OpenAI-compatible prefill/decode serving")

ANONYMOUS = "anonymous"


def _error(e: RequestError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


@api.exception_handler(RequestValidationError)
async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    errs = exc.errors()
    first = errs[0] if errs else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    msg = f"{param}: {first.get('msg', 'invalid request')}" if param else "invalid request body"
    return _error(RequestError(msg, param))


def _cancel(call: Any) -> None:
    """Cancel a Serve call left behind by a time-out (Serve does not on an abandoned await)."""
    cancel = getattr(call, "cancel", None)
    if cancel is not None:
        cancel()


def _reason(e: BaseException) -> str:
    """The innermost message of an engine error (Ray wraps the replica's exception)."""
    cause = getattr(e, "cause", None) or e.__cause__ or e
    return str(cause).strip().splitlines()[-1][:300] if str(cause).strip() else type(cause).__name__


class Tokenizer:
    """The model's tokenizer, loaded once per ingress replica (the ingress tokenizes once)."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(path)

    def completion_ids(self, prompt: str | list[str] | list[int]) -> list[int]:
        if isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
            ids = [int(p) for p in prompt]
            vocab = len(self.tok)
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise RequestError(
                    f"prompt: token id {bad} is outside the vocabulary [0, {vocab})", "prompt"
                )
            return ids
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise RequestError(
                    "prompt: one prompt per request on the prefill/decode path", "prompt"
                )
            prompt = str(prompt[0])
        return list(self.tok(str(prompt))["input_ids"])

    def chat_ids(self, req: ChatCompletionRequest) -> list[int]:
        msgs = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            text = self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # the template refuses the conversation (roles, ...)
            raise RequestError(f"messages: the chat template refused them: {e}", "messages") from e
        return list(self.tok(text, add_special_tokens=False)["input_ids"])


@dataclass
class Prepared:
    """A request after the ``prepare`` phase: who sent it, its tokens, sampling and hashes."""

    rid: str
    chat: bool
    tenant: str
    ids: tuple[int, ...]
    sampling: Sampling
    hashes: dict[str, list[int]]
    stream: bool
    with_usage: bool
    t0: float
    #: wall seconds per phase (filled as the request goes; see ``IngressCore.phases``)
    timing: dict[str, float] = field(default_factory=dict)
    #: when the decode's last chunk arrived (monotonic; the ``respond`` phase starts there)
    last_chunk_at: float | None = None

    @property
    def salt(self) -> str:
        return self.tenant  # one cache namespace per tenant


#: Statistics of the directory reports shown per replica in ``/v1/pdserve/stats``.
_REPORT_KEYS = (
    "requests",
    "prompt_tokens",
    "cached_tokens",
    "queued_uncached_tokens",
    "waiting",
    "running",
    "kv_usage",
    "free_kv_blocks",
    "window_tokens",
    "token_load",
    "hash_mode",
    "external_hits",
    "prefix_hits",
    "kv_load_failures",
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
        self.tokenizer = Tokenizer(str(self.cfg.model.resolved_path()))
        self.model_name = self.cfg.model.served_name
        self.index = IndexView(self.cfg, app_name)
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
            for k in ("prepare", "route", "prefill", "decode_first", "decode", "respond")
        }
        self.requests = 0
        self.refused = 0

    # -- background: follow the prefill replicas ---------------------------------------------
    def _ensure_started(self) -> None:
        if self._sync_task is None or self._sync_task.done():
            self._sync_task = asyncio.get_running_loop().create_task(self._sync_loop())

    async def _sync_loop(self, period_s: float = 0.2) -> None:
        while True:
            await self.sync_index()
            await asyncio.sleep(period_s)  # a polling period, not a synchronisation

    async def sync_index(self) -> None:
        """Reconcile the index view with the prefill replicas Serve runs now."""
        d = self.directories["prefill"]
        if d.version != self._synced_version:
            version = d.version
            await self.index.sync(d.snapshot())
            self._synced_version = version

    # -- auth ----------------------------------------------------------------------------
    def tenant(self, request: Request) -> str:
        keys = self.cfg.ingress.api_keys
        if not keys:
            return ANONYMOUS
        auth = request.headers.get("authorization", "")
        key = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
        if key not in keys:
            raise RequestError("invalid or missing API key", None, status=401)
        return keys[key]

    # -- endpoints -----------------------------------------------------------------------
    async def health(self) -> JSONResponse:
        self._ensure_started()
        t = self.cfg.ingress.health_timeout_s
        status: dict[str, Any] = {}
        for role, h in (("prefill", self.prefill), ("decode", self.decode)):
            try:
                status[role] = bool(await asyncio.wait_for(h.ready.remote(), t))
            except Exception as e:  # not ready, or not reachable in time
                status[role] = f"not ready: {type(e).__name__}"
        ok = all(v is True for v in status.values())
        return JSONResponse(
            {"status": "ok" if ok else "starting", "engines": status},
            status_code=200 if ok else 503,
        )

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
        ``reset`` starts this ingress's overhead and phase samples afresh after reading."""
        from controllers.stats import summarize

        self._ensure_started()
        replicas: dict[str, list[dict[str, Any]]] = {}
        totals: dict[str, dict[str, Any]] = {}
        for role, d in self.directories.items():
            rows = []
            for rid, rep in sorted(d.snapshot().items()):
                rows.append(
                    {"id": rid, "routed": rep.get("requests", 0)}
                    | {k: rep[k] for k in _REPORT_KEYS if k in rep}
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
        }

    async def explain(
        self, request: Request, body: CompletionRequest | ChatCompletionRequest
    ) -> Any:
        """Where the request would be routed: the index's answer, without running it."""
        self._ensure_started()
        try:
            prep = await self.prepare(request, body)
        except RequestError as e:
            return _error(e)
        hint = await self.route(prep)
        return {
            "prompt_tokens": len(prep.ids),
            "blocks": max((len(h) for h in prep.hashes.values()), default=0),
            "matches": hint.matches,
            "policy": self.cfg.routing.policy,
            "prefill_replicas": sorted(self.directories["prefill"].snapshot()),
        }

    async def complete(
        self, request: Request, body: CompletionRequest | ChatCompletionRequest
    ) -> Any:
        """``prepare -> route -> prefill -> decode -> respond``; errors are 4xx/5xx bodies."""
        self._ensure_started()
        try:
            prep = await self.prepare(request, body)
        except RequestError as e:
            self.refused += 1
            return _error(e)
        self.requests += 1
        hint = await self.route(prep)
        try:
            pre = await self.run_prefill(prep, hint)
        except RequestError as e:
            return _error(e)
        chunks = self.decode_chunks(prep, pre)
        if prep.stream:
            return StreamingResponse(
                self.respond_sse(prep, pre, chunks), media_type="text/event-stream"
            )
        return await self.respond_json(prep, pre, chunks)

    # -- phases --------------------------------------------------------------------------
    async def prepare(
        self, request: Request, body: CompletionRequest | ChatCompletionRequest
    ) -> Prepared:
        """Auth, validation, tokenization and block hashes; raises :class:`RequestError`."""
        t0 = time.monotonic()
        chat = isinstance(body, ChatCompletionRequest)
        tenant = self.tenant(request)
        if body.model != self.model_name:
            raise RequestError(
                f"model {body.model!r} is not served here; /v1/models lists {self.model_name!r}",
                "model",
                status=404,
            )

        def work() -> tuple[list[int], Sampling, dict[str, list[int]]]:
            ids = (
                self.tokenizer.chat_ids(body)  # type: ignore[arg-type]
                if chat
                else self.tokenizer.completion_ids(body.prompt)  # type: ignore[union-attr]
            )
            if not ids:
                raise RequestError("the prompt is empty", "messages" if chat else "prompt")
            sampling = sampling_of(
                body,
                prompt_tokens=len(ids),
                max_model_len=self.cfg.model.max_model_len,
                default_max_tokens=self.cfg.ingress.max_tokens_default,
            )
            return ids, sampling, self.index.hashes(ids, tenant)

        if _size(body) > self.cfg.ingress.tokenize_off_loop_chars:
            ids, sampling, hashes = await asyncio.to_thread(work)
        else:
            ids, sampling, hashes = work()
        prep = Prepared(
            rid=new_id("chatcmpl" if chat else "cmpl"),
            chat=chat,
            tenant=tenant,
            ids=tuple(ids),
            sampling=sampling,
            hashes=hashes,
            stream=body.stream,
            with_usage=include_usage(body),
            t0=t0,
        )
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
        req = EngineRequest(prep.rid, prep.ids, prep.sampling, cache_salt=prep.salt, route=hint)
        t = time.monotonic()
        call = self.prefill.prefill.remote(req)
        try:
            pre: EngineChunk = await asyncio.wait_for(call, self.cfg.ingress.engine_timeout_s)
            prep.timing["prefill"] = time.monotonic() - t - pre.engine_s
            return pre
        except TimeoutError:
            _cancel(call)  # or the prefill runs on and holds KV blocks nobody will read
            raise RequestError("prefill timed out", None, status=504) from None
        except Exception as e:  # the engine refused or failed: a gateway error, not a 500
            log.warning("prefill failed for %s: %s", prep.rid, e)
            raise RequestError(f"prefill failed: {_reason(e)}", None, status=502) from None

    async def decode_chunks(self, prep: Prepared, pre: EngineChunk) -> AsyncIterator[EngineChunk]:
        """The decode replica's chunks, for both response forms. Engine failures and the
        deadline (``engine_timeout_s`` from the first chunk request) raise
        :class:`RequestError` (502/504); the stream is cancelled on the way out."""
        dreq = EngineRequest(
            prep.rid,
            prep.ids,
            prep.sampling,
            cache_salt=prep.salt,
            kv_transfer_params=pre.kv_transfer_params,
            route=RouteHint(len(prep.ids), None, prep.sampling.max_tokens),
        )
        t = time.monotonic()
        stream = self.decode_stream.decode.remote(dreq)
        it = stream.__aiter__()
        deadline = asyncio.get_running_loop().time() + self.cfg.ingress.engine_timeout_s
        done = False
        try:
            while True:
                try:
                    async with asyncio.timeout_at(deadline):
                        ch: EngineChunk = await it.__anext__()
                except StopAsyncIteration:
                    done = True
                    return
                except TimeoutError:
                    raise RequestError("decode timed out", None, status=504) from None
                except Exception as e:
                    log.warning("decode failed for %s: %s", prep.rid, e)
                    raise RequestError(f"decode failed: {_reason(e)}", None, status=502) from None
                prep.last_chunk_at = time.monotonic()
                waited = prep.last_chunk_at - t - ch.engine_s
                prep.timing.setdefault("decode_first", waited)
                prep.timing["decode"] = waited
                if ch.finish_reason is not None and ch.finish_reason not in FINISH_REASONS:
                    raise RequestError(f"decode ended with {ch.finish_reason!r}", None, status=502)
                yield ch
        finally:
            if not done:
                _cancel(stream)

    async def respond_json(
        self, prep: Prepared, pre: EngineChunk, chunks: AsyncIterator[EngineChunk]
    ) -> JSONResponse:
        text: list[str] = []
        n_out = 0
        finish: str | None = None
        last: EngineChunk | None = None
        try:
            async for ch in chunks:
                text.append(ch.text)
                n_out += len(ch.token_ids)
                finish = ch.finish_reason or finish
                last = ch
        except RequestError as e:
            return _error(e)
        total_s, engine_s = self._record(prep, pre, last)
        out = completion_body(
            prep.rid,
            self.model_name,
            "".join(text),
            finish,
            usage(len(prep.ids), n_out, pre.num_cached_tokens),
            prep.chat,
        )
        out["pdserve"] = {
            "ingress_replica": self.replica_id,
            "prefill_replica": pre.replica_id,
            "decode_replica": last.replica_id if last else None,
            "engine_s": engine_s,
            "ingress_s": total_s,
        }
        return JSONResponse(out)

    async def respond_sse(
        self, prep: Prepared, pre: EngineChunk, chunks: AsyncIterator[EngineChunk]
    ) -> AsyncIterator[str]:
        created = int(time.time())
        m = self.model_name

        def sse(obj: dict[str, Any]) -> str:
            return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"

        n_out = 0
        last: EngineChunk | None = None
        first = True
        try:
            async for ch in chunks:
                n_out += len(ch.token_ids)
                last = ch
                if ch.text or ch.finish_reason or first:
                    yield sse(
                        stream_chunk(
                            prep.rid,
                            m,
                            created,
                            chat=prep.chat,
                            text=ch.text,
                            role=first,
                            finish_reason=ch.finish_reason,
                        )
                    )
                    first = False
        except RequestError as e:  # an error event, then usage and [DONE]: well-formed
            yield sse(e.body())
        if prep.with_usage:
            use = usage(pre.num_prompt_tokens, n_out, pre.num_cached_tokens)
            yield sse(stream_chunk(prep.rid, m, created, chat=prep.chat, use=use))
        yield "data: [DONE]\n\n"
        self._record(prep, pre, last)

    def _record(
        self, prep: Prepared, pre: EngineChunk, last: EngineChunk | None
    ) -> tuple[float, float]:
        """Record one finished request's overhead (its wall time minus both engines' time)
        and phase times (see ``phases``); returns ``(wall seconds, engine seconds)``."""
        now = time.monotonic()
        total_s = now - prep.t0
        engine_s = pre.engine_s + (last.engine_s if last else 0.0)
        self.overhead_s.append(max(0.0, total_s - engine_s))
        for k, v in prep.timing.items():
            self.phases[k].append(max(0.0, v))
        if prep.last_chunk_at is not None:
            self.phases["respond"].append(now - prep.last_chunk_at)
        return total_s, engine_s


def _size(body: CompletionRequest | ChatCompletionRequest) -> int:
    """A cheap size of the prompt in characters (token ids count as a few each)."""
    if isinstance(body, ChatCompletionRequest):
        return sum(len(m.content) if isinstance(m.content, str) else 64 for m in body.messages)
    p = body.prompt
    if isinstance(p, str):
        return len(p)
    return sum(len(x) if isinstance(x, str) else 4 for x in p)
