"""Live agent benchmark (``pdserve bench agents``, issue 41): ``agents`` concurrent tool-calling
agents of ``turns`` turns each against the live app over HTTP (OpenAI chat API), each turn
re-sending the agent's whole conversation (:mod:`bench.workloads.agents`), under each system
in turn, one deployed at a time, in one run. Live: real engines, nothing simulated.

Systems (:data:`SYSTEMS`): pdserve with ``routing.policy: prefix_load`` (cache-aware: the
prefix index sends an agent's next turn where its history is cached) and with
``round_robin`` (cache-blind), both two prefill replicas and one decode replica; optionally
Ray Serve LLM's PD app (``peer``: ``build_pd_openai_app`` with its
``PrefixCacheAffinityRouter``, pdserve's own engine arguments, as ``pdserve bench compare``
builds it, plus vLLM's hermes tool parser).

Per turn (streamed, ``stream_options.include_usage``):

- TTFT: the time to the first SSE chunk carrying content or a tool-call delta. With
  ``tool_choice: "required"`` that is the call's opening (``<tool_call>`` and the name) parsed,
  so it includes decoding those few tokens; ``first_chunk_s`` beside it is the time to the
  first chunk at all (the role chunk, which the server sends with the first token: the
  prefill's own TTFT).
- prompt tokens and cached tokens (``usage.prompt_tokens_details.cached_tokens``: the prefill
  engine's prefix-cache hits on pdserve). The peer reports no cached tokens per response;
  its overall ratio comes from its prefill engines' vLLM counters, as in ``bench compare``.
- not the prefill replica: a streamed response does not name it (only a whole response's
  ``pdserve`` field does), and streaming is what gives TTFT; the requests each prefill
  replica took over the whole run come from ``/v1/pdserve/stats`` instead.

Summaries per turn number: TTFT p50/p90, the cached-token ratio (cached / prompt tokens);
overall: turns per second (answered turns over the run's wall time), TTFT, cached ratio, the
share of answers that carried a call.

What to read in it: the KV caches (1 GiB an engine) hold every agent's history many times
over, so round-robin is cache-blind only until a replica has seen an agent: with two prefill
replicas an agent's turn finds its history up to the last turn that replica served (two turns
back when turns alternate), and misses it whole only on its first visit. Its per-turn cached
ratio therefore trails ``prefix_load``'s by about one turn's growth (the call and its result)
rather than falling to zero, and its TTFT is that many more prefill tokens a turn. With an
even number of agents moving in lockstep, round-robin can even keep each agent on one
replica by accident; the default of five agents avoids that. On the ``test`` model a
4,096-token prefill is ~0.1 s, so the TTFT gap is tens of milliseconds against the ingress's
own overhead; ``--preset bench`` makes prefill the cost.

Runs a local Ray cluster in this process (or joins ``RAY_ADDRESS``); hold
``/tmp/pdserve-heavy.lock`` around it on a shared machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.workloads.agents import (
    AgentMix,
    after_turn,
    chat_body,
    opening,
    seeded_call,
    tool_result,
)
from controllers.stats import summarize

APP = "pdbench-agents"


@dataclass(frozen=True)
class System:
    """One system of the run: ``kind`` ``pdserve`` (with ``policy``) or ``peer``."""

    kind: str
    policy: str = ""
    about: str = ""


SYSTEMS: dict[str, System] = {
    "prefix_load": System("pdserve", "prefix_load", "pdserve, cache-aware prefix-index routing"),
    "round_robin": System("pdserve", "round_robin", "pdserve, cache-blind round-robin routing"),
    "peer": System("peer", about="Ray Serve LLM PD app, PrefixCacheAffinityRouter"),
}


@dataclass
class Turn:
    """One agent's one turn, as the client saw it."""

    agent: int
    turn: int
    ok: bool
    #: seconds to the first chunk with content or a tool-call delta
    ttft_s: float | None = None
    #: seconds to the first chunk with a choice (the role chunk, sent with the first token)
    first_chunk_s: float | None = None
    e2e_s: float = 0.0
    prompt_tokens: int = 0
    #: the server's ``prompt_tokens_details.cached_tokens``; None: it reported none
    cached_tokens: int | None = None
    completion_tokens: int = 0
    #: the answer carried a call (else the agent appended its seeded one)
    called: bool = False
    error: str = ""


