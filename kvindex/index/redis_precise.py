"""The precise index on Redis: one store shared by every kvindex replica.

Semantics are ``kvindex.index.precise.PreciseIndex``'s, reproduced exactly: a batch is replayed
client-side on a small *overlay* (a ``PreciseIndex`` holding only the worker's entries the batch
can see), so keys, orphans, copies and media follow the very same code; the store receives the
resulting differences and applies them in one server-side script. The common batch (GPU stores
that all get keys, of hashes not held yet, and removals, on a worker holding GPU blocks only, none
keyless or copied among those the batch names) is planned without the overlay (``plan_fast``): the
same plan, at a fraction of the cost; anything else falls back to the replay.

Invariants:
- Every key of one model carries the hash tag ``{<model id>}``, so each script touches one slot
  (Redis Cluster). Global keys: ``<prefix>:gen`` (the store's generation), ``<prefix>:mid`` (HASH
  model -> its small id, allocated from ``<prefix>:mid:n`` by the first client needing it),
  ``<prefix>:pods`` (HASH pod -> model, for load_entries).
- Layout under ``B = <prefix>:{<model id>}:``: ``gen`` (copy of the generation), ``bs`` (block
  size), ``off`` (set once a cpu/disk copy was held), ``s:<stream id>`` HASH q(last seq) e(epoch)
  y(synced) r(reason); workers: ``W`` HASH "rank|pod" -> slot (``N``: its inverse), ``slots`` bitmap of slots in use (the
  lowest free slot is reused, as PreciseIndex reuses bits), ``v`` HASH "rank|pod" -> version (bumped
  by every write to the worker, never deleted: a recreated worker is a new version), ``w:<slot>``
  HASH n(name) M(media in first-store order, "\\n"-joined) o(orphans) c(entries);
  ``b:<slot>:<i>:<bucket>`` HASH engine hash -> key or "o" of the i-th medium, in 128 buckets by the
  hash's low 7 bits (listpack hashes up to Redis's default hash-max-listpack-entries, 512: ~25 bytes
  per entry, listpack up to ~65k hashes per worker and medium; few buckets: a batch's hashes share
  them, and each bucket touched costs the scripts one call), ``k:<slot>:<i>`` bitmap of the
  buckets that may be in use (a superset: an emptied bucket keeps its bit until the worker goes),
  ``x:<slot>`` HASH "<i>:<hash>" -> copies beyond the first; holders per tier t in g|c|d:
  ``t:<key>`` bitmap of the slots holding the key (PreciseIndex's ``_holders`` bitmask), and per
  worker ``D:<slot>`` HASH holder key name -> its copies beyond the first (``_dups``). Engine hashes
  and keys are 8 big-endian bytes (binary strings: compact, and Lua never turns them into
  numbers); a batch's bulk arguments (hashes per bucket, entries per bucket, holder changes) travel
  msgpack-encoded and are unpacked in C (``cmsgpack``): the scripts do no per-entry parsing, and a
  batch costs about one Redis call per bucket touched plus a few (one MGET / MSET / DEL for all its
  holder bitmaps); seqs and epochs are decimal strings that Lua compares as numbers (exact below
  2^53).
- ``apply`` = at most two round trips: a read script (position, block size, worker version and the
  entries of every hash the batch names), then, unless the read already shows the batch is not to
  be applied, the apply script. It re-judges the position (``judge``/``next_position`` of base.py),
  re-checks the worker version and block size it was computed from (else the client recomputes),
  and writes everything or nothing: the scripts validate before their first write. A batch of
  clears only (nothing to read) is one round trip. A call that timed out may still have been
  applied; offering it again is safe (DUPLICATE).
- Every script checks the model slot's generation copy against the one read at ``open()``; a
  mismatch (Redis restarted empty, or another generation) raises ``StoreLost``. Connection and
  timeout errors raise ``StoreUnavailable("redis at <url>: <reason>")``.
- ``match`` takes an optional keyword ``model``: with it, one round trip (the prefix walk over the
  holder bitmaps for all candidate workers runs server-side); without it, every model is walked
  (two round trips), since a key does not say which model's slot holds it.
- A pod's streams share the pod's model: ``restart`` clears the pod's ranks in its stream's model;
  ``clear_pod``, ``pods``, ``blocks_held``, ``engine_hashes`` and ``export_entries`` visit every model.
- ``load_entries`` needs each pod's model: it is the model of the pod's streams applied or
  positioned through this store (``<prefix>:pods``); an entry of an unknown pod is refused.
"""

from __future__ import annotations

import secrets
import struct
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

import msgpack
import redis.asyncio as aioredis
import redis.exceptions as rex

from kvindex import keys as K
from kvindex.events import GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvindex.index.precise import ORPHAN, WorkerReplay, tier_of
from kvindex.index.protocol import ApplyResult, StoreLost, StoreUnavailable
from kvindex.sequence import Outcome, Position, StreamRef, judge
from kvindex.types import Applied, Entry, PodMatch

RETRIES = 16  # optimistic recomputations of one batch when another writer changed its worker
_TIER_CHAR = {"gpu": "g", "cpu": "c", "disk": "d"}
_packb = msgpack.Packer(use_bin_type=False).pack  # the scripts' cmsgpack reads str, not bin
BUCKET_MASK = 127  # a hash's bucket: its low 7 bits (bucket_of in the script)
_DIGITS = tuple(str(b).encode() for b in range(BUCKET_MASK + 1))  # a bucket's number as its key names it
UNCHANGED = (1 << 32) - 1  # extra copies not changed

