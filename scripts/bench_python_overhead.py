#!/usr/bin/env python3
"""Per-call overhead of the Python package against raw ctypes, for one decode step.

The same akv_decode call, on the same small cache (so the library's own work is a few
microseconds), made three ways:
  raw ctypes     anchorkv._capi.akv_decode with pointers computed once, outside the loop
  decode(q, out) Cache.decode with a preallocated output (what a decode loop does)
  decode(q)      Cache.decode allocating its output
Each is timed over --calls calls, best of --repeats; printed in microseconds per call.

  python3 scripts/bench_python_overhead.py   (library: ANCHORKV_LIBRARY or the installed package)
"""
from __future__ import annotations

import argparse
import time

import numpy as np

import anchorkv
from anchorkv import _capi


def best_per_call(fn, calls: int, repeats: int) -> float:
    """Microseconds per call, the best of `repeats` loops of `calls` calls."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seq-len", type=int, default=64)
    args = parser.parse_args()

    heads, q_heads, head_dim = 2, 4, 64
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((heads, args.seq_len, head_dim), dtype=np.float32)
    values = rng.standard_normal((heads, args.seq_len, head_dim), dtype=np.float32)
    query = rng.standard_normal((q_heads, head_dim), dtype=np.float32)
    out = np.empty_like(query)

    with anchorkv.Context(num_threads=1) as context:
        cache = context.compress(keys, values, method="fullkv", num_q_heads=q_heads)
        raw, q_pointer, out_pointer = cache._raw(), query.ctypes.data, out.ctypes.data

        def raw_ctypes():
            _capi.akv_decode(raw, q_pointer, 1, 1, out_pointer, None)

        timings = {
            "raw ctypes": best_per_call(raw_ctypes, args.calls, args.repeats),
            "decode(q, out)": best_per_call(lambda: cache.decode(query, out), args.calls, args.repeats),
            "decode(q)": best_per_call(lambda: cache.decode(query), args.calls, args.repeats),
        }
        cache.close()
    base = timings["raw ctypes"]
    print(f"decode of a [{q_heads}][{head_dim}] f32 query over {args.seq_len} tokens "
          f"(FullKV, 1 thread), anchorkv {anchorkv.library_version()}")
    for name, micros in timings.items():
        print(f"  {name:15s} {micros:7.2f} us/call  {micros / base:5.2f}x raw  "
              f"(+{micros - base:.2f} us)")


if __name__ == "__main__":
    main()
