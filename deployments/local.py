"""What a local Ray head and Serve's CLI need when started from this project's tools
(``pdserve up`` / ``down``, ``pdserve bench compare``): their environment and console scripts."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def local_env() -> dict[str, str]:
    """This environment, with Ray's auth and usage stats off and Hugging Face offline unless
    already set."""
    env = dict(os.environ)
    env.setdefault("RAY_AUTH_MODE", "disabled")
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    return env


def venv_bin(name: str) -> str:
    """The console script ``name`` next to this Python (the project's venv), else ``name``."""
    cand = Path(sys.executable).parent / name
    return str(cand) if cand.exists() else name
