"""The live autoscaling benchmark, short, on the suite's cluster (issue 43): the first
requests of the shipped Azure conversation trace replayed against the serverless app with SLO
targets (``bench.live.autoscale_live``, system ``slo``). Asserted: every request is served;
the SLO policy sized the roles from the replicas' own reports (their prompt mean and p99, the
measured prefill rate) and said which target bound each; replica-seconds are measured from
Serve's replica states. The always-on reference is left to the benchmark (its deploy of the
full pool would add a minute here, and its comparison is unit-tested): the figures themselves
(cost, TTFT and their ratios) are the benchmark's to report, not this test's, since 12
requests on two shared cores say nothing stable about them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e.conftest import ROOT, only_app

pytestmark = [pytest.mark.slow, pytest.mark.integration]

TRACE = ROOT / "bench" / "data" / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv"
REQUESTS = 12
#: the reasons a decision may give in SLO mode (controllers.autoscale: slo_sizes' bounds, then
#: the keep-alive, pairing, hysteresis and bounds); without an SLO a sized role says "demand"
SLO_REASONS = {
    *("slo_ttft", "slo_ttft_infeasible", "slo_itl", "slo_itl_infeasible", "cold_budget"),
    *("window", "kv", "no_demand", "warm_pool", "idle_to_zero", "scale_from_zero"),
    *("paired_with_prefill", "hold_downscale", "bounds"),
}


def test_the_slo_autoscaler_serves_a_scaled_trace_sized_by_its_replicas_reports(
    serve_url: str,
    tiny_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import bench.live.autoscale_live as live

    raw = yaml.safe_load((ROOT / "configs" / "pd_autoscale.yaml").read_text())
    args = live.base_args(
        raw["applications"][0]["args"],
        model_path=str(tiny_model_dir),
        build_preset=None,
        cache_dir=str(tmp_path),
    )
    args["model"]["max_model_len"] = 2048
    monkeypatch.setattr(live, "serve_locally", lambda port: serve_url)  # the suite's Serve
    with only_app(live.APP):
        res: dict[str, Any] = live.run(
            args,
            TRACE,
            systems=("slo",),
            slo={"ttft_p99_s": 5.0, "itl_p99_s": 0.5},
            max_requests=REQUESTS,
            max_output_tokens=16,
            log=print,
        )
    assert res["failed"] == {}, res["failed"]
    slo = res["systems"]["slo"]
    assert (slo["requests"], slo["errors"]) == (REQUESTS, 0), slo["error_samples"]
    assert slo["ttft"]["p99"] is not None and slo["itl"]["p99"] is not None
    # live replicas held the window: at least the warm pair (from the warm-up) throughout
    assert slo["replica_seconds"]["total"] >= 2 * 0.9 * slo["window_s"], slo["replica_seconds"]
    seen = slo["autoscaling_demand"]["prefill"]
    # the sizing's inputs came from the prefill replicas' own reports
    assert seen["prompt_tokens_p99"] > 0 and seen["prompt_tokens_mean"] > 0, seen
    assert seen["prompt_tokens_p99"] >= seen["prompt_tokens_mean"]
    assert seen["tokens_per_s"] > 0, seen
    # and decode's step floor from its TWP gate's own measurement, not the profile's
    assert slo["autoscaling_demand"]["decode"]["l_min_s"] > 0, slo["autoscaling_demand"]
    reasons = {d["reason"] for d in slo["autoscaling_decisions"].values()}
    assert reasons <= SLO_REASONS, reasons
    # the decode step curve the app resolved from its profile rode in the policy's config
    assert set(res["args"]["slo"]["autoscaling"]["slo"]["decode_step"]) == {
        "l_min_s",
        "b0",
        "alpha_s",
    }
