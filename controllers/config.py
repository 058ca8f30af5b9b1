"""Validated parameters of the pure controllers (pydantic, ``extra="forbid"``).

These models are leaves of the project's one config tree; the serving layer nests
them. Every field has a description and its bounds in the type.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class FairwayConfig(BaseModel):
    """Fairway's three parameters, frozen at the paper's values, plus the ablation switches.

    The paper tuned ``fast_lane_weight=4``, ``slo_multiplier=3``, ``slo_floor_s=1.0`` on one
    SEC seed and froze them; the defaults here are those values.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    fast_lane_weight: float = Field(
        default=4.0,
        gt=0,
        description="Multiplier on Fast-lane work in the work-charge ledgers (paper: 4).",
    )
    slo_multiplier: float = Field(
        default=3.0,
        gt=0,
        description="Patience = slo_multiplier x idle prefill time of the full prompt (paper: 3).",
    )
    slo_floor_s: float = Field(
        default=1.0,
        gt=0,
        description="Lower bound on a request's patience in seconds (paper: 1 s).",
    )
    relative_wait: bool = Field(
        default=True,
        description="Score wait relative to the request's own patience; False = wait / 1 s (ablation).",
    )
    fair_lane: bool = Field(
        default=True,
        description="Merge the arrival-ordered Fair lane by work charges; False = Fast lane only (ablation).",
    )
