-- Gives slots back. Releasing a slot whose lease was already reclaimed is a no-op, so a late
-- release can never free someone else's capacity. With fair share a charged slot's charge is
-- service had, and the slot is kept (re-scored to the end of a grace) for its tenant's next
-- request when the tenant is owed it and has nobody waiting (fair.rs: FairShare::keep).
-- KEYS: tier_keys
-- ARGV: base, fair (1/0), slot members...
-- Returns how many of the leases were still held
local K = tier_keys(0)
local base, fair = ARGV[1], ARGV[2] == '1'
local now = now_ms()
local released = 0
for i = 3, #ARGV do
  local member = ARGV[i]
  if redis.call('ZSCORE', K.slots, member) then
    released = released + 1
    local tenant, held = finish(K, member, now)
    local grace = tenant and fair and keep(K, base, tenant, held, now)
    if grace then
      redis.call('ZADD', K.slots, now + grace, member)
      redis.call('HSET', K.kept, member, tenant)
    else
      redis.call('ZREM', K.slots, member)
    end
  end
end
return released
