"""vLLM scheduler plug-ins: Fairway (and its baselines) order ``waiting``; TWP gates it.

Load one through vLLM's ``scheduler_cls`` (``EngineArgs.scheduler_cls``,
``--scheduler-cls``), with parameters in ``additional_config={"pdserve": {...}}``
(:class:`engines.config.EngineSchedulerConfig`):

- ``engines.scheduler.FairwayScheduler``: orders the waiting queue with a prefill policy
  (default ``fairway``; ``fcfs``, ``lpm``, ... through the same code path).
- ``engines.scheduler.TWPScheduler``: Token Window Pacing admission gate, vLLM's order.
- ``engines.scheduler.ColocatedScheduler``: Fairway orders, TWP gates, and prefill is chunked
  by vLLM itself through ``long_prefill_token_threshold`` (set to TWP's ``C`` if unset).
- ``Async*`` variants extend vLLM's ``AsyncScheduler`` for GPU engines with async scheduling
  on. The CPU platform forces ``async_scheduling=False``, so those are untested here.

What the plug-ins do per engine step, and nothing else (vLLM keeps the budget loop, chunking,
allocation and preemption):

1. ``_collect``: per waiting request, the cached prefix from the KV cache manager
   (:class:`engines.prefix_probe.PrefixProbe`: no side effects, recomputed only for new
   arrivals or changed blocks), the arrival time, and the patience from the full prompt
   length (computed once per request).
2. ``_order``: the prefill policy's order replaces the order of ``self.waiting``.
3. ``_gate``: TWP's held requests are taken out of ``waiting`` for this ``schedule()`` call
   only and put back right after it, so vLLM never admits them in this step.
   With ``fair_share`` (and ``fair_share_chunks``, its default), ``_take_turns``: running
   prefill chunks are put in the fair share's turn order for this call, and a tenant whose
   turn is later than a waiting request's sits the call out (its chunks leave ``running``,
   its waiting requests ``waiting``; both are put back right after), since vLLM would run
   every running chunk before any waiting request.
4. Right after vLLM's ``schedule()``: a stateful prefill policy's ``observe_step`` (if it
   has one) gets the ``(request_id, tokens)`` this step scheduled, as in the simulator.
5. After each step (``update_from_output``): the step's wall time, the ITL sample (the gap
   between consecutive steps that carried decode tokens, idle gaps excluded), TWP's
   ``observe``, a :class:`StepRecord`, and the state snapshot on the channel. With
   ``step_target_s`` set, a step that decoded nothing also updates the step's token budget
   (vLLM's ``max_num_scheduled_tokens``; :mod:`controllers.step_budget`).

Timing uses ``self.clock`` (monotonic, replaceable by tests); arrival times and Fairway's
``now`` use ``self.wall_clock`` because vLLM stamps ``Request.arrival_time`` with
``time.time()``. ``self.extra_step_latency`` (``None`` unless a test or experiment sets it)
adds a modelled delay, a function of the batch size, to every measured step time, so a
slowdown can be injected without sleeping.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from controllers import step_budget
from controllers.config import FairwayConfig
from controllers.decode.base import (
    AdmissionDecision,
    DecodeObservation,
    DecodeView,
    EngineView,
    FinishedRequest,
    RunningRequestView,
    WaitingRequestView,
)
from controllers.decode.config import TWPConfig
from controllers.decode.twp import TWP, LMinTracker
from controllers.prefill import (
    PrefillPolicy,
    PrefillQueueView,
    PrefillRequestView,
    make_prefill_policy,
    patience_s,
)
from controllers.prefill.fairshare import ChunkTurns
from controllers.prefill.registry import FAIR_SHARE_SUFFIX
from controllers.profile import EngineProfile
from engines.config import EngineSchedulerConfig, engine_config_from_vllm
from engines.engine_rpc import register as register_engine_rpc
from engines.prefix_probe import PrefixProbe
from engines.runtime import owed_prompt_tokens
from engines.state_channel import StatePublisher

_NEEDS_PROFILE = ("fairway", "peek")
#: the least a step-time target lowers a step's budget to (``step_target_s``): four blocks
#: of 16, and below it a step's fixed cost is most of its time
STEP_FLOOR_TOKENS = 64


@dataclass(slots=True)
class StepRecord:
    """One engine step as the plug-in saw it (seconds; token and request counts)."""

    step: int
    waiting: int
    running: int
    hook_s: float
    schedule_s: float
    step_s: float
    scheduled_tokens: int
    decode_requests: int
    itl_s: float
    window_tokens: float
    token_load: int
    token_load_after: int


@dataclass(slots=True)
class _Turns:
    """One ``schedule()`` call's turns for running chunks (:meth:`_take_turns`): ``running``
    as it was, the chunks taken out of it, and the waiting request they sat out for."""

    before: list[Any]
    sat: list[Any]
    first: str | None


@dataclass(slots=True)
class _ReqInfo:
    arrival_s: float
    patience_s: float
    first_step: int
    first_seen_s: float
    tenant: str
    l_hat: int = 0


class PdserveSchedulerMixin:
    """The plug-in logic; combined with vLLM's ``Scheduler`` or ``AsyncScheduler`` below."""

    default_prefill_policy: ClassVar[str | None] = None
    default_gate: ClassVar[str] = "none"
    colocated: ClassVar[bool] = False

    # Attributes of vLLM's Scheduler that the mixin uses (for the type checker).
    waiting: Any
    running: list[Any]
    requests: dict[str, Any]
    kv_cache_manager: Any
    scheduler_config: Any
    cache_config: Any
    vllm_config: Any
    policy: Any
    block_size: int
    max_num_scheduled_tokens: int
    max_num_active_reqs: int
    num_waiting_for_streaming_input: int

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.policy != SchedulingPolicy.FCFS:
            raise ValueError(
                "pdserve schedulers order the queue themselves: use scheduling policy 'fcfs' "
                f"(got {self.policy.value!r})"
            )
        self.clock: Callable[[], float] = time.monotonic
        self.wall_clock: Callable[[], float] = time.time
        self.extra_step_latency: Callable[[int], float] | None = None
        self.probe = PrefixProbe(self.kv_cache_manager)
        self._publisher: StatePublisher | None = None
        self.configure(engine_config_from_vllm(self.vllm_config.additional_config))

    # ----- configuration -------------------------------------------------------------
    def configure(self, cfg: EngineSchedulerConfig) -> None:
        """(Re)build policy, gate and channel from ``cfg``; clears per-request state.

        Called at engine start; tests and benchmarks may call it again while the engine is
        idle to switch policy without a new engine. Raises ``ValueError`` naming the field.
        """
        profile: EngineProfile | None = cfg.load_profile()
        name = cfg.prefill_policy or self.default_prefill_policy
        if name is not None and name.startswith(_NEEDS_PROFILE) and profile is None:
            raise ValueError(f"profile: prefill policy {name!r} needs an engine profile")
        gate = self.default_gate if cfg.gate == "default" else cfg.gate
        if gate == "twp" and profile is None:
            raise ValueError("profile: the twp gate needs an engine profile (decode l_min, B0)")
        self.pd_config = cfg
        self.profile = profile
        if name is None and cfg.fair_share:
            raise ValueError(
                f"fair_share: {type(self).__name__} orders no prefill queue without a "
                "prefill_policy, so the share would be ignored; name one or turn it off"
            )
        if name is not None and cfg.fair_share and not name.endswith(FAIR_SHARE_SUFFIX):
            name += FAIR_SHARE_SUFFIX
        self.prefill: PrefillPolicy | None = (
            make_prefill_policy(name, profile, cfg.fairway) if name is not None else None
        )
        self._observe_step: Callable[[list[tuple[str, int]], float], None] | None = getattr(
            self.prefill, "observe_step", None
        )
        # Capabilities the policy declares (controllers.prefill.LanedPolicy), not its type.
        self._order_with_lanes: (
            Callable[[PrefillQueueView, float], tuple[list[str], list[str]]] | None
        ) = getattr(self.prefill, "order_with_lanes", None)
        # Capability, not type: a fair share that also takes turns for running chunks.
        self._chunk_turns: Callable[[list[str], list[str]], ChunkTurns] | None = (
            getattr(self.prefill, "chunk_turns", None) if cfg.fair_share_chunks else None
        )
        self.gate: TWP | None = TWP(profile, cfg.twp) if gate == "twp" and profile else None
        if not hasattr(self, "_engine_long_prefill"):
            self._engine_long_prefill = self.scheduler_config.long_prefill_token_threshold
        threshold = self._engine_long_prefill
        if self.gate is not None and self.colocated and cfg.colocated_chunking and not threshold:
            threshold = cfg.twp.C
        self.scheduler_config.long_prefill_token_threshold = threshold
        if not hasattr(self, "_engine_step_tokens"):
            self._engine_step_tokens = self.max_num_scheduled_tokens
        self.max_num_scheduled_tokens = min(
            self._engine_step_tokens, cfg.step_tokens or self._engine_step_tokens
        )
        self._step_budget: step_budget.StepBudget | None = (
            step_budget.start(cfg.step_target_s, STEP_FLOOR_TOKENS, self.max_num_scheduled_tokens)
            if cfg.step_target_s is not None
            else None
        )
        if self._publisher is not None and self._publisher.endpoint != cfg.channel:
            self._publisher.close()
            self._publisher = None
        if cfg.channel and self._publisher is None:
            self._publisher = StatePublisher(cfg.channel)
        self.records: deque[StepRecord] = deque(maxlen=cfg.history_steps)
        self._info: dict[str, _ReqInfo] = {}
        self._step = 0
        self._pending: deque[dict[str, Any]] = deque()
        self._last_decode_end: float | None = None
        self._last_itl = 0.0
        self._l_min_tracker: LMinTracker | None = getattr(self, "_l_min_tracker", None)
        self.l_min_updates: int = getattr(self, "l_min_updates", 0)
        self._lanes = {"fast": 0, "fair": 0}
        self._cached: dict[str, int] = {}
        self._chunk_reorders = 0
        self._chunk_sit_outs = 0
        self._sat_failed: str | None = None
        self._token_load = 0
        self.last_state: dict[str, Any] = {}
        #: request id -> its Fairway lane and rank in the last plan while it waited
        self._placements: dict[str, tuple[str, int]] = {}
        #: request id -> the policy's decision when it was admitted (first scheduled): its
        #: Fairway ``lane`` and ``rank``, the ``queue`` it was in, and the TWP gate's
        #: ``window_tokens`` and ``slowdown`` then. Read (and popped) by the replica for its
        #: trace; bounded, the oldest dropped first.
        self.admissions: dict[str, dict[str, Any]] = {}

    def update_params(
        self, fairway: FairwayConfig | None = None, twp: TWPConfig | None = None
    ) -> None:
        """Live reconfiguration (between steps, on the engine's thread), keeping every
        request's state, unlike :meth:`configure`. New Fairway values apply to requests that
        arrive after (a request's patience is fixed at its arrival, as the paper has it); the
        TWP gate keeps its window and estimates (see :meth:`TWP.reconfigure`). Raises
        ``ValueError`` with nothing changed when the TWP values do not resolve."""
        if twp is not None and self.gate is not None and self.profile is not None:
            self.gate.reconfigure(twp, self.profile)
        update: dict[str, Any] = {}
        if twp is not None:
            update["twp"] = twp
        if fairway is not None:
            update["fairway"] = fairway
            policy: Any = self.prefill
            while policy is not None:  # Fairway itself, or inside the fair share
                if isinstance(getattr(policy, "config", None), FairwayConfig):
                    policy.config = fairway
                policy = getattr(policy, "inner", None)
        if update:
            self.pd_config = self.pd_config.model_copy(update=update)

    def calibrate_decode(self, l_min_s: float, restart: bool = True) -> dict[str, float] | None:
        """Set the profile's decode ``l_min`` to ``l_min_s``, the single-stream inter-token
        latency measured on this very engine as it serves (its step loop, its process), with
        ``alpha`` scaled alike; with ``restart`` the TWP gate restarts its estimate there
        (``sigma`` = 1).

        The shipped profiles are measured on a bare engine: inside a serving replica the
        engine shares its process with the replica's event loop and NIXL polling, so a lone
        stream's ITL is higher (2.7 ms bare, 6-8 ms in the replica for the ``test`` model
        on 2 cores), and TWP would read the difference as overload and hold its window at the
        floor. Returns ``{"l_min_s", "profile_l_min_s"}``, or ``None`` without a TWP gate."""
        if self.gate is None or self.profile is None or not l_min_s > 0:
            return None
        old = self.profile.decode
        self.profile = self.profile.model_copy(update={"decode": old.rescaled(l_min_s)})
        self.gate.set_l_min(self.profile, restart=restart)
        self.l_min_updates += 1
        return {"l_min_s": l_min_s, "profile_l_min_s": old.l_min_s}

    def track_l_min(self, window: int = 256, every: int = 64) -> None:
        """From now on, re-estimate ``l_min`` from this engine's own single-stream steps
        (:class:`~controllers.decode.twp.LMinTracker`): a lone stream's ITL drifts with what
        else the node runs, and a stale ``l_min`` pins TWP's window at its floor."""
        self._l_min_tracker = LMinTracker(window=window, every=every)

    # ----- the step hooks ------------------------------------------------------------
    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        t0 = self.clock()
        n_waiting = len(self.waiting)
        held = self._before_schedule(t0) if n_waiting else []
        turns: _Turns | None = None
        try:
            if self._chunk_turns is not None:
                turns = self._take_turns(held)
            t1 = self.clock()
            out = super().schedule(*args, **kwargs)  # type: ignore[misc]
        finally:
            if held:
                self.waiting.extend(held)
            if turns is not None:
                self._end_turns(turns)
        t2 = self.clock()
        if out.scheduled_new_reqs:
            self._record_admissions(out.scheduled_new_reqs, n_waiting)
        if turns is not None and turns.first is not None:
            # the request a sit-out was for, not scheduled (vLLM skipped it for a reason the
            # check cannot see): no sit-out for it again, so a step cannot idle on it twice
            self._sat_failed = None if turns.first in out.num_scheduled_tokens else turns.first
        if self._observe_step is not None:
            # Stateful prefill policies (k-LPM's turns, fairway_xstep's allowances) learn
            # what this step actually scheduled, as the simulator tells them.
            self._observe_step(list(out.num_scheduled_tokens.items()), self.wall_clock())
        load_after = self._running_token_load() if self.gate is not None else 0
        decode = 0
        for rid in out.num_scheduled_tokens:
            r = self.requests.get(rid)
            if r is not None and r.num_output_tokens > 0 and not r.is_prefill_chunk:
                decode += 1
        # A queue: with async scheduling, schedule() of step t+1 runs before the
        # update_from_output() of step t.
        self._pending.append(
            {
                "t0": t0,
                "hook_s": t1 - t0,
                "schedule_s": t2 - t0,
                "waiting": n_waiting,
                "tokens": out.total_num_scheduled_tokens,
                "decode": decode,
                "ids": list(out.num_scheduled_tokens),
                "load_after": load_after,
                "window": self.gate.window_tokens if self.gate is not None else 0.0,
            }
        )
        return out

    def update_from_output(self, scheduler_output: Any, model_output: Any) -> Any:
        pend = self._pending.popleft() if self._pending else None
        stepped = (
            [self.requests[rid] for rid in pend["ids"] if rid in self.requests] if pend else []
        )
        outputs = super().update_from_output(scheduler_output, model_output)  # type: ignore[misc]
        if pend is None:
            return outputs
        t = self.clock()
        step_s = t - pend["t0"]
        if self.extra_step_latency is not None:
            step_s += self.extra_step_latency(len(self.running))
        if self._step_budget is not None and not pend["decode"]:
            self._step_budget = step_budget.observe(self._step_budget, pend["tokens"], step_s)
            self.max_num_scheduled_tokens = self._step_budget.tokens
        itl = 0.0
        if pend["decode"]:
            if self._last_decode_end is not None:
                itl = t - self._last_decode_end
                if self.extra_step_latency is not None:
                    itl += self.extra_step_latency(len(self.running))
            else:
                itl = step_s
            self._last_decode_end = t
            self._last_itl = itl
            lone = pend["decode"] == 1 and not pend["waiting"] and len(self.running) == 1
            if lone and self._l_min_tracker is not None:
                fresh = self._l_min_tracker.add(itl)
                if fresh is not None:
                    self.calibrate_decode(fresh, restart=False)
        if not self.has_unfinished_requests():  # type: ignore[attr-defined]
            self._last_decode_end = None  # an idle gap follows: not an ITL
        finished = [r for r in stepped if r.is_finished()]
        if self.gate is not None:
            self.gate.observe(
                DecodeObservation(
                    step_index=self._step,
                    step_latency_s=itl,
                    free_blocks=self.kv_cache_manager.block_pool.get_num_free_blocks(),
                    total_blocks=self._total_blocks(),
                    queue_depth=len(self.waiting),
                    batch_size=len(self.running),
                    finished=tuple(
                        FinishedRequest(self._tenant(r), r.num_output_tokens) for r in finished
                    ),
                )
            )
        for r in finished:
            self._info.pop(r.request_id, None)
        rec = StepRecord(
            step=self._step,
            waiting=pend["waiting"],
            running=len(self.running),
            hook_s=pend["hook_s"],
            schedule_s=pend["schedule_s"],
            step_s=step_s,
            scheduled_tokens=pend["tokens"],
            decode_requests=pend["decode"],
            itl_s=itl,
            window_tokens=pend["window"],
            token_load=self._token_load,
            token_load_after=pend["load_after"],
        )
        self.records.append(rec)
        self._step += 1
        if self._step % self.pd_config.publish_every_steps == 0:
            self._publish(rec)
        return outputs

    def _record_admissions(self, new_reqs: list[Any], queue: int) -> None:
        gate = self.gate
        for nr in new_reqs:
            lane, rank = self._placements.pop(nr.req_id, (None, None))
            self.admissions[nr.req_id] = {
                "lane": lane,
                "rank": rank,
                "queue": queue,
                "window_tokens": gate.window_tokens if gate is not None else None,
                "slowdown": gate.state.sigma if gate is not None else None,
            }
        while len(self.admissions) > 4096:  # nobody read them: keep the newest
            self.admissions.pop(next(iter(self.admissions)))

    # ----- phases --------------------------------------------------------------------
    def _before_schedule(self, now_mono: float) -> list[Any]:
        if self.prefill is None and self.gate is None:
            return []
        waiting = list(self.waiting)
        cached = self._collect(waiting, now_mono)
        ordered = self._order(waiting, cached) if self.prefill is not None else waiting
        admitted, held = self._gate(ordered, cached, now_mono)
        if self.prefill is not None or held:
            self.waiting.clear()
            self.waiting.extend(admitted)
        return held

    def _take_turns(self, held: list[Any]) -> _Turns | None:
        """The fair share's turns for running prefill chunks, for this ``schedule()`` call
        (:func:`controllers.prefill.fairshare.chunk_turns`): ``self.running`` becomes the
        other running requests (decodes) in their order, then the chunks that go, in turn
        order; the chunks of tenants whose turn is later leave it, the waiting requests that
        sit out join ``held``, and vLLM's admission limit is lowered by the chunks taken out
        (they keep their slots). A tenant sits out only if the first waiting request left
        can start (:meth:`_can_start`), else the step would idle. Returns what
        :meth:`_end_turns` needs, or None when nothing moved."""
        assert self._chunk_turns is not None
        chunks = [r for r in self.running if r.is_prefill_chunk]
        if not chunks:
            self._chunk_turns([], [])  # the share learns that no prompt is running now
            return None
        ids = [r.request_id for r in chunks]
        turns = self._chunk_turns(ids, [r.request_id for r in self.waiting])
        sat = [r for r in chunks if r.request_id in turns.sit_out]
        first = self._can_start(turns.sit_out) if sat else None
        if sat and first is None:
            turns = self._chunk_turns(ids, [])  # the order only
            sat = []
        by_id = {r.request_id: r for r in chunks}
        before = list(self.running)
        now = [
            *(r for r in before if not r.is_prefill_chunk),
            *(by_id[rid] for rid in turns.order),
        ]
        if not sat and now == before:
            return None
        if sat:
            stay = [r for r in self.waiting if r.request_id not in turns.sit_out]
            held.extend(r for r in self.waiting if r.request_id in turns.sit_out)
            self.waiting.clear()
            self.waiting.extend(stay)
            self.max_num_active_reqs -= len(sat)
            self._chunk_sit_outs += 1
        else:
            self._chunk_reorders += 1
        self.running = now
        return _Turns(before, sat, first)

    def _can_start(self, sit_out: frozenset[str]) -> str | None:
        """The id of the first waiting request outside ``sit_out`` if it can start this
        step, else None: a free slot (vLLM's count: running and paused streams against
        ``max_num_active_reqs``, the chunks that sit out still holding theirs), free KV blocks
        (evictable cached ones count) for its first chunk, and not the request a sit-out
        was already taken for without vLLM scheduling it."""
        if len(self.running) + self.num_waiting_for_streaming_input >= self.max_num_active_reqs:
            return None
        first = next((r for r in self.waiting if r.request_id not in sit_out), None)
        if first is None or first.request_id == self._sat_failed:
            return None
        cached = self._cached.get(first.request_id, 0)
        tokens = min(self.max_num_scheduled_tokens, max(1, first.num_tokens - cached))
        blocks = -(-tokens // self.block_size)
        if self.kv_cache_manager.block_pool.get_num_free_blocks() < blocks:
            return None
        return str(first.request_id)

    def _end_turns(self, turns: _Turns) -> None:
        """``running`` after ``schedule()``: vLLM's order from before the turns (less what
        it preempted), the chunks that sat out among them, then what it admitted; vLLM's
        admission limit as it was."""
        now = self.running
        kept = {id(r) for r in now}
        sat_ids = {id(r) for r in turns.sat}
        was = {id(r) for r in turns.before}
        self.running = [
            *(r for r in turns.before if id(r) in kept or id(r) in sat_ids),
            *(r for r in now if id(r) not in was),
        ]
        self.max_num_active_reqs += len(turns.sat)

    def _collect(self, waiting: list[Any], now_mono: float) -> dict[str, int]:
        info = self._info
        for r in waiting:
            if r.request_id not in info:
                info[r.request_id] = _ReqInfo(
                    arrival_s=r.arrival_time,
                    patience_s=(
                        patience_s(r.num_prompt_tokens, self.profile, self.pd_config.fairway)
                        if self.profile is not None
                        else self.pd_config.fairway.slo_floor_s
                    ),
                    first_step=self._step,
                    first_seen_s=now_mono,
                    tenant=r.cache_salt or "",
                )
        cached = self.probe.refresh(waiting)
        self._cached = cached
        return cached

    def _order(self, waiting: list[Any], cached: dict[str, int]) -> list[Any]:
        assert self.prefill is not None
        info = self._info
        views = []
        for r in waiting:
            rid = r.request_id
            c = cached.get(rid, 0)
            unc = max(0, r.num_tokens - c)
            i = info[rid]
            views.append(
                PrefillRequestView(
                    request_id=rid,
                    arrival_s=i.arrival_s,
                    prompt_tokens=r.num_prompt_tokens,
                    patience_s=i.patience_s,
                    cached_tokens=c,
                    uncached_tokens=unc,
                    tenant=i.tenant,
                )
            )
        queue = PrefillQueueView.of(views)
        now = self.wall_clock()
        if self._order_with_lanes is not None:  # a laned policy (Fairway): report its lanes
            ids, lanes = self._order_with_lanes(queue, now)
            fast = lanes.count("fast")
            self._lanes = {"fast": fast, "fair": len(lanes) - fast}
            self._placements = {
                rid: (lane, rank) for rank, (rid, lane) in enumerate(zip(ids, lanes, strict=False))
            }
        else:
            ids = self.prefill.order(queue, now)
        by_id = {r.request_id: r for r in waiting}
        return [by_id[rid] for rid in ids]

    def _gate(
        self, ordered: list[Any], cached: dict[str, int], now_mono: float
    ) -> tuple[list[Any], list[Any]]:
        gate = self.gate
        if gate is None:
            return ordered, []
        info = self._info
        bs = self.block_size
        candidates = [r for r in ordered if r.status == RequestStatus.WAITING]
        waiting_views = []
        for r in candidates:
            i = info[r.request_id]
            c = cached.get(r.request_id, 0)
            i.l_hat = gate.expected_output(i.tenant, r.max_tokens)
            waiting_views.append(
                WaitingRequestView(
                    request_id=r.request_id,
                    tenant=i.tenant,
                    prompt_tokens=r.num_prompt_tokens,
                    prompt_blocks=max(0, math.ceil(r.num_tokens / bs) - c // bs),
                    max_tokens=r.max_tokens,
                    l_hat=i.l_hat,
                    wait_steps=self._step - i.first_step,
                    wait_s=max(0.0, now_mono - i.first_seen_s),
                )
            )
        running_views = []
        # admitted requests still pulling their KV (PD decode) are committed load: without
        # them, every request arriving while others' KV is in flight sees an empty window
        for r in self._committed(ordered):
            i2 = info.get(r.request_id)
            lh = i2.l_hat if i2 is not None and i2.l_hat else gate.expected_output("", r.max_tokens)
            running_views.append(
                RunningRequestView(r.request_id, r.num_output_tokens, lh, self._tenant(r))
            )
        view = DecodeView.of(
            waiting_views,
            running_views,
            EngineView(
                free_blocks=self.kv_cache_manager.block_pool.get_num_free_blocks(),
                total_blocks=self._total_blocks(),
                last_step_latency_s=self._last_itl,
                queue_depth=len(ordered),
                step_index=self._step,
            ),
        )
        self._token_load = view.token_load
        decisions: list[AdmissionDecision] = gate.admit(view)
        admit_ids = [d.request_id for d in decisions if d.admitted]
        ok = set(admit_ids)
        by_id = {r.request_id: r for r in candidates}
        if self.prefill is not None:
            admitted = [r for r in ordered if r.request_id in ok or r.request_id not in by_id]
        else:  # TWP's own order among the admitted, ungated ones (blocked states) first
            admitted = [r for r in ordered if r.request_id not in by_id]
            admitted += [by_id[rid] for rid in admit_ids]
        held = [r for r in ordered if r.request_id in by_id and r.request_id not in ok]
        return admitted, held

    # ----- helpers -------------------------------------------------------------------
    def _committed(self, waiting: Any) -> list[Any]:
        """The requests the gate has let in: vLLM's running ones, and the admitted ones
        still waiting for their remote KV (``WAITING_FOR_REMOTE_KVS``)."""
        held_kv = list(getattr(self, "kv_holding_waiting", ()))  # vLLM keeps them apart
        loading = [
            r for r in [*waiting, *held_kv] if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        ]
        return [*self.running, *loading]

    def _running_token_load(self) -> int:
        """``K = sum max(1, L_hat - generated)`` over the committed requests (tokens): vLLM's
        running ones and those admitted and pulling their KV."""
        k = 0
        for r in self._committed(self.waiting):
            i = self._info.get(r.request_id)
            lh = i.l_hat if i is not None and i.l_hat else r.max_tokens
            k += max(1, lh - r.num_output_tokens)
        return k

    def _total_blocks(self) -> int:
        return max(1, int(self.kv_cache_manager.block_pool.num_gpu_blocks) - 1)

    @staticmethod
    def _tenant(r: Any) -> str:
        return r.cache_salt or ""

    def state(self) -> dict[str, Any]:
        """The snapshot that goes on the channel (also useful in-process)."""
        gate = self.gate
        return {
            "engine": self.pd_config.engine_name,
            "step": self._step,
            "ts": self.wall_clock(),
            "prefill_policy": self.prefill.name if self.prefill is not None else None,
            "gate": gate.name if gate is not None else None,
            "waiting": len(self.waiting),
            "running": len(self.running),
            # the load report's figure, with the cached prefixes the last step's probe found
            "queued_uncached_tokens": owed_prompt_tokens(self.waiting, self.running, self._cached),
            "lanes": dict(self._lanes),
            "window_tokens": gate.window_tokens if gate is not None else None,
            "token_load": self._token_load if gate is not None else None,
            "slowdown": gate.state.sigma if gate is not None else None,
            "itl_s": self._last_itl,
            "kv_usage": float(self.kv_cache_manager.usage),
            "free_blocks": int(self.kv_cache_manager.block_pool.get_num_free_blocks()),
            "step_tokens": int(self.max_num_scheduled_tokens),
            "chunk_reorders": self._chunk_reorders,
            "chunk_sit_outs": self._chunk_sit_outs,
        }

    def _publish(self, rec: StepRecord) -> None:
        st = self.state()
        st.update(
            hook_ms=rec.hook_s * 1e3, schedule_ms=rec.schedule_s * 1e3, step_ms=rec.step_s * 1e3
        )
        self.last_state = st
        if self._publisher is not None:
            self._publisher.publish(st)

    def records_as_dicts(self) -> list[dict[str, Any]]:
        return [asdict(r) for r in self.records]

    def shutdown(self) -> None:
        if self._publisher is not None:
            self._publisher.close()
            self._publisher = None
        super().shutdown()  # type: ignore[misc]


class FairwayScheduler(PdserveSchedulerMixin, Scheduler):
    """Orders ``waiting`` with a prefill policy each step (default: Fairway)."""

    default_prefill_policy = "fairway"


class TWPScheduler(PdserveSchedulerMixin, Scheduler):
    """Gates admission with Token Window Pacing; vLLM's arrival order otherwise."""

    default_gate = "twp"


class ColocatedScheduler(PdserveSchedulerMixin, Scheduler):
    """Colocated mode: Fairway orders, TWP gates, vLLM chunks prefill (threshold ``C``)."""

    default_prefill_policy = "fairway"
    default_gate = "twp"
    colocated = True


class AsyncFairwayScheduler(PdserveSchedulerMixin, AsyncScheduler):
    """``FairwayScheduler`` over vLLM's ``AsyncScheduler`` (GPU, async scheduling; untested here)."""

    default_prefill_policy = "fairway"


class AsyncTWPScheduler(PdserveSchedulerMixin, AsyncScheduler):
    """``TWPScheduler`` over vLLM's ``AsyncScheduler`` (GPU, async scheduling; untested here)."""

    default_gate = "twp"


class AsyncColocatedScheduler(PdserveSchedulerMixin, AsyncScheduler):
    """``ColocatedScheduler`` over ``AsyncScheduler`` (GPU, async scheduling; untested here)."""

    default_prefill_policy = "fairway"
    default_gate = "twp"
    colocated = True


from engines.scheduler_names import scheduler_cls_name  # noqa: E402,F401  (re-export)

# the replica's calls reach a plug-in in vLLM's engine-core process through this method
# (also a vLLM general plugin; registered here too so the plug-ins never go without it)
register_engine_rpc()
