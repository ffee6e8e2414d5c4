-- FIFO claim: only the head of the queue may take a slot, and leaving the queue and taking the
-- slot happen in one step, so a released slot can never be lost between the two.
-- KEYS: slots, queue, deadlines
-- ARGV: waiter id, capacity, slot member, lease ms
-- Returns {1 claimed | 0 keep waiting | -1 no longer queued (deadline passed), leases reclaimed}
local now = now_ms()
local reclaimed = reclaim(KEYS[1], now)
drop_expired(KEYS[2], KEYS[3], now)
if not redis.call('ZSCORE', KEYS[2], ARGV[1]) then
  return {-1, reclaimed}
end
if redis.call('ZRANGE', KEYS[2], 0, 0)[1] ~= ARGV[1] then
  return {0, reclaimed}
end
local capacity = tonumber(ARGV[2])
if capacity ~= 0 and redis.call('ZCARD', KEYS[1]) >= capacity then
  return {0, reclaimed}
end
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[4]), ARGV[3])
return {1, reclaimed}
