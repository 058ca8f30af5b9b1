"""``pdserve bench replay-band``: the simulator's band for a stored replay, from its file.

The "measured" block here is the simulator's own prediction (a stand-in for the engine's
figures: what is tested is the rebuild, the band and the coverage, not the engine)."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

import pdserve.cli  # noqa: F401  (registers the commands)
from bench.report.prefill import policy_report
from bench.sim.prefill import EngineConfig, simulate
from bench.sim.profiles import load_profile
from bench.workloads.prefill_scenarios import build_scenario
from pdserve.apps import app

runner = CliRunner()


def _stored(tmp_path: Path) -> Path:
    prof = load_profile("cpu2core_vllm032_bench")
    work = build_scenario("sec-spike-paper", seed=3, quick=True, profile=prof)
    cfg = EngineConfig(token_budget=2048, max_running=64, block_size=work.block_size)
    sim = {
        pol: policy_report(
            simulate(work.requests, pol, prof, work.cache_blocks, config=cfg, warm=work.warm),
            list(work.keys),
        )
        for pol in ("fcfs", "lpm", "fairway")
    }
    res = {
        "scenario": "sec-spike-paper",
        "seed": 3,
        "requests": len(work.requests),
        "kv_blocks": work.cache_blocks,
        "token_budget": 2048,
        "profile_used": prof.model_dump(mode="json"),
        "policies": sim,  # stand-in for the engine's measurements
        "sim": {"simulated": True, "policies": sim},
    }  # no "quick": a replay stored before stop 35; the request count picks the form
    path = tmp_path / "replay.json"
    path.write_text(json.dumps(res))
    return path


def test_a_stored_replay_gets_its_band_without_an_engine(tmp_path: Path) -> None:
    path = _stored(tmp_path)
    out = tmp_path / "out.json"
    res = runner.invoke(
        app, ["bench", "replay-band", "--json", str(path), "--out", str(out), "--band", "0.03"]
    )
    assert res.exit_code == 0, res.output
    assert "simulated, step cost +/-3%" in res.output
    got = json.loads(out.read_text())
    band = got["sim_band"]
    assert band["simulated"] is True and band["rel"] == 0.03
    for pol in ("fcfs", "lpm", "fairway"):
        cov = band["coverage"][pol]
        # the stand-in measurements are the prediction at the stored profile, which the
        # band holds by construction: every cell inside, when the rebuild is the same
        assert cov["inside"] == cov["cells"] == 8, cov
        lo, hi = band["policies"][pol]["spike"]["p99"]
        assert lo < got["policies"][pol]["ttft"]["spike"]["p99"] * 1.0001 and lo < hi
    assert band["six_targets"] is not None
    assert all(lo <= hi for lo, hi in band["six_targets"].values())


def test_a_file_that_is_not_a_replay_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"scenario": "sec-spike-paper"}))
    res = runner.invoke(app, ["bench", "replay-band", "--json", str(bad)])
    assert res.exit_code == 2 and "not a `bench replay --json` result" in _flat(res.output)
    path = _stored(tmp_path)
    data = json.loads(path.read_text())
    data["requests"] += 1  # not what the scenario builds at this profile
    path.write_text(json.dumps(data))
    res = runner.invoke(app, ["bench", "replay-band", "--json", str(path)])
    assert res.exit_code == 2 and "does not give the replay's" in _flat(res.output)


def _flat(text: str) -> str:
    """The CLI's error text without rich's box and line wrapping."""
    return " ".join(text.replace("│", " ").split())
