"""``pdserve bench multinode``: the app on several Ray nodes of this machine: one node against
worker nodes per role on the same replay, and Ray's autoscaler adding a decode node."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from pdserve.apps import bench_app
from pdserve.output import table as fmt

PARTS = ("layouts", "autoscale")


@bench_app.command("multinode")
def multinode(
    parts: str = typer.Option("layouts,autoscale", help="Which parts: layouts, autoscale."),
    preset: str = typer.Option("test", help="Model preset (test or bench)."),
    requests: int = typer.Option(80, min=4, help="Requests of the layouts' replay."),
    rate: float = typer.Option(2.0, min=0.01, help="Their arrival rate (requests/s)."),
    max_tokens: int = typer.Option(16, min=2, help="Output tokens per replayed request."),
    streams: int = typer.Option(6, min=1, help="Autoscale: concurrent long streams."),
    stream_tokens: int = typer.Option(256, min=2, help="Autoscale: tokens per stream."),
    downscale_delay_s: float = typer.Option(10.0, min=0, help="Autoscale: the app's hysteresis."),
    idle_timeout_s: float = typer.Option(15.0, min=1, help="Autoscale: Ray's node idle timeout."),
    cache_dir: str | None = typer.Option(None, help="vLLM cache folder of the app."),
    json_out: Path | None = typer.Option(None, "--json", help="Write the results as JSON here."),
    plot: Path | None = typer.Option(None, "--plot", help="Write the plot (PNG) here."),
) -> None:
    """The same prefix-heavy replay on one Ray node and on prefill=2,decode=1,ingress=1
    worker nodes (TTFT and ITL side by side), then the time from "the policy wants a decode
    replica" to "it served" when Ray's autoscaler (fake multi-node provider) must add a node,
    and to the node's termination after the load (starts its own local clusters)."""
    import os

    from tqdm import tqdm

    from bench.live.multinode import plot as plot_multinode
    from bench.live.multinode import run_autoscale, run_layouts
    from bench.live.routing import app_args
    from bench.workloads.rag import RagMix
    from deployments.local import ensure_ray_token, local_env
    from pdserve.output import write_json

    chosen = [p.strip() for p in parts.split(",") if p.strip()]
    if not chosen or any(p not in PARTS for p in chosen):
        raise typer.BadParameter(f"one or more of {', '.join(PARTS)}", param_hint="--parts")
    if preset not in ("test", "bench"):
        raise typer.BadParameter("test or bench", param_hint="--preset")
    # Ray reads its auth mode when it is first imported (building the app imports it): the
    # clusters this bench starts run token auth as `pdserve up` starts one
    os.environ.update(local_env())
    ensure_ray_token(dict(os.environ))
    from deployments.app import build_app

    args = app_args(preset, 2, cache_dir)
    res: dict[str, Any] = {"simulated": False, "preset": preset}
    bars: list[Any] = []

    def progress(name: str, n: int) -> Any:
        bars.append(tqdm(total=n, desc=f"replay on {name}", unit="req"))
        return bars[-1].update

    if "layouts" in chosen:
        mix = RagMix(requests=requests, rate=rate, max_tokens=max_tokens)
        res["layouts"] = run_layouts(args, mix, build_app=build_app, progress=progress)
        for b in bars:
            b.close()
        typer.echo(layouts_table(res["layouts"]))
    if "autoscale" in chosen:
        typer.echo("autoscale: starting a cluster on Ray's fake multi-node provider ...")
        res["autoscale"] = run_autoscale(
            args,
            streams=streams,
            max_tokens=stream_tokens,
            downscale_delay_s=downscale_delay_s,
            idle_timeout_s=idle_timeout_s,
        )
        typer.echo(autoscale_table(res["autoscale"]))
    write_json(json_out, res)
    if plot is not None:
        plot_multinode(res, plot)
        typer.echo(f"wrote {plot}")
    errors = sum(s["errors"] for s in (res.get("layouts") or {}).get("layouts", {}).values())
    errors += int((res.get("autoscale") or {}).get("errors") or 0)
    if errors:
        typer.echo(f"{errors} requests failed")
        raise typer.Exit(1)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:,.0f}"


def layouts_table(res: dict[str, Any]) -> str:
    rows = [
        [
            name,
            f"{s['requests'] - s['errors']}/{s['requests']}",
            _ms(s["ttft"]["p50"]),
            _ms(s["ttft"]["p99"]),
            _ms(s["itl"]["p50"]),
            _ms(s["itl"]["p99"]),
            f"{s['cached_token_ratio']:.0%}",
            f"{s['deploy_s']:.0f}",
        ]
        for name, s in res["layouts"].items()
    ]
    r = res.get("ratios") or {}
    rows.append(
        [
            "multi / one",
            "",
            *(
                "-" if r.get(k) is None else f"{r[k]:.2f}x"
                for k in ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99")
            ),
            "",
            "",
        ]
    )
    head = ["layout", "ok", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms"]
    return fmt([*head, "cached", "deploy s"], rows)


def autoscale_table(res: dict[str, Any]) -> str:
    from bench.live.multinode import EVENTS

    ev = res.get("events_s") or {}
    rows = [[name, "-" if name not in ev else f"{ev[name]:.1f}"] for name in EVENTS]
    rows.append(["requests (failed)", f"{res.get('requests')} ({res.get('errors')})"])
    return fmt(["event (s from the load's start)", "at"], rows)
