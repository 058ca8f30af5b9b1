"""The prefill-ordering interface: frozen queue views in, a new order out.

A prefill policy is called once per engine scheduling step by its mechanism (the
vLLM scheduler plug-in in ``engines/``, or the simulator in ``bench/``) with a frozen
snapshot of the waiting queue and the time ``now`` (seconds, same monotonic clock as
the arrival times). It returns the request ids in the order the engine should try
to admit them. It never mutates the queue; the mechanism keeps the budget loop,
chunking, allocation and preemption (docs/design.md, shapes 1 and 2).

Per request, only ``cached_tokens``/``uncached_tokens`` and the wait move between
steps; ``patience_s`` is computed once at arrival (:func:`patience_s`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from controllers.config import FairwayConfig
from controllers.profile import EngineProfile


@dataclass(frozen=True, slots=True)
class PrefillRequestView:
    """One waiting request as a prefill policy sees it.

    ``cached_tokens`` is ``h_r`` (cached prefix, re-read by the mechanism every step);
    ``uncached_tokens`` is the prompt work still to compute. ``work`` is the paper's
    ``c_r = max(1, uncached_tokens)``.
    """

    request_id: str
    arrival_s: float
    prompt_tokens: int
    patience_s: float
    cached_tokens: int
    uncached_tokens: int
    block_hashes: tuple[int, ...] = ()
    tenant: str = ""

    @property
    def work(self) -> int:
        return max(1, self.uncached_tokens)


@dataclass(frozen=True, slots=True)
class PrefillQueueView:
    """A frozen snapshot of the waiting queue, in the mechanism's current order."""

    requests: tuple[PrefillRequestView, ...]

    @classmethod
    def of(cls, requests: Sequence[PrefillRequestView]) -> PrefillQueueView:
        return cls(tuple(requests))

    def __len__(self) -> int:
        return len(self.requests)


@runtime_checkable
class PrefillPolicy(Protocol):
    """Orders the waiting queue. Implementations are pure (or hold explicit state)."""

    name: str

    def order(self, queue: PrefillQueueView, now: float) -> list[str]:
        """Return every request id of ``queue`` exactly once, first-to-admit first."""
        ...


@runtime_checkable
class ProtectingPolicy(PrefillPolicy, Protocol):
    """A policy that also asks the cache to keep some blocks (PEEK-like)."""

    def protected_blocks(self, queue: PrefillQueueView, now: float) -> frozenset[int]:
        """Block hashes the engine or simulator should not evict while others can go."""
        ...


class LanedPolicy(PrefillPolicy, Protocol):
    """A policy that places each request through a named lane and says which (Fairway's
    ``fast`` and ``fair`` lanes).

    A capability a policy declares by having :meth:`order_with_lanes`; a mechanism that
    reports placements (the engine plug-ins' admission records and per-step lane counts)
    asks for it with ``getattr(policy, "order_with_lanes", None)``, as it asks for
    ``observe_step``, never by the policy's type. Without it a policy's requests carry no lane.
    """

    def order_with_lanes(self, queue: PrefillQueueView, now: float) -> tuple[list[str], list[str]]:
        """:meth:`order`'s ids and, for each, the name of the lane that placed it."""
        ...


def patience_s(
    prompt_tokens: int, profile: EngineProfile, config: FairwayConfig | None = None
) -> float:
    """The paper's patience ``SLO_r = max(slo_floor_s, slo_multiplier * T_idle(full prompt))``.

    Uses the FULL prompt length, not the remaining work: the full length is fixed
    for a request, the remaining work moves with the cache and already enters the
    reuse ratio. Computed once per request at arrival.
    """
    cfg = config or FairwayConfig()
    return max(cfg.slo_floor_s, cfg.slo_multiplier * profile.prefill_seconds(prompt_tokens))


def arrival_order(reqs: Sequence[PrefillRequestView]) -> list[int]:
    """Indices of ``reqs`` oldest first; ties by position in the view (deterministic)."""
    return sorted(range(len(reqs)), key=lambda i: (reqs[i].arrival_s, i))
