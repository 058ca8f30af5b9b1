"""Token Window Pacing (TWP): a token-window admission gate for decode (paper: seeds ``001_*``).

Pure functions over an explicit, frozen state (docs/design.md, shape 3)::

    state = init_state(TWPConfig(...), profile)           # once per replica
    # after every engine step t (the paper's Algorithm 1, steps 1-2: monitor, window):
    state = observe(state, DecodeObservation(...))
    # before step t+1 (steps 3-4: rank, gate):
    state, decisions = admit(state, DecodeView(...))
    # per new request, to fill WaitingRequestView.l_hat / RunningRequestView.l_hat:
    L_hat = l_hat(state, tenant, max_tokens)

Neither function mutates its arguments; ``state`` is replaced. :class:`TWP` wraps them in
the stateful :class:`~controllers.decode.base.DecodeAdmissionPolicy` object the simulator
and the engine plug-in call. The mechanism admits the ``admit``/``force_admit`` decisions
in the order returned and, in ``colocated`` mode, prefills each admitted prompt in chunks
of ``C`` tokens per step (:func:`prefill_chunk`); in ``pd`` mode the prompt arrives as KV
and :func:`headroom` is what the replica publishes to the router.

Quantities (paper names; tokens ``int``, seconds ``float``):

- ``r_i = max(1, L_hat_i - generated_i)``; token load ``K_t = sum r_i``; batch ``B_t``.
- ``L_hat = min(max_tokens, median of the tenant's recent output lengths)``; the running
  medians live in the state (``tenant_median``), fed by ``DecodeObservation.finished``.
- smoothed ITL ``l_hat_t`` (exponential filter, constant ``itl_filter``), slowdown
  ``sigma_t = l_hat_t / l_min``.
- ``H*_t = H0 (1 + min(1, q_t / Q)) / max(0.5, sigma_t)`` (eq. 3);
  ``H_{t+1} = clamp(H_t + gamma (H*_t - H_t), H_min, H_max)`` (eq. 4).
- KV guard ``delta_kv = clamp(delta_base + k * EWMA(blocks consumed per step) * horizon /
  total_blocks, delta_min, delta_max)`` as a fraction of the KV blocks.
- Ranking score ``w1 * min(1, wait_steps / T_max) + w2 * T(r) + w3 * wait_s / (wait_s +
  L_hat * l_min)`` with ``T(r) = exp(-|L_hat(r) - r_bar_t| / (r_bar_t + 1))`` (eq. 5).

Choices where the paper is silent or inconsistent (issue #5 defaults unless noted):

- ``H0 = B0 * L_bar`` (the paper's 400 = 8 x 50), ``Q = B0``, ``H_min = L_bar``,
  ``H_max = 2 * H0``; ``gamma = 0.15``, ``C = 64``, ``T_max = 200`` steps.
- The paper's Algorithm 1 divides the raw ``l_t`` by ``l_min`` while §IV-B uses the
  smoothed ``l_hat_t``; we use the smoothed one (the text's definition, Table I).
- Before any step is observed ``l_hat = l_min`` (``sigma = 1``) and ``H = H0``.
- "Blocks consumed per step" is the net fall of free blocks between two observations,
  floored at 0 (a step that frees more than it takes consumed none).
- The KV guard counts the request's own prompt blocks: a candidate passes when
  ``free_blocks - (prompt blocks admitted this step) - prompt_blocks_i > delta_kv *
  total_blocks``.
- Force-admit: every request with ``wait_steps > T_max`` is admitted first (in ranked
  order), bypassing both checks; its tokens and blocks still count against the gate for
  the remaining candidates. Force-admit means TWP stops holding it; the engine's
  allocator may still delay it.
- No skipping: the first candidate that fails either check closes the gate for the step.
- ``empty_batch_admit``: with no active request and nothing admitted yet, the top
  candidate is admitted even if ``r_i > H_t`` (the window cannot otherwise be below one
  request's ``L_hat`` when a tenant's median exceeds ``H_max``); the KV check still holds.
- ``r_bar_t`` is the mean ``r_i`` of the active batch; with an empty batch ``T(r) = 1``.
- Ties in the ranking go to the longer wait, then to the earlier position in the view.
- Before a tenant has finished requests, ``L_hat = min(max_tokens, L_bar)``.
- ``l_min`` tracking (an addition to the paper, used by the serving replicas): the paper
  profiles ``l_min`` once. A serving replica's lone stream is slower than a bare engine's
  (the replica's event loop, NIXL polling, streaming back to the ingress) and drifts with
  what else the node runs; a stale ``l_min`` reads that as overload and pins the window at
  ``H_min``. :class:`LMinTracker` re-estimates ``l_min`` as the median ITL of recent
  single-stream steps (one running request, nothing waiting), so a lone stream keeps
  ``sigma`` near 1 and only batch pressure narrows the window.
- ``survival_l_hat`` (off by default, an addition to the paper): see :func:`l_hat`.
  The mechanism re-reads ``l_hat(state, tenant, max_tokens, generated)`` for running
  requests every step when it is on.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from controllers.decode.base import (
    AdmissionDecision,
    DecodeObservation,
    DecodeView,
    WaitingRequestView,
)
from controllers.decode.config import TWPConfig
from controllers.profile import EngineProfile


@dataclass(frozen=True, slots=True)
class TWPParams:
    """Resolved numbers (profile + config), fixed for a replica's lifetime."""

    config: TWPConfig
    l_min_s: float
    B0: int
    H0: float
    Q: float
    H_min: float
    H_max: float


