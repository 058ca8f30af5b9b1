"""The autoscaling simulator's profile engine and the ``slo`` policy (issue 43; simulated)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import pdserve.cli  # noqa: F401  (registers the commands)
from bench.sim.autoscale import (
    AlwaysOn,
    SimParams,
    SimRequest,
    Slo,
    Workload,
    pareto_front,
    peak_sizing,
    simulate,
    slo_config,
)
from pdserve.apps import app

# the A6000 / Llama-3.1-8B modelled profile: step 0.005 + 0.00019 c + 1e-8 (c p + c (c+1)/2),
# decode l(B) = 0.024 + 0.0004 max(0, B - 32)
PP = SimParams(engine="profile", cold_start_s=10.0, max_replicas=8)


def step_s(*chunks: tuple[int, int]) -> float:
    return 0.005 + sum(0.00019 * c + 1e-8 * (c * p + c * (c + 1) / 2) for c, p in chunks)


def test_profile_engine_prices_a_prefill_step_and_the_first_decode_step() -> None:
    # one 1,000-token request from zero under slo: the pair starts at 0, ready at 10; one
    # prefill step of 1,000 tokens (0.200005 s), then one decode step at B = 1 (24 ms)
    wl = Workload("one", (SimRequest(0.0, 1000, 40),), 60.0)
    run = simulate(wl, Slo(slo_config(PP), 10.0), PP)
    assert step_s((1000, 0)) == pytest.approx(0.200005)
    assert run.ttft_s[0] == pytest.approx(10.0 + 0.200005 + 0.024)
    assert run.metrics["cold_start_fraction"] == 1.0 and run.metrics["engine"] == "profile"


def test_profile_engine_batches_prompts_in_one_step_and_chunks_past_the_budget() -> None:
    # r0 (1,000 tokens) at 0 starts a step alone (0.200005 s); r1 and r2 (1,000 each) arrive
    # during it and share the next step (2,000 <= 2,048: 0.39501 s), so both finish at
    # 0.595015 and their TTFT is that + one decode step - 0.1 (the simple engine serves
    # them one after the other)
    reqs = (SimRequest(0.0, 1000, 10), SimRequest(0.1, 1000, 10), SimRequest(0.1, 1000, 10))
    run = simulate(Workload("three", reqs, 30.0), AlwaysOn({"prefill": 1, "decode": 1}, 10.0), PP)
    first, both = step_s((1000, 0)), step_s((1000, 0), (1000, 0))
    assert both == pytest.approx(0.39501)
    assert run.ttft_s == pytest.approx(
        [first + 0.024, first + both + 0.024 - 0.1, first + both + 0.024 - 0.1]
    )
    # a 3,000-token prompt takes two steps: 2,048 tokens, then 952 from position 2,048
    big = Workload("big", (SimRequest(0.0, 3000, 10),), 30.0)
    run = simulate(big, AlwaysOn({"prefill": 1, "decode": 1}, 10.0), PP)
    assert run.ttft_s[0] == pytest.approx(step_s((2048, 0)) + step_s((952, 2048)) + 0.024)


def test_profile_engine_decodes_at_the_step_curves_itl() -> None:
    # 64 prompts of 16 tokens: the first prefilled alone, the other 63 in the next step
    # (1,008 tokens) and admitted at its end: then 64 decode together at
    # l(64) = 0.024 + 0.0004 * 32 = 0.0368 s per step (the first few tokens of the first at 24 ms)
    reqs = tuple(SimRequest(0.0, 16, 100) for _ in range(64))
    wl = Workload("batch", reqs, 30.0)
    run = simulate(wl, AlwaysOn({"prefill": 1, "decode": 1}, 10.0), PP)
    assert run.metrics["itl_p99_s"] == pytest.approx(0.0368)
    assert 0.024 < run.metrics["itl_mean_s"] < 0.0368
    assert run.metrics["completed"] == 64


def test_profile_engine_windows_reserve_an_expected_output_not_the_real_one(
    tmp_path: Path,
) -> None:
    # a KV window of 1,000 blocks x 16 = 16,000 tokens; six 200-token prompts, each really
    # generating 2,000 tokens (48 s at 24 ms). Reserving 3,800 output tokens (4,000 a request)
    # fits four: the last two wait for the first ones to finish; reserving 100 fits all six.
    prof = PP.engine_profile().model_copy(update={"kv_blocks": 1000})
    path = tmp_path / "small_kv.json"
    prof.dump(path)
    reqs = tuple(SimRequest(0.0, 200, 2000) for _ in range(6))
    wl = Workload("kv", reqs, 100.0)
    ttft = {}
    for reserve in (3800, 100):
        p = PP.model_copy(update={"profile": str(path), "expected_output_tokens": reserve})
        assert p.window_tokens() == 16000
        run = simulate(wl, AlwaysOn({"prefill": 1, "decode": 1}, 10.0), p, timeline=False)
        ttft[reserve] = np.sort(run.ttft_s)
    assert ttft[3800][3] < 1.0 < 40.0 < ttft[3800][4]
    assert ttft[100][5] < 1.0


def test_always_on_profile_sizing_keeps_decode_in_the_flat_part_of_the_step_curve() -> None:
    # 4 req/s of 100-token outputs (2.4 s each at l_min): 4 * 2.4 = 9.6 sequences in decode;
    # 9.6 / (b0 32 * 0.8) -> 1; at 40 req/s 96 / 25.6 = 3.75 -> 4
    for rate, want in ((4.0, 1), (40.0, 4)):
        reqs = tuple(SimRequest(k / rate, 100, 100) for k in range(int(120 * rate)))
        assert peak_sizing(Workload("flat", reqs, 120.0), PP)["decode"] == want


def test_pareto_front_keeps_the_points_nothing_beats_on_all_three() -> None:
    pts = [
        {"cold_start_fraction": 0.01, "replica_seconds_ratio": 0.9, "ttft_p99_ratio": 1.0},
        {"cold_start_fraction": 0.02, "replica_seconds_ratio": 0.7, "ttft_p99_ratio": 1.2},
        {"cold_start_fraction": 0.02, "replica_seconds_ratio": 0.8, "ttft_p99_ratio": 1.3},
    ]
    assert pareto_front(pts) == pts[:2]


def test_warmup_excludes_the_start_from_requests_and_replica_seconds() -> None:
    reqs = tuple(SimRequest(float(t), 100, 10) for t in range(100))
    wl = Workload("w", reqs, 100.0)
    p = PP.model_copy(update={"warmup_s": 40.0})
    m = simulate(wl, AlwaysOn({"prefill": 1, "decode": 1}, 10.0), p).metrics
    assert m["ttft"]["n"] == 60
    assert m["replica_seconds"] == pytest.approx(2 * 60.0)


def test_cli_runs_the_slo_policy_on_the_profile_engine_with_a_sweep(tmp_path: Path) -> None:
    csv = tmp_path / "tiny.csv"
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    rng = np.random.default_rng(1)
    t = 0.0
    for _ in range(80):
        t += float(rng.exponential(0.5))
        s = int(math.floor(t))
        rows.append(f"2023-11-16 18:{s // 60:02d}:{s % 60:02d}.{int((t % 1) * 1e7):07d},800,30")
    csv.write_text("\n".join(rows) + "\n")
    out = tmp_path / "r.json"
    res = CliRunner().invoke(
        app,
        [
            "sim", "autoscale", "--trace", str(csv), "--policies", "always_on,slo",
            "--engine", "profile", "--warmup", "5", "--slo-ttft-factor", "1.5",
            "--slo-sweep", "0.03:1.5x,0.2:3", "--json", str(out), "--no-progress",
        ],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    assert "SIMULATED" in res.output and "slo goal at 1x" in res.output
    data = json.loads(out.read_text())
    slo = data["policies"]["slo"]
    assert slo["engine"] == "profile" and slo["ttft_p99_ratio"] is not None
    ao99 = data["policies"]["always_on"]["ttft"]["p99"]
    assert slo["config"]["slo"]["ttft_p99_s"] == pytest.approx(1.5 * ao99)
    assert any(k.startswith("prefill:") for k in slo["reasons"])
    sweep = data["slo_sweep"]["1x"]
    assert [p["ttft_p99_target_s"] for p in sweep] == pytest.approx([1.5 * ao99, 3.0])
    assert any(p["on_front"] for p in sweep)
    assert set(data["goal"]["slo"]["met"]["1x"]) == {
        "cold_start_fraction",
        "replica_seconds_ratio",
        "ttft_p99_ratio",
    }


@pytest.mark.parametrize(
    "args",
    [
        ["--engine", "fast"],
        ["--engine", "profile", "--profile", "nope"],
        ["--slo-sweep", "0.03"],
        ["--slo-sweep", "2:1.5x"],
    ],
)
def test_cli_refuses_bad_slo_input(args: list[str]) -> None:
    res = CliRunner().invoke(app, ["sim", "autoscale", "--scenario", "servegen-reason", *args])
    assert res.exit_code != 0
