"""The workload of a live replay (``pdserve bench live``, ``pdserve bench compare``): a trace or
a scenario as requests in token ids, shaped to a run, and :class:`ReplayWorkload`, the one
definition of its parameters (every command's options come from its fields).

Prompts are token ids, so shared prefixes stay shared and every count is exact:

- **Mooncake** traces (``hash_ids``, one per 512-token block): each ``hash_id`` becomes a
  fixed run of 512 token ids drawn from a generator seeded by ``(seed, hash_id)``, so two
  requests that share a hash id share those 512 tokens at that position (the last, partial
  block takes the first tokens of its run). Output lengths come from the trace.
- **Azure** traces carry lengths only: each prompt is its own ids (no shared prefixes).
- **Scenarios**: ``rag`` (the shared-document RAG mix of ``pdserve bench routing``,
  :mod:`bench.workloads.rag`) and every prefill-simulator scenario (``sec-spike``, ``flood``,
  ``musique``, ``long-prompts``, the grid: :data:`bench.workloads.prefill_scenarios.SCENARIOS`).
  Their chained block hashes become fixed runs of ``block_size`` ids the same way (equal hash,
  equal prefix); the partial last block is the request's own. They carry no output lengths:
  ``max_tokens`` each.

Shaping a long trace to a small machine: ``limit`` keeps the first requests; ``time_scale``
multiplies arrival offsets (``2``: half the rate); ``length_scale`` multiplies prompt and output
lengths (a prompt keeps its prefix, so sharing survives); ``rate`` replaces the arrivals with a
seeded Poisson process; ``concurrency`` replays closed-loop instead (that many clients, each
sending its next request when the last one ends). Prompts longer than the endpoint's
``max_model_len`` (from ``/v1/models`` when it says) less their output are cut to fit, keeping
the prefix, and counted.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from bench.workloads.traces import MOONCAKE_BLOCK_TOKENS, TraceRequest, load_azure, load_mooncake

TRACE_FORMATS = ("mooncake", "azure")


#: Token ids drawn for synthetic prompts: above the special tokens of small vocabularies.
LOW_ID = 10


@dataclass(frozen=True)
class LiveRequest:
    """One request to send: its offset from the start (s), prompt ids and output length."""

    at_s: float
    ids: tuple[int, ...]
    max_tokens: int
    label: str = ""
    #: the prompt as text, sent instead of ``ids`` when set (for endpoints that route on text)
    text: str | None = None
    #: API key this request is sent with (its tenant's), instead of the replay's one key
    key: str | None = None


def block_run(key: int, n: int, vocab: int, seed: int) -> list[int]:
    """The fixed run of ``n`` token ids standing for block ``key`` (seeded by seed and key)."""
    rng = random.Random(f"{seed}:{key}")
    return [rng.randrange(LOW_ID, vocab) for _ in range(n)]


def prompt_from_blocks(
    block_keys: Sequence[int],
    block_tokens: int,
    total: int,
    vocab: int,
    seed: int,
    own: int,
) -> tuple[int, ...]:
    """``total`` ids: one run of ``block_tokens`` per block key (the last cut short), then
    ids of the request's own (``own`` seeds them) for whatever the blocks do not cover."""
    ids: list[int] = []
    for k in block_keys:
        if len(ids) >= total:
            break
        ids += block_run(k, block_tokens, vocab, seed)[: total - len(ids)]
    if len(ids) < total:
        rng = random.Random(f"{seed}:own:{own}")
        ids += [rng.randrange(LOW_ID, vocab) for _ in range(total - len(ids))]
    return tuple(ids)


def trace_requests(reqs: Sequence[TraceRequest], vocab: int, seed: int = 0) -> list[LiveRequest]:
    """Mooncake or Azure records as prompts (see the module docstring)."""
    return [
        LiveRequest(
            r.arrival_s,
            prompt_from_blocks(r.hash_ids, MOONCAKE_BLOCK_TOKENS, r.input_tokens, vocab, seed, i),
            max(1, r.output_tokens),
        )
        for i, r in enumerate(reqs)
    ]


def scenario_requests(
    name: str, vocab: int, seed: int = 0, max_tokens: int = 16, quick: bool = False
) -> list[LiveRequest]:
    """A named scenario as prompts: ``rag``, or a prefill-simulator scenario (its arrivals at
    the profile's capacity: shape them with ``time_scale``)."""
    if name == "rag":
        from bench.workloads.rag import RagMix, rag_mix

        mix = RagMix(seed=seed, max_tokens=max_tokens)
        return [
            LiveRequest(a.at_s, tuple(a.ids), max_tokens, f"doc{a.doc}")
            for a in rag_mix(mix, vocab)
        ]
    from bench.workloads.prefill_scenarios import SCENARIOS, build_scenario
    from engines.profile_store import load_profile

    if name not in SCENARIOS:
        known = ", ".join(["rag", *sorted(n for n in SCENARIOS if not n.startswith("grid-"))])
        raise ValueError(f"unknown scenario {name!r}; known: {known} (and the grid-* cells)")
    wl = build_scenario(
        name, seed=seed, quick=quick, profile=load_profile("cpu2core_vllm032_bench")
    )
    return [
        LiveRequest(
            r.arrival_s,
            prompt_from_blocks(r.block_hashes, wl.block_size, r.prompt_tokens, vocab, seed, i),
            max_tokens,
            ",".join(r.labels),
        )
        for i, r in enumerate(wl.requests)
    ]


def load_trace(path: str | Path, fmt: str, limit: int | None = None) -> list[TraceRequest]:
    """A trace file in ``fmt`` (``mooncake`` or ``azure``)."""
    if fmt == "mooncake":
        reqs = load_mooncake(path)
        return reqs[:limit] if limit else reqs
    if fmt == "azure":
        return load_azure(path, limit=limit)
    raise ValueError(f"trace format must be one of {', '.join(TRACE_FORMATS)}, got {fmt!r}")


