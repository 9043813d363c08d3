-- export. ARGV: gen. Returns {evictions, {{pod, cap, {"<hash> <model>"...}}...},
-- {{pod, cap, {hash...}, {hash...}}...}}.
local kthena, gie = {}, {}
local caps = redis.call('HGETALL', P .. 'k:cap')
for i = 1, #caps, 2 do
  kthena[#kthena + 1] = {caps[i], caps[i + 1], redis.call('ZRANGE', P .. 'k:lru:' .. caps[i], 0, -1)}
end
caps = redis.call('HGETALL', P .. 'g:cap')
for i = 1, #caps, 2 do
  gie[#gie + 1] = {caps[i], caps[i + 1], redis.call('ZRANGE', P .. 'g:lru:' .. caps[i], 0, -1),
                   redis.call('ZRANGE', P .. 'g:stale:' .. caps[i], 0, -1)}
end
return {redis.call('GET', P .. 'evictions') or '0', kthena, gie}
