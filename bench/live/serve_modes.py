"""Serving modes side by side on the live app: full prefill/decode disaggregation (PD),
conditional disaggregation (prompts under a threshold prefilled on their decode replica) and
the colocated mode (one engine per replica does both phases, Fairway and TWP together).

For each mode, in one run: bring the app up from a Serve YAML with that mode's routing
(``pdserve up``), then for each concurrency level send ``requests`` streamed completions from
that many closed-loop clients, half with short prompts (``short_words``, under the threshold)
and half with long ones (``long_words``), all distinct (no prefix hits); record each one's
TTFT and mean ITL, and the level's throughput (output tokens per second); bring the app down.
Ratios between modes in one run are the figures to read (absolute times drift on a shared
machine). PD and conditional run one prefill and one decode engine, a core each; the
colocated config one engine on both cores.
"""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml
from tqdm import tqdm

from bench.live.pd import http_pd
from bench.live.warm_start import pdserve_cli
from controllers.stats import summarize

#: mode -> routing.local_prefill_threshold_tokens (on the PD config; colocated has its own)
MODES = {"pd": 0, "conditional": 256, "colocated": 0}


def _level(
    url: str, clients: int, requests: int, short: int, long: int, max_tokens: int, seed: int
) -> dict[str, Any]:
    """``requests`` streamed completions from ``clients`` closed-loop threads."""
    ttft: list[float] = []
    itl: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()
    todo = list(range(requests))
    bar = tqdm(total=requests, desc=f"{clients} streams", unit="req", leave=False)

    def client() -> None:
        while True:
            with lock:
                if not todo:
                    return
                i = todo.pop()
            words = short if i % 2 else long
            head = f"request {seed} {clients} {i}:"  # distinct from the first block on
            prompt = " ".join([head, *(f"w{k}" for k in range(words))])
            try:
                t, mean_itl, _ = http_pd(url, prompt, max_tokens, None)
            except Exception as e:  # counted and shown, the level goes on
                with lock:
                    errors.append(f"{type(e).__name__}: {e}"[:200])
                    bar.update(1)
                continue
            with lock:
                ttft.append(t)
                itl.append(mean_itl)
                bar.update(1)

    t0 = time.monotonic()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.monotonic() - t0
    bar.close()
    return {
        "ttft_s": summarize(ttft),
        "itl_s": summarize(itl),
        "throughput_tps": len(ttft) * max_tokens / wall,
        "errors": len(errors),
        "error_examples": errors[:3],
    }


def run(
    config: Path,
    colocated_config: Path,
    levels: list[int],
    requests: int = 16,
    short_words: int = 30,
    long_words: int = 400,
    max_tokens: int = 32,
) -> dict[str, Any]:
    """``{mode: {clients: {"ttft_s", "itl_s", "throughput_tps", "errors"}}}`` plus each
    mode's ratios to PD."""
    out: dict[str, Any] = {"config": str(config), "levels": levels, "requests": requests}
    with tempfile.TemporaryDirectory() as tmp:
        for mode, threshold in MODES.items():
            src = colocated_config if mode == "colocated" else config
            raw = yaml.safe_load(src.read_text())
            app = raw["applications"][0]
            url = f"http://127.0.0.1:{raw.get('http_options', {}).get('port', 8000)}"
            app["args"].setdefault("routing", {})["local_prefill_threshold_tokens"] = threshold
            path = Path(tmp) / f"{mode}.yaml"
            path.write_text(yaml.safe_dump(raw))
            pdserve_cli("up", "--config", str(path))
            try:
                out[mode] = {
                    str(c): _level(url, c, requests, short_words, long_words, max_tokens, c)
                    for c in levels
                }
            finally:
                pdserve_cli("down")
    out["ratios_to_pd"] = {
        mode: {
            str(c): {
                "ttft_p50": _ratio(out, mode, c, "ttft_s", "p50"),
                "ttft_p99": _ratio(out, mode, c, "ttft_s", "p99"),
                "itl_p99": _ratio(out, mode, c, "itl_s", "p99"),
                "throughput": _ratio(out, mode, c, "throughput_tps", None),
            }
            for c in levels
        }
        for mode in MODES
        if mode != "pd"
    }
    return out


def _ratio(out: dict[str, Any], mode: str, c: int, metric: str, q: str | None) -> float | None:
    """``mode`` / pd for one statistic (None when either is missing)."""
    a, b = out[mode][str(c)][metric], out["pd"][str(c)][metric]
    if q is not None:
        a, b = a[q], b[q]
    return float(a / b) if a is not None and b else None
