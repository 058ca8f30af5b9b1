"""The tenant fair-share layer over a prefill policy (pure): turns by uncached tokens served,
charges from what the engine scheduled, a bounded credit for a tenant that returns, and the
inner policy's order kept within each tenant."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import given

from controllers.prefill import PrefillQueueView, PrefillRequestView, make_prefill_policy
from controllers.prefill.baselines import FCFS
from controllers.prefill.fairshare import TenantFairShare, chunk_turns, tenant_key


def req(
    rid: str, tenant: str, arrival: float, uncached: int, cached: int = 0
) -> PrefillRequestView:
    return PrefillRequestView(
        request_id=rid,
        arrival_s=arrival,
        prompt_tokens=uncached + cached,
        patience_s=1.0,
        cached_tokens=cached,
        uncached_tokens=uncached,
        tenant=tenant,
    )


def q(*rs: PrefillRequestView) -> PrefillQueueView:
    return PrefillQueueView.of(rs)


def test_turns_go_by_uncached_tokens_not_by_request_count() -> None:
    """A's requests cost 1,000 tokens, B's 500: B gets two turns for each of A's."""
    fs = TenantFairShare(FCFS(), burst_credit_tokens=0)
    queue = q(
        req("a1", "A", 0.0, 1000),
        req("a2", "A", 0.1, 1000),
        req("a3", "A", 0.2, 1000),
        req("b1", "B", 0.3, 500),
        req("b2", "B", 0.4, 500),
        req("b3", "B", 0.5, 500),
        req("b4", "B", 0.6, 500),
    )
    # both start at 0 (a tie, by name): a1; then B at 0 < 1000: b1, b2 (1000 = A's 1000,
    # A wins the tie by name), a2, then b3, b4 (B at 1000, 1500 < A's 2000), a3
    assert fs.order(queue, 1.0) == ["a1", "b1", "b2", "a2", "b3", "b4", "a3"]


def test_served_moves_only_on_what_the_engine_scheduled() -> None:
    fs = TenantFairShare(FCFS(), burst_credit_tokens=0)
    queue = q(req("a1", "A", 0.0, 1000), req("b1", "B", 0.1, 1000))
    assert fs.order(queue, 1.0)[0] == "a1"
    assert fs.state.served == {}  # ordering charges nothing
    fs.observe_step([("a1", 600)], 1.1)  # a chunk of a1 ran
    assert fs.state.served == {"A": 600.0}
    assert fs.order(q(req("b1", "B", 0.1, 1000), req("a2", "A", 0.2, 10)), 1.2)[0] == "b1"
    fs.observe_step([("unknown", 99)], 1.3)  # a request it never saw: nobody is charged
    assert fs.state.served == {"A": 600.0}


def test_a_returning_tenant_gets_a_bounded_credit_not_its_idle_time() -> None:
    fs = TenantFairShare(FCFS(), burst_credit_tokens=2000)
    flood = [req(f"a{i}", "A", i * 0.01, 1000) for i in range(20)]
    fs.order(q(*flood), 1.0)
    fs.observe_step([(f"a{i}", 1000) for i in range(10)], 2.0)  # A got 10,000 tokens alone
    backlog = flood[10:]
    b = [req(f"b{i}", "B", 3.0 + i * 0.01, 1000) for i in range(5)]
    order = fs.order(q(*backlog, *b), 3.1)
    # B joins at A's 10,000 - 2,000: its credit buys two requests first, then they alternate
    assert order[:5] == ["b0", "b1", "a10", "b2", "a11"]
    assert fs.state.served["B"] == 8000.0
    # with no credit (plain SFQ) B joins at A's level and wins only the tie
    sfq = TenantFairShare(FCFS(), burst_credit_tokens=0)
    sfq.order(q(*flood), 1.0)
    sfq.observe_step([(f"a{i}", 1000) for i in range(10)], 2.0)
    assert sfq.order(q(*backlog, *b), 3.1)[:4] == ["b0", "a10", "a11", "b1"]


def test_a_tenant_that_joins_a_new_engine_just_after_another_gets_no_head_start() -> None:
    """An engine's start: the light tenant B's first prompt is in, served 64 tokens, when the
    flood A arrives 20 ms later with five prompts, and B's next two come with them. A's
    credit is at most what B has been served (it had no service while absent), so A and B
    take turns from the start. With the whole credit for a tenant never served (tried,
    reverted: issue 39), A started 16,384 tokens below B and all five of its prompts went
    before any of B's."""
    fs = TenantFairShare(FCFS(), burst_credit_tokens=16_384)
    fs.order(q(req("b0", "B", 0.0, 1632)), 0.01)
    fs.observe_step([("b0", 64)], 0.015)
    flood = [req(f"a{i}", "A", 0.02, 1632) for i in range(5)]
    b = [req("b0", "B", 0.0, 1632), req("b1", "B", 0.02, 1632), req("b2", "B", 0.02, 1632)]
    order = fs.order(q(*b, *flood), 0.03)
    assert fs.state.served["A"] == 0.0
    assert order[:4] == ["a0", "b0", "a1", "b1"]


def test_inner_order_is_kept_within_a_tenant_and_cache_salts_fold_into_it() -> None:
    fw = make_prefill_policy("fairway+fair_share")
    assert isinstance(fw, TenantFairShare) and fw.name == "fairway+fair_share"
    assert tenant_key("alice:s1") == "alice" and tenant_key("@acme") == "@acme"
    queue = q(
        req("miss", "alice:s1", 0.0, 4000),
        req("hit", "alice", 0.5, 50, cached=3950),  # Fairway's Fast lane puts it first
        req("b", "bob", 0.2, 100),
    )
    order = fw.order(queue, 1.0)
    alice = [r for r in order if r != "b"]
    assert alice == [r for r in fw.inner.order(queue, 1.0) if r != "b"]


