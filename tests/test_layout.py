"""Each package comes from this project, and the pure layer imports nothing heavy."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["controllers", "engines", "cluster", "deployments", "bench", "pdserve"]


@pytest.mark.parametrize("pkg", PACKAGES)
def test_package_is_this_projects(pkg: str) -> None:
    mod = importlib.import_module(pkg)
    assert Path(mod.__file__).resolve().parent == ROOT / pkg  # type: ignore[arg-type]


ALLOWED_IN_CONTROLLERS = {"numpy", "pydantic", "controllers", "__future__"}


def test_controllers_import_only_stdlib_numpy_pydantic() -> None:
    import sys

    stdlib = set(sys.stdlib_module_names)
    bad = []
    for path in (ROOT / "controllers").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                if top not in stdlib and top not in ALLOWED_IN_CONTROLLERS:
                    bad.append(f"{path.relative_to(ROOT)}: {name}")
    assert not bad, bad


# DESIGN.md's layer table: which of the project's packages each package may import.
MAY_IMPORT = {
    "controllers": {"controllers"},
    "engines": {"controllers", "engines"},
    "cluster": {"controllers", "cluster"},
    "deployments": {"controllers", "engines", "cluster", "deployments"},
    # bench also measures the running app (``pdserve bench pd``) over its wire protocol;
    # deployments never imports bench, so there is no cycle.
    "bench": {"controllers", "engines", "cluster", "deployments", "bench"},
}


@pytest.mark.parametrize("pkg", list(MAY_IMPORT))
def test_imports_point_down_only(pkg: str) -> None:
    bad = []
    for path in (ROOT / pkg).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                if top in PACKAGES and top not in MAY_IMPORT[pkg]:
                    bad.append(f"{path.relative_to(ROOT)}: {name}")
    assert not bad, bad
