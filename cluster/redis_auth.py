"""Who may do what in pdserve's Redis: one ACL user per role, least privilege, passwords in
files (never in a URL, a config or Serve's args).

Redis holds three kinds of entries for an app (``docs/security.md``, "A closed cluster"):

- the prefix index, ``pdx:{<app>:<pool>}:*`` (written by the prefill replicas, read by the
  ingress; rebuilt by the prefill replicas' feeds whenever it is lost);
- the tenants' rate-limit buckets, ``pdserve:{<app>}:rl:*`` (read and written by the ingress);
- tenants' keys, ``pdserve:{<app>}:keys`` (read by the ingress, written by an operator).

:data:`ROLES` gives each its own user: ``ingress`` reads the index and the keys and writes only
the buckets; ``prefill`` reads and writes only the index; ``admin`` (the operator, for
``pdserve keys --redis``) may do anything; the ``default`` user is off, so a client that does
not authenticate is refused. Redis checks key permissions inside scripts too, so the index's
and the limiter's Lua scripts are held to the same patterns. :func:`acl_file` writes these
users with their passwords hashed (SHA-256, Redis's ``#`` form), for ``--aclfile`` or a
Kubernetes Secret; :func:`write_user_files` writes a password file per role, which the
replicas read (``index.redis_users``).

The eviction policy that goes with it (``maxmemory-policy volatile-lru``): only keys with a
time to live may be evicted, and only the index's keys carry one (refreshed by the feeds'
heartbeats), so under memory pressure Redis drops index entries (the feeds rebuild them, the
router meanwhile routes by load) and never a rate-limit bucket or a key.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Redis's commands each role runs, besides the connection's own (see :data:`_CONNECTION`)
ROLES: dict[str, str] = {
    # the index read (match's script), the keys read, the buckets' scripts (GET, SET, TIME)
    "ingress": (
        "resetkeys %R~pdx:* %R~pdserve:*:keys ~pdserve:*:rl:* resetchannels -@all "
        "+@read +set +time +eval +evalsha +evalsha_ro +script|load +script|exists"
    ),
    # the feed's scripts (HSET, HDEL, HMGET, HSCAN, ZADD, ...), its TTL refresh and clean-up
    "prefill": (
        "resetkeys ~pdx:* resetchannels -@all +@read +@write -@dangerous +time +pexpire "
        "+eval +evalsha +evalsha_ro +script|load +script|exists +unlink +scan"
    ),
    # the operator: keys in Redis (pdserve keys --redis), maintenance
    "admin": "~* &* +@all",
}
_CONNECTION = "+ping +hello +auth +select +client|setname"


@dataclass(frozen=True)
class RedisCredentials:
    """How one role connects: a user and its password (read from a file), and the CA that
    signed the server's certificate for ``rediss://`` (None: the system's)."""

    username: str | None = None
    password: str | None = field(default=None, repr=False)
    ca_file: str | None = None

    def client_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``redis.asyncio.Redis.from_url`` for these credentials."""
        out: dict[str, Any] = {}
        if self.username is not None:
            out["username"] = self.username
        if self.password is not None:
            out["password"] = self.password
        if self.ca_file is not None:
            out["ssl_ca_certs"] = self.ca_file
        return out


def read_password(path: str | Path) -> str:
    """The password in ``path`` (its first line); a clear error naming the file otherwise."""
    p = Path(path).expanduser()
    try:
        text = p.read_text()
    except OSError as e:
        raise ValueError(f"Redis password file {p}: {e.strerror or e}") from None
    pw = text.splitlines()[0].strip() if text.strip() else ""
    if not pw:
        raise ValueError(f"Redis password file {p} is empty")
    return pw


def new_passwords(roles: tuple[str, ...] = tuple(ROLES)) -> dict[str, str]:
    """A random 256-bit password per role."""
    return {r: secrets.token_urlsafe(32) for r in roles}


def acl_file(passwords: Mapping[str, str]) -> str:
    """An ACL file (``redis-server --aclfile``) with a user per role of ``passwords``, each
    password stored as its SHA-256 (the file gives nothing away), and the default user off."""
    lines = ["user default off resetkeys -@all"]
    for role, pw in sorted(passwords.items()):
        digest = hashlib.sha256(pw.encode()).hexdigest()
        lines.append(f"user {role} on #{digest} {ROLES[role]} {_CONNECTION}")
    return "\n".join(lines) + "\n"


def write_user_files(folder: Path, passwords: Mapping[str, str]) -> dict[str, Path]:
    """``folder/<role>.password`` (mode 0600) for each role and ``folder/users.acl``; the
    paths by role (``acl`` for the ACL file)."""
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    out: dict[str, Path] = {}
    for role, pw in passwords.items():
        out[role] = write_private(folder / f"{role}.password", pw + "\n")
    out["acl"] = write_private(folder / "users.acl", acl_file(passwords))
    return out


def write_private(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` atomically, readable by its owner only (mode 0600)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
    return path


def redact(url: str) -> str:
    """``url`` with any password replaced by ``***`` (for logs and stats)."""
    from urllib.parse import urlsplit, urlunsplit

    u = urlsplit(url)
    if u.password is None:
        return url
    user = u.username or ""
    host = u.hostname or ""
    netloc = f"{user}:***@{host}" + (f":{u.port}" if u.port else "")
    return urlunsplit((u.scheme, netloc, u.path, u.query, u.fragment))
