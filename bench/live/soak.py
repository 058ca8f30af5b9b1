"""A bounded load test on the live endpoint (loopback): open-loop arrivals at and above
saturation, then checks that nothing was lost and nothing leaks.

One run:

1. **Capacity.** Closed-loop clients, more at each step (``clients``, ``capacity_s`` split
   among the steps) until the completion rate grows by less than 10%: the highest rate seen
   is the saturation rate. (A fixed, small client count underestimates it: in one run 8
   clients gave 7.8 req/s and open-loop arrivals at 11.7 req/s were all served.)
2. **Warm-up.** ``warmup_s`` of open-loop arrivals at the highest level (by default as long
   as one level), so buffers sized by peak concurrency (connections, queues, allocator
   pools) exist before the baseline; memory that grows after it is growth that a repeat of
   the heaviest load causes, a leak, not a high-water mark. With a 20 s warm-up at 1.5x
   the queue had not reached its peak: Serve's proxy grew 16% and the ingress replicas 6%
   in steps while it built, then stayed flat. After a 60 s warm-up, in three runs, every
   pdserve process grew less than 3%; Serve's own proxy grew 3.0%, 3.2% and 7.5%, steadily
   from the start. That was glibc's malloc keeping freed memory (``deployments/local.py``);
   with the head on Ray's jemalloc, as ``pdserve up`` starts it now, the proxy grew 2.5%
   (224 -> 229 MiB, after a peak of 269 under load), every process under 3% (stop 33).
3. **Baseline.** The app's tables (each router's, from ``/v1/pdserve/stats``; the blocks each
   prefill replica's feed holds for the index) and the resident memory of every process of
   the local Ray cluster (Serve's replicas, proxy and controller, raylet, GCS) and of
   ``redis-server``.
4. **Load.** For each level (a multiple of the saturation rate), Poisson arrivals at that
   rate for ``duration_s / len(levels)`` seconds; each request is a RAG-style prompt (one of
   ``documents`` shared documents, Zipf-popular, and a question of its own). Every answer is
   classified: 200, 429 or 503 with ``Retry-After`` (the expected refusals), anything else
   (an error to report).
5. **Drain.** Arrivals stop; the time until no replica has a request waiting or running and
   the ingress has nothing in flight.
6. **After.** The tables again (once the routers' in-flight bookkeeping has had its grace
   period) and the memory of every process, against the baseline.

Figures come as JSON (``simulated: false``: a real cluster) and a PNG: outcomes per second
with the offered rate, and each process's resident memory over the run. Absolute rates
depend on the machine; the checks (errors, drain, tables, memory growth) do not.
"""

from __future__ import annotations

import asyncio
import math
import random
import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

#: processes whose memory is followed: Ray's own (``ray::`` actors, raylet, GCS) and Redis
FOLLOWED = ("ray::", "raylet", "gcs_server", "redis-server")


def _prompt(rng: random.Random, docs: list[list[int]], zipf: list[float], q: int) -> list[int]:
    doc = rng.choices(docs, weights=zipf)[0]
    return doc + [rng.randrange(10, 1000) for _ in range(q)]


def request_bodies(
    seed: int, documents: int, doc_tokens: int, question_tokens: int, max_tokens: int
) -> Callable[[], dict[str, Any]]:
    """The soak's requests, one per call (thread-safe): a document drawn by a Zipf law from
    ``documents`` shared ones, then a question of its own (RAG-like prefix reuse)."""
    rng = random.Random(seed)
    docs = [[rng.randrange(10, 1000) for _ in range(doc_tokens)] for _ in range(documents)]
    zipf = [1.0 / (i + 1) for i in range(documents)]
    lock = threading.Lock()

    def bodies() -> dict[str, Any]:
        with lock:
            ids = _prompt(rng, docs, zipf, question_tokens)
        return {"model": "test", "prompt": ids, "max_tokens": max_tokens, "ignore_eos": True}

    return bodies


def _classify(r: httpx.Response) -> str:
    if r.status_code == 200:
        return "200"
    if r.status_code in (429, 503) and r.headers.get("retry-after"):
        return str(r.status_code)
    return f"error {r.status_code}"


def _reason(r: httpx.Response) -> str:
    """The error's reason as the app gives it (the message of its JSON error), cut short."""
    try:
        err = r.json().get("error")
        msg = err.get("message") if isinstance(err, dict) else err
    except Exception:  # noqa: BLE001 - a proxy's plain-text error
        msg = r.text
    return f"{r.status_code}: {str(msg)[:80]}"


