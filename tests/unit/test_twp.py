"""TWP's pure controller: window dynamics, gate, guards, ranking, estimates."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from controllers.decode import (
    DecodeObservation,
    DecodeView,
    EngineView,
    FinishedRequest,
    RunningRequestView,
    TWPConfig,
    WaitingRequestView,
    admit,
    check_pd_backstop,
    init_state,
    l_hat,
    observe,
    prefill_chunk,
    rank,
)
from controllers.decode.twp import TWP, TWPState
from controllers.profile import EngineProfile

L_MIN = 0.04
B0 = 8


def profile() -> EngineProfile:
    return EngineProfile.model_validate(
        {
            "hardware": "test",
            "model": "test",
            "block_size": 16,
            "token_budget": 2048,
            "kv_blocks": 1000,
            "prefill": {"prompt_tokens": [16, 512], "seconds": [0.05, 0.1]},
            "step_cost": {"fixed_s": L_MIN, "per_token_s": 1e-4, "attn_per_ctx_token_s": 0.0},
            "decode": {"l_min_s": L_MIN, "b0": B0, "alpha_s": L_MIN / B0},
        }
    )


def obs(step: int, latency: float, q: int, free: int = 900, total: int = 1000) -> DecodeObservation:
    return DecodeObservation(step, latency, free, total, q, 4)


def waiting(
    rid: str, l_hat_: int = 50, wait_steps: int = 0, blocks: int = 4, tenant: str = "a"
) -> WaitingRequestView:
    return WaitingRequestView(rid, tenant, 64, blocks, 1024, l_hat_, wait_steps, wait_steps * L_MIN)


def view(
    w: list[WaitingRequestView],
    running: list[RunningRequestView] | None = None,
    free: int = 900,
    total: int = 1000,
) -> DecodeView:
    return DecodeView.of(w, running or [], EngineView(free, total, L_MIN, len(w), 0))


def state(**cfg: object) -> TWPState:
    return init_state(TWPConfig.model_validate(cfg), profile())


def test_defaults_resolve_from_profile() -> None:
    s = state()
    p = s.params
    assert (p.H0, p.Q, p.H_min, p.H_max) == (400.0, 8.0, 50.0, 800.0)
    assert s.H == 400.0 and s.itl_hat_s == L_MIN and s.delta_kv == pytest.approx(0.02)


def test_window_grows_with_queue_at_baseline_itl() -> None:
    s = state()
    hs = [s.H]
    for t in range(60):
        s = observe(s, obs(t, L_MIN, q=2 * B0))
        hs.append(s.H)
    assert all(b > a for a, b in zip(hs, hs[1:], strict=False) if a < 800 - 1e-6)
    assert hs[-1] == pytest.approx(800.0, rel=1e-3)
    # an empty queue at baseline ITL leaves the window at H0
    s2 = state()
    for t in range(60):
        s2 = observe(s2, obs(t, L_MIN, q=0))
    assert pytest.approx(400.0) == s2.H


def test_window_shrinks_when_itl_rises() -> None:
    s = state()
    hs = [s.H]
    for t in range(80):
        s = observe(s, obs(t, 3 * L_MIN, q=0))
        hs.append(s.H)
    assert all(b < a for a, b in zip(hs, hs[1:], strict=False))
    assert s.sigma == pytest.approx(3.0, rel=1e-3)
    assert pytest.approx(400.0 / 3.0, rel=1e-2) == s.H


@pytest.mark.parametrize(
    ("latency", "q", "bound"), [(100 * L_MIN, 0, 50.0), (L_MIN / 10, 99, 800.0)]
)
def test_window_stays_clamped(latency: float, q: int, bound: float) -> None:
    s = state()
    for t in range(300):
        s = observe(s, obs(t, latency, q))
        assert 50.0 <= s.H <= 800.0
    assert pytest.approx(bound) == s.H


def test_force_admit_after_t_max_bypasses_both_checks() -> None:
    s = replace(state(T_max=10), H=60.0)
    running = [RunningRequestView("r", 0, 60)]  # K = 60 = H: the window is full
    v = view([waiting("old", wait_steps=11, blocks=500), waiting("new")], running, free=100)
    s2, d = admit(s, v)
    by = {x.request_id: x for x in d}
    assert by["old"].action == "force_admit"
    assert by["new"].action == "hold"
    assert s2.counters.force_admitted == 1
    # at exactly T_max it is still held
    _, d = admit(s, view([waiting("old", wait_steps=10)], running))
    assert d[0].action == "hold"


def test_no_skipping_to_smaller_requests() -> None:
    s = replace(state(), H=100.0)
    big = waiting("big", l_hat_=90, wait_steps=50)  # ranked first: waited longest
    small = waiting("small", l_hat_=5, wait_steps=1)
    running = [RunningRequestView("r", 0, 30)]  # K = 30; 30 + 90 > 100, 30 + 5 fits
    s2, d = admit(s, view([small, big], running))
    assert [x.request_id for x in d] == ["big", "small"]
    assert all(x.action == "hold" for x in d)
    assert d[0].reason == "window" and d[1].reason.startswith("gate_closed")
    assert s2.counters.closed_by_window == 1


def test_gate_admits_in_rank_order_while_window_holds() -> None:
    s = replace(state(), H=130.0)
    w = [waiting(f"w{i}", l_hat_=50, wait_steps=10 - i) for i in range(4)]
    _, d = admit(s, view(w))
    assert [x.action for x in d[:2]] == ["admit", "admit"]
    assert [x.request_id for x in d[:2]] == ["w0", "w1"]
    assert all(x.action == "hold" for x in d[2:])


def test_kv_guard_counts_the_requests_own_prompt_blocks() -> None:
    s = state()  # delta_kv = 2% of 1000 = 20 blocks
    _, d = admit(s, view([waiting("a", blocks=85)], free=100))
    assert d[0].action == "hold" and d[0].reason == "kv_guard"
    _, d = admit(s, view([waiting("a", blocks=70)], free=100))
    assert d[0].action == "admit"
    # two requests: the second no longer fits once the first's blocks are taken
    _, d = admit(
        s, view([waiting("a", blocks=40, wait_steps=2), waiting("b", blocks=40)], free=100)
    )
    assert [x.action for x in d] == ["admit", "hold"]


def test_delta_kv_rises_under_fast_consumption_and_relaxes_when_stable() -> None:
    s = state()
    free = 1000
    for t in range(40):
        free -= 10
        s = observe(s, obs(t, L_MIN, 0, free=free))
    high = s.delta_kv
    assert high > 0.02 + 0.1  # 0.02 + 10 blocks/step * 16 / 1000 = 0.18 at steady rate
    assert high == pytest.approx(0.18, rel=0.02)
    for t in range(40, 120):
        s = observe(s, obs(t, L_MIN, 0, free=free))
    assert s.delta_kv == pytest.approx(0.02, abs=1e-3)
    # the clamp holds under extreme consumption
    s = state()
    free = 1000
    for t in range(30):
        free -= 30
        s = observe(s, obs(t, L_MIN, 0, free=max(0, free)))
    assert s.delta_kv == pytest.approx(0.25)


def test_delta_kv_is_independent_of_itl() -> None:
    a, b = state(), state()
    for t in range(20):
        a = observe(a, obs(t, L_MIN, 0, free=1000 - 5 * t))
        b = observe(b, obs(t, 5 * L_MIN, 0, free=1000 - 5 * t))
    assert a.delta_kv == pytest.approx(b.delta_kv)
    assert a.H != b.H


def test_l_hat_is_capped_running_median_per_tenant() -> None:
    s = state(L_bar=50)
    assert l_hat(s, "a", 1000) == 50 and l_hat(s, "a", 30) == 30
    fin = tuple(FinishedRequest("a", n) for n in (10, 20, 300))
    s = observe(s, DecodeObservation(0, L_MIN, 900, 1000, 0, 3, fin))
    assert l_hat(s, "a", 1000) == 20
    assert l_hat(s, "b", 1000) == 50  # other tenants keep the prior
    assert l_hat(s, "a", 15) == 15


def test_median_window_forgets_old_lengths() -> None:
    s = state(median_window=3)
    for i, n in enumerate((500, 500, 500, 10, 10, 10)):
        s = observe(s, DecodeObservation(i, L_MIN, 900, 1000, 0, 1, (FinishedRequest("a", n),)))
    assert l_hat(s, "a", 1000) == 10


def test_survival_l_hat_counts_long_runners() -> None:
    fin = tuple(FinishedRequest("a", n) for n in (20, 20, 20, 200, 220))
    for flag, expect in ((False, 20), (True, 210)):
        s = observe(state(survival_l_hat=flag), DecodeObservation(0, L_MIN, 900, 1000, 0, 1, fin))
        assert l_hat(s, "a", 1000, generated=60) == expect
    s = observe(state(survival_l_hat=True), DecodeObservation(0, L_MIN, 900, 1000, 0, 1, fin))
    assert l_hat(s, "a", 1000, generated=300) == 600  # nobody survived that far: 2x


def test_ranking_terms() -> None:
    s = state()
    running = [RunningRequestView("r", 0, 40)]  # r_bar = 40
    close = waiting("close", l_hat_=40)
    far = waiting("far", l_hat_=400)
    order = [w.request_id for _, w in rank(s, view([far, close], running))]
    assert order == ["close", "far"]  # token balance
    old = waiting("old", l_hat_=400, wait_steps=150)
    order = [w.request_id for _, w in rank(s, view([close, old], running))]
    assert order == ["old", "close"]  # starvation outweighs balance (w1 > w2)
    scores = [sc for sc, _ in rank(s, view([close, far, old], running))]
    assert all(0.0 <= sc <= 1.0 for sc in scores)


def test_empty_batch_admits_one_oversized_request() -> None:
    s = replace(state(), H=60.0)
    _, d = admit(s, view([waiting("huge", l_hat_=500), waiting("b", l_hat_=5)]))
    assert d[0].reason == "empty_batch" and d[1].action == "hold"
    s = replace(state(empty_batch_admit=False), H=60.0)
    _, d = admit(s, view([waiting("huge", l_hat_=500)]))
    assert d[0].action == "hold"


def test_prefill_chunk_and_pd_backstop() -> None:
    cfg = TWPConfig()
    assert [prefill_chunk(n, cfg) for n in (800, 64, 10, 0)] == [64, 64, 10, 0]
    check_pd_backstop(cfg, 0.2)  # 200 x 0.2 s = 40 s: fine
    with pytest.raises(ValueError, match="T_max"):
        check_pd_backstop(cfg, 2.0)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"w1": 0.2, "w2": 0.3, "w3": 0.1}, "w1 > w2 > w3"),
        ({"H_min": 10, "L_bar": 50}, "H_min"),
        ({"delta_min": 0.3, "delta_max": 0.2}, "delta_min"),
        ({"gamma": 0.0}, "gamma"),
        ({"bogus": 1}, "bogus"),
    ],
)
def test_config_errors_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValidationError, match=field):
        TWPConfig.model_validate(kwargs)


def test_observe_and_admit_do_not_mutate_their_inputs() -> None:
    s = state()
    before = (s.H, s.itl_hat_s, dict(s.tenant_median), s.counters)
    observe(s, DecodeObservation(0, 3 * L_MIN, 500, 1000, 9, 4, (FinishedRequest("a", 7),)))
    admit(s, view([waiting("a")]))
    assert (s.H, s.itl_hat_s, dict(s.tenant_median), s.counters) == before


req_st = st.tuples(
    st.integers(1, 400),  # l_hat
    st.integers(0, 300),  # wait_steps
    st.integers(0, 60),  # prompt blocks
)


@settings(max_examples=200, deadline=None)
@given(
    reqs=st.lists(req_st, max_size=20),
    running=st.lists(st.tuples(st.integers(1, 400), st.integers(0, 400)), max_size=12),
    window=st.floats(50.0, 800.0),
    free=st.integers(0, 1000),
    t_max=st.integers(1, 250),
)
def test_token_load_never_exceeds_window_except_by_force_admits(
    reqs: list[tuple[int, int, int]],
    running: list[tuple[int, int]],
    window: float,
    free: int,
    t_max: int,
) -> None:
    s = replace(state(T_max=t_max, empty_batch_admit=False), H=window)
    w = [waiting(f"w{i}", lh, ws, b) for i, (lh, ws, b) in enumerate(reqs)]
    run = [RunningRequestView(f"r{i}", g, lh) for i, (lh, g) in enumerate(running)]
    v = view(w, run, free=free)
    _, d = admit(s, v)
    assert sorted(x.request_id for x in d) == sorted(x.request_id for x in w)
    by = {x.request_id: x for x in w}
    forced = sum(max(1, by[x.request_id].l_hat) for x in d if x.action == "force_admit")
    normal = sum(max(1, by[x.request_id].l_hat) for x in d if x.action == "admit")
    K = v.token_load
    if normal:
        # every normal admission saw the load including force-admits and stayed within H
        assert K + forced + normal <= window + 1e-9
    # blocks: normal admissions keep the guard
    blocks = sum(by[x.request_id].prompt_blocks for x in d if x.admitted)
    if normal:
        assert free - blocks > s.delta_kv * 1000 - 1e-9
    # no skipping: once one is held, no later one (in decision order) is admitted normally
    seen_hold = False
    for x in d:
        if x.action == "hold":
            seen_hold = True
        elif seen_hold:
            raise AssertionError("admitted after a hold")
    # force-admits are exactly the requests past T_max
    assert {x.request_id for x in d if x.action == "force_admit"} == {
        r.request_id for r in w if r.wait_steps > t_max
    }


def test_reconfigure_keeps_the_learned_state_and_clamps_the_window() -> None:
    """Live new parameters: the window, ITL estimate and tenants' lengths carry over, the
    window is clamped into the new bounds, and a bad combination changes nothing."""
    gate = TWP(profile(), TWPConfig())
    for step in range(5):
        gate.observe(obs(step, 3 * L_MIN, 20))  # slow steps: the window shrinks, sigma > 1
    learned = gate.state
    assert learned.H < 400.0 and learned.sigma > 1.0
    gate.reconfigure(TWPConfig(H_min=50, H_max=60), profile())
    window = gate.state.H
    assert window == min(max(learned.H, 50.0), 60.0)
    assert gate.state.itl_hat_s == learned.itl_hat_s and gate.state.step == learned.step
    assert gate.state.params.H_max == 60.0 and gate.config.H_max == 60
    before = gate.state
    with pytest.raises(ValueError, match="H_min"):
        gate.reconfigure(TWPConfig(H_min=90, H_max=60), profile())
    assert gate.state is before and gate.config.H_max == 60


# ----- l_min tracking (an addition to the paper) ---------------------------------------------
def test_lmin_tracker_reports_the_median_of_recent_lone_steps_every_so_often() -> None:
    from controllers.decode.twp import LMinTracker

    t = LMinTracker(window=8, every=4)
    assert [t.add(x) for x in (0.010, 0.030, 0.020)] == [None, None, None]
    assert t.add(0.040) == pytest.approx(0.025)  # median of the four
    assert t.add(0.0) is None and t.add(float("inf")) is None  # no ITL: not counted
    for x in (0.1, 0.1, 0.1):
        assert t.add(x) is None
    assert t.add(0.1) == pytest.approx(0.07)  # 8 held: median of 0.01..0.04 and 4 x 0.1
    for _ in range(4):
        last = t.add(0.1)
    assert last == pytest.approx(0.1)  # the oldest fall out of the window
    with pytest.raises(ValueError, match="every"):
        LMinTracker(window=4, every=8)


def test_set_l_min_keeps_the_window_and_restart_resets_the_slowdown() -> None:
    prof = profile()
    gate = TWP(prof, TWPConfig())
    for i in range(30):  # a slow engine: ITL 4x l_min narrows the window
        gate.observe(DecodeObservation(i, 4 * prof.decode.l_min_s, 100, 100, 0, 1))
    narrowed, sigma = gate.state.H, gate.state.sigma
    assert narrowed < gate.state.params.H0 and sigma > 2
    slower = prof.model_copy(
        update={"decode": prof.decode.model_copy(update={"l_min_s": 4 * prof.decode.l_min_s})}
    )
    gate.set_l_min(slower)
    assert narrowed == gate.state.H and gate.state.sigma == sigma  # next step uses it
    gate.observe(DecodeObservation(30, 4 * prof.decode.l_min_s, 100, 100, 0, 1))
    assert gate.state.sigma < 1.1 and narrowed < gate.state.H  # the same ITL is now lone pace
    gate.set_l_min(prof, restart=True)
    assert gate.state.sigma == 1.0 and gate.state.itl_hat_s == prof.decode.l_min_s
