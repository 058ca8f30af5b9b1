"""Live measurements of a running PD app (``pdserve bench pd``): idle CPU of the app's processes,
PD-path vs single-engine TTFT and ITL, and the ingress's overhead per request.

Three paths over the same prompts (distinct per request, so no prefix hits):

- ``http_pd``: the OpenAI endpoint, streaming (ingress -> prefill -> NIXL -> decode -> SSE);
- ``handle_pd``: the same two engine calls made directly through Serve handles (no HTTP, no
  ingress);
- ``single``: one engine (the prefill replica's ``generate``), no transfer.

Ingress overhead per request = ``http_pd`` end-to-end latency minus ``handle_pd``'s, paired by
prompt order; the ingress's own view (its wall time minus the engines' reported time) comes from
``/v1/pdserve/stats``. Runs against a live cluster: hold ``/tmp/pdserve-heavy.lock``.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable, Iterable
from typing import Any

from controllers.stats import summarize

APP = "pdserve"


def process_cpu(match: Callable[[str], bool], seconds: float) -> dict[str, float]:
    """CPU use (% of one core) of each live process whose command line ``match``es, over
    ``seconds``; key ``total`` sums them."""
    import psutil

    procs = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info.get("cmdline") or [])
        if match(cmd):
            try:
                p.cpu_percent(None)
                procs.append((p, cmd))
            except psutil.Error:
                pass
    time.sleep(seconds)  # a measurement window, not a synchronisation
    out: dict[str, float] = {}
    for p, cmd in procs:
        try:
            name = cmd.split()[0] if cmd.startswith("ray::") else cmd.split()[0].rsplit("/", 1)[-1]
            key = f"{name}[{p.pid}]"
            out[key] = round(p.cpu_percent(None), 1)
        except psutil.Error:
            pass
    out["total"] = round(sum(out.values()), 1)
    return out


def is_app_process(cmd: str) -> bool:
    """Ray's and Serve's processes (the replicas host the engines in-process)."""
    return cmd.startswith("ray::") or any(
        k in cmd for k in ("raylet", "gcs_server", "dashboard", "log_monitor", "runtime_env")
    )


def _timings(stamps: Iterable[float], t0: float) -> tuple[float, float, float]:
    """(TTFT, mean ITL, end-to-end) from token arrival stamps."""
    s = list(stamps)
    ttft = s[0] - t0
    itl = (s[-1] - s[0]) / (len(s) - 1) if len(s) > 1 else 0.0
    return ttft, itl, s[-1] - t0


def http_pd(url: str, prompt: str, max_tokens: int, key: str | None) -> tuple[float, float, float]:
    """One streamed completion over HTTP; token stamps from SSE chunks with text."""
    body = json.dumps(
        {
            "model": "test",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
        }
    ).encode()
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(f"{url}/v1/completions", body, headers)
    stamps: list[float] = []
    t0 = time.monotonic()
    with urllib.request.urlopen(req, timeout=300) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data: {"):
                ch = json.loads(line[6:])
                if ch.get("choices") and ch["choices"][0].get("text"):
                    stamps.append(time.monotonic())
    return _timings(stamps, t0)


def run(
    url: str, *, requests: int, prompt_words: int, max_tokens: int, idle_s: float, key: str | None
) -> dict[str, Any]:
    """All measurements; see the module docstring."""
    import ray
    from ray import serve
    from transformers import AutoTokenizer

    from deployments.protocol import EngineRequest, Sampling

    idle = process_cpu(is_app_process, idle_s)
    ray.init(address="auto", log_to_driver=False)
    prefill = serve.get_deployment_handle("prefill", app_name=APP)
    decode = serve.get_deployment_handle("decode", app_name=APP)
    tok = AutoTokenizer.from_pretrained(prefill.model_path.remote().result())
    sampling = Sampling(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    def prompt(i: int, tag: str) -> str:
        return f"{tag} {i} " + " ".join(f"w{(i * 31 + j) % 997}" for j in range(prompt_words))

    def handle_pd(i: int, text: str, single: bool) -> tuple[float, float, float]:
        ids = tuple(tok(text)["input_ids"])
        req = EngineRequest(f"m-{i}-{single}", ids, sampling, cache_salt=f"bench-{i}")
        stamps: list[float] = []
        t0 = time.monotonic()
        gen: Any
        if single:
            gen = prefill.options(stream=True).generate.remote(req)
        else:
            pre = prefill.prefill.remote(req).result()
            dreq = EngineRequest(
                req.request_id, ids, sampling, req.cache_salt, pre.kv_transfer_params
            )
            gen = decode.options(stream=True).decode.remote(dreq)
        for ch in gen:
            stamps.extend([time.monotonic()] * max(1, len(ch.token_ids)) if ch.text else [])
        return _timings(stamps, t0)

    res: dict[str, dict[str, list[float]]] = {}
    for path in ("single", "handle_pd", "http_pd"):
        cols: dict[str, list[float]] = {"ttft_s": [], "itl_s": [], "e2e_s": []}
        http_pd(url, prompt(0, "warm" + path), 4, key)  # warm-up
        for i in range(requests):
            text = prompt(i, path)
            if path == "http_pd":
                t = http_pd(url, text, max_tokens, key)
            else:
                t = handle_pd(i, text, path == "single")
            for k, v in zip(cols, t, strict=True):
                cols[k].append(v)
        res[path] = cols
    overhead = [
        a - b for a, b in zip(res["http_pd"]["e2e_s"], res["handle_pd"]["e2e_s"], strict=True)
    ]
    with urllib.request.urlopen(f"{url}/v1/pdserve/stats", timeout=30) as r:
        st = json.loads(r.read())
    return {
        "idle_cpu_percent": idle,
        "requests": requests,
        "prompt_tokens_approx": len(tok(prompt(0, "x"))["input_ids"]),
        "max_tokens": max_tokens,
        "paths": {p: {k: summarize(v) for k, v in cols.items()} for p, cols in res.items()},
        "ingress_overhead_s": summarize(overhead),
        "ingress_self_overhead_s": st["ingress"]["overhead_s"],
        "decode_external_hits": st["totals"]["decode"]["external_hits"],
        "decode_kv_load_failures": sum(
            int(r.get("kv_load_failures") or 0) for r in st["replicas"]["decode"]
        ),
    }