def stats(url: str, key: str | None) -> dict[str, Any]:
    h = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.get(f"{url}/v1/pdserve/stats", headers=h, timeout=30)
    r.raise_for_status()
    return dict(r.json())


def tables(s: dict[str, Any]) -> dict[str, int]:
    """Sizes of the tables that must not grow with traffic (the routers' bookkeeping) and of
    the ones bounded by the KV caches (the blocks the feeds hold for the index)."""
    out: dict[str, int] = {}
    for role in ("prefill", "decode"):
        for k, v in (s["router"].get(role, {}).get("tables") or {}).items():
            out[f"router.{role}.{k}"] = int(v)
    rows = [r for r in s["replicas"]["prefill"] if "requests" in r]
    out["feed.tracked_blocks"] = sum(int(r.get("tracked_blocks") or 0) for r in rows)
    out["kv_blocks.prefill"] = sum(int(r.get("total_kv_blocks") or 0) for r in rows)
    return out


def busy(s: dict[str, Any]) -> int:
    """Requests still in the system: queued or running in an engine, in flight at the ingress."""
    n = int(s["ingress"]["prefill_queue"]["in_flight"])
    for role in ("prefill", "decode"):
        for r in s["replicas"][role]:
            n += int(r.get("waiting") or 0) + int(r.get("running") or 0)
    return n


def process_name(argv0: str, name: str) -> str:
    """The name a followed process is known by: a Ray actor's title (``argv[0]``) without the
    method it is running (Ray retitles an actor per call: ``ray::ServeReplica:app:ingress``
    becomes ``...ingress.handle_request_with_rejection`` while it serves one), so a process
    keeps one name through the run; other processes by their executable's name."""
    if not argv0.startswith("ray::"):
        return name
    return re.sub(r"\.[A-Za-z_]\w*$", "", argv0)


def rss() -> dict[str, int]:
    """Resident bytes of each followed process, by ``name[pid]`` (:func:`process_name`)."""
    import psutil

    out: dict[str, int] = {}
    for p in psutil.process_iter(["pid", "name", "cmdline", "memory_info"]):
        try:
            argv0 = (p.info["cmdline"] or [p.info["name"] or ""])[0]
            name = process_name(argv0, p.info["name"] or "")
            if any(name.startswith(f) for f in FOLLOWED):
                out[f"{name}[{p.info['pid']}]"] = int(p.info["memory_info"].rss)
        except (psutil.Error, TypeError, AttributeError):
            continue
    return out


class _Memory(threading.Thread):
    """Samples :func:`rss` every ``every_s`` until stopped."""

    def __init__(self, every_s: float = 2.0) -> None:
        super().__init__(daemon=True)
        self.every_s = every_s
        self.samples: list[tuple[float, dict[str, int]]] = []
        self._stop_ev = threading.Event()
        self.t0 = time.monotonic()

    def run(self) -> None:
        while not self._stop_ev.is_set():
            self.samples.append((time.monotonic() - self.t0, rss()))
            self._stop_ev.wait(self.every_s)

    def stop(self) -> None:
        self._stop_ev.set()
        self.join(30)


def capacity(
    url: str, key: str | None, bodies: Any, clients: tuple[int, ...], seconds: float
) -> tuple[float, dict[str, Any]]:
    """The saturation rate: completed requests per second from closed-loop clients, more at
    each step until the rate grows by less than 10% (the highest rate seen)."""
    steps: dict[str, Any] = {}
    best = 0.0
    for n in clients:
        rate, seen = _closed_loop(url, key, bodies, n, seconds / len(clients))
        steps[str(n)] = {"rps": rate, "outcomes": dict(seen)}
        grew = rate >= best * 1.1
        best = max(best, rate)
        if not grew:
            break
    return best, steps


def _closed_loop(
    url: str, key: str | None, bodies: Any, clients: int, seconds: float
) -> tuple[float, Counter[str]]:
    seen: Counter[str] = Counter()
    lock = threading.Lock()
    stop = time.monotonic() + seconds
    h = {"Authorization": f"Bearer {key}"} if key else {}

    def client() -> None:
        with httpx.Client(timeout=300, headers=h) as c:
            while time.monotonic() < stop:
                r = c.post(f"{url}/v1/completions", json=bodies())
                with lock:
                    seen[_classify(r)] += 1

    t0 = time.monotonic()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return seen["200"] / (time.monotonic() - t0), seen


