-- evictions. ARGV: gen. Capacity evictions, store-wide.
return tonumber(redis.call('GET', P .. 'evictions') or '0')