@given(
    st.lists(
        st.tuples(st.sampled_from("ABC"), st.integers(1, 5000), st.floats(0, 10)),
        min_size=1,
        max_size=40,
    )
)
def test_every_request_exactly_once_and_one_tenant_is_the_inner_order(
    items: list[tuple[str, int, float]],
) -> None:
    queue = q(*(req(f"r{i}", t, a, w) for i, (t, w, a) in enumerate(items)))
    fs = TenantFairShare(FCFS())
    order = fs.order(queue, 11.0)
    assert sorted(order) == sorted(r.request_id for r in queue.requests)
    one = q(*(req(f"r{i}", "A", a, w) for i, (_, w, a) in enumerate(items)))
    assert TenantFairShare(FCFS()).order(one, 11.0) == FCFS().order(one, 11.0)


def test_a_lighter_tenants_waiting_request_takes_the_step_from_a_floods_running_chunks() -> None:
    """vLLM runs every running chunk before any waiting request: the flood's prompts in
    progress would take the step. A was served 5,000 tokens, B 1,000 and has a request
    waiting: A's two chunks and A's waiting request sit the step out; C, served as little
    as B, keeps its chunk (par never sits out), and it goes before nobody else's."""
    served = {"A": 5000.0, "B": 1000.0, "C": 1000.0}
    turns = chunk_turns(served, [("a1", "A"), ("c1", "C"), ("a2", "A")], [("a3", "A"), ("b1", "B")])
    assert turns.order == ("c1",)
    assert turns.sit_out == {"a1", "a2", "a3"}


def test_running_chunks_go_least_served_first_and_ties_keep_vllms_order() -> None:
    """Nobody waits: no one sits out, but the chunks go by their tenants' served (B's chunk,
    admitted after A's, goes first), equal served in vLLM's order."""
    served = {"A": 5000.0, "B": 1000.0}
    turns = chunk_turns(served, [("a1", "A"), ("b1", "B"), ("a2", "A"), ("x", "")], [])
    assert turns.order == ("x", "b1", "a1", "a2") and not turns.sit_out
    # a waiting request of a tenant served more than every running one changes nothing
    served_z = {**served, "Z": 9000.0}
    more = chunk_turns(served_z, [("a1", "A"), ("b1", "B")], [("z", "Z")])
    assert more == chunk_turns(served_z, [("a1", "A"), ("b1", "B")], [])
    assert more.order == ("b1", "a1") and not more.sit_out


def test_the_share_takes_turns_from_the_tenants_its_order_saw() -> None:
    """:meth:`TenantFairShare.chunk_turns` reads each request's tenant as ``order`` saw it
    (cache salts folded) and the tokens ``observe_step`` charged; B joins with the burst
    credit, so below A."""
    fs = TenantFairShare(FCFS(), burst_credit_tokens=1000)
    fs.order(q(req("a1", "A:salt", 0.0, 2000), req("a2", "A", 0.1, 2000)), now=1.0)
    fs.observe_step([("a1", 512)], now=1.0)
    fs.order(q(req("a2", "A", 0.1, 2000), req("b1", "B", 0.2, 300)), now=2.0)
    turns = fs.chunk_turns(["a1"], ["a2", "b1"])
    assert turns.order == () and turns.sit_out == {"a1", "a2"}
    fs.observe_step([("b1", 300)], now=3.0)
    assert fs.chunk_turns(["a1", "b1"], []).order == ("b1", "a1")


def test_a_waiting_tenant_whose_turn_is_after_the_late_one_does_not_take_its_step() -> None:
    """A sits out for B; D (no chunk, served more than A) must not take the step A gave up,
    E (served between B and A) may, as its turn comes before A's."""
    served = {"A": 5000.0, "B": 1000.0, "D": 6000.0, "E": 3000.0}
    turns = chunk_turns(served, [("a1", "A")], [("b1", "B"), ("d1", "D"), ("e1", "E")])
    assert turns.order == () and turns.sit_out == {"a1", "d1"}


def test_a_newcomer_is_floored_against_a_tenant_with_prompts_running_in_chunks() -> None:
    """A's prompts are all running (none waiting) when B, never served, arrives: B starts
    at A's served less the credit, not at 0, so A sits out for at most the credit."""
    fs = TenantFairShare(FCFS(), burst_credit_tokens=1000)
    fs.order(q(req("a1", "A", 0.0, 50_000)), now=0.0)
    fs.observe_step([("a1", 20_000)], now=1.0)
    fs.chunk_turns(["a1"], [])  # a1 runs in chunks; nothing waits
    fs.order(q(req("b1", "B", 2.0, 100)), now=2.0)
    assert fs.state.served["B"] == 20_000 - 1000


def test_a_tenant_whose_prompts_finished_no_longer_floors_a_newcomer() -> None:
    """``running`` is what the last ``chunk_turns`` saw: once A's chunks are done (the
    mechanism reports no running chunk), a newcomer is not floored against A."""
    fs = TenantFairShare(FCFS(), burst_credit_tokens=1000)
    fs.order(q(req("a1", "A", 0.0, 50_000)), now=0.0)
    fs.observe_step([("a1", 20_000)], now=1.0)
    fs.chunk_turns(["a1"], [])
    fs.chunk_turns([], [])  # a1 finished
    fs.order(q(req("b1", "B", 2.0, 100)), now=2.0)
    assert fs.state.served.get("B", 0.0) == 0.0
