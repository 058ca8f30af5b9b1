"""``pdserve sim tradeoff``: fairway_xstep's median against worst wait as its share moves."""

from __future__ import annotations

from pathlib import Path

import typer

from pdserve.apps import sim_app
from pdserve.output import csv_ints, csv_list, csv_numbers, table, write_json


def _shares(value: str) -> list[float]:
    return csv_numbers(value, float, "shares")


@sim_app.command("tradeoff")
def sim_tradeoff(
    scenarios: str = typer.Option(
        "flood,sec-spike", help="Scenarios, comma-separated (flood runs the first seed only)."
    ),
    seeds: str = typer.Option("0,1", help="Workload seeds, comma-separated."),
    shares: str = typer.Option(
        "0,0.02,0.05,0.1,0.2,0.5,1,3", help="fairway_xstep bypass_share values, comma-separated."
    ),
    fast_score: str = typer.Option(
        "fairway", help="Fast-lane rank of the variant: fairway | cached | reuse."
    ),
    cached_share: float = typer.Option(
        0.0, min=0.0, help="Extra share for cached requests (held fixed while the share moves)."
    ),
    profile: str = typer.Option("a6000_llama31_8b", help="Engine profile: shipped name or path."),
    quick: bool = typer.Option(False, help="Short seeded smoke workloads."),
    json_out: Path | None = typer.Option(None, "--json", help="Write the points as JSON here."),
    plot_out: Path | None = typer.Option(None, "--plot", help="Write the trade-off PNG here."),
    progress: bool = typer.Option(True, help="Show a progress bar."),
) -> None:
    """Sweep fairway_xstep's bypass_share beside FCFS, LPM and Fairway. Output is simulated."""
    from bench.sim.profiles import load_profile
    from bench.sim.xstep_sweep import plot, rows, run_sweep
    from bench.workloads.prefill_scenarios import SCENARIOS
    from controllers.prefill.xstep import XStepConfig

    names = csv_list(scenarios)
    unknown = [s for s in names if s not in SCENARIOS]
    if unknown:
        raise typer.BadParameter(
            f"unknown scenarios {unknown}; known: {', '.join(SCENARIOS)}", param_hint="--scenarios"
        )
    seed_list = csv_ints(seeds)
    share_list = _shares(shares)
    try:
        prof = load_profile(profile)
    except (FileNotFoundError, ValueError) as e:
        raise typer.BadParameter(str(e), param_hint="--profile") from None
    if fast_score not in ("fairway", "cached", "reuse"):
        raise typer.BadParameter("must be fairway, cached or reuse", param_hint="--fast-score")
    base = XStepConfig.model_validate({"fast_score": fast_score, "cached_share": cached_share})
    report = run_sweep(
        names, seed_list, share_list, prof, quick=quick, progress=progress, base=base
    )
    typer.echo("fairway_xstep trade-off (simulated)")
    typer.echo(table(*rows(report)))
    write_json(json_out, report)
    if plot_out is not None:
        plot(plot_out, report)
        typer.echo(f"wrote {plot_out}")
