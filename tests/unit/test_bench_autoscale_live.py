"""The pure parts of ``pdserve bench autoscale-live`` (bench/live/autoscale_live.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from bench.live.autoscale_live import (
    GOALS,
    ROOT,
    base_args,
    build_replay,
    cold_starts,
    compare,
    deploy_spec,
    fit_requests,
    front,
    parse_slo,
    parse_slo_point,
    replica_seconds,
    summarize_system,
    system_args,
    timeline,
)
from bench.live.replay import LiveResult
from bench.workloads.replay import LiveRequest
from deployments.config import load_app_config


def _states(prefill: dict[str, int], decode: dict[str, int] | None = None) -> dict[str, Any]:
    return {"prefill": prefill, "decode": decode or {}}


def test_replica_seconds_integrates_the_live_states_over_the_window() -> None:
    samples = [
        (0.0, _states({"RUNNING": 1}, {"RUNNING": 1})),
        (2.0, _states({"STARTING": 1, "RUNNING": 1}, {"RUNNING": 1})),
        (5.0, _states({"RUNNING": 2}, {"RUNNING": 1})),
        (8.0, _states({"RUNNING": 1, "STOPPING": 1}, {"STOPPING": 1})),
        (9.0, _states({"RUNNING": 1}, {})),
    ]
    rs = replica_seconds(samples, 1.0, 10.0)
    # prefill: [1,2) 1 + [2,5) 2 + [5,8) 2 + [8,9) 2 + [9,10) 1 = 1 + 6 + 6 + 2 + 1
    assert rs["prefill"] == pytest.approx(16.0)
    # decode: [1,8) 1 + [8,9) 1 (stopping still holds its core) + [9,10) 0
    assert rs["decode"] == pytest.approx(8.0)
    assert rs["total"] == pytest.approx(24.0)


def test_replica_seconds_ignores_other_states_and_holds_the_first_sample_backwards() -> None:
    samples = [(3.0, _states({"RUNNING": 2, "PENDING_MIGRATION": 4}))]
    rs = replica_seconds(samples, 1.0, 5.0)
    assert rs == {"prefill": 8.0, "decode": 0.0, "total": 8.0}
    # unordered samples are sorted; samples after the window do not count
    rs = replica_seconds([(4.0, _states({"RUNNING": 1})), (0.0, _states({}))], 0.0, 2.0)
    assert rs["total"] == 0.0
    assert replica_seconds([], 0.0, 10.0)["total"] == 0.0
    assert replica_seconds([(0.0, _states({"RUNNING": 1}))], 5.0, 5.0)["total"] == 0.0


def test_an_always_on_pool_costs_its_size_times_the_window() -> None:
    on = [(t * 0.5, _states({"RUNNING": 2}, {"RUNNING": 1})) for t in range(-2, 40)]
    rs = replica_seconds(on, 0.0, 12.5)
    assert rs["prefill"] == pytest.approx(25.0) and rs["decode"] == pytest.approx(12.5)
    rows = timeline(on[:3], 0.0)
    assert rows[0] == {"t": -1.0, "prefill": 2.0, "decode": 1.0}


def _csv(path: Path, rows: list[tuple[str, int, int]]) -> Path:
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    lines += [f"2023-11-16 18:15:{s},{c},{g}" for s, c, g in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_replay_scales_arrivals_truncates_and_caps_lengths(tmp_path: Path) -> None:
    trace = _csv(
        tmp_path / "t.csv",
        [
            ("10.0000000", 100, 10),
            ("12.0000000", 5000, 300),
            ("14.5000000", 200, 0),
            ("20.0000000", 50, 5),
        ],
    )
    reqs, info = build_replay(
        trace,
        time_scale=0.5,
        max_requests=3,
        max_model_len=1024,
        max_output_tokens=64,
        vocab=500,
    )
    assert [r.at_s for r in reqs] == pytest.approx([0.0, 1.0, 2.25])
    assert [r.max_tokens for r in reqs] == [10, 64, 1]  # capped; a 0-token output asks 1
    # the long prompt cut to max_model_len less its output and one token
    assert [len(r.ids) for r in reqs] == [100, 1024 - 64 - 1, 200]
    assert all(10 <= i < 500 for r in reqs for i in r.ids)
    assert info["format"] == "azure" and info["requests"] == 3
    assert info["prompts_cut"] == 1 and info["outputs_cut"] == 1
    assert info["span_s"] == pytest.approx(2.25)
    assert info["rate_per_s"] == pytest.approx(2 / 2.25)
    # the same trace gives the same requests (every system sees the identical replay)
    again, _ = build_replay(
        trace, time_scale=0.5, max_requests=3, max_model_len=1024, max_output_tokens=64, vocab=500
    )
    assert again == reqs


def test_fit_requests_keeps_the_prefix_and_refuses_no_room() -> None:
    r = LiveRequest(0.0, tuple(range(10, 110)), 50)
    (fit,), cut = fit_requests([r], 64, 16)
    assert fit.max_tokens == 16 and fit.ids == tuple(range(10, 57))  # 64 - 16 - 1 = 47
    assert cut == {"prompts_cut": 1, "outputs_cut": 1}
    with pytest.raises(ValueError):
        fit_requests([r], 16, 15)


def test_the_shipped_azure_trace_replays(tmp_path: Path) -> None:
    trace = ROOT / "bench" / "data" / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv"
    reqs, info = build_replay(
        trace,
        time_scale=2.0,
        max_requests=20,
        max_model_len=4096,
        max_output_tokens=128,
        vocab=1000,
    )
    assert len(reqs) == 20 and reqs[0].at_s == 0.0
    assert all(len(r.ids) + r.max_tokens < 4096 and r.max_tokens <= 128 for r in reqs)
    assert info["span_s"] > 0


def _config_args() -> dict[str, Any]:
    raw = yaml.safe_load((ROOT / "configs" / "pd_autoscale.yaml").read_text())
    return base_args(raw["applications"][0]["args"], cache_dir="/tmp/x")


def test_the_systems_are_the_configs_app_autoscaled_and_at_its_maximum() -> None:
    args = _config_args()
    assert args["ingress"]["auth"] == "none" and args["model"]["build_preset"] == "test"
    auto = load_app_config(
        system_args("autoscaled", args, idle_to_zero_s=20, downscale_delay_s=5), environ={}
    )
    a = auto.autoscaling
    assert a.enabled and a.idle_to_zero_s == 20 and a.downscale_delay_s == 5 and a.slo is None
    assert (a.prefill.min_replicas, a.prefill.max_replicas) == (0, 2)
    assert auto.tenants.default.requests_per_second is None
    on = load_app_config(system_args("always_on", args), environ={})
    assert not on.autoscaling.enabled
    assert (on.prefill.num_replicas, on.decode.num_replicas) == (2, 1)  # the config's maxima
    slo = system_args("slo", args, slo=parse_slo("1.5,0.05"))
    assert load_app_config(slo, environ={}).autoscaling.slo.ttft_p99_s == 1.5  # type: ignore[union-attr]
    with pytest.raises(ValueError):
        system_args("slo", args)
    assert args["autoscaling"]["idle_to_zero_s"] == 300  # the base is untouched
    # only the autoscaled systems carry the application-level policy
    assert "autoscaling_policy" in deploy_spec("autoscaled", args)
    assert "autoscaling_policy" not in deploy_spec("always_on", args)
    from ray.serve.schema import ServeDeploySchema

    ServeDeploySchema.model_validate({"applications": [deploy_spec("slo", slo)]})


@pytest.mark.parametrize("bad", ["1", "a,b", "0,0.05", "1,-1", "1,2,3", "inf,1"])
def test_parse_slo_refuses_bad_targets(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_slo(bad)


def _res(ttft: float, ok: bool = True) -> LiveResult:
    return LiveResult(
        0.0, ok, ttft if ok else None, ttft + 1.0, [0.01, 0.02], error="" if ok else "x"
    )


def _summary(ttfts: list[float], cold: int, total_rs: float, errors: int = 0) -> dict[str, Any]:
    results = [_res(t) for t in ttfts] + [_res(0.0, ok=False) for _ in range(errors)]
    c = {"requests": cold, "wait_s": {}, "waits_by_role": {"prefill": cold, "decode": 0}}
    rs = {"prefill": total_rs / 2, "decode": total_rs / 2, "total": total_rs}
    return summarize_system(results, c, rs, 10.0)


def test_the_summary_ratios_and_goal_verdicts() -> None:
    on = _summary([0.1] * 100, 0, 300.0)
    auto = _summary([0.1] * 98 + [0.2, 0.2], 2, 150.0)  # 2%, 0.5x, p99 2x
    slo = _summary([0.1] * 100, 5, 200.0, errors=1)
    assert on["cold_start_fraction"] == 0.0 and on["mean_replicas"]["total"] == 30.0
    assert auto["cold_start_fraction"] == 0.02 and slo["errors"] == 1
    assert slo["cold_start_fraction"] == 5 / 101
    assert on["itl"]["n"] == 200  # every token's gap, pooled
    c = compare({"always_on": on, "autoscaled": auto, "slo": slo})
    assert c["always_on"]["replica_seconds_ratio"] == 1.0
    a = c["autoscaled"]
    assert a["replica_seconds_ratio"] == 0.5
    assert a["ttft_p99_ratio"] == pytest.approx(0.2 / 0.1)
    assert a["goals"] == {
        "cold_starts": True,
        "replica_seconds": True,
        "ttft_p99": False,
        "no_errors": True,
        "all": False,
    }
    s = c["slo"]
    assert s["replica_seconds_ratio"] == pytest.approx(2 / 3)
    assert s["goals"]["cold_starts"] is False and s["goals"]["replica_seconds"] is False
    assert s["goals"]["ttft_p99"] is True and s["goals"]["no_errors"] is False
    # the bounds are the issue's
    assert GOALS["max_cold_start_fraction"] == 0.03 and GOALS["max_replica_seconds_ratio"] == 0.6
    # without always_on in the run no ratio, and the verdicts that need one are unknown
    alone = compare({"autoscaled": auto})["autoscaled"]
    assert alone["replica_seconds_ratio"] is None
    assert alone["goals"]["replica_seconds"] is None and alone["goals"]["all"] is None
    assert alone["goals"]["cold_starts"] is True


def test_cold_starts_come_from_the_ingress_phase_and_counters() -> None:
    before = {"ingress": {"cold_start_waits": {"prefill": 1, "decode": 1}}}
    after = {
        "ingress": {
            "cold_start_waits": {"prefill": 4, "decode": 2},
            "phases_s": {"cold_start": {"n": 3, "mean": 20.0, "p50": 19.0, "max": 30.0}},
        }
    }
    c = cold_starts(before, after)
    assert c["requests"] == 3 and c["waits_by_role"] == {"prefill": 3, "decode": 1}
    assert c["wait_s"] == {"mean": 20.0, "p50": 19.0, "max": 30.0}
    assert cold_starts(before, {"ingress": {"phases_s": {}}})["requests"] == 0


def test_the_command_refuses_bad_options_before_starting_ray(tmp_path: Path) -> None:
    import pdserve.cli  # noqa: F401  (registers the commands)
    from pdserve.apps import app

    runner = CliRunner()
    base = ["bench", "autoscale-live"]
    for extra, hint in (
        (["--trace", str(tmp_path / "none.csv")], "--trace"),
        (["--slo", "1"], "--slo"),
        (["--systems", "always_on,slo"], "--slo"),
        (["--systems", "always_on,nope"], "--systems"),
        (["--slo-sweep", "1,0.05;1,0.05,1.5"], "--slo-sweep"),
        (["--slo-sweep", "1,0.05;1,0.05"], "--slo-sweep"),
        (["--config", str(tmp_path / "none.yaml")], "--config"),
    ):
        res = runner.invoke(app, [*base, *extra])
        assert res.exit_code == 2, (extra, res.output)
        assert hint in res.output, (extra, res.output)


def test_run_goes_through_each_system_and_reports_one_that_failed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The orchestration alone (no Ray: deploying and replaying are stand-ins)."""
    import bench.live.autoscale_live as live

    calls: list[tuple[str, dict[str, Any]]] = []
    deleted: list[str] = []

    def fake_system(system: str, args: dict[str, Any], url: str, out: dict[str, Any], **kw: Any):
        calls.append((system, args))
        if "replay" not in out:
            out["_requests"], out["replay"] = [LiveRequest(0.0, (11,), 2)], {"requests": 1}
        if system == "slo":
            raise RuntimeError("deploy failed")
        s = _summary(
            [0.1] * 10, 0 if system == "always_on" else 1, 30.0 if system == "always_on" else 12.0
        )
        return s, [{"t": 0.0, "prefill": 1.0, "decode": 1.0}]

    import ray
    from ray import serve

    # a Ray this process already holds (the suite's session cluster) is not the run's to stop
    shut: list[str] = []
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "shutdown", lambda: shut.append("ray"))
    monkeypatch.setattr(serve, "shutdown", lambda: shut.append("serve"))
    monkeypatch.setattr(live, "serve_locally", lambda port: f"http://127.0.0.1:{port}")
    monkeypatch.setattr(live, "_run_system", fake_system)
    monkeypatch.setattr(live, "delete_app", deleted.append)
    trace = ROOT / "bench" / "data" / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv"
    res = live.run(
        _config_args(),
        trace,
        systems=["always_on", "autoscaled", "slo"],
        slo={"ttft_p99_s": 2.0, "itl_p99_s": 0.05},
        max_requests=5,
        log=lambda _: None,
    )
    assert [c[0] for c in calls] == ["always_on", "autoscaled", "slo"]
    assert shut == []
    assert deleted == [live.APP] * 3  # each system's app goes, the failed one too
    assert list(res["systems"]) == ["always_on", "autoscaled"]
    assert "deploy failed" in res["failed"]["slo"]
    assert "_requests" not in res and res["replay"] == {"requests": 1}
    assert res["compare"]["autoscaled"]["replica_seconds_ratio"] == pytest.approx(0.4)
    # the slo system's targets carry the engine profile's decode step curve
    assert set(calls[2][1]["autoscaling"]["slo"]["decode_step"]) == {"l_min_s", "b0", "alpha_s"}
    import json

    json.dumps(res)  # the whole result is JSON


