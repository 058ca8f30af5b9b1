"""A closed Ray cluster: the suite's cluster runs Ray's token authentication, as ``pdserve
up`` starts a head; a driver without the token, or with another, is refused while the app
serves (real Ray)."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.integration]

CONNECT = (
    "import sys, ray\n"
    "try:\n"
    "    ray.init(address=sys.argv[1], log_to_driver=False)\n"
    "except Exception as e:\n"
    "    print('REFUSED', type(e).__name__); sys.exit(3)\n"
    "print('CONNECTED', int(ray.cluster_resources().get('CPU', 0)))\n"
)


def _connect(address: str, **env: str | None) -> subprocess.CompletedProcess[str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    e.update({k: v for k, v in env.items() if v is not None})
    return subprocess.run(
        [sys.executable, "-c", CONNECT, address], env=e, capture_output=True, text=True,
        timeout=180,
    )  # fmt: skip


def test_a_driver_without_the_clusters_token_is_refused(ray_cluster: dict[str, Any]) -> None:
    address = ray_cluster["address"]
    ok = _connect(address, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=ray_cluster["token_path"])
    assert ok.returncode == 0 and "CONNECTED 8" in ok.stdout, ok.stderr[-2000:]
    wrong = _connect(address, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="not-the-token")
    assert wrong.returncode == 3 and "REFUSED" in wrong.stdout, wrong.stdout + wrong.stderr[-800:]
    none = _connect(address, RAY_AUTH_MODE="disabled")
    assert none.returncode == 3 and "REFUSED" in none.stdout, none.stdout + none.stderr[-800:]
