-- Cluster-wide figures for /status, sweeping first so an idle cluster still reclaims dead
-- replicas' leases and drops abandoned queue entries.
-- KEYS: tier_keys per tier
-- ARGV: base per tier, then how many waiting tenants to list per tier
-- Returns per tier {in flight, queued, leases reclaimed, {tenant, counter, queued, ...}}
local now = now_ms()
local tiers = #KEYS / TIER_KEYS
local listed = tonumber(ARGV[tiers + 1])
local out = {}
for i = 1, tiers do
  local K = tier_keys((i - 1) * TIER_KEYS)
  local base = ARGV[i]
  local reclaimed = reclaim(K.slots, now)
  drop_expired(K, base, now)
  local queued = redis.call('ZCARD', K.queue)
  -- Counters matter only between waiting tenants; with nobody waiting a large set (tenant ids
  -- can come from a client header) is forgotten rather than kept forever.
  if queued == 0 and redis.call('HLEN', K.vtc) > 4096 then
    redis.call('DEL', K.vtc, K.vtc_at, K.vtc_last)
  end
  local waiting = {}
  local entries = redis.call('ZRANGE', K.backlog, 0, listed - 1, 'WITHSCORES')
  for j = 1, #entries, 2 do
    waiting[#waiting + 1] = entries[j]
    waiting[#waiting + 1] = entries[j + 1]
    waiting[#waiting + 1] = redis.call('ZCARD', tenant_queue(base, entries[j]))
  end
  out[i] = {redis.call('ZCARD', K.slots), queued, reclaimed, waiting}
end
return out
