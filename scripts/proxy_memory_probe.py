r"""Where does Ray Serve's HTTP proxy's memory go under ``pdserve bench soak``'s load?

Against a running app (``pdserve up --config configs/pd_cluster.yaml``): it measures the
saturation rate as the soak does, then sends ``--rounds`` rounds of open-loop arrivals at
``--level`` times that rate, ``--span`` seconds each. Inside the proxy actor (through Ray's
``__ray_call__``) it starts ``tracemalloc`` before the load and, after each round once the app
is idle, reads the proxy's resident memory, the Python memory tracemalloc sees live, and the
count of objects the garbage collector tracks. ``--trim`` ends with one ``malloc_trim(0)`` in
the proxy and prints its resident memory before and after: what glibc gives back then was
freed memory its heaps kept, not live data.

    python scripts/proxy_memory_probe.py --json out/probe.json          # app as it runs
    python scripts/proxy_memory_probe.py --json out/probe.json --trim

Measured with it (stop 33, 2-core machine, 1.5x of 17-20 req/s, 4 rounds of 90 s; RSS after
the warm-up round -> after the last; tracemalloc live; requests after the warm-up):

| proxy's malloc | RSS MiB | growth | live Python MB | requests | KiB/request |
|---|---|---|---|---|---|
| glibc | 277.6 -> 328.7 | 18.4% | 1.05 -> 1.10 | 7,744 | 6.8 |
| glibc, ``MALLOC_ARENA_MAX=2`` | 291.2 -> 336.0 | 15.4% | 1.07 -> 1.09 | 7,943 | 5.8 |
| jemalloc (``pdserve up``'s default now) | 231.6 -> 235.5 | 1.7% | 0.99 -> 1.02 | 6,838 | 0.6 |

After the glibc run, ``malloc_trim(0)`` took the proxy from 328.8 to 229.7 MiB.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import typer
from tqdm import tqdm

from bench.live.soak import _open_loop, capacity, request_bodies, wait_idle

cli = typer.Typer(add_completion=False)


def _probe(proxy_self: Any, action: str) -> Any:
    """Runs inside the proxy actor (``__ray_call__`` passes the actor instance first)."""
    import ctypes
    import gc
    import os
    import tracemalloc

    import psutil

    me = psutil.Process()
    if action == "start":
        tracemalloc.start(1)
        return os.getpid()
    if action == "trim":
        before = me.memory_info().rss
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        return {"rss_before": before, "rss_after": me.memory_info().rss}
    gc.collect()
    return {
        "rss": me.memory_info().rss,
        "python_live": tracemalloc.get_traced_memory()[0],
        "gc_objects": len(gc.get_objects()),
    }


@cli.command()
def main(
    url: str = typer.Option("http://127.0.0.1:8000", help="The app's base URL."),
    level: float = typer.Option(1.5, min=0.1, help="Arrival rate, a multiple of saturation."),
    span: float = typer.Option(90.0, min=5, help="Seconds of load per round."),
    rounds: int = typer.Option(4, min=2, help="Rounds; the first is the warm-up."),
    trim: bool = typer.Option(False, help="End with malloc_trim(0) in the proxy."),
    json_out: Path | None = typer.Option(None, "--json", help="Write the figures here."),
) -> None:
    import ray

    ray.init(address="auto", namespace="serve", log_to_driver=False)
    names = [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith("SERVE_PROXY_ACTOR")
    ]
    if not names:
        raise typer.BadParameter("no Serve proxy in this Ray cluster", param_hint="--url")
    proxy = ray.get_actor(names[0], namespace="serve")
    out: dict[str, Any] = {"pid": ray.get(proxy.__ray_call__.remote(_probe, "start"))}
    bodies = request_bodies(0, 8, 512, 24, 16)
    sat, _ = capacity(url, None, bodies, (4, 8, 16, 32), 32.0)
    out.update(saturation_rps=sat, level=level, span_s=span, rounds=[])
    wait_idle(url, None, 120)
    for i in range(rounds):
        with tqdm(total=int(sat * level * span), desc=f"round {i}", unit="req") as bar:
            got = asyncio.run(_open_loop(url, None, bodies, sat * level, span, 10 + i, bar))
        wait_idle(url, None, 120)
        time.sleep(5)
        row = ray.get(proxy.__ray_call__.remote(_probe, "read"))
        row["outcomes"] = dict(Counter(w for _, w, _ in got))
        out["rounds"].append(row)
        typer.echo(
            f"round {i}: rss {row['rss'] / 2**20:.1f} MiB, python live "
            f"{row['python_live'] / 1e6:.2f} MB, gc objects {row['gc_objects']}, "
            f"{row['outcomes']}"
        )
    if trim:
        out["trim"] = ray.get(proxy.__ray_call__.remote(_probe, "trim"))
        typer.echo(
            f"malloc_trim(0): {out['trim']['rss_before'] / 2**20:.1f} -> "
            f"{out['trim']['rss_after'] / 2**20:.1f} MiB"
        )
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    cli()
