"""Admission: every decision that lets a request in or refuses it, in one place.

In the order a request meets them (:meth:`deployments.ingress.core.IngressCore.complete`):

1. **who** (:meth:`AdmissionPhase.principal`): the key, checked from the headers before the
   body was read (:class:`deployments.ingress.auth.AuthGuard`), which also charged the tenant's
   requests bucket;
2. **the prefill queue, cheaply** (:meth:`AdmissionPhase.check_queue_room`): before any
   tokenizing, a request is refused while the queue is already at its bound;
3. **the tenant's tokens** (:meth:`AdmissionPhase.admit`): prompt plus ``max_tokens x n``
   from its tokens bucket, the output part reserved and given back unused when the request
   ends (:meth:`AdmissionPhase.give_back`); work done before a refusal is charged
   (:meth:`AdmissionPhase.charge_tokens`);
4. **the engines' queue** (:meth:`AdmissionPhase.admit_engines`, after routing, when the
   uncached tokens and where the prompt is computed are known): the expected wait
   (:meth:`AdmissionPhase.check_wait`, Little's law over the engines' reports) and, unless
   the prompt stays on its decode replica, the prefill queue's request and token bounds
   (:meth:`AdmissionPhase.admit_prefill`). Admitted prompts count as in flight until their
   prefill returns (:meth:`AdmissionPhase.release_slot`; colocated: until the stream ends).

The decisions themselves are pure (:mod:`controllers.overload`, :mod:`controllers.tenants`);
this module holds the ingress's counts they read.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import TYPE_CHECKING

from fastapi import Request

from cluster.tenants import OPERATOR, Charge, KeyStore, RateLimiter, hash_key
from controllers.overload import (
    CompletionRate,
    expected_wait_s,
    past_ceiling,
    refuse_for,
    reused,
    share_ahead,
    spared,
)
from controllers.tenants import Bucket
from deployments.config import AppConfig
from deployments.ingress.auth import ANONYMOUS, AuthFailures, Gate, Principal, principal_of
from deployments.ingress.auth import configure as configure_gate
from deployments.ingress.openai_requests import RequestError
from deployments.ingress.request import Prepared
from deployments.ingress.state import IngressState
from deployments.protocol import RouteHint

if TYPE_CHECKING:
    from deployments.ingress.route import Placement


class AdmissionPhase(IngressState):
    """Every admission decision of the ingress (see the module's docstring); a part of
    :class:`~deployments.ingress.core.IngressCore`, whose state it reads."""

    def _init_admission(self) -> None:
        self.keys, self.limiter = tenancy(self.cfg, self.app_name)
        ing = self.cfg.ingress
        self.gate = Gate(
            ing.auth,
            self.keys,
            self.limiter,
            self._bucket_specs,
            AuthFailures(ing.max_auth_failures, ing.auth_failures_per_minute),
            self._refused_by,
        )
        configure_gate(self.gate)
        #: output tokens reserved per tenant by requests still running (each reservation is
        #: settled when its request ends, however it ends: 0 once a tenant's requests are done)
        self.reserved_tokens: dict[str, int] = {}
        #: overload control: prompts in flight at the prefill from this ingress per tenant
        #: (past a bound, a tenant below an equal share of them is spared the refusal:
        #: controllers.overload.spared), their uncached tokens, the most ever in flight, and
        #: the 503s given
        self._inflight_by_tenant: dict[str, int] = {}
        self._inflight_uncached = 0
        self.inflight_peak = 0
        #: requests admitted past a bound because their tenant was below its share or their
        #: prompts were mostly cached; of them, those spared for their reuse
        self.overload_spared = 0
        self.overload_spared_reuse = 0
        #: the engines' completions per second (from their reports), for the wait bound
        self._completions = CompletionRate(window_s=20.0)
        #: the engine replicas the rate was measured over
        self._rate_replicas: frozenset[str] = frozenset()
        #: the last expected queueing time (s; Little's law), None while unknown
        self.expected_wait_s: float | None = None
        #: requests refused because the expected wait passed ingress.max_expected_wait_s
        self.wait_refused = 0
        self.overload_refused = 0

    @property
    def _inflight_prefill(self) -> int:
        """Prompts in flight at the prefill from this ingress (all tenants')."""
        return sum(self._inflight_by_tenant.values())

    def check_queue_room(self, tenant: str) -> None:
        """Before any tokenizing: a 503 while the prefill queue is already at its request
        bound (and ``tenant`` is not spared), so that a refusal under overload costs nothing."""
        self._overloaded(0, 0, tenant)

    async def principal(self, request: Request) -> Principal:
        """Who sent ``request``: what :class:`~deployments.ingress.auth.AuthGuard` decided from its
        headers before the body was read, or (a caller that came around the guard) the same
        decision taken now. Raises :class:`RequestError` (401, 403, 429, 503)."""
        who = principal_of(request.scope)
        if who is None:
            client = request.client.host if request.client else None
            headers = {k.lower(): v for k, v in request.headers.items()}
            who = await self.gate.check(request.method, request.url.path, headers, client)
        if who is None:  # an open route: nobody in particular
            return Principal(ANONYMOUS)
        return who

    def _bucket_specs(self, tenant: str) -> dict[str, tuple[float, float]]:
        return self.cfg.tenants.limits(tenant).buckets()

    def _refused_by(self, tenant: str, reason: str) -> None:
        self.metrics.inc("pdserve_auth_refused", tenant=tenant, reason=reason)
        if reason == "rate_limited":
            self.metrics.inc("pdserve_rate_limited", tenant=tenant, limit="requests")

    async def admit(self, prep: Prepared) -> None:
        """Take the request's prompt plus requested output tokens (``max_tokens x n``) from
        its tenant's tokens bucket, or raise 429 with ``Retry-After`` (400 when it could never
        fit). The requests bucket was charged before the body was read
        (:class:`~deployments.ingress.auth.Gate`)."""
        spec = self._bucket_specs(prep.tenant).get("tokens")
        if spec is None:
            return
        out = prep.sampling.max_tokens * prep.sampling.n
        bucket = Bucket(*spec)
        cost = float(len(prep.ids) + out)
        if cost > bucket.capacity:
            e = RequestError(
                f"this request needs {int(cost)} tokens (prompt {len(prep.ids)} + "
                f"max_tokens {prep.sampling.max_tokens} x n {prep.sampling.n}), above this "
                f"tenant's tokens_per_minute of {int(bucket.capacity)}: ask for fewer",
                "max_tokens",
            )
            e.tokenized = len(prep.ids)
            raise e
        v = await self.limiter.admit(prep.tenant, [Charge("tokens", bucket, cost)])
        if not v.allowed:
            wait = max(1, math.ceil(v.retry_after_s))
            self.metrics.inc("pdserve_rate_limited", tenant=prep.tenant, limit="tokens")
            e = RequestError(
                f"tenant {prep.tenant!r} is over its tokens per minute limit; retry after {wait} s",
                None,
                status=429,
                headers={"Retry-After": str(wait)},
                code="rate_limit_exceeded",
            )
            e.tokenized = len(prep.ids)
            raise e
        prep.run.reserved = (bucket, out)
        self.reserved_tokens[prep.tenant] = self.reserved_tokens.get(prep.tenant, 0) + out

    async def charge_tokens(self, tenant: str, tokens: int) -> None:
        """Charge ``tokens`` of work already done (tokenized) to ``tenant``'s tokens bucket,
        however full it is (:meth:`cluster.tenants.RateLimiter.charge`)."""
        spec = self._bucket_specs(tenant).get("tokens")
        if spec is not None and tokens > 0 and tenant != OPERATOR:
            await self.limiter.charge(tenant, "tokens", Bucket(*spec), float(tokens))

    def give_back(self, prep: Prepared) -> None:
        """Return the reserved output tokens the request did not produce (once)."""
        if prep.run.reserved is None:
            return
        bucket, out = prep.run.reserved
        prep.run.reserved = None
        left = self.reserved_tokens.get(prep.tenant, 0) - out
        if left > 0:
            self.reserved_tokens[prep.tenant] = left
        else:
            self.reserved_tokens.pop(prep.tenant, None)
        produced = prep.run.produced
        if out > produced:
            self.spawn(self.limiter.give_back(prep.tenant, "tokens", bucket, out - produced))

    def admit_engines(self, parts: list[tuple[Prepared, RouteHint]], where: Placement) -> None:
        """The engines' admission of routed prompts (``where`` they are computed,
        :meth:`~deployments.ingress.route.RoutePhase.placement`): a prompt kept on its decode
        replica passes the wait bound only (it takes no prefill queue slot); any other passes
        the prefill queue's bounds too and takes a slot (:meth:`admit_prefill`), which in
        colocated mode lasts its whole stream."""
        if where == "decode_local":
            # not spared for reuse: the index knows the prefill replicas' caches, not the
            # decode replica's, where this prompt is computed whole
            if self.check_wait(parts[0][0].tenant, len(parts)):
                self._spared(parts[0][0].tenant)
        else:
            self.admit_prefill(parts)

    def _reused(self, parts: list[tuple[Prepared, RouteHint]], uncached: list[int]) -> bool:
        """Every prompt of the request mostly cached (:func:`controllers.overload.reused`)."""
        least = self.cfg.ingress.overload_spare_reuse
        return all(
            reused(len(prep.ids), n, least) for (prep, _), n in zip(parts, uncached, strict=True)
        )

    def _spared(self, tenant: str, cheap: bool = False) -> None:
        self.overload_spared += 1
        if cheap:
            self.overload_spared_reuse += 1
        self.metrics.inc("pdserve_overload_spared", tenant=tenant)

    def admit_prefill(self, parts: list[tuple[Prepared, RouteHint]]) -> None:
        """Overload control: refuse with 503 and ``Retry-After`` when these prompts would take
        the prefill queue past its bounds (``ingress.max_queued_*_per_replica`` times the
        prefill replicas). The queue is the larger of this ingress's own requests in flight
        at the prefill and what the replicas last reported, so a refusal costs nothing and
        nothing admitted is slowed. Past a bound, a tenant below an equal share of the prompts
        in flight is spared (:func:`controllers.overload.spared`). Admitted prompts count as in
        flight until their prefill returns (:meth:`run_prefill`); no ``await`` between check
        and count."""
        tenant, add_req = parts[0][0].tenant, len(parts)
        tokens = [uncached_tokens(prep, hint) for prep, hint in parts]
        cheap = self._reused(parts, tokens)
        spared_wait = self.check_wait(tenant, add_req, cheap)
        add_tok = sum(tokens)
        if self._overloaded(add_req, add_tok, tenant, cheap) or spared_wait:
            self._spared(tenant, cheap)
        for (prep, _), n in zip(parts, tokens, strict=True):
            prep.run.queued_tokens = n
            self._inflight_by_tenant[prep.tenant] = self._inflight_by_tenant.get(prep.tenant, 0) + 1
        self._inflight_uncached += add_tok
        self.inflight_peak = max(self.inflight_peak, self._inflight_prefill)

    def release_slot(self, prep: Prepared) -> None:
        """``prep`` leaves the prefill queue counted by :meth:`admit_prefill` (once)."""
        if prep.run.queued_tokens is not None:
            self._inflight_uncached -= prep.run.queued_tokens
            prep.run.queued_tokens = None
            left = self._inflight_by_tenant.get(prep.tenant, 0) - 1
            if left > 0:
                self._inflight_by_tenant[prep.tenant] = left
            else:
                self._inflight_by_tenant.pop(prep.tenant, None)

    def check_wait(self, tenant: str, adding: int = 1, cheap: bool = False) -> bool:
        """Overload control in seconds (:mod:`controllers.overload`): refuse with 503 and
        ``Retry-After`` when the requests waiting in the engines (queued, not running, from
        the replicas' reports) over the engines' completion rate pass
        ``ingress.max_expected_wait_s``: the time the queue ahead of a new request takes to
        drain. Running requests do not count: below saturation the completion rate is the
        load, not the capacity, and they made a lone client's request read as a long wait.
        ``tenant`` below its share with ``adding`` more prompts, or a ``cheap`` request (its
        prompts mostly cached), is spared up to ``ingress.overload_spare_factor`` times the
        bound: then True (admitted past it). When the prefill engines keep the tenants' fair
        share (``prefill.scheduler_config.fair_share``), the ceiling of a tenant below its
        share reads the wait ahead of its request under the share: the prefill's waiting
        requests times :func:`controllers.overload.share_ahead`, the decode's whole."""
        bound = self.cfg.ingress.max_expected_wait_s
        if not bound:
            return False
        prefill = self.directories["prefill"].snapshot()
        decode = self.directories["decode"].snapshot()
        rows = {**prefill, **decode}  # an engine counted once
        done = decode or rows  # a request finishes on its decode engine
        now = time.monotonic()
        replicas = frozenset(rows)
        if replicas != self._rate_replicas:
            # capacity changed (a replica started, left, or the pool came up from zero): the
            # rate measured before says nothing of the new capacity, so it starts afresh (and
            # is unknown, so nothing is refused, until it has been measured again)
            self._rate_replicas = replicas
            self._completions = CompletionRate(window_s=self._completions.window_s)
        self._completions.add(now, sum(int(r.get("requests_finished") or 0) for r in done.values()))
        waiting = sum(int(r.get("waiting") or 0) for r in rows.values())
        rate = self._completions.rate()
        wait = expected_wait_s(waiting, rate)
        self.expected_wait_s = wait
        retry = refuse_for(wait, bound)
        if retry is None:
            return False
        assert wait is not None
        factor = self.cfg.ingress.overload_spare_factor
        if cheap and not past_ceiling(wait, bound, factor):
            return True
        what = (
            f"{waiting} requests waiting in the engines, about {wait:.0f} s to drain "
            f"(bound {bound:g} s)"
        )
        fair = self._prefill_fair_share
        if spared(tenant, self._inflight_by_tenant, adding):
            ahead = wait  # without the share, the whole queue is ahead of it
            if fair:
                at_prefill = sum(int(rows[k].get("waiting") or 0) for k in prefill)
                part = share_ahead(tenant, self._inflight_by_tenant, adding)
                ahead = expected_wait_s(waiting - at_prefill * (1.0 - part), rate) or 0.0
            if not past_ceiling(ahead, bound, factor):
                return True
            if fair:
                what += (
                    f"; about {ahead:.0f} s ahead of this request under the tenants' fair "
                    f"share (ceiling {bound * factor:g} s)"
                )
        self.wait_refused += 1
        raise self._overload_error(what, retry)

    @property
    def _prefill_fair_share(self) -> bool:
        """Whether the prefill engines keep the tenants' fair share (their waiting requests
        are served in tenants' turns, not in the flood's order)."""
        sc = self.cfg.prefill.scheduler_config
        return sc is not None and sc.fair_share

    def _overload_error(self, what: str, retry_after_s: int) -> RequestError:
        """The overload 503 (counted), with ``Retry-After``."""
        self.overload_refused += 1
        return RequestError(
            f"overloaded: {what}; retry after {retry_after_s} s",
            None,
            status=503,
            headers={"Retry-After": str(retry_after_s)},
            code="overloaded",
        )

    def _overloaded(self, add_req: int, add_tok: int, tenant: str, cheap: bool = False) -> bool:
        """Raise the overload 503 when ``add_req`` more prompts (``add_tok`` uncached tokens)
        would pass a bound (``add_req=0``: when the request bound is already reached), unless
        ``tenant`` is below its share or the request is ``cheap`` (mostly cached), and the
        bound's ceiling is not passed: then True."""
        ing = self.cfg.ingress
        reports = self.directories["prefill"].snapshot()
        n = max(1, len(reports))
        reported_req = sum(int(r.get("waiting") or 0) for r in reports.values())
        reported_tok = sum(int(r.get("queued_uncached_tokens") or 0) for r in reports.values())
        queued = max(self._inflight_prefill, reported_req)
        tokens = max(self._inflight_uncached, reported_tok)
        cap_req = ing.max_queued_requests_per_replica * n
        cap_tok = ing.max_queued_uncached_tokens_per_replica * n
        passed = []  # (what, past the ceiling) of each bound passed
        factor = ing.overload_spare_factor
        if queued + max(1, add_req) > cap_req:
            what = f"{queued} requests queued at {n} prefill replica(s) (bound {cap_req})"
            passed.append((what, past_ceiling(queued + max(1, add_req), cap_req, factor)))
        if add_tok and tokens > 0 and tokens + add_tok > cap_tok:
            what = f"{tokens} uncached prompt tokens queued at {n} prefill replica(s) (bound {cap_tok})"
            passed.append((what, past_ceiling(tokens + add_tok, cap_tok, factor)))
        if not passed:
            return False
        if not any(past for _, past in passed) and (
            cheap or spared(tenant, self._inflight_by_tenant, max(1, add_req))
        ):
            return True
        raise self._overload_error(passed[0][0], ing.overload_retry_after_s)


def uncached_tokens(prep: Prepared, hint: RouteHint) -> int:
    """The prompt tokens the prefill will compute: all but the best prefix the index saw."""
    return max(0, len(prep.ids) - max((hint.matches or {}).values(), default=0))


def tenancy(cfg: AppConfig, app: str) -> tuple[KeyStore, RateLimiter]:
    """The ingress's key store and rate limiter for ``cfg.tenants`` (Redis where asked)."""
    t = cfg.tenants
    redis_limits = t.limits_backend == "redis" or (
        t.limits_backend == "auto" and cfg.index.backend == "redis"
    )
    client = None
    if t.keys_in_redis or redis_limits:
        import redis.asyncio as aioredis

        timeout = max(0.05, cfg.index.lookup_timeout_s * 5)
        client = aioredis.Redis.from_url(
            cfg.index.redis_url,
            decode_responses=True,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            **cfg.index.redis_credentials("ingress").client_kwargs(),
        )
    hashes = {hash_key(k): v for k, v in cfg.ingress.api_keys.items()}
    hashes.update(t.key_hashes)
    hashes.update({h: OPERATOR for h in t.operator_key_hashes})
    keys = KeyStore(
        hashes,
        file=Path(t.keys_file).expanduser() if t.keys_file else None,
        redis=client if t.keys_in_redis else None,
        app=app,
        cache_s=t.key_cache_s,
    )
    return keys, RateLimiter(client if redis_limits else None, app)
