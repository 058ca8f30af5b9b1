"""The Serve routers over stand-in replicas (no cluster): the policy's choice reaches Serve as the
first rank, in-flight accounting covers the time between load reports, fallbacks are named and
counted, and the ingress's directory follows Serve's replica set."""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
from ray.serve._private.common import (
    DeploymentHandleSource,
    DeploymentID,
    ReplicaID,
    RequestMetadata,
)
from ray.serve._private.request_router.common import PendingRequest

from deployments.protocol import EngineRequest, RouteHint, Sampling
from deployments.router import DecodeRouter, PrefillRouter, ServeDefaultRouter
from deployments.router_registry import directory, router_stats

_apps = itertools.count()


@dataclass
class Replica:
    """Stands in for Serve's RunningReplica: an id and the last load report."""

    unique_id: str
    app: str
    deployment: str
    routing_stats: dict[str, Any] = field(default_factory=dict)
    max_ongoing_requests: int = 256
    multiplexed_model_ids: set[str] = field(default_factory=set)
    node_id: str = "node"
    availability_zone: str | None = None

    @property
    def replica_id(self) -> ReplicaID:
        return ReplicaID(self.unique_id, DeploymentID(self.deployment, self.app))


def make(cls: type, deployment: str, warm_first: bool = False, **routing: Any) -> Any:
    app = f"test-app-{next(_apps)}"
    r = cls(
        deployment_id=DeploymentID(deployment, app), handle_source=DeploymentHandleSource.UNKNOWN
    )
    r.initialize_state(routing={"policy": "prefix_load", **routing}, warm_first=warm_first)
    return r


_ids = itertools.count()


def pending(req: EngineRequest | None) -> PendingRequest:
    n = next(_ids)
    meta = RequestMetadata(request_id=f"r{n}", internal_request_id=f"i{n}")
    args = [req] if req is not None else []
    return PendingRequest(args=args, kwargs={}, metadata=meta, future=None)  # type: ignore[arg-type]


def prefill_req(
    prompt: int,
    matches: dict[str, int] | None,
    pin: str | None = None,
    hashes: tuple[int, ...] = (),
) -> Any:
    return EngineRequest(
        "x",
        tuple(range(prompt)),
        Sampling(max_tokens=8),
        route=RouteHint(prompt, matches, 8, pin, hashes),
    )


def choose(router: Any, cands: list[Replica], p: PendingRequest) -> list[list[str]]:
    ranks = asyncio.run(router.choose_replicas(cands, p))
    return [[r.unique_id for r in rank] for rank in ranks]


def replicas(router: Any, *ids: str, **stats: Any) -> list[Replica]:
    dep = router._deployment_id
    return [Replica(i, dep.app_name, dep.name, dict(stats)) for i in ids]


def test_the_replica_holding_the_prefix_is_the_first_rank() -> None:
    r = make(PrefillRouter, "prefill")
    cands = replicas(r, "a", "b")
    ranks = choose(r, cands, pending(prefill_req(1000, {"b": 896})))
    assert ranks == [["b"], ["a"]]
    # the same call retried (Serve's backoff loop) keeps the decision, counted once
    p = pending(prefill_req(1000, {"a": 896}))
    assert choose(r, cands, p)[0] == ["a"]
    assert choose(r, cands, p)[0] == ["a"]
    assert router_stats(r._deployment_id.app_name, "prefill")["routed"] == {"b": 1, "a": 1}


def test_inflight_tokens_spread_misses_until_a_report_covers_them() -> None:
    r = make(PrefillRouter, "prefill")
    cands = replicas(r, "a", "b", queued_uncached_tokens=0, ts=time.time() - 10)
    first = choose(r, cands, pending(prefill_req(2000, {})))[0][0]
    second = choose(r, cands, pending(prefill_req(2000, {})))[0][0]
    assert {first, second} == {"a", "b"}  # the first one's 2,000 tokens count until reported
    # a newer report from `first` that shows an empty queue retires its in-flight tokens
    for c in cands:
        c.routing_stats = {"queued_uncached_tokens": 0, "ts": time.time() + 1}
    third = choose(r, cands, pending(prefill_req(2000, {})))[0][0]
    fourth = choose(r, cands, pending(prefill_req(2000, {})))[0][0]
    assert {third, fourth} == {"a", "b"}


