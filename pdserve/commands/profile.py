"""``pdserve profile``: measure an engine profile (patience table, step cost, decode) here."""

from __future__ import annotations

import tempfile
from pathlib import Path

import typer

from pdserve.apps import app
from pdserve.output import csv_ints, table


@app.command("profile")
def profile(
    model: Path = typer.Option(..., "--model", help="Model folder (from `pdserve make-model`)."),
    out: Path = typer.Option(..., "--out", help="Write the profile JSON here."),
    prompts: str = typer.Option("128,256,512,1024,2048,4096", help="Prompt lengths to time."),
    batches: str = typer.Option("1,2,4,8,16,32", help="Decode batch sizes to time."),
    repeats: int = typer.Option(2, min=1, help="Runs per prompt length (median)."),
    token_budget: int = typer.Option(2048, min=16, help="max_num_batched_tokens."),
    kv_blocks: int | None = typer.Option(
        None, min=2, help="Cap the KV cache to this many blocks (num_gpu_blocks_override)."
    ),
    hardware: str = typer.Option("cpu-2core", help="Hardware label written into the profile."),
) -> None:
    """Time prefill vs prompt length and decode step vs batch size on vLLM (run under flock)."""
    from tqdm import tqdm

    from engines.profiler import measure_profile

    p_list, b_list = csv_ints(prompts), csv_ints(batches)
    bar = tqdm(total=len(p_list) + len(b_list) + 4, desc="profile")

    def step(msg: str) -> None:
        bar.update(1)
        bar.set_postfix_str(msg)

    with tempfile.TemporaryDirectory(prefix="pdserve-profile-") as cache:
        prof, raw = measure_profile(
            model,
            cache_dir=cache,
            prompt_tokens=p_list,
            batches=b_list,
            repeats=repeats,
            token_budget=token_budget,
            kv_blocks=kv_blocks,
            hardware=hardware,
            progress=step,
        )
    bar.close()
    typer.echo(f"profile of {prof.model} (measured, not simulated)")
    typer.echo(
        table(
            ["prompt tokens", "prefill ms", "patience s"],
            [
                [n, s * 1e3, max(1.0, 3 * s)]
                for n, s in zip(prof.prefill.prompt_tokens, prof.prefill.seconds, strict=True)
            ],
        )
    )
    typer.echo(
        table(
            ["batch", "decode step ms"],
            [
                [b, s * 1e3]
                for b, s in zip(raw["decode_batches"], raw["decode_step_s"], strict=True)
            ],
        )
    )
    d, sc = prof.decode, prof.step_cost
    typer.echo(
        f"decode: l_min={d.l_min_s * 1e3:.2f} ms  B0={d.b0}  alpha={d.alpha_s * 1e3:.3f} ms/request; "
        f"step cost: fixed={sc.fixed_s * 1e3:.2f} ms  per_token={sc.per_token_s * 1e6:.2f} us  "
        f"attn={sc.attn_per_ctx_token_s * 1e9:.3f} ns/token^2"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    prof.dump(out)
    typer.echo(f"wrote {out}")
