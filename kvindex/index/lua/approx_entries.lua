-- entries. ARGV: gen [, pod]. Entries of one pod, or the total.
if ARGV[2] then
  return redis.call('ZCARD', P .. 'k:lru:' .. ARGV[2]) + redis.call('ZCARD', P .. 'g:lru:' .. ARGV[2])
end
return tonumber(redis.call('GET', P .. 'entries') or '0')
