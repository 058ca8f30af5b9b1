"""The one PD application all e2e tests share: deployed once per session on the session's Ray
cluster, on free ports, with the test model; torn down with the cluster."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.ray_cluster import free_port

APP = "pdserve"
TENANT_KEYS = {"sk-alice": "alice", "sk-bob": "bob"}


ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "configs" / "pd_default.yaml"


def shipped_engine(role: str) -> dict[str, Any]:
    """The shipped YAML's scheduler settings for ``role``, so the tests run what ships."""
    import yaml

    args = yaml.safe_load(SHIPPED.read_text())["applications"][0]["args"][role]
    return {k: args[k] for k in ("scheduler_cls", "scheduler_config") if k in args}


def pd_args(model_dir: Path, cache_dir: Path) -> dict[str, Any]:
    """App args on free ports (other runs on the machine may hold the default ones)."""
    return {
        "model": {"path": str(model_dir), "build_preset": None, "max_model_len": 2048},
        "cache_dir": str(cache_dir),
        "prefill": {
            "num_cpus": 1.0,
            "cpu_bind": "0",
            "nixl_side_channel_port": free_port(),
            "kv_events": {"endpoint": f"tcp://*:{free_port()}"},
            **shipped_engine("prefill"),
        },
        "decode": {
            "num_cpus": 1.0,
            "cpu_bind": "1",
            "nixl_side_channel_port": free_port(),
            "kv_events": {"endpoint": f"tcp://*:{free_port()}"},
            **shipped_engine("decode"),
        },
        "ingress": {"num_cpus": 0.25, "api_keys": TENANT_KEYS},
    }


def wait_ready(url: str, timeout_s: float) -> None:
    """Poll /health until 200 (readiness: both engines serve) or fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=10) as r:
                if r.status == 200:
                    return
        except Exception as e:  # 503 while starting
            last = e
        time.sleep(0.5)  # polling a real server's readiness, not a timing assertion
    raise TimeoutError(f"the app at {url} did not become ready: {last!r}")


@pytest.fixture(scope="session")
def pd_app(
    ray_cluster: dict[str, Any], tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    """``{"url", "prefill", "decode", "keys"}``: the deployed app's base URL and handles."""
    from ray import serve

    from deployments.app import build_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = pd_args(tiny_model_dir, tmp_path_factory.mktemp("pd_cache"))
    serve.run(build_app(args), name=APP, route_prefix="/", blocking=False)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, 300)
    yield {
        "url": url,
        "prefill": serve.get_deployment_handle("prefill", app_name=APP),
        "decode": serve.get_deployment_handle("decode", app_name=APP),
        "keys": TENANT_KEYS,
    }
    serve.delete(APP)