async def _open_loop(
    url: str,
    key: str | None,
    bodies: Any,
    rate: float,
    seconds: float,
    seed: int,
    bar: tqdm,
    reasons: Counter[str] | None = None,
) -> list[tuple[float, str, float]]:
    """Poisson arrivals at ``rate`` per second for ``seconds``; ``(sent_at, outcome, s)``.
    The reasons of the answers that are errors are counted into ``reasons``."""
    rng = random.Random(seed)
    h = {"Authorization": f"Bearer {key}"} if key else {}
    out: list[tuple[float, str, float]] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=300, headers=h, limits=limits) as c:

        async def one(at: float) -> None:
            t = time.monotonic()
            try:
                r = await c.post(f"{url}/v1/completions", json=bodies())
                what = _classify(r)
                if what.startswith("error") and reasons is not None:
                    reasons[_reason(r)] += 1
            except httpx.HTTPError as e:
                what = f"error {type(e).__name__}"
                if reasons is not None:
                    reasons[what] += 1
            out.append((at, what, time.monotonic() - t))
            bar.update(1)

        tasks = []
        t0 = time.monotonic()
        at = 0.0
        while True:
            at += rng.expovariate(rate)
            if at >= seconds:
                break
            await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
            tasks.append(asyncio.create_task(one(at)))
        await asyncio.gather(*tasks)
    return out


def run(
    url: str,
    key: str | None = None,
    duration_s: float = 120.0,
    levels: tuple[float, ...] = (1.0, 1.5),
    capacity_s: float = 32.0,
    clients: tuple[int, ...] = (4, 8, 16, 32),
    warmup_s: float | None = None,
    documents: int = 8,
    doc_tokens: int = 512,
    question_tokens: int = 24,
    max_tokens: int = 16,
    drain_bound_s: float = 30.0,
    settle_s: float = 5.0,
    seed: int = 0,
    operator_key: str | None = None,
) -> dict[str, Any]:
    """The report (see the module docstring). ``key`` is the tenant's that sends the load;
    ``operator_key`` reads the stats (an app with keys answers them to an operator only)."""
    op = operator_key or key
    bodies = request_bodies(seed, documents, doc_tokens, question_tokens, max_tokens)
    report: dict[str, Any] = {
        "simulated": False,
        "url": url,
        "duration_s": duration_s,
        "levels": list(levels),
        "workload": {
            "documents": documents,
            "doc_tokens": doc_tokens,
            "question_tokens": question_tokens,
            "max_tokens": max_tokens,
        },
    }
    sat, steps = capacity(url, key, bodies, clients, capacity_s)
    report["saturation_rps"] = sat
    report["capacity_steps"] = steps
    if sat <= 0:
        raise RuntimeError(f"no request completed while measuring capacity: {steps}")
    wait_idle(url, op, drain_bound_s * 4)
    if warmup_s is None:
        warmup_s = duration_s / len(levels)
    report["warmup_s"] = warmup_s
    with tqdm(total=int(sat * max(levels) * warmup_s), desc="warm-up", unit="req") as bar:
        warm = asyncio.run(_open_loop(url, key, bodies, sat * max(levels), warmup_s, seed, bar))
    report["warmup_outcomes"] = dict(Counter(w for _, w, _ in warm))
    wait_idle(url, op, drain_bound_s * 4)
    base_tables = tables(stats(url, op))
    mem = _Memory()
    mem.start()
    results: dict[str, Any] = {}
    timeline: list[tuple[float, str, float]] = []
    offset = 0.0
    span = duration_s / len(levels)
    total = int(sum(sat * x * span for x in levels))
    reasons: Counter[str] = Counter()
    with tqdm(total=total, desc="soak", unit="req") as bar:
        for i, x in enumerate(levels):
            got = asyncio.run(
                _open_loop(url, key, bodies, sat * x, span, seed + 1 + i, bar, reasons)
            )
            outcomes = Counter(w for _, w, _ in got)
            results[f"{x:g}x"] = {
                "offered_rps": sat * x,
                "sent": len(got),
                "outcomes": dict(outcomes),
                "goodput_rps": outcomes["200"] / span,
            }
            timeline += [(offset + a, w, s) for a, w, s in got]
            offset += span
            results[f"{x:g}x"]["rss_mib"] = {k: v / 2**20 for k, v in rss().items()}
    t_drain = time.monotonic()
    drained = wait_idle(url, op, drain_bound_s * 4)
    report["drain_s"] = time.monotonic() - t_drain if drained else None
    time.sleep(settle_s)  # the routers' in-flight prefixes outlive a call by their grace
    after_tables = tables(stats(url, op))
    mem.stop()
    report["levels_out"] = results
    errors = Counter(w for _, w, _ in timeline if w.startswith("error"))
    report["errors"] = dict(errors)
    report["error_reasons"] = dict(reasons.most_common(20))
    report["tables"] = {"before": base_tables, "after": after_tables}
    report["memory"] = _memory_report(mem.samples)
    report["checks"] = {
        "only_expected_refusals": not errors,
        "drained_within_bound": drained and report["drain_s"] <= drain_bound_s,
        "router_tables_back_to_baseline": all(
            after_tables.get(k, 0) <= v for k, v in base_tables.items() if k.startswith("router.")
        ),
        "feed_within_kv_capacity": after_tables["feed.tracked_blocks"]
        <= max(after_tables["kv_blocks.prefill"], base_tables["kv_blocks.prefill"]),
        "rss_growth_under_5pct": all(
            m["growth"] < 0.05 for m in report["memory"]["processes"].values()
        ),
    }
    report["timeline"] = [(round(a, 3), w, round(s, 4)) for a, w, s in timeline]
    report["memory_samples"] = [(round(t, 1), m) for t, m in mem.samples]
    return report


