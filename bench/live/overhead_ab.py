"""Two commits' ingress overhead side by side: the same closed-loop load on the live app, run
alternately from each commit's own tree (A B A B ...), so the machine's drift falls on both.

Each run is ``pdserve bench routing`` of that tree (its closed-loop phase: ``streams``
concurrent streams on the warm app, the ``test`` model, one policy), started in a process
whose ``PYTHONPATH`` is the tree, so its Ray workers import that tree's code and not the
installed one. What is compared is the ingress's own time per phase
(``/v1/pdserve/stats``' ``ingress.phases_s``: wall time outside the engines) and its total
overhead per request, as the median over rounds of each run's p50 and p99, and their ratios
``after / before``. Ratios in one run are the result; absolute times drift on shared cores.
"""

from __future__ import annotations

import json
import os
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


def run_once(tree: Path, out: Path, streams: int, requests: int, seed: int) -> dict[str, Any]:
    """One ``bench routing`` run of ``tree``'s code; its closed-loop summary."""
    cmd = [
        sys.executable,
        "-m",
        "pdserve",
        "bench",
        "routing",
        "--preset",
        "test",
        "--policies",
        "prefix_load",
        "--requests",
        str(requests),
        "--overhead-streams",
        str(streams),
        "--seed",
        str(seed),
        "--json",
        str(out),
    ]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    subprocess.run(cmd, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
    res = json.loads(out.read_text())
    first = next(iter(res["policies"].values()))
    if "closed_loop" not in first:
        raise RuntimeError(f"{tree}: the run has no closed-loop phase")
    return dict(first["closed_loop"])


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
    requests: int = 24,
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
                    out = base / f"{side}-{k}.json"
                    results[side].append(run_once(trees[side], out, streams, requests, seed))
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
