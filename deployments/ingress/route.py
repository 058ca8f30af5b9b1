"""The ``route`` phase: what the prefix index knows of the prompt, as the hint the prefill
router weighs against load (:mod:`deployments.router`), and the one rule that keeps a short
prompt on its decode replica (:func:`controllers.routing.prefill_on_decode`). Also the
operator's ``/v1/pdserve/route``, which explains a routing without running it.
"""

from __future__ import annotations

import time
from typing import Literal

from controllers.routing import prefill_on_decode
from deployments.ingress.request import Prepared
from deployments.ingress.state import IngressState
from deployments.protocol import RouteHint
from deployments.telemetry import child, set_attrs

#: where a request's prompt is computed (:meth:`RoutePhase.placement`)
Placement = Literal["colocated", "decode_local", "pd"]


class RoutePhase(IngressState):
    """The ``route`` phase; a part of :class:`~deployments.ingress.core.IngressCore`."""

    def _init_route(self) -> None:
        #: requests prefilled on their decode replica (conditional disaggregation)
        self.decode_local = 0

    async def route(self, prep: Prepared) -> RouteHint:
        """The index's answer for the prompt, as the prefill router's hint (never raises); kept
        in ``prep.run.hint`` (colocated mode routes the whole request by it). Traced under the
        request's root span when it has one."""
        parent = prep.run.parent
        span = child(self.tracer, "pdserve.route", parent) if parent is not None else None
        t = time.monotonic()
        match = await self.index.match(prep.hashes) if prep.hashes else None
        prep.run.timing["route"] = time.monotonic() - t
        hint = RouteHint(
            prompt_tokens=len(prep.ids),
            matches=None if match is None else match.by_replica,
            expected_output_tokens=min(
                prep.sampling.max_tokens, self.cfg.routing.expected_output_tokens
            ),
            block_hashes=tuple(prep.hashes.get("engine") or next(iter(prep.hashes.values()), ())),
        )
        prep.run.hint = hint
        if span is not None:
            set_attrs(
                span,
                {
                    "policy": self.cfg.routing.policy,
                    "index_answered": hint.matches is not None,
                    "index_best_tokens": max((hint.matches or {}).values(), default=0),
                },
            )
            span.end()
        return hint

    def placement(self, prep: Prepared) -> Placement:
        """Where ``prep``'s prompt is computed: ``colocated`` (one engine does both phases),
        ``decode_local`` (on its decode replica: :func:`controllers.routing.prefill_on_decode`,
        counting the whole prompt as uncached, since the decode replica's cache is not in the
        index) or ``pd`` (a prefill replica, then NIXL to the decode replica)."""
        if self.colocated:
            return "colocated"
        needs_prefill = (
            prep.echo is not None or prep.echo_only or prep.sampling.prompt_logprobs is not None
        )
        threshold = self.cfg.routing.local_prefill_threshold_tokens
        if prefill_on_decode(len(prep.ids), threshold, needs_prefill):
            return "decode_local"
        return "pd"
