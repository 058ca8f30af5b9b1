"""Starting an in-process vLLM engine with a pdserve scheduler (tests, profiler, benchmarks).

A thin front over :mod:`engines.launch`, the one place engines are described and started
(the serving replicas use it too). Every caller that starts an engine must hold the
machine-wide lock (``flock /tmp/pdserve-heavy.lock``); the test fixture takes it itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engines.config import EngineSchedulerConfig
from engines.launch import EngineLaunch, start_llm


def make_llm(
    model: str | Path,
    *,
    cache_dir: str | Path,
    scheduler_cls: str = "engines.scheduler.FairwayScheduler",
    pdserve: dict[str, Any] | None = None,
    kv_blocks: int | None = None,
    max_model_len: int = 4096,
    max_num_batched_tokens: int = 2048,
    max_num_seqs: int = 64,
    long_prefill_token_threshold: int = 0,
    log_stats: bool = True,
    seed: int = 0,
) -> Any:
    """An in-process ``vllm.LLM`` with prefix caching and the given scheduler plug-in.

    ``kv_blocks`` caps the KV cache (``num_gpu_blocks_override``) so eviction happens;
    ``pdserve`` is the :class:`engines.config.EngineSchedulerConfig` as a dict.
    ``log_stats`` keeps vLLM's per-request timings (``RequestOutput.metrics``).
    """
    launch = EngineLaunch.model_validate(
        {
            "model": str(model),
            "cache_dir": str(cache_dir),
            "dtype": "bfloat16",
            "max_model_len": max_model_len,
            "max_num_batched_tokens": max_num_batched_tokens,
            "max_num_seqs": max_num_seqs,
            "long_prefill_token_threshold": long_prefill_token_threshold,
            "kv_blocks": kv_blocks,
            "scheduler_cls": scheduler_cls,
            "scheduler": EngineSchedulerConfig.model_validate(pdserve or {}),
            "log_stats": log_stats,
            "seed": seed,
        }
    )
    return start_llm(launch)


def live_scheduler(llm: Any) -> Any:
    """The scheduler object inside an in-process engine."""
    return llm.llm_engine.engine_core.engine_core.scheduler


def load_report(scheduler: Any) -> dict[str, Any]:
    """A replica's load as the routers read it, taken from a live scheduler (engine thread).

    Keys: ``waiting``, ``running``, ``queued_uncached_tokens`` (waiting requests' tokens not
    yet computed, less their cached prefix when a plug-in's prefix probe is there),
    ``free_kv_blocks``,
    ``total_kv_blocks``, ``kv_usage``, ``kv_pinned_requests`` (finished requests whose blocks
    the engine still holds: on a prefill engine, KV pinned for a decode engine's pull), and
    for a TWP gate ``window_tokens`` and ``token_load`` (``None`` without one: no pacing
    limit).
    """
    pool = scheduler.kv_cache_manager.block_pool
    waiting = list(scheduler.waiting)
    running = list(scheduler.running)
    probe = getattr(scheduler, "probe", None)  # the plug-ins' side-effect-free prefix probe
    cached = probe.refresh(waiting) if probe is not None and waiting else {}
    queued = sum(
        max(0, r.num_tokens - max(r.num_computed_tokens, cached.get(r.request_id, 0)))
        for r in waiting
    )
    gate = getattr(scheduler, "gate", None)
    return {
        "waiting": len(waiting),
        "running": len(running),
        "queued_uncached_tokens": queued,
        "free_kv_blocks": int(pool.get_num_free_blocks()),
        "total_kv_blocks": max(1, int(pool.num_gpu_blocks) - 1),
        "kv_usage": float(scheduler.kv_cache_manager.usage),
        "kv_pinned_requests": max(0, len(scheduler.requests) - len(waiting) - len(running)),
        "window_tokens": float(gate.window_tokens) if gate is not None else None,
        "token_load": float(scheduler._running_token_load()) if gate is not None else None,
    }
