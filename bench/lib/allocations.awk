# Calls into mimalloc's allocation entry points (malloc, zalloc, realloc, plain or aligned: see
# src/alloc.rs for which one a Rust allocation takes) from outside mimalloc,
# summed over a callgrind output file; names may be compressed ("(id) name" once, "(id)" after).
function name(spec,   id, rest) {
  id = spec; sub(/\).*/, ")", id); rest = spec; sub(/^\([0-9]+\) ?/, "", rest)
  if (rest != "") names[id] = rest
  return names[id]
}
/^fn=/  { cur = name(substr($0, 4)); next }
/^cfn=/ { callee = name(substr($0, 5)); next }
/^calls=/ {
  if (callee ~ /^mi_(malloc|zalloc|realloc)(_aligned)?($|[ '])/ && cur !~ /^_?mi_/) { split(substr($1, 7), c, " "); n += c[1] }
  callee = ""; next
}
END { print n + 0 }
