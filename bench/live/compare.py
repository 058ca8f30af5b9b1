"""pdserve side by side with Ray Serve LLM's prefill/decode app (``pdserve bench compare``):
one command, one run, the same replay and the same engines, one system up at a time.

Systems (:data:`SYSTEMS`), each brought up on a fresh local Ray head and torn down after:

- ``pdserve``: Fairway prefill queues, TWP decode admission, prefix-index routing
  (``routing.policy: prefix_load``), the base config as given.
- ``pdserve-fcfs-rr``: vLLM's stock (FCFS) scheduler in both roles and round-robin prefill
  routing: what a user of this app would otherwise run.
- ``pdserve-fairway``: Fairway only (stock decode scheduler), prefix-index routing.
- ``pdserve-twp``: TWP only (stock prefill scheduler), prefix-index routing.
- ``pdserve-nofs``: ``pdserve`` without the prefill scheduler's fair share among tenants in
  ``multi_tenant`` matrix cells (Fairway alone, as the paper has it): what the fair share
  costs the flooding tenant and buys the quiet one.
- ``pdserve-async``: ``pdserve`` with both engines on ``runtime: async_llm`` (vLLM's
  ``AsyncLLM``, engine core in its own process) instead of the CPU default, the in-process
  engine: the runtime comparison of issue 14.
- ``peer``: Ray Serve LLM's ``build_pd_openai_app`` with its ``PrefixCacheAffinityRouter`` on
  both roles and vLLM's stock ``NixlConnector``, whose NIXL progress thread spins one core per
  engine (vLLM exposes no setting for it).
- ``pdserve-pinned`` and ``peer-connector-pinned``: each with vLLM's pin of every engine to
  the last core kept (``nixl_core_pin``, :mod:`engines.nixl_connector`): what every run
  measured before issue 39 found it.
- ``peer-connector``: the same with the project's connector (``engines.nixl_connector``,
  progress thread off), which is what pdserve's engines run: the like-for-like reference, and
  the denominator of every ratio.

Same engines: the peer's ``engine_kwargs`` are :func:`engines.launch.engine_args` of the base
config's own launch (model, dtype, block size, hash algorithm, batch limits, prefix caching),
its engine environment :func:`engines.launch.launch_env` (KV cache size, CPU binding,
``PYTHONHASHSEED``), and the same replica counts. What differs is the runtime: the peer runs
each engine core in its own process under ``AsyncLLM`` (issue 14 is pdserve's side of that).

Same requests: the peer's router matches prompts as text and divides by the text's length, so
token-id prompts make it raise ``ZeroDivisionError`` and the request wait forever (seen with
Ray 2.60). Both systems are therefore sent text: each prompt id becomes one whole-word token
of the model's vocabulary (:func:`word_tokens`), so the text re-encodes to exactly as many
tokens and equal prefixes stay equal.

Figures per system: deploy time to the first token (from the deploy command, ``pdserve up``
or ``serve run``, until a one-token completion answers), resident memory of all processes the
system started (Ray head included; pdserve's Redis too) at idle and at its peak under load
(sampled each second), idle CPU over 15 s after 15 s of rest, and the replay's TTFT, ITL,
end-to-end latency, throughput and cached-token ratio. The peer's OpenAI responses carry no cached-token counts,
so its ratio comes from its prefill engines' own vLLM counters
(``ray_vllm_prefix_cache_hits_total`` over ``..._queries_total`` on Ray's metrics port);
pdserve's from the usage its responses report (its prefill engine's ``num_cached_tokens``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from bench.live.replay import LiveResult, replay, summarize, write_report
from bench.workloads.replay import LiveRequest
from deployments.local import ensure_ray_token, local_env, venv_bin, with_allocator

#: The like-for-like reference: the denominator of every ratio.
REFERENCE = "peer-connector"
PEER_ROUTER = "ray.serve.llm.request_router:PrefixCacheAffinityRouter"
FAIRWAY = "engines.scheduler.FairwayScheduler"
TWP = "engines.scheduler.TWPScheduler"


@dataclass(frozen=True)
class System:
    """One system of the comparison: ``kind`` is ``pdserve`` or ``peer``."""

    kind: str
    prefill_scheduler: str | None = FAIRWAY
    decode_scheduler: str | None = TWP
    routing: str = "prefix_load"
    project_connector: bool = True
    about: str = ""
    #: pdserve engines' runtime (``auto``: the config's own)
    runtime: str = "auto"
    #: the prefill scheduler's fair share among tenants where the run has tenants (the
    #: matrix's ``multi_tenant`` cells, :func:`bench.live.matrix.tenant_config`)
    fair_share: bool = True
    #: keep vLLM's pin of every engine to the last core (engines.nixl_connector's
    #: ``nixl_core_pin``): the before of issue 39's before/after
    core_pin: bool = False


SYSTEMS: dict[str, System] = {
    "pdserve": System("pdserve", about="Fairway + TWP + prefix-index routing"),
    "pdserve-fcfs-rr": System(
        "pdserve", None, None, "round_robin", about="stock FCFS schedulers, round-robin routing"
    ),
    "pdserve-fairway": System("pdserve", FAIRWAY, None, about="Fairway only, index routing"),
    "pdserve-twp": System("pdserve", None, TWP, about="TWP only, index routing"),
    "pdserve-nofs": System(
        "pdserve", fair_share=False, about="Fairway + TWP + index routing, no tenants' fair share"
    ),
    "pdserve-async": System(
        "pdserve", runtime="async_llm", about="Fairway + TWP + index routing, engines on AsyncLLM"
    ),
    "pdserve-pinned": System(
        "pdserve", core_pin=True, about="pdserve with vLLM's pin of every engine to one core"
    ),
    "peer": System("peer", project_connector=False, about="Ray Serve LLM PD, stock NixlConnector"),
    "peer-connector": System("peer", about="Ray Serve LLM PD, the project's NIXL connector"),
    "peer-connector-pinned": System(
        "peer", core_pin=True, about="peer-connector with vLLM's pin of every engine to one core"
    ),
}


def pdserve_config(base: Mapping[str, Any], system: System) -> dict[str, Any]:
    """The Serve YAML (as a dict) of a pdserve variant: ``base`` with the variant's schedulers
    and routing policy."""
    raw = json.loads(json.dumps(base))
    args = raw["applications"][0].setdefault("args", {})
    for role, cls in (("prefill", system.prefill_scheduler), ("decode", system.decode_scheduler)):
        eng = args.setdefault(role, {})
        eng["scheduler_cls"] = cls
        if cls is None:
            eng.pop("scheduler_config", None)  # the stock scheduler takes none
        if system.runtime != "auto":
            eng["runtime"] = system.runtime
        if system.core_pin:
            eng["nixl_core_pin"] = True
    args.setdefault("routing", {})["policy"] = system.routing
    return raw


def _engine_kwargs(
    cfg: Any, role: str, project_connector: bool, core_pin: bool = False
) -> tuple[dict, dict]:
    """``(engine_kwargs, env_vars)`` of one peer role: pdserve's own engine launch for that
    role with the stock scheduler, without the pieces the peer sets itself (model name,
    NIXL ports, multiprocessing) and with the peer's connector."""
    from deployments.config import ReplicaPorts, engine_launch
    from engines.launch import engine_args, launch_env

    launch = engine_launch(cfg, role, ReplicaPorts("127.0.0.1", 20000, None, None))  # type: ignore[arg-type]
    launch = launch.model_copy(update={"scheduler_cls": None, "scheduler": None, "kv_events": None})
    kw = engine_args(launch)
    for k in ("model", "tokenizer", "served_model_name"):
        kw.pop(k, None)
    if kw.get("num_gpu_blocks_override") is None:
        kw.pop("num_gpu_blocks_override", None)
    ktc: dict[str, Any] = {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_both",
        "kv_buffer_device": launch.kv_transfer.buffer_device if launch.kv_transfer else "cpu",
    }
    if project_connector:
        ktc["kv_connector_module_path"] = "engines.nixl_connector"
        # like for like: the project's connector as pdserve's engines run it, paced progress
        # thread included (the base config's setting)
        poll = launch.kv_transfer.progress_poll_us if launch.kv_transfer else 0
        ktc["kv_connector_extra_config"] = {
            "nixl_progress_thread": False,
            "nixl_progress_poll_us": poll,
            "nixl_core_pin": core_pin,
        }
    kw["kv_transfer_config"] = ktc
    peers_own = (
        "VLLM_ENABLE_V1_MULTIPROCESSING",
        *(f"VLLM_NIXL_SIDE_CHANNEL_{x}" for x in ("PORT", "HOST")),
    )
    env = {k: v for k, v in launch_env(launch).items() if v is not None and k not in peers_own}
    return kw, env


