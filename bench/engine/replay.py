"""A simulator workload replayed through the real vLLM engine, open loop, per prefill policy.

Measured, not simulated (``"simulated": false``), beside the simulator's prediction for
the very same replay (``"sim"``, simulated). Unlike ``bench engine`` (one burst), the
requests arrive at their workload times (open loop: an arrival does not wait for the
engine), so the calm, burst and spike phases of ``sec-spike-paper`` reach the engine as
they do the simulator, scaled in time to this machine through the engine profile (the
workload's arrival rates are multiples of FCFS's capacity on that profile).

Prompts: a workload request carries only its chained block hashes (equal hashes mean equal
prefixes); block ``i`` becomes ``block_size`` token ids drawn from a generator seeded by
its hash, the partial tail block unique to the request. Two prompts then share a token
prefix exactly where their hash chains agree, which is what vLLM's prefix cache sees.

Timing: the engine runs in this process and steps synchronously; before each step the
requests whose arrival time has passed are added. TTFT is the wall time from a request's
*scheduled* arrival to the end of the step that emitted its first token (the simulator's
definition), so an arrival during a long step is charged the rest of that step, as it
would be in any engine that schedules between steps. Each request produces one token (a
prefill node). The prefix cache is reset between policies.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.report.prefill import band_factors, policy_report, six_targets
from bench.sim.prefill import EngineConfig, RunResult, simulate
from bench.workloads.prefill_scenarios import Workload
from controllers.profile import EngineProfile, StepCost
from engines.profiler import fit_step_cost_steps


class _BlockTokens:
    """Token ids of a block hash (memoised): ``block_size`` ids drawn from a generator
    seeded by the hash, in ``[10, vocab - 1)``."""

    def __init__(self, block_size: int, vocab: int) -> None:
        self.block_size = block_size
        self.lo, self.hi = 10, max(11, vocab - 1)
        self.blocks: dict[int, list[int]] = {}

    def draw(self, seed: int | str, n: int) -> list[int]:
        rng = random.Random(seed)
        return [rng.randrange(self.lo, self.hi) for _ in range(n)]

    def chain(self, hashes: Sequence[int]) -> list[int]:
        out: list[int] = []
        for h in hashes:
            if h not in self.blocks:
                self.blocks[h] = self.draw(h, self.block_size)
            out += self.blocks[h]
        return out


def prompt_tokens(work: Workload, vocab: int) -> dict[str, list[int]]:
    """Token ids per request id (see the module docstring)."""
    blocks = _BlockTokens(work.block_size, vocab)
    out: dict[str, list[int]] = {}
    for r in work.requests:
        toks = blocks.chain(r.block_hashes)
        toks += blocks.draw(f"{r.request_id}/tail", r.prompt_tokens - len(toks))
        out[r.request_id] = toks
    return out


def _warm(work: Workload, vocab: int) -> list[list[int]]:
    blocks = _BlockTokens(work.block_size, vocab)
    return [blocks.chain(chain) for chain in work.warm]


def _result_from_ttfts(work: Workload, ttft: dict[str, float]) -> RunResult:
    """A :class:`RunResult` over measured TTFTs, so the simulator's report code applies."""
    from bench.sim.prefill import FinishedRequest

    fin = [
        FinishedRequest(
            r.request_id,
            r.arrival_s,
            r.arrival_s,
            r.arrival_s + ttft[r.request_id],
            r.prompt_tokens,
            0,
            r.labels,
        )
        for r in work.requests
        if r.request_id in ttft
    ]
    horizon = max((f.finish_s for f in fin), default=0.0)
    rest = [r for r in work.requests if r.request_id not in ttft]
    return RunResult("engine", fin, rest, horizon, 0, 0.0, 0)


