"""Overload control by expected queueing time (Little's law), pure.

The ingress's count bounds (requests and uncached tokens queued per prefill replica) hold
the prefill queue; they do not see the decode side, and a count that is right for one model
and machine is wrong for another. Measured with ``pdserve bench soak`` at 1.5x saturation on
the cluster config: with the count bounds alone, requests queued until the engine time-out
(120 s) and 439 of 1,233 ended in 504s. This bound is in seconds, which is what clients feel:

    W = L / lambda

``L``: requests waiting in the engines now (queued, not yet running: prefill and decode, from
the replicas' reports); ``lambda``: requests the engines completed per second over the last
``window_s`` (from the same reports' cumulative counts). ``W`` is then the time the queue
ahead of a new request takes to drain. When it passes ``max_expected_wait_s`` a new request
is refused at once with 503 and ``Retry-After`` (about the time the excess takes to drain).
With fewer than ``min_completions`` completions in the window (start-up, a lull, idle time)
the rate is unknown and this bound does not refuse: from one or two completions ``W`` is
noise (one request finished in 20 s reads as 0.05/s, and 4 requests queued behind a decode
gate then read as 80 s), and it refused clients of an app just started (seen in the
hostile-tenant suite: a victim's stream got 503 while the engines were far from saturated).
The count bounds still hold meanwhile.

Why waiting and not waiting + running: ``lambda`` is the engines' capacity only while they
are saturated; below saturation it is the offered load. Counting running requests made the
bound refuse clients of an idle system: one request at a time whose service takes ``T``
seconds gives ``lambda = 1/T``, so every request counted reads as ``T`` seconds of wait, and a
few long prompts in the engines (or one seen in two reports) passed 30 s: 2 of 30 requests
got 503 at one stream on the ``bench`` model (``pdserve bench compare --concurrency 1``).
Requests wait in an engine only when it is saturated, which is when ``lambda`` measures its
capacity.

**Who is refused.** Past a bound, a request is refused when its tenant, with the request's
prompts, would hold at least an equal share of the prompts this ingress has in flight at the
prefill (:func:`spared`); a tenant that would stay below it is admitted while the load stays
under ``spare_factor`` times the bound (``ingress.overload_spare_factor``), and refused above
that like everyone. Seen live (issue 39's ``multi_tenant`` cell,
``docs/design/matrix_39_causes.md``): a flooding tenant took the engines past the 30 s bound,
and the bound then refused a quiet tenant's request, whose tenant held one prompt against the
flood's dozens: the refusal fell on the tenant that was not the cause. With the rule the
flooding tenant's own requests are refused (it is always at or above the mean, so a lone
tenant, or tenants flooding alike, are refused as before), and a quiet tenant's few requests
go on to the prefill, where the tenants' fair share (``fair_share: true``) serves them ahead
of the flood's backlog. The ceiling keeps many light tenants together from taking the queue
past twice its bound (the wait bound's, with the share on, as below), and counting the request's own prompts keeps one batch from carrying a
tenant past its share. For the wait bound, when the prefill engines keep the tenants' fair
share, the ceiling of a tenant below its share reads the wait ahead of its request under
that share (:func:`share_ahead`), not the whole queue's: the flood's backlog is not ahead of
it. The whole queue may then pass twice the wait bound, by the light tenants' own work
only (each counts the others' prompts ahead of its own, so together they reach the ceiling),
which the share serves before the flood's backlog; the count bounds' ceilings still cap the
queue. Shares are counted at this ingress (each ingress replica sees its own part of every
tenant's traffic); choices, where the papers are silent: equal weights, and a
tenant is the request's tenant (the ingress's, not the cache group).

**Which requests are spared besides.** Past a bound, a request whose prompts are mostly
cached (:func:`reused`, ``ingress.overload_spare_reuse``) is spared up to the same ceiling:
it costs the prefill little and Fairway serves it first, so refusing it saves others almost
nothing and loses a request that would have been quick.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping


class CompletionRate:
    """Completions per second from samples of a cumulative count, over a sliding window.

    Only samples inside the window count (those younger than ``window_s``): the rate spans the
    first and last of them. Why (issue 39's ``open0.9/rag`` cell,
    ``docs/design/matrix_39_causes.md``): the ingress samples with each arrival, so after
    idle time (a warm-up, then a pause, then a replay) the next sample came a minute after
    the one before; keeping the last sample older than the window then stretched the rate's
    span over the idle gap, the completions of the busy seconds were divided by the idle
    ones too, and the rate read 0.18/s where the engines completed 1.3/s: the wait bound
    refused 2 requests 15 s into the replay with the engines far from saturated. Counting
    inside the window only, the rate after a gap is unknown (nothing refused by this bound)
    until ``min_completions`` completions fall between samples inside it. Under steady
    arrivals the span lost is at most one gap between arrivals.
    """

    def __init__(self, window_s: float = 20.0, min_completions: int = 8) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0 (got {window_s})")
        self.window_s = window_s
        self.min_completions = max(1, min_completions)
        self._samples: deque[tuple[float, int]] = deque()

    def add(self, now: float, total: int) -> None:
        """The cumulative count ``total`` seen at ``now`` (a count that went down, a replica
        replaced, starts the window afresh)."""
        if self._samples and total < self._samples[-1][1]:
            self._samples.clear()
        self._samples.append((now, total))
        while self._samples[0][0] <= now - self.window_s:
            self._samples.popleft()

    def rate(self) -> float | None:
        """Completions per second between the first and last samples inside the window;
        ``None`` before two such samples a second apart or while fewer than
        ``min_completions`` completed between them (unknown, not zero: an idle system is not
        slow, and a rate from one or two completions is noise)."""
        if len(self._samples) < 2:
            return None
        (t0, n0), (t1, n1) = self._samples[0], self._samples[-1]
        if t1 - t0 < 1.0 or n1 - n0 < self.min_completions:
            return None
        return (n1 - n0) / (t1 - t0)


def expected_wait_s(waiting: float, rate: float | None) -> float | None:
    """Little's law: ``waiting / rate`` seconds; ``None`` when the rate is unknown."""
    if rate is None or rate <= 0:
        return None
    return max(0, waiting) / rate


