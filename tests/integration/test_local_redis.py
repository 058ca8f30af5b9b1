"""``pdserve up`` starts a detached redis-server for a config whose index points at this
machine when none answers there, leaves a running one alone, and ``down`` stops what it
started (real redis-server)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from cluster.redis_server import free_port, ping
from pdserve.commands.serve_app import _ensure_local_redis, _redis_dir, _stop_local_redis

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="no redis-server"),
]


def test_up_starts_a_local_redis_only_when_needed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    assert not ping(port)
    _ensure_local_redis(url, _redis_dir())
    try:
        assert ping(port)
        assert (_redis_dir() / f"redis-{port}.pid").exists()
        _ensure_local_redis(url, _redis_dir())  # one answers: nothing more is started
        assert len(list(_redis_dir().glob("redis-*.pid"))) == 1
        # a remote Redis is the operator's: nothing is started for it
        _ensure_local_redis("redis://redis.example:6379/0", _redis_dir())
        assert len(list(_redis_dir().glob("redis-*.pid"))) == 1
    finally:
        _stop_local_redis()
    assert not list(_redis_dir().glob("redis-*.pid"))
    for _ in range(100):  # the server exits on SIGTERM; bounded wait for its port to close
        if not ping(port):
            break
        time.sleep(0.05)
    assert not ping(port)


def test_up_starts_its_redis_closed_with_the_configs_users(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``index.redis_users`` (configs/pd_cluster.yaml), ``up`` makes the password files
    (mode 0600) and starts Redis on loopback with those users only, bounded in memory: a client
    without a password is refused, each role's user gets in."""
    import redis

    from cluster.redis_auth import read_password
    from deployments.config import RedisUsers

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    users = RedisUsers.model_validate(
        {
            role: {"username": role, "password_file": str(tmp_path / "users" / f"{role}.pw")}
            for role in ("ingress", "prefill")
        }
    )
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    _ensure_local_redis(url, _redis_dir(), users)
    try:
        assert ping(port)  # it answers (asking for a password)
        for role in ("ingress", "prefill"):
            f = tmp_path / "users" / f"{role}.pw"
            assert f.stat().st_mode & 0o777 == 0o600
            r = redis.Redis.from_url(url, username=role, password=read_password(f))
            assert r.ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(url).get("x")
        admin = redis.Redis.from_url(
            url, username="admin", password=read_password(tmp_path / "users" / "admin.password")
        )
        assert admin.config_get("maxmemory-policy") == {"maxmemory-policy": "volatile-lru"}
        assert admin.config_get("bind")["bind"] == "127.0.0.1"
    finally:
        _stop_local_redis()
