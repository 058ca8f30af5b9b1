"""Routing scores: pick a prefill replica (cache hit against load) and a decode replica.

The llm-d shape: **filter**, then **weighted scores in [0, 1]**, then **pick**.

Inputs are frozen snapshots; the router's own bookkeeping (tokens it has sent that a
replica has not yet reported, fallback counters) lives in :class:`RouterState`, passed in
and returned (docs/design.md, shape 3). The mechanism (Ray Serve router, cluster simulator)
owns the index look-up and its time-out, and passes ``matches=None`` when the index was
unavailable or too slow: that is the named, counted ``index_unavailable`` fallback.

Prefill scores, per candidate replica ``i`` for a request of ``P`` prompt tokens:

- ``prefix_score_i = matched_tokens_i / P``: the share of the prompt it holds.
- ``load_score_i = (min_j E_j) / E_i`` with ``E_i = backlog_i + (P - matched_tokens_i)``:
  the expected uncached work ahead of and including this request on ``i``, where
  ``backlog_i = queued_uncached_tokens_i + inflight_tokens_i + running_i * running_weight``.
  It is 1 for the replica that would finish this prefill first and falls as others lag.
- ``score_i = w_prefix * prefix_score_i + w_load * load_score_i``; the highest wins,
  ties go to the lower backlog, then to the replica id (deterministic).

Hot-spot guard (``hotspot``): a replica whose backlog exceeds
``hotspot_factor * (mean backlog of the other candidates) + hotspot_slack_tokens`` is
filtered out while any other candidate remains, so a replica holding a popular prefix
cannot take all the load (the failure Dynamo #737/#7836 and llm-d's prefix-only runs hit).
Counted when it changes the pick. The mean is over the *other* replicas: with the mean over
all of them, two replicas could never trip it (``2 * (a + b) / 2 >= a``).

Conditional disaggregation: when the uncached part at the best prefill replica is below
``local_prefill_threshold_tokens``, the request is prefilled on its decode replica
(``mode="decode_local"``), as llm-d and Dynamo do.

Decode choice (:func:`choose_decode`, the one implementation: the live decode router and the
decode simulator's TWP dispatch both call it): TWP headroom **filters**, the outstanding
count **balances**. Among decode replicas with headroom for the request's expected output
(``window - token_load >= r``) and free KV blocks for the request's prompt blocks plus the
guard, the one with the fewest outstanding requests wins; ties go to the larger headroom
share, then the larger free-KV share, then the replica id. Ranking by headroom alone was
tried in the decode simulator and balanced worse: ``K`` counts a request that outlived its
``L_hat`` as one token (``r_i = max(1, ...)``), so replicas holding long requests look
emptier than they are. When none has room the decision is ``hold``: the caller waits (or,
where waiting is not possible, falls back and counts it).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import islice
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

RoutingName = Literal["round_robin", "least_loaded", "prefix_only", "prefix_load"]
ROUTING_NAMES: tuple[str, ...] = ("round_robin", "least_loaded", "prefix_only", "prefix_load")


class RoutingConfig(BaseModel):
    """Parameters of the prefill/decode routing policy."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    policy: RoutingName = Field(default="prefix_load", description="Prefill routing policy.")
    prefix_weight: float = Field(default=1.0, ge=0, description="Weight of prefix_score.")
    load_weight: float = Field(default=1.0, ge=0, description="Weight of load_score.")
    running_weight_tokens: int = Field(
        default=0,
        ge=0,
        description=(
            "Tokens of backlog counted per running request (0: the load report's queued tokens"
            " already include running prompts' chunks not yet computed)."
        ),
    )
    hotspot_factor: float = Field(
        default=2.0,
        gt=1,
        description="Backlog above factor x the other replicas' mean (+ slack) is a hot spot.",
    )
    hotspot_slack_tokens: int = Field(
        default=4096, ge=0, description="Absolute slack in the hot-spot test (tokens)."
    )
    hotspot_guard: bool = Field(
        default=True, description="Filter hot spots out (prefix_load only)."
    )
    local_prefill_threshold_tokens: int = Field(
        default=0,
        ge=0,
        description="Prefill on the decode replica when fewer uncached tokens remain (0: always disaggregate).",
    )
    decode_kv_guard_blocks: int = Field(
        default=0,
        ge=0,
        description="Free KV blocks a decode replica must keep beyond the prompt's.",
    )
    inflight_ttl_s: float = Field(
        default=30.0,
        gt=0,
        description="In-flight tokens a replica never acknowledges expire after this long (s).",
    )


