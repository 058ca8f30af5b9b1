"""The trade-off sweep of ``fairway_xstep`` (simulated): median against worst wait as the
bypass share moves, beside FCFS, LPM and the paper's Fairway on the same workloads.

For each scenario the sweep runs the references and ``fairway_xstep`` at every share on the
same prefill simulator (:func:`bench.sim.prefill.simulate`) and reports, per run, one point:

- ``flood``: ``median_s`` = the flood requests' p50 TTFT, ``worst_s`` = the backlog's worst
  TTFT (the issue's two flood figures);
- a phased scenario (``sec-spike``...): ``median_s`` = the ``spike`` phase's p50,
  ``worst_s`` = the worst TTFT of the run, plus the six targets met;
- anything else: p50 and worst over all requests.

JSON shape::

    {"simulated": true, "shares": [...],
     "scenarios": {"NAME/sSEED": {"median_key": K, "worst_key": K,
                                  "points": [{"policy", "share", "median_s", "worst_s",
                                              "p99_s", "starved", "targets_met"}, ...]}}}
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from bench.report.prefill import policy_report, six_targets
from bench.sim.prefill import EngineConfig, simulate
from bench.workloads.prefill_scenarios import Workload, build_scenario
from controllers.config import FairwayConfig
from controllers.prefill import PrefillPolicy, make_prefill_policy
from controllers.prefill.xstep import FairwayXStep, XStepConfig
from controllers.profile import EngineProfile

REFERENCES = ("fcfs", "lpm", "fairway")
DEFAULT_SHARES = (0.0, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 3.0)


def point_keys(work: Workload) -> tuple[str, str]:
    """(median key, worst key) of a workload's trade-off point (see the module docstring)."""
    if "backlog" in work.keys and "flood" in work.keys:
        return "flood", "backlog"
    if "spike" in work.keys:
        return "spike", "all"
    return "all", "all"


def _policies(shares: Sequence[float]) -> list[tuple[str, float | None]]:
    return [(n, None) for n in REFERENCES] + [(f"fairway_xstep@{s:g}", s) for s in shares]


def sweep_workload(
    work: Workload,
    shares: Sequence[float],
    profile: EngineProfile,
    *,
    fairway_config: FairwayConfig | None = None,
    base: XStepConfig | None = None,
    bar: Any = None,
) -> dict[str, Any]:
    """Run the references and every share on ``work``; return its points (simulated).

    ``base``: the variant's other settings (``fast_score``, ``cached_share``...); only
    ``bypass_share`` moves.
    """
    fw = fairway_config or FairwayConfig()
    xs = base or XStepConfig()
    cfg = EngineConfig(token_budget=profile.token_budget, block_size=work.block_size)
    med_key, worst_key = point_keys(work)
    reps: dict[str, dict[str, Any]] = {}
    share_of: dict[str, float | None] = {}
    for name, share in _policies(shares):
        pol: PrefillPolicy
        if share is None:
            pol = make_prefill_policy(name, profile, fw)
        else:
            pol = FairwayXStep(xs.model_copy(update={"bypass_share": share}), fw, name=name)
        if bar is not None:
            bar.set_postfix_str(f"{work.name} {name}")
        res = simulate(
            work.requests,
            pol,
            profile,
            work.cache_blocks,
            config=cfg,
            fairway_config=fw,
            warm=work.warm,
        )
        reps[name] = policy_report(res, work.keys)
        share_of[name] = share
        if bar is not None:
            bar.update(1)
    targets = six_targets(reps) or {}
    points = []
    for name, rep in reps.items():
        t = rep["ttft"]
        points.append(
            {
                "policy": name,
                "share": share_of[name],
                "median_s": t[med_key]["p50"],
                "worst_s": t[worst_key]["max"],
                "p99_s": t["all"]["p99"],
                "starved": rep["starved"],
                "targets_met": targets[name]["met"] if name in targets else None,
            }
        )
    return {"median_key": med_key, "worst_key": worst_key, "points": points}


