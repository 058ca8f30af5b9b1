"""The allocator a local Ray head starts its processes on (``deployments.local``), and
``pdserve up --allocator``'s errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from deployments.local import ray_jemalloc, with_allocator


def test_jemalloc_is_rays_own_build_and_goes_first_in_ld_preload() -> None:
    lib = ray_jemalloc()
    assert lib.name == "libjemalloc.so" and lib.parent.name == "core" and lib.is_file()
    assert with_allocator({"A": "1"}, "jemalloc") == {"A": "1", "LD_PRELOAD": str(lib)}
    env = with_allocator({"LD_PRELOAD": "/x/libiomp5.so"}, "jemalloc")
    assert env["LD_PRELOAD"] == f"{lib}:/x/libiomp5.so"


def test_system_and_a_jemalloc_already_preloaded_leave_the_environment_alone() -> None:
    assert with_allocator({"LD_PRELOAD": "/x/libiomp5.so"}, "system") == {
        "LD_PRELOAD": "/x/libiomp5.so"
    }
    mine = {"LD_PRELOAD": "/opt/lib/libjemalloc.so.2"}
    assert with_allocator(mine, "jemalloc") == mine
    src = {"B": "2"}
    with_allocator(src, "jemalloc")
    assert src == {"B": "2"}  # a copy: the caller's environment is not changed


def test_an_unknown_allocator_names_the_choices() -> None:
    with pytest.raises(ValueError, match="jemalloc, system.*'tcmalloc'"):
        with_allocator({}, "tcmalloc")


def test_a_ray_without_jemalloc_says_so_and_names_the_way_out(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import importlib.util

    fake = importlib.util.spec_from_loader("ray", loader=None, is_package=True)
    assert fake is not None
    fake.submodule_search_locations = [str(tmp_path)]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: fake)
    with pytest.raises(FileNotFoundError, match="--allocator system"):
        with_allocator({}, "jemalloc")


def test_pdserve_up_rejects_an_unknown_allocator_before_starting_anything() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "pdserve", "up", "--allocator", "tcmalloc"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr
    assert "--allocator" in r.stderr and "jemalloc, system" in r.stderr
