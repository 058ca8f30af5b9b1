"""``pdserve sim tenant-flood``: a 10x tenant flood at one prefill engine (simulated)."""

from __future__ import annotations

from pathlib import Path

import typer

from pdserve.apps import sim_app
from pdserve.output import table, write_json


@sim_app.command("tenant-flood")
def tenant_flood(
    seed: int = typer.Option(1, help="Workload seed."),
    b_load: float = typer.Option(0.3, min=0.01, max=0.95, help="Tenant B's load (x capacity)."),
    flood_factor: float = typer.Option(10.0, min=1.0, help="Tenant A's rate / B's rate."),
    duration_s: float = typer.Option(60.0, min=1.0, help="Arrival window (s)."),
    policies: str = typer.Option(
        "fairway,fairway+fair_share", help="Prefill policies (NAME or NAME+fair_share)."
    ),
    profile: str = typer.Option("a6000_llama31_8b", help="Engine profile: shipped name or path."),
    json_out: Path | None = typer.Option(None, "--json", help="Write the rows as JSON."),
    plot_out: Path | None = typer.Option(None, "--plot", help="Write B's TTFT CDFs (PNG)."),
    progress: bool = typer.Option(True, help="Show a progress bar."),
) -> None:
    """Tenant B alone, then B beside A's flood, per policy: B's TTFT. Output is simulated."""
    from bench.sim.profiles import load_profile
    from bench.sim.tenant_flood import LABEL, FloodSpec, plot, run
    from controllers.prefill import prefill_policy_names
    from controllers.prefill.registry import FAIR_SHARE_SUFFIX

    names = [p.strip() for p in policies.split(",") if p.strip()]
    known = prefill_policy_names()
    bad = [n for n in names if n.removesuffix(FAIR_SHARE_SUFFIX) not in known]
    if bad or not names:
        raise typer.BadParameter(
            f"unknown {bad or policies!r}; known: {', '.join(known)} (each may end in "
            f"{FAIR_SHARE_SUFFIX})",
            param_hint="--policies",
        )
    try:
        prof = load_profile(profile)
    except (FileNotFoundError, ValueError) as e:
        raise typer.BadParameter(str(e), param_hint="--profile") from None
    spec = FloodSpec(seed=seed, b_load=b_load, flood_factor=flood_factor, duration_s=duration_s)
    rows, ttfts, cap = run(spec, prof, names, progress=progress)
    typer.echo(
        f"[{LABEL}] capacity {cap:.2f} req/s; B at {b_load:g}x, A at {b_load * flood_factor:g}x"
    )
    typer.echo(
        table(
            ["run", "B reqs", "B p50 s", "B p99 s", "B p99 / alone", "A done", "A left"],
            [
                [r.run, r.b_requests, f"{r.b_p50_s:.2f}", f"{r.b_p99_s:.2f}",
                 f"{r.b_p99_vs_alone:.2f}", r.a_finished, r.a_unfinished]
                for r in rows
            ],
        )
    )  # fmt: skip
    write_json(
        json_out,
        {"simulated": True, "capacity_rps": cap, "spec": spec.__dict__,
         "rows": [r.__dict__ for r in rows]},
    )  # fmt: skip
    if plot_out is not None:
        plot_out.parent.mkdir(parents=True, exist_ok=True)
        plot(ttfts, str(plot_out), f"tenant flood, seed {seed}")
        typer.echo(f"wrote {plot_out}")
