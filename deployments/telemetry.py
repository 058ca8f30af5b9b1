"""Traces (OpenTelemetry SDK) and metrics (Ray's metrics API, scraped as Prometheus) of the app.

**Traces.** One trace per request across every hop: the ingress's ``pdserve.request`` span (a
child of the client's W3C ``traceparent`` when it sends one) with ``pdserve.prepare``,
``pdserve.route``, ``pdserve.prefill`` and ``pdserve.decode`` under it; each engine replica's
``engine.prefill`` / ``engine.decode`` span is a child of the ingress's call span, its context
carried in :attr:`deployments.protocol.EngineRequest.trace` (the W3C headers). Engine spans
carry the policy's decision at admission (Fairway lane and rank, TWP window and slowdown) and
vLLM's own queue and first-token times. The exporter is set by ``observability.tracing``:
``none``, ``console``, ``otlp`` (HTTP, to ``endpoint``) or ``file`` (JSON lines, one file per
process under ``path``; what the tests read).

**Metrics.** Series named ``pdserve_*`` through ``ray.util.metrics``; Ray's metrics agent
exports them with a ``ray_`` prefix at the cluster's metrics export port (``pdserve up`` starts
Ray with ``--metrics-export-port=8080``: ``http://127.0.0.1:8080/metrics``). vLLM's own engine
metrics are bridged in by its ``RayPrometheusStatLogger`` (``ray_vllm_*``). Outside a Ray
process (unit tests) every metric is a no-op.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PROPAGATOR = TraceContextTextMapPropagator()
_LOCK = threading.Lock()
_TRACERS: dict[str, trace.Tracer] = {}


class JsonLinesSpanExporter(SpanExporter):
    """Finished spans as JSON lines in ``{path}/spans-{service}-{pid}.jsonl`` (one file per
    process, so replicas on one machine never interleave a line)."""

    def __init__(self, path: str | Path, service: str) -> None:
        self.dir = Path(path).expanduser()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.file = self.dir / f"spans-{service}-{os.getpid()}.jsonl"
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = [json.dumps(json.loads(s.to_json()), separators=(",", ":")) for s in spans]
        with self._lock, open(self.file, "a") as f:
            f.write("".join(line + "\n" for line in lines))
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


class UrandomIdGenerator(IdGenerator):
    """Trace and span ids from ``os.urandom``. OpenTelemetry's default draws them from
    Python's ``random``, which vLLM seeds identically in every engine process (the model's
    seed), so two replicas would mint the same span ids, and new traces the same trace ids."""

    def generate_span_id(self) -> int:
        while True:
            v = int.from_bytes(os.urandom(8), "big")
            if v != trace.INVALID_SPAN_ID:
                return v

    def generate_trace_id(self) -> int:
        while True:
            v = int.from_bytes(os.urandom(16), "big")
            if v != trace.INVALID_TRACE_ID:
                return v


def tracer(tracing: Mapping[str, Any] | None, service: str) -> trace.Tracer:
    """This process's tracer for ``service`` under the config ``tracing`` (the dict of
    ``observability.tracing``); a no-op tracer when its exporter is ``none``. Each process
    builds its provider once (not the global one: Ray's and vLLM's own hooks keep theirs)."""
    cfg = dict(tracing or {})
    exporter = cfg.get("exporter", "none")
    key = f"{service}:{exporter}"
    with _LOCK:
        if key in _TRACERS:
            return _TRACERS[key]
        if exporter == "none":
            t: trace.Tracer = trace.NoOpTracer()
        else:
            provider = TracerProvider(
                resource=Resource.create({"service.name": f"pdserve-{service}"}),
                sampler=ParentBased(TraceIdRatioBased(float(cfg.get("sample_ratio", 1.0)))),
                id_generator=UrandomIdGenerator(),
            )
            if exporter == "file":
                provider.add_span_processor(
                    SimpleSpanProcessor(JsonLinesSpanExporter(cfg["path"], service))
                )
            elif exporter == "console":
                provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
            elif exporter == "otlp":
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                    OTLPSpanExporter,
                )

                endpoint = cfg.get("endpoint")
                exp = OTLPSpanExporter(endpoint=endpoint) if endpoint else OTLPSpanExporter()
                provider.add_span_processor(BatchSpanProcessor(exp))
            else:
                raise ValueError(f"observability.tracing.exporter: unknown {exporter!r}")
            t = provider.get_tracer("pdserve")
        _TRACERS[key] = t
        return t


def extract(headers: Mapping[str, str] | None) -> Context:
    """The context a W3C ``traceparent`` (HTTP headers, or an engine request's carrier) names;
    an empty context when there is none."""
    return _PROPAGATOR.extract(dict(headers or {}))


def inject(span: trace.Span) -> dict[str, str]:
    """The W3C headers that make ``span`` the parent on the other side of a call."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier


def child(t: trace.Tracer, name: str, parent: trace.Span, **attrs: Any) -> trace.Span:
    """A span under ``parent`` (started now; the caller ends it)."""
    span = t.start_span(name, context=trace.set_span_in_context(parent))
    set_attrs(span, attrs)
    return span


def set_attrs(span: trace.Span, attrs: Mapping[str, Any]) -> None:
    """Set ``pdserve.*`` attributes, skipping ``None`` (OpenTelemetry refuses it)."""
    for k, v in attrs.items():
        if v is not None:
            span.set_attribute(k if "." in k else f"pdserve.{k}", v)


# -- metrics -----------------------------------------------------------------------------------

#: Latency buckets (seconds): from a cached prefill on a GPU to a long CPU decode.
LATENCY_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120]
#: Inter-token latency buckets (seconds).
ITL_S = [0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2]

