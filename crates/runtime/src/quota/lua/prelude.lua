-- Shared head of the quota scripts (prepended in Rust). The bucket math is the same as
-- src/quota/bucket.rs: capacity = the per-minute limit, refilled continuously at limit/60 per
-- second, a missing level starts full, room = at least one unit in every configured bucket.
-- A bucket is a hash {r = requests level, t = tokens level, ts = last update, ms}. Time is
-- Redis's (TIME), so replicas with skewed clocks refill alike.

-- now_ms() comes from src/redis_clock.lua, prepended before this file.

-- A level refilled over `elapsed` ms; nil when the dimension has no limit (0).
local function refilled(stored, limit, elapsed)
  if limit <= 0 then
    return nil
  end
  local level = tonumber(stored)
  if level == nil then
    return limit
  end
  level = level + elapsed * limit / 60000
  if level > limit then
    level = limit
  end
  return level
end

-- The bucket's levels as of `now`.
local function load(key, rpm, tpm, now)
  local h = redis.call('HMGET', key, 'r', 't', 'ts')
  local ts = tonumber(h[3]) or now
  local elapsed = now - ts
  if elapsed < 0 then
    elapsed = 0
  end
  return refilled(h[1], rpm, elapsed), refilled(h[2], tpm, elapsed)
end

local function cap(level, limit)
  if level ~= nil and level > limit then
    return limit
  end
  return level
end

-- Writes the bucket. The key expires once the bucket would be full again: a full bucket and
-- a missing key mean the same, so idle tenants leave nothing behind.
local function store(key, rpm, tpm, r, t, now)
  local full_in = 0
  local fields = {'ts', now}
  for _, d in ipairs({{'r', r, rpm}, {'t', t, tpm}}) do
    local name, level, limit = d[1], d[2], d[3]
    if level == nil then
      redis.call('HDEL', key, name)
    else
      table.insert(fields, name)
      table.insert(fields, string.format('%.17g', level))
      local ms = (limit - level) * 60000 / limit
      if ms > full_in then
        full_in = ms
      end
    end
  end
  redis.call('HSET', key, unpack(fields))
  redis.call('PEXPIRE', key, math.ceil(full_in) + 1000)
end

local function show(level)
  if level == nil then
    return ''
  end
  return string.format('%.17g', level)
end
