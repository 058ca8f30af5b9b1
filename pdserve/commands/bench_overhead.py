"""``pdserve bench overhead``: two commits' ingress overhead per phase, side by side."""

from __future__ import annotations

from pathlib import Path

import typer

from pdserve.apps import bench_app
from pdserve.output import table, write_json


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1e3 * x:.2f}"


def _x(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


@bench_app.command("overhead")
def overhead(
    before: str = typer.Option(..., help="The commit (or ref) to compare against."),
    after: str | None = typer.Option(
        None, help="The commit to measure (default: this working tree)."
    ),
    rounds: int = typer.Option(3, min=1, max=10, help="Runs of each side, alternating."),
    streams: int = typer.Option(8, min=1, max=64, help="Closed-loop streams."),
    requests: int = typer.Option(
        64, min=8, help="Measured requests per run (after as many to warm)."
    ),
    json_out: Path | None = typer.Option(None, "--json", help="Write the results as JSON here."),
    plot: Path | None = typer.Option(None, "--plot", help="Write the per-phase bars (PNG) here."),
) -> None:
    """The ingress's time outside the engines, per phase, for two commits of this repository
    on the live app (the ``test`` model), run alternately; reports ``after / before``."""
    import subprocess

    from tqdm import tqdm

    from bench.live.overhead_ab import PHASES, run
    from bench.live.overhead_ab import plot as plot_bars

    top = subprocess.run(
        ["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=False
    )
    if top.returncode != 0:
        raise typer.BadParameter("run it inside the pdserve repository", param_hint="--before")
    repo = Path(top.stdout.strip())
    for ref in (before, after):
        if (
            ref is not None
            and subprocess.run(
                ["git", "-C", str(repo), "rev-parse", "--verify", f"{ref}^{{commit}}"],
                capture_output=True,
                check=False,
            ).returncode
        ):
            raise typer.BadParameter(f"{ref!r} is not a commit here", param_hint="--before/--after")
    bar = tqdm(total=2 * rounds, desc="overhead A/B", unit="run")

    def step(label: str) -> None:
        bar.set_postfix_str(label)
        bar.update(1)

    res = run(repo, before, after, rounds=rounds, streams=streams, requests=requests, progress=step)
    bar.close()
    write_json(json_out, res)
    rows = []
    for name in (*PHASES, "overhead"):
        b, a, r = (
            res["summary"]["before"][name],
            res["summary"]["after"][name],
            res["ratios"][name],
        )
        if b["p50"] is None and a["p50"] is None:
            continue
        rows.append(
            [
                name,
                _ms(b["p50"]),
                _ms(a["p50"]),
                _x(r["p50"]),
                _ms(b["p99"]),
                _ms(a["p99"]),
                _x(r["p99"]),
            ]
        )
    typer.echo(
        table(
            ["phase", "before p50 ms", "after p50 ms", "x", "before p99 ms", "after p99 ms", "x"],
            rows,
        )
    )
    if plot is not None:
        plot_bars(res, plot)
        typer.echo(f"wrote {plot}")
