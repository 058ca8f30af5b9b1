"""Prefill policies by name: one place that CLI, simulator and engine plug-ins share."""

from __future__ import annotations

from collections.abc import Callable

from controllers.config import FairwayConfig
from controllers.prefill.base import PrefillPolicy
from controllers.prefill.baselines import FCFS, KLPM, LPM, PeekLike, PrebleLike, RAGCacheOrder
from controllers.prefill.fairway import Fairway
from controllers.prefill.xstep import FairwayXStep, XStepConfig
from controllers.profile import EngineProfile

#: A policy name with this suffix runs inside the tenant fair-share layer.
FAIR_SHARE_SUFFIX = "+fair_share"

Factory = Callable[[EngineProfile | None, FairwayConfig], PrefillPolicy]

_FACTORIES: dict[str, Factory] = {
    "fcfs": lambda p, c: FCFS(),
    "lpm": lambda p, c: LPM("oldest"),
    "lpm_newest": lambda p, c: LPM("newest"),
    "klpm4": lambda p, c: KLPM(4),
    "klpm8": lambda p, c: KLPM(8),
    "ragcache": lambda p, c: RAGCacheOrder("oldest"),
    "ragcache_newest": lambda p, c: RAGCacheOrder("newest"),
    "preble": lambda p, c: PrebleLike(),
    "peek": lambda p, c: PeekLike(p),
    "fairway": lambda p, c: Fairway(
        c.model_copy(update={"relative_wait": True, "fair_lane": True})
    ),
    "fairway_abs": lambda p, c: Fairway(
        c.model_copy(update={"relative_wait": False, "fair_lane": True})
    ),
    "fairway_nofair": lambda p, c: Fairway(
        c.model_copy(update={"relative_wait": True, "fair_lane": False})
    ),
    "fairway_abs_nofair": lambda p, c: Fairway(
        c.model_copy(update={"relative_wait": False, "fair_lane": False})
    ),
    "fairway_xstep": lambda p, c: FairwayXStep(fairway=c),
    "fairway_xstep_reuse": lambda p, c: FairwayXStep(
        XStepConfig(bypass_share=0.08, cached_share=10.0, fast_score="reuse"),
        fairway=c,
        name="fairway_xstep_reuse",
    ),
}


def register_prefill_policy(name: str, factory: Factory) -> None:
    """Add a named policy (later issues register their variants here)."""
    if name in _FACTORIES:
        raise ValueError(f"prefill policy {name!r} is already registered")
    _FACTORIES[name] = factory


def prefill_policy_names() -> list[str]:
    return list(_FACTORIES)


def make_prefill_policy(
    name: str, profile: EngineProfile | None = None, config: FairwayConfig | None = None
) -> PrefillPolicy:
    """Build a policy by name; an unknown name is an error that lists the known ones.

    ``NAME+fair_share`` is policy NAME inside :class:`TenantFairShare` (tenants' turns by
    uncached tokens served)."""
    if name.endswith(FAIR_SHARE_SUFFIX):
        from controllers.prefill.fairshare import TenantFairShare

        inner = make_prefill_policy(name[: -len(FAIR_SHARE_SUFFIX)], profile, config)
        return TenantFairShare(inner)
    try:
        factory = _FACTORIES[name]
    except KeyError:
        raise ValueError(
            f"unknown prefill policy {name!r}; known: {', '.join(_FACTORIES)}"
        ) from None
    return factory(profile, config or FairwayConfig())
