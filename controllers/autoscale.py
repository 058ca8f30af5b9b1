"""Serverless autoscaling of a prefill/decode pair from token-level demand, pure.

One call, :func:`decide`, turns both roles' demand (:class:`RoleDemand`) into replica counts
(:class:`Decision`, each with a named reason) and the next :class:`AutoscaleState`. The live
wiring (:mod:`deployments.autoscaling`, a Ray Serve application-level policy) and the
autoscaling simulator (``pdserve sim autoscale``) both call it.

**Prefill** is sized by uncached prompt tokens against measured prefill throughput ``mu``
(tokens/s per replica; the replicas report it, ``prefill_tokens_per_s`` until they have)::

    need_p = ceil( lambda / (mu * u)  +  (B + G) / (mu * D) )

``lambda``: uncached prompt tokens arriving per second (from the replicas' cumulative
counts, smoothed); ``u``: the target utilisation; ``B``: uncached tokens queued now,
including requests waiting at the handles for a replica (``expected_prompt_tokens`` each);
``D``: the time the backlog should take to drain (``prefill_drain_s``). ``G`` is where the
**cold start** enters: a replica asked for now serves only after ``C`` seconds (the measured
cold start, ``cold_start_s`` until one is measured), and while it starts the backlog grows
by whatever arrives beyond the present replicas' capacity: ``G = max(0, lambda - n mu) C``.
A long cold start therefore scales up earlier and further; a short one waits for the
backlog itself.

**Decode** is sized by the TWP token window: ``need_d = ceil((K + Q) / (H u))`` with ``K``
the replicas' summed TWP token load, ``Q`` the window tokens of the requests waiting for
admission (in the replicas, and ``expected_output_tokens`` per request waiting at the handle:
admitted load alone can never pass the windows, so a full decode pool would never ask for
more than one step up) and ``H`` their (mean) token window; and by KV:
``ceil(used_kv_blocks / (blocks_per_replica * kv_target))``; whichever is larger.

The inflow ``lambda`` is a moving average with time constant ``inflow_window_s`` (samples at
least a second apart, weighted by ``1 - exp(-dt / window)``), so the sizing follows a load
that lasts, not one second's count.

Then, per role, in this order (each step names the reason when it sets the count):

1. ``scale_from_zero``: a role at zero with requests waiting at its handle goes to at least
   one. In ``pd`` mode the pair starts **together**: a request meets prefill's and decode's
   cold starts in series otherwise (prefill would start, serve, and only then would decode
   see its first request).
2. ``demand``: ``need`` plus the **warm pool** (``warm_pool`` idle replicas kept ready while
   the app is active), at least one while anything is in flight.
3. ``idle_to_zero``: no request seen for ``idle_to_zero_s`` (the keep-alive): ``min_replicas``
   (zero by default), both roles at once.
4. ``paired_with_prefill`` (pd): decode is never at zero while prefill is not (a prefilled
   request has nowhere to go).
5. Hysteresis: up at once; down only after the wanted count has stayed below the target for
   ``downscale_delay_s``, and then to the largest count wanted in that time
   (``hold_downscale`` meanwhile). ``idle_to_zero`` has waited its keep-alive already.
6. ``bounds``: ``[min_replicas, max_replicas]``.

**SLO mode** (``slo`` set, issue 43): the two sizings above are replaced by
:func:`slo_sizes` (:mod:`controllers.slo_sizing`: the smallest counts that meet the TTFT and
ITL p99 targets at the load forecast's ``1 - max_cold_fraction`` quantile over one cold
start, and the TWP window and KV), each naming the bound that set it (``slo_ttft``,
``slo_itl``, ``cold_budget``, ``window``, ``kv``) in place of ``demand``; the downscale delay
is the cold start ``C`` instead of ``downscale_delay_s``, and the keep-alive of step 3 is
derived from the cold-start budget and the request rate
(:func:`controllers.slo_sizing.keep_alive_s`), ``idle_to_zero_s`` its cap. Steps 1 and 4-6
are unchanged.

Choices where the issue is silent, written down: activity is per app (one request keeps
both roles alive); the warm pool is not kept through the keep-alive's end (a pool kept
forever is ``min_replicas``); the measured cold start is the mean of the last eight starts
(time from a raised target to the running count reaching it).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from controllers.slo_sizing import (
    FORECAST_WINDOW_S,
    FORECAST_WINDOWS,
    SloConfig,
    SloSizing,
    forecast,
    keep_alive_s,
    max_batch,
    prefill_replicas,
)

AutoscaleRole = Literal["prefill", "decode"]
ROLES: tuple[AutoscaleRole, ...] = ("prefill", "decode")
#: Cold starts remembered for the measured estimate.
COLD_START_SAMPLES = 8
#: Shortest interval between two inflow samples (s): Serve calls a policy about ten times a
#: second, and the replicas' counts move once per metrics interval.
INFLOW_MIN_INTERVAL_S = 1.0


class RoleBounds(BaseModel):
    """One role's replica bounds."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_replicas: int = Field(default=0, ge=0, description="Fewest replicas (0: scale to zero).")
    max_replicas: int = Field(default=2, ge=1, description="Most replicas.")
    initial_replicas: int | None = Field(
        default=None, ge=0, description="Replicas at deploy time (default: min_replicas)."
    )

    @model_validator(mode="after")
    def _ordered(self) -> RoleBounds:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"min_replicas ({self.min_replicas}) > max_replicas ({self.max_replicas})"
            )
        if self.initial_replicas is not None and not (
            self.min_replicas <= self.initial_replicas <= self.max_replicas
        ):
            raise ValueError(
                f"initial_replicas ({self.initial_replicas}) outside "
                f"[{self.min_replicas}, {self.max_replicas}]"
            )
        return self

    def initial(self) -> int:
        return self.min_replicas if self.initial_replicas is None else self.initial_replicas


