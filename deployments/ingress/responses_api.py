"""OpenAI's Responses API (``POST /v1/responses``), stateless, on the chat path.

vLLM's OpenAI server maps a Responses request onto a chat: ``instructions`` and ``input``
become chat messages (``vllm.entrypoints.openai.responses.utils.construct_input_messages``),
function tools become chat tools (``construct_tool_dicts``), the conversation goes through the
chat template, and the output is parsed by the same ``Parser`` as chat's, laid out as output
items (``build_response_output_items``) or, streamed, as typed events
(``streaming_events.SimpleStreamingEventProcessor``). pdserve does the same with those very
functions, in two halves:

- the request (:func:`to_chat`): vLLM's ``ResponsesRequest`` (unknown fields refused, types
  strict, like the other routes), the fields this path cannot honour refused naming the field
  (:data:`RESPONSES_REFUSED` and the checks of :func:`check_responses`, before any tokenizing),
  then a :class:`~deployments.ingress.openai_requests.ChatCompletionRequest` built from it
  (:data:`TO_CHAT` names each field's chat field), which the ingress runs as any chat:
  routing by prefix, admission, tenants, deadlines, migration and usage apply unchanged, and
  the engines get the sampling vLLM's ``to_sampling_params`` builds;
- the response (:class:`ResponsesPhase`): vLLM's ``ResponsesResponse`` (its
  ``from_request``), or the SSE events of vLLM's stream (``event: TYPE`` and ``data``, each
  with its ``sequence_number``): ``response.created``, ``response.in_progress``, each output
  item's events, ``response.completed``. A failure after the first event is an ``error``
  event and ``response.failed``, then the stream ends (vLLM 0.32 means to send an error
  there, but its conversion of the error fails validation and cuts the stream).

No response is stored (vLLM's default, ``VLLM_ENABLE_RESPONSES_API_STORE`` off): ``store`` is
accepted and ignored as vLLM ignores it; what needs a store (``previous_response_id``,
``background``) is refused.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterator, Callable
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from fastapi.responses import JSONResponse
from pydantic import ConfigDict, TypeAdapter, ValidationError, model_validator
from pydantic_core import PydanticCustomError
from vllm.entrypoints.openai.responses.protocol import (
    ResponsesRequest as _VllmResponsesRequest,
)
from vllm.exceptions import VLLMClientError

from deployments.ingress.openai_requests import (
    ChatCompletionRequest,
    RequestError,
    _StrictTypes,
    refuse_unsupported,
)
from deployments.ingress.openai_responses import chat_logprobs
from deployments.ingress.request import Prepared, Tally
from deployments.ingress.respond import RespondPhase
from deployments.protocol import EngineChunk, TokenLogprob

if TYPE_CHECKING:
    from openai.types.responses import ResponseOutputItem
    from openai.types.responses.response_output_text import Logprob
    from vllm.entrypoints.openai.responses.protocol import ResponsesResponse, ResponseUsage


class _ResponsesShape(_VllmResponsesRequest):
    model_config = ConfigDict(extra="forbid")


class ResponsesRequest(_StrictTypes, _ResponsesShape):
    """``POST /v1/responses``: vLLM's request model, unknown fields refused (``n`` too: one
    output per response), types strict, input items of the types this path renders
    (:func:`check_input_items`, before pydantic's union of them)."""

    @model_validator(mode="before")
    @classmethod
    def _input_items(cls, data: Any) -> Any:
        items = data.get("input") if isinstance(data, dict) else None
        if isinstance(items, list) and all(isinstance(i, dict) for i in items):
            try:
                check_input_items(items)
            except RequestError as e:
                raise PydanticCustomError(
                    "input_item", "{message}", {"param": e.param, "message": e.message}
                ) from None
        return data


#: the include entry that asks for the output text's log-probabilities (the one vLLM reads)
LOGPROBS_INCLUDE = "message.output_text.logprobs"

#: Responses field -> the chat field it becomes (:func:`to_chat`); the contract test checks
#: every field of vLLM's ``ResponsesRequest`` is here, in :data:`RESPONSES_REFUSED`, in
#: :data:`RESPONSES_IGNORED`, or refused by the chat path's ``REFUSED``.
TO_CHAT: dict[str, str] = {
    "model": "model",
    "input": "messages",
    "instructions": "messages (a system message first)",
    "tools": "tools",
    "tool_choice": "tool_choice",
    "parallel_tool_calls": "parallel_tool_calls",
    "max_output_tokens": "max_completion_tokens",
    "stream": "stream",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
    "seed": "seed",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "logit_bias": "logit_bias",
    "skip_special_tokens": "skip_special_tokens",
    "include_stop_str_in_output": "include_stop_str_in_output",
    "structured_outputs": "structured_outputs",
    "text": "response_format (text.format)",
    "include": f"logprobs ({LOGPROBS_INCLUDE})",
    "top_logprobs": "top_logprobs",
    "reasoning": "reasoning_effort (reasoning.effort)",
    "include_reasoning": "include_reasoning",
    "chat_template_kwargs": "chat_template_kwargs",
    "truncation": "truncate_prompt_tokens (auto: -1, from the left)",
    "cache_salt": "cache_salt",
    "request_id": "request_id (the response's id)",
    "session_id": "session_id",
    "user": "user",
    "vllm_xargs": "vllm_xargs",
    "watermarking": "watermarking",
}

#: Responses fields accepted without effect (as on vLLM's server), and why.
RESPONSES_IGNORED: dict[str, str] = {
    "store": "no response is stored (vLLM's default: it ignores store without "
    "VLLM_ENABLE_RESPONSES_API_STORE)",
    "metadata": "returned in the response, as OpenAI and vLLM do",
    "service_tier": "returned in the response; no tiers",
    "prompt_cache_key": "vLLM ignores it too (the prefix index routes by the prompt itself)",
    "include": f"entries other than {LOGPROBS_INCLUDE} (vLLM ignores them too)",
    "reasoning": "summary and generate_summary: no summaries are written (vLLM neither)",
    "text": "verbosity (vLLM ignores it too)",
    "mm_payload": "render endpoints only",
    "return_mm_kwargs": "render endpoints only",
}

#: Responses field -> (is the request's value one this path cannot honour?, why). Checked
#: before any tokenizing; each a 400 naming the field.
RESPONSES_REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "previous_response_id": (
        lambda r: r.previous_response_id is not None,
        "no response store is configured (pdserve's /v1/responses is stateless, as vLLM's "
        "is without VLLM_ENABLE_RESPONSES_API_STORE): send the conversation so far in input",
    ),
    "background": (
        lambda r: bool(r.background),
        "background responses need a response store, which is not configured (vLLM refuses "
        "them without one too)",
    ),
    "previous_input_messages": (
        lambda r: r.previous_input_messages is not None,
        "harmony (gpt-oss) history only; send the conversation in input",
    ),
    "enable_response_messages": (
        lambda r: bool(r.enable_response_messages),
        "the raw prompt and output messages are not returned",
    ),
    "max_tool_calls": (
        lambda r: (
            r.max_tool_calls is not None
            and not (r.parallel_tool_calls is False and r.max_tool_calls >= 1)
        ),
        "the number of calls is not bounded on this path (nor by vLLM's server); "
        "parallel_tool_calls: false allows one call",
    ),
    "structured_outputs": (
        lambda r: (
            r.structured_outputs is not None
            and r.text is not None
            and r.text.format is not None
            and r.text.format.type != "text"
        ),
        "send structured_outputs or text.format, not both (vLLM refuses both too)",
    ),
}

