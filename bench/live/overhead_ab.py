"""Two commits' ingress overhead side by side: the same closed-loop load on the live app, run
alternately from each commit's own tree (A B A B ...), so the machine's drift falls on both.

Each run deploys that tree's app (``bench routing``'s layout on the ``test`` model: two
prefill replicas, one decode replica, the memory index) from a driver process whose
``PYTHONPATH`` is the tree, so its Ray workers import that tree's code and not the installed
one; this tree's client then sends a discarded warm-up and ``requests`` shared-document
prompts over ``streams`` closed-loop streams, the same for both sides. What is compared is the ingress's own time per phase
(``/v1/pdserve/stats``' ``ingress.phases_s``: wall time outside the engines) and its total
overhead per request, as the median over rounds of each run's p50 and p99, and their ratios
``after / before``. Ratios in one run are the result; absolute times drift on shared cores.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: the phases the ingress times (``deployments.ingress.stats``), in a request's order
PHASES = ("prepare", "route", "cold_start", "prefill", "decode_first", "decode", "respond")


def worktree(repo: Path, ref: str, dest: Path) -> Path:
    """A detached checkout of ``ref`` at ``dest`` (``git worktree add``)."""
    subprocess.run(
        ["git", "-C", str(repo), "worktree", "add", "--detach", "--force", str(dest), ref],
        check=True,
        capture_output=True,
    )
    return dest


def drop_worktree(repo: Path, dest: Path) -> None:
    subprocess.run(
        ["git", "-C", str(repo), "worktree", "remove", "--force", str(dest)],
        check=False,
        capture_output=True,
    )


def token_env(folder: Path) -> dict[str, str]:
    """This environment with Ray's token auth on and a token of the run's own in ``folder``
    (made once), so each side's local head and driver agree whatever either tree's bench
    sets."""
    from deployments.local import ensure_ray_token, local_env

    env = {
        **local_env(),
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(folder / "auth_token"),
    }
    env.pop("RAY_AUTH_TOKEN", None)
    ensure_ray_token(env)
    return env


#: the driver each side runs from its own tree: deploys that tree's app and holds it up until
#: its stdin closes (the measuring client is this tree's, the same for both sides)
DRIVER = """
import json, sys
import ray
from ray import serve
from deployments.app import build_app

args, port = json.loads(sys.argv[1]), int(sys.argv[2])
ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
serve.start(http_options={"host": "127.0.0.1", "port": port})
serve.run(build_app(args), name="pdserve", route_prefix="/", blocking=False)
print("deployed", flush=True)
sys.stdin.read()
serve.shutdown()
ray.shutdown()
"""


def load(url: str, arrivals: list[Any], streams: int, max_tokens: int) -> None:
    """``arrivals`` over ``streams`` closed-loop streams; any failed request ends the run (a
    refused request is cheap, and counting only the rest would flatter the ingress)."""
    import asyncio

    from bench.live.routing import closed_loop

    failed = [
        r.error for r in asyncio.run(closed_loop(url, arrivals, streams, max_tokens)) if not r.ok
    ]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(arrivals)} requests failed, e.g. {failed[0]}")


def run_once(
    tree: Path, folder: Path, streams: int, requests: int, seed: int, port: int = 8766
) -> dict[str, Any]:
    """Deploy ``tree``'s app, run ``requests`` closed-loop requests over ``streams`` streams
    (after a discarded warm-up of as many), and return the ingress's stats of that load."""
    import random

    from bench.live.routing import (
        app_args,
        get_json,
        model_vocab,
        reset_stats,
        wait_gone,
        wait_ready,
    )
    from bench.workloads.rag import RagMix, rag_mix
    from deployments.config import load_app_config

    # bench routing's app (two Fairway prefill replicas on core 0, one TWP decode replica on
    # core 1, the memory index, keys off on loopback) on the test model
    args = app_args("test", 2, None)
    cfg = load_app_config(args)
    env = {**token_env(folder), "PYTHONPATH": str(tree)}
    proc = subprocess.Popen(
        [sys.executable, "-c", DRIVER, json.dumps(args), str(port)],
        cwd=tree,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, cfg.prefill.num_replicas)
        mix = RagMix(requests=2 * requests, documents=8, doc_blocks=4, seed=seed, max_tokens=16)
        arrivals = rag_mix(mix, model_vocab(cfg.model.resolved_path()))
        rng = random.Random(seed)
        rng.shuffle(arrivals)
        load(url, arrivals[:requests], streams, mix.max_tokens)  # warm-up, discarded
        mark = reset_stats(url)["ingress"]["requests"]
        load(url, arrivals[requests:], streams, mix.max_tokens)
        s = get_json(url, "/v1/pdserve/stats")["ingress"]
        if s["requests"] - mark != requests:
            raise RuntimeError(f"{tree}: the ingress counted {s['requests'] - mark} of {requests}")
        return {
            "streams": streams,
            "requests": s["requests"] - mark,
            "ingress_overhead_s": s["overhead_s"],
            "phases_s": s["phases_s"],
        }
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
        wait_gone("ServeReplica:pdserve:")


