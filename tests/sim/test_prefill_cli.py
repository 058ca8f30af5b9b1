"""``pdserve sim prefill`` end to end (quick runs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import pdserve.cli  # noqa: F401  (registers the commands)
from pdserve.apps import app

runner = CliRunner()


def test_list_prints_the_scenarios() -> None:
    res = runner.invoke(app, ["sim", "prefill", "--list"])
    assert res.exit_code == 0
    for name in ("sec-spike", "flood", "long-prompts", "musique", "grid-sec-l0.9-c0.25"):
        assert name in res.output


@pytest.mark.slow
def test_quick_run_writes_the_documented_json_and_a_plot(tmp_path: Path) -> None:
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    res = runner.invoke(
        app,
        [
            "sim",
            "prefill",
            "--scenario",
            "sec-spike",
            "--quick",
            "--policies",
            "fcfs,lpm,fairway",
            "--json",
            str(out),
            "--plot",
            str(png),
            "--no-progress",
        ],
    )
    assert res.exit_code == 0, res.output
    assert "simulated" in res.output
    data = json.loads(out.read_text())
    assert data["simulated"] is True and data["scenario"] == "sec-spike-drain"
    fw = data["policies"]["fairway"]
    assert set(fw["ttft"]) == {"all", "calm", "burst", "spike"}
    assert set(fw["ttft"]["all"]) == {"n", "mean", "p50", "p90", "p99", "max"}
    assert isinstance(fw["starved"], bool) and fw["worst_wait_s"] == fw["ttft"]["all"]["max"]
    assert data["six_targets"]["fairway"]["of"] == 6
    assert png.stat().st_size > 1000


@pytest.mark.slow
def test_trace_replay_quick(tmp_path: Path) -> None:
    trace = Path(__file__).resolve().parents[2] / "bench/data/mooncake/synthetic_trace.jsonl"
    res = runner.invoke(
        app,
        [
            "sim",
            "prefill",
            "--trace",
            str(trace),
            "--trace-format",
            "mooncake",
            "--limit",
            "80",
            "--policies",
            "fcfs,fairway",
            "--no-progress",
        ],
    )
    assert res.exit_code == 0, res.output
    assert "mooncake (simulated)" in res.output and "capped" in res.output


def test_bad_input_gives_a_clear_error() -> None:
    res = runner.invoke(app, ["sim", "prefill", "--scenario", "flood", "--policies", "fcfs,nope"])
    assert res.exit_code == 2 and "nope" in res.output
    res = runner.invoke(app, ["sim", "prefill", "--scenario", "nope"])
    assert res.exit_code == 2 and "unknown scenario" in res.output
    res = runner.invoke(app, ["sim", "prefill"])
    assert res.exit_code == 2 and "exactly one" in res.output
