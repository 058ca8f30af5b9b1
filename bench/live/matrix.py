"""pdserve against Ray Serve LLM over a matrix of repeated runs (``pdserve bench compare
--matrix``, issue 39): one live run's median differs from the next by up to 1.45x, so a single
side-by-side run (:mod:`bench.live.compare`) cannot tell a 0.8x from noise.

Cells are ``layout/load/workload``:

- layout: ``pair`` (one prefill + one decode replica) or ``two_prefill`` (two prefill + one
  decode: ``configs/pd_cluster.yaml``'s own counts). Every other setting is the base config's.
- load: ``closed8`` (closed loop, 8 clients) or ``open0.5`` / ``open0.9`` / ``open1.2``
  (Poisson arrivals at that fraction of the reference's capacity). Capacity is the
  reference's (``peer-connector``) completed requests per second in the ``closed8`` cell of
  the same layout and workload, its median over all the repeats. An open cell draws its
  rate once, and only from a closed cell whose reference has run every repeat: when it has
  not, that closed cell joins the selected cells and runs first, every system and repeat.
  (Matrices before this rule drew a rate from one run of the reference alone, kept as
  ``capacity_runs`` in the JSON; one such rate was 0.75x of the later median.)
- workload: ``rag`` (the shared-document RAG mix, :mod:`bench.workloads.rag`);
  ``cache_pressure`` (the same mix over more documents, see :func:`cache_pressure_mix`);
  ``multi_tenant`` (two tenants, ``flood`` at 10x the rate of ``quiet``, see
  :func:`multi_tenant_requests`); ``burst`` (the prefill simulator's ``sec-spike``
  scenario, its quick variant: calm, burst, then a spike at 1.75x, prompts halved in length
  for this machine, and its arrivals stretched so that their mean rate is the cell's rate).

Repeats and order: each cell runs ``repeats`` times (3 by default); repeat ``r`` runs the
systems in the given order when ``r`` is even and reversed when odd (AB, BA, AB, ...), so
that a system is not always the one that runs on a machine warmed (or heated) by the other.
Within a repeat every system gets the very same requests: one list built with seed
``seed + r`` (arrival times included). Different repeats draw different seeds, so the spread
covers the workload's draw as well as the run's noise.

Ratios are pdserve over the reference, **paired by repeat** (the same requests on both
sides): per cell and metric, the median over repeats of the per-repeat ratios, and their
spread as **min-max** (with three repeats an IQR is barely defined). A repeat where either
side failed contributes no ratio. Metrics: throughput (output tokens/s), TTFT p50 and p99,
ITL p99, cached-token ratio, and for ``multi_tenant`` the quiet tenant's TTFT p99.

Goals (over the median ratios): every cell throughput >= 1.0x (in an open-loop cell within
0.5%: the same arrivals served at the same rate) and TTFT p50, p99 <= 1.0x;
``two_prefill/open0.9`` of ``cache_pressure`` and ``burst``: TTFT p50 and p99 <= 0.7x;
``multi_tenant``: the quiet tenant's TTFT p99 <= 0.5x. Each is met, missed or "no data".

Each live run is framed by a host probe (:func:`host_probe`, before and after it): the same
fixed work timed each time, so a repeat that ran on a slower or busier host shows it in the
report's "Every run" table. The repeats of one cell span hours and sessions on a shared
machine, and a run's own CPU seconds cannot tell a slower host from more work. Inside the
run, :class:`RunProbe` times fixed work every 10 s in CPU seconds (a slower host raises it, a
busier one does not) and reads the host's steal time; its figures are the table's last column.

Everything here is pure but :func:`live_runner` and :func:`live_requests`: the per-system
run is a callable (:data:`RunSystem`) so that the unit tests stand it in. Results are
``simulated: false`` and keep every run's raw figures.
"""

from __future__ import annotations

import collections
import hashlib
import json
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench.workloads.replay import LiveRequest

#: The denominator of every ratio (as in :mod:`bench.live.compare`).
REFERENCE = "peer-connector"
DEFAULT_SYSTEMS = ("pdserve", REFERENCE)
#: layout -> (prefill replicas, decode replicas)
LAYOUTS: dict[str, tuple[int, int]] = {"pair": (1, 1), "two_prefill": (2, 1)}
#: load -> (closed-loop clients, open-loop fraction of capacity): exactly one is set
LOADS: dict[str, tuple[int | None, float | None]] = {
    "closed8": (8, None),
    "open0.5": (None, 0.5),
    "open0.9": (None, 0.9),
    "open1.2": (None, 1.2),
}
WORKLOADS = ("rag", "cache_pressure", "multi_tenant", "burst")
#: metric -> whether higher is better (the heat map's caption says which way is good);
#: ``served`` is the requests answered (an open-loop cell's throughput goal, see goals)
METRICS: dict[str, bool] = {
    "throughput": True,
    "served": True,
    "ttft_p50": False,
    "ttft_p99": False,
    "itl_p99": False,
    "cached_token_ratio": True,
    "quiet_ttft_p99": False,
    "cpu_s": False,
}
#: ``cache_pressure``'s document popularity: flatter than the RAG mix's 1.1 so that most
#: documents come back (with 86 documents and 172 requests at seed 0, 69 are requested:
#: 106k tokens, still 1.2x one replica's cache)
CACHE_PRESSURE_ZIPF = 0.3
#: the quiet tenant's share of the ``multi_tenant`` arrivals: the flood sends 10x its rate
FLOOD_FACTOR = 10


@dataclass(frozen=True, order=True)
class Cell:
    """One cell of the matrix: ``layout/load/workload``."""

    layout: str
    load: str
    workload: str

    @property
    def name(self) -> str:
        return f"{self.layout}/{self.load}/{self.workload}"

    @property
    def concurrency(self) -> int | None:
        return LOADS[self.load][0]

    @property
    def load_factor(self) -> float | None:
        return LOADS[self.load][1]

    @property
    def capacity_cell(self) -> Cell:
        """The closed-loop cell whose reference throughput sets this cell's rate."""
        return Cell(self.layout, "closed8", self.workload)


def all_cells() -> list[Cell]:
    """Every cell, layout-major, then load (closed loop first), then workload."""
    return [Cell(a, b, c) for a in LAYOUTS for b in LOADS for c in WORKLOADS]


def parse_cells(spec: str | None) -> list[Cell]:
    """The cells of ``--cells`` (comma-separated ``layout/load/workload``; ``*`` matches any
    part, e.g. ``two_prefill/*/rag``); all cells for None or empty. ``ValueError`` naming
    each bad cell and the known parts."""
    if not spec or not spec.strip():
        return all_cells()
    parts = {"layout": list(LAYOUTS), "load": list(LOADS), "workload": list(WORKLOADS)}
    out: list[Cell] = []
    bad: list[str] = []
    for raw in (x.strip() for x in spec.split(",")):
        if not raw:
            continue
        bits = raw.split("/")
        if len(bits) != 3:
            bad.append(f"{raw!r} (expected layout/load/workload)")
            continue
        choices = []
        for (what, known), bit in zip(parts.items(), bits, strict=True):
            if bit == "*":
                choices.append(known)
            elif bit in known:
                choices.append([bit])
            else:
                bad.append(f"{raw!r} (unknown {what} {bit!r}; known: {', '.join(known)})")
                break
        else:
            for a in choices[0]:
                for b in choices[1]:
                    for c in choices[2]:
                        cell = Cell(a, b, c)
                        if cell not in out:
                            out.append(cell)
    if bad:
        raise ValueError("bad cell " + "; ".join(bad))
    return out


