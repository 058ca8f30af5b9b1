"""Parameters of the vLLM scheduler plug-ins (one node of the project's config tree).

The plug-ins are constructed by vLLM inside its engine process, so their parameters travel
in vLLM's own config: ``additional_config={"pdserve": {...}}`` (``--additional-config`` on
the command line). :func:`engine_config_from_vllm` validates them when the scheduler is
built, so a bad value is an error at engine start that names the field.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from controllers.config import FairwayConfig
from controllers.decode.config import TWPConfig
from controllers.prefill import prefill_policy_names
from controllers.profile import EngineProfile

ADDITIONAL_CONFIG_KEY = "pdserve"


class EngineSchedulerConfig(BaseModel):
    """What a pdserve scheduler plug-in does inside one vLLM engine."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prefill_policy: str | None = Field(
        default=None,
        description="Waiting-queue order by registry name (fcfs, lpm, fairway, ...); "
        "None: the scheduler class's default (FairwayScheduler: fairway; TWPScheduler: none, "
        "i.e. vLLM's own arrival order).",
    )
    fair_share: bool = Field(
        default=False,
        description="Put the prefill policy inside a fair share among tenants, measured in "
        "uncached prompt tokens (controllers.prefill.fairshare); off: the policy as the "
        "paper has it. Needs a prefill policy (FairwayScheduler and ColocatedScheduler have "
        "one by default; TWPScheduler only when prefill_policy names one): without one it is "
        "a config error, not ignored.",
    )
    fair_share_chunks: bool = Field(
        default=True,
        description="With fair_share: running prefill chunks are in the share too (vLLM runs "
        "every running request before any waiting one, so a flood's prompts in progress "
        "would take each step ahead of a lighter tenant's waiting request): they go least "
        "served tenant first, and a tenant served more than a tenant with a waiting request sits "
        "the step out (controllers.prefill.fairshare.chunk_turns); off: vLLM's running order.",
    )
    fairway: FairwayConfig = Field(
        default_factory=FairwayConfig, description="Fairway's parameters (paper values)."
    )
    gate: Literal["default", "none", "twp"] = Field(
        default="default",
        description="Admission gate: twp (Token Window Pacing), none, or the class default.",
    )
    twp: TWPConfig = Field(default_factory=TWPConfig, description="TWP's parameters.")
    step_tokens: int | None = Field(
        default=None,
        ge=16,
        description="Tokens one engine step may schedule (vLLM's max_num_scheduled_tokens, at "
        "most max_num_batched_tokens); None: the engine's budget. A request, however short or "
        "cached, waits for the step in progress and then rides a step of its own, so its TTFT "
        "is at least about 1.5 steps whatever its order: a smaller step bounds that wait on a "
        "slow engine "
        "(issue 39's quiet tenant: docs/design/matrix_39_causes.md).",
    )
    step_target_s: float | None = Field(
        default=None,
        gt=0,
        description="Seconds one engine step should take: the step's token budget follows "
        "the measured seconds per token of the steps that decoded nothing "
        "(controllers/step_budget.py), at least 64 tokens and at most step_tokens (else the "
        "engine's budget); None: a fixed budget. The portable form of step_tokens, for "
        "prefill engines.",
    )
    colocated_chunking: bool = Field(
        default=True,
        description="Colocated mode: set vLLM's long_prefill_token_threshold to TWP's chunk C "
        "when the engine has none (vLLM keeps doing the chunking).",
    )
    profile: EngineProfile | str | None = Field(
        default=None,
        description="Engine profile (patience table, decode l_min/B0/alpha): inline, a JSON "
        "path, a shipped profile name, or 'auto' (the serving layer picks the profile "
        "measured for this platform, vLLM and model preset; none: profile_fallback, else a "
        "config error). Needed by fairway, peek and twp.",
    )
    profile_fallback: str | None = Field(
        default=None,
        description="With profile 'auto': the profile (shipped name or JSON path) used when "
        "none was measured for this engine and model; null: that is a config error.",
    )
    channel: str | None = Field(
        default=None,
        description="ZMQ endpoint the plug-in publishes its state on (PUB, bound), e.g. "
        "ipc:///tmp/pdserve-prefill-0.state or tcp://127.0.0.1:5601; None: not published.",
    )
    publish_every_steps: int = Field(
        default=1, ge=1, description="Publish the state every this many engine steps."
    )
    engine_name: str = Field(
        default="engine", min_length=1, description="Name of this engine in published state."
    )
    history_steps: int = Field(
        default=20000, ge=1, description="Per-step timing records kept in memory (a ring)."
    )

    @field_validator("profile")
    @classmethod
    def _profile_loads(cls, v: EngineProfile | str | None) -> EngineProfile | str | None:
        """A profile named by path or shipped name must load (at deploy time, not in the
        engine later)."""
        if isinstance(v, str) and v != "auto":
            from engines.profile_store import load_profile

            try:
                load_profile(v)
            except Exception as e:  # a missing file, a bad shipped name, a malformed JSON
                raise ValueError(f"{v!r} cannot be loaded: {e}") from None
        return v

    @field_validator("profile_fallback")
    @classmethod
    def _fallback_loads(cls, v: str | None) -> str | None:
        return None if v is None else cls._profile_loads(v)  # type: ignore[return-value]

    @model_validator(mode="after")
    def _check(self) -> EngineSchedulerConfig:
        if self.prefill_policy is not None and self.prefill_policy not in prefill_policy_names():
            raise ValueError(
                f"prefill_policy: unknown prefill policy {self.prefill_policy!r}; "
                f"known: {', '.join(prefill_policy_names())}"
            )
        return self

    def load_profile(self) -> EngineProfile | None:
        """The profile object (loading a path or shipped name); ``None`` when not set."""
        if self.profile is None or isinstance(self.profile, EngineProfile):
            return self.profile
        if self.profile == "auto":
            raise ValueError(
                "profile: 'auto' is resolved by the serving layer before the engine starts "
                "(deployments.config.engine_launch); here it must name a profile"
            )
        from engines.profile_store import load_profile

        return load_profile(self.profile)


def engine_config_from_vllm(additional_config: Any) -> EngineSchedulerConfig:
    """Validate ``additional_config["pdserve"]``; raise ``ValueError`` naming the bad field."""
    raw: Any = {}
    if isinstance(additional_config, dict):
        raw = additional_config.get(ADDITIONAL_CONFIG_KEY, {})
    try:
        return EngineSchedulerConfig.model_validate(raw)
    except ValidationError as e:
        raise ValueError(
            f"invalid pdserve scheduler config (additional_config[{ADDITIONAL_CONFIG_KEY!r}]): {e}"
        ) from None
