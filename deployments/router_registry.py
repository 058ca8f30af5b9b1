"""What the routers share with the ingress in one process: replica directories and counters.

A module of its own, imported by reference: Serve pickles a custom router's own module by value
(``RequestRouterConfig``), so globals defined next to the router class would be a private copy
inside the router, invisible to the ingress. Everything here is thread-safe (the router runs on
Serve's router loop, the ingress on its own).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from deployments.telemetry import metrics


class ReplicaDirectory:
    """Replica id -> its last load report, for one deployment in this process (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._replicas: dict[str, dict[str, Any]] = {}
        self.version = 0

    def update(self, replicas: dict[str, dict[str, Any]]) -> None:
        with self._lock:
            if replicas != self._replicas:
                self._replicas = replicas
                self.version += 1

    def remove(self, replica_id: str) -> None:
        with self._lock:
            if self._replicas.pop(replica_id, None) is not None:
                self.version += 1

    def snapshot(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            return dict(self._replicas)


_DIRECTORIES: dict[tuple[str, str], ReplicaDirectory] = {}
_STATS: dict[tuple[str, str], RouterCounters] = {}
_REGISTRY_LOCK = threading.Lock()


def directory(app: str, deployment: str) -> ReplicaDirectory:
    """The directory of ``app``'s ``deployment`` in this process (created on first use)."""
    with _REGISTRY_LOCK:
        return _DIRECTORIES.setdefault((app, deployment), ReplicaDirectory())


@dataclass
class RouterCounters:
    """What one deployment's router did (thread-safe through its lock)."""

    policy: str = ""
    routed: Counter[str] = field(default_factory=Counter)
    fallbacks: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: the deployment (role) these count for: the ``role`` tag of their metrics
    deployment: str = ""
    #: each router's table sizes, by router (one per handle Serve builds in this process);
    #: summed in :meth:`as_dict`, where a load test checks that they return to their
    #: baseline once the traffic has passed (nothing leaks)
    tables: dict[int, Callable[[], dict[str, int]]] = field(default_factory=dict)

    def count(self, name: str, by: int = 1) -> None:
        """A named fallback, ``by`` times (also ``pdserve_routing_fallbacks``)."""
        with self.lock:
            self.fallbacks[name] += by
        metrics().inc("pdserve_routing_fallbacks", by, role=self.deployment, fallback=name)

    def add_routed(self, replica: str) -> None:
        """One request sent to ``replica`` (also ``pdserve_routed``)."""
        with self.lock:
            self.routed[replica] += 1
        metrics().inc(
            "pdserve_routed", role=self.deployment, replica=replica, reason=self.policy or "?"
        )

    def as_dict(self) -> dict[str, Any]:
        tables = self._table_sizes()  # outside our lock: a router takes its own lock there
        with self.lock:
            return {
                "policy": self.policy,
                "routed": dict(self.routed),
                "fallbacks": dict(self.fallbacks),
                "tables": tables,
            }

    def _table_sizes(self) -> dict[str, int]:
        with self.lock:
            fns = list(self.tables.values())
        out: Counter[str] = Counter({"routers": len(fns)})
        for fn in fns:
            out.update(fn())
        return dict(out)


def router_stats(app: str, deployment: str) -> dict[str, Any]:
    """``{"policy", "routed": {replica: n}, "fallbacks": {name: n}, "tables": {name: n}}`` of
    this process's router for ``app``'s ``deployment`` (empty until the router has been
    built)."""
    with _REGISTRY_LOCK:
        c = _STATS.get((app, deployment))
    return c.as_dict() if c is not None else {"policy": None, "routed": {}, "fallbacks": {}}


def counters_for(app: str, deployment: str, policy: str) -> RouterCounters:
    """The counters of ``app``'s ``deployment`` router in this process, named ``policy``."""
    with _REGISTRY_LOCK:
        c = _STATS.setdefault((app, deployment), RouterCounters(deployment=deployment))
        c.policy = policy
        return c


#: app -> (version, routing config as a dict): routing parameters set live by the ingress's
#: ``user_config``; each router of the app takes them before its next decision
_ROUTING: dict[str, tuple[int, dict[str, Any]]] = {}


def set_routing(app: str, routing: dict[str, Any]) -> int:
    """Publish ``app``'s routing parameters to its routers in this process; the new version."""
    with _REGISTRY_LOCK:
        version = _ROUTING.get(app, (0, {}))[0] + 1
        _ROUTING[app] = (version, dict(routing))
        return version


def routing_of(app: str) -> tuple[int, dict[str, Any]]:
    """``(version, routing dict)`` last published for ``app`` (version 0: none)."""
    with _REGISTRY_LOCK:
        return _ROUTING.get(app, (0, {}))


class HandleWaits:
    """The engine calls a router has placed, by engine request id, each with the seconds it
    waited at the handle before that first decision (no replica running: a cold start, or
    every replica gone); noted by the router, taken by the ingress (thread-safe, bounded).

    Two uses:

    - the request's latency breakdown: :meth:`pop` gives the wait when it was a cold start;
    - a decode call withdrawn before any router placed it: :meth:`withdraw` tells the ingress
      that no decode engine has (or will get) the request, so the prefill's KV pinned for it
      can be released at once instead of after NIXL's lease. It is atomic with
      :meth:`place`: once withdrawn, the router does not place the call (it offers Serve no
      replica until Serve drops the cancelled call); once placed, it cannot be withdrawn.
    """

    #: waits shorter than this are not a cold start (a routing decision): :meth:`pop` says None
    MIN_S = 0.25
    #: placements kept for calls nobody takes (warm-up): oldest dropped first. Far above the
    #: calls one ingress process has in flight (its ``max_ongoing_requests``), so a call in
    #: flight is never dropped (a dropped placement could be withdrawn by mistake).
    MAX_KEPT = 100_000
    #: withdrawn ids kept (a router may be asked about one until Serve drops the call)
    MAX_WITHDRAWN = 10_000

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._placed: dict[str, float] = {}
        self._withdrawn: dict[str, None] = {}

    def place(self, request_id: str, waited_s: float) -> bool:
        """The router's first decision on ``request_id`` (it waited ``waited_s`` at the handle):
        ``False`` when the ingress has withdrawn it (the router must not place it)."""
        with self._lock:
            if request_id in self._withdrawn:
                return False
            self._placed.setdefault(request_id, waited_s)
            while len(self._placed) > self.MAX_KEPT:
                del self._placed[next(iter(self._placed))]
            return True

    def withdraw(self, request_id: str) -> bool:
        """Whether ``request_id`` was never placed; if so, it never will be. A placed call's
        entry is taken (as :meth:`pop`) and ``False`` returned."""
        with self._lock:
            if self._placed.pop(request_id, None) is not None:
                return False
            self._withdrawn[request_id] = None
            while len(self._withdrawn) > self.MAX_WITHDRAWN:
                del self._withdrawn[next(iter(self._withdrawn))]
            return True

    def pop(self, request_id: str) -> float | None:
        """Take ``request_id``'s entry: its wait at the handle when that was a cold start
        (at least :data:`MIN_S`), else ``None``."""
        with self._lock:
            waited = self._placed.pop(request_id, None)
        return waited if waited is not None and waited >= self.MIN_S else None

    def __len__(self) -> int:
        with self._lock:
            return len(self._placed)


_WAITS: dict[tuple[str, str], HandleWaits] = {}


def handle_waits(app: str, deployment: str) -> HandleWaits:
    """The :class:`HandleWaits` of ``app``'s ``deployment`` in this process."""
    with _REGISTRY_LOCK:
        return _WAITS.setdefault((app, deployment), HandleWaits())


_HOLDS: dict[tuple[str, str], float] = {}


def hold_routing(app: str, deployment: str, seconds: float) -> None:
    """Fault injection: this process's routers of ``app``'s ``deployment`` place no engine
    call for ``seconds`` (``0`` ends the hold), as when none of its replicas can take one (all
    starting from zero, or all full): calls wait at the handle."""
    with _REGISTRY_LOCK:
        if seconds > 0:
            _HOLDS[(app, deployment)] = time.time() + float(seconds)
        else:
            _HOLDS.pop((app, deployment), None)


def routing_held(app: str, deployment: str) -> bool:
    """Whether :func:`hold_routing` holds ``app``'s ``deployment`` now."""
    with _REGISTRY_LOCK:
        until = _HOLDS.get((app, deployment))
    return until is not None and time.time() < until