def _calls(acc: dict[int, dict[str, str]]) -> dict[str, Any] | None:
    """The first streamed call put together (id, name, the arguments' pieces), as OpenAI's
    ``tool_calls`` item; None when there was none or it has no name."""
    if not acc:
        return None
    c = acc[min(acc)]
    if not c["name"]:
        return None
    return {
        "id": c["id"] or "call-0",
        "type": "function",
        "function": {"name": c["name"], "arguments": c["args"] or "{}"},
    }


async def stream_turn(
    client: Any, url: str, body: dict[str, Any]
) -> tuple[Turn, dict[str, Any] | None]:
    """Send one turn, read its stream; ``(its figures, the answer's call or None)``. The
    figures' ``agent`` and ``turn`` are the caller's to set."""
    t0 = time.monotonic()
    out = Turn(-1, -1, False)
    acc: dict[int, dict[str, str]] = {}
    use: dict[str, Any] = {}
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                reason = (await r.aread()).decode(errors="replace")[:160]
                out.error = f"HTTP {r.status_code}: {reason}"
                return out, None
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if "error" in obj:
                    out.error = str(obj["error"])[:200]
                    return out, None
                now = time.monotonic() - t0
                for ch in obj.get("choices") or ():
                    if out.first_chunk_s is None:
                        out.first_chunk_s = now
                    d = ch.get("delta") or {}
                    if out.ttft_s is None and (d.get("content") or d.get("tool_calls")):
                        out.ttft_s = now
                    for tc in d.get("tool_calls") or ():
                        c = acc.setdefault(
                            int(tc.get("index", 0)), {"id": "", "name": "", "args": ""}
                        )
                        c["id"] = c["id"] or (tc.get("id") or "")
                        f = tc.get("function") or {}
                        c["name"] += f.get("name") or ""
                        c["args"] += f.get("arguments") or ""
                if obj.get("usage"):
                    use = obj["usage"]
    except Exception as e:  # a transport failure is a failed turn, reported
        out.error = repr(e)[:200]
        return out, None
    details = use.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    out.ok = True
    out.e2e_s = time.monotonic() - t0
    out.prompt_tokens = int(use.get("prompt_tokens", 0))
    out.cached_tokens = None if cached is None else int(cached)
    out.completion_tokens = int(use.get("completion_tokens", 0))
    call = _calls(acc)
    out.called = call is not None
    return out, call


async def agent(
    client: Any,
    url: str,
    model: str,
    mix: AgentMix,
    words: Sequence[str],
    index: int,
    progress: Callable[[int], None] | None = None,
) -> list[Turn]:
    """One agent's ``turns`` turns, each sent when the last has answered: the answer's call
    (or the seeded one) and the tool's result appended, then the next turn."""
    messages = opening(mix, index, words)
    out = []
    for t in range(mix.turns):
        res, call = await stream_turn(client, url, chat_body(model, messages, mix))
        res.agent, res.turn = index, t
        out.append(res)
        if progress is not None:
            progress(1)
        messages = after_turn(
            messages, call or seeded_call(mix, index, t), tool_result(mix, index, t, words)
        )
    return out


async def run_agents(
    url: str,
    mix: AgentMix,
    words: Sequence[str],
    model: str,
    *,
    transport: Any = None,
    progress: Callable[[int], None] | None = None,
) -> tuple[list[Turn], float]:
    """All ``agents`` agents at once; ``(every turn, in agent then turn order; wall seconds)``.
    ``transport``: an ``httpx`` transport (tests hand in a ``MockTransport``)."""
    import httpx

    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=600, limits=limits, transport=transport) as client:
        t0 = time.monotonic()
        per_agent = await asyncio.gather(
            *(agent(client, url, model, mix, words, i, progress) for i in range(mix.agents))
        )
        wall = time.monotonic() - t0
    return [t for turns in per_agent for t in turns], wall


