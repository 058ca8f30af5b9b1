"""``pdserve profile``'s measurement on the shared real engine (small sizes): the steps it
fits include tails on cached heads, read from vLLM's own cached-token count, and a step
of four hits at once. Run under the machine-wide lock."""

from __future__ import annotations

import pytest

from engines.profiler import profile_engine
from tests.fixtures.vllm_engine import ENGINE_BUDGET, PdEngine

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def test_the_profile_times_tails_on_cached_heads_and_hits_batched_in_one_step(
    pd_engine: PdEngine, tiny_model_dir
) -> None:
    pd_engine.configure(prefill_policy="fcfs")
    pd_engine.llm.reset_prefix_cache()
    prof, raw = profile_engine(
        pd_engine.llm,
        tiny_model_dir,
        prompt_tokens=(128, 512),
        batches=(1, 4),
        decode_steps=4,
        repeats=1,
    )
    # tails of 128 and 512 on cached heads of 512, 1,024 and 2,048 (the engine's 4,096
    # max length leaves out the 4,096 head): vLLM reported each head as cached
    heads = {p for _, p in raw["context_chunks"]}
    assert {512, 1024, 2048} <= heads
    # four hits on four cached 2,048-token heads went through in one step, each a tail of
    # a quarter of the token budget
    assert raw["hit_steps"], "no step held the four hits at once"
    for chunks, step_s in raw["hit_steps"]:
        assert chunks == [[ENGINE_BUDGET // 4, 2048]] * 4 and step_s > 0
    assert prof.step_cost.per_token_s > 0 or prof.step_cost.attn_per_ctx_token_s > 0
    assert prof.prefill.seconds[0] <= prof.prefill.seconds[1]
    pd_engine.llm.reset_prefix_cache()
