"""Live multi-node benchmark (``pdserve bench multinode``): the app on several Ray nodes of one
machine, in two parts.

**Layouts.** The same prefix-heavy replay (the RAG mix of ``pdserve bench routing``: shared
documents in token ids, Poisson arrivals, seeded) against the same app (two Fairway prefill
replicas, one TWP decode replica, the in-memory index) on one Ray node and on worker nodes
``prefill=2,decode=1,ingress=1`` (:mod:`deployments.local_nodes`: a raylet each on its own
loopback address, each role pinned by its resource), with the same cores in total (the same
two cores, the same ``cpu_bind``), one layout's cluster at a time. Per layout: TTFT and
end-to-end latency, ITL (per request, ``(e2e - TTFT) / (tokens - 1)``), the cached-token
ratio, deploy time; the multi-node layout's figures relative to one node's.

**Autoscaling.** A cluster whose nodes Ray's autoscaler adds and removes: a head (prefill
and ingress resources) started with ``--autoscaling-config`` on Ray's ``fake_multinode``
provider (:class:`FakeAutoscalingCluster`; the provider starts and stops raylets as a cloud
provider starts machines), node type ``pdserve.decode`` (one ``pdserve_decode``) from one
node to two. The app's own application-level policy (``deployments.autoscaling``) sizes the
decode role from 1 to 2 under a load of long streams; Ray's autoscaler must then start a node
for the replica. Recorded, from the load's start: when the policy wanted a second decode
replica, when Ray's node joined, when Serve ran the replica, when that replica had served
a request (``requests`` in its report; the replicas report every 0.25 s), and, after the load
stops, when the replica went and when Ray terminated the idle node. The fake provider's
nodes all take the machine's own address (Ray's provider sets none of its own).

Both parts start their own Ray clusters: hold ``/tmp/pdserve-heavy.lock`` around it on a
shared machine. Absolute times are this machine's; the layouts' ratio is the comparison.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.live.routing import (
    Result,
    config_app,
    deploy_config,
    get_json,
    model_vocab,
    replay,
    replica_states,
    reset_stats,
    serve_locally,
    wait_gone,
    wait_ready,
)
from bench.workloads.rag import RagMix, rag_mix
from controllers.stats import summarize
from deployments.local import venv_bin
from deployments.local_nodes import (
    ROLE_RESOURCE,
    NodeSpec,
    kill_node,
    parse_nodes,
    processes_where,
    start_nodes,
    stop_processes,
)

APP = "pdmultinode"
LAYOUT_NODES = "prefill=2,decode=1,ingress=1"


def pinned(args: dict[str, Any]) -> dict[str, Any]:
    """``args`` with each role's replicas reserving their role's node resource; with the
    in-memory index, the prefill replicas publish their KV events over TCP at their node's
    address, as the ingress on another machine needs (Unix sockets, the default, would work
    here only because every node shares this machine's ``/tmp``)."""
    out = json.loads(json.dumps(args))
    for role in ("prefill", "decode", "ingress"):
        out.setdefault(role, {})["resources"] = {ROLE_RESOURCE[role]: 1}
    if (out.get("index") or {}).get("backend", "memory") == "memory":
        kv = out["prefill"].setdefault("kv_events", {})
        kv["transport"] = "tcp"
    return out


def _itl(r: Result, max_tokens: int) -> float | None:
    return (r.e2e_s - r.ttft_s) / (max_tokens - 1) if r.ok and max_tokens > 1 else None


def summarize_layout(results: list[Result], max_tokens: int) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    itl = [x for x in (_itl(r, max_tokens) for r in ok) if x is not None]
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "error_samples": sorted({r.error for r in results if not r.ok})[:3],
        "ttft": summarize([r.ttft_s for r in ok]),
        "itl": summarize(itl),
        "e2e": summarize([r.e2e_s for r in ok]),
        "cached_token_ratio": (sum(r.cached_tokens for r in ok) / prompt) if prompt else 0.0,
        "ttft_samples": [r.ttft_s for r in ok],
    }


