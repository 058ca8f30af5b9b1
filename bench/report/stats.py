"""The STATS summary every report uses; it lives in :mod:`controllers.stats` so that the
serving layer (the ingress's own counters) can use it without importing ``bench``."""

from controllers.stats import STAT_KEYS, summarize

__all__ = ["STAT_KEYS", "summarize"]
