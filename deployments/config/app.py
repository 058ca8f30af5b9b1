"""The whole tree (:class:`AppConfig`), its cross-field checks, and the one reader of
``PDSERVE_*`` environment variables (:func:`apply_env_overrides`, :func:`load_app_config`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import ConfigDict, Field, model_validator

from controllers.autoscale import AutoscaleConfig, RoleBounds
from deployments.config.common import Role, _Strict
from deployments.config.engine import EngineConfig
from deployments.config.hashing import HashingConfig
from deployments.config.index import IndexConfig
from deployments.config.ingress import IngressConfig
from deployments.config.model import ModelConfig
from deployments.config.observability import ObservabilityConfig
from deployments.config.routing import AppRoutingConfig
from deployments.config.tenants import TenantsConfig
from engines.config import EngineSchedulerConfig

#: Environment variables read by :func:`apply_env_overrides` (and nowhere else).
ENV_MODEL = "PDSERVE_MODEL"
ENV_API_KEYS = "PDSERVE_API_KEYS"
ENV_CACHE_DIR = "PDSERVE_CACHE_DIR"
ENV_REDIS_URL = "PDSERVE_REDIS_URL"

DEFAULT_CACHE_DIR = "~/.cache/pdserve"


class AppConfig(_Strict):
    """The whole prefill/decode application."""

    # errors name the field and say why, but never echo the value: a refused value may be a
    # secret (a Redis URL with its password) and errors go to logs and Serve's status
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    mode: Literal["pd", "colocated"] = Field(
        default="pd",
        description="pd: prefill and decode on their own replicas, KV handed over by NIXL. "
        "colocated: one engine does both phases (the TWP paper's setting: "
        "engines.scheduler.ColocatedScheduler, Fairway and TWP with chunked prefill); the "
        "'prefill' block configures those engines, routed by the prefix index, and 'decode' "
        "is not used.",
    )
    model: ModelConfig = Field(default_factory=ModelConfig, description="The served model.")
    hashing: HashingConfig = Field(
        default_factory=HashingConfig, description="KV block hashing (engines and ingress)."
    )
    prefill: EngineConfig = Field(
        default_factory=lambda: EngineConfig(num_cpus=1.0, cpu_bind="0"),
        description="The prefill engine replicas (kv_producer).",
    )
    decode: EngineConfig = Field(
        default_factory=lambda: EngineConfig(num_cpus=1.0, cpu_bind="1"),
        description="The decode engine replicas (kv_consumer).",
    )
    ingress: IngressConfig = Field(default_factory=IngressConfig, description="The HTTP ingress.")
    tenants: TenantsConfig = Field(
        default_factory=TenantsConfig, description="API keys, tenant limits, cache sharing."
    )
    index: IndexConfig = Field(default_factory=IndexConfig, description="The prefix index.")
    routing: AppRoutingConfig = Field(
        default_factory=AppRoutingConfig, description="Routing of prefill and decode requests."
    )
    observability: ObservabilityConfig = Field(
        default_factory=ObservabilityConfig, description="Traces (OpenTelemetry) and metrics."
    )
    autoscaling: AutoscaleConfig = Field(
        default_factory=AutoscaleConfig,
        description="Serverless autoscaling of the engine deployments (controllers.autoscale); "
        "when enabled, each role's replica count moves within its bounds and "
        "prefill.num_replicas / decode.num_replicas are not used.",
    )
    cache_dir: str = Field(
        default=DEFAULT_CACHE_DIR,
        description="Folder for vLLM's and torch inductor's caches ('~' expands).",
    )

    def check_auth(self) -> None:
        """Closed by default: with ``ingress.auth: keys`` some key source must exist, else a
        ``ValueError`` naming the field (called when the app is built and by ``pdserve up``,
        so a config without keys still validates for tools that only read it)."""
        if self.ingress.auth != "keys":
            return
        if self.tenants.has_keys() or self.tenants.keys_in_redis or self.ingress.api_keys:
            return
        raise ValueError(
            "ingress.auth: 'keys' (the default) but no key source is configured: set "
            "tenants.keys_file (pdserve keys new TENANT --file F), tenants.key_hashes, "
            "tenants.keys_in_redis or ingress.api_keys; or ingress.auth: none for an endpoint "
            "only you can reach (Serve's proxy on loopback)"
        )

    @model_validator(mode="after")
    def _consistent(self) -> AppConfig:
        if self.index.backend == "memory" and self.ingress.num_replicas > 1:
            raise ValueError(
                f"index.backend: 'memory' keeps the index inside one ingress process, but "
                f"ingress.num_replicas={self.ingress.num_replicas}; use 'redis'"
            )
        p, d = self.prefill, self.decode
        np_, nd = self.max_replicas("prefill"), self.max_replicas("decode")
        _no_overlap(
            "nixl_side_channel_port",
            _span(p.nixl_side_channel_port, 1, np_),
            _span(d.nixl_side_channel_port, 1, nd),
        )
        _no_overlap(  # a publisher and a replay port per replica
            "kv_events.port",
            _span(p.kv_events.port, 2, np_),
            _span(d.kv_events.port, 2, nd),
        )
        for role, e in (("prefill", p), ("decode", d)):
            try:
                self.scheduler_config(role)  # type: ignore[arg-type]
            except ValueError as err:
                raise ValueError(f"{role}.scheduler_config.profile: {err}") from None
            if e.max_num_batched_tokens < self.hashing.block_size:
                raise ValueError(
                    f"{role}.max_num_batched_tokens={e.max_num_batched_tokens} is below one "
                    f"KV block (hashing.block_size={self.hashing.block_size})"
                )
        return self

    def engine(self, role: Role) -> EngineConfig:
        """The engine config of ``role``."""
        return self.prefill if role == "prefill" else self.decode

    def max_replicas(self, role: Role) -> int:
        """The most replicas ``role`` runs: its autoscaling bound, else ``num_replicas``."""
        if self.autoscaling.enabled:
            bounds: RoleBounds = getattr(self.autoscaling, role)
            return bounds.max_replicas
        return self.engine(role).num_replicas

    def model_preset(self) -> str:
        """The model's preset: from its folder's model card when built, else
        ``model.build_preset`` (``"unknown"`` for a model not built here)."""
        from engines.model_builder import model_preset

        found = model_preset(self.model.resolved_path())
        if found == "unknown" and self.model.build_preset is not None:
            return self.model.build_preset
        return found

    def resolved_autoscaling(self) -> AutoscaleConfig:
        """``autoscaling`` as the policy gets it: with ``slo`` set and no ``slo.decode_step``,
        the step curve of the profile the decode role resolves (``scheduler_config``), so the
        ITL target sizes decode without the operator copying the profile; unchanged when the
        role has no profile (decode is then sized by the TWP window and KV only)."""
        slo = self.autoscaling.slo
        if slo is None or slo.decode_step is not None:
            return self.autoscaling
        role: Role = "prefill" if self.mode == "colocated" else "decode"
        try:
            sc = self.scheduler_config(role)
        except ValueError:  # profile: auto with nothing measured and no fallback
            return self.autoscaling
        if sc is None or sc.profile is None:
            return self.autoscaling
        from engines.profile_store import load_profile

        try:
            prof = load_profile(sc.profile) if isinstance(sc.profile, str) else sc.profile
        except FileNotFoundError:  # the engine's own load of it names the error
            return self.autoscaling
        step = slo.model_copy(update={"decode_step": prof.decode})
        return self.autoscaling.model_copy(update={"slo": step})

    def scheduler_config(self, role: Role) -> EngineSchedulerConfig | None:
        """``role``'s scheduler plug-in config with ``profile: auto`` resolved (the profile
        measured for this platform, vLLM and model preset, else ``profile_fallback``);
        ``ValueError`` when neither exists."""
        sc = self.engine(role).scheduler_config
        if sc is None or sc.profile != "auto":
            return sc
        from engines.profile_store import resolve_auto

        return sc.model_copy(
            update={"profile": resolve_auto(self.model_preset(), sc.profile_fallback)}
        )


def _span(base: int | None, per_replica: int, replicas: int) -> range | None:
    """The ports ``replicas`` replicas take from a configured ``base`` (None: free ports)."""
    return None if base is None else range(base, base + per_replica * replicas)


def _no_overlap(name: str, a: range | None, b: range | None) -> None:
    if a is not None and b is not None and set(a) & set(b):
        raise ValueError(
            f"prefill.{name} and decode.{name} give overlapping port ranges ({a.start}-"
            f"{a.stop - 1} and {b.start}-{b.stop - 1}): each engine replica needs its own ports"
        )


def apply_env_overrides(
    raw: Mapping[str, Any], environ: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """Return ``raw`` (a Serve YAML's ``args``) with ``PDSERVE_*`` environment overrides applied.

    The only reader of the project's environment variables:

    - ``PDSERVE_MODEL``: ``model.path``;
    - ``PDSERVE_API_KEYS``: ``ingress.api_keys`` as ``key1=tenant1,key2=tenant2``;
    - ``PDSERVE_CACHE_DIR``: ``cache_dir``;
    - ``PDSERVE_REDIS_URL``: ``index.redis_url`` (e.g. a Kubernetes Service's address).

    A malformed ``PDSERVE_API_KEYS`` is a ``ValueError`` naming the variable.
    """
    env = os.environ if environ is None else environ
    out: dict[str, Any] = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in raw.items()}
    if env.get(ENV_MODEL):
        out.setdefault("model", {})["path"] = env[ENV_MODEL]
    if env.get(ENV_CACHE_DIR):
        out["cache_dir"] = env[ENV_CACHE_DIR]
    if env.get(ENV_REDIS_URL):
        out.setdefault("index", {})["redis_url"] = env[ENV_REDIS_URL]
    if env.get(ENV_API_KEYS):
        keys: dict[str, str] = {}
        for item in env[ENV_API_KEYS].split(","):
            key, sep, tenant = item.strip().partition("=")
            if not sep or not key or not tenant:
                raise ValueError(
                    f"{ENV_API_KEYS}: {item!r} is not 'key=tenant' (expected "
                    "'key1=tenant1,key2=tenant2')"
                )
            keys[key] = tenant
        out.setdefault("ingress", {})["api_keys"] = keys
    return out


def load_app_config(
    raw: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
) -> AppConfig:
    """Validate ``raw`` (plus environment overrides) into an :class:`AppConfig`.

    Raises ``pydantic.ValidationError`` whose messages name the offending fields.
    """
    return AppConfig.model_validate(apply_env_overrides(raw or {}, environ))
