"""OpenAI's Responses API (``/v1/responses``, issue 41) on the PD path: a Responses request runs
as the chat vLLM's server makes of it, over fake engine handles whose decode streams a scripted
answer (text and token ids of the real tiny tokenizer). Every body is checked against vLLM's
``ResponsesResponse`` and ``openai``'s ``Response``, every streamed event against ``openai``'s
event types (and vLLM's, for the events that carry the response); the ``openai`` client itself
reads them through the test app (``client.responses.create``)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from openai import OpenAI
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from pydantic_core import PydanticUndefined
from vllm.entrypoints.openai.responses.protocol import (
    ResponseCompletedEvent,
    ResponseCreatedEvent,
    ResponseInProgressEvent,
    ResponsesResponse,
)
from vllm.entrypoints.openai.responses.protocol import ResponsesRequest as VllmResponsesRequest

from controllers.tenants import Bucket, available
from deployments.ingress.openai_requests import REFUSED
from deployments.ingress.responses_api import (
    RESPONSES_IGNORED,
    RESPONSES_REFUSED,
    TO_CHAT,
    ResponsesRequest,
    to_chat,
)
from tests.unit.test_deployments_ingress import OP, FakeEngine, _wire, auth
from tests.unit.test_ingress_tool_calls import CALL, PARSERS, _agent

pytestmark = pytest.mark.slow  # the tiny model's tokenizer

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
EVENTS = TypeAdapter(ResponseStreamEvent)
#: vLLM's own models of the events that carry the whole response
VLLM_EVENTS = {
    "response.created": ResponseCreatedEvent,
    "response.in_progress": ResponseInProgressEvent,
    "response.completed": ResponseCompletedEvent,
}


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def plain(tiny_model_dir: Path, tok: Any) -> tuple[Any, FakeEngine, Any]:
    """No parsers: vLLM's defaults."""
    return _agent(tiny_model_dir, tok)


@pytest.fixture(scope="module")
def agent(tiny_model_dir: Path, tok: Any) -> tuple[Any, FakeEngine, Any]:
    """hermes tool calls and qwen3 reasoning."""
    return _agent(tiny_model_dir, tok, **PARSERS, reasoning_parser="qwen3")


@pytest.fixture(scope="module")
def tools_only(tiny_model_dir: Path, tok: Any) -> tuple[Any, FakeEngine, Any]:
    """hermes tool calls, no reasoning parser (qwen3's would read text before a call as
    reasoning: a <tool_call> ends its reasoning)."""
    return _agent(tiny_model_dir, tok, **PARSERS)


def create(client: Any, **body: Any) -> Any:
    return client.post("/v1/responses", json={"model": "test", "input": "Hi there", **body})


def answered(r: Any) -> dict[str, Any]:
    """A 200 body that vLLM's and openai's response models both take."""
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    ResponsesResponse.model_validate(body)
    Response.model_validate(body)
    return body


def events(client: Any, **body: Any) -> list[dict[str, Any]]:
    """A stream's events, each framed as vLLM frames them (``event: TYPE``, then its JSON)
    and taken by openai's event union (and vLLM's model where it has one), numbered 0, 1,
    2, ... in order."""
    req = {"model": "test", "input": "Hi there", "stream": True, **body}
    with client.stream("POST", "/v1/responses", json=req) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    out = []
    for head, data in zip(lines[::2], lines[1::2], strict=True):
        ev = json.loads(data.removeprefix("data: "))
        assert head == f"event: {ev['type']}"
        EVENTS.validate_python(ev)
        if ev["type"] in VLLM_EVENTS:
            VLLM_EVENTS[ev["type"]].model_validate(ev)
        out.append(ev)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


def sdk(client: Any) -> OpenAI:
    """The ``openai`` client over the test app (the TestClient is an httpx client)."""
    return OpenAI(base_url="http://testserver/v1", api_key="none", http_client=client)


# -- text --------------------------------------------------------------------------------------


