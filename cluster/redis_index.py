"""Redis backend of the prefix index (redis-py's asyncio client, server-side Lua scripts).

Key layout, all under the namespace ``N = pdx:{<app>:<deployment>}:`` (two apps, or the prefill
and decode pools, never share a key; the braces are a Redis Cluster hash tag, so all keys of
one namespace sit in one slot):

=========================  ======  ==========================================================
key                        type    content
=========================  ======  ==========================================================
``N live``                 HASH    replica -> live epoch (absent: dropped or never registered)
``N epochs``               HASH    replica -> last epoch handed out (kept after a drop, so a
                                   restarted replica gets a larger epoch and starts clean)
``N seen``                 ZSET    replica -> time of its last heartbeat/register (caller's
                                   clock, seconds); read only when ``liveness_ttl_s`` is set
``N r:<replica>:<epoch>``  SET     the block hashes the replica holds in that epoch, each as
                                   8 bytes (the unsigned 64-bit hash, big-endian)
=========================  ======  ==========================================================

Every operation is one script call, so one round trip. ``match`` reads ``live`` (and ``seen``),
then for each live replica probes its set for the first block (``SISMEMBER``) and, on a hit,
for the rest (``SMISMEMBER``), counting the leading hits up to the first miss (at most
``replicas x blocks`` set probes, all server-side).
``record``/``evict`` are one ``SADD``/``SREM`` of up to ``write_batch`` hashes and check the live
epoch in the same script, so a dropped replica is never resurrected by a late write.
``register`` and ``drop_replica`` ``UNLINK`` the old epoch's set (freed in Redis's background
thread), so both are O(1) for the caller. After a Redis restart ``live`` is empty, every write
answers ``False``, and the feed re-registers and re-records from its in-memory block sets.

The per-replica set keys are derived inside the scripts from ``live``; that is fine on a
standalone Redis (the target here) and within one slot of a cluster, but they are not declared
as ``KEYS``, so a proxy that routes by declared keys only must route on ``N live``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from cluster.index import Clock, IndexConfig

# Hashes travel as one argument, 8 bytes each, and are split here: redis-py spends ~5 us
# packing each separate argument, Lua ~0.1 us per string.sub.
_SPLIT = """
local function split(s)
  local t = {}
  for i = 1, #s, 8 do t[#t + 1] = string.sub(s, i, i + 7) end
  return t
end
"""

# KEYS[1]=live KEYS[2]=seen; ARGV[1]=namespace ARGV[2]=liveness floor or '' ARGV[3]=hashes
_MATCH = (
    _SPLIT
    + """
