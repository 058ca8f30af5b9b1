"""The HTTP ingress: OpenAI's completions and chat completions over one prefill and one decode
replica.

Per request: authenticate (API key -> tenant -> cache salt), validate (400 with a reason for what
the PD path cannot honour), tokenize once, hash the prompt's blocks and ask the prefix index what
is cached (advisory, bounded by a time-out), run the prefill replica (one token, NIXL producer),
then the decode replica with the prefill's ``kv_transfer_params``, and stream the decode's deltas
back as SSE ending in ``data: [DONE]``.

``/health`` is readiness: 200 only when both engines have served a probe request; ``/v1/models``
lists the model. ``/v1/pdserve/stats`` returns both engines' counters (local and external prefix
hits, failed KV loads) and the ingress's own (per-request overhead samples, index fallbacks).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from deployments.config import AppConfig
from deployments.openai_api import (
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
from deployments.prefix import ClusterPrefixLookup, NoPrefixLookup, PrefixLookup
from deployments.protocol import EngineChunk, EngineRequest

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


class IngressCore:
    """The ingress logic, independent of Serve's decorators (handles are injected).

    ``prefill`` and ``decode`` are Serve deployment handles (or any object with the same
    ``.prefill/.decode/.ready/.stats`` methods returning awaitables / async iterators via
    ``.remote``).
    """

    def __init__(self, config: dict[str, Any], prefill: Any, decode: Any) -> None:
        self.cfg = AppConfig.model_validate(config)
        self.prefill = prefill
        self.decode = decode
        self.tokenizer = Tokenizer(str(self.cfg.model.resolved_path()))
        self.model_name = self.cfg.model.served_name
        self.index: PrefixLookup = self._make_index()
        self._index_started = False
        self.overhead_s: deque[float] = deque(maxlen=4096)
        self.requests = 0
        self.refused = 0

    def _make_index(self) -> PrefixLookup:
        if self.cfg.index.backend == "none" or self.cfg.prefill.kv_events is None:
            return NoPrefixLookup()
        ev = self.cfg.prefill.kv_events
        return ClusterPrefixLookup({"prefill-0": (ev.endpoint, ev.replay_endpoint, ev.topic)})

    async def _ensure_index(self) -> None:
        if not self._index_started:
            self._index_started = True
            try:
                await self.index.start()
            except Exception:
                log.exception("prefix index feed did not start; continuing without it")
                self.index = NoPrefixLookup()

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

    async def stats(self) -> dict[str, Any]:
        from controllers.stats import summarize

        t = self.cfg.ingress.health_timeout_s
        out: dict[str, Any] = {
            "ingress": {
                "requests": self.requests,
                "refused": self.refused,
                "overhead_s": summarize(list(self.overhead_s)) if self.overhead_s else None,
                "index": dict(self.index.stats.__dict__),
            }
        }
        for role, h in (("prefill", self.prefill), ("decode", self.decode)):
            out[role] = await asyncio.wait_for(h.stats.remote(), t)
        return out

    async def complete(
        self, request: Request, body: CompletionRequest | ChatCompletionRequest
    ) -> Any:
        t0 = time.monotonic()
        chat = isinstance(body, ChatCompletionRequest)
        try:
            tenant = self.tenant(request)
            if body.model != self.model_name:
                raise RequestError(
                    f"model {body.model!r} is not served here; /v1/models lists "
                    f"{self.model_name!r}",
                    "model",
                    status=404,
                )
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
        except RequestError as e:
            self.refused += 1
            return _error(e)
        self.requests += 1
        await self._ensure_index()
        salt = tenant  # one cache namespace per tenant
        await self.index.lookup(ids, salt)
        rid = new_id("chatcmpl" if chat else "cmpl")
        req = EngineRequest(rid, tuple(ids), sampling, cache_salt=salt)
        timeout = self.cfg.ingress.engine_timeout_s
        call = self.prefill.prefill.remote(req)
        try:
            pre: EngineChunk = await asyncio.wait_for(call, timeout)
        except TimeoutError:
            _cancel(call)  # or the prefill runs on and holds KV blocks nobody will read
            return _error(RequestError("prefill timed out", None, status=504))
        except Exception as e:  # the engine refused or failed: a gateway error, not a 500
            log.warning("prefill failed for %s: %s", rid, e)
            return _error(RequestError(f"prefill failed: {_reason(e)}", None, status=502))
        dreq = EngineRequest(
            rid, tuple(ids), sampling, cache_salt=salt, kv_transfer_params=pre.kv_transfer_params
        )
        stream = self.decode.options(stream=True).decode.remote(dreq)
        if body.stream:
            return StreamingResponse(
                self._sse(rid, chat, stream, pre, include_usage(body), t0),
                media_type="text/event-stream",
            )
        text: list[str] = []
        n_out = 0
        finish: str | None = None
        last: EngineChunk | None = None
        try:
            async with asyncio.timeout(timeout):
                async for ch in stream:
                    text.append(ch.text)
                    n_out += len(ch.token_ids)
                    finish = ch.finish_reason or finish
                    last = ch
        except TimeoutError:
            _cancel(stream)
            return _error(RequestError("decode timed out", None, status=504))
        except Exception as e:
            log.warning("decode failed for %s: %s", rid, e)
            return _error(RequestError(f"decode failed: {_reason(e)}", None, status=502))
        engine_s = pre.engine_s + (last.engine_s if last else 0.0)
        total_s = time.monotonic() - t0
        self.overhead_s.append(max(0.0, total_s - engine_s))
        out = completion_body(
            rid,
            self.model_name,
            "".join(text),
            finish,
            usage(len(ids), n_out, pre.num_cached_tokens),
            chat,
        )
        out["pdserve"] = {"engine_s": engine_s, "ingress_s": total_s}
        return JSONResponse(out)

    async def _sse(
        self,
        rid: str,
        chat: bool,
        stream: Any,
        pre: EngineChunk,
        with_usage: bool,
        t0: float,
    ) -> AsyncIterator[str]:
        created = int(time.time())
        m = self.model_name

        def sse(obj: dict[str, Any]) -> str:
            return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"

        n_out = 0
        last: EngineChunk | None = None
        first = True
        try:
            async with asyncio.timeout(self.cfg.ingress.engine_timeout_s):
                async for ch in stream:
                    n_out += len(ch.token_ids)
                    last = ch
                    if ch.text or ch.finish_reason or first:
                        yield sse(
                            stream_chunk(
                                rid,
                                m,
                                created,
                                chat=chat,
                                text=ch.text,
                                role=first,
                                finish_reason=ch.finish_reason,
                            )
                        )
                        first = False
        except TimeoutError:
            _cancel(stream)
            yield sse(RequestError("decode timed out", None, status=504).body())
        except (
            Exception
        ) as e:  # an error event, then usage and [DONE]: the stream stays well-formed
            log.warning("decode failed for %s: %s", rid, e)
            yield sse(RequestError(f"decode failed: {_reason(e)}", None, status=502).body())
        if with_usage:
            yield sse(
                stream_chunk(
                    rid,
                    m,
                    created,
                    chat=chat,
                    use=usage(pre.num_prompt_tokens, n_out, pre.num_cached_tokens),
                )
            )
        yield "data: [DONE]\n\n"
        engine_s = pre.engine_s + (last.engine_s if last else 0.0)
        self.overhead_s.append(max(0.0, time.monotonic() - t0 - engine_s))
