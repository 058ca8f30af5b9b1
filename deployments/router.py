"""Serve request routers for the engine deployments, driven by :mod:`controllers.routing`.

Serve builds one router per deployment handle in the calling process (the ingress), and calls
``choose_replicas(candidates, pending_request)`` for every request; the candidates are the
replicas Serve knows to be running, each with the load report its ``record_routing_stats``
returned (polled every ``routing.stats_period_s``). The routers here are thin: they turn those
reports and the request's :class:`~deployments.protocol.RouteHint` into the pure policy's
inputs, call it, and return ``[[chosen], [the rest]]`` (Serve sends to the first rank unless
that replica's queue is full, then to the next).

- :class:`PrefillRouter`: :func:`controllers.routing.choose_prefill` (``prefix_load`` by
  default; ``round_robin``, ``least_loaded``, ``prefix_only``). The index's replica ids are
  Serve's replica ids. Tokens the router has sent that a replica has not yet reported are kept
  in a :class:`controllers.routing.RouterState` (retired by a later report, by completion, or
  by their TTL), and the prompt blocks it has sent that the index does not show yet count as
  that replica's prefix (:class:`controllers.routing.InflightPrefixes`), so requests sharing
  a new prefix follow the first one instead of being spread while it waits in a queue.
- :class:`DecodeRouter`: :func:`controllers.routing.rank_decode` (TWP headroom filters, the
  outstanding count balances). When no replica has headroom it still sends (to the least
  loaded) and counts ``no_decode_headroom``: the decode engine's own TWP gate holds it, and
  the prefill's KV is already pinned.
- :class:`ServeDefaultRouter`: Serve's power-of-two router unchanged (the plain baseline),
  with the same bookkeeping.

Warm first (serverless, with ``autoscaling.enabled``): a replica whose report does not say
``warm`` (just started; the ingress sends it a warm-up request through each of its pairs
first) gets clients' requests only when no warm replica is a candidate, counted as
``cold_replica_skipped``; pinned calls (the warm-up) reach it. Off for a fixed replica count:
a report polled before a replica's first request still says cold, and with two ingress
replicas that sent the holder of a prefix's next request elsewhere. The first decision on a
call also notes how long it waited at the handle (no replica to take it: a cold start) for
the ingress's latency breakdown (:class:`~deployments.router_registry.HandleWaits`).

Every router keeps its deployment's :class:`~deployments.router_registry.ReplicaDirectory`
(replica id -> last report) up to date, which is how the ingress learns where each prefill
replica publishes its KV events, and counts what it routed and every fallback by name
(:func:`~deployments.router_registry.router_stats`). The router runs on its own event loop
(Serve's default), so what it shares with the ingress is guarded by locks. That shared state
lives in :mod:`deployments.router_registry`, not here: Serve pickles a custom router's module
by value, so this module's globals in the router are a copy, not the ingress's.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any

from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from controllers.routing import (
    DecodeReplicaLoad,
    InflightPrefixes,
    PrefillReplicaLoad,
    RouteRequest,
    RouterState,
    choose_prefill,
    leading_blocks,
    on_dispatch,
    on_report,
    rank_decode,
)
from deployments.config import AppRoutingConfig
from deployments.protocol import EngineRequest
from deployments.router_registry import (
    counters_for,
    directory,
    handle_waits,
    routing_held,
    routing_of,
)

log = logging.getLogger(__name__)

#: A report retires in-flight tokens dispatched at least this long before it was taken: a
#: request in transit to the replica when the report was taken is not in it yet.
REPORT_MARGIN_S = 0.05
#: Most decisions and in-flight entries kept (oldest dropped first): a bound for calls whose
#: completion never arrives.
MAX_TRACKED = 100_000
#: Window of a decode replica without a TWP gate (no pacing limit).
UNPACED_WINDOW = 1e12


def engine_request(pending: PendingRequest | None) -> EngineRequest | None:
    """The :class:`EngineRequest` a call carries (``prefill``/``decode``), else ``None``."""
    if pending is None:
        return None
    for a in pending.args or ():
        if isinstance(a, EngineRequest):
            return a
    return None


class _Bookkeeping:
    """The directory, the counters and in-flight accounting every router here shares."""

    role: str = ""
    _deployment_id: Any

    def _init_bookkeeping(self, routing: dict[str, Any], warm_first: bool = False) -> None:
        self.cfg = AppRoutingConfig.model_validate(routing)
        self.warm_first = warm_first
        self._cfg_version = 0
        dep = self._deployment_id
        self.directory = directory(dep.app_name, dep.name)
        self.waits = handle_waits(dep.app_name, dep.name)
        self.counters = counters_for(dep.app_name, dep.name, self.cfg.policy)
        self._lock = threading.Lock()
        self.state = RouterState()
        self._seen_ts: dict[str, float] = {}
        # internal request id -> the replica the policy chose (a retry keeps the choice)
        self._decided: dict[str, str] = {}
        # internal request id -> (replica, dispatched_at, tokens) while in flight
        self._inflight: dict[str, tuple[str, float, int]] = {}
        self.pending = InflightPrefixes(ttl_s=self.cfg.inflight_ttl_s)
        with self.counters.lock:
            self.counters.tables[id(self)] = self._tables

    def _tables(self) -> dict[str, int]:
        """Entries in this router's tables (expired in-flight prefixes dropped first)."""
        with self._lock:
            self.pending.expire(time.time())
            return {
                "decided": len(self._decided),
                "inflight": len(self._inflight),
                "inflight_reports": sum(len(v) for v in self.state.inflight.values()),
                "inflight_prefixes": len(self.pending),
                "replicas_seen": len(self._seen_ts),
                # the deployment's placements not yet taken by the ingress (shared by this
                # process's routers of the deployment: HandleWaits)
                "placements": len(self.waits),
            }

    # -- Serve's hooks -----------------------------------------------------------------------
    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)  # type: ignore[misc]
        self.directory.update({r.replica_id.unique_id: dict(r.routing_stats) for r in replicas})

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)  # type: ignore[misc]
        self.directory.remove(replica_id.unique_id)
        self.counters.count("replica_died")

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """A call finished (any outcome): its tokens are no longer in flight."""
        with self._lock:
            self.pending.done(internal_request_id, time.time())
            entry = self._inflight.pop(internal_request_id, None)
            self._decided.pop(internal_request_id, None)
            if entry is None:
                return
            rid, at, tokens = entry
            kept = list(self.state.inflight.get(rid, ()))
            if (at, tokens) in kept:
                kept.remove((at, tokens))
                inflight = dict(self.state.inflight)
                inflight[rid] = tuple(kept)
                self.state = RouterState(self.state.rr_next, inflight, self.state.counters)

    # -- helpers -------------------------------------------------------------------------------
    def _follow_live_config(self) -> None:
        """Take the routing parameters the ingress's ``user_config`` last published (no
        restart: the next decision uses them)."""
        version, routing = routing_of(self._deployment_id.app_name)
        if version != self._cfg_version:
            self.cfg = AppRoutingConfig.model_validate(routing)
            self._cfg_version = version
            self.counters.policy = self.cfg.policy
            self.pending.ttl_s = self.cfg.inflight_ttl_s

    def _serving(self, candidates: list[RunningReplica]) -> list[RunningReplica]:
        """The candidates whose last report does not say ``wedged`` (their engine's step loop
        has stalled; Serve's health check replaces them soon). When every one is wedged, all
        of them: a call then waits on a replica rather than failing at once."""
        ok = [r for r in candidates if not r.routing_stats.get("wedged")]
        if len(ok) < len(candidates):
            self.counters.count("wedged_replica_skipped")
        return ok or candidates

    def _avoiding(
        self, candidates: list[RunningReplica], req: EngineRequest | None
    ) -> list[RunningReplica]:
        """The candidates without the replicas ``req``'s hint says to avoid (a migrated
        stream's lost ones), unless none would be left."""
        avoid = req.route.avoid if req is not None and req.route is not None else ()
        if not avoid:
            return candidates
        ok = [r for r in candidates if r.replica_id.unique_id not in avoid]
        if ok and len(ok) < len(candidates):
            self.counters.count("lost_replica_avoided")
        return ok or candidates

    def _warm_first(self, candidates: list[RunningReplica]) -> list[RunningReplica]:
        """The candidates whose report says ``warm`` (an engine call has completed there:
        the ingress warms a new replica's pairs first) when there are any, else all: a
        replica that has just started is sent clients' requests once it is warm, unless it
        is the only one (scale from zero)."""
        if not self.warm_first:
            return candidates
        # a replica without a report yet (just started) is not counted warm
        warm = [r for r in candidates if r.routing_stats.get("warm") is True]
        if warm and len(warm) < len(candidates):
            self.counters.count("cold_replica_skipped")
            return warm
        return candidates

    def _place(self, req: EngineRequest, pending: PendingRequest) -> bool:
        """Note this first decision on ``req`` and how long it waited at the handle before it
        (no replica to place it on: a cold start), for the ingress's latency breakdown.
        ``False`` when the ingress withdrew the call first (its client left while it waited:
        the router then offers no replica, and Serve drops the cancelled call), or while
        routing is held on purpose (:func:`~deployments.router_registry.hold_routing`)."""
        dep = self._deployment_id
        if routing_held(dep.app_name, dep.name):  # fault injection: as if no replica could
            self.counters.count("held_on_purpose")
        elif self.waits.place(req.request_id, time.time() - pending.created_at):
            return True
        else:
            self.counters.count("withdrawn_call_skipped")
        # Serve asks again at once unless told to back off: a loop that never yields
        pending.routing_context.should_backoff = True
        return False

    def _absorb_reports(self, candidates: list[RunningReplica], now: float) -> None:
        """Retire in-flight entries that a newer report from their replica covers."""
        ttl = self.cfg.inflight_ttl_s
        for r in candidates:
            rid = r.replica_id.unique_id
            ts = float(r.routing_stats.get("ts", 0.0) or 0.0)
            if ts > self._seen_ts.get(rid, 0.0):
                self._seen_ts[rid] = ts
                cutoff = ts - REPORT_MARGIN_S
                self.state = on_report(self.state, rid, cutoff, now, ttl)
                gone = [k for k, (x, at, _) in self._inflight.items() if x == rid and at <= cutoff]
                for k in gone:
                    del self._inflight[k]

    def _dispatch(self, key: str, rid: str, tokens: int, now: float) -> None:
        """Record the policy's choice as sent (Serve sends to the first rank unless that
        replica's queue is full, which ``max_ongoing_requests`` makes rare)."""
        self.state = on_dispatch(self.state, rid, tokens, now)
        self._inflight[key] = (rid, now, tokens)
        for book in (self._decided, self._inflight):  # calls that never completed (cancelled)
            while len(book) > MAX_TRACKED:
                del book[next(iter(book))]
        self.counters.add_routed(rid)

    def _ranked(
        self, candidates: list[RunningReplica], order: list[str]
    ) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidates}
        first = [by_id[order[0]]] if order and order[0] in by_id else []
        rest = [by_id[i] for i in order[1:] if i in by_id]
        rest += [r for i, r in by_id.items() if i not in order]
        return [x for x in (first, rest) if x]


