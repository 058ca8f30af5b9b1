"""Scenario generators and reports: determinism, documented shapes, qualitative outcomes."""

from __future__ import annotations

import numpy as np
import pytest

from bench.report.prefill import policy_report, run_workload, six_targets
from bench.sim.prefill import RunResult, SimRequest
from bench.sim.profiles import load_profile
from bench.workloads.prefill_scenarios import (
    SCENARIOS,
    SecCorpus,
    _Ids,
    block_hashes,
    build_scenario,
    long_prompt,
    sec_prompt,
    short_prompt,
)

PROFILE = load_profile("a6000_llama31_8b")


def test_block_hashes_are_chained_prefix_hashes() -> None:
    a = block_hashes([(0, 64), (1, 40)], 16)
    b = block_hashes([(0, 64), (2, 40)], 16)
    assert len(a) == 6  # 104 tokens: six full blocks
    assert a[:4] == b[:4] and a[4] != b[4]
    # the same tokens split differently into segments are different content
    assert block_hashes([(0, 32)], 16)[0] == block_hashes([(0, 64)], 16)[0]


def test_sec_prompts_have_the_documented_shape() -> None:
    rng = np.random.default_rng(0)
    corpus = SecCorpus(rng)
    ids = _Ids(10_000_000)
    for _ in range(200):
        p = sec_prompt(corpus, rng, ids)
        assert p[0] == (0, 64)
        assert 3 <= len(p) - 2 <= 5
        assert all(500 <= n <= 1500 for _, n in p[1:-1])
        assert 30 <= p[-1][1] <= 80
        assert 0.5e3 <= sum(n for _, n in short_prompt(corpus, rng, ids)) <= 2.0e3
    c16 = SecCorpus(rng, sections=4, excerpts_per_section=4)
    lengths = [sum(n for _, n in long_prompt(c16, rng, ids)) for _ in range(100)]
    assert min(lengths) >= 7_500 and max(lengths) <= 16_100


def test_zipf_popularity_favours_the_top_reports() -> None:
    corpus = SecCorpus(np.random.default_rng(0))
    assert corpus.popularity[:10].sum() > 0.4
    assert corpus.popularity[0] / corpus.popularity[1] == pytest.approx(2**1.1)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sec-spike", "long-prompts", "grid-mixed-l0.9-c0.25"])
def test_scenarios_are_deterministic_for_a_seed(name: str) -> None:
    a = build_scenario(name, seed=3, quick=True, profile=PROFILE)
    b = build_scenario(name, seed=3, quick=True, profile=PROFILE)
    c = build_scenario(name, seed=4, quick=True, profile=PROFILE)
    assert a.requests == b.requests and a.cache_blocks == b.cache_blocks
    assert a.requests != c.requests


@pytest.mark.slow
def test_sec_spike_phases_and_cache_fraction() -> None:
    w = build_scenario("sec-spike", seed=0, quick=True, profile=PROFILE, cache_fraction=0.3)
    assert [p[0] for p in w.phases] == ["calm", "burst", "spike"]
    for name, a, b in w.phases:
        assert all(a <= r.arrival_s < b for r in w.requests if name in r.labels)
    rates = {
        name: sum(1 for r in w.requests if name in r.labels) / (b - a) for name, a, b in w.phases
    }
    assert rates["spike"] > rates["burst"] > rates["calm"]
    assert w.keys == ("calm", "burst", "spike")


def test_unknown_scenario_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="sec-spike"):
        build_scenario("nope", profile=PROFILE)
    assert len([n for n in SCENARIOS if n.startswith("grid-")]) >= 8


def _fake(policy: str, ttfts: list[float], labels: tuple[str, ...] = ()) -> RunResult:
    from bench.sim.prefill import FinishedRequest

    fin = [FinishedRequest(f"r{i}", 0.0, 0.0, t, 10, 0, labels) for i, t in enumerate(ttfts)]
    return RunResult(policy, fin, [], max(ttfts), 1, 1.0, 0)


