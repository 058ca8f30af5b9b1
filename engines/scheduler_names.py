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
