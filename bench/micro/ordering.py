"""Per-step ordering cost of prefill policies (a benchmark, not a test).

For each queue size, builds a seeded queue of waiting requests (a mix of misses,
partial and near-full hits, as under a prefix cache), then times ``order()`` over many
steps. Between steps only what moves in a real engine moves: time advances and a few
requests' cached lengths change (eviction, new blocks), so per-request values that do
not move (patience, prompt length, arrival) are built once.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
from collections.abc import Callable, Sequence

from tqdm import tqdm

from controllers.prefill import PrefillQueueView, PrefillRequestView, make_prefill_policy


def make_queue(n: int, rng: random.Random) -> list[PrefillRequestView]:
    reqs = []
    for i in range(n):
        prompt = rng.randint(500, 8000)
        kind = rng.random()
        cached = (
            0
            if kind < 0.3
            else int(prompt * (rng.uniform(0.3, 0.7) if kind < 0.6 else rng.uniform(0.9, 0.99)))
        )
        reqs.append(
            PrefillRequestView(
                request_id=f"r{i}",
                arrival_s=rng.uniform(0.0, 30.0),
                prompt_tokens=prompt,
                patience_s=max(1.0, 3.0 * prompt * 1.2e-4),
                cached_tokens=cached,
                uncached_tokens=prompt - cached,
            )
        )
    return reqs


def time_policy(
    name: str, n: int, steps: int, seed: int = 0, clock: Callable[[], float] = time.perf_counter
) -> float:
    """Median milliseconds per ``order()`` call at ``n`` waiting requests."""
    rng = random.Random(seed)
    reqs = make_queue(n, rng)
    policy = make_prefill_policy(name)
    now = 30.0
    samples = []
    for _ in range(steps):
        for _ in range(max(1, n // 100)):  # a few cached lengths move each step
            j = rng.randrange(n)
            r = reqs[j]
            cached = max(0, min(r.prompt_tokens, r.cached_tokens + rng.choice([-128, 128])))
            reqs[j] = dataclasses.replace(
                r, cached_tokens=cached, uncached_tokens=r.prompt_tokens - cached
            )
        view = PrefillQueueView(tuple(reqs))
        t0 = clock()
        policy.order(view, now)
        samples.append(clock() - t0)
        now += 0.05
    return statistics.median(samples) * 1e3


def run(
    policies: Sequence[str], sizes: Sequence[int], steps: int | None = None, seed: int = 0
) -> dict:
    out: dict = {"policies": {p: {} for p in policies}, "steps": {}, "unit": "ms per step (median)"}
    jobs = [(p, n) for n in sizes for p in policies]
    for p, n in tqdm(jobs, desc="ordering cost", unit="run"):
        k = steps or max(20, min(400, 200_000 // max(n, 1)))
        out["steps"][str(n)] = k
        out["policies"][p][str(n)] = round(time_policy(p, n, k, seed), 4)
    return out
