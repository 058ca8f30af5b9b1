"""Agents on the PD path (issue 41): tool_choice as vLLM takes it, tool calls and reasoning
parsed at the ingress with vLLM's own parsers, over fake engine handles whose decode streams a
scripted answer as text and token ids of the real tiny tokenizer. Every body and chunk is
checked against vLLM's own response models and the ``openai`` client's types."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
)

from deployments.protocol import EngineChunk, EngineRequest, TokenLogprob
from tests.unit.test_deployments_ingress import FakeEngine, _wire

pytestmark = pytest.mark.slow  # the tiny model's tokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
        "strict": True,
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
TIME_CALL = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
PARSERS = {"tool_call_parser": "hermes", "enable_auto_tool_choice": True}


class ScriptedDecode(FakeEngine):
    """A decode engine whose sequence ``i`` answers ``answers[i]`` (the last one for the
    rest): the text's tokens from the real tokenizer, ``per_chunk`` a chunk, each chunk's
    text the decoded growth (as vLLM's detokenizer sends it), finished by ``finish``."""

    def __init__(self, tok: Any, per_chunk: int = 3) -> None:
        super().__init__("decode")
        self.tok = tok
        self.per_chunk = per_chunk
        self.answers = ["hello"]
        self.finish = "stop"

    async def _decode(self, req: EngineRequest) -> AsyncIterator[EngineChunk]:
        self.seen.append(req)
        seqs = []
        for i in range(req.sampling.n):
            text = self.answers[min(i, len(self.answers) - 1)]
            ids = self.tok.encode(text, add_special_tokens=False)
            seqs.append([ids[k : k + self.per_chunk] for k in range(0, len(ids), self.per_chunk)])
        for step in range(max(len(p) for p in seqs)):
            for i, pieces in enumerate(seqs):
                if step >= len(pieces):
                    continue
                before = [t for p in pieces[:step] for t in p]
                ids = pieces[step]
                text = self.tok.decode(before + ids)[len(self.tok.decode(before)) :]
                lps = None
                if req.sampling.logprobs is not None:
                    lps = tuple(TokenLogprob(t, self.tok.decode([t]), -0.5) for t in ids)
                last = self.finish if step == len(pieces) - 1 else None
                n_prompt = len(req.prompt_token_ids)
                yield EngineChunk(text, tuple(ids), last, n_prompt, 0, 0.01, index=i, logprobs=lps)


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _agent(tiny_model_dir: Path, tok: Any, **model: Any) -> tuple[Any, FakeEngine, Any]:
    """An app whose model has ``model``'s parsers, over a scripted decode engine."""
    dec = ScriptedDecode(tok)
    client, pre, _ = _wire(
        tiny_model_dir,
        {
            "model": {"path": str(tiny_model_dir), "build_preset": None, **model},
            "ingress": {"auth": "none"},
        },
        engines=(FakeEngine("prefill"), dec),
    )
    return client, pre, dec


@pytest.fixture(scope="module")
def agent(tiny_model_dir: Path, tok: Any) -> tuple[Any, FakeEngine, Any]:
    """hermes tool calls and qwen3 reasoning, as an agent's server would run them."""
    return _agent(tiny_model_dir, tok, **PARSERS, reasoning_parser="qwen3")


@pytest.fixture(scope="module")
def tools_only(tiny_model_dir: Path, tok: Any) -> tuple[Any, FakeEngine, Any]:
    return _agent(tiny_model_dir, tok, **PARSERS)


@pytest.fixture(scope="module")
def plain(tiny_model_dir: Path, tok: Any) -> tuple[Any, FakeEngine, Any]:
    """No parsers: vLLM's defaults."""
    return _agent(tiny_model_dir, tok)


def chat(client: Any, **body: Any) -> Any:
    return client.post("/v1/chat/completions", json={"model": "test", "messages": ASK, **body})


def answered(r: Any) -> dict[str, Any]:
    """A 200 body that vLLM's and openai's response models both take."""
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    ChatCompletionResponse.model_validate(body)
    ChatCompletion.model_validate(body)
    return body


def streamed(client: Any, **body: Any) -> list[dict[str, Any]]:
    """A stream's chunks (each one taken by vLLM's and openai's chunk models)."""
    req = {"model": "test", "messages": ASK, "stream": True, **body}
    with client.stream("POST", "/v1/chat/completions", json=req) as r:
        assert r.status_code == 200, r.read()
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    for c in chunks:
        assert "error" not in c, c
        ChatCompletionStreamResponse.model_validate(c)
        ChatCompletionChunk.model_validate(c)
    return chunks


def reassembled(chunks: list[dict[str, Any]], index: int = 0) -> dict[str, Any]:
    """One choice of a stream put together as a client does: content, reasoning, and each
    tool call by its index (id, name and the arguments' pieces)."""
    out: dict[str, Any] = {"content": "", "reasoning": "", "calls": {}, "finish": None}
    for c in chunks:
        for ch in c["choices"]:
            if ch["index"] != index:
                continue
            d = ch["delta"]
            assert d.get("reasoning") == d.get("reasoning_content")
            out["content"] += d.get("content") or ""
            out["reasoning"] += d.get("reasoning") or ""
            for tc in d.get("tool_calls") or ():
                call = out["calls"].setdefault(tc["index"], {"id": None, "name": "", "args": ""})
                call["id"] = call["id"] or tc.get("id")
                f = tc.get("function") or {}
                call["name"] += f.get("name") or ""
                call["args"] += f.get("arguments") or ""
            if ch.get("finish_reason"):
                assert out["finish"] is None, "one finish per choice"
                out["finish"] = ch["finish_reason"]
    return out


def structural_tag(dec: Any) -> dict[str, Any]:
    so = dec.seen[-1].sampling.params["structured_outputs"]
    assert so is not None and so.structural_tag is not None, so
    tag: dict[str, Any] = json.loads(so.structural_tag)
    return tag


def grammar_takes(dec: Any, tok: Any, text: str) -> bool:
    """Whether the decode's structured output, compiled by xgrammar (vLLM's backend on CPU)
    for the model's tokenizer, lets the model write ``text``."""
    import xgrammar as xgr

    so = dec.seen[-1].sampling.params["structured_outputs"]
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    matcher = xgr.GrammarMatcher(
        xgr.GrammarCompiler(info).compile_structural_tag(so.structural_tag)
    )
    return bool(matcher.accept_string(text))


# -- tool_choice: required and named become structured output on the decode engine -----------


def test_required_constrains_the_decode_to_a_call_of_the_tools_schema(
    tools_only: Any, tok: Any
) -> None:
    client, _, dec = tools_only
    dec.answers = [CALL]
    body = answered(chat(client, tools=TOOLS, tool_choice="required"))
    # the grammar takes a call, and neither plain text nor arguments off the schema
    assert grammar_takes(dec, tok, CALL)
    assert not grammar_takes(dec, tok, "It is sunny.")
    assert not grammar_takes(dec, tok, CALL.replace('"Paris"', "42"))
    tag = structural_tag(dec)
    tags = tag["format"]["tags"]
    assert tag["format"]["at_least_one"] is True
    assert {t["begin"].split('"name": "')[1].split('"')[0] for t in tags} == {
        "get_weather",
        "get_time",
    }
    weather = next(t for t in tags if "get_weather" in t["begin"])
    # the strict tool's arguments are held to its schema (vLLM's structural tag)
    assert weather["content"]["json_schema"] == WEATHER["function"]["parameters"]  # type: ignore[index]
    # hermes keeps special tokens, as vLLM's hermes parser asks
    assert dec.seen[-1].sampling.params["skip_special_tokens"] is False
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert choice["message"]["content"] == ""  # vLLM's content for a required call


def test_a_named_tool_constrains_to_that_one_call_and_finishes_with_stop(
    tools_only: Any, tok: Any
) -> None:
    client, _, dec = tools_only
    dec.answers = [TIME_CALL]
    named = {"type": "function", "function": {"name": "get_time"}}
    body = answered(chat(client, tools=TOOLS, tool_choice=named))
    assert grammar_takes(dec, tok, TIME_CALL) and not grammar_takes(dec, tok, CALL)
    tag = structural_tag(dec)
    assert all("get_time" in t["begin"] for t in tag["format"]["tags"])
    assert tag["format"]["stop_after_first"] is True
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "stop"  # OpenAI's: a named call ends with stop
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_time"]
    chunks = streamed(client, tools=TOOLS, tool_choice=named)
    got = reassembled(chunks)
    assert got["finish"] == "stop" and [c["name"] for c in got["calls"].values()] == ["get_time"]
    assert json.loads(got["calls"][0]["args"]) == {}


def test_parallel_tool_calls_false_keeps_one_call(tools_only: Any) -> None:
    client, _, dec = tools_only
    dec.answers = [CALL + TIME_CALL]
    body = answered(chat(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False))
    assert structural_tag(dec)["format"]["stop_after_first"] is True  # and the grammar stops
    calls = body["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    body = answered(chat(client, tools=TOOLS, tool_choice="required"))
    names = [c["function"]["name"] for c in body["choices"][0]["message"]["tool_calls"]]
    assert names == ["get_weather", "get_time"]
    got = reassembled(streamed(client, tools=TOOLS, parallel_tool_calls=False))
    assert [c["name"] for c in got["calls"].values()] == ["get_weather"]


# -- tool_choice auto: the model's own calls, parsed ------------------------------------------


def test_auto_parses_a_call_out_of_the_answer(tools_only: Any) -> None:
    client, _, dec = tools_only
    dec.answers = ["Let me look. " + CALL]
    body = answered(chat(client, tools=TOOLS))  # auto: the default with tools
    # auto with a strict tool: free text, and a call once it starts is held to its schema
    fmt = structural_tag(dec)["format"]
    assert fmt["triggers"] == ["<tool_call>"] and fmt["at_least_one"] is False
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me look. "
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    # no call: plain content, the engine's finish reason; without strict tools, no grammar
    dec.answers = ["It is sunny."]
    body = answered(chat(client, tools=[TIME], tool_choice="auto"))
    assert dec.seen[-1].sampling.params["structured_outputs"] is None
    msg = body["choices"][0]["message"]
    assert msg["content"] == "It is sunny." and "tool_calls" not in msg
    assert body["choices"][0]["finish_reason"] == "stop"
    # tool_choice none: the call stays text
    dec.answers = [CALL]
    body = answered(chat(client, tools=TOOLS, tool_choice="none"))
    assert body["choices"][0]["message"]["content"] == CALL


@pytest.mark.parametrize("per_chunk", [1, 4])
def test_streamed_tool_call_deltas_reassemble_to_the_same_call(
    tools_only: Any, per_chunk: int
) -> None:
    client, _, dec = tools_only
    dec.answers, dec.per_chunk = ["Let me look. " + CALL], per_chunk
    try:
        whole = answered(chat(client, tools=TOOLS))["choices"][0]["message"]
        chunks = streamed(client, tools=TOOLS, stream_options={"include_usage": True})
    finally:
        dec.per_chunk = 3
    first = chunks[0]["choices"][0]["delta"]
    assert first == {"role": "assistant", "content": ""}  # vLLM's first chunk
    got = reassembled(chunks)
    assert got["finish"] == "tool_calls"
    assert got["content"] == whole["content"] == "Let me look. "
    (call,) = got["calls"].values()
    assert call["id"].startswith("chatcmpl-tool-") and call["name"] == "get_weather"
    assert json.loads(call["args"]) == json.loads(whole["tool_calls"][0]["function"]["arguments"])
    # vLLM's layout: the name comes with the id and type, then argument pieces by index
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    opening = next(d for d in deltas if d.get("tool_calls"))["tool_calls"][0]
    assert opening["type"] == "function" and opening["function"] == {"name": "get_weather"}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0


def test_each_choice_is_parsed_on_its_own(tools_only: Any) -> None:
    client, _, dec = tools_only
    dec.answers = [CALL, "No tool needed."]
    body = answered(chat(client, tools=TOOLS, n=2, seed=1))
    one, two = body["choices"]
    assert one["finish_reason"] == "tool_calls" and one["message"]["tool_calls"]
    assert two["finish_reason"] == "stop" and "tool_calls" not in two["message"]
    assert two["message"]["content"] == "No tool needed."
    chunks = streamed(client, tools=TOOLS, n=2, seed=1)
    a, b = reassembled(chunks, 0), reassembled(chunks, 1)
    assert a["finish"] == "tool_calls" and a["calls"][0]["name"] == "get_weather"
    assert b["finish"] == "stop" and not b["calls"] and b["content"] == "No tool needed."


def test_a_tool_result_turn_renders_through_the_template(tools_only: Any) -> None:
    client, pre, dec = tools_only
    dec.answers = ["It is sunny in Paris."]
    call = {"name": "get_weather", "arguments": '{"city": "Paris"}'}  # as OpenAI sends it
    msgs = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_1", "type": "function", "function": call}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"},
    ]
    body = answered(chat(client, messages=msgs, tools=TOOLS, return_prompt_text=True))
    text = body["prompt_text"]
    turn = '<|assistant|>\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
    assert turn + "</tool_call></s>\n<|tool|>\nsunny, 24 C</s>\n<|assistant|>\n" in text
    assert json.dumps(WEATHER) in text  # the tools, in the system turn
    assert client.core.tokenizer.decode(pre.seen[-1].prompt_token_ids) == text
    assert body["choices"][0]["message"]["content"] == "It is sunny in Paris."
    # a bad call in the history is a 400 naming it
    msgs[1]["tool_calls"] = [{"id": "c", "type": "function", "function": {"arguments": "{}"}}]
    r = chat(client, messages=msgs, tools=TOOLS)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages.1.tool_calls.0.function.name"