def test_a_sweep_point_names_its_targets_and_keep_alive_cap() -> None:
    assert parse_slo_point("2,0.05") == (
        "slo[2,0.05]",
        {"ttft_p99_s": 2.0, "itl_p99_s": 0.05},
        None,
    )
    name, targets, cap = parse_slo_point(" 0.5, 0.05, 0.2, 3 ")
    assert name == "slo[0.5,0.05,0.2,3]" and cap == 3.0
    assert targets == {"ttft_p99_s": 0.5, "itl_p99_s": 0.05, "max_cold_fraction": 0.2}
    for bad in ("1", "1,0.05,0", "1,0.05,1", "1,0.05,x", "1,0.05,0.1,-1", "1,0.05,0.1,2,3"):
        with pytest.raises(ValueError):
            parse_slo_point(bad)


def test_the_front_keeps_the_unbeaten_systems_that_failed_nothing() -> None:
    on = _summary([0.1] * 100, 0, 300.0)
    cheap = _summary([0.1] * 99 + [0.3], 0, 200.0)  # cheaper, slower: on the front
    worse = _summary([0.1] * 99 + [0.4], 0, 250.0)  # beaten by cheap on every axis
    cold = _summary([0.1] * 100, 30, 60.0)  # cheapest, cold starts: on the front
    failed = _summary([0.1] * 100, 0, 30.0, errors=1)  # would beat all: not a valid point
    systems = {"always_on": on, "cheap": cheap, "worse": worse, "cold": cold, "failed": failed}
    assert front(systems, compare(systems)) == ["always_on", "cheap", "cold"]


