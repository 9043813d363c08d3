-- record_gie. ARGV: gen, pod, capacity, hashes. Returns the number of evictions. The stale pops
-- of the record's hashes are done first in one call: they commute with the LRU adds.
local pod, hashes = ARGV[2], words(ARGV[4])
local cap = tonumber(redis.call('HGET', P .. 'g:cap', pod) or '0')
if cap == 0 then
  redis.call('HSET', P .. 'g:cap', pod, ARGV[3])
  cap = tonumber(ARGV[3])
end
local lru, stale = P .. 'g:lru:' .. pod, P .. 'g:stale:' .. pod
for i = 1, #hashes, 1000 do redis.call('ZREM', stale, unpack(hashes, i, math.min(i + 999, #hashes))) end
local seq, sseq = top_score(lru), top_score(stale)
local size, ssize, evicted, in_lru = redis.call('ZCARD', lru), redis.call('ZCARD', stale), 0, {}
local start_size = size
for _, h in ipairs(hashes) do
  seq = seq + 1
  in_lru[h] = true
  if redis.call('ZADD', lru, seq, h) == 1 then
    size = size + 1
    if size > cap then
      local old = redis.call('ZPOPMIN', lru)[1]
      redis.call('HDEL', P .. 'g:h:' .. old, pod)
      in_lru[old], size, evicted = false, size - 1, evicted + 1
    end
  end
end
for _, h in ipairs(hashes) do
  redis.call('HSET', P .. 'g:h:' .. h, pod, '')
  if not in_lru[h] then
    sseq = sseq + 1
    if redis.call('ZADD', stale, sseq, h) == 1 then ssize = ssize + 1 end
    if ssize > cap then
      redis.call('HDEL', P .. 'g:h:' .. redis.call('ZPOPMIN', stale)[1], pod)
      ssize = ssize - 1
    end
  end
end
redis.call('INCRBY', P .. 'entries', size - start_size)
redis.call('INCRBY', P .. 'evictions', evicted)
return evicted