class _PolicyRouter(_Bookkeeping, RequestRouter):
    """The shared mechanism of the policy routers: an engine call is decided once (a retry in
    Serve's backoff loop keeps the choice), recorded as dispatched, and ranked for Serve;
    other calls (ready, stats) go to Serve's queue-length choice."""

    def initialize_state(
        self,
        routing: dict[str, Any] | None = None,
        block_size: int = 128,
        warm_first: bool = False,
        **_: Any,
    ) -> None:
        self._init_bookkeeping(routing or {}, warm_first)
        self.block_size = block_size

    def _routes(self, req: EngineRequest) -> bool:
        """Whether this router decides ``req`` (else Serve does)."""
        return True

    def _decide(
        self, key: str, req: EngineRequest, candidates: list[RunningReplica], now: float
    ) -> tuple[list[str], int]:
        """The replica ids best first, and the tokens the first one is sent."""
        raise NotImplementedError

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        self._follow_live_config()
        candidate_replicas = self._serving(candidate_replicas)
        req = engine_request(pending_request)
        candidate_replicas = self._avoiding(candidate_replicas, req)
        if req is None or pending_request is None or not self._routes(req):
            return [candidate_replicas]  # ready/stats calls: Serve picks by queue length
        key = pending_request.metadata.internal_request_id
        with self._lock:
            prior = self._decided.get(key)
            if prior is None and not self._place(req, pending_request):
                return []
            if prior is not None and prior in {r.replica_id.unique_id for r in candidate_replicas}:
                return self._ranked(candidate_replicas, [prior])
            now = time.time()
            self._absorb_reports(candidate_replicas, now)
            order, tokens = self._decide(key, req, candidate_replicas, now)
            if order:
                self._decided[key] = order[0]
                self._dispatch(key, order[0], tokens, now)
        return self._ranked(candidate_replicas, order)


