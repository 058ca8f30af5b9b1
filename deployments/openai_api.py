"""OpenAI request schemas the PD path accepts, their validation, and response builders.

The request models *are* vLLM's (``vllm.entrypoints.openai``'s ``CompletionRequest`` and
``ChatCompletionRequest`` of the installed vLLM), so pdserve accepts what vLLM's OpenAI server
accepts, field for field, and builds the engines' ``SamplingParams`` with vLLM's own
``to_sampling_params``. Two differences, both deliberate:

- unknown fields are refused with the field named (vLLM logs and ignores them, so a typo
  silently changes nothing), and types are strict (``"stream": "yes"`` or ``"max_tokens":
  "5"`` is a 400, where vLLM coerces); OpenAI's ``best_of`` is accepted when it equals ``n``;
- the fields the prefill/decode path cannot honour are refused with a 400 whose message says
  why; every such field and reason is in :data:`REFUSED`, the one place the README's table
  and the contract test read. Fields vLLM itself ignores on generation endpoints are listed in
  :data:`IGNORED`.

Responses are built with the ``openai`` package's types, plus vLLM's extensions
(``prompt_logprobs``, ``token_ids``, ``prompt_token_ids``, ``prompt_text``) where asked.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from openai.types import Completion, CompletionChoice
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessage
from openai.types.chat.chat_completion import Choice as ChatChoice
from openai.types.chat.chat_completion import ChoiceLogprobs
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice
from openai.types.chat.chat_completion_chunk import ChoiceDelta
from openai.types.chat.chat_completion_chunk import ChoiceLogprobs as ChunkLogprobs
from openai.types.chat.chat_completion_token_logprob import (
    ChatCompletionTokenLogprob,
    TopLogprob,
)
from openai.types.completion_choice import Logprobs as CompletionLogprobs
from openai.types.completion_usage import CompletionUsage, PromptTokensDetails
from pydantic import BaseModel, ConfigDict, Field, model_validator
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

from deployments.protocol import Sampling, TokenLogprob

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
#: README's table and the contract test over vLLM's request fields read it.
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
    "tool_choice": (
        lambda v, r: v not in (None, "none"),
        "tool calls need vLLM's tool-call parsers, which pdserve does not run: tools go into "
        "the chat template with tool_choice 'none' and the reply is plain text",
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
    "parallel_tool_calls": "no tool calls are parsed (see tool_choice)",
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
) -> Resolved:
    """The engines' sampling for ``req``, after every PD-path check.

    ``max_tokens`` as vLLM resolves it: a completion's defaults to 16 (OpenAI's default); a
    chat's (``max_completion_tokens``, else ``max_tokens``) to ``min(default_max_tokens, room
    left)``. One that does not fit ``max_model_len`` with the prompt is a 400 naming it.
    ``defaults`` are the server's default sampling values (vLLM's
    ``default_sampling_params``: the model's generation config). ``max_tokens_cap`` is the
    tenant's cap: a request asking for more is a 400 naming the field; the default is held
    under it.
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


# -- log-probabilities ---------------------------------------------------------------------------


@dataclass(frozen=True)
class LogprobFormat:
    """How a request asked for log-probabilities: ``top`` alternatives per token (``-1``:
    all the engine returned), tokens as ``token_id:N`` strings, explicit ``logprob_token_ids``."""

    top: int
    as_token_ids: bool = False
    explicit_ids: bool = False

    @staticmethod
    def of(req: AnyRequest) -> LogprobFormat | None:
        if isinstance(req, ChatCompletionRequest):
            if not req.logprobs:
                return None
            top = req.top_logprobs if req.top_logprobs is not None else 0
        else:
            if req.logprobs is None and not req.logprob_token_ids:
                return None
            top = req.logprobs or 0
        return LogprobFormat(
            int(top), bool(req.return_tokens_as_token_ids), bool(req.logprob_token_ids)
        )

    def text(self, token_id: int, token: str | None, decode: Callable[[int], str]) -> str:
        if self.as_token_ids:
            return f"token_id:{token_id}"
        return token if token is not None else decode(token_id)


def _lp(x: float) -> float:
    """OpenAI's finite stand-in for ``-inf``."""
    return max(x, -9999.0) if not math.isnan(x) else -9999.0


def completion_logprobs(
    entries: Sequence[TokenLogprob | None],
    fmt: LogprobFormat,
    decode: Callable[[int], str],
    offset: int = 0,
) -> CompletionLogprobs:
    """The text-completion ``logprobs`` object, as vLLM builds it: per token its text, its
    logprob, the top ``fmt.top`` alternatives plus the token itself, and its text offset.
    ``None`` entries (the first prompt token of an echo) get no logprob."""
    tokens: list[str] = []
    token_lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for e in entries:
        if e is None or e.logprob is None:  # a prompt's first token has no logprob
            tok = fmt.text(e.token_id, e.token, decode) if e is not None else ""
            token_lps.append(None)
            tops.append(None)
        else:
            tok = fmt.text(e.token_id, e.token, decode)
            token_lps.append(_lp(e.logprob))
            tops.append(
                {
                    fmt.text(t, s, decode): _lp(lp)
                    for i, (t, s, lp, _r) in enumerate(e.top)
                    if fmt.explicit_ids or fmt.top == -1 or fmt.top >= i
                }
            )
        offsets.append(offset)
        offset += len(tok)
        tokens.append(tok)
    # built without validation: the first prompt token's logprob is null (as vLLM sends it),
    # which the ``openai`` type does not allow for
    return CompletionLogprobs.model_construct(
        tokens=tokens, token_logprobs=token_lps, top_logprobs=tops, text_offset=offsets
    )