# -- reasoning -----------------------------------------------------------------------------------


def test_reasoning_goes_apart_from_the_content(agent: Any, tok: Any) -> None:
    client, _, dec = agent
    answer = "<think>The user wants Paris.</think>It is sunny."
    dec.answers = [answer]
    body = answered(chat(client))
    msg = body["choices"][0]["message"]
    assert msg["reasoning"] == msg["reasoning_content"] == "The user wants Paris."
    assert msg["content"] == "It is sunny."
    thought = len(tok.encode("The user wants Paris.", add_special_tokens=False))
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == thought
    chunks = streamed(client, stream_options={"include_usage": True})
    got = reassembled(chunks)
    assert (got["reasoning"], got["content"]) == ("The user wants Paris.", "It is sunny.")
    assert chunks[-1]["usage"]["completion_tokens_details"]["reasoning_tokens"] == thought
    # reasoning, then a call
    dec.answers = ["<think>Look it up.</think>" + CALL]
    body = answered(chat(client, tools=TOOLS))
    msg = body["choices"][0]["message"]
    assert msg["reasoning"] == "Look it up." and msg["tool_calls"][0]["function"]["name"]
    got = reassembled(streamed(client, tools=TOOLS))
    assert got["reasoning"] == "Look it up." and got["finish"] == "tool_calls"
    assert json.loads(got["calls"][0]["args"]) == {"city": "Paris"}