LUA = r"""
local op, base = ARGV[1], ARGV[3]
if redis.call('GET', KEYS[1]) ~= ARGV[2] then return {'lost'} end
local band, bor, bxor = bit.band, bit.bor, bit.bxor
local BIT = {[0] = 128, 64, 32, 16, 8, 4, 2, 1}  -- bit b of a byte, most significant first (SETBIT's order)

-- hot paths never turn numbers into strings by concatenation (Lua formats them with %.14g: slow);
-- bulk arguments arrive msgpack-encoded (cmsgpack unpacks them in C)
local function split(s)
  local out = {}
  if s then for part in string.gmatch(s, '[^\n]+') do out[#out + 1] = part end end
  return out
end
local function tier(m)
  if m == 'GPU' then return 'g' elseif string.sub(m, 1, 3) == 'CPU' then return 'c' end
  return 'd'
end
local function hmget(key, fields)
  if #fields <= 4000 then return redis.call('HMGET', key, unpack(fields)) end
  local out = {}
  for i = 1, #fields, 4000 do
    local part = redis.call('HMGET', key, unpack(fields, i, math.min(i + 3999, #fields)))
    for j = 1, #part do out[#out + 1] = part[j] end
  end
  return out
end
local function chunked(cmd, key, args, step)  -- cmd [key] args..., at most ``step`` args per call
  if #args == 0 then return end
  for i = 1, #args, step do
    if key then redis.call(cmd, key, unpack(args, i, math.min(i + step - 1, #args)))
    else redis.call(cmd, unpack(args, i, math.min(i + step - 1, #args))) end
  end
end
local function call_range(cmd, key, flat, a, n)  -- cmd key flat[a .. a + n - 1]: the replies, joined
  local last = a + n - 1
  if n <= 4000 then return redis.call(cmd, key, unpack(flat, a, last)) end
  local out = {}
  for i = a, last, 4000 do
    local part = redis.call(cmd, key, unpack(flat, i, math.min(i + 3999, last)))
    if type(part) == 'table' then for j = 1, #part do out[#out + 1] = part[j] end end
  end
  return out
end
local function mget(names)
  local out = {}
  for i = 1, #names, 4000 do
    local part = redis.call('MGET', unpack(names, i, math.min(i + 3999, #names)))
    for j = 1, #part do out[#out + 1] = part[j] end
  end
  return out
end
local function parse_name(name)
  local rank, pod = string.match(name, '^([^|]*)|(.*)$')
  return rank, pod
end
local function workers_of(pod, rank)  -- {name, slot} of the pod's workers (one rank, or all when rank is nil)
  local all, out = redis.call('HGETALL', base .. 'W'), {}
  for i = 1, #all, 2 do
    local r, p = parse_name(all[i])
    if p == pod and (rank == nil or r == rank) then out[#out + 1] = {all[i], all[i + 1]} end
  end
  return out
end

-- holders of (tier, key): bit ``slot`` of the string t:key (read with one MGET and written with
-- one MSET / DEL per batch, the bits computed here), copies beyond the first in the worker's HASH
-- D:<slot> "<tier char><key>" -> count
local function with_bit(s, pos, on)  -- bitmap s (false: none) with bit pos set or cleared
  s = s or ''
  local j, m = math.floor(pos / 8) + 1, BIT[pos % 8]
  if #s < j then
    if not on then return s end
    s = s .. string.rep('\0', j - #s)
  end
  local old = string.byte(s, j)
  local new = on and bor(old, m) or band(old, 255 - m)
  if new == old then return s end
  return string.sub(s, 1, j - 1) .. string.char(new) .. string.sub(s, j + 1)
end
local function has_bit(s, pos)
  if not s then return false end
  local b = string.byte(s, math.floor(pos / 8) + 1)
  return b ~= nil and band(b, BIT[pos % 8]) ~= 0
end
local offload_marked = false
local function mark_offload()  -- sticky: offload tiers in use
  if not offload_marked then redis.call('SET', base .. 'off', '1'); offload_marked = true end
end
-- names[i] (holder key names, each once) change by deltas[i] copies held by ``slot``. The common
-- cases cost no call of their own: a new key held by the slot alone (one MSET for all) and the
-- slot's last copy of a key only it holds (one DEL for all); the rest is computed bit by bit.
local function apply_holders(slot, names, deltas)
  local n = #names
  if n == 0 then return end
  local pos, dkey = tonumber(slot), base .. 'D:' .. slot
  local solo, bits = with_bit(false, pos, true), mget(names)
  local dups = redis.call('EXISTS', dkey) == 1
  local sets, dels, slow, ns, nd, bj, bm = {}, {}, {}, 0, 0, math.floor(pos / 8) + 1, BIT[pos % 8]
  for i = 1, n do  -- one copy more or less, no duplicate: decided here (one-byte bitmaps inline)
    local b, d, fast = bits[i], deltas[i], false
    if not b then
      if d == 1 then sets[ns + 1] = names[i]; sets[ns + 2] = solo; ns = ns + 2; fast = true end
    elseif not dups and (d == 1 or d == -1) then
      local old = string.byte(b, bj)
      local held = old ~= nil and band(old, bm) ~= 0
      if d == -1 and b == solo then nd = nd + 1; dels[nd] = names[i]; fast = true
      elseif #b == 1 and old ~= nil and held == (d == -1) then
        local x = d == 1 and bor(old, bm) or band(old, 255 - bm)
        if x == 0 then nd = nd + 1; dels[nd] = names[i]
        else sets[ns + 1] = names[i]; sets[ns + 2] = string.char(x); ns = ns + 2 end
        fast = true
      end
    end
    if not fast then slow[#slow + 1] = i end
  end
  local extras, dset, ddel = {}, {}, {}
  if dups and #slow > 0 then
    local fields = {}
    for j, i in ipairs(slow) do fields[j] = names[i] end
    extras = hmget(dkey, fields)
  end
  for j, i in ipairs(slow) do
    local b, held = bits[i], has_bit(bits[i], pos)
    local extra = held and tonumber(extras[j]) or 0
    local after = (held and 1 + extra or 0) + deltas[i]
    if after > 0 then
      if not held then sets[#sets + 1] = names[i]; sets[#sets + 1] = with_bit(b, pos, true) end
      if after - 1 ~= extra then
        if after == 1 then ddel[#ddel + 1] = names[i] else dset[#dset + 1] = names[i]; dset[#dset + 1] = string.format('%d', after - 1) end
      end
    else
      if held then
        local left = with_bit(b, pos, false)
        if string.find(left, '[^%z]') then sets[#sets + 1] = names[i]; sets[#sets + 1] = left
        else dels[#dels + 1] = names[i] end
      end
      if extra > 0 then ddel[#ddel + 1] = names[i] end
    end
  end
  chunked('MSET', false, sets, 4000)
  chunked('DEL', false, dels, 4000)
  chunked('HSET', dkey, dset, 4000)
  chunked('HDEL', dkey, ddel, 4000)
end

-- a worker's engine hashes of one medium live in 128 hashes by the hash's low 7 bits
-- (listpack-encoded while a bucket holds at most hash-max-listpack-entries: up to ~65k hashes per
-- worker and medium); the bitmap k:<slot>:<i> marks the buckets that may be in use (a superset:
-- a bucket emptied keeps its bit until the worker goes)
local function bucket_of(h) return string.byte(h, 8) % 128 end
local function bucket_prefix(slot, idx) return base .. 'b:' .. slot .. ':' .. idx .. ':' end
local function set_entry(slot, idx, h, v)
  local b = bucket_of(h)
  local added = redis.call('HSET', bucket_prefix(slot, idx) .. b, h, v)
  if added == 1 then redis.call('SETBIT', base .. 'k:' .. slot .. ':' .. idx, b, 1) end
  return added
end
local function buckets_used(slot, idx)  -- bucket key names of one medium
  local used, out = redis.call('GET', base .. 'k:' .. slot .. ':' .. idx) or '', {}
  for j = 1, #used do
    local byte = string.byte(used, j)
    for b = 0, 7 do
      if band(byte, BIT[b]) ~= 0 then out[#out + 1] = base .. 'b:' .. slot .. ':' .. idx .. ':' .. ((j - 1) * 8 + b) end
    end
  end
  return out
end
local function medium_entries(slot, idx)  -- flat {hash, key or 'o', ...} of one medium
  local out = {}
  for _, bkey in ipairs(buckets_used(slot, idx)) do
    local all = redis.call('HGETALL', bkey)
    for j = 1, #all do out[#out + 1] = all[j] end
  end
  return out
end

local function clear_worker(name, slot)
  local media = split(redis.call('HGET', base .. 'w:' .. slot, 'M'))
  local names, deltas, seen = {}, {}, {}
  for i, m in ipairs(media) do
    local pre = base .. tier(m) .. ':'
    local buckets = buckets_used(slot, i)
    for _, bkey in ipairs(buckets) do
      local all = redis.call('HGETALL', bkey)
      for j = 2, #all, 2 do
        local v = all[j]
        if v ~= 'o' then
          local name = pre .. v
          if not seen[name] then seen[name] = true; names[#names + 1] = name; deltas[#deltas + 1] = -1 end
        end
      end
    end
    chunked('DEL', false, buckets, 4000)
    redis.call('DEL', base .. 'k:' .. slot .. ':' .. i)
  end
  redis.call('DEL', base .. 'D:' .. slot)  -- first: every holding goes, whatever its copies
  apply_holders(slot, names, deltas)
  redis.call('DEL', base .. 'x:' .. slot, base .. 'w:' .. slot)
  redis.call('HDEL', base .. 'W', name)
  redis.call('HDEL', base .. 'N', slot)
  redis.call('SETBIT', base .. 'slots', slot, 0)
  redis.call('HINCRBY', base .. 'v', name, 1)
end
local function read_pos(key) return redis.call('HMGET', key, 'q', 'e', 'y', 'r') end
local function write_pos(key, q, e, y, r)
  local fields = {'e', e, 'y', y}
  if q then fields[#fields + 1] = 'q'; fields[#fields + 1] = q end
  if r then fields[#fields + 1] = 'r'; fields[#fields + 1] = r end
  redis.call('DEL', key)
  redis.call('HSET', key, unpack(fields))
end
local function judge(p, seq, epoch, forced)
  if not p[2] then return 'applied' end
  local e = tonumber(p[2])
  if epoch < e then return 'stale' end
  if epoch > e then return 'behind' end
  if not p[1] then return 'applied' end
  local last = tonumber(p[1])
  if seq <= last then return 'duplicate' end
  if seq > last + 1 and not forced then return 'gap' end
  return 'applied'
end
local function new_worker(name, media)  -- the lowest free slot, as PreciseIndex reuses its bits
  local slot = tostring(redis.call('BITPOS', base .. 'slots', 0))
  redis.call('SETBIT', base .. 'slots', slot, 1)
  redis.call('HSET', base .. 'W', name, slot)
  redis.call('HSET', base .. 'N', slot, name)
  redis.call('HSET', base .. 'w:' .. slot, 'n', name, 'M', media, 'o', 0, 'c', 0)
  return slot
end
local function count_entries(name, slot, delta)  -- a worker without entries is freed
  if redis.call('HINCRBY', base .. 'w:' .. slot, 'c', delta) <= 0 then
    for i = 1, #split(redis.call('HGET', base .. 'w:' .. slot, 'M')) do redis.call('DEL', base .. 'k:' .. slot .. ':' .. i) end
    redis.call('DEL', base .. 'w:' .. slot)
    redis.call('HDEL', base .. 'W', name)
    redis.call('HDEL', base .. 'N', slot)
    redis.call('SETBIT', base .. 'slots', slot, 0)
  end
end

-- ARGV[4] worker name, ARGV[5] the hashes grouped per bucket, msgpack [[bucket digits, ...],
-- [number of hashes, ...], [hash, ...]] (unpacked in C: no per-hash work here). Replies position, block size, version,
-- media, orphans, then per medium the values of the hashes in the order sent (key, 'o' or nil)
-- and their extra copies (false when the worker has none)
local function read_worker()
  local name = ARGV[4]
  local p = read_pos(KEYS[2])
  local slot = redis.call('HGET', base .. 'W', name)
  local out = {'ok', p[1], p[2], p[3], p[4], redis.call('GET', base .. 'bs'),
               redis.call('HGET', base .. 'v', name) or '0', false, 0}
  if not slot then return out end
  local meta = redis.call('HMGET', base .. 'w:' .. slot, 'M', 'o')
  out[8], out[9] = meta[1], tonumber(meta[2]) or 0
  if #ARGV[5] == 0 then return out end
  local groups = cmsgpack.unpack(ARGV[5])
  local digits, counts, flat = groups[1], groups[2], groups[3]
  local xkey = base .. 'x:' .. slot
  local extras = redis.call('EXISTS', xkey) == 1
  for i in ipairs(split(meta[1])) do
    local pre, values, at = bucket_prefix(slot, i), {}, 1
    for g = 1, #digits do values[g] = call_range('HMGET', pre .. digits[g], flat, at, counts[g]); at = at + counts[g] end
    out[#out + 1] = values
    if extras then
      local fields, ip = {}, string.format('%d:', i)
      for j = 1, #flat do fields[j] = ip .. flat[j] end
      out[#out + 1] = hmget(xkey, fields)
    else
      out[#out + 1] = false
    end
  end
  return out
end

-- The entries written (msgpack, unpacked in C; b'': none), one group per bucket: ``sets``
-- [[medium index, ...], [bucket digits, ...], [bucket, ...], [number of fields, ...], [hash, key
-- or 'o', ...]] and ``dels`` [[medium index, ...], [bucket digits, ...], [number of hashes, ...],
-- [hash, ...]]; ``extras`` [[field "<i>:<hash>", ...] to delete, [field, copies
-- beyond the first, ...] to set]. One entry per (medium, hash).
local function write_entries(slot, sets, dels, extras)
  local pfx = {}
  local function prefix(idx)
    local p = pfx[idx]
    if not p then p = bucket_prefix(slot, idx); pfx[idx] = p end
    return p
  end
  if #dels > 0 then
    local d = cmsgpack.unpack(dels)
    local idxs, digits, counts, flat, at = d[1], d[2], d[3], d[4], 1
    for g = 1, #idxs do call_range('HDEL', prefix(idxs[g]) .. digits[g], flat, at, counts[g]); at = at + counts[g] end
  end
  if #sets > 0 then
    local used = {}  -- medium index -> {its bitmap of buckets in use, as read}
    local t = cmsgpack.unpack(sets)
    local idxs, digits, buckets, counts, flat, at = t[1], t[2], t[3], t[4], t[5], 1
    for g = 1, #idxs do
      local idx = idxs[g]
      call_range('HSET', prefix(idx) .. digits[g], flat, at, counts[g])
      at = at + counts[g]
      local k = used[idx]
      if not k then
        local name = base .. 'k:' .. slot .. ':' .. string.format('%d', idx)
        k = {name, redis.call('GET', name)}
        used[idx] = k
      end
      if not has_bit(k[2], buckets[g]) then redis.call('SETBIT', k[1], digits[g], '1') end
    end
  end
  if #extras > 0 then
    local x, xkey = cmsgpack.unpack(extras), base .. 'x:' .. slot
    chunked('HDEL', xkey, x[1], 4000)
    chunked('HSET', xkey, x[2], 4000)
  end
end
-- holder changes: msgpack [[holder key name, ...], [change of copies, ...], offload] (one per
-- name; offload 1 when an offload tier gains copies)
local function write_holders(slot, changes)
  if #changes == 0 then return end
  local h = cmsgpack.unpack(changes)
  if h[3] == 1 then mark_offload() end
  apply_holders(slot, h[1], h[2])
end
local function write_worker(name, reset, order, orphans, sets, dels, extras, changes, counted)
  redis.call('HINCRBY', base .. 'v', name, 1)
  local slot = redis.call('HGET', base .. 'W', name)
  if slot and reset then clear_worker(name, slot); slot = false end
  if #sets == 0 and #dels == 0 and #extras == 0 and not slot then return end
  if not slot then slot = new_worker(name, order) end
  redis.call('HSET', base .. 'w:' .. slot, 'M', order, 'o', orphans)
  write_entries(slot, sets, dels, extras)
  write_holders(slot, changes)
  count_entries(name, slot, counted)
end

-- ARGV[4] seq, [5] epoch, [6] '-' or '+reason', [7] cleared, [8] name, [9] version read ('*': any),
-- [10] block size read ('*': any), [11] block size to set, [12] reset, [13] media order, [14] orphans,
-- [15] sets, [16] dels, [17] extras (see write_entries), [18] holder changes (see write_holders),
-- [19] change of the number of entries held
local function apply_batch()
  local p = read_pos(KEYS[2])
  local seq, epoch, forced = tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6] ~= '-'
  local outcome = judge(p, seq, epoch, forced)
  if outcome ~= 'applied' then return {outcome, p[1], p[2], p[3], p[4]} end
  local name = ARGV[8]
  if (ARGV[9] ~= '*' and (redis.call('HGET', base .. 'v', name) or '0') ~= ARGV[9])
     or (ARGV[10] ~= '*' and (redis.call('GET', base .. 'bs') or '') ~= ARGV[10]) then
    return {'retry'}
  end
  if ARGV[11] ~= '' then redis.call('SET', base .. 'bs', ARGV[11]) end
  local slot = redis.call('HGET', base .. 'W', name)
  local written = #ARGV[15] > 0 or #ARGV[16] > 0 or #ARGV[17] > 0
  if ARGV[12] == '1' or written or (slot and redis.call('HGET', base .. 'w:' .. slot, 'M') ~= ARGV[13]) then
    write_worker(name, ARGV[12] == '1', ARGV[13], ARGV[14], ARGV[15], ARGV[16], ARGV[17], ARGV[18], tonumber(ARGV[19]))
  end
  local y, r = p[3], p[4]
  if forced then y, r = '0', string.sub(ARGV[6], 2)
  elseif ARGV[7] == '1' or not p[2] then y, r = '1', false end
  write_pos(KEYS[2], ARGV[4], ARGV[5], y, r)
  return {'applied', ARGV[4], ARGV[5], y, r}
end

-- ARGV[4] pod, [5] seen epoch, [6] ranks ('*': all, else ','-joined)
local function restart()
  local p = read_pos(KEYS[2])
  if tonumber(p[2] or '0') ~= tonumber(ARGV[5]) then return {'pos', p[1], p[2], p[3], p[4]} end
  local ranks = nil
  if ARGV[6] ~= '*' then ranks = {}; for r in string.gmatch(ARGV[6], '[^,]+') do ranks[r] = true end end
  for _, w in ipairs(workers_of(ARGV[4], nil)) do
    local r = parse_name(w[1])
    if ranks == nil or ranks[r] then clear_worker(w[1], w[2]) end
  end
  local e = tostring(tonumber(ARGV[5]) + 1)
  write_pos(KEYS[2], false, e, '1', false)
  return {'pos', false, e, '1', false}
end

-- the prefix walk over bitmaps: alive sets are arrays of bytes, bit (7 - s % 8) of byte s // 8 + 1
local function bytes_of(s)
  local out = {}
  for j = 1, #s do out[j] = string.byte(s, j) end
  return out
end
local function note_dropped(depths, j, bits, depth)
  if bits == 0 then return end
  for b = 0, 7 do
    if band(bits, BIT[b]) ~= 0 then depths[(j - 1) * 8 + b] = depth end
  end
end
local function candidates(npods)
  if npods < 0 then return bytes_of(redis.call('GET', base .. 'slots') or '') end
  local wanted, out = {}, {}
  for i = 5, 4 + npods do wanted[ARGV[i]] = true end
  local all = redis.call('HGETALL', base .. 'W')
  for i = 1, #all, 2 do
    local _, pod = parse_name(all[i])
    if wanted[pod] then
      local s = tonumber(all[i + 1])
      local j = math.floor(s / 8) + 1
      for k = #out + 1, j do out[k] = 0 end
      out[j] = bor(out[j], BIT[s % 8])
    end
  end
  return out
end

local CHUNK = 64  -- keys fetched per MGET (a walk reads at most CHUNK - 1 keys past its end)
local function holders_from(packed, first, offload)  -- bitmaps of CHUNK keys: g (and c, d) per key
  local names = {}
  for i = first, math.min(first + 8 * CHUNK, #packed + 1) - 8, 8 do
    local k = string.sub(packed, i, i + 7)
    names[#names + 1] = base .. 'g:' .. k
    if offload then names[#names + 1] = base .. 'c:' .. k; names[#names + 1] = base .. 'd:' .. k end
  end
  if #names == 0 then return {} end
  return redis.call('MGET', unpack(names))
end
-- one key of the walk without offload tiers (the three alive sets are one: w.d)
local function narrow_gpu(w, g, depth)
  local any, alive, dep = false, w.d, w.ddep
  for j = 1, #alive do
    local a = alive[j]
    if a ~= 0 then
      local y = band(a, string.byte(g, j) or 0)
      if y ~= a then note_dropped(dep, j, bxor(a, y), depth); alive[j] = y end
      if y ~= 0 then any = true end
    end
  end
  return any
end
-- one key of the walk: narrow the three alive sets (w.g within w.c within w.d), noting at
-- ``depth`` the workers each drops; returns whether any worker is left
local function narrow(w, g, c, d, depth)
  local any = false
  for j = 1, #w.d do
    local a = w.d[j]
    if a ~= 0 then
      local gb, cb, db = string.byte(g, j) or 0, string.byte(c, j) or 0, string.byte(d, j) or 0
      local x = w.g[j]
      local y = band(x, gb)
      if y ~= x then note_dropped(w.gdep, j, bxor(x, y), depth); w.g[j] = y end
      x = w.c[j]; y = band(x, bor(gb, cb))
      if y ~= x then note_dropped(w.cdep, j, bxor(x, y), depth); w.c[j] = y end
      y = band(a, bor(gb, cb, db))
      if y ~= a then note_dropped(w.ddep, j, bxor(a, y), depth); w.d[j] = y end
      if y ~= 0 then any = true end
    end
  end
  return any
end

-- ARGV[4] number of pods (-1: all), then pods, then the keys (8 bytes each, concatenated):
-- per worker with a match {name, g, c, d}. Consecutive keys mostly have the same holders: the
-- bitmaps (interned Lua strings) are compared with the previous key's first, bytes only on change.
local function match()
  local npods = tonumber(ARGV[4])
  local packed = ARGV[5 + math.max(npods, 0)]
  local w = {d = candidates(npods), g = {}, c = {}, gdep = {}, cdep = {}, ddep = {}}
  for j = 1, #w.d do w.g[j], w.c[j] = w.d[j], w.d[j] end
  local offload = redis.call('EXISTS', base .. 'off') == 1
  local pg, pc, pd, depth, alive = false, false, false, 0, true
  for first = 1, #packed - 7, 8 * CHUNK do
    local r = holders_from(packed, first, offload)
    if offload then
      for j = 1, #r, 3 do
        local g, c, d = r[j] or '', r[j + 1] or '', r[j + 2] or ''
        if not (g == pg and c == pc and d == pd) and not narrow(w, g, c, d, depth) then alive = false; break end
        pg, pc, pd, depth = g, c, d, depth + 1
      end
    else
      for j = 1, #r do
        local g = r[j] or ''
        if g ~= pg and not narrow_gpu(w, g, depth) then alive = false; break end
        pg, depth = g, depth + 1
      end
    end
    if not alive then break end
  end
  if not offload then w.g, w.c, w.gdep, w.cdep = w.d, w.d, w.ddep, w.ddep end  -- one set: every tier alike
  for j = 1, #w.d do
    if offload then note_dropped(w.gdep, j, w.g[j], depth); note_dropped(w.cdep, j, w.c[j], depth) end
    note_dropped(w.ddep, j, w.d[j], depth)
  end
  local out, slots = {}, {}
  for s, d in pairs(w.ddep) do
    if d > 0 then
      slots[#slots + 1] = s
      out[#out + 1] = false; out[#out + 1] = w.gdep[s]; out[#out + 1] = w.cdep[s]; out[#out + 1] = d
    end
  end
  if #slots > 0 then
    local names = hmget(base .. 'N', slots)
    for i = 1, #slots do out[4 * i - 3] = names[i] end
  end
  return out
end

-- ARGV[4] pod, [5] rank or '*'
local function clear_pod()
  local rank = ARGV[5]
  if rank == '*' then rank = nil end
  for _, w in ipairs(workers_of(ARGV[4], rank)) do clear_worker(w[1], w[2]) end
  return {'ok'}
end

-- ARGV[4] pod: copies held {gpu, cpu, disk, orphans}, counted here (nothing but counts travels)
local function held()
  local out, at = {0, 0, 0, 0}, {g = 1, c = 2, d = 3}
  for _, w in ipairs(workers_of(ARGV[4], nil)) do
    local slot = w[2]
    local meta = redis.call('HMGET', base .. 'w:' .. slot, 'M', 'o')
    local media = split(meta[1])
    for i, m in ipairs(media) do
      for _, bkey in ipairs(buckets_used(slot, i)) do out[at[tier(m)]] = out[at[tier(m)]] + redis.call('HLEN', bkey) end
    end
    local extras = redis.call('HGETALL', base .. 'x:' .. slot)
    for j = 1, #extras, 2 do
      local idx = tonumber(string.match(extras[j], '^(%d+):'))
      out[at[tier(media[idx])]] = out[at[tier(media[idx])]] + tonumber(extras[j + 1])
    end
    out[4] = out[4] + (tonumber(meta[2]) or 0)
  end
  return out
end

-- ARGV[4] pod or '*': per worker {name, media order, orphans, blocks of each medium..., extras}
local function dump()
  local out = {}
  local all = redis.call('HGETALL', base .. 'W')
  for i = 1, #all, 2 do
    local _, pod = parse_name(all[i])
    if ARGV[4] == '*' or pod == ARGV[4] then
      local slot = all[i + 1]
      local meta = redis.call('HMGET', base .. 'w:' .. slot, 'M', 'o')
      local item = {all[i], meta[1], tonumber(meta[2]) or 0}
      for j = 1, #split(meta[1]) do item[#item + 1] = medium_entries(slot, j) end
      item[#item + 1] = redis.call('HGETALL', base .. 'x:' .. slot)
      out[#out + 1] = item
    end
  end
  return out
end

-- ARGV[4..] groups of (name, medium, hash, key or 'o', copies); holders are written per slot at the end
local function load()
  local holdings = {}  -- slot -> {holder key name -> copies} (no worker is freed while loading)
  for i = 4, #ARGV, 5 do
    local name, m, h, key, copies = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], tonumber(ARGV[i + 4])
    local slot = redis.call('HGET', base .. 'W', name) or new_worker(name, 'GPU')
    local media = split(redis.call('HGET', base .. 'w:' .. slot, 'M'))
    local idx = nil
    for j, x in ipairs(media) do if x == m then idx = j end end
    if not idx then
      media[#media + 1] = m; idx = #media
      redis.call('HSET', base .. 'w:' .. slot, 'M', table.concat(media, '\n'))
    end
    if set_entry(slot, idx, h, key) == 1 then count_entries(name, slot, 1) end
    if copies > 1 then redis.call('HSET', base .. 'x:' .. slot, idx .. ':' .. h, copies - 1) end
    if key == 'o' then redis.call('HINCRBY', base .. 'w:' .. slot, 'o', 1)
    else
      local t, mine = tier(m), holdings[slot] or {}
      if t ~= 'g' then mark_offload() end
      holdings[slot] = mine
      local hname = base .. t .. ':' .. key
      mine[hname] = (mine[hname] or 0) + copies
    end
    redis.call('HINCRBY', base .. 'v', name, 1)
  end
  for slot, mine in pairs(holdings) do
    local names, deltas = {}, {}
    for hname, copies in pairs(mine) do names[#names + 1] = hname; deltas[#deltas + 1] = copies end
    apply_holders(slot, names, deltas)
  end
  return {'ok'}
end

if op == 'read' then return read_worker()
elseif op == 'apply' then return apply_batch()
elseif op == 'match' then return match()
elseif op == 'restart' then return restart()
elseif op == 'clear' then return clear_pod()
elseif op == 'dump' then return dump()
elseif op == 'held' then return held()
elseif op == 'load' then return load()
elseif op == 'pos' then local p = read_pos(KEYS[2]); return {'pos', p[1], p[2], p[3], p[4]}
elseif op == 'setpos' then
  write_pos(KEYS[2], ARGV[4] ~= '' and ARGV[4], ARGV[5], ARGV[6], ARGV[7] ~= '-' and string.sub(ARGV[7], 2))
  return {'ok'}
elseif op == 'names' then return redis.call('HKEYS', base .. 'W')
elseif op == 'getbs' then return {'ok', redis.call('GET', base .. 'bs')}
elseif op == 'setbs' then redis.call('SET', base .. 'bs', ARGV[4]); return {'ok'}
end
return redis.error_reply('kvindex: unknown op ' .. tostring(op))
"""


