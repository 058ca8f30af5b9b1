"""``pdserve bench`` commands that bring the PD application up on a local Ray cluster (or
reach one) and measure it over HTTP: warm and cold starts, PD against conditional and
colocated serving, the replay, the comparison with Ray Serve LLM, the PD path's own overhead,
the soak and the proxy's memory control. ``pdserve up`` and ``down`` are
:mod:`pdserve.commands.serve_app`.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import typer

from bench.workloads.replay import ReplayWorkload
from pdserve.apps import bench_app
from pdserve.commands.serve_app import DEFAULT_CONFIG
from pdserve.options import replay_options


@bench_app.command("warm-start")
def bench_warm_start(
    config: Path = typer.Option(DEFAULT_CONFIG, help="Serve YAML of the application."),
    requests: int = typer.Option(10, min=2, help="Sequential requests after ready."),
    json_out: Path | None = typer.Option(None, "--json", help="Write the results as JSON here."),
) -> None:
    """The first requests after /health says ready, with and without the pair warm-up
    (brings the app up and down twice; nothing else may run on port 8000)."""
    from bench.live.warm_start import run
    from pdserve.output import table, write_json

    if not config.exists():
        raise typer.BadParameter(f"{config} does not exist", param_hint="--config")
    res = run(config, requests=requests)
    rows = []
    for variant in ("warm_up", "no_warm_up"):
        r = res[variant]
        rows.append(
            [
                variant,
                f"{r['ready_s']:.1f}",
                f"{r['ttft_s'][0] * 1e3:.0f}",
                f"{r['rest_ttft_s'] * 1e3:.0f}",
                f"{r['first_over_rest']:.2f}",
            ]
        )
    typer.echo(
        table(["variant", "up -> ready s", "1st TTFT ms", "rest TTFT ms", "1st / rest"], rows)
    )
    write_json(json_out, res)


@bench_app.command("cold-start")
def bench_cold_start(
    config: Path = typer.Option(
        Path("configs/pd_autoscale.yaml"), help="Serve YAML of the serverless application."
    ),
    presets: str = typer.Option("test,bench", help="Model presets, comma-separated."),
    warm_requests: int = typer.Option(5, min=1, help="Requests on the warm pair after."),
    json_out: Path | None = typer.Option(None, "--json", help="Write the results as JSON here."),
) -> None:
    """Cold starts from zero replicas per model preset: the first request's TTFT, the seconds
    it waited for each role's replica to start, against warm requests (brings the app up and
    down once per preset; nothing else may run on port 8000)."""
    from bench.live.cold_start import run, table
    from pdserve.output import write_json

    if not config.exists():
        raise typer.BadParameter(f"{config} does not exist", param_hint="--config")
    names = [p.strip() for p in presets.split(",") if p.strip()]
    if not names:
        raise typer.BadParameter("no preset given", param_hint="--presets")
    res = run(config, names, warm_requests=warm_requests)
    typer.echo(table(res))
    write_json(json_out, res)


@bench_app.command("serve")
def bench_serve(
    config: Path = typer.Option(DEFAULT_CONFIG, help="Serve YAML of the PD application."),
    colocated_config: Path = typer.Option(
        DEFAULT_CONFIG.parent / "pd_colocated.yaml", help="Serve YAML of the colocated mode."
    ),
    levels: str = typer.Option("1,4,8", help="Concurrent streams, comma-separated."),
    requests: int = typer.Option(16, min=2, help="Requests per level (half short prompts)."),
    json_out: Path | None = typer.Option(None, "--json", help="Write the results as JSON here."),
) -> None:
    """PD vs conditional disaggregation vs colocated on the live app: TTFT, ITL and
    throughput at each concurrency (brings the app up and down once per mode; nothing else
    may run on its port)."""
    from bench.live.serve_modes import MODES, run
    from pdserve.output import csv_numbers, table, write_json

    for path, hint in ((config, "--config"), (colocated_config, "--colocated-config")):
        if not path.exists():
            raise typer.BadParameter(f"{path} does not exist", param_hint=hint)
    lv = [int(x) for x in csv_numbers(levels, int, "levels") if x > 0]
    if not lv:
        raise typer.BadParameter("expected positive stream counts", param_hint="--levels")
    res = run(config, colocated_config, lv, requests=requests)
    rows = []
    for mode in MODES:
        for c in lv:
            r = res[mode][str(c)]
            rows.append(
                [mode, c]
                + [
                    "-" if r[k][q] is None else f"{r[k][q] * 1e3:.0f}"
                    for k in ("ttft_s", "itl_s")
                    for q in ("p50", "p99")
                ]
                + [f"{r['throughput_tps']:.1f}", r["errors"]]
            )
    heads = ["mode", "streams", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms"]
    typer.echo(table([*heads, "tok/s", "errors"], rows))
    for mode, by in res["ratios_to_pd"].items():
        for c, r in by.items():
            cells = ", ".join(f"{k} {v:.2f}" for k, v in r.items() if v is not None)
            typer.echo(f"{mode} / pd at {c} streams: {cells}")
    write_json(json_out, res)


@bench_app.command("live")
@replay_options()
def bench_live(
    endpoint: str = typer.Option(..., help="Base URL of an OpenAI-compatible endpoint."),
    out: Path = typer.Option(..., help="Folder for summary.json, results.json and the report."),
    model: str | None = typer.Option(None, help="Model name (default: the endpoint's first)."),
    key: str | None = typer.Option(None, help="API key (Authorization: Bearer)."),
    *,
    workload: ReplayWorkload,
) -> None:
    """Replay a trace or scenario open-loop against a live endpoint (any OpenAI-compatible
    server): TTFT, ITL, end-to-end latency, throughput and cached-token ratio, with a report
    and plots in OUT."""
    from bench.live.replay import run
    from bench.workloads.traces import TraceFormatError

    if workload.trace is not None and not workload.trace.exists():
        raise typer.BadParameter(f"{workload.trace} does not exist", param_hint="--trace")
    try:
        s = run(endpoint, out, workload, model=model, key=key)
    except (ValueError, TraceFormatError) as e:
        raise typer.BadParameter(str(e)) from None
    t = s["ttft"]
    typer.echo(
        f"{s['requests']} requests, {s['errors']} errors; TTFT p50 {t['p50']} s, p99 "
        f"{t['p99']} s; {s['throughput_tps']:.1f} tokens/s; cached {s['cached_token_ratio']}"
    )
    typer.echo(f"wrote {out}/summary.json and {out}/report.md")


#: ``bench compare``'s systems by default: every pdserve variant and both peers
COMPARE_SYSTEMS = (
    "pdserve",
    "pdserve-fcfs-rr",
    "pdserve-fairway",
    "pdserve-twp",
    "peer-connector",
    "peer",
)
#: ``bench compare --matrix``'s: pdserve and the reference (each run costs minutes)
MATRIX_SYSTEMS = ("pdserve", "peer-connector")


def _bench_matrix(
    out: Path,
    config: Path,
    preset: str,
    systems: str,
    repeats: int,
    cells: str | None,
    workload: ReplayWorkload,
    resume: bool = False,
    budget_min: float | None = None,
    redo: bool = False,
    redo_repeat: str | None = None,
) -> None:
    """``bench compare --matrix``: checks every option before anything starts (a bad cell
    or system is a usage error naming it), then :func:`bench.live.matrix.run_matrix` with
    the live runner. Of the replay options it takes ``--limit``, ``--max-tokens``,
    ``--vocab`` and ``--seed``; the cells define the rest."""
    import yaml

    from bench.live.compare import SYSTEMS, with_preset
    from bench.live.matrix import REFERENCE, parse_cells, parse_repeats, previous_matrix

    try:
        selected = [] if redo_repeat and not cells else parse_cells(cells)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--cells") from None
    try:
        again = parse_repeats(redo_repeat, repeats)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--redo-repeat") from None
    names = [s.strip() for s in systems.split(",") if s.strip()]
    bad = [n for n in names if n not in SYSTEMS]
    if bad or not names or REFERENCE not in names:
        raise typer.BadParameter(
            f"unknown {bad}; known: {', '.join(SYSTEMS)}"
            if bad
            else f"the matrix needs the reference {REFERENCE} among the systems",
            param_hint="--systems",
        )
    w = workload
    fixed = {
        "--trace": w.trace is not None,
        "--rate": w.rate is not None,
        "--concurrency": w.concurrency is not None,
        "--scenario": w.scenario not in (None, "rag"),
        "--time-scale": w.time_scale != 1.0,
        "--length-scale": w.length_scale != 1.0,
    }
    given = [k for k, v in fixed.items() if v]
    if given:
        raise typer.BadParameter(
            f"{', '.join(given)}: with --matrix the cells set the workload and the load",
            param_hint="--matrix",
        )
    if redo and not (resume and cells):
        raise typer.BadParameter(
            "runs the selected cells again in a matrix run before: needs --resume and --cells",
            param_hint="--redo",
        )
    if again and not resume:
        raise typer.BadParameter(
            "runs repeats of a matrix run before again: needs --resume",
            param_hint="--redo-repeat",
        )
    if resume:
        try:
            previous_matrix(out, names, w.seed)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--resume") from None
    elif (out / "matrix.json").exists():
        raise typer.BadParameter(
            f"{out / 'matrix.json'} exists: --resume to go on with it, or another --out",
            param_hint="--out",
        )
    if not config.exists():
        raise typer.BadParameter(f"{config} does not exist", param_hint="--config")
    if preset not in ("test", "bench", "config"):
        raise typer.BadParameter(
            f"{preset!r}: expected test, bench or config", param_hint="--preset"
        )
    base = with_preset(yaml.safe_load(config.read_text()), None if preset == "config" else preset)

    from tokenizers import Tokenizer

    from bench.live.matrix import code_version, live_requests, live_runner, run_matrix
    from deployments.app import ensure_model
    from deployments.config import load_app_config

    cfg = load_app_config(base["applications"][0].get("args") or {})
    ensure_model(cfg)
    tok = Tokenizer.from_file(str(cfg.model.resolved_path() / "tokenizer.json"))
    build, pressure = live_requests(
        base, vocab=w.vocab, max_tokens=w.max_tokens, limit=w.limit, tokenizer=tok
    )
    typer.echo(
        f"{len(selected)} cells x {repeats} repeats x {len(names)} systems "
        f"({len(selected) * repeats * len(names)} runs, each a fresh Ray head, deploy and "
        f"replay: minutes each)"
        + (f", and {len(again)} repeats again" if again else "")
        + f"; cache_pressure: {pressure.explain()}"
    )

    def said(rec: dict[str, Any]) -> None:
        typer.echo(
            f"{rec['cell']} #{rec['repeat'] + 1} {rec['system']}: {rec.get('error') or 'done'}"
        )

    run_matrix(
        selected,
        out,
        run_system=live_runner(cfg.model.served_name),
        build=build,
        base=base,
        systems=names,
        repeats=repeats,
        seed=w.seed,
        notes={"config": str(config), "preset": preset, "cache_pressure": pressure.explain()},
        on_run=said,
        resume=resume,
        redo=redo,
        redo_repeats=again,
        budget_s=None if budget_min is None else 60 * budget_min,
        code=code_version(),
    )
    typer.echo((out / "report.md").read_text())


@bench_app.command("compare")
@replay_options(
    scenario={
        "default": "rag",
        "help": "rag, or a prefill-simulator scenario (ignored with --trace).",
    }
)
def bench_compare(
    out: Path = typer.Option(..., help="Folder for compare.json, report.md and the plots."),
    config: Path = typer.Option(
        DEFAULT_CONFIG.parent / "pd_cluster.yaml",
        help="pdserve's Serve YAML; the peer gets the same model, engines and replica counts.",
    ),
    preset: str = typer.Option(
        "bench", help="Model for every system: test or bench (built locally), or config (its own)."
    ),
    systems: str | None = typer.Option(
        None,
        help="Systems, comma-separated, brought up one at a time in this order (default: "
        + ",".join(COMPARE_SYSTEMS)
        + "; with --matrix: "
        + ",".join(MATRIX_SYSTEMS)
        + ").",
    ),
    matrix: bool = typer.Option(
        False,
        "--matrix",
        help="Run the matrix of repeated runs (layout x load x workload cells, see "
        "docs/benchmarks.md) instead of one run of the replay options' workload.",
    ),
    repeats: int = typer.Option(3, min=1, help="With --matrix: runs per cell and system."),
    cells: str | None = typer.Option(
        None,
        help="With --matrix: cells, comma-separated layout/load/workload ('*' for any part), "
        "e.g. two_prefill/closed8/rag,pair/open0.9/burst (default: all 32).",
    ),
    resume: bool = typer.Option(
        False,
        "--resume",
        help="With --matrix: go on with OUT/matrix.json, running only what it lacks (the "
        "whole matrix is about a day of runs: fill it in slices).",
    ),
    budget_min: float | None = typer.Option(
        None,
        min=0,
        help="With --matrix: start no run after this many minutes; the report says what is "
        "left (--resume goes on).",
    ),
    redo: bool = typer.Option(
        False,
        "--redo",
        help="With --matrix --resume --cells: run these cells again from nothing (their "
        "earlier runs are kept aside in matrix.json; an open cell draws its rate anew).",
    ),
    redo_repeat: str | None = typer.Option(
        None,
        help="With --matrix --resume: run these repeats again, comma-separated CELL#N as the "
        "report names them (e.g. one run on hosts of unlike speed); the earlier runs are "
        "kept aside in matrix.json, the cell keeps its arrivals. Without --cells no other "
        "cell runs.",
    ),
    *,
    workload: ReplayWorkload,
) -> None:
    """pdserve side by side with Ray Serve LLM's prefill/decode app on the same replay and
    engines, one system up at a time (each on a fresh local Ray head; nothing else may run on
    its port): TTFT, ITL, throughput, cached-token ratio, deploy time, memory and idle CPU,
    with ratios to the peer and a report with plots in OUT. With --matrix: every selected
    cell repeated, the median ratios and their spread, goals and a heat map in OUT."""
    import yaml

    from bench.live.compare import SYSTEMS, as_text, run, with_preset
    from bench.workloads.replay import build_requests
    from bench.workloads.traces import TraceFormatError
    from deployments.config import load_app_config

    if systems is None:
        systems = ",".join(MATRIX_SYSTEMS if matrix else COMPARE_SYSTEMS)
    if matrix:
        _bench_matrix(
            out, config, preset, systems, repeats, cells, workload, resume, budget_min, redo,
            redo_repeat,
        )  # fmt: skip
        return
    if resume or budget_min is not None or redo or redo_repeat:
        raise typer.BadParameter(
            "only with --matrix", param_hint="--resume, --budget-min, --redo, --redo-repeat"
        )
    if workload.trace is not None:
        workload = dataclasses.replace(workload, scenario=None)  # the trace wins
    if not config.exists():
        raise typer.BadParameter(f"{config} does not exist", param_hint="--config")
    if workload.trace is not None and not workload.trace.exists():
        raise typer.BadParameter(f"{workload.trace} does not exist", param_hint="--trace")
    if preset not in ("test", "bench", "config"):
        raise typer.BadParameter(
            f"{preset!r}: expected test, bench or config", param_hint="--preset"
        )
    names = [s.strip() for s in systems.split(",") if s.strip()]
    bad = [n for n in names if n not in SYSTEMS]
    if bad or not names:
        raise typer.BadParameter(
            f"unknown {bad or 'empty'}; known: {', '.join(SYSTEMS)}", param_hint="--systems"
        )
    try:
        workload.check()
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    base = with_preset(yaml.safe_load(config.read_text()), None if preset == "config" else preset)
    try:
        cfg = load_app_config(base["applications"][0].get("args") or {})
        reqs, cut = build_requests(workload, max_model_len=cfg.model.max_model_len)
        from tokenizers import Tokenizer

        from deployments.app import ensure_model

        ensure_model(cfg)
        tok = Tokenizer.from_file(str(cfg.model.resolved_path() / "tokenizer.json"))
        reqs = as_text(reqs, tok)
    except (ValueError, TraceFormatError) as e:
        raise typer.BadParameter(str(e)) from None
    typer.echo(
        f"{len(reqs)} requests of {workload.name} ({cut} cut to fit), systems: {', '.join(names)}"
    )
    run(
        base,
        out,
        reqs,
        systems=names,
        workload=workload.name,
        concurrency=workload.concurrency,
        on_system=lambda n, row: typer.echo(f"{n}: {row.get('error') or 'done'}"),
    )
    typer.echo((out / "report.md").read_text())


@bench_app.command("pd")
def bench_pd(
    url: str = typer.Option("http://127.0.0.1:8000", help="Base URL of the running app."),
    requests: int = typer.Option(20, min=2, help="Sequential requests per path."),
    prompt_words: int = typer.Option(400, min=1, help="Words per prompt (~2 tokens each)."),
    max_tokens: int = typer.Option(32, min=2, help="Output tokens per request."),
    idle_s: float = typer.Option(10.0, min=1, help="Idle-CPU sampling window (s)."),
    api_key: str | None = typer.Option(None, help="API key, when the app requires one."),
    json_out: Path | None = typer.Option(None, "--json", help="Write the results as JSON here."),
) -> None:
    """Idle CPU, PD-path vs single-engine TTFT/ITL, and ingress overhead of a running app."""
    from bench.live.pd import run
    from pdserve.output import table, write_json

    os.environ.setdefault("RAY_AUTH_MODE", "token")  # as `pdserve up` starts a head
    res = run(
        url,
        requests=requests,
        prompt_words=prompt_words,
        max_tokens=max_tokens,
        idle_s=idle_s,
        key=api_key,
    )
    rows = []
    for path, cols in res["paths"].items():
        rows.append(
            [
                path,
                *(
                    f"{cols[k]['p50'] * 1e3:.1f} / {cols[k]['p99'] * 1e3:.1f}"
                    for k in ("ttft_s", "itl_s", "e2e_s")
                ),
            ]
        )
    o = res["ingress_overhead_s"]
    rows.append(["ingress overhead", "", "", f"{o['p50'] * 1e3:.1f} / {o['p99'] * 1e3:.1f}"])
    typer.echo(table(["path", "TTFT ms p50/p99", "ITL ms p50/p99", "e2e ms p50/p99"], rows))
    typer.echo(f"idle CPU (% of a core): total {res['idle_cpu_percent']['total']}")
    write_json(json_out, res)


@bench_app.command("soak")
def bench_soak(
    url: str | None = typer.Option(
        None, help="Base URL of a running app; without it the app comes up from --config."
    ),
    config: Path = typer.Option(
        DEFAULT_CONFIG.parent / "pd_cluster.yaml", help="Serve YAML to bring up (without --url)."
    ),
    duration_s: float = typer.Option(120.0, "--duration", min=4, help="Seconds of load in all."),
    levels: str = typer.Option("1.0,1.5", help="Arrival rates, multiples of saturation."),
    capacity_s: float = typer.Option(
        32.0, min=2, help="Seconds measuring saturation (closed loop, 4 to 32 clients)."
    ),
    warmup_s: float | None = typer.Option(
        None,
        "--warmup",
        min=0,
        help="Seconds of load at the top level before the baseline (default: one level's "
        "share of --duration, so peak-concurrency buffers exist before memory is measured).",
    ),
    api_key: str | None = typer.Option(None, help="API key, when the app requires one."),
    operator_key: str | None = typer.Option(
        None,
        envvar="PDSERVE_OPERATOR_KEY",
        help="Operator key for the stats, when the app requires one.",
    ),
    json_out: Path | None = typer.Option(None, "--json", help="Write the results as JSON here."),
    plot_out: Path | None = typer.Option(None, "--plot", help="Write a PNG of the run here."),
) -> None:
    """A bounded load test on the live endpoint: open-loop arrivals at and above saturation;
    reports outcomes (only 429/503 with Retry-After may refuse), drain time, the routers' and
    feeds' table sizes against their baseline, and every process's memory growth."""
    from bench.live.soak import plot, run
    from pdserve.output import csv_numbers, table, write_json

    lv = tuple(float(x) for x in csv_numbers(levels, float, "levels"))
    if not lv or any(x <= 0 for x in lv):
        raise typer.BadParameter("expected positive multiples, e.g. 1.0,1.5", param_hint="--levels")
    if url is None and not config.exists():
        raise typer.BadParameter(f"{config} does not exist", param_hint="--config")
    up = url is None
    if up:
        import yaml

        from bench.live.warm_start import pdserve_cli

        raw = yaml.safe_load(config.read_text())
        url = f"http://127.0.0.1:{raw.get('http_options', {}).get('port', 8000)}"
        pdserve_cli("up", "--config", str(config))
    assert url is not None
    try:
        res = run(
            url,
            api_key,
            duration_s=duration_s,
            levels=lv,
            capacity_s=capacity_s,
            warmup_s=warmup_s,
            operator_key=operator_key,
        )
    finally:
        if up:
            pdserve_cli("down")
    steps = ", ".join(f"{n} clients {v['rps']:.2f}/s" for n, v in res["capacity_steps"].items())
    typer.echo(f"saturation: {res['saturation_rps']:.2f} req/s (closed loop: {steps})")
    rows = [
        [k, f"{v['offered_rps']:.2f}", v["sent"], f"{v['goodput_rps']:.2f}", v["outcomes"]]
        for k, v in res["levels_out"].items()
    ]
    typer.echo(table(["level", "offered/s", "sent", "goodput/s", "outcomes"], rows))
    drain = res["drain_s"]
    typer.echo(f"drain: {'not within the bound' if drain is None else f'{drain:.1f} s'}")
    t = res["tables"]
    typer.echo(
        table(
            ["table", "before", "after"],
            [[k, t["before"].get(k, 0), v] for k, v in sorted(t["after"].items())],
        )
    )
    mem = res["memory"]["processes"]
    typer.echo(
        table(
            ["process", "start MiB", "end MiB", "growth %"],
            [
                [k, f"{m['start_mib']:.0f}", f"{m['end_mib']:.0f}", f"{100 * m['growth']:.1f}"]
                for k, m in mem.items()
            ],
        )
    )
    typer.echo(
        "checks: " + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in res["checks"].items())
    )
    write_json(json_out, res)
    if plot_out is not None:
        plot(res, plot_out)
        typer.echo(f"plot: {plot_out}")


@bench_app.command("proxy-control")
def bench_proxy_control(
    rate: float = typer.Option(25.0, min=0.1, help="Poisson arrivals per second."),
    duration_s: float = typer.Option(120.0, "--duration", min=4, help="Seconds measured."),
    warmup_s: float = typer.Option(60.0, "--warmup", min=0, help="Seconds of load before."),
    delay_s: float = typer.Option(0.2, "--delay", min=0, help="The trivial app's answer time."),
    port: int = typer.Option(8123, min=1, max=65535, help="Serve's HTTP port for this run."),
    replicas: int = typer.Option(1, min=1, max=64, help="Replicas of the trivial app."),
    refuse: float = typer.Option(
        0.0, min=0.0, max=1.0, help="Share of requests answered 503 with Retry-After at once."
    ),
    busy_cores: int = typer.Option(
        0, min=0, max=256, help="Processes spinning a core each from the warm-up to the end."
    ),
    json_out: Path | None = typer.Option(None, "--json", help="Write the results as JSON here."),
) -> None:
    """The control for the soak's memory check: Ray Serve's proxy under the soak's requests
    with a trivial app (no pdserve) on a Ray cluster of its own; its memory growth."""
    from bench.live.proxy_control import run
    from pdserve.output import write_json

    res = run(
        rate=rate,
        duration_s=duration_s,
        warmup_s=warmup_s,
        delay_s=delay_s,
        port=port,
        replicas=replicas,
        refuse=refuse,
        busy_cores=busy_cores,
    )
    typer.echo(
        f"proxy control (Ray Serve with a trivial app, no pdserve): {res['sent']} requests at "
        f"{res['rate_rps']:.1f}/s, {res['completed']} completed, {res['refused']} refused; proxy "
        f"{res['proxy_start_mib']:.0f} -> {res['proxy_end_mib']:.0f} MiB "
        f"({100 * (res['proxy_growth'] or 0):.1f}%, {res['proxy_kib_per_request']:.2f} KiB/request)"
    )
    write_json(json_out, res)
