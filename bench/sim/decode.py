"""Step-level decode simulator over a serverless container pool (every output: simulated).

Drives the same policy objects the engine plug-in drives (:mod:`controllers.decode`):
per container, ``admit(DecodeView)`` before each engine step and
``observe(DecodeObservation)`` after it; a dispatcher picks the container per request.

Model (issue #5; the numbers come from the engine profile, see
``engines/profiles/v100_llama32_3b.md``):

- Synchronous decode steps. A step's latency is ``l(B) = l_min`` for ``B <= B0`` and
  ``l_min + alpha (B - B0)`` beyond, ``B`` the requests decoding in the step, plus a
  noisy-neighbour penalty: ``colocated``: ``step_cost.per_token_s`` per prefill-chunk
  token in the step (the paper, §II-A: a long prompt admitted in one shot can double ITL);
  ``pd``: ``pd_inject_s_per_block`` per KV block injected into the step (the KV write at
  the V100's 900 GB/s HBM bandwidth, 1.75 MiB per block: 2 us; the paper gives no figure).
- ``colocated``: an admitted prompt is prefilled in chunks of the policy's
  ``prefill_chunk_tokens`` (TWP: ``C``) per request per step, else within the engine's
  ``token_budget`` per step (baselines: vLLM's default chunked prefill); the step that
  finishes a prompt emits its first token.
- ``pd``: each container pairs a prefill engine (FIFO, up to ``token_budget`` tokens per
  step at ``step_cost`` prices) with the decode engine; a finished prefill's KV reaches the
  decode engine after ``blocks * block_bytes / kv_link_bytes_per_s`` and waits at its gate.
  TTFT is the first token of the decode engine. A policy's dispatcher may hold a request
  at the router before its prefill (TWP: no decode container has headroom).
- KV: ``kv_blocks`` per decode engine of ``block_size`` tokens; a request holds
  ``ceil((prompt + generated) / block_size)`` blocks. When a step's growth does not fit,
  the most recently admitted request is preempted (vLLM's recompute preemption: blocks
  freed, back to the head of the waiting queue, prompt and generated tokens to prefill
  again). The engine's allocator admits in the policy's order until the first request
  that does not fit or ``max_num_seqs`` is reached.
- The serverless pool (:mod:`bench.sim.serverless_pool`) is shared by all policies.

TTFT is reported two ways (both simulated):

- ``ttft``: from the request's arrival to its first token, what a client sees (the wait at
  the router and in the engine's queue, the rest of the step in flight, the cold start);
- ``ttft_eq1``: the TWP paper's own definition, Eq. (1): ``TTFT_i = cs_i + sum of l_k for
  k from t0``, the cold-start delay the request waited for plus the latencies of the steps
  from its admission step ``t0`` through the step that emits its first token. The paper's
  sum runs to ``t0 + ceil(p_i / C)``, one step more than the chunks; we end at the step
  that finishes the prompt, because that step emits the first token (as in vLLM), so a
  one-chunk prompt counts one step. The wait before admission (TWP's window holding it)
  and the rest of the step in flight at arrival are *not* in Eq. (1). ``t0`` is the first
  admission into the decode engine's running set; a preempted request keeps its first
  ``t0``. In ``pd`` mode that excludes the prefill engine and the KV transfer too, so
  there ``ttft_eq1`` is only the decode side's share.

Metrics per policy: TTFT and end-to-end latency STATS (s, :func:`bench.report.stats.summarize`),
per-step ITL mean, p99 and CV (std / mean over steps that decoded >= 1 request, all
containers pooled), throughput in requests and generated tokens per second of wall time
(first arrival to last completion), cold starts, preemptions. Deterministic: no
randomness inside the simulator; event ties break by insertion order.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, is_dataclass
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from bench.report.stats import summarize
from bench.sim.serverless_pool import PoolConfig, ServerlessPool
from bench.workloads.decode import DecodeRequest
from controllers.decode import (
    DecodeAdmissionPolicy,
    DecodeObservation,
    DecodeView,
    EngineView,
    FinishedRequest,
    RunningRequestView,
    TWPConfig,
    WaitingRequestView,
    make_decode_policy,
)
from controllers.decode.dispatch import ContainerView, DispatchRequest
from controllers.profile import EngineProfile

Mode = Literal["colocated", "pd"]


class DecodeSimConfig(BaseModel):
    """Simulator parameters beyond the engine profile."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Mode = Field(default="colocated", description="colocated: one engine; pd: P + D.")
    pool: PoolConfig = Field(default_factory=PoolConfig, description="Serverless pool.")
    pd_inject_s_per_block: float = Field(
        default=2.0e-6, ge=0, description="pd noisy-neighbour cost per injected KV block (s)."
    )
    block_bytes: int = Field(
        default=1_835_008,
        ge=1,
        description="Bytes of one KV block (Llama-3.2-3B, 16 tokens: 16 x 112 KiB).",
    )
    kv_link_bytes_per_s: float = Field(
        default=10e9, gt=0, description="Prefill-to-decode KV transfer bandwidth (B/s)."
    )
    max_num_seqs: int = Field(default=256, ge=1, description="Engine batch cap (vLLM default).")
    kv_blocks: int | None = Field(
        default=None, ge=1, description="Override the profile's KV blocks per decode engine."
    )
    L_bar: int = Field(
        default=50, ge=1, description="Expected mean output length for TWP's H0 (paper: 50)."
    )
    max_sim_s: float = Field(
        default=7200.0, gt=0, description="Stop simulating after this simulated time (s)."
    )


