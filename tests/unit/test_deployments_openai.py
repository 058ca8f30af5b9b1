"""The OpenAI request layer: vLLM's request models accepted field for field (a contract over
the installed vLLM's fields), what the PD path refuses and why (one list), the engines'
sampling built by vLLM's own ``to_sampling_params``, and the response shapes clients parse
(logprobs as vLLM lays them out)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError
from pydantic_core import PydanticUndefined
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionRequest as VllmChatRequest,
)
from vllm.entrypoints.openai.completion.protocol import CompletionRequest as VllmCompletionRequest

from deployments.ingress.openai_requests import (
    IGNORED,
    REFUSED,
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    include_usage,
    sampling_of,
    usage,
)
from deployments.ingress.openai_responses import (
    ChoiceOut,
    LogprobFormat,
    chat_logprobs,
    completion_body,
    completion_logprobs,
    prompt_logprobs_json,
    stream_chunk,
)
from deployments.protocol import TokenLogprob

MSGS = [{"role": "user", "content": "x"}]


def comp(**kw: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "test", "prompt": "hi", **kw})


def chat(**kw: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "test", "messages": MSGS, **kw})


def samp(req: Any, prompt_tokens: int = 10, max_model_len: int = 100) -> Any:
    return sampling_of(
        req, prompt_tokens=prompt_tokens, max_model_len=max_model_len, default_max_tokens=16
    ).sampling


# -- the contract over vLLM's request fields ------------------------------------------------

#: A value of each refused field that the PD path cannot honour (the contract test checks
#: every entry of REFUSED has one, and that each is refused naming its field).
REFUSED_EXAMPLES: dict[str, Any] = {
    "use_beam_search": True,
    "best_of": 3,
    "suffix": "tail",
    "prompt_embeds": b"abc",
    "kv_transfer_params": {"do_remote_decode": True},
    "ec_transfer_params": {"x": 1},
    "priority": 5,
    "chat_template": "{{ messages }}",
    "media_io_kwargs": {"image": {}},
    "mm_processor_kwargs": {"a": 1},
    "routed_experts_prompt_start": 3,
}


def _default(info: Any) -> Any:
    if info.default_factory is not None:
        return info.default_factory()
    return None if info.default is PydanticUndefined else info.default


@pytest.mark.parametrize(
    ("ours", "theirs", "base"),
    [
        (CompletionRequest, VllmCompletionRequest, {"model": "test", "prompt": "hi"}),
        (ChatCompletionRequest, VllmChatRequest, {"model": "test", "messages": MSGS}),
    ],
    ids=["completions", "chat"],
)
def test_every_vllm_field_is_accepted_at_its_default(ours: Any, theirs: Any, base: Any) -> None:
    """Each of vLLM's request fields, sent explicitly at vLLM's default, is accepted and
    never refused: a field pdserve dropped would be an unknown field here."""
    assert set(theirs.model_fields) <= set(ours.model_fields)
    for name, info in theirs.model_fields.items():
        if name in base or info.deprecated:
            continue
        body = {**base, name: _default(info)}
        if name == "stream_options":
            body["stream_options"] = None
        req = ours.model_validate(body)
        samp(req)  # never refused at the default


@pytest.mark.parametrize("field", sorted(REFUSED_EXAMPLES))
def test_each_refusal_names_its_field_and_says_why(field: str) -> None:
    assert set(REFUSED) == set(REFUSED_EXAMPLES), "every refusal needs an example here"
    in_chat = field in VllmChatRequest.model_fields
    body: dict[str, Any] = {field: REFUSED_EXAMPLES[field]}
    req = chat(**body) if in_chat else comp(**body)
    with pytest.raises(RequestError) as e:
        samp(req)
    assert e.value.param == field and e.value.status == 400
    assert REFUSED[field][1] in e.value.message
    assert e.value.body()["error"]["param"] == field


def test_the_refused_and_ignored_lists_name_real_fields() -> None:
    fields = set(VllmCompletionRequest.model_fields) | set(VllmChatRequest.model_fields)
    assert set(REFUSED) - {"best_of"} <= fields
    assert {k.split(".")[0] for k in IGNORED} <= fields


# -- what the engines get --------------------------------------------------------------------


def test_vllm_sampling_fields_reach_the_engines_with_their_values() -> None:
    kw = {
        "repetition_penalty": 1.3,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.25,
        "top_k": 7,
        "min_p": 0.05,
        "min_tokens": 2,
        "stop_token_ids": [5, 6],
        "ignore_eos": True,
        "logit_bias": {"17": 2.5},
        "seed": 11,
        "skip_special_tokens": False,
        "include_stop_str_in_output": True,
        "bad_words": ["zz"],
        "allowed_token_ids": [1, 2, 3],
    }
    p = samp(comp(**kw, user="u1", max_tokens=9)).params
    for k, v in kw.items():
        got = p[k]
        if k == "logit_bias":
            got = {str(t): b for t, b in got.items()}
        assert got == v, k
    c = samp(chat(**kw, max_completion_tokens=4)).params
    assert c["max_tokens"] == 4 and c["repetition_penalty"] == 1.3


def test_logprobs_n_echo_and_structured_output_are_carried() -> None:
    s = samp(comp(logprobs=3, n=2, echo=True, best_of=2))
    assert (s.logprobs, s.n, s.prompt_logprobs) == (3, 2, 3)  # echo asks the prompt's too
    c = samp(chat(logprobs=True, top_logprobs=4))
    assert c.logprobs == 4 and c.prompt_logprobs is None
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string"}}}
    so = samp(chat(response_format=rf)).params["structured_outputs"]
    assert so is not None and so.json == {"type": "string"}


def test_max_tokens_as_vllm_resolves_it() -> None:
    assert samp(comp()).max_tokens == 16  # OpenAI's completions default
    assert samp(chat(), prompt_tokens=95).max_tokens == 5  # chat: the room left
    assert samp(chat(max_tokens=3, max_completion_tokens=9)).max_tokens == 9
    with pytest.raises(RequestError) as e:
        samp(comp(max_tokens=91), prompt_tokens=10)
    assert e.value.param == "max_tokens"
    with pytest.raises(RequestError) as e:
        samp(comp(), prompt_tokens=100)
    assert e.value.param == "prompt"
    r = sampling_of(
        comp(echo=True, max_tokens=0), prompt_tokens=5, max_model_len=9, default_max_tokens=4
    )
    assert r.echo_only


def test_vllm_range_checks_are_400s_naming_the_field() -> None:
    with pytest.raises(RequestError) as e:
        samp(comp(presence_penalty=5))
    assert "presence_penalty" in e.value.message and e.value.status == 400
    with pytest.raises(RequestError):
        samp(comp(temperature=-1))
    with pytest.raises(RequestError) as e:
        samp(comp(stop=["ok", ""]))
    assert e.value.param == "stop"


def test_unknown_field_is_a_validation_error_naming_it() -> None:
    with pytest.raises(ValidationError, match="frobnicate"):
        comp(frobnicate=1)
    with pytest.raises(ValidationError, match="frobnicate"):
        chat(frobnicate=1)


def test_include_usage_only_when_streaming() -> None:
    assert include_usage(comp(stream=True, stream_options={"include_usage": True}))
    with pytest.raises(Exception, match="stream_options|Stream options"):
        comp(stream=False, stream_options={"include_usage": True})  # vLLM refuses it
    assert not include_usage(comp(stream=True))


# -- log-probabilities, as vLLM lays them out ------------------------------------------------

#: vLLM's order: the sampled token first, then the top ones by rank.
STEP = TokenLogprob(7, "a", -0.5, ((7, "a", -0.5, 2), (3, "b", -0.1, 1), (9, "c", -2.0, 3)))


def test_completion_logprobs_keep_top_k_plus_the_token_and_offsets() -> None:
    lp = completion_logprobs([STEP, STEP], LogprobFormat(top=1), lambda t: "?")
    assert lp.tokens == ["a", "a"] and lp.token_logprobs == [-0.5, -0.5]
    assert lp.top_logprobs == [{"a": -0.5, "b": -0.1}] * 2  # index <= k, as vLLM
    assert lp.text_offset == [0, 1]
    first = TokenLogprob(4, None, None)  # an echo's first prompt token
    lp = completion_logprobs([first, STEP], LogprobFormat(top=0), lambda t: f"<{t}>", offset=0)
    assert lp.tokens == ["<4>", "a"] and lp.token_logprobs == [None, -0.5]
    assert lp.top_logprobs == [None, {"a": -0.5}] and lp.text_offset == [0, 3]
    ids = completion_logprobs([STEP], LogprobFormat(top=0, as_token_ids=True), str)
    assert ids.tokens == ["token_id:7"]


def test_chat_logprobs_take_the_first_k_candidates_with_bytes() -> None:
    out = chat_logprobs([STEP], LogprobFormat(top=2), lambda t: "?")
    assert out[0].token == "a" and out[0].bytes == [97] and out[0].logprob == -0.5
    assert [t.token for t in out[0].top_logprobs] == ["a", "b"]
    assert chat_logprobs([STEP], LogprobFormat(top=0), str)[0].top_logprobs == []


def test_prompt_logprobs_json_is_vllms_extension() -> None:
    out = prompt_logprobs_json([TokenLogprob(4, None, None), STEP])
    assert out[0] is None
    assert out[1] is not None and out[1]["3"] == {"logprob": -0.1, "rank": 1, "decoded_token": "b"}


def test_bodies_parse_with_the_openai_client_types() -> None:
    from openai.types import Completion
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    u = usage(10, 4, 128)
    assert u.total_tokens == 14 and u.prompt_tokens_details is not None
    two = [ChoiceOut(0, "abc", "length"), ChoiceOut(1, "xyz", "stop", stop_reason="\n")]
    c = Completion.model_validate(completion_body("cmpl-1", "test", two, u, False))
    assert [ch.text for ch in c.choices] == ["abc", "xyz"]
    assert c.usage is not None and c.usage.prompt_tokens_details.cached_tokens == 128  # type: ignore[union-attr]
    lp = chat_logprobs([STEP], LogprobFormat(top=1), str)
    cc = ChatCompletion.model_validate(
        completion_body("c-1", "test", [ChoiceOut(0, "hi", "stop", logprobs=lp)], u, True)
    )
    assert cc.choices[0].message.content == "hi"
    assert cc.choices[0].logprobs is not None and cc.choices[0].logprobs.content[0].token == "a"  # type: ignore[index]
    first = ChatCompletionChunk.model_validate(
        stream_chunk("c-1", "test", 0, chat=True, delta=ChoiceOut(1, "h"), role=True)
    )
    assert first.choices[0].delta.role == "assistant" and first.choices[0].index == 1
    last = ChatCompletionChunk.model_validate(stream_chunk("c-1", "test", 0, chat=True, use=u))
    assert last.choices == [] and last.usage is not None
    tc = Completion.model_validate(
        stream_chunk("cmpl-1", "test", 0, chat=False, delta=ChoiceOut(0, "x", "length"))
    )
    assert tc.choices[0].text == "x" and tc.choices[0].finish_reason == "length"
    # a mid-stream text chunk carries finish_reason null, as OpenAI's and vLLM's servers send
    mid = stream_chunk("cmpl-1", "test", 0, chat=False, delta=ChoiceOut(0, "y"))
    assert mid["choices"][0]["finish_reason"] is None and mid["choices"][0]["text"] == "y"
