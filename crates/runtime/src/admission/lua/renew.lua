-- Extends this replica's leases. A lease that is gone was reclaimed (this replica could not
-- renew in time) and others may already use that capacity: it is not re-created.
-- KEYS: slots
-- ARGV: lease ms, slot members...
-- Returns the members that were not found
local expiry = now_ms() + tonumber(ARGV[1])
local missing = {}
for i = 2, #ARGV do
  if redis.call('ZSCORE', KEYS[1], ARGV[i]) then
    redis.call('ZADD', KEYS[1], expiry, ARGV[i])
  else
    missing[#missing + 1] = ARGV[i]
  end
end
return missing