def resolve(config: TWPConfig, profile: EngineProfile) -> TWPParams:
    """Derive ``H0``, ``Q``, ``H_min``, ``H_max`` from the profile where the config leaves None."""
    b0 = profile.decode.b0
    h0 = config.H0 if config.H0 is not None else float(b0 * config.L_bar)
    h_min = config.H_min if config.H_min is not None else float(config.L_bar)
    h_max = config.H_max if config.H_max is not None else 2.0 * h0
    if h_min > h_max:
        raise ValueError(f"H_min ({h_min}) must be <= H_max ({h_max}) after resolving defaults")
    q = config.Q if config.Q is not None else float(b0)
    return TWPParams(config, profile.decode.l_min_s, b0, h0, q, h_min, h_max)


@dataclass(frozen=True, slots=True)
class TWPCounters:
    """Named, counted events (docs/design.md, shape 8)."""

    admitted: int = 0
    force_admitted: int = 0
    empty_batch: int = 0
    closed_by_window: int = 0
    closed_by_kv: int = 0


@dataclass(frozen=True, slots=True)
class TWPState:
    """Everything TWP remembers between steps. Replaced, never mutated.

    ``H``: the token window ``H_t`` (tokens). ``itl_hat_s``: smoothed ITL ``l_hat_t``.
    ``sigma``: ``l_hat_t / l_min``. ``kv_rate``: EWMA of blocks consumed per step.
    ``delta_kv``: KV guard as a fraction of total blocks. ``last_free_blocks``: free
    blocks at the last observation (None before the first). ``tenant_history`` /
    ``tenant_median``: recent output lengths per tenant and their running median;
    ``tenant_sorted``: the same lengths sorted (for ``survival_l_hat``).
    """

    params: TWPParams
    H: float
    itl_hat_s: float
    sigma: float = 1.0
    kv_rate: float = 0.0
    delta_kv: float = 0.0
    last_free_blocks: int | None = None
    step: int = 0
    tenant_history: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    tenant_median: Mapping[str, float] = field(default_factory=dict)
    tenant_sorted: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    counters: TWPCounters = TWPCounters()


