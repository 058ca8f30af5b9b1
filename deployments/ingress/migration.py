"""Stream migration: a decode replica lost mid-stream, and the response goes on.

When the decode replica of a stream under way is lost (its actor died: killed, its node
gone, stopped by Serve after a drain outlasted ``drain_timeout_s``; or its engine failed:
:class:`~engines.refusal.EngineDown`), the ingress sends each unfinished sequence again as
a *continuation*: the prompt plus the tokens the client has, for the tokens still due, to
another decode replica, and the same response goes on from the exact token where it stopped
(NVIDIA Dynamo's ``--migration-limit``; here on by default, ``ingress.migration_limit``).
The walk is in ``docs/design.md`` (step 10) and the choices below in ``docs/operations.md``
(Faults).

What carries over, and how:

- **The prompt's KV.** The continuation is routed as a new prompt: the prefix index finds
  the prefill replica that holds the original prompt (usually the one that prefilled it),
  which computes only the generated tail and hands the KV over NIXL as for any request;
  short tails stay on the decode replica (:func:`controllers.routing.prefill_on_decode`),
  and with no live prefill replica the decode replica computes it all. The continuation is
  work already admitted: it meets no queue bound and the tenant is not charged again.
- **The text.** The ingress makes the migrated sequence's text itself, with vLLM's own
  incremental detokenizer (:class:`SeamText`) primed exactly as the lost engine's was (the
  original prompt, then every token sent): a continuation engine's detokenizer would start
  at the seam, and a token split across it (a multi-byte character) or text the lost engine
  still held back for a stop string would come out differently. Stop strings are the
  ingress's for the same reason (the engine gets none, so one may span the seam);
  ``min_tokens`` counts from the response's start; stop token ids and EOS stay the engine's.
- **Sampling.** ``max_tokens`` and ``min_tokens`` less the tokens sent, ``n`` 1 (each
  sequence of an ``n > 1`` request moves alone and keeps its ``index``). Greedy output is
  the uninterrupted run's. A seeded sequence goes on with :func:`continuation_seed` (vLLM's
  generator state cannot move between engines, so the draw after the seam differs from an
  uninterrupted run's, deterministically). Presence and frequency penalties see only the
  continuation's own output (vLLM takes no earlier output), so a penalised stream is not
  bit-identical across the seam. Structured output is not migrated (its grammar state
  cannot be resumed mid-output): such a stream ends with the error event, and says so.
- **The response.** Its id, ``n`` layout, logprobs (one entry per token, as before),
  usage (prompt tokens once, completion tokens all of them, cached tokens as the first
  engines reported), deadline (migration time counts against it) and the tenant's
  reservation (charged once) are the request's own: a continuation is not a new request.

Bounds: ``ingress.migration_limit`` moves per sequence (0: off), and
``ingress.migration_max_tokens`` (prompt plus tokens sent above it: not moved). A stream not
moved ends as before: an SSE error event naming why, then ``[DONE]`` (a 502 body when not
streamed). Each move is a ``pdserve.migrate`` span in the request's trace, a count in
``pdserve_migrations_total{reason,outcome}`` and the client's stall (last token before the
loss to the first after) in ``pdserve_migration_stall_seconds``.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any

from deployments.ingress.hops import (
    HopsPhase,
    ReplicaLost,
    engine_error,
    local_prefill,
    merge_streams,
    own_stream,
    reason_of,
)
from deployments.ingress.openai_requests import RequestError
from deployments.ingress.request import Prepared, RunState
from deployments.ingress.route import RoutePhase
from deployments.protocol import EngineChunk, Sampling
from deployments.telemetry import child, set_attrs

log = logging.getLogger("deployments.ingress")

#: why a lost stream was not moved (the ``outcome`` of ``pdserve_migrations_total``)
NOT_MOVED = {
    "off": "migration is off (ingress.migration_limit 0)",
    "limit": "it moved ingress.migration_limit times already",
    "too_long": "its sequence is longer than ingress.migration_max_tokens",
    "structured_output": "structured output cannot resume mid-output",
    "deadline": "the request's deadline has passed",
}


@dataclass
class SentSequence:
    """One of a request's ``n`` sequences as the client has it so far."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finished: bool = False
    #: times it moved to another decode replica
    moves: int = 0
    #: the decode replica its last chunk came from
    replica: str | None = None
    #: the decode replicas it was lost on (its continuations avoid them)
    lost: tuple[str, ...] = ()

    def take(self, ch: EngineChunk) -> None:
        self.token_ids += ch.token_ids
        self.text += ch.text
        self.finished = self.finished or ch.finish_reason is not None
        self.replica = ch.replica_id or self.replica