def peer_config(base: Mapping[str, Any], system: System) -> dict[str, Any]:
    """The Serve YAML (as a dict) of Ray Serve LLM's PD app on the same model, engines,
    replica counts and HTTP port as pdserve's ``base`` config."""
    from deployments.config import load_app_config

    app = base["applications"][0]
    cfg = load_app_config(app.get("args") or {})
    roles = {}
    for role in ("prefill", "decode"):
        kw, env = _engine_kwargs(cfg, role, system.project_connector, system.core_pin)
        roles[f"{role}_config"] = {
            "model_loading_config": {
                "model_id": cfg.model.served_name,
                "model_source": str(cfg.model.resolved_path()),
            },
            "accelerator_config": {"kind": "cpu"},
            "deployment_config": {
                "num_replicas": cfg.engine(role).num_replicas,
                "request_router_config": {"request_router_class": PEER_ROUTER},
            },
            "runtime_env": {"env_vars": env},
            "engine_kwargs": kw,
        }
    return {
        "proxy_location": "HeadOnly",
        "http_options": dict(base.get("http_options") or {"host": "127.0.0.1", "port": 8000}),
        "applications": [
            {
                "name": "peer",
                "route_prefix": "/",
                "import_path": "ray.serve.llm:build_pd_openai_app",
                "args": roles,
            }
        ],
    }


# ---------------------------------------------------------------------------------------------
# Prompts as text


def word_tokens(tokenizer: Any) -> list[int]:
    """Ids of the vocabulary's whole-word tokens: a space and lowercase letters that encode
    back to exactly that one id, so text made of them re-encodes token for token."""
    out = []
    for tid in range(tokenizer.get_vocab_size()):
        s = tokenizer.decode([tid])
        if re.fullmatch(r" [a-z]{2,}", s) and tokenizer.encode(s).ids == [tid]:
            out.append(tid)
    return out