class PrefillRouter(_PolicyRouter):
    """Routes prefill calls by :func:`controllers.routing.choose_prefill`.

    A replica's prefix is what the index says it holds, or more: the blocks this router has
    sent it that the index does not show yet (``self.pending``), and the blocks of the
    prefill calls the replica itself reports holding (``queued_blocks``: queued or running
    there, whichever ingress sent them), counted ``queued_prefix`` when they raise its match.
    With several ingress replicas each router sees only its own sends; without the reports,
    a new prefix's followers that reach another ingress while the first waits in a prefill
    queue found it nowhere and were spread by load (measured live in the matrix's
    ``cache_pressure`` cell, docs/design/matrix_39_causes.md)."""

    role = "prefill"

    def initialize_state(self, *args: Any, **kwargs: Any) -> None:
        super().initialize_state(*args, **kwargs)
        #: replica id -> (its last report, the blocks it lists): a set built once a report
        #: (not keyed by the report's ``ts``, the engine's last load reading, which stands
        #: still while a long step runs and calls keep arriving)
        self._queued: dict[str, tuple[dict[str, Any], frozenset[int]]] = {}

    def _queued_blocks(self, r: RunningReplica) -> frozenset[int]:
        """The prompt blocks of the prefill calls ``r`` last reported holding."""
        rid = r.replica_id.unique_id
        stats = r.routing_stats
        seen = self._queued.get(rid)
        if seen is None or seen[0] is not stats:
            seen = (stats, frozenset(stats.get("queued_blocks") or ()))
            self._queued[rid] = seen
        return seen[1]

    def _routes(self, req: EngineRequest) -> bool:
        return req.route is not None

    def _decide(
        self, key: str, req: EngineRequest, candidates: list[RunningReplica], now: float
    ) -> tuple[list[str], int]:
        hint = req.route
        assert hint is not None
        ids = {r.replica_id.unique_id for r in candidates}
        p = max(1, hint.prompt_tokens)
        matches = hint.matches
        if hint.pin is not None:
            if hint.pin in ids:
                return [hint.pin], p
            self.counters.count("pinned_replica_gone")
        candidates = self._warm_first(candidates)
        ids = {r.replica_id.unique_id for r in candidates}
        if matches is not None:
            gone = {r: n for r, n in matches.items() if r not in ids}
            matches = {r: n for r, n in matches.items() if r in ids}
            if gone and max(gone.values()) > max(matches.values(), default=0):
                self.counters.count("matched_replica_gone")
            # blocks sent to a replica and not yet indexed count as its prefix: by this
            # router, or by any (the replica's own report of the calls it holds)
            self.pending.expire(now)
            for r in candidates:
                rid = r.replica_id.unique_id
                sent = self.pending.leading(rid, hint.block_hashes) * self.block_size
                held = leading_blocks(self._queued_blocks(r), hint.block_hashes)
                held *= self.block_size
                if held > max(sent, matches.get(rid, 0)):
                    self.counters.count("queued_prefix")
                if max(sent, held) > matches.get(rid, 0):
                    matches[rid] = min(max(sent, held), p)
        loads = [
            PrefillReplicaLoad(
                replica_id=r.replica_id.unique_id,
                queued_uncached_tokens=int(r.routing_stats.get("queued_uncached_tokens", 0)),
                running=int(r.routing_stats.get("running", 0)),
                reported_at_s=float(r.routing_stats.get("ts", 0.0) or 0.0),
            )
            for r in candidates
        ]
        before = dict(self.state.counters)
        self.state, chosen, reason, _, _ = choose_prefill(
            self.state,
            RouteRequest(req.request_id, p, hint.expected_output_tokens),
            loads,
            matches,
            self.cfg,
            now,
        )
        for name, n in self.state.counters.items():
            if n > before.get(name, 0):
                self.counters.count(name, n - before.get(name, 0))
        if chosen is None:
            return [], 0
        m = matches or {}
        self.pending.add(key, chosen, hint.block_hashes, now)
        ttl = self.cfg.inflight_ttl_s
        rest = sorted(
            (i for i in ids if i != chosen),
            key=lambda i: (-m.get(i, 0), self.state.inflight_tokens(i, now, ttl), i),
        )
        log.debug("prefill %s -> %s (%s)", req.request_id, chosen, reason)
        return [chosen, *rest], p - min(p, m.get(chosen, 0))


