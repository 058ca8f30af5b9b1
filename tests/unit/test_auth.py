"""The gate before the body (deployments.ingress.auth), the extension-field allow-list and bounds
(deployments.ingress.openai_requests.check_bounds), the engines' own transfer fields
(deployments.protocol.engine_extra_args), and work charged whatever the bucket holds
(controllers.tenants.debit). Pure: no tokenizer, no engine, no Ray."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from cluster.tenants import OPERATOR, KeyStore, RateLimiter, hash_key, read_keys_file
from controllers.tenants import Bucket, available, debit
from deployments.ingress.auth import PRINCIPAL, AuthFailures, AuthGuard, Gate, Principal
from deployments.ingress.openai_requests import (
    Bounds,
    CompletionRequest,
    RequestError,
    check_bounds,
)
from deployments.protocol import PREFILL_KV_PARAMS, engine_extra_args


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def gate(
    auth: str = "keys", limits: dict[str, Any] | None = None, clock: Any = None, burst: int = 3
) -> Gate:
    clock = clock or Clock()
    keys = KeyStore({hash_key("k-alice"): "alice", hash_key("k-op"): OPERATOR}, clock=clock)
    lim = limits if limits is not None else {"requests": (1.0, 2.0)}
    return Gate(
        auth,
        keys,
        RateLimiter(clock=clock),
        lambda tenant: lim,
        AuthFailures(burst=burst, per_minute=6.0, clock=clock),
    )


def check(g: Gate, method: str, path: str, key: str | None = None, addr: str = "10.0.0.1") -> Any:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return asyncio.run(g.check(method, path, headers, addr))


def status(g: Gate, *a: Any, **k: Any) -> int:
    try:
        check(g, *a, **k)
    except RequestError as e:
        return e.status
    return 200


def test_each_kind_of_key_reaches_only_its_own_routes_and_health_is_open() -> None:
    g = gate(limits={}, burst=100)
    assert check(g, "GET", "/health") is None  # open: no principal needed
    assert check(g, "POST", "/v1/completions", "k-alice") == Principal("alice")
    assert check(g, "GET", "/v1/pdserve/stats", "k-op") == Principal(OPERATOR, operator=True)
    assert status(g, "GET", "/v1/pdserve/stats", "k-alice") == 403  # a tenant: not stats
    assert status(g, "POST", "/v1/pdserve/stats/reset", "k-alice") == 403
    assert status(g, "POST", "/v1/completions", "k-op") == 403  # the operator: no tokens
    assert status(g, "GET", "/v1/models", None) == 401  # every /v1 route needs a key
    assert status(g, "GET", "/openapi.json", None) == 401
    assert check(g, "GET", "/openapi.json", "k-op").operator  # either kind reads the schema
    assert check(g, "GET", "/openapi.json", "k-alice").tenant == "alice"
    assert status(g, "GET", "/no/such/route", None) == 401  # no route map for strangers
    e = pytest.raises(RequestError, check, g, "POST", "/v1/completions", "nope").value
    assert e.status == 401 and e.headers == {"WWW-Authenticate": "Bearer"}
    assert g.refused == {"wrong_kind_of_key": 3, "invalid_key": 4}


def test_without_keys_every_route_is_anonymous_and_explicitly_so() -> None:
    g = gate(auth="none", limits={})
    assert check(g, "POST", "/v1/completions") == Principal("anonymous", operator=True)
    assert check(g, "GET", "/v1/pdserve/stats").operator


class CountingRedis:
    """A Redis that knows no key and counts the lookups it was asked for."""

    def __init__(self) -> None:
        self.lookups = 0

    async def hget(self, *_: Any) -> None:
        self.lookups += 1


def test_failed_keys_from_one_address_are_slowed_down_and_cost_no_lookups() -> None:
    clock = Clock()
    g = gate(clock=clock, limits={})
    g.keys.redis = redis = CountingRedis()
    for i in range(3):  # the burst: three failures, each a 401 (and a Redis lookup)
        assert status(g, "POST", "/v1/completions", f"guess{i}", addr="6.6.6.6") == 401
    assert redis.lookups == 3
    for i in range(20):
        e = pytest.raises(RequestError, check, g, "POST", "/v1/completions", f"g{i}", "6.6.6.6")
        assert e.value.status == 429 and e.value.headers["Retry-After"] == "10"  # 6 a minute
    assert redis.lookups == 3  # past the bound, guesses cost no lookup
    # a valid key from that address still passes (the guesser may share its NAT or load
    # balancer with real tenants), and other addresses are not slowed at all
    assert check(g, "POST", "/v1/completions", "k-alice", addr="6.6.6.6").tenant == "alice"
    assert status(g, "POST", "/v1/completions", "guess", addr="7.7.7.7") == 401
    clock.t += 10.0
    assert status(g, "POST", "/v1/completions", "guess9", addr="6.6.6.6") == 401


def test_the_failure_table_is_bounded() -> None:
    f = AuthFailures(burst=1, per_minute=1.0, clock=Clock(), max_addresses=3)
    for i in range(10):
        f.failed(f"10.0.0.{i}")
    assert len(f._tat) == 3 and f.retry_after("10.0.0.9") is not None
    assert f.retry_after("10.0.0.0") is None  # forgotten first


def test_a_tenants_post_takes_a_request_before_its_body_is_read() -> None:
    g = gate(limits={"requests": (1.0, 2.0)})
    assert status(g, "POST", "/v1/completions", "k-alice") == 200
    assert status(g, "POST", "/tokenize", "k-alice") == 200  # every route that does work
    e = pytest.raises(RequestError, check, g, "POST", "/v1/completions", "k-alice").value
    assert e.status == 429 and e.code == "rate_limit_exceeded"
    assert status(g, "GET", "/v1/models", "k-alice") == 200  # a GET does no work: free
    assert g.refused["rate_limited"] == 1


def test_operator_keys_live_in_a_keys_file_as_operator(tmp_path: Any) -> None:
    f = tmp_path / "keys.yaml"
    f.write_text(f'"{hash_key("k-op")}": "@operator"\n"{hash_key("k-a")}": alice\n')
    assert read_keys_file(f) == {hash_key("k-op"): OPERATOR, hash_key("k-a"): "alice"}
    f.write_text(f'"{hash_key("k-x")}": "@root"\n')
    with pytest.raises(ValueError, match="not a tenant name"):
        read_keys_file(f)


def _asgi(g: Gate, method: str, path: str, headers: dict[str, str], body: bytes) -> Any:
    """Drive AuthGuard over a downstream app that reads the body; what was sent back, whether
    the body was read and the principal the app saw."""
    seen: dict[str, Any] = {"receive_calls": 0, "app_called": False}
    sent: list[dict[str, Any]] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        seen["app_called"] = True
        seen["principal"] = scope.get(PRINCIPAL)
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def receive() -> dict[str, Any]:
        seen["receive_calls"] += 1
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(msg: dict[str, Any]) -> None:
        sent.append(msg)

    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "headers": [(k.encode(), v.encode()) for k, v in headers.items()],
        "client": ("10.1.2.3", 5555),
    }
    asyncio.run(AuthGuard(app, gate=g)(scope, receive, send))
    return sent, seen


def test_a_wrong_key_is_a_401_without_the_body_being_read() -> None:
    g = gate(limits={})
    big = b'{"model": "test", "prompt": "' + b"x" * (8 << 20) + b'"}'
    headers = {"authorization": "Bearer wrong", "content-type": "application/json"}
    sent, seen = _asgi(g, "POST", "/v1/completions", headers, big)
    assert sent[0]["status"] == 401
    assert (b"www-authenticate", b"Bearer") in sent[0]["headers"]
    assert json.loads(sent[1]["body"])["error"]["type"] == "authentication_error"
    assert seen == {"receive_calls": 0, "app_called": False}  # not one byte was read
    sent, seen = _asgi(g, "POST", "/v1/completions", {"authorization": "Bearer k-alice"}, big)
    assert sent[0]["status"] == 200 and seen["receive_calls"] == 1
    assert seen["principal"] == Principal("alice")


def test_no_gate_yet_is_a_503_not_an_open_door() -> None:
    import deployments.ingress.auth as auth

    auth._GATE["gate"] = None
    sent: list[dict[str, Any]] = []

    async def app(*_: Any) -> None:
        raise AssertionError("reached the app")

    async def send(m: dict[str, Any]) -> None:
        sent.append(m)

    scope = {"type": "http", "method": "GET", "path": "/v1/models", "headers": []}
    asyncio.run(AuthGuard(app)(scope, None, send))
    assert sent[0]["status"] == 503


def _req(**kw: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "test", "prompt": "hi", **kw})


def test_only_allowed_extension_keys_pass_and_the_engines_own_never_do() -> None:
    b = Bounds(allowed_vllm_xargs=frozenset({"my_processor"}))
    check_bounds(_req(vllm_xargs={"my_processor": 3}), b)
    for key in ("kv_transfer_params", "ec_transfer_params", "anything_else"):
        e = pytest.raises(RequestError, check_bounds, _req(vllm_xargs={key: 1}), b).value
        assert e.status == 400 and e.param == f"vllm_xargs.{key}"
    with pytest.raises(ValueError, match="vLLM's own field"):
        from deployments.config import IngressConfig

        IngressConfig(allowed_vllm_xargs=["kv_transfer_params"])


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        ({"stop_token_ids": list(range(17))}, "stop_token_ids"),
        ({"bad_words": [f"w{i}" for i in range(17)]}, "bad_words"),
        ({"logit_bias": {str(i): 1.0 for i in range(301)}}, "logit_bias"),
        ({"request_id": "x" * 129}, "request_id"),
        ({"request_id": "a\nb"}, "request_id"),
        ({"request_id": "<script>"}, "request_id"),
    ],
)
def test_fields_that_cost_every_step_or_reach_logs_are_bounded(
    patch: dict[str, Any], param: str
) -> None:
    e = pytest.raises(RequestError, check_bounds, _req(**patch), Bounds()).value
    assert e.status == 400 and e.param == param
    check_bounds(_req(stop_token_ids=list(range(16)), request_id="abc-123_x.y:z"), Bounds())


def test_an_engine_call_carries_only_its_own_transfer_fields() -> None:
    hostile = {"kv_transfer_params": {"do_remote_prefill": True, "remote_host": "6.6.6.6"},
               "ec_transfer_params": {}, "my_processor": 1}  # fmt: skip
    # a decode computing the prompt itself (n > 1's later sequences, decode-local, colocated,
    # a retry after a dead replica): no transfer at all, whatever the request carried
    assert engine_extra_args(hostile, None) == {"my_processor": 1}
    assert engine_extra_args({"kv_transfer_params": {"x": 1}}, None) is None
    pull = {"remote_engine_id": "e1", "remote_block_ids": [[1]], "do_remote_prefill": True}
    assert engine_extra_args(hostile, pull) == {"my_processor": 1, "kv_transfer_params": pull}
    assert engine_extra_args(None, PREFILL_KV_PARAMS) == {"kv_transfer_params": PREFILL_KV_PARAMS}


def test_work_done_is_charged_however_full_the_bucket_and_at_most_one_capacity() -> None:
    b = Bucket(rate=10.0, capacity=100.0)
    tat = debit(b, 0.0, now=50.0, units=30)
    assert available(b, tat, 50.0) == pytest.approx(70.0)
    tat = debit(b, tat, 50.0, units=500)  # more than the bucket: one capacity at most
    assert tat == pytest.approx(50.0 + 3.0 + 10.0)
    assert available(b, tat, 50.0) < 0  # the tenant now waits for its work


def test_the_limiter_charges_in_memory() -> None:
    clock = Clock()
    lim = RateLimiter(clock=clock)
    b = Bucket(1.0, 10.0)

    async def run() -> None:
        await lim.charge("t", "tokens", b, 8.0)
        from cluster.tenants import Charge

        assert not (await lim.admit("t", [Charge("tokens", b, 5.0)])).allowed
        assert (await lim.admit("t", [Charge("tokens", b, 2.0)])).allowed

    asyncio.run(run())
    assert lim.stats.debits == 1


def test_keys_new_operator_writes_an_operator_key(tmp_path: Any) -> None:
    from typer.testing import CliRunner

    from pdserve.cli import app as cli

    f = tmp_path / "keys.yaml"
    run = CliRunner()
    r = run.invoke(cli, ["keys", "new", "--operator", "--file", str(f)])
    assert r.exit_code == 0, r.output
    key = r.stdout.strip().splitlines()[-1]
    assert read_keys_file(f) == {hash_key(key): OPERATOR}
    assert run.invoke(cli, ["keys", "new", "alice", "--operator", "--file", str(f)]).exit_code != 0
    assert run.invoke(cli, ["keys", "new", "--file", str(f)]).exit_code != 0
    r = run.invoke(cli, ["keys", "revoke", "--tenant", OPERATOR, "--file", str(f)])
    assert r.exit_code == 0 and read_keys_file(f) == {}
