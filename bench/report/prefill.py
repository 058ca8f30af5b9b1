"""Run policies over a workload and report them (simulated): STATS, targets, grid, plots.

JSON shape of :func:`run_workload`::

    {"simulated": true, "scenario": NAME, "seed": N, "notes": [...],
     "policies": {POLICY: {"ttft": {"all": STATS, KEY: STATS, ...},
                           "worst_wait_s": x, "starved": bool, "unfinished": n}},
     "six_targets": {POLICY: {"met": k, "of": 6, "detail": {...}}}   # phased scenarios
    }

``STATS`` is :func:`bench.report.stats.summarize` in seconds. ``worst_wait_s`` is the largest
TTFT; ``starved`` is ``worst_wait_s > 3 x`` the policy's own p99.

The paper's six targets (``calm``, ``burst``, ``spike``): in each phase, a median at most
1.1 x LPM's and a p99 at most 1.1 x FCFS's (so LPM and FCFS need to be in the run).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from bench.report.stats import summarize
from bench.sim.prefill import EngineConfig, RunResult, simulate
from bench.workloads.prefill_scenarios import Workload
from controllers.config import FairwayConfig
from controllers.profile import EngineProfile

#: The policies a prefill report compares by default (Fairway and its baselines).
DEFAULT_POLICIES = ("fcfs", "lpm", "klpm4", "klpm8", "ragcache", "preble", "peek", "fairway")
TARGET_PHASES = ("calm", "burst", "spike")
STARVED_FACTOR = 3.0
TARGET_MARGIN = 1.1


def band_factors(rel: float, points: int) -> list[float]:
    """``points`` step-cost scales evenly spaced from ``1 - rel`` to ``1 + rel`` (1 among
    them when ``points`` is odd): where a prediction's band is simulated."""
    return [1.0 - rel + 2.0 * rel * k / max(1, points - 1) for k in range(points)]


def policy_report(res: RunResult, keys: Sequence[str]) -> dict[str, Any]:
    """STATS per key, worst wait and the starvation flag of one run."""
    ttft: dict[str, Any] = {"all": summarize(res.ttfts())}
    for k in keys:
        ttft[k] = summarize(res.ttfts(k))
    worst = ttft["all"]["max"]
    p99 = ttft["all"]["p99"]
    starved = bool(worst is not None and p99 is not None and worst > STARVED_FACTOR * p99)
    return {
        "ttft": ttft,
        "worst_wait_s": worst,
        "starved": starved,
        "unfinished": len(res.unfinished),
    }


def six_targets(policies: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]] | None:
    """Count the paper's six targets per policy; None without LPM and FCFS or phases."""
    if "lpm" not in policies or "fcfs" not in policies:
        return None
    lpm, fcfs = policies["lpm"]["ttft"], policies["fcfs"]["ttft"]
    if any(ph not in lpm or not lpm[ph]["n"] for ph in TARGET_PHASES):
        return None
    out: dict[str, dict[str, Any]] = {}
    for name, rep in policies.items():
        detail: dict[str, bool] = {}
        for ph in TARGET_PHASES:
            s = rep["ttft"][ph]
            detail[f"{ph}_p50"] = bool(s["p50"] <= TARGET_MARGIN * lpm[ph]["p50"])
            detail[f"{ph}_p99"] = bool(s["p99"] <= TARGET_MARGIN * fcfs[ph]["p99"])
        out[name] = {"met": sum(detail.values()), "of": len(detail), "detail": detail}
    return out


def run_workload(
    work: Workload,
    policies: Sequence[str],
    profile: EngineProfile,
    *,
    seed: int,
    fairway_config: FairwayConfig | None = None,
    progress: bool = True,
) -> tuple[dict[str, Any], dict[str, RunResult]]:
    """Simulate every policy on ``work``; returns the JSON report and the raw runs."""
    cfg = EngineConfig(token_budget=profile.token_budget, block_size=work.block_size)
    runs: dict[str, RunResult] = {}
    reps: dict[str, dict[str, Any]] = {}
    bar = tqdm(policies, desc=f"simulating {work.name}", disable=not progress, leave=False)
    for name in bar:
        bar.set_postfix_str(name)
        res = simulate(
            work.requests,
            name,
            profile,
            work.cache_blocks,
            config=cfg,
            fairway_config=fairway_config,
            warm=work.warm,
        )
        runs[name] = res
        reps[name] = policy_report(res, work.keys)
    out: dict[str, Any] = {
        "simulated": True,
        "scenario": work.name,
        "seed": seed,
        "requests": len(work.requests),
        "block_size": work.block_size,
        "cache_blocks": work.cache_blocks,
        "capacity_rps": work.capacity_rps,
        "notes": list(work.notes),
        "policies": reps,
    }
    targets = six_targets(reps)
    if targets is not None:
        out["six_targets"] = targets
    return out, runs