def parse_repeats(spec: str | None, repeats: int) -> list[tuple[Cell, int]]:
    """The repeats of ``--redo-repeat``: comma-separated ``layout/load/workload#N`` (N from 1,
    as the report names them; no wildcards: one cell each) as (cell, 0-based repeat).
    ``ValueError`` naming each bad one."""
    out: list[tuple[Cell, int]] = []
    bad: list[str] = []
    for raw in (x.strip() for x in (spec or "").split(",")):
        if not raw:
            continue
        name, _, n = raw.partition("#")
        try:
            cells = parse_cells(name) if "*" not in name and name.strip() else []
        except ValueError as e:
            bad.append(f"{raw!r} ({e})")
            continue
        if len(cells) != 1 or not n.strip().isdigit() or not 1 <= int(n) <= repeats:
            bad.append(f"{raw!r} (expected layout/load/workload#N, N from 1 to {repeats})")
            continue
        if (cells[0], int(n) - 1) not in out:
            out.append((cells[0], int(n) - 1))
    if bad:
        raise ValueError("bad repeat " + "; ".join(bad))
    return out


def run_order(systems: Sequence[str], repeats: int) -> list[list[str]]:
    """The systems' order in each repeat: as given in even repeats, reversed in odd ones."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    return [list(systems) if r % 2 == 0 else list(reversed(systems)) for r in range(repeats)]


def schedule(cells: Sequence[Cell]) -> list[Cell]:
    """``cells`` in run order: each closed-loop cell before the open-loop cells it sets the
    rate of, otherwise in the given order."""
    closed = [c for c in cells if c.concurrency is not None]
    return closed + [c for c in cells if c.concurrency is None]


def open_rate(capacity_rps: float, factor: float) -> float:
    """The Poisson rate of an open-loop cell: ``factor`` x the reference's capacity."""
    if not capacity_rps > 0:
        raise ValueError(f"capacity must be > 0 requests/s, got {capacity_rps}")
    return capacity_rps * factor


def layout_config(base: Mapping[str, Any], layout: str) -> dict[str, Any]:
    """``base`` (a Serve YAML as a dict) with the layout's replica counts; the peer's config
    is derived from it, so both systems get them."""
    prefill, decode = LAYOUTS[layout]
    raw = json.loads(json.dumps(base))
    args = raw["applications"][0].setdefault("args", {})
    args.setdefault("prefill", {})["num_replicas"] = prefill
    args.setdefault("decode", {})["num_replicas"] = decode
    return raw


# ---------------------------------------------------------------------------------------------
# Workloads


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """KV cache bytes one token takes: a key and a value per layer and KV head."""
    return 2 * layers * kv_heads * head_dim * dtype_bytes


@dataclass(frozen=True)
class CachePressure:
    """The ``cache_pressure`` mix's sizing and the arithmetic behind it (in the report)."""

    tokens_per_replica: int
    prefill_replicas: int
    doc_tokens: int
    documents: int
    requests: int

    @property
    def working_set_tokens(self) -> int:
        return self.documents * self.doc_tokens

    def explain(self) -> str:
        return (
            f"{self.documents} documents x {self.doc_tokens} tokens = "
            f"{self.working_set_tokens} tokens, 1.5x one prefill replica's KV cache "
            f"({self.tokens_per_replica} tokens) and "
            f"{self.working_set_tokens / (self.tokens_per_replica * self.prefill_replicas):.2f}x "
            f"all {self.prefill_replicas} replicas' together; {self.requests} requests"
        )


def cache_pressure_mix(
    kv_cache_bytes: int,
    bytes_per_token: int,
    *,
    prefill_replicas: int = 2,
    doc_blocks: int = 12,
    block_size: int = 128,
    passes: float = 2.0,
) -> CachePressure:
    """Documents whose working set is 1.5x one prefill replica's KV cache: more than one
    replica holds, less than two hold together (so routing by prefix decides the hit rate),
    with documents of the RAG mix's size (``doc_blocks`` blocks). ``passes``: requests per
    document on average, so each document is seen again after it may have been evicted.
    With the ``bench`` model in float32 (6 layers, 4 KV heads of 64: 12,288 bytes a token)
    and ``kv_cache_gib: 1``: 87,381 tokens a replica, 86 documents of 1,536 tokens (132,096
    tokens), 172 requests."""
    per_replica = kv_cache_bytes // bytes_per_token
    doc_tokens = doc_blocks * block_size
    documents = math.ceil(1.5 * per_replica / doc_tokens)
    if documents * doc_tokens >= per_replica * max(2, prefill_replicas):
        raise ValueError("documents do not fit all prefill replicas' caches together")
    return CachePressure(
        per_replica, max(2, prefill_replicas), doc_tokens, documents, math.ceil(passes * documents)
    )


def rag_requests(
    vocab: int, seed: int, max_tokens: int, *, documents: int = 16, requests: int = 120,
    zipf_s: float = 1.1, label: str = "",
) -> list[LiveRequest]:  # fmt: skip
    """The RAG mix as replay requests (at its own arrivals: the caller reshapes them)."""
    from bench.workloads.rag import RagMix, rag_mix

    mix = RagMix(
        requests=requests, documents=documents, zipf_s=zipf_s, max_tokens=max_tokens, seed=seed
    )
    return [
        LiveRequest(a.at_s, tuple(a.ids), max_tokens, label or f"doc{a.doc}")
        for a in rag_mix(mix, vocab)
    ]


def multi_tenant_requests(
    vocab: int, seed: int, max_tokens: int, rate: float, requests: int = 132
) -> list[LiveRequest]:
    """Two tenants' RAG mixes merged by arrival: ``flood`` at ``FLOOD_FACTOR`` x the rate of
    ``quiet``, ``rate`` requests/s together, their documents disjoint (different seeds).
    Labels ``tenant:flood`` and ``tenant:quiet``; keys are set per system (:func:`with_keys`)."""
    quiet_rate = rate / (FLOOD_FACTOR + 1)
    n_quiet = max(1, round(requests / (FLOOD_FACTOR + 1)))
    out = []
    for name, r, n, s in (
        ("quiet", quiet_rate, n_quiet, seed * 2 + 1),
        ("flood", quiet_rate * FLOOD_FACTOR, requests - n_quiet, seed * 2),
    ):
        base = rag_requests(vocab, s, max_tokens, requests=n, label=f"tenant:{name}")
        out += poisson(base, r, s)
    return sorted(out, key=lambda x: x.at_s)


def poisson(reqs: Sequence[LiveRequest], rate: float, seed: int) -> list[LiveRequest]:
    """``reqs`` re-timed as a seeded Poisson process at ``rate`` per second (from 0)."""
    from bench.workloads.replay import shape

    out, _ = shape(reqs, rate=rate, seed=seed)
    return out


def stretch_to_rate(reqs: Sequence[LiveRequest], rate: float) -> list[LiveRequest]:
    """``reqs`` with arrival offsets scaled so that their mean rate is ``rate``, keeping
    their shape (a spike stays a spike)."""
    if len(reqs) < 2 or reqs[-1].at_s <= reqs[0].at_s:
        return list(reqs)
    t0 = reqs[0].at_s
    native = (len(reqs) - 1) / (reqs[-1].at_s - t0)
    k = native / rate
    return [replace(r, at_s=(r.at_s - t0) * k) for r in reqs]


#: Builds a cell's requests: (cell, rate in requests/s or None for closed loop, seed)
BuildRequests = Callable[[Cell, float | None, int], list[LiveRequest]]


