"""``pdserve up`` / ``pdserve down``: bring the PD application up on a local Ray cluster and tear
it down.

``up`` builds the model when missing, starts a local Ray head (``--num-cpus=8``, no dashboard,
``RAY_AUTH_MODE`` explicit) unless one is running, runs ``serve run --non-blocking CONFIG`` and
waits for ``/health`` (readiness: both engines serve). ``down`` shuts Serve down and stops the
Ray cluster (``--keep-ray`` leaves the cluster running). Environment overrides
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

from pdserve.apps import app

DEFAULT_CONFIG = Path("configs/pd_default.yaml")


def _bin(name: str) -> str:
    """The console script ``name`` next to this Python (the project's venv)."""
    cand = Path(sys.executable).parent / name
    return str(cand) if cand.exists() else name


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("RAY_AUTH_MODE", "disabled")
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    return env


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
) -> None:
    """Bring the prefill/decode app up on a local Ray cluster and wait until it serves."""
    import yaml

    from deployments.app import ensure_model
    from deployments.config import load_app_config

    if not config.exists():
        raise typer.BadParameter(f"{config} does not exist", param_hint="--config")
    raw = yaml.safe_load(config.read_text())
    for a in raw.get("applications", []):
        ensure_model(load_app_config(a.get("args") or {}))  # validates, and builds once
    env = _env()
    if not _ray_running(env):
        typer.echo("pdserve: starting a local Ray head")
        subprocess.run(
            [
                _bin("ray"),
                "start",
                "--head",
                f"--num-cpus={num_cpus}",
                "--include-dashboard=false",
                "--disable-usage-stats",
            ],
            env=env,
            check=True,
            timeout=120,
        )
    typer.echo(f"pdserve: serve run --non-blocking {config}")
    subprocess.run(
        [_bin("serve"), "run", "--non-blocking", str(config)], env=env, check=True, timeout=300
    )
    url = _http_url(raw)
    health = _wait_health(url, timeout_s)
    typer.echo(f"pdserve: ready at {url}  {health}")


@app.command("down")
def down(
    keep_ray: bool = typer.Option(False, help="Only shut Serve down; leave Ray running."),
) -> None:
    """Shut the app down and stop the local Ray cluster (everything ``up`` started)."""
    env = _env()
    if _ray_running(env):
        code = (
            "import ray; from ray import serve; ray.init(address='auto', log_to_driver=False); "
            "serve.shutdown()"
        )
        subprocess.run([sys.executable, "-c", code], env=env, timeout=120, check=False)
        if not keep_ray:
            subprocess.run([_bin("ray"), "stop"], env=env, timeout=120, check=False)
    typer.echo("pdserve: down")
