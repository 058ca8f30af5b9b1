"""The calls an engine replica answers for a request, and what a finished request leaves.

In a request's path: the ingress's router picks this replica and calls ``prefill`` (a
prefill replica: the prompt, one token, the KV held for the decode side), ``decode`` (a
decode replica: pulls that KV over NIXL and streams the output), ``release_kv`` (a withdrawn
decode call's KV freed early) or ``generate`` (one engine, no transfer). Each becomes vLLM's
prompt and ``SamplingParams`` for the runtime (:mod:`engines.runtime`); each output becomes an
:class:`~deployments.protocol.EngineChunk` (:mod:`.outputs`). When a request leaves the
engine its queue wait goes to the metrics and the policy's admission record to the metrics
and its trace span (``_finish``).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from opentelemetry import trace

from deployments.engine.outputs import to_chunk
from deployments.engine.state import ReplicaState
from deployments.protocol import (
    PREFILL_KV_PARAMS,
    EngineChunk,
    EngineDown,
    EngineRequest,
    engine_extra_args,
)
from deployments.telemetry import extract, set_attrs
from engines.refusal import as_refusal

log = logging.getLogger(__name__)

#: What an engine's waiting phase (vLLM's queued -> first scheduled) holds, per role.
_WAIT_INCLUDES = {
    "prefill": "the prefill queue (Fairway's order)",
    "decode": "TWP's admission wait, then the KV pull over NIXL",
}


class Calls(ReplicaState):
    """The replica's engine calls (see the module docstring)."""

    async def prefill(self, req: EngineRequest) -> EngineChunk:
        """:meth:`_prefill`, counted in ``requests_in_flight`` while it runs."""
        self.first_call = self.first_call or req.request_id
        self.in_flight += 1
        if req.route is not None:  # its prompt's blocks count as held here from now on (the
            # load report, polled every 0.25 s, expires the finished calls' entries)
            self.queued_prefixes.add(
                req.request_id, self.replica_id, req.route.block_hashes, time.time()
            )
        if self._prefills == 0:
            self._busy_since = time.monotonic()
        self._prefills += 1
        try:
            out = await self._prefill(req)
            self.warm = True
            return out
        finally:
            self.queued_prefixes.done(req.request_id, time.time())
            self.in_flight -= 1
            self._prefills -= 1
            if self._prefills == 0:
                self._busy_s += time.monotonic() - self._busy_since

    async def release_kv(self, req: EngineRequest) -> bool:
        """Free now the KV this prefill engine holds for a decode replica to pull, named by
        ``req.kv_transfer_params`` (the prefill's own output), instead of after NIXL's lease.

        Only for a request no decode engine has: the ingress sends it for a decode call that
        it withdrew before any router placed it (:meth:`Ingress._release_unsent`), pinned to
        this replica (``req.route.pin``). Another replica (the pinned one gone, the router
        then picks any) or another engine (``remote_engine_id``) releases nothing. Returns
        whether this engine held the request's KV (it is freed at its next step)."""
        params = req.kv_transfer_params or {}
        pin = req.route.pin if req.route is not None else None
        if self.role != "prefill" or pin != self.replica_id or not params.get("remote_request_id"):
            return False
        held = bool(
            await self.engine.rpc(
                "release_kv", str(params["remote_request_id"]), str(params.get("remote_engine_id"))
            )
        )
        self.kv_released += int(held)
        return held

    async def decode(self, req: EngineRequest) -> AsyncIterator[EngineChunk]:
        """:meth:`_decode`, counted in ``requests_in_flight`` until the stream ends (or is
        cancelled)."""
        self.first_call = self.first_call or req.request_id
        self.in_flight += 1
        sent = 0
        try:
            async for chunk in self._decode(req):
                if self.stream_loss is not None:  # fault injection (tests, benches) only
                    self._lose_stream(req, sent)
                sent += len(chunk.token_ids)
                yield chunk
            self.warm = True
        finally:
            self.in_flight -= 1

    def _lose_stream(self, req: EngineRequest, sent: int) -> None:
        """Raise the armed stream loss (:meth:`.faults.Faults.inject_stream_loss`) for
        ``req`` at its next chunk once it has sent ``sent`` tokens (that chunk is lost, as
        when the engine dies computing it): :class:`EngineDown`; once."""
        armed = self.stream_loss
        if armed is None or len(req.prompt_token_ids) != armed[0] or sent < armed[1]:
            return
        self.stream_loss = None
        raise EngineDown(f"injected: the stream lost after {sent} tokens")

    async def _prefill(self, req: EngineRequest) -> EngineChunk:
        """Run ``req``'s prompt with one output token as NIXL producer; return the last chunk
        (its ``kv_transfer_params`` address the KV blocks held for the decode replica, its
        ``prompt_logprobs`` the prompt's when the request asked).

        The request's whole sampling is checked first against this engine's limits (vLLM's
        own ``SamplingParams.verify``), so parameters the decode engine would refuse are
        refused here, as :class:`~engines.refusal.EngineRefused`, before any work."""
        full = req.sampling.to_vllm_kwargs()
        self._verify(full)
        one = {
            "max_tokens": 1,
            "ignore_eos": True,
            "temperature": 0.0,
            "prompt_logprobs": full.get("prompt_logprobs"),
            "skip_special_tokens": full.get("skip_special_tokens", True),
            "spaces_between_special_tokens": full.get("spaces_between_special_tokens", True),
        }
        last: EngineChunk | None = None
        async for chunk in self._generate(req, one, PREFILL_KV_PARAMS, delta=False):
            last = chunk
        assert last is not None
        self.requests += 1
        self.prompt_tokens += last.num_prompt_tokens
        self.cached_tokens += last.num_cached_tokens
        self.recent_prompts.append(max(0, last.num_prompt_tokens - last.num_cached_tokens))
        return last

    async def _decode(self, req: EngineRequest) -> AsyncIterator[EngineChunk]:
        """Stream ``req``'s output deltas, pulling the prompt's KV with
        ``req.kv_transfer_params`` (or computing it locally when that is ``None``).

        ``n > 1``: sequence 0 pulls the prompt's KV; sequences ``1..n-1`` start once it has
        produced its first token, when the pulled blocks are in this engine's prefix cache, so
        they reuse them instead of another transfer or prefill (their last partial block is
        recomputed). Sequence ``i`` samples with ``seed + i`` (vLLM's parallel sampling).
        Chunks carry their sequence's ``index``."""
        self.requests += 1
        self.prompt_tokens += len(req.prompt_token_ids)
        full = req.sampling.to_vllm_kwargs()
        n = int(full.pop("n", 1) or 1)
        full["prompt_logprobs"] = None
        full["prompt_logprob_token_ids"] = None

        def child(i: int) -> dict[str, Any]:
            kw = dict(full)
            if kw.get("seed") is not None:
                kw["seed"] = int(kw["seed"]) + i
            if kw.get("structured_outputs") is not None:
                kw["structured_outputs"] = copy.deepcopy(kw["structured_outputs"])
            return kw

        if n == 1:
            async for chunk in self._generate(req, child(0), req.kv_transfer_params, delta=True):
                yield chunk
            return
        async for chunk in self._decode_n(req, n, child):
            yield chunk

    async def _decode_n(
        self, req: EngineRequest, n: int, child: Callable[[int], dict[str, Any]]
    ) -> AsyncIterator[EngineChunk]:
        q: asyncio.Queue[Any] = asyncio.Queue()
        done = object()

        async def run(i: int) -> None:
            kv = req.kv_transfer_params if i == 0 else None
            try:
                async for ch in self._generate(req, child(i), kv, delta=True, seq=i):
                    q.put_nowait(replace(ch, index=i))
            except BaseException as e:  # noqa: BLE001 - handed to the consumer
                q.put_nowait(e)
            finally:
                q.put_nowait(done)

        tasks = [asyncio.create_task(run(0))]
        live = 1
        try:
            while live:
                item = await q.get()
                if item is done:
                    live -= 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                if len(tasks) < n:  # sequence 0 has its first token: its KV is local now
                    tasks += [asyncio.create_task(run(i)) for i in range(1, n)]
                    live += n - 1
                yield item
        finally:
            for t in tasks:
                t.cancel()

    async def generate(self, req: EngineRequest) -> AsyncIterator[EngineChunk]:
        """Stream ``req`` without any KV transfer (a single-engine run, for comparisons)."""
        kw = req.sampling.to_vllm_kwargs()
        async for chunk in self._generate(req, kw, None, delta=True):
            yield chunk

    def _verify(self, kwargs: dict[str, Any]) -> None:
        """Raise :class:`EngineRefused` when vLLM would refuse these sampling parameters."""
        from vllm import SamplingParams

        ip = self.engine.input_processor
        try:
            sp = SamplingParams(
                **{**kwargs, "structured_outputs": copy.deepcopy(kwargs.get("structured_outputs"))}
            )
            sp.verify(
                ip.model_config,
                ip.speculative_config,
                ip.structured_outputs_config,
                ip.tokenizer,
            )
        except Exception as e:  # vLLM's refusal of the parameters, or anything else as it is
            raise as_refusal(e) from None

    async def _generate(
        self,
        req: EngineRequest,
        kwargs: dict[str, Any],
        kv_params: dict[str, Any] | None,
        *,
        delta: bool,
        seq: int = 0,
    ) -> AsyncIterator[EngineChunk]:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        t0 = time.monotonic()
        kwargs = dict(kwargs)
        # vLLM's own fields in extra_args are this replica's to set, on every path (sequences
        # 1..n-1, a decode that computes the prompt, colocated, retries)
        extra = engine_extra_args(kwargs.pop("extra_args", None), kv_params)
        try:
            sp = SamplingParams(
                **kwargs,
                output_kind=RequestOutputKind.DELTA if delta else RequestOutputKind.FINAL_ONLY,
                extra_args=extra,
            )
        except Exception as e:  # vLLM's refusal of the parameters, or anything else as it is
            raise as_refusal(e) from None
        prompt: dict[str, Any] = {"prompt_token_ids": list(req.prompt_token_ids)}
        if req.cache_salt:
            prompt["cache_salt"] = req.cache_salt
        rid = f"{self.role}-{req.request_id}" + (f"-{seq}" if seq else "")
        span = None
        if req.trace is not None:  # a traced request: this replica's span under the ingress's
            span = self.tracer.start_span(f"engine.{self.role}", context=extract(req.trace))
            load = self.engine.load
            set_attrs(
                span,
                {
                    "role": self.role,
                    "replica": self.replica_id,
                    "request_id": req.request_id,
                    "sequence": seq,
                    "prompt_tokens": len(req.prompt_token_ids),
                    "kv_transfer": bool(kv_params),
                    "submit.waiting": load.get("waiting"),
                    "submit.queued_uncached_tokens": load.get("queued_uncached_tokens"),
                    "submit.window_tokens": load.get("window_tokens"),
                    "submit.token_load": load.get("token_load"),
                },
            )
        out = None
        try:
            async for out in self.engine.generate(prompt, sp, rid):
                yield to_chunk(req, out, t0, self.replica_id)
        finally:
            self._finish(rid, out, span)

    def _finish(self, rid: str, out: Any, span: Any) -> None:
        """A request left the engine: its queue wait goes to the metrics now; the policy's
        decision at its admission (an engine call: :meth:`_admitted`) goes to the metrics
        and, when traced, to its span, which ends as of now."""
        st = getattr(out, "metrics", None) if out is not None else None
        queued, scheduled = getattr(st, "queued_ts", 0.0), getattr(st, "scheduled_ts", 0.0)
        wait = scheduled - queued if queued and scheduled else None
        if wait is not None:
            self.metrics.observe("pdserve_engine_queue_wait_seconds", wait, role=self.role)
        if self.engine.load.get("policy") is None and span is None:
            return  # vLLM's own scheduler keeps no admission records
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (the replica is going): no record to fetch
            return
        task = loop.create_task(self._admitted(rid, out, span, time.time_ns(), wait))
        self._finishing.add(task)
        task.add_done_callback(self._finishing.discard)

    async def _admitted(self, rid: str, out: Any, span: Any, end_ns: int, wait: Any) -> None:
        adm: dict[str, Any] | None = None
        if self.engine.load.get("policy") is not None:
            try:
                adm = await self.engine.rpc("pop_admission", rid)
            except Exception as e:  # noqa: BLE001 - a record lost, never the request
                log.debug("admission record of %s: %r", rid, e)
        if adm is not None and adm.get("lane"):
            self.metrics.inc("pdserve_fairway_admissions", role=self.role, lane=adm["lane"])
        if span is not None:
            self._end_span(span, out, adm, wait, end_ns)

    def _end_span(
        self, span: Any, out: Any, adm: dict[str, Any] | None, wait: Any, end_ns: int
    ) -> None:
        st = getattr(out, "metrics", None) if out is not None else None
        queued, scheduled = getattr(st, "queued_ts", 0.0), getattr(st, "scheduled_ts", 0.0)
        first = getattr(st, "first_token_ts", 0.0)
        set_attrs(
            span,
            {
                "queue_wait_s": wait,
                "first_token_s": first - queued if queued and first else None,
                "cached_tokens": int(getattr(out, "num_cached_tokens", 0) or 0) if out else None,
                "finished": bool(out is not None and out.finished),
            }
            | {f"admission.{k}": v for k, v in (adm or {}).items()},
        )
        # vLLM's timestamps are monotonic seconds: its waiting and first-token phases as
        # child spans on the wall clock
        to_ns = time.time_ns() - time.monotonic_ns()
        ctx = trace.set_span_in_context(span)
        phases = (
            ("engine.wait", queued, scheduled, _WAIT_INCLUDES[self.role]),
            ("engine.first_token", scheduled, first, "compute up to the first output token"),
        )
        for name, a, b, what in phases:
            if a and b and b >= a:
                ph = self.tracer.start_span(name, context=ctx, start_time=int(a * 1e9) + to_ns)
                ph.set_attribute("pdserve.includes", what)
                ph.end(end_time=int(b * 1e9) + to_ns)
        span.end(end_time=end_ns)
