"""Dispatch halves of the decode baselines: which container of the pool gets a request.

A dispatcher sees a frozen :class:`ContainerView` per container and returns an index,
or ``None`` to hold the request at the router (re-asked later by the mechanism). It is
called once per arrival (and per retry of a held request).

- :class:`LeastLoadedDispatch` (FCFS, Priority, DynamicBatch): the warm container with
  the fewest outstanding requests; when even that one holds ``scale_out_load`` or more
  (default B0) and a cold container exists, start the cold one (a conventional
  serverless autoscaler's concurrency target, e.g. Knative's).
- :class:`RoundRobinDispatch`: containers in rotation regardless of warmth or load
  (the paper's "route requests to containers in rotation").
- :class:`LocalityAwareDispatch` (ServerlessLLM-like): as least-loaded, but a cold start
  goes to the container whose checkpoint is in its fastest local tier (the pool models
  this as ``fast_loading``: 1 s instead of 10 s) and while a container is starting,
  requests beyond the warm ones' target wait for it instead of waking yet another.
  Live migration is not modelled.
- :class:`HeadroomDispatch` (TWP): :func:`controllers.routing.choose_decode`, the one
  decode choice the live router uses too: among the live containers whose published TWP
  headroom ``H_t - K_t`` fits the request's ``L_hat`` and prompt blocks, the one with the
  fewest outstanding requests (ties: larger headroom share, then free KV), unless even that one holds
  ``scale_out_load`` or more and a cold container exists (then the cold one: the same
  provisioning rule as :class:`LeastLoadedDispatch`, since the paper's token window "does
  not interact with container provisioning"); else a cold container; else
  ``hold`` at the router (pd: before the prefill starts) or, colocated, the live
  container with the most headroom. Headroom filters, the outstanding count balances:
  ranking by headroom alone was tried and balanced worse, because ``K_t`` counts a request
  that outlived its ``L_hat`` as one token (``r_i = max(1, ...)``), so containers holding
  long requests look emptier than they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from controllers.routing import DecodeReplicaLoad, RouteRequest, choose_decode


@dataclass(frozen=True, slots=True)
class ContainerView:
    """One container of the pool as a dispatcher sees it.

    ``warm``: model loaded and serving; ``starting``: cold start in progress.
    ``outstanding``: requests dispatched there and not finished. ``window_tokens`` /
    ``token_load``: the TWP headroom it publishes (0 when it runs no TWP).
    """

    index: int
    warm: bool
    starting: bool
    outstanding: int
    free_blocks: int
    total_blocks: int
    window_tokens: float = 0.0
    token_load: float = 0.0


@dataclass(frozen=True, slots=True)
class DispatchRequest:
    request_id: str
    prompt_tokens: int
    prompt_blocks: int
    l_hat: int


class LeastLoadedDispatch:
    name = "least_loaded"

    def __init__(self, scale_out_load: int = 8) -> None:
        self.scale_out_load = scale_out_load

    def choose(self, req: DispatchRequest, containers: Sequence[ContainerView]) -> int | None:
        live = [c for c in containers if c.warm or c.starting]
        cold = [c for c in containers if not (c.warm or c.starting)]
        if live:
            best = min(live, key=lambda c: (c.outstanding, c.index))
            if best.outstanding < self.scale_out_load or not cold:
                return best.index
        return cold[0].index if cold else None


class LocalityAwareDispatch(LeastLoadedDispatch):
    name = "locality_aware"

    def choose(self, req: DispatchRequest, containers: Sequence[ContainerView]) -> int | None:
        warm = [c for c in containers if c.warm]
        starting = [c for c in containers if c.starting]
        cold = [c for c in containers if not (c.warm or c.starting)]
        if warm:
            best = min(warm, key=lambda c: (c.outstanding, c.index))
            if best.outstanding < self.scale_out_load:
                return best.index
        if starting:
            s = min(starting, key=lambda c: (c.outstanding, c.index))
            if s.outstanding < self.scale_out_load or not cold:
                return s.index
        if cold:
            return cold[0].index
        live = warm + starting
        return min(live, key=lambda c: (c.outstanding, c.index)).index if live else None


class RoundRobinDispatch:
    name = "round_robin"

    def __init__(self) -> None:
        self.next = 0

    def choose(self, req: DispatchRequest, containers: Sequence[ContainerView]) -> int | None:
        if not containers:
            return None
        i = self.next % len(containers)
        self.next += 1
        return containers[i].index


class HeadroomDispatch:
    name = "headroom"

    def __init__(
        self, hold_when_full: bool, kv_guard_blocks: int = 0, scale_out_load: int = 8
    ) -> None:
        self.hold_when_full = hold_when_full
        self.scale_out_load = scale_out_load
        self.kv_guard_blocks = kv_guard_blocks
        self.held = 0

    def choose(self, req: DispatchRequest, containers: Sequence[ContainerView]) -> int | None:
        live = [c for c in containers if c.warm or c.starting]
        cold = [c for c in containers if not (c.warm or c.starting)]
        need = max(1, req.l_hat)

        def room(c: ContainerView) -> float:
            return c.window_tokens - c.token_load

        loads = [
            DecodeReplicaLoad(
                replica_id=f"{c.index:08d}",
                window_tokens=c.window_tokens,
                token_load=c.token_load,
                free_kv_blocks=c.free_blocks,
                total_kv_blocks=c.total_blocks,
                outstanding=c.outstanding,
            )
            for c in live
        ]
        rreq = RouteRequest(req.request_id, req.prompt_tokens, need, req.prompt_blocks)
        chosen, _ = choose_decode(rreq, loads, self.kv_guard_blocks)
        if chosen is not None:
            best = next(c for c in live if c.index == int(chosen))
            if best.outstanding < self.scale_out_load or not cold:
                return best.index
        if cold:
            return cold[0].index
        if self.hold_when_full or not live:
            self.held += 1
            return None
        return max(live, key=lambda c: (room(c), -c.index)).index
