"""The HTTP surface: the FastAPI app, its middlewares, its error envelope and the Serve
ingress deployment whose routes hand each request to
:class:`~deployments.ingress.core.IngressCore`.

Middlewares, outermost first: :class:`~deployments.ingress.auth.AuthGuard` (the key, from the
headers, before the body is read: 401/403/429 cost no parsing) and
:class:`~deployments.ingress.http_guard.BodyGuard` (the body's size and JSON depth). Every error,
FastAPI's own included, is OpenAI's envelope with a reason.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException
from vllm.exceptions import VLLMClientError

from deployments.ingress.auth import AuthGuard
from deployments.ingress.core import IngressCore
from deployments.ingress.http_guard import BodyGuard
from deployments.ingress.openai_requests import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    RequestError,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from deployments.ingress.respond import error_response
from deployments.ingress.responses_api import ResponsesRequest

api = FastAPI(title="pdserve", description="OpenAI-compatible prefill/decode serving")
api.add_middleware(BodyGuard)
api.add_middleware(AuthGuard)  # added last: runs first, before the body is read


@api.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Starlette's and FastAPI's own errors (unknown route, wrong method, a body FastAPI cannot
    parse) in OpenAI's envelope."""
    return error_response(RequestError(str(exc.detail), None, status=exc.status_code))


@api.exception_handler(RequestValidationError)
async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    errs = exc.errors()
    first = errs[0] if errs else {}
    if first.get("type") == "json_invalid":
        pos = next((p for p in first.get("loc", ()) if isinstance(p, int)), None)
        ctx = first.get("ctx") or {}
        where = f" at character {pos}" if pos is not None else ""
        return error_response(
            RequestError(f"the body is not valid JSON{where}: {ctx.get('error', '')}")
        )
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if not loc and first.get("type") in ("model_attributes_type", "dict_type", "missing"):
        got = type(first.get("input")).__name__
        return error_response(RequestError(f"the body must be a JSON object (got {got})"))
    ctx = first.get("ctx") or {}
    param = ".".join(loc) or (ctx.get("param") if isinstance(ctx, dict) else None)
    text = str(first.get("msg") or "invalid request body")
    msg = text if not loc else f"{param}: {text}"
    return error_response(RequestError(msg[:1000], param))


@api.exception_handler(VLLMClientError)
async def _vllm_client_error(_: Request, exc: VLLMClientError) -> JSONResponse:
    """vLLM's request models raise their own error from some validators (pydantic passes it
    through): a 400 naming the parameter, as vLLM's server answers it."""
    param = getattr(exc, "parameter", None)
    return error_response(RequestError(str(exc).strip()[:500] or "invalid request", param))


@serve.deployment(name="ingress")
@serve.ingress(api)
class Ingress:
    """The ingress deployment: the routes, each handed to :class:`IngressCore`."""

    def __init__(self, config: dict[str, Any], prefill: Any, decode: Any) -> None:
        ctx = serve.get_replica_context()
        self.core = IngressCore(config, prefill, decode, ctx.app_name, ctx.replica_id.unique_id)

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Serve's ``user_config`` (routing parameters, live; see ``IngressCore.reconfigure``)."""
        self.core.reconfigure(user_config)

    @api.post("/v1/completions")
    async def completions(self, request: Request, body: CompletionRequest) -> Any:
        return await self.core.complete(request, body)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request, body: ChatCompletionRequest) -> Any:
        return await self.core.complete(request, body)

    @api.post("/v1/responses")
    async def responses(self, request: Request, body: ResponsesRequest) -> Any:
        """OpenAI's Responses API, stateless: run as a chat (:mod:`.responses_api`)."""
        return await self.core.complete(request, body)

    @api.post("/tokenize")
    async def tokenize(
        self, request: Request, body: TokenizeCompletionRequest | TokenizeChatRequest
    ) -> Any:
        return await self.core.tokenize(request, body)

    @api.post("/detokenize")
    async def detokenize(self, request: Request, body: DetokenizeRequest) -> Any:
        return await self.core.detokenize(request, body)

    async def inject_routing_hold(self, role: str, seconds: float) -> str:
        """Fault injection (the role's ``fault_injection: true`` only): see
        ``IngressCore.inject_routing_hold``. A handle call, not an HTTP route."""
        return self.core.inject_routing_hold(role, seconds)

    @api.get("/v1/models")
    async def models(self) -> Any:
        return self.core.models()

    @api.get("/health")
    async def health(self) -> Any:
        return await self.core.health()

    @api.get("/v1/pdserve/stats")
    async def stats(self) -> Any:
        """Operator route (operator key): every replica, router, the index and the ingress."""
        return await self.core.stats()

    @api.post("/v1/pdserve/stats/reset")
    async def stats_reset(self) -> Any:
        """Operator route: the stats, then this ingress's overhead samples start afresh."""
        return await self.core.stats(reset=True)

    @api.post("/v1/pdserve/route")
    async def route(
        self, request: Request, body: CompletionRequest, tenant: str = "anonymous"
    ) -> Any:
        """Operator route: where ``tenant``'s request would be routed, without running it."""
        return await self.core.explain(request, body, tenant)
