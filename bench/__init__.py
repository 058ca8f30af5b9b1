"""Benchmarks and simulators, by kind.

- :mod:`bench.workloads`: what is sent: traces, scenarios and mixes, the project's tokenizer,
  the replay workload of the live benchmarks.
- :mod:`bench.sim`: simulators (every output simulated): one prefill engine, the decode pool,
  the routed cluster, the autoscalers, and the reports built on them.
- :mod:`bench.engine`: measurements on one in-process vLLM engine.
- :mod:`bench.micro`: micro-benchmarks of one piece (a policy's ordering, the prefix index).
- :mod:`bench.live`: measurements of the running app, over HTTP (and, for ``bench pd``,
  Serve handles speaking :mod:`deployments.protocol`).
- :mod:`bench.report`: the STATS summary and the prefill simulator's reports.

The data sets (traces, GSM8K, MuSiQue, ServeGen, the tokenizer) stay in ``bench/data``
(:data:`DATA_DIR`).
"""

from pathlib import Path

#: ``bench/data``: the shipped traces and data sets (package data).
DATA_DIR = Path(__file__).resolve().parent / "data"
