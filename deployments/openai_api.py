"""OpenAI request schemas the PD path accepts, their validation, and response builders.

Pure (pydantic and the ``openai`` package's response types), so the HTTP contract is unit-tested
without Serve or vLLM. Requests keep
OpenAI's field names; fields OpenAI defines but the prefill/decode path cannot honour are listed
in :data:`UNSUPPORTED` and refused with a 400 whose message says why (for example ``n > 1``: one
prefill hands one KV cache to one decode stream). Unknown fields are refused too, naming them.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from openai.types import Completion, CompletionChoice
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessage
from openai.types.chat.chat_completion import Choice as ChatChoice
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice
from openai.types.chat.chat_completion_chunk import ChoiceDelta
from openai.types.completion_usage import CompletionUsage, PromptTokensDetails
from pydantic import BaseModel, ConfigDict, Field

from deployments.protocol import Sampling


class RequestError(ValueError):
    """A request the PD path refuses; ``param`` names the offending field (OpenAI's error
    ``param``), ``status`` is the HTTP status."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status

    def body(self) -> dict[str, Any]:
        """OpenAI's error envelope."""
        return {
            "error": {
                "message": self.message,
                "type": "invalid_request_error" if self.status < 500 else "server_error",
                "param": self.param,
                "code": None,
            }
        }


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = Field(default=False, description="Send a last chunk with usage.")
    continuous_usage_stats: bool = Field(default=False, description="vLLM extension; ignored.")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "developer", "tool"] = Field(
        description="Author of the message."
    )
    content: str | list[dict[str, Any]] | None = Field(description="Text, or text parts.")
    name: str | None = Field(default=None, description="Optional author name.")

    def text(self) -> str:
        """The message's text; non-text parts are refused."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for p in self.content:
            if p.get("type") != "text":
                raise RequestError(
                    f"content part of type {p.get('type')!r} is not supported (text only)",
                    "messages",
                )
            parts.append(str(p.get("text", "")))
        return "".join(parts)


class _Common(BaseModel):
    """Fields shared by both endpoints (OpenAI's names)."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="Served model name.")
    max_tokens: int | None = Field(default=None, ge=1, description="Most output tokens.")
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, description="Sampling temperature.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    seed: int | None = Field(
        default=None,
        ge=-(2**63),
        le=2**63 - 1,
        description="Sampling seed (a 64-bit signed integer; torch rejects others mid-step).",
    )
    stop: str | list[str] | None = Field(default=None, description="Up to 4 stop strings.")
    stream: bool = Field(default=False, description="Stream server-sent events.")
    stream_options: StreamOptions | None = Field(default=None, description="Streaming options.")
    n: int = Field(default=1, ge=1, description="Choices per prompt (the PD path serves 1).")
    user: str | None = Field(default=None, description="End-user id (recorded, not used).")
    ignore_eos: bool = Field(default=False, description="vLLM extension: run to max_tokens.")
    # OpenAI fields the PD path cannot honour: accepted by the schema so the refusal is a
    # precise 400 rather than "unknown field".
    logprobs: Any = Field(default=None, description="Unsupported on the PD path.")
    top_logprobs: Any = Field(default=None, description="Unsupported on the PD path.")
    presence_penalty: float = Field(default=0.0, description="Unsupported unless 0.")
    frequency_penalty: float = Field(default=0.0, description="Unsupported unless 0.")
    logit_bias: dict[str, float] | None = Field(
        default=None, description="Unsupported on the PD path."
    )


class CompletionRequest(_Common):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[int] = Field(description="One prompt: text or token ids.")
    echo: bool = Field(default=False, description="Unsupported on the PD path.")
    best_of: int | None = Field(default=None, description="Unsupported on the PD path.")
    suffix: str | None = Field(default=None, description="Unsupported on the PD path.")


class ChatCompletionRequest(_Common):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1, description="The conversation.")
    max_completion_tokens: int | None = Field(default=None, ge=1, description="Most output tokens.")
    tools: Any = Field(default=None, description="Unsupported on the PD path.")
    tool_choice: Any = Field(default=None, description="Unsupported on the PD path.")
    response_format: Any = Field(default=None, description="Unsupported on the PD path.")
    parallel_tool_calls: Any = Field(default=None, description="Unsupported on the PD path.")


#: field -> (is it set to something we cannot honour?, why).
UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "n": (
        lambda v: v != 1,
        "n > 1 is not supported: one prefill hands one KV cache to one decode stream",
    ),
    "best_of": (
        lambda v: v not in (None, 1),
        "best_of is not supported on the prefill/decode path",
    ),
    "logprobs": (
        lambda v: v not in (None, False, 0),
        "logprobs are not supported on the prefill/decode path",
    ),
    "top_logprobs": (
        lambda v: v not in (None, 0),
        "top_logprobs are not supported on the prefill/decode path",
    ),
    "echo": (lambda v: bool(v), "echo is not supported on the prefill/decode path"),
    "suffix": (lambda v: v is not None, "suffix is not supported"),
    "presence_penalty": (
        lambda v: v != 0.0,
        "presence_penalty is not supported on the prefill/decode path",
    ),
    "frequency_penalty": (
        lambda v: v != 0.0,
        "frequency_penalty is not supported on the prefill/decode path",
    ),
    "logit_bias": (lambda v: bool(v), "logit_bias is not supported on the prefill/decode path"),
    "tools": (lambda v: bool(v), "tools are not supported"),
    "tool_choice": (lambda v: v not in (None, "none"), "tool_choice is not supported"),
    "response_format": (
        lambda v: v not in (None, {"type": "text"}),
        "response_format is not supported (text only)",
    ),
    "parallel_tool_calls": (lambda v: v is not None, "parallel_tool_calls is not supported"),
}