def test_a_plain_text_response(plain: Any, tok: Any) -> None:
    client, pre, dec = plain
    dec.answers, dec.finish = ["It is sunny in Paris."], "stop"
    body = answered(create(client, max_output_tokens=20, temperature=0.5))
    assert body["object"] == "response" and body["id"].startswith("resp_")
    assert body["status"] == "completed" and body["model"] == "test"
    (item,) = body["output"]
    assert item["type"] == "message" and item["role"] == "assistant"
    assert item["status"] == "completed" and item["id"].startswith("msg_")
    assert [c["type"] for c in item["content"]] == ["output_text"]
    assert item["content"][0]["text"] == "It is sunny in Paris."
    n_out = len(tok.encode("It is sunny in Paris.", add_special_tokens=False))
    use = body["usage"]
    assert use["input_tokens"] == len(pre.seen[-1].prompt_token_ids)
    assert use["output_tokens"] == n_out
    assert use["total_tokens"] == use["input_tokens"] + n_out
    assert use["input_tokens_details"]["cached_tokens"] == 128  # the prefill engine's count
    assert use["output_tokens_details"]["reasoning_tokens"] == 0
    # the sampling that ran, echoed as vLLM echoes it
    assert body["temperature"] == 0.5 and body["max_output_tokens"] == 20
    assert dec.seen[-1].sampling.max_tokens == 20 and dec.seen[-1].sampling.temperature == 0.5
    assert body["pdserve"]["ingress_replica"] == "local"  # pdserve's field, as on chat
    # null where vLLM's request allows it and its response does not: echoed as the default
    body = answered(create(client, background=None, truncation=None, parallel_tool_calls=None))
    assert (body["background"], body["truncation"]) == (False, "disabled")
    # the request's id is the response's (vLLM's rule)
    assert answered(create(client, request_id="resp_mine"))["id"] == "resp_mine"
    # the openai client reads it
    got = sdk(client).responses.create(model="test", input="Hi there")
    assert got.output_text == "It is sunny in Paris." and got.status == "completed"


def test_a_streamed_text_response_in_vllms_event_order(plain: Any) -> None:
    client, _, dec = plain
    dec.answers, dec.finish = ["It is sunny in Paris."], "stop"
    evs = events(client)
    kinds = [e["type"] for e in evs]
    deltas = kinds.count("response.output_text.delta")
    assert deltas > 1
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert evs[0]["response"]["status"] == "in_progress" and evs[0]["response"]["output"] == []
    text = "".join(e["delta"] for e in evs if e["type"] == "response.output_text.delta")
    assert text == "It is sunny in Paris."
    done = next(e for e in evs if e["type"] == "response.output_text.done")
    assert done["text"] == text
    item = next(e for e in evs if e["type"] == "response.output_item.done")["item"]
    final = evs[-1]["response"]
    assert final["status"] == "completed" and final["output"] == [item]  # the streamed ids
    assert final["id"] == evs[0]["response"]["id"]
    assert final["usage"]["output_tokens"] > 0 and final["usage"]["input_tokens"] > 0
    # the openai client reads the stream
    streamed = sdk(client).responses.create(model="test", input="Hi there", stream=True)
    got = [e.type for e in streamed]
    assert got[0] == "response.created" and got[-1] == "response.completed"


def test_a_response_cut_by_max_output_tokens_is_incomplete(plain: Any) -> None:
    client, _, dec = plain
    dec.answers, dec.finish = ["It is"], "length"
    try:
        body = answered(create(client, max_output_tokens=2))
        assert body["status"] == "incomplete"
        assert body["incomplete_details"] == {"reason": "max_output_tokens"}
        assert events(client, max_output_tokens=2)[-1]["response"]["status"] == "incomplete"
    finally:
        dec.finish = "stop"
    # more than the context has room for is held to the room (vLLM's get_max_tokens)
    body = answered(create(client, max_output_tokens=50_000))
    assert body["max_output_tokens"] == dec.seen[-1].sampling.max_tokens < 50_000
    # past the server's bound: a 400 naming the Responses field
    r = create(client, max_output_tokens=10**6)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_output_tokens"
    assert "max_tokens" not in r.json()["error"]["message"].replace("max_tokens_", "")


def test_instructions_and_an_input_list_go_through_the_chat_template(plain: Any) -> None:
    client, pre, dec = plain
    dec.answers = ["Fine."]
    conversation = [
        {"role": "user", "content": "Hello"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hi!"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "How are you?"}]},
    ]  # fmt: skip
    answered(create(client, instructions="Be brief.", input=conversation))
    prompt = pre.seen[-1].prompt_token_ids
    # the same turns as a chat: the same prompt, token for token
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi!"},
        {"role": "user", "content": "How are you?"},
    ]
    r = client.post("/v1/chat/completions", json={"model": "test", "messages": chat})
    assert r.status_code == 200
    assert pre.seen[-1].prompt_token_ids == prompt
    text = client.core.tokenizer.decode(prompt)
    assert text.index("Be brief.") < text.index("Hello") < text.index("Hi!")
    assert text.index("Hi!") < text.index("How are you?")
    # a last assistant message in progress is continued, not answered (vLLM's rule)
    partial = {**conversation[1], "status": "in_progress"}
    answered(create(client, input=[conversation[0], partial]))
    assert client.core.tokenizer.decode(pre.seen[-1].prompt_token_ids).rstrip().endswith("Hi!")