#: input item types this path renders (each a chat turn, as vLLM renders them)
INPUT_TYPES = ("message", "function_call", "function_call_output", "reasoning")
#: content part types of a message or a tool's output (text-only models)
TEXT_PARTS = ("input_text", "output_text")

#: chat parameter -> the Responses parameter it came from (errors name the client's field)
_FROM_CHAT = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "logprobs": "include",
    "reasoning_effort": "reasoning.effort",
    "truncate_prompt_tokens": "truncation",
}


def responses_param(param: str | None) -> str | None:
    """The Responses field a chat field came from (``messages.3.content``: ``input``)."""
    if param is None:
        return None
    head, _, rest = param.partition(".")
    new = _FROM_CHAT.get(head)
    if new is None:
        return param
    return new if head == "messages" or not rest else f"{new}.{rest}"


def renamed(e: RequestError) -> RequestError:
    """``e`` (raised by the chat path) naming the Responses field instead of the chat one."""
    new = responses_param(e.param)
    if new != e.param and e.param is not None and new is not None:
        e.message = re.sub(rf"\b{re.escape(e.param)}\b", new, e.message)
        e.param = new
    return e


def _type_of(item: Any) -> str | None:
    if isinstance(item, dict):
        return item.get("type") or ("message" if "role" in item else None)
    return getattr(item, "type", None)


