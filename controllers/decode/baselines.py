"""Decode-admission baselines of the paper's Table II (admission half of each pair).

Each baseline is a (dispatcher, admission) pair over the container pool; the dispatch
half lives in :mod:`controllers.decode.dispatch` and the pairing in
:mod:`controllers.decode.registry`. None of these gates chunks its prefill: in
``colocated`` mode an admitted prompt is prefilled within the engine's token budget
(vLLM's default chunked prefill with ``max_num_batched_tokens``), i.e. in one step for
the prompts here (``prefill_chunk_tokens = None``).

- :class:`FCFSAdmission`: "admit in arrival order; no concurrency bound" (FCFS and the
  admission of Round-Robin and ServerlessLLM). The engine's KV allocator is the only
  bound, as in stock vLLM.
- :class:`PriorityAdmission`: "admit in shortest-prompt-first order", otherwise as FCFS.
- :class:`DynamicBatchAdmission`: "cap batch size when ITL exceeds a static target; no
  token-level feedback": while the smoothed ITL exceeds ``itl_target_factor * l_min``
  (1.2 by default) it admits only up to ``batch_cap`` (B0) active requests; below the
  target it admits everything, as FCFS.
"""

from __future__ import annotations

from controllers.decode.base import AdmissionDecision, DecodeObservation, DecodeView
from controllers.decode.config import DynamicBatchConfig
from controllers.profile import EngineProfile


class FCFSAdmission:
    """Admit every waiting request, oldest first."""

    prefill_chunk_tokens: int | None = None

    def __init__(self, name: str = "fcfs", L_bar: int = 50) -> None:
        self.name = name
        self.L_bar = L_bar

    def observe(self, obs: DecodeObservation) -> None:
        return None

    def _order(self, view: DecodeView) -> list[int]:
        return list(range(len(view.waiting)))

    def admit(self, view: DecodeView) -> list[AdmissionDecision]:
        return [
            AdmissionDecision(view.waiting[i].request_id, "admit", "no_bound")
            for i in self._order(view)
        ]

    def expected_output(self, tenant: str, max_tokens: int, generated: int = 0) -> int:
        return max(1, min(max_tokens, self.L_bar))


class PriorityAdmission(FCFSAdmission):
    """Admit every waiting request, shortest prompt first (ties: oldest first)."""

    def __init__(self, name: str = "priority", L_bar: int = 50) -> None:
        super().__init__(name, L_bar)

    def _order(self, view: DecodeView) -> list[int]:
        return sorted(range(len(view.waiting)), key=lambda i: (view.waiting[i].prompt_tokens, i))


class DynamicBatchAdmission(FCFSAdmission):
    """FCFS with a batch cap that applies while the smoothed ITL is over a static target."""

    def __init__(
        self,
        profile: EngineProfile,
        config: DynamicBatchConfig | None = None,
        name: str = "dynamic_batch",
        L_bar: int = 50,
    ) -> None:
        super().__init__(name, L_bar)
        self.config = config or DynamicBatchConfig()
        self.l_min_s = profile.decode.l_min_s
        self.target_s = self.config.itl_target_factor * self.l_min_s
        self.cap = self.config.batch_cap or profile.decode.b0
        self.itl_hat_s = self.l_min_s
        self.capped_steps = 0

    def observe(self, obs: DecodeObservation) -> None:
        if obs.step_latency_s > 0:
            a = self.config.itl_filter
            self.itl_hat_s = (1 - a) * self.itl_hat_s + a * obs.step_latency_s

    def admit(self, view: DecodeView) -> list[AdmissionDecision]:
        if self.itl_hat_s <= self.target_s:
            return super().admit(view)
        self.capped_steps += 1
        room = max(0, self.cap - view.batch_size)
        out = []
        for k, w in enumerate(view.waiting):
            if k < room:
                out.append(AdmissionDecision(w.request_id, "admit", "under_cap"))
            else:
                out.append(AdmissionDecision(w.request_id, "hold", "batch_cap"))
        return out
