-- Charges after the fact, many tenants per call: completion tokens (negative, may leave a
-- debt) and refunds of requests refused after their take (positive, never above the limit).
-- KEYS: buckets
-- ARGV: per key, requests per minute, tokens per minute, requests delta, tokens delta
-- Returns the number of buckets charged.
local now = now_ms()
for i, key in ipairs(KEYS) do
  local a = (i - 1) * 4
  local rpm, tpm = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  local r, t = load(key, rpm, tpm, now)
  if r ~= nil then
    r = cap(r + tonumber(ARGV[a + 3]), rpm)
  end
  if t ~= nil then
    t = cap(t + tonumber(ARGV[a + 4]), tpm)
  end
  store(key, rpm, tpm, r, t, now)
end
return #KEYS
