-- Takes a slot only when the tier is below capacity AND nobody is queued ahead, so a newcomer
-- cannot overtake the FIFO queue. Capacity 0 means unlimited (the slot is still counted).
-- KEYS: slots, queue, deadlines
-- ARGV: capacity, slot member, lease ms
-- Returns {1 admitted | 0 refused, leases reclaimed}
local now = now_ms()
local reclaimed = reclaim(KEYS[1], now)
drop_expired(KEYS[2], KEYS[3], now)
local capacity = tonumber(ARGV[1])
if capacity == 0
  or (redis.call('ZCARD', KEYS[2]) == 0 and redis.call('ZCARD', KEYS[1]) < capacity) then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[2])
  return {1, reclaimed}
end
return {0, reclaimed}
