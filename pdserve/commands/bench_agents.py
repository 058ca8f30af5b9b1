"""``pdserve bench agents``: tool-calling agents re-sending their growing conversations to the
live app, cache-aware routing beside cache-blind, per turn."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from bench.live.agents import SYSTEMS
from pdserve.apps import bench_app
from pdserve.output import csv_known, table, write_json


def max_model_len(preset: str) -> int:
    """The positions the preset's model allows (its ``max_position_embeddings``)."""
    from engines.model_builder import PRESETS

    return PRESETS[preset].max_position_embeddings


@bench_app.command("agents")
def bench_agents(
    agents: int = typer.Option(5, "--agents", min=1, max=256, help="Concurrent agents."),
    turns: int = typer.Option(8, "--turns", min=1, help="Turns per agent."),
    tool_tokens: int = typer.Option(300, "--tool-tokens", min=1, help="Tokens per tool result."),
    call_tokens: int = typer.Option(
        64, "--call-tokens", min=32, help="max_tokens of each turn (the model's call)."
    ),
    system_tokens: int = typer.Option(128, min=0, help="Tokens of the shared system prompt."),
    task_tokens: int = typer.Option(32, min=0, help="Tokens of each agent's own task."),
    systems: str = typer.Option(
        "prefix_load,round_robin", help=f"Systems, in order ({', '.join(SYSTEMS)})."
    ),
    preset: str = typer.Option("test", help="Model preset to serve: test or bench."),
    prefill_replicas: int = typer.Option(2, min=1, max=8, help="Prefill replicas."),
    seed: int = typer.Option(0, help="Workload seed."),
    cache_dir: str | None = typer.Option(None, help="vLLM cache folder of the app."),
    json_out: Path | None = typer.Option(None, "--json", help="Write the results as JSON here."),
    plot: Path | None = typer.Option(None, "--plot", help="Write TTFT and cache by turn (PNG)."),
) -> None:
    """N tool-calling agents of M turns each against the live app (not simulated), one system
    deployed at a time: per-turn TTFT and cached-token ratio, turns per second."""
    from bench.workloads.agents import AgentMix, opening_bound, positions_needed

    names = csv_known(systems, list(SYSTEMS), "system", "--systems")
    if preset not in ("test", "bench"):
        raise typer.BadParameter("expected test or bench", param_hint="--preset")
    mix = AgentMix(
        agents=agents,
        turns=turns,
        tool_tokens=tool_tokens,
        call_tokens=call_tokens,
        system_tokens=system_tokens,
        task_tokens=task_tokens,
        seed=seed,
    )
    limit = max_model_len(preset)
    first = opening_bound(mix)
    need = positions_needed(mix, first)
    if need > limit:
        raise typer.BadParameter(
            f"{turns} turns of up to {call_tokens} call + {tool_tokens} tool tokens (plus "
            f"chat markup) after an opening of up to {first} need {need} positions; the "
            f"{preset} model allows {limit}: lower --turns, --tool-tokens or --call-tokens",
            param_hint="--turns",
        )

    import os

    from tqdm import tqdm

    from bench.live.agents import app_args, run, system_table, turn_table, vocabulary_words
    from bench.live.agents import plot as plot_turns
    from deployments.local import ensure_ray_token, local_env

    # Ray reads its auth mode when it is first imported (building the app imports it): the
    # local head this bench starts runs token auth as `pdserve up` starts one
    os.environ.update(local_env())
    ensure_ray_token(dict(os.environ))
    from deployments.app import build_app, ensure_model
    from deployments.config import load_app_config

    args = app_args(preset, prefill_replicas, limit, cache_dir)
    cfg = load_app_config(args)
    ensure_model(cfg)  # the tool results' words come from its tokenizer
    words = vocabulary_words(cfg.model.resolved_path())
    bars: list[Any] = []

    def progress(name: str, n: int) -> Any:
        bar = tqdm(total=n, desc=f"agents {name}", unit="turn")
        bars.append(bar)
        return bar.update

    res = run(args, names, mix, words, build_app=build_app, progress=progress)
    for b in bars:
        b.close()
    write_json(json_out, res)
    typer.echo(
        f"live app (not simulated): {agents} agents x {turns} turns, {tool_tokens}-token tool "
        f"results, {preset} model, {res['prefill_replicas']} prefill + "
        f"{res['decode_replicas']} decode replicas"
    )
    typer.echo(table(*turn_table(res)))
    typer.echo("")
    typer.echo(table(*system_table(res)))
    for name, s in res["systems"].items():
        if s.get("errors"):
            typer.echo(f"{name}: {s['errors']} failed turns, e.g. {s['error_samples']}")
    if plot is not None:
        plot_turns(res, plot)
        typer.echo(f"wrote {plot}")
