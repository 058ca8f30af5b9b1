"""Routing policy: scores, fallbacks, hot-spot guard, decode choice, conditional PD."""

from __future__ import annotations

import pytest

from controllers.routing import (
    DecodeReplicaLoad,
    PrefillReplicaLoad,
    RouteRequest,
    RouterState,
    RoutingConfig,
    choose_prefill,
    on_dispatch,
    on_report,
    route,
)

REPLICAS = [PrefillReplicaLoad(f"p{i}") for i in range(4)]


def _pick(policy: str, matches, loads=REPLICAS, state=None, **kw):  # type: ignore[no-untyped-def]
    cfg = RoutingConfig(policy=policy, **kw)
    st, rid, reason, matched, _ = choose_prefill(
        state or RouterState(), RouteRequest("r", 4000), loads, matches, cfg
    )
    return st, rid, reason, matched


def test_prefix_load_prefers_the_replica_holding_the_prefix_when_idle() -> None:
    _, rid, reason, matched = _pick("prefix_load", {"p2": 3072})
    assert (rid, reason, matched) == ("p2", "prefix_load", 3072)


def test_prefix_load_leaves_a_busy_holder_when_others_finish_sooner() -> None:
    loads = [PrefillReplicaLoad("p0", queued_uncached_tokens=20000), PrefillReplicaLoad("p1")]
    # p0 holds 1,024 of 4,000 tokens but has 20,000 queued: p1 finishes this prefill first.
    _, rid, _, _ = _pick("prefix_load", {"p0": 1024}, loads, hotspot_guard=False)
    assert rid == "p1"
    # prefix_only goes to the holder regardless.
    _, rid, _, _ = _pick("prefix_only", {"p0": 1024}, loads)
    assert rid == "p0"


def test_index_unavailable_falls_back_to_least_loaded_and_is_counted() -> None:
    loads = [
        PrefillReplicaLoad("p0", queued_uncached_tokens=500),
        PrefillReplicaLoad("p1", queued_uncached_tokens=100),
    ]
    st, rid, reason, _ = _pick("prefix_load", None, loads)
    assert (rid, reason) == ("p1", "index_unavailable")
    assert st.counters["index_unavailable"] == 1


def test_round_robin_cycles_and_unhealthy_are_filtered() -> None:
    loads = [
        PrefillReplicaLoad("a"),
        PrefillReplicaLoad("b", healthy=False),
        PrefillReplicaLoad("c"),
    ]
    st = RouterState()
    picks = []
    for _ in range(4):
        st, rid, _, _ = _pick("round_robin", {}, loads, state=st)
        picks.append(rid)
    assert picks == ["a", "c", "a", "c"]


def test_inflight_tokens_count_until_a_later_report_covers_them() -> None:
    cfg = RoutingConfig(policy="least_loaded")
    st = on_dispatch(RouterState(), "p0", 5000, now=1.0)
    loads = [PrefillReplicaLoad("p0"), PrefillReplicaLoad("p1", queued_uncached_tokens=1000)]
    _, rid, _, _, _ = choose_prefill(st, RouteRequest("r", 10), loads, {}, cfg)
    assert rid == "p1"  # p0 reports 0 queued, but the router sent it 5,000 tokens
    st = on_report(st, "p0", reported_at_s=2.0, now=2.0, ttl_s=cfg.inflight_ttl_s)
    assert st.inflight_tokens("p0") == 0


def test_inflight_tokens_expire_without_a_report() -> None:
    """A replica that stops reporting does not look busy forever: its in-flight tokens
    stop counting after inflight_ttl_s."""
    cfg = RoutingConfig(policy="least_loaded", inflight_ttl_s=10.0)
    st = on_dispatch(RouterState(), "p0", 50_000, now=0.0)
    loads = [PrefillReplicaLoad("p0"), PrefillReplicaLoad("p1", queued_uncached_tokens=1000)]
    _, rid, _, _, _ = choose_prefill(st, RouteRequest("r", 10), loads, {}, cfg, now=5.0)
    assert rid == "p1"
    _, rid, _, _, _ = choose_prefill(st, RouteRequest("r", 10), loads, {}, cfg, now=11.0)
    assert rid == "p0"