class AutoscaleConfig(BaseModel):
    """Parameters of :func:`decide` (``autoscaling`` in the app config)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(
        default=False, description="Scale the engine deployments (else num_replicas is fixed)."
    )
    prefill: RoleBounds = Field(default_factory=RoleBounds, description="Prefill bounds.")
    decode: RoleBounds = Field(
        default_factory=lambda: RoleBounds(max_replicas=1), description="Decode bounds."
    )
    warm_pool: int = Field(
        default=0, ge=0, description="Idle replicas per role kept ready above demand while active."
    )
    idle_to_zero_s: float = Field(
        default=300.0,
        gt=0,
        description="Keep-alive: no request this long -> min_replicas (s); with slo set, the "
        "cap of the keep-alive derived from the cold-start budget and the request rate.",
    )
    downscale_delay_s: float = Field(
        default=30.0, ge=0, description="Hysteresis: wanted below target this long before down (s)."
    )
    target_utilization: float = Field(
        default=0.8, gt=0, le=1, description="Share of a replica's capacity the steady demand uses."
    )
    prefill_drain_s: float = Field(
        default=4.0, gt=0, description="Time the queued prefill backlog should take to drain (s)."
    )
    prefill_tokens_per_s: float = Field(
        default=2000.0, gt=0, description="Prefill throughput per replica until one is measured."
    )
    expected_prompt_tokens: int = Field(
        default=1024, ge=1, description="Uncached tokens counted per request waiting at a handle."
    )
    kv_target: float = Field(
        default=0.9, gt=0, le=1, description="Share of a decode replica's KV blocks demand may use."
    )
    cold_start_s: float = Field(
        default=30.0, ge=0, description="Cold-start estimate until one is measured (s)."
    )
    expected_output_tokens: int = Field(
        default=256,
        ge=1,
        description="Window tokens counted per request waiting at the decode handle.",
    )
    inflow_window_s: float = Field(
        default=15.0, gt=0, description="Time constant of the inflow's moving average (s)."
    )
    slo: SloConfig | None = Field(
        default=None,
        description="SLO targets (controllers.slo_sizing): when set, both roles are sized for "
        "them and the cold-start budget instead of target_utilization/prefill_drain_s, and "
        "the downscale delay is the cold start; None: the knob-driven sizing.",
    )


@dataclass(frozen=True)
class RoleDemand:
    """One role's demand and capacity at one instant (summed over its replicas)."""

    running: int
    """Replicas running now."""
    target: int
    """The count the autoscaler last set."""
    handle_queued: float = 0.0
    """Requests waiting at the handles for a replica."""
    ongoing: float = 0.0
    """Requests in the role (queued at handles, waiting or running in replicas)."""
    queued_uncached_tokens: float = 0.0
    """Prefill: uncached prompt tokens queued in the replicas."""
    uncached_tokens_total: float | None = None
    """Prefill: cumulative uncached prompt tokens the replicas have taken (inflow)."""
    tokens_per_s: float | None = None
    """Prefill: measured throughput per replica (tokens/s), when known."""
    token_load: float = 0.0
    """Decode: summed TWP token load."""
    queued_window_tokens: float = 0.0
    """Decode: window tokens of the requests waiting in the replicas for admission."""
    window_tokens: float | None = None
    """Decode: the replicas' mean TWP window (tokens); ``None``: unpaced."""
    used_kv_blocks: float = 0.0
    """Decode: KV blocks in use, summed."""
    kv_blocks_per_replica: float | None = None
    """Decode: KV blocks of one replica."""
    prompt_tokens_p99: float | None = None
    """Prefill: p99 of recent prompts' uncached tokens, when reported (SLO sizing)."""
    prompt_tokens_mean: float | None = None
    """Prefill: mean of recent prompts' uncached tokens, when reported (SLO sizing)."""
    l_min_s: float | None = None
    """Decode: the step floor ``l_min`` the replicas' TWP gates measure (their largest), when
    reported: the SLO sizing rescales the profile's step curve to it."""