def _text(v: Any) -> Any:
    return v.decode() if isinstance(v, bytes) else v


def _position(q: Any, e: Any, y: Any, r: Any) -> Position | None:
    if e is None:
        return None
    return Position(None if q is None else int(q), int(e), _text(y) == "1", _text(r))


def _u64(v: int) -> bytes:
    """An engine hash or key as the store holds it: 8 bytes, big-endian (never a Lua number)."""
    return v.to_bytes(8, "big")


def _key_or_orphan(v: bytes) -> int:
    return ORPHAN if v == b"o" else int.from_bytes(v, "big")


def model_base(prefix: str, model_id: int) -> str:
    """The key prefix of one model: its short id is the hash tag (short key names: each distinct
    block key costs one top-level key per tier, and a long model name in it would cost more)."""
    return f"{prefix}:{{{model_id}}}:"


def client_url(client: aioredis.Redis) -> str:
    kw = client.connection_pool.connection_kwargs
    if "path" in kw:
        return f"unix://{kw['path']}?db={kw.get('db', 0)}"
    return f"redis://{kw.get('host', 'localhost')}:{kw.get('port', 6379)}/{kw.get('db', 0)}"


@dataclass(frozen=True, slots=True)
class _WorkerView:
    """What the read script saw of one worker: the basis of one batch's computation."""

    position: Position | None
    block_size: int | None
    version: str
    media: tuple[str, ...]
    orphans: int
    entries: dict[tuple[str, int], tuple[int, int]]  # (medium, hash) -> (key or ORPHAN, extra copies)