def test_a_new_prefix_follows_the_first_request_before_the_index_has_it() -> None:
    r = make(PrefillRouter, "prefill")
    cands = replicas(r, "a", "b")
    doc = tuple(range(100, 112))  # 12 blocks nobody has computed yet
    p1 = pending(prefill_req(1600, {}, hashes=doc))
    first = choose(r, cands, p1)[0][0]
    # the index still knows nothing; the blocks on their way to `first` count
    followers = [
        choose(r, cands, pending(prefill_req(1600, {}, hashes=doc)))[0][0] for _ in range(3)
    ]
    assert followers == [first] * 3
    # a different new document goes by load, to the other replica
    other = choose(r, cands, pending(prefill_req(1600, {}, hashes=tuple(range(500, 512)))))
    assert other[0] != [first]


def test_a_new_prefix_queued_at_a_replica_draws_its_followers_through_another_router() -> None:
    """Two ingress replicas: two routers. The first router sends a new document to a replica;
    the second router never saw that send, and the index has nothing yet. The replica's own
    report of the prefill calls it holds (``queued_blocks``) draws the follower to it even
    though it is the more loaded one, counted ``queued_prefix``; without the report the
    follower goes to the idle replica."""
    one = make(PrefillRouter, "prefill")
    doc = tuple(range(100, 112))  # 12 blocks nobody has computed yet
    ids = ("a", "b")
    first = choose(one, replicas(one, *ids), pending(prefill_req(1600, {}, hashes=doc)))[0][0]
    other = next(i for i in ids if i != first)
    now = time.time()

    def reports(two: Any, queued: tuple[int, ...]) -> list[Replica]:
        cands = replicas(two, *ids)
        for c in cands:
            held = c.unique_id == first
            c.routing_stats = {
                "queued_uncached_tokens": 1600 if held else 0,
                "ts": now,
                **({"queued_blocks": list(queued)} if held else {}),
            }
        return cands

    two = make(PrefillRouter, "prefill")  # another ingress's router, same app name aside
    follower = choose(two, reports(two, doc), pending(prefill_req(1600, {}, hashes=doc)))
    assert follower[0] == [first]
    assert router_stats(two._deployment_id.app_name, "prefill")["fallbacks"] == {"queued_prefix": 1}
    # the report lists other calls' blocks only: the follower goes by load
    three = make(PrefillRouter, "prefill")
    unrelated = tuple(range(900, 912))
    lone = choose(three, reports(three, unrelated), pending(prefill_req(1600, {}, hashes=doc)))
    assert lone[0] == [other]
    assert (
        "queued_prefix" not in router_stats(three._deployment_id.app_name, "prefill")["fallbacks"]
    )


def test_completion_retires_inflight_tokens() -> None:
    r = make(PrefillRouter, "prefill")
    cands = replicas(r, "a", "b")
    p1 = pending(prefill_req(2000, {}))
    first = choose(r, cands, p1)[0][0]
    r.on_request_completed(ReplicaID(first, r._deployment_id), p1.metadata.internal_request_id)
    # nothing in flight any more: the tie goes to the lower id again
    assert choose(r, cands, pending(prefill_req(2000, {})))[0][0] == "a" == first


def test_reported_queue_outweighs_a_small_hit() -> None:
    r = make(PrefillRouter, "prefill")
    a, b = replicas(r, "a", "b")
    a.routing_stats = {"queued_uncached_tokens": 50_000, "ts": time.time()}
    b.routing_stats = {"queued_uncached_tokens": 0, "ts": time.time()}
    assert choose(r, [a, b], pending(prefill_req(1024, {"a": 128})))[0] == ["b"]