#: name -> (kind, description, tag keys, buckets): every series the app exports; the
#: dashboard (``k8s/grafana/pdserve.json``) and its test read this table.
SERIES: dict[str, tuple[str, str, tuple[str, ...], list[float] | None]] = {
    "pdserve_requests": (
        "counter", "Requests answered by the ingress, by tenant, endpoint and HTTP status.",
        ("tenant", "endpoint", "status"), None,
    ),
    "pdserve_rate_limited": (
        "counter", "Requests refused with 429, by tenant and the limit (requests, tokens).",
        ("tenant", "limit"), None,
    ),
    "pdserve_overload_spared": (
        "counter", "Requests admitted past an overload bound because their tenant held less "
        "than an equal share of the prompts in flight (the flooding tenants got the 503s) or "
        "their prompts were mostly cached, by tenant.", ("tenant",), None,
    ),
    "pdserve_auth_refused": (
        "counter", "Requests refused before their body was read, by tenant ('-' when no key "
        "matched) and reason (invalid_key, address_throttled, wrong_kind_of_key, "
        "rate_limited).", ("tenant", "reason"), None,
    ),
    "pdserve_deadline_exceeded": (
        "counter", "Requests whose deadline passed (504; both engines aborted them), by "
        "tenant and the phase it passed in (prefill, decode).", ("tenant", "phase"), None,
    ),
    "pdserve_replica_retries": (
        "counter", "Requests sent again after their engine replica died before the client "
        "got anything, by phase (prefill, decode).", ("phase",), None,
    ),
    "pdserve_migrations": (
        "counter", "Streams whose decode replica was lost after tokens were sent, by reason "
        "(replica_gone, engine_failed) and outcome (migrated; failed; or why not moved: off, "
        "limit, too_long, structured_output, deadline).", ("reason", "outcome"), None,
    ),
    "pdserve_migration_stall_seconds": (
        "histogram", "The gap a client of a migrated stream saw: from the last token before "
        "its decode replica was lost to the first from the replica it moved to.", (),
        LATENCY_S,
    ),
    "pdserve_cold_start_wait_seconds": (
        "histogram", "Time a request waited at a role's handle for a replica to start "
        "(serverless: the role was at zero), by role.", ("role",), LATENCY_S,
    ),
    "pdserve_ttft_seconds": (
        "histogram", "Time to the first token, at the ingress.", ("tenant",), LATENCY_S,
    ),
    "pdserve_itl_seconds": (
        "histogram", "Mean inter-token latency of a request, at the ingress.", ("tenant",), ITL_S,
    ),
    "pdserve_e2e_seconds": (
        "histogram", "Whole request time, at the ingress.", ("tenant",), LATENCY_S,
    ),
    "pdserve_ingress_overhead_seconds": (
        "histogram", "Request time outside both engines.", (), LATENCY_S,
    ),
    "pdserve_prompt_tokens": ("counter", "Prompt tokens served.", ("tenant",), None),
    "pdserve_cached_tokens": (
        "counter", "Prompt tokens found in the prefill's prefix cache.", ("tenant",), None,
    ),
    "pdserve_completion_tokens": ("counter", "Tokens generated.", ("tenant",), None),
    "pdserve_routed": (
        "counter", "Requests routed, by role, replica and the router's reason.",
        ("role", "replica", "reason"), None,
    ),
    "pdserve_routing_fallbacks": (
        "counter", "Named routing fallbacks (index_unavailable, hotspot, ...).",
        ("role", "fallback"), None,
    ),
    "pdserve_index_lookup_seconds": (
        "histogram", "Prefix-index lookups at the ingress.", ("result",), LATENCY_S,
    ),
    "pdserve_engine_queue_wait_seconds": (
        "histogram", "Time a request waited in an engine's queue (vLLM's queued -> scheduled).",
        ("role",), LATENCY_S,
    ),
    "pdserve_engine_waiting": ("gauge", "Requests waiting in an engine.", ("role", "replica"), None),
    "pdserve_engine_running": ("gauge", "Requests running in an engine.", ("role", "replica"), None),
    "pdserve_engine_queued_uncached_tokens": (
        "gauge",
        "Uncached prompt tokens an engine owes: queued, and running prompts' chunks to come.",
        ("role", "replica"),
        None,
    ),
    "pdserve_engine_kv_usage": (
        "gauge", "Share of an engine's KV blocks in use.", ("role", "replica"), None,
    ),
    "pdserve_twp_window_tokens": (
        "gauge", "The TWP gate's token window.", ("role", "replica"), None,
    ),
    "pdserve_twp_token_load": (
        "gauge", "Tokens the running requests hold against the TWP window.",
        ("role", "replica"), None,
    ),
    "pdserve_twp_slowdown": (
        "gauge", "The TWP gate's measured slowdown (ITL over the profile's l_min).",
        ("role", "replica"), None,
    ),
    "pdserve_fairway_admissions": (
        "counter", "Requests a Fairway scheduler admitted, by lane.", ("role", "lane"), None,
    ),
    "pdserve_twp_events": (
        "counter", "TWP's counted decisions (admitted, force_admitted, closed_by_window, ...).",
        ("role", "replica", "event"), None,
    ),
    "pdserve_index_feed_events": (
        "counter", "Events of the KV-event feed and tracker of each followed prefill replica "
        "(connects, resyncs, replays, block_events, gaps, ...).", ("replica", "event"), None,
    ),
    "pdserve_prefix_hit_tokens": (
        "counter", "Prompt tokens an engine found in its own prefix cache.", ("role",), None,
    ),
    "pdserve_external_hit_tokens": (
        "counter", "Prompt tokens an engine loaded over NIXL.", ("role",), None,
    ),
    "pdserve_kv_load_failures": (
        "counter", "Failed NIXL KV loads (the decode recomputes them).", ("role",), None,
    ),
}  # fmt: skip


