"""``pdserve sim fidelity``: the simulators against the papers' headline figures."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from pdserve.apps import sim_app
from pdserve.output import csv_ints, table, write_json


@sim_app.command("fidelity")
def sim_fidelity(
    out: Path = typer.Option(Path("out/fidelity"), help="Folder for fidelity.md, JSON, PNGs."),
    seeds: str = typer.Option("3,4", help="Report seeds (held apart from calibration's 1,2)."),
    calibrate: bool = typer.Option(
        False,
        help="Re-run the calibration (baselines only, calibration seeds) first and put its "
        "log in the report; the frozen parameters in the code are what the report runs.",
    ),
    experiments: str = typer.Option(
        "spike,flood,twp", help="With --calibrate: which experiments to fit."
    ),
    quick: bool = typer.Option(False, help="Short phases (a quarter): a smoke run."),
    progress: bool = typer.Option(True, help="Show progress bars."),
) -> None:
    """Paper value, ours and the ratio for every headline figure of both papers, with the
    workload and engine model calibrated on the baselines only. Output is simulated."""
    from bench.sim import fidelity as fd

    report_seeds = csv_ints(seeds, "--seeds")
    cals: dict[str, dict] = {}
    if calibrate:
        names = [x.strip() for x in experiments.split(",") if x.strip()]
        unknown = [n for n in names if n not in fd.RUNNERS]
        if unknown or not names:
            raise typer.BadParameter(
                f"unknown {unknown or names}; known: {', '.join(fd.RUNNERS)}",
                param_hint="--experiments",
            )
        out.mkdir(parents=True, exist_ok=True)
        for name in names:
            cal = fd.calibrate(name, quick=quick, progress=progress)
            cals[name] = cal
            write_json(out / f"calibration_{name}.json", cal)
            frozen = fd.frozen_params(name)
            best = cal["best"]["params"]
            same = all(abs(float(best[k]) - float(frozen[k])) < 1e-12 for k in best)
            typer.echo(
                f"calibrated {name} (simulated): best {best} loss {cal['best']['loss']:.3f}; "
                f"frozen in the code: {frozen}" + ("" if same else "  <- DIFFERS")
            )
    else:
        for name in fd.RUNNERS:
            saved = out / f"calibration_{name}.json"
            if saved.exists():
                cals[name] = json.loads(saved.read_text())
    rep = fd.fidelity_report(out, report_seeds, quick=quick, calibration=cals, progress=progress)
    for name, rows in rep["sections"].items():
        typer.echo(f"\n{name} (simulated)")
        typer.echo(table(list(fd.HEADERS), rows))
    typer.echo(f"\nwrote {out / 'fidelity.md'}")
