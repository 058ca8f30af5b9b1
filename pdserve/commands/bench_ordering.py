"""``pdserve bench ordering``: per-step ordering cost of prefill policies."""

from __future__ import annotations

from pathlib import Path

import typer

from pdserve.apps import bench_app
from pdserve.output import csv_ints, csv_known, table, write_json


@bench_app.command("ordering")
def ordering(
    waiting: str = typer.Option("100,1000,10000", help="Queue sizes, comma-separated."),
    policies: str = typer.Option("fcfs,lpm,fairway", help="Prefill policies, comma-separated."),
    steps: int = typer.Option(0, min=0, help="Steps per size (0: scaled to the size)."),
    seed: int = typer.Option(0, help="Seed of the synthetic queue."),
    json_out: Path | None = typer.Option(None, "--json", help="Write the results as JSON here."),
) -> None:
    """Median time of one ``order()`` call per step, at each queue size."""
    from bench.micro.ordering import run
    from controllers.prefill import prefill_policy_names

    names = csv_known(policies, prefill_policy_names(), "policies", "--policies")
    sizes = csv_ints(waiting)
    res = run(names, sizes, steps or None, seed)
    typer.echo(
        table(
            ["policy", *[f"{n} waiting (ms)" for n in sizes]],
            [[p, *[res["policies"][p][str(n)] for n in sizes]] for p in names],
        )
    )
    write_json(json_out, res)
