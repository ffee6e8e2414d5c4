-- Check and take, atomically: refill, then when every configured bucket has room take one
-- request and the prompt's estimated tokens (which may leave the token bucket in debt);
-- otherwise take nothing.
-- KEYS: bucket
-- ARGV: requests per minute (0 = no limit), tokens per minute (0 = no limit), tokens to take
-- Returns {1 room | 0 none, requests level or '', tokens level or ''}
local now = now_ms()
local rpm, tpm, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local r, t = load(KEYS[1], rpm, tpm, now)
local room = (r == nil or r >= 1) and (t == nil or t >= 1)
if room then
  if r ~= nil then
    r = r - 1
  end
  if t ~= nil then
    t = t - cost
  end
end
store(KEYS[1], rpm, tpm, r, t, now)
if room then
  return {1, show(r), show(t)}
end
return {0, show(r), show(t)}
