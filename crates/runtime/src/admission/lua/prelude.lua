-- Shared head of every admission script (prepended in Rust, after src/redis_clock.lua).
--
-- Every per-tier script gets the tier's keys in the same order (tier_keys) and the tier's key
-- base as ARGV[1]: each tenant's own FIFO lives at `<base>:tq:<tenant>`, a key the script
-- derives, which is why these keys are not Redis Cluster-safe (see redis.rs).

-- now_ms() comes from src/redis_clock.lua, prepended before this file.

-- slots: held leases (and slots kept for a tenant's next request, scored by when the grace
-- ends); queue: every waiter by arrival; deadlines: when each gives up; seq: arrival counter;
-- backlog: waiting tenants by virtual token counter; vtc / vtc_at / vtc_last: each tenant's
-- counter, when it was last charged and by how much; vtc_ahead: the charges of its requests
-- still running; before: waiting tenants by their counter less what it is ahead by (fair.rs:
-- ahead_of); wt / wc: each waiter's tenant and charge; pushed: waiters pushed out of a full
-- queue, until they notice; credits: each replica's idle capacity credits (slots it leased and
-- no request uses), as it last reported; lent: each charged slot's charge, when it was taken
-- and its tenant, given back when it is released; kept: slots kept for a tenant, by member;
-- vtc_keep: each tenant's last request end, grace and whether a slot kept for it went unused;
-- vtc_owed: what each tenant was owed for waiting when its latest waiter was admitted, and when.
local TIER_KEYS = 18

-- fair.rs: MAX_GRACE_MS.
local MAX_GRACE_MS = 500

local function tier_keys(offset)
  return {
    slots = KEYS[offset + 1], queue = KEYS[offset + 2], deadlines = KEYS[offset + 3],
    seq = KEYS[offset + 4], backlog = KEYS[offset + 5], vtc = KEYS[offset + 6],
    vtc_at = KEYS[offset + 7], wt = KEYS[offset + 8], wc = KEYS[offset + 9],
    pushed = KEYS[offset + 10], vtc_last = KEYS[offset + 11], before = KEYS[offset + 12],
    credits = KEYS[offset + 13], vtc_ahead = KEYS[offset + 14], lent = KEYS[offset + 15],
    kept = KEYS[offset + 16], vtc_keep = KEYS[offset + 17], vtc_owed = KEYS[offset + 18],
  }
end

local function num(v)
  return string.format('%.17g', v)
end

local function tenant_queue(base, tenant)
  return base .. ':tq:' .. tenant
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

local function hnum(key, field)
  return tonumber(redis.call('HGET', key, field) or '0')
end

-- A waiting tenant's place in `before`: its counter less what it is ahead by (fair.rs: Floor).
local function rebase(K, tenant)
  if redis.call('ZSCORE', K.backlog, tenant) then
    local ahead = math.max(hnum(K.vtc_last, tenant), hnum(K.vtc_ahead, tenant))
    redis.call('ZADD', K.before, num(hnum(K.vtc, tenant) - ahead), tenant)
  end
end

-- Charges a tenant an admission that takes slot `member` (fair.rs: FairShare::charge), and
-- notes what to give back when the slot is released.
local function charge(K, tenant, c, now, member)
  local v = hnum(K.vtc, tenant) + c
  redis.call('HSET', K.vtc, tenant, num(v))
  redis.call('HSET', K.vtc_at, tenant, now)
  redis.call('HSET', K.vtc_last, tenant, num(c))
  redis.call('HSET', K.vtc_ahead, tenant, num(hnum(K.vtc_ahead, tenant) + c))
  redis.call('HSET', K.lent, member, string.format('%s %d %s', num(c), now, tenant))
  if redis.call('ZSCORE', K.backlog, tenant) then
    redis.call('ZADD', K.backlog, num(v), tenant)
    rebase(K, tenant)
  end
end

-- A charged slot is given back (fair.rs: FairShare::finish): its charge is service had.
-- Returns its tenant and how long it was held, or nil for a slot nobody was charged for.
local function finish(K, member, now)
  local rec = redis.call('HGET', K.lent, member)
  if not rec then
    return nil
  end
  redis.call('HDEL', K.lent, member)
  local c, at, tenant = string.match(rec, '^(%S+) (%d+) (.*)$')
  if not tenant then
    return nil
  end
  -- fair.rs: ahead_after.
  local left = hnum(K.vtc_ahead, tenant) - tonumber(c)
  if left > 1e-6 then
    redis.call('HSET', K.vtc_ahead, tenant, num(left))
  else
    redis.call('HDEL', K.vtc_ahead, tenant)
  end
  rebase(K, tenant)
  return tenant, math.max(now - tonumber(at), 0)
end

-- A tenant's hold state (fair.rs: Counter's ended_ms, grace_ms, slow).
local function keep_state(K, tenant)
  local st = redis.call('HGET', K.vtc_keep, tenant)
  if not st then
    return 0, 0, false
  end
  local ended, grace, slow = string.match(st, '^(%d+) (%d+) (%d)$')
  return tonumber(ended or 0), tonumber(grace or 0), slow == '1'
end

local function set_keep_state(K, tenant, ended, grace, slow)
  redis.call('HSET', K.vtc_keep, tenant, string.format('%d %d %d', ended, grace, slow and 1 or 0))
end