class _Null:
    def inc(self, *a: Any, **k: Any) -> None:
        pass

    def observe(self, *a: Any, **k: Any) -> None:
        pass

    def set(self, *a: Any, **k: Any) -> None:
        pass


class Metrics:
    """The app's series in this process (``ray.util.metrics``), or no-ops outside Ray."""

    def __init__(self) -> None:
        self._m: dict[str, Any] = {}
        try:
            import ray
            from ray.util import metrics as rm

            live = ray.is_initialized()
        except Exception:  # no Ray: unit tests
            live = False
        for name, (kind, desc, tags, buckets) in SERIES.items():
            if not live:
                self._m[name] = _Null()
            elif kind == "counter":
                self._m[name] = rm.Counter(name, description=desc, tag_keys=tags)
            elif kind == "gauge":
                self._m[name] = rm.Gauge(name, description=desc, tag_keys=tags)
            else:
                self._m[name] = rm.Histogram(
                    name, description=desc, boundaries=buckets or LATENCY_S, tag_keys=tags
                )

    def inc(self, name: str, value: float = 1.0, **tags: str) -> None:
        if value:
            self._m[name].inc(value, tags=tags or None)

    def observe(self, name: str, value: float, **tags: str) -> None:
        self._m[name].observe(value, tags=tags or None)

    def set(self, name: str, value: float | None, **tags: str) -> None:
        if value is not None:
            self._m[name].set(float(value), tags=tags or None)


