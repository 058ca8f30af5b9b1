"""The global prefix index: which replica holds how many leading blocks of a prompt.

Block hashes are the unsigned 64-bit ints of :mod:`cluster.hashing` (the form vLLM's KV events
carry). Each replica has an *epoch*: :meth:`PrefixIndex.register` starts a new one (a restarted
replica, or one whose event stream had a gap, starts clean). Entries belong to one
``(replica, epoch)`` (memory: one set each; Redis: that epoch's bit in a per-block bitmap, see
:mod:`cluster.redis_index`); lookups see only live epochs. So :meth:`PrefixIndex.drop_replica`
is O(1) for the caller: it forgets the live epoch and the replica's entries become invisible at
once; their memory is freed at once (memory) or by an incremental sweep that rides on the next
writes and heartbeats (Redis).

Contract, shared by every backend (``tests/contract/test_prefix_index_contract.py``):

- ``register(replica) -> epoch``: marks the replica live under a new epoch, greater than any
  epoch it had before in this index; entries of older epochs are gone.
- ``record(replica, hashes) -> bool`` / ``evict(replica, hashes) -> bool``: add/remove the
  replica's entries for these blocks under its live epoch; ``False`` (and no change) when the
  replica is not live, e.g. after ``drop_replica`` or when a Redis restart lost the state: the
  caller then registers again and re-records (see :mod:`cluster.feed`). Idempotent.
- ``match(hashes) -> {replica: n}``: for each live replica holding the first block, ``n`` is
  the number of leading blocks of ``hashes`` it holds with no gap; replicas with ``n = 0`` are
  absent. The scan stops at the first block no live replica holds. One round trip.
- ``drop_replica(replica)``: the replica stops counting at once (O(1)).
- ``heartbeat(replica)``: liveness. With ``liveness_ttl_s`` set, a replica whose last
  heartbeat (or ``register``) is older than that is ignored by ``match`` and by
  ``live_replicas`` until the next heartbeat; entries are kept.
- ``live_replicas() -> {replica: epoch}``; ``close()``.

The routing policy and the ingress call ``match`` on the hot path and must bound it with a
time-out (``asyncio.wait_for``) and fall back to load-only routing when it expires.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

Clock = Callable[[], float]

_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")

#: Where an index lives: embedded in one process, or shared in Redis.
IndexBackend = Literal["memory", "redis"]


class IndexConfig(BaseModel):
    """Where the index lives and how it is namespaced: one process's connection to one pool's
    index, resolved (its namespace, its credentials with the password itself, its socket
    settings).

    Not the app's ``index`` section (:class:`deployments.config.index.IndexConfig`), which is
    the user's side: it says where the index lives and how long to wait for it, names each
    role's Redis user with the file of its password, and refuses a password in the URL; its
    ``cluster_config`` builds this one for each process. They share the name and no fields'
    meaning beyond ``backend``, ``redis_url`` and ``liveness_ttl_s``, whose defaults differ
    (the app's Redis is on 6380, away from a Ray head's 6379)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: IndexBackend = Field(
        default="memory", description="'memory' (embedded, one process) or 'redis' (shared)."
    )
    redis_url: str = Field(
        default="redis://127.0.0.1:6379/0", description="redis:// URL of the Redis backend."
    )
    app: str = Field(default="pdserve", min_length=1, description="Application name (namespace).")
    deployment: str = Field(
        default="prefill", min_length=1, description="Deployment/pool name (namespace)."
    )
    liveness_ttl_s: float | None = Field(
        default=None,
        gt=0,
        description="Ignore replicas without a heartbeat for this long (None: no expiry).",
    )
    write_batch: int = Field(
        default=1024, ge=64, le=4096, description="Block events per write round trip (max)."
    )
    socket_timeout_s: float = Field(
        default=1.0, gt=0, description="Redis socket time-out (a backstop; callers time out)."
    )
    username: str | None = Field(default=None, description="Redis ACL user of this process.")
    password: SecretStr | None = Field(
        default=None, description="Its password (never printed: pydantic's SecretStr)."
    )
    ca_file: str | None = Field(
        default=None, description="CA of the server's certificate (rediss://), else the system's."
    )
    key_ttl_s: float = Field(
        default=3600.0,
        gt=0,
        description="Time to live of the index's keys, refreshed by every heartbeat: they are "
        "the keys Redis may evict (maxmemory-policy volatile-lru).",
    )

    def credentials(self) -> Any:
        """:class:`cluster.redis_auth.RedisCredentials` of this process."""
        from cluster.redis_auth import RedisCredentials

        pw = self.password.get_secret_value() if self.password is not None else None
        return RedisCredentials(self.username, pw, self.ca_file)

    @field_validator("app", "deployment")
    @classmethod
    def _plain(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError(f"{v!r}: use letters, digits, '_', '.', '-' only")
        return v

    @property
    def namespace(self) -> str:
        """Key prefix; the braces make every key of one namespace one Redis Cluster slot."""
        return f"pdx:{{{self.app}:{self.deployment}}}:"


@runtime_checkable
class PrefixIndex(Protocol):
    """The async prefix-index interface (see the module docstring for the contract)."""

    async def register(self, replica: str) -> int: ...

    async def record(self, replica: str, hashes: Sequence[int]) -> bool: ...

    async def evict(self, replica: str, hashes: Sequence[int]) -> bool: ...

    async def match(self, hashes: Sequence[int]) -> dict[str, int]: ...

    async def drop_replica(self, replica: str) -> None: ...

    async def heartbeat(self, replica: str) -> bool: ...

    async def live_replicas(self) -> dict[str, int]: ...

    async def close(self) -> None: ...


class MemoryPrefixIndex:
    """In-process backend: one set of block hashes per (replica, epoch).

    Not thread-safe: one event loop owns it.
    """

    def __init__(self, config: IndexConfig | None = None, clock: Clock = time.time) -> None:
        self.config = config or IndexConfig()
        self._clock = clock
        self._sets: dict[tuple[str, int], set[int]] = {}
        self._live: dict[str, int] = {}
        self._epochs: dict[str, int] = {}
        self._seen: dict[str, float] = {}

    def _alive(self) -> dict[str, int]:
        ttl = self.config.liveness_ttl_s
        if ttl is None:
            return self._live
        floor = self._clock() - ttl
        return {r: e for r, e in self._live.items() if self._seen.get(r, -1.0) >= floor}

    async def register(self, replica: str) -> int:
        old = self._live.get(replica)
        if old is not None:
            self._sets.pop((replica, old), None)
        epoch = self._epochs.get(replica, 0) + 1
        self._epochs[replica] = epoch
        self._live[replica] = epoch
        self._sets[(replica, epoch)] = set()
        self._seen[replica] = self._clock()
        return epoch

    async def record(self, replica: str, hashes: Sequence[int]) -> bool:
        epoch = self._live.get(replica)
        if epoch is None:
            return False
        self._sets[(replica, epoch)].update(hashes)
        return True

    async def evict(self, replica: str, hashes: Sequence[int]) -> bool:
        epoch = self._live.get(replica)
        if epoch is None:
            return False
        self._sets[(replica, epoch)].difference_update(hashes)
        return True

    async def match(self, hashes: Sequence[int]) -> dict[str, int]:
        out: dict[str, int] = {}
        if not hashes:
            return out
        for r, e in self._alive().items():
            held = self._sets[(r, e)]
            n = 0
            for h in hashes:
                if h not in held:
                    break
                n += 1
            if n:
                out[r] = n
        return out

    async def drop_replica(self, replica: str) -> None:
        epoch = self._live.pop(replica, None)
        self._seen.pop(replica, None)
        if epoch is not None:
            self._sets.pop((replica, epoch), None)

    async def heartbeat(self, replica: str) -> bool:
        if replica not in self._live:
            return False
        self._seen[replica] = self._clock()
        return True

    async def live_replicas(self) -> dict[str, int]:
        return dict(self._alive())

    async def close(self) -> None:
        return None

    def entry_count(self) -> int:
        """Stored (block, replica) entries (for tests and benchmarks)."""
        return sum(len(v) for v in self._sets.values())


def make_index(config: IndexConfig, clock: Clock = time.time) -> PrefixIndex:
    """The backend named by ``config.backend`` (Redis is imported only when asked for)."""
    if config.backend == "redis":
        from cluster.redis_index import RedisPrefixIndex

        return RedisPrefixIndex(config, clock=clock)
    return MemoryPrefixIndex(config, clock=clock)


async def match_within(
    index: PrefixIndex, hashes: Sequence[int], timeout_s: float
) -> dict[str, int] | None:
    """``index.match(hashes)`` bounded by ``timeout_s``; ``None`` on time-out or index error.

    The hot-path form for the router and the ingress: on ``None`` they route by load only and
    count the fallback (design rule 7: degrade on the hot path, never a 500)."""
    try:
        async with asyncio.timeout(timeout_s):
            return await index.match(hashes)
    except (TimeoutError, OSError, ConnectionError):
        return None
    except Exception as e:  # redis.exceptions.* without importing redis here
        if type(e).__module__.startswith("redis"):
            return None
        raise
