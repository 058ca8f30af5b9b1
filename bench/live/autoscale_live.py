"""Live autoscaling benchmark (``pdserve bench autoscale-live``): a scaled-down trace replayed
against the serverless app (``configs/pd_autoscale.yaml``) and against the same app on a
fixed always-on pool, one system at a time on one local Ray cluster (issue 43).

**Systems.** ``autoscaled``: the config's application (its args, with the test model, keys off
and an unlimited tenant), deployed from a config as ``serve deploy`` does, because only a
config carries Serve's application-level policy (``deployments.autoscaling:PDAutoscaler``,
which sizes prefill and decode together), with shorter timings for a scaled replay
(``idle_to_zero_s``, ``downscale_delay_s``). ``slo`` (when targets are given): the same with
``autoscaling.slo`` set (:class:`controllers.slo_sizing.SloConfig`; the decode step curve of
the engine profile the app resolves, when it has one). ``always_on``: the same app with the
autoscaler off and each role fixed at the autoscaler's ``max_replicas`` (the reference of
every ratio). ``slo[...]``: points of a sweep of the slo system's settings (``--slo-sweep``:
:func:`parse_slo_point`), each deployed and replayed like the others; with the rest they make
the live Pareto front (:func:`front`: cold-start fraction, replica-seconds ratio, TTFT p99
ratio, among the systems that failed no request), drawn beside the timelines.

**Replay.** The trace's first ``max_requests`` requests (:func:`bench.workloads.replay.
load_trace`, :func:`~bench.workloads.replay.trace_requests`; the Azure conversation trace by
default), arrival offsets multiplied by ``time_scale`` (as ``pdserve bench live``: 2 is half
the rate, 0.5 twice it), outputs capped at ``max_output_tokens`` and prompts cut to fit
``model.max_model_len`` less their output, sent open-loop and streamed
(:func:`bench.live.replay.replay`: TTFT per request, the gap of every streamed token). Every
system gets the identical requests at the identical offsets. Before the replay each system
serves one short request of its own (``warm``, the default: the replay starts from a running
pair, as a service in the middle of its trace does; ``zero``: the autoscaled systems start the
replay at zero replicas and its first request waits for the cold start).

**Measured per system.** Replica-seconds: a thread polls ``serve.status()`` every
``POLL_S`` for the engine deployments' replica states; the replicas in :data:`LIVE_STATES`
(starting, updating, recovering, running, stopping: what holds a core) are integrated over the
replay's window, from its start until its last response (:func:`replica_seconds`: the count of
a sample holds until the next one). Cold starts: the ingress records a ``cold_start`` phase for
every request that waited at a role's handle while a replica started (``/v1/pdserve/stats``,
``ingress.phases_s.cold_start.n``, cleared by a stats reset just before the replay): cold
fraction = those requests / requests sent; the per-role counts of such waits
(``ingress.cold_start_waits``) beside it. TTFT p50/p99 (per request) and ITL p50/p99 (every
streamed token's gap, pooled). Then each system's ratios to always_on's and the issue's goals
(:data:`GOALS`: cold starts <= 3% of requests, replica-seconds <= 60% of always_on's, TTFT
p99 <= 1.5x always_on's, no request failing), reported, not tuned for.

Runs a local Ray cluster in this process (or joins ``RAY_ADDRESS``); hold
``/tmp/pdserve-heavy.lock`` around it on a shared machine. Absolute times are this machine's;
the ratios are the point.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.live.replay import LiveResult, replay
from bench.live.routing import (
    config_app,
    deploy_config,
    get_json,
    model_vocab,
    replica_states,
    reset_stats,
    serve_locally,
    wait_gone,
)
from bench.live.routing import wait_ready as wait_health
from bench.workloads.replay import LiveRequest, load_trace, shape, trace_requests
from controllers.stats import summarize

APP = "pdautoscalelive"
ROLES = ("prefill", "decode")
SYSTEMS = ("always_on", "autoscaled", "slo")
BASE = "always_on"
#: Serve's replica states that hold a replica's resources (its engine is up or coming up).
LIVE_STATES = ("STARTING", "UPDATING", "RECOVERING", "RUNNING", "STOPPING")
#: The period of the replica-state poll (s).
POLL_S = 0.5
#: The issue's goals, each system against always_on on the same replay.
GOALS = {
    "max_cold_start_fraction": 0.03,
    "max_replica_seconds_ratio": 0.60,
    "max_ttft_p99_ratio": 1.5,
    "max_errors": 0,
}
ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "pd_autoscale.yaml"
AZURE_CONV = ROOT / "bench" / "data" / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv"


# -- the workload ----------------------------------------------------------------------------


def trace_format(path: Path) -> str:
    """``azure`` for a CSV, ``mooncake`` for JSONL (the trace formats the loaders read)."""
    return "azure" if path.suffix.lower() == ".csv" else "mooncake"


def fit_requests(
    reqs: Sequence[LiveRequest], max_model_len: int, max_output_tokens: int
) -> tuple[list[LiveRequest], dict[str, int]]:
    """Each request's output capped at ``max_output_tokens`` and its prompt cut (keeping its
    prefix) to ``max_model_len`` less that output and one token; how many of each were cut."""
    if max_output_tokens < 1 or max_model_len < max_output_tokens + 2:
        raise ValueError(
            f"max_output_tokens={max_output_tokens} must be >= 1 and leave room for a prompt "
            f"in max_model_len={max_model_len}"
        )
    out: list[LiveRequest] = []
    cut = {"prompts_cut": 0, "outputs_cut": 0}
    for r in reqs:
        mt = min(r.max_tokens, max_output_tokens)
        room = max_model_len - mt - 1
        cut["outputs_cut"] += int(mt < r.max_tokens)
        cut["prompts_cut"] += int(len(r.ids) > room)
        out.append(replace(r, ids=r.ids[:room], max_tokens=mt))
    return out, cut


def build_replay(
    trace: Path,
    *,
    time_scale: float,
    max_requests: int,
    max_model_len: int,
    max_output_tokens: int,
    vocab: int,
    seed: int = 0,
    fmt: str | None = None,
) -> tuple[list[LiveRequest], dict[str, Any]]:
    """The replay's requests (see the module docstring) and how they were shaped."""
    if max_requests < 1:
        raise ValueError(f"max_requests must be >= 1, got {max_requests}")
    fmt = fmt or trace_format(trace)
    reqs = trace_requests(load_trace(trace, fmt, max_requests), vocab, seed)
    timed, _ = shape(reqs, limit=max_requests, time_scale=time_scale)
    fitted, cut = fit_requests(timed, max_model_len, max_output_tokens)
    span = fitted[-1].at_s if fitted else 0.0
    info = {
        "trace": str(trace),
        "format": fmt,
        "requests": len(fitted),
        "time_scale": time_scale,
        "span_s": span,
        "rate_per_s": (len(fitted) - 1) / span if span > 0 else None,
        "max_model_len": max_model_len,
        "max_output_tokens": max_output_tokens,
        "prompt_tokens_mean": (sum(len(r.ids) for r in fitted) / len(fitted) if fitted else 0.0),
        "output_tokens_mean": (sum(r.max_tokens for r in fitted) / len(fitted) if fitted else 0.0),
        **cut,
    }
    return fitted, info


