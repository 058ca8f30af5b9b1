"""Live routing benchmark (``pdserve bench routing``): the same prefix-heavy replay against the
real app under each prefill routing policy, one policy deployed at a time, in one run.

The workload is a shared-document RAG mix in token ids (so shared prefixes stay shared and
every count is exact): ``documents`` documents of ``doc_blocks`` KV blocks each, picked with
Zipf popularity (exponent ``zipf_s``), each request the document plus a unique question of
``question_tokens`` tokens, arriving open-loop (Poisson, ``rate`` per second, seeded), streamed
with ``max_tokens`` output tokens. Every policy sees the identical request sequence and arrival
times; the app (the config's replicas and engines, the in-memory index) is redeployed per
policy, so every policy starts from cold caches.

Per policy: TTFT (client side: first SSE chunk) p50/p90/p99, end-to-end latency, the
cached-token ratio (vLLM's own count on the prefill engines, summed from the responses' usage),
requests per prefill replica, the routers' named fallbacks, and the ingress's own overhead
(ingress time minus engine time) from ``/v1/pdserve/stats``. After the replays, an optional
closed-loop phase runs ``overhead_streams`` concurrent streams under the first policy and
reports the ingress overhead at that load.

Runs a local Ray cluster in this process (or joins ``RAY_ADDRESS``); hold
``/tmp/pdserve-heavy.lock`` around it on a shared machine.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.workloads.rag import Arrival, RagMix, rag_mix
from controllers.stats import summarize

APP = "pdbench"


@dataclass
class Result:
    ok: bool
    ttft_s: float
    e2e_s: float
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""


async def send_one(client: Any, url: str, ids: list[int], max_tokens: int) -> Result:
    body = {
        "model": "test",
        "prompt": ids,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.monotonic()
    ttft = -1.0
    use: dict[str, Any] = {}
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                reason = (await r.aread()).decode(errors="replace")[:160]
                return Result(False, 0.0, 0.0, error=f"HTTP {r.status_code}: {reason}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if "error" in obj:
                    return Result(False, 0.0, 0.0, error=str(obj["error"])[:200])
                if obj.get("choices") and ttft < 0:
                    ttft = time.monotonic() - t0
                if obj.get("usage"):
                    use = obj["usage"]
    except Exception as e:  # a transport failure is a failed request, reported
        return Result(False, 0.0, 0.0, error=repr(e)[:200])
    details = use.get("prompt_tokens_details") or {}
    return Result(
        True,
        ttft,
        time.monotonic() - t0,
        int(use.get("prompt_tokens", 0)),
        int(details.get("cached_tokens", 0)),
    )


async def replay(
    url: str,
    arrivals: list[Arrival],
    max_tokens: int,
    progress: Callable[[int], None] | None = None,
) -> list[Result]:
    """Open-loop replay: each request is sent at its arrival offset, whatever is in flight."""
    import httpx

    limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        t0 = time.monotonic()

        async def at(a: Arrival) -> Result:
            await asyncio.sleep(max(0.0, t0 + a.at_s - time.monotonic()))  # the schedule
            res = await send_one(client, url, a.ids, max_tokens)
            if progress is not None:
                progress(1)
            return res

        return list(await asyncio.gather(*(at(a) for a in arrivals)))


async def closed_loop(
    url: str, arrivals: list[Arrival], streams: int, max_tokens: int
) -> list[Result]:
    """``streams`` concurrent clients, each sending its next request when the last ends; the
    requests' results."""
    import httpx

    queue = list(arrivals)
    out: list[Result] = []
    async with httpx.AsyncClient(timeout=600) as client:

        async def worker() -> None:
            while queue:
                a = queue.pop()
                out.append(await send_one(client, url, a.ids, max_tokens))

        await asyncio.gather(*(worker() for _ in range(streams)))
    return out


def serve_locally(port: int, **init: Any) -> str:
    """Serve on ``127.0.0.1:port`` over a Ray cluster: the one ``RAY_ADDRESS`` names, else a
    local head of this process (``init``: more of ``ray.init``'s arguments); its URL."""
    import os

    import ray
    from ray import serve

    if not ray.is_initialized():
        if os.environ.get("RAY_ADDRESS"):
            ray.init(log_to_driver=False)
        else:
            ray.init(
                address="local",
                num_cpus=8,
                include_dashboard=False,
                log_to_driver=False,
                **init,
            )
    # on the head only: worker nodes on this machine (bench multinode) share its 127.0.0.1
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    return f"http://127.0.0.1:{port}"


#: pdserve's application-level autoscaling policy, as a Serve config names it
PD_POLICY = {"policy_function": "deployments.autoscaling:PDAutoscaler"}


