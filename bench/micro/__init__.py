"""Micro-benchmarks of one piece outside any engine: a prefill policy's per-step ordering cost,
the prefix index's ingest and lookups."""