def replica_nodes(app: str, by: str = "address") -> dict[str, list[str]]:
    """Each deployment of ``app`` -> its live replicas' nodes: their addresses, or (``by``
    ``"id"``: the fake provider's nodes share the machine's address) the last 8 digits of
    their ids."""
    import ray

    nodes = {
        n["NodeID"]: (n["NodeManagerAddress"] if by == "address" else n["NodeID"][-8:])
        for n in ray.nodes()
        if n["Alive"]
    }
    out: dict[str, list[str]] = {}
    for a in ray._private.state.actors().values():
        name = str(a.get("ActorClassName", ""))
        if a.get("State") == "ALIVE" and name.startswith(f"ServeReplica:{app}:"):
            out.setdefault(name.split(":")[-1], []).append(nodes.get(a["Address"]["NodeID"], "?"))
    return {k: sorted(v) for k, v in out.items()}


def run_layouts(
    app_args: dict[str, Any],
    mix: RagMix,
    *,
    build_app: Callable[[dict[str, Any]], Any],
    port: int = 8766,
    progress: Callable[[str, int], Callable[[int], None]] | None = None,
) -> dict[str, Any]:
    """Replay ``mix`` on one node, then on :data:`LAYOUT_NODES` (see the module docstring)."""
    import ray
    from ray import serve

    from deployments.config import load_app_config

    cfg = load_app_config(app_args)
    vocab = model_vocab(cfg.model.resolved_path())
    arrivals = rag_mix(mix, vocab)
    out: dict[str, Any] = {"mix": asdict(mix), "nodes": LAYOUT_NODES, "layouts": {}}
    for layout in ("one_node", "multi_node"):
        specs: list[NodeSpec] = parse_nodes(LAYOUT_NODES) if layout == "multi_node" else []
        args = pinned(app_args) if specs else app_args
        try:
            url = serve_locally(port)
            t0 = time.monotonic()
            if specs:
                gcs = ray.get_runtime_context().gcs_address
                start_nodes(specs, gcs, dict(os.environ), venv_bin("ray"))
            nodes_s = time.monotonic() - t0
            t1 = time.monotonic()
            serve.run(build_app(args), name=APP, route_prefix="/", blocking=False)
            wait_ready(url, cfg.prefill.num_replicas)
            deploy_s = time.monotonic() - t1
            placement = replica_nodes(APP)
            reset_stats(url)
            tick = progress(layout, len(arrivals)) if progress else None
            t2 = time.monotonic()
            results = asyncio.run(replay(url, arrivals, mix.max_tokens, tick))
            s = summarize_layout(results, mix.max_tokens)
            s.update(
                wall_s=time.monotonic() - t2,
                deploy_s=deploy_s,
                nodes_start_s=nodes_s,
                placement=placement,
            )
            out["layouts"][layout] = s
        finally:
            if ray.is_initialized():
                serve.shutdown()
                ray.shutdown()
            for spec in specs:
                kill_node(spec.ip, graceful=True)
            wait_gone(f"ServeReplica:{APP}:")
    out["ratios"] = layout_ratios(out)
    return out


def layout_ratios(res: dict[str, Any]) -> dict[str, float | None]:
    """The multi-node layout's TTFT p50/p99 and ITL p50/p99 over one node's (same run)."""
    one, multi = res["layouts"].get("one_node"), res["layouts"].get("multi_node")
    out: dict[str, float | None] = {}
    for key in ("ttft", "itl"):
        for q in ("p50", "p99"):
            a = one[key][q] if one else None
            b = multi[key][q] if multi else None
            out[f"{key}_{q}"] = (b / a) if a and b is not None else None
    return out


# -- Ray's autoscaler on the fake multi-node provider ------------------------------------------