@dataclass(frozen=True, slots=True)
class PrefillReplicaLoad:
    """A prefill replica's last reported load (tokens, counts) and health."""

    replica_id: str
    queued_uncached_tokens: int = 0
    running: int = 0
    healthy: bool = True
    reported_at_s: float = 0.0


@dataclass(frozen=True, slots=True)
class DecodeReplicaLoad:
    """A decode replica's TWP headroom, KV state and outstanding requests (running, waiting
    and dispatched but not yet reported), as it last published them."""

    replica_id: str
    window_tokens: float
    token_load: float
    free_kv_blocks: int
    total_kv_blocks: int
    healthy: bool = True
    outstanding: int = 0


@dataclass(frozen=True, slots=True)
class RouteRequest:
    request_id: str
    prompt_tokens: int
    expected_output_tokens: int = 1
    prompt_blocks: int = 0


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """Where one request goes, and why (``reason`` names the rule or fallback that decided)."""

    prefill_replica: str | None
    decode_replica: str | None
    mode: Literal["pd", "decode_local", "hold", "prefill_only"]
    reason: str
    matched_tokens: int = 0
    score: float = 0.0


@dataclass(frozen=True)
class RouterState:
    """The router's own bookkeeping, passed in and returned."""

    rr_next: int = 0
    # replica -> ((dispatched_at_s, tokens), ...) sent but not yet covered by a report
    inflight: Mapping[str, tuple[tuple[float, int], ...]] = field(default_factory=dict)
    counters: Mapping[str, int] = field(default_factory=dict)

    def inflight_tokens(
        self, replica_id: str, now: float | None = None, ttl_s: float | None = None
    ) -> int:
        """Tokens sent to ``replica_id`` not yet covered by a report; with ``now`` and
        ``ttl_s``, entries older than the TTL no longer count (a replica that stopped
        reporting does not look busy forever)."""
        entries = self.inflight.get(replica_id, ())
        if now is None or ttl_s is None:
            return sum(t for _, t in entries)
        return sum(t for at, t in entries if now - at < ttl_s)

    def count(self, name: str, by: int = 1) -> RouterState:
        c = dict(self.counters)
        c[name] = c.get(name, 0) + by
        return replace(self, counters=c)


def on_dispatch(state: RouterState, replica_id: str, tokens: int, now: float) -> RouterState:
    """Record ``tokens`` of uncached prefill sent to ``replica_id`` at ``now``."""
    inflight = dict(state.inflight)
    inflight[replica_id] = (*inflight.get(replica_id, ()), (now, tokens))
    return replace(state, inflight=inflight)


def on_report(
    state: RouterState, replica_id: str, reported_at_s: float, now: float, ttl_s: float
) -> RouterState:
    """A load report taken at ``reported_at_s`` covers everything dispatched before it."""
    entries = tuple(
        (t, n)
        for t, n in state.inflight.get(replica_id, ())
        if t > reported_at_s and now - t < ttl_s
    )
    inflight = dict(state.inflight)
    inflight[replica_id] = entries
    return replace(state, inflight=inflight)


def _backlog(
    r: PrefillReplicaLoad, state: RouterState, cfg: RoutingConfig, now: float | None
) -> int:
    return (
        r.queued_uncached_tokens
        + state.inflight_tokens(r.replica_id, now, cfg.inflight_ttl_s)
        + r.running * cfg.running_weight_tokens
    )