def as_text(reqs: Sequence[LiveRequest], tokenizer: Any) -> list[LiveRequest]:
    """``reqs`` with each prompt id ``i`` replaced by the ``i``-th whole-word token (modulo
    their count): equal id runs give equal text, and the text is as many tokens as ids."""
    words = word_tokens(tokenizer)
    if len(words) < 64:
        raise ValueError(f"the tokenizer has {len(words)} whole-word tokens; need at least 64")
    text = {w: tokenizer.decode([w]) for w in words}
    return [replace(r, text="".join(text[words[i % len(words)]] for i in r.ids)) for r in reqs]


# ---------------------------------------------------------------------------------------------
# Processes, memory, CPU


def _psutil() -> Any:
    import psutil

    return psutil


def process_kind(cmdline: Sequence[str]) -> str:
    """What a process is, for the CPU breakdown: Ray's workers and vLLM's engine cores carry
    their role in their title (``ray::ServeReplica:app:Prefill``, ``VLLM::EngineCore``), the
    rest by program (``raylet``, ``gcs_server``, ``redis-server``; a Python one by its
    script or module)."""
    if not cmdline:
        return "?"
    first = cmdline[0].split()[0] if cmdline[0].strip() else "?"
    if first.startswith(("ray::", "VLLM")):
        return first[:80]
    prog = os.path.basename(first)
    if prog.startswith("python"):
        rest = [a for a in cmdline[1:] if not a.startswith("-")]
        if "-m" in cmdline[1:]:
            i = list(cmdline).index("-m")
            return f"python -m {cmdline[i + 1]}"[:80] if i + 1 < len(cmdline) else prog
        return f"python {os.path.basename(rest[0])}"[:80] if rest else prog
    return prog[:80]


def cpu_by_kind(
    before: Mapping[int, tuple[str, float]], after: Mapping[int, tuple[str, float]]
) -> dict[str, float]:
    """CPU seconds spent between two :meth:`ProcessWatch.cpu_seconds` snapshots, summed by
    process kind, largest first (a process started in between counts from zero; one that
    ended in between is lost, which the total says nothing of)."""
    sums: dict[str, float] = {}
    for kind, spent in _spent(before, after):
        sums[kind] = sums.get(kind, 0.0) + spent
    return dict(sorted(((k, round(v, 2)) for k, v in sums.items()), key=lambda kv: -kv[1]))


def cpu_by_process(
    before: Mapping[int, tuple[str, float]], after: Mapping[int, tuple[str, float]], top: int = 12
) -> list[list[Any]]:
    """The ``top`` processes by CPU seconds spent between two snapshots, ``[kind, seconds]``
    each, largest first: two replicas of one role apart (a routing imbalance shows here)."""
    rows = sorted(_spent(before, after), key=lambda kv: -kv[1])[:top]
    return [[k, round(v, 2)] for k, v in rows]


def _spent(
    before: Mapping[int, tuple[str, float]], after: Mapping[int, tuple[str, float]]
) -> list[tuple[str, float]]:
    out = []
    for pid, (kind, t) in after.items():
        was = before.get(pid)
        spent = t - was[1] if was is not None and was[0] == kind else t
        out.append((kind, max(0.0, spent)))
    return out


class ProcessWatch:
    """Resident memory and CPU of the processes started after construction (the system under
    test: Ray head, replicas, engines, Redis), excluding this process and its children."""

    def __init__(self) -> None:
        ps = _psutil()
        self._before = set(ps.pids())
        self._me = os.getpid()
        self.peak_rss = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def procs(self) -> list[Any]:
        ps = _psutil()
        mine = {self._me}
        with contextlib.suppress(ps.Error):
            mine |= {c.pid for c in ps.Process(self._me).children(recursive=True)}
        out = []
        for p in ps.process_iter():
            if p.pid not in self._before and p.pid not in mine:
                out.append(p)
        return out

    def rss(self) -> int:
        ps = _psutil()
        total = 0
        for p in self.procs():
            with contextlib.suppress(ps.Error):
                total += p.memory_info().rss
        return total

    def cpu_percent(self, seconds: float) -> float:
        """Summed CPU of the system's processes over ``seconds`` (100: one core)."""
        ps = _psutil()
        procs = self.procs()
        for p in procs:
            with contextlib.suppress(ps.Error):
                p.cpu_percent(None)
        time.sleep(seconds)
        total = 0.0
        for p in procs:
            with contextlib.suppress(ps.Error):
                total += p.cpu_percent(None)
        return total

    def cpu_seconds(self) -> dict[int, tuple[str, float]]:
        """Each of the system's processes' CPU seconds so far (user + system), by pid, with
        its kind (:func:`process_kind`)."""
        ps = _psutil()
        out: dict[int, tuple[str, float]] = {}
        for p in self.procs():
            with contextlib.suppress(ps.Error):
                t = p.cpu_times()
                out[p.pid] = (process_kind(p.cmdline() or [p.name()]), t.user + t.system)
        return out

    def sample(self, period_s: float = 1.0) -> None:
        """Keep the peak resident memory in the background until :meth:`stop`."""

        def loop() -> None:
            while not self._stop.wait(period_s):
                self.peak_rss = max(self.peak_rss, self.rss())

        self.peak_rss = self.rss()
        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


# ---------------------------------------------------------------------------------------------
# Metrics (the peer's cached tokens)

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\}\s+([0-9.eE+-]+)$")


