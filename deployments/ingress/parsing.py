"""Tool calls and reasoning in chat output, parsed at the ingress with vLLM's own parsers.

vLLM composes its tool-call parser (``--tool-call-parser``, here ``model.tool_call_parser``)
and its reasoning parser (``--reasoning-parser``, ``model.reasoning_parser``) into one
:class:`vllm.parser.abstract_parser.Parser` class (:meth:`vllm.parser.ParserManager.get_parser`).
Its OpenAI server uses a parser three ways, each done here with the same objects and the same
rules:

1. before sampling (``vllm/renderers/online_renderer.py``, ``OnlineRenderer.render_chat`` and
   ``preprocess_chat``): ``tool_choice`` is refused when the server cannot honour it
   (:meth:`OutputParsers.check`), and ``Parser.adjust_request`` turns ``required`` and a named
   tool into structured output (a structural tag or a JSON schema) that the request's
   ``to_sampling_params`` then hands to the decode engine (:meth:`OutputParsers.plan`);
2. a whole answer (``OpenAIServingChat.chat_completion_full_generator``): ``Parser.parse`` on
   each choice's text with a parser of its own, then the message, the ``tool_calls`` finish
   reason and ``parallel_tool_calls`` as vLLM builds them (:meth:`ChatParsing.message`);
3. a stream (``chat_completion_stream_generator``): ``Parser.parse_delta`` on each chunk, one
   parser per choice for the whole stream (:class:`ChoiceStream`).

The decode replicas know none of this: they run the sampling they are given and stream text
and token ids; every parser and its state live here, per request and per choice. The reasoning
goes out as ``reasoning`` (this vLLM's field) and also as ``reasoning_content`` (the name
older vLLM releases and many clients use).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from deployments.ingress.openai_requests import RequestError

if TYPE_CHECKING:
    from vllm.entrypoints.generate.base.protocol import DeltaMessage, FunctionCall
    from vllm.parser.abstract_parser import Parser

    from deployments.config import ModelConfig
    from deployments.ingress.openai_requests import ChatCompletionRequest

log = logging.getLogger("deployments.ingress")


def _with_reasoning_content(out: dict[str, Any]) -> dict[str, Any]:
    """``reasoning_content`` beside ``reasoning``, wherever it is."""
    if "reasoning" in out:
        out["reasoning_content"] = out["reasoning"]
    return out


def _parser_failed(e: Exception) -> RequestError:
    log.exception("the output parser failed")
    return RequestError(
        f"the model's output could not be parsed ({type(e).__name__}: {str(e)[:200]})",
        status=500,
    )


class OutputParsers:
    """The server's parsers: vLLM's composed :class:`Parser` class for ``model`` (``None``
    when neither a tool-call nor a reasoning parser is configured, or the tool-call parser
    is off because ``enable_auto_tool_choice`` is, as in vLLM). ``tokenizer`` is the model's
    (Hugging Face) tokenizer. A parser that cannot run with it is a ``ValueError`` naming the
    config fields (vLLM fails its start the same way)."""

    def __init__(self, model: ModelConfig, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.enable_auto_tools = model.enable_auto_tool_choice
        self.parser_cls: type[Parser] | None = None
        if model.tool_call_parser or model.reasoning_parser:
            from vllm.parser import ParserManager
            from vllm.tokenizers.hf import get_cached_tokenizer

            # vLLM's server hands its parsers this proxy: the vocabulary and special ids
            # computed once, not at each parser's construction (one per choice)
            self.tokenizer = tokenizer = get_cached_tokenizer(tokenizer)
            try:
                self.parser_cls = ParserManager.get_parser(
                    tool_parser_name=model.tool_call_parser,
                    reasoning_parser_name=model.reasoning_parser,
                    enable_auto_tools=model.enable_auto_tool_choice,
                    model_name=model.served_name,
                    tool_strict_level=model.tool_strict_level,
                    tokenizer=tokenizer,
                )
            except Exception as e:  # TypeError mostly; a parser's missing package too
                raise ValueError(
                    f"model.tool_call_parser={model.tool_call_parser!r}, "
                    f"model.reasoning_parser={model.reasoning_parser!r}: {e}"
                ) from None

    @property
    def tool_parsing(self) -> bool:
        """Whether tool calls are parsed (vLLM: a tool parser and auto tool choice)."""
        return self.parser_cls is not None and self.parser_cls.tool_parser_cls is not None

    @property
    def reasoning(self) -> bool:
        """Whether a reasoning parser is configured."""
        return self.parser_cls is not None and self.parser_cls.reasoning_parser_cls is not None

    def check(self, req: ChatCompletionRequest) -> None:
        """Refuse a ``tool_choice`` this server cannot honour, naming ``tool_choice`` (vLLM's
        ``OnlineRenderer.render_chat`` refuses the same; cheap, before any tokenizing).
        ``auto`` is the default when a request sends tools."""
        choice = req.tool_choice
        if self.tool_parsing or choice in (None, "none"):
            return
        if choice == "auto":
            raise RequestError(
                'tool_choice: "auto" (the default when tools are sent) needs tool-call parsing, '
                "which this server does not run: model.enable_auto_tool_choice and "
                "model.tool_call_parser (vLLM's --enable-auto-tool-choice and "
                '--tool-call-parser); send tool_choice "none" for a plain-text reply',
                "tool_choice",
            )
        what = f'"{choice}"' if isinstance(choice, str) else f'function "{choice.function.name}"'
        raise RequestError(
            f"tool_choice: {what} needs tool-call parsing, which this server does not run: "
            "model.tool_call_parser with model.enable_auto_tool_choice (vLLM's "
            "--tool-call-parser)",
            "tool_choice",
        )

    def plan(self, req: ChatCompletionRequest) -> ChatParsing | None:
        """The request's parsing (``None`` when the server has no parser), after
        ``Parser.adjust_request`` changed ``req`` in place as vLLM's ``preprocess_chat``
        does: ``required`` or a named tool become ``req.structured_outputs`` (which
        ``to_sampling_params`` then carries to the decode engine), special tokens are kept
        where the parser needs them. Call it before the request's sampling is built."""
        self.check(req)
        if self.parser_cls is None:
            return None
        plan = ChatParsing(self, req, req.build_chat_params(None, "string").chat_template_kwargs)
        cls = self.parser_cls
        if (
            cls.always_adjust_request
            or cls.reasoning_parser_cls is not None
            or (req.tool_choice != "none")
        ):
            from vllm.exceptions import VLLMValidationError

            try:
                plan.new_parser().adjust_request(req)
            except (VLLMValidationError, ValueError) as e:
                param = getattr(e, "parameter", None) or "tools"
                raise RequestError(f"{param}: {str(e).strip()[:500]}", param) from None
        return plan


