"""The stall a client sees when its stream's decode replica is lost and the stream migrates.

One app on a local Ray cluster (the ``test`` model: one prefill replica, two decode replicas,
the in-memory index, fault injection on), deployed once per variant:

- ``prefill_cache``: the PD path; a continuation's prompt (the original prompt plus the
  tokens sent) is routed by the index to the prefill replica that prefilled the original,
  which computes only the generated tail, and its KV goes over NIXL to the other decode
  replica (``routing.local_prefill_threshold_tokens`` 0);
- ``recompute``: every prompt is computed on its decode replica
  (``local_prefill_threshold_tokens`` above any prompt), so the continuation's decode
  replica computes the whole sequence, nothing cached for it anywhere.

Per (prompt length, tokens already sent) cell, ``repeats`` trials, each with a prompt of its
own (no cache hits between trials): the decode replicas are armed
(``inject_stream_loss``: the stream whose prompt has that many tokens fails with
``EngineDown`` once it has sent that many tokens, once), one greedy stream is sent, and the
client times every token's arrival. The stall is the gap before the first token after the
loss; it is set against the stream's own inter-token latency before the loss (the ratio is
what holds across machines). Each trial also checks the stream completed with every token
and no error event. The loss is injected inside the replica (the engine failing): a killed
actor adds Ray's detection of the death to the stall (the fault test's kill reports it).
"""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.live.routing import get_json, model_vocab, serve_locally, wait_gone, wait_ready

APP = "pdmigrate"
VARIANTS = ("prefill_cache", "recompute")
#: tokens generated after the loss in each trial
AFTER = 32


@dataclass
class Trial:
    variant: str
    prompt_tokens: int
    sent: int
    ok: bool
    stall_s: float
    itl_s: float
    error: str | None = None
    #: the ingress's parts of the stall (``/v1/pdserve/stats``' ``ingress.migration_last``)
    parts: dict[str, float] | None = None


def app_args(variant: str, cache_dir: str | None) -> dict[str, Any]:
    """The benchmarked app (see the module docstring)."""
    threshold = 0 if variant == "prefill_cache" else 1_000_000
    engine = {"num_cpus": 1.0, "fault_injection": True}
    args: dict[str, Any] = {
        "model": {
            "path": "~/.cache/pdserve/models/test",
            "build_preset": "test",
            "max_model_len": 4096,
        },
        "prefill": {"num_replicas": 1, "cpu_bind": "0", **engine},
        "decode": {"num_replicas": 2, "cpu_bind": "1", **engine},
        "index": {"backend": "memory"},
        "routing": {"local_prefill_threshold_tokens": threshold},
        # the bench's own app, its proxy on loopback: keys off, said explicitly; its one
        # client is the only tenant
        "ingress": {"num_cpus": 0.25, "auth": "none"},
        "tenants": {"default": {"requests_per_second": None, "tokens_per_minute": None}},
    }
    if cache_dir:
        args["cache_dir"] = cache_dir
    return args


def arm(app: str, prompt_tokens: int | None, after: int) -> None:
    """Arm every decode replica (``prompt_tokens`` None: disarm)."""
    from ray import serve

    handle = serve.get_deployment_handle("decode", app_name=app)
    reached: set[str] = set()
    for _ in range(200):  # Serve's handle picks the replica: call until both answered
        rid = handle.inject_stream_loss.remote(prompt_tokens, after).result(timeout_s=30)
        reached.add(rid)
        if len(reached) == 2:
            return
    raise RuntimeError(f"reached only decode replicas {sorted(reached)}")


