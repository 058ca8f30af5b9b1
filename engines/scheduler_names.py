"""``scheduler_cls`` strings per serving mode (no vLLM import: the serving layer uses it)."""

from __future__ import annotations


def scheduler_cls_name(mode: str, async_scheduling: bool = False) -> str:
    """The ``scheduler_cls`` string for a serving mode: ``prefill``, ``decode`` or ``colocated``."""
    base = {
        "prefill": "FairwayScheduler",
        "decode": "TWPScheduler",
        "colocated": "ColocatedScheduler",
    }
    if mode not in base:
        raise ValueError(f"unknown engine mode {mode!r}; known: {', '.join(base)}")
    return f"engines.scheduler.{'Async' if async_scheduling else ''}{base[mode]}"


#: The shipped plug-ins whose class orders the prefill waiting queue when the engine's
#: ``prefill_policy`` is unset (``engines.scheduler``'s ``default_prefill_policy``; a test
#: keeps the two equal). The others (``TWPScheduler``) keep vLLM's arrival order.
ORDERS_PREFILL_BY_DEFAULT: frozenset[str] = frozenset(
    f"engines.scheduler.{a}{b}"
    for a in ("", "Async")
    for b in ("FairwayScheduler", "ColocatedScheduler")
)


def fair_share_error(scheduler_cls: str | None, prefill_policy: str | None) -> str | None:
    """Why ``fair_share: true`` would be ignored under this scheduler class and policy (the
    share wraps a prefill policy, and ``TWPScheduler`` has none unless one is named), or None.
    Checked at configuration, since the ingress's wait bound reads the share as kept
    (``controllers.overload.share_ahead``): ignored, it would read too short a wait for a
    quiet tenant."""
    if prefill_policy is not None or scheduler_cls in ORDERS_PREFILL_BY_DEFAULT:
        return None
    return (
        f"fair_share: the scheduler class {scheduler_cls} orders no prefill queue without a "
        "prefill_policy, so the share would be ignored; name a prefill_policy (e.g. fairway) "
        "or turn fair_share off"
    )
