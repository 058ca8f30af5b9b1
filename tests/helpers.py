"""Small builders shared by the pure tests."""

from __future__ import annotations

from controllers.prefill import PrefillQueueView, PrefillRequestView


def req(
    rid: str,
    *,
    arrival: float = 0.0,
    cached: int = 0,
    uncached: int = 100,
    patience: float = 1.0,
    prompt: int | None = None,
    hashes: tuple[int, ...] = (),
) -> PrefillRequestView:
    return PrefillRequestView(
        request_id=rid,
        arrival_s=arrival,
        prompt_tokens=prompt if prompt is not None else cached + uncached,
        patience_s=patience,
        cached_tokens=cached,
        uncached_tokens=uncached,
        block_hashes=hashes,
    )


def queue(*reqs: PrefillRequestView) -> PrefillQueueView:
    return PrefillQueueView.of(reqs)