def wait_idle(url: str, key: str | None, bound_s: float) -> bool:
    """Poll until nothing is in the system (True), or ``bound_s`` passes (False)."""
    end = time.monotonic() + bound_s
    while time.monotonic() < end:
        if busy(stats(url, key)) == 0:
            return True
        time.sleep(0.25)
    return False


def _memory_report(samples: list[tuple[float, dict[str, int]]]) -> dict[str, Any]:
    """Each process's resident memory at the first and last sample it appears in, and the
    growth between (processes that started or ended during the run are listed apart)."""
    if not samples:
        return {"processes": {}, "came_or_went": []}
    first, last = samples[0][1], samples[-1][1]
    procs = {
        k: {
            "start_mib": first[k] / 2**20,
            "end_mib": last[k] / 2**20,
            "peak_mib": max(s[1].get(k, 0) for s in samples) / 2**20,
            "growth": (last[k] - first[k]) / first[k] if first[k] else math.inf,
        }
        for k in sorted(set(first) & set(last))
    }
    return {"processes": procs, "came_or_went": sorted(set(first) ^ set(last))}


def plot(report: dict[str, Any], out: Path) -> None:
    """Outcomes per second against the offered rate; each process's memory over the run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(2, 1, figsize=(9, 7), sharex=False)
    tl = report["timeline"]
    end = int(max((t for t, _, _ in tl), default=0)) + 1
    kinds = sorted({w for _, w, _ in tl})
    per = {k: [0] * end for k in kinds}
    for t, w, _ in tl:
        per[w][int(t)] += 1
    bottom = [0] * end
    for k in kinds:
        a.bar(range(end), per[k], bottom=bottom, label=k, width=1.0)
        bottom = [x + y for x, y in zip(bottom, per[k], strict=True)]
    span = report["duration_s"] / len(report["levels"])
    for i, x in enumerate(report["levels"]):
        rate = report["saturation_rps"] * x
        a.hlines(rate, i * span, (i + 1) * span, colors="k", linestyles="--")
    a.set_xlabel("seconds since the load began")
    a.set_ylabel("requests per second (by arrival)")
    a.set_title("pdserve soak (real cluster): outcomes; dashed = offered rate")
    a.legend(fontsize=8)
    first = report["memory_samples"][0][1] if report["memory_samples"] else {}
    for k in first:
        xs = [t for t, m in report["memory_samples"] if k in m]
        ys = [100.0 * m[k] / first[k] for _, m in report["memory_samples"] if k in m]
        b.plot(xs, ys, label=k.removeprefix("ray::").removeprefix("ServeReplica:"))
    b.axhline(105, color="r", linestyle=":", label="+5%")
    b.set_xlabel("seconds since the baseline")
    b.set_ylabel("resident memory, % of baseline")
    b.legend(fontsize=6, ncol=3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
