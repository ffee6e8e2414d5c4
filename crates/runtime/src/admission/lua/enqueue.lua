-- Joins the tier's queue and its tenant's own FIFO. Arrival order is a Redis counter, not a
-- clock, so order holds across replicas; the deadline is kept alongside so an abandoned entry
-- drops out by itself.
-- KEYS: tier_keys
-- ARGV: base, waiter id, max queue size, max wait ms, tenant, charge, half-life ms, fair (1/0)
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
  -- Full: a tenant with fewer waiters than the longest-queued one takes the place of that
  -- tenant's newest waiter, which finds itself pushed out at its next claim (local.rs:
  -- push_out_for).
  if ARGV[8] ~= '1' then
    return {-1, size}
  end
  local mine = redis.call('ZCARD', tenant_queue(base, tenant))
  local victim, longest = nil, mine + 1
  for _, t in ipairs(redis.call('ZRANGE', K.backlog, 0, 255)) do
    local n = redis.call('ZCARD', tenant_queue(base, t))
    if t ~= tenant and n > longest then
      victim, longest = t, n
    end
  end
  if not victim then
    return {-1, size}
  end
  local newest = redis.call('ZRANGE', tenant_queue(base, victim), -1, -1)[1]
  forget_waiter(K, base, newest)
  redis.call('ZREMRANGEBYSCORE', K.pushed, '-inf', now - 60000)
  redis.call('ZADD', K.pushed, now, newest)
  size = size - 1
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
