"""Event-driven simulator of a serverless prefill/decode pool under five autoscalers
(every output: **simulated**; ``pdserve sim autoscale``).

The question it answers (issue #15, "Simulation"): how often does a request wait on a cold
start, and how many replica-seconds does each autoscaling policy spend, on a real arrival
trace? ``warm_pool`` and ``slo`` are ours, :func:`controllers.autoscale.decide` called
as-is (knob-driven, and with ``autoscaling.slo`` set: issue 43); the others are baselines
mirrored from their code.

Two engine models (``SimParams.engine``). ``simple`` is the one described under *Model*
below. ``profile`` (issue 43) runs on the engine profile (``SimParams.profile``, default the
modelled A6000 / Llama-3.1-8B one) as the prefill and decode simulators do:

- *Prefill*: per replica, engine steps priced by the profile's ``step_cost`` (the prefill
  simulator's cost model). A replica not in a step starts one with its requests in progress,
  then the queue's head in FCFS order, up to ``token_budget`` tokens (the last one chunked,
  the rest in later steps); several prompts share a step. A prompt that finishes in a step
  goes to decode at the step's end. Not modelled: the policies of ``bench.sim.prefill``
  (FCFS only), KV limits of the prefill engine (prompts in progress reserve no blocks).
- *Prefix cache* (a workload with content: Mooncake's ``hash_ids``, one per 512-token
  block, ``mooncake_workload`` / ``--trace-format mooncake``; Azure and ServeGen have
  lengths only, their requests carry no hashes and never hit, and the simulator runs
  exactly as without a cache). Every prefill replica has its own
  :class:`bench.sim.prefill.BlockCache` (block-level LRU, reference-count pinning) of
  ``prefix_cache_blocks`` blocks of the trace's size, by default the profile's KV in those
  blocks (the A6000 profile: 12,160 x 16 = 194,560 tokens = 380 blocks of 512). A replica
  that starts has an empty cache, a stopped one's is gone: more replicas split the cache,
  scaling to zero loses it. A replica taking a request skips its cached leading blocks
  (pinned while the prompt runs; at most ``(prompt - 1) // 512`` of them, so at least one
  token is computed) and prefills the rest, the cached prefix priced as context in
  ``step_cost``; when the prompt finishes its full blocks are registered in that replica's
  cache (no room with every block pinned: registration stops). *Routing*, simplified: the
  queue stays one FCFS queue; its head goes to the replica not in a step with budget left
  (the only ones that take work) holding its longest cached prefix, ties by the least
  uncached tokens owed, then the first. pdserve's router (``controllers.routing``,
  ``prefix_load``) binds a request to a replica at arrival, scoring the share of the
  prompt cached against the expected uncached work, with a hot-spot guard; neither the
  binding at arrival nor the weights nor the guard are modelled.
- *What the policies see with a cache*: as the real replicas report, uncached tokens:
  ``tokens_total`` (``uncached_tokens_total``) is the uncached tokens of the prompts
  replicas took plus, while one runs, the queue's prompts whole (no replica has matched
  them yet; taken with a hit, such a prompt lowers the counter by its hit, which the
  controller reads as a restart and skips); ``queued_tokens``
  (``queued_uncached_tokens``) the uncached tokens owed plus the queue's; the ``slo``
  policy's prompt mean and p99 are :func:`controllers.slo_sizing.prompt_moments` of the
  last ``RECENT_PROMPTS`` (256) prefilled prompts' uncached tokens (without a cache: the
  last 500 arrived prompts, ``numpy.percentile``, as before). ``cache_hit_ratio``: cached
  prompt tokens / prompt tokens of the counted requests. always_on is still sized on
  whole prompts (the hits depend on how the cache is split).
- *Decode*: per replica a processor-sharing batch: every sequence advances one token per
  step of ``l(B)`` (the profile's decode step curve, ``B`` the replica's batch), so ITL grows
  with the batch; the ITL p99 reported is token-weighted over every step. Admission is FCFS
  to the least-loaded replica whose window (its KV, ``kv_blocks x block_size`` tokens) holds
  ``prompt + expected_output_tokens`` (256) and whose batch is under ``max_num_seqs``
  (256): the real output length decides when a sequence ends but is known neither to the
  window nor to the policies. Not modelled: TWP's own window and ranking
  (``bench.sim.decode`` drives them), preemption when real outputs outgrow the reservation,
  the KV transfer, the noisy-neighbour cost of injected KV.
- *always_on*: prefill over ``token_budget / step_cost(token_budget)`` tokens/s per replica;
  decode sized for the busiest minute's sequences in decode (each for ``output x l_min``,
  exact overlaps) over ``b0 x always_on_utilization``, the flat part of the step curve.
- *TTFT*: the arrival to the end of the decode step that admitted it (``l(B)`` at admission).

``warmup_s`` drops the first seconds from every metric (requests arriving before it, and
replica-seconds before it): every autoscaled policy starts from zero at t = 0, and at 4x a
14 s cold start is already more than 1% of the requests, a start-up and not the steady state.

Model
-----
Each request has an arrival time, prompt tokens and output tokens. It is prefilled by one
**prefill** replica, then decoded by one **decode** replica (disaggregated: a PD pair).

- *Prefill*: one FCFS queue in front of the role; a free running replica takes its head
  and serves the whole prompt at ``prefill_tokens_per_s`` (default 4,000 tokens/s per
  replica, one prompt at a time). The figure is modelled, not measured: the repository's
  modelled A6000 / Llama-3.1-8B profile (``engines/profiles/a6000_llama31_8b.json``)
  prefills 1,024 tokens in 0.205 s and 4,096 in 0.87 s (~4,700-5,000 tokens/s); 4,000 is a
  round figure below that. No prefix cache in this engine (see ``profile`` above).
- *Decode*: one FCFS queue; the head is admitted by the running decode replica with the
  least load that has room in its token window (``decode_window_tokens``, default 16,384;
  a request holds ``prompt + output`` tokens, its KV at completion, for its whole decode;
  a request larger than the window is admitted alone to an empty replica). This is a
  TWP-like token window, simplified: the window is fixed and the output length known.
  Each admitted request emits a token every ``itl_s`` (25 ms, fixed, independent of the
  batch). **TTFT** = first decode token - arrival = waits for a prefill replica
  (including any cold start) + prefill + waits for a decode replica (including any cold
  start, and the window) + one ITL.
- *Replicas*: per role, each is **starting** (ready ``cold_start_s`` after it was asked
  for), **running**, or **draining** (asked to stop while busy: takes no new work, stops
  when its work is done, as Ray Serve stops replicas gracefully), and then off. A starting
  replica asked to stop is cancelled. Scale-down picks starting replicas first (newest),
  then idle running ones, then the least-loaded busy ones.
- *Cold start* (modelled, not measured): ``weights_gb / load_gb_per_s + engine_init_s``.
  Defaults: an 8B model in fp16 is 16 GB; at ~2 GB/s from a local NVMe SSD that is 8 s;
  plus 6 s of engine start (process, CUDA context, KV-cache profiling and allocation,
  CUDA-graph capture with cached compilation): **14 s**. ``serverlessllm`` loads
  checkpoints ``sllm_load_speedup`` (8x: the middle of ServerlessLLM's reported 6-10x over
  the safetensors/PyTorch loaders; its repository's H100 results for Llama-3.1-8B,
  ``benchmarks/results/h100_2025/random``, show ~4.5 s for safetensors against ~0.67 s)
  faster: 16 / 16 + 6 = **7 s**. Both are parameters.
- *Control*: every ``control_interval_s`` (1 s) the policy sees, per role
  (:class:`RoleObs`): running and starting replicas, its last target, requests waiting for
  a replica while none runs (``handle_queued``), requests in the role (``ongoing``),
  queued uncached prompt tokens, the cumulative prompt tokens the replicas have taken,
  the measured prefill throughput (known once one prefill finished), the decode token
  load and window; it returns the replica target per role.

Policies (``POLICY_NAMES``); every autoscaled one starts from zero replicas:

- ``always_on``: a fixed count per role, running from t = 0, sized for the workload's
  peak: the busiest ``peak_window_s`` (60 s) of prompt tokens per second over
  ``prefill_tokens_per_s * u``, and of decode window load (each request's
  ``prompt + output`` tokens over ``[arrival, arrival + output * itl]``) over
  ``decode_window_tokens * u``, with ``u`` = ``always_on_utilization`` (0.8, the
  AutoscaleConfig default; fixed, so tuning warm_pool does not move the reference), at
  least 1. It is the replica-seconds reference (``replica_seconds_ratio``).
- ``serve_default``: Ray Serve 2.60's default request-based policy
  (``ray/serve/autoscaling_policy.py``), per role independently:
  ``desired = total_requests / target_ongoing_requests`` (2) with ``total_requests`` the
  role's ongoing requests averaged over ``look_back_period_s`` (30 s); scaling factors 1;
  up after ``upscale_delay_s`` (30 s) of wanting more, down after ``downscale_delay_s``
  (600 s, also for 1 -> 0; to 1 first from above 1); the cold-start fast path (0 running
  and a request -> ``max(1, target)`` at once); bounds ``[0, max_replicas]``. Not
  modelled: the replicas' 10 s metric push period (Serve sees older numbers than here).
  Decode sees a request only once its prefill is done, so a request from zero meets the
  two cold starts in series.
- ``serverlessllm``: ServerlessLLM's router autoscaler (``sllm/serve/routers/
  roundrobin_router.py``, ``auto_scaler``) with its default config (concurrency target 1,
  min 0, keep-alive 0), per role, with the fast loader: ``desired = ceil(ongoing / 1)``;
  each 1 s loop starts one instance when ``desired`` exceeds starting + ready, and stops
  one when below (after ``keep_alive`` seconds without a request: at once). Its
  ``max_instances`` (10) is replaced by the common ``max_replicas``.
- ``warm_pool``: ours, :func:`controllers.autoscale.decide` with an
  :class:`~controllers.autoscale.AutoscaleConfig` (``paired=True``), bounds
  ``[0, max_replicas]``, ``prefill_tokens_per_s`` = the modelled throughput and
  ``cold_start_s`` = the modelled cold start unless overridden; standard loader (14 s).
- ``slo``: ours with ``autoscaling.slo`` (:mod:`controllers.slo_sizing`): the same base as
  ``warm_pool`` plus targets (``DEFAULT_SLO``: TTFT p99 2 s, ITL p99 50 ms, cold budget 3%,
  or a TTFT target of a multiple of always_on's TTFT p99 on the workload,
  ``slo_ttft_factor``) and the profile's decode step curve; it sees the last 500 prompts'
  mean and p99 (with a prefix cache: the last 256 prefilled prompts' uncached tokens, see
  above) and the decode replicas' KV blocks (profile engine). ``slo_sweep`` runs it at
  several (cold budget, TTFT target) settings and ``pareto_front`` keeps the settings no
  other beats on cold fraction, replica-seconds and TTFT p99 at once.

Metrics per policy (``replica_seconds_ratio`` and ``ttft_p99_ratio``: to always_on's on the
same workload; ``itl_p99_s``; ``reasons``: the count of each decision reason, ours only):
``cold_start_fraction``: the share of requests that waited on a cold
start, i.e. in either role the replica that served it was not yet running when the
request reached that role (it was starting then, or was started afterwards); ``always_on``
has none. It also counts a request that a new replica took from a queue an old replica
would have reached soon after: an upper bound. ``from_zero_fraction``: requests that
reached a role with no running replica; ``two_cold_starts_fraction``: requests that waited
on a cold start in both roles. TTFT STATS (s, :func:`bench.report.stats.summarize`).
``replica_seconds``: the sum over roles of the time replicas were starting, running or
draining within ``[0, duration_s]`` (the workload's span; requests still in flight at the
end finish, but the time after it is not counted, so every policy is charged over the
same span). Scale-ups / downs: replicas started / stopped (cancelled starts included).

Workloads: the Azure LLM conversation trace (:func:`azure_workload`; ``load`` X divides
arrival times by X), the Mooncake trace (:func:`mooncake_workload`, the same, with prefix
block hashes) and ServeGen scenarios (:func:`servegen_workload`) built from
per-client arrival parameters in ``bench/data/servegen`` with lengths from the Azure trace.
Deterministic: a workload's seed fixes it; the simulator has no randomness.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from bench import DATA_DIR
from bench.report.stats import summarize
from bench.sim.prefill import BlockCache
from bench.workloads.traces import MOONCAKE_BLOCK_TOKENS, TraceRequest, load_azure, load_mooncake
from controllers.autoscale import (
    AutoscaleConfig,
    AutoscaleState,
    RoleBounds,
    RoleDemand,
    decide,
)
from controllers.profile import EngineProfile
from controllers.slo_sizing import RECENT_PROMPTS, SloConfig, prompt_moments

ROLES: tuple[str, ...] = ("prefill", "decode")
POLICY_NAMES = ("always_on", "serve_default", "serverlessllm", "warm_pool", "slo")
EngineModel = Literal["simple", "profile"]
#: Recent prompts the ``slo`` policy's prompt p99 is taken over.
PROMPT_P99_SAMPLES = 500
DATA = DATA_DIR
AZURE_CONV = DATA / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv"
SERVEGEN = DATA / "servegen"
SERVEGEN_WINDOW_S = 600.0


class SimParams(BaseModel):
    """Modelled engine and pool figures every policy shares (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prefill_tokens_per_s: float = Field(
        default=4000.0, gt=0, description="Prefill throughput per replica (tokens/s)."
    )
    itl_s: float = Field(default=0.025, gt=0, description="Decode inter-token latency (s).")
    decode_window_tokens: float = Field(
        default=16384.0, gt=0, description="Decode token window per replica (prompt + output)."
    )
    weights_gb: float = Field(default=16.0, gt=0, description="Model weights (GB; 8B fp16).")
    load_gb_per_s: float = Field(default=2.0, gt=0, description="Checkpoint load bandwidth.")
    engine_init_s: float = Field(default=6.0, ge=0, description="Engine start beyond loading.")
    sllm_load_speedup: float = Field(
        default=8.0, ge=1, description="ServerlessLLM's loading speed-up over the standard."
    )
    cold_start_s: float | None = Field(
        default=None, ge=0, description="Override the modelled standard cold start (s)."
    )
    sllm_cold_start_s: float | None = Field(
        default=None, ge=0, description="Override serverlessllm's modelled cold start (s)."
    )
    control_interval_s: float = Field(default=1.0, gt=0, description="Control period (s).")
    max_replicas: int = Field(default=32, ge=1, description="Most replicas per role.")
    peak_window_s: float = Field(default=60.0, gt=0, description="always_on's peak window.")
    always_on_utilization: float = Field(
        default=0.8, gt=0, le=1, description="always_on's sizing: share of capacity at peak."
    )
    engine: EngineModel = Field(
        default="simple",
        description="simple: one prompt at a time at prefill_tokens_per_s, fixed itl_s, known "
        "output lengths in the window; profile: the engine profile's step costs (batched "
        "chunked prefill, decode step curve, unknown output lengths, KV window).",
    )
    profile: str = Field(
        default="a6000_llama31_8b",
        description="engine: profile: the engine profile (shipped name or JSON path).",
    )
    expected_output_tokens: int = Field(
        default=256,
        ge=1,
        description="engine: profile: output tokens a decode admission reserves (the real "
        "length is not known to the engine's window or to the policies).",
    )
    max_num_seqs: int = Field(
        default=256, ge=1, description="engine: profile: most sequences per decode step."
    )
    prefix_cache_blocks: int | None = Field(
        default=None,
        ge=1,
        description="engine: profile: each prefill replica's prefix cache, in the workload's "
        "hash blocks (Mooncake: 512 tokens); None: the profile's KV (kv_blocks x block_size "
        "tokens; the A6000 profile: 194,560 tokens = 380 blocks of 512).",
    )
    warmup_s: float = Field(
        default=0.0,
        ge=0,
        description="Requests arriving before this are served but not counted, and "
        "replica-seconds are charged from it (every autoscaled policy starts from zero at "
        "t = 0: the trace's first seconds are a start-up, not the steady state).",
    )

    def engine_profile(self) -> EngineProfile:
        return _load_profile(self.profile)

    def prefill_rate(self) -> float:
        """Prefill tokens/s per replica: ``prefill_tokens_per_s`` (simple) or a full step's
        ``token_budget / step_cost(token_budget)`` (profile)."""
        if self.engine == "simple":
            return self.prefill_tokens_per_s
        prof = self.engine_profile()
        t = prof.token_budget
        return t / prof.step_cost.seconds([(t, 0)])

    def window_tokens(self) -> float:
        """A decode replica's window: ``decode_window_tokens`` (simple) or its KV in tokens."""
        if self.engine == "simple":
            return self.decode_window_tokens
        prof = self.engine_profile()
        if prof.kv_blocks is None:
            return self.decode_window_tokens
        return float(prof.kv_blocks * prof.block_size)

    def prefix_cache_capacity(self, block_tokens: int) -> int:
        """A prefill replica's prefix cache in blocks of ``block_tokens``: ``prefix_cache_blocks``
        or the profile's KV in tokens over ``block_tokens`` (at least 1)."""
        if self.prefix_cache_blocks is not None:
            return self.prefix_cache_blocks
        prof = self.engine_profile()
        kv_tokens = (
            prof.kv_blocks * prof.block_size
            if prof.kv_blocks is not None
            else self.decode_window_tokens
        )
        return max(1, int(kv_tokens // block_tokens))

    def base_itl_s(self) -> float:
        return self.itl_s if self.engine == "simple" else self.engine_profile().decode.l_min_s

    def standard_cold_start_s(self) -> float:
        if self.cold_start_s is not None:
            return self.cold_start_s
        return self.weights_gb / self.load_gb_per_s + self.engine_init_s

    def fast_cold_start_s(self) -> float:
        if self.sllm_cold_start_s is not None:
            return self.sllm_cold_start_s
        load = self.weights_gb / (self.load_gb_per_s * self.sllm_load_speedup)
        return load + self.engine_init_s


@lru_cache(maxsize=8)
def _load_profile(name: str) -> EngineProfile:
    from engines.profile_store import load_profile

    return load_profile(name)


# --------------------------------------------------------------------------- workloads


@dataclass(frozen=True, slots=True)
class SimRequest:
    """``block_hashes``: the prompt's FULL prefix blocks of ``Workload.block_tokens`` tokens
    (equal hashes: equal prefixes); empty for a trace without content (never hits)."""

    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    block_hashes: tuple[int, ...] = ()


@dataclass(frozen=True)
class Workload:
    """Requests sorted by arrival; ``duration_s``: the span replica-seconds are charged over."""

    name: str
    requests: tuple[SimRequest, ...]
    duration_s: float
    meta: dict[str, Any] = field(default_factory=dict)
    block_tokens: int = MOONCAKE_BLOCK_TOKENS
    """Tokens per entry of the requests' ``block_hashes`` (the prefix cache's block)."""


def azure_workload(
    path: str | Path = AZURE_CONV, *, load: float = 1.0, limit: int | None = None
) -> Workload:
    """The Azure LLM trace with arrival times divided by ``load`` (2: twice the rate)."""
    return trace_workload(load_azure(path, limit=limit), f"azure:{Path(path).name}", load=load)


def mooncake_workload(path: str | Path, *, load: float = 1.0, limit: int | None = None) -> Workload:
    """A Mooncake trace (``hash_ids``: 512-token prefix blocks) with arrival times divided by
    ``load``; each request keeps the hashes of its full blocks (the prefix cache's content)."""
    return trace_workload(
        load_mooncake(path, limit=limit), f"mooncake:{Path(path).name}", load=load
    )


def trace_workload(
    records: Sequence[TraceRequest],
    name: str,
    *,
    load: float = 1.0,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
) -> Workload:
    """Trace records as a workload (arrival times divided by ``load``). A record's
    ``hash_ids`` (one per ``block_tokens`` tokens, the last one possibly partial) become the
    request's full-block hashes, ``input_tokens // block_tokens`` of them; Azure has none."""
    if load <= 0:
        raise ValueError(f"load must be > 0, got {load}")
    reqs = tuple(
        SimRequest(
            r.arrival_s / load,
            r.input_tokens,
            r.output_tokens,
            tuple(r.hash_ids[: r.input_tokens // block_tokens]),
        )
        for r in sorted(records, key=lambda r: r.arrival_s)
    )
    duration = reqs[-1].arrival_s if reqs else 0.0
    meta = {"kind": "trace", "load": load}
    return Workload(name, reqs, max(duration, 1.0), meta, block_tokens)


@dataclass(frozen=True)
class ScenarioSpec:
    """A ServeGen scenario: clients' arrival parameters and the span simulated."""

    directory: str
    clients: tuple[int, ...]
    start_s: float
    duration_s: float
    rate_rps: float | None
    """Mean aggregate rate over the span (req/s) before ``load``; None: the data's own."""
    about: str


SCENARIOS: dict[str, ScenarioSpec] = {
    "servegen-language": ScenarioSpec(
        "language/m-small",
        (2, 11, 16, 19, 36),
        0.0,
        3600.0,
        4.0,
        "5 m-small language clients (steady, bursty CV~19, spiky, a step up, sparse), "
        "first hour of day 1, scaled to 4 req/s",
    ),
    "servegen-reason": ScenarioSpec(
        "reason/deepseek-r1",
        (26, 35, 44),
        61200.0,
        7200.0,
        None,
        "3 deepseek-r1 clients (on/off bursts, intermittent, sparse), 17:00-19:00 of the "
        "day, native rates (~1.4 req/s)",
    ),
}


@dataclass(frozen=True, slots=True)
class ArrivalWindow:
    """One row of a ServeGen ``chunk-*-trace.csv``."""

    start_s: float
    rate_rps: float
    cv: float
    family: str
    param1: float
    param2: float


def load_servegen_client(path: str | Path) -> list[ArrivalWindow]:
    """Parse one ServeGen trace CSV (no header; see ``bench/data/servegen/README.md``)."""
    out: list[ArrivalWindow] = []
    p = Path(path)
    for lineno, line in enumerate(p.read_text().splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        parts = line.split(",")
        if len(parts) != 6:
            raise ValueError(f"{p}:{lineno}: expected 6 fields, got {len(parts)}")
        try:
            w = ArrivalWindow(
                float(parts[0]),
                float(parts[1]),
                float(parts[2]),
                parts[3].strip(),
                float(parts[4]),
                float(parts[5]),
            )
        except ValueError:
            raise ValueError(f"{p}:{lineno}: not numbers: {line!r}") from None
        if w.family not in ("", "Gamma", "Weibull"):
            raise ValueError(f"{p}:{lineno}: unknown family {w.family!r}")
        out.append(w)
    return out


def _window_iats(w: ArrivalWindow, rate: float, rng: np.random.Generator) -> np.ndarray:
    """ServeGen's ``_sample_iats``: ``ceil(rate * 600)`` gaps from the window's distribution,
    rescaled to sum to the window. An empty family with a rate (absent from the shipped
    files) falls back to Gamma with shape ``1 / cv^2``."""
    n = math.ceil(rate * SERVEGEN_WINDOW_S)
    if n <= 0:
        return np.empty(0)
    if w.family == "Gamma":
        iats = rng.gamma(w.param1, w.param2, n)
    elif w.family == "Weibull":
        iats = rng.weibull(w.param1, n) * w.param2
    else:
        shape = 1.0 / max(w.cv, 1e-3) ** 2
        iats = rng.gamma(shape, 1.0 / (shape * rate), n)
    total = float(iats.sum())
    if not np.isfinite(total) or total <= 0:
        return np.full(n, SERVEGEN_WINDOW_S / n)
    return np.asarray(iats * (SERVEGEN_WINDOW_S / total))


def servegen_arrivals(
    clients: Sequence[Sequence[ArrivalWindow]],
    start_s: float,
    duration_s: float,
    rate_scale: float,
    rng: np.random.Generator,
) -> np.ndarray:
    """Arrival times in ``[0, duration_s)`` (relative to ``start_s``), ServeGen's way:
    per client and 10-minute window, gaps drawn from the window's distribution at its rate
    times ``rate_scale`` and rescaled to fill the window (``generate_workload``)."""
    end = start_s + duration_s
    out: list[np.ndarray] = []
    for windows in clients:
        for w in windows:
            if w.start_s + SERVEGEN_WINDOW_S <= start_s or w.start_s >= end:
                continue
            rate = w.rate_rps * rate_scale
            if rate <= 0:
                continue
            ts = w.start_s + np.cumsum(_window_iats(w, rate, rng))
            ts = ts[(ts < w.start_s + SERVEGEN_WINDOW_S) & (ts >= start_s) & (ts < end)]
            out.append(ts - start_s)
    if not out:
        return np.empty(0)
    return np.sort(np.concatenate(out))


def native_rate(clients: Sequence[Sequence[ArrivalWindow]], start_s: float, dur: float) -> float:
    """Mean aggregate rate (req/s) the windows give over ``[start_s, start_s + dur)``."""
    total = 0.0
    for windows in clients:
        for w in windows:
            lo = max(w.start_s, start_s)
            hi = min(w.start_s + SERVEGEN_WINDOW_S, start_s + dur)
            if hi > lo:
                total += w.rate_rps * (hi - lo)
    return total / dur


def servegen_workload(
    name: str,
    *,
    load: float = 1.0,
    seed: int = 0,
    duration_s: float | None = None,
    start_s: float | None = None,
    rate_rps: float | None = None,
    data_dir: Path = SERVEGEN,
    lengths_from: Sequence[TraceRequest] | None = None,
) -> Workload:
    """A ServeGen scenario (:data:`SCENARIOS`); ``rate_rps`` (else the scenario's) is the
    mean rate before ``load`` multiplies it. Prompt and output lengths are drawn jointly
    (one Azure record per request, uniformly, seeded) from the Azure conversation trace:
    the ServeGen length files were not copied, so reasoning outputs are not reason-long."""
    if name not in SCENARIOS:
        raise ValueError(f"unknown scenario {name!r}; known: {sorted(SCENARIOS)}")
    if load <= 0:
        raise ValueError(f"load must be > 0, got {load}")
    spec = SCENARIOS[name]
    start = spec.start_s if start_s is None else start_s
    dur = spec.duration_s if duration_s is None else duration_s
    clients = [
        load_servegen_client(data_dir / spec.directory / f"chunk-{c}-trace.csv")
        for c in spec.clients
    ]
    native = native_rate(clients, start, dur)
    target = spec.rate_rps if rate_rps is None else rate_rps
    scale = (target / native if native > 0 else 0.0) if target is not None else 1.0
    rng = np.random.default_rng(seed)
    times = servegen_arrivals(clients, start, dur, scale * load, rng)
    pool = lengths_from if lengths_from is not None else load_azure(AZURE_CONV)
    idx = rng.integers(0, len(pool), size=len(times))
    reqs = tuple(
        SimRequest(float(t), pool[i].input_tokens, pool[i].output_tokens)
        for t, i in zip(times, idx, strict=True)
    )
    meta = {
        "kind": "servegen",
        "scenario": name,
        "about": spec.about,
        "clients": [f"{spec.directory}/chunk-{c}-trace.csv" for c in spec.clients],
        "start_s": start,
        "native_rate_rps": native,
        "rate_rps": (native if target is None else target) * load,
        "load": load,
        "seed": seed,
    }
    return Workload(f"{name}@{load:g}x", reqs, dur, meta)


# --------------------------------------------------------------------------- policies


@dataclass(frozen=True)
class RoleObs:
    """What a policy sees of one role at a control tick."""

    running: int
    starting: int
    target: int
    handle_queued: int
    ongoing: int
    queued_tokens: float
    tokens_total: float
    tokens_per_s: float | None
    token_load: float
    window_tokens: float | None
    arrivals: int
    """Requests that have reached the role so far (cumulative)."""
    prompt_p99: float | None = None
    """Prefill: p99 of the last ``PROMPT_P99_SAMPLES`` prompts (tokens)."""
    prompt_mean: float | None = None
    """Prefill: mean of the last ``PROMPT_P99_SAMPLES`` prompts (tokens)."""
    used_kv_blocks: float = 0.0
    """Decode (profile engine): KV blocks in use."""
    kv_blocks_per_replica: float | None = None
    """Decode (profile engine): KV blocks of one replica."""


class AutoscalePolicy(Protocol):
    name: str
    cold_start_s: float

    def initial(self) -> dict[str, int]:
        """Replicas running at t = 0."""
        ...

    def decide(self, now: float, obs: dict[str, RoleObs]) -> dict[str, int]:
        """Replica targets per role."""
        ...


class AlwaysOn:
    """A fixed count per role, running from t = 0."""

    name = "always_on"

    def __init__(self, counts: dict[str, int], cold_start_s: float) -> None:
        self.counts = dict(counts)
        self.cold_start_s = cold_start_s

    def initial(self) -> dict[str, int]:
        return dict(self.counts)

    def decide(self, now: float, obs: dict[str, RoleObs]) -> dict[str, int]:
        return dict(self.counts)


@dataclass
class _ServeRoleState:
    samples: deque[tuple[float, float]] = field(default_factory=deque)
    counter: int = 0
    since: float | None = None


class ServeDefault:
    """Ray Serve's ``replica_queue_length_autoscaling_policy`` with Serve's defaults, per
    role (see the module docstring)."""

    name = "serve_default"

    def __init__(
        self,
        cold_start_s: float,
        max_replicas: int,
        *,
        target_ongoing_requests: float = 2.0,
        upscale_delay_s: float = 30.0,
        downscale_delay_s: float = 600.0,
        look_back_period_s: float = 30.0,
        min_replicas: int = 0,
    ) -> None:
        self.cold_start_s = cold_start_s
        self.max_replicas = max_replicas
        self.min_replicas = min_replicas
        self.target = target_ongoing_requests
        self.up_delay = upscale_delay_s
        self.down_delay = downscale_delay_s
        self.look_back = look_back_period_s
        self.state = {r: _ServeRoleState() for r in ROLES}

    def initial(self) -> dict[str, int]:
        return {r: self.min_replicas for r in ROLES}

    def decide(self, now: float, obs: dict[str, RoleObs]) -> dict[str, int]:
        return {r: self._role(self.state[r], now, o) for r, o in obs.items()}

    def _bounded(self, n: int) -> int:
        return max(self.min_replicas, min(self.max_replicas, n))

    def _role(self, st: _ServeRoleState, now: float, o: RoleObs) -> int:
        st.samples.append((now, float(o.ongoing)))
        while st.samples and st.samples[0][0] <= now - self.look_back:
            st.samples.popleft()
        total = sum(v for _, v in st.samples) / len(st.samples)
        cur, tgt = o.running, o.target
        # _get_cold_start_scale_up_replicas: 0 running and a request -> up at once
        if cur == 0 and total > 0:
            return self._bounded(max(1, tgt))
        # _core_replica_queue_length_policy
        desired: float = tgt if cur == 0 else cur * (total / (self.target * cur))
        # _apply_scaling_factors (factors 1)
        if cur == 0:
            scaled = math.ceil(desired)
        else:
            scaled = math.ceil(cur + 1.0 * (desired - cur))
            if math.ceil(float(desired)) < cur and scaled == cur:
                scaled -= 1
        if cur == 0 and scaled > 0:
            return self._bounded(scaled)
        return self._bounded(self._delay(st, max(0, scaled), tgt, now))

    def _delay(self, st: _ServeRoleState, desired: int, tgt: int, now: float) -> int:
        """``_apply_delay_logic``: wall-clock delays, the decision counter's sign the way."""
        decision = tgt
        if desired > tgt:
            if st.counter < 0:
                st.counter, st.since = 0, None
            st.counter += 1
            if st.since is None:
                st.since = now
            if now - st.since + 1e-6 >= self.up_delay:
                st.counter, st.since = 0, None
                decision = desired
        elif desired < tgt:
            if st.counter > 0:
                st.counter, st.since = 0, None
            st.counter -= 1
            if tgt != 1:
                desired = max(1, desired)
            if st.since is None:
                st.since = now
            if now - st.since + 1e-6 >= self.down_delay:
                st.counter, st.since = 0, None
                decision = desired
        else:
            st.counter, st.since = 0, None
        return decision


@dataclass
class _SllmRoleState:
    idle_time: float = 0.0
    arrivals: int = 0


class ServerlessLLM:
    """ServerlessLLM's router autoscaler with its default config, per role."""

    name = "serverlessllm"

    def __init__(
        self,
        cold_start_s: float,
        max_replicas: int,
        *,
        target: int = 1,
        min_instances: int = 0,
        keep_alive_s: float = 0.0,
        interval_s: float = 1.0,
    ) -> None:
        self.cold_start_s = cold_start_s
        self.max_replicas = max_replicas
        self.target = target
        self.min_instances = min_instances
        self.keep_alive = keep_alive_s
        self.interval = interval_s
        self.state = {r: _SllmRoleState() for r in ROLES}

    def initial(self) -> dict[str, int]:
        return {r: self.min_instances for r in ROLES}

    def decide(self, now: float, obs: dict[str, RoleObs]) -> dict[str, int]:
        out = {}
        for r, o in obs.items():
            st = self.state[r]
            if o.arrivals != st.arrivals:  # a request arrived: idle_time = 0
                st.arrivals, st.idle_time = o.arrivals, 0.0
            desired = (o.ongoing + self.target - 1) // self.target
            desired = min(self.max_replicas, max(self.min_instances, desired))
            num = o.running + o.starting
            if desired > num:
                out[r] = num + 1
            elif desired < num:
                if st.idle_time >= self.keep_alive:
                    out[r] = num - 1
                    st.idle_time = 0.0
                else:
                    out[r] = num
                    st.idle_time += self.interval
            else:
                out[r] = num
        return out


class WarmPool:
    """Ours: :func:`controllers.autoscale.decide`, called as-is (``paired=True``)."""

    name = "warm_pool"

    def __init__(self, cfg: AutoscaleConfig, cold_start_s: float) -> None:
        self.cfg = cfg
        self.cold_start_s = cold_start_s
        self.state = AutoscaleState()
        self.reasons: Counter[str] = Counter()

    def initial(self) -> dict[str, int]:
        return {r: getattr(self.cfg, r).initial() for r in ROLES}

    def demand(self, r: str, o: RoleObs) -> RoleDemand:
        """What :func:`controllers.autoscale.decide` sees of role ``r``."""
        return RoleDemand(
            running=o.running,
            target=o.target,
            handle_queued=float(o.handle_queued),
            ongoing=float(o.ongoing),
            queued_uncached_tokens=o.queued_tokens if r == "prefill" else 0.0,
            queued_window_tokens=o.queued_tokens if r == "decode" else 0.0,
            uncached_tokens_total=o.tokens_total if r == "prefill" else None,
            tokens_per_s=o.tokens_per_s,
            token_load=o.token_load,
            window_tokens=o.window_tokens,
        )

    def decide(self, now: float, obs: dict[str, RoleObs]) -> dict[str, int]:
        demand = {r: self.demand(r, o) for r, o in obs.items()}
        self.state, decisions = decide(self.state, demand, self.cfg, now, paired=True)
        for r, d in decisions.items():
            self.reasons[f"{r}:{d.reason}"] += 1
        return {r: d.replicas for r, d in decisions.items()}


class Slo(WarmPool):
    """Ours with ``autoscaling.slo`` set: :func:`controllers.autoscale.decide` sizing for
    the targets (:mod:`controllers.slo_sizing`), called as-is (``paired=True``), seeing the
    decode KV and the recent prompts' mean and p99 too."""

    name = "slo"

    def demand(self, r: str, o: RoleObs) -> RoleDemand:
        return replace(
            super().demand(r, o),
            used_kv_blocks=o.used_kv_blocks,
            kv_blocks_per_replica=o.kv_blocks_per_replica,
            prompt_tokens_p99=o.prompt_p99,
            prompt_tokens_mean=o.prompt_mean,
        )


#: The SLO targets the ``slo`` policy runs with unless given: one setting for every trace
#: and load (the issue's "shipped defaults, no per-trace tuning").
DEFAULT_SLO = {"ttft_p99_s": 2.0, "itl_p99_s": 0.05, "max_cold_fraction": 0.03}


def slo_config(
    params: SimParams, slo: dict[str, float] | None = None, **overrides: Any
) -> AutoscaleConfig:
    """The AutoscaleConfig the ``slo`` policy runs with: :func:`warm_pool_config`'s base, the
    targets (``DEFAULT_SLO`` unless given) and the engine profile's decode step curve (the
    simple engine: flat at ``itl_s``)."""
    from controllers.profile import DecodeProfile

    step = (
        params.engine_profile().decode
        if params.engine == "profile"
        else DecodeProfile(l_min_s=params.itl_s, b0=1, alpha_s=0.0)
    )
    targets = SloConfig.model_validate({**DEFAULT_SLO, **(slo or {}), "decode_step": step})
    return warm_pool_config(params, slo=targets, **overrides)


def warm_pool_config(params: SimParams, **overrides: Any) -> AutoscaleConfig:
    """The AutoscaleConfig the simulator runs warm_pool with: bounds ``[0, max_replicas]``,
    the modelled prefill throughput and cold start; ``overrides`` are AutoscaleConfig
    fields (validated)."""
    base: dict[str, Any] = {
        "enabled": True,
        "prefill": RoleBounds(min_replicas=0, max_replicas=params.max_replicas),
        "decode": RoleBounds(min_replicas=0, max_replicas=params.max_replicas),
        "prefill_tokens_per_s": params.prefill_rate(),
        "cold_start_s": params.standard_cold_start_s(),
    }
    return AutoscaleConfig.model_validate({**base, **overrides})


def _occupancy(start: np.ndarray, end: np.ndarray, horizon: int) -> np.ndarray:
    """Mean number of intervals ``[start, end)`` open in each second ``[k, k + 1)`` (exact
    overlaps: a 2.4 s interval counts 2.4 request-seconds, not three whole seconds)."""
    end = np.minimum(end, float(horizon))
    full = np.zeros(horizon + 1)
    s_up = np.ceil(start).astype(int)
    e_dn = np.floor(end).astype(int)
    inside = s_up <= e_dn  # spans at least one bin boundary
    np.add.at(full, s_up[inside], 1.0)
    np.add.at(full, e_dn[inside], -1.0)
    occ = np.cumsum(full)[:horizon]
    head = np.zeros(horizon + 1)
    s_bin = np.floor(start).astype(int)
    # partial first bin (or the whole interval when it stays inside one bin)
    np.add.at(head, s_bin, np.where(inside, s_up - start, end - start))
    # partial last bin
    np.add.at(head, np.minimum(e_dn[inside], horizon), end[inside] - e_dn[inside])
    return occ + head[:horizon]


def peak_sizing(wl: Workload, params: SimParams) -> dict[str, int]:
    """always_on's counts: the busiest ``peak_window_s`` of demand per role over a
    replica's capacity at ``always_on_utilization`` (see the module docstring). Profile
    engine: decode's demand is the sequences in decode (each for ``output x l_min``) over
    the step curve's flat batch ``b0``: the one sizing whose decode times are those it
    assumes (a larger batch steps slower, holds its sequences longer, and the sequences it
    was sized for no longer fit)."""
    utilization = params.always_on_utilization
    if not wl.requests:
        return {"prefill": 1, "decode": 1}
    arr = np.array([r.arrival_s for r in wl.requests])
    prompt = np.array([r.prompt_tokens for r in wl.requests], dtype=float)
    out = np.array([max(1, r.output_tokens) for r in wl.requests], dtype=float)
    itl = params.base_itl_s()
    horizon = int(math.ceil(max(wl.duration_s, float(arr.max()) + out.max() * itl))) + 2
    win = max(1, int(round(params.peak_window_s)))
    tok = np.zeros(horizon)
    np.add.at(tok, arr.astype(int), prompt)
    if params.engine == "profile":
        load = _occupancy(arr, arr + out * itl, horizon)
    else:
        load = np.zeros(horizon + 1)
        start = arr.astype(int)
        end = np.minimum((arr + out * itl).astype(int) + 1, horizon)
        np.add.at(load, start, prompt + out)
        np.add.at(load, end, -(prompt + out))
        load = np.cumsum(load)[:horizon]

    def peak(series: np.ndarray) -> float:
        c = np.concatenate([[0.0], np.cumsum(series)])
        w = min(win, len(series))
        return float((c[w:] - c[:-w]).max() / w)

    n_p = math.ceil(peak(tok) / (params.prefill_rate() * utilization) - 1e-9)
    d_cap = (
        float(params.engine_profile().decode.b0)
        if params.engine == "profile"
        else params.window_tokens()
    )
    n_d = math.ceil(peak(load) / (d_cap * utilization) - 1e-9)
    return {
        "prefill": max(1, min(params.max_replicas, n_p)),
        "decode": max(1, min(params.max_replicas, n_d)),
    }


# --------------------------------------------------------------------------- prefix cache


def cached_blocks(
    cache: BlockCache | None, hashes: Sequence[int], prompt_tokens: int, block_tokens: int
) -> int:
    """Leading blocks of ``hashes`` that ``cache`` holds now, capped so at least one prompt
    token is computed (only the first ``(prompt - 1) // block_tokens`` blocks can hit, as
    vLLM's ``num_tokens - 1`` cap and :mod:`bench.sim.prefill`); 0 without a cache."""
    if cache is None or not hashes:
        return 0
    return cache.hit_blocks(hashes, max(0, prompt_tokens - 1) // block_tokens)


def register_prefix(cache: BlockCache, hashes: Sequence[int], hits: int) -> None:
    """A prompt whose first ``hits`` blocks were cached (and pinned by :meth:`BlockCache.
    acquire` at admission) finished its prefill: its other full blocks are registered, in
    order, then every reference is released tail first (the tail is evicted before the
    head). A block already cached (another prompt computed it meanwhile) is referenced, not
    duplicated; registration stops at the first block the cache has no room for (every
    block pinned: a later block could never hit without it)."""
    held = list(hashes[:hits])
    for h in hashes[hits:]:
        if h in cache:
            cache.acquire([h])
        elif cache.can_reserve([], 1):
            cache.reserve(1)
            cache.register(h)
        else:
            break
        held.append(h)
    cache.release(held, 0)


def pick_prefill(candidates: Sequence[tuple[int, float]]) -> int:
    """Index of the replica a request goes to, from ``(cached blocks, load)`` per replica
    with room: the longest cached prefix, then the least load, then the first."""
    return min(range(len(candidates)), key=lambda k: (-candidates[k][0], candidates[k][1], k))


# --------------------------------------------------------------------------- simulator

_READY, _PREFILL_DONE, _DECODE_DONE, _ARRIVAL, _TICK = range(5)


@dataclass(eq=False)
class _Replica:
    role: str
    started_s: float
    ready_s: float
    warm: bool = False
    draining: bool = False
    stopped_s: float | None = None
    busy_req: int | None = None  # prefill
    busy_until: float = 0.0
    load: float = 0.0  # decode
    active: int = 0
    # profile engine, prefill: requests in progress [index, tokens done]; a step under way
    own: list[list[int]] = field(default_factory=list)
    plan: list[tuple[list[int], int]] = field(default_factory=list)
    stepping: bool = False
    # profile engine, decode: per sequence the progress (tokens per sequence, shared by the
    # batch) at which it finishes and at which it was admitted; progress and its time
    seqs: dict[int, float] = field(default_factory=dict)
    vstart: dict[int, float] = field(default_factory=dict)
    v: float = 0.0
    v_t: float = 0.0
    version: int = 0
    # profile engine with block hashes, prefill: this replica's own prefix cache
    cache: BlockCache | None = None

    @property
    def idle(self) -> bool:
        return self.busy_req is None and self.active == 0 and not self.stepping and not self.own


@dataclass
class SimResult:
    """One policy on one workload (simulated)."""

    policy: str
    metrics: dict[str, Any]
    ttft_s: np.ndarray
    timeline: list[tuple[float, int, int]]


class _Sim:
    def __init__(
        self, wl: Workload, policy: AutoscalePolicy, params: SimParams, timeline: bool
    ) -> None:
        self.wl = wl
        self.reqs = wl.requests
        self.policy = policy
        self.p = params
        self.profiled = params.engine == "profile"
        self.prof = params.engine_profile() if self.profiled else None
        self.mu = params.prefill_rate()
        self.window = params.window_tokens()
        self.reserve = params.expected_output_tokens
        self.itl_w: dict[float, float] = {}  # ITL (s) -> tokens emitted at it
        self.recent_prompts: deque[int] = deque(maxlen=PROMPT_P99_SAMPLES)
        self.cold_s = policy.cold_start_s
        self.keep_timeline = timeline
        self.heap: list[tuple[float, int, int, Any]] = []
        self.seq = 0
        self.alive: dict[str, list[_Replica]] = {r: [] for r in ROLES}
        self.stopped: list[_Replica] = []
        self.target = {r: 0 for r in ROLES}
        self.pq: deque[int] = deque()
        self.pq_tokens = 0.0
        self.dq: deque[int] = deque()
        self.arrived_tokens = 0.0
        self.prefills_done = 0
        self.arrivals = {r: 0 for r in ROLES}
        n = len(self.reqs)
        self.ttft = np.full(n, np.nan)
        self.prefill_done_s = np.full(n, np.nan)
        self.cold = np.zeros(n, dtype=np.int8)  # bit 1: prefill, bit 2: decode
        self.from_zero = np.zeros(n, dtype=bool)
        self.completed = 0
        self.ups = {r: 0 for r in ROLES}
        self.downs = {r: 0 for r in ROLES}
        self.peak = {r: 0 for r in ROLES}
        self.timeline: list[tuple[float, int, int]] = []
        # prefix cache (profile engine, a workload with block hashes)
        self.block = wl.block_tokens
        self.caching = self.profiled and any(r.block_hashes for r in self.reqs)
        self.cache_capacity = params.prefix_cache_capacity(self.block) if self.caching else 0
        self.hits = np.zeros(n, dtype=np.int64)  # cached blocks at admission
        self.admitted_uncached = 0.0  # uncached tokens of the prompts replicas took
        self.recent_uncached: deque[int] = deque(maxlen=RECENT_PROMPTS)

    def _replica(self, role: str, started_s: float, ready_s: float, warm: bool) -> _Replica:
        """A new replica; a prefill one gets an empty prefix cache when caching."""
        cache = BlockCache(self.cache_capacity) if self.caching and role == "prefill" else None
        return _Replica(role, started_s, ready_s, warm=warm, cache=cache)

    def push(self, t: float, kind: int, obj: Any) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, kind, self.seq, obj))

    def run(self) -> SimResult:
        for role, k in self.policy.initial().items():
            for _ in range(k):
                self.alive[role].append(self._replica(role, 0.0, 0.0, True))
            self.target[role] = k
        for i, r in enumerate(self.reqs):
            self.push(r.arrival_s, _ARRIVAL, i)
        self.push(0.0, _TICK, None)
        n = len(self.reqs)
        limit = self.wl.duration_s + 7 * 86400.0
        while self.heap:
            now, kind, _, obj = heapq.heappop(self.heap)
            if kind == _TICK:
                if self.completed >= n and now >= self.wl.duration_s:
                    break
                if now > limit:
                    raise RuntimeError(f"{self.policy.name}: requests still pending at {now:.0f} s")
                self.tick(now)
                self.push(now + self.p.control_interval_s, _TICK, None)
            elif kind == _ARRIVAL:
                self.arrive(obj, now)
            elif kind == _PREFILL_DONE:
                if self.profiled:
                    self.prefill_step_done(obj, now)
                else:
                    self.prefill_done(obj, now)
            elif kind == _DECODE_DONE:
                if self.profiled:
                    self.decode_progress(obj[0], obj[1], now)
                else:
                    self.decode_done(obj[0], obj[1], now)
            else:
                self.ready(obj, now)
        return self.result()

    # ---- events

    def arrive(self, i: int, now: float) -> None:
        r = self.reqs[i]
        self.arrived_tokens += r.prompt_tokens
        self.recent_prompts.append(r.prompt_tokens)
        self.arrivals["prefill"] += 1
        self.from_zero[i] |= not self._running("prefill")
        self.pq.append(i)
        self.pq_tokens += r.prompt_tokens
        self.dispatch_prefill(now)

    def ready(self, rep: _Replica, now: float) -> None:
        if rep.stopped_s is not None:  # cancelled while starting
            return
        rep.warm = True
        if rep.role == "prefill":
            self.dispatch_prefill(now)
        else:
            self.dispatch_decode(now)

    def prefill_done(self, rep: _Replica, now: float) -> None:
        i = rep.busy_req
        assert i is not None
        rep.busy_req = None
        self.prefills_done += 1
        self.prefill_done_s[i] = now
        self.arrivals["decode"] += 1
        self.from_zero[i] |= not self._running("decode")
        self.dq.append(i)
        if rep.draining:
            self._stop(rep, now)
        self.dispatch_prefill(now)
        self.dispatch_decode(now)

    def decode_done(self, rep: _Replica, i: int, now: float) -> None:
        r = self.reqs[i]
        rep.load -= r.prompt_tokens + r.output_tokens
        rep.active -= 1
        self.completed += 1
        if rep.draining and rep.active == 0:
            self._stop(rep, now)
        self.dispatch_decode(now)

    # ---- dispatch

    def _running(self, role: str) -> bool:
        return any(r.warm and not r.draining for r in self.alive[role])

    def dispatch_prefill(self, now: float) -> None:
        if self.profiled:
            self._prefill_steps(now)
            return
        while self.pq:
            rep = next(
                (
                    r
                    for r in self.alive["prefill"]
                    if r.warm and not r.draining and r.busy_req is None
                ),
                None,
            )
            if rep is None:
                return
            i = self.pq.popleft()
            req = self.reqs[i]
            self.pq_tokens -= req.prompt_tokens
            if rep.ready_s > req.arrival_s:
                self.cold[i] |= 1
            rep.busy_req = i
            rep.busy_until = now + req.prompt_tokens / self.mu
            self.push(rep.busy_until, _PREFILL_DONE, rep)

    def dispatch_decode(self, now: float) -> None:
        if self.profiled:
            self._admit_decode(now)
            return
        while self.dq:
            i = self.dq[0]
            req = self.reqs[i]
            need = req.prompt_tokens + req.output_tokens
            best = self._pick_decode(need)
            if best is None:
                return
            self.dq.popleft()
            if best.ready_s > self.prefill_done_s[i]:
                self.cold[i] |= 2
            best.load += need
            best.active += 1
            self.ttft[i] = now + self.p.itl_s - req.arrival_s
            done = now + max(1, req.output_tokens) * self.p.itl_s
            self.push(done, _DECODE_DONE, (best, i))

    def _pick_decode(self, need: int, max_seqs: int | None = None) -> _Replica | None:
        """The least-loaded warm decode replica, not draining, whose window holds ``need``
        more tokens (an idle one takes any request) and, with ``max_seqs``, whose batch is
        below it; None: the request waits."""
        best: _Replica | None = None
        for r in self.alive["decode"]:
            if not r.warm or r.draining or (max_seqs is not None and r.active >= max_seqs):
                continue
            if r.active and r.load + need > self.window:
                continue
            if best is None or r.load < best.load:
                best = r
        return best

    # ---- profile engine (SimParams.engine == "profile")

    def _prefill_steps(self, now: float) -> None:
        """Start a step on every warm prefill replica that is not in one and has work: its
        requests in progress first, then the queue's head, FCFS, up to ``token_budget``
        tokens (the last one chunked), priced by the profile's ``step_cost``."""
        assert self.prof is not None
        if self.caching:
            self._prefill_steps_cached(now)
            return
        budget_max = self.prof.token_budget
        for rep in self.alive["prefill"]:
            if not rep.warm or rep.stepping:
                continue
            if rep.draining and not rep.own:
                continue
            budget = budget_max
            plan: list[tuple[list[int], int]] = []
            for entry in rep.own:
                if budget <= 0:
                    break
                c = min(self.reqs[entry[0]].prompt_tokens - entry[1], budget)
                plan.append((entry, c))
                budget -= c
            while budget > 0 and self.pq and not rep.draining:
                i = self.pq.popleft()
                req = self.reqs[i]
                self.pq_tokens -= req.prompt_tokens
                if rep.ready_s > req.arrival_s:
                    self.cold[i] |= 1
                entry = [i, 0]
                rep.own.append(entry)
                c = min(max(1, req.prompt_tokens), budget)
                plan.append((entry, c))
                budget -= c
            self._start_step(rep, plan, now)

    def _start_step(self, rep: _Replica, plan: list[tuple[list[int], int]], now: float) -> None:
        """``rep`` runs ``plan`` (``(entry, tokens)`` chunks) as one engine step priced by the
        profile's ``step_cost``; nothing to do for an empty plan."""
        assert self.prof is not None
        if not plan:
            return
        dur = self.prof.step_cost.seconds((c, e[1]) for e, c in plan)
        rep.plan = plan
        rep.stepping = True
        rep.busy_until = now + dur
        self.push(rep.busy_until, _PREFILL_DONE, rep)

    def _prefill_steps_cached(self, now: float) -> None:
        """:meth:`_prefill_steps` with prefix caches. A warm prefill replica not in a step
        plans its requests in progress first; it has *room* for the rest of its
        ``token_budget`` (none while draining). The queue's head, FCFS, goes to the replica
        with room holding its longest cached prefix (ties: the least uncached tokens owed,
        then the first): it skips the cached blocks (pinned until the prompt finishes) and
        computes the rest from the cached position. Then every replica with a plan starts
        its step. A replica in a step takes nothing until it ends (binding a request to a
        busy holder was tried: on Mooncake it raised no hit ratio and lengthened TTFT)."""
        assert self.prof is not None
        budget_max = self.prof.token_budget
        reps = [r for r in self.alive["prefill"] if r.warm and not r.stepping]
        plans: list[list[tuple[list[int], int]]] = []
        rooms: list[int] = []
        loads: list[float] = []
        for rep in reps:
            owed = sum(self.reqs[e[0]].prompt_tokens - e[1] for e in rep.own)
            plan: list[tuple[list[int], int]] = []
            room = budget_max
            for entry in rep.own:
                if room <= 0:
                    break
                c = min(self.reqs[entry[0]].prompt_tokens - entry[1], room)
                plan.append((entry, c))
                room -= c
            plans.append(plan)
            rooms.append(room if not rep.draining else 0)
            loads.append(float(owed))
        while self.pq:
            open_ = [k for k in range(len(reps)) if rooms[k] > 0]
            if not open_:
                break
            i = self.pq.popleft()
            req = self.reqs[i]
            self.pq_tokens -= req.prompt_tokens
            hits = [
                cached_blocks(reps[k].cache, req.block_hashes, req.prompt_tokens, self.block)
                for k in open_
            ]
            j = pick_prefill([(h, loads[k]) for h, k in zip(hits, open_, strict=True)])
            k, h = open_[j], hits[j]
            rep = reps[k]
            if rep.ready_s > req.arrival_s:
                self.cold[i] |= 1
            if h:
                assert rep.cache is not None
                rep.cache.acquire(req.block_hashes[:h])
            self.hits[i] = h
            cached = h * self.block
            self.admitted_uncached += req.prompt_tokens - cached
            entry = [i, cached]
            rep.own.append(entry)
            need = max(1, req.prompt_tokens - cached)
            plans[k].append((entry, min(need, rooms[k])))
            rooms[k] -= need
            loads[k] += need
        for rep, plan in zip(reps, plans, strict=True):
            self._start_step(rep, plan, now)

    def prefill_step_done(self, rep: _Replica, now: float) -> None:
        rep.stepping = False
        for entry, c in rep.plan:
            entry[1] += c
            i = entry[0]
            if entry[1] >= max(1, self.reqs[i].prompt_tokens):
                rep.own.remove(entry)
                if rep.cache is not None:
                    req = self.reqs[i]
                    register_prefix(rep.cache, req.block_hashes, int(self.hits[i]))
                    self.recent_uncached.append(req.prompt_tokens - int(self.hits[i]) * self.block)
                self.prefills_done += 1
                self.prefill_done_s[i] = now
                self.arrivals["decode"] += 1
                self.from_zero[i] |= not self._running("decode")
                self.dq.append(i)
        rep.plan = []
        if rep.draining and not rep.own:
            self._stop(rep, now)
        self.dispatch_prefill(now)
        self.dispatch_decode(now)

    def _step_s(self, batch: int) -> float:
        assert self.prof is not None
        return self.prof.decode.step_latency_s(batch)

    def _advance(self, rep: _Replica, now: float) -> None:
        """Move a decode replica's progress to ``now`` at its batch's step time, counting
        the tokens emitted at that ITL (after ``warmup_s``)."""
        b = len(rep.seqs)
        if b and now > rep.v_t:
            step = self._step_s(b)
            steps = (now - rep.v_t) / step
            rep.v += steps
            counted = (now - max(rep.v_t, self.p.warmup_s)) / step  # warm-up not counted
            if counted > 0:
                self.itl_w[step] = self.itl_w.get(step, 0.0) + counted * b
        rep.v_t = now

    def _reschedule(self, rep: _Replica, now: float) -> None:
        rep.version += 1
        if rep.seqs:
            left = max(0.0, min(rep.seqs.values()) - rep.v)
            self.push(now + left * self._step_s(len(rep.seqs)), _DECODE_DONE, (rep, rep.version))

    def _admit_decode(self, now: float) -> None:
        """FCFS admission to the least-loaded warm decode replica whose window (KV tokens)
        holds ``prompt + expected_output_tokens`` (the real output length is unknown) and
        whose batch is below ``max_num_seqs``; a sequence then advances one token per step of
        the profile's ``l(B)``, ``B`` its replica's batch."""
        while self.dq:
            i = self.dq[0]
            req = self.reqs[i]
            need = req.prompt_tokens + self.reserve
            best = self._pick_decode(need, self.p.max_num_seqs)
            if best is None:
                return
            self.dq.popleft()
            if best.ready_s > self.prefill_done_s[i]:
                self.cold[i] |= 2
            self._advance(best, now)
            best.seqs[i] = best.v + max(1, req.output_tokens)
            best.vstart[i] = best.v
            best.load += need
            best.active += 1
            self.ttft[i] = now + self._step_s(len(best.seqs)) - req.arrival_s
            self._reschedule(best, now)

    def decode_progress(self, rep: _Replica, version: int, now: float) -> None:
        if version != rep.version or rep.stopped_s is not None:
            return
        self._advance(rep, now)
        done = [i for i, end in rep.seqs.items() if end <= rep.v + 1e-6]
        for i in done:
            del rep.seqs[i]
            del rep.vstart[i]
            rep.load -= self.reqs[i].prompt_tokens + self.reserve
            rep.active -= 1
            self.completed += 1
        if rep.draining and rep.active == 0:
            self._stop(rep, now)
        else:
            self._reschedule(rep, now)
        self.dispatch_decode(now)

    def _kv_blocks(self, rep: _Replica) -> float:
        assert self.prof is not None
        bs = self.prof.block_size
        return float(
            sum(
                math.ceil(
                    (self.reqs[i].prompt_tokens + min(self.reqs[i].output_tokens, rep.v - v0)) / bs
                )
                for i, v0 in rep.vstart.items()
            )
        )

    # ---- control

    def observe(self, role: str, now: float) -> RoleObs:
        alive = self.alive[role]
        running = [r for r in alive if r.warm and not r.draining]
        starting = sum(1 for r in alive if not r.warm)
        if role == "prefill":
            if self.profiled:
                in_progress = sum(len(r.own) for r in alive)
                remaining = float(
                    sum(self.reqs[e[0]].prompt_tokens - e[1] for r in alive for e in r.own)
                )
            else:
                busy = [r for r in alive if r.busy_req is not None]
                in_progress = len(busy)
                remaining = sum(max(0.0, r.busy_until - now) * self.mu for r in busy)
            q = len(self.pq)
            mean: float | None
            p99: float | None
            if self.caching:  # what the replicas report: their prefilled prompts' uncached
                mean, p99 = prompt_moments(list(self.recent_uncached))
                if not self.recent_uncached:
                    mean = p99 = None
                # taken: uncached as admitted; queued: whole (no replica has matched it yet)
                taken = self.admitted_uncached + self.pq_tokens
            else:
                recent = np.fromiter(self.recent_prompts, float)
                p99 = float(np.percentile(recent, 99)) if recent.size else None
                mean = float(recent.mean()) if recent.size else None
                taken = self.arrived_tokens
            return RoleObs(
                running=len(running),
                starting=starting,
                target=self.target[role],
                handle_queued=0 if running else q,
                ongoing=q + in_progress,
                queued_tokens=remaining + (self.pq_tokens if running else 0.0),
                tokens_total=taken - (0.0 if running else self.pq_tokens),
                tokens_per_s=self.mu if self.prefills_done else None,
                token_load=0.0,
                window_tokens=None,
                arrivals=self.arrivals[role],
                prompt_p99=p99,
                prompt_mean=mean,
            )
        q = len(self.dq)
        # requests waiting for a decode window: in the replicas' gates (their window tokens)
        # while a replica runs, at the handle (a count) while none does
        if self.profiled:  # the output length is unknown: the reservation stands for it
            waiting = sum(self.reqs[i].prompt_tokens + self.reserve for i in self.dq)
            for r in alive:
                self._advance(r, now)
            kv_used = sum(self._kv_blocks(r) for r in running)
            assert self.prof is not None
            kv_per: float | None = self.window / self.prof.block_size
        else:
            waiting = sum(self.reqs[i].prompt_tokens + self.reqs[i].output_tokens for i in self.dq)
            kv_used, kv_per = 0.0, None
        return RoleObs(
            running=len(running),
            starting=starting,
            target=self.target[role],
            handle_queued=0 if running else q,
            ongoing=q + sum(r.active for r in alive),
            queued_tokens=float(waiting) if running else 0.0,
            tokens_total=0.0,
            tokens_per_s=None,
            token_load=sum(r.load for r in running),
            window_tokens=self.window,
            arrivals=self.arrivals[role],
            used_kv_blocks=kv_used,
            kv_blocks_per_replica=kv_per,
        )

    def tick(self, now: float) -> None:
        obs = {r: self.observe(r, now) for r in ROLES}
        targets = self.policy.decide(now, obs)
        for role in ROLES:
            self.apply(role, targets.get(role, self.target[role]), now)
            self.peak[role] = max(self.peak[role], len(self.alive[role]))
        if self.keep_timeline:
            self.timeline.append((now, len(self.alive["prefill"]), len(self.alive["decode"])))

    def apply(self, role: str, n: int, now: float) -> None:
        n = max(0, min(self.p.max_replicas, int(n)))
        self.target[role] = n
        live = [r for r in self.alive[role] if not r.draining]
        if n > len(live):
            for _ in range(n - len(live)):
                rep = self._replica(role, now, now + self.cold_s, False)
                self.alive[role].append(rep)
                self.ups[role] += 1
                if self.cold_s <= 0:
                    rep.warm = True
                else:
                    self.push(rep.ready_s, _READY, rep)
            if self.cold_s <= 0:
                self.dispatch_prefill(now)
                self.dispatch_decode(now)
            return
        k = len(live) - n
        if k <= 0:
            return
        starting = sorted((r for r in live if not r.warm), key=lambda r: -r.started_s)
        idle = [r for r in live if r.warm and r.idle]
        busy = sorted(
            (r for r in live if r.warm and not r.idle),
            key=lambda r: r.active if role == "decode" else r.busy_until,
        )
        for rep in (starting + idle + busy)[:k]:
            self.downs[role] += 1
            if not rep.warm or rep.idle:
                self._stop(rep, now)
            else:
                rep.draining = True

    def _stop(self, rep: _Replica, now: float) -> None:
        rep.stopped_s = now
        self.alive[rep.role].remove(rep)
        self.stopped.append(rep)

    # ---- result

    def _itl_quantile(self, q: float) -> float | None:
        """Token-weighted ITL quantile (profile engine); the fixed ``itl_s`` (simple)."""
        if not self.profiled:
            return self.p.itl_s
        if not self.itl_w:
            return None
        xs = sorted(self.itl_w.items())
        total = sum(w for _, w in xs)
        acc = 0.0
        for x, w in xs:
            acc += w
            if acc >= q * total:
                return x
        return xs[-1][0]

    def _itl_mean(self) -> float | None:
        if not self.profiled:
            return self.p.itl_s
        total = sum(self.itl_w.values())
        return sum(x * w for x, w in self.itl_w.items()) / total if total else None

    def result(self) -> SimResult:
        d = self.wl.duration_s
        w0 = min(self.p.warmup_s, d)
        by_role = {r: 0.0 for r in ROLES}
        for rep in self.stopped + [x for r in ROLES for x in self.alive[r]]:
            end = d if rep.stopped_s is None else min(rep.stopped_s, d)
            by_role[rep.role] += max(0.0, end - min(max(rep.started_s, w0), d))
        keep = np.array([r.arrival_s >= w0 for r in self.reqs], dtype=bool)
        n = int(keep.sum())
        cold_all = self.cold[keep]
        cold = cold_all != 0
        kept_ttft = self.ttft[keep]
        ttft = kept_ttft[~np.isnan(kept_ttft)]
        prompt = np.array([r.prompt_tokens for r in self.reqs], dtype=float)[keep]
        cached = (self.hits * self.block).astype(float)[keep]
        metrics: dict[str, Any] = {
            "cold_start_fraction": float(cold.mean()) if n else 0.0,
            "from_zero_fraction": float(self.from_zero[keep].mean()) if n else 0.0,
            "two_cold_starts_fraction": float((cold_all == 3).mean()) if n else 0.0,
            "ttft": summarize(ttft),
            "ttft_cold": summarize(kept_ttft[cold]),
            "replica_seconds": sum(by_role.values()),
            "replica_seconds_by_role": by_role,
            "mean_replicas": {r: by_role[r] / max(1e-9, d - w0) for r in ROLES},
            "warmup_s": w0,
            "peak_replicas": dict(self.peak),
            "scale_ups": sum(self.ups.values()),
            "scale_downs": sum(self.downs.values()),
            "scale_ups_by_role": dict(self.ups),
            "scale_downs_by_role": dict(self.downs),
            "cold_start_s": self.cold_s,
            "itl_p99_s": self._itl_quantile(0.99),
            "itl_mean_s": self._itl_mean(),
            "engine": self.p.engine,
            # cached prompt tokens / prompt tokens (profile engine; None: no cache modelled)
            "cache_hit_ratio": (float(cached.sum() / prompt.sum()) if prompt.sum() else 0.0)
            if self.profiled
            else None,
            "prefix_cache_blocks": self.cache_capacity if self.caching else None,
            "n_requests": n,
            "completed": self.completed,
        }
        return SimResult(self.policy.name, metrics, ttft, self.timeline)


def simulate(
    wl: Workload, policy: AutoscalePolicy, params: SimParams, *, timeline: bool = True
) -> SimResult:
    """Run one policy over one workload (simulated)."""
    return _Sim(wl, policy, params, timeline).run()


def make_policy(
    name: str,
    params: SimParams,
    cfg: AutoscaleConfig,
    always_on: dict[str, int],
    slo_cfg: AutoscaleConfig | None = None,
) -> AutoscalePolicy:
    std = params.standard_cold_start_s()
    if name == "always_on":
        return AlwaysOn(always_on, std)
    if name == "serve_default":
        return ServeDefault(std, params.max_replicas)
    if name == "serverlessllm":
        return ServerlessLLM(
            params.fast_cold_start_s(), params.max_replicas, interval_s=params.control_interval_s
        )
    if name == "warm_pool":
        return WarmPool(cfg, std)
    if name == "slo":
        return Slo(slo_cfg if slo_cfg is not None else slo_config(params), std)
    raise ValueError(f"unknown policy {name!r}; known: {list(POLICY_NAMES)}")


def run_policies(
    wl: Workload,
    names: Sequence[str],
    params: SimParams,
    cfg: AutoscaleConfig,
    *,
    always_on: dict[str, int] | None = None,
    on_done: Callable[[], None] | None = None,
    slo_cfg: AutoscaleConfig | None = None,
    slo_ttft_factor: float | None = None,
) -> tuple[dict[str, Any], dict[str, SimResult]]:
    """Every policy in ``names`` on ``wl``; results as JSON-able dicts (plus the raw runs).
    ``always_on`` is always simulated (the reference), reported only when asked for; each
    result has its replica-seconds and TTFT p99 as ratios to always_on's.
    ``slo_ttft_factor``: the ``slo`` policy's TTFT target is that times always_on's TTFT
    p99 on this workload (the goal's own requirement, instead of a fixed target)."""
    sizing = always_on or peak_sizing(wl, params)
    scfg = slo_cfg if slo_cfg is not None else slo_config(params)
    runs: dict[str, SimResult] = {}
    reasons: dict[str, dict[str, int]] = {}
    order = ["always_on"] + [n for n in names if n != "always_on"]
    for name in order:
        if name == "slo" and slo_ttft_factor is not None and scfg.slo is not None:
            target = slo_ttft_factor * (runs["always_on"].metrics["ttft"]["p99"] or 0.0)
            if target > 0:
                scfg = scfg.model_copy(
                    update={"slo": scfg.slo.model_copy(update={"ttft_p99_s": target})}
                )
        pol = make_policy(name, params, cfg, sizing, scfg)
        runs[name] = simulate(wl, pol, params)
        if isinstance(pol, WarmPool):
            reasons[name] = dict(sorted(pol.reasons.items()))
        if on_done is not None:
            on_done()
    ref = runs["always_on"].metrics["replica_seconds"]
    ref_p99 = runs["always_on"].metrics["ttft"]["p99"]
    out: dict[str, Any] = {}
    for name in names:
        m = dict(runs[name].metrics)
        m["replica_seconds_ratio"] = m["replica_seconds"] / ref if ref > 0 else None
        p99 = m["ttft"]["p99"]
        m["ttft_p99_ratio"] = p99 / ref_p99 if p99 is not None and ref_p99 else None
        if name == "warm_pool":
            m["config"] = cfg.model_dump(mode="json")
        if name == "slo":
            m["config"] = scfg.model_dump(mode="json")
        if name in reasons:
            m["reasons"] = reasons[name]
        out[name] = m
    return out, runs


def pareto_sweep(
    wl: Workload,
    params: SimParams,
    cfg: AutoscaleConfig,
    keep_alives: Iterable[float],
    pools: Iterable[int],
    reference_replica_seconds: float,
    *,
    on_done: Callable[[], None] | None = None,
) -> list[dict[str, Any]]:
    """warm_pool at each (keep-alive, warm pool) pair: cold-start fraction against
    replica-seconds (absolute and as a share of always_on's)."""
    points = []
    for pool in pools:
        for ka in keep_alives:
            c = cfg.model_copy(update={"idle_to_zero_s": float(ka), "warm_pool": int(pool)})
            c = AutoscaleConfig.model_validate(c.model_dump())
            m = simulate(wl, WarmPool(c, params.standard_cold_start_s()), params, timeline=False)
            rs = m.metrics["replica_seconds"]
            points.append(
                {
                    "keep_alive_s": float(ka),
                    "warm_pool": int(pool),
                    "cold_start_fraction": m.metrics["cold_start_fraction"],
                    "replica_seconds": rs,
                    "replica_seconds_ratio": rs / reference_replica_seconds
                    if reference_replica_seconds > 0
                    else None,
                    "ttft_p99": m.metrics["ttft"]["p99"],
                }
            )
            if on_done is not None:
                on_done()
    return points


def slo_sweep(
    wl: Workload,
    params: SimParams,
    base: AutoscaleConfig,
    settings: Iterable[tuple[float, float]],
    reference: dict[str, Any],
    *,
    on_done: Callable[[], None] | None = None,
) -> list[dict[str, Any]]:
    """The ``slo`` policy at each ``(max_cold_fraction, ttft_p99_s)``: cold-start fraction,
    replica-seconds and TTFT p99 (each as a ratio to ``reference``, always_on's metrics)."""
    assert base.slo is not None
    points = []
    ref_rs = reference["replica_seconds"]
    ref_p99 = reference["ttft"]["p99"]
    for eps, ttft in settings:
        slo = base.slo.model_copy(update={"max_cold_fraction": eps, "ttft_p99_s": ttft})
        c = AutoscaleConfig.model_validate({**base.model_dump(), "slo": slo.model_dump()})
        m = simulate(wl, Slo(c, params.standard_cold_start_s()), params, timeline=False).metrics
        p99 = m["ttft"]["p99"]
        points.append(
            {
                "max_cold_fraction": eps,
                "ttft_p99_target_s": ttft,
                "cold_start_fraction": m["cold_start_fraction"],
                "replica_seconds_ratio": m["replica_seconds"] / ref_rs if ref_rs > 0 else None,
                "ttft_p99_s": p99,
                "ttft_p99_ratio": p99 / ref_p99 if p99 is not None and ref_p99 else None,
                "itl_p99_s": m["itl_p99_s"],
            }
        )
        if on_done is not None:
            on_done()
    return points


def pareto_front(points: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The points no other point beats on all of cold fraction, replica-seconds ratio and
    TTFT p99 ratio (lower is better on each)."""
    keys = ("cold_start_fraction", "replica_seconds_ratio", "ttft_p99_ratio")

    def vec(p: dict[str, Any]) -> tuple[float, ...]:
        return tuple(math.inf if p[k] is None else float(p[k]) for k in keys)

    out = []
    for p in points:
        v = vec(p)
        beaten = any(
            all(a <= b for a, b in zip(vec(q), v, strict=True)) and vec(q) != v for q in points
        )
        if not beaten:
            out.append(p)
    return out


# --------------------------------------------------------------------------- output


def table_rows(results: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    headers = [
        "policy",
        "cold_frac",
        "from_zero",
        "ttft_p50_s",
        "ttft_p99_s",
        "ttft_mean_s",
        "replica_s",
        "ratio",
        "ups",
        "downs",
        "peak_P/D",
        "cache_hit",
    ]
    rows = []
    for key, m in results.items():
        t = m["ttft"]
        ratio = m.get("replica_seconds_ratio")
        rows.append(
            [
                key,
                round(m["cold_start_fraction"], 4),
                round(m["from_zero_fraction"], 4),
                _r(t["p50"]),
                _r(t["p99"]),
                _r(t["mean"]),
                round(m["replica_seconds"], 1),
                "-" if ratio is None else round(ratio, 3),
                m["scale_ups"],
                m["scale_downs"],
                f"{m['peak_replicas']['prefill']}/{m['peak_replicas']['decode']}",
                _r(m.get("cache_hit_ratio")),
            ]
        )
    return headers, rows


def _r(x: float | None) -> float | str:
    return "-" if x is None else round(x, 3)


def plot(runs_by_load: Sequence[tuple[str, dict[str, SimResult]]], path: str, title: str) -> None:
    """Per load: TTFT CDF per policy, and replicas (both roles) over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(runs_by_load)
    fig, axes = plt.subplots(n, 2, figsize=(12, 3.6 * n), squeeze=False)
    for row, (label, runs) in enumerate(runs_by_load):
        ax_cdf, ax_rep = axes[row]
        for name, res in runs.items():
            if res.ttft_s.size:
                xs = np.sort(res.ttft_s)
                ax_cdf.plot(xs, np.arange(1, xs.size + 1) / xs.size, label=name)
            if res.timeline:
                t = [x[0] for x in res.timeline]
                ax_rep.step(t, [x[1] + x[2] for x in res.timeline], where="post", label=name)
        ax_cdf.set_xscale("log")
        ax_cdf.set_xlabel("TTFT (s)")
        ax_cdf.set_ylabel("CDF")
        ax_cdf.set_title(f"TTFT, {label} (simulated)")
        ax_cdf.legend(fontsize=8)
        ax_rep.set_xlabel("time (s)")
        ax_rep.set_ylabel("replicas (prefill + decode)")
        ax_rep.set_title(f"replicas over time, {label} (simulated)")
        ax_rep.legend(fontsize=8)
    fig.suptitle(f"SIMULATED autoscaling: {title}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_pareto(
    panels: Sequence[tuple[str, list[dict[str, Any]], dict[str, Any]]],
    path: str,
    title: str,
    goal: tuple[float, float] | None = (0.70, 0.05),
) -> None:
    """Cold-start fraction against replica-seconds (share of always_on's): warm_pool's sweep
    (one line per warm pool size, keep-alive labelled) and the baselines as points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter

    n = len(panels)
    cols = min(3, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 5 * rows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    markers = {"always_on": "s", "serve_default": "^", "serverlessllm": "v", "warm_pool": "*"}
    for ax, (label, points, baselines) in zip(axes.flat, panels, strict=False):
        for pool in sorted({p["warm_pool"] for p in points}):
            pts = sorted(
                (p for p in points if p["warm_pool"] == pool), key=lambda p: p["keep_alive_s"]
            )
            xs = [p["replica_seconds_ratio"] for p in pts]
            ys = [p["cold_start_fraction"] for p in pts]
            ax.plot(xs, ys, "o-", label=f"warm_pool, pool={pool}")
            for p, x, y in zip(pts, xs, ys, strict=True):
                ax.annotate(f"{p['keep_alive_s']:g}s", (x, y), fontsize=7, alpha=0.8)
        for name, m in baselines.items():
            ax.plot(
                m["replica_seconds_ratio"],
                m["cold_start_fraction"],
                markers.get(name, "x"),
                markersize=10,
                color="black" if name == "always_on" else None,
                label=f"{name} (run config)",
            )
        if goal is not None:
            ax.axvline(goal[0], ls="--", color="grey", lw=0.8)
            ax.axhline(goal[1], ls="--", color="grey", lw=0.8)
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(FormatStrFormatter("%.2g"))
        ax.xaxis.set_minor_formatter(FormatStrFormatter("%.2g"))
        ax.tick_params(axis="x", which="minor", labelsize=7)
        ax.set_xlabel("replica-seconds / always_on's (log)")
        ax.set_ylabel("cold-start fraction of requests")
        ax.set_title(f"{label} (simulated)")
        ax.legend(fontsize=7)
    fig.suptitle(
        f"SIMULATED: cold starts vs replica-seconds as keep-alive and warm pool move; {title}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
