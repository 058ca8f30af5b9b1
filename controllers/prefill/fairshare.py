"""Fair shares among tenants at the prefill queue, measured in uncached prompt tokens.

An optional outer layer over any prefill policy (Fairway by default; off unless configured,
so Fairway runs as the paper has it). The inner policy orders each tenant's own requests; this
layer decides whose turn it is, so a tenant that floods the queue cannot push another
tenant's requests back by more than its own share of the compute.

It is deficit round-robin in its virtual-time form (start-time fair queuing, as in SFQ and
the "virtual token counter" of fair LLM serving): each tenant has ``served``, the prefill tokens
the engine computed for it; the next request goes to the backlogged tenant with the least
``served`` plus what it was already given in this order. The unit is the paper's work charge
``c_r = max(1, uncached tokens)``, so a cached prompt costs its tenant little. Choices, where
the papers are silent:

- ``served`` moves only on what the engine *actually* scheduled (``observe_step``: the
  tokens of each step per request), never on a plan that was not carried out;
- a tenant that returns after being idle starts at the least ``served`` among the tenants
  backlogged then, less ``burst_credit_tokens`` (and never below its own ``served``): SFQ
  gives no credit for idle time, so a light tenant's burst of a few requests would be served
  at half speed behind a flooding one; a bounded credit lets the burst through at once, while
  the credit caps how far it can jump ahead (the flooding tenant still gets everything the
  light one leaves). ``burst_credit_tokens=0`` is plain SFQ. Ties go to the tenant that just
  joined (the others' next request starts after the one they have in service, as SFQ's start
  tags have it);
- a tenant this share has never served counts as served 0, so its credit is at most what
  the tenants in service have been served: the service they had while it was absent, the
  same measure as a returning tenant's idle time. Tried and reverted (issue 39): a tenant
  never served starting at the floor, the whole credit below the least served. It gave a
  light tenant arriving in an engine's first minute the whole credit, but it gives it to
  whichever tenant joins second, and at an engine's start that can be the flood: in a
  closed-loop run whose light tenant sent its first prompt 20 ms before the flood's, the
  flood's prompts went 16,384 tokens ahead of the light tenant's next two (51 s against
  the peer's 12 s);
- a tenant is the request's ``tenant`` up to the first ``:`` (the ingress's cache namespace:
  the tenant, or its cache group, then the request's own ``cache_salt``); tenants sharing a
  cache group share a share;
- equal weights;
- **running prefill chunks are in the share too** (:func:`chunk_turns`). vLLM schedules
  every running request before any waiting one, so a flood's prompts already in progress
  (a long prompt runs in chunks over several steps) would take each step's budget ahead of
  a light tenant's waiting request whatever this order says. The mechanism asks
  :meth:`TenantFairShare.chunk_turns` each step: running chunks go in the order of their
  tenants' ``served`` (least first), and the chunks of tenants served more than the least
  served tenant with a waiting request sit that step out, with their tenants' waiting
  requests (so the budget goes to the tenant whose turn it is, not to a new request of the
  tenant that yielded).

State is explicit (``served``, ``backlogged``, ``running``); ``order`` changes only the backlog
bookkeeping, ``chunk_turns`` only ``running``.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from controllers.prefill.base import PrefillPolicy, PrefillQueueView, PrefillRequestView


def tenant_key(tenant: str) -> str:
    """The fair-share key of a request's ``tenant`` (see the module docstring)."""
    return tenant.split(":", 1)[0]


@dataclass
class FairShareState:
    """Tokens served per tenant, the tenants backlogged at the last ``order``, the tenants
    with prompts running in chunks at the last ``chunk_turns``, and which tenant each
    recently queued request belongs to (to charge ``observe_step``'s tokens)."""

    served: dict[str, float] = field(default_factory=dict)
    backlogged: frozenset[str] = frozenset()
    running: frozenset[str] = frozenset()
    owner: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ChunkTurns:
    """One step's turns for running prefill chunks: ``order``, the ids of the running chunks
    that go, as they should go (their tenants' least ``served`` first, ties as given);
    ``sit_out``, the ids, running or waiting, of the tenants whose turn is later."""

    order: tuple[str, ...]
    sit_out: frozenset[str]


