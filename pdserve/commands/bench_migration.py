"""``pdserve bench migration``: the stall a client sees when its stream migrates."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from pdserve.apps import bench_app
from pdserve.output import table as fmt


def _ints(raw: str, hint: str) -> list[int]:
    try:
        out = [int(x) for x in raw.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(
            f"expected integers separated by commas: {raw!r}", param_hint=hint
        ) from None
    if not out or min(out) < 2:
        raise typer.BadParameter("expected integers of at least 2", param_hint=hint)
    return out


@bench_app.command("migration")
def migration(
    prompts: str = typer.Option("256,1024,2048", help="Prompt lengths (tokens), comma-separated."),
    sent: str = typer.Option("16,128,512", help="Tokens sent before the loss, comma-separated."),
    repeats: int = typer.Option(3, min=1, max=20, help="Trials per cell (median reported)."),
    cache_dir: str | None = typer.Option(None, help="vLLM cache folder of the app."),
    json_out: Path | None = typer.Option(None, "--json", help="Write the results as JSON here."),
    plot: Path | None = typer.Option(None, "--plot", help="Write the stall plot (PNG) here."),
) -> None:
    """Lose a stream's decode replica after N tokens (injected) and time the client's stall
    before the next token, against prompt length and tokens sent, with the continuation's
    prompt on the prefill replica's cache and recomputed on the decode replica (deploys the
    app twice on a local Ray cluster)."""
    from tqdm import tqdm

    from bench.live.migration import AFTER, run
    from bench.live.migration import plot as plot_stall
    from pdserve.output import write_json

    lengths, sents = _ints(prompts, "--prompts"), _ints(sent, "--sent")
    if max(lengths) + max(sents) + AFTER > 4096:
        raise typer.BadParameter(
            f"a prompt plus the tokens sent plus {AFTER} must fit the app's max_model_len 4096",
            param_hint="--prompts",
        )
    bar: list[tqdm] = []

    def progress(n: int) -> Any:
        bar.append(tqdm(total=n, desc="migration trials", unit="trial"))
        return lambda: bar[0].update(1)

    import os

    from deployments.local import ensure_ray_token, local_env

    # Ray reads its auth mode when it is first imported (building the app imports it): the
    # local head this bench starts runs token auth as `pdserve up` starts one
    os.environ.update(local_env())
    ensure_ray_token(dict(os.environ))
    from deployments.app import build_app

    res = run(lengths, sents, repeats, build_app=build_app, cache_dir=cache_dir, progress=progress)
    for b in bar:
        b.close()
    typer.echo(table(res))
    write_json(json_out, res)
    if plot is not None:
        plot_stall(res, plot)
        typer.echo(f"wrote {plot}")
    failed = sum(r["failed"] for r in res["rows"])
    if failed:
        typer.echo(
            f"{failed} trials failed: {[t['error'] for t in res['trials'] if not t['ok']][:3]}"
        )
        raise typer.Exit(1)


def table(res: dict[str, Any]) -> str:
    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1e3:.0f}"

    rows = [
        [
            r["variant"],
            r["prompt_tokens"],
            r["sent"],
            f"{r['trials'] - r['failed']}/{r['trials']}",
            ms(r["stall_s"]),
            ms(r["itl_s"]),
            "-" if r["stall_over_itl"] is None else f"{r['stall_over_itl']:.1f}",
            ms(r.get("prefill_s")),
            ms(r.get("first_token_s")),
        ]
        for r in res["rows"]
    ]
    head = ["variant", "prompt", "sent", "ok", "stall ms", "ITL ms", "stall / ITL"]
    return fmt([*head, "prefill ms", "1st token ms"], rows)
