"""SLO sizing for the serverless autoscaler, pure: targets in, replica counts out (issue 43).

:func:`controllers.autoscale.decide` calls this when ``autoscaling.slo`` is set; nothing here
has a knob to tune per workload. The inputs are the targets (:class:`SloConfig`: TTFT p99, ITL
p99, the cold-start budget), what is measured (prefill rate ``mu`` per replica, the decode
step curve of the engine profile, the cold start ``C``) and a short-horizon load forecast
(:class:`Forecast`, from the prefill inflow's recent windows).

**Forecast** (:func:`forecast`). The uncached prompt tokens arriving are counted per window of
``FORECAST_WINDOW_S`` (5 s, Serve's look-back) over the last ``FORECAST_WINDOWS`` (24: two
minutes). The level is ``lam = max(mean of the 24, mean of the last 2, the inflow EWMA)``:
a rise shows within ten seconds, a fall is believed only when the two-minute mean falls
(asymmetric on purpose: a replica released too early costs a cold start, one kept too long
costs replica-seconds). The spread ``sigma`` is the standard deviation of the window rates,
and the dispersion ``D = sigma^2 W / lam`` (tokens) is the index of dispersion of the tokens
per window: for Poisson arrivals of prompts of mean ``m`` and squared CV ``cs2`` it is
``m (1 + cs2)``, so ``D / 2`` stands for Kingman's ``m (ca2 + cs2) / 2`` without needing the
request count or the prompt mean (floored at ``expected_prompt_tokens``, arrivals no burstier
than Poisson with constant prompts). Why this and not a fitted model (Holt-Winters, ARIMA): the
horizon that matters is one cold start (seconds to a minute), where a level and a spread from
the last two minutes is what any of them would say, and it has nothing to fit or tune.

**Prefill** (``slo_ttft``). The prefill pool is ``n`` servers of ``mu`` tokens/s fed ``lam``
tokens/s (offered load ``a = lam / mu``). The wait's p99 is Erlang C's exponential tail with
the Allen-Cunneen/Kingman correction for burstiness::

    W99(n) = max(0, ln(C(n, a) / 0.01)) * (D / 2) / (n mu - lam)
    E[W]   = C(n, a) * (D / 2) / (n mu - lam)

and the prefill itself ``S = prompt / mu`` has mean ``E[S] = m / mu`` and p99 ``S99 = P99 / mu``
(``prompt_tokens_mean`` and ``prompt_tokens_p99`` when reported, else
``expected_prompt_tokens`` and ``ln(100)`` times it, an exponential's p99). The TTFT's p99 is
the means plus the excesses over them combined as independent spreads::

    TTFT99(n) = B / (n mu) + l_min + E[W] + E[S] + sqrt((W99 - E[W])^2 + (S99 - E[S])^2)

with ``B / (n mu)`` the backlog queued now served by the pool and ``l_min`` one decode step
(the first token comes from decode). Why not ``W99 + S99``: the p99 of a sum of independent
terms is well below the sum of their p99s (the request with the longest prompt is rarely the
one that waited longest); on the Azure trace the plain sum sized prefill about half a replica
above this on average, for a TTFT p99 well under target (simulated). ``n_p`` is the smallest
``n`` with ``TTFT99(n) <= ttft_p99_s``. If the p99 prompt's own prefill ``S99 + l_min`` does
not fit the target, no count of replicas meets it; the pool is then sized for twice that
(reason ``slo_ttft_infeasible``).

**Decode** (``slo_itl``, ``window``, ``kv``). The profile's step curve
``l(b) = l_min + alpha max(0, b - b0)``, rescaled to the floor the decode replicas' TWP gates
measure (``l_min_s``, the largest reported: the engine in a serving replica is slower than the
bare one the profile measured, 2-3x for the test model on 2 cores; ``alpha`` scales alike,
``b0`` stays, as :meth:`controllers.profile.DecodeProfile.rescaled` and the gate itself do),
gives the largest batch per replica whose step is
within ``itl_p99_s``: ``b* = b0 + floor((itl_p99_s - l_min) / alpha)`` (``b0`` when
``itl_p99_s < l_min``: infeasible, reason ``slo_itl_infeasible``). With ``S`` sequences in
decode (running and waiting), ``n_d = ceil(S / b*)``; the larger of that, the TWP window's
``ceil((K + Q) / H)`` at full use (a request waiting at the window waits in its TTFT) and the
KV's ``ceil(used / (blocks kv_target))`` is taken and names the reason. Output lengths are not
known to this: only the sequences present and their reported load are used.

**Warm pool from the cold-start budget** (``cold_budget``). A request meets a cold start when
the load rises, within one cold start ``C``, beyond what the warm replicas can serve. The warm
capacity is therefore kept at the forecast's upper quantile over that horizon,
``lam_hi = lam + z sigma sqrt(W / max(W, C))`` with ``z`` the standard normal's
``1 - max_cold_fraction`` quantile (``sqrt(W / C)``: the windows' rates averaged over the
horizon, taken as independent): prefill keeps ``ceil(lam_hi / mu)`` replicas, decode
``ceil(S (lam_hi / lam) / b*)`` (Little's law: sequences in decode follow the request rate).
The chance that the horizon's load exceeds the warm capacity is then at most
``max_cold_fraction``, and since only part of the requests in such an excess wait on the new
replicas, cold starts stay below it (bursts sharper than the windows' spread, and the first
request after an idle gap, are not covered: the keep-alive decides those). Capacity, not the
TTFT target at ``lam_hi``: a burst of one cold start's length lengthens the queue for that
long, which the dispersion ``D`` already prices into the wait; asking for the TTFT target at
``lam_hi`` as well counted the burstiness twice (on the Azure trace at 0.25x it kept a second
prefill replica the target did not need, simulated). When this count exceeds the SLO count
the difference is the warm pool and the reason is ``cold_budget``.

**Keep-alive from the cold-start budget** (:func:`keep_alive_s`). After ``T`` seconds without
a request the pool goes to zero; the next request then meets a cold start, and so do the
``r C`` that arrive while it starts. With requests arriving at rate ``r`` (Poisson), a gap
exceeds ``T`` with probability ``exp(-r T)``, so about ``exp(-r T) (1 + r C)`` of the requests
meet a cold start; at most ``max_cold_fraction`` of them when::

    T = max(C, ln((1 + r C) / max_cold_fraction) / r)

never below ``C`` (a replica released and wanted back within its own restart costs as much as
one kept: the ski-rental break-even) and never above ``idle_to_zero_s``, which in this mode is
the operator's cap on what one idle spell may cost (300 s by default: at rates below
``ln(1 / max_cold_fraction) / 300`` requests/s, about one per 100 s at 3%, the budget is not
met and the cap holds). ``r`` is the forecast's two-minute mean inflow over the mean prompt
(both uncached tokens), taken while requests are present and kept through the idle spell it
decides on. Worked: ``C`` = 30 s, 3%: at 1.4 requests/s (the Azure conversation trace at
1x) ``ln(43 / 0.03) / 1.4`` = 5.2 s, so ``T = C`` = 30 s instead of 300 s; at 0.1/s 49 s; at
0.01/s 377 s, capped at 300 s.

Knobs that remain in this mode: the hysteresis's delay is the measured cold start ``C``
(``downscale_delay_s`` is not used: a replica released and wanted back within its own restart
time would have cost a cold start, and the sizing already holds the cold-budget headroom);
``idle_to_zero_s`` is the keep-alive's cap (above); ``warm_pool`` (extra replicas, 0) and the
bounds stay as set; ``expected_prompt_tokens`` and ``prefill_tokens_per_s`` are fallbacks until the
replicas report; ``target_utilization`` and ``prefill_drain_s`` are not used.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist

from pydantic import BaseModel, ConfigDict, Field

from controllers.profile import DecodeProfile

#: Width of one forecast window (s): Serve's look-back period of the replicas' metrics.
FORECAST_WINDOW_S = 5.0
#: Windows the forecast remembers (24 x 5 s: two minutes).
FORECAST_WINDOWS = 24
#: Windows in the forecast's "recent" level (10 s).
RECENT_WINDOWS = 2
#: The quantile of the wait the TTFT target is for.
P99 = 0.99


class SloConfig(BaseModel):
    """The SLO targets the autoscaler sizes both roles for (``autoscaling.slo``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ttft_p99_s: float = Field(
        gt=0, description="Target p99 time to first token of warm requests (s)."
    )
    itl_p99_s: float = Field(gt=0, description="Target p99 inter-token latency (s).")
    max_cold_fraction: float = Field(
        default=0.03,
        gt=0,
        lt=1,
        description="Cold-start budget: share of requests that may wait on a cold start; "
        "sets the warm pool (the forecast's 1 - max_cold_fraction quantile is served warm).",
    )
    decode_step: DecodeProfile | None = Field(
        default=None,
        description="Decode step curve (an engine profile's 'decode'); None: the app takes "
        "the decode role's profile's (AppConfig.resolved_autoscaling), and with no profile "
        "decode is sized by the TWP window and KV only (no ITL term).",
    )


@dataclass(frozen=True)
class Forecast:
    """Short-horizon load forecast of the prefill inflow (uncached tokens/s)."""

    rate: float
    """The level ``lam`` (tokens/s)."""
    sigma: float
    """Standard deviation of the windows' rates (tokens/s)."""
    dispersion: float
    """Index of dispersion of tokens per window, ``sigma^2 W / lam`` (tokens)."""

    def upper(self, horizon_s: float, max_cold_fraction: float) -> float:
        """``lam + z sigma sqrt(W / max(W, horizon))``, ``z`` the ``1 - eps`` normal quantile."""
        z = NormalDist().inv_cdf(1.0 - max_cold_fraction)
        return self.rate + z * self.sigma * math.sqrt(
            FORECAST_WINDOW_S / max(FORECAST_WINDOW_S, horizon_s)
        )


def forecast(windows: tuple[float, ...], ewma: float, min_dispersion: float) -> Forecast:
    """The forecast from the last windows' rates (oldest first), the inflow EWMA and the
    dispersion's floor (the window under way is not used: a second or two of arrivals is
    mostly noise)."""
    xs = list(windows[-FORECAST_WINDOWS:])
    recent = xs[-RECENT_WINDOWS:]
    mean = sum(xs) / len(xs) if xs else 0.0
    level = max(mean, sum(recent) / len(recent) if recent else 0.0, ewma)
    var = sum((x - mean) ** 2 for x in xs) / (len(xs) - 1) if len(xs) > 1 else 0.0
    sigma = math.sqrt(var)
    disp = var * FORECAST_WINDOW_S / level if level > 0 else 0.0
    return Forecast(level, sigma, max(min_dispersion, disp))


#: Prompts a replica remembers for its reported prompt mean and p99 (``prompt_moments``).
RECENT_PROMPTS = 256


def prompt_moments(uncached: Sequence[int]) -> tuple[float, float]:
    """Mean and p99 (nearest rank: the ``ceil(0.99 n)``-th smallest) of recent prompts'
    uncached tokens, which a prefill replica reports as ``prompt_tokens_mean`` and
    ``prompt_tokens_p99`` for :func:`prefill_ttft_p99`; ``(0, 0)`` with none."""
    if not uncached:
        return 0.0, 0.0
    xs = sorted(uncached)
    rank = max(1, math.ceil(P99 * len(xs)))
    return sum(xs) / len(xs), float(xs[rank - 1])


def keep_alive_s(
    rate_rps: float, cold_start_s: float, max_cold_fraction: float, cap_s: float
) -> float:
    """The idle time before scale to zero that keeps cold starts within ``max_cold_fraction``
    at ``rate_rps`` requests/s: ``max(C, ln((1 + r C) / eps) / r)``, at most ``cap_s`` (see
    the module docstring); ``cap_s`` when no rate is known."""
    if rate_rps <= 0:
        return cap_s
    c = max(0.0, cold_start_s)
    t = math.log((1.0 + rate_rps * c) / max_cold_fraction) / rate_rps
    return min(cap_s, max(c, t))


def erlang_c(n: int, a: float) -> float:
    """Probability of waiting in M/M/n at offered load ``a`` (1 when ``a >= n``)."""
    if a <= 0:
        return 0.0
    if a >= n:
        return 1.0
    b = 1.0  # Erlang B by its recursion
    for k in range(1, n + 1):
        b = a * b / (k + a * b)
    return n * b / (n - a * (1.0 - b))


def prefill_ttft_p99(
    n: int,
    lam: float,
    mu: float,
    dispersion: float,
    backlog: float,
    prompt_mean: float,
    prompt_p99: float,
    l_min: float,
) -> float:
    """Predicted TTFT p99 (s) of ``n`` prefill replicas (see the module docstring)."""
    if n <= 0 or lam >= n * mu:
        return math.inf
    c = erlang_c(n, lam / mu)
    scale = (dispersion / 2.0) / (n * mu - lam)  # 1 / the tail's decay rate (s)
    w_mean = c * scale
    w99 = math.log(c / (1.0 - P99)) * scale if c > 1.0 - P99 else 0.0
    s_mean, s99 = prompt_mean / mu, prompt_p99 / mu
    spread = math.hypot(w99 - w_mean, s99 - s_mean)
    return backlog / (n * mu) + l_min + w_mean + s_mean + spread


def prefill_replicas(
    lam: float,
    mu: float,
    dispersion: float,
    backlog: float,
    prompt_mean: float,
    prompt_p99: float,
    l_min: float,
    ttft_p99_s: float,
    max_replicas: int,
) -> tuple[int, bool]:
    """(smallest ``n`` in ``[0, max_replicas]`` meeting ``ttft_p99_s``, feasible). No load and
    no backlog: 0. When the target is below the p99 prompt's own prefill (plus ``l_min``), the
    pool is sized for twice that instead (feasible False)."""
    if lam <= 0 and backlog <= 0:
        return 0, True
    fixed = prompt_p99 / mu + l_min
    feasible = ttft_p99_s > fixed
    target = ttft_p99_s if feasible else 2.0 * fixed
    for n in range(1, max_replicas + 1):
        ttft = prefill_ttft_p99(n, lam, mu, dispersion, backlog, prompt_mean, prompt_p99, l_min)
        if ttft <= target:
            return n, feasible
    return max_replicas, feasible


def max_batch(step: DecodeProfile, itl_p99_s: float) -> tuple[int, bool]:
    """(largest batch per replica whose step time is within ``itl_p99_s``, feasible)."""
    if itl_p99_s < step.l_min_s:
        return step.b0, False
    if step.alpha_s <= 0:
        return 1 << 30, True
    return step.b0 + int(math.floor((itl_p99_s - step.l_min_s) / step.alpha_s + 1e-9)), True


@dataclass(frozen=True)
class SloSizing:
    """One role's SLO size: the replicas and the bound that set them."""

    replicas: int
    reason: str
    need: float
