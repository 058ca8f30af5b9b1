"""``pdserve bench routing``: prefill routing policies side by side on the live app."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from bench.live.routing import app_args
from pdserve.apps import bench_app
from pdserve.output import csv_known, table, write_json

POLICIES = ("prefix_load", "round_robin", "least_loaded", "prefix_only", "serve_default")


def _f(x: float | None, digits: int = 3, scale: float = 1.0) -> str:
    """A number for the table; ``-`` when there is none (e.g. every request failed)."""
    return "-" if x is None or x != x else f"{x * scale:.{digits}f}"


@bench_app.command("routing")
def routing(
    policies: str = typer.Option(
        "prefix_load,round_robin,least_loaded,serve_default",
        help=f"Prefill routing policies, in order ({', '.join(POLICIES)}).",
    ),
    preset: str = typer.Option("bench", help="Model preset to serve: bench or test."),
    prefill_replicas: int = typer.Option(2, min=1, max=8, help="Prefill replicas."),
    requests: int = typer.Option(120, min=4, help="Requests in the replay."),
    rate: float = typer.Option(3.0, min=0.01, help="Open-loop arrival rate (requests/s)."),
    documents: int = typer.Option(16, min=1, help="Shared documents."),
    doc_blocks: int = typer.Option(12, min=1, help="KV blocks (128 tokens) per document."),
    question_tokens: int = typer.Option(96, min=1, help="Unique tokens per request."),
    zipf_s: float = typer.Option(1.1, min=0.0, help="Zipf exponent of document popularity."),
    max_tokens: int = typer.Option(16, min=1, help="Output tokens per request."),
    overhead_streams: int = typer.Option(
        8, min=0, help="Closed-loop streams for the ingress-overhead phase (0: skip)."
    ),
    seed: int = typer.Option(0, help="Workload seed."),
    cache_dir: str | None = typer.Option(None, help="vLLM cache folder of the app."),
    json_out: Path | None = typer.Option(None, "--json", help="Write the results as JSON here."),
    plot: Path | None = typer.Option(None, "--plot", help="Write TTFT CDFs (PNG) here."),
) -> None:
    """Replay one shared-document RAG mix against the live app under each routing policy."""
    from tqdm import tqdm

    from bench.live.routing import plot as plot_cdf
    from bench.live.routing import ratios, run
    from bench.workloads.rag import RagMix

    names = csv_known(policies, POLICIES, "routing policy", "--policies")
    if preset not in ("bench", "test"):
        raise typer.BadParameter("expected bench or test", param_hint="--preset")
    mix = RagMix(
        requests=requests,
        documents=documents,
        doc_blocks=doc_blocks,
        question_tokens=question_tokens,
        zipf_s=zipf_s,
        rate=rate,
        max_tokens=max_tokens,
        seed=seed,
    )
    bars: list[Any] = []

    def progress(policy: str, n: int) -> Any:
        bar = tqdm(total=n, desc=f"replay {policy}", unit="req")
        bars.append(bar)
        return bar.update

    import os

    from deployments.local import ensure_ray_token, local_env

    # Ray reads its auth mode when it is first imported (building the app imports it): the
    # local head this bench starts runs token auth as `pdserve up` starts one, with the token
    # where Ray's processes find it
    os.environ.update(local_env())
    ensure_ray_token(dict(os.environ))
    from deployments.app import build_app

    res = run(
        app_args(preset, prefill_replicas, cache_dir),
        names,
        mix,
        build_app=build_app,
        overhead_streams=overhead_streams,
        progress=progress,
    )
    for b in bars:
        b.close()
    rr = ratios(res, "round_robin")
    ll = ratios(res, "least_loaded")
    res["ratios"] = {"vs_round_robin": rr, "vs_least_loaded": ll}
    write_json(json_out, res)
    rows = []
    for name, s in res["policies"].items():
        t, o = s["ttft"], s["ingress_overhead_s"] or {}
        rows.append(
            [
                name,
                f"{_f(t['p50'])} / {_f(t['p90'])} / {_f(t['p99'])}",
                _f(rr.get(name, {}).get("ttft_p50"), 2),
                _f(ll.get(name, {}).get("ttft_p99"), 2),
                f"{s['cached_token_ratio']:.1%}",
                " / ".join(str(n) for n in s["requests_per_replica"]),
                f"{_f(o.get('p50'), 1, 1e3)} / {_f(o.get('p99'), 1, 1e3)}",
                s["errors"],
            ]
        )
    typer.echo(
        table(
            [
                "policy",
                "TTFT s p50/p90/p99",
                "p50 / RR",
                "p99 / LL",
                "cached",
                "requests per replica",
                "ingress ms p50/p99",
                "errors",
            ],
            rows,
        )
    )
    first = next(iter(res["policies"].values()))
    if "closed_loop" in first:
        c = first["closed_loop"]
        o = c["ingress_overhead_s"] or {}
        typer.echo(
            f"ingress overhead, {c['streams']} closed-loop streams ({c['requests']} requests): "
            f"p50 {_f(o.get('p50'), 1, 1e3)} ms, p99 {_f(o.get('p99'), 1, 1e3)} ms"
        )
        for k, v in c["phases_s"].items():
            typer.echo(f"  {k:>12}: p50 {_f(v['p50'], 1, 1e3)} ms, p99 {_f(v['p99'], 1, 1e3)} ms")
    for name, s in res["policies"].items():
        if s["errors"]:
            typer.echo(f"{name}: {s['errors']} failed requests, e.g. {s['error_samples']}")
    if plot is not None:
        plot_cdf(res, plot)
        typer.echo(f"wrote {plot}")
