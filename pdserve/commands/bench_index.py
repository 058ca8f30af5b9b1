"""``pdserve bench index``: prefix-index lookup latency and KV-event ingest throughput."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import typer

from pdserve.apps import bench_app
from pdserve.output import table, write_json


@bench_app.command("index")
def index(
    backend: str = typer.Option("memory", help="memory or redis."),
    redis_url: str | None = typer.Option(
        None, help="Redis to use (default for --backend redis: a private redis-server)."
    ),
    blocks: int = typer.Option(100_000, min=64, help="Distinct block hashes indexed."),
    replicas: int = typer.Option(16, min=1, help="Replicas holding them."),
    lookups: int = typer.Option(2000, min=10, help="Timed match() calls."),
    prompt_blocks: int = typer.Option(64, min=1, help="Blocks per looked-up prompt."),
    write_batch: int = typer.Option(1024, min=64, help="Block events per write round trip."),
    seed: int = typer.Option(0, help="Seed of the synthetic hashes."),
    json_out: Path | None = typer.Option(None, "--json", help="Write the results as JSON here."),
    plot: Path | None = typer.Option(None, "--plot", help="Write a latency CDF (PNG) here."),
) -> None:
    """Ingest vLLM-format KV events for BLOCKS blocks over REPLICAS replicas, then time lookups."""
    from bench.micro.index import run

    if backend not in ("memory", "redis"):
        raise typer.BadParameter("expected memory or redis", param_hint="--backend")
    proc = None
    url = redis_url
    if backend == "redis" and url is None:
        from cluster.redis_server import RedisNotFound, start_redis

        try:
            proc, port = start_redis(Path(tempfile.mkdtemp(prefix="pdserve-redis-")))
        except RedisNotFound as e:
            raise typer.BadParameter(str(e), param_hint="--redis-url") from None
        url = f"redis://127.0.0.1:{port}/0"
        typer.echo(f"started a private redis-server on 127.0.0.1:{port}")
    try:
        res: dict[str, Any] = run(
            backend,
            blocks,
            replicas,
            redis_url=url,
            lookups=lookups,
            prompt_blocks=prompt_blocks,
            write_batch=write_batch,
            seed=seed,
        )
    finally:
        if proc is not None:
            from cluster.redis_server import stop_redis

            stop_redis(proc)
    lat = res.pop("latencies_ms")
    hot, typ = res["lookup_ms_hot"], res["lookup_ms_typical"]
    typer.echo(
        table(
            ["backend", "blocks", "entries", "replicas", "lookup p50 (ms)", "lookup p99 (ms)",
             "typical p99 (ms)", "hot p99 (ms)", "ingest (events/s)"],
            [[backend, res["blocks"], res["entries"], replicas, res["lookup_ms"]["p50"],
              res["lookup_ms"]["p99"], typ["p99"], hot["p99"], res["ingest_events_per_s"]]],
        )
    )  # fmt: skip
    write_json(json_out, res)
    if plot is not None:
        _plot(plot, lat, f"{backend}, {res['blocks']} blocks, {replicas} replicas")


def _plot(path: Path, lat_ms: list[float], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    a = np.sort(np.asarray(lat_ms))
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(a, np.arange(1, a.size + 1) / a.size)
    ax.set_xscale("log")
    ax.set_xlabel("match() latency (ms)")
    ax.set_ylabel("fraction of lookups")
    ax.set_title(f"prefix-index lookup, measured: {title}")
    ax.grid(True, alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    typer.echo(f"wrote {path}")
