"""OpenAI's requests as the PD path takes them: vLLM's own request models, their validation,
the refusals, the bounds, and the engines' sampling.

The request models *are* vLLM's (``vllm.entrypoints.openai``'s ``CompletionRequest`` and
``ChatCompletionRequest`` of the installed vLLM), so pdserve accepts what vLLM's OpenAI server
accepts, field for field, and builds the engines' ``SamplingParams`` with vLLM's own
``to_sampling_params``. Two differences, both deliberate:

- unknown fields are refused with the field named (vLLM logs and ignores them, so a typo
  silently changes nothing), and types are strict (``"stream": "yes"`` or ``"max_tokens":
  "5"`` is a 400, where vLLM coerces); OpenAI's ``best_of`` is accepted when it equals ``n``;
- the fields the prefill/decode path cannot honour are refused with a 400 whose message says
  why; every such field and reason is in :data:`REFUSED`, the one place the API document's
  table and the contract test read. Fields vLLM itself ignores on generation endpoints are
  listed in :data:`IGNORED`. ``tool_choice`` is refused as vLLM refuses it, by the server's
  parsers (:meth:`deployments.ingress.parsing.OutputParsers.check`).

The responses are :mod:`deployments.ingress.openai_responses`.
"""

from __future__ import annotations

import functools
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from openai.types.completion_usage import CompletionUsage, PromptTokensDetails
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator
from pydantic_core import PydanticCustomError
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionRequest as _VllmChatRequest,
)
from vllm.entrypoints.openai.completion.protocol import CompletionRequest as _VllmCompletionRequest
from vllm.entrypoints.serve.tokenize.protocol import (
    DetokenizeRequest as _VllmDetokenizeRequest,
)
from vllm.entrypoints.serve.tokenize.protocol import (
    TokenizeChatRequest as _VllmTokenizeChatRequest,
)
from vllm.entrypoints.serve.tokenize.protocol import (
    TokenizeCompletionRequest as _VllmTokenizeCompletionRequest,
)
from vllm.exceptions import VLLMClientError

from deployments.protocol import Sampling

#: OpenAI's error types for the statuses that have their own
_ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


class RequestError(ValueError):
    """A request the PD path refuses; ``param`` names the offending field (OpenAI's error
    ``param``), ``status`` is the HTTP status."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        headers: dict[str, str] | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        #: response headers (``Retry-After`` on a 429 or 503, ``WWW-Authenticate`` on a 401)
        self.headers = headers or {}
        self.code = code
        #: the tenant, when known (for the metrics of a refusal)
        self.tenant: str | None = None
        #: prompt tokens tokenized before the refusal (the work its tenant is charged for)
        self.tokenized = 0

    def body(self) -> dict[str, Any]:
        """OpenAI's error envelope."""
        return {
            "error": {
                "message": self.message,
                "type": _ERROR_TYPES.get(self.status)
                or ("invalid_request_error" if self.status < 500 else "server_error"),
                "param": self.param,
                "code": self.code,
            }
        }


_FORBID = ConfigDict(extra="forbid")

#: Roles a chat message may have (vLLM also passes any other role to the chat template)
ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def _strictly(shape: type[BaseModel], data: Any) -> Any:
    """Strict types, at every depth: ``data`` (a JSON body) is first validated as JSON against
    ``shape`` in pydantic's strict mode (no string becomes a boolean or a number, no float an
    integer, in nested objects too), then as vLLM validates it. vLLM's models coerce, so
    ``"stream": "yes"`` would stream and ``"max_tokens": "5"`` would pass; here each is a 400
    naming the field. ``shape`` is the request model without this check (no recursion)."""
    if isinstance(data, dict):
        try:
            text = json.dumps(data)
        except (TypeError, ValueError):  # not from a JSON body (Python callers)
            return data
        try:
            shape.model_validate_json(text, strict=True)
        except (TypeError, AttributeError, KeyError) as e:
            # a vLLM validator that assumed a type the schema did not check yet (e.g.
            # "messages": null): a 400 saying so, not a 500
            raise PydanticCustomError(
                "invalid_type", "the body has a field of the wrong type: {e}", {"e": str(e)[:200]}
            ) from None
    return data


@functools.cache
def _tool_call_shape() -> TypeAdapter[Any]:
    from openai.types.chat import ChatCompletionMessageToolCallUnionParam

    return TypeAdapter(ChatCompletionMessageToolCallUnionParam)


