-- Joins the tier's queue and its tenant's own FIFO. Arrival order is a Redis counter, not a
-- clock, so order holds across replicas; the deadline is kept alongside so an abandoned entry
-- drops out by itself.
-- KEYS: tier_keys
-- ARGV: base, waiter id, max queue size, max wait ms, tenant, charge, half-life ms
-- Returns {1 queued | -1 queue full | -2 already queued, queue length}
local K = tier_keys(0)
local base, waiter, tenant = ARGV[1], ARGV[2], ARGV[5]
local now = now_ms()
drop_expired(K, base, now)
local size = redis.call('ZCARD', K.queue)
if redis.call('ZSCORE', K.queue, waiter) then
  return {-2, size}
end
if size >= tonumber(ARGV[3]) then
  return {-1, size}
end
local seq = redis.call('INCR', K.seq)
redis.call('ZADD', K.queue, seq, waiter)
redis.call('ZADD', K.deadlines, now + tonumber(ARGV[4]), waiter)
redis.call('HSET', K.wt, waiter, tenant)
redis.call('HSET', K.wc, waiter, ARGV[6])
if not redis.call('ZSCORE', K.backlog, tenant) then
  enter(K, tenant, now, tonumber(ARGV[7]))
end
redis.call('ZADD', tenant_queue(base, tenant), seq, waiter)
return {1, size + 1}
