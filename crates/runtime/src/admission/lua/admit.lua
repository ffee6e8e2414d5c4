-- Takes a slot only when the tier is below capacity AND nobody is queued ahead, so a newcomer
-- cannot overtake the queue. Capacity 0 means unlimited (the slot is still counted).
-- KEYS: tier_keys
-- ARGV: base, capacity, slot member, lease ms, tenant, charge, fair (1/0)
-- Returns {1 admitted | 0 refused, leases reclaimed}
local K = tier_keys(0)
local now = now_ms()
local reclaimed = reclaim(K.slots, now)
drop_expired(K, ARGV[1], now)
local capacity = tonumber(ARGV[2])
if capacity == 0
  or (redis.call('ZCARD', K.queue) == 0 and redis.call('ZCARD', K.slots) < capacity) then
  redis.call('ZADD', K.slots, now + tonumber(ARGV[4]), ARGV[3])
  if ARGV[7] == '1' then
    charge(K, ARGV[5], tonumber(ARGV[6]), now)
  end
  return {1, reclaimed}
end
return {0, reclaimed}