def prometheus_sum(text: str, name: str, where: Callable[[dict[str, str]], bool]) -> float:
    """Sum of the samples of ``name`` in Prometheus text whose labels satisfy ``where``."""
    total = 0.0
    for line in text.splitlines():
        m = _SAMPLE.match(line.strip())
        if not m or m.group(1) != name:
            continue
        labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2)))
        if where(labels):
            total += float(m.group(3))
    return total


def _metrics_text(port: int) -> str:
    import httpx

    return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text


def _prefill_replica_ids(env: Mapping[str, str]) -> list[str]:
    """Replica ids of the peer's prefill deployment (from Serve's actor names)."""
    code = (
        "import json, ray; ray.init(address='auto', log_to_driver=False); "
        "print(json.dumps([a['name'] for a in ray.util.list_named_actors(all_namespaces=True)]))"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], env=dict(env), capture_output=True, text=True, timeout=120
    )
    names = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else []
    return [n.rsplit("#", 1)[-1] for n in names if "#Prefill:" in n]


def peer_prefix_counts(
    port: int, replica_ids: Iterable[str], settle_s: float = 11.0, tries: int = 6
) -> tuple[float, float]:
    """(prefix-cache hit tokens, queried tokens) of the peer's prefill engines so far, read
    until two reads ``settle_s`` apart agree. Ray exports the engines' counters periodically
    (about every 10 s), so a read right after the replay can miss its last requests; two
    equal reads further apart than that period mean the export has caught up."""
    last = _prefix_counts_once(port, replica_ids)
    for _ in range(tries):
        time.sleep(settle_s)
        now = _prefix_counts_once(port, replica_ids)
        if now == last:
            break
        last = now
    return last


def _prefix_counts_once(port: int, replica_ids: Iterable[str]) -> tuple[float, float]:
    ids = set(replica_ids)
    text = _metrics_text(port)

    def on_prefill(labels: dict[str, str]) -> bool:
        return labels.get("ReplicaId") in ids

    return (
        prometheus_sum(text, "ray_vllm_prefix_cache_hits_total", on_prefill),
        prometheus_sum(text, "ray_vllm_prefix_cache_queries_total", on_prefill),
    )


# ---------------------------------------------------------------------------------------------
# Bringing a system up and down


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: Ports a Ray head binds by default (GCS, dashboard, dashboard agent, client server, ...): a
#: free port picked for the metrics export must not be one of them, or ``ray start`` fails.
RAY_DEFAULT_PORTS = frozenset({6379, 8265, 10001, 52365, 62365, 8076, 8077, 8078})


def start_ray(env: Mapping[str, str], attempts: int = 3) -> int:
    """A fresh local Ray head (16 logical CPUs, no dashboard) exporting metrics on a free
    port; the port. A port taken between the pick and the start is retried with another.
    Under token authentication the token is made first where missing (a fresh machine has
    none, and ``ray start`` refuses to start without one), as ``pdserve up`` does."""
    if env.get("RAY_AUTH_MODE", "").lower() == "token":
        ensure_ray_token(dict(env))
    err = ""
    for _ in range(attempts):
        port = _free_port()
        if port in RAY_DEFAULT_PORTS:
            continue
        r = subprocess.run(
            [
                venv_bin("ray"),
                "start",
                "--head",
                "--num-cpus=16",
                "--include-dashboard=false",
                "--disable-usage-stats",
                f"--metrics-export-port={port}",
            ],
            env=dict(env),
            timeout=180,
            capture_output=True,
            text=True,
        )
        if r.returncode == 0:
            return port
        err = (r.stderr or r.stdout)[-400:]
        subprocess.run([venv_bin("ray"), "stop"], env=dict(env), timeout=120, capture_output=True)
    raise RuntimeError(f"ray start failed {attempts} times; last: {err}")


def first_token(
    url: str, model: str, timeout_s: float, text: str = "ready", key: str | None = None
) -> float:
    """Poll a one-token completion (sent with ``key`` when given) until it answers 200; the
    seconds it took."""
    import httpx

    t0 = time.monotonic()
    last = ""
    while time.monotonic() - t0 < timeout_s:
        try:
            r = httpx.post(
                f"{url}/v1/completions",
                json={"model": model, "prompt": text, "max_tokens": 1},
                headers={"Authorization": f"Bearer {key}"} if key else {},
                timeout=min(60.0, max(1.0, timeout_s - (time.monotonic() - t0))),
            )
            if r.status_code == 200:
                return time.monotonic() - t0
            last = f"HTTP {r.status_code}: {r.text[:200]}"
        except Exception as e:  # not up yet
            last = repr(e)[:200]
        time.sleep(1.0)
    raise TimeoutError(f"no first token after {timeout_s:.0f} s (last: {last})")


def down() -> None:
    """Serve shut down, Ray stopped, pdserve's Redis stopped (``pdserve down``)."""
    subprocess.run(
        [sys.executable, "-m", "pdserve", "down"], env=local_env(), timeout=300, check=False
    )


def _serve_run(path: Path, system: System, env: Mapping[str, str]) -> None:
    if system.kind == "pdserve":
        # validates, builds the model when missing, starts the local Redis, serve run, /health
        cmd = [sys.executable, "-m", "pdserve", "up", "--config", str(path)]
    else:
        cmd = [venv_bin("serve"), "run", "--non-blocking", str(path)]
    subprocess.run(cmd, env=dict(env), check=True, timeout=900)