class FakeAutoscalingCluster:
    """A Ray head of its own whose autoscaler (v1) runs Ray's ``fake_multinode`` provider
    (``ray.cluster_utils.AutoscalingCluster``'s setup, with the provider's whole config
    written here: the wheel ships no ``example.yaml`` to start from). It listens on a GCS
    port of its own, so it can run beside another local cluster; :meth:`stop` ends only the
    processes that name that port (``ray stop`` would end every cluster on the machine)."""

    def __init__(
        self,
        head_resources: dict[str, float],
        worker_types: dict[str, dict[str, Any]],
        idle_timeout_s: float = 15.0,
    ) -> None:
        self.head_resources = dict(head_resources)
        self.worker_types = worker_types
        self.idle_timeout_s = idle_timeout_s
        self.port = 0
        self.address = ""
        self._dir = Path(tempfile.mkdtemp(prefix="pdserve-fake-cluster-"))

    def config(self, gcs_address: str) -> dict[str, Any]:
        head = {k: v for k, v in self.head_resources.items() if k != "CPU"}
        return {
            "cluster_name": "pdserve-fake",
            "max_workers": sum(int(t.get("max_workers", 1)) for t in self.worker_types.values()),
            "provider": {
                "type": "fake_multinode",
                "use_node_id_as_ip": True,
                "disable_node_updaters": True,
                "disable_launch_config_check": True,
                "gcs_address": gcs_address,
            },
            "available_node_types": {
                "ray.head.default": {
                    "resources": {"CPU": self.head_resources.get("CPU", 1), **head},
                    "node_config": {},
                    "max_workers": 0,
                },
                **self.worker_types,
            },
            "head_node_type": "ray.head.default",
            "auth": {},
            "upscaling_speed": 1.0,
            "idle_timeout_minutes": self.idle_timeout_s / 60.0,
            "docker": {},
            "initialization_commands": [],
            "setup_commands": [],
            "head_setup_commands": [],
            "worker_setup_commands": [],
            "head_start_ray_commands": [],
            "worker_start_ray_commands": [],
            "file_mounts": {},
            "cluster_synced_files": [],
            "file_mounts_sync_continuously": False,
            "rsync_exclude": [],
            "rsync_filter": [],
        }

    def start(self, env: dict[str, str]) -> str:
        """Start the head (its autoscaler starts the worker types' ``min_workers``); its GCS
        address."""
        import socket

        from ray._private.services import get_node_ip_address

        with socket.socket() as s:
            s.bind(("", 0))
            self.port = int(s.getsockname()[1])
        self.address = f"{get_node_ip_address()}:{self.port}"
        cfg = self._dir / "autoscaling.json"
        cfg.write_text(json.dumps(self.config(self.address)))
        head = {k: v for k, v in self.head_resources.items() if k != "CPU"}
        cmd = [
            venv_bin("ray"),
            "start",
            "--head",
            f"--port={self.port}",
            f"--autoscaling-config={cfg}",
            f"--num-cpus={int(self.head_resources.get('CPU', 1))}",
            f"--resources={json.dumps(head)}",
            "--include-dashboard=false",
            "--disable-usage-stats",
        ]
        env = {**env, "RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"}
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
        if r.returncode != 0:
            raise RuntimeError(
                f"ray start of the fake autoscaling head failed:\n{r.stderr[-2000:]}"
            )
        return self.address

    def processes(self) -> list[Any]:
        """This cluster's processes (:func:`cluster_processes` of its GCS port)."""
        return cluster_processes(self.port) if self.port else []

    def stop(self) -> int:
        """End this cluster's processes (SIGTERM, then SIGKILL what is left); how many."""
        return stop_processes(self.processes(), graceful=True, timeout_s=20)


def cluster_processes(port: int) -> list[Any]:
    """The processes of the local Ray cluster whose GCS listens on ``port``: every one whose
    command line names that port (this process excepted)."""
    marks = (f":{port}", f"_port={port}", f"-port={port}")
    me = os.getpid()
    return [
        p
        for p in processes_where(lambda cmd: any(m in " ".join(cmd) for m in marks))
        if p.pid != me
    ]


DECODE_NODE = "pdserve.decode"
#: The autoscaling run's events, in the order each depends on the one before.
EVENTS = (
    "policy_wants_2",
    "node_joined",
    "replica_running",
    "new_replica_served",
    "load_stopped",
    "replica_gone",
    "node_terminated",
)


def decode_nodes() -> list[str]:
    """Live nodes advertising ``pdserve_decode`` (the last 8 digits of their ids)."""
    import ray

    return [
        n["NodeID"][-8:]
        for n in ray.nodes()
        if n["Alive"] and n["Resources"].get(ROLE_RESOURCE["decode"])
    ]


