"""Prefill-ordering baselines behind the same interface as Fairway.

Each is a pure function of the queue view and ``now``. Ties go to the older request
by default (then to the earlier position in the view); LPM and RAGCache also come
with ``tie="newest"``, which is what lets them starve misses when hits keep coming.
"""

from __future__ import annotations

import math
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
    computation length; it also has a starvation window, a GPU + host knowledge tree and
    its PGDSF replacement policy, which this baseline leaves out (the Fairway paper
    describes it as ranking by reuse ratio; eviction here is vLLM's block LRU). When most
    waiting requests share one short cached head (the system prompt), ``h / c`` orders
    them shortest first.
    """

    def __init__(self, tie: Tie = "oldest") -> None:
        self.tie: Tie = tie
        self.name = "ragcache" if tie == "oldest" else "ragcache_newest"

    def order(self, queue: PrefillQueueView, now: float) -> list[str]:
        reqs = queue.requests
        keys = [r.cached_tokens / r.work for r in reqs]
        return [reqs[i].request_id for i in _ranked(reqs, keys, self.tie)]


class PrebleLike:
    """Preble's single-instance scheduler, as released (WukLab/preble, ``fcfs-mpq``).

    From ``python/sglang/srt/managers/router/model_rpc.py``: 10 priority groups by
    cache-hit ratio ``r = h / prompt``, group ``0`` for ``r == 0`` else ``ceil(10 r) - 1``,
    fixed when the request is first seen (a request keeps its group while it waits). Each
    scheduling step serves *one* group, chosen by a pointer that persists across steps and
    moves 9, 8, ..., 0, 9, ... skipping empty groups; that group may admit up to
    ``(g + 1) * 10`` requests, oldest first. Preble's global router (load balancing and
    prefix replication across GPUs) does not apply to one instance.

    One deviation: the source leaves the rest of the step's budget idle, but an ordering
    here must be a permutation of the queue (the engine fills its budget in this order), so
    the other groups follow in the pointer's order, then the chosen group's overflow.
    Eviction is the simulator's (vLLM's) block LRU for every policy, not SGLang's radix LRU.
    """

    name = "preble"
    groups = 10
    k = 10

    def __init__(self) -> None:
        self._ptr = self.groups - 1
        self._group: dict[str, int] = {}

    def _bucket(self, r: PrefillRequestView) -> int:
        if r.prompt_tokens <= 0 or r.cached_tokens <= 0:
            return 0
        ratio = min(1.0, r.cached_tokens / r.prompt_tokens)
        return min(self.groups - 1, max(0, math.ceil(self.groups * ratio) - 1))

    def order(self, queue: PrefillQueueView, now: float) -> list[str]:
        reqs = queue.requests
        if not reqs:
            return []
        live = {r.request_id for r in reqs}
        self._group = {rid: g for rid, g in self._group.items() if rid in live}
        groups: list[list[int]] = [[] for _ in range(self.groups)]
        for i in arrival_order(reqs):
            rid = reqs[i].request_id
            groups[self._group.setdefault(rid, self._bucket(reqs[i]))].append(i)
        g = next(
            x for x in ((self._ptr - s) % self.groups for s in range(self.groups)) if groups[x]
        )
        self._ptr = (g - 1) % self.groups
        cap = (g + 1) * self.k
        out = groups[g][:cap]
        for s in range(1, self.groups):
            out += groups[(g - s) % self.groups]
        out += groups[g][cap:]
        return [reqs[i].request_id for i in out]


class PeekLike:
    """PEEK-like: rank by prefill time saved by the cache, and protect waiting requests' blocks.

    Prefill saved = ``T(cached)``, the cached prefix's own prefill time from the engine
    profile's table (superlinear in its length: attention makes a long cached head worth
    more than its token count); without a profile it falls back to cached tokens. The
    uncached suffix still attends to the cached head, so ``T(prompt) - T(uncached)`` (an
    earlier key) overstated the saving by that cross term, growing with the prompt: misses
    with the same short cached head then ran longest first. :meth:`protected_blocks`
    returns the block hashes of the ``protect_top`` highest-ranked waiting requests so the
    cache evicts other blocks first. No PEEK source was found to check further details
    (aging, the protected count); this keeps what the Fairway paper's comparison describes:
    the saved-work ranking and the protection.
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
        return self.profile.prefill_seconds(r.cached_tokens) if r.cached_tokens > 0 else 0.0

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
