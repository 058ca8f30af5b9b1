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


# docs/design.md's layer table: which of the project's packages each package may import.
MAY_IMPORT = {
    "controllers": {"controllers"},
    "engines": {"controllers", "engines"},
    "cluster": {"controllers", "cluster"},
    "deployments": {"controllers", "engines", "cluster", "deployments"},
    # bench reaches the app over HTTP, or through the spec modules of deployments
    # (BENCH_MAY_IMPORT_FROM_DEPLOYMENTS, checked below), never its Serve deployments.
    "bench": {"controllers", "engines", "cluster", "deployments", "bench"},
    # the CLI is the top: it wires every layer together (e.g. hands bench the app's builder).
    "pdserve": {"controllers", "engines", "cluster", "deployments", "bench", "pdserve"},
    # one-off tools beside the CLI, over the library: everything but the CLI itself.
    "scripts": {"controllers", "engines", "cluster", "deployments", "bench"},
}
#: Top-level names of the project's code (scripts/ is no package, but nothing may import it).
PROJECT = {*PACKAGES, "scripts"}

#: The modules of deployments that bench may import, and why: the app's specification that
#: both sides share. Each is free of Ray, Serve and FastAPI and of the rest of deployments
#: (test_the_spec_bench_may_import_has_no_serve_in_it).
BENCH_MAY_IMPORT_FROM_DEPLOYMENTS = {
    # the engine wire protocol: ``bench pd`` calls the engine replicas' handles with it
    "deployments.protocol",
    # the app's config (a Serve YAML's args) and the engine launch built from it: ``bench
    # compare`` gives the peer pdserve's own engines, ``bench routing`` reads replica counts
    "deployments.config",
    # the environment of a local Ray head (allocator, auth): ``bench compare`` starts heads
    # as ``pdserve up`` does
    "deployments.local",
    # local worker nodes with a role's resource: ``bench multinode`` joins them as ``pdserve
    # up --nodes`` does
    "deployments.local_nodes",
}
SERVING_STACK = {"ray", "fastapi", "starlette", "uvicorn"}


def _imported(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """The modules an import statement names, relative imports resolved against ``module``;
    ``from X import Y`` names ``X.Y`` as well as ``X`` (Y may be a module)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        anchor = module.split(".") if is_package else module.split(".")[:-1]
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join([*anchor, *([base] if base else [])])
    return [base, *(f"{base}.{a.name}" for a in node.names)]


def _imports(path: Path, module_level_only: bool = False) -> list[str]:
    """Every module ``path`` imports (``module_level_only``: those imported when the module
    is, i.e. not inside a function body nor under ``if TYPE_CHECKING:``, which never runs)."""
    module = _module_name(path)
    is_package = path.name == "__init__.py"
    out: list[str] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if module_level_only and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if module_level_only and _type_checking_only(child):
                continue
            out.extend(_imported(child, module, is_package))
            visit(child)

    visit(ast.parse(path.read_text()))
    return out


def _type_checking_only(node: ast.AST) -> bool:
    """``if TYPE_CHECKING:`` (annotations only: the imports under it never run)."""
    if not isinstance(node, ast.If):
        return False
    test = node.test
    name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", None)
    return name == "TYPE_CHECKING"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _within(name: str, modules: set[str]) -> bool:
    """``name`` is one of ``modules`` or inside one of them (a package's submodule)."""
    return any(name == m or name.startswith(m + ".") for m in modules)


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
                if top in PROJECT and top not in MAY_IMPORT[pkg]:
                    bad.append(f"{path.relative_to(ROOT)}: {name}")
    assert not bad, bad


def test_bench_reaches_the_app_only_through_its_spec() -> None:
    """No benchmark imports the app's deployments (ingress, replicas, routers, the Serve
    application): only the modules of BENCH_MAY_IMPORT_FROM_DEPLOYMENTS, anywhere in a file
    (function-local imports included)."""
    bad = []
    for path in (ROOT / "bench").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            for name in names:
                if name.split(".")[0] != "deployments":
                    continue
                if not _within(name, BENCH_MAY_IMPORT_FROM_DEPLOYMENTS):
                    bad.append(f"{path.relative_to(ROOT)}: {name}")
    assert not bad, bad


def _spec_files() -> list[Path]:
    files = []
    for mod in BENCH_MAY_IMPORT_FROM_DEPLOYMENTS:
        base = ROOT / Path(*mod.split("."))
        if base.with_suffix(".py").is_file():
            files.append(base.with_suffix(".py"))
        files += sorted(base.rglob("*.py")) if base.is_dir() else []
    return files


def test_the_spec_bench_may_import_has_no_serve_in_it() -> None:
    """Importing a spec module loads neither Ray, Serve nor FastAPI, nor any other module of
    deployments (imports at module level; a function may import what it runs)."""
    files = _spec_files()
    assert len(files) >= len(BENCH_MAY_IMPORT_FROM_DEPLOYMENTS), files
    bad = []
    for path in files:
        for name in _imports(path, module_level_only=True):
            top = name.split(".")[0]
            if top in SERVING_STACK or (
                top == "deployments"
                and name != "deployments"
                and not _within(name, BENCH_MAY_IMPORT_FROM_DEPLOYMENTS)
            ):
                bad.append(f"{path.relative_to(ROOT)}: {name}")
    assert not bad, bad


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as its modules in order (the first back to the start), or
    None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


@pytest.mark.parametrize("pkg", PACKAGES)
def test_no_import_cycle_inside_a_package(pkg: str) -> None:
    """The modules of a package import one another without a cycle. The graph has an edge
    ``a -> b`` when module ``a`` imports module ``b`` of the same package when ``a`` is
    imported (module level, including class bodies and ``if`` blocks); imports inside a
    function body are left out: they run later, once every module is loaded, which is how a
    module may call back into one that imports it; so are those under ``if TYPE_CHECKING:``
    (they name a type for annotations and never run)."""
    files = {_module_name(p): p for p in (ROOT / pkg).rglob("*.py")}
    graph = {
        mod: {n for n in _imports(path, module_level_only=True) if n in files and n != mod}
        for mod, path in files.items()
    }
    cycle = _cycle(graph)
    assert cycle is None, " -> ".join(cycle or [])
