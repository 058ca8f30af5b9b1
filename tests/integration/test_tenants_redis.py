"""Tenants over a real redis-server: two limiters (two ingress replicas) draw from one bucket,
a refusal takes nothing, refunds return tokens, keys added and revoked in Redis take effect
without a restart, and a dead Redis is a named fallback, not a failed request."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from cluster.redis_server import free_port
from cluster.tenants import (
    Charge,
    KeyStore,
    KeyStoreUnavailable,
    RateLimiter,
    hash_key,
    new_key,
    redis_keys_key,
)
from controllers.tenants import Bucket

pytestmark = pytest.mark.integration


def _run(url: str, body: Callable[[Any, Any], Awaitable[None]]) -> None:
    import redis.asyncio as aioredis

    async def main() -> None:
        a = aioredis.Redis.from_url(url, decode_responses=True)
        b = aioredis.Redis.from_url(url, decode_responses=True)
        try:
            await body(a, b)
        finally:
            await a.aclose()
            await b.aclose()

    asyncio.run(main())


def test_two_ingress_replicas_share_one_bucket(redis_url: str) -> None:
    app = f"t{uuid.uuid4().hex[:8]}"
    slow = Bucket(rate=0.001, capacity=5)  # 5 at once, then one per 1000 s
    tokens = Bucket(rate=1.0, capacity=1000)

    async def body(ra: Any, rb: Any) -> None:
        a, b = RateLimiter(ra, app), RateLimiter(rb, app)
        got = []
        for i in range(8):
            lim = a if i % 2 == 0 else b  # alternate replicas, as a load balancer would
            v = await lim.admit("t1", [Charge("requests", slow, 1), Charge("tokens", tokens, 10)])
            got.append(v)
        assert [v.allowed for v in got] == [True] * 5 + [False] * 3
        assert all(v.backend == "redis" for v in got)
        assert got[5].refused_by == "requests" and 900 < got[5].retry_after_s <= 1000
        # refusals took no tokens: 5 x 10 taken, 950 left
        assert (await a.admit("t1", [Charge("tokens", tokens, 951)])).refused_by == "tokens"
        assert (await b.admit("t1", [Charge("tokens", tokens, 940)])).allowed
        await a.give_back("t1", "tokens", tokens, 500)  # reserved, never produced
        assert (await b.admit("t1", [Charge("tokens", tokens, 490)])).allowed
        # another tenant, another app: their own buckets
        assert (await a.admit("t2", [Charge("requests", slow, 1)])).allowed
        other = RateLimiter(ra, app + "x")
        assert (await other.admit("t1", [Charge("requests", slow, 1)])).allowed
        assert a.stats.redis_fallbacks == 0 and b.stats.redis_fallbacks == 0

    _run(redis_url, body)


def test_keys_in_redis_are_added_and_revoked_live(redis_url: str) -> None:
    app = f"k{uuid.uuid4().hex[:8]}"
    key = new_key()

    async def body(ra: Any, admin: Any) -> None:
        store = KeyStore({}, redis=ra, app=app, cache_s=0.0)
        assert await store.tenant(key) is None
        await admin.hset(redis_keys_key(app), hash_key(key), "carol")
        assert await store.tenant(key) == "carol"
        assert key not in str(await admin.hgetall(redis_keys_key(app)))  # stored hashed
        await admin.hdel(redis_keys_key(app), hash_key(key))
        assert await store.tenant(key) is None

    _run(redis_url, body)


def test_a_dead_redis_is_a_named_fallback() -> None:
    import redis.asyncio as aioredis

    async def main() -> None:
        dead = aioredis.Redis.from_url(
            f"redis://127.0.0.1:{free_port()}/0",
            decode_responses=True,
            socket_connect_timeout=0.2,
            socket_timeout=0.2,
        )
        lim = RateLimiter(dead, "x")
        b = Bucket(1.0, 2.0)
        got = [await lim.admit("t", [Charge("requests", b, 1)]) for _ in range(3)]
        # limits hold per replica meanwhile: the in-memory bucket refuses the third
        assert [v.allowed for v in got] == [True, True, False]
        assert all(v.backend == "memory" for v in got) and lim.stats.redis_fallbacks == 3
        store = KeyStore({hash_key("known"): "alice"}, redis=dead, app="x")
        assert await store.tenant("known") == "alice"  # config keys need no Redis
        with pytest.raises(KeyStoreUnavailable):
            await store.tenant("other")
        await dead.aclose()

    asyncio.run(main())


def test_pdserve_keys_new_list_revoke(tmp_path: Any, redis_url: str) -> None:
    """The CLI's stores are the ones the ingress reads: a keys file and Redis."""
    from pathlib import Path

    from typer.testing import CliRunner

    from cluster.tenants import read_keys_file
    from pdserve.cli import app as cli

    run = CliRunner()
    f = Path(tmp_path) / "keys.yaml"
    r = run.invoke(cli, ["keys", "new", "alice", "--file", str(f)])
    assert r.exit_code == 0, r.output
    key = r.stdout.strip().splitlines()[-1]
    assert read_keys_file(f) == {hash_key(key): "alice"} and key not in f.read_text()
    assert run.invoke(cli, ["keys", "new", "bob", "--file", str(f)]).exit_code == 0
    listed = run.invoke(cli, ["keys", "list", "--file", str(f)]).stdout
    assert "alice\tsha256:" in listed and "bob\tsha256:" in listed
    assert run.invoke(cli, ["keys", "revoke", "--key", key, "--file", str(f)]).exit_code == 0
    assert set(read_keys_file(f).values()) == {"bob"}
    assert run.invoke(cli, ["keys", "revoke", "--tenant", "zed", "--file", str(f)]).exit_code == 1
    assert run.invoke(cli, ["keys", "new", "bad name", "--file", str(f)]).exit_code != 0
    assert run.invoke(cli, ["keys", "hash", key]).stdout.strip() == hash_key(key)

    app_name = f"cli{uuid.uuid4().hex[:6]}"
    r = run.invoke(cli, ["keys", "new", "carol", "--redis", redis_url, "--app", app_name])
    assert r.exit_code == 0, r.output
    rkey = r.stdout.strip().splitlines()[-1]

    async def lookup(ra: Any, _: Any) -> None:
        store = KeyStore({}, redis=ra, app=app_name, cache_s=0.0)
        assert await store.tenant(rkey) == "carol"

    _run(redis_url, lookup)
    h = hash_key(rkey)[7:23]
    r = run.invoke(cli, ["keys", "revoke", "--hash", h, "--redis", redis_url, "--app", app_name])
    assert r.exit_code == 0 and "revoked 1" in r.stdout

    async def gone(ra: Any, _: Any) -> None:
        assert await KeyStore({}, redis=ra, app=app_name, cache_s=0.0).tenant(rkey) is None

    _run(redis_url, gone)
