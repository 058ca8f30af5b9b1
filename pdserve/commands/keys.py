"""``pdserve keys``: make, list and revoke tenants' API keys, stored hashed.

A store is a keys file (``tenants.keys_file``: a mounted Secret, say; the ingress re-reads it
when it changes) or Redis (``tenants.keys_in_redis``: the hash ``pdserve:{APP}:keys`` at
``index.redis_url``). Either way the running app sees a new or revoked key without a restart.
A new key is printed once, on stdout, and never stored in the clear.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import typer

from cluster.tenants import (
    OPERATOR,
    TENANT_PATTERN,
    hash_key,
    is_key_hash,
    new_key,
    read_keys_file,
    redis_keys_key,
    write_keys_file,
)
from pdserve.apps import app

keys_app = typer.Typer(
    help="Tenants' API keys (stored hashed, in a keys file or Redis).", no_args_is_help=True
)
app.add_typer(keys_app, name="keys")

_FILE = typer.Option(None, "--file", help="Keys file (tenants.keys_file).")
_REDIS = typer.Option(None, "--redis", help="redis:// URL (tenants.keys_in_redis).")
_APP = typer.Option("pdserve", "--app", help="Serve application name (the Redis namespace).")
_REDIS_USER = typer.Option(
    None, "--redis-user", envvar="PDSERVE_REDIS_USER", help="Redis ACL user (the operator's)."
)
_REDIS_PASSWORD_FILE = typer.Option(
    None,
    "--redis-password-file",
    envvar="PDSERVE_REDIS_PASSWORD_FILE",
    help="File holding that user's password (pdserve redis-users writes admin.password).",
)
_REDIS_CA = typer.Option(
    None, "--redis-ca-file", help="CA of the server's certificate (rediss://)."
)

#: the Redis credentials of this invocation (set by the store's options)
_CREDS: dict[str, Any] = {}


@keys_app.callback()
def _keys_options(
    redis_user: str | None = _REDIS_USER,
    redis_password_file: Path | None = _REDIS_PASSWORD_FILE,
    redis_ca_file: Path | None = _REDIS_CA,
) -> None:
    """Tenants' API keys (stored hashed, in a keys file or Redis)."""
    from cluster.redis_auth import RedisCredentials, read_password

    try:
        pw = read_password(redis_password_file) if redis_password_file else None
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--redis-password-file") from None
    _CREDS["creds"] = RedisCredentials(
        redis_user, pw, str(redis_ca_file) if redis_ca_file else None
    )


def _redis_call(url: str, fn: Any) -> Any:
    import redis.asyncio as aioredis

    from cluster.redis_auth import RedisCredentials

    creds = _CREDS.get("creds") or RedisCredentials()

    async def main() -> Any:
        r = aioredis.Redis.from_url(
            url, decode_responses=True, socket_connect_timeout=5, **creds.client_kwargs()
        )
        try:
            return await fn(r)
        finally:
            await r.aclose()

    return asyncio.run(main())


def _store(file: Path | None, redis: str | None) -> None:
    if (file is None) == (redis is None):
        raise typer.BadParameter("give exactly one store: --file PATH or --redis URL")


def _load(file: Path | None, redis: str | None, app_name: str) -> dict[str, str]:
    if file is not None:
        return read_keys_file(file) if file.exists() else {}
    assert redis is not None
    got: dict[str, str] = _redis_call(redis, lambda r: r.hgetall(redis_keys_key(app_name)))
    return got


@keys_app.command("new")
def new(
    tenant: str | None = typer.Argument(None, help="The tenant the key belongs to."),
    operator: bool = typer.Option(
        False,
        "--operator",
        help="An operator key instead (no TENANT): it reaches /v1/pdserve/* (stats, route "
        "explanations, resets) and nothing else.",
    ),
    file: Path | None = _FILE,
    redis: str | None = _REDIS,
    app_name: str = _APP,
) -> None:
    """Make a key for TENANT (or, with ``--operator``, an operator key) and store its hash;
    the key is printed once.

    With no store, prints the key and the config line to put it in (``tenants.key_hashes``,
    or ``tenants.operator_key_hashes``)."""
    import re

    if operator == (tenant is not None):
        raise typer.BadParameter("give a TENANT or --operator (one of them)")
    if tenant is not None and not re.match(TENANT_PATTERN, tenant):
        raise typer.BadParameter(f"tenant {tenant!r}: letters, digits, '_', '.', '-' only")
    tenant = tenant or OPERATOR
    key = new_key()
    h = hash_key(key)
    if file is not None and redis is not None:
        raise typer.BadParameter("give one store: --file PATH or --redis URL")
    if file is not None:
        keys = read_keys_file(file) if file.exists() else {}
        keys[h] = tenant
        write_keys_file(file, keys)
    elif redis is not None:
        _redis_call(redis, lambda r: r.hset(redis_keys_key(app_name), h, tenant))
    elif operator:
        typer.echo(f"# tenants.operator_key_hashes entry:\n#   - {h}", err=True)
    else:
        typer.echo(f"# tenants.key_hashes entry:\n#   {h}: {tenant}", err=True)
    typer.echo(key)


@keys_app.command("list")
def list_keys(file: Path | None = _FILE, redis: str | None = _REDIS, app_name: str = _APP) -> None:
    """Tenants and their keys' hashes (the first 16 hex digits)."""
    _store(file, redis)
    for h, t in sorted(_load(file, redis, app_name).items(), key=lambda kv: (kv[1], kv[0])):
        typer.echo(f"{t}\t{h[:23]}")


@keys_app.command("revoke")
def revoke(
    tenant: str | None = typer.Option(
        None, "--tenant", help="Revoke every key of TENANT ('@operator': the operator's)."
    ),
    key_hash: str | None = typer.Option(
        None, "--hash", help="Revoke one key by its hash (or a prefix of 16+ hex digits)."
    ),
    key: str | None = typer.Option(None, "--key", help="Revoke one key given in full."),
    file: Path | None = _FILE,
    redis: str | None = _REDIS,
    app_name: str = _APP,
) -> None:
    """Revoke keys; the app refuses them within ``tenants.key_cache_s`` (Redis) or the keys
    file's next check (about a second)."""
    _store(file, redis)
    if sum(x is not None for x in (tenant, key_hash, key)) != 1:
        raise typer.BadParameter("give one of --tenant, --hash, --key")
    keys = _load(file, redis, app_name)
    if key is not None:
        gone = [h for h in keys if h == hash_key(key)]
    elif key_hash is not None:
        prefix = key_hash if key_hash.startswith("sha256:") else "sha256:" + key_hash
        if len(prefix) < len("sha256:") + 16 and not is_key_hash(prefix):
            raise typer.BadParameter("--hash needs at least 16 hex digits")
        gone = [h for h in keys if h.startswith(prefix)]
    else:
        gone = [h for h, t in keys.items() if t == tenant]
    if not gone:
        typer.echo("no key matched; nothing revoked", err=True)
        raise typer.Exit(1)
    if file is not None:
        write_keys_file(file, {h: t for h, t in keys.items() if h not in gone})
    else:
        assert redis is not None
        _redis_call(redis, lambda r: r.hdel(redis_keys_key(app_name), *gone))
    typer.echo(f"revoked {len(gone)} key(s)")


@keys_app.command("hash")
def hash_cmd(key: str = typer.Argument(..., help="A key; '-' reads it from stdin.")) -> None:
    """The stored form of KEY (``sha256:...``), for ``tenants.key_hashes``."""
    import sys

    typer.echo(hash_key(sys.stdin.readline().strip() if key == "-" else key))