def workload_requests(
    cell: Cell,
    rate: float | None,
    seed: int,
    *,
    vocab: int = 1000,
    max_tokens: int = 16,
    limit: int | None = None,
    pressure: CachePressure | None = None,
    max_prompt_tokens: int | None = None,
) -> list[LiveRequest]:
    """The requests (token ids) of ``cell`` at ``rate`` (None: closed loop, arrivals
    unused) with ``seed``: the same arguments give the same list, arrivals included."""
    from bench.workloads.replay import scenario_requests, shape

    w = cell.workload
    if w == "multi_tenant":
        reqs = multi_tenant_requests(vocab, seed, max_tokens, rate or 1.0)
    elif w == "burst":
        reqs = scenario_requests("sec-spike", vocab, seed, max_tokens, quick=True)
        reqs, _ = shape(reqs, length_scale=0.5)
        reqs = [replace(r, max_tokens=max_tokens) for r in reqs]
        if rate is not None:
            reqs = stretch_to_rate(reqs, rate)
    else:
        if w == "cache_pressure":
            if pressure is None:
                raise ValueError("cache_pressure needs its sizing (cache_pressure_mix)")
            reqs = rag_requests(
                vocab, seed, max_tokens, documents=pressure.documents,
                requests=pressure.requests, zipf_s=CACHE_PRESSURE_ZIPF,
            )  # fmt: skip
        else:
            reqs = rag_requests(vocab, seed, max_tokens)
        if rate is not None:
            reqs = poisson(reqs, rate, seed)
    reqs, _ = shape(reqs, limit=limit, max_prompt_tokens=max_prompt_tokens)
    return reqs


def with_keys(reqs: Sequence[LiveRequest], keys: Mapping[str, str] | None) -> list[LiveRequest]:
    """``reqs`` with each ``tenant:NAME`` request sent with ``keys[NAME]`` (pdserve), or
    with no key at all for None (the peer gets the same requests without tenants)."""
    out = []
    for r in reqs:
        tenant = r.label.removeprefix("tenant:") if r.label.startswith("tenant:") else None
        out.append(replace(r, key=(keys or {}).get(tenant) if tenant else None))
    return out


def tenant_config(
    config: Mapping[str, Any],
    key_hashes: Mapping[str, str],
    operator_key_hashes: Sequence[str] = (),
    fair_share: bool = True,
) -> dict[str, Any]:
    """A pdserve Serve config (as a dict) for ``multi_tenant``: keys required
    (``ingress.auth: keys``), ``key_hashes`` (``sha256:...`` -> tenant) as the tenants' keys,
    ``operator_key_hashes`` as the operator's (the bench reads the stats with one), and the
    prefill scheduler's fair share among tenants set to ``fair_share`` (the engine's default
    is off; the matrix turns it on but for ``pdserve-nofs``) where the prefill scheduler
    takes a config (not vLLM's stock one)."""
    raw = json.loads(json.dumps(config))
    args = raw["applications"][0].setdefault("args", {})
    args.setdefault("ingress", {})["auth"] = "keys"
    tenants = args.setdefault("tenants", {})
    tenants["key_hashes"] = dict(key_hashes)
    if operator_key_hashes:
        tenants["operator_key_hashes"] = list(operator_key_hashes)
    prefill = args.setdefault("prefill", {})
    if prefill.get("scheduler_cls"):
        prefill["scheduler_config"] = {
            **(prefill.get("scheduler_config") or {}),
            "fair_share": fair_share,
        }
    return raw


# ---------------------------------------------------------------------------------------------
# Running the matrix

#: One system's live run: (system, cell, Serve config of the layout, requests, closed-loop
#: clients or None, output folder) -> its figures (:func:`figures`' keys). Raises on failure.
RunSystem = Callable[
    [str, Cell, dict[str, Any], list[LiveRequest], int | None, Path], dict[str, Any]
]


def figures(
    summary: Mapping[str, Any], quiet_ttfts: Sequence[float] | None = None
) -> dict[str, Any]:
    """One run's figures from a replay summary (:func:`bench.live.replay.summarize`):
    ``requests_per_s`` is completed requests over the wall time (the capacity figure)."""
    from bench.live.replay import _stats

    wall = summary.get("wall_s") or 0.0
    ok = (summary.get("requests") or 0) - (summary.get("errors") or 0)
    return {
        "throughput": summary.get("throughput_tps"),
        "requests_per_s": ok / wall if wall > 0 else None,
        "served": ok,
        "ttft_p50": (summary.get("ttft") or {}).get("p50"),
        "ttft_p99": (summary.get("ttft") or {}).get("p99"),
        "itl_p99": (summary.get("itl") or {}).get("p99"),
        "cached_token_ratio": summary.get("cached_token_ratio"),
        "quiet_ttft_p99": _stats(list(quiet_ttfts))["p99"] if quiet_ttfts else None,
        "errors": summary.get("errors"),
        "requests": summary.get("requests"),
        # CPU seconds the system's processes spent over the replay (same requests on both
        # sides: on a 2-core machine, what one system burns the engines cannot use)
        "cpu_s": summary.get("cpu_s"),
        "cpu_s_by_kind": summary.get("cpu_s_by_kind"),
    }


#: The ingress's phases before the first token, outside the engines (``/v1/pdserve/stats``).
OVERHEAD_TO_FIRST = ("prepare", "route", "cold_start", "prefill", "decode_first")
#: CPU roles of the breakdown, in the report's order.
CPU_ROLES = ("prefill", "decode", "engine processes", "http", "serve controller", "ray and other")


def cpu_role(kind: str) -> str:
    """A process kind's role in the CPU breakdown (:func:`bench.live.compare.process_kind`):
    a replica of a role by its title (pdserve's engines run inside their replicas); the
    peer's ``VLLM::EngineCore`` and ``VLLM::Worker`` processes, of either role, as ``engine
    processes``; ingress and Serve's proxy as ``http``."""
    k = kind.lower()
    if k.startswith("vllm::"):
        return "engine processes"
    if "prefill" in k:
        return "prefill"
    if "decode" in k:
        return "decode"
    if "ingress" in k or "proxyactor" in k:
        return "http"
    if "servecontroller" in k:
        return "serve controller"
    return "ray and other"


def breakdown(summary: Mapping[str, Any], stats: Mapping[str, Any] | None) -> dict[str, Any]:
    """Where one run's time went: the mean TTFT and, for pdserve, its parts from the ingress's
    phase means (one ingress replica's sample): the overhead before the first token
    (:data:`OVERHEAD_TO_FIRST`), the prefill engine's time and the decode engine's time to its
    first chunk (queueing inside each engine included); and the CPU seconds of the replay by
    role (:func:`cpu_role`), with their total per request."""
    phases = ((stats or {}).get("ingress") or {}).get("phases_s") or {}

    def mean(k: str) -> float | None:
        v = (phases.get(k) or {}).get("mean")
        return None if v is None else float(v)

    out: dict[str, Any] = {"ttft_mean_s": (summary.get("ttft") or {}).get("mean")}
    if phases:
        out["overhead_to_first_s"] = sum(mean(k) or 0.0 for k in OVERHEAD_TO_FIRST)
        out["prefill_engine_s"] = mean("prefill_engine")
        out["decode_first_engine_s"] = mean("decode_first_engine")
        out["phases_n"] = (phases.get("prepare") or {}).get("n")
    kinds = summary.get("cpu_s_by_kind") or {}
    if kinds:
        roles = dict.fromkeys(CPU_ROLES, 0.0)
        for kind, sec in kinds.items():
            roles[cpu_role(kind)] += float(sec)
        out["cpu_s_by_role"] = {k: round(v, 2) for k, v in roles.items()}
        ok = (summary.get("requests") or 0) - (summary.get("errors") or 0)
        out["cpu_s_per_request"] = sum(roles.values()) / ok if ok > 0 else None
    return out


def spread(xs: Sequence[float]) -> dict[str, Any]:
    """Median, min and max of ``xs`` (None each when empty)."""
    if not xs:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def cell_ratios(
    runs: Sequence[Mapping[str, Any]], system: str, reference: str = REFERENCE
) -> dict[str, dict[str, Any]]:
    """Per metric, the median and min-max of ``system`` / ``reference`` over the repeats
    where both ran (paired by repeat); ``runs`` are the cell's run records."""
    by_rep = figures_by_repeat(runs)
    out = {}
    for m in METRICS:
        xs = []
        for figs in by_rep.values():
            a = _figure(figs.get(system) or {}, m)
            b = _figure(figs.get(reference) or {}, m)
            if a is not None and b:
                xs.append(a / b)
        out[m] = spread(xs)
    return out


