"""``index``: the global prefix index the router consults, and its Redis users."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator

from cluster.index import IndexBackend
from cluster.index import IndexConfig as ClusterIndexConfig
from deployments.config.common import _Strict


class RedisUser(_Strict):
    """One role's Redis ACL user: its name and the file that holds its password (a mounted
    Secret; never the password itself, which would sit in the config in the clear)."""

    username: str = Field(min_length=1, max_length=128, description="The ACL user.")
    password_file: str = Field(
        min_length=1, description="File whose first line is the user's password ('~' expands)."
    )


class RedisUsers(_Strict):
    """Each role's Redis user (:mod:`cluster.redis_auth`: least privilege per role)."""

    ingress: RedisUser = Field(
        description="The ingress's: reads the index and keys, writes the rate-limit buckets."
    )
    prefill: RedisUser = Field(description="The prefill replicas': read and write the index.")


class IndexConfig(_Strict):
    """The global prefix index the router consults (fed by the prefill engines' KV events).

    The user's section: where the index lives, how long a lookup may take, each role's Redis
    user (the password in a file). Each process that reads or writes the index connects with
    the :class:`cluster.index.IndexConfig` that :meth:`cluster_config` resolves from it (the
    Serve app's namespace, the role's credentials read now): two models because they are two
    things, not a copy of one."""

    # a refused redis_url may hold a password: errors must not echo it
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    backend: Literal[IndexBackend, "none"] = Field(
        default="memory",
        description="'memory': in the ingress process (one ingress replica); 'redis': shared "
        "by every ingress replica, each prefill replica writes its own entries; 'none': no "
        "index (routing by load only).",
    )
    redis_url: str = Field(
        default="redis://127.0.0.1:6380/0",
        description="redis:// URL of the Redis backend (the default port is 6380, not Redis's "
        "6379: a Ray head node's GCS listens on 6379).",
    )
    lookup_timeout_s: float = Field(
        default=0.02,
        gt=0,
        le=5,
        description="Longest wait for one index lookup; past it the request is routed by load "
        "(counted as the index_unavailable fallback).",
    )
    liveness_ttl_s: float = Field(
        default=5.0,
        gt=0,
        le=3600,
        description="A prefill replica whose feed has not heartbeat for this long is ignored "
        "by lookups (a backstop: Serve's replica set already filters crashed replicas).",
    )
    heartbeat_s: float = Field(default=1.0, gt=0, le=600, description="Feed heartbeat period (s).")
    redis_users: RedisUsers | None = Field(
        default=None,
        description="Redis ACL users per role, passwords in files (pdserve redis-users writes "
        "them, with the ACL file for redis-server). null: Redis without authentication (a "
        "private Redis on loopback only).",
    )
    redis_ca_file: str | None = Field(
        default=None,
        description="CA certificate that signed the server's, for a rediss:// URL (null: the "
        "system's CAs).",
    )

    def redis_credentials(self, role: Literal["ingress", "prefill"]) -> Any:
        """:class:`cluster.redis_auth.RedisCredentials` of ``role`` (its password read now,
        from its file); a ``ValueError`` naming the file when it cannot be read."""
        from cluster.redis_auth import RedisCredentials, read_password

        ca = str(Path(self.redis_ca_file).expanduser()) if self.redis_ca_file else None
        if self.redis_users is None:
            return RedisCredentials(ca_file=ca)
        user: RedisUser = getattr(self.redis_users, role)
        return RedisCredentials(user.username, read_password(user.password_file), ca)

    def cluster_config(
        self,
        app: str,
        socket_timeout_s: float | None = None,
        role: Literal["ingress", "prefill"] = "ingress",
    ) -> ClusterIndexConfig:
        """The :class:`cluster.index.IndexConfig` of the prefill pool of Serve app ``app``
        (every reader and writer of one app's index must use this one namespace), with
        ``role``'s Redis credentials when the backend is Redis."""
        creds = {}
        if self.backend == "redis":
            c = self.redis_credentials(role)
            creds = {"username": c.username, "password": c.password, "ca_file": c.ca_file}
        cfg = ClusterIndexConfig(
            backend="redis" if self.backend == "redis" else "memory",
            redis_url=self.redis_url,
            app=app,
            deployment="prefill",
            liveness_ttl_s=self.liveness_ttl_s,
            **creds,
        )
        if socket_timeout_s is not None:
            cfg = cfg.model_copy(update={"socket_timeout_s": socket_timeout_s})
        return cfg

    @field_validator("redis_url")
    @classmethod
    def _url(cls, v: str) -> str:
        from urllib.parse import urlsplit

        if not v.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"{v!r} is not a redis://, rediss:// or unix:// URL")
        try:
            password = urlsplit(v).password
        except ValueError:
            raise ValueError("not a valid URL") from None
        if password is not None or "password=" in v:
            raise ValueError(
                "holds a password, which would sit in the config (and Serve's args, a "
                "ConfigMap) in the clear: put it in a file and name it in index.redis_users"
            )
        return v
