"""The application's one validated config tree, and the one place that reads environment
variables.

``AppConfig`` is what a Serve YAML's ``applications[].args`` holds (``deployments.app:build_app``
validates it); every model forbids unknown keys, every field says what it is, bounds live in the
types, and cross-field errors name the fields. The engines' own settings are validated here too
(the scheduler class is a choice among the shipped ones; its parameters are
:class:`engines.config.EngineSchedulerConfig`), so a bad plug-in setting fails the deploy.

One module per section of the tree, everything importable from here:

- :mod:`~deployments.config.model` ``model``; :mod:`~deployments.config.hashing` ``hashing``;
  :mod:`~deployments.config.engine` ``prefill`` / ``decode``; :mod:`~deployments.config.ingress`
  ``ingress``; :mod:`~deployments.config.tenants` ``tenants``; :mod:`~deployments.config.index`
  ``index``; :mod:`~deployments.config.routing` ``routing``;
  :mod:`~deployments.config.observability` ``observability``.
- :mod:`~deployments.config.app`: the whole tree (:class:`AppConfig`, its cross-field checks)
  and :func:`apply_env_overrides`, the only reader of ``PDSERVE_*`` variables.
- :mod:`~deployments.config.live`: the deployments' Serve ``user_config`` (no restart).
- :mod:`~deployments.config.launch`: :func:`replica_ports` and :func:`engine_launch` turn the
  config into one replica's :class:`engines.launch.EngineLaunch` (its ports resolved per
  replica, so two replicas of one role on one node never collide).

A section module imports its siblings by their own names, never this package, so there is no
cycle inside it.
"""

from __future__ import annotations

from deployments.config.app import (
    DEFAULT_CACHE_DIR,
    ENV_API_KEYS,
    ENV_CACHE_DIR,
    ENV_MODEL,
    ENV_REDIS_URL,
    AppConfig,
    apply_env_overrides,
    load_app_config,
)
from deployments.config.common import Port, Role
from deployments.config.engine import EngineConfig, KVEventsConfig
from deployments.config.hashing import HashingConfig
from deployments.config.index import IndexConfig, RedisUser, RedisUsers
from deployments.config.ingress import IngressConfig
from deployments.config.launch import (
    ReplicaPorts,
    engine_launch,
    kv_events_ipc_dir,
    kv_events_launch,
    replica_ports,
)
from deployments.config.live import (
    EngineLiveConfig,
    IngressLiveConfig,
    LiveConfigError,
    live_defaults,
    parse_live_config,
)
from deployments.config.model import ModelConfig
from deployments.config.observability import ObservabilityConfig, TracingConfig
from deployments.config.routing import AppRoutingConfig
from deployments.config.tenants import (
    DEFAULT_REQUESTS_PER_SECOND,
    DEFAULT_TOKENS_PER_MINUTE,
    TenantLimits,
    TenantName,
    TenantsConfig,
)

__all__ = [
    "DEFAULT_CACHE_DIR",
    "DEFAULT_REQUESTS_PER_SECOND",
    "DEFAULT_TOKENS_PER_MINUTE",
    "ENV_API_KEYS",
    "ENV_CACHE_DIR",
    "ENV_MODEL",
    "ENV_REDIS_URL",
    "AppConfig",
    "AppRoutingConfig",
    "EngineConfig",
    "EngineLiveConfig",
    "HashingConfig",
    "IndexConfig",
    "IngressConfig",
    "IngressLiveConfig",
    "KVEventsConfig",
    "LiveConfigError",
    "ModelConfig",
    "ObservabilityConfig",
    "Port",
    "RedisUser",
    "RedisUsers",
    "ReplicaPorts",
    "Role",
    "TenantLimits",
    "TenantName",
    "TenantsConfig",
    "TracingConfig",
    "apply_env_overrides",
    "engine_launch",
    "kv_events_ipc_dir",
    "kv_events_launch",
    "live_defaults",
    "load_app_config",
    "parse_live_config",
    "replica_ports",
]
