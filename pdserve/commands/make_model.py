"""``pdserve make-model``: a random-weight Llama and a locally trained tokenizer, no hub."""

from __future__ import annotations

from pathlib import Path

import typer

from pdserve.apps import app


@app.command("make-model")
def make_model(
    out: Path = typer.Option(..., "--out", help="Folder to write the model into."),
    preset: str = typer.Option("test", help="Model size: test (tiny, for tests) or bench."),
    seed: int = typer.Option(0, min=0, help="Seed of the random weights."),
) -> None:
    """Build a Llama with random weights that vLLM loads offline (deterministic for a seed)."""
    from engines.model_builder import build_model, model_preset, preset_names

    if preset not in preset_names():
        raise typer.BadParameter(
            f"unknown preset {preset!r}; known: {', '.join(preset_names())}", param_hint="--preset"
        )
    path = build_model(out, preset=preset, seed=seed)
    typer.echo(f"wrote {path} (preset {model_preset(path)}, seed {seed})")