class DecodeRouter(_PolicyRouter):
    """Routes decode calls by :func:`controllers.routing.rank_decode` (TWP headroom, KV)."""

    role = "decode"

    def _decide(
        self, key: str, req: EngineRequest, candidates: list[RunningReplica], now: float
    ) -> tuple[list[str], int]:
        ttl = self.cfg.inflight_ttl_s
        pin = req.route.pin if req.route is not None else None
        if pin is not None:  # the ingress's warm-up of one prefill -> decode pair
            if pin in {r.replica_id.unique_id for r in candidates}:
                return [pin], 1
            self.counters.count("pinned_replica_gone")
        candidates = self._warm_first(candidates)
        loads = []
        for r in candidates:
            s = r.routing_stats
            rid = r.replica_id.unique_id
            window = s.get("window_tokens")
            loads.append(
                DecodeReplicaLoad(
                    replica_id=rid,
                    window_tokens=UNPACED_WINDOW if window is None else float(window),
                    token_load=float(s.get("token_load") or 0.0),
                    free_kv_blocks=int(s.get("free_kv_blocks", 1 << 30)),
                    total_kv_blocks=int(s.get("total_kv_blocks", 1 << 30)),
                    # a decode call is dispatched as 1 in-flight "token": a count of calls
                    outstanding=int(s.get("running", 0))
                    + int(s.get("waiting", 0))
                    + self.state.inflight_tokens(rid, now, ttl),
                )
            )
        n = len(req.prompt_token_ids)
        expected = min(req.sampling.max_tokens, self.cfg.expected_output_tokens)
        rreq = RouteRequest(req.request_id, n, expected, math.ceil(n / max(1, self.block_size)))
        order = rank_decode(rreq, loads, self.cfg.decode_kv_guard_blocks)
        if not order:
            self.counters.count("no_decode_headroom")
            order = [
                d.replica_id for d in sorted(loads, key=lambda d: (d.outstanding, d.replica_id))
            ]
        return order, 1


