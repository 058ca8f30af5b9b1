"""Who and where an engine replica is: its Serve identity, its node's address, free ports.

Read once, at the replica's start, to resolve its ports (NIXL side channel, KV events:
:func:`deployments.config.replica_ports`) and to name it in its reports and the index.
"""

from __future__ import annotations

import os
import random
import socket

#: where a replica's own listening ports come from: above Ray's worker ports (10002-19999 by
#: default) and below the kernel's ephemeral range (read at run time; Linux's default starts at
#: 32768). A port the kernel hands out for binding to port 0 is an ephemeral one, which any
#: process's next outgoing connection may take before the engine binds it (seen: a prefill
#: replica's NIXL listener found its port in use and the replica hung in its start-up)
PORT_FLOOR = 20000


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's ephemeral port range (Linux's default when it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_port(taken: set[int], rng: random.Random | None = None) -> int:
    """A TCP port free on this node now, not in ``taken`` (added to it), drawn at random
    between :data:`PORT_FLOOR` and the ephemeral range, so no outgoing connection takes it
    before the engine binds it; a bound port 0 when that range is unusable or full."""
    rng = rng or random.SystemRandom()
    lo, _ = ephemeral_ports()
    if lo - PORT_FLOOR >= 1000:
        for _ in range(256):
            port = rng.randrange(PORT_FLOOR, lo)
            if port in taken:
                continue
            with socket.socket() as sock:
                try:
                    sock.bind(("", port))
                except OSError:
                    continue
            taken.add(port)
            return port
    while True:
        with socket.socket() as sock:
            sock.bind(("", 0))
            port = int(sock.getsockname()[1])
        if port not in taken:
            taken.add(port)
            return port


def serve_identity() -> tuple[str, int, str]:
    """``(replica id, local rank, app name)`` inside a Serve replica; outside one (unit tests)
    a per-process id, rank 0 and app ``pdserve``."""
    try:
        from ray import serve

        ctx = serve.get_replica_context()
        rank = getattr(ctx.rank, "local_rank", None)
        return ctx.replica_id.unique_id, int(rank or 0), ctx.app_name
    except Exception:  # not in a replica
        return f"local-{os.getpid()}", 0, "pdserve"


def node_id() -> str | None:
    """The Ray node this process runs on (its hex id), or None outside Ray."""
    try:
        import ray

        return str(ray.get_runtime_context().get_node_id())
    except Exception:  # no Ray: a single machine
        return None


def node_ip() -> str:
    try:
        import ray.util

        return str(ray.util.get_node_ip_address())
    except Exception:  # no Ray: a single machine
        return "127.0.0.1"
