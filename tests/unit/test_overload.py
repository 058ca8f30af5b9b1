"""Overload control by expected queueing time (Little's law)."""

from __future__ import annotations

import pytest

from controllers.overload import CompletionRate, expected_wait_s, refuse_for


def test_completion_rate_over_a_sliding_window() -> None:
    r = CompletionRate(window_s=10)
    assert r.rate() is None  # nothing seen
    r.add(0.0, 100)
    r.add(0.5, 105)
    assert r.rate() is None  # under a second apart: not yet a rate
    r.add(2.0, 120)
    assert r.rate() == pytest.approx(10.0)
    for t in range(3, 30):  # 2 per second from here on
        r.add(float(t), 120 + 2 * (t - 2))
    assert r.rate() == pytest.approx(2.0, rel=0.1)  # the old 10/s fell out of the window
    r.add(30.0, 5)  # a count that went down (a replica replaced): afresh
    assert r.rate() is None
    r.add(31.0, 5)
    assert r.rate() is None  # none completed: unknown, not zero
    with pytest.raises(ValueError, match="window_s"):
        CompletionRate(window_s=0)


def test_a_rate_from_a_few_completions_is_unknown() -> None:
    """Start-up: one completion in 20 s is not a capacity of 0.05/s (4 queued would read as
    80 s and be refused); below ``min_completions`` the bound does not refuse."""
    r = CompletionRate(window_s=20, min_completions=8)
    r.add(0.0, 0)
    r.add(20.0, 1)
    assert r.rate() is None and expected_wait_s(4, r.rate()) is None
    r.add(21.0, 8)
    assert r.rate() == pytest.approx(8 / 21)


def test_little_law_wait_and_the_refusal() -> None:
    assert expected_wait_s(60, 2.0) == 30.0
    assert expected_wait_s(5, None) is None and expected_wait_s(5, 0.0) is None
    assert refuse_for(30.0, 30.0) is None  # at the bound: admitted
    assert refuse_for(30.2, 30.0) == 1  # at least one second
    assert refuse_for(45.0, 30.0) == 15  # about the time the excess takes to drain
    assert refuse_for(None, 30.0) is None  # rate unknown: this bound does not refuse
    assert refuse_for(1e6, 0) is None  # 0: off
