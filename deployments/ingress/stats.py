"""What the ingress measures and reports: each finished request's overhead, phase times,
metrics and trace end (:meth:`StatsView.record`), and the operator's
``/v1/pdserve/stats`` (every replica's last load report, the routers, the index, this
ingress's counters).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from opentelemetry.trace import Status, StatusCode

from deployments.ingress.admission import AdmissionPhase
from deployments.ingress.request import Prepared, Tally, cached_tokens, endpoint_of
from deployments.protocol import EngineChunk
from deployments.router_registry import router_stats
from deployments.telemetry import set_attrs

if TYPE_CHECKING:
    from deployments.ingress.core import IngressCore


class Records(AdmissionPhase):
    """Each finished request's record; a part of :class:`~deployments.ingress.core.IngressCore`."""

    def _init_stats(self) -> None:
        self.overhead_s: deque[float] = deque(maxlen=4096)
        #: per phase, the last requests' seconds outside the engines: ``prepare`` (auth,
        #: tokenize, hash), ``route`` (index lookup), ``prefill`` (the prefill call's wall
        #: time minus the replica's engine time: routing, transport, queueing in Serve),
        #: ``decode_first`` (the same up to the decode's first chunk), ``decode`` (up to its
        #: last), ``respond`` (after the last chunk until the response is done); and the
        #: engines' own time beside them (queueing in the engine included), which is where a
        #: TTFT goes when the overhead is small: ``prefill_engine`` (the prefill replica, from
        #: receiving the request to its result) and ``decode_first_engine`` (the decode
        #: replica, to its first chunk: admission, the KV pull, the first step)
        self.phases: dict[str, deque[float]] = {
            k: deque(maxlen=4096)
            for k in (
                "prepare",
                "route",
                "cold_start",
                "prefill",
                "prefill_engine",
                "decode_first",
                "decode_first_engine",
                "decode",
                "respond",
            )
        }

    def record_all(self, tally: Tally, status: int) -> list[tuple[float, float]]:
        """:meth:`record` for every part; the first (which holds the trace's root span) last,
        so the root ends after every prompt of a batch."""
        parts = tally.parts
        out = [
            self.record(parts[k][0], parts[k][1], tally.last[k], tally.n_out[k], status)
            for k in range(len(parts) - 1, -1, -1)
        ]
        return out[::-1]

    def record(
        self,
        prep: Prepared,
        pre: EngineChunk,
        last: EngineChunk | None,
        n_out: int = 0,
        status: int = 200,
    ) -> tuple[float, float]:
        """Record one finished request: its overhead (wall time minus both engines' time) and
        phase times (see ``phases``), its metrics, and the end of its trace; returns ``(wall
        seconds, engine seconds)``."""
        now = time.monotonic()
        total_s = now - prep.t0
        engine_s = pre.engine_s + (last.engine_s if last else 0.0)
        self.overhead_s.append(max(0.0, total_s - engine_s))
        for k, v in prep.run.timing.items():
            self.phases[k].append(max(0.0, v))
        if prep.run.last_chunk_at is not None:
            self.phases["respond"].append(now - prep.run.last_chunk_at)
        self.give_back(prep)
        m, tenant = self.metrics, prep.tenant
        m.inc("pdserve_requests", tenant=tenant, endpoint=endpoint_of(prep), status=str(status))
        m.observe("pdserve_e2e_seconds", total_s, tenant=tenant)
        m.observe("pdserve_ingress_overhead_seconds", max(0.0, total_s - engine_s))
        m.inc("pdserve_prompt_tokens", len(prep.ids), tenant=tenant)
        m.inc("pdserve_cached_tokens", cached_tokens(prep, pre), tenant=tenant)
        m.inc("pdserve_completion_tokens", n_out, tenant=tenant)
        ttft = None
        if prep.run.first_chunk_at is not None:
            ttft = prep.run.first_chunk_at - prep.t0
            m.observe("pdserve_ttft_seconds", ttft, tenant=tenant)
            per_seq = n_out / max(1, prep.sampling.n)
            if prep.run.last_chunk_at is not None and per_seq > 1:
                itl = (prep.run.last_chunk_at - prep.run.first_chunk_at) / (per_seq - 1)
                m.observe("pdserve_itl_seconds", itl, tenant=tenant)
        if prep.run.span is not None:
            set_attrs(
                prep.run.span,
                {
                    "prefill_replica": pre.replica_id,
                    "decode_replica": last.replica_id if last else None,
                    "cached_tokens": cached_tokens(prep, pre),
                    "completion_tokens": n_out,
                    "ttft_s": ttft,
                    "engine_s": engine_s,
                },
            )
            finish_span(prep.run.span, status, None)
            prep.run.span = None
        return total_s, engine_s


#: Statistics of the directory reports shown per replica in ``/v1/pdserve/stats``.
_REPORT_KEYS = (
    "warm",
    "first_call",
    "requests",
    "prompt_tokens",
    "cached_tokens",
    "queued_uncached_tokens",
    "waiting",
    "running",
    "kv_usage",
    "free_kv_blocks",
    "kv_pinned_requests",
    "window_tokens",
    "token_load",
    "hash_mode",
    "external_hits",
    "prefix_hits",
    "kv_load_failures",
    "requests_aborted",
    "kv_released",
    "requests_finished",
    "requests_in_flight",
    "total_kv_blocks",
    "tracked_blocks",
    "wedged",
    "runtime",
    "pid",
    "node_ip",
    "node_id",
    "loop_lag",
    "rss_mb",
    "engine_cpus",
    "scheduler",
)


