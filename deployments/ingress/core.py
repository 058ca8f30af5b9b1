"""The ingress's core: one request's phases in order, over the prefill and decode replicas.

:meth:`IngressCore.complete` reads as the request goes:

1. ``prepare`` (:mod:`.prepare`): the tenant (:mod:`.admission`, from the key checked before
   the body was read), validation and bounds (a 4xx naming the field), the chat template and
   the tokenizer (off the event loop for long prompts), the block hashes, the tenant's tokens;
2. ``route`` (:mod:`.route`): which prefill replica holds how much of the prompt (the prefix
   index), as a hint the prefill router weighs against load; or the prompt stays on its
   decode replica (short prompts: :func:`controllers.routing.prefill_on_decode`);
3. ``admit`` (:mod:`.admission`): the engines' queue bounds, now that the uncached tokens
   are known;
4. ``prefill`` (:mod:`.hops`): one output token on the chosen prefill replica (NIXL
   producer), retried on another when its replica died;
5. ``decode`` and ``respond`` (:mod:`.hops`, :mod:`.respond`): the decode replica's stream
   (the decode router picks it by TWP headroom) as SSE or one JSON body; a stream whose
   decode replica is lost mid-way moves to another and goes on (:mod:`.migration`);
6. ``settle`` (:meth:`IngressCore._settle`): whatever the request still holds goes back
   (its unused token reservation, its queue slot, prefill KV no decode took), however it
   ended.

Each phase is a span of the request's trace and a sample of the ingress's phase times
(:mod:`.stats`). The phases are parts (mixins) of one class over one state
(:mod:`.state`), each part initialising the state it owns (``_init_*``) and inheriting the
parts it calls; the walk of a request across modules is in ``docs/design.md``.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from opentelemetry import context as otel_context
from opentelemetry import trace as otel_trace
from opentelemetry.trace import Link, SpanKind

from cluster.tenants import TENANT_PATTERN
from deployments.config import AppConfig, IngressLiveConfig, LiveConfigError, parse_live_config
from deployments.ingress.hops import (
    local_prefill,
    merge_streams,
    no_chunks,
    offset_choices,
    own_serve_request_id,
    own_stream,
    prepend,
)
from deployments.ingress.http_guard import configure as configure_body_guard
from deployments.ingress.migration import MigrationPhase
from deployments.ingress.openai_requests import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    is_batch,
)
from deployments.ingress.prepare import PreparePhase
from deployments.ingress.request import Prepared, Tally
from deployments.ingress.respond import (
    ClosingStreamingResponse,
    SettlingStream,
    error_response,
)
from deployments.ingress.responses_api import ResponsesPhase, ResponsesRequest
from deployments.ingress.route import Placement
from deployments.ingress.stats import finish_span, report
from deployments.ingress.tokenizer import Tokenizer, model_defaults
from deployments.ingress.warmup import HealthPhase
from deployments.prefix import IndexView
from deployments.protocol import EngineChunk, RouteHint
from deployments.router_registry import directory, handle_waits, hold_routing, set_routing
from deployments.telemetry import CounterPublisher, child, extract, metrics, set_attrs, tracer

log = logging.getLogger("deployments.ingress")

TENANT_NAME = re.compile(TENANT_PATTERN)


class IngressCore(PreparePhase, HealthPhase, MigrationPhase, ResponsesPhase):
    """The ingress logic, independent of Serve's decorators (handles are injected).

    ``prefill`` and ``decode`` are Serve deployment handles (or any object with the same
    ``.prefill/.decode/.ready/.stats`` methods returning awaitables / async iterators via
    ``.remote``, and ``.options``). ``app_name`` names the Serve application, whose routers'
    replica directories (:func:`deployments.router_registry.directory`) the index follows;
    ``replica_id`` is this ingress replica's (reported in each non-streamed response's
    ``pdserve`` field with the prefill and decode replicas that served it).
    """

    def __init__(
        self,
        config: dict[str, Any],
        prefill: Any,
        decode: Any,
        app_name: str = "pdserve",
        replica_id: str = "local",
    ) -> None:
        self.cfg = AppConfig.model_validate(config)
        self.app_name = app_name
        self.replica_id = replica_id
        # options() builds each handle's router now, so the directories fill before traffic
        self.prefill = prefill.options()
        self.decode = decode.options()
        self.decode_stream = decode.options(stream=True)
        #: colocated mode: ``decode`` is the one engine deployment, which does both phases
        self.colocated = self.cfg.mode == "colocated"
        self.tokenizer = Tokenizer(str(self.cfg.model.resolved_path()))
        self.defaults = model_defaults(str(self.cfg.model.resolved_path()))
        self.model_name = self.cfg.model.served_name
        self.tracer = tracer(self.cfg.observability.tracing.model_dump(), "ingress")
        self.metrics = metrics()
        self._feed_events = CounterPublisher("pdserve_index_feed_events")
        self.index = IndexView(self.cfg, app_name)
        configure_body_guard(self.cfg.ingress.max_body_bytes, self.cfg.ingress.max_json_depth)
        #: tasks that outlive the request they start from (releases, give-backs, the sandbox)
        self._background: set[asyncio.Task[None]] = set()
        self.directories = {
            "prefill": directory(app_name, "prefill"),
            "decode": directory(app_name, "decode"),
        }
        self._sync_task: asyncio.Task[None] | None = None
        self._synced_version = -1
        self.autoscaling = self.cfg.autoscaling.enabled
        #: where the routers note how long a call waited at its handle (cold starts)
        self.waits = {role: handle_waits(app_name, role) for role in ("prefill", "decode")}
        self.requests = 0
        #: user_config changes applied and refused, and the last refusal
        self.live_applied = 0
        self.live_refused = 0
        self.live_error: str | None = None
        # each part's own state
        self._init_prepare()
        self._init_admission()
        self._init_route()
        self._init_hops()
        self._init_migration()
        self._init_respond()
        self._init_health()
        self._init_stats()

    async def complete(
        self, request: Request, body: CompletionRequest | ChatCompletionRequest | ResponsesRequest
    ) -> Any:
        """``prepare -> route -> prefill -> decode -> respond``; errors are 4xx/5xx bodies.

        A stream's response starts once the decode's first chunk is in, so a refusal or a
        failure before any token is an HTTP status, not an error event inside a 200. However
        the request ends (an answer, an error, a deadline, the client gone), its unused
        token reservation goes back to its tenant and any prefill KV no decode took is
        released (:meth:`_settle`); a stream settles when it closes (:class:`SettlingStream`)."""
        preps: list[Prepared] = []
        try:
            if isinstance(body, CompletionRequest) and is_batch(body.prompt):
                return await self.complete_batch(request, body, preps)
            return await self._complete(request, body, preps)
        finally:
            self._settle(preps)

    async def _complete(
        self,
        request: Request,
        body: CompletionRequest | ChatCompletionRequest | ResponsesRequest,
        preps: list[Prepared],
    ) -> Any:
        self._ensure_started()
        if isinstance(body, ResponsesRequest):
            endpoint = "responses"
        else:
            endpoint = "chat" if isinstance(body, ChatCompletionRequest) else "completions"
        root = self._root_span(request)
        set_attrs(root, {"endpoint": endpoint, "model": self.model_name})
        # 1. prepare: who, what, how many tokens (refused here: nothing was held)
        span = child(self.tracer, "pdserve.prepare", root)
        try:
            prep = await self.prepare(request, body)
        except RequestError as e:
            span.end()
            return self._refused(root, endpoint, e)
        span.end()
        preps.append(prep)  # from here it holds things: settled in complete's finally
        self._begin(prep, root)
        # 2. route: where its prefix is cached, and where its prompt is computed
        hint = await self.route(prep)
        where = self.placement(prep)
        try:
            # 3. admit: the engines' queue and wait bounds
            self.admit_engines([(prep, hint)], where)
            # 4. prefill: on a prefill replica, or the decode engine computes the prompt
            pre = await self.run_prefill(prep, hint) if where == "pd" else local_prefill(prep)
        except RequestError as e:
            return self._failed(prep, e)
        if where == "decode_local":
            self.decode_local += 1
        # 5. decode and respond (a stream settles when it closes)
        return await self._respond([(prep, pre)])

    def _begin(self, prep: Prepared, root: Any) -> None:
        """``prep`` goes on under ``root``, which it ends with its response."""
        prep.run.span = prep.run.parent = root
        set_attrs(
            root,
            {
                "request_id": prep.rid,
                "tenant": prep.tenant,
                "prompt_tokens": len(prep.ids),
                "stream": prep.stream,
                "n": prep.sampling.n,
            },
        )
        self.requests += 1

    async def complete_batch(
        self, request: Request, body: CompletionRequest, preps: list[Prepared]
    ) -> Any:
        """A completions request with several prompts (vLLM accepts them): each prompt is
        prepared, routed (to the prefill replica that holds *its* prefix), prefilled and
        decoded on its own, concurrently; prompt ``k``'s choices are ``k*n .. k*n+n-1``, as
        vLLM numbers them; usage sums the prompts. One trace covers the batch. ``preps``
        collects the prompts prepared, which the caller settles (:meth:`complete`): when one
        prompt fails, the others' reservations go back and their prefills' KV is released."""
        self._ensure_started()
        root = self._root_span(request)
        prompts = list(body.prompt or [])
        cap = self.cfg.ingress.max_batch_prompts
        try:
            if len(prompts) > cap:
                raise RequestError(
                    f"prompt: {len(prompts)} prompts; at most {cap} per request", "prompt"
                )
            tenant = (await self.principal(request)).tenant
            self._check_joint(body, len(prompts), tenant)
            set_attrs(root, {"endpoint": "completions", "batch": len(prompts)})
            for p in prompts:
                sub = body.model_copy(update={"prompt": p})
                preps.append(await self.prepare(request, sub, tenant=tenant))
        except RequestError as e:
            return self._refused(root, "completions", e)
        self.requests += len(preps)
        # one response id; the engines' ids stay apart
        preps[:] = [replace(prep, rid=preps[0].rid) for prep in preps]
        preps[0].run.span = root  # ended once, by the first prompt
        for prep in preps:
            prep.run.parent = root  # every prompt's engine calls are children of the root
        hints = [await self.route(prep) for prep in preps]
        try:
            # a batch's prompts always go through prefill replicas (no decode-local)
            where: Placement = "colocated" if self.colocated else "pd"
            self.admit_engines(list(zip(preps, hints, strict=True)), where)
        except RequestError as e:
            return self._failed(preps[0], e, also=preps[1:])
        if self.colocated:
            return await self._respond([(prep, local_prefill(prep)) for prep in preps])

        async def prefill(prep: Prepared, hint: RouteHint) -> EngineChunk:
            own_serve_request_id()  # this task's calls: this prompt's own request id
            return await self.run_prefill(prep, hint)

        got = await asyncio.gather(
            *(prefill(prep, h) for prep, h in zip(preps, hints, strict=True)),
            return_exceptions=True,
        )
        bad = next((g for g in got if isinstance(g, BaseException)), None)
        if bad is not None:  # the siblings' KV is released as they settle (complete's finally)
            if isinstance(bad, RequestError):
                return self._failed(preps[0], bad, also=preps[1:])
            raise bad
        return await self._respond(list(zip(preps, got, strict=True)))  # type: ignore[arg-type]

    async def _respond(self, parts: list[tuple[Prepared, EngineChunk]]) -> Any:
        """Decode every part (one prompt each) and answer, streamed or as one body."""
        prep0 = parts[0][0]
        n = prep0.sampling.n
        for prep, _ in parts:  # no engine stream for these: their queue slot ends here
            if prep.echo_only:
                self.release_slot(prep)
        streams = [
            offset_choices(no_chunks() if prep.echo_only else self.decode_chunks(prep, pre), k * n)
            for k, (prep, pre) in enumerate(parts)
        ]
        chunks = (
            streams[0] if len(streams) == 1 else merge_streams([own_stream(s) for s in streams])
        )
        if prep0.stream:
            try:
                first = await anext(chunks, None)
            except RequestError as e:
                return self._failed(prep0, e, also=[p for p, _ in parts[1:]])
            except BaseException:
                await chunks.aclose()  # type: ignore[attr-defined]
                raise
            tally = Tally(parts)
            for prep, _ in parts:  # from here the stream settles them, when it closes
                prep.run.stream_owned = True
            sse = self.responses_sse if prep0.responses is not None else self.respond_sse
            body = SettlingStream(
                sse(parts, prepend(first, chunks), tally),
                lambda: self._close_stream(parts, chunks),
            )
            return ClosingStreamingResponse(body, media_type="text/event-stream")
        if prep0.responses is not None:
            return await self.responses_json(parts, chunks)
        return await self.respond_json(parts, chunks)

    async def _close_stream(
        self, parts: list[tuple[Prepared, EngineChunk]], chunks: AsyncIterator[EngineChunk]
    ) -> None:
        """A stream's response ended (done, failed, or the client went, also before its
        first byte): its engine streams end (each decode engine aborts what it still runs),
        its trace ends, and its parts settle (:meth:`_settle`)."""
        try:
            await chunks.aclose()  # type: ignore[attr-defined]
        finally:
            prep0 = parts[0][0]
            if prep0.run.span is not None:  # the client went away mid-stream
                finish_span(prep0.run.span, 499, "client disconnected")
                prep0.run.span = None
            preps = [p for p, _ in parts]
            for p in preps:
                p.run.stream_owned = False
            self._settle(preps)

    def _settle(self, preps: list[Prepared]) -> None:
        """What a request still holds when it ends, given back (each once; a stream's parts
        are settled by the stream when it closes): the tokens reserved and not produced, its
        place in the prefill queue, and the prefill KV that no decode call took."""
        for prep in preps:
            if prep.run.stream_owned:
                continue
            self.give_back(prep)
            self.release_slot(prep)
            pre, prep.run.kv_pending = prep.run.kv_pending, None
            if pre is not None:
                self.release_prefilled(prep.engine_rid, pre)

    def _root_span(self, request: Request) -> Any:
        """The request's root span. A client's W3C ``traceparent`` is linked to it
        (``observability.tracing.client_context: link``, the default), so a client can
        neither force sampling nor choose the trace id; with ``parent`` the span joins the
        client's trace (a gateway you trust sets the header)."""
        client = extract(request.headers)
        if self.cfg.observability.tracing.client_context == "parent":
            return self.tracer.start_span("pdserve.request", context=client, kind=SpanKind.SERVER)
        sc = otel_trace.get_current_span(client).get_span_context()
        links = [Link(sc)] if sc.is_valid else None
        return self.tracer.start_span(
            "pdserve.request", context=otel_context.Context(), kind=SpanKind.SERVER, links=links
        )

    # -- the other routes ----------------------------------------------------------------
    async def health(self) -> JSONResponse:
        """Readiness (open to anyone; see :meth:`HealthPhase.readiness`)."""
        self._ensure_started()
        return await self.readiness()

    async def stats(self, reset: bool = False) -> dict[str, Any]:
        """The operator's ``/v1/pdserve/stats`` (:func:`deployments.ingress.stats.report`)."""
        self._ensure_started()
        return await report(self, reset)

    async def explain(
        self,
        request: Request,
        body: CompletionRequest | ChatCompletionRequest,
        tenant: str,
    ) -> Any:
        """Where a request of ``tenant`` (whose cache namespace the prompt is hashed in) would
        be routed: the index's answer, without running it. An operator route: nothing is
        charged to the tenant."""
        self._ensure_started()
        try:
            if not TENANT_NAME.match(tenant):
                raise RequestError(f"tenant: {tenant[:64]!r} is not a tenant name", "tenant")
            prep = await self.prepare(request, body, charge=False, tenant=tenant)
        except RequestError as e:
            return error_response(e)
        hint = await self.route(prep)
        return {
            "tenant": tenant,
            "prompt_tokens": len(prep.ids),
            "blocks": max((len(h) for h in prep.hashes.values()), default=0),
            "matches": hint.matches,
            "policy": self.cfg.routing.policy,
            "prefill_replicas": sorted(self.directories["prefill"].snapshot()),
        }

    def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "pdserve",
                    "max_model_len": self.cfg.model.max_model_len,
                }
            ],
        }

    def reconfigure(self, user_config: dict[str, Any] | None) -> None:
        """Serve's ``user_config`` of the ingress: routing parameters
        (:class:`~deployments.config.IngressLiveConfig`) for both routers' next decisions and
        the stream migration's bounds for the next migration, no restart. A bad value is refused with the field named (logged, and in
        ``/v1/pdserve/stats`` under ``ingress.live_config``); the old values stay."""
        try:
            live = parse_live_config(IngressLiveConfig, user_config)
            if live.routing is not None:
                old, new = self.cfg.routing, live.routing
                if new.stats_period_s != old.stats_period_s:
                    raise LiveConfigError(
                        "user_config.routing.stats_period_s: Serve's polling period changes "
                        "only with a redeploy (the old values stay)"
                    )
                if (new.policy == "serve_default") != (old.policy == "serve_default"):
                    raise LiveConfigError(
                        f"user_config.routing.policy: {old.policy} -> {new.policy} changes the "
                        "router class, which needs a redeploy (the old values stay)"
                    )
                self.cfg = self.cfg.model_copy(update={"routing": new})
                set_routing(self.app_name, new.model_dump(mode="json"))
            if live.migration is not None:  # the next migration reads them
                ing = self.cfg.ingress.model_copy(update=live.migration.model_dump())
                self.cfg = self.cfg.model_copy(update={"ingress": ing})
        except LiveConfigError as e:
            self.live_error = str(e)
            self.live_refused += 1
            log.error("ingress %s: %s", self.replica_id, e)
            return
        self.live_error = None
        self.live_applied += 1

    def _ensure_started(self) -> None:
        if self._sync_task is None or self._sync_task.done():
            loop = asyncio.get_running_loop()
            self._sync_task = loop.create_task(self._sync_loop())
            if self.sandbox is not None:  # its child starts now, not on a request
                self.spawn(self.sandbox.start())

    async def _sync_loop(self, period_s: float = 0.2) -> None:
        own_serve_request_id(detach=True)  # started from a request, outlives it
        while True:
            await self.sync_index()
            if self.cfg.ingress.warm_up and not self.colocated:
                self._warm_new_pairs()
            feed = self.index.feed  # memory backend: this ingress follows the replicas' events
            if feed is not None:
                for rid, rf in list(feed.replicas.items()):
                    self._feed_events.publish(rf.stats, replica=rid)
                    self._feed_events.publish(rf.tracker.stats, replica=rid)
            await asyncio.sleep(period_s)  # a polling period, not a synchronisation

    async def sync_index(self) -> None:
        """Reconcile the index view with the prefill replicas Serve runs now."""
        d = self.directories["prefill"]
        if d.version != self._synced_version:
            version = d.version
            await self.index.sync(d.snapshot())
            self._synced_version = version

    def inject_routing_hold(self, role: str, seconds: float) -> str:
        """Fault injection (``<role>.fault_injection: true`` only): this ingress's router of
        ``role`` places no call for ``seconds`` (``0`` ends it), as when none of its replicas
        can take one: calls wait at the handle. Returns this ingress replica's id."""
        if role not in ("prefill", "decode"):
            raise ValueError(f"role must be 'prefill' or 'decode', not {role!r}")
        if not self.cfg.engine("prefill" if role == "prefill" else "decode").fault_injection:
            raise PermissionError(f"{role}.fault_injection is off")
        hold_routing(self.app_name, role, float(seconds))
        return self.replica_id
