"""What spans replicas: block hashing, the global prefix index, the KV-event feed.

- :mod:`cluster.hashing`: ``BlockHasher`` (vLLM-equal chained block hashes), ``HashConfig``,
  ``HashMode``, ``check_alignment``.
- :mod:`cluster.index`: the async ``PrefixIndex`` interface, ``IndexConfig``, the in-memory
  backend, ``make_index``, ``match_within`` (the router's hot-path call).
- :mod:`cluster.redis_index`: the Redis backend and its key layout.
- :mod:`cluster.events` / :mod:`cluster.feed`: vLLM KV-event decoding, per-replica trackers, the
  ZMQ feed that keeps the index. :mod:`cluster.probe`: the start-up hash check.

Nothing here imports vLLM or torch; Redis and ZMQ are imported only by the modules that use them.
"""
