#!/usr/bin/env python3
"""Fails when the modules of a crate import each other in a circle.

Every crate of the workspace (a directory with a Cargo.toml and a src/) is read as a graph:
one node per module file, an edge A -> B when A names B in a path (`use crate::b::X`,
`super::b::X`, `crate::b::X` inline, `self::b` from a mod.rs). A module that only declares
modules and re-exports (a facade: lib.rs or mod.rs with nothing but `mod`, `pub use` and
docs) is left out: everyone may go through it, and it adds no dependency of its own. Any
other circle, however long, is printed with the files on it and the script exits 1.

    scripts/check-module-cycles.py [ROOT]      # default: the repository root
"""
import os
import re
import sys

PATH = re.compile(r"\b(crate|super|self)((?:::\w+)+)")
USE_BLOCK = re.compile(r"\buse\s+(crate|super|self)::\{([^;]*)\};", re.S)


def module_files(src):
    """Maps module path tuples to files, from a crate's src/ (lib.rs / main.rs are the root)."""
    mods = {}
    for dirpath, _, files in os.walk(src):
        for f in files:
            if not f.endswith(".rs"):
                continue
            path = os.path.join(dirpath, f)
            rel = os.path.relpath(path, src)[:-3].split(os.sep)
            if rel[-1] in ("lib", "main") and len(rel) == 1:
                key = ()
            elif rel[-1] == "mod":
                key = tuple(rel[:-1])
            else:
                key = tuple(rel)
            if key == () and rel[-1] == "main" and () in mods:
                continue  # a lib.rs beside main.rs is the root that matters
            mods[key] = path
    return mods


def strip_comments(text):
    text = re.sub(r"//[^\n]*", "", text)
    return re.sub(r"/\*.*?\*/", "", text, flags=re.S)


def is_facade(text):
    body = strip_comments(text)
    body = re.sub(r"#!?\[[^\]]*\]", "", body)
    for stmt in re.split(r";", body):
        stmt = stmt.strip()
        if not stmt:
            continue
        if re.match(r"^(pub(\([^)]*\))?\s+)?(mod\s+\w+|use\s+.+)$", stmt, re.S):
            continue
        return False
    return True


def references(text, here):
    """Module paths (as tuples, unresolved length) that `text` of module `here` names."""
    out = []
    body = strip_comments(text)
    # `use crate::{a::X, b}` expands to one path per item.
    for m in USE_BLOCK.finditer(body):
        for item in re.split(r",", m.group(2)):
            item = item.strip()
            if item:
                out.append(resolve(m.group(1), item.split("::"), here))
    for m in PATH.finditer(body):
        segs = [s for s in m.group(2).split("::") if s]
        out.append(resolve(m.group(1), segs, here))
    return [r for r in out if r is not None]


def resolve(anchor, segs, here):
    # `self` is the module itself and `super` its parent, for mod.rs and file modules alike.
    segs = [re.sub(r"\W.*", "", s) for s in segs]
    segs = [s for s in segs if s]
    if anchor == "crate":
        base = ()
    elif anchor == "self":
        base = here
    else:
        base = here[:-1]
    return base + tuple(segs)


def crate_graph(src):
    mods = module_files(src)
    texts = {k: open(p, encoding="utf-8").read() for k, p in mods.items()}
    facades = {k for k, t in texts.items() if is_facade(t)}
    edges = {k: set() for k in mods}
    for k, t in texts.items():
        if k in facades:
            continue
        for ref in references(t, k):
            # The longest known module the path starts with.
            target = None
            for n in range(len(ref), -1, -1):
                if ref[:n] in mods:
                    target = ref[:n]
                    break
            if target is None or target == k or target in facades:
                continue
            edges[k].add(target)
    return mods, edges


def cycles(edges):
    """Strongly connected components with more than one node (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def crates(root):
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in ("target", ".git", "vendor", "node_modules")]
        if "Cargo.toml" in files and os.path.isdir(os.path.join(dirpath, "src")):
            yield dirpath


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..")
    failed = False
    for crate in sorted(crates(os.path.abspath(root))):
        mods, edges = crate_graph(os.path.join(crate, "src"))
        for comp in cycles(edges):
            failed = True
            names = ["::".join(m) or "(root)" for m in comp]
            print(f"{os.path.relpath(crate, root)}: modules in a circle: {', '.join(names)}")
            for m in comp:
                deps = sorted("::".join(t) or "(root)" for t in edges[m] if t in comp)
                print(f"  {os.path.relpath(mods[m], root)} -> {', '.join(deps)}")
    if failed:
        sys.exit(1)
    print("no module circles")


if __name__ == "__main__":
    main()
