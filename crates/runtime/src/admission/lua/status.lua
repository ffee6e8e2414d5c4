-- Cluster-wide figures for /status, sweeping first so an idle cluster still reclaims dead
-- replicas' leases and drops abandoned queue entries. Slots are leases: requests in flight and
-- capacity credits nobody uses yet, which each replica reports here (its last report lapses
-- with its leases, so a dead replica's credits stop counting when they return).
-- KEYS: tier_keys per tier
-- ARGV: base per tier, how many waiting tenants to list per tier, this replica, how long its
-- report holds (ms), then this replica's idle credits per tier
-- Returns per tier {slots held, queued, leases reclaimed, {tenant, counter, queued, ...},
-- idle credits of every replica}
local now = now_ms()
local tiers = #KEYS / TIER_KEYS
local listed = tonumber(ARGV[tiers + 1])
local replica, holds = ARGV[tiers + 2], tonumber(ARGV[tiers + 3])
local out = {}
for i = 1, tiers do
  local K = tier_keys((i - 1) * TIER_KEYS)
  local base = ARGV[i]
  local reclaimed = reclaim(K, now)
  drop_expired(K, base, now)
  local queued = redis.call('ZCARD', K.queue)
  -- Counters matter only between waiting tenants; with nobody waiting a large set (tenant ids
  -- can come from a client header) is forgotten rather than kept forever. (A running request's
  -- charge given back to a forgotten counter is dropped: fair.rs's ahead_after.)
  if queued == 0 and redis.call('HLEN', K.vtc) > 4096 then
    redis.call('DEL', K.vtc, K.vtc_at, K.vtc_last, K.vtc_ahead, K.vtc_keep, K.vtc_owed)
  end
  local waiting = {}
  local entries = redis.call('ZRANGE', K.backlog, 0, listed - 1, 'WITHSCORES')
  for j = 1, #entries, 2 do
    waiting[#waiting + 1] = entries[j]
    waiting[#waiting + 1] = entries[j + 1]
    waiting[#waiting + 1] = redis.call('ZCARD', tenant_queue(base, entries[j]))
  end
  local mine = tonumber(ARGV[tiers + 3 + i])
  if mine > 0 then
    redis.call('HSET', K.credits, replica, string.format('%d:%d', mine, now + holds))
  else
    redis.call('HDEL', K.credits, replica)
  end
  local idle = 0
  local reports = redis.call('HGETALL', K.credits)
  for j = 1, #reports, 2 do
    local n, expiry = string.match(reports[j + 1], '^(%d+):(%d+)$')
    if n and tonumber(expiry) > now then
      idle = idle + tonumber(n)
    else
      redis.call('HDEL', K.credits, reports[j])
    end
  end
  out[i] = {redis.call('ZCARD', K.slots), queued, reclaimed, waiting, idle}
end
return out