def config_app(name: str, args: dict[str, Any], policy: bool) -> dict[str, Any]:
    """The application a Serve config would hold for the app built from ``args`` at ``/``
    (``policy``: with pdserve's application-level autoscaling policy)."""
    app: dict[str, Any] = {
        "name": name,
        "route_prefix": "/",
        "import_path": "deployments.app:build_app",
        "args": args,
    }
    if policy:
        app["autoscaling_policy"] = dict(PD_POLICY)
    return app


def deploy_config(app: dict[str, Any]) -> None:
    """Deploy ``app`` (:func:`config_app`) as ``serve deploy`` does: only a config carries
    Serve's application-level policy (``serve.run`` of a built app cannot)."""
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    client = _get_global_client()
    assert client is not None, "start Serve first (serve_locally)"
    client.deploy_apps(ServeDeploySchema.model_validate({"applications": [app]}))


def replica_states(app: str) -> dict[str, dict[str, int]]:
    """Serve's count of replicas per state, by the state's name, of each deployment of
    ``app``."""
    from ray import serve

    deps = serve.status().applications[app].deployments
    return {
        name: {str(getattr(k, "value", k)): int(v) for k, v in d.replica_states.items()}
        for name, d in deps.items()
    }


def get_json(url: str, path: str) -> dict[str, Any]:
    import httpx

    r = httpx.get(f"{url}{path}", timeout=60)
    r.raise_for_status()
    return dict(r.json())


def reset_stats(url: str) -> dict[str, Any]:
    """The stats, then the ingress's overhead samples start afresh (an operator's POST)."""
    import httpx

    r = httpx.post(f"{url}/v1/pdserve/stats/reset", timeout=60)
    r.raise_for_status()
    return dict(r.json())


def wait_ready(url: str, replicas: int, timeout_s: float = 900, role: str = "prefill") -> None:
    """Until ``/health`` is ok and ``replicas`` replicas of ``role`` report."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if get_json(url, "/health")["status"] == "ok":
                s = get_json(url, "/v1/pdserve/stats")
                if sum(1 for r in s["replicas"][role] if "requests" in r) >= replicas:
                    return
        except Exception:  # 503 while the engines start
            pass
        time.sleep(1.0)  # polling a starting server
    raise TimeoutError(f"the app at {url} did not become ready in {timeout_s:.0f} s")


def summarize_policy(results: list[Result], before: dict[str, Any], after: dict[str, Any]) -> Any:
    ok = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    per_replica = {}
    b = {r["id"]: r.get("requests", 0) for r in before["replicas"]["prefill"]}
    for r in after["replicas"]["prefill"]:
        per_replica[r["id"]] = r.get("requests", 0) - b.get(r["id"], 0)
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "error_samples": sorted({r.error for r in results if not r.ok})[:3],
        "ttft": summarize([r.ttft_s for r in ok]),
        "e2e": summarize([r.e2e_s for r in ok]),
        "cached_token_ratio": (sum(r.cached_tokens for r in ok) / prompt) if prompt else 0.0,
        "requests_per_replica": sorted(per_replica.values(), reverse=True),
        "fallbacks": after["router"]["fallbacks"],
        "ingress_overhead_s": after["ingress"]["overhead_s"],
        "ingress_phases_s": after["ingress"]["phases_s"],
        "ttft_samples": [r.ttft_s for r in ok],
    }


def run(
    app_args: dict[str, Any],
    policies: list[str],
    mix: RagMix,
    *,
    build_app: Callable[[dict[str, Any]], Any],
    overhead_streams: int = 8,
    overhead_requests: int = 40,
    port: int = 8765,
    progress: Callable[[str, int], Callable[[int], None]] | None = None,
) -> dict[str, Any]:
    """Deploy the app once per policy, replay ``mix`` against it, and summarize (see module).

    ``build_app`` is the application builder a Serve config names (``import_path:
    deployments.app:build_app``), handed in by the caller, so that the benchmark reaches the
    app only through it, its config and its HTTP routes."""

    from ray import serve

    from deployments.config import load_app_config

    cfg = load_app_config(app_args)
    url = serve_locally(port)
    out: dict[str, Any] = {
        "mix": asdict(mix),
        "prefill_replicas": cfg.prefill.num_replicas,
        "model": str(cfg.model.path),
        "policies": {},
    }
    arrivals: list[Arrival] | None = None
    for i, policy in enumerate(policies):
        args = dict(app_args)
        args["routing"] = {**dict(app_args.get("routing") or {}), "policy": policy}
        t_deploy = time.monotonic()
        serve.run(build_app(args), name=APP, route_prefix="/", blocking=False)
        wait_ready(url, cfg.prefill.num_replicas)
        deploy_s = time.monotonic() - t_deploy
        if arrivals is None:
            vocab = model_vocab(cfg.model.resolved_path())
            arrivals = rag_mix(mix, vocab)
        before = reset_stats(url)
        tick = progress(policy, len(arrivals)) if progress else None
        t0 = time.monotonic()
        results = asyncio.run(replay(url, arrivals, mix.max_tokens, tick))
        wall = time.monotonic() - t0
        time.sleep(2 * cfg.routing.stats_period_s + 0.5)  # the replicas' last reports
        after = get_json(url, "/v1/pdserve/stats")
        summary = summarize_policy(results, before, after)
        summary.update(deploy_s=deploy_s, wall_s=wall)
        if i == 0 and overhead_streams > 0:
            # the ingress at a steady closed-loop load, on this policy's warm app
            rng = random.Random(mix.seed + 1)
            sample = [arrivals[rng.randrange(len(arrivals))] for _ in range(overhead_requests)]
            mark = reset_stats(url)["ingress"]["requests"]
            asyncio.run(closed_loop(url, sample, overhead_streams, mix.max_tokens))
            s = get_json(url, "/v1/pdserve/stats")
            summary["closed_loop"] = {
                "streams": overhead_streams,
                "requests": s["ingress"]["requests"] - mark,
                "ingress_overhead_s": s["ingress"]["overhead_s"],
                "phases_s": s["ingress"]["phases_s"],
            }
        out["policies"][policy] = summary
        serve.delete(APP)
        wait_gone(f"ServeReplica:{APP}:")
    return out


def wait_gone(marker: str, timeout_s: float = 120.0) -> None:
    """Wait until no local process's title contains ``marker`` (the deleted app's replicas),
    so the next policy does not share the cores with the last one's engines shutting down."""
    from deployments.local_nodes import processes_where

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not processes_where(lambda cmd: marker in " ".join(cmd)):
            return
        time.sleep(0.5)  # polling process exit