def init_state(config: TWPConfig, profile: EngineProfile) -> TWPState:
    """The state before the first step: ``H = H0``, ``l_hat = l_min``, ``delta_kv = delta_base``."""
    p = resolve(config, profile)
    delta = min(max(config.delta_base, config.delta_min), config.delta_max)
    return TWPState(params=p, H=p.H0, itl_hat_s=p.l_min_s, delta_kv=delta)


def l_hat(state: TWPState, tenant: str, max_tokens: int, generated: int = 0) -> int:
    """``L_hat = min(max_tokens, running median of the tenant's output lengths)`` (tokens, >= 1).

    With ``survival_l_hat`` (off by default) and ``generated > 0``, the estimate for a
    running request is the median of the tenant's lengths *greater than* ``generated``
    (the median length of requests that survived this far); when none survived that far,
    ``2 * generated``. Without it, a request that outlives the median counts as
    ``r_i = 1`` however long it still runs.
    """
    cfg = state.params.config
    med = state.tenant_median.get(tenant)
    est: float = cfg.L_bar if med is None else med
    if cfg.survival_l_hat and generated > 0 and generated >= est:
        srt = state.tenant_sorted.get(tenant, ())
        i = bisect.bisect_right(srt, generated)
        n = len(srt) - i
        if n > 0:
            mid = i + n // 2
            est = float(srt[mid]) if n % 2 else (srt[mid - 1] + srt[mid]) / 2.0
        else:
            est = 2.0 * generated
    return max(1, min(int(max_tokens), int(round(est))))


def window_target(state: TWPState, queue_depth: int, sigma: float) -> float:
    """Eq. 3: ``H*_t = H0 (1 + min(1, q_t / Q)) / max(0.5, sigma_t)``."""
    p = state.params
    return p.H0 * (1.0 + min(1.0, queue_depth / p.Q)) / max(0.5, sigma)


def observe(state: TWPState, obs: DecodeObservation) -> TWPState:
    """Monitor + headroom controller, once after each engine step (pure)."""
    p, cfg = state.params, state.params.config
    itl = state.itl_hat_s
    if obs.step_latency_s > 0:
        itl = (1.0 - cfg.itl_filter) * itl + cfg.itl_filter * obs.step_latency_s
    sigma = itl / p.l_min_s
    target = window_target(state, obs.queue_depth, sigma)
    h = state.H + cfg.gamma * (target - state.H)
    h = min(max(h, p.H_min), p.H_max)

    consumed = 0
    if state.last_free_blocks is not None:
        consumed = max(0, state.last_free_blocks - obs.free_blocks)
    kv_rate = (1.0 - cfg.kv_filter) * state.kv_rate + cfg.kv_filter * consumed
    total = max(1, obs.total_blocks)
    delta = cfg.delta_base + cfg.kv_k * kv_rate * cfg.kv_horizon_steps / total
    delta = min(max(delta, cfg.delta_min), cfg.delta_max)

    history, median = state.tenant_history, state.tenant_median
    if obs.finished:
        hist = dict(history)
        for f in obs.finished:
            hist[f.tenant] = (hist.get(f.tenant, ()) + (max(0, f.output_tokens),))[
                -cfg.median_window :
            ]
        touched = {f.tenant for f in obs.finished}
        med, srt = dict(median), dict(state.tenant_sorted)
        for t in touched:
            med[t] = float(statistics.median(hist[t]))
            srt[t] = tuple(sorted(hist[t]))
        history, median = hist, med
        sorted_: Mapping[str, tuple[int, ...]] = srt
    else:
        sorted_ = state.tenant_sorted

    return replace(
        state,
        H=h,
        itl_hat_s=itl,
        sigma=sigma,
        kv_rate=kv_rate,
        delta_kv=delta,
        last_free_blocks=obs.free_blocks,
        step=obs.step_index,
        tenant_history=history,
        tenant_median=median,
        tenant_sorted=sorted_,
    )


