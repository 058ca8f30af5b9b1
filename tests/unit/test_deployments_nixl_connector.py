"""The project's NIXL connector: same name and base as vLLM's, agent rebuilt without NIXL's
busy progress thread (real NIXL agents, no engine)."""

from __future__ import annotations

import os
import threading
from types import SimpleNamespace
from typing import Any

import pytest

pytestmark = pytest.mark.slow  # imports vLLM


def test_config_turns_the_progress_thread_off_and_is_thread_safe() -> None:
    from nixl._api import nixl_thread_sync_t

    from engines.nixl_connector import agent_config_without_progress_thread

    c = agent_config_without_progress_thread(4, ["UCX"])
    assert c.enable_pthread is False
    assert c.sync_mode == nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
    assert c.num_threads == 4 and c.backends == ["UCX"]
    c2 = agent_config_without_progress_thread(4, ["UCX", "GDS"])
    assert c2.backends == ["UCX", "GDS"] and c2.num_threads == 0  # as vLLM builds it


def test_rebuild_keeps_the_agent_name_and_replaces_the_agent() -> None:
    from nixl._api import nixl_agent, nixl_agent_config

    from engines.nixl_connector import rebuild_agent_without_progress_thread

    class Ktc:
        def get_from_extra_config(self, key: str, default: Any) -> Any:
            return {"num_threads": 2}.get(key, default)

    stock = nixl_agent("pdserve-test-agent", nixl_agent_config(num_threads=2))
    worker = SimpleNamespace(nixl_wrapper=stock, kv_transfer_config=Ktc(), nixl_backends=["UCX"])
    rebuild_agent_without_progress_thread(worker)
    assert worker.nixl_wrapper is not stock
    assert worker.nixl_wrapper.name == "pdserve-test-agent"
    assert "UCX" in worker.nixl_wrapper.backends


def test_vllm_sees_its_own_connector_name_and_base() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPullConnector

    from engines.nixl_connector import NixlConnector

    assert NixlConnector.__name__ == "NixlConnector"
    assert issubclass(NixlConnector, NixlPullConnector)


def test_an_armed_faulty_agent_fails_exactly_the_next_reads() -> None:
    """Fault injection for the KV-transfer tests: ``fail_next_reads(n)`` makes the next ``n``
    ``transfer`` calls raise (the connector's own error path recomputes), then the real
    agent's ``transfer`` runs again; everything else is the wrapped agent's."""
    from engines import nixl_connector as nc

    class Agent:
        name = "agent-a"

        def __init__(self) -> None:
            self.sent: list[int] = []

        def transfer(self, handle: int) -> str:
            self.sent.append(handle)
            return "PROC"

    inner = Agent()
    agent = nc.FaultyAgent(inner)
    assert agent.name == "agent-a"
    before = nc.failed_on_purpose
    try:
        nc.fail_next_reads(2)
        for h in (1, 2):
            with pytest.raises(RuntimeError, match="on purpose"):
                agent.transfer(h)
        assert agent.transfer(3) == "PROC" and inner.sent == [3]
        nc.fail_next_reads(1)
        nc.fail_next_reads(0)  # disarmed
        assert agent.transfer(4) == "PROC"
        assert nc.failed_on_purpose == before + 2
    finally:
        nc.fail_next_reads(0)


def test_early_release_ends_the_lease_of_a_request_held_for_sending() -> None:
    """The worker side of the early release: a released request held for a pull gets its
    lease ended (vLLM's expiry path frees it in the same step); one the worker has not seen
    yet is looked for in later steps, then given up; nothing else is touched."""
    from engines.nixl_connector import RELEASE_WAIT_S, end_leases

    worker = SimpleNamespace(_reqs_to_send={"a": 100.0, "other": 100.0})
    pending: dict[str, float] = {}
    assert end_leases(worker, pending, ("a", "late"), now=10.0) == ["a"]
    assert worker._reqs_to_send == {"a": 0.0, "other": 100.0}
    assert list(pending) == ["late"]
    worker._reqs_to_send["late"] = 100.0  # its reqs_to_send came in a later step
    assert end_leases(worker, pending, (), now=11.0) == ["late"]
    assert pending == {} and worker._reqs_to_send["late"] == 0.0
    assert end_leases(worker, pending, ("never",), now=20.0) == []
    assert end_leases(worker, pending, (), now=20.0 + RELEASE_WAIT_S) == [] and pending == {}


def test_release_is_queued_only_on_its_engine_for_a_finished_request() -> None:
    from engines.nixl_connector import NixlConnector

    class Req:
        def __init__(self, finished: bool) -> None:
            self.finished = finished

        def is_finished(self) -> bool:
            return self.finished

    conn = SimpleNamespace(connector_scheduler=SimpleNamespace(engine_id="e1"), _to_release=set())
    sched = SimpleNamespace(requests={"done": Req(True), "running": Req(False)})
    release = NixlConnector.release_kv
    assert release(conn, sched, "done", "e2") is False  # another engine's KV
    assert release(conn, sched, "running", "e1") is False  # not finished: nothing pinned yet
    assert release(conn, sched, "pulled", "e1") is False  # gone already (pulled or expired)
    assert release(conn, sched, "done", "e1") is True
    assert conn._to_release == {"done"}


