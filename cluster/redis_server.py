"""Start a private ``redis-server`` on a free loopback port (tests, benchmarks, ``.ci/run``).

No persistence (``--save '' --appendonly no``); ``--port 0`` would disable TCP in Redis, so the
port is picked here. The caller owns the process and must :func:`stop_redis` it. ``extra``
arguments go to redis-server as they are (:func:`secured_args`: ACL users, a memory bound,
TLS).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path


class RedisNotFound(RuntimeError):
    """``redis-server`` is not on PATH."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ping(port: int) -> bool:
    """Whether a Redis answers on 127.0.0.1:``port`` (one that asks for authentication
    first answers too)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith((b"+PONG", b"-NOAUTH"))
    except OSError:
        return False


def secured_args(acl_file: Path | None = None, maxmemory_mb: int | None = None) -> list[str]:
    """redis-server arguments for pdserve's closed defaults (:mod:`cluster.redis_auth`): its
    ACL users (the default user off), and a memory bound with ``volatile-lru``, under which
    only the prefix index's keys (the only ones with a time to live) are ever evicted."""
    out: list[str] = []
    if acl_file is not None:
        out += ["--aclfile", str(acl_file)]
    if maxmemory_mb is not None:
        out += ["--maxmemory", f"{maxmemory_mb}mb", "--maxmemory-policy", "volatile-lru"]
    return out


def start_redis(
    workdir: Path,
    port: int | None = None,
    timeout_s: float = 10.0,
    extra: list[str] | None = None,
    tls: bool = False,
) -> tuple[subprocess.Popen[bytes], int]:
    """Start redis-server as a child process; returns ``(process, port)`` once it answers."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise RedisNotFound("redis-server not on PATH (apt-get install redis-server)")
    tries = 1 if port is not None else 5
    for _ in range(tries):
        p = port if port is not None else free_port()
        listen = ["--port", "0", "--tls-port", str(p)] if tls else ["--port", str(p)]
        proc = subprocess.Popen(
            [
                exe, *listen, "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(workdir),
                "--logfile", str(workdir / f"redis-{p}.log"), *(extra or []),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and proc.poll() is None:
            if _listening(p) if tls else ping(p):
                return proc, p
            time.sleep(0.02)  # start-up poll
        stop_redis(proc)
    raise RuntimeError(f"redis-server did not start on a loopback port (see {workdir})")


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def stop_redis(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def start_redis_daemon(
    port: int, workdir: Path, timeout_s: float = 10.0, extra: list[str] | None = None
) -> Path:
    """Start a detached redis-server on 127.0.0.1:``port`` that outlives the caller (``pdserve
    up``); returns its pidfile (``workdir/redis-<port>.pid``), which :func:`stop_redis_daemon`
    reads. No persistence, like :func:`start_redis`; ``extra`` as there."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise RedisNotFound("redis-server not on PATH (apt-get install redis-server)")
    workdir.mkdir(parents=True, exist_ok=True)
    pidfile = workdir / f"redis-{port}.pid"
    subprocess.run(
        [
            exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", str(workdir), "--daemonize", "yes",
            "--pidfile", str(pidfile), "--logfile", str(workdir / f"redis-{port}.log"),
            *(extra or []),
        ],
        check=True,
        timeout=timeout_s,
    )  # fmt: skip
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ping(port):
            return pidfile
        time.sleep(0.05)  # start-up poll
    raise RuntimeError(f"redis-server did not answer on port {port} (see {workdir})")


def stop_redis_daemon(pidfile: Path) -> bool:
    """Stop the redis-server whose pidfile this is; False when it was not running."""
    import os
    import signal

    try:
        pid = int(pidfile.read_text().strip())
    except (OSError, ValueError):
        return False
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pidfile.unlink(missing_ok=True)
        return False
    pidfile.unlink(missing_ok=True)
    return True
