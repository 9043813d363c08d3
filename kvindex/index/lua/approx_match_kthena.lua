-- match_kthena. ARGV: gen, model, top_k, candidates (msgpack, distinct), hashes. Walks deepest
-- first; returns flat [depth, count, pods...] for each depth that matched new candidates, up to
-- the cut-off's.
local model, top_k = ARGV[2], tonumber(ARGV[3])
local remaining, hashes = cmsgpack.unpack(ARGV[4]), words(ARGV[5])
local open, out, found = {}, {}, 0
for _, pod in ipairs(remaining) do open[pod] = true end
for j = #hashes, 1, -1 do
  if #remaining == 0 or found >= top_k then break end
  local new = holders(P .. 'k:h:' .. hashes[j] .. ':' .. model, remaining, open)
  if #new > 0 then
    out[#out + 1] = j
    out[#out + 1] = #new
    for _, pod in ipairs(new) do open[pod] = nil; out[#out + 1] = pod end
    local rest = {}
    for _, pod in ipairs(remaining) do if open[pod] then rest[#rest + 1] = pod end end
    remaining, found = rest, found + #new
  end
end
return out
