"""The engine replica: a vLLM engine (prefill or decode role) in one Serve replica.

In a request's path: the ingress's router picks a replica of the role and calls it through
Serve (:mod:`.calls`); the replica runs the call on its engine runtime
(:mod:`engines.runtime`) and streams chunks (:class:`~deployments.protocol.EngineChunk`)
back.
This module is the Serve class itself: its start-up and shutdown, and the concerns it is
built from, one module each: :mod:`.calls`, :mod:`.health`, :mod:`.live_config`,
:mod:`.reports`, :mod:`.faults`, with its index side in :mod:`.index_writer`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace
from typing import Any

from controllers.routing import InflightPrefixes
from controllers.slo_sizing import RECENT_PROMPTS
from deployments.config import AppConfig, Role, engine_launch, replica_ports
from deployments.engine.counters import EngineCounters, make_counter_logger, vllm_metrics_loggers
from deployments.engine.faults import Faults
from deployments.engine.identity import free_port, node_id, node_ip, serve_identity
from deployments.engine.index_writer import IndexWriter
from deployments.engine.reports import QUEUED_PREFIX_TTL_S, Reports
from deployments.protocol import EngineRequest, Sampling
from deployments.telemetry import CounterPublisher, LoopLag, metrics, tracer
from engines.runtime import AsyncLLMEngine, InProcessEngine


class EngineReplica(Reports, Faults):
    """A vLLM engine (prefill or decode role) in one Serve replica.

    Contract: constructed with the validated app config (as a dict, so Serve can pickle it) and a
    role. At start the replica resolves its own ports (NIXL side channel, KV events: a base plus
    its rank on the node, or free ports), builds its engine through
    :func:`engines.launch.start_engine`, and, for a prefill replica with an index, checks that
    its engine hashes blocks as the ingress does (:func:`cluster.probe.probe_hash_mode`: a
    mismatch refuses the replica or switches it to token re-hashing, per
    ``hashing.on_mismatch``). With the Redis index it also feeds its own KV events into Redis
    (one writer per replica; it drops its entries when it shuts down: :mod:`.index_writer`).
    It answers calls only after its engine has served a request end to end.

    ``record_routing_stats()`` is its load report (Serve polls it for the routers): the engine
    thread's snapshot, its KV-event endpoints, hash mode, and cumulative request counters.
    """

    async def __init__(self, config: dict[str, Any], role: Role) -> None:  # type: ignore[misc]
        self.cfg = AppConfig.model_validate(config)
        self.role = role
        self.replica_id, rank, self.app_name = serve_identity()
        taken: set[int] = set()
        self.node_ip, self.node_id = node_ip(), node_id()
        self.ports = replica_ports(self.cfg, role, rank, self.node_ip, lambda: free_port(taken))
        self.counters = EngineCounters()
        self.metrics = metrics()
        self.tracer = tracer(self.cfg.observability.tracing.model_dump(), role)
        self._twp_events = CounterPublisher("pdserve_twp_events")
        self._feed_events = CounterPublisher("pdserve_index_feed_events")
        launch = engine_launch(self.cfg, role, self.ports)
        self.index_writer = IndexWriter(self.cfg, self.app_name, self.replica_id, launch.kv_events)
        loggers = [make_counter_logger(self.counters, role), *vllm_metrics_loggers()]
        self.runtime = launch.runtime
        if launch.runtime == "async_llm":
            self.engine = AsyncLLMEngine(launch, loggers)
            await self.engine.start()
        else:
            self.engine = InProcessEngine(
                launch, loggers, transfer_poll_s=self.cfg.engine(role).transfer_poll_s
            )
        self._finishing = set()
        self.loop_lag = LoopLag()
        self.loop_lag.start()
        self._rss = (0.0, None)
        self._ready = False
        self.kv_released = 0
        self._seq = 0
        self.live_config_error = None
        self.live_config_applied = 0
        self.live_config_refused = 0
        self.requests = 0
        self.in_flight = 0
        self.warm = not (self.cfg.ingress.warm_up and self.cfg.mode == "pd")
        self._prefill_rate = None
        self.first_call = None
        self._prefills = 0
        self._busy_since = 0.0
        self._busy_s = 0.0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.recent_prompts = deque(maxlen=RECENT_PROMPTS)
        self.queued_prefixes = InflightPrefixes(ttl_s=QUEUED_PREFIX_TTL_S)
        if role == "prefill" and self.cfg.index.backend != "none" and self.ports.kv_events:
            vocab = int(self.engine.model_config.get_vocab_size())
            await self.index_writer.start(self._hash_probe, vocab)
        await self.ready()
        n = max(1, min(1024, self.cfg.model.max_model_len // 2))
        self._prefill_rate = await self.engine.rpc("prefill_rate", n)
        self.calibration = None
        self.stream_loss = None
        decodes_here = role == "decode" or self.cfg.mode == "colocated"
        if decodes_here and self.cfg.engine(role).calibrate_decode:
            await self._calibrate_decode()

    async def _hash_probe(self, ids: list[int], salt: str | None) -> None:
        """One request of the start-up hash probe (:meth:`IndexWriter.start`)."""
        self._seq += 1
        req = EngineRequest(f"hash-probe-{self._seq}", tuple(ids), Sampling(max_tokens=1))
        req = replace(req, cache_salt=salt)
        async for _ in self._generate(req, req.sampling.to_vllm_kwargs(), None, delta=False):
            pass

    async def model_path(self) -> str:
        """The model folder this engine loaded (clients use its tokenizer)."""
        return str(self.cfg.model.resolved_path())

    async def __del__(self) -> None:
        """The last step of Serve's graceful shutdown (scale-down, redeploy), after Serve
        stopped routing to this replica and its calls drained (within
        ``graceful_shutdown_timeout_s``, which is ``drain_timeout_s``): its index entries go
        first, so no ingress routes by them; then it waits, bounded, until its engine holds
        no KV for a transfer (a prefill's blocks a decode replica has yet to pull: stopping
        now would fail that pull); then the engine stops."""
        writer = getattr(self, "index_writer", None)
        if writer is not None:
            writer.drop()  # the Redis feed's entries; nothing without one
        eng = getattr(self, "engine", None)
        if eng is not None:
            cfg = getattr(self, "cfg", None)
            wait = cfg is not None and self.wedged() is None  # a wedged engine is not waited on
            await eng.close(cfg.engine(self.role).drain_kv_s if wait and cfg else None)
        lag = getattr(self, "loop_lag", None)
        if lag is not None:
            lag.stop()