def test_hotspot_guard_is_counted() -> None:
    r = make(PrefillRouter, "prefill", hotspot_slack_tokens=0, hotspot_factor=1.5)
    a, b = replicas(r, "a", "b")
    a.routing_stats = {"queued_uncached_tokens": 9000, "ts": time.time()}
    b.routing_stats = {"queued_uncached_tokens": 1000, "ts": time.time()}
    assert choose(r, [a, b], pending(prefill_req(4096, {"a": 3968})))[0] == ["b"]
    assert router_stats(r._deployment_id.app_name, "prefill")["fallbacks"]["hotspot"] == 1


def test_index_unavailable_and_gone_replicas_are_named_fallbacks() -> None:
    r = make(PrefillRouter, "prefill")
    cands = replicas(r, "a", "b")
    choose(r, cands, pending(prefill_req(1000, None)))  # the index gave no answer
    ranks = choose(r, cands, pending(prefill_req(1000, {"gone": 896, "b": 128})))
    assert ranks[0] == ["b"]  # the gone replica's entries are ignored
    choose(r, cands, pending(prefill_req(1000, {}, pin="gone")))
    assert choose(r, cands, pending(prefill_req(1000, {"b": 896}, pin="a")))[0] == ["a"]
    fb = router_stats(r._deployment_id.app_name, "prefill")["fallbacks"]
    assert fb == {"index_unavailable": 1, "matched_replica_gone": 1, "pinned_replica_gone": 1}


@pytest.mark.parametrize("policy", ["round_robin", "least_loaded", "prefix_only"])
def test_other_policies_are_selectable(policy: str) -> None:
    r = make(PrefillRouter, "prefill", policy=policy)
    cands = replicas(r, "a", "b")
    picks = [choose(r, cands, pending(prefill_req(1000, {"b": 896})))[0][0] for _ in range(4)]
    if policy == "round_robin":
        assert picks == ["a", "b", "a", "b"]
    elif policy == "prefix_only":
        assert picks == ["b", "b", "b", "b"]
    else:  # least_loaded ignores the hit; in flight: a 1,000 tokens, b 104 per request
        assert picks == ["a", "b", "b", "b"]
        misses = [choose(r, cands, pending(prefill_req(1000, {})))[0][0] for _ in range(2)]
        assert misses == ["b", "a"]  # b at 1,312 < a at 2,000, then a at 1,000 < b at 2,312


def test_calls_without_an_engine_request_go_to_serve() -> None:
    r = make(PrefillRouter, "prefill")
    cands = replicas(r, "a", "b")
    assert choose(r, cands, pending(None)) == [["a", "b"]]


def decode_req(prompt: int, max_tokens: int = 16) -> EngineRequest:
    return EngineRequest(
        "d", tuple(range(prompt)), Sampling(max_tokens=max_tokens), route=RouteHint(prompt)
    )


def test_decode_goes_where_twp_has_headroom_and_balances_outstanding() -> None:
    r = make(DecodeRouter, "decode", expected_output_tokens=64)
    a, b, c = replicas(r, "a", "b", "c")
    now = time.time()
    a.routing_stats = {"window_tokens": 100, "token_load": 95, "free_kv_blocks": 500, "ts": now}
    b.routing_stats = {"window_tokens": 400, "token_load": 100, "running": 3, "ts": now}
    c.routing_stats = {"window_tokens": 400, "token_load": 300, "running": 1, "ts": now}
    # a lacks headroom for 16 tokens; c has fewer outstanding than b
    assert choose(r, [a, b, c], pending(decode_req(300)))[0] == ["c"]
    # c's dispatched request counts as outstanding until reported: 2 vs b's 3
    assert choose(r, [a, b, c], pending(decode_req(300)))[0] == ["c"]
    assert choose(r, [a, b, c], pending(decode_req(300)))[0] in (["b"], ["c"])


