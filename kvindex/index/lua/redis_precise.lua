-- The precise index's one script (kvindex/index/redis_precise.py; layout in its docstring).
-- KEYS[1] the model slot's generation copy, KEYS[2] the stream's position HASH; ARGV[1] the op,
-- ARGV[2] the generation read at open(), then the store's guard (store_guard.lua, placed before this
-- file: evictions watched, a cluster's masters), ARGV[3] the model's key prefix, then the op's arguments.
-- Every op, reads included, checks the generation first, in the same atomic step as its work
-- ({'lost'} on a mismatch: the store restarted empty), then the guard ({'lost'}: keys evicted since
-- open, or a cluster node not seen at open; {'moving'}: the model's slot is migrating).
local op, base = ARGV[1], ARGV[3]
local gen, guard = string.match(ARGV[2], '^([^|@]*)(.*)$')
if redis.call('GET', KEYS[1]) ~= gen then return {'lost'} end
local verdict = store_guard(guard)
if verdict then return {verdict} end
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
-- seqs are u64s: compared as decimal strings without leading zeros (Lua numbers are doubles, exact
-- only below 2**53), shorter first; ``prev`` is seq - 1, sent by the client (no arithmetic here)
local function dec_lt(a, b)
  if #a ~= #b then return #a < #b end
  return a < b
end
local function judge(p, seq, prev, epoch, forced)
  if not p[2] then return 'applied' end
  local e = tonumber(p[2])
  if epoch < e then return 'stale' end
  if epoch > e then return 'behind' end
  if not p[1] then return 'applied' end
  local last = p[1]
  if not dec_lt(last, seq) then return 'duplicate' end
  if dec_lt(last, prev) and not forced then return 'gap' end
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
-- media, orphans, the number of the model's other workers (they hold the block size), the number of
-- the worker's entries (all of them, not only the hashes sent), then per medium the values of the hashes in the order sent (key, 'o' or nil) and their extra copies
-- (false when the worker has none)
local function others_than(name)
  return redis.call('HLEN', base .. 'W') - redis.call('HEXISTS', base .. 'W', name)
end
local function read_worker()
  local name = ARGV[4]
  local p = read_pos(KEYS[2])
  local slot = redis.call('HGET', base .. 'W', name)
  local out = {'ok', p[1], p[2], p[3], p[4], redis.call('GET', base .. 'bs'),
               redis.call('HGET', base .. 'v', name) or '0', false, 0, others_than(name), 0}
  if not slot then return out end
  local meta = redis.call('HMGET', base .. 'w:' .. slot, 'M', 'o', 'c')
  out[8], out[9], out[11] = meta[1], tonumber(meta[2]) or 0, tonumber(meta[3]) or 0
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
-- [19] change of the number of entries held, [20] seq - 1 (decimal; seqs are never turned into numbers)
local function apply_batch()
  local p = read_pos(KEYS[2])
  local epoch, forced = tonumber(ARGV[5]), ARGV[6] ~= '-'
  local outcome = judge(p, ARGV[4], ARGV[20], epoch, forced)
  if outcome ~= 'applied' then return {outcome, p[1], p[2], p[3], p[4]} end
  local name = ARGV[8]
  if (ARGV[9] ~= '*' and (redis.call('HGET', base .. 'v', name) or '0') ~= ARGV[9])
     or (ARGV[10] ~= '*' and (redis.call('GET', base .. 'bs') or '') ~= ARGV[10]) then
    return {'retry'}
  end
  if ARGV[11] ~= '' then  -- the model follows the engine: only while no other worker holds the old size
    -- (this worker's own entries, their count included, are the ones the plan read: the version check)
    local bs = redis.call('GET', base .. 'bs')
    if bs and bs ~= ARGV[11] and others_than(name) > 0 then return {'retry'} end
    redis.call('SET', base .. 'bs', ARGV[11])
  end
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
  local out, slots = {redis.call('GET', base .. 'bs')}, {}  -- the block size the keys must have been made with
  for s, d in pairs(w.ddep) do
    if d > 0 then
      slots[#slots + 1] = s
      out[#out + 1] = false; out[#out + 1] = w.gdep[s]; out[#out + 1] = w.cdep[s]; out[#out + 1] = d
    end
  end
  if #slots > 0 then
    local names = hmget(base .. 'N', slots)
    for i = 1, #slots do out[4 * i - 2] = names[i] end
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
elseif op == 'setbs' then  -- ARGV[4] size, [5] '1' when configured: every replica must configure the same
  local cfg = redis.call('GET', base .. 'cbs')
  if ARGV[5] == '1' and cfg and cfg ~= ARGV[4] then return {'conflict', cfg} end
  if ARGV[5] == '1' then redis.call('SET', base .. 'cbs', ARGV[4]) end
  if redis.call('HLEN', base .. 'W') == 0 or not redis.call('GET', base .. 'bs') then redis.call('SET', base .. 'bs', ARGV[4]) end
  return {'ok', redis.call('GET', base .. 'bs')}
end
return redis.error_reply('kvindex: unknown op ' .. tostring(op))