local hs = split(ARGV[3])
local live = redis.call('HGETALL', KEYS[1])
local ttl = ARGV[2] ~= ''
local floor = ttl and tonumber(ARGV[2]) or 0
local out = {}
for i = 1, #live, 2 do
  local r = live[i]
  local ok = true
  if ttl then
    local s = redis.call('ZSCORE', KEYS[2], r)
    ok = s and tonumber(s) >= floor
  end
  local key = ARGV[1] .. 'r:' .. r .. ':' .. live[i + 1]
  -- most replicas lack the first block: one cheap probe before the bulk one
  if ok and redis.call('SISMEMBER', key, hs[1]) == 1 then
    -- slices of 4,096: Lua's unpack fails near 8,000 values (a 128k-token prompt at 16)
    local n = 1
    local i = 2
    while i <= #hs do
      local j = math.min(#hs, i + 4095)
      local hits = redis.call('SMISMEMBER', key, unpack(hs, i, j))
      local k = 1
      while k <= #hits and hits[k] == 1 do k = k + 1 end
      n = n + k - 1
      if k <= #hits then break end
      i = j + 1
    end
    out[#out + 1] = r; out[#out + 1] = n
  end
end
return out
"""
)

# KEYS[1]=live; ARGV[1]=namespace ARGV[2]=replica ARGV[3]=hashes
_WRITE = (
    _SPLIT
    + """
local e = redis.call('HGET', KEYS[1], ARGV[2])
if not e then return -1 end
if #ARGV[3] == 0 then return 0 end
return redis.call('{op}', ARGV[1] .. 'r:' .. ARGV[2] .. ':' .. e, unpack(split(ARGV[3])))
"""
)

# KEYS[1]=live KEYS[2]=epochs KEYS[3]=seen; ARGV[1]=namespace ARGV[2]=replica ARGV[3]=now
_REGISTER = """
local old = redis.call('HGET', KEYS[1], ARGV[2])
if old then redis.call('UNLINK', ARGV[1] .. 'r:' .. ARGV[2] .. ':' .. old) end
local e = redis.call('HINCRBY', KEYS[2], ARGV[2], 1)
redis.call('HSET', KEYS[1], ARGV[2], e)
redis.call('ZADD', KEYS[3], ARGV[3], ARGV[2])
return e
"""

# KEYS[1]=live KEYS[2]=seen; ARGV[1]=namespace ARGV[2]=replica
_DROP = """
local old = redis.call('HGET', KEYS[1], ARGV[2])
if old then redis.call('UNLINK', ARGV[1] .. 'r:' .. ARGV[2] .. ':' .. old) end
redis.call('HDEL', KEYS[1], ARGV[2])
redis.call('ZREM', KEYS[2], ARGV[2])
return old and 1 or 0
"""

# KEYS[1]=live KEYS[2]=seen; ARGV[1]=replica ARGV[2]=now
_HEARTBEAT = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
return 1
"""


def _pack(hashes: Sequence[int]) -> bytes:
    return b"".join([h.to_bytes(8, "big") for h in hashes])


class RedisPrefixIndex:
    """The prefix index in Redis; satisfies :class:`cluster.index.PrefixIndex`.

    ``client`` may be passed in (a ``redis.asyncio.Redis`` with ``decode_responses=False``);
    otherwise one is built from ``config.redis_url``.
    """

    def __init__(
        self, config: IndexConfig, clock: Clock = time.time, client: Any | None = None
    ) -> None:
        import redis.asyncio as aioredis

        self.config = config
        self._clock = clock
        self._r = client or aioredis.Redis.from_url(
            config.redis_url,
            decode_responses=False,
            socket_timeout=config.socket_timeout_s,
            socket_connect_timeout=config.socket_timeout_s,
        )
        self._ns = config.namespace
        self._live = self._ns + "live"
        self._epochs = self._ns + "epochs"
        self._seen = self._ns + "seen"
        self._match = self._r.register_script(_MATCH)
        self._record = self._r.register_script(_WRITE.replace("{op}", "SADD"))
        self._evict = self._r.register_script(_WRITE.replace("{op}", "SREM"))
        self._register = self._r.register_script(_REGISTER)
        self._drop = self._r.register_script(_DROP)
        self._heartbeat = self._r.register_script(_HEARTBEAT)

    def set_key(self, replica: str, epoch: int) -> str:
        """The key of a replica's block set in one epoch."""
        return f"{self._ns}r:{replica}:{epoch}"

    def _floor(self) -> str:
        ttl = self.config.liveness_ttl_s
        return "" if ttl is None else repr(self._clock() - ttl)

    async def register(self, replica: str) -> int:
        keys = [self._live, self._epochs, self._seen]
        args = [self._ns, replica, repr(self._clock())]
        return int(await self._register(keys=keys, args=args))

    async def _write(self, script: Any, replica: str, hashes: Sequence[int]) -> bool:
        step = self.config.write_batch
        for i in range(0, max(len(hashes), 1), step):
            args: list[str | bytes] = [self._ns, replica, _pack(hashes[i : i + step])]
            if int(await script(keys=[self._live], args=args)) < 0:
                return False
        return True

    async def record(self, replica: str, hashes: Sequence[int]) -> bool:
        return await self._write(self._record, replica, hashes)

    async def evict(self, replica: str, hashes: Sequence[int]) -> bool:
        return await self._write(self._evict, replica, hashes)

    async def match(self, hashes: Sequence[int]) -> dict[str, int]:
        if not hashes:
            return {}
        args: list[str | bytes] = [self._ns, self._floor(), _pack(hashes)]
        flat = await self._match(keys=[self._live, self._seen], args=args)
        return {flat[i].decode(): int(flat[i + 1]) for i in range(0, len(flat), 2)}

    async def drop_replica(self, replica: str) -> None:
        await self._drop(keys=[self._live, self._seen], args=[self._ns, replica])

    async def heartbeat(self, replica: str) -> bool:
        keys = [self._live, self._seen]
        return bool(await self._heartbeat(keys=keys, args=[replica, repr(self._clock())]))

    async def live_replicas(self) -> dict[str, int]:
        live: dict[Any, Any] = await self._r.hgetall(self._live)
        out = {bytes(k).decode(): int(v) for k, v in live.items()}
        ttl = self.config.liveness_ttl_s
        if ttl is None or not out:
            return out
        floor = self._clock() - ttl
        seen = await self._r.zmscore(self._seen, list(out))
        return {r: e for (r, e), s in zip(out.items(), seen, strict=True) if s and s >= floor}

    async def entry_count(self) -> int:
        """Stored (block, replica) entries of live epochs (tests, benchmarks)."""
        live = await self.live_replicas()
        n = 0
        for r, e in live.items():
            n += int(await self._r.scard(self.set_key(r, e)))
        return n

    async def server_stats(self, reset: bool = False) -> dict[str, float]:
        """Redis's own time per script call (``INFO commandstats``, all scripts, all clients);
        ``reset`` zeroes the counters first (benchmarks)."""
        if reset:
            await self._r.config_resetstat()
            return {}
        stats: dict[str, Any] = await self._r.info("commandstats")
        ev = stats.get("cmdstat_evalsha", {"calls": 0, "usec": 0, "usec_per_call": 0.0})
        return {k: float(ev[k]) for k in ("calls", "usec", "usec_per_call")}

    async def clear_namespace(self) -> int:
        """Delete every key of this namespace (tests, benchmarks); returns how many."""
        n, batch = 0, []
        async for key in self._r.scan_iter(match=self._ns + "*", count=1000):
            batch.append(key)
            if len(batch) >= 1000:
                n += int(await self._r.unlink(*batch))
                batch = []
        if batch:
            n += int(await self._r.unlink(*batch))
        return n

    async def close(self) -> None:
        await self._r.aclose()
