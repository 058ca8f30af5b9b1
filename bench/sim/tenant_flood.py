"""A 10x tenant flood at one prefill engine (simulated): does tenant B keep its TTFT?

Two tenants query one SEC-like corpus (:class:`bench.workloads.prefill_scenarios.SecCorpus`); each
tenant's blocks are salted apart, as the ingress salts their caches. Tenant B sends
``b_load`` x the engine's FCFS capacity (Poisson) for ``duration_s``; tenant A sends
``flood_factor`` times B's rate over the same window, far beyond capacity. The runs, all on
the same prompts and arrival times:

- ``alone``: B's requests only, under the first policy (the reference);
- per policy: A and B together.

The pass mark (issue: tenants) is B's p99 TTFT under the flood within 1.5x of B alone.
Fair shares (``+fair_share``) give B half the engine when both are backlogged; B asks for
``b_load`` of it, so B waits only for the step in progress. A's backlog is not drained: the
run stops ``drain_s`` after the last arrival, and A's unfinished requests are counted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from bench.sim.prefill import EngineConfig, RunResult, SimRequest, fcfs_capacity, simulate
from bench.workloads.prefill_scenarios import (
    SecCorpus,
    _Ids,
    _poisson_times,
    block_hashes,
    sec_prompt,
)
from controllers.profile import EngineProfile

LABEL = "simulated"


def percentile(xs: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if len(xs) else float("nan")


@dataclass(frozen=True)
class FloodSpec:
    seed: int = 1
    b_load: float = 0.3
    flood_factor: float = 10.0
    duration_s: float = 60.0
    drain_s: float = 60.0
    cache_blocks: int = 4096
    block_size: int = 16


def _salted(hashes: tuple[int, ...], tenant: str) -> tuple[int, ...]:
    salt = sum(ord(c) * 131**i for i, c in enumerate(tenant)) + 1
    return tuple((h * 1_000_003 + salt) % (1 << 62) for h in hashes)


def workload(spec: FloodSpec, profile: EngineProfile) -> tuple[list[SimRequest], float]:
    """``(requests of A and B, capacity in requests/s)``; B's requests are labelled ``B``."""
    corpus = SecCorpus(np.random.default_rng([spec.seed, 0]))

    def prompts(tenant: str, n: int, stream: int) -> list[tuple[int, tuple[int, ...]]]:
        rng = np.random.default_rng([spec.seed, stream])
        ids = _Ids(10_000_000 * (stream + 1))
        out = []
        for _ in range(n):
            segs = sec_prompt(corpus, rng, ids)
            out.append(
                (sum(t for _, t in segs), _salted(block_hashes(segs, spec.block_size), tenant))
            )
        return out

    cfg = EngineConfig(block_size=spec.block_size)
    probe = [SimRequest(f"p{k}", 0.0, t, h) for k, (t, h) in enumerate(prompts("B", 200, 9))]
    cap = fcfs_capacity(probe, profile, spec.cache_blocks, cfg)
    reqs: list[SimRequest] = []
    for tenant, load, stream in (
        ("B", spec.b_load, 1),
        ("A", spec.b_load * spec.flood_factor, 2),
    ):
        times = _poisson_times([(tenant, spec.duration_s, load)], cap, spec.seed * 10 + stream)
        for k, ((t, _), (tok, h)) in enumerate(
            zip(times, prompts(tenant, len(times), stream), strict=True)
        ):
            reqs.append(SimRequest(f"{tenant}{k}", t, tok, h, (tenant,), tenant=tenant))
    return sorted(reqs, key=lambda r: r.arrival_s), cap


@dataclass(frozen=True)
class FloodRow:
    run: str
    b_requests: int
    b_p50_s: float
    b_p99_s: float
    b_p99_vs_alone: float
    a_finished: int
    a_unfinished: int


def _row(run: str, res: RunResult, alone_p99: float | None) -> FloodRow:
    b = res.ttfts("B")
    p99 = percentile(b, 99)
    return FloodRow(
        run,
        len(b),
        percentile(b, 50),
        p99,
        p99 / alone_p99 if alone_p99 else 1.0,
        sum(1 for f in res.finished if f.request_id.startswith("A")),
        sum(1 for r in res.unfinished if r.tenant == "A"),
    )


def run(
    spec: FloodSpec,
    profile: EngineProfile,
    policies: Sequence[str] = ("fairway", "fairway+fair_share"),
    progress: bool = True,
) -> tuple[list[FloodRow], dict[str, list[float]], float]:
    """Rows (``alone`` first), B's TTFTs per run (for plots), and the capacity used."""
    from tqdm import tqdm

    reqs, cap = workload(spec, profile)
    cfg = EngineConfig(block_size=spec.block_size)
    horizon = spec.duration_s + spec.drain_s
    only_b = [r for r in reqs if r.tenant == "B"]
    bar = tqdm(total=1 + len(policies), desc=f"tenant flood ({LABEL})", disable=not progress)
    alone = simulate(only_b, policies[0], profile, spec.cache_blocks, config=cfg, horizon_s=1e9)
    bar.update(1)
    if alone.unfinished:
        raise RuntimeError("B alone did not finish: lower b_load")
    ref = percentile(alone.ttfts("B"), 99)
    rows = [_row(f"B alone ({policies[0]})", alone, None)]
    ttfts = {rows[0].run: alone.ttfts("B")}
    for p in policies:
        res = simulate(reqs, p, profile, spec.cache_blocks, config=cfg, horizon_s=horizon)
        row = _row(f"A x{spec.flood_factor:g} + B ({p})", res, ref)
        rows.append(row)
        ttfts[row.run] = res.ttfts("B")
        bar.update(1)
    bar.close()
    return rows, ttfts, cap


def plot(ttfts: dict[str, list[float]], path: str, title: str, label: str = LABEL) -> None:
    """CDFs of B's TTFT per run (PNG), labelled ``label`` (simulated, or measured)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, xs in ttfts.items():
        if not xs:
            continue
        v = np.sort(np.asarray(xs))
        ax.step(v, np.arange(1, len(v) + 1) / len(v), where="post", label=name)
    ax.set_xscale("log")
    ax.set_xlabel("tenant B's TTFT (s)")
    ax.set_ylabel("fraction of B's requests")
    ax.set_title(f"{title} [{label}]")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- the same flood through a real vLLM engine (measured, not simulated) -----------------------