@dataclass(frozen=True)
class Decision:
    """One role's replica count and why."""

    replicas: int
    reason: str
    need: float = 0.0


@dataclass(frozen=True)
class RoleState:
    """Hysteresis and cold-start bookkeeping of one role."""

    below_since: float | None = None
    below_max: int = 0
    raised_at: float | None = None
    raised_to: int = 0
    cold_starts: tuple[float, ...] = ()


@dataclass(frozen=True)
class AutoscaleState:
    """Everything :func:`decide` remembers between calls (JSON-able via :meth:`to_dict`)."""

    last_active: float | None = None
    inflow_tokens_per_s: float = 0.0
    inflow_last: tuple[float, float] | None = None
    roles: dict[str, RoleState] = field(default_factory=dict)
    windows: tuple[float, ...] = ()
    """SLO forecast: the last windows' inflow rates (tokens/s), oldest first."""
    window_start: tuple[float, float] | None = None
    """SLO forecast: (time, cumulative tokens) where the window under way began."""
    keep_alive_s: float | None = None
    """SLO mode: the keep-alive derived while requests were last present
    (:func:`controllers.slo_sizing.keep_alive_s`); None: ``idle_to_zero_s``."""

    def role(self, name: str) -> RoleState:
        return self.roles.get(name, RoleState())

    def cold_start_s(self, cfg: AutoscaleConfig) -> float:
        """Mean of the measured cold starts of either role (``cfg.cold_start_s`` before)."""
        xs = [x for r in self.roles.values() for x in r.cold_starts]
        return sum(xs) / len(xs) if xs else cfg.cold_start_s

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> AutoscaleState:
        if not d:
            return cls()
        roles = {
            k: RoleState(**{**v, "cold_starts": tuple(v.get("cold_starts", ()))})
            for k, v in d.get("roles", {}).items()
        }
        last = d.get("inflow_last")
        start = d.get("window_start")
        return cls(
            last_active=d.get("last_active"),
            inflow_tokens_per_s=float(d.get("inflow_tokens_per_s", 0.0)),
            inflow_last=None if last is None else (float(last[0]), float(last[1])),
            roles=roles,
            windows=tuple(float(x) for x in d.get("windows", ())),
            window_start=None if start is None else (float(start[0]), float(start[1])),
            keep_alive_s=None if d.get("keep_alive_s") is None else float(d["keep_alive_s"]),
        )


