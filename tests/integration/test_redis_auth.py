"""pdserve's Redis closed (cluster.redis_auth), on a real redis-server: a client without
credentials is refused; each role's user does its own work and nothing else (the ingress
reads the index and writes only the buckets, the prefill replicas write only the index), in
the app's own code paths (the index, the limiter, the key store); under memory pressure only
the index is evicted, never a bucket or a key; rediss:// with a generated certificate."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from cluster.index import IndexConfig
from cluster.redis_auth import new_passwords, read_password, redact, write_user_files
from cluster.redis_index import RedisPrefixIndex
from cluster.redis_server import RedisNotFound, secured_args, start_redis, stop_redis
from cluster.tenants import Charge, KeyStore, RateLimiter, hash_key, redis_keys_key
from controllers.tenants import Bucket

pytestmark = pytest.mark.integration


def creds(secured: dict[str, Any], role: str) -> dict[str, str]:
    user = secured["users"][role] if role != "admin" else None
    pw_file = user["password_file"] if user else str(secured["dir"] / "admin.password")
    return {"username": role, "password": read_password(pw_file)}


def index(secured: dict[str, Any], role: str, app: str, **kw: Any) -> RedisPrefixIndex:
    c = creds(secured, role)
    cfg = IndexConfig(backend="redis", redis_url=secured["url"], app=app, **c, **kw)
    return RedisPrefixIndex(cfg)


def test_a_client_without_the_right_credentials_is_refused(secured_redis: dict[str, Any]) -> None:
    url = secured_redis["url"]
    with pytest.raises(redis.AuthenticationError):  # NOAUTH: the default user is off
        redis.Redis.from_url(url).get("anything")
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(url, username="ingress", password="guess").ping()
    with pytest.raises(redis.AuthenticationError):  # the default user cannot log in at all
        redis.Redis.from_url(url, username="default", password="").ping()
    assert redis.Redis.from_url(url, **creds(secured_redis, "ingress")).ping()


def test_each_role_does_its_own_work_and_nothing_else(secured_redis: dict[str, Any]) -> None:
    app = "roles"
    admin = redis.Redis.from_url(secured_redis["url"], **creds(secured_redis, "admin"))

    async def main() -> None:
        writer = index(secured_redis, "prefill", app)
        reader = index(secured_redis, "ingress", app)
        try:
            await writer.register("P1")
            assert await writer.record("P1", list(range(1, 9)))
            assert await writer.heartbeat("P1")
            assert await reader.match(list(range(1, 9))) == {"P1": 8}
            with pytest.raises(redis.exceptions.NoPermissionError):
                await reader.register("EVIL")  # the ingress cannot write the index
            ing = aioredis.Redis.from_url(
                secured_redis["url"], decode_responses=True, **creds(secured_redis, "ingress")
            )
            lim = RateLimiter(ing, app)
            b = Bucket(1.0, 10.0)
            assert (await lim.admit("t", [Charge("tokens", b, 4.0)])).allowed
            await lim.charge("t", "tokens", b, 2.0)
            await lim.give_back("t", "tokens", b, 1.0)
            assert lim.stats.redis_fallbacks == 0  # all of it in Redis, as the ingress user
            admin.hset(redis_keys_key(app), hash_key("k-alice"), "alice")
            keys = KeyStore({}, redis=ing, app=app)
            assert await keys.tenant("k-alice") == "alice"
            with pytest.raises(redis.exceptions.NoPermissionError):
                await ing.hset(redis_keys_key(app), hash_key("k-mallory"), "alice")
            pre = aioredis.Redis.from_url(secured_redis["url"], **creds(secured_redis, "prefill"))
            with pytest.raises(redis.exceptions.NoPermissionError):  # buckets: not its own
                await pre.get(f"pdserve:{{{app}}}:rl:t:tokens")
            await ing.aclose()
            await pre.aclose()
        finally:
            await writer.close()
            await reader.close()

    asyncio.run(main())
    # the index's keys live for a while (refreshed by heartbeats); the buckets have no TTL
    assert 0 < admin.pttl(f"pdx:{{{app}:prefill}}:blocks") <= 3_600_000
    assert admin.pttl(f"pdserve:{{{app}}}:rl:t:tokens") == -1
    assert admin.pttl(redis_keys_key(app)) == -1


def test_under_memory_pressure_only_the_index_is_evicted(tmp_path: Path) -> None:
    """A Redis of a few MiB under volatile-lru: recording blocks until Redis evicts, the
    tenants' buckets and keys all survive, and the index keeps working (its lost entries are
    the feeds' to record again)."""
    paths = write_user_files(tmp_path / "users", new_passwords())
    try:
        proc, port = start_redis(tmp_path, extra=secured_args(paths["acl"], maxmemory_mb=3))
    except RedisNotFound as e:
        pytest.skip(str(e))
    url = f"redis://127.0.0.1:{port}/0"
    secured = {"url": url, "dir": tmp_path / "users", "users": {
        r: {"password_file": str(paths[r])} for r in ("ingress", "prefill")}}  # fmt: skip
    admin = redis.Redis.from_url(url, username="admin", password=read_password(paths["admin"]))
    try:
        for t in range(50):
            admin.set(f"pdserve:{{ev}}:rl:tenant{t}:tokens", "123.5")
            admin.hset(redis_keys_key("ev"), hash_key(f"k{t}"), f"tenant{t}")

        async def fill() -> int:
            ix = index(secured, "prefill", "ev", key_ttl_s=600)
            await ix.register("P1")
            await ix.heartbeat("P1")  # the index's keys get their time to live
            n = 0
            try:
                for k in range(200):
                    await ix.record("P1", list(range(k * 1000 + 1, k * 1000 + 1001)))
                    await ix.heartbeat("P1")
                    n += 1000
                    if int(admin.info("stats")["evicted_keys"]) > 0:
                        break
                assert await ix.register("P2") >= 0  # the index still takes writes
            finally:
                await ix.close()
            return n

        recorded = asyncio.run(fill())
        assert int(admin.info("stats")["evicted_keys"]) > 0, f"no eviction after {recorded}"
        assert all(admin.exists(f"pdserve:{{ev}}:rl:tenant{t}:tokens") for t in range(50))
        assert admin.hlen(redis_keys_key("ev")) == 50
    finally:
        stop_redis(proc)


