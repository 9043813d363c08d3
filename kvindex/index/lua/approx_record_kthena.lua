-- record_kthena. ARGV: gen, pod, model, capacity, hashes (first block first). Returns the evicted
-- keys' models. Invariant used: (hash, model) is in the pod's LRU iff the pod is a field of its
-- holders hash, so a refresh touches the LRU only.
local pod, model = ARGV[2], ARGV[3]
redis.call('HSETNX', P .. 'k:cap', pod, ARGV[4])
local cap = tonumber(redis.call('HGET', P .. 'k:cap', pod))
local lru, hashes = P .. 'k:lru:' .. pod, words(ARGV[5])
local seq, size, evicted = top_score(lru), redis.call('ZCARD', lru), {}
local start_size = size
for i = #hashes, 1, -1 do
  local h = hashes[i]
  seq = seq + 1
  if redis.call('ZADD', lru, seq, h .. ' ' .. model) == 1 then
    redis.call('HSET', P .. 'k:h:' .. h .. ':' .. model, pod, '')
    size = size + 1
    if size > cap then
      local eh, em = split_key(redis.call('ZPOPMIN', lru)[1])
      redis.call('HDEL', P .. 'k:h:' .. eh .. ':' .. em, pod)
      size = size - 1
      evicted[#evicted + 1] = em
    end
  end
end
redis.call('INCRBY', P .. 'entries', size - start_size)
redis.call('INCRBY', P .. 'evictions', #evicted)
return evicted
