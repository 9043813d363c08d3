-- match_gie. ARGV: gen, candidates (msgpack, distinct), hashes. Forward walk, stopping at the
-- first hash no pod holds (candidate or not); returns the candidates' counts in their order.
local cands, hashes = cmsgpack.unpack(ARGV[2]), words(ARGV[3])
local index, counts = {}, {}
for i, pod in ipairs(cands) do index[pod] = i; counts[i] = 0 end
for _, h in ipairs(hashes) do
  local key = P .. 'g:h:' .. h
  local hit = holders(key, cands, index)
  if #hit == 0 and redis.call('HLEN', key) == 0 then break end
  for _, pod in ipairs(hit) do counts[index[pod]] = counts[index[pod]] + 1 end
end
return counts