def run_sweep(
    scenarios: Sequence[str],
    seeds: Sequence[int],
    shares: Sequence[float],
    profile: EngineProfile,
    *,
    quick: bool = False,
    progress: bool = True,
    base: XStepConfig | None = None,
) -> dict[str, Any]:
    """The sweep over ``scenarios x seeds`` (``flood`` runs seed ``seeds[0]`` only)."""
    xs = base or XStepConfig()
    cells = [(s, d) for s in scenarios for d in (seeds[:1] if s == "flood" else seeds)]
    total = len(cells) * (len(REFERENCES) + len(shares))
    out: dict[str, Any] = {
        "simulated": True,
        "shares": list(shares),
        "variant": xs.model_dump(exclude={"bypass_share"}),
        "scenarios": {},
    }
    with tqdm(total=total, desc="trade-off sweep (simulated)", disable=not progress) as bar:
        for name, seed in cells:
            work = build_scenario(name, seed=seed, quick=quick, profile=profile)
            out["scenarios"][f"{name}/s{seed}"] = sweep_workload(
                work, shares, profile, base=xs, bar=bar
            )
    return out


def rows(report: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    """A table: per scenario and policy, median, worst, p99, starved, targets met."""
    headers = [
        "scenario (simulated)",
        "policy",
        "median (s)",
        "worst (s)",
        "p99 (s)",
        "starved",
        "targets",
    ]
    out: list[list[Any]] = []
    for cell, rep in report["scenarios"].items():
        for p in rep["points"]:
            out.append(
                [
                    f"{cell} [{rep['median_key']} p50 / {rep['worst_key']} max]",
                    p["policy"],
                    _r(p["median_s"]),
                    _r(p["worst_s"]),
                    _r(p["p99_s"]),
                    "yes" if p["starved"] else "no",
                    "-" if p["targets_met"] is None else f"{p['targets_met']}/6",
                ]
            )
    return headers, out


def _r(x: float | None) -> float | str:
    return "-" if x is None else round(float(x), 2)


def plot(path: Path, report: dict[str, Any]) -> None:
    """PNG: per scenario, fairway_xstep's (worst, median) curve over the share, labelled,
    with FCFS, LPM and Fairway as reference markers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = list(report["scenarios"].items())
    fig, axes = plt.subplots(1, len(cells), figsize=(5.2 * len(cells), 4.6), squeeze=False)
    marks = {"fcfs": "s", "lpm": "^", "fairway": "D"}
    for ax, (cell, rep) in zip(axes[0], cells, strict=True):
        pts = [p for p in rep["points"] if p["share"] is not None and p["median_s"] is not None]
        xs = [p["worst_s"] for p in pts]
        ys = [p["median_s"] for p in pts]
        ax.plot(xs, ys, "o-", color="tab:blue", label="fairway_xstep (share)")
        for p in pts:
            ax.annotate(
                f"{p['share']:g}",
                (p["worst_s"], p["median_s"]),
                fontsize=7,
                xytext=(3, 3),
                textcoords="offset points",
            )
        for p in rep["points"]:
            if p["share"] is None and p["median_s"] is not None:
                ax.plot(
                    p["worst_s"],
                    p["median_s"],
                    marks.get(p["policy"], "x"),
                    ms=8,
                    label=p["policy"],
                )
        ax.set_xlabel(f"worst TTFT of '{rep['worst_key']}' (s, simulated)")
        ax.set_ylabel(f"median TTFT of '{rep['median_key']}' (s, simulated)")
        ax.set_title(cell, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    v = report.get("variant", {})
    extra = ", ".join(f"{k}={v[k]}" for k in ("fast_score", "cached_share") if k in v)
    fig.suptitle(
        f"fairway_xstep ({extra}) trade-off: median vs worst wait as bypass_share moves (simulated)"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
