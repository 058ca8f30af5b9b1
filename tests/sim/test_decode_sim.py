"""Decode simulator: step model, chunking, KV and preemption, pool, determinism, CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from bench.sim.decode import DecodeSimConfig, simulate, summarize_result
from bench.sim.profiles import load_profile
from bench.sim.serverless_pool import PoolConfig
from bench.workloads.decode import DecodeRequest, synthetic
from controllers.profile import EngineProfile

PROF = load_profile("v100_llama32_3b")
WARM = PoolConfig(n_containers=1, warm_at_start=1)


def one(prompt: int, out: int, t: float = 0.0, rid: str = "x") -> DecodeRequest:
    return DecodeRequest(rid, "t0", t, prompt, out, 256)


def cfg(mode: str = "colocated", **kw: object) -> DecodeSimConfig:
    return DecodeSimConfig.model_validate({"mode": mode, "pool": WARM, **kw})


def test_twp_chunks_prefill_in_c_tokens_per_step_baselines_in_one() -> None:
    l_min, per_tok = PROF.decode.l_min_s, PROF.step_cost.per_token_s
    req = [one(800, 5)]
    twp = simulate(PROF, "twp", req, cfg())
    fcfs = simulate(PROF, "fcfs", req, cfg())
    chunks = math.ceil(800 / 64)
    expect_twp = (chunks - 1) * (l_min + 64 * per_tok) + l_min + (800 - 64 * 12) * per_tok
    assert twp.ttft[0] == pytest.approx(expect_twp)
    assert fcfs.ttft[0] == pytest.approx(l_min + 800 * per_tok)
    # after the first token each remaining token takes one decode step at l(1) = l_min
    assert fcfs.e2e[0] - fcfs.ttft[0] == pytest.approx(4 * l_min)


def test_eq1_ttft_is_the_cold_start_plus_the_steps_from_admission() -> None:
    """The TWP paper's Eq. (1): a request arriving mid-step is admitted at the next step's
    start; its Eq. (1) TTFT is that one step, its TTFT from arrival adds the rest of the
    step in flight. A cold container's delay enters both."""
    l_min, per_tok = PROF.decode.l_min_s, PROF.step_cost.per_token_s
    reqs = [one(16, 50, t=0.0, rid="a"), one(800, 5, t=0.001, rid="b")]
    res = simulate(PROF, "fcfs", reqs, cfg())
    first_step = l_min + 16 * per_tok  # a's prefill; b arrives during it
    b_step = PROF.decode.step_latency_s(1) + 800 * per_tok  # a decodes, b prefills
    assert res.ttft_eq1[1] == pytest.approx(b_step)
    assert res.ttft[1] == pytest.approx(first_step - 0.001 + b_step)
    assert res.ttft_eq1[0] == pytest.approx(res.ttft[0]) == pytest.approx(first_step)
    # TWP chunks b over ceil(800 / 64) steps: Eq. (1) counts each of them
    twp = simulate(PROF, "twp", [one(800, 5)], cfg())
    assert twp.ttft_eq1[0] == pytest.approx(twp.ttft[0])
    cold = cfg(pool=PoolConfig(n_containers=1, warm_at_start=0))
    res = simulate(PROF, "fcfs", [one(16, 2)], cold)
    assert res.cold_starts == 1 and res.ttft_eq1[0] == pytest.approx(res.ttft[0])
    assert res.ttft_eq1[0] > 10.0  # cs_i: the cold start it waited for


def test_itl_follows_the_batch_model_beyond_b0() -> None:
    reqs = [one(16, 40, rid=f"r{i}") for i in range(12)]
    res = simulate(PROF, "fcfs", reqs, cfg())
    expected = PROF.decode.l_min_s + PROF.decode.alpha_s * (12 - PROF.decode.b0)
    assert max(res.itl) == pytest.approx(expected)
    assert res.completed == 12 and res.generated_tokens == 12 * 40


def test_pd_ttft_is_prefill_plus_transfer_plus_one_decode_step() -> None:
    c = cfg("pd")
    res = simulate(PROF, "fcfs", [one(512, 3)], c)
    sc = PROF.step_cost
    prefill = sc.fixed_s + sc.per_token_s * 512
    transfer = 32 * c.block_bytes / c.kv_link_bytes_per_s
    first = PROF.decode.l_min_s + c.pd_inject_s_per_block * 32
    assert res.ttft[0] == pytest.approx(prefill + transfer + first)