def chat_logprobs(
    entries: Sequence[TokenLogprob], fmt: LogprobFormat, decode: Callable[[int], str]
) -> list[ChatCompletionTokenLogprob]:
    """The chat ``logprobs.content`` list, as vLLM builds it (``top_logprobs`` are the first
    ``fmt.top`` of the engine's candidates)."""
    out = []
    for e in entries:
        tok = fmt.text(e.token_id, e.token, decode)
        top = [
            TopLogprob(token=s2, logprob=_lp(lp), bytes=list(s2.encode("utf-8", "replace")))
            for i, (t, s, lp, _r) in enumerate(e.top)
            if fmt.explicit_ids or fmt.top == -1 or i < fmt.top
            for s2 in (fmt.text(t, s, decode),)
        ]
        out.append(
            ChatCompletionTokenLogprob(
                token=tok,
                logprob=_lp(e.logprob if e.logprob is not None else -9999.0),
                bytes=list(tok.encode("utf-8", "replace")),
                top_logprobs=top,
            )
        )
    return out


def prompt_logprobs_json(
    entries: Sequence[TokenLogprob | None],
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs`` extension: per prompt position ``{token_id: {logprob, rank,
    decoded_token}}``, ``None`` for the first."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for e in entries:
        if e is None or e.logprob is None:
            out.append(None)
            continue
        out.append(
            {str(t): {"logprob": _lp(lp), "rank": r, "decoded_token": s} for t, s, lp, r in e.top}
        )
    return out


# -- bodies --------------------------------------------------------------------------------------


@dataclass
class ChoiceOut:
    """One choice of a response, accumulated from the decode's chunks (or one chunk's delta)."""

    index: int = 0
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    token_ids: list[int] = field(default_factory=list)
    #: completions: the ``logprobs`` object; chat: the ``logprobs.content`` list
    logprobs: Any = None
    prompt_logprobs: Any = None


def _dump(m: Any) -> dict[str, Any]:
    out: dict[str, Any] = m.model_dump(mode="json", exclude_unset=True)
    return out


def completion_body(
    rid: str,
    model: str,
    choices: Sequence[ChoiceOut],
    use: CompletionUsage,
    chat: bool,
    *,
    token_ids: bool = False,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A whole (non-streamed) completion or chat completion (the ``openai`` package's types,
    with vLLM's ``stop_reason``, and ``token_ids`` when ``token_ids``)."""
    created = int(time.time())
    if chat:
        body = _dump(
            ChatCompletion(
                id=rid,
                object="chat.completion",
                created=created,
                model=model,
                choices=[
                    ChatChoice(
                        index=c.index,
                        message=ChatCompletionMessage(role="assistant", content=c.text),
                        finish_reason=c.finish_reason,  # type: ignore[arg-type]
                        logprobs=None if c.logprobs is None else ChoiceLogprobs(content=c.logprobs),
                    )
                    for c in choices
                ],
                usage=use,
            )
        )
    else:
        body = _dump(
            Completion(
                id=rid,
                object="text_completion",
                created=created,
                model=model,
                choices=[
                    CompletionChoice(
                        index=c.index,
                        text=c.text,
                        finish_reason=c.finish_reason,  # type: ignore[arg-type]
                        logprobs=c.logprobs,
                    )
                    for c in choices
                ],
                usage=use,
            )
        )
    for out, c in zip(body["choices"], choices, strict=True):
        out["stop_reason"] = c.stop_reason
        if token_ids:
            out["token_ids"] = list(c.token_ids)
        if c.prompt_logprobs is not None:
            out["prompt_logprobs"] = c.prompt_logprobs
    body.update(extra or {})
    return body


def stream_chunk(
    rid: str,
    model: str,
    created: int,
    *,
    chat: bool,
    delta: ChoiceOut | None = None,
    role: bool = False,
    use: CompletionUsage | None = None,
    token_ids: bool = False,
) -> dict[str, Any]:
    """One SSE chunk: ``delta`` is one choice's new text (and logprobs); ``use`` set: the
    usage-only last chunk (``choices`` empty).

    Chat chunks are ``openai``'s ``ChatCompletionChunk``; text-completion chunks are its
    ``Completion`` built without validation (its ``finish_reason`` is not optional, but a
    stream's chunks before the last carry none, as OpenAI's and vLLM's servers send them).
    """
    d = delta or ChoiceOut()
    if chat:
        choices = []
        if use is None:
            cd = ChoiceDelta(role="assistant") if role else ChoiceDelta()
            cd.content = d.text
            choices = [
                ChunkChoice(
                    index=d.index,
                    delta=cd,
                    finish_reason=d.finish_reason,  # type: ignore[arg-type]
                    logprobs=None if d.logprobs is None else ChunkLogprobs(content=d.logprobs),
                )
            ]
        chunk = ChatCompletionChunk(
            id=rid, object="chat.completion.chunk", created=created, model=model, choices=choices
        )
        if use is not None:
            chunk.usage = use  # marked as set, so it is dumped
        body = _dump(chunk)
    else:
        body = {"id": rid, "object": "text_completion", "created": created, "model": model}
        if use is not None:
            body["choices"] = []
            body["usage"] = use.model_dump(mode="json", exclude_unset=True)
            return body
        choice = CompletionChoice.model_construct(
            index=d.index, text=d.text, finish_reason=d.finish_reason, logprobs=d.logprobs
        )
        body["choices"] = [choice.model_dump(mode="json")]
    if use is None:
        ch = body["choices"][0]
        if d.finish_reason is not None:
            ch["stop_reason"] = d.stop_reason
        if token_ids:
            ch["token_ids"] = list(d.token_ids)
    return body


#: The finish reasons OpenAI's schema allows; any other (vLLM's ``abort``) is an engine error.
FINISH_REASONS = frozenset({"stop", "length"})