# -- tools ---------------------------------------------------------------------------------------


def test_a_required_function_tool_gives_a_function_call_item(agent: Any) -> None:
    client, _, dec = agent
    dec.answers = [CALL]
    body = answered(
        create(client, input="Weather in Paris?", tools=[WEATHER], tool_choice="required")
    )
    # the decode engine was held to a call (vLLM's structural tag)
    so = dec.seen[-1].sampling.params["structured_outputs"]
    assert so is not None and "get_weather" in so.structural_tag
    (call,) = body["output"]
    assert call["type"] == "function_call" and call["status"] == "completed"
    assert call["name"] == "get_weather" and call["call_id"] and call["id"].startswith("fc_")
    jsonschema.validate(json.loads(call["arguments"]), WEATHER["parameters"])
    assert json.loads(call["arguments"]) == {"city": "Paris"}
    assert body["tool_choice"] == "required" and body["tools"][0]["name"] == "get_weather"
    # streamed: the call's events, its arguments in pieces
    evs = events(client, input="Weather in Paris?", tools=[WEATHER], tool_choice="required")
    kinds = [e["type"] for e in evs]
    assert kinds[2] == "response.output_item.added"
    assert evs[2]["item"]["type"] == "function_call" and evs[2]["item"]["name"] == "get_weather"
    args = "".join(e["delta"] for e in evs if e["type"] == "response.function_call_arguments.delta")
    done = next(e for e in evs if e["type"] == "response.function_call_arguments.done")
    assert json.loads(args) == json.loads(done["arguments"]) == {"city": "Paris"}
    assert kinds[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    (item,) = evs[-1]["response"]["output"]
    assert item["call_id"] == evs[2]["item"]["call_id"]
    # a named function, as the openai client sends it
    got = sdk(client).responses.create(
        model="test",
        input="Weather in Paris?",
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "get_weather"},
    )
    (fc,) = got.output
    assert fc.type == "function_call" and fc.name == "get_weather"


def test_auto_text_before_a_call_is_a_message_then_the_call(tools_only: Any) -> None:
    client, _, dec = tools_only
    dec.answers = ["Let me look. " + CALL]
    body = answered(create(client, input="Weather in Paris?", tools=[WEATHER]))
    assert [i["type"] for i in body["output"]] == ["message", "function_call"]
    assert body["output"][0]["content"][0]["text"] == "Let me look. "
    evs = events(client, input="Weather in Paris?", tools=[WEATHER])
    done = [e["item"]["type"] for e in evs if e["type"] == "response.output_item.done"]
    assert done == ["message", "function_call"]


def test_a_function_call_output_renders_as_a_tool_turn(agent: Any) -> None:
    client, pre, dec = agent
    dec.answers = ["It is sunny in Paris."]
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 24 C"},
    ]  # fmt: skip
    body = answered(create(client, input=history, tools=[WEATHER]))
    text = client.core.tokenizer.decode(pre.seen[-1].prompt_token_ids)
    turn = '<|assistant|>\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
    assert turn + "</tool_call></s>\n<|tool|>\nsunny, 24 C</s>\n<|assistant|>\n" in text
    assert '"name": "get_weather"' in text.split("<|user|>")[0]  # the tools, in the system turn
    assert body["output"][0]["content"][0]["text"] == "It is sunny in Paris."


# -- reasoning, formats, logprobs ------------------------------------------------------------