def test_decode_without_headroom_anywhere_is_counted_not_held() -> None:
    r = make(DecodeRouter, "decode")
    a, b = replicas(r, "a", "b")
    a.routing_stats = {"window_tokens": 10, "token_load": 10, "running": 4}
    b.routing_stats = {"window_tokens": 10, "token_load": 10, "running": 2}
    assert choose(r, [a, b], pending(decode_req(100)))[0] == ["b"]
    fb = router_stats(r._deployment_id.app_name, "decode")["fallbacks"]
    assert fb == {"no_decode_headroom": 1}
    # not enough free KV for the prompt's blocks is no headroom either
    a.routing_stats = {"free_kv_blocks": 1, "total_kv_blocks": 100}
    b.routing_stats = {"free_kv_blocks": 50, "total_kv_blocks": 100}
    assert choose(r, [a, b], pending(decode_req(1000)))[0] == ["b"]


def update(router: Any, reps: list[Replica]) -> None:
    async def run() -> None:  # Serve calls it on the router's loop (it probes new replicas)
        router.update_replicas(reps)
        await asyncio.sleep(0)

    asyncio.run(run())


def test_directory_follows_serve_and_counts_deaths() -> None:
    r = make(PrefillRouter, "prefill")
    dep = r._deployment_id
    a, b = replicas(r, "a", "b")
    a.routing_stats = {"kv_events": "tcp://h:1"}
    update(r, [a, b])
    d = directory(dep.app_name, "prefill")
    assert d.snapshot() == {"a": {"kv_events": "tcp://h:1"}, "b": {}}
    v = d.version
    r.on_replica_actor_died(ReplicaID("a", dep))
    assert set(d.snapshot()) == {"b"} and d.version > v
    assert router_stats(dep.app_name, "prefill")["fallbacks"]["replica_died"] == 1


def test_serve_default_router_keeps_the_books() -> None:
    r = make(ServeDefaultRouter, "prefill", policy="serve_default")
    dep = r._deployment_id
    a, b = replicas(r, "a", "b")
    update(r, [a, b])
    p = pending(prefill_req(1000, {"a": 896}))
    ranks = choose(r, [a, b], p)
    assert sorted(sum(ranks, [])) == ["a", "b"]  # power of two: both, Serve picks the shorter
    r.on_request_completed(ReplicaID("b", dep), p.metadata.internal_request_id)
    books = router_stats(dep.app_name, "prefill")
    assert books["policy"] == "serve_default" and books["routed"] == {"b": 1}
    assert books["fallbacks"] == {} and books["tables"]["inflight"] == 0


@pytest.mark.parametrize("cls,deployment", [(PrefillRouter, "prefill"), (DecodeRouter, "decode")])
def test_a_wedged_replica_gets_nothing_while_another_serves(cls: type, deployment: str) -> None:
    """A replica whose report says ``wedged`` is left out of every rank, even when it holds
    the prompt's prefix; counted. When every replica is wedged, they are all candidates."""
    r = make(cls, deployment)
    a, b = replicas(r, "a", "b")
    a.routing_stats = {"wedged": True}
    req = prefill_req(1000, {"a": 896}) if deployment == "prefill" else decode_req(300)
    ranks = choose(r, [a, b], pending(req))
    assert "a" not in {i for rank in ranks for i in rank} and ranks[0] == ["b"]
    assert choose(r, [a, b], pending(None)) == [["b"]]  # other calls too
    assert (
        router_stats(r._deployment_id.app_name, deployment)["fallbacks"]["wedged_replica_skipped"]
        == 2
    )
    b.routing_stats = {"wedged": True}
    assert {i for rank in choose(r, [a, b], pending(None)) for i in rank} == {"a", "b"}