@dataclass
class ChatParsing:
    """One chat request's parsing: the server's parsers and the (adjusted) request, which
    every parser call reads (its ``tool_choice``, ``tools``, ``include_reasoning``,
    ``parallel_tool_calls``)."""

    parsers: OutputParsers
    request: ChatCompletionRequest
    #: the template's kwargs, as vLLM hands them to the parsers (``enable_thinking``, ...)
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)

    def new_parser(self) -> Parser:
        """A parser of its own (parsers keep state: one per choice, as vLLM does)."""
        cls = self.parsers.parser_cls
        assert cls is not None
        tools: Any = self.request.tools
        return cls(self.parsers.tokenizer, tools, chat_template_kwargs=self.chat_template_kwargs)

    @property
    def hide_reasoning(self) -> bool:
        """``include_reasoning: false``: no reasoning, and (as vLLM) no per-token logprobs or
        token ids, which would show it."""
        return not self.request.include_reasoning

    def parse(
        self, text: str, token_ids: list[int], prompt_ids: list[int]
    ) -> tuple[str | None, str | None, list[FunctionCall], int]:
        """One whole choice through ``Parser.parse`` with a parser of its own: its reasoning
        (``None`` when hidden, ``include_reasoning: false``), content, tool calls and
        reasoning tokens, as vLLM's servers take them (chat lays them out as a message,
        the Responses API as output items)."""
        parser = self.new_parser()
        parser.set_prompt_token_ids(prompt_ids)
        try:
            reasoning, content, calls = parser.parse(
                text,
                self.request,
                enable_auto_tools=self.parsers.enable_auto_tools,
                model_output_token_ids=token_ids,
            )
            reasoning_tokens = parser.count_reasoning_tokens(token_ids)
        except Exception as e:
            raise _parser_failed(e) from e
        if self.hide_reasoning:
            reasoning = None
        return reasoning, content, list(calls or ()), int(reasoning_tokens)

    def message(
        self,
        text: str,
        token_ids: list[int],
        finish_reason: str | None,
        prompt_ids: list[int],
    ) -> tuple[dict[str, Any], str, int]:
        """One whole choice: its message (vLLM's ``ChatMessage`` as its server fills it),
        its finish reason (``tool_calls`` when an ``auto`` call was parsed, or a ``required``
        one ended by a stop), and its reasoning tokens."""
        from vllm.entrypoints.generate.base.protocol import ToolCall
        from vllm.entrypoints.openai.chat_completion.protocol import (
            ChatCompletionNamedToolChoiceParam,
            ChatCompletionResponseChoice,
            ChatMessage,
        )
        from vllm.entrypoints.serve.utils.tool_calls_utils import (
            maybe_filter_parallel_tool_calls,
        )
        from vllm.renderers.chat_utils import make_tool_call_id

        req = self.request
        reasoning, content, calls, reasoning_tokens = self.parse(text, token_ids, prompt_ids)
        named = type(req.tool_choice) is ChatCompletionNamedToolChoiceParam
        required = req.tool_choice == "required"
        tool_calls = [ToolCall(id=tc.id or make_tool_call_id(), function=tc) for tc in calls]
        auto_called = False
        tool_parsing = self.parsers.tool_parsing
        # the branches of vLLM's chat_completion_full_generator, in its order
        if not tool_parsing and not named and not required:
            msg = ChatMessage(role="assistant", reasoning=reasoning, content=content)
        elif named or required:
            msg = ChatMessage(
                role="assistant", reasoning=reasoning, content=content or "", tool_calls=tool_calls
            )
        elif not req.tool_choice or req.tool_choice == "none":
            msg = ChatMessage(role="assistant", reasoning=reasoning, content=content)
        elif req.tools and req.tool_choice == "auto" and tool_calls:
            auto_called = True
            msg = ChatMessage(
                role="assistant", reasoning=reasoning, content=content, tool_calls=tool_calls
            )
        else:
            msg = ChatMessage(role="assistant", reasoning=reasoning, content=content)
        finish = (
            "tool_calls"
            if auto_called or (required and finish_reason == "stop")
            else (finish_reason or "stop")
        )
        choice = maybe_filter_parallel_tool_calls(
            ChatCompletionResponseChoice(index=0, message=msg, finish_reason=finish), req
        )
        out = choice.message.model_dump(mode="json", exclude_none=True)
        out["content"] = choice.message.content
        if self.parsers.reasoning:
            out["reasoning"] = choice.message.reasoning
        return _with_reasoning_content(out), finish, reasoning_tokens

    def stream(self, prompt_ids: list[int]) -> ChoiceStream:
        """The parsing of one streamed choice."""
        return ChoiceStream(self, prompt_ids)


