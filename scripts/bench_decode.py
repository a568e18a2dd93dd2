#!/usr/bin/env python3
"""Decode benchmark on a CUDA device: compact AnchorKV decode against our dense decode of the
full cache and PyTorch SDPA on the full cache (issue 5).

One layer, H=8 KV heads, Hq=32 query heads, D=128, bf16, theta=0.05 (20x); S and the batch
sizes from the command line. Every timed call runs with a cold L2: a 512 MiB buffer is
cleared right before it, and the call is enqueued while the clear still runs, so CUDA events
time the kernels and not the Python launch overhead. Prints one table (and --csv rows):

  S, batch, compact us, dense us, SDPA us, speedup vs SDPA (compact, dense), effective
  bandwidth of the compact decode (compressed bytes read per step / time, and as a share of
  HBM_TB_S), its ratio to the bandwidth floor (time / (footprint / HBM_TB_S)), and decode-time
  device memory of one request: the compressed cache as allocated vs the bf16 full cache.

--rows 32768x1 131072x1 131072x8 32768x32 runs exactly those (S x batch) rows (the table of
issue 14) instead of every --seq-lens x --batches pair.

It also checks on the device that our dense decode equals SDPA (same data, bf16 tolerance),
that the compact decode equals the CPU backend's decode of the same compressed cache (the
first and last request of each batch, within the bf16 bound of tests/gpu/cuda_decode_test.cpp:
|gpu - cpu| <= 4e-2 + 4e-2 |cpu|), and reports the compact decode's deviation from SDPA
(the compression's own error, not checked). A row that fails a check fails the run.

Needs torch with CUDA and the anchorkv Python package (PYTHONPATH=python) over a library
built with the CUDA backend (ANCHORKV_LIBRARY=build-device/src/libanchorkv.so).
"""
import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

import anchorkv

H, HQ, D = 8, 32, 128
WINDOW = 32
# The bf16 tolerance of the GPU tests (tests/gpu/cuda_decode_test.cpp, tolerance()): absolute
# and relative to the CPU backend's output.
GPU_TEST_BF16_TOLERANCE = 4e-2
HBM_TB_S = 4.3  # H200 HBM3e peak, the bandwidth floor's denominator


def cold_timer(flush):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def run(fn, iters):
        fn()  # warm-up: workspaces, kernel attributes, lazy module loads
        torch.cuda.synchronize()
        times = []
        for _ in range(iters):
            flush.zero_()
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) * 1e3)  # us
        return statistics.median(times)

    return run


