-- Takes a slot kept for the tenant (fair share: its latest request's slot, for a grace), or
-- one only when the tier is below capacity AND nobody is queued ahead, so a newcomer cannot
-- overtake the queue. Capacity 0 means unlimited (the slot is still counted).
-- KEYS: tier_keys
-- ARGV: base, capacity, slot member, lease ms, tenant, charge, fair (1/0)
-- Returns {1 admitted | 0 refused, leases reclaimed}
local K = tier_keys(0)
local now = now_ms()
local reclaimed = reclaim(K, now)
drop_expired(K, ARGV[1], now)
local capacity, member, tenant = tonumber(ARGV[2]), ARGV[3], ARGV[5]
local fair = ARGV[7] == '1'
if fair then
  arrive(K, tenant, now)
end
if (fair and take_kept(K, tenant)) or capacity == 0
  or (redis.call('ZCARD', K.queue) == 0 and redis.call('ZCARD', K.slots) < capacity) then
  redis.call('ZADD', K.slots, now + tonumber(ARGV[4]), member)
  if fair then
    charge(K, tenant, tonumber(ARGV[6]), now, member)
  end
  return {1, reclaimed}
end
return {0, reclaimed}
