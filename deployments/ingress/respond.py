"""The ``respond`` phase: decode chunks into OpenAI's response forms, laid out as vLLM's
server lays them out (``n`` choices, logprobs, echo, usage): SSE ending in ``data: [DONE]``,
or one JSON body; and the error bodies of refused and failed requests.

A streamed response owns its request's settling: :class:`SettlingStream` and
:class:`ClosingStreamingResponse` close it however it ends (Starlette cancels a body on a
disconnect without closing it, and never starts one the client left before).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from openai.types.completion_usage import CompletionTokensDetails, CompletionUsage

from deployments.ingress.openai_requests import RequestError
from deployments.ingress.openai_responses import (
    ChoiceOut,
    chat_logprobs,
    completion_body,
    completion_logprobs,
    prompt_logprobs_json,
    stream_chunk,
)
from deployments.ingress.parsing import ChoiceStream
from deployments.ingress.request import Prepared, Tally, endpoint_of
from deployments.ingress.stats import Records, finish_span
from deployments.protocol import EngineChunk, TokenLogprob


class RespondPhase(Records):
    """The ``respond`` phase; a part of :class:`~deployments.ingress.core.IngressCore`."""

    def _init_respond(self) -> None:
        #: requests refused in ``prepare`` (before any engine call)
        self.refused = 0

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
        # with the server's parsers a chat's echo joins the parsed content instead
        if first and prep.echo is not None and prep.parsing is None:
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
        self,
        parts: list[tuple[Prepared, EngineChunk]],
        chunks: AsyncIterator[EngineChunk],
    ) -> JSONResponse:
        """One JSON body over every part's choices: part ``k`` (one prompt of a batch; one
        part unless the request sent several prompts) owns choices ``k*n .. k*n+n-1``."""
        prep0 = parts[0][0]
        n = prep0.sampling.n
        choices: dict[int, ChoiceOut] = {}
        state: dict[int, Any] = {}
        tally = Tally(parts)
        try:
            async for ch in with_echo_only(parts, chunks):
                prep, pre = tally.take(ch)
                d = self._delta(prep, pre, ch, state)
                c = choices.setdefault(ch.index, ChoiceOut(index=ch.index))
                c.text += d.text
                c.token_ids += d.token_ids
                c.finish_reason = d.finish_reason or c.finish_reason
                c.stop_reason = d.stop_reason if d.finish_reason else c.stop_reason
                c.logprobs = merge_logprobs(c.logprobs, d.logprobs)
            reasoning_tokens = self._parse_choices(parts, choices)
        except RequestError as e:
            return self._failed(prep0, e)
        total_s, engine_s = self.record_all(tally, 200)[0]
        extra = dict(prep0.extra)
        if not prep0.chat:  # completions carry the prompt's ids in each choice (below)
            extra.pop("prompt_token_ids", None)
        for i, c in choices.items():
            prep, pre = parts[i // n]
            if pre.prompt_logprobs is not None and not prep.chat:
                c.prompt_logprobs = prompt_logprobs_json(pre.prompt_logprobs)
        if prep0.chat and parts[0][1].prompt_logprobs is not None:
            extra["prompt_logprobs"] = prompt_logprobs_json(parts[0][1].prompt_logprobs)
        hidden = prep0.parsing is not None and prep0.parsing.hide_reasoning
        out = completion_body(
            prep0.rid,
            self.model_name,
            [choices[i] for i in sorted(choices)],
            with_reasoning_tokens(tally.usage(), reasoning_tokens),
            prep0.chat,
            token_ids=prep0.token_ids and not hidden,
            extra=extra,
        )
        if not prep0.chat and "prompt_token_ids" in prep0.extra:
            for c in out["choices"]:
                c["prompt_token_ids"] = parts[c["index"] // n][0].extra["prompt_token_ids"]
        out["pdserve"] = self._replicas(parts, tally) | {
            "engine_s": engine_s,
            "ingress_s": total_s,
        }
        return JSONResponse(out)

    def _replicas(self, parts: list[tuple[Prepared, EngineChunk]], tally: Tally) -> dict[str, Any]:
        """Which replicas served a response (the ``pdserve`` field of a whole response and
        of a stream's usage chunk): ids only, the ones ``/v1/pdserve/stats`` lists."""
        last = tally.last
        out: dict[str, Any] = {
            "ingress_replica": self.replica_id,
            "prefill_replica": parts[0][1].replica_id,
            "decode_replica": last[0].replica_id if last[0] else None,
        }
        if len(parts) > 1:  # a batch: every prompt's replicas
            out["prefill_replicas"] = [pre.replica_id for _, pre in parts]
            out["decode_replicas"] = [x.replica_id if x else None for x in last]
        return out

    def _parse_choices(
        self, parts: list[tuple[Prepared, EngineChunk]], choices: dict[int, ChoiceOut]
    ) -> int | None:
        """Each whole chat choice through the server's parsers (:mod:`.parsing`): its
        message (tool calls, reasoning), finish reason, and (``include_reasoning: false``) no
        logprobs; a chat's echo joins the parsed content, as vLLM joins it. Returns the
        reasoning tokens of them all (``None`` without a reasoning parser)."""
        plan = parts[0][0].parsing
        if plan is None:
            return None
        n = parts[0][0].sampling.n
        total = 0
        for i, c in choices.items():
            prep = parts[i // n][0]
            msg, c.finish_reason, reasoning = plan.message(
                c.text, c.token_ids, c.finish_reason, list(prep.ids)
            )
            if prep.echo is not None:
                msg["content"] = prep.echo + (msg.get("content") or "")
            c.message = msg
            if plan.hide_reasoning:
                c.logprobs = None
            total += reasoning
        return total if plan.parsers.reasoning else None

    def _parsed_chunks(
        self,
        prep: Prepared,
        ch: EngineChunk,
        d: ChoiceOut,
        streams: dict[int, ChoiceStream],
        created: int,
    ) -> list[dict[str, Any]]:
        """The SSE bodies of one decode chunk of a chat the server's parsers parse: a
        choice's first is preceded by its role chunk (with a chat's echo, and the fields vLLM
        sends first); then the parsed delta (tool-call deltas, reasoning, content), unless
        the parser holds it back and nothing else (a finish, logprobs, token ids) must go."""
        plan = prep.parsing
        assert plan is not None
        out = []
        st = streams.get(ch.index)
        if st is None:
            st = streams[ch.index] = plan.stream(list(prep.ids))
            role = ChoiceOut(index=ch.index, text=prep.echo or "")
            body = stream_chunk(
                prep.rid, self.model_name, created, chat=True, delta=role, role=True
            )
            body.update(prep.extra)  # vLLM sends them with the first chunk
            out.append(body)
        delta, d.finish_reason = st.delta(ch.text, list(ch.token_ids), ch.finish_reason)
        if plan.hide_reasoning:  # no per-token data that would show the reasoning
            d.logprobs = None
        ids = prep.token_ids and not plan.hide_reasoning
        if delta is None:
            if d.finish_reason is None and d.logprobs is None and not ids:
                return out
            delta = {}
        d.message = delta
        out.append(
            stream_chunk(prep.rid, self.model_name, created, chat=True, delta=d, token_ids=ids)
        )
        return out

    async def respond_sse(
        self,
        parts: list[tuple[Prepared, EngineChunk]],
        chunks: AsyncIterator[EngineChunk],
        tally: Tally,
    ) -> AsyncIterator[str]:
        """The SSE lines of a streamed response (its close, :meth:`_close_stream`, ends its
        trace and settles it when the client goes)."""
        created = int(time.time())
        m = self.model_name
        prep0 = parts[0][0]

        def sse(obj: dict[str, Any]) -> str:
            return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"

        state: dict[int, Any] = {}
        #: the parsing of each chat choice (the server's parsers), kept for the stream
        streams: dict[int, ChoiceStream] = {}
        try:
            async for ch in with_echo_only(parts, chunks):
                prep, pre = tally.take(ch)
                first = ch.index not in state
                d = self._delta(prep, pre, ch, state)
                if prep.parsing is not None:
                    for body in self._parsed_chunks(prep, ch, d, streams, created):
                        yield sse(body)
                    continue
                # a token with no text yet (part of a character, a stop string's head held
                # back) still goes out when the client asked for token ids
                if d.text or d.finish_reason or first or d.logprobs or prep.token_ids:
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
            if prep0.parsing is not None and prep0.parsing.parsers.reasoning:
                try:
                    spent = sum(st.reasoning_tokens() for st in streams.values())
                except RequestError:
                    spent = None
                use = with_reasoning_tokens(use, spent)
            body = stream_chunk(prep0.rid, m, created, chat=prep0.chat, use=use)
            yield sse(body | {"pdserve": self._replicas(parts, tally)})
        yield "data: [DONE]\n\n"
        self.record_all(tally, status)

    def _refused(self, root: Any, endpoint: str, e: RequestError) -> JSONResponse:
        """A request refused in ``prepare`` (before any engine call): counted, its trace
        ended, its error body."""
        self.refused += 1
        finish_span(root, e.status, e.message)
        self.metrics.inc(
            "pdserve_requests", tenant=e.tenant or "-", endpoint=endpoint, status=str(e.status)
        )
        return error_response(e)

    def _failed(
        self, prep: Prepared, e: RequestError, also: list[Prepared] | None = None
    ) -> JSONResponse:
        """A request that failed after ``prepare``: its metric and trace end, its error body
        (its reserved output tokens go back to its tenant, and those of the batch's other
        prompts in ``also``)."""
        self.give_back(prep)
        for other in also or ():
            self.give_back(other)
        self.metrics.inc(
            "pdserve_requests", tenant=prep.tenant, endpoint=endpoint_of(prep), status=str(e.status)
        )
        if prep.run.span is not None:
            finish_span(prep.run.span, e.status, e.message)
            prep.run.span = None
        return error_response(e)


def with_reasoning_tokens(use: CompletionUsage, reasoning: int | None) -> CompletionUsage:
    """``use`` with ``completion_tokens_details.reasoning_tokens`` when a reasoning parser
    counted them (vLLM reports them whenever it runs one)."""
    if reasoning is not None:
        use.completion_tokens_details = CompletionTokensDetails(reasoning_tokens=reasoning)
    return use


def error_response(e: RequestError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers or None)


async def with_echo_only(
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


def merge_logprobs(acc: Any, new: Any) -> Any:
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


class SettlingStream:
    """A response body (an async iterator of SSE lines) that runs ``on_close`` exactly once
    when it ends, fails or is closed, also when it was never iterated (the client went
    before the first byte: Starlette then never starts the body)."""

    def __init__(self, lines: AsyncIterator[str], on_close: Callable[[], Any]) -> None:
        self._lines = lines
        self._on_close: Callable[[], Any] | None = on_close

    def __aiter__(self) -> SettlingStream:
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


class ClosingStreamingResponse(StreamingResponse):
    """Starlette's streaming response, whose body is closed however the response ends
    (Starlette cancels the body on a disconnect without closing it)."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await asyncio.shield(self.body_iterator.aclose())  # type: ignore[attr-defined]