def test_kv_exhaustion_preempts_and_everything_still_completes() -> None:
    reqs = [one(200, 150, t=0.01 * i, rid=f"r{i}") for i in range(30)]
    small = cfg(kv_blocks=300)
    fcfs = simulate(PROF, "fcfs", reqs, small)
    twp = simulate(PROF, "twp", reqs, small)
    assert fcfs.preemptions > 0
    assert fcfs.completed == twp.completed == 30
    assert twp.preemptions < fcfs.preemptions  # the KV guard and window hold work back


def test_cold_start_delay_and_fast_loading() -> None:
    cold = cfg(pool=PoolConfig(n_containers=2, warm_at_start=0))
    slow = simulate(PROF, "fcfs", [one(16, 2)], cold)
    fast = simulate(PROF, "serverlessllm", [one(16, 2)], cold)
    assert slow.cold_starts == fast.cold_starts == 1
    assert 10.0 < slow.ttft[0] < 10.2
    assert 1.0 < fast.ttft[0] < 1.2


def test_keep_warm_expiry_makes_a_later_request_cold() -> None:
    pool = PoolConfig(n_containers=1, warm_at_start=1, keep_warm_s=60)
    reqs = [one(16, 2, t=0.0, rid="a"), one(16, 2, t=30.0, rid="b"), one(16, 2, t=200.0, rid="c")]
    res = simulate(PROF, "fcfs", reqs, cfg(pool=pool))
    assert res.cold_starts == 1
    assert res.ttft[1] < 1.0 and res.ttft[2] > 10.0


def test_pd_twp_holds_at_the_router_under_overload() -> None:
    reqs = synthetic("high", 40.0, 0, 10.0)  # far beyond one container's capacity
    res = simulate(PROF, "twp", reqs, cfg("pd"))
    assert res.held_at_router > 0
    assert res.completed == len(reqs)
    fcfs = simulate(PROF, "fcfs", reqs, cfg("pd"))
    assert max(res.itl) < max(fcfs.itl)


def test_deterministic_for_a_seed() -> None:
    reqs = synthetic("burst", 10.0, 3, 15.0)
    c = DecodeSimConfig(mode="colocated")
    for p in ("twp", "round_robin"):
        a = summarize_result(simulate(PROF, p, reqs, c))
        b = summarize_result(simulate(PROF, p, reqs, c))
        assert a == b
    assert synthetic("burst", 10.0, 3, 15.0) == reqs
    assert synthetic("burst", 10.0, 4, 15.0) != reqs


def test_profile_json_round_trips_and_is_the_papers_reading() -> None:
    assert PROF.decode.b0 == 8 and PROF.decode.l_min_s == pytest.approx(0.043)
    assert EngineProfile.model_validate_json(PROF.model_dump_json()) == PROF


def test_cli_writes_simulated_json_and_table(tmp_path: Path) -> None:
    from pdserve.cli import app

    out = tmp_path / "r.json"
    r = CliRunner().invoke(
        app,
        [
            "sim",
            "decode",
            "--scenario",
            "low",
            "--quick",
            "--runs",
            "1",
            "--policies",
            "fcfs,twp",
            "--json",
            str(out),
        ],
    )
    assert r.exit_code == 0, r.output
    assert "SIMULATED" in r.output and "twp" in r.output
    data = json.loads(out.read_text())
    assert data["simulated"] is True and data["mode"] == "colocated"
    block = data["policies"]["twp"]
    assert set(block) >= {
        "ttft",
        "e2e",
        "itl",
        "throughput_rps",
        "throughput_tps",
        "cold_starts",
        "preemptions",
    }
    assert set(block["itl"]) == {"mean", "p99", "cv"}
    assert block["ttft"]["n"] > 0


def test_cli_rejects_bad_input_naming_the_option() -> None:
    from pdserve.cli import app

    r = CliRunner().invoke(app, ["sim", "decode", "--scenario", "low", "--policies", "nope"])
    assert r.exit_code != 0 and "--policies" in r.output
    r = CliRunner().invoke(app, ["sim", "decode"])
    assert r.exit_code != 0 and "--scenario" in r.output


def test_cli_twp_overrides_are_validated() -> None:
    from pdserve.cli import app

    r = CliRunner().invoke(
        app, ["sim", "decode", "--scenario", "low", "--quick", "--twp", "gamma=7"]
    )
    assert r.exit_code != 0 and "--twp" in r.output and "gamma" in r.output
    r = CliRunner().invoke(app, ["sim", "decode", "--scenario", "low", "--twp", "oops"])
    assert r.exit_code != 0 and "key=value" in r.output