def summary(runs: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Per phase (and ``overhead``), the median over runs of each run's p50 and p99 (s)."""
    out: dict[str, dict[str, float | None]] = {}
    for name in (*PHASES, "overhead"):
        per = [
            (r["ingress_overhead_s"] if name == "overhead" else r["phases_s"].get(name)) or {}
            for r in runs
        ]
        row: dict[str, float | None] = {}
        for q in ("p50", "p99"):
            xs = [p[q] for p in per if p.get(q) is not None]
            row[q] = statistics.median(xs) if xs else None
        out[name] = row
    return out


def ratios(
    before: dict[str, dict[str, float | None]], after: dict[str, dict[str, float | None]]
) -> dict[str, dict[str, float | None]]:
    """``after / before`` per phase and quantile (None where either is missing or 0)."""
    out: dict[str, dict[str, float | None]] = {}
    for name, b in before.items():
        a = after.get(name, {})
        row: dict[str, float | None] = {}
        for q in ("p50", "p99"):
            x, y = a.get(q), b.get(q)
            row[q] = x / y if x is not None and y else None
        out[name] = row
    return out


def run(
    repo: Path,
    before: str,
    after: str | None,
    *,
    rounds: int = 3,
    streams: int = 8,
    requests: int = 64,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """``rounds`` runs of each side, alternating (before first); ``after`` None is the working
    tree at ``repo`` itself. ``progress(label)`` is called after each run."""
    results: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory(prefix="pdserve-ab-") as tmp:
        base = Path(tmp)
        trees = {"before": worktree(repo, before, base / "before")}
        trees["after"] = worktree(repo, after, base / "after") if after else repo
        try:
            for k in range(rounds):
                for side in ("before", "after"):
                    results[side].append(run_once(trees[side], base, streams, requests, seed))
                    if progress:
                        progress(f"{side} round {k + 1} done")
        finally:
            drop_worktree(repo, base / "before")
            if after:
                drop_worktree(repo, base / "after")
    s_before, s_after = summary(results["before"]), summary(results["after"])
    return {
        "before": before,
        "after": after or "working tree",
        "rounds": rounds,
        "streams": streams,
        "runs": results,
        "summary": {"before": s_before, "after": s_after},
        "ratios": ratios(s_before, s_after),
    }


def plot(res: dict[str, Any], path: Path) -> None:
    """Per phase, the p50 and p99 ms of both sides (bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = [n for n in (*PHASES, "overhead") if res["summary"]["before"][n]["p50"] is not None]
    x = np.arange(len(names))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=False)
    for ax, q in zip(axes, ("p50", "p99"), strict=True):
        for j, side in enumerate(("before", "after")):
            ys = [1e3 * (res["summary"][side][n][q] or 0.0) for n in names]
            ax.bar(x + (j - 0.5) * 0.38, ys, 0.38, label=f"{side} ({res[side]})"[:40])
        ax.set_xticks(x, names, rotation=30, ha="right")
        ax.set_ylabel(f"{q} ms (median over {res['rounds']} rounds)")
        ax.set_title(f"ingress time outside the engines, {q}")
        ax.legend(fontsize=8)
    fig.suptitle(f"{res['streams']} closed-loop streams, test model, live app")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