def _hotspot_run(policy: str) -> dict[str, int]:
    """Every request (8,000 tokens) shares one popular 4,000-token prefix held only by p0;
    each replica drains 2,500 tokens per arrival, so no single replica keeps up with the
    4,000 uncached tokens each request brings. Returns the peak backlog per replica."""
    cfg = RoutingConfig(policy=policy)
    backlog = {f"p{i}": 0 for i in range(4)}
    peak = dict(backlog)
    st = RouterState()
    for n in range(400):
        loads = [PrefillReplicaLoad(k, queued_uncached_tokens=v) for k, v in backlog.items()]
        st, rid, _, matched, _ = choose_prefill(
            st, RouteRequest(f"r{n}", 8000), loads, {"p0": 4000}, cfg
        )
        assert rid is not None
        backlog[rid] += 8000 - matched
        for k in backlog:
            backlog[k] = max(0, backlog[k] - 2500)
            peak[k] = max(peak[k], backlog[k])
    return peak


def test_hotspot_prefix_only_overloads_one_replica_and_prefix_load_does_not() -> None:
    only = _hotspot_run("prefix_only")
    ours = _hotspot_run("prefix_load")
    assert only["p0"] >= 400 * 1500 * 0.9  # grows without bound: 4,000 in, 2,500 out
    assert max(ours.values()) < 20000  # spreads the load; no replica runs away
    assert ours["p0"] > 0  # and still uses the holder


def test_decode_choice_by_headroom_and_hold_when_none_fits() -> None:
    cfg = RoutingConfig()
    decode = [
        DecodeReplicaLoad(
            "d0", window_tokens=400, token_load=390, free_kv_blocks=100, total_kv_blocks=100
        ),
        DecodeReplicaLoad(
            "d1", window_tokens=400, token_load=100, free_kv_blocks=100, total_kv_blocks=100
        ),
    ]
    st, dec = route(RouterState(), RouteRequest("r", 1000, 50, 8), REPLICAS, decode, {}, cfg)
    assert (dec.mode, dec.decode_replica) == ("pd", "d1")
    full = [DecodeReplicaLoad("d0", 400, 390, 100, 100), DecodeReplicaLoad("d1", 400, 100, 4, 100)]
    st, dec = route(RouterState(), RouteRequest("r", 1000, 50, 8), REPLICAS, full, {}, cfg)
    assert dec.mode == "hold" and dec.prefill_replica is None and st.counters["hold"] == 1


def test_conditional_disaggregation_for_short_uncached_part() -> None:
    cfg = RoutingConfig(local_prefill_threshold_tokens=256)
    decode = [DecodeReplicaLoad("d0", 400, 0, 100, 100)]
    _, dec = route(
        RouterState(), RouteRequest("r", 1100, 10, 9), REPLICAS, decode, {"p1": 1024}, cfg
    )
    assert dec.mode == "decode_local" and dec.decode_replica == "d0"
    _, dec = route(
        RouterState(), RouteRequest("r", 1100, 10, 9), REPLICAS, decode, {"p1": 512}, cfg
    )
    assert dec.mode == "pd" and dec.prefill_replica == "p1"


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match="hotspot_factor"):
        RoutingConfig(hotspot_factor=1.0)
    with pytest.raises(ValueError, match="policy"):
        RoutingConfig(policy="random")  # type: ignore[arg-type]