def figures_by_repeat(runs: Sequence[Mapping[str, Any]]) -> dict[int, dict[str, Mapping[str, Any]]]:
    """A cell's run records as ``{repeat: {system: figures}}``, the runs with figures only:
    the pairing every per-repeat comparison reads."""
    by_rep: dict[int, dict[str, Mapping[str, Any]]] = {}
    for r in runs:
        if r.get("figures") is not None:
            by_rep.setdefault(r["repeat"], {})[r["system"]] = r["figures"]
    return by_rep


def _figure(figs: Mapping[str, Any], m: str) -> float | None:
    """One run's figure ``m``; ``served`` of a run recorded before it was a figure comes
    from its requests less its errors."""
    v = figs.get(m)
    if v is None and m == "served" and figs.get("requests") is not None:
        v = figs["requests"] - (figs.get("errors") or 0)
    return v


def goals(cell: Cell, med: Mapping[str, float | None]) -> dict[str, bool | None]:
    """The issue's goals for this cell over the median ratios (None: no data)."""

    def check(m: str, ok: Callable[[float], bool]) -> bool | None:
        v = med.get(m)
        return None if v is None else ok(v)

    # Open loop: both systems get the same arrivals (every request the same output length),
    # so the throughput a system can show is the offered one, less what it did not answer.
    # Its tokens per second over the wall time differ from the other's only by when the last
    # request ended (0.99 in two_prefill/open0.9/burst, all 44 served by both, the last 2.7 s
    # later), which the latencies already count. So the goal there is the requests answered:
    # at least the peer's, every refusal or failure a miss (a tolerance on tokens/s let a
    # run with one refused request of 132 pass). Closed loop: tokens per second, as sent.
    tput = "served" if cell.concurrency is None and med.get("served") is not None else "throughput"
    out = {
        "throughput >= 1.0x": check(tput, lambda v: v >= 1.0),
        "ttft_p50 <= 1.0x": check("ttft_p50", lambda v: v <= 1.0),
        "ttft_p99 <= 1.0x": check("ttft_p99", lambda v: v <= 1.0),
    }
    if (
        cell.workload in ("cache_pressure", "burst")
        and cell.layout == "two_prefill"
        and cell.load == "open0.9"
    ):
        out["ttft_p50 <= 0.7x"] = check("ttft_p50", lambda v: v <= 0.7)
        out["ttft_p99 <= 0.7x"] = check("ttft_p99", lambda v: v <= 0.7)
    if cell.workload == "multi_tenant":
        out["quiet tenant ttft_p99 <= 0.5x"] = check("quiet_ttft_p99", lambda v: v <= 0.5)
    return out