def prefill_need(d: RoleDemand, inflow: float, cold_start_s: float, cfg: AutoscaleConfig) -> float:
    """Replicas the prefill demand needs (fractional; see the module docstring)."""
    mu = d.tokens_per_s if d.tokens_per_s and d.tokens_per_s > 0 else cfg.prefill_tokens_per_s
    backlog = d.queued_uncached_tokens + d.handle_queued * cfg.expected_prompt_tokens
    growth = max(0.0, inflow - d.running * mu) * cold_start_s
    return inflow / (mu * cfg.target_utilization) + (backlog + growth) / (mu * cfg.prefill_drain_s)


def decode_need(d: RoleDemand, cfg: AutoscaleConfig) -> float:
    """Replicas the decode demand needs (fractional): TWP window and KV, the larger."""
    by_window = 0.0
    if d.window_tokens is not None and d.window_tokens > 0:
        waiting = d.queued_window_tokens + d.handle_queued * cfg.expected_output_tokens
        by_window = (d.token_load + waiting) / (d.window_tokens * cfg.target_utilization)
    by_kv = 0.0
    if d.kv_blocks_per_replica:
        by_kv = d.used_kv_blocks / (d.kv_blocks_per_replica * cfg.kv_target)
    return max(by_window, by_kv)


def _observe_inflow(
    state: AutoscaleState, d: RoleDemand, cfg: AutoscaleConfig, now: float
) -> AutoscaleState:
    total = d.uncached_tokens_total
    if total is None:
        return state
    last = state.inflow_last
    rate = state.inflow_tokens_per_s
    if last is not None and now - last[0] < INFLOW_MIN_INTERVAL_S:
        return state
    if last is not None:
        delta = total - last[1]
        if delta >= 0:  # a drop is a replica gone or restarted: start afresh
            dt = now - last[0]
            a = 1.0 - math.exp(-dt / cfg.inflow_window_s)
            rate = a * (delta / dt) + (1 - a) * rate
    return replace(state, inflow_tokens_per_s=rate, inflow_last=(now, float(total)))


def _observe_windows(state: AutoscaleState, d: RoleDemand, now: float) -> AutoscaleState:
    """SLO forecast: close the window under way once ``FORECAST_WINDOW_S`` has passed (a
    longer gap between calls counts as that many windows at the gap's mean rate)."""
    total = d.uncached_tokens_total
    if total is None:
        return state
    start = state.window_start
    if start is None or total < start[1]:  # first sample, or a replica gone: start afresh
        return replace(state, window_start=(now, float(total)))
    dt = now - start[0]
    if dt < FORECAST_WINDOW_S:
        return state
    k = min(FORECAST_WINDOWS, int(dt / FORECAST_WINDOW_S))
    rate = (total - start[1]) / dt
    windows = (*state.windows, *([rate] * k))[-FORECAST_WINDOWS:]
    return replace(state, windows=windows, window_start=(now, float(total)))