def shape(
    reqs: Sequence[LiveRequest],
    *,
    limit: int | None = None,
    time_scale: float = 1.0,
    length_scale: float = 1.0,
    rate: float | None = None,
    max_prompt_tokens: int | None = None,
    seed: int = 0,
) -> tuple[list[LiveRequest], int]:
    """``reqs`` fitted to a run (see the module docstring); also how many prompts were cut
    to ``max_prompt_tokens``."""
    if time_scale <= 0 or length_scale <= 0:
        raise ValueError("time_scale and length_scale must be > 0")
    if rate is not None and rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    out = list(reqs[:limit] if limit else reqs)
    if out:
        t0 = out[0].at_s
        out = [replace(r, at_s=(r.at_s - t0) * time_scale) for r in out]
    if rate is not None:
        rng = random.Random(f"{seed}:arrivals")
        t = 0.0
        timed = []
        for r in out:
            timed.append(replace(r, at_s=t))
            t += rng.expovariate(rate)
        out = timed
    cut = 0
    shaped = []
    for r in out:
        ids, mt = r.ids, r.max_tokens
        if length_scale != 1.0:
            ids = ids[: max(1, math.ceil(len(ids) * length_scale))]
            mt = max(1, math.ceil(mt * length_scale))
        if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
            ids, cut = ids[:max_prompt_tokens], cut + 1
        shaped.append(replace(r, ids=ids, max_tokens=mt))
    return shaped, cut


#: Smallest vocabulary a replay draws prompt ids from (ids start at :data:`LOW_ID`).
MIN_VOCAB = 16


def _opt(help: str, **bounds: Any) -> dict[str, Any]:
    """A field's command-line description: its help and its bounds (``min``)."""
    return {"help": help, **bounds}


@dataclass(frozen=True)
class ReplayWorkload:
    """What a live replay sends and how: a trace or a scenario, shaped (see the module
    docstring), sent at its arrivals, at a Poisson ``rate`` or by ``concurrency`` closed-loop
    clients. The one definition of these parameters: each command's options are its fields
    (``pdserve.options.replay_options``, from each field's ``metadata``)."""

    trace: Path | None = field(default=None, metadata=_opt("A trace file (with --trace-format)."))
    trace_format: str | None = field(default=None, metadata=_opt("mooncake or azure."))
    scenario: str | None = field(
        default=None,
        metadata=_opt("rag, or a prefill-simulator scenario (sec-spike, flood, musique, ...)."),
    )
    limit: int | None = field(
        default=None, metadata=_opt("Replay only the first N requests.", min=1)
    )
    time_scale: float = field(
        default=1.0, metadata=_opt("Multiply arrival offsets (2: half the rate).")
    )
    length_scale: float = field(default=1.0, metadata=_opt("Multiply prompt and output lengths."))
    concurrency: int | None = field(
        default=None, metadata=_opt("Closed loop: N clients (instead of the arrivals).", min=1)
    )
    rate: float | None = field(default=None, metadata=_opt("Poisson arrivals at R requests/s."))
    max_tokens: int = field(default=16, metadata=_opt("Output tokens of scenario requests.", min=1))
    vocab: int = field(default=1000, metadata=_opt("Token ids drawn below this.", min=MIN_VOCAB))
    seed: int = field(
        default=0, metadata=_opt("Seed of the prompts' ids and of --rate's arrivals.")
    )

    def check(self) -> None:
        """``ValueError`` for a combination no replay can run: not exactly one of ``trace``
        and ``scenario``, a trace without its format, both ``concurrency`` and ``rate``, or
        fewer than one client."""
        if (self.trace is None) == (self.scenario is None):
            raise ValueError("give exactly one of --trace or --scenario")
        if self.trace is not None and self.trace_format is None:
            raise ValueError("--trace needs --trace-format (mooncake or azure)")
        if self.concurrency is not None and self.rate is not None:
            raise ValueError("give at most one of --concurrency or --rate")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")

    @property
    def name(self) -> str:
        """The workload as a report names it: the trace's path or the scenario."""
        return str(self.trace) if self.trace is not None else str(self.scenario)

    def shaping(self, prompts_cut_to_fit: int) -> dict[str, Any]:
        """How the run was shaped (a summary's ``shaping``)."""
        return {
            "limit": self.limit,
            "time_scale": self.time_scale,
            "length_scale": self.length_scale,
            "rate": self.rate,
            "concurrency": self.concurrency,
            "prompts_cut_to_fit": prompts_cut_to_fit,
        }


def build_requests(
    workload: ReplayWorkload, max_model_len: int | None = None
) -> tuple[list[LiveRequest], int]:
    """The requests of ``workload``'s trace or scenario, shaped (see the module docstring);
    also how many prompts were cut to fit ``max_model_len`` less their output."""
    w = workload
    w.check()
    if w.trace is not None:
        assert w.trace_format is not None
        reqs = trace_requests(load_trace(w.trace, w.trace_format, w.limit), w.vocab, w.seed)
    else:
        assert w.scenario is not None
        reqs = scenario_requests(w.scenario, w.vocab, w.seed, w.max_tokens, quick=bool(w.limit))
    room = None
    if max_model_len is not None and reqs:
        room = max_model_len - max(r.max_tokens for r in reqs) - 1
    return shape(
        reqs,
        limit=w.limit,
        time_scale=w.time_scale,
        length_scale=w.length_scale,
        rate=w.rate,
        max_prompt_tokens=room,
        seed=w.seed,
    )
