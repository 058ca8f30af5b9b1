"""``pdserve`` console script: imports every command module, then runs the app."""

from __future__ import annotations

import importlib
import pkgutil

import pdserve.commands
from pdserve.apps import app


def _load_commands() -> None:
    for mod in sorted(pkgutil.iter_modules(pdserve.commands.__path__), key=lambda m: m.name):
        importlib.import_module(f"pdserve.commands.{mod.name}")


def main() -> None:
    _load_commands()
    app()


_load_commands()
