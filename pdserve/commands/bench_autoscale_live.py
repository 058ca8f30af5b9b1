"""``pdserve bench autoscale-live``: a scaled-down trace against the serverless app and against
the same app on a fixed always-on pool, live (cold starts, replica-seconds, TTFT and ITL)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from pdserve.apps import bench_app
from pdserve.output import csv_known
from pdserve.output import table as fmt

SYSTEM_NAMES = ("always_on", "autoscaled", "slo")
DEFAULT_TRACE = Path("bench/data/azure_llm_2023/AzureLLMInferenceTrace_conv.csv")


@bench_app.command("autoscale-live")
def autoscale_live(
    trace: Path = typer.Option(DEFAULT_TRACE, help="Trace file: Azure CSV or Mooncake JSONL."),
    trace_format: str | None = typer.Option(
        None, help="azure or mooncake (default: from the file's suffix)."
    ),
    time_scale: float = typer.Option(
        1.0, min=0.001, help="Multiply arrival offsets (2: half the rate, 0.5: twice it)."
    ),
    max_requests: int = typer.Option(100, min=2, help="Replay the trace's first N requests."),
    max_output_tokens: int = typer.Option(
        128, min=2, help="Cap each request's output tokens at this."
    ),
    slo: str | None = typer.Option(
        None, help="TTFT_S,ITL_S: p99 targets of a third system, slo (autoscaling.slo)."
    ),
    slo_sweep: str | None = typer.Option(
        None,
        help="Points of a sweep of the slo system's settings, run after --systems, separated "
        "by ';': TTFT_S,ITL_S[,MAX_COLD_FRACTION[,KEEP_ALIVE_CAP_S]] (the cap: that point's "
        "idle_to_zero_s). With the others they make the live Pareto front.",
    ),
    systems: str | None = typer.Option(
        None,
        help="Systems in order (always_on, autoscaled, slo); default: always_on,autoscaled "
        "and slo with --slo.",
    ),
    idle_to_zero_s: float = typer.Option(
        20.0, min=0, help="The autoscaled systems' keep-alive (config: 300 s)."
    ),
    downscale_delay_s: float = typer.Option(
        10.0, min=0, help="The autoscaled systems' hysteresis (config: 30 s)."
    ),
    from_zero: bool = typer.Option(
        False,
        "--from-zero",
        help="Start the autoscaled systems' replay at zero replicas (default: after one "
        "request of their own has started the pair).",
    ),
    config: Path = typer.Option(
        Path("configs/pd_autoscale.yaml"), help="Serve YAML of the serverless application."
    ),
    cache_dir: str | None = typer.Option(None, help="vLLM cache folder of the app."),
    port: int = typer.Option(8768, min=1, max=65535, help="Serve's HTTP port (loopback)."),
    json_out: Path | None = typer.Option(None, "--json", help="Write the results as JSON here."),
    plot: Path | None = typer.Option(None, "--plot", help="Write the plot (PNG) here."),
) -> None:
    """Replay a scaled-down trace against configs/pd_autoscale.yaml's app (the autoscaler on,
    deployed from a config with its application-level policy) and against the same app on a
    fixed pool at the autoscaler's maximum, one at a time on a local Ray cluster: cold-start
    fraction, replica-seconds, TTFT and ITL p50/p99 each, ratios to always-on and the issue's
    goals (cold <= 3%, replica-seconds <= 60%, TTFT p99 <= 1.5x, no errors)."""
    import os

    import yaml
    from tqdm import tqdm

    from bench.live.autoscale_live import parse_slo, parse_slo_point

    if not trace.exists():
        raise typer.BadParameter(f"{trace} does not exist", param_hint="--trace")
    if trace_format is not None and trace_format not in ("azure", "mooncake"):
        raise typer.BadParameter("azure or mooncake", param_hint="--trace-format")
    if not config.exists():
        raise typer.BadParameter(f"{config} does not exist", param_hint="--config")
    targets = None
    if slo is not None:
        try:
            targets = parse_slo(slo)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--slo") from None
    sweep = []
    for point in (slo_sweep or "").split(";"):
        if not point.strip():
            continue
        try:
            sweep.append(parse_slo_point(point))
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--slo-sweep") from None
    if len({name for name, _, _ in sweep}) < len(sweep):
        raise typer.BadParameter("a point is given twice", param_hint="--slo-sweep")
    if systems is None:
        chosen = ["always_on", "autoscaled"] + (["slo"] if targets else [])
    else:
        chosen = csv_known(systems, SYSTEM_NAMES, "system", "--systems")
    if "slo" in chosen and targets is None:
        raise typer.BadParameter("the slo system needs --slo TTFT_S,ITL_S", param_hint="--slo")
    apps = (yaml.safe_load(config.read_text()) or {}).get("applications") or []
    if not apps or not (apps[0].get("args") or {}).get("autoscaling"):
        raise typer.BadParameter(
            f"{config} has no application with args.autoscaling", param_hint="--config"
        )

    from deployments.local import ensure_ray_token, local_env

    # Ray reads its auth mode when it is first imported (the bench imports it to deploy): the
    # local head this bench starts runs token auth as `pdserve up` starts one
    os.environ.update(local_env())
    ensure_ray_token(dict(os.environ))
    from bench.live.autoscale_live import base_args, run
    from bench.live.autoscale_live import plot as plot_live
    from pdserve.output import write_json

    args = base_args(apps[0]["args"], cache_dir=cache_dir)
    bars: list[Any] = []

    def progress(name: str, n: int) -> Any:
        bars.append(tqdm(total=n, desc=f"replay on {name}", unit="req"))
        return bars[-1].update

    try:
        res = run(
            args,
            trace,
            systems=chosen,
            time_scale=time_scale,
            max_requests=max_requests,
            max_output_tokens=max_output_tokens,
            idle_to_zero_s=idle_to_zero_s,
            downscale_delay_s=downscale_delay_s,
            slo=targets,
            sweep=sweep,
            start="zero" if from_zero else "warm",
            trace_fmt=trace_format,
            port=port,
            progress=progress,
            log=typer.echo,
        )
    finally:
        for b in bars:
            b.close()
    typer.echo(summary_table(res))
    write_json(json_out, res)
    if plot is not None:
        plot_live(res, plot)
        typer.echo(f"wrote {plot}")
    for name, why in (res.get("failed") or {}).items():
        typer.echo(f"{name} failed: {why}")
    errors = sum(s["errors"] for s in res["systems"].values())
    if errors:
        typer.echo(f"{errors} requests failed")
    if errors or res.get("failed"):
        raise typer.Exit(1)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:,.0f}"


def _x(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _ok(v: bool | None) -> str:
    return "-" if v is None else ("yes" if v else "NO")


def summary_table(res: dict[str, Any]) -> str:
    """One row per system: requests, cold fraction, replica-seconds, TTFT and ITL, ratios to
    always-on, goals met, on the Pareto front."""
    rows = []
    cmp = res.get("compare") or {}
    on_front = set(res.get("front") or ())
    for name, s in res["systems"].items():
        c = cmp.get(name) or {}
        g = c.get("goals") or {}
        rs = s["replica_seconds"]
        cold = s["cold_start_fraction"]
        rows.append(
            [
                name,
                f"{s['requests'] - s['errors']}/{s['requests']}",
                "-" if cold is None else f"{cold:.1%}",
                f"{rs['prefill']:.0f}+{rs['decode']:.0f}={rs['total']:.0f}",
                _ms(s["ttft"]["p50"]),
                _ms(s["ttft"]["p99"]),
                _ms(s["itl"]["p50"]),
                _ms(s["itl"]["p99"]),
                _x(c.get("replica_seconds_ratio")),
                _x(c.get("ttft_p99_ratio")),
                " ".join(
                    f"{k}:{_ok(g.get(k))}"
                    for k in ("cold_starts", "replica_seconds", "ttft_p99", "no_errors")
                ),
                "yes" if name in on_front else "",
            ]
        )
    head = [
        "system",
        "ok",
        "cold",
        "replica-s P+D",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "ITL p50 ms",
        "ITL p99 ms",
        "rs / on",
        "p99 / on",
        "goals",
        "front",
    ]
    return fmt(head, rows)
