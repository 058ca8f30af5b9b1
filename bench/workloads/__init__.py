"""What the benchmarks send: trace loaders, scenarios and mixes, the project's tokenizer, and the
replay workload of the live benchmarks (no engine, no HTTP)."""