class ServeDefaultRouter(_Bookkeeping, PowerOfTwoChoicesRequestRouter):
    """Serve's power-of-two router, unchanged (the plain baseline), with the directory and
    counters kept; ``routed`` is counted when a call completes (the choice is Serve's)."""

    def initialize_state(
        self, routing: dict[str, Any] | None = None, warm_first: bool = False, **_: Any
    ) -> None:
        self._init_bookkeeping(routing or {}, warm_first)
        self._engine_calls: set[str] = set()

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        req = engine_request(pending_request)
        if req is not None:
            assert pending_request is not None
            with self._lock:
                key = pending_request.metadata.internal_request_id
                if key not in self._engine_calls and not self._place(req, pending_request):
                    return []
                self._engine_calls.add(key)
            candidate_replicas = self._warm_first(self._avoiding(candidate_replicas, req))
        out: list[list[RunningReplica]] = await super().choose_replicas(
            candidate_replicas, pending_request
        )
        # Serve's choice draws from its own replica set: take the wedged out afterwards
        serving = {r.replica_id for r in self._serving(candidate_replicas)}
        kept = [[r for r in rank if r.replica_id in serving] for rank in out]
        kept = [rank for rank in kept if rank]
        if kept:
            return kept
        return [[r for r in candidate_replicas if r.replica_id in serving]]

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        with self._lock:
            if internal_request_id not in self._engine_calls:
                return
            self._engine_calls.discard(internal_request_id)
        self.counters.add_routed(replica_id.unique_id)
