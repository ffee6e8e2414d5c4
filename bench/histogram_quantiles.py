#!/usr/bin/env python3
"""Quantiles of a Prometheus histogram from a /metrics text (linear interpolation inside the
bucket, as PromQL's histogram_quantile does). Usage: histogram_quantiles.py METRIC < metrics.txt"""
import re
import sys

name = sys.argv[1]
buckets = {}
for line in sys.stdin:
    m = re.match(r'^' + re.escape(name) + r'_bucket\{(.*)\} (\S+)$', line.strip())
    if not m:
        continue
    le = re.search(r'le="([^"]+)"', m.group(1)).group(1)
    le = float("inf") if le == "+Inf" else float(le)
    buckets[le] = buckets.get(le, 0.0) + float(m.group(2))
bounds = sorted(buckets)
total = buckets.get(float("inf"), 0.0)
if total == 0:
    sys.exit("no observations of " + name)

def q(p):
    rank = p * total
    prev_b, prev_c = 0.0, 0.0
    for b in bounds:
        c = buckets[b]
        if c >= rank:
            if b == float("inf"):
                return prev_b
            return prev_b + (b - prev_b) * (rank - prev_c) / max(c - prev_c, 1e-12)
        prev_b, prev_c = b, c
    return bounds[-1]

print(f"count={int(total)} p50={q(0.5)*1e6:.1f}us p90={q(0.9)*1e6:.1f}us p99={q(0.99)*1e6:.1f}us")