def _chat_parts(content: Any) -> Any:
    """A message's (or a tool output's) content as a chat's: a string, or its text parts
    (``input_text``, ``output_text``) as chat ``text`` parts, which vLLM's renderer reads
    the same (:func:`check_input_items` allowed no other)."""
    if content is None or isinstance(content, str):
        return content
    return [{"type": "text", "text": _field(part, "text")} for part in content]


def _field(obj: Any, name: str) -> Any:
    return obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)


def check_input_items(items: list[Any]) -> None:
    """Each input item of a type this path renders (:data:`INPUT_TYPES`), its content (a
    message's, a function call output's) text only (:data:`TEXT_PARTS`), no encrypted
    reasoning; a 400 naming the item's field. Runs on the body's items before pydantic takes
    them apart (whose errors over OpenAI's union of some thirty item types name none of
    them), and again on the validated items."""
    for j, item in enumerate(items):
        kind = _type_of(item)
        where = f"input.{j}"
        if kind not in INPUT_TYPES:
            raise RequestError(
                f"{where}.type: input items of type {kind!r} are not supported (stateless, "
                f"function tools only: {', '.join(INPUT_TYPES)})",
                f"{where}.type",
            )
        content = "output" if kind == "function_call_output" else "content"
        parts = _field(item, content) if kind != "reasoning" else None
        if isinstance(parts, (list, tuple)):
            for k, part in enumerate(parts):
                ptype = _field(part, "type")
                if ptype not in TEXT_PARTS:
                    raise RequestError(
                        f"{where}.{content}.{k}.type: content of type {ptype!r} is not "
                        f"supported (text only: {', '.join(TEXT_PARTS)})",
                        f"{where}.{content}.{k}.type",
                    )
        if kind == "reasoning" and _field(item, "encrypted_content"):
            raise RequestError(
                f"{where}.encrypted_content: encrypted reasoning is not supported (none is "
                "ever returned here; vLLM refuses it too)",
                f"{where}.encrypted_content",
            )


def _checked_input(items: list[Any]) -> list[Any]:
    """The input items checked (:func:`check_input_items`) and as vLLM's conversion takes
    them: an assistant message of several text parts as one text (vLLM reads the first part
    only), text parts as chat's, a function call's arguments JSON."""
    from openai.types.responses import ResponseFunctionToolCall, ResponseOutputMessage

    check_input_items(items)
    out = []
    for j, item in enumerate(items):
        kind = _type_of(item)
        where = f"input.{j}"
        if isinstance(item, ResponseOutputMessage):
            texts = [getattr(part, "text", "") for part in item.content]
            item = {"role": "assistant", "content": "".join(texts)}
        elif kind == "reasoning":
            pass
        elif isinstance(item, ResponseFunctionToolCall):
            try:
                json.loads(item.arguments)
            except ValueError:
                raise RequestError(
                    f"{where}.arguments: not JSON: {item.arguments[:100]!r}", f"{where}.arguments"
                ) from None
        elif kind == "function_call":  # left a dict by vLLM's parsing: not a valid call
            raise RequestError(f"{where}: a function_call needs call_id, name and arguments", where)
        elif kind == "function_call_output":
            item = {**item, "output": _chat_parts(item.get("output"))}
        else:  # a message as a dict
            item = {**item, "content": _chat_parts(item.get("content"))}
        out.append(item)
    return out