@dataclass(frozen=True, slots=True)
class _Plan:
    """A batch's effect on one worker, as the apply script takes it."""

    done: Applied
    reset: bool
    media: tuple[str, ...]
    orphans: int
    changes: list[tuple[int, int, int | None, int]]  # (medium index, hash, key / ORPHAN / None: gone, extra)
    holders: dict[tuple[str, int], int]  # (tier char, key) -> change of the copies held (non-zero)
    counted: int  # change of the number of entries (medium, hash) held
    new_block_size: int | None


def _view_of(reply: list[Any], hashes: list[int]) -> _WorkerView:
    pos = _position(*reply[1:5])
    bs = None if reply[5] is None else int(reply[5])
    media = tuple(_text(reply[7]).split("\n")) if reply[7] is not None else ()
    entries: dict[tuple[str, int], tuple[int, int]] = {}
    for i, medium in enumerate(media):
        if 9 + 2 * i >= len(reply):
            break
        values, extras = chain.from_iterable(reply[9 + 2 * i]), reply[10 + 2 * i]  # per bucket group
        for j, v in enumerate(values):
            if v is not None:
                x = extras[j] if extras else None
                entries[(medium, hashes[j])] = (_key_or_orphan(v), 0 if x is None else int(x))
    return _WorkerView(pos, bs, _text(reply[6]), media, int(reply[8] or 0), entries)