def refuse_unsupported(req: _Common) -> None:
    """Raise :class:`RequestError` for the first field set to something the PD path cannot do."""
    for name, (bad, why) in UNSUPPORTED.items():
        if name in type(req).model_fields and bad(getattr(req, name)):
            raise RequestError(why, name)


def sampling_of(
    req: CompletionRequest | ChatCompletionRequest,
    *,
    prompt_tokens: int,
    max_model_len: int,
    default_max_tokens: int,
) -> Sampling:
    """The engines' sampling parameters for ``req``, after every PD-path check.

    ``max_tokens`` defaults to ``min(default_max_tokens, room left)``; an explicit one that does
    not fit ``max_model_len`` with the prompt is a 400 naming it.
    """
    refuse_unsupported(req)
    room = max_model_len - prompt_tokens
    if room < 1:
        raise RequestError(
            f"the prompt has {prompt_tokens} tokens; max_model_len is {max_model_len}",
            "messages" if isinstance(req, ChatCompletionRequest) else "prompt",
        )
    asked = req.max_tokens
    field = "max_tokens"
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        asked, field = req.max_completion_tokens, "max_completion_tokens"
    if asked is not None and asked > room:
        raise RequestError(
            f"{field}={asked} plus the prompt's {prompt_tokens} tokens exceeds "
            f"max_model_len={max_model_len}",
            field,
        )
    stop: tuple[str, ...] = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    if len(stop) > 4:
        raise RequestError("stop takes at most 4 strings", "stop")
    if any(not s for s in stop):
        raise RequestError("stop strings must be non-empty", "stop")
    return Sampling(
        max_tokens=asked if asked is not None else min(default_max_tokens, room),
        temperature=req.temperature,
        top_p=req.top_p,
        seed=req.seed,
        stop=stop,
        ignore_eos=req.ignore_eos,
    )


def include_usage(req: _Common) -> bool:
    return bool(req.stream and req.stream_options and req.stream_options.include_usage)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> CompletionUsage:
    """OpenAI's usage block, with ``prompt_tokens_details.cached_tokens``."""
    return CompletionUsage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


def _dump(m: Any) -> dict[str, Any]:
    out: dict[str, Any] = m.model_dump(mode="json", exclude_unset=True)
    return out


def completion_body(
    rid: str,
    model: str,
    text: str,
    finish_reason: str | None,
    use: CompletionUsage,
    chat: bool,
) -> dict[str, Any]:
    """A whole (non-streamed) completion or chat completion (the ``openai`` package's types)."""
    created = int(time.time())
    if chat:
        return _dump(
            ChatCompletion(
                id=rid,
                object="chat.completion",
                created=created,
                model=model,
                choices=[
                    ChatChoice(
                        index=0,
                        message=ChatCompletionMessage(role="assistant", content=text),
                        finish_reason=finish_reason,  # type: ignore[arg-type]
                        logprobs=None,
                    )
                ],
                usage=use,
            )
        )
    return _dump(
        Completion(
            id=rid,
            object="text_completion",
            created=created,
            model=model,
            choices=[
                CompletionChoice(
                    index=0,
                    text=text,
                    finish_reason=finish_reason,  # type: ignore[arg-type]
                    logprobs=None,
                )
            ],
            usage=use,
        )
    )


def stream_chunk(
    rid: str,
    model: str,
    created: int,
    *,
    chat: bool,
    text: str | None = None,
    role: bool = False,
    finish_reason: str | None = None,
    use: CompletionUsage | None = None,
) -> dict[str, Any]:
    """One SSE chunk. ``use`` set: the usage-only last chunk (``choices`` empty).

    Chat chunks are ``openai``'s ``ChatCompletionChunk``; text-completion chunks are its
    ``Completion`` built without validation (its ``finish_reason`` is not optional, but a
    stream's chunks before the last carry none, as OpenAI's and vLLM's servers send them).
    """
    if chat:
        choices = []
        if use is None:
            delta = ChoiceDelta(role="assistant") if role else ChoiceDelta()
            if text is not None:
                delta.content = text
            choices = [
                ChunkChoice(
                    index=0,
                    delta=delta,
                    finish_reason=finish_reason,  # type: ignore[arg-type]
                    logprobs=None,
                )
            ]
        chunk = ChatCompletionChunk(
            id=rid, object="chat.completion.chunk", created=created, model=model, choices=choices
        )
        if use is not None:
            chunk.usage = use  # marked as set, so it is dumped
        return _dump(chunk)
    body: dict[str, Any] = {"id": rid, "object": "text_completion", "created": created}
    body["model"] = model
    if use is not None:
        body["choices"] = []
        body["usage"] = use.model_dump(mode="json", exclude_unset=True)
        return body
    choice = CompletionChoice.model_construct(
        index=0, text=text or "", finish_reason=finish_reason, logprobs=None
    )
    body["choices"] = [choice.model_dump(mode="json")]
    return body


#: The finish reasons OpenAI's schema allows; any other (vLLM's ``abort``) is an engine error.
FINISH_REASONS = frozenset({"stop", "length"})
