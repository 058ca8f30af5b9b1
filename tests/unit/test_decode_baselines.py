"""Decode baselines: admissions, dispatchers, registry."""

from __future__ import annotations

import pytest

from controllers.decode import (
    DecodeObservation,
    DecodeView,
    DynamicBatchAdmission,
    EngineView,
    FCFSAdmission,
    PriorityAdmission,
    RunningRequestView,
    WaitingRequestView,
    decode_policy_names,
    make_decode_policy,
)
from controllers.decode.dispatch import (
    ContainerView,
    DispatchRequest,
    HeadroomDispatch,
    LeastLoadedDispatch,
    LocalityAwareDispatch,
    RoundRobinDispatch,
)
from tests.unit.test_twp import L_MIN, profile


def w(rid: str, prompt: int) -> WaitingRequestView:
    return WaitingRequestView(rid, "a", prompt, 1, 256, 50, 0, 0.0)


def v(waiting: list[WaitingRequestView], running: int = 0) -> DecodeView:
    run = [RunningRequestView(f"r{i}", 0, 50) for i in range(running)]
    return DecodeView.of(waiting, run, EngineView(100, 100, L_MIN, len(waiting), 0))


def test_fcfs_admits_everything_in_arrival_order() -> None:
    d = FCFSAdmission().admit(v([w("a", 500), w("b", 10), w("c", 100)]))
    assert [(x.request_id, x.action) for x in d] == [("a", "admit"), ("b", "admit"), ("c", "admit")]


def test_priority_is_shortest_prompt_first() -> None:
    d = PriorityAdmission().admit(v([w("a", 500), w("b", 10), w("c", 100), w("d", 10)]))
    assert [x.request_id for x in d] == ["b", "d", "c", "a"]
    assert all(x.admitted for x in d)


def test_dynamic_batch_caps_only_while_itl_is_over_target() -> None:
    pol = DynamicBatchAdmission(profile())
    q = [w(f"x{i}", 10) for i in range(5)]
    assert all(x.admitted for x in pol.admit(v(q, running=6)))
    for t in range(30):
        pol.observe(DecodeObservation(t, 2 * L_MIN, 100, 100, 5, 6))
    d = pol.admit(v(q, running=6))  # cap B0 = 8: two more
    assert [x.action for x in d] == ["admit", "admit", "hold", "hold", "hold"]
    for t in range(30, 80):
        pol.observe(DecodeObservation(t, L_MIN, 100, 100, 5, 6))
    assert all(x.admitted for x in pol.admit(v(q, running=6)))


def c(
    i: int, warm: bool = True, out: int = 0, starting: bool = False, **kw: float
) -> ContainerView:
    return ContainerView(
        i, warm, starting, out, int(kw.get("free", 100)), 100, kw.get("H", 0.0), kw.get("K", 0.0)
    )


REQ = DispatchRequest("q", 64, 4, 50)


def test_least_loaded_scales_out_at_the_concurrency_target() -> None:
    d = LeastLoadedDispatch(scale_out_load=8)
    assert d.choose(REQ, [c(0, out=3), c(1, out=1), c(2, warm=False)]) == 1
    assert d.choose(REQ, [c(0, out=8), c(1, warm=False)]) == 1  # starts the cold one
    assert d.choose(REQ, [c(0, out=8), c(1, out=9)]) == 0  # none cold: least loaded


def test_round_robin_rotates_regardless_of_warmth() -> None:
    d = RoundRobinDispatch()
    pool = [c(0), c(1, warm=False), c(2, out=50)]
    assert [d.choose(REQ, pool) for _ in range(5)] == [0, 1, 2, 0, 1]


def test_locality_aware_prefers_a_starting_container_to_a_new_cold_start() -> None:
    d = LocalityAwareDispatch(scale_out_load=8)
    pool = [c(0, out=8), c(1, warm=False, starting=True, out=2), c(2, warm=False)]
    assert d.choose(REQ, pool) == 1
    assert LeastLoadedDispatch(8).choose(REQ, pool) == 1


def test_headroom_dispatch_filters_by_headroom_and_holds_in_pd() -> None:
    pd = HeadroomDispatch(hold_when_full=True)
    full = [c(0, H=400, K=380, out=3), c(1, H=400, K=390, out=1)]
    assert pd.choose(REQ, full) is None and pd.held == 1
    assert HeadroomDispatch(hold_when_full=False).choose(REQ, full) == 0  # most room
    mixed = [c(0, H=400, K=380, out=1), c(1, H=400, K=100, out=5)]
    assert pd.choose(REQ, mixed) == 1  # only 1 has room for L_hat = 50
    assert pd.choose(REQ, [c(0, H=400, K=0, out=1, free=2)]) is None  # KV: 4 blocks needed
    assert pd.choose(REQ, [*full, c(2, warm=False)]) == 2  # a cold container before holding


def test_registry_builds_every_name_and_rejects_unknown() -> None:
    prof = profile()
    for name in decode_policy_names():
        spec = make_decode_policy(name, prof, mode="pd")
        pol = spec.new_admission()
        assert pol.name == name
        assert pol.admit(v([w("a", 10)]))[0].request_id == "a"
    assert make_decode_policy("serverlessllm", prof).fast_loading
    assert not make_decode_policy("fcfs", prof).fast_loading
    with pytest.raises(ValueError, match="known: fcfs"):
        make_decode_policy("nope", prof)


def test_twp_ablations_change_weights() -> None:
    spec = make_decode_policy("twp_no_balance", profile())
    cfg = spec.new_admission().config  # type: ignore[attr-defined]
    assert (cfg.w1, cfg.w2, cfg.w3) == (0.5, 0.0, 0.2) and cfg.ablation
