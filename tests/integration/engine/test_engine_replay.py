"""``bench replay``'s core on the shared real engine: a small two-phase workload arrives at
its times, every request is served once per policy, the prompts built from block hashes
share exactly the cached prefix vLLM then reuses, and the simulator's prediction of the
same replay sits beside the measurement. Run under the machine-wide lock."""

from __future__ import annotations

import pytest

from bench.engine.replay import prompt_tokens, replay
from bench.sim.prefill import SimRequest
from bench.workloads.prefill_scenarios import Workload, block_hashes
from tests.fixtures.vllm_engine import ENGINE_BUDGET, ENGINE_KV_BLOCKS, TEST_PROFILE, PdEngine

pytestmark = [pytest.mark.slow, pytest.mark.integration]

BS = 128
DOC = [(7, 3 * BS)]  # a shared document of three full blocks


def _work() -> Workload:
    reqs = []
    for k in range(8):
        phase = "calm" if k < 4 else "spike"
        t = 0.25 * k if k < 4 else 1.0 + 0.05 * k
        # even: a hit (the document, then a unique question); odd: a miss (unique content)
        segs = [*DOC, (1000 + k, 40)] if k % 2 == 0 else [(2000 + k, 500)]
        n = sum(x for _, x in segs)
        reqs.append(SimRequest(f"r{k}", t, n, block_hashes(segs, BS), (phase,)))
    return Workload(
        "replay-test",
        reqs,
        BS,
        ENGINE_KV_BLOCKS,
        ("calm", "spike"),
        (("calm", 0.0, 1.0), ("spike", 1.0, 2.0)),
        warm=(block_hashes(DOC, BS),),
    )


def test_prompts_share_tokens_exactly_where_their_block_hashes_agree() -> None:
    work = _work()
    toks = prompt_tokens(work, vocab=2000)
    assert all(len(toks[r.request_id]) == r.prompt_tokens for r in work.requests)
    assert toks["r0"][: 3 * BS] == toks["r2"][: 3 * BS]  # two hits: the document
    assert toks["r0"][3 * BS :] != toks["r2"][3 * BS :]  # their questions differ
    assert toks["r1"][:BS] != toks["r3"][:BS] and toks["r1"][:BS] != toks["r0"][:BS]


def test_a_replay_serves_every_request_at_its_time_on_the_real_engine(
    pd_engine: PdEngine,
) -> None:
    from controllers.profile import EngineProfile

    prof = EngineProfile.model_validate(TEST_PROFILE)
    work = _work()
    seen: list[tuple[str, int, int]] = []
    res = replay(
        pd_engine.llm,
        work,
        ["fcfs", "fairway"],
        prof,
        kv_blocks=ENGINE_KV_BLOCKS,
        token_budget=ENGINE_BUDGET,
        max_running=32,
        configure=lambda p: pd_engine.configure(prefill_policy=p),
        progress=lambda p, d, n: seen.append((p, d, n)),
    )
    assert res["simulated"] is False and res["sim"]["simulated"] is True
    for policy in ("fcfs", "fairway"):
        got, sim = res["policies"][policy], res["sim"]["policies"][policy]
        assert got["ttft"]["all"]["n"] == 8 and got["unfinished"] == 0
        assert got["ttft"]["calm"]["n"] == 4 and got["ttft"]["spike"]["n"] == 4
        assert min(got["ttft_s"].values()) > 0  # no first token before its arrival
        assert got["wall_s"] >= max(r.arrival_s for r in work.requests)  # open loop
        # the hits reuse the warmed document (three full blocks) in vLLM's own count
        assert all(got["cached_tokens"][f"r{k}"] >= 3 * BS for k in (0, 2, 4, 6))
        assert all(got["cached_tokens"][f"r{k}"] == 0 for k in (1, 3, 5, 7))
        assert sim["ttft"]["all"]["n"] == 8 and sim["unfinished"] == 0
        # every step's chunks were logged: they add up to the tokens vLLM computed
        computed = sum(r.prompt_tokens - got["cached_tokens"][r.request_id] for r in work.requests)
        assert sum(c for _, ch in got["steps"] for c, _ in ch) == computed
        assert all(t > 0 for t, _ in got["steps"])
        assert res["sim_refit"]["policies"][policy]["ttft"]["all"]["n"] == 8
        # the simulator's band holds its own prediction; the coverage counts every cell
        band = res["sim_band"]["policies"][policy]
        lo, hi = band["spike"]["p99"]
        assert lo <= sim["ttft"]["spike"]["p99"] <= hi and lo < hi
        cov = res["sim_band"]["coverage"][policy]
        assert cov["cells"] == 2 * len(band) and cov["inside"] + len(cov["outside"]) == cov["cells"]
    check = res["step_cost_check"]["groups"]
    assert check["all"]["steps"] == check["fcfs"]["steps"] + check["fairway"]["steps"]
    assert check["all"]["steps"] == check["long_context"]["steps"] + check["short_context"]["steps"]
    assert seen[-1] == ("fairway", 8, 8)
    # no targets in the band without LPM (the targets are relative to FCFS and LPM)
    assert res["sim_band"]["six_targets"] is None and res["sim_band"]["rel"] == 0.02
