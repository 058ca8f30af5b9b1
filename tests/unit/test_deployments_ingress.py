"""The ingress logic over fake engine handles (no Ray, no vLLM): auth and tenant salts, the
prefill -> decode hand-off of kv_transfer_params, SSE framing, usage, readiness."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from ray.exceptions import ActorDiedError

from deployments.engine.counters import _count_failed_transfers
from deployments.ingress.openai_requests import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from deployments.ingress.responses_api import ResponsesRequest
from deployments.protocol import EngineChunk, EngineRefused, EngineRequest

pytestmark = pytest.mark.slow  # builds the tiny model's tokenizer once per session

KV = {"remote_engine_id": "e1", "remote_block_ids": [[1, 2]], "do_remote_prefill": True}


class _Remote:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def remote(self, *a: Any) -> Any:
        return self.fn(*a)


class FakeEngine:
    """Stands in for a Serve handle of one engine replica."""

    def __init__(self, role: str, ready: bool = True) -> None:
        self.role = role
        self.is_ready = ready
        self.fail_after: int | None = None  # raise after this many chunks (an engine failure)
        self.refuse: str | None = None  # refuse requests' parameters, naming this field
        self.gate: Any = None  # an asyncio.Event the prefill waits on (a slow engine)
        self.gone = 0  # the next calls find their replica dead (Ray's ActorDiedError)
        self.dies_after: int | None = None  # the replica dies after this many chunks
        self.seen: list[EngineRequest] = []
        self.released: list[EngineRequest] = []
        self.prefill = _Remote(self._prefill)
        self.release_kv = _Remote(self._release_kv)
        self.decode = _Remote(self._decode)
        self.ready = _Remote(self._ready)
        self.stats = _Remote(self._stats)

    def options(self, **_: Any) -> FakeEngine:
        return self

    def _dead(self) -> bool:
        if self.gone:
            self.gone -= 1
            return True
        return False

    async def _prefill(self, req: EngineRequest) -> EngineChunk:
        self.seen.append(req)
        if self._dead():
            raise ActorDiedError()
        if self.gate is not None:
            await self.gate.wait()
        if self.refuse:
            raise EngineRefused(f"{self.refuse} is out of range", self.refuse)
        if self.fail_after == 0:
            raise RuntimeError("engine refused the request")
        return EngineChunk(
            "x", (9,), "length", len(req.prompt_token_ids), 128, 0.01, KV, replica_id=self.role
        )

    async def _decode(self, req: EngineRequest) -> AsyncIterator[EngineChunk]:
        self.seen.append(req)
        if self._dead():
            raise ActorDiedError()
        n = req.sampling.max_tokens
        for i in range(n):
            if self.dies_after is not None and i >= self.dies_after:
                raise ActorDiedError()
            for seq in range(req.sampling.n):  # the n sequences' chunks interleave
                if self.fail_after is not None and i >= self.fail_after:
                    raise RuntimeError("decode engine died")
                last = "length" if i == n - 1 else None
                yield EngineChunk(
                    f"t{i}",
                    (i,),
                    last,
                    len(req.prompt_token_ids),
                    0,
                    0.02,
                    index=seq,
                    replica_id=self.role,
                )

    async def _release_kv(self, req: EngineRequest) -> bool:
        self.released.append(req)
        return True

    async def _ready(self) -> bool:
        if not self.is_ready:
            raise RuntimeError("starting")
        return True

    async def _stats(self) -> dict[str, Any]:
        return {"role": self.role}


@pytest.fixture(scope="module")
def wired(tiny_model_dir: Path) -> Any:
    return _wire(tiny_model_dir, {"ingress": {"api_keys": {"ka": "alice", "kb": "bob"}}})


def _wire(
    tiny_model_dir: Path,
    extra: dict[str, Any],
    engines: tuple[Any, Any] | None = None,
    app_name: str = "pdserve",
) -> Any:
    """A test client over an ingress on fake engine handles (``engines``: prefill and
    decode, :class:`FakeEngine` by default)."""
    from cluster.tenants import hash_key
    from deployments.config import AppConfig
    from deployments.ingress import IngressCore
    from deployments.ingress.auth import AuthGuard
    from deployments.ingress.http import api
    from deployments.ingress.http_guard import BodyGuard

    # no replica directories behind the fakes: readiness without the pair warm-up; no
    # cached readiness (the tests flip the fakes' state and probe at once)
    extra = {
        **extra,
        "ingress": {"warm_up": False, "health_cache_s": 0, **extra.get("ingress", {})},
        # no rate limits unless a test sets some (said explicitly: the default limits all)
        "tenants": {
            "operator_key_hashes": [hash_key("op-key")],
            "default": {"requests_per_second": None, "tokens_per_minute": None},
            **extra.get("tenants", {}),
        },
    }

    cfg = AppConfig.model_validate(
        {
            "model": {"path": str(tiny_model_dir), "build_preset": None},
            "index": {"backend": "none"},
            **extra,
        }
    ).model_dump(mode="json")
    pre, dec = engines or (FakeEngine("prefill"), FakeEngine("decode"))
    core = IngressCore(cfg, pre, dec, app_name=app_name)
    app = FastAPI()
    app.exception_handlers.update(api.exception_handlers)
    ing = AppConfig.model_validate(cfg).ingress
    app.add_middleware(BodyGuard, max_body_bytes=ing.max_body_bytes, max_json_depth=64)
    app.add_middleware(AuthGuard, gate=core.gate)

    @app.post("/v1/completions")
    async def comp(request: Request, body: CompletionRequest) -> Any:
        return await core.complete(request, body)

    @app.post("/v1/chat/completions")
    async def chat(request: Request, body: ChatCompletionRequest) -> Any:
        return await core.complete(request, body)

    @app.post("/v1/responses")
    async def responses(request: Request, body: ResponsesRequest) -> Any:
        return await core.complete(request, body)

    @app.get("/health")
    async def health() -> Any:
        return await core.health()

    @app.post("/tokenize")
    async def tokenize(
        request: Request, body: TokenizeCompletionRequest | TokenizeChatRequest
    ) -> Any:
        return await core.tokenize(request, body)

    @app.post("/detokenize")
    async def detokenize(request: Request, body: DetokenizeRequest) -> Any:
        return await core.detokenize(request, body)

    @app.post("/v1/pdserve/route")
    async def route(request: Request, body: CompletionRequest, tenant: str = "anonymous") -> Any:
        return await core.explain(request, body, tenant)

    @app.get("/v1/pdserve/stats")
    async def stats() -> Any:
        return await core.stats()

    @app.post("/v1/pdserve/stats/reset")
    async def stats_reset() -> Any:
        return await core.stats(reset=True)

    client = TestClient(app)
    client.core = core  # type: ignore[attr-defined]
    return client, pre, dec


def auth(k: str = "ka") -> dict[str, str]:
    return {"Authorization": f"Bearer {k}"}


#: the operator's key (every wired app has it): /v1/pdserve/* only
OP = auth("op-key")


def test_kv_params_go_from_prefill_to_decode_with_the_tenant_salt(wired: Any) -> None:
    client, pre, dec = wired
    r = client.post(
        "/v1/completions",
        json={"model": "test", "prompt": "hello", "max_tokens": 3},
        headers=auth("kb"),
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["text"] == "t0t1t2"
    assert body["usage"]["completion_tokens"] == 3
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 128  # prefill's hits
    assert pre.seen[-1].cache_salt == "bob" and pre.seen[-1].kv_transfer_params is None
    assert dec.seen[-1].kv_transfer_params == KV
    assert dec.seen[-1].prompt_token_ids == pre.seen[-1].prompt_token_ids


def test_route_hint_and_phase_timings(wired: Any) -> None:
    client, pre, dec = wired
    client.post("/v1/pdserve/stats/reset", headers=OP)
    r = client.post(
        "/v1/completions",
        json={"model": "test", "prompt": "hello there", "max_tokens": 300},
        headers=auth(),
    )
    assert r.status_code == 200, r.text
    hint = pre.seen[-1].route
    assert hint is not None and hint.prompt_tokens == len(pre.seen[-1].prompt_token_ids)
    assert hint.matches is None  # index.backend: none -> the router routes by load
    assert hint.expected_output_tokens == 64  # min(max_tokens, routing.expected_output_tokens)
    assert dec.seen[-1].route is not None and dec.seen[-1].route.expected_output_tokens == 300
    s = client.get("/v1/pdserve/stats", headers=OP).json()
    phases = s["ingress"]["phases_s"]
    assert set(phases) == {
        "prepare",
        "route",
        "prefill",
        "prefill_engine",
        "decode_first",
        "decode_first_engine",
        "decode",
        "respond",
    }
    assert all(p["n"] == 1 for p in phases.values()), phases
    # the engines' own time is the stand-ins' engine_s, not the ingress's overhead
    assert phases["prefill_engine"]["max"] == pytest.approx(0.01)  # FakeEngine._prefill's
    assert phases["decode_first_engine"]["max"] == pytest.approx(0.02)  # its first chunk's
    assert s["ingress"]["overhead_s"]["n"] == 1
    assert s["index"]["backend"] == "none" and s["router"]["policy"] == "prefix_load"


def test_sse_stream_with_usage_and_done(wired: Any) -> None:
    client, _, _ = wired
    body = {
        "model": "test",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with client.stream("POST", "/v1/chat/completions", json=body, headers=auth()) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "t0"}
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 2
    # the usage chunk names the replicas that served it, as a whole response's field does
    assert chunks[-1]["pdserve"]["prefill_replica"] == "prefill"
    assert chunks[-1]["pdserve"]["decode_replica"] == "decode"
    assert all("pdserve" not in c for c in chunks[:-1])


def test_auth_and_model_errors(wired: Any) -> None:
    client, _, _ = wired
    ok = {"model": "test", "prompt": "hello", "max_tokens": 1}
    assert client.post("/v1/completions", json=ok).status_code == 401
    assert client.post("/v1/completions", json=ok, headers=auth("nope")).status_code == 401
    r = client.post("/v1/completions", json={**ok, "model": "other"}, headers=auth())
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = client.post("/v1/completions", json={**ok, "temperature": -1}, headers=auth())
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    r = client.post("/v1/completions", json={**ok, "prompt": None}, headers=auth())
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_health_is_ready_only_when_both_engines_are(wired: Any) -> None:
    client, pre, dec = wired
    assert client.get("/health").status_code == 200
    dec.is_ready = False
    try:
        r = client.get("/health")
        assert r.status_code == 503 and r.json()["engines"]["prefill"] is True
    finally:
        dec.is_ready = True


def test_failed_transfers_are_counted_from_connector_stats() -> None:
    assert _count_failed_transfers({"NixlConnector": {"num_failed_transfers": [1, 1]}}) == 2
    assert _count_failed_transfers({"num_failed_transfers": 3, "other": []}) == 3
    assert _count_failed_transfers(None) == 0


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"seed": 2**64}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"prompt": [5, 10**9]}, "prompt"),
        ({"prompt": [5, -1]}, "prompt"),
    ],
)
def test_input_the_engine_would_fail_on_is_a_400(
    wired: Any, body: dict[str, Any], param: str
) -> None:
    client, pre, _ = wired
    n = len(pre.seen)
    r = client.post(
        "/v1/completions", headers=auth(), json={"model": "test", "prompt": "hi", **body}
    )
    assert r.status_code == 400, r.text
    assert param in r.json()["error"]["message"]
    assert len(pre.seen) == n  # refused before any engine saw it


def test_engine_failures_are_gateway_errors_and_streams_stay_well_formed(wired: Any) -> None:
    client, pre, dec = wired
    try:
        pre.fail_after = 0
        r = client.post("/v1/completions", headers=auth(), json={"model": "test", "prompt": "hi"})
        assert r.status_code == 502 and "prefill failed" in r.json()["error"]["message"]
        pre.fail_after = None
        dec.fail_after = 2
        r = client.post(
            "/v1/completions",
            headers=auth(),
            json={"model": "test", "prompt": "hi", "max_tokens": 5},
        )
        assert r.status_code == 502 and "decode failed" in r.json()["error"]["message"]
        with client.stream(
            "POST",
            "/v1/completions",
            headers=auth(),
            json={"model": "test", "prompt": "hi", "max_tokens": 5, "stream": True},
        ) as s:
            lines = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        events = [json.loads(ln[6:]) for ln in lines[:-1]]
        assert any("error" in e and "decode failed" in e["error"]["message"] for e in events)
    finally:
        pre.fail_after = dec.fail_after = None


def retries(client: Any) -> dict[str, int]:
    return dict(client.get("/v1/pdserve/stats", headers=OP).json()["ingress"]["replica_retries"])


def test_a_dead_replica_is_retried_elsewhere_only_before_the_client_got_anything(
    wired: Any,
) -> None:
    """A prefill whose replica died is sent again (another prefill replica: Serve's router
    drops the dead one); a decode whose replica died before its first chunk goes to another
    decode replica that computes the prompt itself (no KV params: the dead one may have
    freed them). Once a chunk reached the client the stream migrates (its own tests:
    ``test_migration.py``); with migration off it ends with an error event."""
    client, pre, dec = wired
    body = {"model": "test", "prompt": "hi", "max_tokens": 4}
    try:
        before = retries(client)
        pre.gone = 1
        r = client.post("/v1/completions", headers=auth(), json=body)
        assert r.status_code == 200, r.text
        first, again = pre.seen[-2:]
        assert again.request_id == f"{first.request_id}-retry1"
        assert dec.seen[-1].kv_transfer_params is not None  # the retried prefill's KV
        dec.gone = 1
        r = client.post("/v1/completions", headers=auth(), json=body | {"stream": True})
        lines = [ln for ln in r.text.splitlines() if ln.startswith("data: ")]
        assert r.status_code == 200 and lines[-1] == "data: [DONE]"
        assert not any('"error"' in ln for ln in lines)
        chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "t0t1t2t3"
        dead, again = dec.seen[-2:]
        assert dead.kv_transfer_params is not None and again.kv_transfer_params is None
        assert again.request_id == f"{dead.request_id}-retry1"
        assert retries(client) == {"prefill": before["prefill"] + 1, "decode": before["decode"] + 1}
        dec.gone = 2  # one retry (the default), then a gateway error
        r = client.post("/v1/completions", headers=auth(), json=body)
        assert r.status_code == 502 and "decode failed" in r.json()["error"]["message"]
        n_seen = len(dec.seen)
        client.core.reconfigure({"migration": {"migration_limit": 0}})
        dec.dies_after = 2  # mid-stream, migration off: the stream ends with an error
        r = client.post("/v1/completions", headers=auth(), json=body | {"stream": True})
        lines = [ln for ln in r.text.splitlines() if ln.startswith("data: ")]
        assert lines[-1] == "data: [DONE]" and '"error"' in lines[-2]
        assert "migration is off" in lines[-2]
        assert len(dec.seen) == n_seen + 1  # not sent again
        assert retries(client)["decode"] == before["decode"] + 2
    finally:
        pre.gone = dec.gone = 0
        dec.dies_after = None
        client.core.reconfigure({"migration": {}})


def test_engine_refusals_are_400s_naming_the_field(wired: Any) -> None:
    client, pre, _ = wired
    try:
        pre.refuse = "logprobs"
        r = client.post(
            "/v1/completions", headers=auth(), json={"model": "test", "prompt": "hi", "logprobs": 5}
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
    finally:
        pre.refuse = None


def test_a_stream_that_fails_before_its_first_token_is_an_http_error(wired: Any) -> None:
    client, _, dec = wired
    try:
        dec.fail_after = 0
        body = {"model": "test", "prompt": "hi", "max_tokens": 3, "stream": True}
        r = client.post("/v1/completions", headers=auth(), json=body)
        assert r.status_code == 502 and "decode failed" in r.json()["error"]["message"]
    finally:
        dec.fail_after = None


def test_n_choices_echo_and_request_id(wired: Any) -> None:
    client, _, dec = wired
    body = {
        "model": "test",
        "prompt": "hello",
        "max_tokens": 2,
        "n": 2,
        "echo": True,
        "request_id": "abc",
        "return_token_ids": True,
    }
    r = client.post("/v1/completions", headers=auth(), json=body).json()
    assert r["id"] == "cmpl-abc"
    assert dec.seen[-1].request_id != "cmpl-abc"  # the engines' id stays unique
    assert [c["index"] for c in r["choices"]] == [0, 1]
    assert all(c["text"] == "hellot0t1" for c in r["choices"])  # the prompt, then the output
    assert r["choices"][0]["token_ids"] == [0, 1] and r["choices"][0]["prompt_token_ids"]
    assert r["usage"]["completion_tokens"] == 4
    with client.stream(
        "POST",
        "/v1/chat/completions",
        headers=auth(),
        json={
            "model": "test",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
            "n": 2,
            "stream": True,
        },
    ) as s:
        chunks = [json.loads(ln[6:]) for ln in s.iter_lines() if ln.startswith("data: {")]
    firsts = [c["choices"][0] for c in chunks if c["choices"][0]["delta"].get("role")]
    assert sorted(c["index"] for c in firsts) == [0, 1]  # each choice opens with the role


def test_a_batch_of_prompts_is_one_request_per_prompt(wired: Any) -> None:
    client, pre, dec = wired
    n_pre = len(pre.seen)
    body = {"model": "test", "prompt": [[4, 8, 9, 10], [5, 6, 7]], "max_tokens": 2, "n": 2}
    r = client.post("/v1/completions", headers=auth(), json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    # prompt k owns choices k*n .. k*n+n-1, as vLLM numbers them
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert all(c["text"] == "t0t1" for c in out["choices"])
    seen = pre.seen[n_pre:]
    assert [x.prompt_token_ids for x in seen] == [(4, 8, 9, 10), (5, 6, 7)]  # a prefill each
    assert seen[0].request_id != seen[1].request_id
    assert out["usage"]["prompt_tokens"] == 7
    assert out["usage"]["completion_tokens"] == 8
    assert len(out["pdserve"]["prefill_replicas"]) == 2
    with client.stream(
        "POST", "/v1/completions", headers=auth(), json={**body, "stream": True}
    ) as st:
        chunks = [json.loads(ln[6:]) for ln in st.iter_lines() if ln.startswith("data: {")]
    finished = sorted(c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"])
    assert finished == [0, 1, 2, 3]
    echo = client.post(
        "/v1/completions",
        headers=auth(),
        json={"model": "test", "prompt": ["ab", "cd"], "max_tokens": 0, "echo": True},
    ).json()
    assert [c["text"] for c in echo["choices"]] == ["ab", "cd"]
    assert echo["usage"]["completion_tokens"] == 0


@pytest.fixture(scope="module")
def tenanted(tiny_model_dir: Path) -> Any:
    from cluster.tenants import hash_key

    return _wire(
        tiny_model_dir,
        {
            "tenants": {
                "key_hashes": {
                    hash_key("k-alice"): "alice",
                    hash_key("k-bob"): "bob",
                    hash_key("k-carol"): "carol",
                    hash_key("k-dave"): "dave",
                    hash_key("k-erin"): "erin",
                },
                "default": {"max_tokens": 50, "max_context_tokens": 40},
                "by_name": {
                    "alice": {"requests_per_second": 0.001, "burst_requests": 2},
                    "bob": {"tokens_per_minute": 100},
                    "carol": {"cache_group": "acme"},
                    "dave": {"cache_group": "acme", "max_tokens": 8},
                    "erin": {"requests_per_second": 0.001, "burst_requests": 1},
                },
            }
        },
    )


def test_hashed_keys_and_401_with_a_challenge(tenanted: Any) -> None:
    client, pre, _ = tenanted
    ok = {"model": "test", "prompt": "hello", "max_tokens": 1}
    r = client.post("/v1/completions", json=ok, headers=auth("k-nobody"))
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert r.json()["error"]["type"] == "authentication_error"
    assert (
        client.post("/v1/completions", json=ok, headers={"Authorization": "k-bob"}).status_code
        == 401
    )
    r = client.post("/v1/completions", json=ok, headers=auth("k-carol"))
    assert r.status_code == 200, r.text
    assert client.get("/health").status_code == 200  # stays open


def test_requests_per_second_is_a_429_with_retry_after(tenanted: Any) -> None:
    client, _, _ = tenanted
    ok = {"model": "test", "prompt": "hello", "max_tokens": 1}
    codes = [client.post("/v1/completions", json=ok, headers=auth("k-alice")) for _ in range(3)]
    assert [r.status_code for r in codes] == [200, 200, 429]
    r = codes[-1]
    assert 900 < int(r.headers["retry-after"]) <= 1000  # one request per 1000 s
    assert r.json()["error"]["type"] == "rate_limit_error"
    assert r.json()["error"]["code"] == "rate_limit_exceeded"
    # other tenants are not limited by alice's bucket
    assert client.post("/v1/completions", json=ok, headers=auth("k-carol")).status_code == 200


def test_tokens_per_minute_reserves_max_tokens_and_gives_back_the_unused(tenanted: Any) -> None:
    client, _, _ = tenanted
    # bob: 100 tokens per minute; prompt ~2 tokens + max_tokens 40 reserved, 3 produced
    body = {"model": "test", "prompt": "hello", "max_tokens": 40, "stop": ["t2"]}
    r = client.post("/v1/completions", json={**body, "max_tokens": 3}, headers=auth("k-bob"))
    assert r.status_code == 200
    for _ in range(3):  # each would reserve 42; after a refund of 0 two fit, not three
        r = client.post("/v1/completions", json=body, headers=auth("k-bob"))
        if r.status_code == 429:
            break
    else:
        pytest.fail("bob's tokens per minute never bound")
    assert (
        int(r.headers["retry-after"]) >= 1 and "tokens per minute" in r.json()["error"]["message"]
    )
    big = client.post("/v1/completions", json={**body, "max_tokens": 120}, headers=auth("k-bob"))
    # more than the whole bucket: no wait helps, so a 400 naming the field
    assert big.status_code == 400 and big.json()["error"]["param"] == "max_tokens"


def test_tenant_caps_on_context_and_max_tokens(tenanted: Any) -> None:
    client, pre, _ = tenanted
    long = {"model": "test", "prompt": " ".join(f"w{i}x" for i in range(60)), "max_tokens": 1}
    r = client.post("/v1/completions", json=long, headers=auth("k-carol"))
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert "max_context_tokens of 40" in r.json()["error"]["message"]
    r = client.post(
        "/v1/completions",
        json={"model": "test", "prompt": "hi", "max_tokens": 9},
        headers=auth("k-dave"),
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = client.post(
        "/v1/chat/completions",
        json={"model": "test", "messages": [{"role": "user", "content": "hi"}]},
        headers=auth("k-dave"),
    )
    assert r.status_code == 200 and pre.seen[-1].sampling.max_tokens == 8  # default under the cap


def test_cache_groups_share_a_salt_and_other_tenants_do_not(tenanted: Any) -> None:
    client, pre, _ = tenanted
    salts = {}
    for who in ("k-carol", "k-dave", "k-bob"):
        r = client.post(
            "/v1/completions",
            json={"model": "test", "prompt": "hello", "max_tokens": 1},
            headers=auth(who),
        )
        assert r.status_code in (200, 429)
        if r.status_code == 200:
            salts[who] = pre.seen[-1].cache_salt
    assert salts["k-carol"] == salts["k-dave"] == "@acme"
    if "k-bob" in salts:
        assert salts["k-bob"] == "bob"
    r = client.post(
        "/v1/completions",
        json={"model": "test", "prompt": "hello", "max_tokens": 1, "cache_salt": "s1"},
        headers=auth("k-carol"),
    )
    assert r.status_code == 200 and pre.seen[-1].cache_salt == "@acme:s1"


@pytest.mark.parametrize(
    "patch, param",
    [
        ({"stream": "yes"}, "stream"),
        ({"max_tokens": "5"}, "max_tokens"),
        ({"max_tokens": 2.0}, "max_tokens"),
        ({"temperature": "0.5"}, "temperature"),
        ({"echo": 1}, "echo"),
        ({"n": True}, "n"),
        (
            {"stream": True, "stream_options": {"include_usage": "true"}},
            "stream_options.include_usage",
        ),
        ({"logit_bias": {"5": "1"}}, "logit_bias.5"),
    ],
)
def test_no_silent_coercion(wired: Any, patch: dict[str, Any], param: str) -> None:
    client, _, _ = wired
    r = client.post(
        "/v1/completions",
        json={"model": "test", "prompt": "hello", "max_tokens": 1, **patch},
        headers=auth(),
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


_J = {"content-type": "application/json"}


@pytest.mark.parametrize(
    "content, headers, status, says",
    [
        (b'{"prompt": "x", ', _J, 400, "not valid JSON at character 16"),
        (b'{"prompt": "\xff\xfe", "max_tokens": 1}', _J, 400, "not valid UTF-8"),
        (b'{"prompt": "x", "max_tokens": 1}', {"content-type": "text/plain"}, 415, "text/plain"),
        (b'{"prompt": "x", "max_tokens": 1}', {}, 415, "application/json"),
        (b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", _J, 400, "nested deeper than 64"),
        (b"[1, 2]", _J, 400, "must be a JSON object (got list)"),
        (b"", _J, 400, "body is empty"),
        (b'{"prompt": "x", "temperature": NaN, "max_tokens": 1}', _J, 400, "finite"),
        (b'{"prompt": "\\ud800", "max_tokens": 1}', _J, 400, "not valid JSON"),
        (b'{"prompt": "x", "max_tokens": 1000000000000000000000}', _J, 400, "max_request_output"),
        (b'{"prompt": "x", "max_tokens": 0}', _J, 400, "at least 1"),
        (b'{"prompt": [], "max_tokens": 1}', _J, 400, "the prompt is empty"),
        (b'{"prompt": [1000000000], "max_tokens": 1}', _J, 400, "outside the vocabulary"),
        (b'{"prompt": "x", "max_tokens": 1, "pad": "' + b"a" * 40_000 + b'"}', _J, 413, "limit"),
    ],
)
def test_malformed_bodies_get_a_clear_4xx(
    small_body_limit: Any, content: bytes, headers: dict[str, str], status: int, says: str
) -> None:
    client, _, _ = small_body_limit
    r = client.post("/v1/completions", content=content, headers={**headers, **auth()})
    assert r.status_code == status, r.text
    assert says in r.json()["error"]["message"]


@pytest.fixture(scope="module")
def small_body_limit(tiny_model_dir: Path) -> Any:
    return _wire(
        tiny_model_dir,
        {"ingress": {"api_keys": {"ka": "alice"}, "max_body_bytes": 32 * 1024}},
    )


def test_chat_roles_and_content_parts_are_checked(wired: Any) -> None:
    client, _, _ = wired
    for msgs, param in (
        ([{"role": "bogus", "content": "x"}], "messages.0.role"),
        ([{"role": "user", "content": "x"}, {"role": 5, "content": "x"}], "messages.1.role"),
        ([{"role": "user", "content": [{"type": "text", "text": 5}]}], "messages.0.content"),
        ([], "messages"),
        (None, None),  # vLLM's own validators would raise TypeError (a 500) on it
    ):
        r = client.post(
            "/v1/chat/completions",
            json={"model": "test", "messages": msgs, "max_tokens": 1},
            headers=auth(),
        )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.text


def test_json_depth() -> None:
    from deployments.ingress.http_guard import json_depth

    assert json_depth(1) == 0 and json_depth([]) == 1 and json_depth({"a": [1, {"b": []}]}) == 4


def test_explaining_a_route_is_the_operators_and_takes_nothing_from_the_tenant(
    tenanted: Any,
) -> None:
    client, _, _ = tenanted
    body = {"model": "test", "prompt": "hello", "max_tokens": 1}
    route = "/v1/pdserve/route"
    r = client.post(route, json=body, headers=auth("k-erin"))
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    for _ in range(3):
        r = client.post(route, json=body, headers=OP, params={"tenant": "erin"})
        assert r.status_code == 200 and r.json()["tenant"] == "erin"
    r = client.post(route, json=body, headers=OP, params={"tenant": "no/such"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tenant"
    # the operator's explanations took nothing: erin's burst of one request is intact
    # (her 403 above was refused before her bucket was charged)
    assert client.post("/v1/completions", json=body, headers=auth("k-erin")).status_code == 200
    assert client.post("/v1/completions", json=body, headers=auth("k-erin")).status_code == 429


@pytest.fixture(scope="module")
def bounded(tiny_model_dir: Path) -> Any:
    return _wire(
        tiny_model_dir,
        {
            "ingress": {
                "api_keys": {"ka": "alice"},
                "max_queued_requests_per_replica": 3,
                "overload_retry_after_s": 2,
            }
        },
    )


def test_over_the_queue_bound_a_503_at_once_and_the_admitted_all_complete(bounded: Any) -> None:
    """The prefill engine is stuck: 3 requests are admitted and wait; the next 4 get 503 with
    Retry-After at once (while the 3 still wait); released, the 3 complete, and a new request
    is admitted again."""
    import asyncio

    import httpx

    client, pre, _ = bounded

    async def run() -> tuple[list[int], list[httpx.Response], int]:
        pre.gate = asyncio.Event()
        transport = httpx.ASGITransport(app=client.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:

            async def one(i: int) -> httpx.Response:
                body = {"model": "test", "prompt": f"request {i}", "max_tokens": 2}
                return await c.post("/v1/completions", json=body, headers=auth())

            admitted = [asyncio.create_task(one(i)) for i in range(3)]
            while len(pre.seen) < 3:  # all three reached the (stuck) prefill
                await asyncio.sleep(0.01)
            refused = [await one(10 + i) for i in range(4)]  # answered while the 3 wait
            assert not any(t.done() for t in admitted)
            pre.gate.set()
            done = [(await t).status_code for t in admitted]
            pre.gate = None
            after = (await one(99)).status_code
        return done, refused, after

    done, refused, after = asyncio.run(run())
    assert done == [200, 200, 200] and after == 200
    for r in refused:
        assert r.status_code == 503 and r.headers["retry-after"] == "2"
        err = r.json()["error"]
        assert err["type"] == "overloaded_error" and "3 requests queued" in err["message"]
    s = client.get("/v1/pdserve/stats", headers=OP).json()["ingress"]["prefill_queue"]
    assert s["in_flight"] == 0 and s["uncached_tokens"] == 0  # every slot came back
    assert s["peak"] == 3 and s["overload_refused"] == 4


def test_over_the_queue_bound_the_flooding_tenant_is_refused_and_the_quiet_one_admitted(
    tiny_model_dir: Path,
) -> None:
    """The prefill engine is stuck with a flooding tenant's 3 requests (the bound): its next
    is refused; a quiet tenant's request, its tenant below an equal share of what is in
    flight, is admitted past the bound (counted as spared), as is a third tenant's first,
    but not its second (2 of 6 is the mean: not below it); a fourth tenant's fills the
    ceiling (2 x 3) and a fifth's is refused there, share or not. Released, every admitted
    request completes. With ``overload_spare_factor: 1`` the quiet request is refused at the
    bound."""
    import asyncio

    import httpx

    keys = {"kf": "flood", "kq": "quiet", "kr": "third", "ks": "fourth", "kt": "fifth"}

    def wire(factor: float) -> Any:
        return _wire(
            tiny_model_dir,
            {
                "ingress": {
                    "api_keys": keys,
                    "max_queued_requests_per_replica": 3,
                    "overload_spare_factor": factor,
                }
            },
            app_name=f"spare-unit-{factor:g}",
        )

    async def run(client: Any, pre: Any, spare: bool) -> dict[str, Any]:
        pre.gate = asyncio.Event()
        transport = httpx.ASGITransport(app=client.app)
        out: dict[str, Any] = {}
        held: list[asyncio.Task[httpx.Response]] = []
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:

            async def one(key: str, i: int) -> httpx.Response:
                body = {"model": "test", "prompt": f"request {key} {i}", "max_tokens": 2}
                return await c.post("/v1/completions", json=body, headers=auth(key))

            async def admitted(key: str, i: int) -> None:
                """``key``'s request reaches the stuck engine (and waits there)."""
                n = len(pre.seen)
                held.append(asyncio.create_task(one(key, i)))
                while len(pre.seen) == n:
                    assert not held[-1].done(), (await held[-1]).text
                    await asyncio.sleep(0.01)

            for i in range(3):
                await admitted("kf", i)
            out["flood"] = (await one("kf", 9)).status_code
            if spare:
                await admitted("kq", 0)
                await admitted("kr", 0)
                out["third_again"] = (await one("kr", 1)).status_code
                await admitted("ks", 0)
                out["fifth"] = (await one("kt", 0)).status_code
            else:
                out["quiet"] = (await one("kq", 0)).status_code
            pre.gate.set()
            out["held"] = [(await t).status_code for t in held]
            pre.gate = None
        return out

    client, pre, _ = wire(2.0)
    out = asyncio.run(run(client, pre, spare=True))
    assert out == {"flood": 503, "third_again": 503, "fifth": 503, "held": [200] * 6}, out
    q = client.get("/v1/pdserve/stats", headers=OP).json()["ingress"]["prefill_queue"]
    assert q["overload_spared"] == 3 and q["overload_refused"] == 3 and q["in_flight"] == 0
    assert q["peak"] == 6

    client, pre, _ = wire(1.0)
    out = asyncio.run(run(client, pre, spare=False))
    assert out == {"flood": 503, "quiet": 503, "held": [200] * 3}, out


