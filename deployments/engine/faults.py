"""Fault injection into an engine replica (``fault_injection: true`` only: the fault tests).

Called through the replica's Serve handle, never on a request's path: wedge the engine's
step loop (:meth:`Faults.inject_wedge`, which :mod:`.health` then detects), fail its next
KV reads (:meth:`Faults.inject_kv_load_failures`, which decode recomputes) or fail one
stream as a failed engine would (:meth:`Faults.inject_stream_loss`, which the ingress
migrates: ``pdserve bench migration``).
"""

from __future__ import annotations

from deployments.engine.state import ReplicaState


class Faults(ReplicaState):
    """The fault-injection calls (see the module docstring)."""

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

    async def inject_stream_loss(self, prompt_tokens: int | None, after_tokens: int) -> str:
        """Fault injection (``fault_injection: true`` only): this replica's next decode
        stream whose prompt has ``prompt_tokens`` tokens fails with
        :class:`~engines.refusal.EngineDown` (the replica's fault, as when its engine dies)
        once it has sent ``after_tokens`` tokens; once. ``None`` disarms. Returns this
        replica's id (Serve's handle picks the replica: call until each one answered)."""
        self._fault_target(None)  # raised in Calls.decode
        self.stream_loss = None if prompt_tokens is None else (int(prompt_tokens), after_tokens)
        return self.replica_id

    def _fault_target(self, replica_id: str | None) -> bool:
        """Whether a fault-injection call is for this replica (``replica_id`` None: any);
        refused (``PermissionError``) unless ``fault_injection`` is on."""
        if not self.cfg.engine(self.role).fault_injection:
            raise PermissionError(f"{self.role}.fault_injection is off")
        return replica_id is None or replica_id == self.replica_id
