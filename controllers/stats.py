"""Summary statistics shared by every simulator and benchmark report.

``STATS = {"n", "mean", "p50", "p90", "p99", "max"}`` in the values' own unit (seconds for
latencies). Percentiles use numpy's default (linear) interpolation. An empty sample gives
``n = 0`` and ``None`` elsewhere, so a report never invents a number.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

STAT_KEYS = ("n", "mean", "p50", "p90", "p99", "max")


def summarize(values: Iterable[float]) -> dict[str, float | int | None]:
    a = np.asarray(list(values), dtype=np.float64)
    if a.size == 0:
        return {"n": 0, "mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {
        "n": int(a.size),
        "mean": float(a.mean()),
        "p50": float(p50),
        "p90": float(p90),
        "p99": float(p99),
        "max": float(a.max()),
    }
