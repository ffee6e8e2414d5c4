-- Removes a waiter that gave up (deadline, client gone) from the queue.
-- KEYS: tier_keys
-- ARGV: base, waiter id
-- Returns 1 when it was still queued, else 0
local K = tier_keys(0)
local queued = redis.call('ZSCORE', K.queue, ARGV[2])
forget_waiter(K, ARGV[1], ARGV[2])
if queued then
  return 1
end
return 0