def rank(state: TWPState, view: DecodeView) -> list[tuple[float, WaitingRequestView]]:
    """Waiting requests with their composite score, best first (each term in [0, 1])."""
    p, cfg = state.params, state.params.config
    running = view.running
    r_bar = sum(r.remaining for r in running) / len(running) if running else None
    scored: list[tuple[float, int, WaitingRequestView]] = []
    for i, w in enumerate(view.waiting):
        starvation = min(1.0, w.wait_steps / cfg.T_max)
        balance = 1.0 if r_bar is None else math.exp(-abs(w.l_hat - r_bar) / (r_bar + 1.0))
        wait_s = max(0.0, w.wait_s)
        denom = wait_s + w.l_hat * p.l_min_s
        fairness = wait_s / denom if denom > 0 else 0.0
        score = cfg.w1 * starvation + cfg.w2 * balance + cfg.w3 * fairness
        scored.append((score, i, w))
    scored.sort(key=lambda s: (-s[0], -s[2].wait_steps, s[1]))
    return [(s, w) for s, _, w in scored]


def admit(state: TWPState, view: DecodeView) -> tuple[TWPState, list[AdmissionDecision]]:
    """The gate, once before each engine step (pure).

    Returns the new state (counters) and one decision per waiting request: admitted
    ones first, in admission order, then the held ones in ranked order.
    """
    cfg = state.params.config
    ranked = [w for _, w in rank(state, view)]
    K = view.token_load
    free = view.engine.free_blocks
    delta_blocks = state.delta_kv * view.engine.total_blocks
    c = state.counters
    admitted: list[AdmissionDecision] = []
    held: list[AdmissionDecision] = []

    rest: list[WaitingRequestView] = []
    for w in ranked:
        if w.wait_steps > cfg.T_max:
            admitted.append(
                AdmissionDecision(
                    w.request_id, "force_admit", f"force_admit: waited {w.wait_steps} > T_max"
                )
            )
            K += max(1, w.l_hat)
            free -= w.prompt_blocks
        else:
            rest.append(w)
    n_force = len(admitted)

    closed: str | None = None
    n_empty = 0
    for w in rest:
        if closed is not None:
            held.append(AdmissionDecision(w.request_id, "hold", f"gate_closed: {closed}"))
            continue
        r_i = max(1, w.l_hat)
        if free - w.prompt_blocks <= delta_blocks:
            closed = "kv_guard"
            c = replace(c, closed_by_kv=c.closed_by_kv + 1)
            held.append(AdmissionDecision(w.request_id, "hold", "kv_guard"))
            continue
        if K + r_i > state.H:
            if cfg.empty_batch_admit and not view.running and not admitted:
                n_empty += 1
                admitted.append(AdmissionDecision(w.request_id, "admit", "empty_batch"))
                K += r_i
                free -= w.prompt_blocks
                continue
            closed = "window"
            c = replace(c, closed_by_window=c.closed_by_window + 1)
            held.append(AdmissionDecision(w.request_id, "hold", "window"))
            continue
        admitted.append(AdmissionDecision(w.request_id, "admit", "window_and_kv_ok"))
        K += r_i
        free -= w.prompt_blocks

    c = replace(
        c,
        admitted=c.admitted + len(admitted),
        force_admitted=c.force_admitted + n_force,
        empty_batch=c.empty_batch + n_empty,
    )
    return replace(state, counters=c), admitted + held


def headroom(state: TWPState, view: DecodeView) -> tuple[float, float]:
    """What a ``pd`` decode replica publishes to the router: ``(H_t, K_t)`` in tokens."""
    return state.H, float(view.token_load)


def prefill_chunk(remaining_prompt_tokens: int, config: TWPConfig) -> int:
    """Colocated mode: prompt tokens of one admitted request to prefill in this step."""
    return max(0, min(config.C, remaining_prompt_tokens))