def _certificate(folder: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (it is its own CA): (cert, key)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pdserve-test-redis")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = folder / "redis.crt", folder / "redis.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_file, key_file


def test_rediss_with_a_generated_certificate(tmp_path: Path) -> None:
    cert, key = _certificate(tmp_path)
    paths = write_user_files(tmp_path / "users", new_passwords())
    tls = ["--tls-cert-file", str(cert), "--tls-key-file", str(key),
           "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no"]  # fmt: skip
    try:
        proc, port = start_redis(tmp_path, extra=tls + secured_args(paths["acl"]), tls=True)
    except RedisNotFound as e:
        pytest.skip(str(e))
    try:
        secured = {"url": f"rediss://127.0.0.1:{port}/0", "dir": tmp_path / "users",
                   "users": {r: {"password_file": str(paths[r])} for r in ("ingress", "prefill")}}  # fmt: skip

        async def main() -> None:
            ix = index(secured, "prefill", "tls", ca_file=str(cert))
            try:
                await ix.register("P1")
                assert await ix.record("P1", [1, 2, 3])
                assert await ix.match([1, 2, 3]) == {"P1": 3}
            finally:
                await ix.close()

        asyncio.run(main())
        with pytest.raises(redis.ConnectionError):  # plain text to a TLS port
            redis.Redis.from_url(
                f"redis://127.0.0.1:{port}/0", socket_timeout=2, **creds(secured, "ingress")
            ).ping()
    finally:
        stop_redis(proc)


def test_a_password_never_sits_in_the_config_or_a_log() -> None:
    from pydantic import ValidationError

    from deployments.config import AppConfig

    with pytest.raises(ValidationError) as e:
        AppConfig.model_validate({"index": {"redis_url": "redis://u:s3cret@h:6380/0"}})
    assert "index.redis_url" in str(e.value) and "redis_users" in str(e.value)
    assert "s3cret" not in str(e.value)
    assert redact("redis://u:s3cret@h:6380/0") == "redis://u:***@h:6380/0"
    cfg = IndexConfig(backend="redis", username="ingress", password="s3cret")
    assert "s3cret" not in repr(cfg) and "s3cret" not in cfg.model_dump_json()