@contextmanager
def _chunk_log(sched: Any) -> Iterator[list[list[tuple[int, int]]]]:
    """While open, every step's chunks ``(c, p)`` are logged: ``c`` tokens of a request
    from position ``p`` (vLLM advances ``num_computed_tokens`` inside ``schedule``, so
    ``p`` is it less ``c``), the simulator's step-cost inputs. It wraps ``sched.schedule``
    on the instance and removes the wrapper on exit."""
    log: list[list[tuple[int, int]]] = []
    inner = sched.schedule

    def schedule(*args: Any, **kwargs: Any) -> Any:
        out = inner(*args, **kwargs)
        log.append(
            [
                (int(c), int(sched.requests[rid].num_computed_tokens) - int(c))
                for rid, c in out.num_scheduled_tokens.items()
            ]
        )
        return out

    sched.schedule = schedule
    try:
        yield log
    finally:
        del sched.schedule


def step_cost_check(
    steps: dict[str, Sequence[Sequence[Any]]], profile_cost: StepCost, *, long_head: int = 2048
) -> dict[str, Any]:
    """The profile's step cost held against a replay's measured steps.

    ``steps``: per policy, ``[step_s, [[c, p], ...]]`` as :func:`replay` logs them. Returns
    the step cost refitted on all of them (``refit``, the profiler's fit) and, per group of
    steps, the measured seconds, the profile's predicted seconds and their ratio
    (``predicted / measured``; above 1: the profile overprices). Groups: ``all``; by policy;
    ``long_context``: steps with a chunk that starts at or beyond ``long_head`` tokens
    (past what the profile measured before stop 34) against ``short_context``; and the
    replay's wall time in thirds per policy (``third_1..3``: the machine's drift)."""
    per_policy = {
        pol: [(float(t), [(int(c), int(p)) for c, p in ch]) for t, ch in st if ch]
        for pol, st in steps.items()
    }
    every = [row for rows in per_policy.values() for row in rows]
    refit = fit_step_cost_steps([(ch, t) for t, ch in every]) if len(every) >= 3 else profile_cost
    groups: dict[str, list[tuple[float, list[tuple[int, int]]]]] = {"all": every, **per_policy}
    for rows in per_policy.values():
        n = len(rows)
        for k in range(3):
            groups.setdefault(f"third_{k + 1}", []).extend(rows[k * n // 3 : (k + 1) * n // 3])
    groups["long_context"] = [(t, ch) for t, ch in every if max(p for _, p in ch) >= long_head]
    groups["short_context"] = [(t, ch) for t, ch in every if max(p for _, p in ch) < long_head]
    report: dict[str, Any] = {}
    for name, rows in groups.items():
        meas = sum(t for t, _ in rows)
        pred = sum(profile_cost.seconds(ch) for _, ch in rows)
        fit = sum(refit.seconds(ch) for _, ch in rows)
        report[name] = {
            "steps": len(rows),
            "measured_s": round(meas, 3),
            "profile_s": round(pred, 3),
            "profile_over_measured": round(pred / meas, 3) if meas > 0 else None,
            "refit_over_measured": round(fit / meas, 3) if meas > 0 else None,
        }
    return {
        "profile": profile_cost.model_dump(mode="json"),
        "refit": refit.model_dump(mode="json"),
        "long_head": long_head,
        "groups": report,
    }


def refit_profile(profile: EngineProfile, check: dict[str, Any], what: str) -> EngineProfile:
    """``profile`` with the step cost :func:`step_cost_check` refitted on a replay's
    measured steps (``what`` names the replay in the profile's ``source``): a profile
    that a later replay can scale its arrivals by, measured under load for minutes
    rather than on an idle engine for seconds."""
    n = check["groups"]["all"]["steps"]
    return profile.model_copy(
        update={
            "step_cost": StepCost(**check["refit"]),
            "source": f"{profile.source}; step cost refitted on {n} steps measured in a "
            f"`bench replay` of {what}",
        }
    )


#: The prediction band's half-width: the simulator is run again with every step this much
#: cheaper and dearer. Why 2%: in the stop-34 replays a step cost that priced all steps at
#: 1.00x their measured time priced each policy's own steps at 0.97-1.03x. The policies run
#: one after another, and identical steps took 2-4% longer or shorter from one policy's
#: run to the next (the shared machine's speed). Near saturation that is not small in
#: TTFT: priced exactly on Fairway's own steps (its profile x 0.985), the seed-3 spike
#: median went from 4.57 s to 3.06 s, against 2.98 s measured.
BAND_REL = 0.02


def prediction_band(
    predict: Callable[[EngineProfile, str], dict[str, Any]],
    profile: EngineProfile,
    policies: Sequence[str],
    central: dict[str, dict[str, Any]],
    rel: float = BAND_REL,
    points: int = 9,
) -> dict[str, Any]:
    """The simulator's prediction with the step cost scaled from ``1 - rel`` to ``1 + rel``.

    The scale takes ``points`` evenly spaced values, not only the two ends: a percentile of
    a bimodal TTFT (a spike's hits served at once, its misses queued) jumps as the queue
    crosses it, so it need not move monotonically with the step cost (seed 3's Fairway
    spike median: 3.23 s at 0.97, 2.90 s at 0.98, 4.57 s at 1). ``central`` is the
    prediction at 1, already made. Returns ``policies``: per policy and phase, ``[low,
    high]`` of p50 and p99 TTFT over the points and ``central``; and ``six_targets``: per
    policy, ``[fewest, most]`` of the paper's targets met over them (``None`` without FCFS
    and LPM: the targets are relative to them)."""
    runs = [central] + [
        {pol: predict(profile.with_step_cost_scaled(f), pol) for pol in policies}
        for f in band_factors(rel, points)
        if abs(f - 1.0) > 1e-9
    ]
    band: dict[str, dict[str, dict[str, list[float]]]] = {}
    for pol in policies:
        reps = [run[pol]["ttft"] for run in runs]
        band[pol] = {
            ph: {
                stat: [min(r[ph][stat] for r in reps), max(r[ph][stat] for r in reps)]
                for stat in ("p50", "p99")
            }
            for ph in reps[0]
            if all(r[ph]["n"] for r in reps)
        }
    counts = [six_targets({pol: run[pol] for pol in policies}) for run in runs]
    met = [[c[pol]["met"] for c in counts if c is not None] for pol in policies]
    targets = (
        {pol: [min(m), max(m)] for pol, m in zip(policies, met, strict=True)}
        if all(c is not None for c in counts)
        else None
    )
    return {"policies": band, "six_targets": targets}


def _band_block(
    predict: Callable[[EngineProfile, str], dict[str, Any]],
    profile: EngineProfile,
    measured: dict[str, dict[str, Any]],
    central: dict[str, dict[str, Any]],
    rel: float,
) -> dict[str, Any]:
    """A replay's ``sim_band``: :func:`prediction_band` and :func:`band_coverage`."""
    band = prediction_band(predict, profile, list(measured), central, rel)
    return {
        "simulated": True,
        "rel": rel,
        "note": f"the simulator's p50 and p99 with every step {rel:.0%} cheaper to {rel:.0%} "
        "dearer: the spread of a step cost's accuracy across policies",
        **band,
        "coverage": band_coverage(measured, band["policies"]),
    }


def rebuild_workload(res: dict[str, Any]) -> Workload:
    """The workload a stored replay (``bench replay --json``) ran: its scenario and seed
    built at the profile it used (``quick`` as stored; replays written before stop 35 did
    not store it, and then the form whose request count matches is taken)."""
    from bench.workloads.prefill_scenarios import build_scenario

    prof = EngineProfile.model_validate(res["profile_used"])
    for quick in [res["quick"]] if "quick" in res else [False, True]:
        work = build_scenario(res["scenario"], seed=int(res["seed"]), quick=quick, profile=prof)
        if len(work.requests) == res["requests"]:
            return work
    raise ValueError(
        f"{res['scenario']} seed {res['seed']} at the stored profile does not give the "
        f"replay's {res['requests']} requests (built with another version of the scenario?)"
    )


def band_of_stored(res: dict[str, Any], work: Workload, rel: float = BAND_REL) -> dict[str, Any]:
    """The simulator's band for a stored replay, from what it stored: ``work`` as
    :func:`rebuild_workload` rebuilt it, the prediction at its profile simulated again, and
    the measured figures held against the band (no engine runs)."""
    prof = EngineProfile.model_validate(res["profile_used"])
    predict = _predictor(
        work, int(res["kv_blocks"]), int(res["token_budget"]), int(res.get("max_running", 64))
    )
    central = {pol: predict(prof, pol) for pol in res["policies"]}
    return _band_block(predict, prof, res["policies"], central, rel)


def _predictor(
    work: Workload, kv_blocks: int, token_budget: int, max_running: int
) -> Callable[[EngineProfile, str], dict[str, Any]]:
    """The simulator's report of ``work`` for a profile and a policy, on the engine shape a
    replay ran (its KV cache, token budget and running cap)."""
    cfg = EngineConfig(
        token_budget=token_budget, max_running=max_running, block_size=work.block_size
    )
    keys = list(work.keys)

    def predict(prof: EngineProfile, policy: str) -> dict[str, Any]:
        run = simulate(work.requests, policy, prof, kv_blocks, config=cfg, warm=work.warm)
        return policy_report(run, keys)

    return predict


def band_coverage(
    measured: dict[str, dict[str, Any]], band: dict[str, dict[str, dict[str, list[float]]]]
) -> dict[str, dict[str, Any]]:
    """Per policy: how many of the band's cells (phase x p50/p99) hold the measured value,
    and the ones that do not (``"spike p50 above"``: measured above the band)."""
    out: dict[str, dict[str, Any]] = {}
    for pol, phases in band.items():
        t = measured[pol]["ttft"]
        outside = []
        cells = 0
        for ph, stats in phases.items():
            for stat, (lo, hi) in stats.items():
                v = t[ph][stat]
                cells += 1
                if v < lo:
                    outside.append(f"{ph} {stat} below")
                elif v > hi:
                    outside.append(f"{ph} {stat} above")
        out[pol] = {"inside": cells - len(outside), "cells": cells, "outside": outside}
    return out


def replay(
    llm: Any,
    work: Workload,
    policies: Sequence[str],
    profile: EngineProfile,
    *,
    kv_blocks: int,
    token_budget: int,
    max_running: int,
    configure: Callable[[str], None],
    progress: Callable[[str, int, int], None] | None = None,
    max_wall_s: float = 3600.0,
    band_rel: float = BAND_REL,
) -> dict[str, Any]:
    """Replay ``work`` through ``llm`` once per policy (``configure(policy)`` switches the
    live scheduler and resets the prefix cache); returns measured and simulated reports,
    the simulator's band (:func:`prediction_band`, ``band_rel``) and whether the measured
    figures fall in it."""
    from vllm import SamplingParams

    from engines.runtime import live_scheduler

    eng = llm.llm_engine
    vocab = int(eng.model_config.get_vocab_size())
    prompts = prompt_tokens(work, vocab)
    warm = _warm(work, vocab)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    reqs = sorted(work.requests, key=lambda r: r.arrival_s)
    arrival = {r.request_id: r.arrival_s for r in reqs}
    keys = list(work.keys)
    out: dict[str, Any] = {
        "simulated": False,
        "scenario": work.name,
        "requests": len(reqs),
        "block_size": work.block_size,
        "kv_blocks": kv_blocks,
        "token_budget": token_budget,
        "arrival_span_s": reqs[-1].arrival_s if reqs else 0.0,
        "policies": {},
        "sim": {"simulated": True, "policies": {}},
    }
    measured: dict[str, dict[str, Any]] = {}
    predicted: dict[str, dict[str, Any]] = {}
    sched = live_scheduler(llm)
    predict = _predictor(work, kv_blocks, token_budget, max_running)

    for policy in policies:
        configure(policy)
        for i, w in enumerate(warm):
            eng.add_request(f"warm{i}", {"prompt_token_ids": w}, one)
        while eng.has_unfinished_requests():
            eng.step()
        ttft: dict[str, float] = {}
        cached: dict[str, int] = {}
        steps: list[tuple[float, list[tuple[int, int]]]] = []
        nxt = 0
        t0 = time.monotonic()
        with _chunk_log(sched) as log:
            while nxt < len(reqs) or eng.has_unfinished_requests():
                now = time.monotonic() - t0
                if now > max_wall_s:
                    raise TimeoutError(f"replay of {policy} ran past {max_wall_s:.0f} s")
                while nxt < len(reqs) and reqs[nxt].arrival_s <= now:
                    r = reqs[nxt]
                    eng.add_request(r.request_id, {"prompt_token_ids": prompts[r.request_id]}, one)
                    nxt += 1
                if not eng.has_unfinished_requests():
                    time.sleep(min(0.05, max(0.0, reqs[nxt].arrival_s - now)))
                    continue
                outs = eng.step()
                done = time.monotonic() - t0
                if log and sched.records:
                    steps.append((sched.records[-1].step_s, log[-1]))
                log.clear()
                for o in outs:
                    rid = o.request_id
                    if rid in arrival and rid not in ttft and o.outputs and o.outputs[0].token_ids:
                        ttft[rid] = done - arrival[rid]
                        cached[rid] = int(o.num_cached_tokens or 0)
                if progress is not None:
                    progress(policy, len(ttft), len(reqs))
        measured[policy] = policy_report(_result_from_ttfts(work, ttft), keys)
        measured[policy]["wall_s"] = time.monotonic() - t0
        measured[policy]["cached_tokens"] = cached
        measured[policy]["ttft_s"] = {k: round(v, 4) for k, v in ttft.items()}
        measured[policy]["steps"] = [[round(t, 5), ch] for t, ch in steps]
        predicted[policy] = predict(profile, policy)
    out["policies"] = measured
    out["sim"]["policies"] = predicted
    out["max_running"] = max_running
    out["sim_band"] = _band_block(predict, profile, measured, predicted, band_rel)
    out["step_cost_check"] = step_cost_check(
        {p: measured[p]["steps"] for p in measured}, profile.step_cost
    )
    refit = refit_profile(profile, out["step_cost_check"], work.name)
    out["sim_refit"] = {
        "simulated": True,
        "note": "the simulator with its step cost refitted on this replay's own measured "
        "steps (in-sample: a diagnosis of the queue model, not a prediction)",
        "policies": {p: predict(refit, p) for p in measured},
    }
    for block, reps in (
        (out, measured),
        (out["sim"], predicted),
        (out["sim_refit"], out["sim_refit"]["policies"]),
    ):
        targets = six_targets(reps)
        if targets is not None:
            block["six_targets"] = targets
    return out


def run_engine_replay(
    model_dir: str | Path,
    work: Workload,
    policies: Sequence[str],
    profile: EngineProfile,
    *,
    cache_dir: str | Path,
    token_budget: int = 2048,
    max_running: int = 64,
    progress: Callable[[str, int, int], None] | None = None,
    band_rel: float = BAND_REL,
) -> dict[str, Any]:
    """Start one in-process engine (KV capped at the workload's cache) and :func:`replay`."""
    from engines.config import EngineSchedulerConfig
    from engines.runtime import live_scheduler
    from engines.session import llm_session

    longest = max(r.prompt_tokens for r in work.requests)
    with llm_session(
        model_dir,
        cache_dir=cache_dir,
        kv_blocks=work.cache_blocks,
        max_model_len=max(4096, longest + 16),
        max_num_batched_tokens=token_budget,
        max_num_seqs=max_running,
    ) as llm:
        sched = live_scheduler(llm)

        def configure(policy: str) -> None:
            sched.configure(EngineSchedulerConfig(prefill_policy=policy, profile=profile))
            llm.reset_prefix_cache()

        return replay(
            llm,
            work,
            policies,
            profile,
            kv_blocks=work.cache_blocks,
            token_budget=token_budget,
            max_running=max_running,
            configure=configure,
            progress=progress,
            band_rel=band_rel,
        )
