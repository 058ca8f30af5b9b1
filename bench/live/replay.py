"""Open-loop replay of a trace or scenario against any OpenAI-compatible endpoint
(``pdserve bench live``): real requests, client-side timings, a report with plots.

The requests are a :class:`~bench.workloads.replay.ReplayWorkload` built by
:func:`bench.workloads.replay.build_requests` (token-id prompts, shaped to the run).

Per request: time to first token, the gaps between streamed chunks (inter-token latency,
divided by the tokens a chunk carries), end-to-end latency, and the usage the endpoint reports
(prompt and cached tokens). ``DIR/summary.json`` follows the issue's schema; ``DIR/report.md``
holds the tables, with ``ttft_cdf.png``, ``ttft_over_time.png`` and ``itl.png`` beside it.
"""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.workloads.replay import LiveRequest, ReplayWorkload, build_requests


@dataclass
class LiveResult:
    """What the client saw of one request (times in seconds)."""

    sent_s: float
    ok: bool
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: str = ""
    #: the replicas that served it, where the endpoint names them (pdserve's usage chunk)
    prefill_replica: str | None = None
    decode_replica: str | None = None


async def _one(
    client: Any, url: str, model: str, key: str | None, r: LiveRequest, t0: float
) -> LiveResult:
    body = {
        "model": model,
        "prompt": r.text if r.text is not None else list(r.ids),
        "max_tokens": r.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    key = r.key or key
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    sent = time.monotonic()
    res = LiveResult(sent_s=sent - t0, ok=False)
    last = None
    try:
        async with client.stream(
            "POST", f"{url}/v1/completions", json=body, headers=headers
        ) as resp:
            if resp.status_code != 200:
                reason = (await resp.aread()).decode(errors="replace")[:200]
                res.error = f"HTTP {resp.status_code}: {reason}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if "error" in obj:
                    res.error = str(obj["error"])[:200]
                    return res
                now = time.monotonic()
                choices = obj.get("choices") or []
                if choices:
                    # the first chunk with a choice carries the first token (its text may be
                    # empty: a token that decodes to nothing yet); later ones count when
                    # they carry text or token ids
                    c = choices[0]
                    n = max(1, len(c.get("token_ids") or []))
                    if last is None:
                        res.ttft_s = now - sent
                        last = now
                    elif c.get("text") or c.get("token_ids"):
                        res.itl_s += [(now - last) / n] * n
                        last = now
                use = obj.get("usage")
                if use:
                    res.prompt_tokens = int(use.get("prompt_tokens") or 0)
                    res.completion_tokens = int(use.get("completion_tokens") or 0)
                    details = use.get("prompt_tokens_details") or {}
                    res.cached_tokens = int(details.get("cached_tokens") or 0)
                served = obj.get("pdserve")
                if isinstance(served, dict):
                    res.prefill_replica = served.get("prefill_replica")
                    res.decode_replica = served.get("decode_replica")
    except Exception as e:  # a transport failure is a failed request, reported
        res.error = repr(e)[:200]
        return res
    res.e2e_s = time.monotonic() - sent
    res.ok = res.ttft_s is not None
    if not res.ok:
        res.error = "the stream ended without a token"
    return res


async def replay(
    url: str,
    reqs: Sequence[LiveRequest],
    *,
    model: str,
    key: str | None = None,
    concurrency: int | None = None,
    timeout_s: float = 600.0,
    progress: Callable[[int], None] | None = None,
) -> tuple[list[LiveResult], float]:
    """Send ``reqs`` open-loop at their offsets (or closed-loop with ``concurrency``
    clients); the results in request order and the wall time of the run."""
    import httpx

    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        t0 = time.monotonic()
        if concurrency:
            results: list[LiveResult | None] = [None] * len(reqs)
            todo = iter(range(len(reqs)))

            async def worker() -> None:
                for i in todo:
                    results[i] = await _one(client, url, model, key, reqs[i], t0)
                    if progress is not None:
                        progress(1)

            await asyncio.gather(*(worker() for _ in range(concurrency)))
            done = [r for r in results if r is not None]
        else:

            async def at(r: LiveRequest) -> LiveResult:
                await asyncio.sleep(max(0.0, t0 + r.at_s - time.monotonic()))  # the schedule
                out = await _one(client, url, model, key, r, t0)
                if progress is not None:
                    progress(1)
                return out

            done = list(await asyncio.gather(*(at(r) for r in reqs)))
        return done, time.monotonic() - t0


def _stats(xs: Sequence[float]) -> dict[str, float | None]:
    if not xs:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    s = sorted(xs)

    def q(p: float) -> float:
        return s[min(len(s) - 1, max(0, math.ceil(p * len(s)) - 1))]

    return {"p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "mean": statistics.fmean(s)}


def summarize(endpoint: str, results: Sequence[LiveResult], wall_s: float) -> dict[str, Any]:
    """The run's summary (``summary.json``): the issue's schema, plus a few counts."""
    ok = [r for r in results if r.ok]
    itl = [x for r in ok for x in r.itl_s]
    itl_mean = statistics.fmean(itl) if itl else None
    cv = None
    if itl and len(itl) > 1 and itl_mean:
        cv = statistics.pstdev(itl) / itl_mean
    prompt = sum(r.prompt_tokens for r in ok)
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            kind = r.error.split(":")[0] if r.error else "error"
            errors[kind] = errors.get(kind, 0) + 1
    return {
        "endpoint": endpoint,
        "requests": len(results),
        "errors": len(results) - len(ok),
        "error_kinds": errors,
        "ttft": _stats([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl": {"mean": itl_mean, "p50": _stats(itl)["p50"], "p99": _stats(itl)["p99"], "cv": cv},
        "e2e": _stats([r.e2e_s for r in ok if r.e2e_s is not None]),
        "throughput_tps": sum(r.completion_tokens for r in ok) / wall_s if wall_s > 0 else 0.0,
        "cached_token_ratio": (sum(r.cached_tokens for r in ok) / prompt) if prompt else None,
        "wall_s": wall_s,
        "by_prefill_replica": by_prefill_replica(ok),
    }


def _by_prefill(results: Sequence[LiveResult]) -> dict[str, list[LiveResult]]:
    """``results`` by the prefill replica that served them, in id order; ``""``: not named."""
    groups: dict[str, list[LiveResult]] = {}
    for r in results:
        groups.setdefault(r.prefill_replica or "", []).append(r)
    return dict(sorted(groups.items()))


def by_prefill_replica(ok: Sequence[LiveResult]) -> dict[str, Any]:
    """Per prefill replica that served a request (where the endpoint names it): its
    requests, TTFTs and cached-token ratio; empty when none is named (the reference)."""
    out: dict[str, Any] = {}
    for rid, rs in _by_prefill(ok).items():
        if not rid:
            continue
        prompt = sum(r.prompt_tokens for r in rs)
        out[rid] = {
            "requests": len(rs),
            "ttft": _stats([r.ttft_s for r in rs if r.ttft_s is not None]),
            "cached_token_ratio": sum(r.cached_tokens for r in rs) / prompt if prompt else None,
        }
    return out


def max_model_len(url: str, key: str | None) -> tuple[str | None, int | None]:
    """The first model the endpoint lists and its ``max_model_len`` (when it says)."""
    import httpx

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.get(f"{url}/v1/models", headers=headers, timeout=30)
    r.raise_for_status()
    data = r.json().get("data") or []
    if not data:
        return None, None
    m = data[0]
    n = m.get("max_model_len")
    return m.get("id"), int(n) if n else None


def write_report(out: Path, summary: dict[str, Any], results: Sequence[LiveResult]) -> list[Path]:
    """``report.md`` and its plots in ``out``; the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    ok = [r for r in results if r.ok and r.ttft_s is not None]
    files = []
    ttft = sorted(r.ttft_s for r in ok if r.ttft_s is not None)
    fig, ax = plt.subplots(figsize=(6, 4))
    if ttft:
        ax.plot(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))])
    ax.set(xlabel="TTFT (s)", ylabel="fraction of requests", title="TTFT CDF")
    fig.tight_layout()
    fig.savefig(out / "ttft_cdf.png")
    files.append(out / "ttft_cdf.png")
    fig, ax = plt.subplots(figsize=(6, 4))
    groups = _by_prefill(ok)  # one colour per prefill replica where the endpoint names them
    for rid, rs in groups.items():
        ax.scatter([r.sent_s for r in rs], [r.ttft_s or 0.0 for r in rs], s=6, label=rid or None)
    if len(groups) > 1 or "" not in groups:
        ax.legend(title="prefill replica", fontsize="small")
    ax.set(xlabel="sent at (s)", ylabel="TTFT (s)", title="TTFT over the run")
    fig.tight_layout()
    fig.savefig(out / "ttft_over_time.png")
    files.append(out / "ttft_over_time.png")
    fig, ax = plt.subplots(figsize=(6, 4))
    itl = [x * 1e3 for r in ok for x in r.itl_s]
    if itl:
        ax.hist(itl, bins=50)
    ax.set(xlabel="inter-token latency (ms)", ylabel="tokens", title="ITL distribution")
    fig.tight_layout()
    fig.savefig(out / "itl.png")
    files.append(out / "itl.png")
    plt.close("all")

    def f(x: float | None, scale: float = 1.0, fmt: str = "{:.3f}") -> str:
        return "-" if x is None else fmt.format(x * scale)

    t, e = summary["ttft"], summary["e2e"]
    lines = [
        f"# Live replay against {summary['endpoint']}",
        "",
        f"{summary['requests']} requests, {summary['errors']} errors "
        f"{summary['error_kinds'] or ''}, {summary['wall_s']:.1f} s.",
        "",
        "| metric | p50 | p90 | p99 | mean |",
        "|---|---|---|---|---|",
        f"| TTFT s | {f(t['p50'])} | {f(t['p90'])} | {f(t['p99'])} | {f(t['mean'])} |",
        f"| end to end s | {f(e['p50'])} | {f(e['p90'])} | {f(e['p99'])} | {f(e['mean'])} |",
        "",
        f"ITL mean {f(summary['itl']['mean'], 1e3, '{:.1f}')} ms, p99 "
        f"{f(summary['itl']['p99'], 1e3, '{:.1f}')} ms, CV {f(summary['itl']['cv'], 1, '{:.2f}')}; "
        f"throughput {summary['throughput_tps']:.1f} tokens/s; cached-token ratio "
        f"{f(summary['cached_token_ratio'], 1, '{:.3f}')}.",
        "",
        "![TTFT CDF](ttft_cdf.png) ![TTFT over time](ttft_over_time.png) ![ITL](itl.png)",
        "",
    ]
    per = summary.get("by_prefill_replica") or {}
    if per:
        lines += [
            "| prefill replica | requests | TTFT p50 s | TTFT p99 s | cached-token ratio |",
            "|---|---|---|---|---|",
            *(
                f"| {rid} | {v['requests']} | {f(v['ttft']['p50'])} | {f(v['ttft']['p99'])} "
                f"| {f(v['cached_token_ratio'])} |"
                for rid, v in per.items()
            ),
            "",
        ]
    (out / "report.md").write_text("\n".join(lines))
    files.append(out / "report.md")
    return files


def run(
    endpoint: str,
    out: Path,
    workload: ReplayWorkload,
    *,
    model: str | None = None,
    key: str | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Replay ``workload`` and write ``out/summary.json``, ``out/results.json`` and the report;
    the summary."""
    workload.check()
    endpoint = endpoint.rstrip("/")
    listed, max_len = max_model_len(endpoint, key)
    model = model or listed or "default"
    shaped, cut = build_requests(workload, max_model_len=max_len)
    from tqdm import tqdm

    bar = tqdm(total=len(shaped), desc="live replay", unit="req", disable=not progress)
    results, wall = asyncio.run(
        replay(
            endpoint,
            shaped,
            model=model,
            key=key,
            concurrency=workload.concurrency,
            progress=bar.update,
        )
    )
    bar.close()
    summary = summarize(endpoint, results, wall)
    summary |= {"model": model, "workload": workload.name, "shaping": workload.shaping(cut)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    (out / "results.json").write_text(json.dumps([asdict(r) for r in results]))
    write_report(out, summary, results)
    return summary