def choose_prefill(
    state: RouterState,
    req: RouteRequest,
    replicas: Sequence[PrefillReplicaLoad],
    matches: Mapping[str, int] | None,
    cfg: RoutingConfig,
    now: float | None = None,
) -> tuple[RouterState, str | None, str, int, float]:
    """Pick a prefill replica. ``matches`` maps replica -> cached prefix tokens it holds;
    ``None`` means the index was unavailable (load-only fallback, counted).

    Returns ``(state, replica_id or None, reason, matched_tokens, score)``.
    """
    cands = sorted((r for r in replicas if r.healthy), key=lambda r: r.replica_id)
    if not cands:
        return state.count("no_prefill_replica"), None, "no_prefill_replica", 0, 0.0
    policy = cfg.policy
    if policy == "round_robin":
        r = cands[state.rr_next % len(cands)]
        return replace(state, rr_next=state.rr_next + 1), r.replica_id, "round_robin", 0, 0.0
    backlog = {r.replica_id: _backlog(r, state, cfg, now) for r in cands}
    if matches is None and policy in ("prefix_only", "prefix_load"):
        state = state.count("index_unavailable")
        policy = "least_loaded"
    m = matches or {}
    p = max(1, req.prompt_tokens)

    def matched(rid: str) -> int:
        return min(p, max(0, m.get(rid, 0)))

    if policy == "least_loaded":
        best = min(cands, key=lambda r: (backlog[r.replica_id], r.replica_id))
        reason = "least_loaded" if cfg.policy == "least_loaded" else "index_unavailable"
        return state, best.replica_id, reason, matched(best.replica_id), 0.0
    if policy == "prefix_only":
        best = min(
            cands, key=lambda r: (-matched(r.replica_id), backlog[r.replica_id], r.replica_id)
        )
        return state, best.replica_id, "prefix_only", matched(best.replica_id), 0.0

    # prefix_load: filter hot spots, score, pick.
    pool = cands
    reason = "prefix_load"
    if cfg.hotspot_guard and len(cands) > 1:
        total = sum(backlog.values())
        others = len(cands) - 1

        def hot(rid: str) -> bool:
            mean_others = (total - backlog[rid]) / others
            return backlog[rid] > cfg.hotspot_factor * mean_others + cfg.hotspot_slack_tokens

        cool = [r for r in cands if not hot(r.replica_id)]
        if cool and len(cool) < len(cands):
            pool = cool
    expected = {r.replica_id: backlog[r.replica_id] + (p - matched(r.replica_id)) for r in pool}
    e_min = max(1, min(expected.values()))

    def score(rid: str) -> float:
        return cfg.prefix_weight * matched(rid) / p + cfg.load_weight * e_min / max(
            1, expected[rid]
        )

    best = min(pool, key=lambda r: (-score(r.replica_id), backlog[r.replica_id], r.replica_id))
    if pool is not cands:
        unguarded = max(cands, key=lambda r: matched(r.replica_id))
        if best.replica_id != unguarded.replica_id and matched(unguarded.replica_id) > matched(
            best.replica_id
        ):
            state = state.count("hotspot")
            reason = "hotspot"
    return state, best.replica_id, reason, matched(best.replica_id), score(best.replica_id)


def choose_decode(
    req: RouteRequest, replicas: Sequence[DecodeReplicaLoad], kv_guard_blocks: int = 0
) -> tuple[str | None, str]:
    """Pick a decode replica (see the module docstring's decode rule).

    Returns ``(replica_id, "decode_headroom")``, or ``(None, "no_decode_headroom")`` when no
    healthy replica has room for ``req``'s expected output and prompt blocks.
    """
    ranked = rank_decode(req, replicas, kv_guard_blocks)
    if not ranked:
        return None, "no_decode_headroom"
    return ranked[0], "decode_headroom"


def rank_decode(
    req: RouteRequest, replicas: Sequence[DecodeReplicaLoad], kv_guard_blocks: int = 0
) -> list[str]:
    """Every decode replica that fits ``req``, best first (the rule of :func:`choose_decode`)."""
    r_i = max(1, req.expected_output_tokens)
    fits = [
        d
        for d in replicas
        if d.healthy
        and d.window_tokens - d.token_load >= r_i
        and d.free_kv_blocks >= req.prompt_blocks + kv_guard_blocks
    ]

    def key(d: DecodeReplicaLoad) -> tuple[int, float, float, str]:
        headroom = (d.window_tokens - d.token_load) / max(1.0, d.window_tokens)
        free = d.free_kv_blocks / max(1, d.total_kv_blocks)
        return (d.outstanding, -headroom, -free, d.replica_id)

    return [d.replica_id for d in sorted(fits, key=key)]


def prefill_on_decode(
    uncached_tokens: int, threshold: int, needs_prefill_output: bool = False
) -> bool:
    """Conditional disaggregation (``routing.local_prefill_threshold_tokens``; 0 turns it off):
    a prompt whose uncached part is shorter than ``threshold`` is prefilled on its decode
    replica (no prefill call, no KV transfer; mode ``decode_local``): for a short prompt the
    hand-off costs more than the compute, as llm-d and Dynamo decide. A request that needs
    the prefill's own output (``echo``, prompt logprobs: ``needs_prefill_output``) always goes
    through a prefill replica.

    The one rule for both callers, who count the uncached part as each can: the cluster
    simulator (:func:`route`) at the best prefill replica; the live ingress
    (:mod:`deployments.ingress.route`) counts the whole prompt, because what matters there is
    the decode replica's own cache, which does not feed the prefix index (so a long prompt
    that is nearly fully cached on the decode replica is not sent decode-local)."""
    return threshold > 0 and not needs_prefill_output and uncached_tokens < threshold


