-- pods. ARGV: gen. The pods with beliefs (either personality).
local out = {}
for _, pod in ipairs(redis.call('HKEYS', P .. 'k:cap')) do
  if redis.call('ZCARD', P .. 'k:lru:' .. pod) > 0 then out[#out + 1] = pod end
end
for _, pod in ipairs(redis.call('HKEYS', P .. 'g:cap')) do
  if redis.call('ZCARD', P .. 'g:lru:' .. pod) > 0 or redis.call('EXISTS', P .. 'g:stale:' .. pod) == 1 then
    out[#out + 1] = pod
  end
end
return out
