"""The control for ``pdserve bench soak``'s memory check: Ray Serve's HTTP proxy under the same
open-loop load with a trivial app in place of pdserve.

The soak measures every process's resident memory over the run. pdserve's own processes
(ingress, engine replicas) grew under 3% in every run, Ray Serve's ``ProxyActor`` 3.0-7.5%.
The proxy is Ray's code: every request passes through it whatever the app behind it. This
bench separates the two: a local Ray cluster, Serve's proxy, and one FastAPI deployment that
answers ``POST /v1/completions`` after a short sleep with a body of the size pdserve's answer
has. The requests are the soak's (the same prompt mix, so the same request bodies), sent as
Poisson arrivals at ``rate`` per second: a warm-up, then the measured run. The report gives
the proxy's resident memory at the baseline and at the end, its growth, and the growth per
request. A proxy that grows as much here as in the soak grows by Ray's code, not by pdserve.

Measured here (2 cores, Ray 2.60), 4,046 requests at 34/s after a 60 s warm-up, against the
soak's 4,054 at 1.0x and 1.5x of 27.4/s (``pdserve bench soak --duration 120``, stop 33):

| run | proxy MiB | growth | KiB/request |
|---|---|---|---|
| control, answers after 1 s (~34 in flight) | 175 -> 178 | 1.7% | 0.75 |
| control, answers after 8 s (~270 in flight) | 204 -> 208 | 2.1% | 1.08 |
| control, 8 s, 2 replicas, 12% answered 503 | 203 -> 208 | 2.9% | 1.49 |
| pdserve soak (2 ingress replicas, 299 x 503) | 258 -> 272 | 5.3% | 3.5 |

So Ray's proxy grows on its own (1-1.5 KiB a request, more with more requests in flight,
more replicas and 503 answers), and about 2.5 times that in front of pdserve. These runs were
on glibc's malloc. Stop 35 found what the growth is (``scripts/proxy_memory_probe.py``): the
proxy's live Python memory stays flat while glibc keeps the memory freed after each peak of
requests in flight (one ``malloc_trim(0)`` gave back 99 MiB), so more in flight, longer, as in
front of pdserve's queues, grows it more. ``pdserve up`` now runs its head on Ray's jemalloc
(``deployments/local.py``); this control starts its own head with ``ray.init`` and stays on
the allocator of the shell that runs it.

CPU contention (``--busy-cores N``: N processes spin a core each; stop 33, answers after
1 s): idle cores 177 -> 180 MiB (1.9%, 0.87 KiB/request); one core spinning 1.3-2.0%
(0.58-0.89 KiB/request, two runs). With both cores spinning the proxy falls behind (1,153
and 2,389 of 4,046 answered), Serve's controller kills and restarts it, and its memory is
no longer comparable (one run read no proxy at the baseline, one 219 -> 313 MiB). So one
busy core does not explain pdserve's share; a proxy starved of both cores would.

Real Ray and Serve, no engine: nothing here is simulated.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import random
import time
from typing import Any

from tqdm import tqdm

from bench.live.soak import _open_loop, request_bodies, rss

#: the answer's body: about the size of a pdserve completion of 16 tokens with its usage
ANSWER_TEXT = "x" * 64


def build_app(delay_s: float, replicas: int = 1, refuse: float = 0.0) -> Any:
    """The trivial app: FastAPI behind Serve's proxy on ``replicas`` replicas; a share
    ``refuse`` of the requests is answered 503 with ``Retry-After`` at once (as pdserve's
    overload control does)."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse
    from ray import serve

    api = FastAPI()

    @serve.deployment(name="control", num_replicas=replicas, max_ongoing_requests=4096)
    @serve.ingress(api)
    class Control:
        @api.post("/v1/completions")
        async def complete(self, body: dict[str, Any]) -> Any:
            if refuse and random.random() < refuse:
                msg = {"error": {"message": "overloaded", "type": "overloaded", "code": 503}}
                return JSONResponse(msg, status_code=503, headers={"Retry-After": "1"})
            await asyncio.sleep(delay_s)
            n = len(body.get("prompt") or ())
            return {
                "id": f"cmpl-{random.getrandbits(64):x}",
                "object": "text_completion",
                "model": body.get("model"),
                "choices": [{"index": 0, "text": ANSWER_TEXT, "finish_reason": "length"}],
                "usage": {"prompt_tokens": n, "completion_tokens": 16, "total_tokens": n + 16},
            }

    deployment: Any = Control  # Serve's decorator makes the class a Deployment
    return deployment.bind()


def _spin() -> None:
    while True:
        pass


def busy(n: int) -> list[Any]:
    """``n`` started processes that each keep one core busy (daemonic: they end with this
    one at the latest; spawned, so they carry none of Ray's threads or signal handlers)."""
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_spin, daemon=True) for _ in range(n)]
    for p in procs:
        p.start()
    return procs


def proxy_rss() -> int:
    """Resident bytes of this machine's Serve proxy (0 when none is running)."""
    return sum(v for k, v in rss().items() if k.startswith("ray::ProxyActor"))


def run(
    rate: float = 25.0,
    duration_s: float = 120.0,
    warmup_s: float = 60.0,
    delay_s: float = 0.2,
    port: int = 8123,
    replicas: int = 1,
    refuse: float = 0.0,
    documents: int = 8,
    doc_tokens: int = 512,
    question_tokens: int = 24,
    seed: int = 0,
    busy_cores: int = 0,
) -> dict[str, Any]:
    """Start Ray and Serve here, load the trivial app, and measure the proxy (see the module
    docstring). ``busy_cores`` processes spin from the warm-up to the end of the measured run,
    as pdserve's engines keep this machine's cores busy in the soak. Ray is shut down at the
    end."""
    import ray
    from ray import serve

    bodies = request_bodies(seed, documents, doc_tokens, question_tokens, 16)
    url = f"http://127.0.0.1:{port}"
    ray.init(include_dashboard=False, log_to_driver=False)
    spinners: list[Any] = []
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(delay_s, replicas, refuse), name="control", route_prefix="/")
        spinners = busy(busy_cores)
        with tqdm(total=int(rate * warmup_s), desc="warm-up", unit="req") as bar:
            warm = asyncio.run(_open_loop(url, None, bodies, rate, warmup_s, seed, bar))
        time.sleep(2.0)
        start = proxy_rss()
        with tqdm(total=int(rate * duration_s), desc="control", unit="req") as bar:
            got = asyncio.run(_open_loop(url, None, bodies, rate, duration_s, seed + 1, bar))
        time.sleep(2.0)
        end = proxy_rss()
    finally:
        for p in spinners:
            p.terminate()
        serve.shutdown()
        ray.shutdown()
    ok = sum(1 for _, w, _ in got if w == "200")
    return {
        "simulated": False,
        "rate_rps": rate,
        "replicas": replicas,
        "refuse": refuse,
        "busy_cores": busy_cores,
        "refused": sum(1 for _, w, _ in got if w == "503"),
        "duration_s": duration_s,
        "warmup_s": warmup_s,
        "warmup_sent": len(warm),
        "sent": len(got),
        "completed": ok,
        "proxy_start_mib": start / 2**20,
        "proxy_end_mib": end / 2**20,
        "proxy_growth": (end - start) / start if start else None,
        "proxy_kib_per_request": (end - start) / 1024 / max(1, len(got)),
    }
