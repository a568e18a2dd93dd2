#!/usr/bin/env python3
"""CPU compression cost against the layer's causal prefill attention, in one run (issue 25).

  scripts/bench_cpu_compress.py --seq-lens 16384 32768 --threads 1

For each (S, threads): PyTorch's CPU SDPA causal prefill attention of one layer (q [1, Hq, S, D],
K/V [1, H, S, D], GQA through enable_gqa) in fp32 and in bf16, one timed call each after a
short warm-up; then `anchorkv bench` compressing one synthetic LLM-like layer of the same shape
(AnchorKV at each ratio, median of --repeats calls) with ANCHORKV_COMPRESS_PROFILE=1, which
makes the library print its milliseconds per stage. Prints the compression time, its share of
each SDPA time (target: at most 5% of the fp32 one) and the share of each stage.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGE = re.compile(r"anchorkv AnchorKV compress \(cpu\) S=(\d+):(.*) total ([0-9.]+) ms")


def sdpa_prefill_s(S, H, HQ, D, dtype, threads):
    import torch
    import torch.nn.functional as F
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        small = [torch.randn(1, n, 512, D, generator=g).to(dtype) for n in (HQ, H, H)]
        F.scaled_dot_product_attention(*small, is_causal=True, enable_gqa=True)  # warm-up
        q = torch.randn(1, HQ, S, D, generator=g).to(dtype)
        k = torch.randn(1, H, S, D, generator=g).to(dtype)
        v = torch.randn(1, H, S, D, generator=g).to(dtype)
        t0 = time.perf_counter()
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return time.perf_counter() - t0


def compress(cli, S, H, HQ, D, ratio, threads, repeats):
    env = dict(os.environ, ANCHORKV_COMPRESS_PROFILE="1")
    cmd = [cli, "bench", "--seq-len", str(S), "--heads", str(H), "--q-heads", str(HQ), "--head-dim", str(D),
           "--methods", "AnchorKV", "--ratios", str(ratio), "--repeats", str(repeats), "--decode-iters", "1",
           "--backend", "cpu", "--threads", str(threads), "--json", "--quiet"]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    row = next(r for r in json.loads(run.stdout)["rows"] if r["method"] == "AnchorKV")
    # The profile lines of the timed calls; the stage shares are their mean.
    stages = {}
    lines = [m for m in (STAGE.search(l) for l in run.stderr.splitlines()) if m]
    for m in lines:
        for part in m.group(2).split(";"):
            if part.strip():
                name, ms = part.strip().rsplit(" ", 2)[0], float(part.strip().rsplit(" ", 2)[1])
                stages[name] = stages.get(name, 0.0) + ms / len(lines)
    return row["compress_seconds_median"], stages


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cli", default=os.path.join(ROOT, "build", "tools", "cli", "anchorkv"))
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[16384, 32768])
    ap.add_argument("--threads", type=int, nargs="+", default=[1])
    ap.add_argument("--ratios", type=float, nargs="+", default=[5, 10, 20])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    args = ap.parse_args()
    import torch
    H, HQ, D = args.heads, args.q_heads, args.head_dim
    print(f"# H={H} Hq={HQ} D={D}; torch {torch.__version__}; {args.cli}")
    for S in args.seq_lens:
        for T in args.threads:
            f32 = sdpa_prefill_s(S, H, HQ, D, torch.float32, T)
            b16 = sdpa_prefill_s(S, H, HQ, D, torch.bfloat16, T)
            print(f"\nS={S} threads={T}: SDPA causal prefill attention {f32:.2f} s fp32, {b16:.2f} s bf16")
            names = None
            for r in args.ratios:
                sec, stages = compress(args.cli, S, H, HQ, D, r, T, args.repeats)
                if names is None:
                    names = list(stages)
                    print(f"{'ratio':>6} {'compress':>9} {'/fp32':>6} {'/bf16':>6}  " + " ".join(f"{n[:10]:>10}" for n in names))
                total = sum(stages.values()) or 1.0
                shares = " ".join(f"{100 * stages.get(n, 0.0) / total:>9.0f}%" for n in names)
                print(f"{r:>5g}x {sec:>8.3f}s {100 * sec / f32:>5.1f}% {100 * sec / b16:>5.1f}%  {shares}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
