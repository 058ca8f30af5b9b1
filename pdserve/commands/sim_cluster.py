"""``pdserve sim cluster``: N prefill replicas behind the router (simulated)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from pdserve.apps import sim_app
from pdserve.output import csv_ints, csv_known, table, write_json


@sim_app.command("cluster")
def sim_cluster(
    replicas: str = typer.Option("4", help="Replica counts, comma-separated (e.g. 4,8)."),
    routing: str = typer.Option(
        "round_robin,least_loaded,prefix_only,prefix_load",
        help="Routing policies, comma-separated.",
    ),
    policies: str = typer.Option("fcfs,lpm,fairway", help="Queue policies, comma-separated."),
    scenario: str | None = typer.Option(None, help="Prefill scenario (see `sim prefill --list`)."),
    trace: Path | None = typer.Option(None, help="Replay a trace file instead of a scenario."),
    trace_format: str = typer.Option("mooncake", help="Trace format: mooncake or azure."),
    seed: int = typer.Option(0, help="Seed of the workload generator."),
    load: float | None = typer.Option(
        None,
        min=0.01,
        help="Offered load relative to the cluster's FCFS capacity (replicas x one replica's).",
    ),
    cache_fraction: float | None = typer.Option(
        None, min=0.001, help="Each replica's KV cache as a fraction of the reusable content."
    ),
    limit: int | None = typer.Option(None, min=1, help="Traces: replay the first N requests."),
    report_period_s: float = typer.Option(0.5, min=0.001, help="Router load-report period (s)."),
    profile: str = typer.Option("a6000_llama31_8b", help="Engine profile: shipped name or path."),
    quick: bool = typer.Option(False, help="A short seeded smoke run."),
    json_out: Path | None = typer.Option(None, "--json", help="Write the results as JSON here."),
    plot_out: Path | None = typer.Option(None, "--plot", help="Write a PNG plot here."),
) -> None:
    """Compare routing x queue policy over N replicas. Output is simulated."""
    from tqdm import tqdm

    from bench.sim.cluster import simulate_cluster
    from bench.sim.prefill import EngineConfig, SimRequest
    from bench.sim.profiles import load_profile
    from bench.workloads.prefill_scenarios import SCENARIOS
    from controllers.prefill import prefill_policy_names
    from controllers.routing import ROUTING_NAMES
    from pdserve.commands.sim_prefill import workload_from_options

    counts = csv_ints(replicas)
    if any(c < 1 for c in counts):
        raise typer.BadParameter("replica counts must be >= 1", param_hint="--replicas")
    routings = csv_known(routing, ROUTING_NAMES, "routing", "--routing")
    names = csv_known(policies, prefill_policy_names(), "policies", "--policies")
    if (scenario is None) == (trace is None):
        raise typer.BadParameter(
            "give exactly one of --scenario or --trace", param_hint="--scenario"
        )
    if scenario is not None and scenario not in SCENARIOS:
        raise typer.BadParameter(
            f"unknown scenario {scenario!r}; known: {', '.join(SCENARIOS)}", param_hint="--scenario"
        )
    if trace_format not in ("mooncake", "azure"):
        raise typer.BadParameter("must be mooncake or azure", param_hint="--trace-format")
    try:
        prof = load_profile(profile)
    except (FileNotFoundError, ValueError) as e:
        raise typer.BadParameter(str(e), param_hint="--profile") from None
    work = workload_from_options(
        scenario, trace, trace_format, prof, seed, load, cache_fraction, limit, 32_768, quick
    )
    typer.echo(f"{work.name} (simulated), seed {seed}, {len(work.requests)} requests")
    for note in work.notes:
        typer.echo(f"  {note}")

    runs: list[dict[str, Any]] = []
    raw: dict[tuple[int, str, str], Any] = {}
    jobs = [(c, r, p) for c in counts for r in routings for p in names]
    for c, r, p in tqdm(jobs, desc="cluster runs (simulated)", unit="run"):
        # One replica's workload, compressed in time by the replica count: the offered
        # load per replica stays what the scenario (or --load) sets.
        reqs = [
            SimRequest(q.request_id, q.arrival_s / c, q.prompt_tokens, q.block_hashes, q.labels)
            for q in work.requests
        ]
        res = simulate_cluster(
            reqs,
            c,
            r,
            p,
            prof,
            work.cache_blocks,
            config=EngineConfig(token_budget=prof.token_budget, block_size=work.block_size),
            report_period_s=report_period_s,
            warm=work.warm,
        )
        raw[(c, r, p)] = res
        runs.append(res.summary())
    headers = [
        "replicas",
        "routing",
        "policy",
        "ttft p50 (s)",
        "ttft p99 (s)",
        "hit rate",
        "imbalance",
        "unfinished",
    ]
    rows = [
        [
            s["replicas"],
            s["routing"],
            s["policy"],
            s["ttft"]["p50"],
            s["ttft"]["p99"],
            s["hit_rate"],
            s["imbalance"],
            s["unfinished"],
        ]
        for s in runs
    ]
    typer.echo("simulated")
    typer.echo(table(headers, rows))
    write_json(json_out, {"simulated": True, "scenario": work.name, "seed": seed, "runs": runs})
    if plot_out is not None:
        _plot(plot_out, runs, work.name)


def _plot(path: Path, runs: list[dict[str, Any]], name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = sorted({s["replicas"] for s in runs})
    fig, axes = plt.subplots(1, len(counts), figsize=(6 * len(counts), 4.5), squeeze=False)
    for ax, c in zip(axes[0], counts, strict=True):
        sub = [s for s in runs if s["replicas"] == c]
        labels = [f"{s['routing']}\n{s['policy']}" for s in sub]
        x = range(len(sub))
        ax.bar([i - 0.2 for i in x], [s["ttft"]["p50"] or 0 for s in sub], 0.4, label="p50")
        ax.bar([i + 0.2 for i in x], [s["ttft"]["p99"] or 0 for s in sub], 0.4, label="p99")
        ax.set_xticks(list(x), labels, rotation=90, fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("TTFT (s)")
        ax.set_title(f"{name}, {c} replicas (simulated)")
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    typer.echo(f"wrote {path}")