_METRICS: Metrics | None = None


def metrics() -> Metrics:
    """This process's :class:`Metrics` (built on first use; no lock after that, since
    routers and the index call it per request)."""
    global _METRICS
    if _METRICS is not None:
        return _METRICS
    with _LOCK:
        if _METRICS is None:
            _METRICS = Metrics()
        return _METRICS


class CounterPublisher:
    """Publishes the increases of cumulative counters (dataclasses such as ``FeedStats``,
    ``TrackerStats``, or their dicts, as ``TWPCounters`` comes from the engine's report: the
    counters the components keep for ``/v1/pdserve/stats``) as one metric, a field per
    ``event`` tag, so both read one source."""

    def __init__(self, series: str) -> None:
        self.series = series
        self.last: dict[tuple[Any, ...], int] = {}

    def publish(self, counters: Any, **tags: str) -> None:
        import dataclasses

        key0 = tuple(sorted(tags.items()))
        items = (
            counters.items()
            if isinstance(counters, dict)
            else ((f.name, getattr(counters, f.name)) for f in dataclasses.fields(counters))
        )
        for name, v in items:
            if not isinstance(v, int) or isinstance(v, bool):
                continue
            key = (key0, name)
            d = v - self.last.get(key, 0)
            if d > 0:
                metrics().inc(self.series, d, event=name, **tags)
            self.last[key] = v


class LoopLag:
    """How late an event loop runs a timer: every ``period_s`` one sleep, and how much later
    than asked it woke (the time every callback on the loop waits behind whatever holds it:
    a step loop holding the interpreter lock, a blocking call). :meth:`report` gives the p50,
    p99 and max of the last ``window`` samples in milliseconds, and the max since start."""

    def __init__(self, period_s: float = 0.05, window: int = 1200) -> None:
        from collections import deque

        self.period_s = period_s
        self.samples: deque[float] = deque(maxlen=window)
        self.max_s = 0.0
        self._task: Any = None

    def start(self) -> None:
        import asyncio

        async def run() -> None:
            loop = asyncio.get_running_loop()
            while True:
                t = loop.time()
                await asyncio.sleep(self.period_s)
                self.add(max(0.0, loop.time() - t - self.period_s))

        self._task = asyncio.get_running_loop().create_task(run())

    def add(self, lag_s: float) -> None:
        self.samples.append(lag_s)
        self.max_s = max(self.max_s, lag_s)

    def report(self) -> dict[str, float | int]:
        xs = sorted(self.samples)
        if not xs:
            return {"samples": 0}

        def q(p: float) -> float:
            return round(xs[min(len(xs) - 1, int(p * len(xs)))] * 1e3, 3)

        return {
            "samples": len(xs),
            "p50_ms": q(0.5),
            "p99_ms": q(0.99),
            "max_ms": round(xs[-1] * 1e3, 3),
            "max_since_start_ms": round(self.max_s * 1e3, 3),
        }

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
