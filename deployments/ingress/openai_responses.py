"""OpenAI's responses, built with the ``openai`` package's types as vLLM's server lays them
out, plus vLLM's extensions (``prompt_logprobs``, ``token_ids``, ``prompt_token_ids``,
``prompt_text``) where asked: log-probabilities, choices, usage, bodies and stream chunks.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

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
from openai.types.completion_usage import CompletionUsage

from deployments.ingress.openai_requests import AnyRequest, ChatCompletionRequest
from deployments.protocol import TokenLogprob

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
    #: chat with the server's parsers: the choice's ``message`` (or a chunk's ``delta``) as
    #: vLLM's parsing made it (tool calls, reasoning), sent instead of one built from ``text``
    message: dict[str, Any] | None = None


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
        if chat and c.message is not None:
            out["message"] = c.message
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
        if chat and d.message is not None:
            ch["delta"] = d.message
        if d.finish_reason is not None:
            ch["stop_reason"] = d.stop_reason
        if token_ids:
            ch["token_ids"] = list(d.token_ids)
    return body


#: The finish reasons OpenAI's schema allows; any other (vLLM's ``abort``) is an engine error.
FINISH_REASONS = frozenset({"stop", "length"})