def sdpa_fn(q, k, v):
    try:
        F.scaled_dot_product_attention(q[:1, :, :1], k[:1, :, :8], v[:1, :, :8], enable_gqa=True)
        return lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    except TypeError:  # torch < 2.5: no GQA flag; SDPA then needs the heads repeated
        kr, vr = k.repeat_interleave(HQ // H, dim=1), v.repeat_interleave(HQ // H, dim=1)
        print("note: this torch has no enable_gqa; SDPA reads keys repeated per query head", file=sys.stderr)
        return lambda: F.scaled_dot_product_attention(q, kr, vr)


def bf16_bits(t):
    return t.contiguous().view(torch.int16).cpu().numpy().view(np.uint16)


def excess_over_cpu(cpu_cache, query, out):
    """max(|gpu - cpu| - (tol + tol |cpu|)) over one request's output: > 0 fails the bound."""
    bits = cpu_cache.decode(bf16_bits(query), dtype="bf16")
    expected = torch.from_numpy((bits.astype(np.uint32) << 16).view(np.float32))
    got = out.float().cpu()
    excess = (got - expected).abs() - GPU_TEST_BF16_TOLERANCE * (1 + expected.abs())
    return float("inf") if not torch.isfinite(got).all() else excess.max().item()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 32768, 65536, 131072])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--rows", nargs="+", metavar="SxB",
                        help="(S x batch) rows to run instead of the --seq-lens x --batches grid, e.g. 32768x1")
    parser.add_argument("--theta", type=float, default=0.05)
    parser.add_argument("--rope-style", choices=("neox", "gptj", "none"), default="neox",
                        help="the caches' RoPE pairs (gptj: the register-gather path's GPT-J kernel; none: keys "
                             "taken as given, the anchors' scores looked up instead of their rows gathered)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--csv", help="also write the rows to this CSV file")
    parser.add_argument("--profile", action="store_true",
                        help="after each row's timings, one compact and one dense decode with ANCHORKV_DECODE_PROFILE=1: "
                             "the library's stderr line of each kernel's time (cold L2), for scripts/predict_decode.py's parts")
    args = parser.parse_args()

    torch.manual_seed(0)
    dev = torch.device("cuda")
    flush = torch.empty(512 << 20, dtype=torch.uint8, device=dev)
    timed = cold_timer(flush)
    ctx = anchorkv.Context("cuda")
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | anchorkv {anchorkv.library_version()} | "
          f"RoPE {args.rope_style}")
    rows = []
    if args.rows:
        plan = [tuple(int(x) for x in r.lower().split("x")) for r in args.rows]
    else:
        plan = [(S, B) for S in args.seq_lens for B in args.batches]
    for S in dict.fromkeys(S for S, _ in plan):
        # LLM-like enough for timing: the decode's work depends on the budget, not the values.
        keys = (torch.randn(H, S, D, device=dev) + 0.5 * torch.randn(H, 1, D, device=dev)).to(torch.bfloat16)
        values = torch.randn(H, S, D, device=dev, dtype=torch.bfloat16)
        window_q = torch.randn(HQ, WINDOW, D, device=dev, dtype=torch.bfloat16)
        t0 = time.perf_counter()
        compact = ctx.compress(keys, values, window_q, retain_fraction=args.theta, rope_style=args.rope_style)
        torch.cuda.synchronize()
        compress_s = time.perf_counter() - t0
        full = ctx.compress(keys, values, window_q, method="fullkv", rope_style=args.rope_style)
        blob_compact, blob_full = compact.to_bytes(), full.to_bytes()
        cpu_compact = anchorkv.Cache.from_bytes(blob_compact)  # the CPU backend's reference
        stats = compact.stats
        full_cache_bytes = 2 * S * H * D * 2  # bf16 K and V
        # Post-RoPE keys as the dense caches hold them, for SDPA.
        k_full = torch.empty(H, S, D, device=dev, dtype=torch.bfloat16)
        v_full = torch.empty_like(k_full)
        full.reconstruct("bf16", rotated=True, keys=k_full, values=v_full)
        print(f"# S={S}: compressed {stats.compressed_bytes / 1e6:.2f} MB, ratio {stats.ratio:.1f}x vs M_full, "
              f"allocated {stats.allocated_bytes / 1e6:.2f} MB; compress (host-staged) {compress_s * 1e3:.0f} ms")
        for B in [b for s_, b in plan if s_ == S]:
            compact_caches = [compact] + [ctx.deserialize(blob_compact) for _ in range(B - 1)]
            full_caches = [full] + [ctx.deserialize(blob_full) for _ in range(B - 1)]
            q = torch.randn(B, HQ, 1, D, device=dev, dtype=torch.bfloat16)
            out_c = torch.empty_like(q)
            out_d = torch.empty_like(q)
            k = k_full.reshape(1, H, S, D).expand(B, H, S, D).contiguous()
            v = v_full.reshape(1, H, S, D).expand(B, H, S, D).contiguous()
            sdpa = sdpa_fn(q, k, v)
            t_compact = timed(lambda: ctx.decode_batch(compact_caches, q, out_c), args.iters)
            t_dense = timed(lambda: ctx.decode_batch(full_caches, q, out_d), args.iters)
            t_sdpa = timed(sdpa, args.iters)
            if args.profile:
                print(f"# profile S={S} B={B}: compact, then dense", flush=True)
                os.environ["ANCHORKV_DECODE_PROFILE"] = "1"  # read by the library at each decode
                for caches, out in ((compact_caches, out_c), (full_caches, out_d)):
                    flush.zero_()
                    ctx.decode_batch(caches, q, out)
                    torch.cuda.synchronize()
                del os.environ["ANCHORKV_DECODE_PROFILE"]
            ref = sdpa().float()
            dense_err = (out_d.float() - ref).abs().max().item()
            compact_rel = ((out_c.float() - ref).norm() / ref.norm()).item()
            compact_excess = max(excess_over_cpu(cpu_compact, q[b], out_c[b]) for b in {0, B - 1})
            bandwidth = B * stats.compressed_bytes / (t_compact * 1e-6) / 1e12
            floor_us = B * stats.compressed_bytes / (HBM_TB_S * 1e12) * 1e6
            row = dict(S=S, batch=B, compact_us=t_compact, dense_us=t_dense, sdpa_us=t_sdpa,
                       speedup_compact=t_sdpa / t_compact, speedup_dense=t_sdpa / t_dense,
                       compact_tb_s=bandwidth, compact_bw_share=bandwidth / HBM_TB_S, floor_us=floor_us,
                       x_floor=t_compact / floor_us, memory_ratio=full_cache_bytes / stats.allocated_bytes,
                       dense_max_abs_err=dense_err, compact_rel_err=compact_rel,
                       compact_excess_vs_cpu=compact_excess)
            rows.append(row)
            del compact_caches[1:], full_caches[1:], k, v
            torch.cuda.empty_cache()
        del k_full, v_full, compact, full, cpu_compact
        torch.cuda.empty_cache()

    header = ("S", "batch", "compact_us", "dense_us", "sdpa_us", "speedup_compact", "speedup_dense",
              "compact_tb_s", "compact_bw_share", "floor_us", "x_floor", "memory_ratio", "dense_max_abs_err", "compact_rel_err", "compact_excess_vs_cpu")
    print(f"{'S':>7} {'B':>3} {'compact us':>10} {'dense us':>9} {'SDPA us':>9} {'x SDPA':>7} {'dense x':>7} "
          f"{'TB/s':>6} {'% HBM':>6} {'floor us':>8} {'x floor':>7} {'mem x':>6} {'dense err':>9} {'AKV rel':>8} {'vs CPU':>6}")
    for r in rows:
        verdict = "ok" if r["compact_excess_vs_cpu"] <= 0 else "FAIL"
        print(f"{r['S']:>7} {r['batch']:>3} {r['compact_us']:>10.1f} {r['dense_us']:>9.1f} {r['sdpa_us']:>9.1f} "
              f"{r['speedup_compact']:>7.2f} {r['speedup_dense']:>7.2f} {r['compact_tb_s']:>6.2f} "
              f"{100 * r['compact_bw_share']:>6.1f} {r['floor_us']:>8.1f} {r['x_floor']:>7.1f} "
              f"{r['memory_ratio']:>6.1f} {r['dense_max_abs_err']:>9.2e} {r['compact_rel_err']:>8.3f} {verdict:>6}")
    if args.csv:
        with open(args.csv, "w") as f:
            f.write(",".join(header) + "\n")
            for r in rows:
                f.write(",".join(str(r[h]) for h in header) + "\n")
    failed = False
    bad = [r for r in rows if not r["dense_max_abs_err"] < 3e-2]
    if bad:
        print(f"FAIL: our dense decode differs from SDPA by up to {max(r['dense_max_abs_err'] for r in bad):.3g}")
        failed = True
    bad = [r for r in rows if not r["compact_excess_vs_cpu"] <= 0]
    if bad:
        print(f"FAIL: the compact decode differs from the CPU backend's beyond the GPU tests' bound "
              f"({GPU_TEST_BF16_TOLERANCE} abs + rel) in rows " + ", ".join(f"S={r['S']} B={r['batch']}" for r in bad))
        failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