@pytest.mark.parametrize("cls", [DecodeRouter, ServeDefaultRouter])
def test_a_migrated_streams_lost_replica_is_avoided_while_another_can_serve(cls: type) -> None:
    """A decode call whose hint says to avoid a replica (a migration's lost one) never goes
    there while another replica can take it, even when that one is the policy's first
    choice; counted. When it is the only replica, the call still goes there."""
    r = make(cls, "decode", **({"policy": "serve_default"} if cls is ServeDefaultRouter else {}))
    a, b = replicas(r, "a", "b")
    a.routing_stats = {"window_tokens": 400, "token_load": 0, "running": 0}
    b.routing_stats = {"window_tokens": 400, "token_load": 300, "running": 5}
    update(r, [a, b])
    req = EngineRequest(
        "x", tuple(range(300)), Sampling(max_tokens=8), route=RouteHint(300, avoid=("a",))
    )
    ranks = choose(r, [a, b], pending(req))
    assert {i for rank in ranks for i in rank} == {"b"}
    fb = router_stats(r._deployment_id.app_name, "decode")["fallbacks"]
    assert fb.get("lost_replica_avoided") == 1
    assert {i for rank in choose(r, [a], pending(req)) for i in rank} == {"a"}


def test_serve_default_router_skips_a_wedged_replica() -> None:
    r = make(ServeDefaultRouter, "prefill", policy="serve_default")
    a, b = replicas(r, "a", "b")
    b.routing_stats = {"wedged": True}
    update(r, [a, b])
    ranks = choose(r, [a, b], pending(prefill_req(100, None)))
    assert {i for rank in ranks for i in rank} == {"a"}


def test_a_router_takes_live_routing_parameters_before_its_next_decision() -> None:
    """prefix_load sends a prompt to the replica holding its prefix; once round_robin is
    published for the app (the ingress's user_config), the next decisions alternate."""
    from deployments.router_registry import set_routing

    r = make(PrefillRouter, "prefill")
    cands = replicas(r, "a", "b")
    assert choose(r, cands, pending(prefill_req(1000, {"b": 896})))[0] == ["b"]
    set_routing(r._deployment_id.app_name, {"policy": "round_robin"})
    firsts = [choose(r, cands, pending(prefill_req(1000, {"b": 896})))[0][0] for _ in range(4)]
    assert sorted(firsts) == ["a", "a", "b", "b"]
    assert router_stats(r._deployment_id.app_name, "prefill")["policy"] == "round_robin"


def test_the_routers_tables_are_reported_and_empty_again_once_the_calls_complete() -> None:
    """The load test's leak check reads these sizes: every table entry a call adds goes
    when the call completes (in-flight prefixes after their grace, here 0 s)."""
    r = make(PrefillRouter, "prefill")
    r.pending.grace_s = 0.0
    cands = replicas(r, "a", "b")
    calls = [pending(prefill_req(1600, {}, hashes=(7000 + i, 7100 + i))) for i in range(3)]
    chosen = [choose(r, cands, p)[0][0] for p in calls]
    app = r._deployment_id.app_name
    busy = router_stats(app, "prefill")["tables"]
    assert busy["routers"] == 1
    assert busy["decided"] == busy["inflight"] == busy["inflight_reports"] == 3
    assert busy["inflight_prefixes"] == 3
    assert busy["placements"] == 1  # prefill_req's calls share one engine request id
    for p, rid in zip(calls, chosen, strict=True):
        r.on_request_completed(ReplicaID(rid, r._deployment_id), p.metadata.internal_request_id)
    r.waits.pop("x")  # the ingress takes a call's placement when it ends
    idle = router_stats(app, "prefill")["tables"]
    assert idle == {k: 0 for k in busy} | {"routers": 1}


