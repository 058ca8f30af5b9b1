"""The OpenAI request layer: what the PD path refuses (with the field named) and the
response shapes clients parse."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from deployments.openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    completion_body,
    include_usage,
    sampling_of,
    stream_chunk,
    usage,
)


def comp(**kw: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "test", "prompt": "hi", **kw})


def samp(req: Any, prompt_tokens: int = 10, max_model_len: int = 100) -> Any:
    return sampling_of(
        req, prompt_tokens=prompt_tokens, max_model_len=max_model_len, default_max_tokens=16
    )


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 2),
        ("best_of", 2),
        ("logprobs", 1),
        ("echo", True),
        ("presence_penalty", 0.5),
        ("frequency_penalty", 0.1),
        ("logit_bias", {"1": 2.0}),
        ("suffix", "x"),
    ],
)
def test_unsupported_values_are_refused_naming_the_field(field: str, value: Any) -> None:
    with pytest.raises(RequestError) as e:
        samp(comp(**{field: value}))
    assert e.value.param == field and e.value.status == 400
    assert e.value.body()["error"]["param"] == field


def test_n_refusal_says_why() -> None:
    with pytest.raises(RequestError, match="n > 1"):
        samp(comp(n=3))


def test_neutral_values_of_unsupported_fields_pass() -> None:
    s = samp(comp(n=1, logprobs=None, presence_penalty=0.0, echo=False))
    assert s.max_tokens == 16


def test_chat_tools_are_refused() -> None:
    req = ChatCompletionRequest.model_validate(
        {"model": "t", "messages": [{"role": "user", "content": "x"}], "tools": [{"x": 1}]}
    )
    with pytest.raises(RequestError) as e:
        samp(req)
    assert e.value.param == "tools"


def test_unknown_field_is_a_validation_error_naming_it() -> None:
    with pytest.raises(ValidationError, match="frobnicate"):
        comp(frobnicate=1)


def test_max_tokens_default_and_room() -> None:
    assert samp(comp(), prompt_tokens=95).max_tokens == 5  # clipped to what fits
    assert samp(comp(max_tokens=7)).max_tokens == 7
    with pytest.raises(RequestError) as e:
        samp(comp(max_tokens=91), prompt_tokens=10)
    assert e.value.param == "max_tokens"
    with pytest.raises(RequestError) as e:
        samp(comp(), prompt_tokens=100)
    assert e.value.param == "prompt"


def test_max_completion_tokens_wins_in_chat() -> None:
    req = ChatCompletionRequest.model_validate(
        {
            "model": "t",
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 3,
            "max_completion_tokens": 9,
        }
    )
    assert samp(req).max_tokens == 9


def test_sampling_fields_carry_over() -> None:
    s = samp(comp(temperature=0, top_p=0.5, seed=7, stop=["a", "b"], ignore_eos=True))
    assert (s.temperature, s.top_p, s.seed, s.stop, s.ignore_eos) == (0, 0.5, 7, ("a", "b"), True)
    assert samp(comp(stop="z")).stop == ("z",)
    with pytest.raises(RequestError) as e:
        samp(comp(stop=list("abcde")))
    assert e.value.param == "stop"


def test_include_usage_only_when_streaming() -> None:
    assert include_usage(comp(stream=True, stream_options={"include_usage": True}))
    assert not include_usage(comp(stream=False, stream_options={"include_usage": True}))
    assert not include_usage(comp(stream=True))


def test_bodies_parse_with_the_openai_client_types() -> None:
    from openai.types import Completion
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    u = usage(10, 4, 128)
    assert u.total_tokens == 14 and u.prompt_tokens_details is not None
    assert u.prompt_tokens_details.cached_tokens == 128
    c = Completion.model_validate(completion_body("cmpl-1", "test", "abc", "length", u, False))
    assert c.usage is not None and c.usage.prompt_tokens_details.cached_tokens == 128  # type: ignore[union-attr]
    cc = ChatCompletion.model_validate(completion_body("c-1", "test", "hi", "stop", u, True))
    assert cc.choices[0].message.content == "hi"
    first = ChatCompletionChunk.model_validate(
        stream_chunk("c-1", "test", 0, chat=True, text="h", role=True)
    )
    assert first.choices[0].delta.role == "assistant" and first.choices[0].delta.content == "h"
    last = ChatCompletionChunk.model_validate(stream_chunk("c-1", "test", 0, chat=True, use=u))
    assert last.choices == [] and last.usage is not None
    tc = Completion.model_validate(
        stream_chunk("cmpl-1", "test", 0, chat=False, text="x", finish_reason="length")
    )
    assert tc.choices[0].text == "x" and tc.choices[0].finish_reason == "length"
    # a mid-stream text chunk carries finish_reason null, as OpenAI's and vLLM's servers send
    mid = stream_chunk("cmpl-1", "test", 0, chat=False, text="y")
    assert mid["choices"][0]["finish_reason"] is None and mid["choices"][0]["text"] == "y"


def test_non_text_chat_parts_are_refused() -> None:
    req = ChatCompletionRequest.model_validate(
        {"model": "t", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}
    )
    with pytest.raises(RequestError) as e:
        req.messages[0].text()
    assert e.value.param == "messages"