def _hashes_of(events: Sequence[KVEvent]) -> list[int]:
    """Every engine hash the batch can read or write (stored, removed, parents), once each."""
    seen: dict[int, None] = {}
    for ev in events:
        if type(ev) is BlockStored:
            if ev.parent_hash is not None:
                seen[ev.parent_hash] = None
            seen.update(dict.fromkeys(ev.block_hashes))
        elif type(ev) is BlockRemoved:
            seen.update(dict.fromkeys(ev.block_hashes))
    return list(seen)


def plan_batch(pod: str, model: str, rank: int, events: Sequence[KVEvent], view: _WorkerView, hashes: list[int]) -> _Plan:
    """The batch's plan: the fast path when it applies, else the full replay."""
    return plan_fast(model, events, view, hashes) or plan_replayed(pod, model, rank, events, view, hashes)


def plan_replayed(pod: str, model: str, rank: int, events: Sequence[KVEvent], view: _WorkerView,
                  hashes: list[int]) -> _Plan:
    """Replay the batch with PreciseIndex's own rules (``WorkerReplay``) and diff the worker (any batch)."""
    replay = WorkerReplay(pod, model, rank, view.block_size, view.media, view.entries, view.orphans)
    done = replay.run(events)
    if replay.reset:  # the store clears the worker first: everything the replay holds is new
        changes, holders, counted = _diff(replay, {}, replay.held())
    else:
        changes, holders, counted = _diff(replay, view.entries, [(m, h) for m in replay.media for h in hashes])
    new_bs = replay.block_size() if view.block_size is None else None
    return _Plan(done, replay.reset, replay.media, replay.orphans, changes, holders, counted, new_bs)


