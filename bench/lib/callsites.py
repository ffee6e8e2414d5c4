#!/usr/bin/env python3
"""Where one function is called from, by source line, in a callgrind file.

callgrind_annotate's caller trees name the calling function, not the line, and an async
function's whole state machine is one function: "memcpy, called from process_new" does not say
which await moved what. With line tables in the binary (build with
CARGO_PROFILE_RELEASE_DEBUG=line-tables-only in its own target directory), every call in the
callgrind file carries the file and line it was made from, inlined code included; this sums
each call site's inclusive cost and calls, per request.

    bench/lib/callsites.py CALLGRIND_FILE FUNCTION_SUBSTRING REQUESTS [TOP]

e.g. `bench/lib/callsites.py /tmp/cg/sluice.out __memcpy_avx_unaligned_erms 4555` (REQUESTS from
bench/instructions.sh's output) printed `boxed.rs:289 in <ConnGuard as ServerApp>::process_new`
at 16.4k instructions and one call a request: the boxed per-request future (issue 13).
"""
import collections
import re
import sys


def main():
    path, target, requests = sys.argv[1], sys.argv[2], float(sys.argv[3])
    top = int(sys.argv[4]) if len(sys.argv) > 4 else 15
    names = {"file": {}, "fn": {}}

    def resolve(table, text):
        # Compressed names: "(12) name" defines id 12, "(12)" refers to it.
        m = re.match(r"\((\d+)\)(?: (.*))?", text)
        if not m:
            return text
        if m.group(2) is not None:
            names[table][m.group(1)] = m.group(2)
        return names[table].get(m.group(1), "?")

    current_file = current_fn = callee = None
    calls = 0
    line = 0
    sites = collections.defaultdict(lambda: [0, 0])
    with open(path, errors="replace") as f:
        for raw in f:
            raw = raw.rstrip("\n")
            key = raw[:4]
            if raw[:3] in ("fl=", "fi=", "fe="):
                current_file = resolve("file", raw[3:])
            elif raw.startswith("fn="):
                current_fn = resolve("fn", raw[3:])
            elif key in ("cfl=", "cfi="):
                resolve("file", raw[4:])
            elif key == "cfn=":
                callee = resolve("fn", raw[4:])
            elif raw.startswith("calls="):
                calls = int(raw[6:].split()[0])
            elif raw and (raw[0].isdigit() or raw[0] in "+-*"):
                fields = raw.split()
                pos = fields[0]
                # Positions may be relative to the previous line (--compress-pos).
                if pos[0] == "+":
                    line += int(pos[1:])
                elif pos[0] == "-":
                    line -= int(pos[1:])
                elif pos != "*":
                    line = int(pos)
                if callee is not None:
                    if target in callee and len(fields) > 1:
                        site = sites[(current_file, line, current_fn)]
                        site[0] += int(fields[1])
                        site[1] += calls
                    callee = None
    ranked = sorted(sites.items(), key=lambda kv: -kv[1][0])[:top]
    print(f"{'instr/req':>9} {'calls/req':>9}  call site")
    for (file, line, fn), (cost, n) in ranked:
        short = (file or "?").split("/src/")[-1]
        print(f"{cost / requests:9.0f} {n / requests:9.2f}  {short}:{line} in {fn[:100]}")


if __name__ == "__main__":
    main()
