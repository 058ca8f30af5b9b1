"""Readiness and warm-up: ``/health`` is 200 once both roles have a replica that served a
probe and (``ingress.warm_up``) one request has gone through every prefill -> decode replica
pair, so the NIXL handshakes and the engines' first-use costs are paid before a client's
request; replicas that join later are warmed in the background before the routers send them
traffic.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import Any

from fastapi.responses import JSONResponse

from deployments.ingress.hops import HopsPhase, own_serve_request_id
from deployments.protocol import EngineChunk, EngineRequest, RouteHint, Sampling

log = logging.getLogger("deployments.ingress")


class HealthPhase(HopsPhase):
    """Readiness and warm-up; a part of :class:`~deployments.ingress.core.IngressCore`."""

    def _init_health(self) -> None:
        #: /health: the last answer and when it was made (reused for ingress.health_cache_s),
        #: and the check in flight (concurrent probes wait for the same one)
        self._health: tuple[float, JSONResponse] | None = None
        self._health_task: asyncio.Task[JSONResponse] | None = None
        #: warm-up: (prefill, decode) replica pairs a request has gone through, the task
        #: warming the rest, failures, and seconds per warmed pair
        self._warm: set[tuple[str, str]] = set()
        self._warming: asyncio.Task[None] | None = None
        #: the directories' versions the sync loop last looked for new pairs at
        self._warm_checked: tuple[int, int] | None = None
        self._warm_seq = 0
        self._was_warm = False
        self.warm_up_failures = 0
        self.warm_up_s: list[float] = []

    async def readiness(self) -> JSONResponse:
        """Readiness: 200 once both roles have a replica that served a probe and (with
        ``ingress.warm_up``) one request has gone from every prefill replica to every decode
        replica, so the NIXL handshakes and the engines' first-use costs are paid before the
        first client's request; 503 ``starting`` or ``warming`` before.

        Open to anyone, so cheap: one answer serves every probe for ``ingress.health_cache_s``
        and concurrent probes share one check, so probes cost the engines at most one
        readiness call per role per that many seconds."""
        cached = self._health
        if cached is not None and time.monotonic() - cached[0] < self.cfg.ingress.health_cache_s:
            return cached[1]
        if self._health_task is None or self._health_task.done():
            self._health_task = asyncio.get_running_loop().create_task(self._check_health())
        resp = await asyncio.shield(self._health_task)
        self._health = (time.monotonic(), resp)
        return resp

    async def _check_health(self) -> JSONResponse:
        # shared by every probe that comes while it runs: none of them owns its calls (the
        # first one's time-out would have Serve cancel them under the others)
        own_serve_request_id(detach=True)
        t = self.cfg.ingress.health_timeout_s
        status: dict[str, Any] = {}
        roles = (
            (("prefill", self.prefill),)
            if self.colocated
            else (
                ("prefill", self.prefill),
                ("decode", self.decode),
            )
        )
        at_zero = False
        for role, h in roles:
            if self.autoscaling and not self.directories[role].snapshot():
                # serverless: no replica runs (scaled to zero, or starting). Ready all the
                # same: a request waits for the cold start. No probe either: a probe queued
                # at the handle would start a replica, and the load balancer's probes would
                # keep the pool from ever idling.
                status[role], at_zero = "zero_replicas", True
                continue
            try:
                status[role] = bool(await asyncio.wait_for(h.ready.remote(), t))
            except Exception as e:  # not ready, or not reachable in time
                status[role] = f"not ready: {type(e).__name__}"
        ok = all(v is True or v == "zero_replicas" for v in status.values())
        body: dict[str, Any] = {"status": "ok" if ok else "starting", "engines": status}
        if ok and not at_zero and self.cfg.ingress.warm_up and not self.colocated:
            left = self._pairs_to_warm()
            if left is None or left:
                self._start_warm_up(left or [])
                # once ready, replicas that join later warm in the background: a scale-up
                # must not take the whole endpoint out of its load balancer
                if not self._was_warm:
                    ok = False
                    body["status"] = "warming"
            else:
                self._was_warm = True
            body["warm_up"] = {"pairs_warmed": len(self._warm), "pairs_left": len(left or [])}
        return JSONResponse(body, status_code=200 if ok else 503)

    def _pairs_to_warm(self) -> list[tuple[str, str]] | None:
        """The (prefill, decode) replica pairs no request has gone through yet; ``None``
        while the routers have not listed both roles' replicas."""
        pre = sorted(self.directories["prefill"].snapshot())
        dec = sorted(self.directories["decode"].snapshot())
        if not pre or not dec:
            return None
        current = {(p, d) for p in pre for d in dec}
        self._warm &= current  # pairs of replicas that left
        return sorted(current - self._warm)

    def _warm_new_pairs(self) -> None:
        """Warm the pairs of replicas that joined (the autoscaler's, or Serve's replacement of
        a dead one) before clients' requests reach them (the routers send to warm replicas
        first), without waiting for a /health probe. Looks only when a directory changed since
        the last look, or a warm-up failed (a running warm-up is left to finish first)."""
        versions = (self.directories["prefill"].version, self.directories["decode"].version)
        if versions == self._warm_checked or not (self._warming is None or self._warming.done()):
            return
        left = self._pairs_to_warm()
        if left is not None:  # both roles listed: this set of replicas is taken care of
            self._warm_checked = versions
        self._start_warm_up(left or [])

    def _start_warm_up(self, pairs: list[tuple[str, str]]) -> None:
        if not pairs or (self._warming is not None and not self._warming.done()):
            return
        self._warming = asyncio.get_running_loop().create_task(self._warm_up(pairs))

    async def _warm_up(self, pairs: list[tuple[str, str]]) -> None:
        for p, d in pairs:
            t0 = time.monotonic()
            try:
                await asyncio.wait_for(self._warm_pair(p, d), self.cfg.ingress.engine_timeout_s)
            except Exception as e:  # retried at the next /health or sync-loop look
                self.warm_up_failures += 1
                self._warm_checked = None
                log.warning("warm-up of prefill %s -> decode %s failed: %s", p, d, e)
                continue
            self._warm.add((p, d))
            self.warm_up_s.append(time.monotonic() - t0)

    async def _warm_pair(self, p: str, d: str) -> None:
        """One request of two KV blocks, prefilled on ``p`` and decoded on ``d`` (pinned)
        under a salt of its own, so ``d`` pulls it over NIXL instead of finding it cached.
        Its calls carry an id of their own, detached from the request (a /health probe) that
        started the warm-up: a probe's time-out must not cancel them, and one pair's calls must
        not share an id with the next pair's."""
        own_serve_request_id(detach=True)
        block = self.cfg.hashing.block_size
        vocab = max(16, len(self.tokenizer.tok) - 1)
        ids = tuple(5 + (k * 7) % (vocab - 5) for k in range(2 * block))
        self._warm_seq += 1
        rid = f"warmup-{self._warm_seq}-{self.replica_id}"
        base = EngineRequest(
            rid,
            ids,
            Sampling(max_tokens=2, temperature=0.0, ignore_eos=True),
            cache_salt=f"pdserve-warmup:{p}:{d}",
        )
        try:
            pre: EngineChunk = await self.prefill.prefill.remote(
                replace(base, route=RouteHint(len(ids), None, 2, pin=p))
            )
            dreq = replace(
                base,
                kv_transfer_params=pre.kv_transfer_params,
                route=RouteHint(len(ids), None, 2, pin=d),
            )
            async for _ in self.decode_stream.decode.remote(dreq):
                pass
        finally:  # the routers' placements of both calls (no latency breakdown for these)
            self.waits["prefill"].pop(rid)
            self.waits[self._decode_dep].pop(rid)
