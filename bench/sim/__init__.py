"""Simulators (every output simulated): one prefill engine, the serverless decode pool, the routed
cluster, the autoscalers, the tenant flood, the trade-off sweep and the fidelity report; and
the engine profiles they run on."""