def _read_between_two_agents(poll_us: int, wait_s: float) -> tuple[str, bool]:
    """Two agents of this process, ``b`` reading 8 MiB from ``a``; ``a``'s owner never polls
    (as a prefill engine in a long step). ``b`` checks the state once after ``wait_s``: the
    state then, and whether the bytes arrived."""
    import time

    import numpy as np
    from nixl._api import nixl_agent

    from engines.nixl_connector import agent_config_without_progress_thread, paced_agent

    def make(name: str) -> Any:
        cfg = agent_config_without_progress_thread(1, ["UCX"], progress_thread=poll_us > 0)
        return paced_agent(name, cfg, poll_us) if poll_us else nixl_agent(name, cfg)

    a, b = make(f"pdserve-src-{poll_us}"), make(f"pdserve-dst-{poll_us}")
    src = np.arange(8 << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    a.register_memory(a.get_reg_descs([(src.ctypes.data, src.nbytes, 0, "")], "DRAM"))
    b.register_memory(b.get_reg_descs([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM"))
    b.add_remote_agent(a.get_agent_metadata())
    a.add_remote_agent(b.get_agent_metadata())
    h = b.initialize_xfer(
        "READ",
        b.get_xfer_descs([(dst.ctypes.data, dst.nbytes, 0)], "DRAM"),
        a.get_xfer_descs([(src.ctypes.data, src.nbytes, 0)], "DRAM"),
        a.name,
        b"pulled",
    )
    b.transfer(h)
    time.sleep(wait_s)
    state = b.check_xfer_state(h)
    return state, bool((dst == src).all())


def test_a_paced_progress_thread_moves_a_read_whose_source_never_polls() -> None:
    """Issue 39's cause: without a progress thread a read of a prefill engine's blocks waits
    for that engine's next step (UCX's rendezvous needs the source's progress); the paced
    thread moves it while the source computes. The contrast is what this machine's UCX does
    today (shared memory, rendezvous): a change there would show here first."""
    state, arrived = _read_between_two_agents(1000, 0.5)
    assert (state, arrived) == ("DONE", True)
    state, _ = _read_between_two_agents(0, 0.5)
    assert state == "PROC"  # not done for vLLM (the bytes may be there; the completion is not)


def test_a_paced_agent_does_not_spin_a_core() -> None:
    """The stock thread (``pthrDelay`` 0) spins; the paced one sleeps between polls, so it
    costs a small fraction of it (compared, not timed: both measured in this one run)."""
    import time

    from nixl._api import nixl_agent, nixl_agent_config

    from engines.nixl_connector import agent_config_without_progress_thread, paced_agent

    def cpu_over(seconds: float) -> float:
        t0 = time.process_time()
        time.sleep(seconds)
        return time.process_time() - t0

    paced = paced_agent(
        "pdserve-paced", agent_config_without_progress_thread(1, ["UCX"], True), 1000
    )
    paced_cpu = cpu_over(1.0)
    del paced
    stock = nixl_agent("pdserve-stock", nixl_agent_config(num_threads=1))
    stock_cpu = cpu_over(1.0)
    del stock
    assert paced_cpu < 0.25 * stock_cpu, (paced_cpu, stock_cpu)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_the_thread_vllms_nixl_worker_pinned_gets_its_cpus_back() -> None:
    """vLLM's NIXL worker pins the thread that builds it to the last core; the connector gives
    that thread back what it had (:func:`give_back_cpus`), and touches no other thread."""
    from engines.nixl_connector import give_back_cpus

    allowed = os.sched_getaffinity(0)
    seen: dict[str, Any] = {}

    def builder() -> None:
        os.sched_setaffinity(0, {max(allowed)})  # what vLLM's NixlConnectorWorker does
        seen["pinned"] = os.sched_getaffinity(0)
        seen["gave"] = give_back_cpus(allowed)
        seen["after"] = os.sched_getaffinity(0)
        seen["again"] = give_back_cpus(allowed)  # nothing narrowed it: nothing to do

    t = threading.Thread(target=builder)
    t.start()
    t.join()
    assert seen == {"pinned": {max(allowed)}, "gave": True, "after": allowed, "again": False}
    assert os.sched_getaffinity(0) == allowed  # the calling thread's own CPUs untouched


def test_an_in_process_engine_steps_on_cpu_binds_cpus() -> None:
    from engines.launch import engine_cpus

    assert engine_cpus("0", {0, 1}) == {0}
    assert engine_cpus("1", {0, 1}) == {1}
    assert engine_cpus("0-1", {0, 1}) == {0, 1}
    assert engine_cpus("0,2-3", {0, 1, 2, 3, 4}) == {0, 2, 3}
    assert engine_cpus("1-3", {0, 1}) == {1}  # within the process's own CPUs
    assert engine_cpus("5", {0, 1}) is None  # none of them: the thread keeps what it has
    assert engine_cpus("auto", {0, 1}) is None and engine_cpus("nobind", {0, 1}) is None