def route(
    state: RouterState,
    req: RouteRequest,
    prefill: Sequence[PrefillReplicaLoad],
    decode: Sequence[DecodeReplicaLoad] | None,
    matches: Mapping[str, int] | None,
    cfg: RoutingConfig,
    now: float | None = None,
) -> tuple[RouterState, RouteDecision]:
    """One routing decision at ``now`` (the router's clock; None: in-flight tokens never
    expire). ``decode=None`` routes prefill only (prefill-node simulations)."""
    d_id: str | None = None
    if decode is not None:
        d_id, d_reason = choose_decode(req, decode, cfg.decode_kv_guard_blocks)
        if d_id is None:
            return state.count("hold"), RouteDecision(None, None, "hold", d_reason)
    state, p_id, reason, matched, score = choose_prefill(state, req, prefill, matches, cfg, now)
    uncached = req.prompt_tokens - matched
    if d_id is not None and prefill_on_decode(uncached, cfg.local_prefill_threshold_tokens):
        return state.count("decode_local"), RouteDecision(
            None, d_id, "decode_local", "short_uncached", matched, score
        )
    if p_id is None:
        return state, RouteDecision(None, d_id, "hold", reason)
    return state, RouteDecision(
        p_id, d_id, "pd" if d_id else "prefill_only", reason, matched, score
    )


class InflightPrefixes:
    """Prompt blocks the router has sent to each prefill replica that the replica has not yet
    computed, so they count as that replica's prefix before its KV events say so.

    Without it, requests that share a new prefix and arrive while the first of them still
    waits in a prefill queue find nothing in the index and are spread by load, and every
    replica computes the prefix cold (measured on the live app: under a backlog, prefix_load's
    cached-token ratio fell to round-robin's). An entry lives from the routing decision until
    ``grace_s`` after the call completes (by then the replica's KV events have reached the
    index) or, for a call whose completion never arrives, ``ttl_s`` after it was added.

    The router's own mutable bookkeeping (one per router; not thread-safe: the router holds
    its lock). Block hashes are any ints the caller uses consistently.
    """

    def __init__(self, grace_s: float = 2.0, ttl_s: float = 300.0) -> None:
        self.grace_s = grace_s
        self.ttl_s = ttl_s
        self._held: dict[str, dict[int, int]] = {}  # replica -> block -> requests holding it
        self._entries: dict[str, tuple[str, tuple[int, ...], float]] = {}  # key -> entry
        self._expires: dict[str, float] = {}  # key -> when its blocks stop counting

    def add(self, key: str, replica: str, hashes: Sequence[int], now: float) -> None:
        """Request ``key``'s prompt blocks are on their way to ``replica``."""
        if key in self._entries or not hashes:
            return
        held = self._held.setdefault(replica, {})
        for h in hashes:
            held[h] = held.get(h, 0) + 1
        self._entries[key] = (replica, tuple(hashes), now)
        self._expires[key] = now + self.ttl_s

    def done(self, key: str, now: float) -> None:
        """Request ``key`` completed: its blocks count ``grace_s`` longer."""
        if key in self._entries:
            self._expires[key] = min(self._expires[key], now + self.grace_s)

    def expire(self, now: float) -> None:
        for key in [k for k, t in self._expires.items() if t <= now]:
            replica, hashes, _ = self._entries.pop(key)
            del self._expires[key]
            held = self._held[replica]
            for h in hashes:
                n = held[h] - 1
                if n:
                    held[h] = n
                else:
                    del held[h]

    def leading(self, replica: str, hashes: Sequence[int]) -> int:
        """How many leading blocks of ``hashes`` are on their way to ``replica``."""
        return leading_blocks(self._held.get(replica) or (), hashes)

    def blocks(self, replica: str, limit: int) -> list[int]:
        """Up to ``limit`` of the blocks held for ``replica``, the longest-held first."""
        return list(islice(self._held.get(replica) or (), max(0, limit)))

    def __len__(self) -> int:
        return len(self._entries)


def leading_blocks(held: Collection[int], hashes: Sequence[int]) -> int:
    """How many leading blocks of ``hashes`` are in ``held`` (block hashes chain their
    parent's, so a block's hash in ``held`` stands for its whole prefix)."""
    n = 0
    for h in hashes:
        if h not in held:
            break
        n += 1
    return n
