-- Capacity credits: a block of slots leased to one replica at once, which it then hands to its
-- own requests without asking Redis. Granted only while nobody waits and the tier stays at most
-- half full with the block, so credits never take capacity from a waiting request and the
-- bound is exact (a credit is a slot like any other: leased, renewed, reclaimed).
-- KEYS: tier_keys
-- ARGV: base, capacity (0 = unlimited), block size, lease ms, member prefix, first member number
-- Returns the granted members (none when the tier is not far from its bound)
local K = tier_keys(0)
local now = now_ms()
reclaim(K, now)
drop_expired(K, ARGV[1], now)
local capacity, n = tonumber(ARGV[2]), tonumber(ARGV[3])
if redis.call('ZCARD', K.queue) > 0
  or (capacity ~= 0 and (redis.call('ZCARD', K.slots) + n) * 2 > capacity) then
  return {}
end
local expiry = now + tonumber(ARGV[4])
local out = {}
for i = 0, n - 1 do
  local member = ARGV[5] .. (tonumber(ARGV[6]) + i)
  redis.call('ZADD', K.slots, expiry, member)
  out[#out + 1] = member
end
return out
