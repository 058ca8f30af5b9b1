"""``bench kv-pressure``'s core on the shared real engine: under KV pressure an ungated
engine preempts (vLLM's own counter) and a gate at what fits does not, every request
still generating all its tokens. Run under the machine-wide lock."""

from __future__ import annotations

import pytest

from bench.engine.kv_pressure import kv_pressure, rows
from tests.fixtures.vllm_engine import ENGINE_KV_BLOCKS, PdEngine

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def test_a_gate_at_what_fits_avoids_the_preemptions_an_ungated_engine_makes(
    pd_engine: PdEngine,
) -> None:
    pd_engine.configure(prefill_policy="fcfs")
    # 32 requests of 3 prompt blocks (96 of the 128: all admitted) grow into a 6th:
    # 192 blocks wanted
    n, prompt, out = 32, 384, 300
    assert n * -(-(prompt + out) // 128) > ENGINE_KV_BLOCKS
    seen: list[tuple[int, int]] = []
    res = kv_pressure(
        pd_engine.llm,
        [8, n],
        requests=n,
        prompt_tokens=prompt,
        output_tokens=out,
        progress=lambda cap, done, total: seen.append((cap, done)),
    )
    assert not pd_engine.llm.llm_engine.has_unfinished_requests()
    gated, ungated = res["runs"]
    assert gated["gated"] and not ungated["gated"]
    for r in (gated, ungated):
        assert r["generated_tokens"] == n * out  # nothing lost to preemption
        assert r["tokens_per_s"] > 0
    assert gated["in_engine"]["max"] <= 8
    assert ungated["in_engine"]["max"] == n
    assert gated["preemptions"] == 0
    assert ungated["preemptions"] > 0
    assert ungated["vs_ungated"] == 1.0
    assert gated["vs_ungated"] == pytest.approx(gated["tokens_per_s"] / ungated["tokens_per_s"])
    assert seen[-1] == (n, n) and (8, n) in seen
    headers, table = rows(res)
    assert table[1][0] == f"{n} (no gate)" and table[0][-1] == 0


def test_bad_caps_and_counts_are_clear_errors(pd_engine: PdEngine) -> None:
    with pytest.raises(ValueError, match="caps"):
        kv_pressure(pd_engine.llm, [0, 4], requests=4, prompt_tokens=8, output_tokens=2)
    with pytest.raises(ValueError, match="output_tokens"):
        kv_pressure(pd_engine.llm, [4], requests=4, prompt_tokens=8, output_tokens=0)
