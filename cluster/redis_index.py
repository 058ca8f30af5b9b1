"""Redis backend of the prefix index (server-side Lua scripts over redis-py's asyncio client,
which parses replies with hiredis when it is installed).

Key layout, all under the namespace ``N = pdx:{<app>:<deployment>}:`` (two apps, or the prefill
and decode pools, never share a key; the braces are a Redis Cluster hash tag, so all keys of
one namespace sit in one slot, and every script declares every key it touches):

=============  ======  ==========================================================================
key            type    content
=============  ======  ==========================================================================
``N live``     HASH    replica -> live epoch (absent: dropped or never registered)
``N epochs``   HASH    replica -> last epoch handed out (kept after a drop, so a restarted
                       replica gets a larger epoch and starts clean)
``N seen``     ZSET    replica -> time of its last heartbeat/register (caller's clock, seconds);
                       read only when ``liveness_ttl_s`` is set
``N slots``    HASH    replica -> its *slot* (a small int) for the live epoch; same fields as
                       ``live``
``N blocks``   HASH    block hash (8 bytes, the unsigned 64-bit hash, big-endian) -> holder
                       bitmap: slot ``s`` is bit ``s % 8`` of byte ``s // 8`` (byte 0 first);
                       trailing zero bytes are trimmed and a block no slot holds has no field
``N retired``  HASH    slot -> sweep pass that frees it: slots of dropped or superseded epochs
                       whose bits may still be set in ``blocks``
``N free``     ZSET    slots that no block mentions any more, ready for reuse (score = slot)
``N meta``     HASH    ``next`` (slots ever made), ``cursor`` and ``pass`` of the sweep
=============  ======  ==========================================================================

Lookups cost O(blocks), not O(replicas x blocks): ``match`` reads ``slots`` (and ``seen``),
then fetches the bitmaps of the prompt's blocks with ``HMGET`` in growing slices (8, 32, 128,
... blocks, so a prompt that misses early costs few probes) and narrows the set of replicas
still matching; a bitmap equal to the previous one (Lua strings are interned: one pointer
compare) cannot narrow it, which makes a prefix that every replica holds nearly free. The scan
stops at the first block no live replica holds. ``record``/``evict`` read the bitmaps of up to
``write_batch`` blocks and write back the changed ones (two ``HMGET``/``HSET`` calls), after
reading the replica's slot in the same script, so a dropped replica is never resurrected by a
late write.

Epochs and freeing: a slot belongs to one ``(replica, epoch)``. ``register`` and
``drop_replica`` move the old slot to ``retired`` and delete it from ``slots``, so its entries
vanish from lookups at once, in O(1). A slot is handed out again only after an incremental
*sweep* has cleared its bits from every block: each ``record``/``evict``/``heartbeat`` call
while ``retired`` is not empty also scans ``SWEEP_COUNT`` fields of ``blocks`` (``HSCAN``,
which returns every field present for a whole pass at least once), clearing retired bits and
deleting fields left empty. A slot retired before a pass starts is freed when that pass ends
(retired mid-pass: at the end of the next one), so no stale bit ever shows under a reused slot.
The memory of a dropped replica's entries is thus returned over the following writes (a pass
over ``B`` blocks takes ``B / SWEEP_COUNT`` calls) rather than at once; :meth:`sweep` drives
it by hand. After a Redis restart ``live`` is empty, every write answers ``False``, and the feed
re-registers and re-records from its in-memory block sets.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Sequence
from typing import Any

from cluster.index import Clock, IndexConfig

SWEEP_COUNT = 256
"""Fields of ``N blocks`` one write or heartbeat sweeps while some slot is retired."""

# Hashes travel as one argument, 8 bytes each, and are cut here: redis-py spends ~5 us packing
# each separate argument, Lua ~0.3 us per string.sub. Bitmaps are edited with arithmetic
# (bytes < 256, masks are powers of two). unpack() fails near 8,000 values: calls take at most
# 4,096 blocks (HMGET) or 2,048 field/value pairs (HSET).
_BITS = """
local function cut(s, i, j)
  local t = {}
  for b = i, j do t[#t + 1] = string.sub(s, b * 8 - 7, b * 8) end
  return t
end

local function has(v, bi, m)
  local c = string.byte(v, bi)
  return c ~= nil and c % (m + m) >= m
end
"""

# Every script but match: KEYS = live epochs seen slots blocks meta free retired
_LIB = (
    _BITS
    + """
local K_LIVE, K_EPOCHS, K_SEEN, K_SLOTS = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local K_BLOCKS, K_META, K_FREE, K_RETIRED = KEYS[5], KEYS[6], KEYS[7], KEYS[8]

-- v with d (+mask or -mask) added to byte bi (1-based), zero-padded; trailing zeros trimmed
local function flip(v, bi, d)
  if #v < bi then v = v .. string.rep('\\0', bi - #v) end
  v = string.sub(v, 1, bi - 1) .. string.char(string.byte(v, bi) + d) .. string.sub(v, bi + 1)
  local e = #v
  while e > 0 and string.byte(v, e) == 0 do e = e - 1 end
  return string.sub(v, 1, e)
end

local function bitpos(slot)
  local s = tonumber(slot)
  return math.floor(s / 8) + 1, 2 ^ (s % 8)
end

-- write changed bitmaps: set = {field, value, ...}, del = {field, ...}
local function store(set, del)
  for i = 1, #set, 4096 do
    redis.call('HSET', K_BLOCKS, unpack(set, i, math.min(#set, i + 4095)))
  end
  for i = 1, #del, 4096 do
    redis.call('HDEL', K_BLOCKS, unpack(del, i, math.min(#del, i + 4095)))
  end
end

local function retire(slot)
  local st = redis.call('HMGET', K_META, 'cursor', 'pass')
  local pass = tonumber(st[2] or '0')
  if st[1] and st[1] ~= '0' then pass = pass + 1 end  -- mid-pass: the next pass frees it
  redis.call('HSET', K_RETIRED, slot, pass)
end

-- One sweep step over up to ~count fields; returns 1 when no slot is left retired.
local function sweep(count)
  local ret = redis.call('HGETALL', K_RETIRED)
  if #ret == 0 then return 1 end
  local bis, ms = {}, {}
  for i = 1, #ret, 2 do bis[#bis + 1], ms[#ms + 1] = bitpos(ret[i]) end
  local st = redis.call('HMGET', K_META, 'cursor', 'pass')
  local pass = tonumber(st[2] or '0')
  local res = redis.call('HSCAN', K_BLOCKS, st[1] or '0', 'COUNT', count)
  local kv, set, del = res[2], {}, {}
  for i = 1, #kv, 2 do
    local v = kv[i + 1]
    local w = v
    for k = 1, #bis do
      if has(w, bis[k], ms[k]) then w = flip(w, bis[k], -ms[k]) end
    end
    if w ~= v then
      if w == '' then del[#del + 1] = kv[i] else set[#set + 1] = kv[i]; set[#set + 1] = w end
    end
  end
  store(set, del)
  if res[1] ~= '0' then
    redis.call('HSET', K_META, 'cursor', res[1])
    return 0
  end
  local left = 0
  for i = 1, #ret, 2 do
    if tonumber(ret[i + 1]) <= pass then
      redis.call('HDEL', K_RETIRED, ret[i])
      redis.call('ZADD', K_FREE, ret[i], ret[i])
    else
      left = left + 1
    end
  end
  redis.call('HSET', K_META, 'cursor', '0', 'pass', pass + 1)
  return left == 0 and 1 or 0
end
"""
)

# KEYS[1]=slots KEYS[2]=seen KEYS[3]=blocks; ARGV[1]=liveness floor or '' ARGV[2]=hashes
_MATCH = """
local sl = redis.call('HGETALL', KEYS[1])
if #sl == 0 then return {} end
local fresh = nil
if ARGV[1] ~= '' then
  fresh = {}
  for _, r in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], ARGV[1], '+inf')) do fresh[r] = true end
end
local names, bis, ms, run = {}, {}, {}, {}
for i = 1, #sl, 2 do
  if not fresh or fresh[sl[i]] then
    local s = tonumber(sl[i + 1])
    names[#names + 1] = sl[i]
    bis[#bis + 1] = math.floor(s / 8) + 1
    ms[#ms + 1] = 2 ^ (s % 8)
    run[#run + 1] = #names
  end
end
local hs = ARGV[2]
local nb = #hs / 8
local out, depth, last, size, gap = {}, 0, nil, 8, false
-- run: replicas holding every block so far; a replica leaving at block b held b - 1
while not gap and depth < nb and #run > 0 do
  local j = math.min(nb, depth + size)
  local vals = redis.call('HMGET', KEYS[3], unpack(cut(hs, depth + 1, j)))
  for k = 1, #vals do
    local v = vals[k]
    if not v then gap = true; break end
    if v ~= last then
      local keep = {}
      for _, i in ipairs(run) do
        if has(v, bis[i], ms[i]) then
          keep[#keep + 1] = i
        elseif depth > 0 then
          out[#out + 1] = names[i]; out[#out + 1] = depth
        end
      end
      run, last = keep, v
      if #run == 0 then break end
    end
    depth = depth + 1
  end
  size = math.min(size * 4, 4096)
end
if depth > 0 then
  for _, i in ipairs(run) do out[#out + 1] = names[i]; out[#out + 1] = depth end
end
return out
"""

# ARGV[1]=replica ARGV[2]=hashes ARGV[3]=sweep count; -1 when the replica is not live
_RECORD = """
local slot = redis.call('HGET', K_SLOTS, ARGV[1])
if not slot then return -1 end
local bi, m = bitpos(slot)
local nb = #ARGV[2] / 8
local set, n = {}, 0
for i = 1, nb, 4096 do
  local hs = cut(ARGV[2], i, math.min(nb, i + 4095))
  local vals = redis.call('HMGET', K_BLOCKS, unpack(hs))
  for k = 1, #hs do
    local v = vals[k] or ''
    if not has(v, bi, m) then
      set[#set + 1] = hs[k]; set[#set + 1] = flip(v, bi, m); n = n + 1
    end
  end
end
store(set, {})
sweep(tonumber(ARGV[3]))
return n
"""

_EVICT = """
local slot = redis.call('HGET', K_SLOTS, ARGV[1])
if not slot then return -1 end
local bi, m = bitpos(slot)
local nb = #ARGV[2] / 8
local set, del, n = {}, {}, 0
for i = 1, nb, 4096 do
  local hs = cut(ARGV[2], i, math.min(nb, i + 4095))
  local vals = redis.call('HMGET', K_BLOCKS, unpack(hs))
  for k = 1, #hs do
    local v = vals[k]
    if v and has(v, bi, m) then
      local w = flip(v, bi, -m)
      if w == '' then del[#del + 1] = hs[k] else set[#set + 1] = hs[k]; set[#set + 1] = w end
      n = n + 1
    end
  end
end
store(set, del)
sweep(tonumber(ARGV[3]))
return n
"""

# ARGV[1]=replica ARGV[2]=now
_REGISTER = """
local old = redis.call('HGET', K_SLOTS, ARGV[1])
if old then retire(old) end
local e = redis.call('HINCRBY', K_EPOCHS, ARGV[1], 1)
local free = redis.call('ZPOPMIN', K_FREE)
local slot = free[1] or (redis.call('HINCRBY', K_META, 'next', 1) - 1)
redis.call('HSET', K_LIVE, ARGV[1], e)
redis.call('HSET', K_SLOTS, ARGV[1], slot)
redis.call('ZADD', K_SEEN, ARGV[2], ARGV[1])
return e
"""

# ARGV[1]=replica
_DROP = """
local old = redis.call('HGET', K_SLOTS, ARGV[1])
if old then retire(old) end
redis.call('HDEL', K_LIVE, ARGV[1])
redis.call('HDEL', K_SLOTS, ARGV[1])
redis.call('ZREM', K_SEEN, ARGV[1])
return old and 1 or 0
"""

# ARGV[1]=replica ARGV[2]=now ARGV[3]=sweep count ARGV[4]=the keys' time to live (ms)
_HEARTBEAT = """
if redis.call('HEXISTS', K_LIVE, ARGV[1]) == 0 then return 0 end
redis.call('ZADD', K_SEEN, ARGV[2], ARGV[1])
sweep(tonumber(ARGV[3]))
for i = 1, #KEYS do redis.call('PEXPIRE', KEYS[i], ARGV[4]) end
return 1
"""

# ARGV[1]=count; 1 when nothing is left to sweep
_SWEEP = """
return sweep(tonumber(ARGV[1]))
"""


def _pack(hashes: Sequence[int]) -> bytes:
    return struct.pack(f">{len(hashes)}Q", *hashes)


def _bits(bitmap: bytes, slots: set[int] | None = None) -> int:
    """Set bits of ``bitmap`` (all, or only those of ``slots``)."""
    if slots is None:
        return sum(bin(c).count("1") for c in bitmap)
    return sum(1 for s in slots if s // 8 < len(bitmap) and bitmap[s // 8] >> (s % 8) & 1)


class RedisPrefixIndex:
    """The prefix index in Redis; satisfies :class:`cluster.index.PrefixIndex`.

    ``client`` may be passed in (a ``redis.asyncio.Redis`` with ``decode_responses=False``);
    otherwise one is built from ``config.redis_url`` (redis-py parses replies with hiredis when
    it is installed, as the ``cluster`` extra does).
    """

    def __init__(
        self,
        config: IndexConfig,
        clock: Clock = time.time,
        client: Any | None = None,
    ) -> None:
        import redis.asyncio as aioredis

        self.config = config
        self._clock = clock
        self._r = client or aioredis.Redis.from_url(
            config.redis_url,
            decode_responses=False,
            socket_timeout=config.socket_timeout_s,
            socket_connect_timeout=config.socket_timeout_s,
            **config.credentials().client_kwargs(),
        )
        self._ns = ns = config.namespace
        self._live, self._slots, self._blocks = ns + "live", ns + "slots", ns + "blocks"
        self._seen = ns + "seen"
        self._keys = [
            self._live, ns + "epochs", self._seen, self._slots,
            self._blocks, ns + "meta", ns + "free", ns + "retired",
        ]  # fmt: skip
        self._match_keys = [self._slots, self._seen, self._blocks]
        lib = self._r.register_script
        # run read-only (EVALSHA_RO, Redis 7): the ingress's user may only read the index
        # (cluster.redis_auth), and Redis checks a plain EVALSHA's keys for writing
        self._match = lib(_BITS + _MATCH)
        self._record = lib(_LIB + _RECORD)
        self._evict = lib(_LIB + _EVICT)
        self._register = lib(_LIB + _REGISTER)
        self._drop = lib(_LIB + _DROP)
        self._heartbeat = lib(_LIB + _HEARTBEAT)
        self._sweep = lib(_LIB + _SWEEP)

    def _floor(self) -> str:
        ttl = self.config.liveness_ttl_s
        return "" if ttl is None else repr(self._clock() - ttl)

    async def register(self, replica: str) -> int:
        return int(await self._register(keys=self._keys, args=[replica, repr(self._clock())]))

    async def _write(self, script: Any, replica: str, hashes: Sequence[int]) -> bool:
        step = self.config.write_batch
        for i in range(0, max(len(hashes), 1), step):
            args = [replica, _pack(hashes[i : i + step]), SWEEP_COUNT]
            if int(await script(keys=self._keys, args=args)) < 0:
                return False
        return True

    async def _read_only(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        """``script`` by EVALSHA_RO (loaded first when Redis does not have it)."""
        from redis.exceptions import NoScriptError

        try:
            return await self._r.evalsha_ro(script.sha, len(keys), *keys, *args)
        except NoScriptError:
            await self._r.script_load(script.script)
            return await self._r.evalsha_ro(script.sha, len(keys), *keys, *args)

    async def record(self, replica: str, hashes: Sequence[int]) -> bool:
        return await self._write(self._record, replica, hashes)

    async def evict(self, replica: str, hashes: Sequence[int]) -> bool:
        return await self._write(self._evict, replica, hashes)

    async def match(self, hashes: Sequence[int]) -> dict[str, int]:
        if not hashes:
            return {}
        flat = await self._read_only(self._match, self._match_keys, [self._floor(), _pack(hashes)])
        return {flat[i].decode(): int(flat[i + 1]) for i in range(0, len(flat), 2)}

    async def drop_replica(self, replica: str) -> None:
        await self._drop(keys=self._keys, args=[replica])

    async def heartbeat(self, replica: str) -> bool:
        """Mark ``replica`` alive; also refreshes every index key's time to live
        (``config.key_ttl_s``): the index's are the only keys of an app that carry one, so a
        Redis under ``maxmemory-policy volatile-lru`` evicts them first, never a tenant's rate
        limits or keys (:mod:`cluster.redis_auth`). Evicted entries come back as the feeds
        re-register and re-record, as after a Redis restart."""
        ttl_ms = int(self.config.key_ttl_s * 1000)
        args: list[str | int] = [replica, repr(self._clock()), SWEEP_COUNT, ttl_ms]
        return bool(await self._heartbeat(keys=self._keys, args=args))

    async def live_replicas(self) -> dict[str, int]:
        live: dict[Any, Any] = await self._r.hgetall(self._live)
        out = {bytes(k).decode(): int(v) for k, v in live.items()}
        ttl = self.config.liveness_ttl_s
        if ttl is None or not out:
            return out
        floor = self._clock() - ttl
        seen = await self._r.zmscore(self._seen, list(out))
        return {r: e for (r, e), s in zip(out.items(), seen, strict=True) if s and s >= floor}

    async def sweep(self, count: int = 4096) -> bool:
        """One sweep step over about ``count`` blocks (writes and heartbeats run these by
        themselves); ``True`` when no retired slot is left, i.e. every entry of a dropped or
        superseded epoch has been freed."""
        return bool(await self._sweep(keys=self._keys, args=[count]))

    async def _count(self, slots: set[int] | None) -> int:
        n = 0
        async for _, bitmap in self._r.hscan_iter(self._blocks, count=1000):
            n += _bits(bytes(bitmap), slots)
        return n

    async def entry_count(self) -> int:
        """Stored (block, replica) entries of live epochs (tests, benchmarks; scans ``blocks``)."""
        live = await self.live_replicas()
        slots: dict[Any, Any] = await self._r.hgetall(self._slots)
        return await self._count({int(s) for r, s in slots.items() if bytes(r).decode() in live})

    async def stored_entries(self) -> int:
        """Every (block, slot) bit still stored, retired slots included (tests)."""
        return await self._count(None)

    async def server_stats(self, reset: bool = False) -> dict[str, float]:
        """Redis's own time per script call (``INFO commandstats``, all scripts, all clients);
        ``reset`` zeroes the counters first (benchmarks)."""
        if reset:
            await self._r.config_resetstat()
            return {}
        stats: dict[str, Any] = await self._r.info("commandstats")
        ev = stats.get("cmdstat_evalsha", {"calls": 0, "usec": 0, "usec_per_call": 0.0})
        return {k: float(ev[k]) for k in ("calls", "usec", "usec_per_call")}

    async def memory_bytes(self) -> int:
        """Redis's ``used_memory`` (the whole server, not only this namespace; benchmarks)."""
        info: dict[str, Any] = await self._r.info("memory")
        return int(info["used_memory"])

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
