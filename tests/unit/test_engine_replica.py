"""The engine replica's pieces that run without an engine: its Serve surface, its shared
state, its counters, its index writer's reports and its output conversion."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from deployments.engine import EngineReplica
from deployments.engine.counters import EngineCounters
from deployments.engine.index_writer import IndexWriter
from deployments.engine.outputs import to_chunk
from deployments.engine.state import ReplicaState
from deployments.protocol import EngineRequest, Sampling, TokenLogprob

#: What Serve, the ingress, the routers and the tests call on a replica, and whether it is a
#: coroutine (Serve runs the two kinds differently).
SURFACE = {
    "prefill": "async",
    "release_kv": "async",
    "decode": "asyncgen",
    "generate": "asyncgen",
    "reconfigure": "async",
    "live_config": "sync",
    "ready": "async",
    "record_routing_stats": "sync",
    "record_autoscaling_stats": "sync",
    "rss_mb": "sync",
    "prefill_tokens_per_s": "sync",
    "model_path": "async",
    "stats": "async",
    "wedged": "sync",
    "check_health": "async",
    "inject_wedge": "async",
    "inject_kv_load_failures": "async",
    "__init__": "async",
    "__del__": "async",
}


def _kind(fn: Any) -> str:
    if inspect.isasyncgenfunction(fn):
        return "asyncgen"
    return "async" if inspect.iscoroutinefunction(fn) else "sync"


def test_the_replica_answers_every_call_it_answered_before_the_split() -> None:
    got = {name: _kind(getattr(EngineReplica, name, None)) for name in SURFACE}
    assert got == SURFACE


def test_every_attribute_the_replica_sets_at_start_is_declared_in_its_state() -> None:
    """The concerns (calls, reports, ...) read the replica's attributes through
    :class:`ReplicaState`; an attribute set in ``__init__`` but not declared there is state
    no concern can name for the type checker."""
    src = Path(inspect.getfile(EngineReplica)).read_text()
    init = next(
        n
        for n in ast.walk(ast.parse(src))
        if isinstance(n, ast.AsyncFunctionDef) and n.name == "__init__"
    )
    set_here = set()
    for node in ast.walk(init):
        targets = node.targets if isinstance(node, ast.Assign) else []
        for t in targets:
            elts = t.elts if isinstance(t, ast.Tuple) else [t]
            for e in elts:
                if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name):
                    set_here.add(e.attr)
    declared = set(ReplicaState.__annotations__)
    assert set_here - declared == set()
    assert declared - set_here == set()


def test_counters_are_a_dataclass_whose_dict_is_the_report() -> None:
    c = EngineCounters()
    c.prefix_hits += 3
    assert c.as_dict() == {
        "prefix_queries": 0,
        "prefix_hits": 3,
        "external_queries": 0,
        "external_hits": 0,
        "kv_load_failures": 0,
        "requests_finished": 0,
    }


def test_an_index_writer_without_a_feed_reports_nothing_and_drops_nothing() -> None:
    launch = SimpleNamespace(endpoints=lambda host: (f"tcp://{host}:1", f"tcp://{host}:2"))
    w = IndexWriter(cfg=None, app_name="a", replica_id="r", kv_launch=launch)  # type: ignore[arg-type]
    assert w.hash_mode == "engine"
    assert w.endpoints("10.0.0.1") == ("tcp://10.0.0.1:1", "tcp://10.0.0.1:2")
    assert (w.tracked_blocks(), w.feed_stats()) == (None, None)
    w.drop()  # no feed: nothing to remove, no thread
    assert IndexWriter(None, "a", "r", None).endpoints("h") == (None, None)  # type: ignore[arg-type]


def _lp(decoded: str, logprob: float, rank: int) -> Any:
    return SimpleNamespace(decoded_token=decoded, logprob=logprob, rank=rank)


def test_a_request_output_becomes_the_wires_chunk() -> None:
    req = EngineRequest("r1", (7, 8, 9), Sampling(max_tokens=2))
    comp = SimpleNamespace(
        text="ab",
        token_ids=[11, 12],
        finish_reason="length",
        stop_reason=None,
        logprobs=[{11: _lp("a", -0.5, 1)}, {12: _lp("b", -0.25, 2), 13: _lp("c", -0.1, 1)}],
    )
    out = SimpleNamespace(
        outputs=[comp],
        prompt_token_ids=None,
        num_cached_tokens=None,
        kv_transfer_params={"x": 1},
        prompt_logprobs=[None, {8: _lp("8", -1.0, 1)}],
    )
    ch = to_chunk(req, out, t0=0.0, replica_id="rep")
    assert (ch.text, ch.token_ids, ch.finish_reason) == ("ab", (11, 12), "length")
    assert (ch.num_prompt_tokens, ch.num_cached_tokens, ch.replica_id) == (3, 0, "rep")
    assert ch.kv_transfer_params == {"x": 1}
    assert ch.logprobs is not None and ch.logprobs[1] == TokenLogprob(
        12, "b", -0.25, ((12, "b", -0.25, 2), (13, "c", -0.1, 1))
    )
    assert ch.prompt_logprobs == (
        TokenLogprob(7, None, None),
        TokenLogprob(8, "8", -1.0, ((8, "8", -1.0, 1),)),
        TokenLogprob(9, None, None),
    )


def test_a_replica_reports_its_recent_prompts_mean_and_p99_to_the_autoscaler() -> None:
    """``record_autoscaling_stats`` (Reports) on a stand-in replica: the SLO sizing's prompt
    mean and p99 come from the prompts it prefilled; none yet, none reported."""
    from collections import deque

    from deployments.autoscaling import METRICS
    from deployments.engine.reports import Reports

    me = SimpleNamespace(
        engine=SimpleNamespace(load={"queued_uncached_tokens": 0}),
        in_flight=0,
        warm=True,
        prompt_tokens=0,
        cached_tokens=0,
        recent_prompts=deque(maxlen=4),
        prefill_tokens_per_s=lambda: None,
    )
    out = Reports.record_autoscaling_stats(me)  # type: ignore[arg-type]
    assert "prompt_tokens_mean" not in out and "prompt_tokens_p99" not in out
    me.recent_prompts.extend([50, 100, 300, 10, 20])  # the oldest (50) has left the window
    out = Reports.record_autoscaling_stats(me)  # type: ignore[arg-type]
    assert (out["prompt_tokens_mean"], out["prompt_tokens_p99"]) == (107.5, 300.0)
    assert set(out) <= set(METRICS)  # every metric is one the policy's module documents
    assert "decode_l_min_s" not in out  # no TWP gate: no measured floor
    # a decode replica with a TWP gate reports the floor the gate measures
    me.engine.load["policy"] = {"twp_state": {"l_min_s": 0.0071, "sigma": 1.0}}
    out = Reports.record_autoscaling_stats(me)  # type: ignore[arg-type]
    assert out["decode_l_min_s"] == 0.0071 and set(out) <= set(METRICS)
