"""Stream migration (``deployments/ingress/migration.py``) over fake engine handles whose
"model" is a deterministic function of the whole sequence and whose text is vLLM's own
incremental detokenizer, as a real engine's is: a stream whose decode replica dies after
some chunks must go on from the exact token, with the text, stop strings, ``n``, logprobs and
usage of an uninterrupted run. The same on real engines: ``tests/e2e/test_faults.py``."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from ray.exceptions import ActorDiedError

from deployments.ingress.migration import (
    SeamText,
    SentSequence,
    continuation_sampling,
    continuation_seed,
)
from deployments.protocol import EngineChunk, EngineDown, EngineRequest, Sampling, TokenLogprob
from tests.unit.test_deployments_ingress import KV, OP, _wire, auth

pytestmark = pytest.mark.slow  # the tiny model's tokenizer

PROMPT = list(range(200, 240))
KEYS = {"ingress": {"api_keys": {"ka": "alice"}}}


def next_token(ids: list[int], seed: int | None) -> int:
    """The fake model: the next token of a sequence (its seed moves it when sampling)."""
    return 100 + (sum(ids[-3:]) * 31 + len(ids) * 7 + (seed or 0)) % 900


class ModelEngine:
    """A fake engine deployment (prefill and decode) over :func:`next_token`, its text made
    by vLLM's ``IncrementalDetokenizer`` with the request's stop strings, as an engine's.
    ``dies_after``: the replica dies after that many more chunks (once: its calls then go to
    a live replica); ``dies_every``: every call's replica dies after that many chunks."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.dies_after: int | None = None
        self.dies_every: int | None = None
        self.down = False  # the replica's engine fails (EngineDown) instead of the actor
        self.seen: list[EngineRequest] = []
        self.prefill = SimpleNamespace(remote=self._prefill)
        self.decode = SimpleNamespace(remote=self._decode)

    def options(self, **_: Any) -> ModelEngine:
        return self

    async def _prefill(self, req: EngineRequest) -> EngineChunk:
        self.seen.append(req)
        return EngineChunk("", (1,), "length", len(req.prompt_token_ids), 64, 0.01, KV, None, "p0")

    def _detokenizer(self, req: EngineRequest) -> Any:
        from vllm import SamplingParams
        from vllm.v1.engine.detokenizer import IncrementalDetokenizer

        kw = req.sampling.to_vllm_kwargs()
        keep = ("stop", "include_stop_str_in_output", "min_tokens", "skip_special_tokens")
        sp = SamplingParams(max_tokens=1, **{k: kw[k] for k in keep if kw.get(k) is not None})
        r = SimpleNamespace(
            request_id="x",
            sampling_params=sp,
            prompt_token_ids=list(req.prompt_token_ids),
            prompt_embeds=None,
        )
        return IncrementalDetokenizer.from_new_request(self.tokenizer, r)

    async def _decode(self, req: EngineRequest) -> AsyncIterator[EngineChunk]:
        self.seen.append(req)
        s = req.sampling
        kw = s.to_vllm_kwargs()
        seqs = [list(req.prompt_token_ids) for _ in range(s.n)]
        dets = [self._detokenizer(req) for _ in range(s.n)]
        done = [False] * s.n
        sent = 0
        die = self.dies_every
        if self.dies_after is not None:
            die, self.dies_after = self.dies_after, None
        for step in range(s.max_tokens):
            for i in range(s.n):
                if done[i]:
                    continue
                if die is not None and sent >= die:
                    if self.down:
                        raise EngineDown("the engine core has failed")
                    raise ActorDiedError()
                seed = None if kw.get("seed") is None else int(kw["seed"]) + i
                tok = next_token(seqs[i], seed if s.temperature > 0 else None)
                seqs[i].append(tok)
                stop = dets[i].update([tok], False)
                last = step == s.max_tokens - 1
                finish = "stop" if stop is not None else ("length" if last else None)
                done[i] = finish is not None
                lp = None
                if s.logprobs is not None:
                    lp = (TokenLogprob(tok, None, -0.25 - tok / 1000, ((tok, None, -0.25, 1),)),)
                sent += 1
                yield EngineChunk(
                    dets[i].get_next_output_text(done[i], True),
                    (tok,),
                    finish,
                    len(req.prompt_token_ids),
                    0,
                    0.01,
                    stop_reason=stop,
                    replica_id="d0",
                    index=i,
                    logprobs=lp,
                )


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> Any:
    from deployments.ingress.tokenizer import Tokenizer

    tok = Tokenizer(str(tiny_model_dir)).tok
    pre, dec = ModelEngine(tok), ModelEngine(tok)
    client, _, _ = _wire(tiny_model_dir, KEYS, engines=(pre, dec), app_name="migration-test")
    client.dec = dec  # type: ignore[attr-defined]
    return client


def body(**kw: Any) -> dict[str, Any]:
    return {"model": "test", "prompt": PROMPT, "max_tokens": 24, "temperature": 0} | kw


def streamed(client: Any, b: dict[str, Any]) -> tuple[dict[int, dict[str, Any]], list[Any]]:
    """Per choice: text, token ids, finish and stop reasons, logprob count; and every event."""
    r = client.post("/v1/completions", headers=auth(), json=b | {"stream": True})
    assert r.status_code == 200, r.text
    lines = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    events = [json.loads(x) for x in lines[:-1]]
    out: dict[int, dict[str, Any]] = {}
    for e in events:
        for c in e.get("choices") or ():
            o = out.setdefault(c["index"], {"text": "", "ids": [], "lp": 0})
            o["text"] += c["text"]
            o["ids"] += c.get("token_ids") or []
            o["lp"] += len((c.get("logprobs") or {}).get("tokens") or [])
            if c.get("finish_reason"):
                o["finish"], o["stop"] = c["finish_reason"], c.get("stop_reason")
    return out, events


def moves(client: Any) -> dict[str, dict[str, int]]:
    stats = client.get("/v1/pdserve/stats", headers=OP).json()
    return dict(stats["ingress"]["migrations"])


def test_a_stream_goes_on_from_the_exact_token_on_another_replica(model: Any) -> None:
    """Killed after 7 chunks: the client's stream ends with ``[DONE]`` and no error, its
    text and token ids are the uninterrupted run's (none missing or twice), the
    continuation was the prompt plus the 7 tokens sent for the 17 still due, and usage
    counts the prompt once and every completion token."""
    dec = model.dec
    b = body(return_token_ids=True, stream_options={"include_usage": True})
    ref, _ = streamed(model, b)
    before = moves(model).get("replica_gone", {}).get("migrated", 0)
    dec.dies_after = 7
    got, events = streamed(model, b)
    assert not any("error" in e for e in events)
    assert got == ref and len(got[0]["ids"]) == 24
    cont = dec.seen[-1]
    assert list(cont.prompt_token_ids) == PROMPT + ref[0]["ids"][:7]
    assert cont.sampling.max_tokens == 17 and cont.kv_transfer_params is None  # computed there
    assert cont.route is not None and cont.route.avoid == ("d0",)  # not the lost replica
    use = events[-1]["usage"]
    assert use["prompt_tokens"] == len(PROMPT) and use["completion_tokens"] == 24
    assert moves(model)["replica_gone"]["migrated"] == before + 1
    last = model.get("/v1/pdserve/stats", headers=OP).json()["ingress"]["migration_last"]
    assert last["stall_s"] >= last["detect_s"] + last["prefill_s"] >= 0  # its parts


def test_a_stop_string_across_the_seam_stops_where_it_would_have(model: Any) -> None:
    """A stop string whose first characters came before the replica died (held back by the
    engine, never sent) and whose last came after it: the client's text ends before it, as
    an uninterrupted run's does (the ingress applies stop strings to a migrated sequence)."""
    dec = model.dec
    _, events = streamed(model, body())
    texts = [c["text"] for e in events for c in e.get("choices") or ()]
    full = "".join(texts)
    for k in range(6, 18):  # a seam after k tokens with a stop string across it
        head = "".join(texts[:k])
        stop = full[len(head) - 2 : len(head) + 2]
        if len(stop) == 4 and full.find(stop) == len(head) - 2:
            break
    else:
        pytest.fail(f"no stop string spans a seam in {full!r}")
    ref, _ = streamed(model, body(return_token_ids=True, stop=[stop]))
    assert ref[0]["finish"] == "stop" and ref[0]["stop"] == stop
    dec.dies_after = k  # k tokens sent; the stop string's head held back at the seam
    got, events = streamed(model, body(return_token_ids=True, stop=[stop]))
    assert not any("error" in e for e in events)
    assert got == ref
    assert dec.seen[-1].sampling.stop == ()  # the ingress applies them across the seam


def test_n_sequences_move_alone_keeping_their_index_and_logprobs(model: Any) -> None:
    """``n = 2`` with logprobs, not streamed: both sequences move, each as its own request
    (``n`` 1, its seed moved on), and each choice is the uninterrupted one, one logprob per
    token."""
    dec = model.dec
    b = body(n=2, logprobs=1, return_token_ids=True, temperature=0.8, seed=11)
    ref = model.post("/v1/completions", headers=auth(), json=b).json()
    dec.dies_after = 6  # three tokens of each
    n_seen = len(dec.seen)
    got = model.post("/v1/completions", headers=auth(), json=b)
    assert got.status_code == 200, got.text
    out = got.json()
    conts = dec.seen[n_seen + 1 :]
    assert sorted(len(c.prompt_token_ids) - len(PROMPT) for c in conts) == [3, 3]
    assert {c.sampling.n for c in conts} == {1}
    seeds = {c.sampling.to_vllm_kwargs()["seed"] for c in conts}
    assert seeds == {continuation_seed(11, 3), continuation_seed(12, 3)}
    for c, r in zip(out["choices"], ref["choices"], strict=True):
        assert c["index"] == r["index"]
        assert c["token_ids"][:3] == r["token_ids"][:3]  # sampled: only what was sent is equal
        assert len(c["token_ids"]) == 24 == len(c["logprobs"]["tokens"])
    assert out["usage"]["completion_tokens"] == 48


def test_streamed_n_sequences_each_go_on_to_their_end(model: Any) -> None:
    """``n = 2`` streamed (sampled: vLLM refuses greedy ``n > 1``): each sequence keeps the
    tokens it had and goes on to its ``max_tokens``; one ``[DONE]``, no error."""
    dec = model.dec
    b = body(n=2, return_token_ids=True, temperature=0.8, seed=3)
    ref, _ = streamed(model, b)
    dec.dies_after = 5
    got, events = streamed(model, b)
    assert not any("error" in e for e in events)
    assert sorted(got) == [0, 1]
    for i in (0, 1):
        assert len(got[i]["ids"]) == 24 and got[i]["finish"] == "length"
        sent = 3 if i == 0 else 2  # the chunks interleave: 0, 1, 0, 1, 0 before the loss
        assert got[i]["ids"][:sent] == ref[i]["ids"][:sent]


def test_an_engine_failure_migrates_and_the_limit_ends_the_stream_saying_so(model: Any) -> None:
    """The replica's engine failing (``EngineDown``) moves the stream too; a stream whose
    every replica dies moves ``migration_limit`` times, then ends with an error event that
    says so, then ``[DONE]``."""
    dec = model.dec
    ref, _ = streamed(model, body())
    dec.down, dec.dies_after = True, 4
    try:
        got, _ = streamed(model, body())
        assert got == ref
        assert moves(model)["engine_failed"]["migrated"] >= 1
    finally:
        dec.down = False
    dec.dies_every = 3
    try:
        got, events = streamed(model, body())
        errors = [e["error"]["message"] for e in events if "error" in e]
        assert len(errors) == 1 and "migration_limit" in errors[0]
        assert len(got[0]["text"]) > 0  # what came before the last loss reached the client
        assert moves(model)["replica_gone"]["limit"] >= 1
    finally:
        dec.dies_every = None


def test_the_bounds_are_live_and_a_long_sequence_is_not_moved(model: Any) -> None:
    """``migration_max_tokens`` through ``user_config``: a sequence above it ends with the
    error event naming it; a bad value is refused, naming the field, the old ones kept."""
    core = model.core
    dec = model.dec
    try:
        core.reconfigure({"migration": {"migration_max_tokens": len(PROMPT) + 3}})
        assert core.cfg.ingress.migration_max_tokens == len(PROMPT) + 3
        dec.dies_after = 5
        _, events = streamed(model, body())
        errors = [e["error"]["message"] for e in events if "error" in e]
        assert errors and "migration_max_tokens" in errors[0]
        core.reconfigure({"migration": {"migration_limit": -1}})
        assert "user_config.migration.migration_limit" in (core.live_error or "")
        assert core.cfg.ingress.migration_max_tokens == len(PROMPT) + 3
    finally:
        core.reconfigure({"migration": {}})
        dec.dies_after = None


