"""Workloads for the prefill simulator: the paper's scenarios and trace replays (simulated).

Every generator is deterministic for its seed (``numpy.random.default_rng``). Content is
modelled as segments (a system prompt, report excerpts, a question), each with an integer
id and a token length; a prompt is a sequence of segments, and its full-block hashes are
chained over ``(segment id, offset range)`` pieces, so equal hashes mean equal prefixes,
as vLLM's chained block hashes do.

The SEC-like corpus (``sec-spike``, ``long-prompts``, the grid)
----------------------------------------------------------------
Financial-QA RAG prompts over quarterly-filing excerpts, sized after the issue:

- 200 reports; report ``k`` (1-based) is chosen with probability proportional to
  ``k ** -1.1`` (Zipf 1.1: the top 10 reports take ~45% of requests, the bottom half ~12%).
- Each report has 2 sections of 5 excerpts; an excerpt is 500-1,500 tokens (uniform).
- A prompt is a 64-token system prompt shared by all, then 3-5 excerpts, then a unique
  30-80-token question. With probability 0.6 all excerpts come from one report, else
  from two (the first report gives ceil(k/2) of them). Excerpts are taken from the start
  of one section (section 0 with probability 0.7), in the section's order, as a retriever
  with a stable ranking would return them; so two prompts over the same report share a
  prefix of one to five excerpts, and a two-report prompt shares only its first part.
- A full hit computes ~50-100 tokens (the question and the partial block), a miss
  1,500-7,500: remaining work differs by up to ~100 x within one queue.

``sec-spike`` phases: 120 s at 0.5 x capacity (``calm``), 120 s at 0.9 (``burst``), a
60-second spike at 1.75 (``spike``), then either a drain (``--variant drain``) or 120 s
more at 0.5 (``after``; variant ``continued``). The KV cache holds ``cache_fraction``
(default 0.3) of the trace's reusable content. Capacity and cache sizing are two-pass:
the cache is sized against a trace drawn at a first capacity estimate, capacity is then
re-measured with that cache, and the final trace is drawn at it (the prompts are the
same stream; only their times change).

``flood``: 20 misses of 4-8k unique tokens at t = 0 (``backlog``), then requests over 8
popular documents of 3,000-5,000 tokens plus a unique 50-300-token question (``flood``; at
least 90% of the prompt cached) arriving for 60 s at 2 x capacity, where capacity is
FCFS's saturated throughput on the flood mix. The documents are in the cache at t = 0
and the cache is sized to hold them twice over (the scenario's premise is a flood of
hits), so ``--cache-fraction`` does not apply. The issue's example of 300 backlog misses
is 1.8M tokens, six minutes of FCFS work on the default profile, beside which a 60 s
flood barely matters; 20 misses is ~25 s of work, comparable to the paper's 22 s FCFS
worst wait.

``long-prompts``: 20% of prompts are long-document QA (the system prompt, then one
report's excerpts in order up to 8-16k tokens, then a question; ``long``), the rest
0.5-2k-token prompts (one or two excerpts; ``short``); reports have 16 excerpts here so a
long prompt fits in one. 120 s at 0.6 x capacity, then 120 s at 1.2, then a drain.

Grid: steady Poisson arrivals for 240 s at ``load`` in {0.7, 0.9, 1.1} x mix in {``sec``
(the sec-spike prompts), ``mixed`` (the long-prompts mix)} x cache fraction in {0.25, 0.5}:
12 scenarios named ``grid-{mix}-l{load}-c{cache}``.

Traces: see :func:`mooncake_workload`, :func:`azure_workload`, :func:`musique_workload`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench import DATA_DIR
from bench.sim.prefill import EngineConfig, SimRequest, fcfs_capacity, reusable_blocks
from bench.workloads.traces import MOONCAKE_BLOCK_TOKENS, TraceRequest
from controllers.profile import EngineProfile

Segment = tuple[int, int]  # (segment id, tokens)
SYSTEM_SEGMENT: Segment = (0, 64)


@dataclass(frozen=True)
class Workload:
    """A workload ready to simulate: requests, cache size, report keys, phases, notes.

    ``capacity_rps`` is the FCFS capacity the arrivals were scaled to (None for a trace
    replayed at its own rate). ``phases``: ``(name, start_s, end_s)`` arrival windows.
    ``warm``: block chains cached at t = 0.
    """

    name: str
    requests: list[SimRequest]
    block_size: int
    cache_blocks: int
    keys: tuple[str, ...]
    phases: tuple[tuple[str, float, float], ...] = ()
    capacity_rps: float | None = None
    notes: tuple[str, ...] = ()
    warm: tuple[tuple[int, ...], ...] = ()
    meta: dict[str, float | int | str] = field(default_factory=dict)


def block_hashes(segments: Sequence[Segment], block_size: int) -> tuple[int, ...]:
    """Chained hashes of the full blocks of a prompt made of ``segments``.

    Block ``i`` hashes ``(hash of block i-1, pieces)``, where pieces are the
    ``(segment id, start, end)`` token ranges it covers. Python's hash of int tuples is
    deterministic, so hashes are stable across processes.
    """
    out: list[int] = []
    parent = 0
    pieces: list[tuple[int, int, int]] = []
    filled = 0
    for seg_id, n in segments:
        off = 0
        while off < n:
            take = min(n - off, block_size - filled)
            pieces.append((seg_id, off, off + take))
            off += take
            filled += take
            if filled == block_size:
                parent = hash((parent, tuple(pieces)))
                out.append(parent)
                pieces, filled = [], 0
    return tuple(out)


class _Ids:
    """Fresh segment ids (unique content such as questions and miss documents)."""

    def __init__(self, start: int) -> None:
        self.next = start

    def __call__(self) -> int:
        self.next += 1
        return self.next


#: The SEC mix's defaults: reports in the corpus, and the share of prompts whose excerpts
#: come from one report (else two). ``sec-spike-paper`` fits both (:data:`SEC_SPIKE_CALIBRATED`).
SEC_N_REPORTS = 200
SEC_ONE_REPORT_SHARE = 0.6


class SecCorpus:
    """The SEC-like report corpus (see the module docstring for its numbers)."""

    def __init__(
        self,
        rng: np.random.Generator,
        n_reports: int = SEC_N_REPORTS,
        sections: int = 2,
        excerpts_per_section: int = 5,
        zipf_s: float = 1.1,
    ) -> None:
        self.n_reports = n_reports
        self.excerpts: list[list[list[Segment]]] = []  # [report][section] -> excerpts
        sid = 1_000
        for _ in range(n_reports):
            secs = []
            for _ in range(sections):
                ex = []
                for _ in range(excerpts_per_section):
                    ex.append((sid, int(rng.integers(500, 1501))))
                    sid += 1
                secs.append(ex)
            self.excerpts.append(secs)
        w = np.arange(1, n_reports + 1, dtype=np.float64) ** -zipf_s
        self.popularity = w / w.sum()

    def report(self, rng: np.random.Generator) -> int:
        return int(rng.choice(self.n_reports, p=self.popularity))

    def section(self, rng: np.random.Generator, report: int) -> list[Segment]:
        n = len(self.excerpts[report])
        if n == 1:
            return self.excerpts[report][0]
        p = [0.7] + [0.3 / (n - 1)] * (n - 1)
        return self.excerpts[report][int(rng.choice(n, p=p))]

    def full_text(self, report: int) -> list[Segment]:
        return [e for sec in self.excerpts[report] for e in sec]


def _question(rng: np.random.Generator, ids: _Ids, lo: int = 30, hi: int = 80) -> Segment:
    return (ids(), int(rng.integers(lo, hi + 1)))


def sec_prompt(
    corpus: SecCorpus,
    rng: np.random.Generator,
    ids: _Ids,
    one_report_share: float = SEC_ONE_REPORT_SHARE,
) -> list[Segment]:
    """A SEC-like RAG prompt: system prompt, 3-5 excerpts from one report (with probability
    ``one_report_share``) or two, question."""
    k = int(rng.integers(3, 6))
    a = corpus.report(rng)
    if rng.random() < one_report_share:
        exc = corpus.section(rng, a)[:k]
    else:
        b = corpus.report(rng)
        ka = math.ceil(k / 2)
        exc = corpus.section(rng, a)[:ka] + corpus.section(rng, b)[: k - ka]
    return [SYSTEM_SEGMENT, *exc, _question(rng, ids)]


def short_prompt(corpus: SecCorpus, rng: np.random.Generator, ids: _Ids) -> list[Segment]:
    """A 0.5-2k-token prompt: system prompt, one or two excerpts, a question."""
    a = corpus.report(rng)
    sec = corpus.section(rng, a)
    exc = sec[:1]
    if rng.random() < 0.5 and sum(t for _, t in sec[:2]) + 144 <= 2000:
        exc = sec[:2]
    return [SYSTEM_SEGMENT, *exc, _question(rng, ids)]


def long_prompt(corpus: SecCorpus, rng: np.random.Generator, ids: _Ids) -> list[Segment]:
    """Long-document QA: system prompt, one report's excerpts in order up to 8-16k tokens."""
    target = int(rng.integers(8_000, 16_001)) - SYSTEM_SEGMENT[1] - 80
    a = corpus.report(rng)
    out: list[Segment] = []
    total = 0
    for sid, n in corpus.full_text(a):
        if total + n > target:
            if target - total > 0:
                out.append((sid, target - total))
                total = target
            break
        out.append((sid, n))
        total += n
    return [SYSTEM_SEGMENT, *out, _question(rng, ids)]


