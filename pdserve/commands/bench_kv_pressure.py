"""``pdserve bench kv-pressure``: throughput against an admission cap on a KV-capped engine."""

from __future__ import annotations

import tempfile
from pathlib import Path

import typer

from pdserve.apps import bench_app
from pdserve.output import csv_ints, table, write_json


@bench_app.command("kv-pressure")
def kv_pressure(
    model: Path = typer.Option(
        ..., "--model", help="Model folder (`pdserve make-model --preset bench`)."
    ),
    caps: str = typer.Option(
        "8,16,32,48,64,96", help="Admission caps to try (requests inside the engine at once)."
    ),
    requests: int = typer.Option(96, min=1, help="Requests served per cap."),
    prompt_tokens: int = typer.Option(128, min=1, help="Prompt tokens per request."),
    output_tokens: int = typer.Option(256, min=1, help="Generated tokens per request."),
    fit: int = typer.Option(
        32, min=1, help="Size the KV cache to hold this many requests at full length."
    ),
    json_out: Path | None = typer.Option(None, "--json", help="Write the results as JSON here."),
    plot: Path | None = typer.Option(None, "--plot", help="Write a PNG: tokens/s against the cap."),
) -> None:
    """Serve the same requests once per admission cap on a vLLM engine whose KV cache holds
    only --fit of them: does holding requests back raise throughput through fewer
    preemptions (the TWP paper's mechanism)? Measured; run under the heavy-work lock."""
    from tqdm import tqdm

    from bench.engine.kv_pressure import plot as draw
    from bench.engine.kv_pressure import rows, run_kv_pressure

    cap_list = csv_ints(caps, "--caps")
    if not cap_list or min(cap_list) < 1:
        raise typer.BadParameter("caps must be positive integers", param_hint="--caps")
    if not (model / "config.json").exists():
        raise typer.BadParameter(f"no model at {model} (no config.json)", param_hint="--model")
    bar = tqdm(total=len(cap_list) * requests, desc="kv-pressure (engine)")
    seen: dict[int, int] = {}

    def progress(cap: int, done: int, total: int) -> None:
        bar.update(done - seen.get(cap, 0))
        seen[cap] = done
        bar.set_postfix_str(f"cap {cap}")

    with tempfile.TemporaryDirectory(prefix="pdserve-kvp-") as cache:
        res = run_kv_pressure(
            model,
            cache_dir=cache,
            caps=cap_list,
            requests=requests,
            prompt_tokens=prompt_tokens,
            output_tokens=output_tokens,
            fit=fit,
            progress=progress,
        )
    bar.close()
    typer.echo(
        f"KV cache: {res['kv_blocks']} blocks of {res['block_size']} tokens "
        f"({res['fit_actual']} requests at full length); {requests} requests of "
        f"{prompt_tokens} + {output_tokens} tokens"
    )
    typer.echo(table(*rows(res)))
    write_json(json_out, res)
    if plot is not None:
        draw(plot, res)
        typer.echo(f"wrote {plot}")
