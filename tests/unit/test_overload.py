"""Overload control by expected queueing time (Little's law)."""

from __future__ import annotations

import pytest

from controllers.overload import (
    CompletionRate,
    expected_wait_s,
    past_ceiling,
    refuse_for,
    reused,
    share_ahead,
    spared,
)


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
    r.add(10.0, 1)
    assert r.rate() is None and expected_wait_s(4, r.rate()) is None
    r.add(19.0, 8)
    assert r.rate() == pytest.approx(8 / 19)
    r.add(20.0, 8)  # the sample at 0 s left the window: 7 completions from 10 s on
    assert r.rate() is None


def test_the_rate_after_idle_time_counts_the_busy_seconds_only() -> None:
    """Issue 39's ``open0.9/rag`` cell: a warm-up completed 8 requests by 4 s, nothing
    arrived (so nothing was sampled) for a minute, then a replay arrived every 0.75 s while
    the engines completed 1.3/s. The rate spanning the idle minute read 0.27/s 15 s into the
    replay, and 9 requests waiting read as 33 s, past the 30 s bound; counting inside the
    window only, the rate is unknown until 8 completions fall between samples inside it, and
    then reads the engines' 1.3/s."""
    r = CompletionRate(window_s=20, min_completions=8)
    for t in range(5):  # the warm-up, sampled each second
        r.add(float(t), 2 * t)
    assert r.rate() == pytest.approx(2.0)
    t, rates = 60.0, []
    while t <= 75.0:  # the replay's arrivals, after the idle minute
        r.add(t, 8 + int(1.3 * (t - 60.0)))
        rates.append((t, r.rate()))
        t += 0.75
    assert all(rate is None for at, rate in rates if at < 66.0)  # fewer than 8 seen since 60 s
    assert rates[-1][1] == pytest.approx(1.3, rel=0.1)
    wait = expected_wait_s(9, rates[-1][1])
    assert wait is not None and wait < 30.0


def test_little_law_wait_and_the_refusal() -> None:
    assert expected_wait_s(60, 2.0) == 30.0
    assert expected_wait_s(5, None) is None and expected_wait_s(5, 0.0) is None
    assert refuse_for(30.0, 30.0) is None  # at the bound: admitted
    assert refuse_for(30.2, 30.0) == 1  # at least one second
    assert refuse_for(45.0, 30.0) == 15  # about the time the excess takes to drain
    assert refuse_for(None, 30.0) is None  # rate unknown: this bound does not refuse
    assert refuse_for(1e6, 0) is None  # 0: off


def test_past_a_bound_the_tenant_below_its_share_is_spared() -> None:
    """Who a bound refuses (issue 39's multi_tenant cell: the wait bound refused the quiet
    tenant's request beside a flood): a tenant that with its request would still hold less
    than an equal share of the prompts in flight is spared, the others are not, and nobody
    is spared past the ceiling."""
    flood = {"flood": 30, "quiet": 1}
    assert spared("quiet", flood) and not spared("flood", flood)  # 2 x 2 < 32; 31 x 2 >= 32
    assert spared("new", flood)  # nothing in flight yet: 1 x 3 < 32
    assert not spared("a", {"a": 5, "b": 5}) and not spared("b", {"a": 5, "b": 5})
    assert not spared("alone", {"alone": 9}) and not spared("alone", {})  # refused as before
    # three tenants, 18 in flight: a (12) is at twice the mean; b (4) and c (2) below it
    three = {"a": 12, "b": 4, "c": 2}
    assert [spared(t, three) for t in "abc"] == [False, True, True]
    # the request's own prompts count: b's batch of 5 would take it to 9 of 23, past the
    # mean of 7.7; of 2, to 6 of 20, still below 6.7
    assert not spared("b", three, adding=5) and spared("b", three, adding=2)
    assert not spared("new", {}, adding=100)  # one batch alone is all of the share
    # at the mean after admission is not below it: a third tenant's second prompt beside
    # 3 and 1 would make 2 of 6
    assert not spared("c", {"a": 3, "b": 1, "c": 1}) and spared("c", {"a": 3, "b": 1})
    # the ceiling: spared up to the factor times the bound, never past it; 1 spares nobody
    assert not past_ceiling(60.0, 30.0, 2.0) and past_ceiling(60.5, 30.0, 2.0)
    assert past_ceiling(31.0, 30.0, 1.0)


def test_past_a_bound_a_mostly_cached_prompt_is_spared() -> None:
    """The docstring's worked examples (issue 39's cache_pressure cell: 1,536 of 1,632 tokens
    cached for a repeated document), the threshold itself, and 0 turning it off."""
    assert reused(1632, 96, 0.5)  # 0.94 cached
    assert not reused(1632, 832, 0.5)  # 800 of 1,632 cached: 0.49
    assert reused(1000, 500, 0.5) and not reused(1000, 501, 0.5)
    assert not reused(1632, 0, 0.0)  # off: nobody is spared for reuse
    assert not reused(0, 0, 0.5)  # an empty prompt has nothing cached
    assert reused(100, -5, 1.0)  # a stale count below zero is all cached, not more


def test_the_part_of_the_queue_the_fair_share_serves_before_a_request() -> None:
    """The docstring's worked examples (issue 39's ``multi_tenant`` cell at 1.2x: the quiet
    tenant's requests were refused at a whole queue's wait past the ceiling, while the
    share served them ahead of nearly all of it), and the edges."""
    assert share_ahead("quiet", {"flood": 30, "quiet": 1}) == pytest.approx(4 / 32)
    assert share_ahead("a", {"a": 5, "b": 5}) == 1.0  # at par: everything is ahead
    assert share_ahead("c", {"a": 12, "b": 4, "c": 2}) == pytest.approx(9 / 19)
    assert share_ahead("alone", {}) == 1.0 and share_ahead("alone", {"alone": 9}) == 1.0
    assert share_ahead("new", {}, adding=0) == 1.0  # nothing at all in flight
    # a tenant with fewer prompts than the request's tenant will hold has all of its own
    # ahead: b's 1 and the flood's 3 of 40, with c's 3
    assert share_ahead("c", {"flood": 40, "b": 1, "c": 2}) == pytest.approx(7 / 44)
    # the request's own prompts count: a batch of 9 beside a flood of 30 puts 9 of the
    # flood's ahead, 18 of 39
    assert share_ahead("quiet", {"flood": 30}, adding=9) == pytest.approx(18 / 39)
    # many light tenants: each counts the others' ahead, so the part grows with them
    light = {f"t{i}": 1 for i in range(20)} | {"flood": 30}
    assert share_ahead("t0", light) > 0.4 > share_ahead("quiet", {"flood": 30, "quiet": 1})
    # counts below zero (a stale release) count as none
    assert share_ahead("q", {"flood": -3, "q": 0}) == 1.0