def test_include_reasoning_false_hides_it_and_the_tokens_that_would_show_it(agent: Any) -> None:
    client, _, dec = agent
    dec.answers = ["<think>secret</think>It is sunny."]
    body = answered(chat(client, include_reasoning=False, logprobs=True, return_token_ids=True))
    (choice,) = body["choices"]
    assert choice["message"]["content"] == "It is sunny." and choice["message"]["reasoning"] is None
    assert choice["logprobs"] is None and "token_ids" not in choice
    chunks = streamed(client, include_reasoning=False, logprobs=True)
    text = json.dumps(chunks)
    assert "secret" not in text and reassembled(chunks)["content"] == "It is sunny."
    # asked for: logprobs and token ids of every token go out, reasoning too
    body = answered(chat(client, logprobs=True, return_token_ids=True))
    (choice,) = body["choices"]
    assert choice["message"]["reasoning"] == "secret"
    assert len(choice["logprobs"]["content"]) == len(choice["token_ids"]) > 0


def test_an_echo_joins_the_parsed_content(agent: Any) -> None:
    client, _, dec = agent
    dec.answers = ["<think>hm</think> sunny."]
    msgs = [*ASK, {"role": "assistant", "content": "It is"}]
    body = answered(
        chat(
            client,
            messages=msgs,
            echo=True,
            add_generation_prompt=False,
            continue_final_message=True,
        )
    )
    msg = body["choices"][0]["message"]
    assert msg["content"] == "It is sunny." and msg["reasoning"] == "hm"
    got = reassembled(
        streamed(
            client,
            messages=msgs,
            echo=True,
            add_generation_prompt=False,
            continue_final_message=True,
        )
    )
    assert got["content"] == "It is sunny." and got["reasoning"] == "hm"


