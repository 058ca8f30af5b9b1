"""Trace loaders: Mooncake (JSONL with prefix-block hash ids) and Azure LLM inference (CSV).

Both return a list of :class:`TraceRequest`, sorted by arrival, with arrival times in
seconds relative to the first request of the trace (the first request arrives at 0.0).

Formats
-------
Mooncake (``kvcache-ai/Mooncake``, FAST'25 release): one JSON object per line with
``timestamp`` (ms, relative), ``input_length`` and ``output_length`` (tokens) and
``hash_ids`` (remapped hashes of 512-token prefix blocks; equal ids are reusable KV blocks,
``len(hash_ids) == ceil(input_length / 512)``). The timestamps have 1 ms resolution and a
few requests share one; with ``spread_ties=True`` (default) requests that share a
timestamp are spread evenly over the gap to the next distinct timestamp, so a simulator
does not see artificial simultaneous arrivals.

Azure LLM inference 2023 (``Azure/AzurePublicDataset``): CSV with ``TIMESTAMP`` (wall
clock, up to 7 fractional digits), ``ContextTokens``, ``GeneratedTokens``. It carries
lengths only, no content: records have ``hash_ids == ()`` and must be replayed as
cache-free.

Bad input gives a :class:`TraceFormatError` naming the file, line and field.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

MOONCAKE_BLOCK_TOKENS = 512
"""Tokens per hash id in Mooncake traces."""


class TraceFormatError(ValueError):
    """A trace file does not match its format; the message names file, line and field."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace.

    ``arrival_s``: seconds since the trace's first arrival (>= 0). ``input_tokens`` /
    ``output_tokens``: prompt and generated lengths in tokens. ``hash_ids``: prefix-block
    ids (Mooncake: one per 512-token block, the last block may be partial; empty when the
    trace carries no content, as Azure's).
    """

    arrival_s: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()


def _int_field(obj: dict[str, object], key: str, where: str, minimum: int = 0) -> int:
    if key not in obj:
        raise TraceFormatError(f"{where}: missing field {key!r}")
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, int | float) or int(v) != v or v < minimum:
        raise TraceFormatError(f"{where}: field {key!r} must be an integer >= {minimum}, got {v!r}")
    return int(v)


def _iter_jsonl(path: Path) -> Iterator[tuple[int, dict[str, object]]]:
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceFormatError(f"{path}:{lineno}: not JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise TraceFormatError(f"{path}:{lineno}: expected a JSON object")
            yield lineno, obj


def _spread(times: list[float]) -> list[float]:
    """Spread runs of equal times evenly over the gap to the next distinct time."""
    out = list(times)
    n = len(times)
    i = 0
    while i < n:
        j = i
        while j + 1 < n and times[j + 1] == times[i]:
            j += 1
        if j > i:
            nxt = times[j + 1] if j + 1 < n else times[i] + 1e-3
            gap = (nxt - times[i]) / (j - i + 1)
            for k in range(i, j + 1):
                out[k] = times[i] + gap * (k - i)
        i = j + 1
    return out


def load_mooncake(
    path: str | Path, *, limit: int | None = None, spread_ties: bool = True
) -> list[TraceRequest]:
    """Load a Mooncake-format JSONL trace (see the module docstring).

    ``limit`` keeps the first ``limit`` requests by arrival. Arrival times are shifted so
    the first request arrives at 0.0 s.
    """
    p = Path(path)
    rows: list[tuple[float, int, int, tuple[int, ...]]] = []
    for lineno, obj in _iter_jsonl(p):
        where = f"{p}:{lineno}"
        ts = obj.get("timestamp")
        if isinstance(ts, bool) or not isinstance(ts, int | float) or ts < 0:
            raise TraceFormatError(f"{where}: field 'timestamp' must be a number >= 0, got {ts!r}")
        inp = _int_field(obj, "input_length", where, minimum=1)
        out = _int_field(obj, "output_length", where)
        ids = obj.get("hash_ids", [])
        if not isinstance(ids, list) or not all(
            isinstance(h, int) and not isinstance(h, bool) for h in ids
        ):
            raise TraceFormatError(f"{where}: field 'hash_ids' must be a list of integers")
        rows.append((float(ts) / 1000.0, inp, out, tuple(ids)))
    rows.sort(key=lambda r: r[0])  # stable: file order among equal timestamps
    if limit is not None:
        rows = rows[:limit]
    if not rows:
        return []
    t0 = rows[0][0]
    times = [r[0] - t0 for r in rows]
    if spread_ties:
        times = _spread(times)
    return [TraceRequest(t, r[1], r[2], r[3]) for t, r in zip(times, rows, strict=True)]


def _parse_azure_time(s: str) -> datetime:
    s = s.strip()
    if "." in s:  # Python parses at most 6 fractional digits; the trace has 7
        head, frac = s.split(".", 1)
        s = f"{head}.{frac[:6]}"
    return datetime.fromisoformat(s)


def load_azure(path: str | Path, *, limit: int | None = None) -> list[TraceRequest]:
    """Load an Azure LLM inference trace CSV (2023 format; see the module docstring).

    Records carry no hash ids: replay them as cache-free.
    """
    p = Path(path)
    rows: list[tuple[datetime, int, int]] = []
    with p.open(encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        need = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
        missing = [k for k in need if k not in (reader.fieldnames or [])]
        if missing:
            raise TraceFormatError(f"{p}: missing column(s) {missing}; found {reader.fieldnames}")
        for lineno, row in enumerate(reader, 2):
            where = f"{p}:{lineno}"
            try:
                ts = _parse_azure_time(row["TIMESTAMP"])
            except ValueError:
                raise TraceFormatError(
                    f"{where}: field 'TIMESTAMP' is not a timestamp: {row['TIMESTAMP']!r}"
                ) from None
            vals = []
            for key, minimum in (("ContextTokens", 1), ("GeneratedTokens", 0)):
                try:
                    v = int(row[key])
                except (TypeError, ValueError):
                    raise TraceFormatError(
                        f"{where}: field {key!r} must be an integer, got {row[key]!r}"
                    ) from None
                if v < minimum:
                    raise TraceFormatError(f"{where}: field {key!r} must be >= {minimum}, got {v}")
                vals.append(v)
            rows.append((ts, vals[0], vals[1]))
    rows.sort(key=lambda r: r[0])
    if limit is not None:
        rows = rows[:limit]
    if not rows:
        return []
    t0 = rows[0][0]
    return [TraceRequest((r[0] - t0).total_seconds(), r[1], r[2]) for r in rows]


def scale_arrivals(reqs: list[TraceRequest], factor: float) -> list[TraceRequest]:
    """Arrival times multiplied by ``factor`` (``factor < 1`` compresses: higher load)."""
    if factor <= 0:
        raise ValueError(f"scale_arrivals: factor must be > 0, got {factor}")
    return [
        TraceRequest(r.arrival_s * factor, r.input_tokens, r.output_tokens, r.hash_ids)
        for r in reqs
    ]