def slo_sizes(
    state: AutoscaleState,
    demand: dict[str, RoleDemand],
    cfg: AutoscaleConfig,
    cold_start_s: float,
    now: float,
) -> dict[str, SloSizing]:
    """Both roles' sizes for ``cfg.slo`` (:mod:`controllers.slo_sizing`): replicas, the bound
    that set them (``slo_ttft``, ``slo_itl``, ``window``, ``kv``, ``cold_budget``, or an
    ``*_infeasible`` target) and the fractional need."""
    slo = cfg.slo
    assert slo is not None
    pre = demand.get("prefill")
    fc = forecast(state.windows, state.inflow_tokens_per_s, float(cfg.expected_prompt_tokens))
    hi = fc.upper(cold_start_s, slo.max_cold_fraction)
    dec = demand.get("decode")
    step = slo.decode_step
    if step is not None and dec is not None and dec.l_min_s:
        step = step.rescaled(dec.l_min_s)  # the replicas' measured floor over the profile's
    l_min = step.l_min_s if step is not None else 0.0
    out: dict[str, SloSizing] = {}
    if pre is not None:
        mu = (
            pre.tokens_per_s
            if pre.tokens_per_s and pre.tokens_per_s > 0
            else cfg.prefill_tokens_per_s
        )
        backlog = pre.queued_uncached_tokens + pre.handle_queued * cfg.expected_prompt_tokens
        mean = pre.prompt_tokens_mean or float(cfg.expected_prompt_tokens)
        p99 = pre.prompt_tokens_p99 or math.log(100.0) * mean
        cap = cfg.prefill.max_replicas

        def n_at(lam: float) -> tuple[int, bool]:
            return prefill_replicas(
                lam, mu, fc.dispersion, backlog, mean, p99, l_min, slo.ttft_p99_s, cap
            )

        base, ok = n_at(fc.rate)
        # the warm capacity absorbs the forecast's upper quantile without a new replica
        warm = min(cap, math.ceil(hi / mu - 1e-9))
        reason = "slo_ttft" if ok else "slo_ttft_infeasible"
        if warm > base:
            reason = "cold_budget"
        out["prefill"] = SloSizing(max(base, warm), reason, max(float(base), hi / mu))
    if dec is not None:
        growth = hi / fc.rate if fc.rate > 0 else 1.0
        seqs = dec.ongoing
        by: dict[str, float] = {}
        if step is not None:
            b, ok = max_batch(step, slo.itl_p99_s)
            by["slo_itl" if ok else "slo_itl_infeasible"] = seqs / b
            by["cold_budget"] = seqs * growth / b
        if dec.window_tokens is not None and dec.window_tokens > 0:
            waiting = dec.queued_window_tokens + dec.handle_queued * cfg.expected_output_tokens
            by["window"] = (dec.token_load + waiting) / dec.window_tokens
        if dec.kv_blocks_per_replica:
            by["kv"] = dec.used_kv_blocks / (dec.kv_blocks_per_replica * cfg.kv_target)
        if by:
            # the first of the largest names the bound (cold_budget only when it adds one)
            counts = {k: math.ceil(v - 1e-9) for k, v in by.items()}
            top = max(counts.values())
            reason = next(k for k, v in counts.items() if v == top)
            out["decode"] = SloSizing(top, reason, max(by.values()))
        else:
            out["decode"] = SloSizing(0, "no_demand", 0.0)
    return out


def _keep_alive(state: AutoscaleState, pre: RoleDemand, cfg: AutoscaleConfig, cold: float) -> float:
    """SLO mode's keep-alive from the request rate now: the forecast windows' mean inflow
    over the mean prompt (both uncached tokens), ``idle_to_zero_s`` the cap."""
    assert cfg.slo is not None
    if not state.windows:
        return cfg.idle_to_zero_s
    mean_prompt = pre.prompt_tokens_mean or float(cfg.expected_prompt_tokens)
    rate = sum(state.windows) / len(state.windows) / mean_prompt
    return keep_alive_s(rate, cold, cfg.slo.max_cold_fraction, cfg.idle_to_zero_s)


def _observe_cold_start(rs: RoleState, d: RoleDemand, now: float) -> RoleState:
    """A raised target that the running count has reached is one measured cold start (from
    when this policy raised it, or first saw it above the running count: Serve raises a
    target at zero itself when a request waits)."""
    if rs.raised_at is None and d.target > d.running:
        rs = replace(rs, raised_at=now, raised_to=d.target)
    if rs.raised_at is not None and d.running >= rs.raised_to:
        starts = (*rs.cold_starts, now - rs.raised_at)[-COLD_START_SAMPLES:]
        return replace(rs, raised_at=None, raised_to=0, cold_starts=starts)
    return rs


def _hysteresis(
    rs: RoleState, target: int, want: int, now: float, delay: float
) -> tuple[RoleState, int, bool]:
    """(state, count, held): up at once; down after ``delay`` to the window's largest want."""
    if want >= target:
        return replace(rs, below_since=None, below_max=0), want, False
    since = now if rs.below_since is None else rs.below_since
    rs = replace(rs, below_since=since, below_max=max(rs.below_max, want))
    if now - since >= delay:
        count = rs.below_max
        return replace(rs, below_since=None, below_max=0), count, False
    return rs, target, True