def _response_format(req: ResponsesRequest) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format`` (which ``to_sampling_params`` turns into
    the structured output vLLM's ``ResponsesRequest.extract_structured_outputs`` makes)."""
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    schema: dict[str, Any] = {"name": fmt.name, "schema": fmt.schema_}
    if fmt.description is not None:
        schema["description"] = fmt.description
    if fmt.strict is not None:
        schema["strict"] = fmt.strict
    return {"type": "json_schema", "json_schema": schema}


def _tool_choice(req: ResponsesRequest) -> Any:
    """The Responses ``tool_choice`` as chat's: ``auto``, ``none``, ``required``, or a named
    function (``{"type": "function", "name"}`` -> ``{"type": "function", "function":
    {"name"}}``); a hosted tool, ``allowed_tools`` or a custom tool is a 400."""
    choice = req.tool_choice
    if isinstance(choice, str):
        return choice
    kind = getattr(choice, "type", None)
    if kind == "function":
        return {"type": "function", "function": {"name": choice.name}}  # type: ignore[union-attr]
    raise RequestError(
        f"tool_choice: {kind!r} is not supported (auto, none, required, or a function by name)",
        "tool_choice",
    )


def check_responses(req: ResponsesRequest, reasoning_parser: bool) -> None:
    """Refuse what this path cannot honour, naming the field (cheap: before any tokenizing):
    :data:`RESPONSES_REFUSED` and the chat path's ``REFUSED`` (``priority``, ...), tools
    other than functions, ``reasoning`` without a reasoning parser (the reasoning would come
    back inside the text). The input items are :func:`check_input_items`'s."""
    for name, (bad, why) in RESPONSES_REFUSED.items():
        if bad(req):
            raise RequestError(f"{name}: {why}", name)
    refuse_unsupported(req)  # the chat path's refusals of the fields both have (priority, ...)
    for i, tool in enumerate(req.tools):
        if tool.type != "function":
            raise RequestError(
                f"tools.{i}.type: {tool.type!r} tools are not supported (function tools "
                "only: no built-in tool runs on this path, and custom and namespace tools are "
                "not taken)",
                f"tools.{i}.type",
            )
    effort = req.reasoning.effort if req.reasoning is not None else None
    if effort not in (None, "none") and not reasoning_parser:
        raise RequestError(
            f"reasoning.effort: {effort!r} asks for reasoning, which this server does not "
            "parse apart from the answer: model.reasoning_parser (vLLM's --reasoning-parser)",
            "reasoning.effort",
        )


def to_chat(req: ResponsesRequest, reasoning_parser: bool = False) -> ChatCompletionRequest:
    """The chat request ``req`` becomes (after :func:`check_responses`), as vLLM's server
    renders it: ``instructions`` as a system message first, then the input items as chat
    turns (vLLM's ``construct_input_messages``: a function call joins the assistant turn
    before it, a function call's output is a ``tool`` turn), function tools as chat tools
    (vLLM's ``construct_tool_dicts``), a last assistant message ``in_progress`` or
    ``incomplete`` continued (vLLM's ``should_continue_final_message``), and the sampling
    fields as chat's (:data:`TO_CHAT`). Errors name the Responses field."""
    from vllm.entrypoints.openai.responses.utils import (
        construct_input_messages,
        construct_tool_dicts,
        should_continue_final_message,
    )
    from vllm.sampling_params import StructuredOutputsParams

    check_responses(req, reasoning_parser)
    items = req.input if isinstance(req.input, str) else _checked_input(list(req.input))
    try:
        messages = construct_input_messages(
            request_instructions=req.instructions, request_input=items
        )
    except VLLMClientError as e:
        raise RequestError(f"input: {e}", "input") from None
    keep = ("role", "content", "name", "tool_calls", "tool_call_id", "reasoning")
    messages = [{k: v for k, v in dict(m).items() if k in keep} for m in messages]
    tools = construct_tool_dicts(req.tools, req.tool_choice) if req.tools else None
    continue_final = should_continue_final_message(req.input)
    logprobs = LOGPROBS_INCLUDE in (req.include or ())
    body: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "stream": bool(req.stream),
        "tools": tools,
        "tool_choice": _tool_choice(req) if tools else None,
        "parallel_tool_calls": req.parallel_tool_calls,
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty,
        "seed": req.seed,
        "stop": req.stop or None,
        "stop_token_ids": req.stop_token_ids or None,
        "ignore_eos": req.ignore_eos,
        "logit_bias": req.logit_bias,
        "skip_special_tokens": req.skip_special_tokens,
        "include_stop_str_in_output": req.include_stop_str_in_output,
        "response_format": _response_format(req),
        "structured_outputs": None
        if req.structured_outputs is None
        else TypeAdapter(StructuredOutputsParams).dump_python(
            req.structured_outputs, mode="json", exclude_none=True
        ),
        "logprobs": logprobs or None,
        "top_logprobs": req.top_logprobs if logprobs else None,
        "reasoning_effort": req.reasoning.effort if req.reasoning is not None else None,
        "include_reasoning": req.include_reasoning,
        "chat_template_kwargs": req.chat_template_kwargs,
        "add_generation_prompt": not continue_final,
        "continue_final_message": continue_final,
        "truncate_prompt_tokens": -1 if req.truncation == "auto" else None,
        "truncation_side": "left" if req.truncation == "auto" else None,
        "cache_salt": req.cache_salt,
        "request_id": req.request_id,
        "session_id": req.session_id,
        "user": req.user,
        "vllm_xargs": req.vllm_xargs,
        "watermarking": req.watermarking,
    }
    body = {k: v for k, v in body.items() if v is not None}
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err.get("loc", ()))
        param = responses_param(loc) if loc else None
        raise RequestError(f"{param or 'input'}: {err['msg']}"[:500], param) from None
    except VLLMClientError as e:
        param = responses_param(getattr(e, "parameter", None))
        raise RequestError(f"{param or 'input'}: {str(e).strip()}"[:500], param) from None