def _diff(replay: WorkerReplay, before: dict[tuple[str, int], tuple[int, int]],
          touched: list[tuple[str, int]]) -> tuple[list[tuple[int, int, int | None, int]], dict[tuple[str, int], int], int]:
    """The changed entries, the holder deltas (copies per tier and key) and the change of the
    number of entries, between ``before`` and the replayed worker over ``touched``."""
    changes: list[tuple[int, int, int | None, int]] = []
    deltas: dict[tuple[str, int], int] = {}
    index = {m: i for i, m in enumerate(replay.media, 1)}
    counted = 0
    for m, h in touched:
        old, now = before.get((m, h)), replay.entry(m, h)
        if old == now:
            continue
        new, new_x = now if now is not None else (None, 0)
        counted += (new is not None) - (old is not None)
        keep = old is not None and old[1] == new_x or old is None and new_x == 0
        changes.append((index[m], h, new, UNCHANGED if keep else new_x))
        t = _TIER_CHAR[tier_of(m)]
        if old is not None and old[0] != ORPHAN:
            deltas[(t, old[0])] = deltas.get((t, old[0]), 0) - 1 - old[1]
        if new is not None and new != ORPHAN:
            deltas[(t, new)] = deltas.get((t, new), 0) + 1 + new_x
    return changes, {k: d for k, d in deltas.items() if d}, counted


def plan_fast(model: str, events: Sequence[KVEvent], view: _WorkerView, hashes: list[int]) -> _Plan | None:
    """The common batch without the overlay: a worker holding GPU blocks only, none keyless or
    copied twice among those the batch names, and GPU stores that all get keys (parent held or
    none, tokens for every block, the model's block size) of hashes not held yet, and removals.
    Same result as ``plan_replayed``; None (use it) as soon as the batch leaves that case."""
    if view.media not in ((), (GPU,)):
        return None
    held: dict[int, int] = {}
    for (_, h), (key, extra) in view.entries.items():
        if extra or key == ORPHAN:
            return None
        held[h] = key
    now, deltas, done, bs = dict(held), {}, Applied(), view.block_size
    for ev in events:
        t = type(ev)
        if t is BlockStored:
            if ev.medium != GPU or (bs is not None and ev.block_size != bs):  # type: ignore[union-attr]
                return None
            bs = ev.block_size  # type: ignore[union-attr]
            if not _store_fast(model, ev, now, deltas):  # type: ignore[arg-type]
                return None
            done.stored_events += 1
            done.stored += len(ev.block_hashes)  # type: ignore[union-attr]
        elif t is BlockRemoved and ev.medium == GPU:  # type: ignore[union-attr]
            gone = [now.pop(h, None) for h in ev.block_hashes]  # type: ignore[union-attr]
            for key in gone:
                if key is not None:
                    deltas[key] = deltas.get(key, 0) - 1
            done.removed_events += 1
            done.unknown_removals += gone.count(None)
            done.removed += len(gone) - gone.count(None)
        else:
            return None
    changes, counted = [], 0
    for h in hashes:
        old, new = held.get(h), now.get(h)
        if old != new:
            counted += (new is not None) - (old is not None)
            changes.append((1, h, new, UNCHANGED))
    new_bs = bs if view.block_size is None else None
    return _Plan(done, False, (GPU,), view.orphans, changes, {("g", k): d for k, d in deltas.items() if d}, counted, new_bs)


def _store_fast(model: str, ev: BlockStored, now: dict[int, int], deltas: dict[int, int]) -> bool:
    """Store ``ev``'s blocks in ``now`` (hash -> key); False if one would be keyless or a copy."""
    if ev.parent_hash is None:
        parent: int | None = K.root_key(model, ev.lora_name, ev.cache_salt)
    else:
        parent = now.get(ev.parent_hash)
        if parent is None:
            return False
    hashes = ev.block_hashes
    keys = K.prompt_keys(parent, ev.token_ids, ev.block_size, limit=len(hashes))
    if len(keys) < len(hashes):
        return False
    for h, key in zip(hashes, keys):
        if h in now:
            return False
        now[h] = key
        deltas[key] = deltas.get(key, 0) + 1
    return True


def _pack_changes(changes: list[tuple[int, int, int | None, int]]) -> tuple[bytes, bytes, bytes]:
    """The apply script's entry sections (see write_entries): writes and deletions grouped per
    (medium, bucket), and the changed extra copies."""
    sets: dict[tuple[int, int], list[bytes]] = {}
    dels: dict[tuple[int, int], list[bytes]] = {}
    xdel: list[bytes] = []
    xset: list[bytes] = []
    for idx, h, key, extra in changes:
        group, hb = (idx, h & BUCKET_MASK), h.to_bytes(8, "big")
        if key is None:
            fields = dels.get(group)
            if fields is None:
                dels[group] = [hb]
            else:
                fields.append(hb)
        else:
            value = b"o" if key == ORPHAN else key.to_bytes(8, "big")
            fields = sets.get(group)
            if fields is None:
                sets[group] = [hb, value]
            else:
                fields += (hb, value)
        if extra != UNCHANGED:
            field = b"%d:%s" % (idx, hb)
            if extra:
                xset += (field, b"%d" % extra)
            else:
                xdel.append(field)
    return (_packb(_columns(sets, with_bucket=True)) if sets else b"",
            _packb(_columns(dels, with_bucket=False)) if dels else b"",
            _packb([xdel, xset]) if xdel or xset else b"")


def _columns(groups: dict[tuple[int, int], list[bytes]], *, with_bucket: bool) -> list[list[Any]]:
    """Groups as write_entries takes them: medium indexes, bucket digits, (buckets,) sizes, items."""
    keys = list(groups)
    out: list[list[Any]] = [[i for i, _ in keys], [_DIGITS[b] for _, b in keys]]
    if with_bucket:
        out.append([b for _, b in keys])
    out.append([len(f) for f in groups.values()])
    out.append([x for f in groups.values() for x in f])
    return out


def _read_groups(hashes: list[int]) -> tuple[bytes, list[int]]:
    """The read script's hashes grouped per bucket (msgpack, see read_worker), and the hashes in
    that order."""
    groups: dict[int, list[int]] = {}
    for h in hashes:
        group = groups.get(h & BUCKET_MASK)
        if group is None:
            groups[h & BUCKET_MASK] = [h]
        else:
            group.append(h)
    order = [h for hs in groups.values() for h in hs]
    return _packb([[_DIGITS[b] for b in groups], [len(hs) for hs in groups.values()],
                   [h.to_bytes(8, "big") for h in order]]), order


