"""``pdserve sim decode``: TWP and its baselines in the decode simulator (simulated)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Literal

import typer

from pdserve.apps import sim_app
from pdserve.output import csv_known, table, write_json

if TYPE_CHECKING:
    from controllers.decode import TWPConfig


@sim_app.command("decode")
def decode(
    scenario: str | None = typer.Option(
        None, help="paper | low | medium | high | burst (or use --trace)."
    ),
    trace: Path | None = typer.Option(None, help="Replay a trace file instead of a scenario."),
    trace_format: str = typer.Option("azure", help="azure | mooncake (with --trace)."),
    mode: str = typer.Option("colocated", help="colocated | pd."),
    policies: str = typer.Option(
        "fcfs,round_robin,priority,dynamic_batch,serverlessllm,twp",
        help="Decode policies, comma-separated.",
    ),
    runs: int | None = typer.Option(
        None, min=1, help="Runs per policy (default 10 for low/medium/high/burst, else 1)."
    ),
    seed: int = typer.Option(0, help="Seed of the first run (run k uses seed + k)."),
    load: float | None = typer.Option(
        None,
        min=0.01,
        help="Load: fraction of FCFS's saturated rate (scenarios, trace); paper: x 18 req/s.",
    ),
    max_requests: int | None = typer.Option(
        2000, min=1, help="With --trace: replay only the first N records."
    ),
    profile: str = typer.Option("v100_llama32_3b", help="Engine profile (shipped name or JSON)."),
    l_bar: int = typer.Option(50, min=1, help="TWP's expected mean output L_bar (paper: 50)."),
    warm: int = typer.Option(
        1, min=0, help="Containers warm at t = 0 (of 4); 4 isolates admission from cold starts."
    ),
    twp_set: str = typer.Option(
        "", "--twp", help="TWP settings to override, e.g. 'H_max=400,survival_l_hat=true'."
    ),
    quick: bool = typer.Option(False, help="20 s of arrivals and at most 2 runs."),
    json_out: Path | None = typer.Option(None, "--json", help="Write results as JSON here."),
    plot_out: Path | None = typer.Option(None, "--plot", help="Write a PNG plot here."),
) -> None:
    """Simulate decode admission over a serverless pool; every output is simulated."""
    from bench.sim.decode import DecodeSimConfig, Experiment, plot, run_experiment, table_rows
    from bench.sim.profiles import load_profile
    from bench.sim.serverless_pool import PoolConfig
    from bench.workloads.traces import load_azure, load_mooncake
    from controllers.decode import decode_policy_names

    if (scenario is None) == (trace is None):
        raise typer.BadParameter(
            "give exactly one of --scenario or --trace", param_hint="--scenario"
        )
    if mode not in ("colocated", "pd"):
        raise typer.BadParameter(f"expected colocated or pd, got {mode!r}", param_hint="--mode")
    names = csv_known(policies, decode_policy_names(), "policies", "--policies")
    try:
        prof = load_profile(profile)
    except FileNotFoundError as e:
        raise typer.BadParameter(str(e), param_hint="--profile") from None
    records = None
    trace_name = "trace"
    if trace is not None:
        if trace_format not in ("azure", "mooncake"):
            raise typer.BadParameter(
                f"expected azure or mooncake, got {trace_format!r}", param_hint="--trace-format"
            )
        if not trace.exists():
            raise typer.BadParameter(f"no such file: {trace}", param_hint="--trace")
        loader = load_azure if trace_format == "azure" else load_mooncake
        records = loader(trace, limit=max_requests)
        trace_name = f"{trace_format}:{trace.name}"
    elif scenario not in ("paper", "low", "medium", "high", "burst"):
        raise typer.BadParameter(
            f"unknown scenario {scenario!r}; known: paper, low, medium, high, burst",
            param_hint="--scenario",
        )
    twp_cfg = _twp_config(twp_set)
    m: Literal["colocated", "pd"] = "pd" if mode == "pd" else "colocated"
    exp = Experiment(
        scenario=scenario or "trace",
        mode=m,
        policies=names,
        runs=runs,
        seed=seed,
        load=load,
        quick=quick,
        trace=records,
        trace_name=trace_name,
        max_requests=max_requests,
    )
    result, raw = run_experiment(
        prof,
        exp,
        DecodeSimConfig(mode=m, L_bar=l_bar, pool=PoolConfig(warm_at_start=warm)),
        twp_cfg,
    )
    result["l_bar"] = l_bar
    result["twp_overrides"] = twp_set
    rate = result["rate_rps"]
    sat = result["fcfs_saturated_rps"]
    typer.echo(
        f"SIMULATED decode: {result['scenario']} / {m}, {result['runs']} run(s), "
        f"{sum(result['n_requests'])} requests, rate "
        f"{'native' if rate is None else f'{rate:.2f} req/s'}"
        + ("" if sat is None else f" (FCFS saturated: {sat:.2f} req/s)")
        + f", profile {prof.model} on {prof.hardware}"
    )
    headers, rows = table_rows(result)
    typer.echo(table(headers, rows))
    write_json(json_out, result)
    if plot_out is not None:
        plot_out.parent.mkdir(parents=True, exist_ok=True)
        plot(result, raw, str(plot_out))
        typer.echo(f"wrote {plot_out}")


def _twp_config(spec: str) -> TWPConfig | None:
    """``key=value,...`` into a validated TWPConfig (errors name the field)."""
    from pydantic import ValidationError

    from controllers.decode import TWPConfig

    if not spec.strip():
        return None
    values: dict[str, str] = {}
    for item in spec.split(","):
        key, sep, val = item.partition("=")
        if not sep or not key.strip():
            raise typer.BadParameter(f"expected key=value, got {item!r}", param_hint="--twp")
        values[key.strip()] = val.strip()
    try:
        return TWPConfig.model_validate(values)
    except ValidationError as e:
        raise typer.BadParameter(str(e), param_hint="--twp") from None
