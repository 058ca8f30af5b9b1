"""What vLLM's stat loggers feed in an engine replica: its cumulative counters and metrics.

vLLM calls a stat logger after every engine step (in the replica's process under both
runtimes: ``AsyncLLM`` sends the core's stats back to it). :func:`make_counter_logger` adds
each step's prefix-cache, transferred-prefix and failed-KV-load counts into the replica's
:class:`EngineCounters` (its ``stats()`` and load report) and the app's metrics
(``pdserve_*_hit_tokens``, ``pdserve_kv_load_failures``); :func:`vllm_metrics_loggers` adds
vLLM's own engine series through Ray's metrics API when the replica runs in Ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deployments.telemetry import metrics


@dataclass
class EngineCounters:
    """Cumulative engine counters (tokens), fed by :class:`CounterStatLogger`."""

    prefix_queries: int = 0
    prefix_hits: int = 0
    external_queries: int = 0
    external_hits: int = 0
    kv_load_failures: int = 0
    requests_finished: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


def _count_failed_transfers(stats: Any) -> int:
    """Failed NIXL transfers in one step's ``kv_connector_stats`` (a nested dict of lists)."""
    if isinstance(stats, dict):
        n = 0
        for k, v in stats.items():
            if k == "num_failed_transfers":
                n += len(v) if isinstance(v, list) else int(v)
            else:
                n += _count_failed_transfers(v)
        return n
    data = getattr(stats, "data", None)
    return _count_failed_transfers(data) if isinstance(data, dict) else 0


def make_counter_logger(counters: EngineCounters, role: str = "") -> Any:
    """A vLLM stat-logger factory whose loggers add each step's stats into ``counters`` and
    the app's metrics (``pdserve_*_hit_tokens``, ``pdserve_kv_load_failures``)."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    m = metrics()

    class CounterStatLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.counters = counters

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            c = self.counters
            if scheduler_stats is not None:
                c.prefix_queries += scheduler_stats.prefix_cache_stats.queries
                c.prefix_hits += scheduler_stats.prefix_cache_stats.hits
                m.inc(
                    "pdserve_prefix_hit_tokens", scheduler_stats.prefix_cache_stats.hits, role=role
                )
                ext = scheduler_stats.connector_prefix_cache_stats
                if ext is not None:
                    c.external_queries += ext.queries
                    c.external_hits += ext.hits
                    m.inc("pdserve_external_hit_tokens", ext.hits, role=role)
                if scheduler_stats.kv_connector_stats:
                    failed = _count_failed_transfers(scheduler_stats.kv_connector_stats)
                    c.kv_load_failures += failed
                    m.inc("pdserve_kv_load_failures", failed, role=role)
            if iteration_stats is not None:
                c.requests_finished += len(iteration_stats.finished_requests)

        def log_engine_initialized(self) -> None:
            pass

    return CounterStatLogger


def vllm_metrics_loggers() -> list[Any]:
    """vLLM's own engine metrics through Ray's metrics API (``ray_vllm_*``), as Ray Serve
    LLM exports them; none outside Ray."""
    try:
        import ray

        if not ray.is_initialized():
            return []
        from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger
    except Exception:  # an older vLLM without it: our own series still go out
        return []
    return [RayPrometheusStatLogger]