def model_vocab(model: Path) -> int:
    """Token ids the served model accepts: the smaller of its embedding and its tokenizer."""
    from tokenizers import Tokenizer

    cfg = json.loads((Path(model) / "config.json").read_text())
    tok = Tokenizer.from_file(str(Path(model) / "tokenizer.json"))
    return min(int(cfg["vocab_size"]), int(tok.get_vocab_size()))


def ratios(res: dict[str, Any], base: str) -> dict[str, dict[str, float | None]]:
    """Each policy's TTFT p50 and p99 relative to ``base``'s (same run)."""
    pol = res["policies"]
    if base not in pol:
        return {}
    b = pol[base]["ttft"]
    out = {}
    for name, s in pol.items():
        t = s["ttft"]
        out[name] = {
            "ttft_p50": (t["p50"] / b["p50"]) if b["p50"] and t["p50"] is not None else None,
            "ttft_p99": (t["p99"] / b["p99"]) if b["p99"] and t["p99"] is not None else None,
        }
    return out


def plot(res: dict[str, Any], path: Path) -> None:
    """TTFT CDF per policy (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, s in res["policies"].items():
        xs = sorted(s["ttft_samples"])
        if not xs:
            continue
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ax.plot(xs, ys, label=f"{name} (cached {s['cached_token_ratio']:.0%})")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s, log scale)")
    ax.set_ylabel("fraction of requests")
    m = res["mix"]
    ax.set_title(
        f"Live app, {res['prefill_replicas']} prefill replicas: RAG mix, "
        f"{m['requests']} requests at {m['rate']}/s"
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def app_args(preset: str, prefill_replicas: int, cache_dir: str | None) -> dict[str, Any]:
    """The benchmarked app: ``prefill_replicas`` Fairway prefill replicas sharing core 0, one
    TWP decode replica on core 1, the in-memory index, the preset's measured profile."""
    profile = {"bench": "cpu2core_vllm032_bench", "test": "cpu2core_vllm032_test"}[preset]
    sched = {"scheduler_config": {"profile": profile}}
    args: dict[str, Any] = {
        "model": {
            "path": f"~/.cache/pdserve/models/{preset}",
            "build_preset": preset,
            "max_model_len": 4096,
        },
        "prefill": {
            "num_replicas": prefill_replicas,
            "num_cpus": 1.0,
            "cpu_bind": "0",
            "scheduler_cls": "engines.scheduler.FairwayScheduler",
            **sched,
        },
        "decode": {
            "num_cpus": 1.0,
            "cpu_bind": "1",
            "scheduler_cls": "engines.scheduler.TWPScheduler",
            "kv_events": {"enabled": False},
            **sched,
        },
        "index": {"backend": "memory"},
        # the bench's own app, its proxy on loopback: keys off, said explicitly; its one
        # client is the only tenant, and what is measured is the app, not its limits
        "ingress": {"num_cpus": 0.25, "auth": "none"},
        "tenants": {"default": {"requests_per_second": None, "tokens_per_minute": None}},
    }
    if cache_dir:
        args["cache_dir"] = cache_dir
    return args