def test_reasoning_is_a_reasoning_item_and_counted(agent: Any, tok: Any) -> None:
    client, _, dec = agent
    dec.answers = ["<think>The user wants Paris.</think>It is sunny."]
    body = answered(create(client, reasoning={"effort": "low"}))
    kinds = [i["type"] for i in body["output"]]
    assert kinds == ["reasoning", "message"]
    assert body["output"][0]["content"][0]["text"] == "The user wants Paris."
    assert body["output"][1]["content"][0]["text"] == "It is sunny."
    thought = len(tok.encode("The user wants Paris.", add_special_tokens=False))
    assert body["usage"]["output_tokens_details"]["reasoning_tokens"] == thought
    assert body["reasoning"]["effort"] == "low"
    evs = events(client)
    kinds = [e["type"] for e in evs]
    assert "response.reasoning_text.delta" in kinds
    reasoning = "".join(e["delta"] for e in evs if e["type"] == "response.reasoning_text.delta")
    assert reasoning == "The user wants Paris."
    assert evs[-1]["response"]["usage"]["output_tokens_details"]["reasoning_tokens"] == thought
    # include_reasoning false: no reasoning item, nothing of it streamed
    body = answered(create(client, include_reasoning=False))
    assert [i["type"] for i in body["output"]] == ["message"]
    evs = events(client, include_reasoning=False, include=["message.output_text.logprobs"])
    assert "The user wants" not in json.dumps(evs)
    assert [e["item"]["type"] for e in evs if e["type"] == "response.output_item.done"] == [
        "message"
    ]
    assert all(e["logprobs"] == [] for e in evs if e["type"] == "response.output_text.delta")


def test_text_format_json_schema_is_the_decodes_structured_output(plain: Any) -> None:
    client, _, dec = plain
    dec.answers = ['{"city": "Paris"}']
    fmt = {"type": "json_schema", "name": "city", "schema": WEATHER["parameters"]}
    body = answered(create(client, text={"format": fmt}))
    so = dec.seen[-1].sampling.params["structured_outputs"]
    assert so is not None and so.json == WEATHER["parameters"]
    assert body["text"]["format"]["name"] == "city"
    answered(create(client, text={"format": {"type": "json_object"}}))
    assert dec.seen[-1].sampling.params["structured_outputs"].json_object is True


def test_output_logprobs_when_included(plain: Any) -> None:
    client, _, dec = plain
    dec.answers = ["It is sunny."]
    body = answered(create(client, include=["message.output_text.logprobs"], top_logprobs=0))
    part = body["output"][0]["content"][0]
    n_out = body["usage"]["output_tokens"]
    assert len(part["logprobs"]) == n_out and part["logprobs"][0]["logprob"] == -0.5
    assert "".join(lp["token"] for lp in part["logprobs"]) == "It is sunny."
    evs = events(client, include=["message.output_text.logprobs"])
    got = [lp for e in evs if e["type"] == "response.output_text.delta" for lp in e["logprobs"]]
    assert len(got) == n_out
    # not asked: none computed
    answered(create(client))
    assert dec.seen[-1].sampling.logprobs is None


# -- failures and refusals -----------------------------------------------------------------------


def test_a_failure_mid_stream_is_an_error_event_then_response_failed(tiny_model_dir: Path) -> None:
    dec = FakeEngine("decode")
    client, _, _ = _wire(
        tiny_model_dir, {"ingress": {"auth": "none"}}, engines=(FakeEngine("prefill"), dec)
    )
    dec.fail_after = 2
    evs = events(client, max_output_tokens=5)
    kinds = [e["type"] for e in evs]
    assert kinds[-2:] == ["error", "response.failed"]
    assert "response.completed" not in kinds
    assert kinds.count("response.output_text.delta") == 2
    assert evs[-2]["code"] == "server_error" and evs[-2]["message"]
    failed = evs[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    assert failed["usage"]["output_tokens"] == 2
    # before any token: an HTTP status, not a 200
    dec.fail_after = 0
    r = create(client, stream=True)
    assert r.status_code == 502, r.text


WEB = {"type": "web_search"}
#: refused as the body is parsed (FastAPI's validation), before the route runs
AT_PARSE = {
    "n", "best_of", "max_output_tokens", "stream", "prompt",
    "input.0.type", "input.0.content.0.type", "input.0.encrypted_content",
}  # fmt: skip


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"background": True}, "background"),
        ({"tools": [WEATHER, WEB]}, "tools.1.type"),
        ({"tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]}, "tools.0.type"),
        ({"tools": [WEATHER], "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type"),
        ({"input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": "http://x/y.png", "detail": "auto"}]}]},
         "input.0.content.0.type"),
        ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "x"}]},
         "input.0.encrypted_content"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]},
         "input.0.arguments"),
        ({"n": 2}, "n"),
        ({"best_of": 2}, "best_of"),
        ({"max_tool_calls": 3, "tools": [WEATHER]}, "max_tool_calls"),
        ({"enable_response_messages": True}, "enable_response_messages"),
        ({"reasoning": {"effort": "high"}}, "reasoning.effort"),  # no reasoning parser
        ({"tools": [WEATHER]}, "tool_choice"),  # auto without a tool-call parser
        ({"priority": 3}, "priority"),
        ({"kv_transfer_params": {"do_remote_decode": True}}, "kv_transfer_params"),
        ({"structured_outputs": {"regex": "a+"}, "text": {"format": {"type": "json_object"}}},
         "structured_outputs"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"max_output_tokens": "5"}, "max_output_tokens"),
        ({"stream": "yes"}, "stream"),
        ({"model": "other"}, "model"),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)  # fmt: skip
