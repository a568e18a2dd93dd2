#!/usr/bin/env python3
"""CPU decode per call, in one run: the library's methods (`anchorkv bench --json`, one
synthetic LLM-like layer) next to PyTorch's CPU SDPA decode over the dense cache in the
engine's dtype (what a user would otherwise run), at the same shape and thread count.

  scripts/bench_cpu_decode.py --seq-lens 2048 16384 32768 --threads 1 2 [--key-space pre post]

Prints one table per (S, threads): decode ms per call and the speed against FullKV and
against SDPA (> 1: faster). SDPA: q [1, Hq, 1, D], K/V [1, H, S, D] (GQA through
enable_gqa, no copy), bf16 by default, median of --iters calls after a warm-up.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sdpa_ms(S, H, HQ, D, dtype, threads, iters):
    import torch
    import torch.nn.functional as F
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, HQ, 1, D, generator=g).to(dtype)
    k = torch.randn(1, H, S, D, generator=g).to(dtype)
    v = torch.randn(1, H, S, D, generator=g).to(dtype)
    with torch.inference_mode():
        for _ in range(3):
            F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def library_rows(cli, S, H, HQ, D, ratios, methods, threads, iters, key_space="pre"):
    cmd = [cli, "bench", "--backend", "cpu", "--seq-len", str(S), "--heads", str(H), "--q-heads", str(HQ),
           "--head-dim", str(D), "--ratios", ratios, "--methods", methods, "--threads", str(threads),
           "--decode-iters", str(iters), "--repeats", "1", "--key-space", key_space, "--json", "--quiet"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out)["rows"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cli", default=os.path.join(ROOT, "build", "tools", "cli", "anchorkv"))
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 16384, 32768])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--ratios", default="5,10,20")
    ap.add_argument("--methods", default="AnchorKV,SnapKV")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", choices=["bf16", "f16", "f32"], default="bf16")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--key-space", nargs="+", choices=["pre", "post"], default=["pre"],
                    help="AnchorKV's keys fitted before RoPE (the default) and/or after it (anchorkv bench "
                         "--key-space post: rows labelled 'post')")
    args = ap.parse_args()
    import torch
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[args.dtype]
    for S in args.seq_lens:
        for threads in args.threads:
            rows = []
            for space in args.key_space:
                got = library_rows(args.cli, S, args.heads, args.q_heads, args.head_dim, args.ratios, args.methods,
                                   threads, args.iters, space)
                if space == "post":  # rows labelled; its FullKV is pre's cache again: kept only when alone
                    got = [r if r["method"] == "FullKV" else dict(r, method=r["method"] + " post")
                           for r in got if r["method"] != "FullKV" or not rows]
                rows += got
            sdpa = sdpa_ms(S, args.heads, args.q_heads, args.head_dim, dtype, threads, args.iters)
            full = next(r for r in rows if r["method"] == "FullKV")
            full_ms = 1e3 * full["decode_seconds_median"]
            print(f"\nS={S}, threads={threads}, H={args.heads}, Hq={args.q_heads}, D={args.head_dim}")
            print(f"{'method':<12} {'target':>7} {'decode ms':>10} {'vs FullKV':>10} {'vs SDPA':>9}")
            print(f"{'SDPA ' + args.dtype:<12} {'1x':>7} {sdpa:>10.2f} {full_ms / sdpa:>9.2f}x {1.0:>8.2f}x")
            for r in rows:
                ms = 1e3 * r["decode_seconds_median"]
                target = f"{r['target_ratio']:g}x"
                print(f"{r['method']:<12} {target:>7} {ms:>10.2f} {full_ms / ms:>9.2f}x {sdpa / ms:>8.2f}x")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
