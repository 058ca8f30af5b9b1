"""Workloads of the decode simulator (TWP paper §VI; issue #5).

Every generator returns a list of :class:`DecodeRequest`, sorted by arrival, deterministic
for a seed.

- ``paper``: Poisson arrivals at 18 req/s for 60 s; prompt lengths 60% short (30-80
  tokens), 30% medium (120-250), 10% long (350-512). Texts come from the GSM8K test split
  (``bench/data/gsm8k``): a short prompt is one question of that length; GSM8K questions
  run to ~180 tokens, so medium and long prompts are few-shot prompts (``"Question: ...
  Answer: ..."`` pairs of other rows, then the question), as GSM8K is commonly prompted.
  The output length is the token count of the target question's answer. Token counts use
  the project's tokenizer (:func:`bench.workloads.tokenizer.count_tokens`).
- ``low`` / ``medium`` / ``high`` / ``burst``: prompts {50, 200, 800} and outputs
  {20, 50, 200} tokens, each drawn independently with probabilities {0.5, 0.3, 0.2};
  Poisson arrivals at 0.3 / 0.6 / 0.9 x a reference rate (the simulator passes FCFS's
  saturated rate), ``burst`` at 0.5 x with bursts at 2x the base rate for 10 s in every
  30 s.
- :func:`from_trace`: Azure / Mooncake traces (:mod:`bench.workloads.traces`), arrivals rescaled so
  the mean rate is a given target.

Choices: 4 tenants (``t0``-``t3``) drawn uniformly per request with the same mix (the
per-tenant medians of TWP then each see a quarter of the traffic); ``max_tokens`` is the
request's true output length rounded up to the next multiple of 64, at least 256 (a
client cap, not an oracle: ``L_hat`` is the median, capped by it).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from bench import DATA_DIR
from bench.workloads.tokenizer import count_tokens, count_tokens_batch
from bench.workloads.traces import TraceRequest

GSM8K_FILE = DATA_DIR / "gsm8k" / "test.jsonl"
SCENARIOS = ("paper", "low", "medium", "high", "burst")
SYNTHETIC_LOAD = {"low": 0.3, "medium": 0.6, "high": 0.9, "burst": 0.5}
N_TENANTS = 4
BURST_PERIOD_S = 30.0
BURST_LEN_S = 10.0
BURST_FACTOR = 2.0


@dataclass(frozen=True, slots=True)
class DecodeRequest:
    """One request: arrival (s), prompt and true output lengths (tokens), client cap, tenant."""

    request_id: str
    tenant: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    max_tokens: int


def _max_tokens(out: int) -> int:
    return max(256, -(-out // 64) * 64)


def _tenants(rng: np.random.Generator, n: int) -> list[str]:
    return [f"t{i}" for i in rng.integers(0, N_TENANTS, n)]


def poisson_arrivals(rng: np.random.Generator, rate: float, duration_s: float) -> list[float]:
    """Homogeneous Poisson arrival times in ``[0, duration_s)`` at ``rate`` per second."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    out: list[float] = []
    t = float(rng.exponential(1.0 / rate))
    while t < duration_s:
        out.append(t)
        t += float(rng.exponential(1.0 / rate))
    return out


def burst_arrivals(rng: np.random.Generator, rate: float, duration_s: float) -> list[float]:
    """Poisson at ``rate``, at ``BURST_FACTOR x rate`` in the last 10 s of every 30 s (thinning)."""
    peak = rate * BURST_FACTOR
    out = []
    for t in poisson_arrivals(rng, peak, duration_s):
        in_burst = (t % BURST_PERIOD_S) >= BURST_PERIOD_S - BURST_LEN_S
        if in_burst or rng.random() < 1.0 / BURST_FACTOR:
            out.append(t)
    return out


def synthetic(
    scenario: str, ref_rate: float, seed: int, duration_s: float = 60.0
) -> list[DecodeRequest]:
    """The ``low``/``medium``/``high``/``burst`` mixes at ``SYNTHETIC_LOAD[scenario] * ref_rate``."""
    if scenario not in SYNTHETIC_LOAD:
        raise ValueError(f"unknown synthetic scenario {scenario!r}; known: {list(SYNTHETIC_LOAD)}")
    rng = np.random.default_rng(seed)
    rate = SYNTHETIC_LOAD[scenario] * ref_rate
    gen = burst_arrivals if scenario == "burst" else poisson_arrivals
    times = gen(rng, rate, duration_s)
    n = len(times)
    probs = [0.5, 0.3, 0.2]
    prompts = rng.choice([50, 200, 800], size=n, p=probs)
    outs = rng.choice([20, 50, 200], size=n, p=probs)
    tenants = _tenants(rng, n)
    return [
        DecodeRequest(
            f"{scenario}-{i}",
            tenants[i],
            t,
            int(prompts[i]),
            int(outs[i]),
            _max_tokens(int(outs[i])),
        )
        for i, t in enumerate(times)
    ]


