#!/usr/bin/env python3
"""Static PTX instruction counts of one kernel, per basic block and per source line.

Compile with line info, e.g.
  nvcc -ptx -lineinfo -arch=sm_90 -std=c++17 -O3 -DNDEBUG -I src -I include inst.cu -o k.ptx
where inst.cu includes src/cuda/decode_kernels.cuh and instantiates the kernels, then
  scripts/ptx_count.py k.ptx ENTRY_SUBSTRING [--file decode_kernels.cuh] [--lines A-B ...]
prints every basic block (label, non-mov instructions, source lines of --file they come
from, shuffles / shared / global loads) and, for each --lines range, the non-mov
instructions attributed to those lines (the innermost .loc, inlined code included).
Multiply a block's count by its executions per tile to get per-token costs.
"""
import argparse
import re
import sys
from collections import Counter, defaultdict


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ptx")
    ap.add_argument("entry")
    ap.add_argument("--file", default="decode_kernels.cuh")
    ap.add_argument("--lines", action="append", default=[])
    ap.add_argument("--quiet", action="store_true", help="no per-block listing")
    a = ap.parse_args()
    text = open(a.ptx).read().splitlines()
    files = {}
    for ln in text:
        m = re.match(r'\s*\.file\s+(\d+)\s+"([^"]+)"', ln)
        if m:
            files[m.group(1)] = m.group(2)
    start = next(i for i, ln in enumerate(text) if ".entry" in ln and a.entry in ln)
    body = []
    depth = 0
    for ln in text[start:]:
        depth += ln.count("{") - ln.count("}")
        body.append(ln)
        if depth == 0 and "}" in ln:
            break
    blocks = []  # [label, count, Counter(lines), Counter(kinds)]
    cur = ["<entry>", 0, Counter(), Counter()]
    line = None
    per_line = Counter()
    for ln in body:
        s = ln.strip()
        m = re.match(r"\.loc\s+(\d+)\s+(\d+)", s)
        if m:
            line = int(m.group(2)) if a.file in files.get(m.group(1), "") else None
            continue
        m = re.match(r"^(\$?\w+):$", s)
        if m:
            blocks.append(cur)
            cur = [m.group(1), 0, Counter(), Counter()]
            continue
        if not s or s.startswith(("//", ".", "{", "}", ")")) or s.endswith(","):
            continue
        op = re.sub(r"^@!?%p\d+\s+", "", s).split()[0]
        if op.startswith("mov") or op.startswith("ld.param"):
            continue
        cur[1] += 1
        if line is not None:
            cur[2][line] += 1
            per_line[line] += 1
        for kind in ("shfl", "ld.shared", "st.shared", "ld.global", "bra", "call"):
            if op.startswith(kind):
                cur[3][kind] += 1
        if op.startswith("bra") or op.startswith("ret"):
            blocks.append(cur)
            cur = ["(fall)", 0, Counter(), Counter()]
    blocks.append(cur)
    if not a.quiet:
        for b in blocks:
            if b[1]:
                ls = sorted(b[2])
                rng = f"{ls[0]}-{ls[-1]}" if ls else "-"
                print(f"{b[0]:>14} {b[1]:5d}  lines {rng:>9}  {dict(b[3])}")
    print(f"total {sum(b[1] for b in blocks)}")
    for r in a.lines:
        lo, hi = map(int, r.split("-"))
        print(f"lines {r}: {sum(v for k, v in per_line.items() if lo <= k <= hi)}")


if __name__ == "__main__":
    sys.exit(main())
