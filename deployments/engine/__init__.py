"""The engine replicas: a vLLM engine, prefill or decode role, behind a Serve deployment.

One class serves both roles (:class:`EngineReplica`); ``role`` decides the NIXL ``kv_role``
and the call it answers: ``prefill`` runs the prompt with one output token as
``kv_producer`` and returns the chunk whose ``kv_transfer_params`` let the decode replica
pull the KV over NIXL; ``decode`` runs as ``kv_consumer`` with those parameters and streams
token deltas. The engine itself runs under one of two runtimes, which never touch Serve
(:mod:`engines.runtime`).

The modules, by concern:

- :mod:`.replica`: the Serve class, its start-up and shutdown;
- :mod:`.calls`: the calls of a request (``prefill``, ``decode``, ``release_kv``,
  ``generate``) and what a finished request leaves (queue wait, admission record, spans);
- :mod:`.outputs`: vLLM's outputs as the wire's ``EngineChunk``;
- :mod:`.reports`: the routers' load report, the autoscaler's metrics, ``stats``;
- :mod:`.live_config`: TWP's calibration at start, Serve's ``user_config`` while serving;
- :mod:`.health`: ready once it has served a probe end to end; wedge detection;
- :mod:`.faults`: fault injection for the fault tests;
- :mod:`.index_writer`: the replica's KV events, hash probe and Redis index feed;
- :mod:`.counters`: what vLLM's stat loggers feed (counters, metrics);
- :mod:`.identity`: the replica's Serve identity, node address and free ports;
- :mod:`.state`: the attributes the concerns share.

How the runtimes came to be as they are (the AsyncLLM crash of issue 14):
``docs/design/engine-history.md``.
"""

from deployments.engine.replica import EngineReplica

__all__ = ["EngineReplica"]
