"""The deployments' Serve ``user_config``: what changes without a restart."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from controllers.config import FairwayConfig
from controllers.decode.config import TWPConfig
from deployments.config.app import AppConfig
from deployments.config.common import Role, _Strict
from deployments.config.routing import AppRoutingConfig


class EngineLiveConfig(_Strict):
    """An engine deployment's Serve ``user_config``: the scheduler plug-in's parameters that
    change without a restart (``serve deploy`` with a new ``user_config``; Serve calls the
    replicas' ``reconfigure``). A section left out keeps its values; a section given is the
    whole section (its fields left out take their defaults, not their current values)."""

    fairway: FairwayConfig | None = Field(
        default=None, description="Fairway's parameters (prefill; new arrivals see them)."
    )
    twp: TWPConfig | None = Field(
        default=None, description="TWP's parameters (decode; the next step sees them)."
    )


class MigrationLiveConfig(_Strict):
    """``ingress.migration_limit`` and ``ingress.migration_max_tokens``, live."""

    migration_limit: int = Field(default=2, ge=0, le=16)
    migration_max_tokens: int | None = Field(default=None, ge=1, le=10_000_000)


class IngressLiveConfig(_Strict):
    """The ingress deployment's Serve ``user_config``: the routing parameters, reloaded
    without a restart. ``policy`` may move between the index-aware policies, not to or from
    ``serve_default`` (another router class), and ``stats_period_s`` is Serve's: both need a
    redeploy."""

    routing: AppRoutingConfig | None = Field(
        default=None, description="Routing of prefill and decode requests (all fields)."
    )
    migration: MigrationLiveConfig | None = Field(
        default=None,
        description="Stream migration when a decode replica is lost (both fields; "
        "ingress.migration_limit and ingress.migration_max_tokens).",
    )


class LiveConfigError(ValueError):
    """A ``user_config`` refused; the message names the field and says the old values stay."""


def parse_live_config(model: type[_Strict], raw: Any) -> Any:
    """Validate a ``user_config`` as ``model``; :class:`LiveConfigError` naming the field."""
    from pydantic import ValidationError

    try:
        return model.model_validate(raw or {})
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "user_config"
        raise LiveConfigError(
            f"user_config.{where}: {first['msg']} (the old values stay)"
        ) from None


def live_defaults(cfg: AppConfig) -> dict[str, dict[str, Any]]:
    """Each deployment's initial ``user_config`` (what the app args say), by deployment name:
    ``serve deploy`` replaces it with the YAML's ``deployments[].user_config``."""
    out: dict[str, dict[str, Any]] = {}
    roles: tuple[Role, Role] = ("prefill", "decode")
    for role in roles:
        sc = cfg.engine(role).scheduler_config
        out[role] = (
            {} if sc is None else {"fairway": sc.fairway.model_dump(), "twp": sc.twp.model_dump()}
        )
    out["ingress"] = {
        "routing": cfg.routing.model_dump(mode="json"),
        "migration": cfg.ingress.model_dump(include={"migration_limit", "migration_max_tokens"}),
    }
    return out
