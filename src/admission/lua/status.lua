-- Cluster-wide figures for /status, sweeping first so an idle cluster still reclaims dead
-- replicas' leases and drops abandoned queue entries.
-- KEYS: (slots, queue, deadlines) per tier
-- Returns {in flight, queued, leases reclaimed} per tier, flattened
local now = now_ms()
local out = {}
for i = 1, #KEYS, 3 do
  local reclaimed = reclaim(KEYS[i], now)
  drop_expired(KEYS[i + 1], KEYS[i + 2], now)
  out[#out + 1] = redis.call('ZCARD', KEYS[i])
  out[#out + 1] = redis.call('ZCARD', KEYS[i + 1])
  out[#out + 1] = reclaimed
end
return out
