-- Claim: only the waiter served next (fair share between tenants, FIFO within one) may take a
-- slot, and leaving the queue and taking the slot happen in one step, so a released slot can
-- never be lost between the two.
-- KEYS: tier_keys
-- ARGV: base, waiter id, capacity, slot member, lease ms, fair (1/0)
-- Returns {1 claimed | 0 keep waiting | -1 no longer queued (deadline passed) | -2 pushed out of
-- a full queue by a tenant with fewer waiters, leases reclaimed}
local K = tier_keys(0)
local base, waiter = ARGV[1], ARGV[2]
local now = now_ms()
local reclaimed = reclaim(K, now)
drop_expired(K, base, now)
if not redis.call('ZSCORE', K.queue, waiter) then
  if redis.call('ZREM', K.pushed, waiter) == 1 then
    return {-2, reclaimed}
  end
  return {-1, reclaimed}
end
if next_waiter(K, base, ARGV[6]) ~= waiter then
  return {0, reclaimed}
end
local capacity = tonumber(ARGV[3])
if capacity ~= 0 and redis.call('ZCARD', K.slots) >= capacity then
  return {0, reclaimed}
end
local tenant = redis.call('HGET', K.wt, waiter)
local c = tonumber(redis.call('HGET', K.wc, waiter) or '1')
forget_waiter(K, base, waiter)
redis.call('ZADD', K.slots, now + tonumber(ARGV[5]), ARGV[4])
if tenant and ARGV[6] == '1' then
  charge(K, tenant, c, now, ARGV[4])
  claimed(K, tenant, now)
end
return {1, reclaimed}