@lru_cache(maxsize=2)
def _gsm8k(
    path: str,
) -> tuple[tuple[str, ...], tuple[str, ...], np.ndarray, np.ndarray, np.ndarray]:
    rows = [
        json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line
    ]
    qs = tuple(str(r["question"]) for r in rows)
    ans = tuple(str(r["answer"]) for r in rows)
    q_tok = np.array(count_tokens_batch([f"Question: {q}\nAnswer:" for q in qs]))
    a_tok = np.array(count_tokens_batch(list(ans)))
    pair_tok = np.array(
        count_tokens_batch(
            [f"Question: {q}\nAnswer: {a}\n\n" for q, a in zip(qs, ans, strict=True)]
        )
    )
    return qs, ans, q_tok, a_tok, pair_tok


PAPER_CLASSES = ((0.6, 30, 80), (0.3, 120, 250), (0.1, 350, 512))


def few_shot_prompt(
    rng: np.random.Generator, target: int, lo: int, hi: int, path: Path = GSM8K_FILE
) -> tuple[str, int]:
    """A GSM8K prompt of ``lo..hi`` tokens: few-shot pairs, then question ``target``.

    Exemplar pairs are drawn at random (not the target) and added while the estimated
    length stays within ``hi``; tried up to 64 times to land in ``[lo, hi]``, then the
    closest attempt is kept. Returns the text and its exact token count.
    """
    qs, ans, q_tok, _, pair_tok = _gsm8k(str(path))
    best: tuple[int, list[int]] = (10**9, [])
    for _ in range(64):
        goal = int(rng.integers(lo, hi + 1))
        total, shots = int(q_tok[target]), []
        for j in rng.permutation(len(qs)):
            if j == target:
                continue
            if total + pair_tok[j] <= goal:
                shots.append(int(j))
                total += int(pair_tok[j])
            if total >= lo and total >= goal - 20:
                break
        miss = 0 if lo <= total <= hi else min(abs(total - lo), abs(total - hi))
        if miss < best[0]:
            best = (miss, shots)
        if miss == 0:
            break
    text = "".join(f"Question: {qs[j]}\nAnswer: {ans[j]}\n\n" for j in best[1])
    text += f"Question: {qs[target]}\nAnswer:"
    return text, count_tokens(text)


def paper(
    seed: int, rate: float = 18.0, duration_s: float = 60.0, path: Path = GSM8K_FILE
) -> list[DecodeRequest]:
    """The paper's workload: Poisson ``rate`` for ``duration_s``, GSM8K prompt classes."""
    rng = np.random.default_rng(seed)
    qs, _, q_tok, a_tok, _ = _gsm8k(str(path))
    times = poisson_arrivals(rng, rate, duration_s)
    tenants = _tenants(rng, len(times))
    short = np.flatnonzero((q_tok >= 30) & (q_tok <= 80))
    weights = [c[0] for c in PAPER_CLASSES]
    out = []
    for i, t in enumerate(times):
        cls = int(rng.choice(len(PAPER_CLASSES), p=weights))
        _, lo, hi = PAPER_CLASSES[cls]
        if cls == 0:
            target = int(rng.choice(short))
            prompt = int(q_tok[target])
        else:
            target = int(rng.integers(0, len(qs)))
            _, prompt = few_shot_prompt(rng, target, lo, hi, path)
        o = int(a_tok[target])
        out.append(DecodeRequest(f"paper-{i}", tenants[i], t, prompt, o, _max_tokens(o)))
    return out


def from_trace(
    trace: Sequence[TraceRequest], target_rate: float | None, seed: int, name: str = "trace"
) -> list[DecodeRequest]:
    """Trace records as requests; arrivals scaled so the mean rate is ``target_rate`` (if given)."""
    if not trace:
        return []
    span = trace[-1].arrival_s - trace[0].arrival_s
    factor = 1.0
    if target_rate is not None and span > 0:
        factor = (len(trace) - 1) / span / target_rate
    rng = np.random.default_rng(seed)
    tenants = _tenants(rng, len(trace))
    t0 = trace[0].arrival_s
    return [
        DecodeRequest(
            f"{name}-{i}",
            tenants[i],
            (r.arrival_s - t0) * factor,
            max(1, r.input_tokens),
            max(1, r.output_tokens),
            _max_tokens(max(1, r.output_tokens)),
        )
        for i, r in enumerate(trace)
    ]


def mean_output(reqs: Sequence[DecodeRequest]) -> float:
    return float(np.mean([r.output_tokens for r in reqs])) if reqs else 0.0
