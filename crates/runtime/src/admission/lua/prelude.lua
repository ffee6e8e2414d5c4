-- Shared head of every admission script (prepended in Rust, after src/redis_clock.lua).
--
-- Every per-tier script gets the tier's keys in the same order (tier_keys) and the tier's key
-- base as ARGV[1]: each tenant's own FIFO lives at `<base>:tq:<tenant>`, a key the script
-- derives, which is why these keys are not Redis Cluster-safe (see redis.rs).

-- now_ms() comes from src/redis_clock.lua, prepended before this file.

-- slots: held leases; queue: every waiter by arrival; deadlines: when each gives up;
-- seq: arrival counter; backlog: waiting tenants by virtual token counter; vtc / vtc_at /
-- vtc_last: each tenant's counter, when it was last charged and by how much; before: waiting
-- tenants by their counter before their latest charge; wt / wc: each waiter's tenant and
-- charge; pushed: waiters pushed out of a full queue, until they notice; credits: each
-- replica's idle capacity credits (slots it leased and no request uses), as it last reported.
local TIER_KEYS = 13

local function tier_keys(offset)
  return {
    slots = KEYS[offset + 1], queue = KEYS[offset + 2], deadlines = KEYS[offset + 3],
    seq = KEYS[offset + 4], backlog = KEYS[offset + 5], vtc = KEYS[offset + 6],
    vtc_at = KEYS[offset + 7], wt = KEYS[offset + 8], wc = KEYS[offset + 9],
    pushed = KEYS[offset + 10], vtc_last = KEYS[offset + 11], before = KEYS[offset + 12],
    credits = KEYS[offset + 13],
  }
end

local function num(v)
  return string.format('%.17g', v)
end

local function tenant_queue(base, tenant)
  return base .. ':tq:' .. tenant
end

-- Leases nobody renewed in time belong to a replica that died or lost Redis: their capacity
-- goes back to the pool. Returns how many were reclaimed.
local function reclaim(slots, now)
  return redis.call('ZREMRANGEBYSCORE', slots, '-inf', now)
end

-- Removes a waiter from every structure; a tenant whose own queue empties stops waiting.
local function forget_waiter(K, base, member)
  redis.call('ZREM', K.queue, member)
  redis.call('ZREM', K.deadlines, member)
  local tenant = redis.call('HGET', K.wt, member)
  if tenant then
    local tq = tenant_queue(base, tenant)
    redis.call('ZREM', tq, member)
    if redis.call('ZCARD', tq) == 0 then
      redis.call('ZREM', K.backlog, tenant)
      redis.call('ZREM', K.before, tenant)
    end
    redis.call('HDEL', K.wt, member)
    redis.call('HDEL', K.wc, member)
  end
end

-- Queue entries past their deadline belong to waiters that gave up or died; left in place they
-- would block the head of the queue.
local function drop_expired(K, base, now)
  local gone = redis.call('ZRANGEBYSCORE', K.deadlines, '-inf', now)
  for _, member in ipairs(gone) do
    forget_waiter(K, base, member)
  end
  return #gone
end

-- Charges a tenant an admission (fair.rs: FairShare::charge).
local function charge(K, tenant, c, now)
  local before = tonumber(redis.call('HGET', K.vtc, tenant) or '0')
  local v = before + c
  redis.call('HSET', K.vtc, tenant, num(v))
  redis.call('HSET', K.vtc_at, tenant, now)
  redis.call('HSET', K.vtc_last, tenant, num(c))
  if redis.call('ZSCORE', K.backlog, tenant) then
    redis.call('ZADD', K.backlog, num(v), tenant)
    redis.call('ZADD', K.before, num(before), tenant)
  end
end

-- A tenant starts waiting (fair.rs: FairShare::enter and entered): below the lowest counter
-- any waiting tenant had before its latest charge it is lifted to it; up to the lowest waiting
-- counter it keeps its own (it is owed what the others were charged in advance); above, its
-- excess fades by half-lives since it was last charged.
local function enter(K, tenant, now, half_life)
  local v = tonumber(redis.call('HGET', K.vtc, tenant) or '0')
  local last = tonumber(redis.call('HGET', K.vtc_last, tenant) or '0')
  local low = redis.call('ZRANGE', K.backlog, 0, 0, 'WITHSCORES')
  if low[1] then
    local lowest = tonumber(low[2])
    local lift = tonumber(redis.call('ZRANGE', K.before, 0, 0, 'WITHSCORES')[2] or lowest)
    local was = v
    if v <= lift then
      v = lift
    elseif v > lowest then
      local at = tonumber(redis.call('HGET', K.vtc_at, tenant) or now)
      v = lowest + (v - lowest) * math.pow(0.5, math.max(now - at, 0) / half_life)
    end
    if v ~= was then
      -- A lifted or faded counter owes nothing to a running request any more.
      last = 0
      redis.call('HSET', K.vtc, tenant, num(v))
      redis.call('HSET', K.vtc_last, tenant, 0)
    end
  end
  redis.call('ZADD', K.backlog, num(v), tenant)
  redis.call('ZADD', K.before, num(v - last), tenant)
end

-- The waiter served next: with fair share, the oldest waiter of the tenant with the lowest
-- counter (ties: the oldest head); without, the oldest waiter. A waiting tenant whose own queue
-- is empty (its entries expired elsewhere) is dropped on the way.
local function next_waiter(K, base, fair)
  if fair ~= '1' then
    return redis.call('ZRANGE', K.queue, 0, 0)[1]
  end
  local entries = redis.call('ZRANGE', K.backlog, 0, 63, 'WITHSCORES')
  local best, best_score, best_seq
  for i = 1, #entries, 2 do
    local tenant, score = entries[i], tonumber(entries[i + 1])
    if best_score and score > best_score then
      break
    end
    local head = redis.call('ZRANGE', tenant_queue(base, tenant), 0, 0, 'WITHSCORES')
    if not head[1] then
      redis.call('ZREM', K.backlog, tenant)
      redis.call('ZREM', K.before, tenant)
    elseif not best_seq or tonumber(head[2]) < best_seq then
      best, best_score, best_seq = head[1], score, tonumber(head[2])
    end
  end
  return best or redis.call('ZRANGE', K.queue, 0, 0)[1]
end
