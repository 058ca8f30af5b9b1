"""Validated parameters of TWP and the decode baselines (pydantic, ``extra="forbid"``).

Defaults follow the issue where the paper (seeds ``001_*``) is silent; each field says
which. ``None`` for ``H0``, ``Q``, ``H_min`` and ``H_max`` means "derived from the engine
profile and ``L_bar``" (see :func:`controllers.decode.twp.resolve`).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator

Fraction = Annotated[float, Field(ge=0.0, le=1.0)]


class TWPConfig(BaseModel):
    """Token Window Pacing parameters (paper §IV-A, §IV-B, §V)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    L_bar: int = Field(
        default=50,
        ge=1,
        description="Expected mean output length L_bar (tokens); a workload setting. "
        "Paper: H0 = B0 * L_bar = 8 * 50 = 400.",
    )
    H0: float | None = Field(
        default=None,
        gt=0,
        description="Nominal token window H0 (tokens); None: B0 * L_bar from the profile.",
    )
    gamma: float = Field(
        default=0.15, gt=0.0, le=1.0, description="Window control gain gamma (paper: 0.15)."
    )
    C: int = Field(
        default=64,
        ge=1,
        description="Prefill chunk size C (tokens per request per step; paper: 64).",
    )
    Q: float | None = Field(
        default=None,
        gt=0,
        description="Queue depth at which the queue term of H* saturates; None: B0 (issue default).",
    )
    H_min: float | None = Field(
        default=None, gt=0, description="Lower clamp of the window (tokens); None: L_bar."
    )
    H_max: float | None = Field(
        default=None, gt=0, description="Upper clamp of the window (tokens); None: 2 * H0."
    )
    itl_filter: float = Field(
        default=0.25,
        gt=0.0,
        le=1.0,
        description="Exponential-filter constant of the smoothed ITL l_hat (issue: 0.2-0.3).",
    )
    T_max: int = Field(
        default=200,
        ge=1,
        description="Force-admit threshold (decode steps waited); also scales the starvation term.",
    )
    w1: float = Field(default=0.5, ge=0.0, description="Weight of the starvation priority.")
    w2: float = Field(default=0.3, ge=0.0, description="Weight of the token-balance score T(r).")
    w3: float = Field(default=0.2, ge=0.0, description="Weight of the fairness score.")
    ablation: bool = Field(
        default=False,
        description="Allow weights outside w1 > w2 > w3 (ablation runs only).",
    )
    delta_base: Fraction = Field(
        default=0.02, description="KV guard base delta_base (fraction of total blocks)."
    )
    kv_k: float = Field(
        default=1.0, ge=0.0, description="KV guard gain k on the block-consumption EWMA."
    )
    kv_horizon_steps: int = Field(
        default=16, ge=1, description="KV guard horizon (steps of consumption to keep free)."
    )
    kv_filter: float = Field(
        default=0.25,
        gt=0.0,
        le=1.0,
        description="EWMA constant of the blocks consumed per step.",
    )
    delta_min: Fraction = Field(default=0.01, description="Lower clamp of delta_kv (fraction).")
    delta_max: Fraction = Field(default=0.25, description="Upper clamp of delta_kv (fraction).")
    median_window: int = Field(
        default=256,
        ge=1,
        description="Output lengths kept per tenant for the running median behind L_hat.",
    )
    survival_l_hat: bool = Field(
        default=False,
        description="For running requests past the median, estimate L_hat as the median of "
        "the tenant's lengths above the tokens generated (not in the paper; off by default).",
    )
    empty_batch_admit: bool = Field(
        default=True,
        description="Admit the top candidate past the window when the active set is empty "
        "(an idle engine never holds work; counted as 'empty_batch').",
    )

    @model_validator(mode="after")
    def _check(self) -> TWPConfig:
        if not self.ablation and not (self.w1 > self.w2 > self.w3):
            raise ValueError(
                f"w1 > w2 > w3 is required (got w1={self.w1}, w2={self.w2}, w3={self.w3}); "
                "set ablation=True for other weights"
            )
        if self.w1 + self.w2 + self.w3 <= 0:
            raise ValueError("w1 + w2 + w3 must be > 0")
        if self.delta_min > self.delta_max:
            raise ValueError(
                f"delta_min ({self.delta_min}) must be <= delta_max ({self.delta_max})"
            )
        if self.H_min is not None and self.H_min < self.L_bar:
            raise ValueError(f"H_min ({self.H_min}) must be >= L_bar ({self.L_bar})")
        if self.H_min is not None and self.H_max is not None and self.H_min > self.H_max:
            raise ValueError(f"H_min ({self.H_min}) must be <= H_max ({self.H_max})")
        return self


class DynamicBatchConfig(BaseModel):
    """DynamicBatch baseline: cap the batch while the ITL exceeds a static target."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    itl_target_factor: float = Field(
        default=1.2, gt=0.0, description="Static ITL target as a multiple of l_min (issue: 1.2)."
    )
    itl_filter: float = Field(
        default=0.25, gt=0.0, le=1.0, description="Exponential-filter constant on step latency."
    )
    batch_cap: int | None = Field(
        default=None, ge=1, description="Batch cap applied while over target; None: B0."
    )