def _ratio(turns: Sequence[Turn]) -> float | None:
    """Cached over prompt tokens of answered turns; None when the server reported no cached
    counts or there were no prompt tokens."""
    ok = [t for t in turns if t.ok and t.cached_tokens is not None]
    prompt = sum(t.prompt_tokens for t in ok)
    return sum(t.cached_tokens or 0 for t in ok) / prompt if ok and prompt else None


def summarize_turns(turns: Sequence[Turn], wall_s: float) -> dict[str, Any]:
    """Per turn number (1-based): turns, errors, TTFT p50/p90, first chunk p50, mean prompt
    tokens, cached-token ratio; and overall."""
    ok = [t for t in turns if t.ok]
    per_turn = []
    for n in sorted({t.turn for t in turns}):
        at = [t for t in turns if t.turn == n]
        good = [t for t in at if t.ok]
        ttft = summarize(t.ttft_s for t in good if t.ttft_s is not None)
        first = summarize(t.first_chunk_s for t in good if t.first_chunk_s is not None)
        per_turn.append(
            {
                "turn": n + 1,
                "turns": len(at),
                "errors": len(at) - len(good),
                "ttft_p50": ttft["p50"],
                "ttft_p90": ttft["p90"],
                "first_chunk_p50": first["p50"],
                "prompt_tokens_mean": (
                    sum(t.prompt_tokens for t in good) / len(good) if good else None
                ),
                "cached_token_ratio": _ratio(at),
            }
        )
    return {
        "turns": len(turns),
        "errors": len(turns) - len(ok),
        "error_samples": sorted({t.error for t in turns if not t.ok})[:3],
        "calls_answered": (sum(t.called for t in ok) / len(ok)) if ok else None,
        "wall_s": wall_s,
        "turns_per_s": len(ok) / wall_s if wall_s > 0 else None,
        "ttft": summarize(t.ttft_s for t in ok if t.ttft_s is not None),
        "first_chunk": summarize(t.first_chunk_s for t in ok if t.first_chunk_s is not None),
        "cached_token_ratio": _ratio(turns),
        "per_turn": per_turn,
    }