@dataclass(slots=True)
class _Req:
    src: DecodeRequest
    l_hat: int = 0
    container: int = -1
    prefill_left: int = 0
    pd_prefill_left: int = 0
    generated: int = 0
    blocks: int = 0
    chunk: int = 0
    inject: bool = False
    wait_steps: int = 0
    wait_since_s: float = 0.0
    cold_s: float = 0.0
    admit_s: float | None = None
    first_token_s: float | None = None
    finish_s: float | None = None

    @property
    def rid(self) -> str:
        return self.src.request_id


@dataclass
class _Engine:
    index: int
    policy: DecodeAdmissionPolicy
    total_blocks: int
    free_blocks: int
    waiting: list[_Req] = field(default_factory=list)
    running: list[_Req] = field(default_factory=list)
    prefill_q: list[_Req] = field(default_factory=list)
    in_transfer: int = 0
    busy: bool = False
    prefill_busy: bool = False
    step_index: int = 0
    last_latency_s: float = 0.0
    decoders: list[_Req] = field(default_factory=list)
    prefilling: list[_Req] = field(default_factory=list)
    prefill_batch: list[tuple[_Req, int]] = field(default_factory=list)


@dataclass
class PolicyResult:
    """Raw outcome of one policy on one workload (summarised by :func:`summarize_result`)."""

    ttft: list[float]
    e2e: list[float]
    ttft_eq1: list[float]
    itl: list[float]
    itl_t: list[float]
    generated_tokens: int
    completed: int
    unfinished: int
    wall_s: float
    cold_starts: int
    preemptions: int
    held_at_router: int
    counters: dict[str, int]


