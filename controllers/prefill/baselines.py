"""Prefill-ordering baselines behind the same interface as Fairway.

Each is a pure function of the queue view and ``now``. Ties go to the older request
by default (then to the earlier position in the view); LPM and RAGCache also come
with ``tie="newest"``, which is what lets them starve misses when hits keep coming.
"""

from __future__ import annotations

from typing import Literal

from controllers.prefill.base import PrefillQueueView, PrefillRequestView, arrival_order
from controllers.profile import EngineProfile

Tie = Literal["oldest", "newest"]


def _ranked(reqs: tuple[PrefillRequestView, ...], keys: list[float], tie: Tie) -> list[int]:
    """Indices by key descending; ties by arrival (oldest or newest first), then position."""
    sign = 1.0 if tie == "oldest" else -1.0
    return sorted(range(len(reqs)), key=lambda i: (-keys[i], sign * reqs[i].arrival_s, i))


class FCFS:
    """First come, first served: vLLM's default waiting-queue order."""

    name = "fcfs"

    def order(self, queue: PrefillQueueView, now: float) -> list[str]:
        reqs = queue.requests
        return [reqs[i].request_id for i in arrival_order(reqs)]


class LPM:
    """Longest prefix match first (SGLang's ``lpm`` policy): rank by cached prefix tokens.

    Departs from SGLang in that SGLang computes the match against its radix tree and
    silently falls back to FCFS above 128 waiting requests; here the cached length
    comes from the mechanism and there is no hidden fallback.
    """

    def __init__(self, tie: Tie = "oldest") -> None:
        self.tie: Tie = tie
        self.name = "lpm" if tie == "oldest" else "lpm_newest"

    def order(self, queue: PrefillQueueView, now: float) -> list[str]:
        reqs = queue.requests
        keys = [float(r.cached_tokens) for r in reqs]
        return [reqs[i].request_id for i in _ranked(reqs, keys, self.tie)]


class KLPM:
    """k-LPM: LPM, but every k-th admission goes to the oldest waiting request.

    The "let the oldest run once every k turns" compromise the paper compares against; a
    turn is one admission, whatever its size in tokens. Turns are counted across steps:
    the mechanism reports what each step scheduled through :meth:`observe_step`, and the
    admissions so far (``admitted``) number this step's slots, so with k = 4 the 4th,
    8th, 12th, ... admission overall is arrival-ordered. Counting slots within one step's
    order instead would make k-LPM equal to LPM whenever a step admits fewer than k
    requests, which is the common case at a 2,048-token budget. A mechanism that never
    calls :meth:`observe_step` gets per-step slot counting.
    """

    def __init__(self, k: int = 4) -> None:
        if k < 1:
            raise ValueError(f"k-LPM: k must be >= 1, got {k}")
        self.k = k
        self.name = f"klpm{k}"
        self.admitted = 0
        self._offered: frozenset[str] = frozenset()

    def order(self, queue: PrefillQueueView, now: float) -> list[str]:
        reqs = queue.requests
        n = len(reqs)
        lpm = _ranked(reqs, [float(r.cached_tokens) for r in reqs], "oldest")
        old = arrival_order(reqs)
        placed = bytearray(n)
        out: list[int] = []
        li = oi = 0
        while len(out) < n:
            if (self.admitted + len(out) + 1) % self.k == 0:
                while placed[old[oi]]:
                    oi += 1
                i = old[oi]
            else:
                while placed[lpm[li]]:
                    li += 1
                i = lpm[li]
            placed[i] = 1
            out.append(i)
        ids = [reqs[i].request_id for i in out]
        self._offered = frozenset(ids)
        return ids

    def observe_step(self, scheduled: list[tuple[str, int]], now: float) -> None:
        """Count this step's admissions: scheduled requests that were waiting when ordered."""
        self.admitted += sum(1 for rid, _ in scheduled if rid in self._offered)
        self._offered = frozenset()


class RAGCacheOrder:
    """RAGCache-style: rank by reuse ratio ``h / c`` alone (no wait term, no fairness).

    RAGCache's own scheduler ("cache-aware reordering") ranks by cached length over
    computation length; it also has a knowledge tree and a starvation window that
    this baseline leaves out.
    """

    def __init__(self, tie: Tie = "oldest") -> None:
        self.tie: Tie = tie
        self.name = "ragcache" if tie == "oldest" else "ragcache_newest"

    def order(self, queue: PrefillQueueView, now: float) -> list[str]:
        reqs = queue.requests
        keys = [r.cached_tokens / r.work for r in reqs]
        return [reqs[i].request_id for i in _ranked(reqs, keys, self.tie)]


class PrebleLike:
    """Preble-like: 10 buckets of cache-hit ratio ``h / prompt``, served by weighted round-robin.

    Bucket ``b = min(9, floor(10 * h / prompt))`` has weight ``b + 1``; each round visits
    buckets from the highest ratio down and takes up to ``weight`` requests from each,
    oldest first within a bucket. Preble's real scheduler balances prefix groups across
    GPUs and uses the hit ratio to pick a priority group; this keeps only the
    within-instance group rotation.
    """

    name = "preble"
    buckets = 10

    def order(self, queue: PrefillQueueView, now: float) -> list[str]:
        reqs = queue.requests
        groups: list[list[int]] = [[] for _ in range(self.buckets)]
        for i in arrival_order(reqs):
            r = reqs[i]
            ratio = r.cached_tokens / r.prompt_tokens if r.prompt_tokens > 0 else 0.0
            groups[min(self.buckets - 1, max(0, int(self.buckets * ratio)))].append(i)
        heads = [0] * self.buckets
        out: list[int] = []
        while len(out) < len(reqs):
            for b in range(self.buckets - 1, -1, -1):
                g, h = groups[b], heads[b]
                take = min(b + 1, len(g) - h)
                out.extend(g[h : h + take])
                heads[b] = h + take
        return [reqs[i].request_id for i in out]


class PeekLike:
    """PEEK-like: rank by prefill time saved by the cache, and protect waiting requests' blocks.

    Prefill saved = ``T(prompt) - T(uncached)`` from the engine profile's prefill table
    (attention makes a cached head worth more than its token count); without a profile
    it falls back to cached tokens. :meth:`protected_blocks` returns the block hashes of
    the ``protect_top`` highest-ranked waiting requests so the cache evicts other blocks
    first. PEEK's published scheduler also ages requests; this baseline keeps only the
    saved-work ranking and the protection, as the paper's comparison describes it.
    """

    name = "peek"

    def __init__(self, profile: EngineProfile | None = None, protect_top: int = 32) -> None:
        if protect_top < 0:
            raise ValueError(f"peek: protect_top must be >= 0, got {protect_top}")
        self.profile = profile
        self.protect_top = protect_top

    def _saved(self, r: PrefillRequestView) -> float:
        if self.profile is None:
            return float(r.cached_tokens)
        return self.profile.prefill_seconds(r.prompt_tokens) - self.profile.prefill_seconds(
            r.uncached_tokens
        )

    def _ranked(self, queue: PrefillQueueView) -> list[int]:
        reqs = queue.requests
        return _ranked(reqs, [self._saved(r) for r in reqs], "oldest")

    def order(self, queue: PrefillQueueView, now: float) -> list[str]:
        reqs = queue.requests
        return [reqs[i].request_id for i in self._ranked(queue)]

    def protected_blocks(self, queue: PrefillQueueView, now: float) -> frozenset[int]:
        reqs = queue.requests
        out: set[int] = set()
        for i in self._ranked(queue)[: self.protect_top]:
            out.update(reqs[i].block_hashes)
        return frozenset(out)
