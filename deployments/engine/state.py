"""What one engine replica holds: the state its concerns share, declared in one place.

:class:`~deployments.engine.replica.EngineReplica` is one Serve class built from one mixin per
concern (:mod:`.calls`, :mod:`.health`, :mod:`.live_config`, :mod:`.reports`,
:mod:`.faults`); each reads and writes the attributes declared here, which the replica's
``__init__`` sets at start.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

from controllers.routing import InflightPrefixes
from deployments.config import AppConfig, ReplicaPorts, Role
from deployments.engine.counters import EngineCounters
from deployments.engine.index_writer import IndexWriter
from deployments.telemetry import CounterPublisher, LoopLag, Metrics
from engines.runtime import AsyncLLMEngine, InProcessEngine


class ReplicaState:
    """The attributes of an engine replica (set by ``EngineReplica.__init__``)."""

    cfg: AppConfig
    role: Role
    replica_id: str
    app_name: str
    #: the Ray node it runs on: its address and hex id (None outside Ray)
    node_ip: str
    node_id: str | None
    ports: ReplicaPorts
    #: ``in_process`` or ``async_llm`` (:mod:`engines.runtime`)
    runtime: str
    engine: InProcessEngine | AsyncLLMEngine
    #: cumulative engine counters, fed by vLLM's stat loggers (:mod:`.counters`)
    counters: EngineCounters
    metrics: Metrics
    tracer: Any
    _twp_events: CounterPublisher
    _feed_events: CounterPublisher
    #: this replica's KV events and, with an index, its hash mode and Redis feed
    index_writer: IndexWriter
    #: the admission records and spans still being finished (:meth:`.calls.Calls._finish`)
    _finishing: set[asyncio.Task[None]]
    #: how late this replica's event loop runs (calls in, chunks out)
    loop_lag: LoopLag
    _rss: tuple[float, float | None]
    _ready: bool
    #: prefill KV released early at the ingress's word (``release_kv``)
    kv_released: int
    #: numbers this replica's own requests (probes, calibration)
    _seq: int
    live_config_error: str | None
    live_config_applied: int
    live_config_refused: int
    requests: int
    #: engine calls (prefill or decode) running in this replica now
    in_flight: int
    #: warm: an engine call has completed here (the ingress's warm-up of a new replica's
    #: pairs is one), so the routers may send it clients' requests; without the ingress's
    #: warm-up (colocated, or ``ingress.warm_up: false``) warm once ready
    warm: bool
    #: the engine profile's prefill rate (tokens/s), until a measured one replaces it
    _prefill_rate: float | None
    #: the request id of the first engine call after start-up (a warm-up's, when the
    #: routers sent this replica nothing before it was warm)
    first_call: str | None
    #: prefill calls running now, and the seconds at least one has run (the measured
    #: prefill throughput is the uncached tokens prefilled over those seconds)
    _prefills: int
    _busy_since: float
    _busy_s: float
    prompt_tokens: int
    cached_tokens: int
    #: the uncached tokens of the last prompts prefilled here (their mean and p99 go to the
    #: SLO autoscaler: ``record_autoscaling_stats``)
    recent_prompts: deque[int]
    #: the prompt blocks of the prefill calls this replica holds (queued or running, and a
    #: grace after, until its KV events reach the index): reported to every router
    #: (``queued_blocks``) so that a new prefix's followers find it through any ingress
    queued_prefixes: InflightPrefixes
    #: an armed stream loss, ``(prompt tokens, after tokens)`` (:mod:`.faults`; tests, benches)
    stream_loss: tuple[int, int] | None
    #: TWP's decode calibration at start (:meth:`.live_config.LiveConfig._calibrate_decode`)
    calibration: dict[str, float] | None
