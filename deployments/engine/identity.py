"""Who and where an engine replica is: its Serve identity, its node's address, free ports.

Read once, at the replica's start, to resolve its ports (NIXL side channel, KV events:
:func:`deployments.config.replica_ports`) and to name it in its reports and the index.
"""

from __future__ import annotations

import os
import socket


def free_port(taken: set[int]) -> int:
    """A TCP port free on this node now, not in ``taken`` (added to it)."""
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


def node_ip() -> str:
    try:
        import ray.util

        return str(ray.util.get_node_ip_address())
    except Exception:  # no Ray: a single machine
        return "127.0.0.1"
