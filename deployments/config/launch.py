"""From the config to one engine replica's launch: its ports, resolved per replica (two
replicas of one role on one node never collide), and its :class:`engines.launch.EngineLaunch`."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from deployments.config.app import AppConfig
from deployments.config.common import Role
from engines.launch import EngineLaunch, KVEventsLaunch, KVTransfer


@dataclass(frozen=True)
class ReplicaPorts:
    """The ports and address one engine replica binds (resolved when the replica starts)."""

    host: str
    nixl: int
    kv_events: int | None
    kv_replay: int | None


def replica_ports(
    cfg: AppConfig,
    role: Role,
    rank: int,
    node_ip: str,
    free_port: Callable[[], int],
) -> ReplicaPorts:
    """Ports of replica ``rank`` of ``role``: a configured base plus the rank, or free ports
    (``free_port()``) when the config leaves them null, so two replicas of one role on one node
    never collide. ``node_ip`` is used when ``nixl_side_channel_host`` is ``auto``."""
    e = cfg.engine(role)
    host = node_ip if e.nixl_side_channel_host == "auto" else e.nixl_side_channel_host
    nixl = e.nixl_side_channel_port + rank if e.nixl_side_channel_port else free_port()
    ev, replay = None, None
    if e.kv_events.enabled:
        ev = e.kv_events.port + 2 * rank if e.kv_events.port else free_port()
        if e.kv_events.replay:
            replay = e.kv_events.port + 2 * rank + 1 if e.kv_events.port else free_port()
    return ReplicaPorts(host, nixl, ev, replay)


def kv_events_ipc_dir() -> Path:
    """This node's folder of KV-event sockets (``ipc`` transport): one per user, mode 0700,
    so no other user of the node can connect to a replica's events."""
    import tempfile

    d = Path(tempfile.gettempdir()) / f"pdserve-kv-{os.getuid()}"
    d.mkdir(mode=0o700, exist_ok=True)
    d.chmod(0o700)
    return d


def kv_events_launch(cfg: AppConfig, role: Role, ports: ReplicaPorts) -> KVEventsLaunch | None:
    """Where replica ``ports`` of ``role`` publishes its KV events (None: it does not)."""
    e = cfg.engine(role)
    if ports.kv_events is None:
        return None
    return KVEventsLaunch(
        port=ports.kv_events,
        replay_port=ports.kv_replay,
        topic=e.kv_events.topic,
        ipc_dir=str(kv_events_ipc_dir()) if e.kv_events.transport == "ipc" else None,
    )


def engine_launch(cfg: AppConfig, role: Role, ports: ReplicaPorts) -> EngineLaunch:
    """The :class:`engines.launch.EngineLaunch` of one replica of ``role``.

    Prefill is the NIXL ``kv_producer``, decode the ``kv_consumer``; both load the project's
    connector (``engines.nixl_connector``) with the KV buffer on ``kv_buffer_device``, and hash
    blocks with ``cfg.hashing`` (the ingress's own settings).
    """
    e = cfg.engine(role)
    return EngineLaunch(
        model=str(cfg.model.resolved_path()),
        served_name=cfg.model.served_name,
        cache_dir=str(Path(cfg.cache_dir).expanduser()),
        max_model_len=cfg.model.max_model_len,
        dtype=cfg.model.dtype,
        **e.engine_settings(),  # enforce_eager, max_num_seqs, cpu_bind, scheduler_cls, ...
        block_size=cfg.hashing.block_size,
        hash_algo=cfg.hashing.algo,
        hash_seed=cfg.hashing.seed,
        max_num_batched_tokens=e.max_num_batched_tokens,
        scheduler=cfg.scheduler_config(role),
        runtime=e.resolved_runtime,
        kv_transfer=None
        if cfg.mode == "colocated"
        else KVTransfer(
            role="kv_producer" if role == "prefill" else "kv_consumer",
            side_channel_host=ports.host,
            side_channel_port=ports.nixl,
            progress_thread=e.nixl_progress_thread,
            progress_poll_us=e.nixl_progress_poll_us,
            core_pin=e.nixl_core_pin,
            load_failure_policy=e.kv_load_failure_policy,
            buffer_device=e.kv_buffer_device,
            fault_injection=e.fault_injection,
        ),
        kv_events=kv_events_launch(cfg, role, ports),
    )
