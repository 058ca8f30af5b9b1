"""``pdserve sim prefill``: the step-level prefill simulator over scenarios and traces."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from bench.report.prefill import DEFAULT_POLICIES as _POLICIES
from pdserve.apps import sim_app
from pdserve.output import csv_known, table, write_json

DEFAULT_POLICIES = ",".join(_POLICIES)


@sim_app.command("prefill")
def sim_prefill(
    scenario: str | None = typer.Option(
        None, help="Scenario name (see --list); 'grid' runs every grid scenario."
    ),
    trace: Path | None = typer.Option(None, help="Replay a trace file instead of a scenario."),
    trace_format: str = typer.Option("mooncake", help="Trace format: mooncake or azure."),
    policies: str = typer.Option(DEFAULT_POLICIES, help="Prefill policies, comma-separated."),
    seed: int = typer.Option(0, help="Seed of the workload generator."),
    load: float | None = typer.Option(
        None,
        min=0.01,
        help="Scenarios: multiplier on every phase's load (default 1). Traces: target "
        "utilisation, arrivals scaled to load x FCFS capacity (default 0.9).",
    ),
    cache_fraction: float | None = typer.Option(
        None, min=0.001, help="KV cache size as a fraction of the reusable content."
    ),
    limit: int | None = typer.Option(None, min=1, help="Traces: replay the first N requests."),
    max_context: int = typer.Option(32_768, min=1, help="Traces: cap prompts at this length."),
    profile: str = typer.Option("a6000_llama31_8b", help="Engine profile: shipped name or path."),
    quick: bool = typer.Option(False, help="A short seeded smoke run."),
    list_: bool = typer.Option(False, "--list", help="List the scenarios and exit."),
    json_out: Path | None = typer.Option(None, "--json", help="Write the results as JSON here."),
    plot_out: Path | None = typer.Option(None, "--plot", help="Write a PNG plot here."),
    progress: bool = typer.Option(True, help="Show a progress bar."),
) -> None:
    """Simulate prefill orderings (Fairway and baselines) on one engine. Output is simulated."""
    from bench.workloads.prefill_scenarios import GRID_SCENARIOS, SCENARIOS

    if list_:
        typer.echo(
            table(
                ["scenario", "description"], [[s.name, s.description] for s in SCENARIOS.values()]
            )
        )
        return
    from bench.sim.profiles import load_profile
    from controllers.prefill import prefill_policy_names

    names = csv_known(policies, prefill_policy_names(), "policies", "--policies")
    if (scenario is None) == (trace is None):
        raise typer.BadParameter(
            "give exactly one of --scenario or --trace", param_hint="--scenario"
        )
    if scenario is not None and scenario != "grid" and scenario not in SCENARIOS:
        raise typer.BadParameter(
            f"unknown scenario {scenario!r}; known: grid, {', '.join(SCENARIOS)}",
            param_hint="--scenario",
        )
    if trace_format not in ("mooncake", "azure"):
        raise typer.BadParameter("must be mooncake or azure", param_hint="--trace-format")
    try:
        prof = load_profile(profile)
    except (FileNotFoundError, ValueError) as e:
        raise typer.BadParameter(str(e), param_hint="--profile") from None

    if scenario == "grid":
        _grid(
            list(GRID_SCENARIOS), names, prof, seed, load, cache_fraction, quick, json_out, progress
        )
        return
    work = workload_from_options(
        scenario, trace, trace_format, prof, seed, load, cache_fraction, limit, max_context, quick
    )
    _single(work, names, prof, seed, json_out, plot_out, progress)


def workload_from_options(
    scenario: str | None,
    trace: Path | None,
    trace_format: str,
    prof: Any,
    seed: int,
    load: float | None,
    cache_fraction: float | None,
    limit: int | None,
    max_context: int,
    quick: bool,
) -> Any:
    """The workload the scenario or trace options describe (shared by ``sim prefill`` and
    ``sim cluster``); a trace that cannot be read is a ``--trace`` error."""
    from bench.workloads.prefill_scenarios import azure_workload, build_scenario, mooncake_workload
    from bench.workloads.traces import TraceFormatError, load_azure, load_mooncake

    if scenario is not None:
        return build_scenario(
            scenario,
            seed=seed,
            quick=quick,
            profile=prof,
            load=load or 1.0,
            cache_fraction=cache_fraction,
        )
    assert trace is not None
    n = limit if limit is not None else (200 if quick else None)
    try:
        if trace_format == "mooncake":
            recs = load_mooncake(trace, limit=n)
            return mooncake_workload(
                recs,
                prof,
                load=load or 0.9,
                cache_fraction=cache_fraction or 0.3,
                max_context=max_context,
            )
        recs = load_azure(trace, limit=n)
        return azure_workload(recs, prof, load=load or 0.9, max_context=max_context)
    except (OSError, TraceFormatError) as e:
        raise typer.BadParameter(str(e), param_hint="--trace") from None


def _single(
    work: Any,
    names: list[str],
    prof: Any,
    seed: int,
    json_out: Path | None,
    plot_out: Path | None,
    progress: bool,
) -> None:
    from bench.report.prefill import plot, run_workload, stat_rows

    report, runs = run_workload(work, names, prof, seed=seed, progress=progress)
    typer.echo(f"{work.name} (simulated), seed {seed}, {len(work.requests)} requests")
    for note in work.notes:
        typer.echo(f"  {note}")
    headers, rows = stat_rows(report, list(work.keys))
    typer.echo(table(headers, rows))
    write_json(json_out, report)
    if plot_out is not None:
        plot(plot_out, runs, work)
        typer.echo(f"wrote {plot_out}")


def _grid(
    cells: list[str],
    names: list[str],
    prof: Any,
    seed: int,
    load: float | None,
    cache_fraction: float | None,
    quick: bool,
    json_out: Path | None,
    progress: bool,
) -> None:
    from tqdm import tqdm

    from bench.report.prefill import grid_row, run_workload
    from bench.workloads.prefill_scenarios import build_scenario

    if "fairway" not in names:
        raise typer.BadParameter(
            "the grid compares 'fairway' with the baselines", param_hint="--policies"
        )
    reports: dict[str, Any] = {}
    rows = []
    for cell in tqdm(cells, desc="grid (simulated)", disable=not progress):
        work = build_scenario(
            cell,
            seed=seed,
            quick=quick,
            profile=prof,
            load=load or 1.0,
            cache_fraction=cache_fraction,
        )
        rep, _ = run_workload(work, names, prof, seed=seed, progress=False)
        reports[cell] = rep
        rows.append(grid_row(rep))
    typer.echo(f"grid (simulated), seed {seed}: Fairway p99 vs the best non-starving baseline")
    typer.echo(
        table(
            ["scenario", "fairway p99", "starved", "best baseline", "its p99", "delta"],
            [
                [
                    r["scenario"],
                    _fmt(r["policy_p99_s"]),
                    "yes" if r["policy_starved"] else "no",
                    r["best_baseline"] or "-",
                    _fmt(r["best_baseline_p99_s"]),
                    f"{100 * r['delta']:+.1f}%" if r["delta"] is not None else "-",
                ]
                for r in rows
            ],
        )
    )
    write_json(
        json_out,
        {"simulated": True, "scenario": "grid", "seed": seed, "rows": rows, "cells": reports},
    )


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"
