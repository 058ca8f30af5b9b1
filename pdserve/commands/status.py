"""``pdserve status``: a terminal view of a running app, read from its ``/v1/pdserve/stats``.

Per role, each replica (Serve's replica id) with the Ray node it runs on (its address), the requests routed to it, its queue (waiting,
running, uncached prompt tokens), KV usage, TWP window and load (decode), prompt and cached
tokens and NIXL hits;
then the routers' named fallbacks, the index and the ingress's overhead. ``--watch`` redraws
it every ``--every`` seconds (rich's live display).
"""

from __future__ import annotations

import time
from typing import Any

import typer

from pdserve.apps import app


def fetch(url: str, key: str | None = None, timeout_s: float = 10.0) -> dict[str, Any]:
    """The app's ``/v1/pdserve/stats`` body."""
    import httpx

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.get(f"{url.rstrip('/')}/v1/pdserve/stats", headers=headers, timeout=timeout_s)
    r.raise_for_status()
    out: dict[str, Any] = r.json()
    return out


def _num(v: Any, fmt: str = "{:,.0f}") -> str:
    if v is None:
        return "-"
    try:
        return fmt.format(v)
    except (TypeError, ValueError):
        return str(v)


def render(stats: dict[str, Any]) -> Any:
    """A rich renderable of one stats body (pure: tested without a running app)."""
    from rich import box
    from rich.console import Group
    from rich.table import Table

    parts: list[Any] = []
    for role in ("prefill", "decode"):
        t = Table(
            title=f"{role} replicas",
            title_justify="left",
            box=box.SIMPLE_HEAD,
            collapse_padding=True,
            pad_edge=False,
        )
        for col in (
            "replica", "node", "routed", "wait", "run", "uncached", "KV",
            "window", "load", "prompt", "cached", "NIXL",
        ):  # fmt: skip
            t.add_column(col, justify="left" if col == "replica" else "right", no_wrap=True)
        for r in stats.get("replicas", {}).get(role, []):
            t.add_row(
                str(r.get("id", "?")),
                str(r.get("node_ip") or "-"),
                _num(r.get("routed")),
                _num(r.get("waiting")),
                _num(r.get("running")),
                _num(r.get("queued_uncached_tokens")),
                _num(r.get("kv_usage"), "{:.0%}"),
                _num(r.get("window_tokens")),
                _num(r.get("token_load")),
                _num(r.get("prompt_tokens")),
                _num(r.get("cached_tokens")),
                _num(r.get("external_hits")),
            )
        parts.append(t)
    router = stats.get("router", {})
    fb = router.get("fallbacks", {}) or {}
    s = Table(title="routing, index, ingress", title_justify="left")
    s.add_column("what")
    s.add_column("value", justify="right")
    s.add_row("policy", str(router.get("policy")))
    s.add_row("fallbacks", ", ".join(f"{k}={v}" for k, v in sorted(fb.items())) or "none")
    pre = stats.get("totals", {}).get("prefill", {})
    if pre.get("prompt_tokens"):
        s.add_row("prefill cache hit ratio", f"{pre['cached_tokens'] / pre['prompt_tokens']:.1%}")
    idx = stats.get("index", {})
    s.add_row(
        "index", f"{idx.get('backend')}: {idx.get('lookups', 0)} lookups, "
        f"{idx.get('timeouts', 0)} unanswered",
    )  # fmt: skip
    ing = stats.get("ingress", {})
    over = ing.get("overhead_s") or {}
    s.add_row(
        "ingress", f"{ing.get('requests', 0)} requests, {ing.get('refused', 0)} refused; "
        f"overhead p50 {_num(over.get('p50'), '{:.3f}')} s p99 {_num(over.get('p99'), '{:.3f}')} s",
    )  # fmt: skip
    parts.append(s)
    return Group(*parts)


@app.command("status")
def status(
    url: str = typer.Option("http://127.0.0.1:8000", help="The app's HTTP address."),
    key: str = typer.Option(
        None,
        envvar="PDSERVE_OPERATOR_KEY",
        help="An operator key (pdserve keys new --operator): the stats are an operator route "
        "whenever the app has keys (ingress.auth: keys).",
    ),
    watch: bool = typer.Option(False, "--watch", help="Redraw until interrupted."),
    every: float = typer.Option(2.0, min=0.2, help="Seconds between redraws (--watch)."),
) -> None:
    """Show the running app's replicas, queues, TWP window, cache hits and fallbacks."""
    import httpx
    from rich.console import Console
    from rich.live import Live

    console = Console()
    try:
        body = fetch(url, key)
    except httpx.HTTPError as e:
        console.print(f"pdserve status: {url} did not answer: {e}")
        raise typer.Exit(1) from None
    if not watch:
        console.print(render(body))
        return
    with Live(render(body), console=console, refresh_per_second=4) as live:
        try:
            while True:
                time.sleep(every)
                try:
                    live.update(render(fetch(url, key)))
                except httpx.HTTPError as e:
                    live.update(f"pdserve status: {url} did not answer: {e}")
        except KeyboardInterrupt:
            pass
