-- Shared head of every admission script (prepended in Rust). Time comes from Redis, never
-- from the replicas, so lease expiry and queue deadlines mean the same on every replica even
-- when their clocks disagree.

-- Redis < 5 must be told to replicate effects before a script may write after reading TIME.
if redis.replicate_commands then
  redis.replicate_commands()
end

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Leases nobody renewed in time belong to a replica that died or lost Redis: their capacity
-- goes back to the pool. Returns how many were reclaimed.
local function reclaim(slots, now)
  return redis.call('ZREMRANGEBYSCORE', slots, '-inf', now)
end

-- Queue entries past their deadline belong to waiters that gave up or died; left in place they
-- would block the head of the queue.
local function drop_expired(queue, deadlines, now)
  local gone = redis.call('ZRANGEBYSCORE', deadlines, '-inf', now)
  for _, member in ipairs(gone) do
    redis.call('ZREM', queue, member)
  end
  if #gone > 0 then
    redis.call('ZREMRANGEBYSCORE', deadlines, '-inf', now)
  end
  return #gone
end
