"""Measurements on one in-process vLLM engine (no Serve): a spike per policy, a simulator workload
replayed open loop, KV pressure, a tenant flood. Each engine starts and stops through
:func:`engines.session.llm_session`."""
