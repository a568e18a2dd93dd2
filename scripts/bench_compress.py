#!/usr/bin/env python3
"""Compression benchmark on a CUDA device (issue 4): per layer, H=8, Hq=32, D=128, bf16,
theta=0.05, S = 32K, 64K, 128K. In the same run:

  * our AnchorKV compress on a CUDA context (the GPU pass), wall time per layer including its
    final synchronisation (it checks the inputs for NaN/Inf);
  * PyTorch SDPA causal prefill attention for the layer (the work the compression rides on);
  * our SnapKV compress on the same CUDA context (compress_eviction_cuda: window attention,
    pooled scores and a per-head radix sort on the device, one head at a time; the kept token
    ids are downloaded and the host picks them (it waits for the stream), then their rows are
    gathered on the device into the cache).

Prints the ratio compress / prefill attention (target, issue 15: at most 2%; 0.5 / 1.5 / 8.9 ms
at 32K / 64K / 128K). After the timed runs, one more AnchorKV compress per S runs with
ANCHORKV_COMPRESS_PROFILE=1: the library prints one line on stderr with the milliseconds per
stage (CUDA events at the stage marks, summed over heads; the events themselves serialise the
stream a little) and the number of stream operations (kernels, cuBLAS calls, CUB sorts, copies,
fills) of the layer. Needs torch with CUDA and the anchorkv Python package over a CUDA build.
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import anchorkv

H, HQ, D, WINDOW = 8, 32, 128, 32


def wall(fn, iters):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[32768, 65536, 131072])
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--snapkv-iters", type=int, default=1)
    parser.add_argument("--no-profile", action="store_true", help="skip the per-stage profile run")
    args = parser.parse_args()
    dev = torch.device("cuda")
    ctx = anchorkv.Context("cuda")
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | anchorkv {anchorkv.library_version()}")
    print(f"{'S':>7} {'AnchorKV ms':>12} {'prefill ms':>11} {'share':>7} {'SnapKV ms':>10}")
    for S in args.seq_lens:
        torch.manual_seed(S)
        keys = (torch.randn(H, S, D, device=dev) + 0.5 * torch.randn(H, 1, D, device=dev)).to(torch.bfloat16)
        values = torch.randn(H, S, D, device=dev, dtype=torch.bfloat16)
        window_q = torch.randn(HQ, WINDOW, D, device=dev, dtype=torch.bfloat16)
        t_akv = wall(lambda: ctx.compress(keys, values, window_q, retain_fraction=0.05), args.iters)
        q = torch.randn(1, HQ, S, D, device=dev, dtype=torch.bfloat16)
        k4, v4 = keys.unsqueeze(0), values.unsqueeze(0)
        try:
            t_prefill = wall(lambda: F.scaled_dot_product_attention(q, k4, v4, is_causal=True, enable_gqa=True), args.iters)
        except TypeError:  # torch < 2.5
            kr, vr = k4.repeat_interleave(HQ // H, 1), v4.repeat_interleave(HQ // H, 1)
            t_prefill = wall(lambda: F.scaled_dot_product_attention(q, kr, vr, is_causal=True), args.iters)
        snap_window = torch.randn(HQ, 64, D, device=dev, dtype=torch.bfloat16)
        t_snap = wall(lambda: ctx.compress(keys, values, snap_window, method="snapkv", retain_fraction=0.05,
                                           pool_kernel=5), args.snapkv_iters)
        print(f"{S:>7} {t_akv:>12.2f} {t_prefill:>11.2f} {100 * t_akv / t_prefill:>6.1f}% {t_snap:>10.1f}", flush=True)
        if not args.no_profile:  # per-stage times and the operation count, on stderr
            os.environ["ANCHORKV_COMPRESS_PROFILE"] = "1"
            try:
                ctx.compress(keys, values, window_q, retain_fraction=0.05)
                torch.cuda.synchronize()
            finally:
                del os.environ["ANCHORKV_COMPRESS_PROFILE"]
            sys.stderr.flush()
        del keys, values, q, k4, v4
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
