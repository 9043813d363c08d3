-- The approximate index's shared prelude (kvindex/index/redis_approx.py), placed after the
-- script's shebang line and the store's guard (store_guard.lua). Every script: KEYS[1] = T:gen,
-- ARGV[1] = the generation read at open(), then the guard's argument (a cluster's masters);
-- P = "T:". Hashes travel as one argument of space-separated decimals, pod lists as one msgpack
-- array (few arguments: each one costs the client more than the server's work per block).
local P = string.sub(KEYS[1], 1, -4)
local GEN, GUARD = string.match(ARGV[1], '^([^|@]*)(.*)$')
if redis.call('GET', KEYS[1]) ~= GEN then
  return redis.error_reply('KVI_LOST the approximate index generation vanished or changed')
end
local VERDICT = store_guard(GUARD)
if VERDICT == 'lost' then
  return redis.error_reply('KVI_LOST the approximate index is on a node not seen at open (a failover)')
elseif VERDICT == 'moving' then
  return redis.error_reply('KVI_MOVING the approximate index slot is migrating')
end
local function words(text)
  local out = {}
  for w in string.gmatch(text, '%S+') do out[#out + 1] = w end
  return out
end
local function top_score(key)
  local top = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  if top[2] then return tonumber(top[2]) end
  return 0
end
local function split_key(member)
  local sp = string.find(member, ' ', 1, true)
  return string.sub(member, 1, sp - 1), string.sub(member, sp + 1)
end
-- The pods of `list` (all in the set `wanted`) that are fields of the holders hash `key`.
local function holders(key, list, wanted)
  local out = {}
  if #list <= 16 then
    if #list == 0 then return out end
    local vals = redis.call('HMGET', key, unpack(list))
    for k = 1, #list do if vals[k] then out[#out + 1] = list[k] end end
  else
    for _, pod in ipairs(redis.call('HKEYS', key)) do if wanted[pod] then out[#out + 1] = pod end end
  end
  return out
end