# ---------------------------------------------------------------------------------------------
# Table and plot


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def turn_table(res: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    """Per turn number: the mean prompt tokens (the first system's), then per system its
    TTFT p50 / p90 (ms) and cached-token ratio."""
    rows_of = {n: s for n, s in res["systems"].items() if "per_turn" in s}
    headers = ["turn", "prompt tok"]
    for n in rows_of:
        headers += [f"{n} TTFT ms p50/p90", f"{n} cached"]
    turns = max((len(s["per_turn"]) for s in rows_of.values()), default=0)
    rows = []
    for i in range(turns):
        row: list[Any] = [i + 1, "-"]
        for s in rows_of.values():
            pt = s["per_turn"][i] if i < len(s["per_turn"]) else {}
            if row[1] == "-" and pt.get("prompt_tokens_mean") is not None:
                row[1] = f"{pt['prompt_tokens_mean']:.0f}"
            row += [
                f"{_ms(pt.get('ttft_p50'))} / {_ms(pt.get('ttft_p90'))}",
                _pct(pt.get("cached_token_ratio")),
            ]
        rows.append(row)
    return headers, rows


def system_table(res: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    """Per system: turns per second, TTFT p50/p90 and first chunk p50 over every turn, the
    cached-token ratio, answers with a call, requests per prefill replica, errors (or why it
    failed)."""
    headers = [
        "system",
        "turns/s",
        "TTFT ms p50/p90",
        "first chunk ms p50",
        "cached",
        "answers with a call",
        "requests per prefill replica",
        "errors",
    ]
    rows: list[list[Any]] = []
    for n, s in res["systems"].items():
        if "error" in s:
            rows.append([n, "-", "-", "-", "-", "-", "-", f"failed: {s['error'][:80]}"])
            continue
        t = s["ttft"]
        per = s.get("requests_per_replica")
        rows.append(
            [
                n,
                "-" if s["turns_per_s"] is None else f"{s['turns_per_s']:.2f}",
                f"{_ms(t['p50'])} / {_ms(t['p90'])}",
                _ms(s["first_chunk"]["p50"]),
                _pct(s["cached_token_ratio"]),
                _pct(s["calls_answered"]),
                " / ".join(str(x) for x in per) if per else "-",
                s["errors"],
            ]
        )
    return headers, rows


def plot(res: dict[str, Any], path: Path) -> None:
    """Per turn number: TTFT p50 (solid) and p90 (dashed) per system, and the cached-token
    ratio per system (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, (name, s) in enumerate(res["systems"].items()):
        if "per_turn" not in s:
            continue
        color = f"C{i}"
        pts = s["per_turn"]
        xs = [p["turn"] for p in pts]

        def line(key: str, scale: float, rows: list[dict[str, Any]] = pts) -> list[float]:
            return [float("nan") if p[key] is None else p[key] * scale for p in rows]

        ax.plot(xs, line("ttft_p50", 1e3), "-o", color=color, label=f"{name} p50")
        ax.plot(xs, line("ttft_p90", 1e3), "--", color=color, alpha=0.6, label=f"{name} p90")
        if any(p["cached_token_ratio"] is not None for p in pts):
            bx.plot(xs, line("cached_token_ratio", 100), "-o", color=color, label=name)
    m = res["mix"]
    ax.set(xlabel="turn", ylabel="TTFT (ms)", title="TTFT by turn")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    bx.set(xlabel="turn", ylabel="cached / prompt tokens (%)", title="prompt tokens cached")
    bx.set_ylim(0, 100)
    bx.grid(True, alpha=0.3)
    bx.legend(fontsize=8)
    fig.suptitle(
        f"Live app (not simulated), {res['model']} model, {res['prefill_replicas']} prefill + "
        f"{res['decode_replicas']} decode: {m['agents']} agents x {m['turns']} turns, "
        f"{m['tool_tokens']}-token tool results"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# The app and the run


def app_args(
    preset: str, prefill_replicas: int, max_model_len: int, cache_dir: str | None
) -> dict[str, Any]:
    """``bench routing``'s app (Fairway prefill replicas sharing core 0, one TWP decode replica
    on core 1, the in-memory index, keys off on loopback) with vLLM's hermes tool parser on,
    ``max_model_len`` positions, and a render budget that a loaded 2-core machine does not
    hit on long conversations (what is measured is the app, not its limits)."""
    from bench.live.routing import app_args as routing_args

    args = routing_args(preset, prefill_replicas, cache_dir)
    args["model"] |= {
        "max_model_len": max_model_len,
        "tool_call_parser": "hermes",
        "enable_auto_tool_choice": True,
    }
    args["ingress"] |= {"render_timeout_s": 30.0}
    return args


def vocabulary_words(model: Path) -> list[str]:
    """The model's whole-word tokens as text (a space and lowercase letters, each one token
    that encodes back to itself: :func:`bench.live.compare.word_tokens`)."""
    from tokenizers import Tokenizer

    from bench.live.compare import word_tokens

    tok = Tokenizer.from_file(str(Path(model) / "tokenizer.json"))
    words = [tok.decode([i]) for i in word_tokens(tok)]
    if len(words) < 64:
        raise ValueError(f"{model}: {len(words)} whole-word tokens; need at least 64")
    return words


def peer_args(args: dict[str, Any]) -> dict[str, Any]:
    """Ray Serve LLM's PD app on the same engines as pdserve's ``args`` (``bench compare``'s
    ``peer-connector``: the project's NIXL connector, progress thread off), with vLLM's
    hermes tool parser in both roles' frontend arguments."""
    from bench.live.compare import SYSTEMS as COMPARED
    from bench.live.compare import peer_config

    conf = peer_config({"applications": [{"args": args}]}, COMPARED["peer-connector"])
    out: dict[str, Any] = conf["applications"][0]["args"]
    for role in ("prefill_config", "decode_config"):
        out[role]["engine_kwargs"] |= {
            "tool_call_parser": args["model"]["tool_call_parser"],
            "enable_auto_tool_choice": True,
        }
    return out


def _replica_requests(before: dict[str, Any], after: dict[str, Any]) -> list[int]:
    b = {r["id"]: r.get("requests", 0) for r in before["replicas"]["prefill"]}
    return sorted(
        (r.get("requests", 0) - b.get(r["id"], 0) for r in after["replicas"]["prefill"]),
        reverse=True,
    )


def run(
    args: dict[str, Any],
    systems: Sequence[str],
    mix: AgentMix,
    words: Sequence[str],
    *,
    build_app: Callable[[dict[str, Any]], Any],
    port: int = 8765,
    ready_timeout_s: float = 900.0,
    progress: Callable[[str, int], Callable[[int], None]] | None = None,
) -> dict[str, Any]:
    """Deploy each system, run the agents against it, summarize, delete it (see module). A
    system that fails is reported as failed and the others go on. ``build_app``: pdserve's
    application builder (``deployments.app:build_app``), handed in by the caller; the model
    must be built (``words`` come from its tokenizer)."""

    from ray import serve

    from bench.live.compare import (
        RAY_DEFAULT_PORTS,
        _free_port,
        _prefill_replica_ids,
        first_token,
        peer_prefix_counts,
    )
    from bench.live.routing import get_json, serve_locally, wait_gone, wait_ready
    from deployments.config import load_app_config
    from deployments.local import local_env

    cfg = load_app_config(args)
    model = cfg.model.served_name
    metrics_port = _free_port()
    while metrics_port in RAY_DEFAULT_PORTS:
        metrics_port = _free_port()
    url = serve_locally(port, _metrics_export_port=metrics_port)  # the peer's vLLM counters
    out: dict[str, Any] = {
        "kind": "live",
        "mix": asdict(mix),
        "model": model,
        "max_model_len": cfg.model.max_model_len,
        "prefill_replicas": cfg.prefill.num_replicas,
        "decode_replicas": cfg.decode.num_replicas,
        "systems": {},
    }
    for name in systems:
        sys_ = SYSTEMS[name]
        app = f"{APP}-{name.replace('_', '-')}"
        row: dict[str, Any] = {"about": sys_.about}
        try:
            t0 = time.monotonic()
            if sys_.kind == "pdserve":
                a = dict(args)
                a["routing"] = {**dict(args.get("routing") or {}), "policy": sys_.policy}
                serve.run(build_app(a), name=app, route_prefix="/", blocking=False)
                wait_ready(url, cfg.prefill.num_replicas, ready_timeout_s)
            else:
                from ray.serve.llm import build_pd_openai_app

                serve.run(
                    build_pd_openai_app(peer_args(args)), name=app, route_prefix="/", blocking=False
                )
                first_token(url, model, ready_timeout_s)
            row["deploy_s"] = time.monotonic() - t0
            before: dict[str, Any] = {}
            replicas: list[str] = []
            counts: tuple[float, float] | None = None
            if sys_.kind == "pdserve":
                before = get_json(url, "/v1/pdserve/stats")
            else:
                with contextlib.suppress(Exception):  # a figure missing, not a failed run
                    replicas = _prefill_replica_ids(local_env())
                    counts = peer_prefix_counts(metrics_port, replicas)
            tick = progress(name, mix.agents * mix.turns) if progress else None
            turns, wall = asyncio.run(run_agents(url, mix, words, model, progress=tick))
            row |= summarize_turns(turns, wall)
            if sys_.kind == "pdserve":
                time.sleep(2 * cfg.routing.stats_period_s + 0.5)  # the replicas' last reports
                row["requests_per_replica"] = _replica_requests(
                    before, get_json(url, "/v1/pdserve/stats")
                )
                row["cached_token_source"] = "usage"
            else:
                row["cached_token_ratio"] = None
                row["cached_token_source"] = "none (the peer's vLLM counters did not answer)"
                if counts is not None and replicas:
                    with contextlib.suppress(Exception):
                        hits, queries = peer_prefix_counts(metrics_port, replicas)
                        dq = queries - counts[1]
                        row["cached_token_ratio"] = (hits - counts[0]) / dq if dq > 0 else None
                        row["cached_token_source"] = "vllm prefill counters (overall only)"
            row["turn_samples"] = [asdict(t) for t in turns]
        except Exception as e:  # reported; the other systems still run
            row["error"] = f"{type(e).__name__}: {e}"[:500]
        finally:
            with contextlib.suppress(Exception):
                serve.delete(app)
            wait_gone(f"ServeReplica:{app}:")
        out["systems"][name] = row
    return out