def one_stream(url: str, prompt: list[int], sent: int) -> tuple[list[float], str | None]:
    """One greedy stream of ``sent + AFTER`` tokens: each token's arrival (monotonic), and
    the first error event's message (None when it completed cleanly)."""
    body = {
        "model": "test",
        "prompt": prompt,
        "max_tokens": sent + AFTER,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    arrivals: list[float] = []
    error = None
    done = False
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            return arrivals, f"HTTP {r.status_code}"
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                ev = json.loads(line[6:])
                if "error" in ev:
                    error = error or str(ev["error"].get("message"))
                for c in ev.get("choices") or ():
                    now = time.monotonic()
                    arrivals += [now] * len(c.get("token_ids") or ())
    if not done:
        error = error or "no [DONE]"
    return arrivals, error


def trial(url: str, variant: str, prompt: list[int], sent: int) -> Trial:
    arm(APP, len(prompt), sent)
    try:
        arrivals, error = one_stream(url, prompt, sent)
    finally:
        arm(APP, None, 0)
    ok = error is None and len(arrivals) == sent + AFTER
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    stall = gaps[sent - 1] if ok else float("nan")
    before = gaps[: sent - 1] or [float("nan")]
    if ok and len(arrivals) != sent + AFTER:
        error = f"{len(arrivals)} tokens of {sent + AFTER}"
    parts = get_json(url, "/v1/pdserve/stats")["ingress"]["migration_last"] if ok else None
    return Trial(
        variant, len(prompt), sent, ok, stall, statistics.median(before), error or None, parts
    )


def summarize(trials: list[Trial]) -> list[dict[str, Any]]:
    """One row per (variant, prompt length, sent): the median stall, the median ITL before
    the loss, their ratio, and the failed trials."""
    cells: dict[tuple[str, int, int], list[Trial]] = {}
    for t in trials:
        cells.setdefault((t.variant, t.prompt_tokens, t.sent), []).append(t)
    rows = []
    for (variant, p, s), ts in sorted(cells.items()):
        ok = [t for t in ts if t.ok]
        stall = statistics.median(t.stall_s for t in ok) if ok else None
        itl = statistics.median(t.itl_s for t in ok) if ok else None
        parts = {
            k: statistics.median(t.parts[k] for t in ok if t.parts)
            for k in ("detect_s", "prefill_s", "first_token_s")
            if any(t.parts for t in ok)
        }
        rows.append(
            {
                "variant": variant,
                "prompt_tokens": p,
                "sent": s,
                "trials": len(ts),
                "failed": len(ts) - len(ok),
                "stall_s": stall,
                "itl_s": itl,
                "stall_over_itl": stall / itl if stall is not None and itl else None,
                **parts,
            }
        )
    return rows


def run(
    prompts: list[int],
    sents: list[int],
    repeats: int,
    *,
    build_app: Callable[[dict[str, Any]], Any],
    variants: tuple[str, ...] = VARIANTS,
    port: int = 8766,
    cache_dir: str | None = None,
    progress: Callable[[int], Callable[[], None]] | None = None,
) -> dict[str, Any]:
    """Every variant's trials (see the module docstring) and their summary."""

    from ray import serve

    from deployments.config import load_app_config

    url = serve_locally(port)
    rng = random.Random(0)
    trials: list[Trial] = []
    tick = progress(len(variants) * len(prompts) * len(sents) * repeats) if progress else None
    for variant in variants:
        args = app_args(variant, cache_dir)
        vocab = model_vocab(load_app_config(args).model.resolved_path())
        serve.run(build_app(args), name=APP, route_prefix="/", blocking=False)
        wait_ready(url, 2, role="decode")
        for p in prompts:
            for s in sents:
                for _ in range(repeats):
                    prompt = [rng.randrange(10, vocab) for _ in range(p)]
                    trials.append(trial(url, variant, prompt, s))
                    if tick:
                        tick()
        serve.delete(APP)
        wait_gone(f"ServeReplica:{APP}:")
    return {
        "simulated": False,
        "app": "one prefill and two decode replicas, test model, in-memory index",
        "after_tokens": AFTER,
        "trials": [asdict(t) for t in trials],
        "rows": summarize(trials),
    }


def plot(res: dict[str, Any], path: Path) -> None:
    """The stall against tokens sent, one line per prompt length, a panel per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rows"]
    variants = sorted({r["variant"] for r in rows})
    fig, axes = plt.subplots(1, len(variants), figsize=(5 * len(variants), 4), sharey=True)
    axes = [axes] if len(variants) == 1 else list(axes)
    for ax, v in zip(axes, variants, strict=True):
        for p in sorted({r["prompt_tokens"] for r in rows}):
            pts = [
                (r["sent"], r["stall_s"] * 1e3)
                for r in rows
                if r["variant"] == v and r["prompt_tokens"] == p and r["stall_s"] is not None
            ]
            if pts:
                xs, ys = zip(*sorted(pts), strict=True)
                ax.plot(xs, ys, marker="o", label=f"prompt {p}")
        ax.set_title(v)
        ax.set_xlabel("tokens sent before the loss")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("stall: gap before the next token (ms)")
    axes[0].legend()
    fig.suptitle("pdserve stream migration: the client's stall (live, CPU, test model)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