def chunk_turns(
    served: Mapping[str, float],
    running: Sequence[tuple[str, str]],
    waiting: Sequence[tuple[str, str]],
) -> ChunkTurns:
    """Start-time fair queuing over running prefill chunks as well as waiting requests.

    ``running``: ``(request id, tenant)`` of each running prefill chunk, in vLLM's running
    order; ``waiting``: the same for the waiting requests (tenants as fair-share keys). A
    running chunk goes before another whose tenant was served more. A tenant with a running
    chunk is *late* when some tenant with a waiting request was served less: that tenant's
    turn comes first, and vLLM would give the budget to every running chunk before any
    waiting request. The late tenants sit the step out, their running chunks and their
    waiting requests, and so does every waiting request of a tenant served at least as much
    as the least served late one (its turn is after the late tenant's, so it must not take
    the step the late tenant gave up). Equal ``served`` never makes a tenant late, so
    tenants at par share steps as vLLM orders them."""
    least_waiting = min((served.get(t, 0.0) for _, t in waiting), default=math.inf)
    late = {t for _, t in running if served.get(t, 0.0) > least_waiting}
    going = sorted(
        (r for r in running if r[1] not in late), key=lambda r: served.get(r[1], 0.0)
    )  # a stable sort: ties keep vLLM's order
    if not late:
        return ChunkTurns(tuple(rid for rid, _ in going), frozenset())
    after = min(served.get(t, 0.0) for t in late)
    sit_out = frozenset(
        [rid for rid, t in running if t in late]
        + [rid for rid, t in waiting if t in late or served.get(t, 0.0) >= after]
    )
    return ChunkTurns(tuple(rid for rid, _ in going), sit_out)


class TenantFairShare:
    """``inner``'s order within each tenant; tenants' turns by least tokens served."""

    def __init__(
        self,
        inner: PrefillPolicy,
        burst_credit_tokens: float = 16384.0,
        state: FairShareState | None = None,
    ) -> None:
        if burst_credit_tokens < 0:
            raise ValueError(f"burst_credit_tokens must be >= 0, got {burst_credit_tokens}")
        self.inner = inner
        self.burst_credit_tokens = burst_credit_tokens
        self.name = f"{inner.name}+fair_share"
        self.state = state or FairShareState()
        self._inner_observe = getattr(inner, "observe_step", None)

    def order(self, queue: PrefillQueueView, now: float) -> list[str]:
        inner = self.inner.order(queue, now)
        by_id = {r.request_id: r for r in queue.requests}
        lanes: dict[str, deque[PrefillRequestView]] = {}
        for rid in inner:
            r = by_id[rid]
            lanes.setdefault(tenant_key(r.tenant), deque()).append(r)
        joined = self._join(frozenset(lanes))
        st = self.state
        for r in queue.requests:
            st.owner[r.request_id] = tenant_key(r.tenant)
        # ties go to a tenant that just joined: the others' next request starts after the
        # one they have in service (SFQ's start tags), a joiner's at the current floor
        heap = [(st.served.get(t, 0.0), 0 if t in joined else 1, t) for t in lanes]
        heapq.heapify(heap)
        out: list[str] = []
        while heap:
            given, _, t = heapq.heappop(heap)
            r = lanes[t].popleft()
            out.append(r.request_id)
            if lanes[t]:
                heapq.heappush(heap, (given + r.work, 1, t))
        return out

    def _join(self, now_backlogged: frozenset[str]) -> frozenset[str]:
        """Tenants newly backlogged start at the least ``served`` of those that stayed;
        returns the newcomers."""
        st = self.state
        # a tenant whose prompts were running in chunks stayed in service (chunk_turns saw it)
        # even with nothing waiting: a newcomer is floored against it too
        stayed = (now_backlogged & st.backlogged) | st.running
        joined = now_backlogged - st.backlogged - st.running
        if stayed:
            floor = min(st.served.get(t, 0.0) for t in stayed) - self.burst_credit_tokens
            for t in joined:  # one never served counts as 0 (module docstring)
                st.served[t] = max(st.served.get(t, 0.0), floor)
        st.backlogged = now_backlogged
        return joined

    def chunk_turns(self, running: Sequence[str], waiting: Sequence[str]) -> ChunkTurns:
        """:func:`chunk_turns` on this share's ``served``, from request ids (the running
        prefill chunks in vLLM's order, the waiting requests), each request's tenant as
        :meth:`order` saw it (one it never saw counts as tenant ``""``)."""
        st = self.state
        owner = st.owner
        ran = []
        for rid in running:  # each made newest again, so pruning keeps one still in service
            t = owner.pop(rid, None)
            if t is not None:
                owner[rid] = t
            ran.append((rid, t or ""))
        st.running = frozenset(t for _, t in ran)
        return chunk_turns(st.served, ran, [(rid, owner.get(rid, "")) for rid in waiting])

    def observe_step(self, scheduled: Sequence[tuple[str, int]], now: float) -> None:
        """Charge each tenant the tokens the engine computed for it this step."""
        st = self.state
        for rid, n in scheduled:
            t = st.owner.get(rid)
            if t is not None:
                st.served[t] = st.served.get(t, 0.0) + n
        if len(st.owner) > 100_000:  # requests long gone: keep the newest half
            for rid in list(st.owner)[: len(st.owner) // 2]:
                del st.owner[rid]
        if self._inner_observe is not None:
            self._inner_observe(list(scheduled), now)
