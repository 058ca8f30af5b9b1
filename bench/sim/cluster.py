"""N simulated prefill replicas behind the router (simulated, not measured).

Each replica is a :class:`bench.sim.prefill.PrefillEngine` with its own queue policy and
its own block cache (``cache_blocks`` each). The router is :func:`controllers.routing.route`,
the same pure function the Ray Serve router calls, driven here by a discrete-event loop:

- The next event is the earliest of the next arrival and the earliest step start of a busy
  replica. Arrivals are routed at their arrival time; a replica that was idle starts its next
  step then. A request arriving while a replica is mid-step joins its queue for the next
  step (as in vLLM).
- Prefix matches are exact: for each replica, the cached prefix the request would get there
  now (:meth:`PrefillEngine.cached_tokens_for`), which is what a prefix index fed by the
  engines' KV events reports, without its propagation lag.
- Load reports are stale: every ``report_period_s`` the router refreshes each replica's
  queued uncached tokens and running count; between reports it counts the uncached tokens
  it has itself dispatched (in-flight tokens, :func:`controllers.routing.on_dispatch`).

Reported per run: TTFT STATS, ``hit_rate`` = cached prompt tokens / prompt tokens over
finished requests (cached at admission), ``imbalance`` = max over mean of per-replica work
(uncached prompt tokens computed), plus the router's fallback counters.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.report.stats import summarize
from bench.sim.prefill import (
    BlockCache,
    EngineConfig,
    FinishedRequest,
    PrefillEngine,
    SimRequest,
)
from controllers.config import FairwayConfig
from controllers.prefill import make_prefill_policy
from controllers.profile import EngineProfile
from controllers.routing import (
    PrefillReplicaLoad,
    RouteRequest,
    RouterState,
    RoutingConfig,
    on_dispatch,
    on_report,
    route,
)


@dataclass(frozen=True)
class ClusterRun:
    """One (routing, queue policy, replica count) run over a workload (simulated)."""

    routing: str
    policy: str
    replicas: int
    finished: list[FinishedRequest]
    unfinished: int
    work_per_replica: list[int]
    counters: dict[str, int] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        prompt = sum(f.prompt_tokens for f in self.finished)
        cached = sum(f.cached_tokens for f in self.finished)
        mean_work = sum(self.work_per_replica) / max(1, len(self.work_per_replica))
        return {
            "routing": self.routing,
            "policy": self.policy,
            "replicas": self.replicas,
            "ttft": summarize(f.ttft_s for f in self.finished),
            "hit_rate": cached / prompt if prompt else 0.0,
            "imbalance": max(self.work_per_replica) / mean_work if mean_work > 0 else 1.0,
            "unfinished": self.unfinished,
            "counters": dict(self.counters),
        }


def simulate_cluster(
    requests: Sequence[SimRequest],
    replicas: int,
    routing: str,
    policy: str,
    profile: EngineProfile,
    cache_blocks: int,
    *,
    config: EngineConfig | None = None,
    routing_config: RoutingConfig | None = None,
    fairway_config: FairwayConfig | None = None,
    report_period_s: float = 0.5,
    warm: Sequence[Sequence[int]] = (),
    horizon_s: float | None = None,
    on_event: Callable[[], None] | None = None,
) -> ClusterRun:
    """Route ``requests`` over ``replicas`` engines until all finish (or the horizon passes).

    ``warm`` chains are cached on every replica at t = 0 (a shared system prompt, say).
    """
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    if report_period_s <= 0:
        raise ValueError(f"report_period_s must be > 0, got {report_period_s}")
    fw = fairway_config or FairwayConfig()
    # model_validate, not model_copy: the routing name must be validated like any config field.
    rcfg = RoutingConfig.model_validate(
        {**(routing_config or RoutingConfig()).model_dump(), "policy": routing}
    )
    engines: list[PrefillEngine] = []
    for _ in range(replicas):
        cache = BlockCache(cache_blocks)
        for chain in warm:
            cache.warm(chain)
        engines.append(
            PrefillEngine(make_prefill_policy(policy, profile, fw), profile, cache, config, fw)
        )
    ids = [f"p{j}" for j in range(replicas)]
    clock = [0.0] * replicas  # when each replica may start its next step
    work = [0] * replicas
    reqs = sorted(requests, key=lambda r: r.arrival_s)
    last = reqs[-1].arrival_s if reqs else 0.0
    horizon = horizon_s if horizon_s is not None else 20.0 * last + 600.0
    state = RouterState()
    loads = [PrefillReplicaLoad(i) for i in ids]
    next_report = 0.0
    finished: list[FinishedRequest] = []
    i, n = 0, len(reqs)
    while True:
        busy = [j for j in range(replicas) if engines[j].has_work()]
        t_step = min((clock[j] for j in busy), default=math.inf)
        t_arr = reqs[i].arrival_s if i < n else math.inf
        if t_step == math.inf and t_arr == math.inf:
            break
        if min(t_step, t_arr) >= horizon:
            break
        if t_arr <= t_step:
            now = t_arr
            if now >= next_report:
                loads = [
                    PrefillReplicaLoad(
                        ids[j], e.queued_uncached_tokens(), e.running_count, True, now
                    )
                    for j, e in enumerate(engines)
                ]
                for rid in ids:
                    state = on_report(state, rid, now, now, rcfg.inflight_ttl_s)
                next_report = now + report_period_s
            r = reqs[i]
            i += 1
            matches = {ids[j]: e.cached_tokens_for(r) for j, e in enumerate(engines)}
            state, dec = route(
                state, RouteRequest(r.request_id, r.prompt_tokens), loads, None, matches, rcfg, now
            )
            assert dec.prefill_replica is not None  # every replica is healthy here
            j = ids.index(dec.prefill_replica)
            if not engines[j].has_work():
                clock[j] = max(clock[j], now)
            engines[j].submit(r)
            state = on_dispatch(state, ids[j], r.prompt_tokens - matches[ids[j]], now)
        else:
            j = min(busy, key=lambda k: (clock[k], k))
            res = engines[j].step(clock[j])
            for f in res.finished:
                work[j] += f.prompt_tokens - f.cached_tokens
            finished.extend(res.finished)
            clock[j] = res.end_s
        if on_event is not None:
            on_event()
    return ClusterRun(
        routing,
        policy,
        replicas,
        finished,
        n - len(finished),
        work,
        dict(state.counters),
    )