def test_a_cold_replica_gets_clients_only_once_warm_but_takes_its_pinned_warm_up() -> None:
    from deployments.router_registry import handle_waits

    off = make(PrefillRouter, "prefill")  # a fixed replica count: no warm-first
    pair = [*replicas(off, "old", warm=True), *replicas(off, "new")]
    assert choose(off, pair, pending(prefill_req(1000, {"new": 896})))[0] == ["new"]
    r = make(PrefillRouter, "prefill", warm_first=True)
    old = replicas(r, "old", warm=True, ts=time.time())[0]
    new = replicas(r, "new", ts=time.time())[0]  # no report yet: not counted warm
    # the policy would pick the new one (it holds the prefix, and has no load) ...
    for _ in range(3):
        assert choose(r, [old, new], pending(prefill_req(1000, {"new": 896})))[0] == ["old"]
    assert (
        router_stats(r._deployment_id.app_name, "prefill")["fallbacks"]["cold_replica_skipped"] == 3
    )
    # ... but the ingress's pinned warm-up reaches it
    assert choose(r, [old, new], pending(prefill_req(256, None, pin="new")))[0] == ["new"]
    new.routing_stats = {"warm": True, "ts": time.time()}
    assert choose(r, [old, new], pending(prefill_req(1000, {"new": 896})))[0] == ["new"]
    # the only replica is taken warm or not (scale from zero)
    new.routing_stats = {"warm": False}
    assert choose(r, [new], pending(prefill_req(1000, {})))[0] == ["new"]
    # a call that waited at the handle (no replica) is noted for the ingress
    p = pending(EngineRequest("late", (1, 2), Sampling(max_tokens=1), route=RouteHint(2, {}, 1)))
    p.created_at -= 5.0
    choose(r, [old], p)
    waited = handle_waits(r._deployment_id.app_name, "prefill").pop("late")
    assert waited is not None and waited >= 5.0
    d = make(DecodeRouter, "decode", warm_first=True)
    dold = replicas(d, "dold", warm=True)[0]
    dnew = replicas(d, "dnew", warm=False)[0]
    dreq = EngineRequest("y", (1, 2, 3), Sampling(max_tokens=4))
    assert choose(d, [dnew, dold], pending(dreq))[0] == ["dold"]


def test_handle_waits_place_withdraw_and_pop_are_one_decision() -> None:
    """A call is either placed by a router or withdrawn by the ingress, never both: the
    first of the two wins, and a cold-start wait is reported only from MIN_S up."""
    from deployments.router_registry import HandleWaits

    w = HandleWaits()
    assert w.place("a", 3.0) is True
    assert w.withdraw("a") is False  # placed first: a decode engine has it
    assert w.pop("a") is None  # the withdrawal took its entry
    assert w.withdraw("b") is True  # never placed ...
    assert w.place("b", 0.0) is False  # ... and now it never will be
    assert w.place("c", 0.1) is True and w.pop("c") is None  # a routing decision, not a wait
    assert w.place("d", 2.0) is True and w.pop("d") == 2.0 and w.pop("d") is None
    assert len(w) == 0


@pytest.mark.parametrize("cls", [DecodeRouter, ServeDefaultRouter])
def test_a_withdrawn_or_held_call_gets_no_replica_and_serve_backs_off(cls: type) -> None:
    """A call the ingress withdrew (its client left while it waited at the handle) is offered
    no replica, with Serve told to back off (an empty answer without it is a loop that never
    yields); so is every call while routing is held on purpose, and a call first seen during
    the hold is placed once it ends."""
    from deployments.router_registry import handle_waits, hold_routing

    r = make(cls, "decode")
    app = r._deployment_id.app_name
    cands = replicas(r, "d1", "d2")
    waits = handle_waits(app, "decode")
    assert waits.withdraw("gone") is True
    p = pending(EngineRequest("gone", (1, 2), Sampling(max_tokens=2)))
    assert choose(r, cands, p) == []
    assert p.routing_context.should_backoff is True
    assert router_stats(app, "decode")["fallbacks"]["withdrawn_call_skipped"] == 1
    hold_routing(app, "decode", 60)
    try:
        q = pending(EngineRequest("later", (1, 2), Sampling(max_tokens=2)))
        assert choose(r, cands, q) == []
        assert router_stats(app, "decode")["fallbacks"]["held_on_purpose"] == 1
    finally:
        hold_routing(app, "decode", 0)
    assert choose(r, cands, q) != []  # the hold ended: placed
    assert waits.withdraw("later") is False