def check_pd_backstop(
    config: TWPConfig, worst_step_latency_s: float, kv_transfer_timeout_s: float = 480.0
) -> None:
    """In ``pd`` mode the decode-side gate must release a request well before vLLM aborts
    its KV transfer (``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``, 480 s by default). Raises when
    ``T_max * worst_step_latency_s`` exceeds half of that time-out."""
    bound = config.T_max * worst_step_latency_s
    if bound > 0.5 * kv_transfer_timeout_s:
        raise ValueError(
            f"T_max={config.T_max} steps x {worst_step_latency_s:.3f} s = {bound:.1f} s exceeds "
            f"half the KV-transfer time-out ({kv_transfer_timeout_s:.0f} s); lower T_max"
        )


@dataclass(slots=True)
class LMinTracker:
    """``l_min`` from the replica's own single-stream steps (see the module docstring).

    ``add(itl_s)`` takes the ITL of a step that decoded one lone request (one running,
    none waiting); after every ``every`` such steps, once ``every`` are held, it returns
    the median of the last ``window`` as the new ``l_min`` (else ``None``). The median, not
    a low quantile: TWP's ``sigma`` compares the *smoothed* ITL with ``l_min``, and the
    smoothed ITL of a lone stream sits at its typical, not its fastest, step."""

    window: int = 256
    every: int = 64
    samples: list[float] = field(default_factory=list)
    since_update: int = 0

    def __post_init__(self) -> None:
        if self.window < 1 or not 1 <= self.every <= self.window:
            raise ValueError(
                f"LMinTracker: need 1 <= every <= window (got {self.every}, {self.window})"
            )

    def add(self, itl_s: float) -> float | None:
        if not itl_s > 0 or math.isinf(itl_s):
            return None
        self.samples.append(itl_s)
        if len(self.samples) > self.window:
            del self.samples[: len(self.samples) - self.window]
        self.since_update += 1
        if self.since_update < self.every:
            return None
        self.since_update = 0
        return float(statistics.median(self.samples))


class TWP:
    """The stateful policy object over the pure functions (``state`` is public)."""

    def __init__(self, profile: EngineProfile, config: TWPConfig | None = None, name: str = "twp"):
        self.name = name
        self.config = config or TWPConfig()
        self.state = init_state(self.config, profile)
        self.prefill_chunk_tokens: int | None = self.config.C

    def reconfigure(self, config: TWPConfig, profile: EngineProfile) -> None:
        """New parameters, live: the window, ITL estimate, KV guard and per-tenant lengths
        carry over (the window and guard clamped into the new bounds); the next step uses
        the new values. Raises ``ValueError`` (nothing changed) when they do not resolve."""
        p = resolve(config, profile)
        st = self.state
        self.state = replace(
            st,
            params=p,
            H=min(max(st.H, p.H_min), p.H_max),
            delta_kv=min(max(st.delta_kv, config.delta_min), config.delta_max),
        )
        self.config = config
        self.prefill_chunk_tokens = config.C

    def set_l_min(self, profile: EngineProfile, restart: bool = False) -> None:
        """A new ``l_min`` (``profile.decode.l_min_s``), keeping the window and estimates;
        ``restart`` also sets the smoothed ITL to it (``sigma`` = 1), as at start."""
        self.reconfigure(self.config, profile)
        if restart:
            self.state = replace(self.state, itl_hat_s=profile.decode.l_min_s, sigma=1.0)

    def observe(self, obs: DecodeObservation) -> None:
        self.state = observe(self.state, obs)

    def admit(self, view: DecodeView) -> list[AdmissionDecision]:
        self.state, decisions = admit(self.state, view)
        return decisions

    def expected_output(self, tenant: str, max_tokens: int, generated: int = 0) -> int:
        return l_hat(self.state, tenant, max_tokens, generated)

    @property
    def window_tokens(self) -> float:
        return self.state.H

    @property
    def delta_kv(self) -> float:
        return self.state.delta_kv
