-- forget_pod(pod): forget one pod in both personalities (no eviction counted); returns the LRU
-- keys dropped. A fragment, placed after the prelude by the scripts that use it.
local function forget_pod(pod)
  local klru, glru, gstale = P .. 'k:lru:' .. pod, P .. 'g:lru:' .. pod, P .. 'g:stale:' .. pod
  for _, member in ipairs(redis.call('ZRANGE', klru, 0, -1)) do
    local h, m = split_key(member)
    redis.call('HDEL', P .. 'k:h:' .. h .. ':' .. m, pod)
  end
  for _, key in ipairs({glru, gstale}) do
    for _, h in ipairs(redis.call('ZRANGE', key, 0, -1)) do redis.call('HDEL', P .. 'g:h:' .. h, pod) end
  end
  local dropped = redis.call('ZCARD', klru) + redis.call('ZCARD', glru)
  redis.call('DEL', klru, glru, gstale)
  redis.call('HDEL', P .. 'k:cap', pod)
  redis.call('HDEL', P .. 'g:cap', pod)
  return dropped
end