def _pack_holders(base: str, holders: dict[tuple[str, int], int]) -> bytes:
    """The holder changes as write_holders takes them (b"": none)."""
    if not holders:
        return b""
    prefixes = {t: f"{base}{t}:".encode() for t in "gcd"}
    names = [prefixes[t] + k.to_bytes(8, "big") for t, k in holders]
    offload = any(t != "g" and d > 0 for (t, _), d in holders.items())
    return _packb([names, list(holders.values()), 1 if offload else 0])


def _apply_args(base: str, seq: int, epoch: int, force: str | None, cleared: bool, name: str, view: _WorkerView,
                plan: _Plan) -> list[str | bytes]:
    """The apply script's arguments; a view of version "*" was not read (nothing to check)."""
    if view.version == "*":
        read_bs = "*"
    else:
        read_bs = "" if view.block_size is None else str(view.block_size)
    sets, dels, extras = _pack_changes(plan.changes)
    holders = _pack_holders(base, plan.holders)
    return [str(seq), str(epoch), "-" if force is None else "+" + force, "1" if cleared else "0", name,
            view.version, read_bs, "" if plan.new_block_size is None else str(plan.new_block_size),
            "1" if plan.reset else "0", "\n".join(plan.media), str(plan.orphans), sets, dels, extras, holders,
            str(plan.counted)]


