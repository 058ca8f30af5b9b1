"""The serverless container pool shared by every policy in the decode simulator (simulated).

A pool of ``n_containers`` containers, each holding one engine (colocated) or one
prefill + decode engine pair (pd). A container is *warm* (model loaded), *starting*
(cold start in progress until ``ready_at_s``) or *cold*. A warm container with nothing
outstanding for ``keep_warm_s`` goes cold (its instance is reclaimed, as serverless
platforms do). Dispatching a request to a cold container starts it: ``cold_start_s``
(10 s by default) or ``fast_cold_start_s`` (1 s) for policies with ServerlessLLM-style
fast checkpoint loading. The pool counts cold starts.

Defaults (issue #5): 4 containers, 60 s keep-warm, 10 s / 1 s cold start, one container
warm at t = 0 (the others start cold; the paper does not say; ``warm_at_start`` sets it).
The ServerlessLLM paper reports 10-200x faster loading than a naive loader; 10 s -> 1 s is
the low end of that range for a 3B model.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field


class PoolConfig(BaseModel):
    """Serverless pool parameters (every policy shares them)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    n_containers: int = Field(default=4, ge=1, description="Containers in the pool.")
    keep_warm_s: float = Field(
        default=60.0, ge=0, description="Idle time after which a warm container goes cold (s)."
    )
    cold_start_s: float = Field(default=10.0, ge=0, description="Cold start-up delay (s).")
    fast_cold_start_s: float = Field(
        default=1.0, ge=0, description="Cold start with fast checkpoint loading (s)."
    )
    warm_at_start: int = Field(default=1, ge=0, description="Containers warm at t = 0.")


@dataclass
class ContainerSlot:
    """Warmth bookkeeping of one container (the engines live in the simulator)."""

    index: int
    warm: bool
    ready_at_s: float = 0.0
    last_active_s: float = 0.0
    outstanding: int = 0
    cold_starts: int = 0

    @property
    def starting(self) -> bool:
        return not self.warm and self.ready_at_s > 0.0


class ServerlessPool:
    """Warm/cold state of every container; time is passed in (seconds)."""

    def __init__(self, config: PoolConfig, fast_loading: bool) -> None:
        self.config = config
        self.fast_loading = fast_loading
        self.slots = [
            ContainerSlot(i, warm=i < config.warm_at_start) for i in range(config.n_containers)
        ]

    @property
    def cold_starts(self) -> int:
        return sum(s.cold_starts for s in self.slots)

    def expire(self, now: float) -> None:
        """Turn warm containers idle for ``keep_warm_s`` or more cold."""
        for s in self.slots:
            if s.warm and s.outstanding == 0 and now - s.last_active_s >= self.config.keep_warm_s:
                s.warm = False
                s.ready_at_s = 0.0

    def start(self, index: int, now: float) -> float:
        """Start a cold container; returns the time it becomes warm."""
        s = self.slots[index]
        delay = self.config.fast_cold_start_s if self.fast_loading else self.config.cold_start_s
        s.ready_at_s = max(now + delay, 1e-12)
        s.cold_starts += 1
        return s.ready_at_s

    def ready(self, index: int, now: float) -> None:
        s = self.slots[index]
        s.warm = True
        s.ready_at_s = 0.0
        s.last_active_s = now

    def touch(self, index: int, now: float) -> None:
        self.slots[index].last_active_s = now
