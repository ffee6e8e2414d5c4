-- Gives a slot back. Releasing a slot whose lease was already reclaimed is a no-op, so a late
-- release can never free someone else's capacity.
-- KEYS: slots
-- ARGV: slot member
-- Returns 1 when the lease was still held, else 0
return redis.call('ZREM', KEYS[1], ARGV[1])
