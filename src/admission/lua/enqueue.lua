-- Joins the tier's queue. Arrival order is a Redis counter, not a clock, so FIFO holds across
-- replicas; the deadline is kept alongside so an abandoned entry drops out by itself.
-- KEYS: queue, deadlines, sequence counter
-- ARGV: waiter id, max queue size, max wait ms
-- Returns {1 queued | -1 queue full | -2 already queued, queue length}
local now = now_ms()
drop_expired(KEYS[1], KEYS[2], now)
local size = redis.call('ZCARD', KEYS[1])
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then
  return {-2, size}
end
if size >= tonumber(ARGV[2]) then
  return {-1, size}
end
local seq = redis.call('INCR', KEYS[3])
redis.call('ZADD', KEYS[1], seq, ARGV[1])
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[3]), ARGV[1])
return {1, size + 1}