class RedisPreciseStore:
    """``PreciseStore`` on one Redis (or one Redis Cluster slot per model)."""

    name = "redis"

    def __init__(self, client: aioredis.Redis, *, prefix: str = "kvi") -> None:
        if client.get_encoder().decode_responses:
            raise ValueError("RedisPreciseStore needs a client with decode_responses=False (it stores binary hashes)")
        self._client = client
        self._prefix = prefix
        self._url = client_url(client)
        self._script = client.register_script(LUA)
        self._gen: str | None = None
        self._bases: dict[str, str] = {}  # model -> key prefix (ids never change within a generation)
        # model -> block size as last read or set here: a query's keys need it before its one round
        # trip; it changes only by configuration (set_block_size), never back to unknown
        self._block_sizes: dict[str, int] = {}
        self._ready_pods: set[tuple[str, str]] = set()

    # -- plumbing ------------------------------------------------------------------------------
    async def _call(self, make: Callable[[], Awaitable[Any]], *, idempotent: bool = True) -> Any:
        """Await ``make()``; a dropped connection is retried once when the call is idempotent (a
        pooled connection that died with its server fails first), then reported as unavailable.
        A connection that timed out is not retried: the server is there but not answering (a
        network cut), and a retry would only double the wait for the caller's 503."""
        for attempt in (0, 1):
            try:
                return await make()
            except rex.ConnectionError as exc:
                timed_out = isinstance(exc.__cause__, (rex.TimeoutError, TimeoutError))
                if attempt or not idempotent or timed_out:
                    raise self._unavailable(exc) from None
            except (rex.TimeoutError, TimeoutError, OSError) as exc:
                raise self._unavailable(exc) from None
            except rex.ResponseError as exc:
                raise StoreUnavailable(f"redis at {self._url}: refused: {exc}".splitlines()[0]) from None

    def _unavailable(self, exc: Exception) -> StoreUnavailable:
        return StoreUnavailable(f"redis at {self._url}: {type(exc).__name__}: {exc}".splitlines()[0])

    def _lost(self) -> StoreLost:
        return StoreLost(f"redis at {self._url}: the store's generation changed since open (its data was lost)")

    async def open(self) -> None:
        """Load the script and read (or create) the store's generation; again after StoreLost."""
        gen_key = f"{self._prefix}:gen"
        await self._call(lambda: self._client.set(gen_key, secrets.token_hex(8), nx=True))
        self._gen = _text(await self._call(lambda: self._client.get(gen_key)))
        await self._call(lambda: self._client.script_load(LUA))
        self._bases.clear()
        self._block_sizes.clear()
        self._ready_pods.clear()

    async def _ensure(self, model: str, pod: str | None = None) -> str:
        """The model's key prefix, its slot checked once per process; registers the pod's model."""
        if self._gen is None:
            raise StoreUnavailable(f"redis at {self._url}: store not opened")
        base = self._bases.get(model)
        if base is None:
            base = self._bases[model] = await self._register(model)
        if pod is not None and (pod, model) not in self._ready_pods:
            await self._call(lambda: self._client.hset(f"{self._prefix}:pods", pod, model))
            self._ready_pods.add((pod, model))
        return base

    async def _register(self, model: str) -> str:
        """The model's short id (``<prefix>:mid``; the first client to need one allocates it) and
        its slot's generation copy: set if absent, then the store's generation read after it, so
        a store that restarted in between is found lost."""
        mids, gen_key = f"{self._prefix}:mid", f"{self._prefix}:gen"
        if _text(await self._call(lambda: self._client.get(gen_key))) != self._gen:
            raise self._lost()
        mid = await self._call(lambda: self._client.hget(mids, model))
        if mid is None:
            fresh = await self._call(lambda: self._client.incr(mids + ":n"))
            await self._call(lambda: self._client.hsetnx(mids, model, fresh))
            mid = await self._call(lambda: self._client.hget(mids, model))
        base = model_base(self._prefix, int(mid))

        async def check() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            pipe.set(base + "gen", self._gen, nx=True, get=True)
            pipe.get(gen_key)
            return await pipe.execute()
        old, gen = await self._call(check)
        if _text(gen) != self._gen or _text(old) not in (None, self._gen):
            raise self._lost()
        return base

    async def _run(self, base: str, op: str, *args: Any, stream: str = "", idempotent: bool = True) -> list[Any]:
        keys, argv = [base + "gen", base + "s:" + stream], [op, self._gen, base, *args]
        reply = await self._call(lambda: self._script(keys=keys, args=argv), idempotent=idempotent)
        if reply and _text(reply[0]) == "lost":
            raise self._lost()
        return reply

    async def _models(self) -> list[str]:
        async def read() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            pipe.get(f"{self._prefix}:gen")
            pipe.hkeys(f"{self._prefix}:mid")
            return await pipe.execute()
        gen, models = await self._call(read)
        if self._gen is None or _text(gen) != self._gen:
            raise self._lost()
        return sorted(_text(m) for m in models)

    async def _each_model(self, op: str, *args: Any) -> list[tuple[str, list[Any]]]:
        """Run one op on every model's slot (pipelined): for pod-wide reads and clears."""
        models = await self._models()
        bases = [await self._ensure(m) for m in models]
        async def run() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            for base in bases:
                await self._script(keys=[base + "gen", base + "s:"], args=[op, self._gen, base, *args], client=pipe)
            return await pipe.execute()
        replies = await self._call(run)
        if any(r and _text(r[0]) == "lost" for r in replies):
            raise self._lost()
        return list(zip(models, replies))

    # -- streams -------------------------------------------------------------------------------
    async def apply(self, stream: StreamRef, seq: int, epoch: int, dp_rank: int, events: Sequence[KVEvent],
                    *, force: str | None = None) -> ApplyResult:
        base = await self._ensure(stream.model, stream.pod)
        name = f"{dp_rank}|{stream.pod}"
        hashes = _hashes_of(events)
        cleared = any(type(ev) is AllBlocksCleared for ev in events)
        blind = not hashes and not any(type(ev) is BlockStored for ev in events)  # nothing to read
        for _ in range(RETRIES):
            if blind:  # clears only (or nothing): one round trip, computed on an empty worker
                view = _WorkerView(None, None, "*", (), 0, {})
            else:
                packed, order = _read_groups(hashes)
                view = _view_of(await self._run(base, "read", name, packed, stream=stream.id), order)
                outcome = judge(view.position, seq, epoch, force)
                if outcome is not Outcome.APPLIED:
                    return ApplyResult(outcome, view.position or Position(epoch=epoch))
            plan = plan_batch(stream.pod, stream.model, dp_rank, events, view, hashes)
            args = _apply_args(base, seq, epoch, force, cleared, name, view, plan)
            reply = await self._run(base, "apply", *args, stream=stream.id)
            status = _text(reply[0])
            if status == "retry":
                continue
            pos = _position(*reply[1:5])
            if status != "applied":
                return ApplyResult(Outcome(status), pos or Position(epoch=epoch))
            assert pos is not None
            return ApplyResult(Outcome.APPLIED, pos, plan.done)
        raise StoreUnavailable(f"redis at {self._url}: worker {name} kept changing under {RETRIES} attempts")

    async def restart(self, stream: StreamRef, seen_epoch: int, ranks: Iterable[int] | None) -> Position:
        base = await self._ensure(stream.model, stream.pod)
        spec = "*" if ranks is None else ",".join(str(r) for r in ranks)
        if spec == "":
            spec = ","  # no rank: nothing to clear
        reply = await self._run(base, "restart", stream.pod, str(seen_epoch), spec, stream=stream.id)
        return _position(*reply[1:5]) or Position()

    async def position(self, stream: StreamRef) -> Position | None:
        base = await self._ensure(stream.model)
        reply = await self._run(base, "pos", stream=stream.id)
        return _position(*reply[1:5])

    async def set_position(self, stream: StreamRef, position: Position) -> None:
        base = await self._ensure(stream.model, stream.pod)
        q = "" if position.last_seq is None else str(position.last_seq)
        await self._run(base, "setpos", q, str(position.epoch), "1" if position.synced else "0",
                        "-" if position.reason is None else "+" + position.reason, stream=stream.id)

    # -- models and pods -----------------------------------------------------------------------
    async def set_block_size(self, model: str, block_size: int) -> None:
        await self._run(await self._ensure(model), "setbs", str(block_size))
        self._block_sizes[model] = block_size

    async def block_size(self, model: str) -> int | None:
        """The model's block size; once known, from this client's memory (no round trip: a
        query's only round trip is its walk). Unknown sizes are read every time."""
        known = self._block_sizes.get(model)
        if known is not None:
            return known
        reply = await self._run(await self._ensure(model), "getbs")
        if reply[1] is None:
            return None
        bs = self._block_sizes[model] = int(reply[1])
        return bs

    async def block_sizes(self) -> dict[str, int]:
        out = {}
        for model, reply in await self._each_model("getbs"):
            if reply[1] is not None:
                out[model] = int(reply[1])
        return out

    async def clear_pod(self, pod: str, dp_rank: int | None = None) -> None:
        await self._each_model("clear", pod, "*" if dp_rank is None else str(dp_rank))

    async def _dump(self, pod: str) -> list[tuple[str, int, str, dict[int, int], dict[tuple[str, int], int], int]]:
        """(pod, rank, medium, hash -> key, (medium, hash) -> extra, orphans) per worker medium."""
        out = []
        for _, workers in await self._each_model("dump", pod):
            for item in workers:
                rank, _, wpod = _text(item[0]).partition("|")
                media = _text(item[1]).split("\n")
                extra: dict[tuple[str, int], int] = {}
                flat = item[-1]
                for i in range(0, len(flat), 2):
                    idx, _, h = flat[i].partition(b":")
                    extra[(media[int(idx) - 1], int.from_bytes(h, "big"))] = int(flat[i + 1])
                for j, medium in enumerate(media):
                    blocks = item[3 + j]
                    entries = {int.from_bytes(blocks[i], "big"): _key_or_orphan(blocks[i + 1])
                               for i in range(0, len(blocks), 2)}
                    out.append((wpod, int(rank), medium, entries, extra, int(item[2] or 0) if j == 0 else 0))
        return out

    async def pods(self) -> list[str]:
        return sorted({_text(n).partition("|")[2] for _, names in await self._each_model("names") for n in names})

    async def blocks_held(self, pod: str) -> dict[str, int]:
        out = {"gpu": 0, "cpu": 0, "disk": 0, "orphans": 0}
        for _, counts in await self._each_model("held", pod):
            for name, n in zip(("gpu", "cpu", "disk", "orphans"), counts):
                out[name] += int(n)
        return out

    async def engine_hashes(self, pod: str) -> dict[int, dict[int, int | None]]:
        out: dict[int, dict[int, int | None]] = {}
        for _, rank, _, entries, _, _ in await self._dump(pod):
            out.setdefault(rank, {}).update({h: None if k == ORPHAN else k for h, k in entries.items()})
        return out

    # -- queries -------------------------------------------------------------------------------
    async def match(self, keys: Sequence[int], pods: Iterable[str] | None = None, *,
                    model: str | None = None) -> dict[str, PodMatch]:
        """Longest prefix of ``keys`` per pod. ``model`` names the slot to walk (one round trip);
        without it every model's slot is walked."""
        if not keys:
            return {}
        wanted = None if pods is None else sorted(set(pods))
        if wanted == []:
            return {}
        args = ["-1"] if wanted is None else [str(len(wanted)), *wanted]
        args.append(struct.pack(f">{len(keys)}Q", *keys))
        if model is not None:
            replies = [await self._run(await self._ensure(model), "match", *args)]
        else:
            replies = [r for _, r in await self._each_model("match", *args)]
        return _per_pod(replies)

    # -- state out and in ----------------------------------------------------------------------
    async def export_entries(self) -> list[Entry]:
        """Every held entry, one pod at a time (each pod's entries are one point in time; a script
        never blocks the store for the whole fleet)."""
        out = []
        dumps = [item for pod in await self.pods() for item in await self._dump(pod)]
        for pod, rank, medium, entries, extra, _ in dumps:
            for h, key in entries.items():
                out.append(Entry(pod, rank, medium, h, None if key == ORPHAN else key, 1 + extra.get((medium, h), 0)))
        return out

    async def load_entries(self, entries: Iterable[Entry]) -> int:
        entries = list(entries)
        if not entries:
            return 0
        models = await self._call(lambda: self._client.hmget(f"{self._prefix}:pods", sorted({e.pod for e in entries})))
        model_of = dict(zip(sorted({e.pod for e in entries}), (_text(m) for m in models)))
        unknown = sorted(p for p, m in model_of.items() if m is None)
        if unknown:
            raise ValueError(f"load_entries: no model known for pod(s) {', '.join(unknown)} (apply or set_position first)")
        by_model: dict[str, list[str | bytes]] = {}
        for e in entries:
            by_model.setdefault(model_of[e.pod], []).extend(
                [f"{e.dp_rank}|{e.pod}", e.medium, _u64(e.hash), b"o" if e.key is None else _u64(e.key), str(e.copies)])
        for model, args in by_model.items():
            await self._run(await self._ensure(model), "load", *args, idempotent=False)
        return len(entries)

    async def close(self) -> None:
        """Nothing to release: the client is the caller's (it may serve other stores too)."""
        return None


def _per_pod(replies: list[list[Any]]) -> dict[str, PodMatch]:
    """Per-worker depths (name, gpu, cpu, disk) into per-pod matches, as PreciseIndex._per_pod."""
    out: dict[str, PodMatch] = {}
    for flat in replies:
        for i in range(0, len(flat), 4):
            rank, _, pod = _text(flat[i]).partition("|")
            g, c, d = int(flat[i + 1]), int(flat[i + 2]), int(flat[i + 3])
            prev = out.get(pod)
            if prev is None:
                out[pod] = PodMatch(g, c, d, {int(rank): g})
            else:
                prev.dp[int(rank)] = g
                out[pod] = PodMatch(max(prev.gpu, g), max(prev.cpu, c), max(prev.disk, d), prev.dp)
    return out
