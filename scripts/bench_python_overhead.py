#!/usr/bin/env python3
"""Per-call overhead of the Python package against raw ctypes, for the per-token calls.

The same C call on the same small cache (so the library's own work is a few microseconds),
made through raw ctypes (anchorkv._capi with pointers computed once, outside the loop) and
through the package:
  decode(q, out) Cache.decode with a preallocated output (what a decode loop does)
  decode(q)      Cache.decode allocating its output
  append(k, v)   Cache.append of one token (into room reserved beforehand)
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
    new_key, new_value = keys[:, 0].copy(), values[:, 0].copy()  # [H][D]: one token

    with anchorkv.Context(num_threads=1) as context:
        cache = context.compress(keys, values, method="fullkv", num_q_heads=q_heads)
        growing = context.compress(keys, values, method="fullkv", num_q_heads=q_heads)
        growing.reserve(2 * args.calls * args.repeats)  # appends never allocate
        raw, q_pointer, out_pointer = cache._raw(), query.ctypes.data, out.ctypes.data
        raw_growing, k_pointer, v_pointer = growing._raw(), new_key.ctypes.data, new_value.ctypes.data

        def time_it(fn):
            return best_per_call(fn, args.calls, args.repeats)

        rows = [
            ("decode(q, out)", time_it(lambda: _capi.akv_decode(raw, q_pointer, 1, 1, out_pointer, None)),
             time_it(lambda: cache.decode(query, out))),
            ("decode(q)", None, time_it(lambda: cache.decode(query))),
            ("append(k, v)", time_it(lambda: _capi.akv_append(raw_growing, k_pointer, v_pointer, 1, 1, None, None)),
             time_it(lambda: growing.append(new_key, new_value))),
        ]
        cache.close()
        growing.close()
    print(f"[{q_heads}][{head_dim}] f32 query over {args.seq_len} tokens, H={heads} (FullKV, 1 thread), "
          f"anchorkv {anchorkv.library_version()}; us per call, best of {args.repeats} x {args.calls}")
    raw_decode = rows[0][1]
    for name, raw_micros, micros in rows:
        raw_micros = raw_micros or raw_decode  # decode(q) against the same raw decode
        print(f"  {name:15s} raw ctypes {raw_micros:7.2f}   package {micros:7.2f}   "
              f"{micros / raw_micros:5.2f}x raw (+{micros - raw_micros:.2f} us)")


if __name__ == "__main__":
    main()
