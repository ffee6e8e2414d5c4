-- Removes a waiter that gave up (deadline, client gone) from the queue.
-- KEYS: queue, deadlines
-- ARGV: waiter id
-- Returns 1 when it was still queued, else 0
redis.call('ZREM', KEYS[2], ARGV[1])
return redis.call('ZREM', KEYS[1], ARGV[1])
