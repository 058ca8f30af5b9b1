"""The shared Typer apps that command modules attach to."""

from __future__ import annotations

import typer

app = typer.Typer(
    help="pdserve: disaggregated prefill/decode serving with Fairway and TWP.", no_args_is_help=True
)
sim_app = typer.Typer(
    help="Step-level simulators (every output says 'simulated').", no_args_is_help=True
)
bench_app = typer.Typer(
    help="Benchmarks that compare policies or systems side by side.", no_args_is_help=True
)
app.add_typer(sim_app, name="sim")
app.add_typer(bench_app, name="bench")