def new_events(seen: dict[str, float], x: dict[str, Any], first_replicas: set[str]) -> list[str]:
    """The events a sample ``x`` of :class:`Timeline` shows that ``seen`` lacks, in order:
    the policy wants a second decode replica, Ray's second decode node joined, Serve runs the
    replica, a replica other than ``first_replicas`` has served, then (after those) the
    replica gone and the node terminated."""
    out: list[str] = []
    have = set(seen)

    def add(name: str, cond: bool) -> None:
        if cond and name not in have:
            have.add(name)
            out.append(name)

    add("policy_wants_2", x["wanted"] >= 2)
    add("node_joined", x["nodes"] >= 2)
    add("replica_running", x["running"] >= 2)
    served = any(r not in first_replicas and n > 0 for r, n in x["served"].items())
    add("new_replica_served", "replica_running" in have and served)
    add("replica_gone", "new_replica_served" in have and x["running"] <= 1)
    add("node_terminated", "replica_gone" in have and x["nodes"] <= 1)
    return out


class Timeline:
    """Polls the cluster, Serve and the app every ``period_s`` in a thread; keeps the time
    (from :attr:`t0`) each event was first seen."""

    def __init__(self, url: str, period_s: float = 0.5) -> None:
        self.url = url
        self.period_s = period_s
        self.t0 = time.monotonic()
        self.events: dict[str, float] = {}
        self.first_replicas: set[str] = set()
        self.samples: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def mark(self, name: str) -> None:
        self.events.setdefault(name, round(time.monotonic() - self.t0, 2))

    def _sample(self) -> dict[str, Any]:
        s = get_json(self.url, "/v1/pdserve/stats")
        dec = s["autoscaling"]["decisions"].get("decode") or {}
        rows = {r["id"]: r for r in s["replicas"]["decode"] if "requests" in r}
        states = replica_states(APP)["decode"]
        return {
            "t": round(time.monotonic() - self.t0, 2),
            "wanted": int(dec.get("replicas") or 0),
            "reason": dec.get("reason"),
            "running": states.get("RUNNING", 0),
            "states": states,
            "nodes": len(nodes := decode_nodes()),
            "node_ids": nodes,
            "served": {rid: int(r.get("requests") or 0) for rid, r in rows.items()},
        }

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                x = self._sample()
            except Exception:  # a stats or status call racing a change: poll again
                time.sleep(self.period_s)
                continue
            self.samples.append(x)
            for name in new_events(self.events, x, self.first_replicas):
                self.mark(name)
            time.sleep(self.period_s)

    def __enter__(self) -> Timeline:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def autoscale_args(app_args: dict[str, Any], downscale_delay_s: float) -> dict[str, Any]:
    """The app on the autoscaling cluster: prefill and ingress on the head (their resources),
    decode pinned to ``pdserve.decode`` nodes, one replica per node; the app's policy keeps
    prefill at one and sizes decode between one and two (a low ``target_utilization``: the
    test model's streams are short of a replica's TWP window on this machine)."""
    args = pinned(app_args)
    args["autoscaling"] = {
        "enabled": True,
        "prefill": {"min_replicas": 1, "max_replicas": 1, "initial_replicas": 1},
        "decode": {"min_replicas": 1, "max_replicas": 2, "initial_replicas": 1},
        "idle_to_zero_s": 3600,
        "downscale_delay_s": downscale_delay_s,
        "target_utilization": 0.05,
    }
    return args


