"""The engine hops: the prefill call, the decode stream, KV releases, retries and deadlines.

A prefill call runs one output token on the routed prefill replica (the NIXL producer) and
is sent again (``ingress.replica_retries``) when its replica died; the decode stream pulls
the KV and yields chunks, sent to another decode replica when its own died before the first
chunk reached the client (after it, the stream migrates: :mod:`.migration`). Every call is bounded by the request's deadline and
``ingress.engine_timeout_s``; a call left behind is cancelled (its engine aborts it). KV a
prefill pinned for a decode that will never come is released at once
(:meth:`HopsPhase.release_prefilled`) rather than at NIXL's lease.

Serve keys its bookkeeping and its cancellation by request id, so calls that are not the
request's own (a batch's prompts, and work that outlives the request) run under ids of their
own (:func:`own_serve_request_id`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from deployments.ingress.admission import AdmissionPhase
from deployments.ingress.openai_requests import RequestError
from deployments.ingress.openai_responses import FINISH_REASONS
from deployments.ingress.request import Prepared
from deployments.protocol import (
    EngineChunk,
    EngineDown,
    EngineRefused,
    EngineRequest,
    RouteHint,
    Sampling,
)
from deployments.telemetry import child, inject, set_attrs

log = logging.getLogger("deployments.ingress")


class HopsPhase(AdmissionPhase):
    """The engine calls of a request; a part of :class:`~deployments.ingress.core.IngressCore`."""

    def _init_hops(self) -> None:
        #: requests answered 504 because their deadline passed (both engines aborted them)
        self.deadline_exceeded = 0
        #: requests sent again after their replica died before the client got anything
        self.replica_retries = {"prefill": 0, "decode": 0}
        #: prefill KV released at once for decode calls withdrawn before any decode replica
        #: took them (:meth:`_release_unsent`): sent, freed by the holder, failed
        self.kv_released = {"sent": 0, "freed": 0, "failed": 0}
        #: serverless: a role's calls waited at its handle while it started from zero
        #: (the ``cold_start`` phase: those waits, taken out of ``prefill``/``decode_first``)
        self.cold_start_waits = {"prefill": 0, "decode": 0}
        self.cold_start_last_s: dict[str, float | None] = {"prefill": None, "decode": None}

    async def run_prefill(self, prep: Prepared, hint: RouteHint) -> EngineChunk:
        """One output token on the routed prefill replica; 502/504 as :class:`RequestError`."""
        span = child(self.tracer, "pdserve.prefill", prep.run.parent)
        try:
            return await self._run_prefill(prep, hint, span)
        finally:
            self.release_slot(prep)

    async def _run_prefill(self, prep: Prepared, hint: RouteHint, span: Any) -> EngineChunk:
        try:
            return await self._prefill_on_a_replica(prep, hint, span)
        except BaseException:  # the call's placements, which _cold_wait takes on success
            rid = prep.engine_rid
            for k in range(self.cfg.ingress.replica_retries + 1):
                self.waits["prefill"].pop(f"{rid}-retry{k}" if k else rid)
            raise
        finally:
            span.end()

    async def _prefill_on_a_replica(
        self, prep: Prepared, hint: RouteHint, span: Any
    ) -> EngineChunk:
        """The prefill call; sent again (``ingress.replica_retries``) when its replica died."""
        req = engine_request(prep, span, route=hint)
        t = time.monotonic()
        attempt = 0
        while True:
            left = prep.deadline - time.monotonic()
            if left <= 0:
                raise self._deadline_error(prep, "prefill")
            by_deadline = left < self.cfg.ingress.engine_timeout_s
            call = self.prefill.prefill.remote(req)
            try:
                pre: EngineChunk = await asyncio.wait_for(
                    call, min(left, self.cfg.ingress.engine_timeout_s)
                )
            except TimeoutError:
                cancel_call(call)  # the replica aborts it: no prefill runs on for nobody
                if by_deadline:
                    raise self._deadline_error(prep, "prefill") from None
                raise RequestError("prefill timed out", None, status=504) from None
            except Exception as e:  # the engine refused (400) or failed: a gateway error
                if _replica_gone(e) and attempt < self.cfg.ingress.replica_retries:
                    attempt += 1  # Serve's router drops the dead replica; another one runs it
                    self.waits["prefill"].pop(req.request_id)
                    req = replace(req, request_id=f"{prep.engine_rid}-retry{attempt}")
                    self._count_retry(prep, "prefill", e)
                    continue
                raise engine_error("prefill", prep, e) from None
            cold = self._cold_wait(prep, "prefill", req.request_id)
            prep.run.timing["prefill"] = time.monotonic() - t - pre.engine_s - cold
            prep.run.timing["prefill_engine"] = pre.engine_s
            set_attrs(
                span,
                {
                    "cold_start_s": cold,
                    "replica": pre.replica_id,
                    "cached_tokens": pre.num_cached_tokens,
                    "engine_s": pre.engine_s,
                    "retries": attempt,
                },
            )
            prep.run.kv_pending = pre if pre.kv_transfer_params else None
            return pre

    def _cold_wait(self, prep: Prepared, role: str, engine_rid: str) -> float:
        """Seconds ``prep``'s call to ``role`` waited at the handle for a replica (a cold
        start: the role was at zero, or its replicas were gone), noted by the router; it goes
        into the request's ``cold_start`` phase and ``pdserve_cold_start_wait_seconds``,
        never into an error (0.0 when it did not wait)."""
        dep = "prefill" if self.colocated else role
        waited = self.waits[dep].pop(engine_rid)
        if waited is None:
            return 0.0
        prep.run.timing["cold_start"] = prep.run.timing.get("cold_start", 0.0) + waited
        self.cold_start_waits[role] += 1
        self.cold_start_last_s[role] = waited
        self.metrics.observe("pdserve_cold_start_wait_seconds", waited, role=role)
        return waited

    def _count_retry(self, prep: Prepared, phase: str, e: BaseException) -> None:
        self.replica_retries[phase] += 1
        self.metrics.inc("pdserve_replica_retries", phase=phase)
        log.warning("%s replica gone for %s (%s): sent again", phase, prep.rid, type(e).__name__)

    def _deadline_error(self, prep: Prepared, phase: str) -> RequestError:
        """The 504 of a request whose deadline passed in ``phase`` (counted)."""
        self.deadline_exceeded += 1
        self.metrics.inc("pdserve_deadline_exceeded", tenant=prep.tenant, phase=phase)
        budget = prep.deadline - prep.t0
        return RequestError(
            f"the request's deadline ({budget:g} s) passed during {phase}",
            None,
            status=504,
            code="deadline_exceeded",
        )

    async def decode_call(self, prep: Prepared, pre: EngineChunk) -> AsyncIterator[EngineChunk]:
        """One decode call's chunks. A replica lost before the call's first chunk sends the
        call again (``ingress.replica_retries``); lost after it, or past the retries, it
        raises :class:`ReplicaLost` (the stream migrates:
        :meth:`~deployments.ingress.migration.MigrationPhase.decode_chunks`). Other engine
        failures and time-outs (``engine_timeout_s`` from the first chunk request, or the
        request's deadline when sooner) raise :class:`RequestError` (502/504); the stream is
        cancelled on the way out, which aborts the request in the decode engine (its KV
        blocks come back)."""
        prep.run.kv_pending = None  # this call takes the KV (or releases it, _release_unsent)
        span = child(self.tracer, "pdserve.decode", prep.run.parent)
        route = RouteHint(
            len(prep.ids),
            None,
            prep.sampling.max_tokens * prep.sampling.n,
            avoid=prep.run.avoid,
        )
        if self.colocated and prep.run.hint is not None:  # the prefix index picks the engine
            route = replace(
                prep.run.hint,
                expected_output_tokens=route.expected_output_tokens,
                avoid=prep.run.avoid,
            )
        dreq = engine_request(prep, span, kv_transfer_params=pre.kv_transfer_params, route=route)
        n_out = 0
        t = time.monotonic()
        stream = self.decode_stream.decode.remote(dreq)
        it = stream.__aiter__()
        now = asyncio.get_running_loop().time()
        left = prep.deadline - time.monotonic()
        by_deadline = left < self.cfg.ingress.engine_timeout_s
        deadline = now + min(left, self.cfg.ingress.engine_timeout_s)
        done = False
        attempt = 0
        cold = 0.0  # seconds the call waited for a decode replica to start
        try:
            while True:
                try:
                    async with asyncio.timeout_at(deadline):
                        ch: EngineChunk = await it.__anext__()
                except StopAsyncIteration:
                    done = True
                    return
                except TimeoutError:
                    if by_deadline:
                        raise self._deadline_error(prep, "decode") from None
                    raise RequestError("decode timed out", None, status=504) from None
                except Exception as e:
                    if (
                        prep.run.first_chunk_at is None
                        and replica_lost(e) is not None
                        and attempt < self.cfg.ingress.replica_retries
                    ):
                        # Nothing reached the client: another decode replica computes the
                        # prompt itself (the dead one may have pulled, and so freed, its KV).
                        attempt += 1
                        self._count_retry(prep, "decode", e)
                        cancel_call(stream)
                        self.waits[self._decode_dep].pop(dreq.request_id)
                        prep.run.local_cached = 0  # that engine's cached tokens are the usage's
                        dreq = replace(
                            dreq,
                            request_id=f"{prep.engine_rid}-retry{attempt}",
                            kv_transfer_params=None,
                        )
                        stream = self.decode_stream.decode.remote(dreq)
                        it = stream.__aiter__()
                        continue
                    why = replica_lost(e)
                    if why is not None:
                        raise ReplicaLost(why, e) from None
                    raise engine_error("decode", prep, e) from None
                prep.run.last_chunk_at = time.monotonic()
                if prep.run.first_chunk_at is None:
                    prep.run.first_chunk_at = prep.run.last_chunk_at
                    if prep.run.local_cached is not None:  # this engine computed the prompt
                        prep.run.local_cached = ch.num_cached_tokens
                    span.add_event("first_token")
                    cold = self._cold_wait(prep, "decode", dreq.request_id)
                    set_attrs(span, {"replica": ch.replica_id, "cold_start_s": cold})
                n_out += len(ch.token_ids)
                waited = prep.run.last_chunk_at - t - ch.engine_s - cold  # outside the engine
                prep.run.timing.setdefault("decode_first", waited)
                prep.run.timing.setdefault("decode_first_engine", ch.engine_s)
                prep.run.timing["decode"] = waited
                if ch.finish_reason is not None and ch.finish_reason not in FINISH_REASONS:
                    raise RequestError(f"decode ended with {ch.finish_reason!r}", None, status=502)
                yield ch
        finally:
            set_attrs(span, {"completion_tokens": n_out, "finished": done})
            span.end()
            self.release_slot(prep)  # colocated: its slot lasted the stream
            if not done:
                cancel_call(stream)
            if prep.run.first_chunk_at is None:  # else _cold_wait took the call's placement
                self._release_unsent(dreq, pre)

    @property
    def _decode_dep(self) -> str:
        return "prefill" if self.colocated else "decode"

    def _release_unsent(self, dreq: EngineRequest, pre: EngineChunk) -> None:
        """The decode call ``dreq`` ended before its first chunk (the client left, a time-out,
        an error). When no router ever placed it (it waited at the handle: decode replicas
        starting from zero, or all full), no decode engine has the request, so none will pull
        or release the prefill's KV pinned for it, which would stay pinned for NIXL's lease
        (30 s). The call is withdrawn (a router will not place it now) and the prefill replica
        that holds the KV is asked to release it at once (:meth:`EngineReplica.release_kv`).
        A call some router placed is left to its decode engine: vLLM's connector tells the
        prefill of a request aborted before its pull, and a release then could free blocks
        that engine is reading."""
        placed = not self.waits[self._decode_dep].withdraw(dreq.request_id)
        if not placed and dreq.kv_transfer_params:
            self.release_prefilled(dreq.request_id, pre)

    def release_prefilled(self, rid: str, pre: EngineChunk) -> None:
        """Ask the prefill replica that holds ``pre``'s KV (pinned to it) to free it now
        rather than at NIXL's lease: no decode engine has the request (its decode call was
        withdrawn, never made: a batch's sibling failed, the client went between the two
        phases). See :meth:`EngineReplica.release_kv`."""
        params = pre.kv_transfer_params
        if not params or not pre.replica_id:
            return
        rel = EngineRequest(
            f"{rid}-release",
            (),
            Sampling(max_tokens=1),
            kv_transfer_params=dict(params),
            route=RouteHint(0, pin=pre.replica_id),
        )
        self.kv_released["sent"] += 1
        self.spawn(self._send_release(rel))

    async def _send_release(self, rel: EngineRequest) -> None:
        # a task of its own, made while serving the request: its call must not share that
        # request's Serve id with the other prompts' releases (a batch releases several at
        # once), which Serve's and our routers' bookkeeping are keyed by (seen: the second
        # release never completed and every later prefill call waited 10-30 s to be placed)
        own_serve_request_id(detach=True)
        call = None
        try:
            call = self.prefill.release_kv.remote(rel)
            freed = await asyncio.wait_for(call, self.cfg.ingress.engine_timeout_s)
        except Exception as e:  # noqa: BLE001 - the lease frees the KV anyway
            cancel_call(call)
            self.kv_released["failed"] += 1
            log.warning("KV release %s: %s", rel.request_id, reason_of(e))
            return
        finally:
            self.waits["prefill"].pop(rel.request_id)
        if freed:
            self.kv_released["freed"] += 1


def engine_request(prep: Prepared, span: Any, **kw: Any) -> EngineRequest:
    """The engine call of ``prep`` under ``span`` (its W3C context travels with it)."""
    return EngineRequest(
        prep.engine_rid, prep.ids, prep.sampling, cache_salt=prep.salt, trace=inject(span), **kw
    )


def local_prefill(prep: Prepared) -> EngineChunk:
    """The stand-in for a prefill's result when the decode (or colocated) engine computes the
    prompt itself: no KV to pull (``kv_transfer_params`` None). ``prep`` is marked so that
    its cached tokens are the ones that engine reports with its first chunk."""
    prep.run.local_cached = 0
    return EngineChunk("", (), None, len(prep.ids), 0, 0.0, kv_transfer_params=None)


def cancel_call(call: Any) -> None:
    """Cancel a Serve call left behind by a time-out (Serve does not on an abandoned await)."""
    cancel = getattr(call, "cancel", None)
    if cancel is not None:
        cancel()


def reason_of(e: BaseException) -> str:
    """The innermost message of an engine error (Ray wraps the replica's exception)."""
    cause = getattr(e, "cause", None) or e.__cause__ or e
    return str(cause).strip().splitlines()[-1][:300] if str(cause).strip() else type(cause).__name__


def cause_of(e: BaseException) -> BaseException:
    """The replica's own exception inside Ray's wrapper."""
    return getattr(e, "cause", None) or e


def _replica_gone(e: BaseException) -> bool:
    """The call failed because its replica died or cannot be reached (not because of the
    request): Ray's actor errors, as Serve raises them to the caller."""
    from ray.exceptions import RayActorError

    return isinstance(e, RayActorError) or isinstance(cause_of(e), RayActorError)


def replica_lost(e: BaseException) -> str | None:
    """Why a decode call's failure is its replica's and not its request's: ``replica_gone``
    (the actor died: killed, its node lost, or stopped by Serve after a drain outlasted
    ``drain_timeout_s``) or ``engine_failed`` (its engine thread or core died:
    :class:`~engines.refusal.EngineDown`); ``None`` for the request's own failures."""
    if _replica_gone(e):
        return "replica_gone"
    if isinstance(cause_of(e), EngineDown) or isinstance(e, EngineDown):
        return "engine_failed"
    return None


class ReplicaLost(Exception):
    """A decode call's replica was lost (``reason``: :func:`replica_lost`) after the call
    sent chunks, or past its retries: the stream migrates or ends with ``error``'s message."""

    def __init__(self, reason: str, error: BaseException) -> None:
        super().__init__(reason)
        self.reason = reason
        self.error = error


def engine_error(phase: str, prep: Prepared, e: BaseException) -> RequestError:
    """An engine's refusal of the request's parameters is a 400 naming the field; any other
    failure a 502."""
    cause = cause_of(e)
    if isinstance(cause, EngineRefused):
        return RequestError(cause.message, cause.param)
    log.warning("%s failed for %s: %s", phase, prep.rid, e)
    return RequestError(f"{phase} failed: {reason_of(e)}", None, status=502)


def own_serve_request_id(detach: bool = False) -> None:
    """Give the current task's Serve calls an internal request id of their own. A handle call
    made while serving a request inherits that request's id, so the prefill (or decode) calls
    of a batch's prompts would share one id, which Serve's and our routers' bookkeeping are
    keyed by (seen: the second call never completed). ``detach``: a task that outlives the
    request it was started from (readiness checks, warm-ups, KV releases, the sync loop):
    Serve cancels a request's child calls, keyed by its id, when the request is cancelled (a
    client's time-out), so those calls must neither carry its id nor be cancelled with it. A
    no-op outside a Serve request."""
    try:
        from ray.serve import context as serve_context
        from ray.serve._private.utils import generate_request_id
    except Exception:  # no Serve: unit tests
        return
    cur = serve_context._serve_request_context.get()
    if cur is not None:
        update: dict[str, Any] = {"_internal_request_id": generate_request_id()}
        if detach:
            update["cancel_on_parent_request_cancel"] = False
        serve_context._serve_request_context.set(replace(cur, **update))


async def own_stream(stream: AsyncIterator[EngineChunk]) -> AsyncIterator[EngineChunk]:
    """``stream``, its Serve calls under their own request id (see
    :func:`own_serve_request_id`); run in its own task, as :func:`merge_streams` does."""
    own_serve_request_id()
    async for ch in stream:
        yield ch


async def offset_choices(stream: AsyncIterator[EngineChunk], by: int) -> AsyncIterator[EngineChunk]:
    """``stream`` with its chunks' choice index moved up by ``by`` (a batch's prompt ``k``)."""
    async for ch in stream:
        yield replace(ch, index=ch.index + by) if by else ch


async def merge_streams(streams: list[AsyncIterator[EngineChunk]]) -> AsyncIterator[EngineChunk]:
    """The chunks of several streams as they come; the first error ends all of them."""
    q: asyncio.Queue[Any] = asyncio.Queue()
    done = object()

    async def pump(s: AsyncIterator[EngineChunk]) -> None:
        try:
            async for ch in s:
                q.put_nowait(ch)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            q.put_nowait(e)
        finally:
            q.put_nowait(done)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    live = len(tasks)
    try:
        while live:
            item = await q.get()
            if item is done:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()


async def prepend(
    first: EngineChunk | None, rest: AsyncIterator[EngineChunk]
) -> AsyncIterator[EngineChunk]:
    if first is not None:
        yield first
    async for ch in rest:
        yield ch


async def no_chunks() -> AsyncIterator[EngineChunk]:
    return
    yield  # an empty async generator
