-- Reads buckets as of now without changing them (the /status refresh).
-- KEYS: buckets
-- ARGV: per key, requests per minute, tokens per minute
-- Returns per key the requests and tokens levels ('' when not limited).
local now = now_ms()
local out = {}
for i, key in ipairs(KEYS) do
  local rpm, tpm = tonumber(ARGV[2 * i - 1]), tonumber(ARGV[2 * i])
  local r, t = load(key, rpm, tpm, now)
  table.insert(out, show(r))
  table.insert(out, show(t))
end
return out
