"""``pdserve sim autoscale``: serverless autoscaling of a PD pool, five policies (simulated)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from pdserve.apps import sim_app
from pdserve.output import csv_known, csv_numbers, table, write_json

if TYPE_CHECKING:
    from controllers.autoscale import AutoscaleConfig

GOAL_COLD_FRACTION = 0.05
GOAL_REPLICA_RATIO = 0.70
#: Issue 43's goals for the ``slo`` policy (simulated, shipped defaults).
SLO_GOAL_COLD_FRACTION = 0.03
SLO_GOAL_REPLICA_RATIO = 0.60
SLO_GOAL_TTFT_RATIO = 1.5


@sim_app.command("autoscale")
def autoscale(
    scenario: str | None = typer.Option(
        None, help="servegen-language | servegen-reason (or use --trace)."
    ),
    trace: Path | None = typer.Option(None, help="Replay a trace file instead of a scenario."),
    trace_format: str = typer.Option(
        "azure",
        help="azure or mooncake (with --trace); mooncake's hash_ids feed the prefix cache "
        "of --engine profile.",
    ),
    policies: str = typer.Option(
        "always_on,serve_default,serverlessllm,warm_pool,slo", help="Policies, comma-separated."
    ),
    load: float | None = typer.Option(
        None, min=0.001, help="Arrival rate x this (trace: time compressed by it)."
    ),
    loads: str | None = typer.Option(
        None, help="Several loads in one run, e.g. 0.5,1,2 (instead of --load)."
    ),
    max_requests: int | None = typer.Option(
        None, min=1, help="With --trace: replay only the first N records."
    ),
    duration_s: float | None = typer.Option(
        None, min=1.0, help="Scenario: seconds of arrivals (default: the scenario's)."
    ),
    start_s: float | None = typer.Option(
        None, min=0.0, help="Scenario: where in the data's day to start (s)."
    ),
    rate: float | None = typer.Option(
        None, min=1e-4, help="Scenario: mean req/s before --load (default: the scenario's)."
    ),
    seed: int = typer.Option(0, help="Scenario: seed of arrivals and lengths."),
    warm_pool: int | None = typer.Option(
        None, min=0, help="warm_pool: idle replicas kept per role while active."
    ),
    keep_alive: float | None = typer.Option(
        None, min=0.001, help="warm_pool: keep-alive before scaling to zero (idle_to_zero_s)."
    ),
    autoscale_set: str = typer.Option(
        "",
        "--autoscale",
        help="Other AutoscaleConfig fields for warm_pool, e.g. "
        "'downscale_delay_s=30,target_utilization=0.95'.",
    ),
    prefill_tps: float = typer.Option(
        4000.0, min=1.0, help="Prefill tokens/s per replica (modelled)."
    ),
    itl_ms: float = typer.Option(25.0, min=0.01, help="Decode inter-token latency (ms)."),
    window_tokens: float = typer.Option(
        16384.0, min=1.0, help="Decode token window per replica (prompt + output tokens)."
    ),
    cold_start_s: float | None = typer.Option(
        None, min=0.0, help="Cold start (s); default modelled: 16 GB / 2 GB/s + 6 s = 14 s."
    ),
    sllm_cold_start_s: float | None = typer.Option(
        None, min=0.0, help="serverlessllm's cold start (s); default modelled: 7 s."
    ),
    max_replicas: int = typer.Option(32, min=1, help="Most replicas per role (every policy)."),
    engine: str = typer.Option(
        "simple",
        help="Engine model: simple (fixed prefill rate and ITL, known output lengths) or "
        "profile (the engine profile's batched prefill steps and decode step curve).",
    ),
    profile: str = typer.Option(
        "a6000_llama31_8b", help="--engine profile: engine profile (shipped name or path)."
    ),
    prefix_cache_blocks: int | None = typer.Option(
        None,
        min=1,
        help="--engine profile with a trace of block hashes (mooncake): each prefill "
        "replica's prefix cache in the trace's blocks (default: the profile's KV).",
    ),
    warmup: float = typer.Option(
        0.0, min=0.0, help="Seconds at the start not counted (requests and replica-seconds)."
    ),
    slo_ttft: float = typer.Option(2.0, min=1e-3, help="slo: TTFT p99 target (s)."),
    slo_itl: float = typer.Option(0.05, min=1e-4, help="slo: ITL p99 target (s)."),
    max_cold_fraction: float = typer.Option(
        0.03, min=1e-4, max=0.99, help="slo: cold-start budget (share of requests)."
    ),
    slo_ttft_factor: float | None = typer.Option(
        None,
        min=1e-3,
        help="slo: TTFT target = this x always_on's TTFT p99 on each workload (instead of "
        "--slo-ttft).",
    ),
    slo_sweep: str | None = typer.Option(
        None,
        help="slo settings for a Pareto front, 'EPS:TTFT,...' (TTFT in s, or '1.5x' for a "
        "multiple of always_on's TTFT p99), e.g. '0.01:1.5x,0.03:1.5x,0.1:2x'.",
    ),
    always_on: str | None = typer.Option(
        None, help="always_on's counts 'P,D' (default: sized for the peak minute)."
    ),
    pareto_keep_alives: str = typer.Option(
        "10,30,60,120,300,600", help="--pareto: keep-alives swept (s)."
    ),
    pareto_pools: str = typer.Option("0,1,2", help="--pareto: warm pool sizes swept."),
    json_out: Path | None = typer.Option(None, "--json", help="Write results as JSON here."),
    plot_out: Path | None = typer.Option(
        None, "--plot", help="PNG: TTFT CDF and replicas over time per policy."
    ),
    pareto_out: Path | None = typer.Option(
        None, "--pareto", help="PNG: cold starts vs replica-seconds as warm_pool's knobs move."
    ),
    progress: bool = typer.Option(True, help="Show a progress bar."),
) -> None:
    """Simulate serverless autoscaling of a prefill/decode pool; every output is simulated."""
    from tqdm import tqdm

    from bench.sim.autoscale import (
        POLICY_NAMES,
        SCENARIOS,
        SimParams,
        pareto_front,
        pareto_sweep,
        peak_sizing,
        plot,
        plot_pareto,
        run_policies,
        servegen_workload,
        slo_config,
        table_rows,
        trace_workload,
    )
    from bench.sim.autoscale import (
        slo_sweep as run_slo_sweep,
    )
    from bench.workloads.traces import MOONCAKE_BLOCK_TOKENS, load_azure, load_mooncake

    if (scenario is None) == (trace is None):
        raise typer.BadParameter(
            "give exactly one of --scenario or --trace", param_hint="--scenario"
        )
    if load is not None and loads is not None:
        raise typer.BadParameter("give --load or --loads, not both", param_hint="--loads")
    load_list = [load] if load is not None else [1.0]
    if loads is not None:
        load_list = csv_numbers(loads, float, "loads")
        if any(x <= 0 for x in load_list):
            raise typer.BadParameter("loads must be > 0", param_hint="--loads")
    names = csv_known(policies, POLICY_NAMES, "policies", "--policies")
    if trace is not None:
        if trace_format not in ("azure", "mooncake"):
            raise typer.BadParameter(
                f"expected azure or mooncake, got {trace_format!r}", param_hint="--trace-format"
            )
        if not trace.exists():
            raise typer.BadParameter(f"no such file: {trace}", param_hint="--trace")
    elif scenario not in SCENARIOS:
        raise typer.BadParameter(
            f"unknown scenario {scenario!r}; known: {sorted(SCENARIOS)}", param_hint="--scenario"
        )
    if engine not in ("simple", "profile"):
        raise typer.BadParameter(
            f"expected simple or profile, got {engine!r}", param_hint="--engine"
        )
    params = SimParams(
        prefill_tokens_per_s=prefill_tps,
        itl_s=itl_ms / 1000.0,
        decode_window_tokens=window_tokens,
        cold_start_s=cold_start_s,
        sllm_cold_start_s=sllm_cold_start_s,
        max_replicas=max_replicas,
        engine=engine,  # type: ignore[arg-type]
        profile=profile,
        warmup_s=warmup,
        prefix_cache_blocks=prefix_cache_blocks,
    )
    if engine == "profile":
        try:
            params.engine_profile()
        except FileNotFoundError as e:
            raise typer.BadParameter(str(e), param_hint="--profile") from None
    cfg = _warm_pool_config(params, warm_pool, keep_alive, autoscale_set)
    scfg = slo_config(
        params,
        {"ttft_p99_s": slo_ttft, "itl_p99_s": slo_itl, "max_cold_fraction": max_cold_fraction},
    )
    sweep = _sweep(slo_sweep) if slo_sweep else []
    fixed = _counts(always_on) if always_on is not None else None
    kas = csv_numbers(pareto_keep_alives, float, "keep-alives")
    pools = csv_numbers(pareto_pools, int, "warm pool sizes")
    if pareto_out is not None and (not kas or any(k <= 0 for k in kas)):
        raise typer.BadParameter("keep-alives must be > 0", param_hint="--pareto-keep-alives")

    loader = load_mooncake if trace_format == "mooncake" else load_azure
    records = loader(trace) if trace is not None else None
    if records is not None and max_requests is not None:
        records = records[:max_requests]
    if records is not None and not records:
        raise typer.BadParameter("the trace has no requests", param_hint="--trace")
    per_load = (
        len(set(names) | {"always_on"}) + (len(kas) * len(pools) if pareto_out else 0) + len(sweep)
    )
    bar = tqdm(total=per_load * len(load_list), desc="autoscale (simulated)", disable=not progress)
    t0 = time.monotonic()
    flat: dict[str, Any] = {}
    workloads: dict[str, Any] = {}
    sizing: dict[str, Any] = {}
    pareto: dict[str, Any] = {}
    goal_met: dict[str, bool] = {}
    slo_goal: dict[str, dict[str, Any]] = {}
    sweeps: dict[str, Any] = {}
    plots: list[tuple[str, Any]] = []
    panels: list[tuple[str, list[dict[str, Any]], dict[str, Any]]] = []
    for x in load_list:
        label = f"{x:g}x"
        if records is not None:
            wl = trace_workload(records, f"{trace_format}:{trace.name if trace else ''}", load=x)
        else:
            assert scenario is not None
            wl = servegen_workload(
                scenario, load=x, seed=seed, duration_s=duration_s, start_s=start_s, rate_rps=rate
            )
        if not wl.requests:
            raise typer.BadParameter(f"no requests at load {x:g}", param_hint="--scenario")
        counts = fixed or peak_sizing(wl, params)
        res, runs = run_policies(
            wl,
            names,
            params,
            cfg,
            always_on=counts,
            on_done=lambda: bar.update(1),
            slo_cfg=scfg,
            slo_ttft_factor=slo_ttft_factor,
        )
        workloads[label] = {
            "name": wl.name,
            "n_requests": len(wl.requests),
            "duration_s": wl.duration_s,
            "mean_rate_rps": len(wl.requests) / wl.duration_s,
            **wl.meta,
        }
        sizing[label] = counts
        for name, m in res.items():
            key = name if len(load_list) == 1 else f"{name}@{label}"
            flat[key] = {"policy": name, "load": x, **m}
        wp = res.get("warm_pool")
        if wp is not None:
            goal_met[label] = bool(
                wp["cold_start_fraction"] <= GOAL_COLD_FRACTION
                and wp["replica_seconds_ratio"] is not None
                and wp["replica_seconds_ratio"] <= GOAL_REPLICA_RATIO
            )
        sp = res.get("slo")
        if sp is not None:
            slo_goal[label] = {
                "cold_start_fraction": sp["cold_start_fraction"] <= SLO_GOAL_COLD_FRACTION,
                "replica_seconds_ratio": (sp["replica_seconds_ratio"] or 0.0)
                <= SLO_GOAL_REPLICA_RATIO,
                "ttft_p99_ratio": sp["ttft_p99_ratio"] is not None
                and sp["ttft_p99_ratio"] <= SLO_GOAL_TTFT_RATIO,
            }
        if sweep:
            ref = runs["always_on"].metrics
            ao99 = ref["ttft"]["p99"] or 0.0
            settings = [(eps, t * ao99 if rel else t) for eps, t, rel in sweep]
            pts = run_slo_sweep(wl, params, scfg, settings, ref, on_done=lambda: bar.update(1))
            front = pareto_front(pts)
            for p in pts:
                p["on_front"] = p in front
            sweeps[label] = pts
        plots.append((label, {n: runs[n] for n in names}))
        if pareto_out is not None:
            ref = runs["always_on"].metrics["replica_seconds"]
            pts = pareto_sweep(wl, params, cfg, kas, pools, ref, on_done=lambda: bar.update(1))
            pareto[label] = pts
            panels.append((f"{wl.name}, load {label}", pts, res))
    bar.close()
    elapsed = time.monotonic() - t0
    source = f"trace {trace}" if trace is not None else f"scenario {scenario}"
    result: dict[str, Any] = {
        "simulated": True,
        "policies": flat,
        "source": source,
        "loads": load_list,
        "workloads": workloads,
        "always_on_replicas": sizing,
        "parameters": {
            **params.model_dump(mode="json"),
            "standard_cold_start_s": params.standard_cold_start_s(),
            "serverlessllm_cold_start_s": params.fast_cold_start_s(),
            "warm_pool_config": cfg.model_dump(mode="json"),
            "slo_config": scfg.model_dump(mode="json"),
            "slo_ttft_factor": slo_ttft_factor,
        },
        "goal": {
            "cold_start_fraction_max": GOAL_COLD_FRACTION,
            "replica_seconds_ratio_max": GOAL_REPLICA_RATIO,
            "warm_pool_met": goal_met,
            "slo": {
                "cold_start_fraction_max": SLO_GOAL_COLD_FRACTION,
                "replica_seconds_ratio_max": SLO_GOAL_REPLICA_RATIO,
                "ttft_p99_ratio_max": SLO_GOAL_TTFT_RATIO,
                "met": slo_goal,
            },
        },
        "elapsed_s": elapsed,
    }
    if pareto:
        result["pareto"] = pareto
    if sweeps:
        result["slo_sweep"] = sweeps
    typer.echo(
        f"SIMULATED autoscale: {source}, loads {', '.join(f'{x:g}x' for x in load_list)}; "
        f"cold start {params.standard_cold_start_s():g} s (serverlessllm "
        f"{params.fast_cold_start_s():g} s), modelled; "
        + (f"prefill {prefill_tps:g} tok/s, " if engine == "simple" else "")
        + (
            f"ITL {itl_ms:g} ms, decode window {window_tokens:g} tokens"
            if engine == "simple"
            else f"engine profile {profile} ({params.prefill_rate():.0f} tok/s per prefill "
            f"replica at full steps)"
        )
        + (
            f"; per prefill replica a prefix cache of "
            f"{params.prefix_cache_capacity(MOONCAKE_BLOCK_TOKENS)} blocks of "
            f"{MOONCAKE_BLOCK_TOKENS} tokens (the trace's hash_ids)"
            if engine == "profile" and trace_format == "mooncake" and trace is not None
            else ""
        )
        + (f"; first {warmup:g} s not counted" if warmup > 0 else "")
    )
    for label, w in workloads.items():
        typer.echo(
            f"  {label}: {w['n_requests']} requests over {w['duration_s']:.0f} s "
            f"({w['mean_rate_rps']:.2f} req/s); always_on P/D = "
            f"{sizing[label]['prefill']}/{sizing[label]['decode']}"
        )
    headers, rows = table_rows(flat)
    typer.echo(table(headers, rows))
    if goal_met:
        met = [k for k, v in goal_met.items() if v]
        typer.echo(
            f"goal (warm_pool: cold starts <= {GOAL_COLD_FRACTION:.0%} of requests, "
            f"replica-seconds <= {GOAL_REPLICA_RATIO:.0%} of always_on's): "
            + (f"met at {', '.join(met)}" if met else "not met")
            + (
                f"; not met at {', '.join(k for k, v in goal_met.items() if not v)}"
                if met and len(met) < len(goal_met)
                else ""
            )
        )
    for label, g in slo_goal.items():
        missed = [k for k, ok in g.items() if not ok]
        typer.echo(
            f"slo goal at {label} (cold <= {SLO_GOAL_COLD_FRACTION:.0%}, replica-seconds <= "
            f"{SLO_GOAL_REPLICA_RATIO:.0%}, TTFT p99 <= {SLO_GOAL_TTFT_RATIO:g}x always_on's): "
            + ("met" if not missed else f"missed on {', '.join(missed)}")
        )
    for label, pts in sweeps.items():
        typer.echo(f"slo sweep at {label} (simulated; * on the Pareto front):")
        typer.echo(
            table(
                [
                    "eps",
                    "ttft_target_s",
                    "cold_frac",
                    "rs_ratio",
                    "ttft_p99_ratio",
                    "itl_p99_s",
                    "front",
                ],
                [
                    [
                        p["max_cold_fraction"],
                        round(p["ttft_p99_target_s"], 3),
                        round(p["cold_start_fraction"], 4),
                        _round(p["replica_seconds_ratio"]),
                        _round(p["ttft_p99_ratio"]),
                        _round(p["itl_p99_s"]),
                    ]
                    + (["*"] if p["on_front"] else [""])
                    for p in pts
                ],
            )
        )
    typer.echo(f"simulated in {elapsed:.1f} s")
    write_json(json_out, result)
    title = f"{source}"
    if plot_out is not None:
        plot_out.parent.mkdir(parents=True, exist_ok=True)
        plot(plots, str(plot_out), title)
        typer.echo(f"wrote {plot_out}")
    if pareto_out is not None:
        pareto_out.parent.mkdir(parents=True, exist_ok=True)
        plot_pareto(panels, str(pareto_out), title, (GOAL_REPLICA_RATIO, GOAL_COLD_FRACTION))
        typer.echo(f"wrote {pareto_out}")


def _round(x: float | None) -> float | str:
    return "-" if x is None else round(x, 3)


def _sweep(spec: str) -> list[tuple[float, float, bool]]:
    """``EPS:TTFT`` items: (cold budget, TTFT target, relative to always_on's p99)."""
    out = []
    for item in spec.split(","):
        eps_s, sep, ttft_s = item.strip().partition(":")
        rel = ttft_s.strip().endswith("x")
        try:
            eps = float(eps_s)
            ttft = float(ttft_s.strip().rstrip("x"))
        except ValueError:
            eps = ttft = -1.0
        if not sep or not (0 < eps < 1) or ttft <= 0:
            raise typer.BadParameter(
                f"expected EPS:TTFT with 0 < EPS < 1 and TTFT > 0 (s, or '1.5x'), got {item!r}",
                param_hint="--slo-sweep",
            )
        out.append((eps, ttft, rel))
    return out


def _counts(spec: str) -> dict[str, int]:
    parts = [p.strip() for p in spec.split(",")]
    try:
        p, d = (int(x) for x in parts)
    except ValueError:
        raise typer.BadParameter(
            f"expected 'P,D' (two integers), got {spec!r}", param_hint="--always-on"
        ) from None
    if p < 1 or d < 1:
        raise typer.BadParameter("always_on counts must be >= 1", param_hint="--always-on")
    return {"prefill": p, "decode": d}


def _warm_pool_config(
    params: Any, warm_pool: int | None, keep_alive: float | None, spec: str
) -> AutoscaleConfig:
    """warm_pool's AutoscaleConfig: the simulator's base, then ``--autoscale``, then the
    named flags (errors name the field)."""
    from pydantic import ValidationError

    from bench.sim.autoscale import warm_pool_config

    values: dict[str, Any] = {}
    for item in spec.split(","):
        if not item.strip():
            continue
        key, sep, val = item.partition("=")
        if not sep or not key.strip():
            raise typer.BadParameter(f"expected key=value, got {item!r}", param_hint="--autoscale")
        values[key.strip()] = val.strip()
    if warm_pool is not None:
        values["warm_pool"] = warm_pool
    if keep_alive is not None:
        values["idle_to_zero_s"] = keep_alive
    try:
        return warm_pool_config(params, **values)
    except ValidationError as e:
        raise typer.BadParameter(str(e), param_hint="--autoscale") from None
