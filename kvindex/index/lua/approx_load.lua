-- load (after the forget_pod fragment). ARGV: gen, msgpack {evictions = "n", kthena = {{pod,
-- cap, {hash, model, ...}}...}, gie = {{pod, cap, {hash...}, {stale hash...}}...}} with hashes as
-- text: an export already validated and normalised by ApproxIndex. Replaces everything.
local state = cmsgpack.unpack(ARGV[2])
local pods = redis.call('HKEYS', P .. 'k:cap')
for _, pod in ipairs(redis.call('HKEYS', P .. 'g:cap')) do pods[#pods + 1] = pod end
for _, pod in ipairs(pods) do forget_pod(pod) end
local total = 0
for _, saved in ipairs(state.kthena) do
  local pod, keys = saved[1], saved[3]
  redis.call('HSET', P .. 'k:cap', pod, saved[2])
  for i = 1, #keys, 2 do
    redis.call('ZADD', P .. 'k:lru:' .. pod, (i + 1) / 2, keys[i] .. ' ' .. keys[i + 1])
    redis.call('HSET', P .. 'k:h:' .. keys[i] .. ':' .. keys[i + 1], pod, '')
  end
  total = total + #keys / 2
end
for _, saved in ipairs(state.gie) do
  local pod = saved[1]
  redis.call('HSET', P .. 'g:cap', pod, saved[2])
  for part, kind in ipairs({'g:lru:', 'g:stale:'}) do
    for s, h in ipairs(saved[2 + part]) do
      redis.call('ZADD', P .. kind .. pod, s, h)
      redis.call('HSET', P .. 'g:h:' .. h, pod, '')
    end
  end
  total = total + #saved[3]
end
redis.call('SET', P .. 'entries', total)
redis.call('SET', P .. 'evictions', state.evictions)
return total
