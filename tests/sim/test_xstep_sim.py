"""fairway_xstep in the prefill simulator: the cross-step bound on the engine's own loop,
against the paper's Fairway on a small flood, and the ``pdserve sim tradeoff`` command."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import pdserve.cli  # noqa: F401  (registers the commands)
from bench.report.prefill import policy_report
from bench.sim.prefill import EngineConfig, SimRequest, StepResult, simulate
from bench.sim.profiles import load_profile
from controllers.prefill import PrefillQueueView, make_prefill_policy
from controllers.prefill.xstep import FairwayXStep, XStepConfig
from pdserve.apps import app

PROFILE = load_profile("a6000_llama31_8b")
BS = 16
DOC = tuple(range(1, 1 + 4000 // BS))  # a 4,000-token document, cached at t = 0


def _flood(n_backlog: int = 6, n_hits: int = 300, seconds: float = 6.0) -> list[SimRequest]:
    rng = np.random.default_rng(7)
    out = [
        SimRequest(f"b{k}", 0.0, int(rng.integers(3000, 6001)), (), ("backlog",))
        for k in range(n_backlog)
    ]
    for k in range(n_hits):
        t = 0.1 + seconds * k / n_hits
        tokens = 4000 + int(rng.integers(50, 300))
        out.append(SimRequest(f"h{k}", t, tokens, DOC, ("flood",)))
    return out


class _Recording(FairwayXStep):
    """Remembers every request's allowance as the policy first fixed it."""

    def __init__(self, share: float) -> None:
        super().__init__(XStepConfig(bypass_share=share))
        self.allowance: dict[str, float] = {}

    def order(self, queue: PrefillQueueView, now: float) -> list[str]:
        out = super().order(queue, now)
        for rid, e in self.state.waiting.items():
            self.allowance.setdefault(rid, e.allowance)
        return out


@pytest.mark.parametrize("share", [0.05, 0.25])
def test_engine_loop_keeps_each_requests_bypass_within_its_allowance(share: float) -> None:
    """Younger tokens the engine schedules while r waits (summed over every step of its
    wait, running continuations included) <= r's allowance; no eviction here."""
    reqs = _flood()
    steps: list[StepResult] = []
    pol = _Recording(share)
    cfg = EngineConfig(token_budget=PROFILE.token_budget, block_size=BS)
    res = simulate(reqs, pol, PROFILE, 20_000, config=cfg, warm=[DOC], on_step=steps.append)
    assert not res.unfinished and res.evictions == 0
    rank = {r.request_id: k for k, r in enumerate(reqs)}  # arrival order = list order
    admitted = {f.request_id: f.admitted_s for f in res.finished}
    arrival = {r.request_id: r.arrival_s for r in reqs}
    charged = 0
    for rid in rank:
        younger = sum(
            c
            for st in steps
            if arrival[rid] <= st.start_s < admitted[rid]
            for sid, c in st.scheduled
            if rank[sid] > rank[rid]
        )
        assert younger <= pol.allowance[rid] + 1e-6, (rid, younger, pol.allowance[rid])
        charged += younger > 0
    assert charged > 0  # hits did pass the backlog, within the allowances


def test_backlog_worst_wait_beats_the_papers_fairway_on_a_flood() -> None:
    reqs = _flood()
    cfg = EngineConfig(token_budget=PROFILE.token_budget, block_size=BS)
    reps = {}
    for name in ("fcfs", "fairway", "fairway_xstep"):
        res = simulate(reqs, name, PROFILE, 20_000, config=cfg, warm=[DOC])
        reps[name] = policy_report(res, ("backlog", "flood"))
    worst = {n: r["ttft"]["backlog"]["max"] for n, r in reps.items()}
    # Per-step Fairway lets hits pass each backlog miss anew; xstep charges them once.
    assert worst["fcfs"] <= worst["fairway_xstep"] <= 1.1 * worst["fcfs"] + 0.5
    assert worst["fairway_xstep"] < worst["fairway"]
    med = {n: r["ttft"]["flood"]["p50"] for n, r in reps.items()}
    assert med["fairway_xstep"] < med["fcfs"]


def test_share_zero_reproduces_fcfs_in_the_simulator() -> None:
    reqs = _flood(n_hits=80)
    a = simulate(reqs, "fcfs", PROFILE, 20_000, warm=[DOC])
    b = simulate(reqs, FairwayXStep(XStepConfig(bypass_share=0.0)), PROFILE, 20_000, warm=[DOC])
    assert [(f.request_id, f.finish_s) for f in a.finished] == [
        (f.request_id, f.finish_s) for f in b.finished
    ]
    assert make_prefill_policy("fairway_xstep").name == "fairway_xstep"


runner = CliRunner()


def test_tradeoff_command_writes_points_json_and_plot(tmp_path: Path) -> None:
    out, png = tmp_path / "t.json", tmp_path / "t.png"
    res = runner.invoke(
        app,
        [
            "sim", "tradeoff", "--quick", "--scenarios", "sec-spike", "--seeds", "0",
            "--shares", "0,1", "--json", str(out), "--plot", str(png), "--no-progress",
        ],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    assert "simulated" in res.output
    data = json.loads(out.read_text())
    assert data["simulated"] is True and data["shares"] == [0.0, 1.0]
    cell = data["scenarios"]["sec-spike/s0"]
    assert (cell["median_key"], cell["worst_key"]) == ("spike", "all")
    pts = {p["policy"]: p for p in cell["points"]}
    assert set(pts) == {"fcfs", "lpm", "fairway", "fairway_xstep@0", "fairway_xstep@1"}
    for k in ("median_s", "worst_s", "p99_s", "targets_met"):  # share 0 is FCFS
        assert pts["fairway_xstep@0"][k] == pts["fcfs"][k]
    assert png.stat().st_size > 10_000
    assert data["variant"]["fast_score"] == "fairway"


@pytest.mark.parametrize(
    ("args", "hint"),
    [
        (["--shares", "0,-1"], "shares must be >= 0"),
        (["--shares", "a"], "comma-separated numbers"),
        (["--scenarios", "nope"], "unknown scenarios"),
        (["--seeds", "x"], "comma-separated integers"),
        (["--fast-score", "lifo"], "fairway, cached or reuse"),
    ],
)
def test_tradeoff_bad_input_is_a_clear_error(args: list[str], hint: str) -> None:
    res = runner.invoke(app, ["sim", "tradeoff", "--quick", *args])
    assert res.exit_code != 0
    assert hint in res.output
