-- Prepended to every Sluice script: time comes from Redis, never from the replicas, so leases,
-- deadlines and refills mean the same on every replica even when their clocks disagree.

-- Redis < 5 must be told to replicate effects before a script may write after reading TIME.
if redis.replicate_commands then
  redis.replicate_commands()
end

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