def test_run_deploys_each_sweep_point_with_its_targets_and_cap(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The orchestration of a sweep (no Ray: deploying and replaying are stand-ins)."""
    import bench.live.autoscale_live as live
    from pdserve.commands.bench_autoscale_live import summary_table

    calls: list[tuple[str, dict[str, Any]]] = []
    cost = {"always_on": 300.0, "slo[0.5,0.05]": 310.0, "slo[8,0.05,0.3,2]": 90.0}

    def fake_system(system: str, args: dict[str, Any], url: str, out: dict[str, Any], **kw: Any):
        calls.append((system, args))
        out.setdefault("replay", {"requests": 1})
        cold = 40 if system.endswith(",2]") else 0
        return _summary([0.1] * 100, cold, cost[system]), [
            {"t": 0.0, "prefill": 1.0, "decode": 1.0}
        ]

    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(live, "serve_locally", lambda port: f"http://127.0.0.1:{port}")
    monkeypatch.setattr(live, "_run_system", fake_system)
    monkeypatch.setattr(live, "delete_app", lambda app: None)
    trace = ROOT / "bench" / "data" / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv"
    points = [parse_slo_point("0.5,0.05"), parse_slo_point("8,0.05,0.3,2")]
    res = live.run(
        _config_args(),
        trace,
        systems=["always_on"],
        sweep=points,
        max_requests=5,
        idle_to_zero_s=20,
        log=lambda _: None,
    )
    assert [c[0] for c in calls] == ["always_on", "slo[0.5,0.05]", "slo[8,0.05,0.3,2]"]
    tight, zero = (load_app_config(c[1], environ={}).autoscaling for c in calls[1:])
    assert tight.slo is not None and tight.slo.ttft_p99_s == 0.5 and tight.idle_to_zero_s == 20
    assert tight.slo.decode_step is not None  # the profile's curve, as for the slo system
    assert zero.slo is not None and zero.slo.max_cold_fraction == 0.3 and zero.idle_to_zero_s == 2
    # the tight point costs more than always_on at its TTFT: beaten; the cold one is cheapest
    assert res["front"] == ["always_on", "slo[8,0.05,0.3,2]"]
    table = summary_table(res)
    assert "front" in table and table.count("yes") >= 2
    live.plot(res, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0
    with pytest.raises(ValueError, match="twice"):
        live.run(_config_args(), trace, systems=[], sweep=points + points[:1], log=lambda _: None)
