"""The project's NIXL KV connector: vLLM's pull-mode ``NixlConnector`` without NIXL's busy-spinning
progress thread.

vLLM's NIXL worker builds its agent with ``nixl_agent_config(num_threads=..., capture_telemetry=True)``
and never passes ``enable_prog_thread``; NIXL's default starts one progress thread per agent that
polls with a zero delay, so every idle engine spins a core at 100%. vLLM has no setting for it, so
this module is loaded by vLLM instead of its own connector::

    kv_transfer_config = {
        "kv_connector": "NixlConnector",
        "kv_connector_module_path": "engines.nixl_connector",
        "kv_role": "kv_producer",            # or "kv_consumer"
        "kv_buffer_device": "cpu",
        "kv_connector_extra_config": {"nixl_progress_thread": False,  # the default
                                      "nixl_progress_poll_us": 1000},  # the default
    }

The class keeps the name ``NixlConnector`` so vLLM's NIXL-specific checks (which compare the
connector's name) still apply. After the stock worker initialisation, and before any memory is
registered, the worker's agent is replaced by one built with a **paced** progress thread and a
thread-safe sync mode (vLLM calls the agent from its handshake thread as well as the engine
thread).

**Paced progress** (``nixl_progress_poll_us``, 1,000 by default). NIXL's progress thread sleeps
``pthrDelay`` microseconds between polls; NIXL's Python wrapper sets it to 0 (the spin) with no
way to pass another value, so :func:`paced_agent` builds the agent with a config type that
keeps the given delay (swapped in for that one construction, under a lock). Why a thread at
all: without one, NIXL makes progress only when vLLM polls transfer state and notifications,
once per engine step, on both sides of a transfer. A decode step is ~0.1 s and a prefill step
of a long prompt seconds on CPU, so a pull of a few MB that the shared-memory transport moves
in milliseconds took 0.4-4 s on average (vLLM's own ``KV Transfer metrics``: 1.3-9 MB/s, p90
up to 12 s, on the ``bench`` model with two prefill replicas on one core; issue 39), and that
wait was a quarter of the TTFT. At one poll a millisecond the thread costs a few percent of a
core. ``0`` turns the thread off (progress at engine steps only, the previous behaviour).
Nothing installed is patched beyond that one constructor swap.

**No core pin** (``nixl_core_pin``, False by default). On CPU, vLLM's NIXL worker calls
``os.sched_setaffinity(0, [last core of each NUMA node])`` when it is built ("reserve different
cores for start_load_kv() from model_forward()"). That pins the thread building it, which is
the thread that then runs the model's forward (the worker's main thread; an in-process
engine's builder, whose step thread and event loop inherit the pin), so on a 2-core node every
engine ran on core 1 and core 0 held none, whatever ``cpu_bind`` said (issue 39: read per
thread from /proc, every engine of pdserve and of the peer on core 1). This connector gives the
thread back the CPUs it had before the worker was built; ``cpu_bind`` then places the engine
(vLLM's OMP binding in its worker process, :class:`engines.runtime.InProcessEngine` for its
step thread). ``True`` keeps vLLM's pin, for before/after measurements.

**Early release** (:meth:`NixlConnector.release_kv`). A prefill engine keeps a finished
request's blocks until a decode engine has pulled them (its NIXL notification) or the lease
runs out (``kv_lease_duration``, 30 s; decode engines holding the request send heartbeats).
vLLM frees them early when a decode engine aborts the request before its pull (the decode
side's connector notifies the prefill). When no decode engine ever got the request (its call
waited in a Serve handle and the client left), nothing would, so the serving layer asks the
prefill engine itself: the scheduler side queues the request id, the next step's connector
metadata carries it to the worker, and the worker ends the request's lease there, which vLLM's
own expiry path then reaps in the same step (blocks back to the scheduler as ``finished
sending``). The caller must know that no decode engine reads those blocks.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPullConnector
from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = init_logger(__name__)

#: ``kv_connector_extra_config`` key: ``True`` keeps NIXL's own progress thread (vLLM's stock
#: behaviour, for before/after measurements); ``False`` (the default) turns it off.
PROGRESS_THREAD_KEY = "nixl_progress_thread"
#: ``kv_connector_extra_config`` key: with the stock thread off, NIXL's progress thread paced at
#: one poll per this many microseconds (0: no thread; see the module docstring).
PROGRESS_POLL_KEY = "nixl_progress_poll_us"
#: its default
DEFAULT_PROGRESS_POLL_US = 1000
#: ``kv_connector_extra_config`` key: ``True`` keeps vLLM's pin of the building thread to the
#: last core (see the module docstring); ``False`` (the default) gives its CPUs back.
CORE_PIN_KEY = "nixl_core_pin"
#: ``kv_connector_extra_config`` key: ``True`` lets tests fail this process's next KV reads
#: (:func:`fail_next_reads`); off in production.
FAULT_INJECTION_KEY = "pdserve_fault_injection"

_faults_lock = threading.Lock()
_reads_to_fail = 0
failed_on_purpose = 0


def fail_next_reads(n: int) -> None:
    """Fault injection: the next ``n`` KV reads this process starts (on an engine built with
    ``FAULT_INJECTION_KEY``) fail as a read from a vanished peer does: vLLM's connector
    counts a failed transfer and the consumer recomputes the blocks or fails the request
    (``kv_load_failure_policy``). ``0`` disarms."""
    global _reads_to_fail
    with _faults_lock:
        _reads_to_fail = max(0, int(n))


def _take_a_failure() -> bool:
    global _reads_to_fail, failed_on_purpose
    with _faults_lock:
        if _reads_to_fail <= 0:
            return False
        _reads_to_fail -= 1
        failed_on_purpose += 1
        return True


class FaultyAgent:
    """A NIXL agent whose ``transfer`` raises while :func:`fail_next_reads` is armed (the
    connector's own error path takes it from there); everything else is the agent's."""

    def __init__(self, agent: Any) -> None:
        self._agent = agent

    def __getattr__(self, name: str) -> Any:
        return getattr(self._agent, name)

    def transfer(self, handle: Any, *args: Any, **kwargs: Any) -> Any:
        if _take_a_failure():
            raise RuntimeError("pdserve fault injection: this KV read fails on purpose")
        return self._agent.transfer(handle, *args, **kwargs)


def agent_config_without_progress_thread(
    num_threads: int,
    backends: list[str],
    capture_telemetry: bool = True,
    progress_thread: bool = False,
) -> Any:
    """A ``nixl_agent_config`` equal to vLLM's, but with a thread-safe sync mode
    (``NIXL_THREAD_SYNC_STRICT``) and the progress thread off unless ``progress_thread`` (which
    :func:`paced_agent` then paces)."""
    from nixl._api import nixl_agent_config, nixl_thread_sync_t

    non_ucx = [b for b in backends if b != "UCX"]
    kwargs: dict[str, Any] = {
        "enable_prog_thread": progress_thread,
        "capture_telemetry": capture_telemetry,
        "sync_mode": nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
    }
    # Mirror vLLM: a backend list only when it names non-UCX backends, else UCX with num_threads.
    if non_ucx:
        kwargs["backends"] = backends
    else:
        kwargs["num_threads"] = num_threads
    return nixl_agent_config(**kwargs)


_paced_lock = threading.Lock()


def paced_agent(name: str, config: Any, poll_us: int) -> Any:
    """``nixl_agent(name, config)`` whose progress thread sleeps ``poll_us`` microseconds
    between polls. The wrapper builds its ``nixlAgentConfig`` itself and sets ``pthrDelay =
    0``; for this one construction the module's config type is a subclass that keeps
    ``poll_us`` instead (restored at once, under a lock; no other agent is built meanwhile)."""
    import nixl._api as api

    base = api.nixlBind.nixlAgentConfig

    class _Paced(base):  # type: ignore[misc, valid-type]
        def __setattr__(self, key: str, value: Any) -> None:
            super().__setattr__(key, poll_us if key == "pthrDelay" else value)

    with _paced_lock:
        api.nixlBind.nixlAgentConfig = _Paced
        try:
            return api.nixl_agent(name, config)
        finally:
            api.nixlBind.nixlAgentConfig = base


def rebuild_agent_without_progress_thread(worker: Any, poll_us: int = 0) -> None:
    """Replace ``worker.nixl_wrapper`` (a fresh agent, nothing registered yet) by an agent of the
    same name without NIXL's spinning progress thread: with ``poll_us`` > 0 a paced one
    (:func:`paced_agent`), else none. The old agent is dropped first, which joins its
    thread."""
    from nixl._api import nixl_agent

    name: str = worker.nixl_wrapper.name
    num_threads = int(worker.kv_transfer_config.get_from_extra_config("num_threads", 4))
    config = agent_config_without_progress_thread(
        num_threads, list(worker.nixl_backends), progress_thread=poll_us > 0
    )
    worker.nixl_wrapper = None  # release the stock agent (and its spinning thread) first
    if poll_us > 0:
        worker.nixl_wrapper = paced_agent(name, config, poll_us)
        logger.info("pdserve: NIXL agent %s rebuilt, progress polled every %d us", name, poll_us)
    else:
        worker.nixl_wrapper = nixl_agent(name, config)
        logger.info("pdserve: NIXL agent %s rebuilt without its progress thread", name)


def give_back_cpus(cpus: set[int]) -> bool:
    """Set the calling thread's CPUs back to ``cpus`` when something (vLLM's NIXL worker) has
    narrowed them; whether it did. Threads started meanwhile keep what they inherited."""
    now = os.sched_getaffinity(0)
    if now == cpus:
        return False
    os.sched_setaffinity(0, cpus)
    logger.info("pdserve: vLLM's NIXL worker pinned this thread to CPUs %s; back to %s",
                sorted(now), sorted(cpus))  # fmt: skip
    return True


#: metadata attribute carrying the request ids whose lease the worker ends (early release)
RELEASE_ATTR = "pdserve_release"
#: how long the worker keeps looking for a released request it has not seen yet (its
#: ``reqs_to_send`` may arrive in the same step's metadata or a later one)
RELEASE_WAIT_S = 10.0


def end_leases(worker: Any, pending: dict[str, float], released: Any, now: float) -> list[str]:
    """Worker side of the early release: add ``released`` ids to ``pending`` (id -> give-up
    time), then end the lease of each pending request the worker holds for sending (vLLM
    reaps an ended lease in the same step); drop those past their give-up time. Returns the
    ids whose lease was ended."""
    for rid in released or ():
        pending.setdefault(str(rid), now + RELEASE_WAIT_S)
    ended = []
    for rid, give_up in list(pending.items()):
        if rid in worker._reqs_to_send:
            worker._reqs_to_send[rid] = 0.0  # expired: _reap_expired_send_leases frees it
            ended.append(rid)
            del pending[rid]
        elif now >= give_up:
            del pending[rid]
    return ended


class NixlConnector(NixlPullConnector):
    """vLLM's pull-mode NIXL connector whose worker's agent has no progress thread.

    Contract: identical to vLLM's ``NixlConnector`` (roles ``kv_producer`` / ``kv_consumer``,
    ``kv_transfer_params`` in and out); only the agent's threading differs. Set
    ``kv_connector_extra_config["nixl_progress_thread"] = True`` to keep the stock thread, and
    ``["nixl_progress_poll_us"]`` to pace the replacement (0: none); its building thread keeps
    its CPUs unless ``["nixl_core_pin"]`` (the module docstring).
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        ktc = vllm_config.kv_transfer_config
        assert ktc is not None
        cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        super().__init__(vllm_config, role, kv_cache_config)
        if cpus is not None and not ktc.get_from_extra_config(CORE_PIN_KEY, False):
            give_back_cpus(cpus)
        keep_thread = bool(ktc.get_from_extra_config(PROGRESS_THREAD_KEY, False))
        poll_us = int(ktc.get_from_extra_config(PROGRESS_POLL_KEY, DEFAULT_PROGRESS_POLL_US))
        if role == KVConnectorRole.WORKER and self.connector_worker is not None and not keep_thread:
            rebuild_agent_without_progress_thread(self.connector_worker, poll_us)
        if (
            role == KVConnectorRole.WORKER
            and self.connector_worker is not None
            and ktc.get_from_extra_config(FAULT_INJECTION_KEY, False)
        ):
            w = self.connector_worker
            w.nixl_wrapper = FaultyAgent(w.nixl_wrapper)
        #: scheduler side: ids to release at the next step; worker side: ids not yet seen
        self._to_release: set[str] = set()
        self._release_pending: dict[str, float] = {}

    # -- early release (module docstring) -------------------------------------------------
    def release_kv(self, scheduler: Any, request_id: str, engine_id: str) -> bool:
        """Scheduler side: free ``request_id``'s blocks held for a pull at the next step,
        when this is engine ``engine_id`` and the request has finished here (its blocks are
        held only for the pull). Whether it was queued."""
        cs = self.connector_scheduler
        if cs is None or cs.engine_id != engine_id:
            return False
        req = scheduler.requests.get(request_id)
        if req is None or not req.is_finished():  # pulled or expired already, or running
            return False
        self._to_release.add(request_id)
        return True

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)
        if self._to_release:
            setattr(meta, RELEASE_ATTR, tuple(self._to_release))
            self._to_release.clear()
        return meta

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        super().start_load_kv(forward_context, **kwargs)  # takes this step's reqs_to_send
        released = getattr(self._connector_metadata, RELEASE_ATTR, ())
        if released or self._release_pending:
            import time

            ended = end_leases(
                self.connector_worker, self._release_pending, released, time.perf_counter()
            )
            for rid in ended:
                logger.info("pdserve: KV of %s released early (no decode engine has it)", rid)
