"""One in-process engine for the length of a ``with`` block (the profiler and the one-engine
benchmarks).

Each of them started an engine on ``FairwayScheduler`` in vLLM's own order (``fcfs``, the
run then configures its policy live), measured, and shut the engine core down however the
measurement ended; :func:`llm_session` is that block, once.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from engines.runtime import make_llm

#: The plug-in every measured engine runs: it times the steps and takes a policy live.
MEASURED_SCHEDULER = "engines.scheduler.FairwayScheduler"


@contextmanager
def llm_session(
    model_dir: str | Path,
    *,
    cache_dir: str | Path,
    pdserve: dict[str, Any] | None = None,
    **launch: Any,
) -> Iterator[Any]:
    """An in-process ``vllm.LLM`` (:func:`engines.runtime.make_llm`) on
    :data:`MEASURED_SCHEDULER` with ``prefill_policy: fcfs`` unless ``pdserve`` says otherwise
    (the rest of ``pdserve`` joins it), the other launch arguments as given; its engine core is
    shut down when the block ends, by return or by exception."""
    llm = make_llm(
        model_dir,
        cache_dir=cache_dir,
        scheduler_cls=MEASURED_SCHEDULER,
        pdserve={"prefill_policy": "fcfs", **(pdserve or {})},
        **launch,
    )
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