def run_autoscale(
    app_args: dict[str, Any],
    *,
    streams: int = 6,
    max_tokens: int = 256,
    downscale_delay_s: float = 10.0,
    idle_timeout_s: float = 15.0,
    timeout_s: float = 600.0,
    port: int = 8767,
) -> dict[str, Any]:
    """The autoscaling part (see the module docstring): its event times (s from the load's
    start) and the polled samples."""
    import ray
    from ray import serve

    cluster = FakeAutoscalingCluster(
        head_resources={"CPU": 4, ROLE_RESOURCE["prefill"]: 1, ROLE_RESOURCE["ingress"]: 1},
        worker_types={
            DECODE_NODE: {
                "resources": {"CPU": 1, ROLE_RESOURCE["decode"]: 1},
                "node_config": {},
                "min_workers": 1,
                "max_workers": 2,
            }
        },
        idle_timeout_s=idle_timeout_s,
    )
    args = autoscale_args(app_args, downscale_delay_s)
    out: dict[str, Any] = {"streams": streams, "max_tokens": max_tokens}
    try:
        t_start = time.monotonic()
        address = cluster.start(dict(os.environ))
        ray.init(address=address, log_to_driver=False)
        deadline = time.monotonic() + 180
        while len(decode_nodes()) < 1 and time.monotonic() < deadline:
            time.sleep(0.5)  # the provider's first decode node (min_workers)
        out["first_node_s"] = round(time.monotonic() - t_start, 2)
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        url = f"http://127.0.0.1:{port}"
        deploy_config(config_app(APP, args, policy=True))
        wait_ready(url, 1, timeout_s=600)
        wait_ready(url, 1, timeout_s=600, role="decode")
        out["deploy_s"] = round(time.monotonic() - t_start, 2)
        out["placement_before"] = replica_nodes(APP, by="id")
        with Timeline(url) as tl:
            first = {r["id"] for r in get_json(url, "/v1/pdserve/stats")["replicas"]["decode"]}
            tl.first_replicas = first
            results = asyncio.run(_load_until(url, tl, streams, max_tokens, timeout_s))
            out["placement_under_load"] = replica_nodes(APP, by="id")
            tl.mark("load_stopped")
            deadline = time.monotonic() + timeout_s
            while "node_terminated" not in tl.events and time.monotonic() < deadline:
                time.sleep(1.0)
        out["events_s"] = tl.events
        out["requests"] = len(results)
        out["errors"] = sum(1 for r in results if not r.ok)
        out["error_samples"] = sorted({r.error for r in results if not r.ok})[:3]
        out["samples"] = tl.samples
        out["placement_after"] = replica_nodes(APP, by="id")
    finally:
        if ray.is_initialized():
            try:
                serve.shutdown()
            finally:
                ray.shutdown()
        out["gcs_port"] = cluster.port
        out["processes_stopped"] = cluster.stop()
    return out


async def _load_until(
    url: str, tl: Timeline, streams: int, max_tokens: int, timeout_s: float
) -> list[Result]:
    """``streams`` closed-loop clients of distinct prompts until the new decode replica has
    served (or ``timeout_s``), then a few seconds more."""
    import random

    import httpx

    from bench.live.routing import send_one

    out: list[Result] = []
    stop = asyncio.Event()
    rng = random.Random(0)

    async def client(k: int) -> None:
        async with httpx.AsyncClient(timeout=600) as c:
            while not stop.is_set():
                ids = [rng.randrange(10, 1000) for _ in range(200)]
                out.append(await send_one(c, url, ids, max_tokens))

    tasks = [asyncio.create_task(client(k)) for k in range(streams)]
    deadline = time.monotonic() + timeout_s
    while "new_replica_served" not in tl.events and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
    await asyncio.sleep(3.0)
    stop.set()
    await asyncio.gather(*tasks)
    return out


def plot(res: dict[str, Any], path: Path) -> None:
    """Left: TTFT CDF per layout; right: the autoscaling run's decode replicas and nodes over
    time (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, s in (res.get("layouts") or {}).get("layouts", {}).items():
        xs = sorted(s["ttft_samples"])
        if xs:
            a.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=name)
    a.set_xscale("log")
    a.set_xlabel("TTFT (s, log scale)")
    a.set_ylabel("fraction of requests")
    a.set_title("Same replay: one node vs prefill=2,decode=1,ingress=1")
    a.grid(True, which="both", alpha=0.3)
    a.legend()
    auto = res.get("autoscale") or {}
    samples = auto.get("samples") or []
    if samples:
        ts = [x["t"] for x in samples]
        b.step(ts, [x["wanted"] for x in samples], where="post", label="policy wants")
        b.step(ts, [x["running"] for x in samples], where="post", label="Serve running")
        b.step(ts, [x["nodes"] for x in samples], where="post", label="decode nodes (Ray)")
        for name, t in (auto.get("events_s") or {}).items():
            b.axvline(t, color="grey", alpha=0.3)
            b.text(t, 2.05, name, rotation=90, fontsize=7, va="bottom")
        b.set_ylim(0, 2.8)
    b.set_xlabel("s from the load's start")
    b.set_ylabel("decode replicas / nodes")
    b.set_title("Ray's autoscaler (fake provider): a decode node added, removed")
    b.legend(loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":  # pragma: no cover - the CLI is pdserve bench multinode
    sys.exit("run: pdserve bench multinode")