def engine_replicas(stats: Mapping[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Each pdserve engine replica's runtime, resident memory (with the engine processes it
    started), event-loop lag (``loop_lag``: p50/p99/max ms of its last minute) and the CPUs
    its in-process engine steps on (``engine_cpus``), from the ingress's
    ``/v1/pdserve/stats`` (:func:`pdserve_stats`); empty when it did not answer."""
    keep = ("runtime", "rss_mb", "loop_lag", "engine_cpus")
    return {
        role: [{"id": r["id"]} | {k: r.get(k) for k in keep} for r in rs]
        for role, rs in (stats.get("replicas") or {}).items()
    }


def write_requests(path: Path, reqs: Sequence[LiveRequest], results: Sequence[Any]) -> None:
    """One JSON line per request, in the replay's order: when it was sent, what the client
    saw (TTFT, end to end, tokens, the cached tokens its usage reported, the error, the
    prefill and decode replicas where the endpoint names them) and its label, for the
    per-request look at a run (which requests made the tail, on which engine)."""
    with path.open("w") as f:
        for req, r in zip(reqs, results, strict=False):
            row = {
                "label": req.label,
                "sent_s": round(r.sent_s, 4),
                "ok": r.ok,
                "ttft_s": r.ttft_s,
                "e2e_s": r.e2e_s,
                "prompt_tokens": r.prompt_tokens,
                "cached_tokens": r.cached_tokens,
                "completion_tokens": r.completion_tokens,
                "error": r.error[:200],
            }
            if r.prefill_replica is not None:  # where the endpoint names them
                row |= {"prefill_replica": r.prefill_replica, "decode_replica": r.decode_replica}
            f.write(json.dumps(row) + "\n")


def read_stats(url: str, key: str | None, timeout_s: float = 30.0) -> dict[str, Any] | None:
    """One read of pdserve's ``/v1/pdserve/stats`` (with the operator's ``key`` when given);
    None when it fails or is refused."""
    import httpx

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        r = httpx.get(f"{url}/v1/pdserve/stats", headers=headers, timeout=timeout_s)
        return dict(r.json()) if r.status_code == 200 else None
    except Exception:  # noqa: BLE001 - a figure missing, not a failed run
        return None


def pdserve_stats(
    url: str, key: str | None = None, ingress_replicas: int = 1, tries: int = 16
) -> dict[str, Any]:
    """The ingress's whole ``/v1/pdserve/stats`` (its phase times, each replica's report,
    the autoscaler's decisions), kept beside a run for the cause analysis of issue 39; empty
    when it does not answer or refuses. ``key``: an operator key (a config with
    ``ingress.auth: keys`` refuses the stats without one). Each read reaches one ingress
    replica; with ``ingress_replicas`` > 1 it reads up to ``tries`` times until it has seen
    that many, and adds ``ingresses`` (each one's ``ingress`` section, by replica id): the
    overload counts of issue 39's multi_tenant cells were one replica's of two."""
    first: dict[str, Any] = {}
    seen: dict[str, Any] = {}
    for _ in range(max(1, tries)):
        body = read_stats(url, key)
        if body is None:
            break
        first = first or body
        ing = body.get("ingress") or {}
        seen[str(ing.get("replica"))] = ing
        if ingress_replicas <= 1 or len(seen) >= ingress_replicas:
            break
    if first and ingress_replicas > 1:
        first["ingresses"] = seen
    return first


#: Each engine replica's load fields a stats timeline keeps (``engines.runtime.load_report``).
TIMELINE_FIELDS = (
    "waiting",
    "running",
    "queued_uncached_tokens",
    "kv_usage",
    "kv_pinned_requests",
    "token_load",
    "window_tokens",
)
#: The period of a stats timeline's reads (s).
TIMELINE_PERIOD_S = 2.0


def timeline_row(stats: Mapping[str, Any], t: float) -> dict[str, Any]:
    """One row of a stats timeline: ``t`` (s since the replay began), each engine replica's
    :data:`TIMELINE_FIELDS` by role and id (as its last report said), and the answering
    ingress replica's prompts in flight at the prefill (``prefill_in_flight``)."""
    queue = (stats.get("ingress") or {}).get("prefill_queue") or {}
    return {
        "t": round(t, 2),
        "prefill_in_flight": queue.get("in_flight"),
        "replicas": {
            role: {str(r.get("id")): {k: r.get(k) for k in TIMELINE_FIELDS} for r in rs}
            for role, rs in (stats.get("replicas") or {}).items()
        },
    }


class StatsTimeline:
    """Reads pdserve's ``/v1/pdserve/stats`` every ``period_s`` in a thread while a replay
    runs: how the engines' queues and KV moved (issue 39's cause analysis: where a request
    waits at the prefill engine, behind its queue or behind KV pinned for transfers). A read
    that fails or is refused is skipped."""

    def __init__(self, url: str, key: str | None, period_s: float = TIMELINE_PERIOD_S) -> None:
        self.url, self.key, self.period_s = url, key, period_s
        self.rows: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._t0 = 0.0

    def _run(self) -> None:
        while not self._stop.is_set():
            body = read_stats(self.url, self.key, timeout_s=10.0)
            if body is not None:
                self.rows.append(timeline_row(body, time.monotonic() - self._t0))
            self._stop.wait(self.period_s)

    def __enter__(self) -> StatsTimeline:
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def plot_timeline(rows: Sequence[Mapping[str, Any]], path: Path, title: str) -> None:
    """The engines over the replay (PNG): prefill replicas' waiting and running requests,
    their KV use and requests pinned for a pull, and the decode replicas' waiting and
    running."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.4))
    ts = [r["t"] for r in rows]
    ids = {
        role: sorted({i for r in rows for i in (r["replicas"].get(role) or {})})
        for role in ("prefill", "decode")
    }

    def series(role: str, rid: str, key: str) -> list[float]:
        return [float(((r["replicas"].get(role) or {}).get(rid) or {}).get(key) or 0) for r in rows]

    a, k, d = axes

    def pair(
        ax: Any,
        role: str,
        rid: str,
        keys: tuple[str, str],
        labels: tuple[str, str],
        scale: float = 1.0,
    ) -> None:
        (line,) = ax.plot(ts, series(role, rid, keys[0]), label=f"{rid} {labels[0]}")
        ax.plot(
            ts,
            [x * scale for x in series(role, rid, keys[1])],
            ls="--",
            color=line.get_color(),
            label=f"{rid} {labels[1]}",
        )

    for rid in ids["prefill"]:
        pair(a, "prefill", rid, ("waiting", "running"), ("waiting", "running"))
        pair(
            k,
            "prefill",
            rid,
            ("kv_usage", "kv_pinned_requests"),
            ("KV use", "pinned requests / 10"),
            0.1,
        )
    for rid in ids["decode"]:
        pair(d, "decode", rid, ("waiting", "running"), ("waiting", "running"))
    a.set_title("prefill engines: requests")
    k.set_title("prefill engines: KV")
    d.set_title("decode engines: requests")
    for ax in axes:
        ax.set_xlabel("s from the replay's start")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


@dataclass
class Measured:
    """One system's figures."""

    summary: dict[str, Any]
    deploy_to_first_token_s: float
    rss_idle_bytes: int
    rss_peak_bytes: int
    idle_cpu_percent: float
    #: the replay's per-request results, in request order
    results: list[LiveResult] = field(default_factory=list)
    #: pdserve's ``/v1/pdserve/stats`` after the replay (None for the peer), as kept in
    #: ``stats.json``
    stats: dict[str, Any] | None = None


def measure(
    name: str,
    system: System,
    config: dict[str, Any],
    reqs: Sequence[LiveRequest],
    out: Path,
    *,
    model: str,
    concurrency: int | None = None,
    ready_timeout_s: float = 900.0,
    idle_s: float = 15.0,
    progress: bool = True,
    key: str | None = None,
    operator_key: str | None = None,
) -> Measured:
    """Bring one system up on a fresh Ray head, measure it, replay ``reqs``, bring it down.
    ``key``: the API key of the readiness probe, ``operator_key`` the one that reads pdserve's
    stats (a config with ``ingress.auth: keys``)."""
    from tqdm import tqdm

    env = local_env()
    down()  # nothing of an earlier system (or run) stays up
    watch = ProcessWatch()
    # both systems' heads on the allocator ``pdserve up`` gives its head (deployments/local.py)
    metrics_port = start_ray(with_allocator(env, "jemalloc"))
    try:
        url = "http://{host}:{port}".format(
            host=(config.get("http_options") or {}).get("host", "127.0.0.1"),
            port=(config.get("http_options") or {}).get("port", 8000),
        )
        path = out / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        t0 = time.monotonic()
        _serve_run(path, system, env)
        first_token(url, model, max(1.0, ready_timeout_s - (time.monotonic() - t0)), key=key)
        deploy_s = time.monotonic() - t0
        time.sleep(idle_s)  # settle after start-up
        idle_cpu = watch.cpu_percent(idle_s)
        rss_idle = watch.rss()
        replicas = _prefill_replica_ids(env) if system.kind == "peer" else []
        before = peer_prefix_counts(metrics_port, replicas) if replicas else None
        watch.sample()
        cpu0 = watch.cpu_seconds()
        bar = tqdm(total=len(reqs), desc=name, unit="req", disable=not progress)
        timeline = StatsTimeline(url, operator_key) if system.kind == "pdserve" else None
        try:
            with timeline or contextlib.nullcontext():
                results, wall = asyncio.run(
                    replay(url, reqs, model=model, concurrency=concurrency, progress=bar.update)
                )
        finally:
            bar.close()
            watch.stop()
        cpu1 = watch.cpu_seconds()
        cpu = cpu_by_kind(cpu0, cpu1)
        summary = summarize(url, results, wall)
        summary["cpu_s_by_kind"] = cpu
        summary["cpu_s_top_processes"] = cpu_by_process(cpu0, cpu1)
        summary["cpu_s"] = round(sum(cpu.values()), 2)
        summary["cached_token_source"] = "usage"
        stats = None
        if system.kind == "pdserve":
            from deployments.config import load_app_config

            args = config["applications"][0].get("args") or {}
            n_ingress = load_app_config(args).ingress.num_replicas
            stats = pdserve_stats(url, operator_key, n_ingress)  # the figures and the file
            summary["replicas"] = engine_replicas(stats)
            (out / name).mkdir(parents=True, exist_ok=True)
            (out / name / "stats.json").write_text(json.dumps(stats, indent=2))
            if timeline is not None and timeline.rows:
                (out / name / "stats_timeline.json").write_text(json.dumps(timeline.rows))
                plot_timeline(timeline.rows, out / name / "engines_over_time.png", name)
        if before is not None:
            hits, queries = peer_prefix_counts(metrics_port, replicas)
            dq = queries - before[1]
            summary["cached_token_ratio"] = (hits - before[0]) / dq if dq > 0 else None
            summary["cached_token_source"] = "vllm prefill counters"
        summary["system"] = name
        write_report(out / name, summary, results)
        (out / name / "summary.json").write_text(json.dumps(summary, indent=2))
        ttfts = sorted(r.ttft_s for r in results if r.ok and r.ttft_s is not None)
        (out / name / "ttft.json").write_text(json.dumps(ttfts))
        write_requests(out / name / "requests.jsonl", reqs, results)
        return Measured(summary, deploy_s, rss_idle, watch.peak_rss, idle_cpu, list(results), stats)
    finally:
        down()


# ---------------------------------------------------------------------------------------------
# Ratios, goal, report


def _get(m: Mapping[str, Any], path: str) -> float | None:
    cur: Any = m
    for k in path.split("."):
        if not isinstance(cur, Mapping) or k not in cur:
            return None
        cur = cur[k]
    return float(cur) if isinstance(cur, int | float) else None


#: metric name -> path in a system's row
METRICS = {
    "ttft_p50": "summary.ttft.p50",
    "ttft_p99": "summary.ttft.p99",
    "itl_p99": "summary.itl.p99",
    "throughput": "summary.throughput_tps",
    "cached_token_ratio": "summary.cached_token_ratio",
    "rss_peak": "rss_peak_bytes",
    "rss_idle": "rss_idle_bytes",
    "deploy_s": "deploy_to_first_token_s",
}


def ratios(rows: Mapping[str, Mapping[str, Any]], reference: str = REFERENCE) -> dict:
    """``{system: {metric: system / reference}}`` (None where either side is missing)."""
    ref = rows.get(reference)
    out: dict[str, dict[str, float | None]] = {}
    for name, row in rows.items():
        if ref is None or name == reference:
            continue
        out[name] = {}
        for metric, path in METRICS.items():
            a, b = _get(row, path), _get(ref, path)
            out[name][metric] = a / b if a is not None and b else None
    return out


def goal(r: Mapping[str, float | None]) -> dict[str, bool | None]:
    """The issue's goal for pdserve against the peer: at least its throughput, TTFT p50 and
    p99 at most 0.8x, less memory (peak under load)."""

    def check(v: float | None, ok: Callable[[float], bool]) -> bool | None:
        return None if v is None else ok(v)

    return {
        "throughput >= 1.0x": check(r.get("throughput"), lambda v: v >= 1.0),
        "ttft_p50 <= 0.8x": check(r.get("ttft_p50"), lambda v: v <= 0.8),
        "ttft_p99 <= 0.8x": check(r.get("ttft_p99"), lambda v: v <= 0.8),
        "memory < 1.0x": check(r.get("rss_peak"), lambda v: v < 1.0),
    }


def replica_lines(rows: Mapping[str, Any]) -> list[str]:
    """The pdserve systems' engine replicas after the replay: runtime, resident memory (with
    the engine processes each started), event-loop lag, and the replay's ITL p50 beside."""
    out = [
        "",
        "## pdserve engine replicas (after the replay)",
        "",
        "| system | role | replica | runtime | engine CPUs | RSS MiB "
        "| loop lag p50 / p99 / max ms | ITL p50 ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    n0 = len(out)
    for name, r in rows.items():
        reps = (r.get("summary") or {}).get("replicas") or {}
        itl50 = ((r.get("summary") or {}).get("itl") or {}).get("p50")
        for role, rs in reps.items():
            for x in rs:
                lag = x.get("loop_lag") or {}
                lag_s = " / ".join(str(lag.get(k, "-")) for k in ("p50_ms", "p99_ms", "max_ms"))
                cpus = ",".join(str(c) for c in x.get("engine_cpus") or []) or "-"
                out.append(
                    f"| {name} | {role} | {str(x['id'])[:8]} | {x.get('runtime') or '-'} "
                    f"| {cpus} | {x.get('rss_mb') or '-'} | {lag_s} "
                    f"| {'-' if itl50 is None else f'{itl50 * 1e3:.1f}'} |"
                )
    return out if len(out) > n0 else []


def report(res: Mapping[str, Any], out: Path) -> list[Path]:
    """``report.md`` with the table, ratios and goal, and ``compare.png`` beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["systems"]
    names = list(rows)

    def f(v: float | None, scale: float = 1.0, fmt: str = "{:.0f}") -> str:
        return "-" if v is None else fmt.format(v * scale)

    lines = [
        f"# pdserve vs Ray Serve LLM: {res['workload']}",
        "",
        f"{res['requests']} requests, model `{res['model']}`, "
        f"{res['prefill_replicas']} prefill + {res['decode_replicas']} decode replicas. "
        f"Ratios are each system over `{res['reference']}`.",
        "",
        "| system | TTFT p50 ms | TTFT p99 ms | ITL p99 ms | tok/s | cached | errors "
        "| deploy s | RSS idle GiB | RSS peak GiB | idle CPU % |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n in names:
        r = rows[n]
        s = r.get("summary") or {}
        if "error" in r:
            lines.append(f"| {n} | failed: {r['error'][:120]} |" + " |" * 9)
            continue
        lines.append(
            f"| {n} | {f(_get(r, METRICS['ttft_p50']), 1e3)} | {f(_get(r, METRICS['ttft_p99']), 1e3)}"
            f" | {f(_get(r, METRICS['itl_p99']), 1e3)} | {f(s.get('throughput_tps'), 1, '{:.1f}')}"
            f" | {f(s.get('cached_token_ratio'), 1, '{:.2f}')} | {s.get('errors', '-')}"
            f" | {f(r['deploy_to_first_token_s'], 1, '{:.1f}')}"
            f" | {f(r['rss_idle_bytes'], 2**-30, '{:.2f}')} | {f(r['rss_peak_bytes'], 2**-30, '{:.2f}')}"
            f" | {f(r['idle_cpu_percent'], 1, '{:.1f}')} |"
        )
    lines += replica_lines(rows)
    lines += ["", f"## Ratios to `{res['reference']}`", ""]
    heads = list(METRICS)
    lines += ["| system | " + " | ".join(heads) + " |", "|---" * (len(heads) + 1) + "|"]
    for n, r in res["ratios"].items():
        lines.append(f"| {n} | " + " | ".join(f(r[h], 1, "{:.2f}") for h in heads) + " |")
    if res.get("goal"):
        lines += ["", "## Goal (pdserve over the reference)", ""]
        for k, v in res["goal"].items():
            lines.append(f"- {k}: {'-' if v is None else ('met' if v else 'not met')}")
    lines += ["", "![side by side](compare.png) ![TTFT CDFs](ttft_cdf.png)", ""]
    (out / "report.md").write_text("\n".join(lines))

    ok = [n for n in names if "error" not in rows[n]]
    fig, axes = plt.subplots(1, 4, figsize=(16, 4))
    panels = [
        ("TTFT p50 / p99 (ms)", ("ttft_p50", "ttft_p99"), 1e3),
        ("ITL p99 (ms)", ("itl_p99",), 1e3),
        ("throughput (tok/s)", ("throughput",), 1.0),
        ("RSS idle / peak (GiB)", ("rss_idle", "rss_peak"), 2**-30),
    ]
    for ax, (title, keys, scale) in zip(axes, panels, strict=True):
        width = 0.8 / len(keys)
        for j, k in enumerate(keys):
            vals = [(_get(rows[n], METRICS[k]) or 0.0) * scale for n in ok]
            ax.bar([i + j * width for i in range(len(ok))], vals, width, label=k)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(ok))], ok, rotation=30, ha="right")
        ax.set_title(title)
        if len(keys) > 1:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "compare.png")
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for n in ok:
        path = out / n / "ttft.json"
        xs = json.loads(path.read_text()) if path.exists() else []
        if xs:
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=n)
    ax.set(xscale="log", xlabel="TTFT (s)", ylabel="fraction of requests", title="TTFT CDFs")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "ttft_cdf.png")
    plt.close(fig)
    return [out / "report.md", out / "compare.png", out / "ttft_cdf.png"]


def with_preset(base: Mapping[str, Any], preset: str | None) -> dict[str, Any]:
    """``base`` on the locally built model ``preset`` (``test`` or ``bench``); as is for None."""
    raw = json.loads(json.dumps(base))
    if preset is not None:
        model = raw["applications"][0].setdefault("args", {}).setdefault("model", {})
        model |= {
            "path": f"~/.cache/pdserve/models/{preset}",
            "served_name": preset,
            "build_preset": preset,
        }
    return raw


def run(
    base: Mapping[str, Any],
    out: Path,
    reqs: Sequence[LiveRequest],
    *,
    systems: Sequence[str] = tuple(SYSTEMS),
    workload: str = "",
    concurrency: int | None = None,
    progress: bool = True,
    on_system: Callable[[str, dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Each of ``systems`` up, measured on the same ``reqs`` (text prompts), down; then the
    ratios, the goal and the report. A system that fails to come up is reported as failed
    and the rest go on. The model must be built (the caller, ``pdserve bench compare``, builds
    it before it turns the prompts into the model's text)."""
    from deployments.config import load_app_config

    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        raise ValueError(f"unknown systems {unknown}; known: {', '.join(SYSTEMS)}")
    cfg = load_app_config(base["applications"][0].get("args") or {})
    out.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {
        "workload": workload,
        "requests": len(reqs),
        "model": cfg.model.served_name,
        "prefill_replicas": cfg.prefill.num_replicas,
        "decode_replicas": cfg.decode.num_replicas,
        "reference": REFERENCE,
        "systems": {},
    }
    for name in systems:
        sys_ = SYSTEMS[name]
        config = pdserve_config(base, sys_) if sys_.kind == "pdserve" else peer_config(base, sys_)
        try:
            m = measure(
                name,
                sys_,
                config,
                reqs,
                out,
                model=cfg.model.served_name,
                concurrency=concurrency,
                progress=progress,
            )
            row: dict[str, Any] = {
                "about": sys_.about,
                "summary": m.summary,
                "deploy_to_first_token_s": m.deploy_to_first_token_s,
                "rss_idle_bytes": m.rss_idle_bytes,
                "rss_peak_bytes": m.rss_peak_bytes,
                "idle_cpu_percent": m.idle_cpu_percent,
            }
        except Exception as e:  # reported; the other systems still run
            row = {"about": sys_.about, "error": f"{type(e).__name__}: {e}"[:500]}
        res["systems"][name] = row
        if on_system is not None:
            on_system(name, row)
        (out / "compare.json").write_text(json.dumps(res, indent=2))
    res["ratios"] = ratios(res["systems"])
    res["goal"] = goal(res["ratios"]["pdserve"]) if "pdserve" in res["ratios"] else {}
    (out / "compare.json").write_text(json.dumps(res, indent=2))
    report(res, out)
    return res