def run_matrix(
    cells: Sequence[Cell],
    out: Path,
    *,
    run_system: RunSystem,
    build: BuildRequests,
    base: Mapping[str, Any],
    systems: Sequence[str] = DEFAULT_SYSTEMS,
    repeats: int = 3,
    seed: int = 0,
    progress: bool = True,
    notes: Mapping[str, Any] | None = None,
    on_run: Callable[[dict[str, Any]], None] | None = None,
    resume: bool = False,
    redo: bool = False,
    redo_repeats: Sequence[tuple[Cell, int]] = (),
    budget_s: float | None = None,
    code: str | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> dict[str, Any]:
    """Run every cell ``repeats`` times over ``systems`` (the reference among them), then the
    ratios, goals and report in ``out`` (``matrix.json``, ``report.md``, ``heatmap.png``).
    A run that raises is recorded with its error and the others go on; ``matrix.json`` is
    rewritten after each run, so an interrupted matrix keeps what it measured.

    The whole matrix is about a day of runs on a small machine, so it can be filled in
    slices: with ``resume`` the runs already in ``out/matrix.json`` that have figures are
    kept and not run again (a failed one is run again), its capacities and each open cell's
    rate are reused (every repeat of a cell keeps the same arrivals), and cells measured
    before but not selected now stay in the report. The earlier file must have the same
    systems and seed (else ``ValueError`` naming the difference); ``repeats`` may grow.
    With ``redo`` (and ``resume``) the selected cells start again: their earlier runs and
    drawn rate move to ``replaced`` in the JSON (their folders to ``<cell>.replaced<n>``)
    and an open one draws its rate anew, e.g. after its closed cell's capacity moved.
    ``redo_repeats`` (cell, repeat) sets one repeat's runs aside the same way (its run
    folders to ``r<repeat>-<system>.replaced<n>``) and runs it again on the same arrivals,
    e.g. a repeat the report names as run on hosts of unlike speed; its cell need not be
    among ``cells``.
    With ``budget_s`` no run starts once that many seconds have passed: the cells not
    finished are reported as ``incomplete`` and ``stopped`` says so. ``code`` (e.g. the git
    commit) is written into each run's record, so that a matrix filled over several
    sessions says which code each run measured."""
    from tqdm import tqdm

    if REFERENCE not in systems:
        raise ValueError(f"the systems must include the reference {REFERENCE!r}")
    others = [s for s in systems if s != REFERENCE]
    out.mkdir(parents=True, exist_ok=True)
    order = run_order(systems, repeats)
    prev = previous_matrix(out, systems, seed) if resume else None
    start = clock()
    res: dict[str, Any] = {
        "simulated": False,
        "reference": REFERENCE,
        "systems": list(systems),
        "repeats": repeats,
        "order": ["".join(chr(65 + list(systems).index(s)) for s in o) for o in order],
        "seed": seed,
        "spread": "min-max over repeats of the per-repeat ratio (same requests on both sides)",
        "notes": dict(notes or {}),
        "capacity_rps": dict((prev or {}).get("capacity_rps") or {}),
        "capacity_runs": [r for r in (prev or {}).get("capacity_runs") or [] if r.get("figures")],
        "cells": {
            name: {k: v for k, v in c.items() if k in ("rate_rps",)}
            | {"runs": [r for r in c.get("runs") or [] if r.get("figures")]}
            for name, c in ((prev or {}).get("cells") or {}).items()
        },
        "replaced": dict((prev or {}).get("replaced") or {}),
    }
    if redo:
        for cell in cells:
            set_aside(res, out, cell)
    for cell, rep in redo_repeats:
        set_aside_repeat(res, out, cell, rep)
    cells = [*cells, *(c for c, _ in redo_repeats if c not in cells)]
    cells = schedule(closed_first(cells, res["cells"], systems, repeats))

    def done(cell: Cell, rep: int, system: str) -> bool:
        runs = (res["cells"].get(cell.name) or {}).get("runs") or []
        return any(r["repeat"] == rep and r["system"] == system for r in runs)

    todo = [
        (c, rep, s) for c in cells for rep, names in enumerate(order) for s in names
        if not done(c, rep, s)
    ]  # fmt: skip
    bar = tqdm(total=len(todo), desc="matrix", unit="run", disable=not progress)

    class OutOfBudget(Exception):
        pass

    def check_budget() -> None:
        if budget_s is not None and clock() - start >= budget_s:
            res["stopped"] = (
                f"budget of {budget_s / 60:.0f} min spent; run again with --resume to go on"
            )
            raise OutOfBudget

    def save() -> None:
        (out / "matrix.json").write_text(json.dumps(res, indent=2, default=str))

    def one(system: str, cell: Cell, rep: int, rate: float | None, reqs: list[LiveRequest],
            folder: Path) -> dict[str, Any]:  # fmt: skip
        check_budget()
        bar.set_postfix_str(f"{cell.name} #{rep + 1} {system}")
        rec: dict[str, Any] = {"system": system, "repeat": rep, "seed": seed + rep, "rate": rate}
        if code is not None:
            rec["code"] = code
        t0 = clock()
        try:
            cfg = layout_config(base, cell.layout)
            rec["figures"] = run_system(
                system, cell, cfg, reqs, cell.concurrency, folder / f"r{rep}-{system}"
            )
        except Exception as e:  # noqa: BLE001 - reported; the other runs go on
            rec["figures"] = None
            rec["error"] = f"{type(e).__name__}: {e}"[:500]
        rec["run_s"] = round(clock() - t0, 1)  # head, deploy, replay, down: for the estimate
        bar.update(1)
        if on_run is not None:
            on_run({"cell": cell.name, **rec})
        return rec

    def capacity(cell: Cell) -> float | None:
        closed = res["cells"].get(cell.capacity_cell.name) or {}
        return closed_capacity(closed.get("runs") or [], repeats)

    try:
        for cell in cells:
            folder = out / cell.name.replace("/", "-")
            entry: dict[str, Any] = res["cells"].setdefault(cell.name, {"runs": []})
            rate = entry.get("rate_rps")
            if cell.load_factor is not None and rate is None:
                cap = capacity(cell)
                if cap is None:
                    entry["status"] = "failed"
                    entry["error"] = (
                        f"no capacity: the reference's {cell.capacity_cell.name} lacks a "
                        f"repeat of its {repeats} (failed)"
                    )
                    bar.update(sum(1 for t in todo if t[0] == cell))
                    save()
                    continue
                rate = open_rate(cap, cell.load_factor)
                entry["rate_rps"] = rate
            for rep, names in enumerate(order):
                names = [s for s in names if not done(cell, rep, s)]
                if not names:
                    continue
                reqs = build(cell, rate, seed + rep)  # one list: every system the same
                for system in names:
                    entry["runs"].append(one(system, cell, rep, rate, reqs, folder))
                    save()
            entry |= summarize_cell(cell, entry["runs"], systems, others, repeats)
            if cell.concurrency is not None and (rps := _reference_rps(entry["runs"])):
                res["capacity_rps"][cell.name] = statistics.median(rps.values())
            save()
    except OutOfBudget:
        pass
    finally:
        bar.close()
        for name, entry in res["cells"].items():  # what ran, also when stopped
            if entry.get("runs"):
                entry |= summarize_cell(
                    Cell(*name.split("/")), entry["runs"], systems, others, repeats
                )
            elif "status" not in entry:
                entry["status"] = "not run"
        save()
    report(res, out)
    return res


def _reference_rps(runs: Sequence[Mapping[str, Any]]) -> dict[int, float]:
    """The requests per second of the reference's runs of a closed cell, by repeat (the runs
    that measured it)."""
    return {
        r["repeat"]: r["figures"]["requests_per_s"]
        for r in runs
        if r["system"] == REFERENCE and (r.get("figures") or {}).get("requests_per_s")
    }


def closed_capacity(runs: Sequence[Mapping[str, Any]], repeats: int) -> float | None:
    """The capacity an open cell draws its rate from: the median requests/s of the
    reference's runs of the closed cell, once it has one for each of the ``repeats`` (None
    before: a rate drawn from fewer runs stays with the cell for good, noise and all)."""
    rps = _reference_rps(runs)
    if not set(range(repeats)) <= rps.keys():
        return None
    return statistics.median(rps.values())


def closed_first(
    cells: Sequence[Cell],
    done: Mapping[str, Mapping[str, Any]],
    systems: Sequence[str],
    repeats: int,
) -> list[Cell]:
    """``cells`` and, ahead of them, the closed cell of each open cell that has no rate yet
    and whose closed cell lacks a run (of any system: the closed cell runs whole, so that its
    runs keep their AB/BA order) in ``done`` (the matrix's cells so far)."""
    extra: list[Cell] = []
    for c in cells:
        if c.concurrency is not None or (done.get(c.name) or {}).get("rate_rps") is not None:
            continue
        cc = c.capacity_cell
        have = _measured((done.get(cc.name) or {}).get("runs") or [])
        full = all((rep, s) in have for rep in range(repeats) for s in systems)
        if not full and cc not in cells and cc not in extra:
            extra.append(cc)
    return extra + list(cells)


def set_aside(res: dict[str, Any], out: Path, cell: Cell) -> None:
    """``--redo``: move ``cell``'s runs and drawn rate from ``res["cells"]`` to
    ``res["replaced"]`` (a list per cell: every earlier attempt is kept) and its run
    folders to ``<cell>.replaced<n>``, so that it runs again from nothing."""
    entry = res["cells"].pop(cell.name, None)
    if not entry:
        return
    res["replaced"].setdefault(cell.name, []).append(entry)
    _move_aside(out / cell.name.replace("/", "-"))


def _move_aside(path: Path) -> None:
    """Rename ``path`` (a cell's or a run's folder) to ``<name>.replaced<n>``, the first
    such name free, so that every earlier attempt is kept; nothing when it is missing."""
    if not path.exists():
        return
    n = 1
    while path.with_name(f"{path.name}.replaced{n}").exists():
        n += 1
    path.rename(path.with_name(f"{path.name}.replaced{n}"))


def set_aside_repeat(res: dict[str, Any], out: Path, cell: Cell, rep: int) -> None:
    """``--redo-repeat``: move the runs of ``cell``'s repeat ``rep`` (0-based) to
    ``res["replaced"]`` as ``{"repeat": rep, "runs": [...]}`` and their folders to
    ``r<rep>-<system>.replaced<n>``, so that the repeat runs again; the cell keeps its rate
    and its other repeats."""
    entry = res["cells"].get(cell.name) or {}
    runs = [r for r in entry.get("runs") or [] if r["repeat"] == rep]
    if not runs:
        return
    entry["runs"] = [r for r in entry["runs"] if r["repeat"] != rep]
    res["replaced"].setdefault(cell.name, []).append({"repeat": rep, "runs": runs})
    folder = out / cell.name.replace("/", "-")
    for r in runs:
        _move_aside(folder / f"r{rep}-{r['system']}")


def previous_matrix(out: Path, systems: Sequence[str], seed: int) -> dict[str, Any] | None:
    """``out/matrix.json`` from an earlier run, to resume (None when there is none);
    ``ValueError`` when it was run with other systems or another seed, whose runs cannot be
    paired with new ones."""
    path = out / "matrix.json"
    if not path.exists():
        return None
    prev: dict[str, Any] = json.loads(path.read_text())
    if prev.get("simulated") is not False:
        raise ValueError(f"--resume: {path} is not a live matrix")
    if list(prev.get("systems") or []) != list(systems):
        raise ValueError(
            f"--resume: {path} was run with the systems {prev.get('systems')}, not {list(systems)}"
        )
    if prev.get("seed") != seed:
        raise ValueError(f"--resume: {path} was run with seed {prev.get('seed')}, not {seed}")
    return prev


def summarize_cell(
    cell: Cell,
    runs: Sequence[Mapping[str, Any]],
    systems: Sequence[str],
    others: Sequence[str],
    repeats: int | None = None,
) -> dict[str, Any]:
    """A cell's status, each system's median figures, the ratios and the goals. The status
    is ``failed`` (no repeat paired), ``partial`` (some run failed), ``incomplete`` (fewer
    runs than ``repeats`` x systems, none failed: a budget stopped it) or ``ok``."""
    failed = [r for r in runs if r.get("figures") is None]
    medians: dict[str, dict[str, float | None]] = {}
    for s in systems:
        figs = [r["figures"] for r in runs if r["system"] == s and r.get("figures")]
        medians[s] = {
            m: spread([v for f in figs if (v := _figure(f, m)) is not None])["median"]
            for m in (*METRICS, "requests_per_s")
        }
    ratios = {s: cell_ratios(runs, s) for s in others}
    paired = max((int(v["throughput"]["n"]) for v in ratios.values()), default=0)
    status = "ok" if not failed else ("partial" if paired else "failed")
    if status == "ok" and repeats is not None and len(_measured(runs)) < repeats * len(systems):
        status = "incomplete"
    med = {m: v["median"] for m, v in main_ratios({"ratios": ratios}).items()}
    out: dict[str, Any] = {
        "status": status,
        "medians": medians,
        "ratios": ratios,
        "goals": goals(cell, med),
    }
    if failed:
        out["errors"] = sorted({r["error"] for r in failed})
    return out


# ---------------------------------------------------------------------------------------------
# Report


def _measured(runs: Sequence[Mapping[str, Any]]) -> set[tuple[int, str]]:
    """``(repeat, system)`` of the runs that have figures."""
    return {(r["repeat"], r["system"]) for r in runs if r.get("figures") is not None}


def _every_run(res: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The capacity runs, then every cell's runs."""
    return [
        *(res.get("capacity_runs") or []),
        *(r for c in res["cells"].values() for r in c.get("runs") or []),
    ]


def main_system(systems: Sequence[str], reference: str = REFERENCE) -> str | None:
    """The system whose ratios the report's table and heat map show: ``pdserve``, else the
    first system that is not the reference (``pdserve-nofs`` in a matrix of its own)."""
    if "pdserve" in systems:
        return "pdserve"
    return next((s for s in systems if s != reference), None)


def main_ratios(cell: Mapping[str, Any]) -> dict[str, Any]:
    """A cell's ratios of its :func:`main_system`."""
    ratios: dict[str, Any] = cell.get("ratios") or {}
    name = main_system(list(ratios))  # the reference has no ratios of its own
    return dict(ratios[name]) if name is not None else {}


def _fmt(v: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def report(res: Mapping[str, Any], out: Path) -> list[Path]:
    """``report.md`` (per cell: status, the median ratios with their min-max, the goals; then
    every run's raw figures) and ``heatmap.png`` (cells x metrics, median ratios)."""
    cells = res["cells"]
    metrics = [m for m in METRICS if m != "quiet_ttft_p99"] + ["quiet_ttft_p99"]
    lines = [
        "# pdserve vs Ray Serve LLM: the matrix",
        "",
        f"Live runs (simulated: {str(res['simulated']).lower()}), systems {', '.join(res['systems'])}, "
        f"{res['repeats']} repeats per cell in the orders {', '.join(res['order'])}. "
        f"Ratios are `{main_system(res['systems'], res['reference'])}` over "
        f"`{res['reference']}`: the median over repeats of the "
        f"per-repeat ratio, with its spread as min-max. Higher is better for throughput and "
        f"the cached ratio, lower for the latencies.",
        "",
    ]
    lines += [f"- {k}: {v}" for k, v in (res.get("notes") or {}).items()]
    measured = [n for n, c in cells.items() if c.get("status") == "ok"]
    lines.append(
        f"- cells with every run done: {len(measured)} of {len(all_cells())}"
        + (f"; stopped: {res['stopped']}" if res.get("stopped") else "")
    )
    lines.append(runs_left_line(res))
    codes = collections.Counter(r.get("code") or "not recorded" for r in _every_run(res))
    if codes:
        lines.append(
            "- code measured (runs): " + ", ".join(f"{k} ({v})" for k, v in codes.most_common())
        )
    if res.get("capacity_rps"):
        caps = ", ".join(f"{k} {v:.3f}" for k, v in res["capacity_rps"].items())
        lines += ["", f"Capacity (the reference's closed-loop requests/s): {caps}"]
        moved = drifted_rates(res)
        if moved:
            lines.append(
                "Open cells whose rate was drawn from a capacity more than 10% off today's "
                "(`--resume --redo --cells CELL` draws it anew): " + moved
            )
    uneven = uneven_hosts(res)
    if uneven:
        lines.append(
            "Repeats whose systems ran on hosts of unlike speed (the during-run probe's "
            "medians more than 15% apart, see Every run; `--resume --redo-repeat 'CELL#N'` "
            "runs one again): " + uneven
        )
    if res.get("replaced"):
        again = collections.Counter(
            k if t.get("repeat") is None else f"{k} #{t['repeat'] + 1}"
            for k, v in res["replaced"].items()
            for t in v
        )
        lines.append(
            "Run again (the earlier runs are kept under `replaced` in matrix.json): "
            + ", ".join(f"{k} ({n}x)" for k, n in again.items())
        )
    if lines[-1]:
        lines.append("")
    lines += [
        "| cell | status | " + " | ".join(metrics) + " | goals |",
        "|---|---|" + "---|" * len(metrics) + "---|",
    ]
    for name, c in cells.items():
        if c.get("status") == "failed" and "ratios" not in c:
            why = str(c.get("error", ""))[:100]
            lines.append(f"| {name} | failed: {why} |" + " - |" * (len(metrics) + 1))
            continue
        r = main_ratios(c)
        vals = []
        for m in metrics:
            s = r.get(m) or {}
            d = 3 if m == "served" else 2  # one request of 132 shows: 0.992, not 1.00
            vals.append(
                "-"
                if s.get("median") is None
                else f"{s['median']:.{d}f} ({s['min']:.{d}f}-{s['max']:.{d}f})"
            )
        g = c.get("goals") or {}
        met = sum(1 for v in g.values() if v)
        missed = [k for k, v in g.items() if v is False]
        verdict = f"{met}/{len(g)} met" + (f"; missed: {', '.join(missed)}" if missed else "")
        lines.append(f"| {name} | {c.get('status')} | " + " | ".join(vals) + f" | {verdict} |")
    lines += ["", "## Goals", ""]
    for name, c in cells.items():
        for k, v in (c.get("goals") or {}).items():
            lines.append(f"- {name}: {k}: {'no data' if v is None else ('met' if v else 'missed')}")
    lines += [
        "",
        "## Every run",
        "",
        f"Host probe: seconds to hash a fixed {PROBE_MIB} MiB on one thread before / after the run; a "
        "longer probe is a slower or busier host. During the run: every 10 s the CPU ms of "
        f"hashing {DURING_HASH_MIB} MiB / copying {DURING_COPY_MIB} MiB, median (max), and the "
        "host's steal time; more CPU for the same work is a slower host, not a busier one "
        "(`bench.live.matrix.RunProbe`).",
        "",
        "| cell | repeat | system | rate req/s | tok/s | req/s | TTFT p50 s | TTFT p99 s "
        "| ITL p99 s | cached | quiet TTFT p99 s | errors | host probe s | during: hash/copy ms, steal |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    all_runs = [(r["cell"], r) for r in res.get("capacity_runs") or []]
    all_runs += [(n, r) for n, c in cells.items() for r in c.get("runs") or []]
    for name, r in all_runs:
        f = r.get("figures")
        if f is None:
            lines.append(
                f"| {name} | {r['repeat'] + 1} | {r['system']} | {_fmt(r.get('rate'), '{:.3f}')} "
                f"| failed: {str(r.get('error', ''))[:100]} |" + " - |" * 9
            )
            continue
        lines.append(
            f"| {name} | {r['repeat'] + 1} | {r['system']} | {_fmt(r.get('rate'), '{:.3f}')} "
            f"| {_fmt(f.get('throughput'), '{:.1f}')} | {_fmt(f.get('requests_per_s'), '{:.3f}')} "
            f"| {_fmt(f.get('ttft_p50'), '{:.3f}')} | {_fmt(f.get('ttft_p99'), '{:.3f}')} "
            f"| {_fmt(f.get('itl_p99'), '{:.3f}')} | {_fmt(f.get('cached_token_ratio'))} "
            f"| {_fmt(f.get('quiet_ttft_p99'), '{:.3f}')} | {f.get('errors', '-')} "
            f"| {'/'.join(f'{v:.2f}' for v in f.get('host_probe_s') or []) or '-'} "
            f"| {during_cell(f.get('host_during'))} |"
        )
    lines += breakdown_table(res)
    lines += ["", "![median ratios](heatmap.png)", ""]
    (out / "report.md").write_text("\n".join(lines))
    heatmap(res, out / "heatmap.png", metrics)
    return [out / "report.md", out / "heatmap.png"]


def during_cell(d: Mapping[str, Any] | None) -> str:
    """A run's :class:`RunProbe` figures in the report's row: ``hash/copy ms median (max),
    steal s``; ``-`` for a run without them (before the probe, or a stand-in)."""
    if not d or not d.get("hash_ms") or not d.get("copy_ms"):
        return "-"
    (h50, hmax), (c50, cmax) = d["hash_ms"], d["copy_ms"]
    steal = d.get("steal_s")
    return f"{h50:.0f}/{c50:.0f} ({hmax:.0f}/{cmax:.0f})" + (
        "" if steal is None else f", {steal:.1f} s"
    )


def uneven_hosts(res: Mapping[str, Any], tolerance: float = 0.15) -> str:
    """The repeats where the systems' :class:`RunProbe` medians (hash or copy) differ by more
    than ``tolerance``: their ratios compare two hosts as much as two systems. As
    ``cell #repeat (system kind Nx system)``, slowest over fastest, comma-separated; empty
    when none (runs without the probe are not judged)."""
    out = []
    for name, c in res["cells"].items():
        for rep, figs in sorted(figures_by_repeat(c.get("runs") or []).items()):
            sides = {
                system: d
                for system, f in figs.items()
                if (d := f.get("host_during")) and d.get("hash_ms") and d.get("copy_ms")
            }
            if len(sides) < 2:
                continue
            spreads = []
            for kind in ("hash_ms", "copy_ms"):
                ranked = sorted((d[kind][0], system) for system, d in sides.items())
                (fast_ms, fast), (slow_ms, slow) = ranked[0], ranked[-1]
                spreads.append((slow_ms / fast_ms, slow, kind.split("_")[0], fast))
            x, slow, kind, fast = max(spreads)
            if x > 1 + tolerance:
                out.append(f"{name} #{rep + 1} ({slow} {kind} {x:.2f}x {fast})")
    return ", ".join(out)


def drifted_rates(res: Mapping[str, Any], tolerance: float = 0.10) -> str:
    """The open cells whose rate was drawn from a capacity (``rate / load factor``) more
    than ``tolerance`` off the one the matrix holds now for their closed cell, as
    ``cell drawn X (now Y, Zx)``, comma-separated; empty when none."""
    out = []
    for name, c in res["cells"].items():
        cell = Cell(*name.split("/"))
        rate, now = c.get("rate_rps"), res["capacity_rps"].get(cell.capacity_cell.name)
        if cell.load_factor is None or not rate or not now:
            continue
        drawn = rate / cell.load_factor
        if abs(drawn / now - 1) > tolerance:
            out.append(f"{name} drawn at {drawn:.3f} (now {now:.3f}, {drawn / now:.2f}x)")
    return ", ".join(out)


def runs_left_line(res: Mapping[str, Any]) -> str:
    """How many runs the whole matrix still lacks at ``res``'s repeats, and about how long
    they take at the median time of the runs so far that recorded one (``run_s``: a fresh
    head, the deploy, the replay and the teardown). The estimate is rough: an open cell at
    0.5x runs about twice as long as one at 0.9x, and the runs so far are mostly not those."""
    systems, reps = list(res["systems"]), int(res["repeats"])
    left = 0
    for cell in all_cells():
        have = _measured((res["cells"].get(cell.name) or {}).get("runs") or [])
        left += sum(1 for rep in range(reps) for s in systems if (rep, s) not in have)
    timed = [float(r["run_s"]) for r in _every_run(res) if r.get("run_s") is not None]
    line = (
        f"- runs left for all {len(all_cells())} cells at {reps} "
        f"repeat{'s' if reps != 1 else ''}: {left}"
    )
    if left and timed:
        per = statistics.median(timed)
        line += (
            f"; about {left * per / 3600:.1f} h at the median run so far "
            f"({per / 60:.1f} min, of {len(timed)} runs with their time recorded)"
        )
    return line


def breakdown_table(res: Mapping[str, Any]) -> list[str]:
    """The report's "Where the time goes" section: per cell and system, the medians over the
    repeats of each run's :func:`breakdown` (none when no run has one)."""
    rows = []
    for name, c in res["cells"].items():
        for system in res["systems"]:
            bs = [
                r["figures"]["breakdown"]
                for r in c.get("runs") or []
                if r["system"] == system and (r.get("figures") or {}).get("breakdown")
            ]
            if not bs:
                continue

            def med(key: str, bs: list[dict[str, Any]] = bs) -> float | None:
                return spread([b[key] for b in bs if b.get(key) is not None])["median"]

            def ms(key: str) -> str:
                v = med(key)
                return _fmt(None if v is None else 1e3 * v, "{:.0f}")

            def role(r: str, bs: list[dict[str, Any]] = bs) -> float | None:
                xs = [b["cpu_s_by_role"][r] for b in bs if b.get("cpu_s_by_role")]
                return spread(xs)["median"]

            cells = [
                ms("ttft_mean_s"),
                ms("overhead_to_first_s"),
                ms("prefill_engine_s"),
                ms("decode_first_engine_s"),
                *(_fmt(role(r), "{:.0f}") for r in CPU_ROLES),
                _fmt(med("cpu_s_per_request"), "{:.2f}"),
            ]
            rows.append(f"| {name} | {system} | {len(bs)} | " + " | ".join(cells) + " |")
    if not rows:
        return []
    return [
        "",
        "## Where the time goes",
        "",
        "Medians over the repeats. TTFT mean and, for pdserve, its parts from one ingress "
        "replica's phase means: the ingress's overhead before the first token, the prefill "
        "engine's time and the decode engine's time to its first chunk (each engine's "
        "queueing included). CPU: seconds the system's processes spent over the replay, by "
        "role (pdserve's engines run inside their replicas; the peer's in `VLLM::` "
        "processes of either role).",
        "",
        "| cell | system | runs | TTFT mean ms | overhead to first ms | prefill engine ms "
        "| decode first engine ms | CPU s: " + " | ".join(CPU_ROLES) + " | CPU s per request |",
        "|---|---|---|---|---|---|---|" + "---|" * len(CPU_ROLES) + "---|",
        *rows,
    ]


def heatmap(res: Mapping[str, Any], path: Path, metrics: Sequence[str]) -> Path:
    """Cells x metrics of the median ratios on a diverging colormap centred on 1.0 (log
    scale, so 0.5x and 2x are equally far from 1), each square annotated with its value;
    blank where there is no ratio."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    names = list(res["cells"])
    grid = []
    for n in names:
        r = main_ratios(res["cells"][n])
        grid.append(
            [
                math.nan if (r.get(m) or {}).get("median") is None else r[m]["median"]
                for m in metrics
            ]
        )
    finite = [v for row in grid for v in row if v == v and v > 0]
    span = max([2.0] + [max(v, 1 / v) for v in finite])
    fig, ax = plt.subplots(figsize=(1.6 * len(metrics) + 3, 0.45 * max(1, len(names)) + 1.8))
    im = ax.imshow(
        [[v if v == v and v > 0 else math.nan for v in row] for row in grid] or [[math.nan]],
        cmap="RdBu_r",
        norm=LogNorm(vmin=1 / span, vmax=span),
        aspect="auto",
    )
    ax.set_xticks(range(len(metrics)), metrics, rotation=30, ha="right")
    ax.set_yticks(range(len(names)), names)
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            d = 3 if metrics[j] == "served" else 2
            ax.text(j, i, "-" if v != v else f"{v:.{d}f}", ha="center", va="center", fontsize=8)
    cb = fig.colorbar(im, ax=ax, label=f"pdserve / {res['reference']} (median)")
    ticks = [t for t in (0.25, 0.5, 0.7, 1.0, 1.4, 2.0, 4.0) if 1 / span <= t <= span]
    cb.set_ticks(ticks, labels=[f"{t:g}" for t in ticks])
    cb.minorticks_off()
    ax.set_title("median ratios (throughput, cached: higher is better; latencies: lower)")
    fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")  # the colour bar's label whole
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------
# The live pieces (not unit-tested: they start Ray and vLLM)


#: the host probe's work: SHA-256 over this many MiB on one thread (under a second here)
PROBE_MIB = 256


def host_probe(mib: int = PROBE_MIB) -> float:
    """Wall seconds to hash ``mib`` MiB with SHA-256 on one thread: the same work every time,
    so a longer probe is a slower or busier host (see the module docstring)."""
    t0 = time.perf_counter()
    _sha256_mib(mib)
    return time.perf_counter() - t0


def _sha256_mib(mib: int, block: bytes = bytes(2**20)) -> None:
    """SHA-256 over ``mib`` MiB of zeros: the fixed work both host probes time."""
    h = hashlib.sha256()
    for _ in range(mib):
        h.update(block)


#: the during-run probe's work, each round: SHA-256 over this many MiB (compute) and a copy of
#: this many MiB (memory bandwidth), timed in the probing thread's own CPU seconds
DURING_HASH_MIB, DURING_COPY_MIB = 16, 32


def probe_figures(rounds: Sequence[tuple[float, float]], steal_s: float | None) -> dict[str, Any]:
    """What :class:`RunProbe` reports of its rounds (``(hash_s, copy_s)`` CPU seconds each):
    per kind the median and the max in ms, the number of rounds, and the host's steal time
    over the run (None where ``/proc/stat`` has none)."""
    out: dict[str, Any] = {"rounds": len(rounds), "steal_s": steal_s}
    for i, kind in enumerate(("hash_ms", "copy_ms")):
        xs = [r[i] * 1e3 for r in rounds]
        out[kind] = [statistics.median(xs), max(xs)] if xs else None
    return out


def _steal_s() -> float | None:
    """The host's steal time so far, in seconds (``/proc/stat``'s eighth CPU column, in the
    kernel's 100 Hz ticks); None where it cannot be read."""
    try:
        cols = Path("/proc/stat").read_text().split("\n", 1)[0].split()
        return int(cols[8]) / 100.0
    except (OSError, IndexError, ValueError):
        return None


class RunProbe:
    """Fixed work timed all through a run, on a thread of the bench's process: every
    ``interval_s`` one round of SHA-256 over :data:`DURING_HASH_MIB` MiB and one copy of
    :data:`DURING_COPY_MIB` MiB, each timed in the thread's own CPU seconds
    (``time.thread_time``). CPU time, not wall time: a host that is only busy leaves it
    unchanged (the thread waits, unclocked), a slower one (its clock, a sibling hyperthread,
    a neighbour sharing its caches or memory) raises it. :func:`host_probe` brackets a run;
    this sees inside it, where a run of issue 39 spent 1.3-1.5x the CPU per second of its
    repeats on the same work while both brackets read normal. A round costs about 15 ms of one core here."""

    def __init__(self, interval_s: float = 10.0) -> None:
        import threading

        self.interval_s = interval_s
        self.rounds: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="run-probe", daemon=True)
        self._steal0: float | None = None
        self._steal_s: float | None = None

    def _loop(self) -> None:
        src, dst = bytearray(DURING_COPY_MIB * 2**20), bytearray(DURING_COPY_MIB * 2**20)
        dst[:] = src  # fault both buffers' pages in once, outside the timed rounds
        while True:
            t0 = time.thread_time()
            _sha256_mib(DURING_HASH_MIB)
            t1 = time.thread_time()
            dst[:] = src  # one copy of the whole buffer
            self.rounds.append((t1 - t0, time.thread_time() - t1))
            if self._stop.wait(self.interval_s):
                return

    def __enter__(self) -> RunProbe:
        self._steal0 = _steal_s()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        end = _steal_s()
        self._steal_s = None if end is None or self._steal0 is None else end - self._steal0

    def figures(self) -> dict[str, Any]:
        return probe_figures(self.rounds, self._steal_s)


def live_requests(
    base: Mapping[str, Any], *, vocab: int, max_tokens: int, limit: int | None, tokenizer: Any
) -> tuple[BuildRequests, CachePressure]:
    """The builder of the cells' requests on ``base``'s model (text prompts, as
    :mod:`bench.live.compare` sends both systems), and the ``cache_pressure`` sizing derived
    from the base config's prefill KV cache and the model's shape."""
    from bench.live.compare import as_text
    from deployments.config import load_app_config

    cfg = load_app_config(base["applications"][0].get("args") or {})
    shape = json.loads((cfg.model.resolved_path() / "config.json").read_text())
    head_dim = shape.get("head_dim") or shape["hidden_size"] // shape["num_attention_heads"]
    dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}.get(str(cfg.model.dtype), 4)
    per_token = kv_bytes_per_token(
        shape["num_hidden_layers"], shape["num_key_value_heads"], head_dim, dtype_bytes
    )
    pressure = cache_pressure_mix(
        cfg.prefill.kv_cache_gib * 2**30,
        per_token,
        prefill_replicas=LAYOUTS["two_prefill"][0],
        block_size=cfg.hashing.block_size,
    )
    room = cfg.model.max_model_len - max_tokens - 1

    def build(cell: Cell, rate: float | None, seed: int) -> list[LiveRequest]:
        reqs = workload_requests(
            cell, rate, seed, vocab=vocab, max_tokens=max_tokens, limit=limit,
            pressure=pressure, max_prompt_tokens=room,
        )  # fmt: skip
        return as_text(reqs, tokenizer)

    return build, pressure


def live_runner(model: str, progress: bool = True) -> RunSystem:
    """The per-system run: :func:`bench.live.compare.measure` (a fresh Ray head, deploy,
    replay, tear down). ``multi_tenant`` cells give pdserve two tenant keys (fresh each run,
    only their hashes in the config) and its fair share (:func:`tenant_config`); the peer
    gets the same requests without keys; an operator key, fresh too, reads pdserve's stats."""
    from bench.live.compare import SYSTEMS, measure, pdserve_config, peer_config
    from cluster.tenants import hash_key, new_key

    def run(
        system: str,
        cell: Cell,
        config: dict[str, Any],
        reqs: list[LiveRequest],
        concurrency: int | None,
        out: Path,
    ) -> dict[str, Any]:
        sys_ = SYSTEMS[system]
        probe_key = operator = None
        if sys_.kind == "pdserve":
            cfg = pdserve_config(config, sys_)
            if cell.workload == "multi_tenant":
                keys = {t: new_key() for t in ("quiet", "flood")}
                operator = new_key()
                cfg = tenant_config(
                    cfg,
                    {hash_key(k): t for t, k in keys.items()},
                    [hash_key(operator)],
                    fair_share=sys_.fair_share,
                )
                reqs, probe_key = with_keys(reqs, keys), keys["quiet"]
        else:
            cfg = peer_config(config, sys_)
            reqs = with_keys(reqs, None)
        out.mkdir(parents=True, exist_ok=True)
        probe = [host_probe()]
        with RunProbe() as during:
            m = measure(
                system, sys_, cfg, reqs, out, model=model, concurrency=concurrency,
                progress=progress, key=probe_key, operator_key=operator,
            )  # fmt: skip
        quiet = [
            res.ttft_s
            for req, res in zip(reqs, m.results, strict=False)
            if req.label == "tenant:quiet" and res.ok and res.ttft_s is not None
        ]
        f = figures(m.summary, quiet if cell.workload == "multi_tenant" else None)
        f["breakdown"] = breakdown(m.summary, m.stats)
        f["deploy_to_first_token_s"] = m.deploy_to_first_token_s
        f["rss_peak_bytes"] = m.rss_peak_bytes
        f["host_probe_s"] = [*probe, host_probe()]  # before and after the run
        f["host_during"] = during.figures()  # and all through it
        return f

    return run


def code_version() -> str | None:
    """The checkout's commit (short), ``+dirty`` when tracked files differ from it; None
    outside a git checkout. Written into each run's record (``run_matrix``'s ``code``)."""
    import subprocess

    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, check=True, timeout=10,
        ).stdout.strip()  # fmt: skip
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, check=True, timeout=10,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "") if head else None