def _check_tool_calls(calls: Any, where: str) -> None:
    """An assistant message's ``tool_calls``, each checked now against the type vLLM's
    message takes (OpenAI's tool call): vLLM's model checks them lazily, where a bad one's
    error loses its place in the body."""
    if not isinstance(calls, list):
        return
    for j, call in enumerate(calls):
        try:
            _tool_call_shape().validate_python(call)
        except ValidationError as e:
            err = e.errors()[0]
            at = ".".join(str(p) for p in err["loc"][1:])
            raise PydanticCustomError(
                "tool_call",
                "{param}: {msg}",
                {"param": f"{where}.{j}" + (f".{at}" if at else ""), "msg": err["msg"]},
            ) from None


def _check_roles(data: Any) -> Any:
    msgs = data.get("messages") if isinstance(data, dict) else None
    if isinstance(msgs, list):
        for i, m in enumerate(msgs):
            role = m.get("role") if isinstance(m, dict) else None
            if role not in ROLES:
                raise PydanticCustomError(
                    "role",
                    "{param}: {role} is not one of {roles}",
                    {"param": f"messages.{i}.role", "role": repr(role), "roles": ", ".join(ROLES)},
                )
            if role == "assistant":
                _check_tool_calls(m.get("tool_calls"), f"messages.{i}.tool_calls")
    return data


class _StrictTypes(BaseModel):
    """Mixin of the request models: the body is checked by :func:`_strictly` against the
    model's *shape* (the next class in its MRO, the same model without this check), after
    :func:`_check_roles` for models that carry ``messages`` (``checks_roles``)."""

    checks_roles: ClassVar[bool] = False

    @model_validator(mode="before")
    @classmethod
    def _strict(cls, data: Any) -> Any:
        shape = next(
            b
            for b in cls.__mro__[1:]
            if issubclass(b, BaseModel) and not issubclass(b, _StrictTypes)
        )
        return _strictly(shape, _check_roles(data) if cls.checks_roles else data)


class _CompletionShape(_VllmCompletionRequest):
    model_config = _FORBID
    best_of: int | None = Field(
        default=None, ge=1, description="OpenAI's; accepted when it equals n (vLLM V1 has none)."
    )


class CompletionRequest(_StrictTypes, _CompletionShape):
    """``POST /v1/completions``: vLLM's request model, unknown fields refused, types strict."""


class _ChatShape(_VllmChatRequest):
    model_config = _FORBID


class ChatCompletionRequest(_StrictTypes, _ChatShape):
    """``POST /v1/chat/completions``: vLLM's request model, unknown fields refused, types
    strict, roles among :data:`ROLES`."""

    checks_roles = True


class _TokenizeShape(_VllmTokenizeCompletionRequest):
    model_config = _FORBID


class TokenizeCompletionRequest(_StrictTypes, _TokenizeShape):
    """``POST /tokenize`` with a ``prompt`` (vLLM's route)."""


class _TokenizeChatShape(_VllmTokenizeChatRequest):
    model_config = _FORBID


class TokenizeChatRequest(_StrictTypes, _TokenizeChatShape):
    """``POST /tokenize`` with ``messages`` (vLLM's route)."""

    checks_roles = True


class _DetokenizeShape(_VllmDetokenizeRequest):
    model_config = _FORBID


class DetokenizeRequest(_StrictTypes, _DetokenizeShape):
    """``POST /detokenize`` (vLLM's route)."""


AnyRequest = CompletionRequest | ChatCompletionRequest


def is_batch(prompt: Any) -> bool:
    """More than one prompt: several strings, or several token-id lists."""
    return isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], (str, list))