PromptFn = Callable[[np.random.Generator, _Ids], tuple[list[Segment], tuple[str, ...]]]


def _sec_mix(corpus: SecCorpus, one_report_share: float = SEC_ONE_REPORT_SHARE) -> PromptFn:
    def f(rng: np.random.Generator, ids: _Ids) -> tuple[list[Segment], tuple[str, ...]]:
        segs = sec_prompt(corpus, rng, ids, one_report_share)
        return segs, ()

    return f


def _mixed_lengths(corpus: SecCorpus, long_share: float = 0.2) -> PromptFn:
    def f(rng: np.random.Generator, ids: _Ids) -> tuple[list[Segment], tuple[str, ...]]:
        if rng.random() < long_share:
            return long_prompt(corpus, rng, ids), ("long",)
        return short_prompt(corpus, rng, ids), ("short",)

    return f


@dataclass(frozen=True)
class _Prompt:
    tokens: int
    hashes: tuple[int, ...]
    labels: tuple[str, ...]


def _prompt_stream(fn: PromptFn, seed: int, n: int, block_size: int) -> list[_Prompt]:
    rng = np.random.default_rng([seed, 1])
    ids = _Ids(10_000_000)
    out = []
    for _ in range(n):
        segs, labels = fn(rng, ids)
        out.append(_Prompt(sum(t for _, t in segs), block_hashes(segs, block_size), labels))
    return out