async def report(core: IngressCore, reset: bool = False) -> dict[str, Any]:
    """Replicas (from their last load reports), routers, index and ingress counters;
    ``reset`` starts this ingress's overhead and phase samples afresh after reading (the
    operator's ``POST /v1/pdserve/stats/reset``)."""
    from controllers.stats import summarize

    replicas: dict[str, list[dict[str, Any]]] = {}
    totals: dict[str, dict[str, Any]] = {}
    for role, d in core.directories.items():
        rows = []
        for rid, rep in sorted(d.snapshot().items()):
            ts = float(rep.get("ts", 0.0) or 0.0)
            rows.append(
                {"id": rid, "routed": rep.get("requests", 0)}
                | {k: rep[k] for k in _REPORT_KEYS if k in rep}
                # when the engine's load was read (wall clock): a report older than a
                # few periods is stale (a wedged engine's, or one Serve has not polled)
                | ({"report_ts": ts} if ts else {})
                # how many prompt blocks of its prefill calls it reported (the routers count
                # them as its prefix before its KV events reach the index)
                | ({"queued_blocks": len(rep["queued_blocks"])} if "queued_blocks" in rep else {})
            )
        replicas[role] = rows
        totals[role] = {
            k: sum(r.get(k, 0) or 0 for r in rows)
            for k in ("routed", "prompt_tokens", "cached_tokens", "external_hits")
        }
    routers = {role: router_stats(core.app_name, role) for role in ("prefill", "decode")}
    ingress = {
        "replica": core.replica_id,
        "requests": core.requests,
        "refused": core.refused,
        "overhead_s": summarize(list(core.overhead_s)) if core.overhead_s else None,
        "phases_s": {k: summarize(list(v)) for k, v in core.phases.items() if v},
        "prefill_queue": {
            "in_flight": core._inflight_prefill,
            "uncached_tokens": core._inflight_uncached,
            "peak": core.inflight_peak,
            "overload_refused": core.overload_refused,
            "wait_refused": core.wait_refused,
            "overload_spared": core.overload_spared,
            "overload_spared_reuse": core.overload_spared_reuse,
            "expected_wait_s": core.expected_wait_s,
        },
        "deadline_exceeded": core.deadline_exceeded,
        "replica_retries": dict(core.replica_retries),
        "migrations": {k: dict(v) for k, v in core.migrations.items()},
        "migration_last": core.migration_last,
        "kv_released": dict(core.kv_released),
        "decode_local": core.decode_local,
        "cold_start_waits": dict(core.cold_start_waits),
        "cold_start_last_s": dict(core.cold_start_last_s),
        "warm_up": {
            "pairs_warmed": sorted(f"{p}->{d}" for p, d in core._warm),
            "failures": core.warm_up_failures,
            "seconds": [round(x, 3) for x in core.warm_up_s[-16:]],
        },
        "live_config": {
            "routing": core.cfg.routing.model_dump(mode="json"),
            "migration": core.cfg.ingress.model_dump(
                include={"migration_limit", "migration_max_tokens"}
            ),
            "applied": core.live_applied,
            "refused": core.live_refused,
            "error": core.live_error,
        },
        "rate_limits": {"backend": core.limiter.backend}
        | asdict(core.limiter.stats)
        | {"reserved_tokens": dict(sorted(core.reserved_tokens.items())[:256])},
        "keys": asdict(core.keys.stats),
        "auth": {
            "mode": core.cfg.ingress.auth,
            "refused": dict(core.gate.refused),
        },
        "render_timeouts": core.render_timeouts,
        "template_sandbox": core.sandbox.stats() if core.sandbox is not None else None,
    }
    if reset:
        core.overhead_s.clear()
        for v in core.phases.values():
            v.clear()
    fallbacks: dict[str, int] = {}
    for r in routers.values():
        for name, n in r["fallbacks"].items():
            fallbacks[name] = fallbacks.get(name, 0) + n
    return {
        "replicas": replicas,
        "totals": totals,
        "router": {
            "policy": core.cfg.routing.policy,
            "fallbacks": fallbacks,
            "prefill": routers["prefill"],
            "decode": routers["decode"],
        },
        "index": {
            "backend": core.cfg.index.backend,
            **core.index.stats.__dict__,
            "feeds": core.index.feed_stats(),
        },
        "ingress": ingress,
        "autoscaling": await autoscaling_report(core),
    }


async def autoscaling_report(core: IngressCore) -> dict[str, Any] | None:
    """The serverless autoscaler's last decisions for this app (with their reasons, the
    demand they saw and the measured cold starts), as its policy published them."""
    if not core.autoscaling:
        return None
    from deployments.autoscaling import read_decisions

    roles = ("prefill",) if core.colocated else ("prefill", "decode")
    app = await asyncio.to_thread(read_decisions, core.app_name)
    if app is None:  # no application-level policy: each role's own
        per_role = {
            r: await asyncio.to_thread(read_decisions, f"{core.app_name}/{r}") for r in roles
        }
        return {"scope": "deployment", "roles": per_role}
    return app


def finish_span(span: Any, status: int, message: str | None) -> None:
    span.set_attribute("http.response.status_code", status)
    if status >= 400:
        span.set_status(Status(StatusCode.ERROR, message))
    span.end()
