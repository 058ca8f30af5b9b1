"""Small helpers shared by commands: comma lists, JSON writing, plain tables."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import typer

N = TypeVar("N", int, float)


def csv_list(value: str, param_hint: str | None = None) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    if not items:
        raise typer.BadParameter("expected a comma-separated list", param_hint=param_hint)
    return items


def csv_known(value: str, known: Sequence[str], what: str, param_hint: str) -> list[str]:
    """A comma list whose every item must be one of ``known``; the error lists them."""
    items = csv_list(value)
    unknown = [v for v in items if v not in known]
    if unknown:
        raise typer.BadParameter(
            f"unknown {what} {unknown}; known: {list(known)}", param_hint=param_hint
        )
    return items


def csv_numbers(
    value: str,
    kind: Callable[[str], N],
    what: str = "values",
    param_hint: str | None = None,
) -> list[N]:
    """Comma-separated non-negative numbers of ``kind`` (``int`` or ``float``); errors name
    ``param_hint`` (the option) when given."""
    try:
        out = [kind(v) for v in csv_list(value, param_hint)]
    except ValueError:
        noun = "integers" if kind is int else "numbers"
        raise typer.BadParameter(
            f"expected comma-separated {noun}, got {value!r}", param_hint=param_hint
        ) from None
    if any(v < 0 for v in out):
        raise typer.BadParameter(f"{what} must be >= 0", param_hint=param_hint)
    return out


def csv_ints(value: str, param_hint: str | None = None) -> list[int]:
    return csv_numbers(value, int, param_hint=param_hint)


def write_json(path: Path | None, data: Any) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    typer.echo(f"wrote {path}")


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = [
        "  ".join(
            c.rjust(w) if j else c.ljust(w) for j, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(c: Any) -> str:
    if isinstance(c, float):
        return f"{c:.4g}"
    return str(c)
