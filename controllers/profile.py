"""The engine profile: what one engine on one hardware type costs.

One pydantic model, stored as JSON, read by the prefill policies (patience), both
simulators and TWP. The simulators ship the papers' defaults (``engines/profiles``, see ``engines.profile_store``);
``pdserve profile`` writes measured ones.

Units: tokens are ``int``, times are seconds (``float``).

Layering note: ``controllers/`` may import stdlib, numpy and pydantic. pydantic is
pure validation with no I/O; it is allowed here so that the one config tree can
validate the policies' own parameters (docs/design.md, shape 6).
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterable
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PrefillTable(_Frozen):
    """Idle-engine prefill time against full prompt length, measured once per hardware type."""

    prompt_tokens: list[int] = Field(
        description="Prompt lengths (tokens), strictly increasing, at least two points.",
        min_length=2,
    )
    seconds: list[float] = Field(
        description="Prefill time on an idle engine for each prompt length (s), non-decreasing.",
        min_length=2,
    )

    @model_validator(mode="after")
    def _check(self) -> PrefillTable:
        if len(self.prompt_tokens) != len(self.seconds):
            raise ValueError(
                "prefill.prompt_tokens and prefill.seconds must have the same length "
                f"({len(self.prompt_tokens)} != {len(self.seconds)})"
            )
        if any(b <= a for a, b in zip(self.prompt_tokens, self.prompt_tokens[1:], strict=False)):
            raise ValueError("prefill.prompt_tokens must be strictly increasing")
        if any(t <= 0 for t in self.prompt_tokens):
            raise ValueError("prefill.prompt_tokens must be positive")
        if any(s < 0 for s in self.seconds):
            raise ValueError("prefill.seconds must be non-negative")
        if any(b < a for a, b in zip(self.seconds, self.seconds[1:], strict=False)):
            raise ValueError("prefill.seconds must be non-decreasing in prompt length")
        return self

    def seconds_for(self, prompt_tokens: int) -> float:
        """Expected idle prefill time of a prompt of ``prompt_tokens`` tokens (s).

        Linear interpolation inside the table; below the first point, scaled
        proportionally from the origin; beyond the last point, extrapolated with the
        slope of the last segment (attention makes long prompts superlinear, so this
        underestimates slightly rather than inventing a curve the table does not hold).
        """
        xs, ys = self.prompt_tokens, self.seconds
        n = max(0, int(prompt_tokens))
        if n <= xs[0]:
            return ys[0] * n / xs[0]
        if n >= xs[-1]:
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
            return ys[-1] + slope * (n - xs[-1])
        i = bisect.bisect_right(xs, n)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (n - x0) / (x1 - x0)


class StepCost(_Frozen):
    """Cost of one engine step: ``fixed_s + per_token_s * scheduled + attn_per_ctx_token_s * sum(ctx)``."""

    fixed_s: float = Field(ge=0, description="Fixed overhead of a step (s).")
    per_token_s: float = Field(ge=0, description="Cost per scheduled token (s/token).")
    attn_per_ctx_token_s: float = Field(
        ge=0,
        description="Attention cost per scheduled token per token of context it attends to (s/token^2).",
    )

    @staticmethod
    def terms(chunks: Iterable[tuple[int, int]]) -> tuple[float, float]:
        """A step's ``(tokens, context)`` over its chunks ``(c, p)``: ``c`` tokens of a request
        from position ``p``, each attending to ``p`` cached tokens plus its own causal
        prefix (``sum c`` and ``sum c p + c (c + 1) / 2``): what the coefficients multiply."""
        tokens = attn = 0.0
        for c, p in chunks:
            tokens += c
            attn += c * p + c * (c + 1) / 2
        return tokens, attn

    def seconds(self, chunks: Iterable[tuple[int, int]]) -> float:
        """One step's cost over its chunks ``(c, p)`` (see :meth:`terms`)."""
        tokens, attn = self.terms(chunks)
        return self.fixed_s + self.per_token_s * tokens + self.attn_per_ctx_token_s * attn

    def scaled(self, factor: float) -> StepCost:
        """Every step ``factor`` times as long (all three coefficients scaled)."""
        return StepCost(
            fixed_s=self.fixed_s * factor,
            per_token_s=self.per_token_s * factor,
            attn_per_ctx_token_s=self.attn_per_ctx_token_s * factor,
        )


class DecodeProfile(_Frozen):
    """Decode step latency model ``l(B) = l_min`` for ``B <= b0``, ``l_min + alpha_s * (B - b0)`` beyond."""

    l_min_s: float = Field(gt=0, description="Decode step latency at small batch (s).")
    b0: int = Field(ge=1, description="Saturation batch size B0: step time is flat up to it.")
    alpha_s: float = Field(ge=0, description="Added step latency per request beyond B0 (s).")

    def step_latency_s(self, batch: int) -> float:
        """ITL of one synchronous decode step at batch size ``batch``."""
        return self.l_min_s + self.alpha_s * max(0, batch - self.b0)

    def rescaled(self, l_min_s: float) -> DecodeProfile:
        """The curve with a measured floor ``l_min_s``, ``alpha`` scaled by the same factor
        (a slower node is slower per added sequence too), ``b0`` kept: how the TWP gate takes
        a measured floor (``engines.scheduler.calibrate_decode``)."""
        scale = l_min_s / self.l_min_s
        return self.model_copy(update={"l_min_s": l_min_s, "alpha_s": self.alpha_s * scale})


class EngineProfile(_Frozen):
    """What one engine costs on one hardware type (JSON on disk)."""

    hardware: str = Field(description="Hardware the profile was measured or modelled on.")
    model: str = Field(description="Model the profile belongs to.")
    source: str = Field(
        default="",
        description="How the numbers were obtained (measured by `pdserve profile`, or derived from a paper).",
    )
    block_size: int = Field(ge=1, description="KV block size in tokens.")
    token_budget: int = Field(ge=1, description="Tokens scheduled per engine step at most.")
    kv_blocks: int | None = Field(
        default=None, ge=1, description="KV cache capacity in blocks, if known."
    )
    prefill: PrefillTable = Field(
        description="Idle prefill time vs prompt length: the patience table."
    )
    step_cost: StepCost = Field(description="Per-step cost model used by the prefill simulator.")
    decode: DecodeProfile = Field(description="Decode step latency vs batch size.")

    def prefill_seconds(self, prompt_tokens: int) -> float:
        return self.prefill.seconds_for(prompt_tokens)

    def with_step_cost_scaled(self, factor: float) -> EngineProfile:
        """This profile with every step ``factor`` times as long (:meth:`StepCost.scaled`)."""
        return self.model_copy(update={"step_cost": self.step_cost.scaled(factor)})

    @classmethod
    def load(cls, path: str | Path) -> EngineProfile:
        return cls.model_validate_json(Path(path).read_text())

    def dump(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.model_dump(mode="json"), indent=2) + "\n")
