"""Option groups shared by several commands, each built from the one definition of its
parameters."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable
from typing import Any, TypeVar

import typer

from bench.workloads.replay import ReplayWorkload

F = TypeVar("F", bound=Callable[..., Any])

#: Where ``--help`` lists the replay workload's options.
REPLAY_PANEL = "Replay workload"


def replay_options(**overrides: dict[str, Any]) -> Callable[[F], F]:
    """A Typer command decorator: every field of :class:`ReplayWorkload` becomes an option
    (``--trace``, ``--trace-format``, ``--scenario``, ``--limit``, ``--time-scale``,
    ``--length-scale``, ``--concurrency``, ``--rate``, ``--max-tokens``, ``--vocab``,
    ``--seed``; help and bounds from the field's metadata), and the command receives them as
    one ``workload: ReplayWorkload`` argument. ``overrides`` maps a field to what this
    command changes of its option (``default``, ``help``)."""
    fields = dataclasses.fields(ReplayWorkload)
    field_hints = typing.get_type_hints(ReplayWorkload)
    unknown = set(overrides) - {f.name for f in fields}
    if unknown:
        raise ValueError(f"no ReplayWorkload fields {sorted(unknown)}")

    def decorate(fn: F) -> F:
        hints = typing.get_type_hints(fn)
        own = [
            p.replace(annotation=hints.get(p.name, p.annotation))
            for p in inspect.signature(fn).parameters.values()
            if p.name != "workload"
        ]
        added = []
        for f in fields:
            meta = {**f.metadata, **overrides.get(f.name, {})}
            default = meta.pop("default", f.default)
            option = typer.Option(default, rich_help_panel=REPLAY_PANEL, **meta)
            added.append(
                inspect.Parameter(
                    f.name,
                    inspect.Parameter.KEYWORD_ONLY,
                    default=option,
                    annotation=field_hints[f.name],
                )
            )

        @functools.wraps(fn)
        def command(*args: Any, **kwargs: Any) -> Any:
            workload = ReplayWorkload(**{f.name: kwargs.pop(f.name) for f in fields})
            return fn(*args, workload=workload, **kwargs)

        params = own + added
        command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in params}
        return typing.cast(F, command)

    return decorate
