"""``routing``: the routing of prefill and decode requests."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from controllers.routing import RoutingConfig, RoutingName


class AppRoutingConfig(RoutingConfig):
    """Routing of both roles: the prefill policy of :mod:`controllers.routing`, or Serve's own."""

    policy: RoutingName | Literal["serve_default"] = Field(  # type: ignore[assignment]
        default="prefix_load",
        description="Prefill routing: prefix_load (cache hit weighed against load), "
        "round_robin, least_loaded, prefix_only, or serve_default (Serve's power-of-two "
        "router, the plain baseline; decode then uses it too).",
    )
    stats_period_s: float = Field(
        default=0.25,
        gt=0,
        le=0.5,
        description="How often each engine replica reports its load to the routers "
        "(request_routing_stats_period_s).",
    )
    expected_output_tokens: int = Field(
        default=64,
        ge=1,
        description="Output tokens a request is expected to take when choosing a decode "
        "replica by TWP headroom (min with its max_tokens).",
    )