def test_each_refusal_is_a_400_naming_its_field_before_any_engine_call(
    plain: Any, body: dict[str, Any], param: str
) -> None:
    client, pre, _ = plain
    seen, refused = len(pre.seen), client.core.refused
    r = create(client, **body)
    assert r.status_code in (400, 404), r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert len(pre.seen) == seen  # no engine call
    if r.status_code == 404:  # the model: not served here
        assert param == "model"
    if param in RESPONSES_REFUSED:
        assert RESPONSES_REFUSED[param][1] in err["message"]
    if param in ("previous_response_id", "background"):
        assert "store" in err["message"]
    # counted as chat's refusals are: in prepare, or (the body's shape) when it is parsed
    assert client.core.refused == refused + (param not in AT_PARSE)


def test_refusals_are_charged_to_the_tenant_as_chats_are(tiny_model_dir: Path) -> None:
    """A refused Responses request costs its tenant a request (taken before the body is
    read), and a prompt refused after tokenizing costs its tokens, as a chat's does."""
    from cluster.tenants import hash_key

    client, pre, _ = _wire(
        tiny_model_dir,
        {
            "tenants": {
                "key_hashes": {hash_key("k-r"): "r", hash_key("k-t"): "t"},
                "by_name": {
                    "r": {"requests_per_second": 0.001, "burst_requests": 2},
                    "t": {"tokens_per_minute": 1000, "max_context_tokens": 10},
                },
            }
        },
    )
    body = {"model": "test", "input": "hi", "previous_response_id": "resp_1"}
    codes = [client.post("/v1/responses", json=body, headers=auth("k-r")) for _ in range(3)]
    assert [r.status_code for r in codes] == [400, 400, 429]
    # a tenant route: the operator's key is not taken there
    assert client.post("/v1/responses", json=body, headers=OP).status_code == 403
    lim = client.core.limiter
    b = Bucket(1000 / 60.0, 1000.0)

    def left() -> float:
        return available(b, lim._tat.get(("t", "tokens"), 0.0), time.monotonic())

    start = left()
    long = {"model": "test", "input": "w1 " * 20}
    r = client.post("/v1/responses", json=long, headers=auth("k-t"))
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    assert "max_context_tokens" in r.json()["error"]["message"]
    n = len(client.core.tokenizer.encode(client.core.tokenizer.tok.apply_chat_template(
        [{"role": "user", "content": "w1 " * 20}], tokenize=False, add_generation_prompt=True
    ), False))  # fmt: skip
    assert start - left() == pytest.approx(n, abs=2)
    assert pre.seen == []


# -- the contract over vLLM's request fields ------------------------------------------------------


def _default(info: Any) -> Any:
    if info.default_factory is not None:
        return info.default_factory()
    return None if info.default is PydanticUndefined else info.default


def test_every_vllm_field_is_mapped_refused_or_ignored_and_taken_at_its_default() -> None:
    """Each field of vLLM's ``ResponsesRequest`` has a place here (a chat field, a refusal,
    or vLLM's own ignoring), and sent at vLLM's default it is accepted: a new vLLM field
    fails this test until it is placed."""
    fields = set(VllmResponsesRequest.model_fields)
    placed = set(TO_CHAT) | set(RESPONSES_REFUSED) | set(RESPONSES_IGNORED) | set(REFUSED)
    assert fields - {"prompt"} <= placed, sorted(fields - placed)  # prompt: vLLM refuses it
    assert set(ResponsesRequest.model_fields) == fields
    base = {"model": "test", "input": "hi"}
    for name, info in VllmResponsesRequest.model_fields.items():
        if name in base or info.deprecated:
            continue
        value = _default(info)
        req = ResponsesRequest.model_validate({**base, name: value})
        to_chat(req)  # never refused at its default