# -- the response --------------------------------------------------------------------------------


def _sse(event: Any) -> str:
    """One event as vLLM's server frames it: its type, then its JSON."""
    return f"event: {event.type}\ndata: {event.model_dump_json(indent=None, by_alias=True)}\n\n"


def _error_code(status: int) -> str:
    """OpenAI's ``ResponseError.code`` for a failure of ``status``."""
    return "rate_limit_exceeded" if status == 429 else "server_error"


class ResponsesPhase(RespondPhase):
    """The ``respond`` phase of a Responses request (a chat underneath, one choice): its
    output items from the same parsing as chat's, laid out by vLLM's own builders; a part of
    :class:`~deployments.ingress.core.IngressCore`."""

    def _output_logprobs(self, prep: Prepared, entries: list[TokenLogprob]) -> list[Logprob]:
        """The output text's ``logprobs`` (``include: [message.output_text.logprobs]``), as
        vLLM lays them out: per token its text, logprob, bytes and ``top_logprobs`` of them."""
        from openai.types.responses.response_output_text import Logprob

        assert prep.fmt is not None
        decode = self.tokenizer.token_text
        return [
            Logprob.model_validate(lp.model_dump())
            for lp in chat_logprobs(entries, prep.fmt, decode)
        ]

    def _output_items(
        self, prep: Prepared, text: str, token_ids: list[int], entries: list[TokenLogprob]
    ) -> tuple[list[ResponseOutputItem], int]:
        """A whole answer's output items and reasoning tokens: with the server's parsers,
        ``Parser.parse``'s reasoning, content and calls through vLLM's
        ``build_response_output_items``; without, one message of the text (vLLM's
        fallback)."""
        from openai.types.responses import ResponseOutputMessage, ResponseOutputText
        from vllm.entrypoints.openai.responses.utils import build_response_output_items
        from vllm.entrypoints.serve.utils.tool_calls_utils import (
            maybe_filter_parallel_tool_calls,
        )
        from vllm.utils import random_uuid

        assert prep.responses is not None
        logprobs = self._output_logprobs(prep, entries) if prep.fmt is not None else None
        plan = prep.parsing
        if plan is None:
            part = ResponseOutputText(
                text=text, annotations=[], type="output_text", logprobs=logprobs
            )
            msg = ResponseOutputMessage(
                id=f"msg_{random_uuid()}",
                content=[part] if text else [],
                role="assistant",
                status="completed",
                type="message",
            )
            return [msg], 0
        reasoning, content, calls, reasoning_tokens = plan.parse(text, token_ids, list(prep.ids))
        if plan.hide_reasoning:
            logprobs = None
        items = build_response_output_items(
            reasoning=reasoning,
            content=content,
            tool_calls=maybe_filter_parallel_tool_calls(calls, plan.request),
            logprobs=logprobs,
            tools=prep.responses.tools,
        )
        return items, reasoning_tokens

    def _usage(self, tally: Tally, reasoning_tokens: int) -> ResponseUsage:
        """vLLM's ``ResponseUsage``: input tokens with the prefill's cached ones, output
        tokens with the reasoning parser's count."""
        from vllm.entrypoints.openai.responses.protocol import (
            InputTokensDetails,
            OutputTokensDetails,
            ResponseUsage,
        )

        use = tally.usage()
        details = use.prompt_tokens_details
        return ResponseUsage(
            input_tokens=use.prompt_tokens,
            input_tokens_details=InputTokensDetails(
                cached_tokens=(details.cached_tokens or 0) if details else 0,
                cache_write_tokens=0,
            ),
            output_tokens=use.completion_tokens,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning_tokens),
            total_tokens=use.total_tokens,
        )

    def _response(
        self,
        prep: Prepared,
        output: list[ResponseOutputItem],
        status: str,
        use: ResponseUsage | None,
        created: int,
    ) -> ResponsesResponse:
        """vLLM's ``ResponsesResponse.from_request`` over the request as the client sent it
        (``background`` and ``truncation`` sent as null echoed as their defaults) and the
        sampling the engines ran (temperature, top_p, max_output_tokens as resolved)."""
        from vllm.entrypoints.openai.responses.protocol import ResponsesResponse

        req = prep.responses
        assert req is not None
        # null where the request allows it and the response does not (vLLM would fail there)
        req = req.model_copy(
            update={"background": bool(req.background), "truncation": req.truncation or "disabled"}
        )
        sampling: Any = SimpleNamespace(**(prep.sampling.params or {}))
        return ResponsesResponse.from_request(
            req,
            sampling,
            model_name=self.model_name,
            created_time=created,
            output=output,
            status=status,  # type: ignore[arg-type]
            usage=use,
        )

    async def responses_json(
        self, parts: list[tuple[Prepared, EngineChunk]], chunks: AsyncIterator[EngineChunk]
    ) -> JSONResponse:
        """The whole response: ``status`` ``incomplete`` when the answer ran into
        ``max_output_tokens`` (vLLM's rule), ``completed`` otherwise."""
        prep, pre = parts[0]
        tally = Tally(parts)
        created = int(time.time())
        text = ""
        token_ids: list[int] = []
        entries: list[TokenLogprob] = []
        finish: str | None = None
        try:
            async for ch in chunks:
                tally.take(ch)
                text += ch.text
                token_ids.extend(ch.token_ids)
                entries.extend(e for e in ch.logprobs or () if e is not None)
                finish = ch.finish_reason or finish
            output, reasoning_tokens = self._output_items(prep, text, token_ids, entries)
        except RequestError as e:
            return self._failed(prep, e)
        total_s, engine_s = self.record_all(tally, 200)[0]
        status = "incomplete" if finish == "length" else "completed"
        body = self._response(
            prep, output, status, self._usage(tally, reasoning_tokens), created
        ).model_dump(mode="json", by_alias=True)
        last = tally.last[0]
        body["pdserve"] = {
            "ingress_replica": self.replica_id,
            "prefill_replica": pre.replica_id,
            "decode_replica": last.replica_id if last else None,
            "engine_s": engine_s,
            "ingress_s": total_s,
        }
        return JSONResponse(body)

    async def responses_sse(
        self,
        parts: list[tuple[Prepared, EngineChunk]],
        chunks: AsyncIterator[EngineChunk],
        tally: Tally,
    ) -> AsyncIterator[str]:
        """The streamed response, vLLM's events in vLLM's order (``SimpleStreamingEventProcessor``
        over each chunk's ``Parser.parse_delta``, or the text itself without parsers), each
        numbered; ``response.completed`` carries the items as streamed (same ids) and usage."""
        from openai.types.responses import ResponseErrorEvent, ResponseFailedEvent
        from vllm.entrypoints.generate.base.protocol import DeltaMessage
        from vllm.entrypoints.openai.responses.protocol import (
            ResponseCompletedEvent,
            ResponseCreatedEvent,
            ResponseInProgressEvent,
        )
        from vllm.entrypoints.openai.responses.streaming_events import (
            SimpleStreamingEventProcessor,
            _StateType,
            split_delta,
        )

        prep = parts[0][0]
        assert prep.responses is not None
        created = int(time.time())
        seq = 0

        def numbered(event: Any) -> str:
            nonlocal seq
            event.sequence_number = seq
            seq += 1
            return _sse(event)

        initial = self._response(prep, [], "in_progress", None, created)
        yield numbered(
            ResponseCreatedEvent(type="response.created", sequence_number=-1, response=initial)
        )
        yield numbered(
            ResponseInProgressEvent(
                type="response.in_progress", sequence_number=-1, response=initial
            )
        )
        plan = prep.parsing
        hidden = plan is not None and plan.hide_reasoning
        stream = plan.stream(list(prep.ids)) if plan is not None else None
        processor = SimpleStreamingEventProcessor(tools=prep.responses.tools)

        def logprobs_of(ch: Any) -> list[Logprob]:
            if prep.fmt is None or hidden:
                return []
            return self._output_logprobs(prep, [e for e in ch.logprobs or () if e is not None])

        finish: str | None = None
        try:
            async for ch in chunks:
                tally.take(ch)
                finish = ch.finish_reason or finish
                if stream is not None:
                    delta = stream.parse(ch.text, list(ch.token_ids), ch.finish_reason)
                else:
                    delta = DeltaMessage(content=ch.text)
                if delta is None:
                    continue
                for d in split_delta(delta):
                    target, call = processor.resolve_target_state(d)
                    if target == _StateType.NONE:
                        continue
                    if processor.needs_transition(target, call):
                        for event in processor.close_current():
                            yield numbered(event)
                        for event in processor.open(target, call):
                            yield numbered(event)
                    # vLLM hands the engine's output to ``logprobs_of`` alone: the chunk
                    for event in processor.emit_delta(d, ch, logprobs_of):  # type: ignore[arg-type]
                        yield numbered(event)
            for event in processor.close_current():
                yield numbered(event)
            reasoning_tokens = stream.reasoning_tokens() if stream is not None else 0
        except RequestError as e:  # an error event, then the response failed: well-formed
            yield numbered(
                ResponseErrorEvent(
                    type="error",
                    code=e.code or _error_code(e.status),
                    message=e.message,
                    param=e.param,
                    sequence_number=-1,
                )
            )
            failed = self._response(
                prep, processor.output_items, "failed", self._usage(tally, 0), created
            ).model_dump(mode="json", by_alias=True)
            failed["error"] = {"code": _error_code(e.status), "message": e.message}
            yield numbered(
                ResponseFailedEvent(type="response.failed", sequence_number=-1, response=failed)  # type: ignore[arg-type]
            )
            self.record_all(tally, e.status)
            return
        status = "incomplete" if finish == "length" else "completed"
        final = self._response(
            prep, processor.output_items, status, self._usage(tally, reasoning_tokens), created
        )
        yield numbered(
            ResponseCompletedEvent(type="response.completed", sequence_number=-1, response=final)
        )
        self.record_all(tally, 200)
