"""The decode-admission interface: frozen views in, per-request decisions out.

Who calls what, and when (one decode replica, one engine step at a time)::

    after step t completes:   state = policy.observe(DecodeObservation(...))   # monitor
    before step t+1 starts:   decisions = policy.admit(DecodeView(...))        # gate

The mechanism (the vLLM scheduler plug-in in ``engines/``, or the simulator in
``bench/``) builds both snapshots from its own state, calls the policy, and then admits
the requests whose decision is ``admit`` or ``force_admit`` *in the order returned*.
The policy never touches the engine's queues, allocator or chunking; the engine's
allocator may still delay an admitted request (KV full): that is not the policy's
business, and the request reappears in the next view as waiting.

Units: tokens and blocks are ``int``; times are seconds (``float``) from one monotonic
clock; waits are given both in decode steps (``wait_steps``, what ``T_max`` counts) and
in seconds (``wait_s``, what the fairness term uses).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

Action = Literal["admit", "force_admit", "hold"]
"""``admit``: passed the gate. ``force_admit``: waited past ``T_max``, bypassed both
checks. ``hold``: stays waiting this step."""


@dataclass(frozen=True, slots=True)
class WaitingRequestView:
    """One request waiting for admission at this decode replica.

    ``prompt_blocks``: KV blocks the request's prompt needs here (colocated: to be
    prefilled; pd: arriving as KV from the prefill replica). ``l_hat``: the expected
    output length ``L_hat`` (tokens), filled by the mechanism from
    :func:`controllers.decode.twp.l_hat` (or any estimate it prefers for baselines).
    ``wait_steps``: decode steps this request has waited at this replica; ``wait_s``: the
    same wait in seconds.
    """

    request_id: str
    tenant: str
    prompt_tokens: int
    prompt_blocks: int
    max_tokens: int
    l_hat: int
    wait_steps: int
    wait_s: float


@dataclass(frozen=True, slots=True)
class RunningRequestView:
    """One active request: ``generated_tokens`` so far and its ``L_hat`` (tokens)."""

    request_id: str
    generated_tokens: int
    l_hat: int
    tenant: str = ""

    @property
    def remaining(self) -> int:
        """The paper's ``r_i = max(1, L_hat_i - generated_i)`` (tokens)."""
        return max(1, self.l_hat - self.generated_tokens)


@dataclass(frozen=True, slots=True)
class EngineView:
    """The engine as the gate sees it, before step ``step_index`` runs.

    ``last_step_latency_s``: wall time of the previous step (0.0 before the first);
    ``queue_depth``: waiting requests at this replica (the paper's ``q_t``).
    """

    free_blocks: int
    total_blocks: int
    last_step_latency_s: float
    queue_depth: int
    step_index: int


@dataclass(frozen=True, slots=True)
class DecodeView:
    """A frozen snapshot for one admission decision.

    ``waiting`` is in the mechanism's arrival order (oldest first); policies rank it
    themselves. ``running`` is the active set ``A_t``.
    """

    waiting: tuple[WaitingRequestView, ...]
    running: tuple[RunningRequestView, ...]
    engine: EngineView

    @classmethod
    def of(
        cls,
        waiting: Sequence[WaitingRequestView],
        running: Sequence[RunningRequestView],
        engine: EngineView,
    ) -> DecodeView:
        return cls(tuple(waiting), tuple(running), engine)

    @property
    def token_load(self) -> int:
        """``K_t = sum_{i in A_t} r_i`` (tokens)."""
        return sum(r.remaining for r in self.running)

    @property
    def batch_size(self) -> int:
        """``B_t = |A_t|``."""
        return len(self.running)


@dataclass(frozen=True, slots=True)
class AdmissionDecision:
    """What the gate decided for one waiting request, and why (``reason`` names the rule)."""

    request_id: str
    action: Action
    reason: str

    @property
    def admitted(self) -> bool:
        return self.action != "hold"


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    """A request that finished in the observed step: its tenant and output length (tokens)."""

    tenant: str
    output_tokens: int


@dataclass(frozen=True, slots=True)
class DecodeObservation:
    """What the monitor saw when step ``step_index`` completed.

    ``step_latency_s``: the step's wall time, i.e. the paper's ``l_t`` (prefill chunks
    or KV injection in the step included: that is the noisy-neighbour signal).
    ``free_blocks`` / ``total_blocks``: KV state after the step. ``queue_depth``: ``q_t``.
    ``finished``: requests that completed in this step (feeds the per-tenant medians).
    """

    step_index: int
    step_latency_s: float
    free_blocks: int
    total_blocks: int
    queue_depth: int
    batch_size: int
    finished: tuple[FinishedRequest, ...] = ()


@runtime_checkable
class DecodeAdmissionPolicy(Protocol):
    """A stateful admission policy object (its state is explicit and inspectable).

    ``observe`` is called once after every engine step; ``admit`` once before every
    step in which requests wait. ``admit`` returns one decision per waiting request,
    admitted ones first, in the order the mechanism must admit them.
    """

    name: str
    prefill_chunk_tokens: int | None
    """Colocated mode: prompt tokens prefilled per admitted request per step
    (``None``: the engine's own token budget, i.e. one shot for the prompts here)."""

    def observe(self, obs: DecodeObservation) -> None: ...

    def admit(self, view: DecodeView) -> list[AdmissionDecision]: ...

    def expected_output(self, tenant: str, max_tokens: int, generated: int = 0) -> int:
        """``L_hat`` of a request of ``tenant`` that has ``generated`` tokens so far."""
        ...
