"""Redis backend of the prefix index (redis-py's asyncio client, server-side Lua scripts).

Key layout, all under the namespace ``N = pdx:{<app>:<deployment>}:`` (the braces are a Redis
Cluster hash tag, so every key of one namespace is in one slot and the scripts may touch them
together; two apps, or the prefill and decode pools, never share a key):

=====================  ======  =============================================================
key                    type    content
=====================  ======  =============================================================
``N live``             HASH    replica -> live epoch (absent: dropped, or never registered)
``N epochs``           HASH    replica -> last epoch handed out (kept after a drop, so a
                               restarted replica gets a larger epoch and starts clean)
``N seen``             ZSET    replica -> time of its last heartbeat/register (caller's clock,
                               seconds); read only when ``liveness_ttl_s`` is set
``N b:<hash>``         HASH    replica -> epoch of its entry for block ``<hash>`` (16 lowercase
                               hex digits of the unsigned 64-bit hash)
=====================  ======  =============================================================

Every operation is one script call, so one round trip: ``match`` reads ``live`` (and ``seen``)
then the block hashes in prompt order and returns as soon as no live replica holds the next
block; ``record``/``evict`` write up to ``write_batch`` blocks per call and check the live
epoch inside the same script, so a dropped replica is never resurrected by a late write. After
a Redis restart ``live`` is empty, every write answers ``False``, and the feed re-registers and
re-records from its in-memory block sets.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from cluster.index import Clock, IndexConfig

_MATCH = """
local live = redis.call('HGETALL', KEYS[1])
local ttl = ARGV[1] ~= ''
local floor = ttl and tonumber(ARGV[1]) or 0
local cand = {}
local n = 0
for i = 1, #live, 2 do
  local ok = true
  if ttl then
    local s = redis.call('ZSCORE', KEYS[2], live[i])
    ok = s and tonumber(s) >= floor
  end
  if ok then cand[live[i]] = live[i + 1]; n = n + 1 end
end
local out = {}
if n == 0 then return out end
for k = 3, #KEYS do
  local fields = redis.call('HGETALL', KEYS[k])
  local nxt = {}
  local m = 0
  for i = 1, #fields, 2 do
    local r = fields[i]
    if cand[r] ~= nil and cand[r] == fields[i + 1] then nxt[r] = fields[i + 1]; m = m + 1 end
  end
  if k > 3 then
    for r, _ in pairs(cand) do
      if nxt[r] == nil then out[#out + 1] = r; out[#out + 1] = k - 3 end
    end
  end
  cand = nxt
  if m == 0 then return out end
end
for r, _ in pairs(cand) do out[#out + 1] = r; out[#out + 1] = #KEYS - 2 end
return out
"""

_RECORD = """
local e = redis.call('HGET', KEYS[1], ARGV[1])
if not e then return -1 end
for k = 2, #KEYS do redis.call('HSET', KEYS[k], ARGV[1], e) end
return #KEYS - 1
"""

_EVICT = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then return -1 end
for k = 2, #KEYS do redis.call('HDEL', KEYS[k], ARGV[1]) end
return #KEYS - 1
"""

_PURGE = """
local e = redis.call('HGET', KEYS[1], ARGV[1])
local n = 0
for k = 2, #KEYS do
  local v = redis.call('HGET', KEYS[k], ARGV[1])
  if v and v ~= e then redis.call('HDEL', KEYS[k], ARGV[1]); n = n + 1 end
end
return n
"""

_REGISTER = """
local e = redis.call('HINCRBY', KEYS[2], ARGV[1], 1)
redis.call('HSET', KEYS[1], ARGV[1], e)
redis.call('ZADD', KEYS[3], ARGV[2], ARGV[1])
return e
"""

_HEARTBEAT = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
return 1
"""


class RedisPrefixIndex:
    """The prefix index in Redis; satisfies :class:`cluster.index.PrefixIndex`.

    ``client`` may be passed in (an ``redis.asyncio.Redis`` with ``decode_responses=False``);
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
        ns = config.namespace
        self._block_prefix = ns + "b:"
        self._live = ns + "live"
        self._epochs = ns + "epochs"
        self._seen = ns + "seen"
        self._match = self._r.register_script(_MATCH)
        self._record = self._r.register_script(_RECORD)
        self._evict = self._r.register_script(_EVICT)
        self._purge = self._r.register_script(_PURGE)
        self._register = self._r.register_script(_REGISTER)
        self._heartbeat = self._r.register_script(_HEARTBEAT)

    def block_key(self, block_hash: int) -> str:
        return f"{self._block_prefix}{block_hash:016x}"

    def _keys(self, hashes: Sequence[int]) -> list[str]:
        p = self._block_prefix
        return [f"{p}{h:016x}" for h in hashes]

    def _floor(self) -> str:
        ttl = self.config.liveness_ttl_s
        return "" if ttl is None else repr(self._clock() - ttl)

    async def register(self, replica: str) -> int:
        keys = [self._live, self._epochs, self._seen]
        return int(await self._register(keys=keys, args=[replica, repr(self._clock())]))

    async def _write(self, script: Any, replica: str, hashes: Sequence[int]) -> bool:
        step = self.config.write_batch
        for i in range(0, max(len(hashes), 1), step):
            keys = [self._live, *self._keys(hashes[i : i + step])]
            if int(await script(keys=keys, args=[replica])) < 0:
                return False
        return True

    async def record(self, replica: str, hashes: Sequence[int]) -> bool:
        return await self._write(self._record, replica, hashes)

    async def evict(self, replica: str, hashes: Sequence[int]) -> bool:
        return await self._write(self._evict, replica, hashes)

    async def purge(self, replica: str, hashes: Sequence[int]) -> None:
        step = self.config.write_batch
        for i in range(0, len(hashes), step):
            keys = [self._live, *self._keys(hashes[i : i + step])]
            await self._purge(keys=keys, args=[replica])

    async def match(self, hashes: Sequence[int]) -> dict[str, int]:
        if not hashes:
            return {}
        keys = [self._live, self._seen, *self._keys(hashes)]
        flat = await self._match(keys=keys, args=[self._floor()])
        return {flat[i].decode(): int(flat[i + 1]) for i in range(0, len(flat), 2)}

    async def drop_replica(self, replica: str) -> None:
        async with self._r.pipeline(transaction=True) as p:
            p.hdel(self._live, replica)
            p.zrem(self._seen, replica)
            await p.execute()

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

    async def clear_namespace(self) -> int:
        """Delete every key of this namespace (tests, benchmarks); returns how many."""
        n, batch = 0, []
        async for key in self._r.scan_iter(match=self.config.namespace + "*", count=1000):
            batch.append(key)
            if len(batch) >= 1000:
                n += int(await self._r.unlink(*batch))
                batch = []
        if batch:
            n += int(await self._r.unlink(*batch))
        return n

    async def close(self) -> None:
        await self._r.aclose()