# -- refusals: each a 400 naming its field ---------------------------------------------------

NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize(
    "body",
    [
        {"tools": TOOLS},  # auto, the default with tools
        {"tools": TOOLS, "tool_choice": "auto"},
        {"tools": TOOLS, "tool_choice": "required"},
        {"tools": TOOLS, "tool_choice": NAMED},
    ],
    ids=["default", "auto", "required", "named"],
)
def test_without_parsers_tool_choice_is_refused_as_vllm_refuses_it(
    plain: Any, body: dict[str, Any]
) -> None:
    client, pre, _ = plain
    seen = len(pre.seen)
    r = chat(client, **body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "tool_choice" and "model.tool_call_parser" in err["message"]
    assert len(pre.seen) == seen  # before any engine call
    # tool_choice none: the tools go into the template, the reply is text
    assert chat(client, tools=TOOLS, tool_choice="none").status_code == 200


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {}}}, "tool_choice.function.name"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": []}, "tools"),
        ({"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls"),
        ({"tools": TOOLS, "include_reasoning": "yes"}, "include_reasoning"),
    ],
    ids=["no-tools", "unknown-name", "no-name", "bad-value", "empty-tools",
         "parallel-type", "include-reasoning-type"],
)  # fmt: skip
def test_bad_tool_fields_are_400s_naming_them(
    tools_only: Any, body: dict[str, Any], param: str
) -> None:
    client, pre, _ = tools_only
    seen = len(pre.seen)
    r = chat(client, **body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    assert len(pre.seen) == seen


# -- the server's parser settings ------------------------------------------------------------


def test_parser_settings_are_checked_naming_the_field(tiny_model_dir: Path, tok: Any) -> None:
    from pydantic import ValidationError

    from deployments.config import AppConfig, ModelConfig
    from deployments.ingress.parsing import OutputParsers

    for bad, field in [
        ({"tool_call_parser": "no_such"}, "model.tool_call_parser"),
        ({"reasoning_parser": "no_such"}, "model.reasoning_parser"),
        ({"enable_auto_tool_choice": True}, "model.tool_call_parser"),
        ({"tool_strict_level": "max"}, "model.tool_strict_level"),
    ]:
        with pytest.raises(ValidationError, match=field.replace(".", r"\.")):
            AppConfig.model_validate({"model": bad})
    # a parser the model's tokenizer cannot serve fails the deploy (and an ingress's start),
    # naming the fields
    from deployments.app import check_parsers

    model = {"path": str(tiny_model_dir), "build_preset": None, "reasoning_parser": "k2_horizon"}
    with pytest.raises(ValueError, match="model.reasoning_parser"):
        check_parsers(AppConfig.model_validate({"model": model}))
    with pytest.raises(ValueError, match="model.reasoning_parser"):
        OutputParsers(ModelConfig(reasoning_parser="k2_horizon"), tok)
    check_parsers(AppConfig.model_validate({"model": {**model, "reasoning_parser": "qwen3"}}))
    # the tool parser parses only with auto tool choice, as in vLLM
    off = OutputParsers(ModelConfig(tool_call_parser="hermes"), tok)
    assert off.parser_cls is None and not off.tool_parsing
