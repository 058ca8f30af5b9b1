"""The Fairway paper's worked examples, as exact tests."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controllers.config import FairwayConfig
from controllers.prefill import Fairway, PrefillQueueView, PrefillRequestView, patience_s
from controllers.prefill.fairway import FAIR, FAST, fast_lane_scores, merge_by_work_charges
from controllers.profile import EngineProfile
from tests.helpers import queue, req


def test_h1_to_h5_and_m_ledgers_and_order() -> None:
    """Figure example: M (oldest, 6,000 uncached) and five hits of 300 uncached, 6,000 cached."""
    m = req("M", arrival=0.0, cached=0, uncached=6000)
    hits = [req(f"H{i}", arrival=0.1 * i, cached=6000, uncached=300) for i in range(1, 8)]
    q = queue(m, *hits)
    plan = Fairway().plan(q, now=0.8)
    # Fast ledger starts at 300 x 4 = 1,200, Fair at 6,000: H1..H4 reach 6,000, the tie
    # goes to Fast (H5, 7,200), then the Fair lane places M.
    assert plan.order[:6] == ["H1", "H2", "H3", "H4", "H5", "M"]
    assert plan.lanes[:6] == [FAST] * 5 + [FAIR]
    ahead = sum(r.work for r in q.requests if r.request_id in plan.order[:5])
    assert ahead == 1500 == m.work // 4


def test_ledger_start_values() -> None:
    """Each ledger starts at its front request's work (Fast x weight): 1,200 and 6,000."""
    work = [6000, 300, 300]
    order, lanes = merge_by_work_charges([1, 2, 0], [0, 1, 2], work, 4.0)
    # 1,200 <= 6,000 -> Fast places 1 (2,400); 2,400 <= 6,000 -> Fast places 2 (3,600);
    # Fast's next is 0 itself, 3,600 <= 6,000 -> Fast places M too.
    assert order == [1, 2, 0] and lanes == [FAST, FAST, FAST]
    # With a Fast front of 2,000 uncached: 8,000 > 6,000 so the Fair lane places first.
    order, lanes = merge_by_work_charges([1, 0], [0, 1], [6000, 2000], 4.0)
    assert order == [0, 1] and lanes == [FAIR, FAST]


def test_equal_cache_a_before_b() -> None:
    """A and B both have 6,000 cached; A has 300 left, B 3,000: A goes first (20 vs 2)."""
    a = req("A", arrival=0.0, cached=6000, uncached=300)
    b = req("B", arrival=0.0, cached=6000, uncached=3000)
    scores = fast_lane_scores((a, b), now=0.0)
    assert scores == pytest.approx([20.0, 2.0])
    assert Fairway().order(queue(b, a), now=0.0) == ["A", "B"]


def test_relative_wait_term_and_order() -> None:
    """Both waited 2 s; patience 1 s vs 4 s: second terms 2 and 0.5; the short one moves up."""
    short = req("short", arrival=0.0, cached=0, uncached=200, patience=1.0)
    long_ = req("long", arrival=0.0, cached=0, uncached=200, patience=4.0)
    assert fast_lane_scores((short, long_), now=2.0) == pytest.approx([2.0, 0.5])
    # Equal first terms (0 cached): order by the second term alone; Fast only isolates it.
    nofair = Fairway(FairwayConfig(fair_lane=False))
    assert nofair.order(queue(long_, short), now=2.0) == ["short", "long"]
    # Absolute wait (ablation) scores both 2 / 1 s: the tie goes to the earlier position.
    absolute = Fairway(FairwayConfig(relative_wait=False, fair_lane=False))
    assert fast_lane_scores((short, long_), now=2.0, relative_wait=False) == pytest.approx(
        [2.0, 2.0]
    )
    assert absolute.order(queue(long_, short), now=2.0) == ["long", "short"]


def test_unequal_sizes_pin_ledger_semantics() -> None:
    """Unequal sizes: O (oldest, 1,000), fast candidates of 100, 50, 400 uncached.

    Fast ledger starts 4 x 100 = 400; Fair 1,000.
    400 <= 1000 -> Fast places F100 (800); 800 <= 1000 -> F50 (1,000);
    1000 <= 1000 tie -> Fast places F400 (2,600); Fair places O (2,000);
    2000 < 2600 -> Fair: next oldest unplaced is X (300), Fair ledger 2,300; then X2.
    """
    o = req("O", arrival=0.0, cached=0, uncached=1000)
    x = req("X", arrival=0.5, cached=0, uncached=300)
    x2 = req("X2", arrival=0.6, cached=0, uncached=10)
    f100 = req("F100", arrival=1.0, cached=5000, uncached=100)  # ratio 50
    f50 = req("F50", arrival=1.1, cached=2000, uncached=50)  # ratio 40
    f400 = req("F400", arrival=1.2, cached=8000, uncached=400)  # ratio 20
    plan = Fairway().plan(queue(o, x, x2, f100, f50, f400), now=1.2)
    assert plan.order == ["F100", "F50", "F400", "O", "X", "X2"]
    assert plan.lanes == [FAST, FAST, FAST, FAIR, FAIR, FAIR]