def non_starving_best(policies: dict[str, dict[str, Any]], exclude: Sequence[str]) -> str | None:
    """The baseline with the lowest p99 among those that do not starve (None if all do)."""
    cands = [
        (rep["ttft"]["all"]["p99"], name)
        for name, rep in policies.items()
        if name not in exclude and not rep["starved"] and rep["ttft"]["all"]["p99"] is not None
    ]
    return min(cands)[1] if cands else None


def is_fairway_family(name: str) -> bool:
    """Fairway, its ablations and its cross-step variants: never a baseline in the grid."""
    return name.startswith("fairway")


def grid_row(report: dict[str, Any], policy: str = "fairway") -> dict[str, Any]:
    """Fairway's p99 against the best non-starving baseline of one scenario."""
    pols = report["policies"]
    best = non_starving_best(pols, exclude=[p for p in pols if is_fairway_family(p)])
    mine = pols[policy]["ttft"]["all"]["p99"]
    theirs = pols[best]["ttft"]["all"]["p99"] if best else None
    delta = (mine / theirs - 1.0) if theirs else None
    return {
        "scenario": report["scenario"],
        "policy_p99_s": mine,
        "policy_starved": pols[policy]["starved"],
        "best_baseline": best,
        "best_baseline_p99_s": theirs,
        "delta": delta,
    }


def stat_rows(report: dict[str, Any], keys: Sequence[str]) -> tuple[list[str], list[list[Any]]]:
    """A table: per policy, n/p50/p99 of every key, worst wait, starved, targets met."""
    headers = ["policy (simulated)"]
    for k in ["all", *keys]:
        headers += [f"{k} n", f"{k} p50", f"{k} p99"]
    headers += ["worst", "starved"]
    targets = report.get("six_targets")
    if targets:
        headers.append("targets")
    rows: list[list[Any]] = []
    for name, rep in report["policies"].items():
        row: list[Any] = [name]
        for k in ["all", *keys]:
            s = rep["ttft"][k]
            row += [s["n"], _r(s["p50"]), _r(s["p99"])]
        row += [_r(rep["worst_wait_s"]), "yes" if rep["starved"] else "no"]
        if targets:
            row.append(f"{targets[name]['met']}/6")
        rows.append(row)
    return headers, rows


def _r(x: float | None) -> float | str:
    return "-" if x is None else round(float(x), 2)


def plot(path: Path, runs: dict[str, RunResult], work: Workload, title: str | None = None) -> None:
    """PNG: TTFT CDFs per policy, and TTFT over arrival time (rolling p50/p99) with phases."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    for i, (name, res) in enumerate(runs.items()):
        style = ("-", "--", ":")[(i // 10) % 3]  # the colour cycle has ten colours
        t = np.sort(np.asarray(res.ttfts()))
        if t.size:
            ax1.plot(t, np.arange(1, t.size + 1) / t.size, style, label=name)
        arr = sorted((f.arrival_s, f.ttft_s) for f in res.finished)
        if len(arr) >= 10:
            xs = np.array([a for a, _ in arr])
            ys = np.array([y for _, y in arr])
            w = max(5, len(arr) // 40)
            p99 = [np.percentile(ys[max(0, i - w) : i + 1], 99) for i in range(len(ys))]
            ax2.plot(xs, p99, style, label=f"{name} p99", lw=1)
    ax1.set_xscale("log")
    ax1.set_xlabel("TTFT (s, simulated)")
    ax1.set_ylabel("fraction of requests")
    ax1.set_title("TTFT CDF")
    ax1.legend(fontsize=7)
    for i, (name, a, b) in enumerate(work.phases):
        ax2.axvspan(a, b, alpha=0.08 * (1 + i % 3), color="grey")
        ax2.text(a, 0.98, name, transform=ax2.get_xaxis_transform(), fontsize=8, va="top")
    ax2.set_yscale("log")
    ax2.set_xlabel("arrival time (s, simulated)")
    ax2.set_ylabel("rolling p99 TTFT (s)")
    ax2.set_title("TTFT over time")
    ax2.legend(fontsize=6, ncol=2)
    fig.suptitle(title or f"{work.name} (simulated)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