def test_past_the_token_bound_a_mostly_cached_prompt_is_admitted_and_an_uncached_one_refused(
    tiny_model_dir: Path,
) -> None:
    """One tenant alone (never below its share) and a stuck prefill holding 45 uncached
    tokens, past the bound of 40: a 20-token prompt the index shows cached but for 2 tokens
    is admitted (spared for its reuse, counted), the same prompt uncached gets the 503, and
    with ``overload_spare_reuse: 0`` so does the cached one. Issue 39's cache_pressure cell:
    the bound refused repeats of served documents, the requests that waited least."""
    import asyncio
    from types import SimpleNamespace

    import httpx

    held = {"tokens": 0}

    async def match(hashes: Any) -> Any:
        """The prefix index's answer, stood in: every prompt's first tokens on r0."""
        return SimpleNamespace(by_replica={"r0": held["tokens"]})

    def wire(reuse: float) -> Any:
        client, pre, _ = _wire(
            tiny_model_dir,
            {
                "ingress": {
                    "api_keys": {"ka": "alice"},
                    "max_queued_uncached_tokens_per_replica": 40,
                    "overload_spare_reuse": reuse,
                },
                "index": {"backend": "memory"},  # prompts get block hashes to look up
            },
            app_name=f"reuse-unit-{reuse:g}",
        )
        client.core.index.match = match
        return client, pre

    async def run(client: Any, pre: Any) -> dict[str, int]:
        pre.gate = asyncio.Event()
        out: dict[str, int] = {}
        transport = httpx.ASGITransport(app=client.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:

            async def one(tokens: int) -> httpx.Response:
                body = {"model": "test", "prompt": [7] * tokens, "max_tokens": 2}
                return await c.post("/v1/completions", json=body, headers=auth())

            first = asyncio.create_task(one(45))  # admitted: nothing was queued
            while not pre.seen:
                assert not first.done(), (await first).text
                await asyncio.sleep(0.01)
            held["tokens"] = 18  # 2 of 20 tokens left to compute
            cached = asyncio.create_task(one(20))
            await asyncio.sleep(0.2)
            held["tokens"] = 0
            out["uncached"] = (await one(20)).status_code
            pre.gate.set()
            out["first"] = (await first).status_code
            out["cached"] = (await cached).status_code
            pre.gate = None
        return out

    client, pre = wire(0.5)
    assert asyncio.run(run(client, pre)) == {"uncached": 503, "first": 200, "cached": 200}
    q = client.get("/v1/pdserve/stats", headers=OP).json()["ingress"]["prefill_queue"]
    assert q["overload_spared"] == 1 and q["overload_spared_reuse"] == 1
    assert q["overload_refused"] == 1

    client, pre = wire(0.0)
    assert asyncio.run(run(client, pre)) == {"uncached": 503, "first": 200, "cached": 503}


def test_routing_user_config_applies_live_and_bad_values_keep_the_old(tiny_model_dir: Path) -> None:
    """The ingress's ``user_config``: routing parameters reach the routers of its app (the
    registry they read before each decision); a bad value, or one that needs a redeploy,
    is refused naming the field, and the old values stay."""
    from deployments.config import AppConfig
    from deployments.ingress import IngressCore
    from deployments.router_registry import routing_of

    cfg = AppConfig.model_validate(
        {
            "model": {"path": str(tiny_model_dir), "build_preset": None},
            "index": {"backend": "none"},
            "ingress": {"auth": "none", "health_cache_s": 0},
        }
    ).model_dump(mode="json")
    core = IngressCore(cfg, FakeEngine("prefill"), FakeEngine("decode"), app_name="live-unit")
    core.reconfigure({"routing": {"policy": "round_robin", "hotspot_slack_tokens": 99}})
    assert core.cfg.routing.policy == "round_robin" and core.live_error is None
    version, published = routing_of("live-unit")
    assert published["policy"] == "round_robin" and published["hotspot_slack_tokens"] == 99
    for bad, field in (
        ({"routing": {"hotspot_factor": -1}}, "routing.hotspot_factor"),
        ({"routing": {"policy": "serve_default"}}, "routing.policy"),
        ({"routing": {"stats_period_s": 0.5}}, "routing.stats_period_s"),
        ({"routng": {}}, "routng"),
    ):
        core.reconfigure(bad)
        assert core.live_error is not None and field in core.live_error, core.live_error
        assert "old values stay" in core.live_error
        assert core.cfg.routing.policy == "round_robin"
        assert routing_of("live-unit")[0] == version  # nothing republished
    assert core.live_refused == 4 and core.live_applied == 1


def test_ready_waits_for_every_prefill_decode_pair_to_be_warmed(tiny_model_dir: Path) -> None:
    """/health is 503 ``warming`` until one request has gone from each prefill replica to each
    decode replica (pinned, each pair under its own salt so the decode side pulls the KV);
    a replica that joins later is warmed in the background while /health stays 200."""
    import asyncio
    import json as _json

    from deployments.config import AppConfig
    from deployments.ingress import IngressCore
    from deployments.router_registry import directory

    app = "warm-unit"
    cfg = AppConfig.model_validate(
        {
            "model": {"path": str(tiny_model_dir), "build_preset": None},
            "index": {"backend": "none"},
            "ingress": {"auth": "none", "health_cache_s": 0},
        }
    ).model_dump(mode="json")
    pre, dec = FakeEngine("prefill"), FakeEngine("decode")
    core = IngressCore(cfg, pre, dec, app_name=app)
    directory(app, "prefill").update({"p1": {}, "p2": {}})
    directory(app, "decode").update({"d1": {}})

    async def run() -> None:
        r = await core.health()
        assert r.status_code == 503 and _json.loads(r.body)["status"] == "warming"
        assert core._warming is not None
        await core._warming
        r = await core.health()
        assert r.status_code == 200 and _json.loads(r.body)["warm_up"]["pairs_left"] == 0
        directory(app, "prefill").update({"p1": {}, "p2": {}, "p3": {}})
        assert (await core.health()).status_code == 200  # p3 warms in the background
        await core._warming
        assert _json.loads((await core.health()).body)["warm_up"]["pairs_warmed"] == 3

    asyncio.run(run())
    assert sorted(q.route.pin for q in pre.seen if q.route) == ["p1", "p2", "p3"]
    decodes = [q for q in dec.seen]
    assert [q.route.pin for q in decodes if q.route] == ["d1"] * 3
    assert all(q.kv_transfer_params == KV for q in decodes)
    assert len({q.cache_salt for q in decodes}) == 3  # one salt per pair: a real pull each


def test_short_prompts_are_prefilled_on_their_decode_replica(tiny_model_dir: Path) -> None:
    """routing.local_prefill_threshold_tokens: a prompt shorter than it skips the prefill
    replica (the decode request carries no KV parameters: the decode engine computes the
    prompt); a longer one, or one asking for the prefill's own output (echo), goes PD."""
    client, pre, dec = _wire(
        tiny_model_dir,
        {"ingress": {"auth": "none"}, "routing": {"local_prefill_threshold_tokens": 32}},
    )
    body = {"model": "test", "prompt": "short one", "max_tokens": 3}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert pre.seen == [] and dec.seen[-1].kv_transfer_params is None
    long_prompt = " ".join(f"w{i}" for i in range(60))
    assert client.post("/v1/completions", json=body | {"prompt": long_prompt}).status_code == 200
    assert len(pre.seen) == 1 and dec.seen[-1].kv_transfer_params == KV
    assert client.post("/v1/completions", json=body | {"echo": True}).status_code == 200
    assert len(pre.seen) == 2
    assert client.get("/v1/pdserve/stats", headers=OP).json()["ingress"]["decode_local"] == 1


def _colocated(tiny_model_dir: Path, app_name: str) -> tuple[Any, FakeEngine, Any]:
    """An ingress in colocated mode over one fake engine deployment (passed as both roles,
    as build_app binds it): ``(client, engine, core)``."""
    from deployments.config import AppConfig
    from deployments.ingress import IngressCore

    cfg = AppConfig.model_validate(
        {
            "mode": "colocated",
            "model": {"path": str(tiny_model_dir), "build_preset": None},
            "index": {"backend": "none"},
            "ingress": {"auth": "none", "health_cache_s": 0},
        }
    ).model_dump(mode="json")
    eng = FakeEngine("prefill")
    core = IngressCore(cfg, eng, eng, app_name=app_name)
    app = FastAPI()

    @app.post("/v1/completions")
    async def comp(request: Request, body: CompletionRequest) -> Any:
        return await core.complete(request, body)

    @app.post("/v1/responses")
    async def responses(request: Request, body: ResponsesRequest) -> Any:
        return await core.complete(request, body)

    @app.get("/health")
    async def health() -> Any:
        return await core.health()

    return TestClient(app), eng, core


def test_colocated_mode_sends_the_whole_request_to_one_engine(tiny_model_dir: Path) -> None:
    """mode: colocated: no prefill call and no KV parameters; the one engine deployment gets
    the decode call with the prefix index's hint (so its router can follow the prefix);
    prompt log-probabilities, which come from a prefill replica, are a 400 naming the field."""
    client, eng, core = _colocated(tiny_model_dir, "colocated-unit")
    assert client.get("/health").status_code == 200  # no pairs to warm
    body = {"model": "test", "prompt": "one engine", "max_tokens": 4}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert len(eng.seen) == 1  # the decode call only
    (req,) = eng.seen
    assert req.kv_transfer_params is None and req.route is not None
    assert req.route.prompt_tokens == len(req.prompt_token_ids)
    r = client.post("/v1/completions", json=body | {"prompt_logprobs": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
    assert core._inflight_prefill == 0  # the slot came back when the stream ended


def test_colocated_echo_only_gives_its_queue_slot_back(tiny_model_dir: Path) -> None:
    """echo with max_tokens 0 runs no engine stream in colocated mode; its prefill-queue slot
    (held for the stream) still comes back."""
    client, eng, core = _colocated(tiny_model_dir, "colocated-echo")
    r = client.post(
        "/v1/completions",
        json={"model": "test", "prompt": "say it back", "max_tokens": 0, "echo": True},
    )
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "say it back"
    assert eng.seen == [] and core._inflight_prefill == 0 and core._inflight_uncached == 0


def test_the_wait_bound_refuses_once_the_engines_hold_more_than_it_in_seconds(
    tiny_model_dir: Path,
) -> None:
    """``max_expected_wait_s``: requests waiting in the engines (their reports' ``waiting``;
    running ones do not count) over the engines' completion rate (their reports'
    ``requests_finished``). 40 waiting at 2 per second is 20 s: admitted under a 30 s bound,
    however many run; 79 is 39.5 s: a 503 with Retry-After (the excess, rounded up) and the
    numbers in the message."""
    import asyncio
    import time

    from deployments.config import AppConfig
    from deployments.ingress import IngressCore
    from deployments.ingress.openai_requests import RequestError
    from deployments.router_registry import directory

    app = "wait-unit"
    cfg = AppConfig.model_validate(
        {
            "model": {"path": str(tiny_model_dir), "build_preset": None},
            "index": {"backend": "none"},
            "ingress": {"warm_up": False, "max_expected_wait_s": 30},
        }
    ).model_dump(mode="json")
    core = IngressCore(cfg, FakeEngine("prefill"), FakeEngine("decode"), app_name=app)

    def reports(waiting: int, finished: int, running: int = 0) -> None:
        directory(app, "prefill").update({"p1": {"waiting": waiting // 2, "running": running}})
        directory(app, "decode").update(
            {
                "d1": {
                    "waiting": waiting - waiting // 2,
                    "running": running,
                    "requests_finished": finished,
                }
            }
        )

    async def run() -> None:
        reports(40, 0)
        core.check_wait("t")  # the first replica set: the rate is measured from here
        core._completions = type(core._completions)(window_s=20.0)
        core._completions.add(time.monotonic() - 10, 0)  # 20 done in the last 10 s: 2/s
        reports(40, 20, running=30)  # 60 running: being served, not waiting
        core.check_wait("t")
        assert core.expected_wait_s == pytest.approx(20.0, rel=0.05)
        reports(79, 20)
        with pytest.raises(RequestError) as e:
            core.check_wait("t")
        assert e.value.status == 503 and e.value.headers == {"Retry-After": "10"}
        assert "79 requests waiting in the engines" in str(e.value) and core.wait_refused == 1
        # a replica joins (capacity changed): the old rate is dropped, nothing is refused
        # until the new capacity's rate is measured
        directory(app, "prefill").update(
            {"p1": {"waiting": 39, "running": 0}, "p2": {"waiting": 0, "running": 0}}
        )
        core.check_wait("t")
        assert core.expected_wait_s is None and core.wait_refused == 1

    asyncio.run(run())


def test_past_the_wait_ceiling_a_quiet_tenant_is_judged_by_the_wait_ahead_of_it_under_the_share(
    tiny_model_dir: Path,
) -> None:
    """Issue 39's ``multi_tenant`` cell at 1.2x: a flood took the engines' queue past twice the
    30 s wait bound and the quiet tenant's requests were refused there, though the prefill's
    fair share served them ahead of nearly all of that queue. With the share on, a tenant
    below its share is judged at the ceiling by the wait ahead of its request: the prefill's
    waiting requests times its part (4 of 32 beside a flood of 30), the decode's whole. 140
    waiting at the prefill at 2/s is 70 s (past the 60 s ceiling) but 8.75 s under the
    share: admitted; the flood is refused; with decode's 120 and the prefill's 20 the wait
    ahead is 61 s: refused, the message naming it. With the share off, the whole queue's
    wait stands, as before."""
    from deployments.config import AppConfig
    from deployments.ingress import IngressCore
    from deployments.ingress.openai_requests import RequestError
    from deployments.router_registry import directory

    def core_for(fair: bool) -> tuple[Any, str]:
        app = f"share-wait-unit-{fair}"
        cfg = AppConfig.model_validate(
            {
                "model": {"path": str(tiny_model_dir), "build_preset": None},
                "index": {"backend": "none"},
                "ingress": {"warm_up": False, "max_expected_wait_s": 30},
                "prefill": {
                    "num_cpus": 1.0,
                    "scheduler_cls": "engines.scheduler.FairwayScheduler",
                    "scheduler_config": {"fair_share": fair},
                },
            }
        ).model_dump(mode="json")
        core = IngressCore(cfg, FakeEngine("prefill"), FakeEngine("decode"), app_name=app)
        core._inflight_by_tenant = {"flood": 30, "quiet": 1}
        return core, app

    def reports(app: str, at_prefill: int, at_decode: int) -> None:
        directory(app, "prefill").update({"p1": {"waiting": at_prefill}})
        directory(app, "decode").update({"d1": {"waiting": at_decode, "requests_finished": 20}})

    def measured(core: Any, app: str) -> None:
        """The engines' rate, 2/s (held there: the test's own time must not move it)."""
        reports(app, 0, 0)
        core.check_wait("t")  # the first replica set: the rate is measured from here
        core._completions.rate = lambda: 2.0

    core, app = core_for(fair=True)
    measured(core, app)
    reports(app, 140, 0)
    assert core.check_wait("quiet") is True  # spared: 140 x 4/32 / 2 = 8.75 s ahead
    assert core.expected_wait_s == pytest.approx(70.0, rel=0.05)  # the whole queue's
    with pytest.raises(RequestError) as e:
        core.check_wait("flood")  # at or above its share: refused at the bound
    assert e.value.status == 503 and "under the tenants' fair share" not in str(e.value)
    reports(app, 40, 100)  # the decode's 100 count whole: (100 + 5) / 2 = 52.5 s
    assert core.check_wait("quiet") is True
    reports(app, 20, 120)  # (120 + 2.5) / 2 = 61.25 s: past the ceiling
    with pytest.raises(RequestError) as e:
        core.check_wait("quiet")
    # Retry-After: the whole queue's excess over the bound
    assert e.value.status == 503 and e.value.headers == {"Retry-After": "40"}
    assert "about 61 s ahead of this request under the tenants' fair share" in str(e.value)
    assert "(ceiling 60 s)" in str(e.value) and core.wait_refused == 2

    core, app = core_for(fair=False)
    measured(core, app)
    reports(app, 140, 0)
    with pytest.raises(RequestError) as e:
        core.check_wait("quiet")  # the whole queue's 70 s, past the ceiling
    assert "about 70 s to drain" in str(e.value) and "fair share" not in str(e.value)
    reports(app, 110, 0)  # 55 s: under the ceiling, spared as before
    assert core.check_wait("quiet") is True


def test_a_decode_call_no_router_placed_releases_the_prefills_kv_and_a_placed_one_does_not(
    wired: Any,
) -> None:
    """A decode call that ends before its first chunk (the client left, a time-out) while it
    still waited at the handle is withdrawn, and the prefill replica holding its KV (pinned by
    id) is asked to free it at once; a call a router had placed is left to its decode engine
    (vLLM's connector frees the KV of a request aborted before its pull), and a withdrawn
    call can no longer be placed."""
    import asyncio

    from deployments.protocol import Sampling
    from deployments.router_registry import handle_waits

    client, pre, _ = wired
    core = client.core
    waits = handle_waits(core.app_name, "decode")
    chunk = EngineChunk("x", (9,), "length", 3, 0, 0.01, KV, replica_id="prefill-7")

    def end_before_first_chunk(rid: str, kv: dict[str, Any] | None = KV) -> list[EngineRequest]:
        n = len(pre.released)
        dreq = EngineRequest(rid, (1, 2, 3), Sampling(max_tokens=4), kv_transfer_params=kv)

        async def go() -> None:
            core._release_unsent(dreq, chunk)
            await asyncio.gather(*core._background)

        asyncio.run(go())
        return pre.released[n:]

    before = dict(client.get("/v1/pdserve/stats", headers=OP).json()["ingress"]["kv_released"])
    sent = end_before_first_chunk("never-placed")
    assert len(sent) == 1
    assert sent[0].route is not None and sent[0].route.pin == "prefill-7"
    assert sent[0].kv_transfer_params == KV
    assert waits.place("never-placed", 0.0) is False  # a router can no longer place it
    after = client.get("/v1/pdserve/stats", headers=OP).json()["ingress"]["kv_released"]
    assert after["sent"] == before["sent"] + 1 and after["freed"] == before["freed"] + 1

    assert waits.place("placed", 0.0) is True  # a router placed it: a decode engine has it
    assert end_before_first_chunk("placed") == []
    assert waits.pop("placed") is None  # its placement was taken with the withdrawal
    assert end_before_first_chunk("no-kv", kv=None) == []  # nothing pinned for it
