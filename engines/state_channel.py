"""The plug-ins' state channel: a named ZMQ PUB socket that tools outside the engine can read.

The scheduler plug-ins run inside vLLM's engine process, out of a caller's reach. With
``channel`` set in the plug-in's config (``additional_config={"pdserve": {"channel":
...}}``, the README's "The vLLM plug-ins") a plug-in publishes its state every
``publish_every_steps`` steps, under any vLLM that loads it (``vllm serve --scheduler-cls``,
a benchmark's engine, a test's): one JSON object as a single frame ``TOPIC + b" " + json``
(single-frame because ``CONFLATE`` does not support multipart). Readers subscribe with
``CONFLATE`` and keep only the newest snapshot: :class:`StateReader`, the client half, for a
dashboard, a script or a test. The serving app itself does not read it: its replicas ask
their scheduler through :mod:`engines.engine_rpc` (a call pdserve's vLLM plug-in adds to the
engine core), which works under both runtimes and answers calls, not just snapshots. Off by
default (``channel: null``).

Snapshot keys (all optional except ``engine``, ``step``, ``ts``): ``prefill_policy``,
``gate``, ``waiting``, ``running``, ``queued_uncached_tokens``, ``lanes``
(``{"fast": n, "fair": n}`` placements this step), ``window_tokens`` (TWP's ``H``),
``token_load`` (``K``), ``slowdown`` (``sigma``), ``itl_s``, ``kv_usage``, ``free_blocks``,
``hook_ms``, ``schedule_ms``, ``step_ms``.
"""

from __future__ import annotations

import json
from typing import Any

TOPIC = b"pdserve.state"


class StatePublisher:
    """Binds a PUB socket at ``endpoint``; ``publish`` never blocks; only the newest snapshot is queued."""

    def __init__(self, endpoint: str) -> None:
        import zmq

        self.endpoint = endpoint
        self._ctx: Any = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.CONFLATE, 1)  # keep only the newest snapshot queued
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(endpoint)
        self._noblock = zmq.NOBLOCK
        self._again = zmq.Again
        self.sent = 0

    def publish(self, state: dict[str, Any]) -> None:
        try:
            self._sock.send(TOPIC + b" " + json.dumps(state).encode(), flags=self._noblock)
            self.sent += 1
        except self._again:
            pass

    def close(self) -> None:
        self._sock.close(0)


class StateReader:
    """Subscribes to a plug-in's channel; ``latest`` returns the newest snapshot or ``None``."""

    def __init__(self, endpoint: str) -> None:
        import zmq

        self._zmq = zmq
        self._sock: Any = zmq.Context.instance().socket(zmq.SUB)
        self._sock.setsockopt(zmq.CONFLATE, 1)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SUBSCRIBE, TOPIC)
        self._sock.connect(endpoint)
        self.last: dict[str, Any] | None = None

    def latest(self, timeout_s: float = 0.0) -> dict[str, Any] | None:
        """Drain what arrived; wait up to ``timeout_s`` for a first message if none is new."""
        if self._sock.poll(int(timeout_s * 1000)):
            while True:
                try:
                    msg = self._sock.recv(self._zmq.NOBLOCK)
                except self._zmq.Again:
                    break
                self.last = json.loads(msg[len(TOPIC) + 1 :])
        return self.last

    def close(self) -> None:
        self._sock.close(0)