def decide(
    state: AutoscaleState,
    demand: dict[str, RoleDemand],
    cfg: AutoscaleConfig,
    now: float,
    *,
    paired: bool = True,
) -> tuple[AutoscaleState, dict[str, Decision]]:
    """Replica counts for the roles in ``demand`` (``prefill`` and, when ``paired``, ``decode``
    too) and the next state. ``paired=False`` (colocated: one role serves both phases) skips
    the pairing rules."""
    pre = demand.get("prefill")
    if pre is not None:
        state = _observe_inflow(state, pre, cfg, now)
        if cfg.slo is not None:
            state = _observe_windows(state, pre, now)
    roles = dict(state.roles)
    for name, d in demand.items():
        roles[name] = _observe_cold_start(state.role(name), d, now)
    state = replace(state, roles=roles)
    cold = state.cold_start_s(cfg)

    active_now = any(
        d.ongoing > 0 or d.handle_queued > 0 or d.queued_uncached_tokens > 0 or d.token_load > 0
        for d in demand.values()
    )
    if active_now:
        state = replace(state, last_active=now)
        if cfg.slo is not None and pre is not None:
            state = replace(state, keep_alive_s=_keep_alive(state, pre, cfg, cold))
    keep_alive = cfg.idle_to_zero_s if state.keep_alive_s is None else state.keep_alive_s
    idle = state.last_active is None or now - state.last_active >= keep_alive
    from_zero = any(d.running == 0 and d.handle_queued > 0 for d in demand.values())

    sized = slo_sizes(state, demand, cfg, cold, now) if cfg.slo is not None else {}
    wants: dict[str, tuple[int, str, float]] = {}
    for name, d in demand.items():
        bounds: RoleBounds = getattr(cfg, name)
        bound = "demand"
        if name in sized:
            need, bound = sized[name].need, sized[name].reason
            needed = sized[name].replicas
        else:
            if name == "prefill":
                need = prefill_need(d, state.inflow_tokens_per_s, cold, cfg)
            else:
                need = decode_need(d, cfg)
            needed = math.ceil(need - 1e-9)
        if idle and not active_now:
            want, reason = 0, "idle_to_zero"
        else:
            want = needed + cfg.warm_pool
            if d.ongoing > 0 or d.handle_queued > 0:
                want = max(want, 1)
            reason = bound if needed > 0 else "warm_pool" if want else "no_demand"
        waiting_here = d.running == 0 and d.handle_queued > 0
        partner_waiting = from_zero and paired and d.running == 0 and d.target == 0
        if waiting_here or partner_waiting:
            want, reason = max(want, 1), "scale_from_zero"
        wants[name] = (max(0, min(want, bounds.max_replicas)), reason, need)

    if paired and "prefill" in wants and "decode" in wants:
        wp, _, _ = wants["prefill"]
        wd, _, nd = wants["decode"]
        if wp > 0 and wd == 0:
            wants["decode"] = (1, "paired_with_prefill", nd)

    decisions: dict[str, Decision] = {}
    roles = dict(state.roles)
    for name, (want, reason, need) in wants.items():
        d = demand[name]
        bounds = getattr(cfg, name)
        rs = roles.get(name, RoleState())
        if reason == "idle_to_zero":
            count, held = want, False
            rs = replace(rs, below_since=None, below_max=0)
        else:
            delay = cfg.downscale_delay_s if cfg.slo is None else cold
            rs, count, held = _hysteresis(rs, d.target, want, now, delay)
        if held:
            reason = "hold_downscale"
        bounded = max(bounds.min_replicas, min(bounds.max_replicas, count))
        if bounded != count:
            reason = "bounds"
        if bounded > max(d.target, d.running):
            rs = replace(
                rs, raised_at=now if rs.raised_at is None else rs.raised_at, raised_to=bounded
            )
        elif bounded < rs.raised_to:
            rs = replace(rs, raised_at=None, raised_to=0)
        roles[name] = rs
        decisions[name] = Decision(bounded, reason, round(need, 3))
    return replace(state, roles=roles), decisions