# -- the systems -----------------------------------------------------------------------------


def base_args(
    config_args: dict[str, Any],
    *,
    model_path: str | None = None,
    build_preset: str | None = "test",
    cache_dir: str | None = None,
) -> dict[str, Any]:
    """The config's args for this bench: the test model (``model_path``, built from
    ``build_preset`` when missing), keys off (``ingress.auth: none``: the proxy is on
    loopback) and the one tenant unlimited (what is measured is the pool, not the limits)."""
    args = copy.deepcopy(config_args)
    model = dict(args.get("model") or {})
    if model_path is not None:
        model["path"] = model_path
    model["build_preset"] = build_preset
    args["model"] = model
    args["ingress"] = {**dict(args.get("ingress") or {}), "auth": "none"}
    args["tenants"] = {
        **dict(args.get("tenants") or {}),
        "default": {"requests_per_second": None, "tokens_per_minute": None},
    }
    if cache_dir:
        args["cache_dir"] = cache_dir
    return args


def system_args(
    system: str,
    args: dict[str, Any],
    *,
    idle_to_zero_s: float | None = None,
    downscale_delay_s: float | None = None,
    slo: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``args`` for ``system``: ``autoscaled`` (the config's autoscaling, shorter timings when
    given), ``slo`` (that plus ``autoscaling.slo``), ``always_on`` (autoscaling off, each role
    at the autoscaler's ``max_replicas``)."""
    if system not in SYSTEMS:
        raise ValueError(f"unknown system {system!r}; known: {list(SYSTEMS)}")
    out = copy.deepcopy(args)
    auto = dict(out.get("autoscaling") or {})
    if system == "always_on":
        for role in ROLES:
            bounds = dict(auto.get(role) or {})
            if "max_replicas" not in bounds:
                raise ValueError(f"autoscaling.{role}.max_replicas is not in the config")
            out[role] = {**dict(out.get(role) or {}), "num_replicas": bounds["max_replicas"]}
        out["autoscaling"] = {**auto, "enabled": False}
        return out
    auto["enabled"] = True
    if idle_to_zero_s is not None:
        auto["idle_to_zero_s"] = idle_to_zero_s
    if downscale_delay_s is not None:
        auto["downscale_delay_s"] = downscale_delay_s
    if system == "slo":
        if not slo:
            raise ValueError("the slo system needs its targets (--slo TTFT_S,ITL_S)")
        auto["slo"] = dict(slo)
    out["autoscaling"] = auto
    return out


def parse_slo(value: str) -> dict[str, float]:
    """``"TTFT_S,ITL_S"`` (seconds, both > 0) as ``autoscaling.slo``'s targets."""
    parts = [p.strip() for p in value.split(",")]
    if len(parts) != 2:
        raise ValueError(f"expected TTFT_S,ITL_S (two numbers of seconds), got {value!r}")
    try:
        ttft, itl = float(parts[0]), float(parts[1])
    except ValueError:
        raise ValueError(f"expected TTFT_S,ITL_S (two numbers of seconds), got {value!r}") from None
    if not (ttft > 0 and itl > 0 and math.isfinite(ttft) and math.isfinite(itl)):
        raise ValueError(f"both targets must be > 0 s, got {value!r}")
    return {"ttft_p99_s": ttft, "itl_p99_s": itl}


def parse_slo_point(value: str) -> tuple[str, dict[str, float], float | None]:
    """One ``--slo-sweep`` point, ``"TTFT_S,ITL_S[,MAX_COLD_FRACTION[,KEEP_ALIVE_CAP_S]]"``:
    its system name (``slo[<the point>]``), its ``autoscaling.slo`` targets and its
    ``idle_to_zero_s`` (the derived keep-alive's cap; None: the run's)."""
    parts = [p.strip() for p in value.split(",")]
    if not 2 <= len(parts) <= 4:
        raise ValueError(
            f"expected TTFT_S,ITL_S[,MAX_COLD_FRACTION[,KEEP_ALIVE_CAP_S]], got {value!r}"
        )
    targets: dict[str, float] = parse_slo(",".join(parts[:2]))
    try:
        eps, cap = (float(p) for p in (*parts[2:], "nan", "nan")[:2])
    except ValueError:
        raise ValueError(f"not a number in {value!r}") from None
    if len(parts) >= 3:
        if not 0 < eps < 1:
            raise ValueError(f"MAX_COLD_FRACTION must be in (0, 1), got {value!r}")
        targets["max_cold_fraction"] = eps
    if len(parts) == 4 and not (cap >= 0 and math.isfinite(cap)):
        raise ValueError(f"KEEP_ALIVE_CAP_S must be >= 0 s, got {value!r}")
    return f"slo[{','.join(parts)}]", targets, cap if len(parts) == 4 else None


def decode_step(args: dict[str, Any]) -> dict[str, Any] | None:
    """The decode step curve the app's policy sizes decode with (``autoscaling.slo.
    decode_step``: the one set, else the decode role's profile's, as ``build_app`` resolves
    it: ``AppConfig.resolved_autoscaling``), or None when there is none."""
    from deployments.config import load_app_config

    slo = load_app_config(args, environ={}).resolved_autoscaling().slo
    if slo is None or slo.decode_step is None:
        return None
    return dict(slo.decode_step.model_dump(mode="json"))


def deploy_spec(system: str, args: dict[str, Any]) -> dict[str, Any]:
    """The application a Serve config would hold for ``system`` (the autoscaled ones, every
    system but ``always_on``, sweep points included, with the application-level policy)."""
    return config_app(APP, args, policy=system != "always_on")


# -- replica-seconds ---------------------------------------------------------------------------


Sample = tuple[float, dict[str, dict[str, int]]]
"""One poll: its time (s) and each role's count of replicas per Serve state."""


def live_replicas(states: dict[str, int]) -> int:
    """Replicas in :data:`LIVE_STATES` of one role's state counts."""
    return sum(int(n) for s, n in states.items() if s in LIVE_STATES)


def replica_seconds(samples: Sequence[Sample], t0: float, t1: float) -> dict[str, float]:
    """Replica-seconds per role and ``total`` over ``[t0, t1]``: each sample's live replicas
    (:func:`live_replicas`) hold from its time until the next sample's (the last until
    ``t1``; before the first sample, the first sample's count). No samples: zeros."""
    out = {r: 0.0 for r in ROLES}
    pts = sorted(samples, key=lambda s: s[0])
    if pts and t1 > t0:
        for i, (t, snap) in enumerate(pts):
            start = t0 if i == 0 else max(t, t0)
            end = min(pts[i + 1][0], t1) if i + 1 < len(pts) else t1
            if end <= start:
                continue
            for role in ROLES:
                out[role] += live_replicas(snap.get(role) or {}) * (end - start)
    out["total"] = sum(out[r] for r in ROLES)
    return out


def _role_states(app: str) -> dict[str, dict[str, int]]:
    states = replica_states(app)
    return {role: states.get(role, {}) for role in ROLES}


class ReplicaPoll:
    """Polls Serve's replica states of both engine deployments every ``period_s`` in a
    thread (:data:`POLL_S`); keeps ``(time.monotonic(), states)`` samples."""

    def __init__(self, app: str = APP, period_s: float = POLL_S) -> None:
        self.app = app
        self.period_s = period_s
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            # a status call racing a change is skipped: the next poll comes
            with contextlib.suppress(Exception):
                self.samples.append((time.monotonic(), _role_states(self.app)))
            self._stop.wait(self.period_s)

    def __enter__(self) -> ReplicaPoll:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def timeline(samples: Sequence[Sample], t0: float) -> list[dict[str, float]]:
    """The samples as ``{"t": s from t0, role: live replicas}`` rows (JSON, the plot)."""
    return [
        {"t": round(t - t0, 2), **{r: float(live_replicas(s.get(r) or {})) for r in ROLES}}
        for t, s in samples
    ]


# -- summaries -----------------------------------------------------------------------------------


def cold_starts(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """From the stats before the replay (just before their reset) and after it: the requests
    that waited for a cold start (the ``cold_start`` phase's count since the reset) and each
    role's waits in that time."""
    ing_b, ing_a = before.get("ingress") or {}, after.get("ingress") or {}
    phase = (ing_a.get("phases_s") or {}).get("cold_start") or {}
    wb = ing_b.get("cold_start_waits") or {}
    wa = ing_a.get("cold_start_waits") or {}
    return {
        "requests": int(phase.get("n") or 0),
        "wait_s": {k: phase.get(k) for k in ("mean", "p50", "max")},
        "waits_by_role": {r: int(wa.get(r) or 0) - int(wb.get(r) or 0) for r in ROLES},
    }


def summarize_system(
    results: Sequence[LiveResult],
    cold: dict[str, Any],
    rs: dict[str, float],
    window_s: float,
) -> dict[str, Any]:
    """One system's summary: requests, errors, cold-start fraction, replica-seconds (and the
    mean replicas over the window), TTFT and ITL."""
    ok = [r for r in results if r.ok]
    n = len(results)
    return {
        "requests": n,
        "errors": n - len(ok),
        "error_samples": sorted({r.error for r in results if not r.ok})[:3],
        "cold_start_requests": cold["requests"],
        "cold_start_fraction": cold["requests"] / n if n else None,
        "cold_start_waits_by_role": cold["waits_by_role"],
        "cold_start_wait_s": cold["wait_s"],
        "replica_seconds": rs,
        "mean_replicas": {k: v / window_s if window_s > 0 else None for k, v in rs.items()},
        "window_s": window_s,
        "ttft": summarize([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl": summarize([x for r in ok for x in r.itl_s]),
        "e2e": summarize([r.e2e_s for r in ok if r.e2e_s is not None]),
        "ttft_samples": [r.ttft_s for r in ok if r.ttft_s is not None],
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def compare(systems: dict[str, dict[str, Any]], base: str = BASE) -> dict[str, dict[str, Any]]:
    """Each system's ratios to ``base``'s (replica-seconds, TTFT p50/p99, ITL p99) and the
    :data:`GOALS` it meets (None: not measurable, e.g. no base in the run)."""
    b = systems.get(base)
    out: dict[str, dict[str, Any]] = {}
    for name, s in systems.items():
        r = {
            "replica_seconds_ratio": _ratio(
                s["replica_seconds"]["total"], b["replica_seconds"]["total"] if b else None
            ),
            "ttft_p50_ratio": _ratio(s["ttft"]["p50"], b["ttft"]["p50"] if b else None),
            "ttft_p99_ratio": _ratio(s["ttft"]["p99"], b["ttft"]["p99"] if b else None),
            "itl_p99_ratio": _ratio(s["itl"]["p99"], b["itl"]["p99"] if b else None),
        }
        out[name] = {**r, "goals": goals(s, r)}
    return out


def _at_most(x: float | None, bound: float) -> bool | None:
    return None if x is None else x <= bound


def goals(summary: dict[str, Any], ratios: dict[str, float | None]) -> dict[str, bool | None]:
    """Which of :data:`GOALS` ``summary`` (with its ``ratios``) meets; ``all``: every one
    (None when one is not measurable)."""
    g = {
        "cold_starts": _at_most(summary["cold_start_fraction"], GOALS["max_cold_start_fraction"]),
        "replica_seconds": _at_most(
            ratios["replica_seconds_ratio"], GOALS["max_replica_seconds_ratio"]
        ),
        "ttft_p99": _at_most(ratios["ttft_p99_ratio"], GOALS["max_ttft_p99_ratio"]),
        "no_errors": summary["errors"] <= GOALS["max_errors"],
    }
    verdicts = list(g.values())
    g["all"] = None if any(v is None for v in verdicts) else all(verdicts)
    return g


def front(systems: dict[str, dict[str, Any]], ratios: dict[str, dict[str, Any]]) -> list[str]:
    """The systems on the live Pareto front: among those that failed no request, the ones no
    other beats on all of cold-start fraction, replica-seconds ratio and TTFT p99 ratio
    (:func:`bench.sim.autoscale.pareto_front`, the simulator's front)."""
    from bench.sim.autoscale import pareto_front

    points = [
        {
            "name": name,
            "cold_start_fraction": s["cold_start_fraction"],
            "replica_seconds_ratio": ratios.get(name, {}).get("replica_seconds_ratio"),
            "ttft_p99_ratio": ratios.get(name, {}).get("ttft_p99_ratio"),
        }
        for name, s in systems.items()
        if s["errors"] == 0
    ]
    return [p["name"] for p in pareto_front(points)]


# -- the run ------------------------------------------------------------------------------------


def _app_status(app: str) -> tuple[str | None, str]:
    from ray import serve

    try:
        a = serve.status().applications.get(app)
    except Exception:  # Serve's status races an app being created: poll again
        return None, ""
    if a is None:
        return None, ""
    return str(getattr(a.status, "value", a.status)), str(getattr(a, "message", "") or "")


def wait_running(app: str, timeout_s: float = 900.0) -> None:
    """Until Serve says ``app`` is RUNNING (its deployments at their targets: zero replicas
    for the autoscaled app); a failed deploy raises with Serve's message."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status, message = _app_status(app)
        if status == "RUNNING":
            return
        if status == "DEPLOY_FAILED":
            raise RuntimeError(f"the app {app} failed to deploy: {message[-2000:]}")
        time.sleep(1.0)  # polling a deploy
    raise TimeoutError(f"the app {app} was not running after {timeout_s:.0f} s")


def warm_request(url: str, model: str, timeout_s: float = 900.0) -> None:
    """One short streamed request (not part of the replay), until it is answered: the
    autoscaled pool starts its pair for it, and every system's engines serve once first."""
    req = LiveRequest(0.0, tuple(range(10, 74)), 4)
    res, _ = asyncio.run(replay(url, [req], model=model, timeout_s=timeout_s))
    if not res[0].ok:
        raise RuntimeError(f"the warm-up request failed: {res[0].error}")


def delete_app(app: str) -> None:
    from ray import serve

    try:
        serve.delete(app)
    except TimeoutError:  # a wedged replica can outlast serve.delete's own wait
        deadline = time.monotonic() + 300
        while app in serve.status().applications and time.monotonic() < deadline:
            time.sleep(1.0)
    wait_gone(f"ServeReplica:{app}:")


def run(
    config_args: dict[str, Any],
    trace: Path,
    *,
    systems: Sequence[str] = ("always_on", "autoscaled"),
    time_scale: float = 1.0,
    max_requests: int = 100,
    max_output_tokens: int = 128,
    idle_to_zero_s: float | None = 20.0,
    downscale_delay_s: float | None = 10.0,
    slo: dict[str, Any] | None = None,
    sweep: Sequence[tuple[str, dict[str, float], float | None]] = (),
    start: str = "warm",
    trace_fmt: str | None = None,
    seed: int = 0,
    port: int = 8768,
    progress: Callable[[str, int], Callable[[int], None]] | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Deploy each of ``systems`` in turn, replay the trace against it, summarize and compare
    (see the module docstring). ``config_args``: :func:`base_args` of the config's app;
    ``sweep``: :func:`parse_slo_point`'s points, run after ``systems``."""
    from ray import serve

    from deployments.config import load_app_config

    if start not in ("warm", "zero"):
        raise ValueError(f"start must be warm or zero, got {start!r}")
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or not (systems or sweep):
        raise ValueError(f"systems must be some of {list(SYSTEMS)}, got {list(systems)}")
    if "slo" in systems and not slo:
        raise ValueError("the slo system needs its targets (--slo TTFT_S,ITL_S)")
    per = {
        s: system_args(
            s,
            config_args,
            idle_to_zero_s=idle_to_zero_s,
            downscale_delay_s=downscale_delay_s,
            slo=slo,
        )
        for s in systems
    }
    for name, targets, cap in sweep:
        if name in per:
            raise ValueError(f"the sweep point {name} is given twice")
        per[name] = system_args(
            "slo",
            config_args,
            idle_to_zero_s=idle_to_zero_s if cap is None else cap,
            downscale_delay_s=downscale_delay_s,
            slo=targets,
        )
    for name, a in per.items():
        if name.startswith("slo"):
            step = decode_step(a)
            if step is not None:
                a["autoscaling"]["slo"].setdefault("decode_step", step)
    # refuse bad args and a trace that does not load before starting Ray
    cfg = [load_app_config(a) for a in per.values()][0]
    if not load_trace(trace, trace_fmt or trace_format(trace), max_requests):
        raise ValueError(f"the trace {trace} has no requests")
    out: dict[str, Any] = {
        "simulated": False,
        "start": start,
        "goals": GOALS,
        "args": per,
        "systems": {},
        "timelines": {},
        "failed": {},
    }
    import ray

    owns_ray = not ray.is_initialized()  # shut down at the end only a Ray this call started
    url = serve_locally(port)
    try:
        for system in per:
            log(f"{system}: deploying ...")
            try:
                summary, rows = _run_system(
                    system,
                    per[system],
                    url,
                    out,
                    start=start,
                    build=lambda: build_replay(
                        trace,
                        time_scale=time_scale,
                        max_requests=max_requests,
                        max_model_len=cfg.model.max_model_len,
                        max_output_tokens=max_output_tokens,
                        vocab=model_vocab(cfg.model.resolved_path()),
                        seed=seed,
                        fmt=trace_fmt,
                    ),
                    progress=progress,
                )
            except Exception as e:  # one system's failure is reported; the others still run
                out["failed"][system] = repr(e)[:2000]
                log(f"{system}: failed: {e!r}"[:500])
                continue
            finally:
                try:
                    delete_app(APP)
                except Exception as e:  # the next system's deploy replaces it anyway
                    log(f"{system}: deleting the app failed: {e!r}"[:500])
            out["systems"][system] = summary
            out["timelines"][system] = rows
            log(f"{system}: {summary['requests'] - summary['errors']}/{summary['requests']} ok")
    finally:
        if owns_ray and ray.is_initialized() and not os.environ.get("RAY_ADDRESS"):
            try:
                serve.shutdown()
            finally:
                ray.shutdown()
    out.pop("_requests", None)
    out["compare"] = compare(out["systems"])
    out["front"] = front(out["systems"], out["compare"])
    return out


def _run_system(
    system: str,
    args: dict[str, Any],
    url: str,
    out: dict[str, Any],
    *,
    start: str,
    build: Callable[[], tuple[list[LiveRequest], dict[str, Any]]],
    progress: Callable[[str, int], Callable[[int], None]] | None,
) -> tuple[dict[str, Any], list[dict[str, float]]]:
    """Deploy ``system`` (``args``), warm it (see ``start``), replay against it; its summary
    and replica timeline. The replay's requests are built once, when the first app has built
    the model (``out["replay"]``, ``out["_requests"]``), so every system sends the same."""
    from deployments.config import load_app_config

    c = load_app_config(args)
    t_deploy = time.monotonic()
    deploy_config(deploy_spec(system, args))
    wait_running(APP)
    if system == "always_on":
        wait_health(url, c.prefill.num_replicas)
        wait_health(url, c.decode.num_replicas, role="decode")
    else:
        wait_health(url, 0)  # ready at zero: requests wait for the cold start
    if "replay" not in out:  # the model exists once an app is built: its vocabulary
        out["_requests"], out["replay"] = build()
    reqs: list[LiveRequest] = out["_requests"]
    model = c.model.served_name
    if start == "warm" or system == "always_on":
        warm_request(url, model)
        time.sleep(1.0)  # its record in the stats, before they are reset
    deploy_s = time.monotonic() - t_deploy
    before = reset_stats(url)
    tick = progress(system, len(reqs)) if progress else None
    with ReplicaPoll() as poll:
        time.sleep(2 * POLL_S)  # a sample before the replay's start
        t0 = time.monotonic()
        results, _ = asyncio.run(replay(url, reqs, model=model, progress=tick))
        t1 = time.monotonic()
        time.sleep(2 * POLL_S)
    time.sleep(1.0)  # the last requests' records
    after = get_json(url, "/v1/pdserve/stats")
    rs = replica_seconds(poll.samples, t0, t1)
    s = summarize_system(results, cold_starts(before, after), rs, t1 - t0)
    s["deploy_s"] = round(deploy_s, 2)
    s["autoscaling_decisions"] = (after.get("autoscaling") or {}).get("decisions")
    s["autoscaling_demand"] = (after.get("autoscaling") or {}).get("demand")  # what it saw
    return s, timeline(poll.samples, t0)


# -- the plot -----------------------------------------------------------------------------------


def plot(res: dict[str, Any], path: Path) -> None:
    """Left: live replicas (both roles) over the replay per system; middle: TTFT CDF; right:
    replica-seconds against TTFT p99 (ratios to always_on), the front's systems filled, the
    goals' corner shaded (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, f) = plt.subplots(1, 3, figsize=(19, 4.8))
    colors = {"always_on": "tab:grey", "autoscaled": "tab:blue", "slo": "tab:orange"}
    others = iter(("tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive"))
    for name in res.get("systems") or {}:
        colors.setdefault(name, next(others, "black"))
    for name, rows in (res.get("timelines") or {}).items():
        if not rows:
            continue
        ts = [x["t"] for x in rows]
        c = colors.get(name)
        a.step(ts, [x["prefill"] for x in rows], where="post", color=c, label=f"{name} prefill")
        a.step(ts, [x["decode"] for x in rows], where="post", color=c, ls="--", label="decode")
    a.set_xlabel("s from the replay's start")
    a.set_ylabel("replicas (starting to stopping)")
    a.set_title("Serve's replicas over the replay")
    a.grid(True, alpha=0.3)
    a.legend(fontsize=8)
    for name, s in (res.get("systems") or {}).items():
        xs = sorted(s.get("ttft_samples") or [])
        if xs:
            b.plot(
                xs,
                [(i + 1) / len(xs) for i in range(len(xs))],
                color=colors.get(name),
                label=f"{name} (cold {s['cold_start_fraction'] or 0:.1%})",
            )
    b.set_xscale("log")
    b.set_xlabel("TTFT (s, log scale)")
    b.set_ylabel("fraction of requests")
    rep = res.get("replay") or {}
    b.set_title(
        f"TTFT: {rep.get('requests', '?')} requests, time scale {rep.get('time_scale', '?')}"
    )
    b.grid(True, which="both", alpha=0.3)
    b.legend(fontsize=8)
    on_front = set(res.get("front") or ())
    for name, c in (res.get("compare") or {}).items():
        x, y = c.get("replica_seconds_ratio"), c.get("ttft_p99_ratio")
        if x is None or y is None:
            continue
        s = res["systems"][name]
        f.scatter(
            [x],
            [y],
            s=60,
            color=colors.get(name),
            facecolors=colors.get(name) if name in on_front else "none",
        )
        f.annotate(
            f"{name} (cold {s['cold_start_fraction'] or 0:.0%}"
            + (f", {s['errors']} failed)" if s["errors"] else ")"),
            (x, y),
            fontsize=7,
            xytext=(4, 4),
            textcoords="offset points",
        )
    f.fill_between(
        [0, GOALS["max_replica_seconds_ratio"]],
        0,
        GOALS["max_ttft_p99_ratio"],
        color="tab:green",
        alpha=0.12,
        label="goals (rs <= 0.6, p99 <= 1.5x)",
    )
    f.set_xlim(left=0)
    f.set_ylim(bottom=0)
    f.set_xlabel("replica-seconds / always_on")
    f.set_ylabel("TTFT p99 / always_on")
    f.set_title("Pareto front (filled: on it; failed runs excluded)")
    f.grid(True, alpha=0.3)
    f.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
