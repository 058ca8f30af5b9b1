"""``pdserve bench fuzz``: fuzz a live endpoint's HTTP API from its OpenAPI schema."""

from __future__ import annotations

from pathlib import Path

import typer

from pdserve.apps import bench_app
from pdserve.output import table, write_json


@bench_app.command("fuzz")
def fuzz_cmd(
    endpoint: str = typer.Option("http://127.0.0.1:8000", help="The app's base URL."),
    key: str | None = typer.Option(
        None, help="API key of a tenant with small caps (max_tokens, max_context_tokens)."
    ),
    examples: int = typer.Option(50, min=1, help="Cases per operation and generation mode."),
    modes: str = typer.Option("positive,negative", help="Generation modes, comma-separated."),
    seed: int = typer.Option(0, help="Hypothesis seed (the same seed sends the same cases)."),
    out: Path | None = typer.Option(None, help="Write the report here as JSON."),
) -> None:
    """Send schemathesis-generated requests to every operation; count statuses and 5xx.

    Exits 1 when any request got a 5xx, timed out or lost its connection."""
    from bench.live.fuzz_api import fuzz

    picked = tuple(m.strip() for m in modes.split(",") if m.strip())
    bad = [m for m in picked if m not in ("positive", "negative")]
    if bad or not picked:
        raise typer.BadParameter(f"--modes: {bad or modes!r}; use positive and/or negative")
    rep = fuzz(endpoint, key, examples=examples, modes=picked, seed=seed)
    statuses = sorted(rep.by_status)
    rows = [
        [op, sum(c.values()), *[c.get(s, 0) for s in statuses]]
        for op, c in rep.by_operation.items()
    ]
    typer.echo(table(["operation", "cases", *map(str, statuses)], rows))
    typer.echo(f"cases: {rep.cases}  5xx or no answer: {rep.server_errors}")
    for f in rep.failures[:10]:
        typer.echo(f"  {f['operation']} ({f['mode']}): {f['status']} {f['response'][:120]}")
        typer.echo(f"    {f['curl'][:400]}")
    write_json(out, rep.as_dict())
    if rep.server_errors:
        raise typer.Exit(1)