class Ledger:
    """A request's sequences as its chunks go by (what a migration starts from)."""

    def __init__(self, n: int) -> None:
        self.seqs = [SentSequence(i) for i in range(n)]

    def take(self, ch: EngineChunk) -> None:
        self.seqs[ch.index].take(ch)

    def sent_any(self) -> bool:
        return any(s.token_ids or s.text for s in self.seqs)

    def open(self) -> list[SentSequence]:
        return [s for s in self.seqs if not s.finished]


def continuation_seed(seed: int, offset: int) -> int:
    """The seed of a seeded sequence's continuation after ``offset`` tokens: a hash of the
    sequence's own seed (``seed + index`` for sequence ``index``, as vLLM seeds ``n > 1``)
    and the offset, in ``[0, 2**63)``. The same migration point gives the same continuation;
    it is not the draw an uninterrupted run would have made (vLLM's generator state does not
    move between engines)."""
    digest = hashlib.blake2b(f"{seed}:{offset}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & (2**63 - 1)


def continuation_sampling(s: Sampling, seq: SentSequence) -> Sampling:
    """The sampling of ``seq``'s continuation: the tokens still due (``max_tokens`` and
    ``min_tokens`` less those sent), one sequence, its seed moved on
    (:func:`continuation_seed`), no prompt logprobs, and no stop strings (the ingress applies
    them across the seam: :class:`SeamText`)."""
    sent = len(seq.token_ids)
    seed = s.seed if s.params is None else s.params.get("seed")
    seed = None if seed is None else continuation_seed(int(seed) + seq.index, sent)
    left = max(1, s.max_tokens - sent)
    params = None
    if s.params is not None:
        params = dict(s.params)
        params.update(
            max_tokens=left,
            n=1,
            seed=seed,
            stop=None,
            prompt_logprobs=None,
            min_tokens=max(0, int(params.get("min_tokens") or 0) - sent),
        )
    return replace(s, max_tokens=left, n=1, seed=seed, stop=(), prompt_logprobs=None, params=params)


class SeamText:
    """The text of a migrated sequence as its first engine would have made it: vLLM's own
    incremental detokenizer (``IncrementalDetokenizer``: stop strings, the held-back stop
    buffer, ``min_tokens``, special tokens) primed with the original prompt and every token
    already sent, then fed the continuation's tokens. :meth:`take` turns each continuation
    chunk into the client's chunk (its text; cut at a stop string, finished there)."""

    def __init__(self, tokenizer: Any, prompt: tuple[int, ...], s: Sampling, seq: SentSequence):
        from vllm import SamplingParams
        from vllm.v1.engine.detokenizer import IncrementalDetokenizer

        kw = s.params if s.params is not None else s.to_vllm_kwargs()
        keep = (
            "stop",
            "include_stop_str_in_output",
            "min_tokens",
            "skip_special_tokens",
            "spaces_between_special_tokens",
        )
        params = SamplingParams(max_tokens=1, **{k: kw[k] for k in keep if kw.get(k) is not None})
        self.detokenize = kw.get("detokenize", True) is not False
        req = SimpleNamespace(
            request_id="seam",
            sampling_params=params,
            prompt_token_ids=list(prompt),
            prompt_embeds=None,
        )
        self.det = IncrementalDetokenizer.from_new_request(tokenizer, req)  # type: ignore[arg-type]
        self.det.update(list(seq.token_ids), False)
        #: whether replaying the sent tokens gave the text the client has (it should)
        self.replayed = self.det.get_next_output_text(False, True) if self.detokenize else ""
        if self.detokenize and self.replayed != seq.text:
            log.warning("migration: the replayed text differs from the text sent")

    def take(self, ch: EngineChunk) -> EngineChunk:
        """The client's chunk for continuation chunk ``ch``."""
        before = len(self.det.token_ids)
        # an engine stop on a token (EOS, stop_token_ids): vLLM leaves that token's text out
        on_token = ch.finish_reason == "stop" and not isinstance(ch.stop_reason, str)
        stop = self.det.update(list(ch.token_ids), on_token)
        finished = ch.finish_reason is not None or stop is not None
        text = self.det.get_next_output_text(finished, True) if self.detokenize else ""
        if stop is None:
            return replace(ch, text=text)
        kept = len(self.det.token_ids) - before  # tokens after the stop string's are dropped
        return replace(
            ch,
            text=text,
            token_ids=ch.token_ids[:kept],
            logprobs=None if ch.logprobs is None else ch.logprobs[:kept],
            finish_reason="stop",
            stop_reason=stop,
        )


def not_moved(cfg: Any, prep: Prepared, seq: SentSequence) -> str | None:
    """Why ``seq`` of ``prep`` is not moved again (a key of :data:`NOT_MOVED`), or ``None``."""
    if cfg.migration_limit == 0:
        return "off"
    if seq.moves >= cfg.migration_limit:
        return "limit"
    bound = cfg.migration_max_tokens
    if bound is not None and len(prep.ids) + len(seq.token_ids) > bound:
        return "too_long"
    if (prep.sampling.params or {}).get("structured_outputs") is not None:
        return "structured_output"
    if time.monotonic() >= prep.deadline:
        return "deadline"
    return None


class MigrationPhase(RoutePhase, HopsPhase):
    """The decode stream with its migrations; a part of
    :class:`~deployments.ingress.core.IngressCore`."""

    def _init_migration(self) -> None:
        #: moves by outcome: ``migrated`` (the continuation's first chunk came),
        #: ``failed`` (the continuation failed otherwise), or why none was made
        #: (:data:`NOT_MOVED`); by the loss's reason
        self.migrations: dict[str, dict[str, int]] = {}
        #: the last move's stall and its parts (seconds): ``stall_s`` the client's gap from
        #: the last token before the loss to the first after; ``detect_s`` until the loss
        #: reached the ingress; ``prefill_s`` the continuation's prompt on its prefill
        #: replica (0 when its decode replica computed it); ``first_token_s`` the rest
        self.migration_last: dict[str, float] | None = None

    def _count_move(self, reason: str, outcome: str) -> None:
        by = self.migrations.setdefault(reason, {})
        by[outcome] = by.get(outcome, 0) + 1
        self.metrics.inc("pdserve_migrations", reason=reason, outcome=outcome)

    async def decode_chunks(self, prep: Prepared, pre: EngineChunk) -> AsyncIterator[EngineChunk]:
        """The decode replica's chunks, for both response forms (:meth:`decode_call`); when
        that replica is lost after chunks went out, each unfinished sequence goes on on
        another one (:meth:`_moved`), its chunks as the lost replica's would have been."""
        ledger = Ledger(prep.sampling.n)
        try:
            async for ch in self.decode_call(prep, pre):
                ledger.take(ch)
                yield ch
            return
        except ReplicaLost as lost:
            if not ledger.sent_any():  # nothing went out, and the retries are spent
                raise engine_error("decode", prep, lost.error) from None
            loss = lost
        log.warning("decode replica lost mid-stream for %s (%s): migrating", prep.rid, loss.reason)
        lost_on = next((s.replica for s in ledger.seqs if s.replica), None)
        for seq in ledger.open():  # a sequence that had not started was on that replica too
            seq.replica = seq.replica or lost_on
        moved = [self._moved(prep, seq, loss) for seq in ledger.open()]
        chunks = moved[0] if len(moved) == 1 else merge_streams([own_stream(m) for m in moved])
        async for ch in chunks:
            yield ch

    async def _moved(
        self, prep: Prepared, seq: SentSequence, loss: ReplicaLost
    ) -> AsyncIterator[EngineChunk]:
        """``seq``'s rest, from continuations on other decode replicas (again when one of
        those is lost, up to ``ingress.migration_limit``)."""
        stopped_at = prep.run.last_chunk_at or time.monotonic()
        while True:
            why = not_moved(self.cfg.ingress, prep, seq)
            if why is not None:
                self._count_move(loss.reason, why)
                raise RequestError(
                    f"decode failed: {reason_of(loss.error)} (the stream was not moved to "
                    f"another decode replica: {NOT_MOVED[why]})",
                    None,
                    status=502,
                )
            seq.moves += 1
            if seq.replica is not None and seq.replica not in seq.lost:
                seq.lost += (seq.replica,)
            lost_at = time.monotonic()
            span = child(self.tracer, "pdserve.migrate", prep.run.parent)
            set_attrs(
                span,
                {
                    "reason": loss.reason,
                    "sequence": seq.index,
                    "sent_tokens": len(seq.token_ids),
                    "move": seq.moves,
                },
            )
            cont = self._continuation(prep, seq, span)
            seam = SeamText(self.tokenizer.tok, prep.ids, prep.sampling, seq)
            first = True
            try:
                pre = await self._continuation_prefill(cont)
                set_attrs(span, {"prefill_replica": pre.replica_id or "decode"})
                times = {"stopped": stopped_at, "lost": lost_at, "prefilled": time.monotonic()}
                async for ch in self.decode_call(cont, pre):
                    if first:
                        first = False
                        self._moved_in(span, loss.reason, times, ch)
                    out = replace(seam.take(ch), index=seq.index)
                    seq.take(out)
                    prep.run.last_chunk_at = cont.run.last_chunk_at
                    yield out
                    if out.finish_reason is not None:
                        return  # a stop string the ingress found: the continuation is cut
                return
            except ReplicaLost as again:  # the continuation's replica was lost too
                set_attrs(span, {"outcome": "lost_again"})
                loss = again
                stopped_at = prep.run.last_chunk_at or stopped_at
            except RequestError as e:
                if first:
                    self._count_move(loss.reason, "failed")
                    set_attrs(span, {"outcome": "failed", "error": e.message})
                raise
            finally:
                span.end()

    def _moved_in(self, span: Any, reason: str, times: dict[str, float], ch: EngineChunk) -> None:
        """A continuation's first chunk: the move is done; the client's stall measured, with
        its parts (:attr:`migration_last`)."""
        now = time.monotonic()
        last = {
            "stall_s": now - times["stopped"],
            "detect_s": times["lost"] - times["stopped"],
            "prefill_s": times["prefilled"] - times["lost"],
            "first_token_s": now - times["prefilled"],
        }
        self.migration_last = last
        self._count_move(reason, "migrated")
        self.metrics.observe("pdserve_migration_stall_seconds", last["stall_s"])
        set_attrs(span, {"outcome": "migrated", "decode_replica": ch.replica_id, **last})

    def _continuation(self, prep: Prepared, seq: SentSequence, span: Any) -> Prepared:
        """``seq``'s continuation as a request of its own (its own engine id, calls under
        ``span``): the prompt plus the tokens sent, for the rest."""
        ids = prep.ids + tuple(seq.token_ids)
        rid = f"{prep.engine_rid}-m{seq.moves}" + (f"s{seq.index}" if prep.sampling.n > 1 else "")
        return replace(
            prep,
            ids=ids,
            sampling=continuation_sampling(prep.sampling, seq),
            hashes={},  # hashed only when it is routed by the index (_continuation_prefill)
            engine_rid=rid,
            echo=None,
            echo_only=False,
            run=RunState(parent=span, avoid=seq.lost),
        )

    async def _continuation_prefill(self, cont: Prepared) -> EngineChunk:
        """Where the continuation's prompt is computed: a prefill replica the index picks
        (the one holding the original prompt, usually), unless the tail is short enough for
        its decode replica (:meth:`placement`) or no prefill replica is up; a prefill that
        fails then is computed by the decode replica instead (past the deadline: 504)."""
        where = self.placement(cont)
        routed = where == "colocated" or (where == "pd" and self._prefill_up())
        if routed:  # the prompt's blocks, for the index (colocated: the engine holding them)
            cont = replace(cont, hashes=self.index.hashes(cont.ids, cont.salt))
        if where == "colocated":
            await self.route(cont)
        if not routed or where != "pd":
            return local_prefill(cont)
        hint = await self.route(cont)
        try:
            return await self.run_prefill(cont, hint)
        except RequestError as e:
            if time.monotonic() >= cont.deadline:
                raise
            log.warning("continuation prefill failed (%s): its decode replica computes it", e)
            return local_prefill(cont)

    def _prefill_up(self) -> bool:
        """Some prefill replica reports and is not wedged (else the decode replica computes a
        continuation's prompt rather than wait for one to start)."""
        rows = self.directories["prefill"].snapshot()
        return any(not r.get("wedged") for r in rows.values())
