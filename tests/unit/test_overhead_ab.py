"""The A/B overhead bench's arithmetic (pure; the runs themselves need the live app)."""

from __future__ import annotations

import pytest

from bench.live.overhead_ab import ratios, summary


def _run(p50: float, p99: float, prepare: float | None = None) -> dict:
    phases = {"route": {"p50": p50, "p99": p99}}
    if prepare is not None:
        phases["prepare"] = {"p50": prepare, "p99": 2 * prepare}
    return {"ingress_overhead_s": {"p50": 10 * p50, "p99": 10 * p99}, "phases_s": phases}


def test_the_summary_is_the_median_over_runs_of_each_runs_quantile() -> None:
    s = summary([_run(1.0, 5.0), _run(3.0, 4.0, 0.5), _run(2.0, 100.0)])
    assert s["route"] == {"p50": 2.0, "p99": 5.0}
    assert s["overhead"] == {"p50": 20.0, "p99": 50.0}
    assert s["prepare"] == {"p50": 0.5, "p99": 1.0}  # only the run that has it
    assert s["cold_start"] == {"p50": None, "p99": None}


def test_ratios_are_after_over_before_and_none_where_either_is_missing() -> None:
    before = summary([_run(2.0, 4.0)])
    after = summary([_run(3.0, 2.0, 1.0)])
    r = ratios(before, after)
    assert r["route"]["p50"] == pytest.approx(1.5)
    assert r["route"]["p99"] == pytest.approx(0.5)
    assert r["prepare"] == {"p50": None, "p99": None}  # no "before" value
