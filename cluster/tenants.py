"""Tenants across ingress replicas: hashed API keys and shared rate limits.

**Keys** are never stored in the clear. A key's record is ``sha256:<hex digest>`` (keys are
random 256-bit tokens made by :func:`new_key`, so an unsalted fast hash is enough: nothing can
be guessed from the digest, as with GitHub's or Stripe's token stores). :class:`KeyStore`
answers ``key -> tenant`` from three sources, first hit wins:

1. the config's ``tenants.key_hashes`` (and plain ``ingress.api_keys``, hashed at start);
2. a keys file (YAML or JSON, ``sha256:... -> tenant``) re-read when its modification time or
   size changes (checked at most every ``file_check_s``), so ``pdserve keys add|revoke
   --file`` takes effect without a restart; a file that no longer parses keeps the last good
   keys (counted in ``file_errors``, logged);
3. a Redis hash ``pdserve:{<app>}:keys`` (``pdserve keys add|revoke --redis``); an answer is
   reused for ``cache_s`` seconds, so a revoked key stops working within that time.

**Rate limits** are token buckets in GCRA form (:mod:`controllers.tenants`): one number per
bucket. :class:`RateLimiter` keeps them in this process (``memory``) or in Redis, where one Lua
script checks and takes from all of a request's buckets atomically on the server's clock
(``TIME``), so every ingress replica draws from the same bucket and their clocks do not matter.
When Redis fails, the limiter falls back to its memory buckets (named and counted in
``redis_fallbacks``): limits then hold per replica, and no request fails for it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controllers.tenants import Bucket, debit, refund, take

log = logging.getLogger(__name__)

KEY_PREFIX = "sha256:"
TENANT_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
#: What a key store holds for an operator key in place of a tenant (no tenant name can start
#: with '@'): such a key reaches the operator routes and nothing else.
OPERATOR = "@operator"


def hash_key(key: str) -> str:
    """A key's stored form: ``sha256:<64 hex digits>``."""
    return KEY_PREFIX + hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    """A new API key: ``pds-`` and 256 random bits (URL-safe base64)."""
    return "pds-" + secrets.token_urlsafe(32)


def is_key_hash(s: str) -> bool:
    h = s[len(KEY_PREFIX) :]
    return s.startswith(KEY_PREFIX) and len(h) == 64 and all(c in "0123456789abcdef" for c in h)


def redis_keys_key(app: str) -> str:
    """The Redis hash of app ``app``'s keys (key hash -> tenant)."""
    return f"pdserve:{{{app}}}:keys"


