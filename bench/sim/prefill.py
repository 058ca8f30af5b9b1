"""Step-level simulator of one prefill engine under a prefix cache (simulated, not measured).

It mirrors vLLM's v1 scheduler on a prefill node of a disaggregated deployment, and drives
the very policy objects the engines use (:func:`controllers.prefill.make_prefill_policy`),
never copies.

One step at time ``now``
------------------------
1. Requests that arrived by ``now`` have joined the waiting queue (the driver submits them).
2. The cached prefix of every waiting request is re-read from the cache (eviction moves it),
   a frozen :class:`~controllers.prefill.PrefillQueueView` is built in arrival order, and
   the policy returns the admission order. A :class:`~controllers.prefill.ProtectingPolicy`
   (PEEK-like) is also asked for its protected blocks, which the cache evicts only when no
   other evictable block is left.
3. Running (partly prefilled) requests continue first, oldest admission first, each taking
   ``min(remaining, budget left)`` tokens of the step's token budget (2,048 by default).
4. Waiting requests are then admitted in the policy's order while budget is left and fewer
   than ``max_running`` requests run. At admission the cached prefix is read again (earlier
   admissions in the same step may have evicted blocks); the request takes references on its
   cached blocks and reserves KV blocks for the rest of its prompt. If the cache cannot
   supply them, admission stops for this step (vLLM breaks out of its waiting loop the same
   way). A request that does not fit the remaining budget is chunked.
5. The step's duration comes from the profile's cost model
   (:class:`~controllers.profile.StepCost`): ``fixed_s + per_token_s * sum(c_i) +
   attn_per_ctx_token_s * sum(c_i * p_i + c_i * (c_i + 1) / 2)`` for chunks of ``c_i``
   tokens starting at position ``p_i`` (the cached prefix counts as context). The default
   profile (``engines/profiles/a6000_llama31_8b.json``, Llama-3.1-8B on one A6000) is a
   roofline model whose numbers and derivation are in ``a6000_llama31_8b.md`` beside it;
   its patience table is the idle-engine time under this same cost model.
6. Each full block a chunk completes is registered in the cache at once (vLLM caches full
   blocks as they are computed), so a later request can hit it while its producer still runs.
   A request whose last prompt token was computed emits its one token and finishes at the
   end of the step: TTFT = step end - arrival. Its blocks are released.
7. If the policy defines ``observe_step(scheduled: list[tuple[str, int]], now: float)``, it
   is called after every step with the ``(request_id, tokens scheduled)`` pairs of that step
   (running requests first, then admissions, in schedule order) and ``now`` = the step's
   end time. Stateful policies (issue 4) use it; stateless ones need not define it.

Definitions (fixed for every policy; each of them changes the headline)
-----------------------------------------------------------------------
- Tie-breaking inside LPM and RAGCache: arrival order (``lpm``, ``ragcache``); the
  newest-first variants are the policies ``lpm_newest`` and ``ragcache_newest``.
- Cached prefixes are re-read for every waiting request at every step and again at
  admission; never kept from arrival time.
- Capacity: FCFS's saturated throughput (requests/s) on the same request mix and the same
  cache: the mix is submitted at t = 0 and the number of requests is divided by FCFS's
  makespan (:func:`fcfs_capacity`). ``load = x`` means Poisson arrivals at ``x`` times it.
- What follows a spike is scenario-defined: ``sec-spike`` reports a drain and continued
  arrivals separately. Every run ends by serving every submitted request (a drain), within
  a horizon; unfinished requests are counted and their TTFT censored at the horizon.
- LRU order: a finishing request releases its blocks tail first, so within a request the
  tail becomes least recently used before the head (vLLM frees blocks in reverse order).
  Blocks are inserted per computed block, not on completion. Two requests admitted while a
  prefix is still uncomputed both compute it (duplicate computation, as in vLLM); the
  second copy is a private block, not registered, freed at completion.
- The cached part is capped so at least one token is computed: only the first
  ``(prompt - 1) // block_size`` full blocks can hit (vLLM's ``num_tokens - 1`` cap).
- KV reservation: a request reserves its whole prompt's blocks at admission (vLLM
  allocates per chunk and preempts on shortage; with one output token per request the
  reservation gives the same admission limit without preemption churn).
- Reusable content (for cache sizing): distinct full blocks referenced by at least two
  requests of the workload (:func:`reusable_blocks`); it depends on block size and trace.
- Worst wait: the largest TTFT (queueing + prefill) of the policy's run. Starved: worst
  TTFT > 3 x the policy's own p99 TTFT.

Everything is deterministic for a seed: no wall clock, no unseeded randomness.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from controllers.config import FairwayConfig
from controllers.prefill import (
    PrefillPolicy,
    PrefillQueueView,
    PrefillRequestView,
    make_prefill_policy,
    patience_s,
)
from controllers.profile import EngineProfile


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One request of a simulated workload.

    ``block_hashes``: hashes of the prompt's FULL blocks (``prompt_tokens // block_size`` of
    them at most; chained, so equal hashes mean equal prefixes). ``labels``: report keys the
    request belongs to (a phase such as ``"spike"``, a class such as ``"long"``).
    """

    request_id: str
    arrival_s: float
    prompt_tokens: int
    block_hashes: tuple[int, ...] = ()
    labels: tuple[str, ...] = ()
    tenant: str = ""


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    """A request whose first (and only) token was produced at ``finish_s``."""

    request_id: str
    arrival_s: float
    admitted_s: float
    finish_s: float
    prompt_tokens: int
    cached_tokens: int
    labels: tuple[str, ...]

    @property
    def ttft_s(self) -> float:
        return self.finish_s - self.arrival_s


