"""A hostile tenant against the ingress logic over fake engine handles (no Ray, no vLLM; the
tiny model's tokenizer): request-controlled templates, work refused before or charged after
tokenizing, joint bounds, reservations and KV given back on every exit, the operator's
routes, readiness that costs the engines nothing per probe. The live suite with real engines
is tests/e2e/test_hostile.py."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request

from controllers.tenants import Bucket, available
from deployments.ingress.auth import AuthGuard
from deployments.ingress.http import api
from deployments.ingress.http_guard import BodyGuard
from deployments.ingress.openai_requests import CompletionRequest
from deployments.protocol import EngineChunk, EngineRefused, EngineRequest
from tests.unit.test_deployments_ingress import KV, OP, FakeEngine, _Remote, _wire, auth

pytestmark = pytest.mark.slow  # the tiny model's tokenizer

CHAT = {"model": "test", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def strict(tiny_model_dir: Path) -> Any:
    from cluster.tenants import hash_key

    return _wire(
        tiny_model_dir,
        {
            "ingress": {
                "max_request_sequences": 8,
                "max_request_output_tokens": 128,
                "max_prompt_chars_per_token": 4,
                "allowed_vllm_xargs": ["my_processor"],
            },
            "tenants": {
                "key_hashes": {
                    hash_key("k-a"): "a",
                    hash_key("k-ctx"): "ctx",
                    hash_key("k-tok"): "tok",
                },
                "default": {"requests_per_second": None, "tokens_per_minute": None},
                "by_name": {
                    "ctx": {"max_context_tokens": 40, "tokens_per_minute": 100},
                    "tok": {"tokens_per_minute": 1000},
                },
            },
        },
    )


def test_a_requests_own_template_is_refused_unless_the_operator_trusts_them(strict: Any) -> None:
    client, pre, _ = strict
    r = client.post(
        "/v1/chat/completions", json=CHAT | {"chat_template": "{{ 'x' }}"}, headers=auth("k-a")
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"
    for name in ("chat_template", "tokenize", "messages", "return_dict"):
        r = client.post(
            "/v1/chat/completions",
            json=CHAT | {"chat_template_kwargs": {name: "{{ 'x' * 999999999 }}"}},
            headers=auth("k-a"),
        )
        assert r.status_code == 400, name
        assert r.json()["error"]["param"] == f"chat_template_kwargs.{name}"


def test_template_kwargs_reach_the_template_only_where_it_reads_them(strict: Any) -> None:
    client, pre, _ = strict
    assert client.post("/v1/chat/completions", json=CHAT, headers=auth("k-a")).status_code == 200
    plain = pre.seen[-1].prompt_token_ids
    r = client.post(
        "/v1/chat/completions",
        json=CHAT | {"chat_template_kwargs": {"no_such_var": "x" * 100}},
        headers=auth("k-a"),
    )
    assert r.status_code == 200 and pre.seen[-1].prompt_token_ids == plain  # dropped
    r = client.post(
        "/v1/chat/completions",
        json=CHAT | {"chat_template_kwargs": {"bos_token": "ZZZ "}},  # the template reads it
        headers=auth("k-a"),
    )
    assert r.status_code == 200 and pre.seen[-1].prompt_token_ids != plain


def test_a_trusted_template_renders_in_the_sandbox_within_its_budget(tiny_model_dir: Path) -> None:
    client, pre, _ = _wire(
        tiny_model_dir,
        {
            "ingress": {
                "auth": "none",
                "trust_request_chat_template": True,
                "render_timeout_s": 1.0,
            }
        },
    )
    core = client.core
    with client:  # one event loop for every request, as in a replica
        _trusted(client, core, pre)


def _trusted(client: Any, core: Any, pre: Any) -> None:
    own = "{% for m in messages %}[{{ m.role }}] {{ m.content }} {% endfor %}{{ bos_token }}"
    r = client.post("/v1/chat/completions", json=CHAT | {"chat_template": own})
    assert r.status_code == 200, r.text
    ids = list(pre.seen[-1].prompt_token_ids)
    text = core.tokenizer.decode(ids)
    assert "[user] hello there" in text and "<|user|>" not in text, text  # its own template
    loops = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"
    t = time.monotonic()
    r = client.post("/v1/chat/completions", json=CHAT | {"chat_template": loops})
    took = time.monotonic() - t
    assert r.status_code == 413 and r.json()["error"]["param"] == "chat_template"
    assert took < 30  # the budget is 1 s; bounded, not a timing ratio
    bomb = "{{ 'x' * 3000000000 }}"
    r = client.post("/v1/chat/completions", json=CHAT | {"chat_template": bomb})
    assert r.status_code == 400 and "memory" in r.json()["error"]["message"]
    r = client.post("/v1/chat/completions", json=CHAT | {"chat_template": own})
    assert r.status_code == 200  # a new child took the killed one's place
    stats = core.sandbox.stats()
    assert stats["killed"] == 1 and stats["started"] == 2, stats
    core.sandbox.kill()


def test_joint_bounds_hold_before_any_work(strict: Any) -> None:
    client, pre, _ = strict
    before = len(pre.seen)
    batch = {"model": "test", "prompt": ["a", "b", "c"], "n": 3, "max_tokens": 1}
    r = client.post("/v1/completions", json=batch, headers=auth("k-a"))
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"  # 9 sequences > 8
    r = client.post("/v1/completions", json=batch | {"n": 2, "max_tokens": 22}, headers=auth("k-a"))
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"  # 132 > 128
    assert "max_request_output_tokens" in r.json()["error"]["message"]
    assert len(pre.seen) == before  # refused before any prompt was tokenized or run
    r = client.post("/v1/completions", json=batch | {"n": 2, "max_tokens": 10}, headers=auth("k-a"))
    assert r.status_code == 200 and len(r.json()["choices"]) == 6


def test_extension_keys_and_client_ids_are_checked_over_http(strict: Any) -> None:
    client, pre, dec = strict
    body = {"model": "test", "prompt": "hi", "max_tokens": 1}
    r = client.post(
        "/v1/completions",
        json=body | {"vllm_xargs": {"kv_transfer_params": "x"}},
        headers=auth("k-a"),
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "vllm_xargs.kv_transfer_params"
    r = client.post(
        "/v1/completions", json=body | {"vllm_xargs": {"my_processor": 7}}, headers=auth("k-a")
    )
    assert r.status_code == 200
    assert dec.seen[-1].sampling.params["extra_args"] == {"my_processor": 7}
    r = client.post("/v1/completions", json=body | {"request_id": "x" * 500}, headers=auth("k-a"))
    assert r.status_code == 400 and r.json()["error"]["param"] == "request_id"


def test_a_prompt_no_context_could_hold_is_refused_before_it_is_tokenized(strict: Any) -> None:
    client, _, _ = strict
    core = client.core
    calls = []
    encode = core.tokenizer.encode

    def counting(text: str, add_special_tokens: bool) -> list[int]:
        calls.append(len(text))
        return encode(text, add_special_tokens)

    core.tokenizer.encode = counting
    try:
        # ctx: 40 tokens x 4 characters per token = 160 characters at most
        long = {"model": "test", "prompt": "w " * 200, "max_tokens": 1}
        r = client.post("/v1/completions", json=long, headers=auth("k-ctx"))
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        chat = CHAT | {"messages": [{"role": "user", "content": "w " * 200}]}
        r = client.post("/v1/chat/completions", json=chat, headers=auth("k-ctx"))
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        r = client.post("/tokenize", json={"prompt": "w " * 200}, headers=auth("k-ctx"))
        assert r.status_code == 400
        assert calls == []  # none of them reached the tokenizer
    finally:
        core.tokenizer.encode = encode


def test_a_prompt_refused_after_tokenizing_is_charged_to_its_tenant(strict: Any) -> None:
    """ctx: a 40-token context and 100 tokens a minute. A prompt of ``n`` > 40 tokens is
    refused for its context after it was tokenized: its ``n`` tokens are charged, so a
    request that needs more than the ``100 - n`` left waits (429) where it would have fit."""
    client, _, _ = strict
    core = client.core
    text = "w1 " * 30  # under the 160 characters refused before tokenizing
    n = len(core.tokenizer.encode(text, True))
    hi = len(core.tokenizer.encode("hi", True))
    assert 40 < n < 100
    frozen = time.monotonic() + 10**6  # later than any bucket's state: ctx's bucket is full
    clock, core.limiter.clock = core.limiter.clock, lambda: frozen  # no refill in the test
    try:
        _charged(client, text, hi)
    finally:
        core.limiter.clock = clock


def _charged(client: Any, text: str, hi: int) -> None:
    r = client.post(
        "/v1/completions", json={"model": "test", "prompt": text, "max_tokens": 1},
        headers=auth("k-ctx"),
    )  # fmt: skip
    assert r.status_code == 400 and "max_context_tokens" in r.json()["error"]["message"]
    fits_a_full_bucket = 100 - hi - 1
    r = client.post(
        "/v1/completions",
        json={"model": "test", "prompt": "hi", "max_tokens": fits_a_full_bucket},
        headers=auth("k-ctx"),
    )
    assert r.status_code == 429 and "tokens per minute" in r.json()["error"]["message"]


def test_tokenize_and_detokenize_are_charged(strict: Any) -> None:
    client, _, _ = strict
    core = client.core
    lim = core.limiter
    b = Bucket(1000 / 60.0, 1000.0)

    def left() -> float:
        return available(b, lim._tat.get(("tok", "tokens"), 0.0), time.monotonic())

    start = left()
    r = client.post("/tokenize", json={"prompt": "w1 w2 w3 " * 20}, headers=auth("k-tok"))
    assert r.status_code == 200
    n = r.json()["count"]
    assert start - left() == pytest.approx(n, abs=2)  # refill over the call: a token or two
    r = client.post("/detokenize", json={"tokens": list(range(5, 105))}, headers=auth("k-tok"))
    assert r.status_code == 200
    assert start - left() == pytest.approx(n + 100, abs=3)
    r = client.post("/detokenize", json={"tokens": [5] * 100_000}, headers=auth("k-tok"))
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


class HeldDecode(FakeEngine):
    """A decode engine whose streams give ``first`` chunks and then hold until released; a
    prefill engine that answers with its replica id (so its KV can be released) and refuses
    prompts that hold token ``poison``."""

    def __init__(self, role: str, first: int = 2, poison: int | None = None) -> None:
        super().__init__(role)
        self.first = first
        self.poison = poison
        self.held = asyncio.Event()
        self.cancelled = 0
        self.prefill = _Remote(self._held_prefill)
        self.decode = _Remote(self._held_decode)

    async def _held_prefill(self, req: EngineRequest) -> EngineChunk:
        self.seen.append(req)
        if self.poison is not None and self.poison in req.prompt_token_ids:
            raise EngineRefused("logit_bias is out of range", "logit_bias")
        return EngineChunk(
            "x", (9,), "length", len(req.prompt_token_ids), 0, 0.01,
            {**KV, "remote_request_id": req.request_id}, replica_id="prefill-1",
        )  # fmt: skip

    async def _held_decode(self, req: EngineRequest) -> AsyncIterator[EngineChunk]:
        self.seen.append(req)
        try:
            for i in range(self.first):
                yield EngineChunk(f"t{i}", (i,), None, len(req.prompt_token_ids), 0, 0.01)
            await asyncio.Event().wait()  # the rest never comes
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.held.set()


def _held(tiny_model_dir: Path, poison: int | None = None) -> Any:
    from cluster.tenants import hash_key
    from deployments.config import AppConfig
    from deployments.ingress import IngressCore

    cfg = AppConfig.model_validate(
        {
            "model": {"path": str(tiny_model_dir), "build_preset": None},
            "index": {"backend": "none"},
            "ingress": {"warm_up": False},
            "tenants": {
                "key_hashes": {hash_key("k-v"): "v"},
                "default": {"requests_per_second": None, "tokens_per_minute": 6000},
            },
        }
    ).model_dump(mode="json")
    pre, dec = HeldDecode("prefill", poison=poison), HeldDecode("decode")
    core = IngressCore(cfg, pre, dec, app_name="held-unit")
    core.limiter.clock = lambda: NOW  # frozen: the buckets' arithmetic exact
    return core, pre, dec


NOW = 5000.0


def _drive(core: Any, path: str, body: dict[str, Any], chunks_before_leaving: int) -> Any:
    """The ingress app (its middleware included) over ASGI: the client sends ``body``, reads
    ``chunks_before_leaving`` body chunks of the response, then disconnects. Returns what
    it received (status, chunks)."""
    app = FastAPI()
    app.exception_handlers.update(api.exception_handlers)
    app.add_middleware(BodyGuard)
    app.add_middleware(AuthGuard, gate=core.gate)

    @app.post("/v1/completions")
    async def comp(request: Request, b: CompletionRequest) -> Any:
        return await core.complete(request, b)

    raw = json.dumps(body).encode()
    got: dict[str, Any] = {"status": None, "chunks": []}

    async def run() -> None:
        gone = asyncio.Event()
        sent_body = False

        async def receive() -> dict[str, Any]:
            nonlocal sent_body
            if not sent_body:
                sent_body = True
                return {"type": "http.request", "body": raw, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(msg: dict[str, Any]) -> None:
            if msg["type"] == "http.response.start":
                got["status"] = msg["status"]
            elif msg.get("body"):
                got["chunks"].append(msg["body"])
                if len(got["chunks"]) >= chunks_before_leaving:
                    gone.set()

        scope = {
            "type": "http",
            "method": "POST",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "headers": [
                (b"content-type", b"application/json"),
                (b"authorization", b"Bearer k-v"),
                (b"content-length", str(len(raw)).encode()),
            ],
            "client": ("10.9.9.9", 1),
            "server": ("test", 80),
            "scheme": "http",
            "http_version": "1.1",
            "asgi": {"version": "3.0"},
        }
        await asyncio.wait_for(app(scope, receive, send), 30)
        await asyncio.sleep(0.05)  # the give-back task the close scheduled
        got["tat"] = core.limiter._tat.get(("v", "tokens"), 0.0)

    asyncio.run(run())
    return got


def test_a_client_that_leaves_mid_stream_gets_its_unused_reservation_back(
    tiny_model_dir: Path,
) -> None:
    core, pre, dec = _held(tiny_model_dir)
    body = {"model": "test", "prompt": "hello there", "max_tokens": 1000, "stream": True}
    got = _drive(core, "/v1/completions", body, chunks_before_leaving=2)
    assert got["status"] == 200 and len(got["chunks"]) >= 2
    prompt = len(pre.seen[-1].prompt_token_ids)
    b = Bucket(6000 / 60.0, 6000.0)
    used = 6000.0 - available(b, got["tat"], NOW)
    # charged the prompt and the two tokens that reached the client, not the 1,000 reserved
    assert used == pytest.approx(prompt + 2)
    assert core.reserved_tokens == {}  # nothing left reserved
    assert dec.cancelled == 1  # the decode stream was ended (its engine aborts the request)


def test_a_failed_sibling_in_a_batch_gives_back_every_reservation_and_kv(
    tiny_model_dir: Path,
) -> None:
    core, pre, dec = _held(tiny_model_dir, poison=None)
    poison = core.tokenizer.encode("zebra", False)[0]
    pre.poison = poison
    body = {"model": "test", "prompt": ["hello there", "zebra", "good day"], "max_tokens": 900}
    got = _drive(core, "/v1/completions", body, chunks_before_leaving=1)
    assert got["status"] == 400 and b"logit_bias" in got["chunks"][0]
    prompts = sum(len(q.prompt_token_ids) for q in pre.seen)
    used = 6000.0 - available(Bucket(100.0, 6000.0), got["tat"], NOW)
    assert used == pytest.approx(prompts)  # the 3 x 900 reserved all came back
    assert core.reserved_tokens == {}
    # the two prefills that ran hold KV for a decode that will never come: released now
    released = sorted(r.kv_transfer_params["remote_request_id"] for r in pre.released)
    ran = sorted(q.request_id for q in pre.seen if poison not in q.prompt_token_ids)
    assert released == ran and all(r.route.pin == "prefill-1" for r in pre.released)
    assert dec.seen == []  # no decode ran


def test_readiness_probes_share_one_check_per_period(tiny_model_dir: Path) -> None:
    from deployments.config import AppConfig
    from deployments.ingress import IngressCore

    cfg = AppConfig.model_validate(
        {
            "model": {"path": str(tiny_model_dir), "build_preset": None},
            "index": {"backend": "none"},
            "ingress": {"auth": "none", "warm_up": False, "health_cache_s": 60},
        }
    ).model_dump(mode="json")
    pre, dec = FakeEngine("prefill"), FakeEngine("decode")
    calls = {"n": 0}
    ready = pre.ready.fn

    async def counted() -> bool:
        calls["n"] += 1
        await asyncio.sleep(0.01)
        return bool(await ready())

    pre.ready = _Remote(counted)
    core = IngressCore(cfg, pre, dec, app_name="health-unit")

    async def run() -> list[int]:
        rs = await asyncio.gather(*(core.health() for _ in range(50)))
        rs += [await core.health() for _ in range(50)]
        return [r.status_code for r in rs]

    assert asyncio.run(run()) == [200] * 100
    assert calls["n"] == 1


def test_stats_are_the_operators_and_reset_is_a_post(strict: Any) -> None:
    client, _, _ = strict
    assert client.get("/v1/pdserve/stats", headers=auth("k-a")).status_code == 403
    assert client.get("/v1/pdserve/stats").status_code == 401
    s = client.get("/v1/pdserve/stats", headers=OP).json()
    assert s["ingress"]["auth"]["mode"] == "keys"
    assert s["ingress"]["auth"]["refused"]["wrong_kind_of_key"] >= 1
    assert client.post("/v1/pdserve/stats/reset", headers=OP).status_code == 200


def test_logprobs_merge_in_place() -> None:
    from openai.types.completion_choice import Logprobs

    from deployments.ingress.respond import merge_logprobs as _merge_logprobs

    acc: list[int] = [1]
    assert _merge_logprobs(acc, [2, 3]) is acc and acc == [1, 2, 3]
    lp = Logprobs(tokens=["a"], token_logprobs=[-1.0], top_logprobs=None, text_offset=[0])
    same = _merge_logprobs(lp, Logprobs(tokens=["b"], token_logprobs=[-2.0], text_offset=[1]))
    assert same is lp and lp.tokens == ["a", "b"] and lp.text_offset == [0, 1]


def test_tokenizing_a_conversation_renders_it_off_the_loop_and_charges_it(strict: Any) -> None:
    client, _, _ = strict
    msgs = [{"role": "user", "content": "find it " * 300}]  # long: the preparation threads
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    r = client.post("/tokenize", json={"messages": msgs, "tools": tools}, headers=auth("k-tok"))
    assert r.status_code == 200, r.text
    with_tools = r.json()["count"]
    r = client.post("/tokenize", json={"messages": msgs}, headers=auth("k-tok"))
    assert r.status_code == 200 and r.json()["count"] < with_tools  # tools rendered
    r = client.post(
        "/tokenize",
        json={"messages": msgs, "chat_template_kwargs": {"tokenize": True}},
        headers=auth("k-tok"),
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "chat_template_kwargs.tokenize"