def test_decode_rule_headroom_filters_outstanding_balances() -> None:
    """One rule for the live router and the decode simulator: fits first, then the fewest
    outstanding, then the larger headroom share, the larger free-KV share, the id."""
    from controllers.routing import choose_decode, rank_decode

    req = RouteRequest("r", 500, expected_output_tokens=50, prompt_blocks=4)
    loads = [
        DecodeReplicaLoad("full", 400, 390, 100, 100, outstanding=0),  # no headroom
        DecodeReplicaLoad("nokv", 400, 0, 3, 100, outstanding=0),  # prompt does not fit
        DecodeReplicaLoad("busy", 400, 0, 100, 100, outstanding=5),
        DecodeReplicaLoad("b", 400, 200, 50, 100, outstanding=1),
        DecodeReplicaLoad("a", 400, 200, 80, 100, outstanding=1),
        DecodeReplicaLoad("c", 400, 100, 10, 100, outstanding=1),
    ]
    assert rank_decode(req, loads) == ["c", "a", "b", "busy"]
    assert choose_decode(req, loads) == ("c", "decode_headroom")
    assert choose_decode(req, loads, kv_guard_blocks=100) == (None, "no_decode_headroom")


def test_headroom_dispatch_uses_the_same_rule() -> None:
    from controllers.decode.dispatch import ContainerView, DispatchRequest, HeadroomDispatch

    d = HeadroomDispatch(hold_when_full=True)
    views = [
        ContainerView(0, True, False, 2, 100, 100, 400, 0),
        ContainerView(1, True, False, 1, 100, 100, 400, 300),
        ContainerView(2, True, False, 1, 100, 100, 400, 100),
    ]
    # 1 and 2 tie on outstanding; 2 has the larger headroom share
    assert d.choose(DispatchRequest("r", 100, 1, 50), views) == 2
    full = [ContainerView(0, True, False, 0, 100, 100, 40, 39)]
    assert d.choose(DispatchRequest("r", 100, 1, 50), full) is None and d.held == 1


def test_inflight_prefixes_count_until_shortly_after_completion() -> None:
    from controllers.routing import InflightPrefixes

    p = InflightPrefixes(grace_s=2.0, ttl_s=100.0)
    p.add("r1", "a", [1, 2, 3], now=0.0)
    p.add("r2", "a", [1, 2, 9], now=0.0)
    assert p.leading("a", [1, 2, 3, 4]) == 3 and p.leading("b", [1, 2]) == 0
    assert p.leading("a", [2, 3]) == 2 and p.leading("a", [5, 1]) == 0  # leading only
    p.done("r1", now=10.0)
    p.expire(now=11.0)
    assert p.leading("a", [1, 2, 3]) == 3  # the grace: its KV events may not be in yet
    p.expire(now=12.0)
    assert p.leading("a", [1, 2, 3]) == 2  # r2 still holds 1 and 2
    p.expire(now=100.0)  # r2 never completed: its TTL
    assert p.leading("a", [1, 2]) == 0 and len(p) == 0


def test_a_replicas_held_blocks_are_listed_oldest_first_up_to_the_limit() -> None:
    """What a prefill replica reports as its held prompt blocks (``queued_blocks``)."""
    from controllers.routing import InflightPrefixes, leading_blocks

    p = InflightPrefixes(grace_s=2.0, ttl_s=100.0)
    p.add("r1", "a", [1, 2, 3], now=0.0)
    p.add("r2", "a", [1, 2, 9], now=1.0)  # shares 1 and 2: listed once
    assert p.blocks("a", 10) == [1, 2, 3, 9] and p.blocks("a", 2) == [1, 2]
    assert p.blocks("b", 10) == [] and p.blocks("a", 0) == []
    p.done("r1", now=5.0)
    p.expire(now=8.0)  # past r1's grace: 3 goes, 1 and 2 stay with r2
    assert p.blocks("a", 10) == [1, 2, 9]
    held = set(p.blocks("a", 10))
    assert leading_blocks(held, [1, 2, 9, 4]) == 3 and leading_blocks(held, [2, 9]) == 2
    assert leading_blocks(held, [7, 1]) == 0 and leading_blocks((), [1]) == 0
