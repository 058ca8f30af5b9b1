"""vLLM's outputs as the wire's :class:`~deployments.protocol.EngineChunk`.

The last step inside an engine replica on a request's way back: each ``RequestOutput`` the
runtime yields becomes one chunk (text and token deltas, finish reason, prompt and cached
token counts, the KV hand-off's ``kv_transfer_params``, logprobs as plain data) that Serve
pickles back to the ingress.
"""

from __future__ import annotations

import time
from typing import Any

from deployments.protocol import EngineChunk, EngineRequest, TokenLogprob


def to_chunk(req: EngineRequest, out: Any, t0: float, replica_id: str) -> EngineChunk:
    """One ``RequestOutput`` of ``req`` (started at monotonic ``t0``) from ``replica_id``."""
    c = out.outputs[0]
    ids = tuple(c.token_ids)
    return EngineChunk(
        text=c.text,
        token_ids=ids,
        finish_reason=c.finish_reason,
        stop_reason=c.stop_reason,
        num_prompt_tokens=len(out.prompt_token_ids or req.prompt_token_ids),
        num_cached_tokens=int(out.num_cached_tokens or 0),
        engine_s=time.monotonic() - t0,
        kv_transfer_params=out.kv_transfer_params,
        replica_id=replica_id,
        logprobs=None if c.logprobs is None else _logprobs(ids, c.logprobs),
        prompt_logprobs=None
        if out.prompt_logprobs is None
        else _prompt_logprobs(req.prompt_token_ids, out.prompt_logprobs),
    )


def _position(token_id: int, cands: Any) -> TokenLogprob:
    """One position of vLLM's logprobs (``{token_id: Logprob}``, the token first) as plain data."""
    items = tuple((int(t), lp.decoded_token, float(lp.logprob), lp.rank) for t, lp in cands.items())
    own = cands.get(token_id) if hasattr(cands, "get") else None
    if own is None:
        own = next((lp for t, lp in cands.items() if t == token_id), None)
    return TokenLogprob(
        token_id=int(token_id),
        token=None if own is None else own.decoded_token,
        logprob=None if own is None else float(own.logprob),
        top=items,
    )


def _logprobs(token_ids: tuple[int, ...], lps: Any) -> tuple[TokenLogprob, ...]:
    """A chunk's sample logprobs, one per generated token."""
    return tuple(_position(t, lps[i]) for i, t in enumerate(token_ids))


def _prompt_logprobs(prompt: tuple[int, ...], lps: Any) -> tuple[TokenLogprob | None, ...]:
    """A prompt's logprobs; the first token has none (vLLM's ``None``)."""
    out: list[TokenLogprob | None] = []
    for i, t in enumerate(prompt):
        cands = lps[i] if i < len(lps) else None
        out.append(TokenLogprob(int(t), None, None) if cands is None else _position(t, cands))
    return tuple(out)