class DecodeSimulator:
    """One policy, one workload, one pool. Call :meth:`run` once."""

    def __init__(
        self,
        profile: EngineProfile,
        policy_name: str,
        config: DecodeSimConfig | None = None,
        twp: TWPConfig | None = None,
    ) -> None:
        self.profile = profile
        self.cfg = config or DecodeSimConfig()
        self.spec = make_decode_policy(
            policy_name, profile, mode=self.cfg.mode, L_bar=self.cfg.L_bar, twp=twp
        )
        self.pool = ServerlessPool(self.cfg.pool, self.spec.fast_loading)
        blocks = self.cfg.kv_blocks or profile.kv_blocks or 12000
        self.engines = [
            _Engine(i, self.spec.new_admission(), blocks, blocks)
            for i in range(self.cfg.pool.n_containers)
        ]
        self.bs = profile.block_size
        self._heap: list[tuple[float, int, str, int, Any]] = []
        self._seq = 0
        self.now = 0.0
        self.held: list[_Req] = []
        self.preemptions = 0
        self.held_count = 0
        self.itl: list[float] = []
        self.itl_t: list[float] = []
        self.done: list[_Req] = []

    # -- events --------------------------------------------------------------------
    def _push(self, t: float, kind: str, idx: int, payload: Any = None) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, idx, payload))

    def run(
        self, requests: Sequence[DecodeRequest], progress: Callable[[int], None] | None = None
    ) -> PolicyResult:
        reqs = [_Req(r) for r in sorted(requests, key=lambda r: (r.arrival_s, r.request_id))]
        for i, r in enumerate(reqs):
            self._push(r.src.arrival_s, "arrive", -1, i)
        handlers = {
            "arrive": lambda idx, p: self._arrive(reqs[p]),
            "ready": lambda idx, p: self._ready(idx),
            "step_end": lambda idx, p: self._step_end(self.engines[idx]),
            "prefill_end": lambda idx, p: self._prefill_end(self.engines[idx]),
            "kv_ready": lambda idx, p: self._kv_ready(self.engines[idx], p),
        }
        while self._heap:
            t, _, kind, idx, payload = heapq.heappop(self._heap)
            if t > self.cfg.max_sim_s:
                break
            self.now = t
            n_done = len(self.done)
            handlers[kind](idx, payload)
            if progress is not None and len(self.done) > n_done:
                progress(len(self.done) - n_done)
        first = reqs[0].src.arrival_s if reqs else 0.0
        last = max((r.finish_s or 0.0) for r in self.done) if self.done else first
        counters: dict[str, int] = {}
        for e in self.engines:
            st = getattr(e.policy, "state", None)
            c = getattr(st, "counters", None)
            if c is not None and is_dataclass(c) and not isinstance(c, type):
                for k, v in asdict(c).items():
                    counters[k] = counters.get(k, 0) + int(v)
        return PolicyResult(
            ttft=[r.first_token_s - r.src.arrival_s for r in reqs if r.first_token_s is not None],
            e2e=[r.finish_s - r.src.arrival_s for r in self.done if r.finish_s is not None],
            ttft_eq1=[
                r.cold_s + r.first_token_s - r.admit_s
                for r in reqs
                if r.first_token_s is not None and r.admit_s is not None
            ],
            itl=self.itl,
            itl_t=self.itl_t,
            generated_tokens=sum(r.generated for r in reqs),
            completed=len(self.done),
            unfinished=len(reqs) - len(self.done),
            wall_s=max(1e-9, last - first),
            cold_starts=self.pool.cold_starts,
            preemptions=self.preemptions,
            held_at_router=self.held_count,
            counters=counters,
        )

    # -- dispatch ------------------------------------------------------------------
    def _views(self) -> list[ContainerView]:
        self.pool.expire(self.now)
        out = []
        for e, s in zip(self.engines, self.pool.slots, strict=True):
            self._refresh_l_hat(e)
            window = float(getattr(e.policy, "window_tokens", 0.0))
            load = sum(max(1, r.l_hat - r.generated) for r in e.running)
            load += sum(r.l_hat for r in e.waiting) + sum(r.l_hat for r in e.prefill_q)
            load += e.in_transfer
            out.append(
                ContainerView(
                    index=e.index,
                    warm=s.warm,
                    starting=s.starting,
                    outstanding=s.outstanding,
                    free_blocks=e.free_blocks,
                    total_blocks=e.total_blocks,
                    window_tokens=window,
                    token_load=float(load),
                )
            )
        return out

    def _arrive(self, r: _Req) -> None:
        if self.held:
            self.held.append(r)
            self.held_count += 1
            self._retry_held()
            return
        if not self._dispatch(r):
            self.held.append(r)
            self.held_count += 1

    def _dispatch(self, r: _Req) -> bool:
        prompt_blocks = -(-r.src.prompt_tokens // self.bs)
        # L_hat comes from the policy replica that will hold the request; the router asks
        # the first replica's estimate (replicas see the same tenants' completions).
        r.l_hat = self.engines[0].policy.expected_output(r.src.tenant, r.src.max_tokens)
        dreq = DispatchRequest(r.rid, r.src.prompt_tokens, prompt_blocks, r.l_hat)
        idx = self.spec.dispatcher.choose(dreq, self._views())
        if idx is None:
            return False
        e, slot = self.engines[idx], self.pool.slots[idx]
        r.l_hat = e.policy.expected_output(r.src.tenant, r.src.max_tokens)
        r.container = idx
        slot.outstanding += 1
        if not slot.warm and not slot.starting:
            self._push(self.pool.start(idx, self.now), "ready", idx)
        if not slot.warm:  # Eq. (1)'s cs_i: the cold start this request waits for
            r.cold_s = max(0.0, slot.ready_at_s - self.now)
        if self.cfg.mode == "pd":
            r.pd_prefill_left = r.src.prompt_tokens
            e.prefill_q.append(r)
            self._kick_prefill(e)
        else:
            r.prefill_left = r.src.prompt_tokens
            self._enqueue(e, r)
        return True

    def _retry_held(self) -> None:
        while self.held and self._dispatch(self.held[0]):
            self.held.pop(0)

    def _ready(self, idx: int) -> None:
        self.pool.ready(idx, self.now)
        e = self.engines[idx]
        self._kick_prefill(e)
        self._kick(e)
        self._retry_held()

    def _enqueue(self, e: _Engine, r: _Req) -> None:
        r.wait_steps = 0
        r.wait_since_s = self.now
        e.waiting.append(r)
        self._kick(e)

    # -- prefill engine (pd) -------------------------------------------------------
    def _kick_prefill(self, e: _Engine) -> None:
        if e.prefill_busy or not e.prefill_q or not self.pool.slots[e.index].warm:
            return
        budget = self.profile.token_budget
        batch: list[tuple[_Req, int]] = []
        for r in e.prefill_q:
            if budget <= 0:
                break
            c = min(r.pd_prefill_left, budget)
            batch.append((r, c))
            budget -= c
        tokens = sum(c for _, c in batch)
        sc = self.profile.step_cost
        e.prefill_batch = batch
        e.prefill_busy = True
        self._push(self.now + sc.fixed_s + sc.per_token_s * tokens, "prefill_end", e.index)

    def _prefill_end(self, e: _Engine) -> None:
        e.prefill_busy = False
        for r, c in e.prefill_batch:
            r.pd_prefill_left -= c
            if r.pd_prefill_left <= 0:
                e.prefill_q.remove(r)
                blocks = -(-r.src.prompt_tokens // self.bs)
                e.in_transfer += r.l_hat
                delay = blocks * self.cfg.block_bytes / self.cfg.kv_link_bytes_per_s
                self._push(self.now + delay, "kv_ready", e.index, r)
        e.prefill_batch = []
        self.pool.touch(e.index, self.now)
        self._kick_prefill(e)

    def _kv_ready(self, e: _Engine, r: _Req) -> None:
        e.in_transfer -= r.l_hat
        r.prefill_left = 0
        r.inject = True
        self._enqueue(e, r)

    # -- decode engine -------------------------------------------------------------
    def _kick(self, e: _Engine) -> None:
        if not e.busy and self.pool.slots[e.index].warm and (e.waiting or e.running):
            self._start_step(e)

    def _need_blocks(self, r: _Req) -> int:
        return -(-(r.src.prompt_tokens + r.generated) // self.bs)

    def _refresh_l_hat(self, e: _Engine) -> None:
        """Re-read ``L_hat`` of running requests (matters only for survival estimates)."""
        if not getattr(getattr(e.policy, "config", None), "survival_l_hat", False):
            return
        for r in e.running:
            r.l_hat = e.policy.expected_output(r.src.tenant, r.src.max_tokens, r.generated)

    def _admit(self, e: _Engine) -> None:
        if not e.waiting:
            return
        self._refresh_l_hat(e)
        view = DecodeView(
            waiting=tuple(
                WaitingRequestView(
                    request_id=r.rid,
                    tenant=r.src.tenant,
                    prompt_tokens=r.src.prompt_tokens + r.generated,
                    prompt_blocks=self._need_blocks(r),
                    max_tokens=r.src.max_tokens,
                    l_hat=r.l_hat,
                    wait_steps=r.wait_steps,
                    wait_s=self.now - r.wait_since_s,
                )
                for r in e.waiting
            ),
            running=tuple(
                RunningRequestView(r.rid, r.generated, r.l_hat, r.src.tenant) for r in e.running
            ),
            engine=EngineView(
                free_blocks=e.free_blocks,
                total_blocks=e.total_blocks,
                last_step_latency_s=e.last_latency_s,
                queue_depth=len(e.waiting),
                step_index=e.step_index,
            ),
        )
        by_id = {r.rid: r for r in e.waiting}
        taken: set[str] = set()
        for d in e.policy.admit(view):
            if not d.admitted:
                continue
            r = by_id[d.request_id]
            need = self._need_blocks(r)
            if need > e.free_blocks or len(e.running) >= self.cfg.max_num_seqs:
                break  # the allocator delays this one and everything after it
            e.free_blocks -= need
            r.blocks = need
            if r.admit_s is None:
                r.admit_s = self.now  # Eq. (1)'s t0: this step starts now
            e.running.append(r)
            taken.add(r.rid)
        if taken:
            e.waiting = [r for r in e.waiting if r.rid not in taken]

    def _preempt(self, e: _Engine) -> _Req:
        victim = e.running.pop()
        e.free_blocks += victim.blocks
        victim.blocks = 0
        victim.inject = False
        victim.chunk = 0
        victim.prefill_left = victim.src.prompt_tokens + victim.generated
        victim.wait_steps = 0
        victim.wait_since_s = self.now
        e.waiting.insert(0, victim)
        self.preemptions += 1
        return victim

    def _start_step(self, e: _Engine) -> None:
        self._admit(e)
        if not e.running:
            return
        # KV growth of this step's decoders; preempt the newest until it fits.
        while True:
            decoders = [r for r in e.running if r.prefill_left == 0]
            grow = sum(1 for r in decoders if (r.src.prompt_tokens + r.generated) % self.bs == 0)
            if grow <= e.free_blocks or len(e.running) <= 1:
                break
            self._preempt(e)
        grow = min(grow, e.free_blocks)
        e.free_blocks -= grow
        for r in decoders:
            if (r.src.prompt_tokens + r.generated) % self.bs == 0 and grow > 0:
                r.blocks += 1
                grow -= 1
        prefilling = [r for r in e.running if r.prefill_left > 0]
        budget = max(0, self.profile.token_budget - len(decoders))
        cap = e.policy.prefill_chunk_tokens or budget
        prefill_tokens = 0
        for r in prefilling:
            c = min(r.prefill_left, cap, budget)
            r.chunk = c
            budget -= c
            prefill_tokens += c
        injected = sum(self._need_blocks(r) for r in decoders if r.inject)
        for r in decoders:
            r.inject = False
        latency = self.profile.decode.step_latency_s(len(decoders))
        if self.cfg.mode == "colocated":
            latency += self.profile.step_cost.per_token_s * prefill_tokens
        else:
            latency += self.cfg.pd_inject_s_per_block * injected
            latency += self.profile.step_cost.per_token_s * prefill_tokens  # recomputes
        e.decoders, e.prefilling = decoders, prefilling
        e.busy = True
        e.last_latency_s = latency
        self._push(self.now + latency, "step_end", e.index)

    def _step_end(self, e: _Engine) -> None:
        e.busy = False
        now = self.now
        if e.decoders:
            self.itl.append(e.last_latency_s)
            self.itl_t.append(now)
        for r in e.decoders:
            r.generated += 1
            if r.first_token_s is None:
                r.first_token_s = now
        for r in e.prefilling:
            if r.chunk <= 0:
                continue
            r.prefill_left -= r.chunk
            r.chunk = 0
            if r.prefill_left <= 0:
                r.prefill_left = 0
                r.generated += 1
                if r.first_token_s is None:
                    r.first_token_s = now
        finished: list[FinishedRequest] = []
        keep: list[_Req] = []
        slot = self.pool.slots[e.index]
        for r in e.running:
            if r.generated >= r.src.output_tokens:
                r.finish_s = now
                e.free_blocks += r.blocks
                r.blocks = 0
                finished.append(FinishedRequest(r.src.tenant, r.generated))
                self.done.append(r)
                slot.outstanding -= 1
            else:
                keep.append(r)
        e.running = keep
        for r in e.waiting:
            r.wait_steps += 1
        e.policy.observe(
            DecodeObservation(
                step_index=e.step_index,
                step_latency_s=e.last_latency_s,
                free_blocks=e.free_blocks,
                total_blocks=e.total_blocks,
                queue_depth=len(e.waiting),
                batch_size=len(e.decoders),
                finished=tuple(finished),
            )
        )
        e.step_index += 1
        e.decoders, e.prefilling = [], []
        self.pool.touch(e.index, now)
        if self.held:
            self._retry_held()
        self._kick(e)


def summarize_result(res: PolicyResult) -> dict[str, Any]:
    """The JSON block of one policy (issue #5 schema, plus counts)."""
    itl = np.asarray(res.itl, dtype=np.float64)
    itl_block: dict[str, float | None] = {"mean": None, "p99": None, "cv": None}
    if itl.size:
        mean = float(itl.mean())
        itl_block = {
            "mean": mean,
            "p99": float(np.percentile(itl, 99)),
            "cv": float(itl.std() / mean) if mean > 0 else None,
        }
    return {
        "ttft": summarize(res.ttft),
        "ttft_eq1": summarize(res.ttft_eq1),
        "e2e": summarize(res.e2e),
        "itl": itl_block,
        "throughput_rps": res.completed / res.wall_s,
        "throughput_tps": res.generated_tokens / res.wall_s,
        "cold_starts": res.cold_starts,
        "preemptions": res.preemptions,
        "completed": res.completed,
        "unfinished": res.unfinished,
        "held_at_router": res.held_at_router,
        "counters": res.counters,
    }


def simulate(
    profile: EngineProfile,
    policy: str,
    requests: Sequence[DecodeRequest],
    config: DecodeSimConfig | None = None,
    twp: TWPConfig | None = None,
    progress: Callable[[int], None] | None = None,
) -> PolicyResult:
    """Run one policy over one workload (fresh pool and engines)."""
    return DecodeSimulator(profile, policy, config, twp).run(requests, progress)


def fcfs_saturated_rate(
    profile: EngineProfile,
    config: DecodeSimConfig,
    make_requests: Callable[[float, float], Sequence[DecodeRequest]],
    n_requests: int = 600,
) -> float:
    """FCFS's saturated completion rate (req/s) on this pool and mix.

    A flood of ``n_requests`` arriving within 1 s into an all-warm pool; the rate is
    completions per second of wall time. ``make_requests(rate, duration_s)`` draws the
    mix (the synthetic scenarios' prompt and output lengths).
    """
    warm = config.model_copy(
        update={"pool": config.pool.model_copy(update={"warm_at_start": config.pool.n_containers})}
    )
    reqs = list(make_requests(float(n_requests), 1.0))
    res = simulate(profile, "fcfs", reqs, warm)
    return res.completed / res.wall_s if res.completed else 0.0


# -- experiments: scenarios x policies x runs --------------------------------------------

DEFAULT_POLICIES = ("fcfs", "round_robin", "priority", "dynamic_batch", "serverlessllm", "twp")
PAPER_RATE_RPS = 18.0


@dataclass
class Experiment:
    """What to run: a named scenario (or trace records), a mode, policies, runs."""

    scenario: str
    mode: Mode = "colocated"
    policies: Sequence[str] = DEFAULT_POLICIES
    runs: int | None = None
    seed: int = 0
    load: float | None = None
    quick: bool = False
    trace: Sequence[Any] | None = None
    trace_name: str = "trace"
    max_requests: int | None = None


def _spread(values: Sequence[float]) -> dict[str, float | None]:
    a = np.asarray([v for v in values if v is not None], dtype=np.float64)
    if a.size == 0:
        return {"mean": None, "std": None, "min": None, "max": None}
    return {
        "mean": float(a.mean()),
        "std": float(a.std()),
        "min": float(a.min()),
        "max": float(a.max()),
    }


def run_experiment(
    profile: EngineProfile,
    exp: Experiment,
    config: DecodeSimConfig | None = None,
    twp: TWPConfig | None = None,
    show_progress: bool = True,
) -> tuple[dict[str, Any], dict[str, PolicyResult]]:
    """Run every policy on the same workloads; returns the JSON dict and run 0's raw results.

    Rates: ``paper`` at 18 req/s (``--load`` scales it); ``low``/``medium``/``high``/
    ``burst`` at their load (or ``load``) x FCFS's saturated rate on this pool and mix;
    a trace at its own rate, or ``load`` x FCFS's saturated rate on the trace's mix.
    Runs: 10 for the synthetic scenarios, 1 otherwise, 2 at most with ``quick`` (which also
    shortens the arrival window from 60 s to 20 s).
    """
    from tqdm import tqdm

    from bench.workloads import decode as wl

    cfg = (config or DecodeSimConfig()).model_copy(update={"mode": exp.mode})
    duration = 20.0 if exp.quick else 60.0
    synthetic = exp.scenario in wl.SYNTHETIC_LOAD
    runs = exp.runs or (10 if synthetic else 1)
    if exp.quick:
        runs = min(runs, 2)
    sat: float | None = None
    rate: float | None = None

    if exp.trace is not None:
        recs = list(exp.trace)[: exp.max_requests] if exp.max_requests else list(exp.trace)
        if exp.load is not None:

            def flood(r: float, d: float) -> list[DecodeRequest]:
                n = int(r * d)
                reqs = wl.from_trace(recs[:n], None, 0, exp.trace_name)
                return [
                    DecodeRequest(
                        x.request_id,
                        x.tenant,
                        i / max(1, n),
                        x.prompt_tokens,
                        x.output_tokens,
                        x.max_tokens,
                    )
                    for i, x in enumerate(reqs)
                ]

            sat = fcfs_saturated_rate(profile, cfg, flood, n_requests=min(600, len(recs)))
            rate = exp.load * sat

        def make(seed: int) -> list[DecodeRequest]:
            return wl.from_trace(recs, rate, seed, exp.trace_name)
    elif exp.scenario == "paper":
        rate = PAPER_RATE_RPS * (exp.load if exp.load is not None else 1.0)

        def make(seed: int) -> list[DecodeRequest]:
            return wl.paper(seed, rate=rate or PAPER_RATE_RPS, duration_s=duration)
    elif synthetic:
        sat = fcfs_saturated_rate(
            profile, cfg, lambda r, d: wl.synthetic("low", r / wl.SYNTHETIC_LOAD["low"], 0, d)
        )
        factor = exp.load if exp.load is not None else wl.SYNTHETIC_LOAD[exp.scenario]
        rate = factor * sat
        ref = rate / wl.SYNTHETIC_LOAD[exp.scenario]

        def make(seed: int) -> list[DecodeRequest]:
            return wl.synthetic(exp.scenario, ref, seed, duration)
    else:
        raise ValueError(
            f"unknown scenario {exp.scenario!r}; known: {list(wl.SCENARIOS)} or a trace"
        )

    workloads = [make(exp.seed + k) for k in range(runs)]
    raw: dict[str, list[PolicyResult]] = {p: [] for p in exp.policies}
    bar = tqdm(
        total=runs * len(exp.policies),
        desc=f"sim decode {exp.scenario}/{exp.mode} (simulated)",
        disable=not show_progress,
        leave=False,
    )
    for reqs in workloads:
        for p in exp.policies:
            raw[p].append(simulate(profile, p, reqs, cfg, twp))
            bar.update(1)
    bar.close()

    out: dict[str, Any] = {
        "simulated": True,
        "scenario": exp.scenario if exp.trace is None else exp.trace_name,
        "mode": exp.mode,
        "profile": profile.model,
        "hardware": profile.hardware,
        "runs": runs,
        "seed": exp.seed,
        "load": exp.load,
        "rate_rps": rate,
        "fcfs_saturated_rps": sat,
        "n_requests": [len(w) for w in workloads],
        "pool": cfg.pool.model_dump(),
        "policies": {},
    }
    for p, results in raw.items():
        pooled = PolicyResult(
            ttft=[x for r in results for x in r.ttft],
            e2e=[x for r in results for x in r.e2e],
            ttft_eq1=[x for r in results for x in r.ttft_eq1],
            itl=[x for r in results for x in r.itl],
            itl_t=[],
            generated_tokens=sum(r.generated_tokens for r in results),
            completed=sum(r.completed for r in results),
            unfinished=sum(r.unfinished for r in results),
            wall_s=sum(r.wall_s for r in results),
            cold_starts=sum(r.cold_starts for r in results),
            preemptions=sum(r.preemptions for r in results),
            held_at_router=sum(r.held_at_router for r in results),
            counters={
                k: sum(r.counters.get(k, 0) for r in results)
                for k in (results[0].counters if results else {})
            },
        )
        block = summarize_result(pooled)
        block["cold_starts"] = pooled.cold_starts / runs
        block["preemptions"] = pooled.preemptions / runs
        per_run = [summarize_result(r) for r in results]
        block["spread"] = {
            "ttft_p99": _spread([s["ttft"]["p99"] for s in per_run]),
            "itl_cv": _spread([s["itl"]["cv"] for s in per_run]),
            "itl_p99": _spread([s["itl"]["p99"] for s in per_run]),
            "throughput_tps": _spread([s["throughput_tps"] for s in per_run]),
        }
        out["policies"][p] = block
    return out, {p: r[0] for p, r in raw.items()}


def table_rows(result: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    """Headers and rows of the printed table (ms for latencies; mean of runs with spread)."""
    headers = [
        "policy (simulated)",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "p99 sd",
        "ITL mean ms",
        "ITL p99 ms",
        "ITL CV",
        "CV sd",
        "req/s",
        "tok/s",
        "cold",
        "preempt",
    ]
    rows = []

    def ms(v: float | None) -> float | str:
        return "-" if v is None else round(v * 1e3, 1)

    for p, b in result["policies"].items():
        sp = b["spread"]
        rows.append(
            [
                p,
                ms(b["ttft"]["p50"]),
                ms(b["ttft"]["p99"]),
                ms(sp["ttft_p99"]["std"]),
                ms(b["itl"]["mean"]),
                ms(b["itl"]["p99"]),
                "-" if b["itl"]["cv"] is None else round(b["itl"]["cv"], 4),
                "-" if sp["itl_cv"]["std"] is None else round(sp["itl_cv"]["std"], 4),
                round(b["throughput_rps"], 3),
                round(b["throughput_tps"], 1),
                b["cold_starts"],
                b["preemptions"],
            ]
        )
    return headers, rows


def plot(result: dict[str, Any], raw: dict[str, PolicyResult], path: str) -> None:
    """ITL over time (1 s bins, run 0) and TTFT CDFs (run 0), PNG, Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, r in raw.items():
        if r.itl:
            t = np.asarray(r.itl_t)
            v = np.asarray(r.itl) * 1e3
            bins = np.floor(t).astype(int)
            uniq = np.unique(bins)
            means = [v[bins == b].mean() for b in uniq]
            ax1.plot(uniq, means, label=name, lw=1)
        if r.ttft:
            x = np.sort(np.asarray(r.ttft))
            ax2.plot(x, np.arange(1, x.size + 1) / x.size, label=name, lw=1)
    ax1.set_xlabel("time (s)")
    ax1.set_ylabel("mean step ITL in 1 s bins (ms)")
    ax1.set_yscale("log")
    ax2.set_xlabel("TTFT (s)")
    ax2.set_xscale("log")
    ax2.set_ylabel("CDF")
    ax1.legend(fontsize=7)
    fig.suptitle(f"SIMULATED decode: {result['scenario']} / {result['mode']} (run 0)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
