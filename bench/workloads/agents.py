"""The agent conversations of ``pdserve bench agents`` (issue 41): tool-calling agents that
re-send their whole, growing conversation every turn, the prefix-heavy traffic the prefix
index and Fairway exist for.

Each of ``agents`` agents opens with a system message shared by all of them
(``system_tokens`` words) and a task of its own (``task_tokens`` words), and offers the model
one function tool (:data:`TOOL`) with ``tool_choice: "required"``, so every turn's answer is
a call. After a turn the agent appends the answer's call as an assistant message with
``tool_calls`` and a ``role: tool`` message with that call's result (``tool_tokens`` words),
and sends the conversation again: turn ``t``'s prompt is turn ``t - 1``'s plus one call and
one result. The model's call is whatever it answers (temperature 0); when an answer carries
no call (cut off at ``call_tokens``, a failed request), the agent appends a seeded call of its
own (:func:`seeded_call`) so the conversation grows the same way.

Every text is drawn from ``words`` (a vocabulary's whole-word tokens, each with its leading
space, so ``n`` words are exactly ``n`` tokens: :func:`bench.live.agents.vocabulary_words`)
with ``random.Random`` seeded per agent and turn: the same ``(mix, words)`` gives the same
texts whatever the replies, and every system of one run sees the same ones.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

#: The tool's argument values: a strict tool with an enum keeps the call a handful of tokens
#: (the decode engine is held to the schema), so ``call_tokens`` bounds it on any model.
TOPICS = ("build", "config", "logs", "tests", "docs", "metrics", "traces", "deploys")

#: The one function tool every turn offers.
TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look a topic up in the project's knowledge base.",
        "parameters": {
            "type": "object",
            "properties": {"topic": {"type": "string", "enum": list(TOPICS)}},
            "required": ["topic"],
            "additionalProperties": False,
        },
        "strict": True,
    },
}

#: Chat markup one turn adds beyond the call's and the result's own tokens, at most: the
#: assistant and tool turns' role tags and ends, and the call re-rendered by the template
#: (its JSON written again) against the tokens the model spent on it.
TURN_OVERHEAD = 32


@dataclass(frozen=True)
class AgentMix:
    """The agents' conversations (see the module docstring)."""

    agents: int = 5
    turns: int = 8
    tool_tokens: int = 300
    call_tokens: int = 64
    system_tokens: int = 128
    task_tokens: int = 32
    seed: int = 0


def _rng(mix: AgentMix, agent: int, turn: int) -> random.Random:
    """The generator of one agent's one text (``agent`` -1: the shared system prompt; ``turn``
    -1: the agent's task)."""
    return random.Random(((mix.seed * 1_000_003) + agent + 1) * 1_000_033 + turn + 1)


def text(rng: random.Random, words: Sequence[str], n: int) -> str:
    """``n`` words drawn from ``words`` (each with its leading space), joined as they are."""
    return "".join(rng.choice(words) for _ in range(n))


def opening(mix: AgentMix, agent: int, words: Sequence[str]) -> list[dict[str, Any]]:
    """Agent ``agent``'s first prompt: the shared system message and its own task."""
    return [
        {"role": "system", "content": text(_rng(mix, -1, -1), words, mix.system_tokens)},
        {"role": "user", "content": text(_rng(mix, agent, -1), words, mix.task_tokens)},
    ]


def tool_result(mix: AgentMix, agent: int, turn: int, words: Sequence[str]) -> str:
    """What agent ``agent``'s tool answers on turn ``turn`` (0-based): ``tool_tokens`` words."""
    return text(_rng(mix, agent, turn), words, mix.tool_tokens)


def seeded_call(mix: AgentMix, agent: int, turn: int) -> dict[str, Any]:
    """The call the agent appends when the answer carried none (OpenAI's ``tool_calls`` item)."""
    topic = _rng(mix, agent, turn).choice(TOPICS)
    return {
        "id": f"call-{agent}-{turn}",
        "type": "function",
        "function": {"name": TOOL["function"]["name"], "arguments": json.dumps({"topic": topic})},
    }


def after_turn(
    messages: Sequence[dict[str, Any]], call: dict[str, Any], result: str
) -> list[dict[str, Any]]:
    """The next turn's conversation: ``messages``, the call as an assistant message, the
    tool's result for it (a new list; ``messages`` is left as it is)."""
    return [
        *messages,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": result},
    ]


def chat_body(model: str, messages: Sequence[dict[str, Any]], mix: AgentMix) -> dict[str, Any]:
    """One turn's streamed chat request: the tool, a call required, one call at most, greedy,
    at most ``call_tokens`` out, and the usage at the end of the stream."""
    return {
        "model": model,
        "messages": list(messages),
        "tools": [TOOL],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_tokens": mix.call_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def opening_bound(mix: AgentMix, chat_template: str | None = None) -> int:
    """An upper bound on the tokens of any agent's first prompt (with the tool listed and the
    generation prompt): its words (one token each), plus the template's own text rendered
    around empty messages counted in bytes (a byte-level tokenizer's token is at least one
    byte). ``chat_template``: the built models' (:data:`engines.model_builder.CHAT_TEMPLATE`)
    by default."""
    import jinja2

    if chat_template is None:
        from engines.model_builder import CHAT_TEMPLATE

        chat_template = CHAT_TEMPLATE
    empty = [{"role": "system", "content": ""}, {"role": "user", "content": ""}]
    markup = (
        jinja2.Environment()
        .from_string(chat_template)
        .render(
            messages=empty,
            tools=[TOOL],
            add_generation_prompt=True,
            bos_token="<s>",
            eos_token="</s>",
        )
    )
    return mix.system_tokens + mix.task_tokens + len(markup.encode())


def positions_needed(mix: AgentMix, opening_tokens: int) -> int:
    """Positions the longest turn can take: the opening, then every turn's call (at most
    ``call_tokens``), result and markup; the last turn's own call is within that bound."""
    return opening_tokens + mix.turns * (mix.call_tokens + mix.tool_tokens + TURN_OVERHEAD)
