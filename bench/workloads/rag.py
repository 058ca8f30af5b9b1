"""The shared-document RAG mix of ``pdserve bench routing`` (and ``bench live --scenario rag``),
in token ids so shared prefixes stay shared and every count is exact: ``documents`` documents
of ``doc_blocks`` KV blocks each, picked with Zipf popularity (exponent ``zipf_s``), each
request the document plus a unique question of ``question_tokens`` tokens, arriving open-loop
(Poisson, ``rate`` per second, seeded)."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class RagMix:
    """The shared-document RAG mix (see the module docstring)."""

    requests: int = 120
    documents: int = 16
    doc_blocks: int = 12
    question_tokens: int = 96
    zipf_s: float = 1.1
    rate: float = 3.0
    max_tokens: int = 16
    block_size: int = 128
    seed: int = 0


@dataclass(frozen=True)
class Arrival:
    at_s: float
    doc: int
    ids: list[int]


def rag_mix(mix: RagMix, vocab: int) -> list[Arrival]:
    """The request sequence: arrival offsets (s), document index, prompt token ids."""
    rng = random.Random(mix.seed)
    docs = [
        [rng.randrange(10, vocab) for _ in range(mix.doc_blocks * mix.block_size)]
        for _ in range(mix.documents)
    ]
    weights = [1.0 / (k + 1) ** mix.zipf_s for k in range(mix.documents)]
    out = []
    t = 0.0
    for _ in range(mix.requests):
        t += rng.expovariate(mix.rate)
        d = rng.choices(range(mix.documents), weights)[0]
        q = [rng.randrange(10, vocab) for _ in range(mix.question_tokens)]
        out.append(Arrival(t, d, docs[d] + q))
    return out
