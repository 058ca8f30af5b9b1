"""Root conftest: loads every fixture plugin in tests/fixtures/ (one module per shared
resource: the vLLM engine, Redis, the Ray cluster), so each resource is started at most
once per test session and areas do not edit one shared file."""

from __future__ import annotations

from pathlib import Path

pytest_plugins = sorted(
    f"tests.fixtures.{p.stem}"
    for p in (Path(__file__).parent / "fixtures").glob("*.py")
    if p.stem != "__init__"
)
