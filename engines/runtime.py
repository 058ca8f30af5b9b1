"""Starting an in-process vLLM engine with a pdserve scheduler (tests, profiler, benchmarks).

Keeps the CPU-platform settings in one place (PLATFORM.md): engine in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the live scheduler is reachable, both cores,
eager mode, bfloat16, caches inside ``cache_dir``, offline hub. Every caller that starts an
engine must hold the machine-wide lock (``flock /tmp/pdserve-heavy.lock``); the test fixture
takes it itself.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from engines.config import ADDITIONAL_CONFIG_KEY


def engine_env(cache_dir: str | Path, kv_space_gib: int = 1) -> dict[str, str]:
    """Environment variables for a CPU engine; ``setdefault``-applied by :func:`make_llm`."""
    c = Path(cache_dir)
    return {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": str(kv_space_gib),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_CACHE_ROOT": str(c / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(c / "inductor"),
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }


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
    for k, v in engine_env(cache_dir).items():
        os.environ.setdefault(k, v)
    from vllm import LLM

    return LLM(
        model=str(model),
        tokenizer=str(model),
        dtype="bfloat16",
        enforce_eager=True,
        enable_prefix_caching=True,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        long_prefill_token_threshold=long_prefill_token_threshold,
        num_gpu_blocks_override=kv_blocks,
        scheduler_cls=scheduler_cls,
        additional_config={ADDITIONAL_CONFIG_KEY: pdserve or {}},
        disable_log_stats=not log_stats,
        seed=seed,
    )


def live_scheduler(llm: Any) -> Any:
    """The scheduler object inside an in-process engine."""
    return llm.llm_engine.engine_core.engine_core.scheduler
