-- The store's guard, the first thing every script defines (kvindex/index/redis_cluster.py): may this
-- node's answer be trusted? ``guard`` is what follows the generation in the script's generation
-- argument: '' (nothing to check), '|<evicted keys at open>' (one Redis whose eviction policy is
-- unknown), or '@ <replid>=<evicted keys or ''> ...' (a Redis Cluster: every master seen at open).
-- Returns nil (trusted), 'lost' (a node not seen at open: a replica promoted since, which may lack
-- acknowledged writes; or keys evicted since) or 'moving' (the script's slot is migrating: its
-- keys may be split over two nodes). Reads only; nothing is written before it answers.
local function store_guard(guard)
  if guard == '' then return nil end
  local evicted
  if string.sub(guard, 1, 1) == '|' then
    evicted = string.sub(guard, 2)
  else
    local rid = string.match(redis.call('INFO', 'replication'), 'master_replid:(%w+)')
    evicted = rid and string.match(guard, ' ' .. rid .. '=(%d*)')
    if not evicted then return 'lost' end
    local me = string.match(redis.call('CLUSTER', 'NODES'), '[^\n]*myself[^\n]*') or ''
    if string.find(me, '[' .. redis.call('CLUSTER', 'KEYSLOT', KEYS[1]) .. '-', 1, true) then return 'moving' end
  end
  if evicted ~= '' and tonumber(string.match(redis.call('INFO', 'stats'), 'evicted_keys:(%d+)')) > tonumber(evicted) then
    return 'lost'
  end
  return nil
end