def test_starved_means_worst_above_three_times_own_p99() -> None:
    ok = policy_report(_fake("x", [1.0] * 200 + [2.9]), ())
    bad = policy_report(_fake("x", [1.0] * 200 + [3.5]), ())
    assert not ok["starved"] and bad["starved"]
    assert bad["worst_wait_s"] == 3.5


def test_six_targets_compare_medians_with_lpm_and_p99_with_fcfs() -> None:
    def rep(p50: float, p99: float) -> dict[str, object]:
        s = {"n": 100, "p50": p50, "p99": p99}
        return {"ttft": {"calm": s, "burst": s, "spike": s}}

    t = six_targets({"lpm": rep(1.0, 10.0), "fcfs": rep(5.0, 4.0), "x": rep(1.05, 4.3)})
    assert t is not None
    assert t["x"]["met"] == 6 and t["lpm"]["met"] == 3 and t["fcfs"]["met"] == 3
    assert six_targets({"x": rep(1.0, 1.0)}) is None


@pytest.mark.slow
def test_flood_quick_fairway_protects_the_backlog() -> None:
    w = build_scenario("flood", seed=0, quick=True, profile=PROFILE)
    rep, _ = run_workload(w, ["lpm", "fairway"], PROFILE, seed=0, progress=False)
    backlog = {p: rep["policies"][p]["ttft"]["backlog"]["max"] for p in ("lpm", "fairway")}
    flood = {p: rep["policies"][p]["ttft"]["flood"]["p50"] for p in ("lpm", "fairway")}
    assert backlog["fairway"] < 0.5 * backlog["lpm"]
    assert flood["fairway"] > flood["lpm"]  # the price: the flood's own median rises
    assert rep["simulated"] is True


@pytest.mark.slow
def test_requests_carry_their_labels() -> None:
    w = build_scenario("long-prompts", seed=0, quick=True, profile=PROFILE)
    for r in w.requests:
        assert isinstance(r, SimRequest)
        assert ("long" in r.labels) != ("short" in r.labels)
        assert ("long" in r.labels) == (r.prompt_tokens >= 7_500)


@pytest.mark.slow
def test_musique_prompts_share_passage_prefixes() -> None:
    w = build_scenario("musique", seed=0, quick=True, profile=PROFILE)
    firsts: dict[tuple[int, ...], int] = {}
    for r in w.requests:
        assert r.prompt_tokens > 1000  # ten passages of ~560 tokens
        key = r.block_hashes[:20]
        firsts[key] = firsts.get(key, 0) + 1
    assert max(firsts.values()) >= 2  # some prompts share at least 20 leading blocks


def test_sec_prompts_hit_mix_follows_one_report_share_and_the_corpus_size() -> None:
    """The spike calibration's hit-mix parameters: a prompt draws its excerpts from one
    report with probability ``one_report_share``, else from two; ``n_reports`` sizes the
    corpus its popularity spreads over."""
    corpus = SecCorpus(np.random.default_rng(0), n_reports=10, zipf_s=0.0)
    assert corpus.n_reports == 10 and len(corpus.popularity) == 10
    owner = {sid: r for r in range(10) for sid, _ in corpus.full_text(r)}

    def reports_per_prompt(share: float) -> list[int]:
        rng, ids = np.random.default_rng(1), _Ids(10_000_000)
        out = []
        for _ in range(300):
            segs = sec_prompt(corpus, rng, ids, one_report_share=share)
            out.append(len({owner[sid] for sid, _ in segs if sid in owner}))
        return out

    assert set(reports_per_prompt(1.0)) == {1}
    two = reports_per_prompt(0.0)
    # two draws from 10 equally popular reports coincide about a tenth of the time
    assert 0.8 < sum(n == 2 for n in two) / len(two) < 0.97
    assert set(two) <= {1, 2}