def single_prompt(prompt: Any) -> str | list[int]:
    """The one prompt of a request (``["text"]`` and ``[[ids]]`` are batches of one); a
    batch of several is a 400 here (the ingress splits batches before)."""
    if is_batch(prompt):
        raise RequestError("prompt: one prompt here, not a batch", "prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    return [int(t) for t in prompt]


#: field -> (is its value one the PD path cannot honour?, why). The one list of refusals: the
#: API document's table (docs/api.md) and the contract test over vLLM's request fields read it.
REFUSED: dict[str, tuple[Callable[[Any, Any], bool], str]] = {
    "use_beam_search": (
        lambda v, r: bool(v),
        "beam search runs many dependent sequences in vLLM's serving layer; the PD path "
        "runs one prefill and n independent decode sequences",
    ),
    "best_of": (
        lambda v, r: v is not None and v != (r.n or 1),
        "best_of other than n is not supported (vLLM V1 has no best_of)",
    ),
    "suffix": (lambda v, r: v is not None, "suffix is not supported (nor by vLLM's server)"),
    "prompt_embeds": (
        lambda v, r: v is not None,
        "prompt embeddings have no token ids to hash and route by",
    ),
    "kv_transfer_params": (
        lambda v, r: v is not None,
        "set by pdserve itself for the prefill -> decode hand-off",
    ),
    "ec_transfer_params": (
        lambda v, r: v is not None,
        "encoder-cache disaggregation is not configured (text-only models)",
    ),
    "priority": (
        lambda v, r: v not in (None, 0),
        "priority scheduling is not configured: Fairway orders the prefill queue and TWP "
        "admits the decode",
    ),
    "chat_template": (
        lambda v, r: v is not None,
        "a request-supplied chat template is refused (vLLM refuses it too unless started "
        "with --trust-request-chat-template); the model's own template is used",
    ),
    "media_io_kwargs": (lambda v, r: v is not None, "multimodal inputs are not supported"),
    "mm_processor_kwargs": (lambda v, r: v is not None, "multimodal inputs are not supported"),
    "routed_experts_prompt_start": (
        lambda v, r: v not in (None, 0),
        "routed-expert data is not returned",
    ),
}

#: Fields accepted and, as on vLLM's own generation endpoints, without effect here.
IGNORED: dict[str, str] = {
    "user": "recorded by OpenAI; vLLM ignores it too",
    "session_id": "no session affinity beyond the prefix index",
    "return_token_offsets": "render endpoints only (vLLM ignores it on generation too)",
    "mm_payload": "render endpoints only (vLLM ignores it on generation too)",
    "return_mm_kwargs": "render endpoints only (vLLM ignores it on generation too)",
    "length_penalty": "beam search only",
    "stream_options.continuous_usage_stats": "usage comes in the last chunk",
}


def refuse_unsupported(req: Any, trust_request_chat_template: bool = False) -> None:
    """Raise :class:`RequestError` for the first field set to something the PD path cannot do
    (a request's own ``chat_template`` passes when the operator trusts them:
    ``ingress.trust_request_chat_template``)."""
    fields = type(req).model_fields
    for name, (bad, why) in REFUSED.items():
        if name == "chat_template" and trust_request_chat_template:
            continue
        if name in fields and bad(getattr(req, name), req):
            raise RequestError(f"{name}: {why}", name)


#: what a client ``request_id`` may hold (it reaches logs, engine request ids and spans)
REQUEST_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._:-")


@dataclass(frozen=True)
class Bounds:
    """Per-request bounds on the fields that make work in the shared engines or reach logs
    (``ingress.*``: see :class:`deployments.config.IngressConfig`)."""

    allowed_vllm_xargs: frozenset[str] = frozenset()
    max_stop_sequences: int = 16
    max_logit_bias: int = 300
    max_request_id_chars: int = 128


def check_bounds(req: Any, b: Bounds) -> None:
    """Raise :class:`RequestError` (400 naming the field) for a field past its bound: a
    ``vllm_xargs`` key not allowed (it reaches the engines' ``SamplingParams.extra_args``,
    where vLLM keeps its own fields), too many stop strings, stop token ids, bad words or
    logit-bias entries, a ``request_id`` too long or with other characters than
    :data:`REQUEST_ID_CHARS`. Cheap: it runs before the prompt is tokenized."""
    rid = getattr(req, "request_id", None)
    if isinstance(rid, str):
        if len(rid) > b.max_request_id_chars:
            raise RequestError(
                f"request_id: {len(rid)} characters; at most {b.max_request_id_chars}",
                "request_id",
            )
        if not set(rid) <= REQUEST_ID_CHARS:
            raise RequestError("request_id: letters, digits and '._:-' only", "request_id")
    xargs = getattr(req, "vllm_xargs", None) or {}
    bad = sorted(k for k in xargs if k not in b.allowed_vllm_xargs)
    if bad:
        allowed = ", ".join(sorted(b.allowed_vllm_xargs)) or "none"
        raise RequestError(
            f"vllm_xargs.{bad[0][:64]}: not an allowed extension key (allowed: {allowed}; "
            "ingress.allowed_vllm_xargs)",
            f"vllm_xargs.{bad[0][:64]}",
        )
    stop = getattr(req, "stop", None)
    lists = {
        "stop": [stop] if isinstance(stop, str) else list(stop or ()),
        "stop_token_ids": list(getattr(req, "stop_token_ids", None) or ()),
        "bad_words": list(getattr(req, "bad_words", None) or ()),
    }
    for name, items in lists.items():
        if len(items) > b.max_stop_sequences:
            raise RequestError(
                f"{name}: {len(items)} entries; at most {b.max_stop_sequences}", name
            )
    bias = getattr(req, "logit_bias", None) or {}
    if len(bias) > b.max_logit_bias:
        raise RequestError(
            f"logit_bias: {len(bias)} entries; at most {b.max_logit_bias}", "logit_bias"
        )


@dataclass(frozen=True)
class Resolved:
    """What :func:`sampling_of` resolved: the engines' sampling and the response's options."""

    sampling: Sampling
    #: completions with ``echo`` and ``max_tokens`` 0: the prompt back, no decode
    echo_only: bool = False


#: ``vllm.SamplingParams`` fields derived in its ``__post_init__`` or set per role by the
#: engine replicas, so not carried from the ingress.
_DERIVED = frozenset(
    {"output_text_buffer_length", "skip_reading_prefix_cache", "skip_clone", "output_kind"}
)


def _params_kwargs(sp: Any) -> dict[str, Any]:
    """The public constructor keywords of a ``vllm.SamplingParams``."""
    return {
        f: getattr(sp, f)
        for f in sp.__struct_fields__
        if not f.startswith("_") and f not in _DERIVED
    }


def sampling_of(
    req: AnyRequest,
    *,
    prompt_tokens: int,
    max_model_len: int,
    default_max_tokens: int,
    defaults: dict[str, Any] | None = None,
    max_tokens_cap: int | None = None,
    trust_request_chat_template: bool = False,
    clamp_to_room: bool = False,
) -> Resolved:
    """The engines' sampling for ``req``, after every PD-path check.

    ``max_tokens`` as vLLM resolves it: a completion's defaults to 16 (OpenAI's default); a
    chat's (``max_completion_tokens``, else ``max_tokens``) to ``min(default_max_tokens, room
    left)``. One that does not fit ``max_model_len`` with the prompt is a 400 naming it.
    ``defaults`` are the server's default sampling values (vLLM's
    ``default_sampling_params``: the model's generation config). ``max_tokens_cap`` is the
    tenant's cap: a request asking for more is a 400 naming the field; the default is held
    under it. ``clamp_to_room``: more ``max_tokens`` than the context has room for is held
    to the room instead (vLLM's Responses API does that with ``max_output_tokens``).
    """
    refuse_unsupported(req, trust_request_chat_template)
    chat = isinstance(req, ChatCompletionRequest)
    room = max_model_len - prompt_tokens
    where = "messages" if chat else "prompt"
    if room < 1:
        raise RequestError(
            f"{where}: the prompt has {prompt_tokens} tokens; max_model_len is {max_model_len}",
            where,
        )
    asked: int | None
    if isinstance(req, ChatCompletionRequest):
        if req.max_completion_tokens is not None:
            asked, fname = req.max_completion_tokens, "max_completion_tokens"
        else:  # deprecated in chat (read without the deprecation warning), still honoured
            asked, fname = vars(req).get("max_tokens"), "max_tokens"
    else:
        asked, fname = req.max_tokens, "max_tokens"
    if asked is not None and asked > room and clamp_to_room:
        asked = room
    if asked is not None and asked > room:
        raise RequestError(
            f"{fname}={asked} plus the prompt's {prompt_tokens} tokens exceeds "
            f"max_model_len={max_model_len}",
            fname,
        )
    if asked is not None and max_tokens_cap is not None and asked > max_tokens_cap:
        raise RequestError(f"{fname}={asked} is above this tenant's cap of {max_tokens_cap}", fname)
    if max_tokens_cap is not None:
        default_max_tokens = min(default_max_tokens, max_tokens_cap)
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if any(not s for s in stops):
        raise RequestError("stop: stop strings must be non-empty", "stop")
    echo_only = not chat and bool(req.echo) and asked == 0
    max_tokens = asked if asked is not None else min(default_max_tokens, room)
    try:
        sp = req.to_sampling_params(max_tokens, dict(defaults or {}))
    except (ValueError, TypeError, VLLMClientError) as e:
        param = getattr(e, "parameter", None)
        raise RequestError(str(e).strip().splitlines()[0][:500], param) from None
    params = _params_kwargs(sp)
    return Resolved(
        Sampling(
            max_tokens=int(sp.max_tokens or 1),
            temperature=float(sp.temperature),
            top_p=float(sp.top_p),
            seed=sp.seed,
            stop=tuple(sp.stop or ()),
            ignore_eos=bool(sp.ignore_eos),
            n=int(sp.n),
            logprobs=sp.logprobs,
            prompt_logprobs=sp.prompt_logprobs,
            params=params,
        ),
        echo_only=echo_only,
    )


def include_usage(req: AnyRequest) -> bool:
    return bool(req.stream and req.stream_options and req.stream_options.include_usage)


def new_id(prefix: str, request_id: str | None = None) -> str:
    return f"{prefix}-{request_id or uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> CompletionUsage:
    """OpenAI's usage block, with ``prompt_tokens_details.cached_tokens``."""
    return CompletionUsage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )
