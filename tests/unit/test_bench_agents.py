"""``pdserve bench agents``'s pure parts: the seeded conversations grow as an agent's do, the
client loop reads a stream's call and timing and sends it back, the per-turn summary's
maths, the table and plot writers, and the command's refusals before anything comes up."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

import pdserve.cli  # noqa: F401  (registers the commands)
from bench.live.agents import (
    Turn,
    plot,
    run_agents,
    summarize_turns,
    system_table,
    turn_table,
)
from bench.workloads.agents import (
    TOOL,
    TOPICS,
    AgentMix,
    after_turn,
    chat_body,
    opening,
    opening_bound,
    positions_needed,
    seeded_call,
    tool_result,
)
from pdserve.apps import app

WORDS = [f" w{i}" for i in range(100)]


def n_words(text: str) -> int:
    return len(text.split())


# -- the conversations ------------------------------------------------------------------------


def test_conversations_are_seeded_and_share_only_the_system_prompt() -> None:
    mix = AgentMix(agents=3, turns=4, tool_tokens=50, system_tokens=20, task_tokens=7, seed=1)
    a = [opening(mix, i, WORDS) for i in range(3)]
    assert a == [opening(mix, i, WORDS) for i in range(3)]  # seeded
    assert [m["role"] for m in a[0]] == ["system", "user"]
    assert a[0][0] == a[1][0] == a[2][0]  # one system prompt for all agents
    assert len({x[1]["content"] for x in a}) == 3  # a task of each agent's own
    assert n_words(a[0][0]["content"]) == 20 and n_words(a[0][1]["content"]) == 7
    # each word keeps its leading space: n words are n whole-word tokens
    assert a[0][1]["content"].startswith(" w")
    r = tool_result(mix, 0, 2, WORDS)
    assert n_words(r) == 50 and r == tool_result(mix, 0, 2, WORDS)
    assert r != tool_result(mix, 0, 3, WORDS) and r != tool_result(mix, 1, 2, WORDS)
    other = AgentMix(agents=3, turns=4, tool_tokens=50, system_tokens=20, task_tokens=7, seed=2)
    assert opening(other, 0, WORDS) != a[0] and tool_result(other, 0, 2, WORDS) != r
    call = seeded_call(mix, 1, 2)
    assert call == seeded_call(mix, 1, 2) and call["id"] == "call-1-2"
    assert call["function"]["name"] == TOOL["function"]["name"]
    assert json.loads(call["function"]["arguments"])["topic"] in TOPICS


def test_each_turn_resends_the_last_one_with_the_call_and_its_result() -> None:
    mix = AgentMix(agents=1, turns=3, tool_tokens=10, system_tokens=5, task_tokens=3)
    msgs = opening(mix, 0, WORDS)
    history = [msgs]
    for t in range(mix.turns):
        call = seeded_call(mix, 0, t)
        nxt = after_turn(msgs, call, tool_result(mix, 0, t, WORDS))
        assert nxt[: len(msgs)] == msgs and len(nxt) == len(msgs) + 2  # a prefix, grown by 2
        assert nxt[-2] == {"role": "assistant", "content": "", "tool_calls": [call]}
        assert nxt[-1] == {
            "role": "tool",
            "tool_call_id": call["id"],
            "content": tool_result(mix, 0, t, WORDS),
        }
        msgs = nxt
        history.append(msgs)
    assert len(history[0]) == 2 and len(history[-1]) == 2 + 2 * mix.turns
    assert len(history[1]) == 4  # after_turn leaves its input as it was
    body = chat_body("test", msgs, mix)
    assert body["tools"] == [TOOL] and body["tool_choice"] == "required"
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == mix.call_tokens and body["temperature"] == 0
    assert body["messages"] == msgs and body["parallel_tool_calls"] is False


def test_the_position_budget_counts_every_turn() -> None:
    mix = AgentMix(turns=8, tool_tokens=300, call_tokens=64, system_tokens=128, task_tokens=32)
    first = opening_bound(mix)
    assert first > 128 + 32  # the template's markup and the tool's listing on top
    assert positions_needed(mix, first) == first + 8 * (64 + 300 + 32)
    longer = AgentMix(turns=9, tool_tokens=300, call_tokens=64, system_tokens=128, task_tokens=32)
    assert positions_needed(longer, first) - positions_needed(mix, first) == 64 + 300 + 32


@pytest.mark.slow  # the tiny model's tokenizer
def test_the_budget_bounds_a_real_conversation_on_the_built_model(tiny_model_dir: Path) -> None:
    """On the built model's tokenizer: whole words are one token each, so a tool result of
    ``tool_tokens`` words is that many tokens, and the rendered conversation stays within
    :func:`positions_needed` every turn."""
    from transformers import AutoTokenizer

    from bench.live.agents import vocabulary_words

    words = vocabulary_words(tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    mix = AgentMix(agents=1, turns=6, tool_tokens=120, call_tokens=64)

    def tokens(msgs: list[dict[str, Any]]) -> int:
        s = tok.apply_chat_template(msgs, tools=[TOOL], add_generation_prompt=True, tokenize=False)
        return len(tok(s, add_special_tokens=False)["input_ids"])

    result = tool_result(mix, 0, 0, words)
    assert len(tok(result, add_special_tokens=False)["input_ids"]) == mix.tool_tokens
    msgs = opening(mix, 0, words)
    first = tokens(msgs)
    assert first <= opening_bound(mix)
    for t in range(mix.turns):
        call = seeded_call(mix, 0, t)
        # the template gets the arguments as an object, as the app hands them on
        args = json.loads(call["function"]["arguments"])
        call = {**call, "function": {**call["function"], "arguments": args}}
        msgs = after_turn(msgs, call, tool_result(mix, 0, t, words))
        # turn t + 2's prompt (t + 1 turns of history) and its own call
        assert tokens(msgs) + mix.call_tokens <= positions_needed(
            AgentMix(agents=1, turns=t + 2, tool_tokens=120, call_tokens=64), first
        )


# -- the client loop over fake HTTP -----------------------------------------------------------


def sse(*objs: Any) -> list[bytes]:
    return [f"data: {json.dumps(o)}\n\n".encode() for o in objs] + [b"data: [DONE]\n\n"]


def call_stream(call_id: str, topic: str, prompt: int, cached: int | None) -> list[bytes]:
    """vLLM's layout of a streamed required call: the role chunk, the call's opening, its
    arguments in two pieces, the finish, the usage."""
    details = None if cached is None else {"cached_tokens": cached}
    opening_ = {"index": 0, "id": call_id, "type": "function", "function": {"name": "lookup"}}
    return sse(
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [opening_]}}]},
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {
                        "tool_calls": [{"index": 0, "function": {"arguments": '{"topic": '}}]
                    },
                }
            ]
        },
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {
                        "tool_calls": [{"index": 0, "function": {"arguments": f'"{topic}"}}'}}]
                    },
                }
            ]
        },
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
        {
            "choices": [],
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": 12,
                "total_tokens": prompt + 12,
                "prompt_tokens_details": details,
            },
        },
    )


class FakeAgentServer:
    """A chat endpoint that answers each agent's turn ``t`` with a call (ids naming agent and
    turn), ``prompt = 100 (t + 1)`` and ``cached = 100 t`` tokens, after ``delay`` seconds
    between the role chunk and the call (so the two times differ); ``fail`` and ``no_call``:
    ``(agent, turn)`` pairs answered 500, or with text and no call."""

    def __init__(self, mix: AgentMix, delay: float = 0.0, cached: bool = True) -> None:
        self.mix = mix
        self.delay = delay
        self.cached = cached
        self.seen: dict[tuple[int, int], list[dict[str, Any]]] = {}
        self.fail: set[tuple[int, int]] = set()
        self.no_call: set[tuple[int, int]] = set()
        self.tasks = {opening(mix, i, WORDS)[1]["content"]: i for i in range(mix.agents)}

    def handler(self, request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/chat/completions"
        body = json.loads(request.content)
        msgs = body["messages"]
        agent = self.tasks[msgs[1]["content"]]
        turn = sum(1 for m in msgs if m["role"] == "assistant")
        self.seen[(agent, turn)] = msgs
        if (agent, turn) in self.fail:
            return httpx.Response(500, text="boom")
        prompt, cached = 100 * (turn + 1), (100 * turn if self.cached else None)
        if (agent, turn) in self.no_call:
            chunks = sse(
                {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
                {"choices": [{"index": 0, "delta": {"content": "no"}, "finish_reason": "length"}]},
                {"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": 1}},
            )
        else:
            chunks = call_stream(f"chatcmpl-tool-{agent}-{turn}", "logs", prompt, cached)

        async def body_() -> AsyncIterator[bytes]:
            yield chunks[0]
            await asyncio.sleep(self.delay)
            for c in chunks[1:]:
                yield c

        return httpx.Response(200, content=body_(), headers={"content-type": "text/event-stream"})


def test_agents_send_back_the_answers_call_and_the_tools_result() -> None:
    mix = AgentMix(agents=2, turns=3, tool_tokens=8, system_tokens=4, task_tokens=3)
    server = FakeAgentServer(mix, delay=0.02)
    ticks: list[int] = []
    turns, wall = asyncio.run(
        run_agents(
            "http://app",
            mix,
            WORDS,
            "test",
            transport=httpx.MockTransport(server.handler),
            progress=ticks.append,
        )
    )
    assert len(turns) == 6 and sum(ticks) == 6 and wall > 0
    assert [(t.agent, t.turn) for t in turns] == [(a, t) for a in range(2) for t in range(3)]
    for t in turns:
        assert t.ok and t.called and not t.error
        assert t.prompt_tokens == 100 * (t.turn + 1) and t.cached_tokens == 100 * t.turn
        assert t.completion_tokens == 12
        # the role chunk first, the call's opening after the server's pause
        assert t.first_chunk_s is not None and t.ttft_s is not None
        assert t.first_chunk_s < t.ttft_s <= t.e2e_s and t.ttft_s - t.first_chunk_s >= 0.015
    for agent in range(2):
        for turn in range(1, 3):
            prev, now = server.seen[(agent, turn - 1)], server.seen[(agent, turn)]
            assert now[: len(prev)] == prev and len(now) == len(prev) + 2
            call = now[-2]["tool_calls"][0]
            # the call as the stream gave it, put together from its pieces
            assert call == {
                "id": f"chatcmpl-tool-{agent}-{turn - 1}",
                "type": "function",
                "function": {"name": "lookup", "arguments": '{"topic": "logs"}'},
            }
            assert now[-1] == {
                "role": "tool",
                "tool_call_id": call["id"],
                "content": tool_result(mix, agent, turn - 1, WORDS),
            }


def test_a_failed_turn_or_one_without_a_call_still_grows_the_conversation() -> None:
    mix = AgentMix(agents=1, turns=3, tool_tokens=8, system_tokens=4, task_tokens=3)
    server = FakeAgentServer(mix)
    server.fail, server.no_call = {(0, 0)}, {(0, 1)}
    turns, _ = asyncio.run(
        run_agents("http://app", mix, WORDS, "test", transport=httpx.MockTransport(server.handler))
    )
    first, second, third = turns
    assert not first.ok and first.error == "HTTP 500: boom" and not first.called
    assert second.ok and not second.called and second.ttft_s is not None  # text counts
    assert second.cached_tokens is None  # no prompt_tokens_details: none reported
    assert third.ok and third.called
    # the agent's seeded calls stand in for the missing ones
    sent = server.seen[(0, 2)]
    assert [m["tool_calls"][0] for m in sent if m["role"] == "assistant"] == [
        seeded_call(mix, 0, 0),
        seeded_call(mix, 0, 1),
    ]


def test_a_transport_failure_is_a_failed_turn() -> None:
    mix = AgentMix(agents=1, turns=2, tool_tokens=8, system_tokens=4, task_tokens=3)

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    turns, _ = asyncio.run(
        run_agents("http://app", mix, WORDS, "test", transport=httpx.MockTransport(refuse))
    )
    assert [t.ok for t in turns] == [False, False] and "ConnectError" in turns[0].error


@pytest.mark.slow  # the tiny model's tokenizer
def test_the_apps_own_ingress_takes_the_turns_and_streams_the_call_back(
    tiny_model_dir: Path,
) -> None:
    """The client loop against the real ingress in process (hermes parser on, a scripted
    decode engine answering a call): every turn is taken, the stream's call is read, the
    call and result re-render into a prompt that grows by one result and call a turn, and
    the decode's grammar holds the call to the tool's schema."""
    from transformers import AutoTokenizer

    from bench.live.agents import vocabulary_words
    from tests.unit.test_ingress_tool_calls import PARSERS, _agent, grammar_takes

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    client, _, dec = _agent(tiny_model_dir, tok, **PARSERS)
    call = '<tool_call>{"name": "lookup", "arguments": {"topic": "logs"}}</tool_call>'
    dec.answers = [call]
    mix = AgentMix(agents=2, turns=3, tool_tokens=50)
    turns, _ = asyncio.run(
        run_agents(
            "http://testserver",
            mix,
            vocabulary_words(tiny_model_dir),
            "test",
            transport=httpx.ASGITransport(app=client.app),
        )
    )
    assert all(t.ok and t.called and t.ttft_s is not None for t in turns), turns
    prompts = [t.prompt_tokens for t in turns if t.agent == 0]
    growth = {b - a for a, b in zip(prompts, prompts[1:], strict=False)}
    assert len(growth) == 1 and mix.tool_tokens < growth.pop() <= mix.tool_tokens + 64
    assert len(dec.seen[-1].prompt_token_ids) == prompts[-1]
    assert grammar_takes(dec, tok, call)
    assert not grammar_takes(dec, tok, call.replace("logs", "weather"))  # off the enum


# -- summary, table, plot ---------------------------------------------------------------------


def _turn(agent: int, turn: int, ttft: float, prompt: int, cached: int | None, **kw: Any) -> Turn:
    return Turn(agent, turn, True, ttft, ttft / 2, ttft * 3, prompt, cached, 10, called=True, **kw)


def test_the_summary_per_turn_and_overall() -> None:
    turns = [
        _turn(0, 0, 0.1, 400, 0),
        _turn(1, 0, 0.3, 400, 256),
        _turn(0, 1, 0.2, 800, 512),
        _turn(1, 1, 0.4, 800, 768),
        Turn(2, 1, False, error="HTTP 503: busy"),
    ]
    s = summarize_turns(turns, wall_s=2.0)
    assert s["turns"] == 5 and s["errors"] == 1 and s["error_samples"] == ["HTTP 503: busy"]
    assert s["turns_per_s"] == 2.0  # four answered turns in two seconds
    assert s["calls_answered"] == 1.0
    assert s["cached_token_ratio"] == (256 + 512 + 768) / 2400
    one, two = s["per_turn"]
    assert one["turn"] == 1 and one["turns"] == 2 and one["errors"] == 0
    assert one["ttft_p50"] == pytest.approx(0.2) and one["ttft_p90"] == pytest.approx(0.28)
    assert one["first_chunk_p50"] == pytest.approx(0.1)
    assert one["cached_token_ratio"] == 256 / 800 and one["prompt_tokens_mean"] == 400
    assert two["turns"] == 3 and two["errors"] == 1  # the failed turn counts, apart
    assert two["cached_token_ratio"] == (512 + 768) / 1600
    assert s["ttft"]["p50"] == pytest.approx(0.25)
    # a server that reports no cached counts (the peer): no ratio, rather than 0
    peer = summarize_turns([_turn(0, 0, 0.1, 400, None)], wall_s=1.0)
    assert peer["cached_token_ratio"] is None and peer["per_turn"][0]["cached_token_ratio"] is None
    empty = summarize_turns([Turn(0, 0, False, error="x")], wall_s=0.0)
    assert empty["turns_per_s"] is None and empty["calls_answered"] is None
    assert empty["per_turn"][0]["ttft_p50"] is None


def _res() -> dict[str, Any]:
    flat = [_turn(a, t, 0.05, 400 * (t + 1), 384 * t) for a in range(2) for t in range(3)]
    grows = [_turn(a, t, 0.05 * (t + 1), 400 * (t + 1), 0) for a in range(2) for t in range(3)]
    rl = summarize_turns(flat, 1.0) | {"requests_per_replica": [6, 0]}
    rr = summarize_turns(grows, 2.0) | {"requests_per_replica": [3, 3]}
    return {
        "kind": "live",
        "mix": {"agents": 2, "turns": 3, "tool_tokens": 300},
        "model": "test",
        "prefill_replicas": 2,
        "decode_replicas": 1,
        "systems": {"prefix_load": rl, "round_robin": rr, "peer": {"error": "TimeoutError: x"}},
    }


def test_the_tables_put_systems_side_by_side_per_turn() -> None:
    res = _res()
    headers, rows = turn_table(res)
    assert headers == [
        "turn",
        "prompt tok",
        "prefix_load TTFT ms p50/p90",
        "prefix_load cached",
        "round_robin TTFT ms p50/p90",
        "round_robin cached",
    ]
    assert rows[0] == [1, "400", "50 / 50", "0%", "50 / 50", "0%"]
    assert rows[2] == [3, "1200", "50 / 50", "64%", "150 / 150", "0%"]
    headers, rows = system_table(res)
    assert headers[0] == "system" and len(rows) == 3
    assert rows[0][:2] == ["prefix_load", "6.00"] and rows[0][6] == "6 / 0"
    assert rows[1][:2] == ["round_robin", "3.00"] and rows[1][6] == "3 / 3"
    assert rows[2][0] == "peer" and rows[2][-1].startswith("failed: TimeoutError")


def test_the_plot_is_written(tmp_path: Path) -> None:
    out = tmp_path / "sub" / "agents.png"
    plot(_res(), out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- the command refuses before bringing anything up ------------------------------------------

runner = CliRunner()


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["--turns", "30"], "--turns"),  # 30 x (64 + 300 + 32) > 8192
        (["--turns", "15", "--tool-tokens", "600"], "--turns"),
        (["--systems", "prefix_load,nope"], "--systems"),
        (["--preset", "huge"], "--preset"),
        (["--agents", "0"], "--agents"),
    ],
)
def test_bench_agents_refuses_bad_input_naming_the_option(args: list[str], names: str) -> None:
    res = runner.invoke(app, ["bench", "agents", *args])
    assert res.exit_code == 2, res.output
    assert names in res.output


def test_bench_agents_takes_a_run_that_fits_the_test_model() -> None:
    from pdserve.commands.bench_agents import max_model_len

    mix = AgentMix(turns=18)
    assert max_model_len("test") == 8192 and max_model_len("bench") == 32768
    assert positions_needed(mix, opening_bound(mix)) <= 8192  # the defaults, 18 turns
    assert positions_needed(AgentMix(turns=19), opening_bound(mix)) > 8192


def test_the_benchs_app_serves_tool_calls_at_the_presets_length() -> None:
    """Both pdserve systems' app: two prefill replicas and one decode replica, hermes tool
    calls on, the preset's positions, keys off on loopback; the peer gets the same engines
    and the same parser."""
    from bench.live.agents import app_args, peer_args
    from deployments.config import load_app_config

    args = app_args("test", 2, 8192, None)
    cfg = load_app_config(args)
    cfg.check_auth()
    assert cfg.prefill.num_replicas == 2 and cfg.decode.num_replicas == 1
    assert cfg.model.max_model_len == 8192 and cfg.model.tool_call_parser == "hermes"
    assert cfg.model.enable_auto_tool_choice and cfg.ingress.auth == "none"
    peer = peer_args(args)
    for role, n in (("prefill_config", 2), ("decode_config", 1)):
        kw = peer[role]["engine_kwargs"]
        assert kw["tool_call_parser"] == "hermes" and kw["enable_auto_tool_choice"] is True
        assert kw["max_model_len"] == 8192
        assert peer[role]["deployment_config"]["num_replicas"] == n