def test_variants_names() -> None:
    assert Fairway().name == "fairway"
    assert Fairway(FairwayConfig(relative_wait=False)).name == "fairway_abs"
    assert Fairway(FairwayConfig(fair_lane=False)).name == "fairway_nofair"
    assert Fairway(FairwayConfig(relative_wait=False, fair_lane=False)).name == "fairway_abs_nofair"


def test_config_defaults_frozen_and_validated() -> None:
    cfg = FairwayConfig()
    assert (cfg.fast_lane_weight, cfg.slo_multiplier, cfg.slo_floor_s) == (4.0, 3.0, 1.0)
    with pytest.raises(ValueError, match="fast_lane_weight"):
        FairwayConfig(fast_lane_weight=0)
    with pytest.raises(ValueError, match="extra"):
        FairwayConfig(fast_lane_wieght=2)  # type: ignore[call-arg]


def _profile() -> EngineProfile:
    return EngineProfile.model_validate(
        {
            "hardware": "test",
            "model": "test",
            "block_size": 16,
            "token_budget": 2048,
            "prefill": {"prompt_tokens": [1000, 8000], "seconds": [0.1, 1.5]},
            "step_cost": {"fixed_s": 0.01, "per_token_s": 1e-4, "attn_per_ctx_token_s": 1e-9},
            "decode": {"l_min_s": 0.02, "b0": 8, "alpha_s": 0.002},
        }
    )


def test_patience_from_full_prompt_with_floor() -> None:
    p = _profile()
    assert patience_s(1000, p) == 1.0  # 3 x 0.1 s = 0.3 s, floored at 1 s
    assert patience_s(8000, p) == pytest.approx(4.5)  # 3 x 1.5 s
    assert patience_s(4500, p) == pytest.approx(3 * 0.8)  # interpolated: 0.1 + 1.4 * 0.5
    # Beyond the table: the last segment's slope (0.2 ms/token).
    assert patience_s(16000, p) == pytest.approx(3 * (1.5 + 0.0002 * 8000))


# --- the paper's bound, as a property -----------------------------------------------

req_strategy = st.builds(
    lambda arrival, cached, uncached, patience: (arrival, cached, uncached, patience),
    st.floats(0, 100, allow_nan=False),
    st.integers(0, 20000),
    st.integers(0, 20000),
    st.floats(0.1, 30, allow_nan=False),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(req_strategy, min_size=1, max_size=40), st.floats(0, 200, allow_nan=False))
def test_work_ahead_of_oldest_is_bounded(
    raw: list[tuple[float, int, int, float]], dt: float
) -> None:
    """Work placed ahead of the oldest request <= its work / weight + one request's work."""
    reqs = tuple(
        PrefillRequestView(f"r{i}", a, c + u, p, c, u) for i, (a, c, u, p) in enumerate(raw)
    )
    now = max(r.arrival_s for r in reqs) + dt
    order = Fairway().order(PrefillQueueView(reqs), now)
    oldest = min(range(len(reqs)), key=lambda i: (reqs[i].arrival_s, i))
    by_id = {r.request_id: r for r in reqs}
    pos = order.index(reqs[oldest].request_id)
    ahead = [by_id[rid].work for rid in order[:pos]]
    overshoot = max(ahead, default=0)
    assert sum(ahead) <= reqs[oldest].work / 4.0 + overshoot


def test_fairway_declares_its_lanes_and_the_plain_orders_do_not() -> None:
    """The engine plug-in reports lanes through the policy's declared capability
    (``order_with_lanes``), never by its type: Fairway names each request's lane as its plan
    placed it; the baselines and Fairway inside the fair share declare none (no lanes)."""
    from controllers.prefill import make_prefill_policy

    m = req("M", arrival=0.0, cached=0, uncached=6000)
    hits = [req(f"H{i}", arrival=0.1 * i, cached=6000, uncached=300) for i in range(1, 8)]
    q = queue(m, *hits)
    plan = Fairway().plan(q, now=0.8)
    ids, lanes = Fairway().order_with_lanes(q, now=0.8)
    assert ids == plan.order
    assert lanes == ["fast" if lane == FAST else "fair" for lane in plan.lanes]
    assert lanes[:6] == ["fast"] * 5 + ["fair"]
    for name in ("fcfs", "lpm", "fairway+fair_share", "fairway_xstep"):
        policy = make_prefill_policy(name, _profile(), FairwayConfig())
        assert getattr(policy, "order_with_lanes", None) is None, name