def read_keys_file(path: Path) -> dict[str, str]:
    """``{key hash: tenant}`` from a YAML or JSON mapping; ``ValueError`` naming the entry."""
    import re

    import yaml

    text = path.read_text()
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as e:
        raise ValueError(
            f"{path}: not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {e}"
        ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping 'sha256:<hex>: tenant'")
    out: dict[str, str] = {}
    for h, t in data.items():
        if not isinstance(h, str) or not is_key_hash(h):
            raise ValueError(f"{path}: {h!r} is not 'sha256:<64 lowercase hex digits>'")
        if t != OPERATOR and (not isinstance(t, str) or not re.match(TENANT_PATTERN, t)):
            raise ValueError(f"{path}: tenant {t!r} of {h[:15]}... is not a tenant name")
        out[h] = t
    return out


def write_keys_file(path: Path, keys: Mapping[str, str]) -> None:
    """Write ``keys`` to ``path`` atomically (a reader sees the old or the new file)."""
    import yaml

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    body = (
        json.dumps(dict(keys), indent=1, sort_keys=True)
        if path.suffix == ".json"
        else yaml.safe_dump(dict(sorted(keys.items())), default_flow_style=False)
    )
    tmp.write_text(body)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


@dataclass
class KeyStoreStats:
    file_reloads: int = 0
    file_errors: int = 0
    redis_lookups: int = 0
    redis_errors: int = 0


class KeyStoreUnavailable(RuntimeError):
    """The key could only be checked in Redis, and Redis did not answer."""


class KeyStore:
    """``key -> tenant`` over the config's hashes, a keys file and Redis (see module doc).

    ``redis`` is a ``redis.asyncio.Redis`` (``decode_responses=True``) or None; ``clock`` is
    injected for tests.
    """

    def __init__(
        self,
        hashes: Mapping[str, str],
        file: Path | None = None,
        redis: Any = None,
        app: str = "pdserve",
        cache_s: float = 2.0,
        file_check_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.hashes = dict(hashes)
        self.file = file
        self.redis = redis
        self.redis_key = redis_keys_key(app)
        self.cache_s = cache_s
        self.file_check_s = file_check_s
        self.clock = clock
        self.stats = KeyStoreStats()
        self._file_keys: dict[str, str] = {}
        self._file_sig: tuple[float, int] | None = None
        self._file_checked = -math.inf
        self._cache: dict[str, tuple[str | None, float]] = {}
        if file is not None:
            self._file_keys = read_keys_file(file)  # a bad file fails the replica at start
            st = file.stat()
            self._file_sig = (st.st_mtime, st.st_size)
            self._file_checked = clock()

    @property
    def enabled(self) -> bool:
        """Whether any key source is configured (none: every request is anonymous)."""
        return bool(self.hashes) or self.file is not None or self.redis is not None

    def _reload(self) -> None:
        now = self.clock()
        if self.file is None or now - self._file_checked < self.file_check_s:
            return
        self._file_checked = now
        try:
            st = self.file.stat()
            sig = (st.st_mtime, st.st_size)
            if sig == self._file_sig:
                return
            self._file_keys = read_keys_file(self.file)
            self._file_sig = sig
            self.stats.file_reloads += 1
        except (OSError, ValueError) as e:  # keep the last good keys
            self.stats.file_errors += 1
            log.error(
                "keys file %s not reloaded (keeping %d keys): %s",
                self.file,
                len(self._file_keys),
                e,
            )

    async def tenant(self, key: str, remote: bool = True) -> str | None:
        """The tenant of ``key``, or None when no source knows it; raises
        :class:`KeyStoreUnavailable` when only Redis could tell and it failed. ``remote``
        False: no Redis call (a cached answer still counts), for a caller that has sent too
        many unknown keys already."""
        if not key:
            return None
        h = hash_key(key)
        t = self.hashes.get(h)
        if t is not None:
            return t
        self._reload()
        t = self._file_keys.get(h)
        if t is not None or self.redis is None:
            return t
        now = self.clock()
        hit = self._cache.get(h)
        if hit is not None and hit[1] > now:
            return hit[0]
        if not remote:
            return None
        try:
            self.stats.redis_lookups += 1
            got = await self.redis.hget(self.redis_key, h)
        except Exception as e:
            self.stats.redis_errors += 1
            raise KeyStoreUnavailable(f"key store (Redis) unavailable: {type(e).__name__}") from e
        if len(self._cache) > 65536:
            self._cache.clear()
        self._cache[h] = (got, now + self.cache_s)
        return str(got) if got is not None else None


# -- rate limits ------------------------------------------------------------------------


@dataclass(frozen=True)
class Charge:
    """One bucket a request takes from: ``name`` (``requests`` or ``tokens``), its bucket and
    the units taken."""

    name: str
    bucket: Bucket
    cost: float


@dataclass(frozen=True)
class Verdict:
    """A limiter's answer: allowed, or which bucket refused and when to retry."""

    allowed: bool
    refused_by: str | None = None
    retry_after_s: float = 0.0
    backend: str = "memory"


@dataclass
class LimiterStats:
    allowed: int = 0
    refused: int = 0
    refunds: int = 0
    #: charges for work done whatever the bucket held (:meth:`RateLimiter.charge`)
    debits: int = 0
    redis_fallbacks: int = 0


# KEYS: one per bucket; ARGV: rate, capacity, cost per bucket. Checks every bucket first and
# takes from them only when all allow (atomically: no other script runs in between). Buckets
# carry no time to live: one key per tenant and bucket, and under maxmemory-policy
# volatile-lru only keys with a time to live (the prefix index's) may be evicted, so a
# tenant's limits never are (cluster.redis_auth).
_TAKE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local new = {}
for i = 1, #KEYS do
  local rate = tonumber(ARGV[3 * i - 2])
  local cap = tonumber(ARGV[3 * i - 1])
  local cost = tonumber(ARGV[3 * i])
  local tat = tonumber(redis.call('GET', KEYS[i]) or '0')
  local nt = math.max(tat, now) + cost / rate
  local ahead = nt - now - cap / rate
  if ahead > 1e-9 then
    return {0, i, string.format('%.6f', ahead)}
  end
  new[i] = nt
end
for i = 1, #KEYS do
  redis.call('SET', KEYS[i], string.format('%.6f', new[i]))
end
return {1, 0, '0'}
"""

# KEYS[1]: the bucket; ARGV: rate, units to take however full it is (at most its capacity).
_DEBIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local tat = tonumber(redis.call('GET', KEYS[1]) or '0')
local nt = math.max(tat, now) + tonumber(ARGV[2]) / tonumber(ARGV[1])
redis.call('SET', KEYS[1], string.format('%.6f', nt))
return 1
"""

# KEYS[1]: the bucket; ARGV: rate, units to give back.
_REFUND = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local tat = tonumber(redis.call('GET', KEYS[1]) or '0')
if tat > now then
  local nt = math.max(now, tat - tonumber(ARGV[2]) / tonumber(ARGV[1]))
  redis.call('SET', KEYS[1], string.format('%.6f', nt))
end
return 1
"""


class RateLimiter:
    """Token buckets per ``(tenant, bucket name)``, in Redis (shared) or in this process.

    ``redis``: a ``redis.asyncio.Redis`` or None (memory only). ``clock`` (seconds) drives the
    memory buckets; Redis's scripts use the server's clock.
    """

    def __init__(
        self,
        redis: Any = None,
        app: str = "pdserve",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.redis = redis
        self.prefix = f"pdserve:{{{app}}}:rl:"
        self.clock = clock
        self.stats = LimiterStats()
        self._tat: dict[tuple[str, str], float] = {}
        self._take = redis.register_script(_TAKE) if redis is not None else None
        self._refund = redis.register_script(_REFUND) if redis is not None else None
        self._debit = redis.register_script(_DEBIT) if redis is not None else None

    @property
    def backend(self) -> str:
        return "redis" if self.redis is not None else "memory"

    async def admit(self, tenant: str, charges: Sequence[Charge]) -> Verdict:
        """Take every charge from ``tenant``'s buckets, or none of them."""
        if not charges:
            return Verdict(True, backend=self.backend)
        v: Verdict | None = None
        if self._take is not None:
            try:
                keys = [self.prefix + f"{tenant}:{c.name}" for c in charges]
                args: list[float] = []
                for c in charges:
                    args += [c.bucket.rate, c.bucket.capacity, c.cost]
                ok, idx, ahead = await self._take(keys=keys, args=args)
                v = (
                    Verdict(True, backend="redis")
                    if int(ok)
                    else Verdict(False, charges[int(idx) - 1].name, float(ahead), "redis")
                )
            except Exception as e:  # Redis down: limits per replica until it returns
                self.stats.redis_fallbacks += 1
                log.warning("rate limits in memory (Redis failed: %s)", type(e).__name__)
        if v is None:
            v = self._admit_memory(tenant, charges)
        if v.allowed:
            self.stats.allowed += 1
        else:
            self.stats.refused += 1  # per tenant: the pdserve_rate_limited metric
        return v

    def _admit_memory(self, tenant: str, charges: Sequence[Charge]) -> Verdict:
        now = self.clock()
        new = []
        for c in charges:
            got = take(c.bucket, self._tat.get((tenant, c.name), 0.0), now, c.cost)
            if not got.allowed:
                return Verdict(False, c.name, got.retry_after_s, "memory")
            new.append(got.tat)
        for c, tat in zip(charges, new, strict=True):
            self._tat[(tenant, c.name)] = tat
        if len(self._tat) > 100_000:  # drop buckets that are full again
            self._tat = {k: t for k, t in self._tat.items() if t > now}
        return Verdict(True, backend="memory")

    async def charge(self, tenant: str, name: str, bucket: Bucket, units: float) -> None:
        """Take ``units`` from a bucket however full it is (:func:`controllers.tenants.debit`:
        work already done, at most one capacity at once). Never raises."""
        if units <= 0:
            return
        self.stats.debits += 1
        units = min(units, bucket.capacity)
        if self._debit is not None:
            try:
                await self._debit(
                    keys=[self.prefix + f"{tenant}:{name}"], args=[bucket.rate, units]
                )
                return
            except Exception:
                self.stats.redis_fallbacks += 1
        k = (tenant, name)
        self._tat[k] = debit(bucket, self._tat.get(k, 0.0), self.clock(), units)

    async def give_back(self, tenant: str, name: str, bucket: Bucket, units: float) -> None:
        """Return ``units`` to a bucket (tokens reserved but not produced). Never raises."""
        if units <= 0:
            return
        self.stats.refunds += 1
        if self._refund is not None:
            try:
                await self._refund(
                    keys=[self.prefix + f"{tenant}:{name}"], args=[bucket.rate, units]
                )
                return
            except Exception:
                self.stats.redis_fallbacks += 1
        k = (tenant, name)
        if k in self._tat:
            self._tat[k] = refund(bucket, self._tat[k], self.clock(), units)
