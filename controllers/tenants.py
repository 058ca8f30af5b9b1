"""Per-tenant rate limits, pure: the generic cell rate algorithm (GCRA) of a token bucket.

A bucket of ``capacity`` units refilled at ``rate`` units per second is one number, its
*theoretical arrival time* ``tat`` (seconds): the bucket is full when ``tat <= now``, and each
unit taken moves ``tat`` on by ``1 / rate``. A take of ``cost`` units is allowed when the new
``tat`` lies at most ``capacity / rate`` ahead of ``now``. One number per bucket is what makes
the limit cheap to share across ingress replicas: the Redis script in :mod:`cluster.tenants`
runs this same arithmetic on one key per bucket, atomically, on the server's clock.

``refund`` gives units back (a request that asked for ``max_tokens`` and produced fewer), never
beyond a full bucket; ``debit`` takes units for work already done, allowed or not.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Bucket:
    """A token bucket: ``rate`` units per second, at most ``capacity`` units at once."""

    rate: float
    capacity: float

    def __post_init__(self) -> None:
        if not self.rate > 0 or not self.capacity > 0:
            raise ValueError(f"a bucket needs rate > 0 and capacity > 0, not {self}")


@dataclass(frozen=True, slots=True)
class Take:
    """The answer to one take: allowed or not, the bucket's new ``tat``, and when not allowed,
    the seconds after which the same take would be (``retry_after_s``; ``inf`` when the cost
    exceeds the bucket's capacity, so no wait helps)."""

    allowed: bool
    tat: float
    retry_after_s: float


def take(bucket: Bucket, tat: float, now: float, cost: float) -> Take:
    """Take ``cost`` units from ``bucket`` whose state is ``tat`` at time ``now``."""
    if cost > bucket.capacity:
        return Take(False, tat, float("inf"))
    base = max(tat, now)
    new_tat = base + cost / bucket.rate
    ahead = new_tat - now - bucket.capacity / bucket.rate
    if ahead > 1e-9:
        return Take(False, tat, ahead)
    return Take(True, new_tat, 0.0)


def refund(bucket: Bucket, tat: float, now: float, units: float) -> float:
    """The ``tat`` after giving ``units`` back (a full bucket stays full)."""
    return max(now, tat - units / bucket.rate) if tat > now else tat


def debit(bucket: Bucket, tat: float, now: float, units: float) -> float:
    """The ``tat`` after taking ``units`` unconditionally: work already done (a prompt
    tokenized and then refused) is charged even when the bucket is empty, so the tenant waits
    for it. At most one bucket's ``capacity`` is taken at once: one refused request locks its
    tenant out for at most ``capacity / rate`` seconds more."""
    return max(tat, now) + min(units, bucket.capacity) / bucket.rate


def available(bucket: Bucket, tat: float, now: float) -> float:
    """Units that could be taken at ``now``."""
    return min(bucket.capacity, bucket.capacity - (max(tat, now) - now) * bucket.rate)