def _poisson_times(
    phases: Sequence[tuple[str, float, float]], rate_rps: float, seed: int
) -> list[tuple[float, str]]:
    """Arrival times for ``(name, duration_s, load)`` phases at ``load * rate_rps``."""
    rng = np.random.default_rng([seed, 2])
    out: list[tuple[float, str]] = []
    t0 = 0.0
    for name, dur, load in phases:
        lam = load * rate_rps
        t = t0
        while True:
            t += float(rng.exponential(1.0 / lam))
            if t >= t0 + dur:
                break
            out.append((t, name))
        t0 += dur
    return out


def _to_requests(times: list[tuple[float, str]], prompts: list[_Prompt]) -> list[SimRequest]:
    return [
        SimRequest(f"r{k}", t, p.tokens, p.hashes, (ph, *p.labels) if ph else p.labels)
        for k, ((t, ph), p) in enumerate(zip(times, prompts, strict=False))
    ]


def _phase_windows(
    phases: Sequence[tuple[str, float, float]],
) -> tuple[tuple[str, float, float], ...]:
    out, t = [], 0.0
    for name, dur, _ in phases:
        out.append((name, t, t + dur))
        t += dur
    return tuple(out)


def _min_cache(prompts: Sequence[_Prompt], block_size: int) -> int:
    # Room for the largest prompts in flight: four of the longest at once.
    biggest = max(-(-p.tokens // block_size) for p in prompts)
    return 4 * biggest


def phased_workload(
    name: str,
    fn: PromptFn,
    phases: Sequence[tuple[str, float, float]],
    *,
    seed: int,
    profile: EngineProfile,
    cache_fraction: float,
    load_scale: float = 1.0,
    block_size: int | None = None,
    keys: tuple[str, ...] = (),
    capacity_sample: int = 400,
) -> Workload:
    """Poisson arrivals over load phases, scaled to FCFS's capacity (two-pass, see module)."""
    bs = block_size or profile.block_size
    cfg = EngineConfig(token_budget=profile.token_budget, block_size=bs)
    phases = [(n, d, load * load_scale) for n, d, load in phases]
    sample = _prompt_stream(fn, seed + 7919, capacity_sample, bs)
    mix = [SimRequest(f"m{k}", 0.0, p.tokens, p.hashes) for k, p in enumerate(sample)]
    floor = _min_cache(sample, bs)
    cache0 = max(floor, int(cache_fraction * reusable_blocks(mix)))
    cap0 = fcfs_capacity(mix, profile, cache0, cfg)
    expected = int(sum(d * load for _, d, load in phases) * cap0 * 1.5) + 100
    prompts = _prompt_stream(fn, seed, expected, bs)
    reqs0 = _to_requests(_poisson_times(phases, cap0, seed), prompts)
    cache = max(floor, int(cache_fraction * reusable_blocks(reqs0)))
    cap = fcfs_capacity(mix, profile, cache, cfg)
    times = _poisson_times(phases, cap, seed)
    if len(times) > len(prompts):
        prompts = _prompt_stream(fn, seed, len(times) + 100, bs)
    reqs = _to_requests(times, prompts)
    reuse = reusable_blocks(reqs)
    notes = (
        f"capacity (FCFS saturated, {capacity_sample}-prompt mix, this cache) = {cap:.3f} req/s",
        f"KV cache {cache} blocks of {bs} = {cache / max(1, reuse):.2f} of the trace's reusable "
        f"content ({reuse} blocks referenced >= 2 times)",
    )
    return Workload(
        name,
        reqs,
        bs,
        cache,
        keys,
        _phase_windows(phases),
        cap,
        notes,
        meta={"cache_fraction": cache_fraction, "reusable_blocks": reuse},
    )


# -- the scenarios ---------------------------------------------------------------------


@dataclass(frozen=True)
class ScenarioSpec:
    """A named scenario: ``build(seed, quick, profile, load, cache_fraction) -> Workload``.

    ``load`` multiplies every phase's load (1.0 = as documented); ``cache_fraction`` is
    None for the scenario's default.
    """

    name: str
    description: str
    build: Callable[[int, bool, EngineProfile, float, float | None], Workload]


SEC_SPIKE_PHASES = [("calm", 120.0, 0.5), ("burst", 120.0, 0.9), ("spike", 60.0, 1.75)]

#: ``sec-spike-paper``: the sec-spike workload with its free parameters fitted so that the
#: baselines (FCFS, LPM, RAGCache; never Fairway) land in the Fairway paper's published
#: ranges on calibration seeds 1 and 2 (``pdserve sim fidelity --calibrate``; the grid, the
#: targets and the log are in :mod:`bench.sim.fidelity` and ``docs/fidelity.md``).
SEC_SPIKE_CALIBRATED: dict[str, float] = {
    "burst_load": 0.8,
    "spike_load": 1.2,
    "zipf_s": 1.7,
    "cache_fraction": 0.33,
    "one_report_share": 0.6,
    "n_reports": 50,
}
#: ``flood-paper``: the flood with its backlog and flood load fitted the same way (FCFS,
#: LPM, RAGCache, PEEK on the paper's flood figures).
FLOOD_CALIBRATED: dict[str, float] = {"backlog": 16, "flood_load": 1.5}


def sec_spike_workload(
    seed: int,
    quick: bool,
    profile: EngineProfile,
    *,
    burst_load: float = 0.9,
    spike_load: float = 1.75,
    zipf_s: float = 1.1,
    cache_fraction: float = 0.3,
    load: float = 1.0,
    variant: str = "drain",
    name: str | None = None,
    one_report_share: float = SEC_ONE_REPORT_SHARE,
    n_reports: int = SEC_N_REPORTS,
) -> Workload:
    """The sec-spike scenario with its free parameters open (module docstring): the burst
    and spike loads (x FCFS capacity), the reports' Zipf exponent, the cache fraction, the
    share of prompts drawing on one report (else two) and the number of reports."""
    phases = [("calm", 120.0, 0.5), ("burst", 120.0, burst_load), ("spike", 60.0, spike_load)]
    if variant == "continued":
        phases.append(("after", 120.0, 0.5))
    if quick:
        phases = [(n, d / 4, x) for n, d, x in phases]
    corpus = SecCorpus(np.random.default_rng([seed, 0]), n_reports=n_reports, zipf_s=zipf_s)
    keys = ("calm", "burst", "spike") + (("after",) if variant == "continued" else ())
    return phased_workload(
        name or f"sec-spike-{variant}",
        _sec_mix(corpus, one_report_share),
        phases,
        seed=seed,
        profile=profile,
        cache_fraction=cache_fraction,
        load_scale=load,
        capacity_sample=200 if quick else 400,
        keys=keys,
    )


def _sec_spike(variant: str) -> Callable[[int, bool, EngineProfile, float, float | None], Workload]:
    def build(
        seed: int, quick: bool, profile: EngineProfile, load: float, frac: float | None
    ) -> Workload:
        burst, spike = SEC_SPIKE_PHASES[1][2], SEC_SPIKE_PHASES[2][2]
        return sec_spike_workload(
            seed,
            quick,
            profile,
            burst_load=burst,
            spike_load=spike,
            cache_fraction=frac if frac is not None else 0.3,
            load=load,
            variant=variant,
        )

    return build


def sec_spike_paper_workload(
    seed: int,
    quick: bool,
    profile: EngineProfile,
    params: dict[str, float],
    load: float = 1.0,
    cache_fraction: float | None = None,
) -> Workload:
    """``sec-spike-paper`` at ``params`` (:data:`SEC_SPIKE_CALIBRATED`'s keys; the
    calibration tries others); ``cache_fraction`` overrides the fitted one."""
    return sec_spike_workload(
        seed,
        quick,
        profile,
        burst_load=float(params["burst_load"]),
        spike_load=float(params["spike_load"]),
        zipf_s=float(params["zipf_s"]),
        cache_fraction=float(
            cache_fraction if cache_fraction is not None else params["cache_fraction"]
        ),
        load=load,
        name="sec-spike-paper",
        one_report_share=float(params["one_report_share"]),
        n_reports=int(params["n_reports"]),
    )


def _sec_spike_paper(
    seed: int, quick: bool, profile: EngineProfile, load: float, frac: float | None
) -> Workload:
    return sec_spike_paper_workload(seed, quick, profile, SEC_SPIKE_CALIBRATED, load, frac)


def _long_prompts(
    seed: int, quick: bool, profile: EngineProfile, load: float, frac: float | None
) -> Workload:
    phases = [("calm", 120.0, 0.6), ("burst", 120.0, 1.2)]
    if quick:
        phases = [(n, d / 4, x) for n, d, x in phases]
    corpus = SecCorpus(np.random.default_rng([seed, 0]), sections=4, excerpts_per_section=4)
    return phased_workload(
        "long-prompts",
        _mixed_lengths(corpus),
        phases,
        seed=seed,
        profile=profile,
        cache_fraction=frac if frac is not None else 0.3,
        load_scale=load,
        capacity_sample=200 if quick else 400,
        keys=("short", "long", "calm", "burst"),
    )


def _grid_cell(
    mix: str, grid_load: float, grid_cache: float
) -> Callable[[int, bool, EngineProfile, float, float | None], Workload]:
    def build(
        seed: int, quick: bool, profile: EngineProfile, load: float, frac: float | None
    ) -> Workload:
        dur = 60.0 if quick else 240.0
        keys: tuple[str, ...] = ()
        if mix == "sec":
            corpus = SecCorpus(np.random.default_rng([seed, 0]))
            fn = _sec_mix(corpus)
        else:
            corpus = SecCorpus(np.random.default_rng([seed, 0]), sections=4, excerpts_per_section=4)
            fn, keys = _mixed_lengths(corpus), ("short", "long")
        return phased_workload(
            f"grid-{mix}-l{grid_load}-c{grid_cache}",
            fn,
            [("", dur, grid_load)],
            seed=seed,
            profile=profile,
            cache_fraction=frac if frac is not None else grid_cache,
            load_scale=load,
            capacity_sample=200 if quick else 400,
            keys=keys,
        )

    return build


def flood_workload(
    seed: int,
    quick: bool,
    profile: EngineProfile,
    load: float = 1.0,
    frac: float | None = None,
    backlog: int = 20,
    n_docs: int = 8,
    flood_s: float = 60.0,
    flood_load: float = 2.0,
    name: str = "flood",
) -> Workload:
    """The flood stress test (see the module docstring)."""
    bs = profile.block_size
    cfg = EngineConfig(token_budget=profile.token_budget, block_size=bs)
    rng = np.random.default_rng([seed, 0])
    ids = _Ids(10_000_000)
    if quick:
        backlog, flood_s = max(4, backlog // 2), flood_s / 4
    docs = [[SYSTEM_SEGMENT, (100 + d, int(rng.integers(3000, 5001)))] for d in range(n_docs)]
    doc_w = np.arange(1, n_docs + 1, dtype=np.float64) ** -1.0
    doc_p = doc_w / doc_w.sum()

    def flood_prompt(r: np.random.Generator) -> list[Segment]:
        d = docs[int(r.choice(n_docs, p=doc_p))]
        return [*d, _question(r, ids, 50, 300)]

    def to_req(rid: str, t: float, segs: list[Segment], labels: tuple[str, ...]) -> SimRequest:
        return SimRequest(rid, t, sum(n for _, n in segs), block_hashes(segs, bs), labels)

    warm = tuple(block_hashes(d, bs) for d in docs)
    doc_blocks = sum(len(w) for w in warm)
    srng = np.random.default_rng([seed, 3])
    sample = [to_req(f"m{k}", 0.0, flood_prompt(srng), ()) for k in range(300)]
    backlog_reqs = [
        to_req(f"b{k}", 0.0, [(ids(), int(rng.integers(4000, 8001)))], ("backlog",))
        for k in range(backlog)
    ]
    cache = 2 * doc_blocks + 4 * max(-(-r.prompt_tokens // bs) for r in backlog_reqs)
    cap = fcfs_capacity(sample, profile, cache, cfg, warm=warm)
    frng = np.random.default_rng([seed, 4])
    times = _poisson_times([("flood", flood_s, flood_load * load)], cap, seed)
    flood = [
        to_req(f"f{k}", 0.5 + t, flood_prompt(frng), ("flood",)) for k, (t, _) in enumerate(times)
    ]
    notes = (
        f"capacity (FCFS saturated on the flood mix, documents cached) = {cap:.2f} req/s",
        f"{backlog} backlog misses ({sum(r.prompt_tokens for r in backlog_reqs)} tokens) at t=0; "
        f"{len(flood)} flood requests over {flood_s:.0f} s from t=0.5 s at "
        f"{flood_load * load:.2f} x capacity",
        f"KV cache {cache} blocks of {bs} (the {n_docs} documents take {doc_blocks}); "
        "--cache-fraction does not apply",
    )
    return Workload(
        name,
        backlog_reqs + flood,
        bs,
        cache,
        ("backlog", "flood"),
        (("flood", 0.5, 0.5 + flood_s),),
        cap,
        notes,
        warm,
    )


def _flood(
    seed: int, quick: bool, profile: EngineProfile, load: float, frac: float | None
) -> Workload:
    return flood_workload(seed, quick, profile, load, frac)


def flood_paper_workload(
    seed: int, quick: bool, profile: EngineProfile, params: dict[str, float], load: float = 1.0
) -> Workload:
    """``flood-paper`` at ``params`` (:data:`FLOOD_CALIBRATED`'s keys)."""
    return flood_workload(
        seed,
        quick,
        profile,
        load,
        backlog=int(params["backlog"]),
        flood_load=float(params["flood_load"]),
        name="flood-paper",
    )


def _flood_paper(
    seed: int, quick: bool, profile: EngineProfile, load: float, frac: float | None
) -> Workload:
    return flood_paper_workload(seed, quick, profile, FLOOD_CALIBRATED, load)


# -- traces ----------------------------------------------------------------------------


def trace_workload(
    name: str,
    trace: Sequence[TraceRequest],
    profile: EngineProfile,
    *,
    block_size: int,
    load: float | None,
    cache_fraction: float,
    max_context: int = 32_768,
    capacity_sample: int = 300,
    cache_free: bool = False,
) -> Workload:
    """Replay a trace: cap prompts at ``max_context``, size the cache, scale arrivals.

    Hash ids are taken as full-block hashes at ``block_size`` (Mooncake: 512); a prompt
    keeps ``prompt // block_size`` of them. ``load`` rescales arrival times so the offered
    load is ``load`` x FCFS's capacity on the trace's mix (the first ``capacity_sample``
    requests at t = 0); None replays at the trace's own times. Cache-free traces (no hash
    ids, e.g. Azure) get unique content per request.
    """
    if not trace:
        raise ValueError(f"{name}: empty trace")
    capped = 0
    reqs: list[SimRequest] = []
    for k, r in enumerate(trace):
        n = r.input_tokens
        if n > max_context:
            n = max_context
            capped += 1
        hashes = () if cache_free else tuple(r.hash_ids[: n // block_size])
        reqs.append(SimRequest(f"t{k}", r.arrival_s, n, hashes))
    reuse = reusable_blocks(reqs)
    floor = 4 * max(-(-r.prompt_tokens // block_size) for r in reqs)
    cache = max(floor, int(cache_fraction * reuse))
    cfg = EngineConfig(token_budget=profile.token_budget, block_size=block_size)
    notes = [
        f"{capped} of {len(reqs)} prompts longer than the modelled context ({max_context}) capped",
        (
            f"KV cache {cache} blocks of {block_size} = {cache / reuse:.2f} of reusable "
            f"content ({reuse} blocks referenced >= 2 times)"
            if reuse
            else f"KV cache {cache} blocks of {block_size}; no reusable content"
        )
        + (" (floor: room for 4 of the longest prompts)" if cache == floor else ""),
    ]
    if cache_free:
        notes.append("replayed cache-free: the trace carries lengths only")
    cap = None
    if load is not None:
        cap = fcfs_capacity(reqs[:capacity_sample], profile, cache, cfg)
        span = reqs[-1].arrival_s - reqs[0].arrival_s
        natural = (len(reqs) - 1) / span if span > 0 else float("inf")
        factor = natural / (load * cap)
        reqs = [
            SimRequest(r.request_id, r.arrival_s * factor, r.prompt_tokens, r.block_hashes)
            for r in reqs
        ]
        notes.append(
            f"capacity {cap:.3f} req/s; trace rate {natural:.3f} req/s; arrival times x "
            f"{factor:.3f} for load {load}"
        )
    return Workload(
        name,
        reqs,
        block_size,
        cache,
        (),
        (),
        cap,
        tuple(notes),
        meta={"capped": capped, "reusable_blocks": reuse},
    )


def mooncake_workload(
    trace: Sequence[TraceRequest],
    profile: EngineProfile,
    *,
    load: float | None = 0.9,
    cache_fraction: float = 0.3,
    max_context: int = 32_768,
) -> Workload:
    """A Mooncake trace at 512-token blocks (its hash ids' block size)."""
    return trace_workload(
        "mooncake",
        trace,
        profile,
        block_size=MOONCAKE_BLOCK_TOKENS,
        load=load,
        cache_fraction=cache_fraction,
        max_context=max_context,
    )


def azure_workload(
    trace: Sequence[TraceRequest],
    profile: EngineProfile,
    *,
    load: float | None = 0.9,
    max_context: int = 32_768,
) -> Workload:
    """An Azure trace, cache-free (lengths only)."""
    return trace_workload(
        "azure",
        trace,
        profile,
        block_size=profile.block_size,
        load=load,
        cache_fraction=0.0,
        max_context=max_context,
        cache_free=True,
    )


MUSIQUE_FILE = DATA_DIR / "musique" / "musique_tokens.json"


def musique_workload(
    seed: int,
    quick: bool,
    profile: EngineProfile,
    load: float = 1.0,
    frac: float | None = None,
) -> Workload:
    """MuSiQue RAG prompts: the system prompt, a question's 10 passages, the question.

    Token counts come from the project's tokenizer (``bench/data/musique``). Passages
    are put in one global order (most-referenced first, then by id), so passages shared
    between questions form shared prefixes; questions are drawn uniformly with
    replacement, so a repeated question is a full hit. Phases: 120 s at 0.6, 120 s at 1.2.
    """
    data = json.loads(MUSIQUE_FILE.read_text(encoding="utf-8"))
    passages: list[int] = data["passage_tokens"]
    qs: list[dict[str, object]] = data["questions"]
    refs = np.zeros(len(passages), dtype=np.int64)
    for q in qs:
        for p in q["passages"]:  # type: ignore[attr-defined]
            refs[int(p)] += 1
    rank = {p: (-int(refs[p]), p) for p in range(len(passages))}

    def fn(rng: np.random.Generator, ids: _Ids) -> tuple[list[Segment], tuple[str, ...]]:
        qi = int(rng.integers(len(qs)))
        q = qs[qi]
        ps = sorted((int(p) for p in q["passages"]), key=lambda p: rank[p])  # type: ignore[attr-defined]
        segs = [SYSTEM_SEGMENT, *[(1_000 + p, passages[p]) for p in ps]]
        segs.append((5_000_000 + qi, int(q["question_tokens"])))  # type: ignore[call-overload]
        return segs, ()

    phases = [("calm", 120.0, 0.6), ("burst", 120.0, 1.2)]
    if quick:
        phases = [(n, d / 4, x) for n, d, x in phases]
    return phased_workload(
        "musique",
        fn,
        phases,
        seed=seed,
        profile=profile,
        cache_fraction=frac if frac is not None else 0.3,
        load_scale=load,
        capacity_sample=200 if quick else 400,
        keys=("calm", "burst"),
    )


GRID_LOADS = (0.7, 0.9, 1.1)
GRID_MIXES = ("sec", "mixed")
GRID_CACHES = (0.25, 0.5)


def _registry() -> dict[str, ScenarioSpec]:
    out = {
        "sec-spike": ScenarioSpec(
            "sec-spike",
            "SEC-like RAG: calm 0.5x, burst 0.9x, 60 s spike 1.75x, then a drain",
            _sec_spike("drain"),
        ),
        "sec-spike-continued": ScenarioSpec(
            "sec-spike-continued",
            "sec-spike followed by 120 s more at 0.5x instead of a drain",
            _sec_spike("continued"),
        ),
        "sec-spike-paper": ScenarioSpec(
            "sec-spike-paper",
            "sec-spike with its loads, popularity and cache fitted to the paper's baselines",
            _sec_spike_paper,
        ),
        "flood-paper": ScenarioSpec(
            "flood-paper",
            "flood with its backlog and load fitted to the paper's baselines",
            _flood_paper,
        ),
        "flood": ScenarioSpec(
            "flood",
            "20 misses of 4-8k tokens at t=0, then >=90%-cached requests at 2x capacity for 60 s",
            _flood,
        ),
        "long-prompts": ScenarioSpec(
            "long-prompts",
            "20% of prompts 8-16k tokens, the rest 0.5-2k; 120 s at 0.6x, 120 s at 1.2x",
            _long_prompts,
        ),
        "musique": ScenarioSpec(
            "musique",
            "MuSiQue RAG prompts (passages reused across questions); 120 s 0.6x, 120 s 1.2x",
            musique_workload,
        ),
    }
    for mix in GRID_MIXES:
        for ld in GRID_LOADS:
            for c in GRID_CACHES:
                name = f"grid-{mix}-l{ld}-c{c}"
                out[name] = ScenarioSpec(
                    name,
                    f"steady {ld}x load, {mix} prompts, cache {c} of reusable content, 240 s",
                    _grid_cell(mix, ld, c),
                )
    return out


SCENARIOS: dict[str, ScenarioSpec] = _registry()
GRID_SCENARIOS: tuple[str, ...] = tuple(n for n in SCENARIOS if n.startswith("grid-"))


def build_scenario(
    name: str,
    *,
    seed: int = 0,
    quick: bool = False,
    profile: EngineProfile,
    load: float = 1.0,
    cache_fraction: float | None = None,
) -> Workload:
    """Build a named scenario; an unknown name is an error listing the known ones."""
    try:
        spec = SCENARIOS[name]
    except KeyError:
        raise ValueError(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}") from None
    if load <= 0:
        raise ValueError(f"load must be > 0, got {load}")
    if cache_fraction is not None and not 0 < cache_fraction <= 10:
        raise ValueError(f"cache_fraction must be in (0, 10], got {cache_fraction}")
    return spec.build(seed, quick, profile, load, cache_fraction)


def write_musique_tokens(src: str | Path, out: str | Path = MUSIQUE_FILE) -> Path:
    """Build ``bench/data/musique/musique_tokens.json`` from CacheBlend's ``musique_s.json``.

    Keeps token counts only (the project's tokenizer): the distinct passages (``title. text``)
    in order of first appearance, and per question its passage indices and question tokens.
    """
    from bench.workloads.tokenizer import count_tokens_batch

    data = json.loads(Path(src).read_text(encoding="utf-8"))
    index: dict[str, int] = {}
    texts: list[str] = []
    questions = []
    for q in data:
        ps = []
        for c in q["ctxs"]:
            t = f"{c['title']}. {c['text']}"
            if t not in index:
                index[t] = len(texts)
                texts.append(t)
            ps.append(index[t])
        questions.append({"passages": ps, "question": q["question"]})
    p_tok = count_tokens_batch(texts)
    q_tok = count_tokens_batch([q["question"] for q in questions])
    doc = {
        "source": "YaoJiayi/CacheBlend inputs/musique_s.json (MuSiQue, CC-BY-4.0)",
        "tokenizer": "bench/data/tokenizer/tokenizer.json",
        "passage_tokens": p_tok,
        "questions": [
            {"passages": q["passages"], "question_tokens": n}
            for q, n in zip(questions, q_tok, strict=True)
        ],
    }
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, separators=(",", ":")) + "\n", encoding="utf-8")
    return path
