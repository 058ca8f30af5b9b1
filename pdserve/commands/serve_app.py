"""``pdserve up`` / ``pdserve down``: bring the PD application up on a local Ray cluster and tear
it down.

``up`` builds the model when missing, starts a local redis-server when the config's Redis index
points at this machine and none answers there, starts a local Ray head (``--num-cpus=8``, no
dashboard, ``RAY_AUTH_MODE`` explicit, its processes on jemalloc: ``--allocator``,
``deployments/local.py``) unless one is running, runs ``serve run --non-blocking
CONFIG`` and waits for ``/health`` (readiness: both engines serve). ``--nodes
prefill=2,decode=1,ingress=1`` also joins worker nodes to that head, each on a loopback address
of its own and advertising its role's resource (:mod:`deployments.local_nodes`;
``configs/pd_multinode.yaml`` pins each role to them). ``down`` shuts Serve down
and stops the Ray cluster and the redis-server ``up`` started (``--keep-ray`` leaves both). Environment overrides
(``PDSERVE_MODEL``, ``PDSERVE_API_KEYS``, ``PDSERVE_CACHE_DIR``) are passed to the cluster, which
is where the application is built.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import typer

from deployments.local import ensure_ray_token, local_env, venv_bin, with_allocator
from pdserve.apps import app

DEFAULT_CONFIG = Path("configs/pd_default.yaml")


def _bin(name: str) -> str:
    return venv_bin(name)


def _env(insecure: bool = False) -> dict[str, str]:
    return local_env(insecure)


def _ray_running(env: dict[str, str]) -> bool:
    r = subprocess.run([_bin("ray"), "status"], env=env, capture_output=True, text=True, timeout=60)
    return r.returncode == 0


def _http_url(raw: dict[str, Any]) -> str:
    http = raw.get("http_options") or {}
    return f"http://{http.get('host', '127.0.0.1')}:{int(http.get('port', 8000))}"


def _wait_health(url: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=10) as r:
                if r.status == 200:
                    return str(r.read().decode())
        except Exception as e:  # 503 while the engines start, or the proxy not up yet
            last = repr(e)
        time.sleep(1.0)
    raise typer.Exit(_fail(f"not ready after {timeout_s:.0f} s (last: {last})"))


def _fail(msg: str) -> int:
    typer.echo(f"pdserve: {msg}", err=True)
    return 1


@app.command("up")
def up(
    config: Path = typer.Option(DEFAULT_CONFIG, help="Serve YAML of the application."),
    timeout_s: float = typer.Option(300.0, "--timeout", min=1, help="Readiness wait (s)."),
    num_cpus: int = typer.Option(8, min=5, help="Logical CPUs of a Ray head started here."),
    metrics_port: int = typer.Option(
        8080, min=1, max=65535, help="Ray's Prometheus metrics port (pdserve_* series)."
    ),
    allocator: str = typer.Option(
        "jemalloc",
        help="malloc of a Ray head started here: jemalloc (Ray's build; glibc's kept Serve's "
        "proxy's freed memory: 18% growth under the soak) or system. A running head keeps "
        "its own.",
    ),
    nodes: str = typer.Option(
        None,
        help="Also start local worker nodes, e.g. prefill=2,decode=1,ingress=1: each a raylet "
        "on its own loopback address (127.0.0.2, ...) advertising pdserve_<role> "
        "(configs/pd_multinode.yaml pins the roles to them). pdserve down stops them.",
    ),
    node_slots: int = typer.Option(
        2, min=1, max=64, help="Replicas of its role each --nodes node can host."
    ),
    insecure: bool = typer.Option(
        False,
        "--insecure",
        help="Start the local Ray head WITHOUT token authentication: anyone who reaches its "
        "ports (the GCS binds every interface) can then run code on it. Off by default.",
    ),
) -> None:
    """Bring the prefill/decode app up on a local Ray cluster and wait until it serves.

    The head runs Ray's token authentication (``RAY_AUTH_MODE=token``): the token is made in
    ``~/.ray/auth_token`` (or where ``RAY_AUTH_TOKEN_PATH`` says) when missing, where Ray's
    ``ray`` and ``serve`` commands find it, so ``serve status`` and ``serve deploy`` keep
    working for the user who started it."""
    import yaml

    from deployments.app import ensure_model
    from deployments.config import load_app_config

    if not config.exists():
        raise typer.BadParameter(f"{config} does not exist", param_hint="--config")
    if not insecure and os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
        raise typer.BadParameter(
            "RAY_AUTH_MODE=disabled is set: unset it (the local head runs Ray's token "
            "authentication) or pass --insecure to start one without it",
            param_hint="--insecure",
        )
    try:
        head_env = with_allocator(_env(insecure), allocator)
    except (ValueError, FileNotFoundError) as e:
        raise typer.BadParameter(str(e), param_hint="--allocator") from e
    from deployments.local_nodes import parse_nodes

    try:
        node_specs = parse_nodes(nodes, node_slots) if nodes else []
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--nodes") from None
    raw = yaml.safe_load(config.read_text())
    for a in raw.get("applications", []):
        cfg = load_app_config(a.get("args") or {})  # validates
        try:
            cfg.check_auth()
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--config") from None
        ensure_model(cfg)  # builds once
        if cfg.index.backend == "redis":
            _ensure_local_redis(cfg.index.redis_url, _redis_dir(), cfg.index.redis_users)
    env = _env(insecure)
    if not insecure:
        where = ensure_ray_token(env)
        typer.echo(
            "pdserve: Ray token authentication on (token: "
            f"{where or 'RAY_AUTH_TOKEN'}; --insecure turns it off)"
        )
    if not _ray_running(env):
        metrics_port = _port_or_free(metrics_port)
        typer.echo(
            f"pdserve: starting a local Ray head (metrics: http://127.0.0.1:{metrics_port}/metrics)"
        )
        subprocess.run(
            [
                _bin("ray"),
                "start",
                "--head",
                f"--num-cpus={num_cpus}",
                "--include-dashboard=false",
                "--disable-usage-stats",
                f"--metrics-export-port={metrics_port}",  # Prometheus scrapes pdserve_* here
            ],
            env=head_env,
            check=True,
            timeout=120,
        )
    if node_specs:
        _start_nodes(node_specs, head_env)
    typer.echo(f"pdserve: serve run --non-blocking {config}")
    subprocess.run(
        [_bin("serve"), "run", "--non-blocking", str(config)], env=env, check=True, timeout=300
    )
    url = _http_url(raw)
    health = _wait_health(url, timeout_s)
    typer.echo(f"pdserve: ready at {url}  {health}")


def _start_nodes(specs: list[Any], env: dict[str, str]) -> None:
    """Join ``specs``' worker nodes to the local head (those whose raylet already runs are
    kept as they are)."""
    from ray._private.services import canonicalize_bootstrap_address_or_die

    from deployments.local_nodes import raylet_ips, start_nodes

    gcs = canonicalize_bootstrap_address_or_die("auto")
    running = raylet_ips()
    todo = []
    for spec in specs:
        if spec.ip in running:
            typer.echo(f"pdserve: node {spec.name} ({spec.ip}) is already running")
            continue
        typer.echo(
            f"pdserve: starting node {spec.name} at {spec.ip} "
            f"({spec.num_cpus} CPUs, {spec.resources})"
        )
        todo.append(spec)
    try:
        start_nodes(todo, gcs, env, _bin("ray"))
    except RuntimeError as e:
        raise typer.Exit(_fail(str(e))) from None


def _port_or_free(port: int) -> int:
    """``port`` when nothing listens there, else a free one (said), so a busy 8080 does not
    stop the app from coming up."""
    import socket

    with socket.socket() as sock:
        try:
            sock.bind(("", port))
            return port
        except OSError:
            pass
    with socket.socket() as sock:
        sock.bind(("", 0))
        free = int(sock.getsockname()[1])
    typer.echo(f"pdserve: port {port} is taken; Ray's metrics go to port {free}")
    return free


#: the memory bound of a Redis ``up`` starts (MiB; only the index is ever evicted)
LOCAL_REDIS_MAXMEMORY_MB = 256


def _ensure_local_redis(url: str, workdir: Path, users: Any = None) -> None:
    """Start a redis-server for ``url`` when it names this machine and none answers there:
    on loopback only, bounded in memory, and with ``users`` (``index.redis_users``) its ACL
    users, the default user off. Their password files are made (random passwords, mode
    0600, an ``admin.password`` beside them for ``pdserve keys --redis``) when missing."""
    from urllib.parse import urlparse

    from cluster.redis_server import ping, secured_args, start_redis_daemon

    u = urlparse(url)
    port = u.port or 6379
    if u.scheme != "redis" or u.hostname not in ("127.0.0.1", "localhost"):
        return  # a remote Redis is the operator's to run
    if port == 6379:
        raise typer.BadParameter(
            f"index.redis_url: {url} is port 6379, where a local Ray head's GCS listens; "
            "use another port (the shipped configs use 6380)",
            param_hint="--config",
        )
    if ping(port):
        return
    acl = _local_redis_users(users, workdir) if users is not None else None
    typer.echo(
        f"pdserve: starting redis-server on 127.0.0.1:{port} (index.redis_url"
        + (", ACL users from index.redis_users)" if acl else ", no authentication)")
    )
    start_redis_daemon(port, workdir, extra=secured_args(acl, LOCAL_REDIS_MAXMEMORY_MB))


def _local_redis_users(users: Any, workdir: Path) -> Path:
    """The ACL file of ``users`` (``index.redis_users``) for a local Redis, their password
    files made first when missing; its path."""
    from cluster.redis_auth import acl_file, new_passwords, read_password, write_private

    files = {
        "ingress": Path(users.ingress.password_file).expanduser(),
        "prefill": Path(users.prefill.password_file).expanduser(),
    }
    files["admin"] = files["ingress"].parent / "admin.password"
    if not all(f.exists() for f in files.values()):
        fresh = new_passwords()
        for role, f in files.items():
            write_private(f, fresh[role] + "\n")
        typer.echo(f"pdserve: made Redis passwords in {files['ingress'].parent} (mode 0600)")
    names = {"ingress": users.ingress.username, "prefill": users.prefill.username}
    passwords = {role: read_password(f) for role, f in files.items()}
    text = acl_file(passwords)
    for role, name in names.items():  # the config may name the users otherwise
        text = text.replace(f"user {role} on", f"user {name} on")
    workdir.mkdir(parents=True, exist_ok=True)
    return write_private(workdir / "users.acl", text)


@app.command("down")
def down(
    keep_ray: bool = typer.Option(False, help="Only shut Serve down; leave Ray running."),
) -> None:
    """Shut the app down and stop the local Ray cluster (everything ``up`` started, the
    ``--nodes`` worker nodes included: ``ray stop`` stops every Ray node of this machine)."""
    env = _env()
    if _ray_running(env):
        code = (
            "import ray; from ray import serve; ray.init(address='auto', log_to_driver=False); "
            "serve.shutdown()"
        )
        subprocess.run([sys.executable, "-c", code], env=env, timeout=120, check=False)
        if not keep_ray:
            subprocess.run([_bin("ray"), "stop"], env=env, timeout=120, check=False)
    if not keep_ray:
        _stop_local_redis()
    typer.echo("pdserve: down")


def _redis_dir() -> Path:
    """Where ``up`` keeps the pidfiles and logs of the redis-servers it starts."""
    from deployments.config import DEFAULT_CACHE_DIR, ENV_CACHE_DIR

    return Path(os.environ.get(ENV_CACHE_DIR) or DEFAULT_CACHE_DIR).expanduser() / "redis"


def _stop_local_redis() -> None:
    """Stop the redis-servers ``up`` started (their pidfiles under :func:`_redis_dir`)."""
    from cluster.redis_server import stop_redis_daemon

    for pidfile in _redis_dir().glob("redis-*.pid"):
        if stop_redis_daemon(pidfile):
            typer.echo(f"pdserve: stopped redis-server ({pidfile.stem})")