-- A request of `tenant` that held its slot `held` ms ended (fair.rs: FairShare::keep, called
-- when nobody of the tenant waits): how long the slot is kept for the tenant's next request,
-- or nil when it goes on.
local function keep(K, base, tenant, held, now)
  if redis.call('ZCARD', tenant_queue(base, tenant)) > 0 then
    return nil
  end
  if not redis.call('HGET', K.vtc, tenant) then
    return nil
  end
  local _, _, slow = keep_state(K, tenant)
  -- fair.rs: grace_of.
  local grace = math.min(math.floor(held / 4), MAX_GRACE_MS)
  set_keep_state(K, tenant, now, grace, slow)
  local low = redis.call('ZRANGE', K.backlog, 0, 0, 'WITHSCORES')
  -- fair.rs: keeps.
  if not low[1] or slow or grace <= 0 or hnum(K.vtc, tenant) > tonumber(low[2]) then
    return nil
  end
  return grace
end

-- A slot kept for `tenant` went unused (fair.rs: FairShare::unused).
local function unused(K, tenant)
  local ended, grace = keep_state(K, tenant)
  set_keep_state(K, tenant, ended, grace, true)
end

-- A request of `tenant` arrives (fair.rs: FairShare::arrive).
local function arrive(K, tenant, now)
  local ended, grace, slow = keep_state(K, tenant)
  if slow and now - ended <= grace then
    set_keep_state(K, tenant, ended, grace, false)
  end
end

-- Takes a slot kept for `tenant`, if there is one (its grace has not ended: `reclaim` ran).
local function take_kept(K, tenant)
  local kept = redis.call('HGETALL', K.kept)
  for i = 1, #kept, 2 do
    if kept[i + 1] == tenant and redis.call('ZSCORE', K.slots, kept[i]) then
      redis.call('HDEL', K.kept, kept[i])
      redis.call('ZREM', K.slots, kept[i])
      return true
    end
  end
  return false
end

-- Leases nobody renewed in time belong to a replica that died or lost Redis: their capacity
-- goes back to the pool, and their charges are service had. Slots kept for a tenant whose
-- grace ended go on too (not counted: nobody died). Returns how many leases were reclaimed.
local function reclaim(K, now)
  local gone = redis.call('ZRANGEBYSCORE', K.slots, '-inf', now)
  if #gone == 0 then
    return 0
  end
  local n = 0
  for _, member in ipairs(gone) do
    local tenant = redis.call('HGET', K.kept, member)
    if tenant then
      redis.call('HDEL', K.kept, member)
      unused(K, tenant)
    else
      finish(K, member, now)
      n = n + 1
    end
  end
  redis.call('ZREMRANGEBYSCORE', K.slots, '-inf', now)
  return n
end

-- A waiter of `tenant` was admitted from the queue, after `charge` (fair.rs:
-- FairShare::claimed): what its counter stays under the lowest counter of the tenants still
-- waiting besides it is owed to it until it next waits.
local function claimed(K, tenant, now)
  local owed = 0
  local low = redis.call('ZRANGE', K.backlog, 0, 1, 'WITHSCORES')
  for i = 1, #low, 2 do
    if low[i] ~= tenant then
      -- fair.rs: owed_under.
      owed = math.max(tonumber(low[i + 1]) - hnum(K.vtc, tenant), 0)
      break
    end
  end
  redis.call('HSET', K.vtc_owed, tenant, string.format('%s %d', num(owed), now))
end

-- `amount` recorded at `at`, halved every `half_life` ms since (fair.rs: faded).
local function faded(amount, at, now, half_life)
  return amount * math.pow(0.5, math.max(now - at, 0) / half_life)
end

-- What `tenant` is still owed for waiting.
local function owed(K, tenant, now, half_life)
  local rec = redis.call('HGET', K.vtc_owed, tenant)
  local o, at = string.match(rec or '', '^(%S+) (%d+)$')
  if not o then
    return 0
  end
  return faded(tonumber(o), tonumber(at), now, half_life)
end

-- A tenant starts waiting (fair.rs: FairShare::enter and entered): below the lowest counter
-- any waiting tenant has less what it is ahead by, less what it is still owed for waiting, it
-- is lifted to that; up to the lowest waiting counter it keeps its own (it is owed what the
-- others were charged in advance); above, its excess fades by half-lives since it was last
-- charged.
local function enter(K, tenant, now, half_life)
  local v = hnum(K.vtc, tenant)
  local low = redis.call('ZRANGE', K.backlog, 0, 0, 'WITHSCORES')
  if low[1] then
    local lowest = tonumber(low[2])
    local lift = tonumber(redis.call('ZRANGE', K.before, 0, 0, 'WITHSCORES')[2] or lowest)
      - owed(K, tenant, now, half_life)
    local was = v
    if v <= lift then
      v = lift
    elseif v > lowest then
      local at = tonumber(redis.call('HGET', K.vtc_at, tenant) or now)
      v = lowest + faded(v - lowest, at, now, half_life)
    end
    if v ~= was then
      -- A lifted or faded counter owes nothing to its latest admission any more.
      redis.call('HSET', K.vtc, tenant, num(v))
      redis.call('HSET', K.vtc_last, tenant, 0)
    end
  end
  redis.call('ZADD', K.backlog, num(v), tenant)
  rebase(K, tenant)
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