def test_a_continuation_is_prefilled_where_the_index_sends_it(tiny_model_dir: Path) -> None:
    """With a prefill replica up, the continuation's prompt goes through the prefill
    replicas (the prompt plus the tokens sent) and its KV to the decode replica."""
    from deployments.ingress.tokenizer import Tokenizer
    from deployments.router_registry import directory

    tok = Tokenizer(str(tiny_model_dir)).tok
    pre, dec = ModelEngine(tok), ModelEngine(tok)
    client, _, _ = _wire(
        tiny_model_dir,
        KEYS | {"routing": {"local_prefill_threshold_tokens": 0}},
        engines=(pre, dec),
        app_name="migration-pd",
    )
    directory("migration-pd", "prefill").update({"p0": {"wedged": False}})
    ref, _ = streamed(client, body(return_token_ids=True))
    dec.dies_after = 10
    got, _ = streamed(client, body(return_token_ids=True))
    assert got == ref
    assert list(pre.seen[-1].prompt_token_ids) == PROMPT + ref[0]["ids"][:10]
    assert dec.seen[-1].kv_transfer_params == KV


def test_continuation_sampling_moves_the_bounds_on() -> None:
    """Pure: the tokens still due, ``min_tokens`` less those sent, one sequence, no stop
    strings (the ingress's), no prompt logprobs; an unseeded sequence stays unseeded."""
    s = Sampling(
        max_tokens=10,
        stop=("x",),
        n=3,
        prompt_logprobs=2,
        params={
            "max_tokens": 10,
            "min_tokens": 5,
            "n": 3,
            "stop": ["x"],
            "seed": None,
            "prompt_logprobs": 2,
        },
    )
    c = continuation_sampling(s, SentSequence(2, [1, 2, 3]))
    assert (c.max_tokens, c.n, c.stop, c.prompt_logprobs, c.seed) == (7, 1, (), None, None)
    assert c.params is not None
    assert (c.params["max_tokens"], c.params["min_tokens"], c.params["n"]) == (7, 2, 1)
    assert c.params["stop"] is None and c.params["prompt_logprobs"] is None
    assert continuation_seed(5, 3) == continuation_seed(5, 3) != continuation_seed(5, 4)


def test_seam_text_replays_what_was_sent(tiny_model_dir: Path) -> None:
    """Pure: primed with the sent tokens, the seam's detokenizer has the client's text, and
    the rest comes out as one detokenizer's would (a token split across the seam, too)."""
    from deployments.ingress.tokenizer import Tokenizer

    tok = Tokenizer(str(tiny_model_dir)).tok
    eng = ModelEngine(tok)
    ids = [next_token(PROMPT, k) for k in range(40)]
    req = EngineRequest("r", tuple(PROMPT), Sampling(max_tokens=64))
    whole = eng._detokenizer(req)
    text = ""
    for t in ids:
        whole.update([t], False)
        text += whole.get_next_output_text(False, True)
    for cut in (1, 10, 20, 39):
        sent = eng._detokenizer(req)
        sent.update(ids[:cut], False)
        seq = SentSequence(0, ids[:cut], sent.get_next_output_text(False, True))
        seam = SeamText(tok, tuple(PROMPT), Sampling(max_tokens=64), seq)
        assert seam.replayed == seq.text
        rest = "".join(seam.take(EngineChunk("?", (t,), None, 0, 0, 0.0)).text for t in ids[cut:])
        assert seq.text + rest == text


def test_a_responses_stream_migrates_too(model: Any) -> None:
    """``/v1/responses`` runs as a chat: its stream moves as a chat's does, and its events
    read as an uninterrupted run's (the text, the final response's usage), no error."""
    dec = model.dec
    b = {"model": "test", "input": "hello", "max_output_tokens": 24, "temperature": 0}

    def run() -> list[dict[str, Any]]:
        r = model.post("/v1/responses", headers=auth(), json=b | {"stream": True})
        assert r.status_code == 200, r.text
        return [json.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: ")]

    def text(events: list[dict[str, Any]]) -> str:
        return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")

    ref = run()
    before = moves(model).get("replica_gone", {}).get("migrated", 0)
    dec.dies_after = 7
    got = run()
    assert [e["type"] for e in got if e["type"] in ("error", "response.failed")] == []
    assert text(got) == text(ref) and got[-1]["type"] == "response.completed"
    assert got[-1]["response"]["usage"]["output_tokens"] == 24
    assert got[-1]["response"]["output"] == [
        {**item, "id": got[-1]["response"]["output"][0]["id"]}
        for item in ref[-1]["response"]["output"]
    ]
    assert moves(model)["replica_gone"]["migrated"] == before + 1
