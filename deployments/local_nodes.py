"""A multi-node Ray cluster on one machine: worker nodes (raylets) that each advertise one
role's custom resource, under the GCS of a local head.

``pdserve up --nodes prefill=2,decode=1,ingress=1`` starts them for a user who wants to try a
cluster layout on a laptop (``configs/pd_multinode.yaml`` pins each role to its resource);
the multi-node tests and ``pdserve bench multinode`` start them the same way. Each node is a
``ray start --address=GCS`` of its own (Ray's daemons outlive the command; ``ray stop`` stops
every node on the machine), with

- **its own loopback address**: node ``k`` (from 0, in the order the spec lists them) is
  ``127.0.0.{k + 2}`` (``--node-ip-address``; Linux routes all of 127/8 to ``lo``). A replica's
  ``ray.util.get_node_ip_address()`` is its node's, so its NIXL side channel binds there
  (``nixl_side_channel_host: auto``), and a peer that dialled a wrong node's address would
  fail rather than reach the right process through one shared address. (vLLM binds the
  KV-event publisher on every interface: only wildcard endpoints are bound by its
  ``ZmqEventPublisher``; the address the feeds dial is still the node's.)
- **its role's resource** ``pdserve_<role>`` with ``slots`` units (default 2: room for a
  replacement when the other node of the role is lost), and ``slots x cpus_per_slot``
  logical CPUs.

The head (``pdserve up``'s own) advertises no role resource, so a replica that reserves one
never lands there: Serve's controller and HTTP proxy run on the head.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

NodeRole = Literal["prefill", "decode", "ingress"]

#: The custom resource each role's nodes advertise and its replicas reserve.
ROLE_RESOURCE: dict[str, str] = {
    "prefill": "pdserve_prefill",
    "decode": "pdserve_decode",
    "ingress": "pdserve_ingress",
}

#: Logical CPUs per slot of a role's node: an engine replica reserves 1 (``num_cpus``), an
#: ingress replica 0.25.
CPUS_PER_SLOT: dict[str, float] = {"prefill": 1.0, "decode": 1.0, "ingress": 0.5}

FIRST_HOST = 2  # 127.0.0.1 is the machine's own loopback: nodes start at 127.0.0.2


class NodeSpec(BaseModel):
    """One worker node of a local multi-node cluster."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    role: NodeRole
    index: int = Field(ge=0, description="Its number among the role's nodes.")
    ip: str = Field(description="Its loopback address (127.0.0.2, ...).")
    slots: int = Field(ge=1, le=64, description="Replicas of the role it can host.")
    num_cpus: int = Field(ge=1, description="Its logical CPUs.")

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"

    @property
    def resources(self) -> dict[str, float]:
        return {ROLE_RESOURCE[self.role]: float(self.slots)}


def parse_nodes(text: str, slots: int = 2) -> list[NodeSpec]:
    """``"prefill=2,decode=1,ingress=1"`` -> one :class:`NodeSpec` per node, addresses in the
    order written. A bad part is a ``ValueError`` naming it."""
    counts: dict[str, int] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        m = re.fullmatch(r"(\w+)=(\d+)", part)
        if m is None:
            raise ValueError(f"--nodes: {part!r} is not ROLE=COUNT (e.g. prefill=2)")
        role, n = m.group(1), int(m.group(2))
        if role not in ROLE_RESOURCE:
            raise ValueError(f"--nodes: unknown role {role!r} (one of {', '.join(ROLE_RESOURCE)})")
        if role in counts:
            raise ValueError(f"--nodes: {role} is given twice")
        if not 0 <= n <= 32:
            raise ValueError(f"--nodes: {role}={n} is outside 0..32")
        counts[role] = n
    if not counts:
        raise ValueError("--nodes: no node given (e.g. prefill=2,decode=1,ingress=1)")
    specs: list[NodeSpec] = []
    for role, n in counts.items():
        for i in range(n):
            specs.append(
                NodeSpec(
                    role=role,  # type: ignore[arg-type]
                    index=i,
                    ip=f"127.0.0.{FIRST_HOST + len(specs)}",
                    slots=slots,
                    num_cpus=max(1, round(slots * CPUS_PER_SLOT[role])),
                )
            )
    return specs


def ray_start_command(spec: NodeSpec, gcs_address: str, ray_bin: str = "ray") -> list[str]:
    """The ``ray start`` that joins ``spec``'s node to the cluster at ``gcs_address``."""
    return [
        ray_bin,
        "start",
        f"--address={gcs_address}",
        f"--node-ip-address={spec.ip}",
        f"--num-cpus={spec.num_cpus}",
        "--num-gpus=0",
        f"--resources={json.dumps(spec.resources)}",
        "--object-store-memory=100000000",  # 100 MB: replicas pass no large objects
        # one log monitor per machine (the head's): the nodes share its session's log
        # folder, and each node's own would stream every line to the driver again
        "--include-log-monitor=false",
        "--disable-usage-stats",
    ]


def start_nodes(
    specs: list[NodeSpec], gcs_address: str, env: dict[str, str], ray_bin: str = "ray"
) -> None:
    """Join ``specs``' nodes to the cluster, one after the other (daemons that outlive this
    process; started together, four of them timed out registering with a GCS on two
    loaded cores); a ``RuntimeError`` naming the node, with Ray's output, when one fails."""
    for spec in specs:
        r = subprocess.run(
            ray_start_command(spec, gcs_address, ray_bin),
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        if r.returncode != 0:
            raise RuntimeError(
                f"ray start of node {spec.name} ({spec.ip}) failed:\n{r.stderr[-2000:]}"
            )


def _has_ip(cmdline: list[str], ip: str) -> bool:
    return any(
        a in (f"--node_ip_address={ip}", f"--node-ip-address={ip}", f"--node-ip={ip}")
        for a in cmdline
    )


def processes_where(match: Callable[[list[str]], bool]) -> list[Any]:
    """This machine's processes whose command line (its arguments) ``match`` accepts; one
    scan of the process table."""
    import psutil

    out = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            cmd = p.info["cmdline"] or []
        except psutil.Error:
            continue
        if match(cmd):
            out.append(p)
    return out


def node_processes(ip: str) -> list[Any]:
    """The processes of the Ray node at ``ip`` (its raylet, agents and workers)."""
    return processes_where(lambda cmd: _has_ip(cmd, ip))


def raylet_ips() -> set[str]:
    """The addresses of the Ray nodes whose raylet runs on this machine."""
    flag = "--node_ip_address="
    raylets = processes_where(lambda cmd: bool(cmd) and cmd[0].endswith("/raylet"))
    return {
        a[len(flag) :] for p in raylets for a in (p.info["cmdline"] or []) if a.startswith(flag)
    }


def stop_processes(procs: list[Any], graceful: bool = False, timeout_s: float = 30.0) -> int:
    """SIGKILL ``procs`` (a node lost), or (``graceful``) SIGTERM them and SIGKILL what is
    left after ``timeout_s``; how many were signalled."""
    import psutil

    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.send_signal(signal.SIGTERM if graceful else signal.SIGKILL)
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    return len(procs)


def kill_node(ip: str, graceful: bool = False) -> int:
    """Stop the node at ``ip``: every process of it (:func:`stop_processes`); how many were
    signalled."""
    return stop_processes(node_processes(ip), graceful)