def refuse_for(wait_s: float | None, bound_s: float) -> int | None:
    """``Retry-After`` seconds when ``wait_s`` passes ``bound_s`` (the excess, at least 1),
    else ``None``. ``bound_s`` of 0 turns the check off."""
    if not bound_s or wait_s is None or wait_s <= bound_s:
        return None
    return max(1, math.ceil(wait_s - bound_s))


def spared(tenant: str, inflight: Mapping[str, int], adding: int = 1) -> bool:
    """Whether ``tenant``'s request of ``adding`` prompts is spared a refusal at a bound: with
    them its tenant would still hold less than an equal share of the prompts in flight
    (``inflight``: per tenant; the tenants counted are those with a prompt in flight, and
    ``tenant`` itself). Counting the request's own prompts keeps one batch from carrying a
    tenant past its share. Worked examples, one prompt each: a flood of 30 and a quiet
    tenant's 1, the quiet one is spared ((1 + 1) x 2 < 32) and the flood is not (31 x 2 >=
    32); two tenants at 5 each, neither (6 x 2 >= 11); a tenant alone, never (its share is
    all)."""
    active = {t for t, n in inflight.items() if n > 0} | {tenant}
    total = sum(max(0, n) for n in inflight.values()) + adding
    return (max(0, inflight.get(tenant, 0)) + adding) * len(active) < total


def share_ahead(tenant: str, inflight: Mapping[str, int], adding: int = 1) -> float:
    """The part of the prompts in flight (``inflight``, per tenant, with the request's own
    ``adding``) that the tenants' fair share at the prefill serves no later than the
    request's last prompt: its tenant's own, and from each other tenant as many as the
    request's tenant will then hold, since turns alternate between backlogged tenants (a
    tenant with fewer has all of its own ahead). 1.0 when nothing else is in flight.

    Why (issue 39's ``multi_tenant`` cell at 1.2x, ``docs/design/matrix_39_causes.md``): the
    wait bound's ceiling read the whole queue's wait for a quiet tenant's request too, and
    past twice the bound (69-83 s) it refused 3 of the quiet tenant's 12 requests, while the
    fair share put them ahead of nearly all of that queue (its admitted requests waited at
    most 40.7 s). For a tenant below its share (:func:`spared`) the ceiling reads the wait
    ahead of its request under the share instead (the ingress's wait check,
    ``deployments.ingress.admission``, scales the prefill's waiting requests by this part
    when the prefill engines keep the share; the decode's queue has no tenants' share and
    counts whole). Choices, where the papers are silent: prompts, not tokens (the share is
    kept in uncached tokens, which the ingress knows for its own prompts only; prompts of
    like size are the cells' case), and round-robin from par (the share's burst credit can
    put a returning tenant further ahead, so this errs toward a longer wait). Many light
    tenants together each count the others' prompts ahead, so the part grows with them and
    the ceiling still holds them back. Worked examples, one prompt each: a flood of 30 and
    a quiet tenant's 1, 4 of 32 (2 of the flood's, 2 its own); two tenants at 5, all 11;
    ``{a: 12, b: 4, c: 2}``, c's next is 9 of 19 (3 + 3 + 3)."""
    mine = max(0, inflight.get(tenant, 0)) + max(0, adding)
    others = [max(0, n) for t, n in inflight.items() if t != tenant]
    total = sum(others) + mine
    if total <= 0:
        return 1.0
    return (sum(min(n, mine) for n in others) + mine) / total


def reused(prompt_tokens: int, uncached_tokens: int, min_reuse: float) -> bool:
    """Whether a prompt is spared a refusal at a bound for what it reuses: at least
    ``min_reuse`` of its tokens are cached (``1 - uncached / prompt``); ``min_reuse`` 0 spares
    none this way.

    Why (issue 39's ``cache_pressure`` cell, ``docs/design/matrix_39_causes.md``): past the
    30 s wait bound one tenant alone was refused 24 of 172 requests, and 19 of those repeated
    a document already served, so they would have been cached: the admitted cached requests
    had a TTFT p50 of 5.7 s, the uncached 31.6 s, since Fairway serves high reuse first. The
    bound refused the requests that cost the prefill least and waited least. A cached prompt
    adds little prefill work for the others, and Fairway ranks it ahead, so the wait the
    bound speaks of is not its wait. It is spared up to the same ceiling as a tenant below
    its share (:func:`past_ceiling`): a tenant that sends only cached prompts cannot take the
    queue past twice its bound; what its outputs cost the decode is its rate limits'. Worked
    examples: 1,536 of 1,632 tokens cached at 0.5, spared (0.94); 800 of 1,632, not (0.49);
    an empty prompt is not spared."""
    if min_reuse <= 0 or prompt_tokens <= 0:
        return False
    return 1.0 - max(0, uncached_tokens) / prompt_tokens >= min_reuse


def past_ceiling(load: float, bound: float, spare_factor: float) -> bool:
    """Whether ``load`` is past the ceiling up to which tenants below their share are spared
    (``spare_factor`` times ``bound``; a factor of 1 spares nobody)."""
    return load > bound * spare_factor