class BlockCache:
    """Block-level prefix cache with LRU eviction and reference-count pinning.

    Capacity is in physical blocks. A block is either registered (its hash is in the cache,
    shared, reference-counted; with zero references it is evictable, in LRU order) or
    private (held by one running request: a partial tail block, a block not computed yet,
    or a duplicate of a block already registered). Blocks with references are never
    evicted. ``protected`` hashes are evicted only when no other evictable block is left.
    """

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"BlockCache: capacity_blocks must be >= 1, got {capacity_blocks}")
        self.capacity = capacity_blocks
        self._ref: dict[int, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # evictable, first = evicted first
        self._private = 0
        self.protected: frozenset[int] = frozenset()
        self.evictions = 0

    @property
    def used(self) -> int:
        return len(self._ref) + self._private

    @property
    def free(self) -> int:
        return self.capacity - self.used

    @property
    def evictable(self) -> int:
        return len(self._lru)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._ref

    def hit_blocks(self, hashes: Sequence[int], max_blocks: int) -> int:
        """Number of leading ``hashes`` (at most ``max_blocks``) that are cached now."""
        ref = self._ref
        n = 0
        for h in hashes[:max_blocks]:
            if h not in ref:
                break
            n += 1
        return n

    def can_reserve(self, hits: Sequence[int], new_blocks: int) -> bool:
        """Whether ``acquire(hits)`` then ``reserve(new_blocks)`` would succeed."""
        lru = self._lru
        hits_evictable = sum(1 for h in hits if h in lru)
        return self.free + len(lru) - hits_evictable >= new_blocks

    def acquire(self, hits: Iterable[int]) -> None:
        """Take one reference on each cached hash (pins it; refreshes nothing else)."""
        for h in hits:
            r = self._ref[h]
            if r == 0:
                del self._lru[h]
            self._ref[h] = r + 1

    def reserve(self, n: int) -> None:
        """Reserve ``n`` private blocks, evicting LRU blocks (unprotected first) as needed."""
        need = n - self.free
        if need > 0:
            self._evict(need)
        if self.free < n:
            raise RuntimeError("BlockCache.reserve: not enough blocks (call can_reserve first)")
        self._private += n

    def _evict(self, n: int) -> None:
        lru, prot = self._lru, self.protected
        victims: list[int] = []
        if prot:
            for h in lru:
                if h not in prot:
                    victims.append(h)
                    if len(victims) == n:
                        break
            if len(victims) < n:
                for h in lru:
                    if h in prot:
                        victims.append(h)
                        if len(victims) == n:
                            break
        else:
            for h in lru:
                victims.append(h)
                if len(victims) == n:
                    break
        for h in victims:
            del lru[h]
            del self._ref[h]
        self.evictions += len(victims)

    def warm(self, hashes: Iterable[int]) -> None:
        """Insert computed blocks as evictable (most recent last), e.g. a pre-warmed document.

        Blocks already cached are left alone; fails if the cache has no free block left.
        """
        for h in hashes:
            if h in self._ref:
                continue
            if self.free < 1:
                raise ValueError("BlockCache.warm: more warm blocks than free capacity")
            self._ref[h] = 0
            self._lru[h] = None

    def register(self, block_hash: int) -> bool:
        """A running request computed the full block ``block_hash`` in one of its private blocks.

        Registers it (the private block becomes the cached, referenced copy) and returns
        True, unless the hash is already cached (duplicate computation): then the private
        block stays private and False is returned.
        """
        if block_hash in self._ref:
            return False
        self._private -= 1
        self._ref[block_hash] = 1
        return True

    def release(self, registered: Sequence[int], private: int) -> None:
        """A request finished: drop its references, tail first, and free its private blocks.

        Blocks reaching zero references become evictable in the order released, so the
        request's tail is evicted before its head.
        """
        for h in reversed(registered):
            r = self._ref[h] - 1
            self._ref[h] = r
            if r == 0:
                self._lru[h] = None
        self._private -= private


@dataclass(slots=True)
class _Live:
    req: SimRequest
    patience_s: float
    computed: int = 0  # prompt tokens computed or cached
    cached_at_admission: int = 0
    admitted_s: float = -1.0
    registered: list[int] = field(default_factory=list)
    private: int = 0
    full_done: int = 0  # full blocks accounted for (hit, registered or duplicate)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Mechanism settings of the simulated engine (vLLM's names in brackets).

    ``token_budget`` [max_num_batched_tokens], ``max_running`` [max_num_seqs],
    ``block_size`` [block_size].
    """

    token_budget: int = 2048
    max_running: int = 256
    block_size: int = 16

    def __post_init__(self) -> None:
        for name in ("token_budget", "max_running", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one step did: its duration, the ``(request_id, tokens)`` scheduled, who finished."""

    start_s: float
    duration_s: float
    scheduled: list[tuple[str, int]]
    finished: list[FinishedRequest]

    @property
    def end_s(self) -> float:
        return self.start_s + self.duration_s


class PrefillEngine:
    """One simulated prefill replica: a waiting queue, running requests, a cache, a policy.

    API (a router over N replicas drives several of these): :meth:`submit` a request whose
    arrival time has come, :meth:`step` at ``now`` (returns a :class:`StepResult`, whose
    ``end_s`` is when the caller may step again), :attr:`waiting_count`,
    :attr:`running_count`, :meth:`queued_uncached_tokens`, :meth:`has_work`,
    :meth:`cached_tokens_for` (what a router's prefix lookup would see).
    """

    def __init__(
        self,
        policy: PrefillPolicy,
        profile: EngineProfile,
        cache: BlockCache,
        config: EngineConfig | None = None,
        fairway_config: FairwayConfig | None = None,
    ) -> None:
        self.policy = policy
        self.profile = profile
        self.cache = cache
        self.config = config or EngineConfig(
            token_budget=profile.token_budget, block_size=profile.block_size
        )
        self.fairway_config = fairway_config or FairwayConfig()
        self._waiting: dict[str, _Live] = {}  # insertion = arrival order
        self._running: dict[str, _Live] = {}  # insertion = admission order
        self._protects = callable(getattr(policy, "protected_blocks", None))
        self._observe: Callable[[list[tuple[str, int]], float], None] | None = getattr(
            policy, "observe_step", None
        )
        self.steps = 0
        self.busy_s = 0.0

    # -- queue state -------------------------------------------------------------------
    @property
    def waiting_count(self) -> int:
        return len(self._waiting)

    @property
    def running_count(self) -> int:
        return len(self._running)

    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    def _cap_blocks(self, req: SimRequest) -> int:
        return min(len(req.block_hashes), (req.prompt_tokens - 1) // self.config.block_size)

    def cached_tokens_for(self, req: SimRequest) -> int:
        """Cached prefix tokens ``req`` would get on this replica now (capped, see module)."""
        return self.cache.hit_blocks(req.block_hashes, self._cap_blocks(req)) * (
            self.config.block_size
        )

    def queued_uncached_tokens(self) -> int:
        """Prompt tokens still to compute: waiting (cache re-read now) plus running."""
        w = sum(
            lv.req.prompt_tokens - self.cached_tokens_for(lv.req) for lv in self._waiting.values()
        )
        return w + sum(lv.req.prompt_tokens - lv.computed for lv in self._running.values())

    def submit(self, req: SimRequest) -> None:
        """Add an arrived request to the waiting queue (arrival order = submission order)."""
        if req.request_id in self._waiting or req.request_id in self._running:
            raise ValueError(f"request id {req.request_id!r} submitted twice")
        if req.prompt_tokens < 1:
            raise ValueError(f"request {req.request_id!r}: prompt_tokens must be >= 1")
        blocks = -(-req.prompt_tokens // self.config.block_size)
        if blocks > self.cache.capacity:
            raise ValueError(
                f"request {req.request_id!r}: its {req.prompt_tokens} tokens need {blocks} KV "
                f"blocks, more than the cache's {self.cache.capacity}"
            )
        pat = patience_s(req.prompt_tokens, self.profile, self.fairway_config)
        self._waiting[req.request_id] = _Live(req, pat)

    # -- one step ----------------------------------------------------------------------
    def _view(self) -> PrefillQueueView:
        views = []
        for rid, lv in self._waiting.items():
            r = lv.req
            cached = self.cached_tokens_for(r)
            views.append(
                PrefillRequestView(
                    request_id=rid,
                    arrival_s=r.arrival_s,
                    prompt_tokens=r.prompt_tokens,
                    patience_s=lv.patience_s,
                    cached_tokens=cached,
                    uncached_tokens=r.prompt_tokens - cached,
                    block_hashes=r.block_hashes,
                    tenant=r.tenant,
                )
            )
        return PrefillQueueView(tuple(views))

    def _admit(self, lv: _Live, now: float) -> bool:
        r, bs = lv.req, self.config.block_size
        hit = self.cache.hit_blocks(r.block_hashes, self._cap_blocks(r))
        hits = r.block_hashes[:hit]
        total_blocks = -(-r.prompt_tokens // bs)
        new = total_blocks - hit
        if not self.cache.can_reserve(hits, new):
            return False
        self.cache.acquire(hits)
        self.cache.reserve(new)
        lv.registered = list(hits)
        lv.private = new
        lv.full_done = hit
        lv.computed = hit * bs
        lv.cached_at_admission = hit * bs
        lv.admitted_s = now
        return True

    def step(self, now: float) -> StepResult:
        """Run one engine step starting at ``now`` (see the module docstring)."""
        budget = self.config.token_budget
        scheduled: list[tuple[str, int]] = []
        chunks: list[tuple[_Live, int, int]] = []  # (request, start position, tokens)
        for rid, lv in self._running.items():
            if budget <= 0:
                break
            c = min(lv.req.prompt_tokens - lv.computed, budget)
            chunks.append((lv, lv.computed, c))
            scheduled.append((rid, c))
            budget -= c
        if self._waiting and budget > 0 and len(self._running) < self.config.max_running:
            view = self._view()
            if self._protects:
                self.cache.protected = self.policy.protected_blocks(view, now)  # type: ignore[attr-defined]
            for rid in self.policy.order(view, now):
                if budget <= 0 or len(self._running) >= self.config.max_running:
                    break
                lv = self._waiting[rid]
                if not self._admit(lv, now):
                    break
                del self._waiting[rid]
                self._running[rid] = lv
                c = min(lv.req.prompt_tokens - lv.computed, budget)
                chunks.append((lv, lv.computed, c))
                scheduled.append((rid, c))
                budget -= c
        elif not self._waiting:
            self.cache.protected = frozenset()
        duration = self._cost(chunks)
        end = now + duration
        finished = self._advance(chunks, end)
        self.steps += 1
        self.busy_s += duration
        if self._observe is not None:
            self._observe(scheduled, end)
        return StepResult(now, duration, scheduled, finished)

    def _cost(self, chunks: list[tuple[_Live, int, int]]) -> float:
        return self.profile.step_cost.seconds((c, p) for _, p, c in chunks)

    def _advance(self, chunks: list[tuple[_Live, int, int]], end: float) -> list[FinishedRequest]:
        bs = self.config.block_size
        finished: list[FinishedRequest] = []
        for lv, _, c in chunks:
            lv.computed += c
            r = lv.req
            full = min(lv.computed // bs, len(r.block_hashes))
            for i in range(lv.full_done, full):
                h = r.block_hashes[i]
                if self.cache.register(h):
                    lv.registered.append(h)
                    lv.private -= 1
            lv.full_done = max(lv.full_done, full)
            if lv.computed >= r.prompt_tokens:
                del self._running[r.request_id]
                self.cache.release(lv.registered, lv.private)
                finished.append(
                    FinishedRequest(
                        r.request_id,
                        r.arrival_s,
                        lv.admitted_s,
                        end,
                        r.prompt_tokens,
                        lv.cached_at_admission,
                        r.labels,
                    )
                )
        return finished


@dataclass(frozen=True)
class RunResult:
    """The outcome of one policy on one workload (simulated)."""

    policy: str
    finished: list[FinishedRequest]
    unfinished: list[SimRequest]
    horizon_s: float
    steps: int
    busy_s: float
    evictions: int

    def ttfts(self, label: str | None = None) -> list[float]:
        """TTFTs (s) of requests carrying ``label`` (all when None); unfinished are censored."""
        out = [f.ttft_s for f in self.finished if label is None or label in f.labels]
        out += [
            self.horizon_s - r.arrival_s
            for r in self.unfinished
            if label is None or label in r.labels
        ]
        return out


def simulate(
    requests: Sequence[SimRequest],
    policy: PrefillPolicy | str,
    profile: EngineProfile,
    cache_blocks: int,
    *,
    config: EngineConfig | None = None,
    fairway_config: FairwayConfig | None = None,
    horizon_s: float | None = None,
    on_step: Callable[[StepResult], None] | None = None,
    warm: Sequence[Sequence[int]] = (),
) -> RunResult:
    """Run ``requests`` through one engine until all finish (or ``horizon_s`` passes).

    ``policy`` is a policy object or a registry name (built with ``make_prefill_policy``).
    The default horizon is 20 x the last arrival + 600 s, a guard against a run that cannot
    finish; what is left then is reported as unfinished.
    """
    fw = fairway_config or FairwayConfig()
    pol = make_prefill_policy(policy, profile, fw) if isinstance(policy, str) else policy
    reqs = sorted(requests, key=lambda r: r.arrival_s)
    last = reqs[-1].arrival_s if reqs else 0.0
    horizon = horizon_s if horizon_s is not None else 20.0 * last + 600.0
    cache = BlockCache(cache_blocks)
    for chain in warm:
        cache.warm(chain)
    eng = PrefillEngine(pol, profile, cache, config, fw)
    finished: list[FinishedRequest] = []
    now, i, n = 0.0, 0, len(reqs)
    while (i < n or eng.has_work()) and now < horizon:
        while i < n and reqs[i].arrival_s <= now:
            eng.submit(reqs[i])
            i += 1
        if not eng.has_work():
            now = reqs[i].arrival_s
            continue
        res = eng.step(now)
        finished.extend(res.finished)
        if on_step is not None:
            on_step(res)
        now = res.end_s
    done = {f.request_id for f in finished}
    unfinished = [r for r in reqs if r.request_id not in done]
    return RunResult(
        getattr(pol, "name", str(policy)),
        finished,
        unfinished,
        now,
        eng.steps,
        eng.busy_s,
        eng.cache.evictions,
    )


def reusable_blocks(requests: Iterable[SimRequest]) -> int:
    """Reusable content: distinct full blocks referenced by at least two requests."""
    counts: Counter[int] = Counter()
    for r in requests:
        counts.update(set(r.block_hashes))
    return sum(1 for c in counts.values() if c >= 2)


def fcfs_capacity(
    mix: Sequence[SimRequest],
    profile: EngineProfile,
    cache_blocks: int,
    config: EngineConfig | None = None,
    warm: Sequence[Sequence[int]] = (),
) -> float:
    """Capacity in requests/s: FCFS's saturated throughput on ``mix`` with this cache.

    All of ``mix`` is submitted at t = 0 (in its given order) and the count is divided by
    FCFS's makespan.
    """
    if not mix:
        raise ValueError("fcfs_capacity: empty request mix")
    at0 = [
        SimRequest(f"cap{k}", 0.0, r.prompt_tokens, r.block_hashes, r.labels)
        for k, r in enumerate(mix)
    ]
    res = simulate(at0, "fcfs", profile, cache_blocks, config=config, horizon_s=1e9, warm=warm)
    return len(mix) / res.horizon_s
