-- believes. ARGV: gen, "k" or "g", pod, model, hash.
local key = P .. 'g:h:' .. ARGV[5]
if ARGV[2] == 'k' then key = P .. 'k:h:' .. ARGV[5] .. ':' .. ARGV[4] end
return redis.call('HEXISTS', key, ARGV[3])