class ChoiceStream:
    """One streamed choice's parser (vLLM keeps one per choice for the whole stream), and
    whether it has streamed tool calls (for the ``tool_calls`` finish reason)."""

    def __init__(self, plan: ChatParsing, prompt_ids: list[int]) -> None:
        from vllm.entrypoints.openai.chat_completion.protocol import (
            ChatCompletionNamedToolChoiceParam,
        )

        self.plan = plan
        self.parser = plan.new_parser()
        self.prompt_ids = prompt_ids
        self.tools_streamed = False
        self.named = isinstance(plan.request.tool_choice, ChatCompletionNamedToolChoiceParam)
        #: the choice's output tokens so far (its reasoning tokens are counted over them)
        self.token_ids: list[int] = []

    def delta(
        self, text: str, token_ids: list[int], finish_reason: str | None
    ) -> tuple[dict[str, Any] | None, str | None]:
        """One chunk through ``Parser.parse_delta``: its delta as vLLM's ``DeltaMessage``
        lays it out (``None``: nothing to send yet, e.g. a tool call's opening tag), and its
        finish reason (``tool_calls`` when calls were streamed and the choice stopped, unless
        the tool was named)."""
        d = self.parse(text, token_ids, finish_reason)
        if d is not None and d.tool_calls:
            self.tools_streamed = True
        finish = finish_reason
        if finish == "stop" and self.tools_streamed and not self.named:
            finish = "tool_calls"
        if d is None:
            return None, finish
        return _with_reasoning_content(d.model_dump(mode="json", exclude_unset=True)), finish

    def parse(
        self, text: str, token_ids: list[int], finish_reason: str | None
    ) -> DeltaMessage | None:
        """One chunk through ``Parser.parse_delta``: vLLM's ``DeltaMessage`` (``None``:
        nothing to send yet), its tool calls held to ``parallel_tool_calls``."""
        from vllm.entrypoints.serve.utils.tool_calls_utils import (
            maybe_filter_parallel_tool_calls,
        )

        req = self.plan.request
        self.token_ids.extend(token_ids)
        try:
            d = self.parser.parse_delta(
                delta_text=text,
                delta_token_ids=list(token_ids),
                request=req,
                prompt_token_ids=self.prompt_ids,
                finished=finish_reason is not None,
            )
        except Exception as e:
            raise _parser_failed(e) from e
        return None if d is None else maybe_filter_parallel_tool_calls(d, req)

    def reasoning_tokens(self) -> int:
        try:
            return int(self.parser.count_reasoning_tokens(self.token_ids))
        except Exception as e:
            raise _parser_failed(e) from e
