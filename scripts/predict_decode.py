#!/usr/bin/env python3
"""Static performance model of the compact AnchorKV decode on an H200 (issue 14), no device.

Rows: S x batch of issue 14 (H=8 KV heads, Hq=32, D=128, bf16, theta=0.05, default options:
NeoX RoPE over all 64 pairs, so the fused gather+RoPE path; q_len 1, G=4 -> 4 rows ->
decode_split_kernel<128, 4> for every row, 32K x 32 included: the planner picks MAXROWS from
G * q_len alone, not from the batch).

HONESTY: the tile loop (most of the time) is counted from SASS by scripts/sass_count.py, with
its trip-count and warp model, and so are the two merge kernels (sass_count.py's merge_walk:
a block's cycles with its loads from L2 and its barriers, at the plan's splits and anchor
parts), and so are the split kernel's set-up before its first tile (prologue_walk) and its
partial write and window tile (tail_walk): their issue, and the set-up's and partial write's
cycles, whose excess over their issue adds to each wave; the window's tile, which the kernel
counts as two prefix tiles when it splits the tiles, in the busiest block's tiles. Where
sass_count.py is missing, PTX constants (below). The tile loop issues at IPC, or at the latency bound
sass_count.py derives from the SASS's own stall counts and scoreboards where that is lower: a
scheduler's warps (2 a resident block of 8) hide each other's latency only so far, and at each
barrier the block waits for its slowest warp (warp 0's metadata and value staging). Global loads:
the gathered anchor rows 3 of 4 times from L1, the others from L2 (the headline), or every one
from L1 (in brackets). Bank conflicts and atomics' serialisation are not modelled beyond that.
Treat the times as +-40% predictions to be checked with bench_decode.py --rows.

Counts without sass_count.py (--ptx-model; non-mov PTX instructions of basic blocks, scripts/ptx_count.py per-block listing of
decode_split_kernel<128,4>, CUDA 13 nvcc, sm_90), regenerate with
  printf '#include "cuda/decode_kernels.cuh"\\ntemplate __global__ void akv::cuda::decode_split_kernel<128,4>(const __grid_constant__ akv::cuda::DecodeLaunch);\\ntemplate __global__ void akv::cuda::decode_merge_kernel<128,4>(const __grid_constant__ akv::cuda::DecodeLaunch);\\n' > inst.cu
  nvcc -ptx -lineinfo -arch=sm_90 -std=c++17 -O3 -DNDEBUG -I src -I include inst.cu -o k.ptx
  scripts/ptx_count.py k.ptx decode_split_kernelILi128ELi4E
and map the blocks of the prefix-tile loop (source lines of decode_kernels.cuh in brackets).
--from-ptx reruns nvcc + ptx_count and prints the listing totals next to the constants (the
block-to-phase map is by hand; labels move between compiler versions).

Residual fractions: from the library's geometry (src/core/layout.cpp) via a real compression
of random keys with default options (scripts/predict_decode.py --measure, needs
ANCHORKV_LIBRARY=build-p14/src/libanchorkv.so PYTHONPATH=python): 32K: k=815, N_K=13672,
N_V=13673, 6710869 B; 128K: k=3258, N_K=N_V=54634, 26843522 B (per request, 8 heads).
"""
import argparse
import math
import os
import subprocess
import sys
import tempfile

H, HQ, D, T, NT, W = 8, 32, 128, 64, 256, 32
NW = NT // 32  # warps a split block
ROWS = 4  # G * q_len
SMS, SCHED, CLOCK_GHZ, HBM_TBS = 132, 4, 1.98, 4.3
IPC = 0.7          # assumed fraction of one warp instruction / scheduler / cycle actually issued
L2_TBS = 8.0       # assumed L2 -> SM bandwidth (anchor rows are gathered through L2 per token)
WINDOW_UNITS = 2  # SplitBlock::kWindowUnits: a window tile counted as 2 prefix tiles in the split
LAUNCH_US = 6.0    # three back-to-back kernels (split, anchor values, merge): launch gaps and tails, assumed
VIEW_BYTES, HEAD_ARRAYS_BYTES = 432, 128  # sizeof(CacheView), sizeof(HeadArrays) (cache_view.hpp)
MERGE_CHUNK, MAX_PER_PART = 64, 256  # kMergeAnchorChunk, kMergeMaxAnchorsPerPart (cache_view.hpp)
SDPA = {(32768, 1): 54.0, (131072, 1): 133.0, (131072, 8): 970.0, (32768, 32): 970.0}  # 32Kx32: not measured; same tokens as 128Kx8, SDPA is bandwidth-bound: its 970 us assumed
TARGET = {(32768, 1): 2.5, (131072, 1): 5.0, (131072, 8): 8.0, (32768, 32): 6.0}
GEOM = {32768: dict(k=815, nk=13672, nv=13673, bytes=6710869),
        131072: dict(k=3258, nk=54634, nv=54634, bytes=26843522)}

# ---- PTX counts per tile (warp instructions; "w0-1" = executed by warps 0-1 only) ----------
# 1 metadata/angles [173-241]: tile loop head 14+57 (all warps); tid<64 token metadata
#   7+34+33+38=112 (warps 0-1); 64<=tid<128 first angles rope_angle 3+32+2+1+6+11+10+10+26+32=133
#   (warps 2-3); others 7.
META = 8 * 71 + 2 * 112 + 2 * 133 + 4 * 7
# 2 gather+RoPE [249-323] bf16 fused NeoX: per item 13+16+1+21+48+3=102, 4 items a thread
#   (V8=16, STEP=16, T=64), +9 entry; query rotation [337-344] 69 for warps 0-1 (64 pairs), 4 else.
GATHER = 8 * (9 + 4 * 102) + 2 * 69 + 6 * 4
# 3 key residuals [376-458]: setup 21+1+5 all warps; one warp iteration (4 residuals, 8 lanes
#   each: decode 130, butterflies+3 shuffle stages 215+12, sign/rope setup 4+6+3, partner
#   shuffles 22+1, table RoPE 75, row add 1+33, loop 4) = 506. Warp iterations per tile =
#   ceil(c_K / 4) (warp w takes residuals 4w.., 4w+32..).
KRES_SETUP, KRES_ITER = 8 * 27, 506
# 4 contraction [495-541] (rows == MAXROWS): 3+1+2x(90+1) (8 float4 steps, unrolled x4) +40
#   +24+9+15+4x16+6 = 344 per warp.
QK = 8 * 344
# 5 online softmax [542-567]: all warps 30 (row tests, alpha, rescale test), warps 0-3 (one row
#   each) +20 (warp max, exp2 of 2 tokens a lane); rescale path 46+36 when a row max rises.
SOFTMAX, RESCALE, P_RESCALE = 8 * 30 + 4 * 20, 8 * 82, 0.05
# 6 per-anchor weights [580-586]: rows*T = 256 = NT: one (row, token) a thread, 5+10+5+16=36
#   (value_index, value_gamma loads, shared atomicAdd).
WEIGHTS = 8 * 36
# 7 value residuals [587-615]: setup 20+1+3+12+4=40 all warps; [count][4] probabilities and
#   levels listed: ceil(4 c_V / 32) warps x (22 + 23); accumulation loop body 17, SG=2 groups:
#   4 warps x ceil(c_V/2) + 4 warps x floor(c_V/2) = 4 c_V warp iterations.
VRES_SETUP, VRES_LIST, VRES_ITER = 8 * 40, 45, 17
# Per block: prologue [148-198]: ~150 straight-line + q/qr load 80 + 16 entries of the tile's
#   (cos, sin) table copied from the view (~4 each; they were 16 sincosf x 75 until the host
#   computed the table) + w_s zeroing 5 per (4 k / 256); write partial [647-671]: 2 x (9 + 2 x
#   22 + 10) + 14 per (4 k / 256) + 81; the window tile (split 0 only): a tile without
#   residuals or weights + 40.
def prologue(k):
    return 8 * (150 + 80 + 16 * 4 + 5 * 4 * k / NT)


def write_partial(k, segments=False):  # segments: the weights are in the workspace already
    return 8 * (2 * 63 + (0 if segments else 14 * 4 * k / NT) + 81)


WINDOW_TILE = META + GATHER + QK + SOFTMAX + 8 * 40
# sum_a w_a V_a, decode_anchor_values_kernel per thread (one block per part of 64-256 anchors):
#   ~150 + per 64-anchor chunk (w over splits ~8 a split, 32 anchors x ~10 (bf16 value, 4 row
#   FMAs), ~30 loop) + group reduction and store ~100.
def anchor_thread_instr(k, splits, per_part):
    return 150 + math.ceil(min(k, per_part) / MERGE_CHUNK) * (8 * splits + 320 + 30) + 100


def anchors_per_part(k, merge_blocks):
    """plan_decode's choice (plan.cpp): 256 anchors a part, less (down to 64) while the parts
    would not give each multiprocessor one and a half blocks (of the workspace's stride, k
    rounded up to 4)."""
    per, k = MAX_PER_PART, (k + 3) // 4 * 4
    while per > MERGE_CHUNK and 2 * merge_blocks * math.ceil(k / per) < 3 * SMS:
        per -= MERGE_CHUNK
    return per


# Merge kernel per thread: ~150 (split factors) + ~8 a split + ~8 an anchor part (half the parts
# per thread group) + red/Hadamard/store ~600.
def merge_thread_instr(k, splits, per_part):
    return 150 + 8 * splits + 8 * math.ceil(math.ceil(k / per_part) / 2) + 600


def poisson_ceil(lam, div):
    """E[ceil(c / div)] for c ~ Poisson(lam): residual counts of a tile."""
    e, p, n = 0.0, math.exp(-lam), 0
    while n < 200:
        e += p * math.ceil(n / div)
        n += 1
        p *= lam / n
    return e


def smem_bytes(k, rows=ROWS):
    """SplitSmem(D, rows, k).total (cache_view.hpp), region by region in its order."""
    a16 = lambda x: (x + 15) // 16 * 16
    mp = D // 2  # max pairs
    parts = [VIEW_BYTES, 4 * rows * D, 4 * rows * D, 4 * rows * T, 4 * rows * T, 4 * NW * rows, 4 * rows]
    parts += [4 * mp] * 5 + [8 * mp, 8 * mp, 4 * mp, HEAD_ARRAYS_BYTES, 8 * T * mp, 4 * D]
    parts += [4 * T] * 4 + [8 * T] + [4 * T] * 3 + [12 * rows, 12, 2 * 256, 4 * 3 * 256]
    parts += [2 * rows * (D + 16), 4 * rows * T, 16, 8 * 2 * 4, 4 * 2 * T, T * D // 4, 4 * T, 16 * T, T * D // 4,
              4 * T, 4 * T * (D + 4), 4 * rows * k]
    return sum(a16(p) for p in parts)


# plan_decode's choice of where a split block sums its per-anchor weights (plan.cpp): all k in
# shared memory, or (format 3's segment tables) a table's 256 entries at a time, added to the
# workspace when the segment ends, where that fits more blocks on a multiprocessor: at 128K
# (k 3258) one block with k weights, two with 256. --shared-weights: a what-if of the plan
# before that (all k in shared memory wherever they fit).
SHARED_WEIGHTS_ONLY = False
COUNT_DISPERSION = None  # a tile's residual counts' variance / mean: sass_count.py's default unless given
GPTJ = False  # price the register-gather path's GPT-J kernel (sass_count.py --gptj) instead of its NeoX one
SCORES = False  # price its path for caches without RoPE (sass_count.py --scores; the scores kernel itself not priced)


def merge_resident(registers, smem):
    """A merge kernel's blocks (NT threads) resident on a multiprocessor: 64K registers, allocated
    8 a thread at a time, 228 KiB of shared memory (1 KiB reserved a block), 2048 threads."""
    regs = 8 * math.ceil((registers or 32) / 8)
    return max(1, min(2048 // NT, 65536 // (regs * NT), (228 * 1024) // ((smem or 0) + 1024)))


def plan(S, batch, k):
    resident_of = lambda smem: max(1, min(2, 2048 // NT, (228 * 1024) // (smem + 1024)))  # 128 regs: 2 by registers
    smem = smem_bytes(k)
    resident, segments = resident_of(smem), False
    if not SHARED_WEIGHTS_ONLY and k > 256 and resident_of(smem_bytes(256)) > resident:
        smem, resident, segments = smem_bytes(256), resident_of(smem_bytes(256)), True
    tiles = math.ceil((S - W) / T)
    splits = max(1, min(resident * SMS // (H * min(batch, 128)), tiles, 64))
    return dict(smem=smem, resident=resident, tiles=tiles, splits=splits, blocks=H * batch * splits,
                segments=segments)


def tile_phases(fk, fv):
    lk, lv = T * fk, T * fv
    return {
        "tile metadata/angles": META,
        "key gather+RoPE": GATHER,
        "key residual decode": KRES_SETUP + KRES_ITER * poisson_ceil(lk, 4),
        "contraction (QK)": QK,
        "online softmax": SOFTMAX + P_RESCALE * RESCALE,
        "value residual accum": VRES_SETUP + VRES_LIST * poisson_ceil(4 * lv, 32) + VRES_ITER * 4 * lv,
        "per-anchor weights": WEIGHTS,
    }


def sass_phases(fk, fv, k, block_tiles, segments=False, merge=None):
    """Per-tile warp instructions by phase from scripts/sass_count.py (SASS) and the tile's
    conflict-free shared-memory wavefronts, or None; blocks of block_tiles tiles (the share of
    tiles that rescale); segments: the per-anchor weights a segment at a time."""
    root = os.path.dirname(os.path.abspath(__file__))
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "counts.json")
        r = subprocess.run([sys.executable, os.path.join(root, "sass_count.py"), "--fk", str(fk), "--fv", str(fv),
                            "--anchors", str(k), "--block-tiles", str(block_tiles), "--json", out]
                           + (["--segment-weights"] if segments else [])
                           + (["--splits", str(merge[0]), "--anchor-parts", str(merge[1]), "--anchors-per-part",
                               str(merge[2])] if merge else [])
                           + (["--count-dispersion", str(COUNT_DISPERSION)] if COUNT_DISPERSION is not None else [])
                           + (["--gptj"] if GPTJ else []) + (["--scores"] if SCORES else []),
                           capture_output=True, text=True)
        if r.returncode or not os.path.exists(out):
            return None
        import json
        res = json.load(open(out))
        loop = res["tile_loop"]
        return loop["per_tile"], loop["smem_wavefronts"], dict(loop["latency"], merge=res.get("merge"),
                                                               prologue=res.get("prologue"), tail=res.get("tail"))


def predict(S, batch, use_sass=False):
    g = GEOM[S]
    P = S - W
    fk, fv = g["nk"] / (H * P), g["nv"] / (H * P)
    pl = plan(S, batch, g["k"])
    per_part = anchors_per_part(g["k"], H * batch)
    ph, wf, lat = ((use_sass and sass_phases(fk, fv, g["k"], math.ceil(pl["tiles"] / pl["splits"]), pl["segments"],
                                             (pl["splits"], math.ceil(g["k"] / per_part), per_part)))
                   or (tile_phases(fk, fv), None, None))
    tile = sum(ph.values())
    # The set-up and the partial write from their SASS walks (prologue_walk, tail_walk), or the
    # PTX constants; the window's tile likewise.
    pro = lat.get("prologue") if lat else None
    tail = lat.get("tail") if lat else None
    partial = tail["partial"] if tail else None
    window_issue = tail["window"]["issue"] if tail else WINDOW_TILE
    fixed = (pro["issue"] if pro else prologue(g["k"])) + (partial["issue"] if partial else write_partial(g["k"], pl["segments"]))
    # The busiest block: the kernel splits the prefix's tiles and the window's, a window tile
    # counted as WINDOW_UNITS prefix tiles (SplitBlock::split_unit), evenly.
    wt = math.ceil(W / T)
    per_block = math.ceil((pl["tiles"] + WINDOW_UNITS * wt) / pl["splits"]) * tile + fixed
    total = pl["blocks"] * (pl["tiles"] / pl["splits"] * tile + fixed) + H * batch * wt * window_issue
    waves = math.ceil(pl["blocks"] / (SMS * pl["resident"]))
    rate = SCHED * CLOCK_GHZ * 1e3 * IPC  # warp instructions per us per SM
    # The tile loop's issue rate: IPC, or less where sass_count.py's latency bounds say the
    # schedulers cannot issue that often: their warps' own cycles (n warps a scheduler, 2 a
    # resident block), and the tile with its barriers (each resident block's tiles at that pace;
    # the blocks' barriers are independent).
    n = NW * pl["resident"] / SCHED

    def bound(c):
        alone = n * lat["issue"] / lat[c]["cycles"]
        barriers = pl["resident"] * NW * lat["issue"] / (SCHED * lat[c]["block_cycles"])
        return min(IPC, alone, barriers)
    ipc = {c: bound(c) if lat else IPC for c in ("mixed", "l1")}
    at_ipc = max(total / (SMS * rate), waves * pl["resident"] * per_block / rate)  # issue us at IPC
    issue = {c: at_ipc * IPC / ipc[c] for c in ipc}
    # The set-up to a block's first tile is latency-bound (its loads from L2, its barriers): beyond
    # its issue, which the above counts, each wave waits its cycles less what the multiprocessor
    # issues of its resident blocks' set-ups meanwhile (sass_count.py's prologue_walk).
    # The partial write the same (tail_walk).
    setup_us = sum(waves * max(0.0, x["block_cycles"] / (CLOCK_GHZ * 1e3) - pl["resident"] * x["issue"] / rate)
                   for x in (pro, partial) if x)
    issue = {c: v + setup_us for c, v in issue.items()}
    issue_us = issue["mixed"]
    ws = pl["blocks"] * ROWS * (2 * D + 2 + g["k"]) * 4
    hbm = batch * g["bytes"] + 2 * ws + batch * HQ * D * 2 * 2
    mem_us = hbm / (HBM_TBS * 1e6)
    l2 = batch * H * P * D * 2  # one anchor row (bf16) through L2 per prompt token
    l2_us = l2 / (L2_TBS * 1e6)
    # a wavefront a clock per SM; the PTX model has no count (None)
    smem_us = None if wf is None else pl["blocks"] * pl["tiles"] / pl["splits"] * wf / (SMS * CLOCK_GHZ * 1e3)
    mblocks = H * batch
    ablocks = mblocks * math.ceil(g["k"] / per_part)
    ai = anchor_thread_instr(g["k"], pl["splits"], per_part) * 8  # warp instructions of one anchor-values block
    mi = merge_thread_instr(g["k"], pl["splits"], per_part) * 8  # warp instructions of one merge block
    # Each kernel: one block's instructions at one multiprocessor's issue rate, or all blocks'
    # spread over the multiprocessors (blocks of 256 threads share one), whichever is longer.
    merge_us = max(ai / rate, ablocks * ai / (SMS * rate)) + max(mi / rate, mblocks * mi / (SMS * rate))
    merge_src = f"PTX constants: {ai // 8} and {mi // 8} instructions a thread"
    if lat and lat.get("merge"):
        # From the SASS (sass_count.py's merge_walk): a block's cycles with its barriers (its
        # loads from L2), as many blocks resident an SM as its registers and shared memory
        # allow (ptxas's counts; 256 threads a block: at most 8) and their issue shared by its
        # schedulers at IPC: each kernel's waves at the slower of the two.
        merge_us, merge_src = 0.0, "SASS walk"
        # the merge kernel a block a row (ROWS rows a row chunk)
        for name, blocks in (("decode_anchor_values_kernel", ablocks), ("decode_merge_kernel", mblocks * ROWS)):
            m = lat["merge"][name]
            fit = merge_resident(m.get("registers"), m.get("smem"))
            per_sm = min(fit, math.ceil(blocks / SMS))
            waves = math.ceil(blocks / (SMS * fit))
            merge_us += waves * max(m["block_cycles"] / (CLOCK_GHZ * 1e3), per_sm * m["issue"] / rate)
        av, mg = lat["merge"]["decode_anchor_values_kernel"], lat["merge"]["decode_merge_kernel"]
        merge_src = ("SASS walk: a block {:.0f} and {:.0f} cycles, {:.0f} and {:.0f} warp instructions, {} and {} blocks "
                     "resident a multiprocessor").format(
            av["block_cycles"], mg["block_cycles"], av["issue"], mg["issue"],
            merge_resident(av.get("registers"), av.get("smem")), merge_resident(mg.get("registers"), mg.get("smem")))
    t = max(issue_us, mem_us, l2_us, smem_us or 0.0) + merge_us + LAUNCH_US
    t_l1 = max(issue["l1"], mem_us, l2_us, smem_us or 0.0) + merge_us + LAUNCH_US
    return dict(S=S, batch=batch, g=g, fk=fk, fv=fv, pl=pl, ph=ph, tile=tile, fixed=fixed, total=total,
                per_part=per_part, ipc=ipc, t_l1=t_l1, merge_src=merge_src, setup_us=setup_us, pro=pro, tail=tail,
                issue=issue_us, hbm=hbm, mem=mem_us, l2=l2, l2_us=l2_us, smem_us=smem_us, merge=merge_us, t=t)


def measure():
    import numpy as np
    import anchorkv
    for S in GEOM:
        rng = np.random.default_rng(0)
        k = rng.standard_normal((H, S, D), dtype=np.float32)
        c = anchorkv.compress(k, rng.standard_normal((H, S, D), dtype=np.float32),
                              rng.standard_normal((HQ, W, D), dtype=np.float32), retain_fraction=0.05)
        st = c.stats
        print(S, dict(k=st.anchors, nk=st.key_residuals, nv=st.value_residuals, bytes=st.compressed_bytes),
              "akv_compressed_size", anchorkv.compressed_size(S, H, D, num_q_heads=HQ, retain_fraction=0.05))


def from_ptx():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "inst.cu")
        with open(src, "w") as f:
            f.write('#include "cuda/decode_kernels.cuh"\n')
            for k in ("decode_split_kernel<128, 4>", "decode_merge_kernel<128, 4>"):
                f.write(f"template __global__ void akv::cuda::{k}(const __grid_constant__ akv::cuda::DecodeLaunch);\n")
        ptx = os.path.join(d, "k.ptx")
        subprocess.run(["nvcc", "-ptx", "-lineinfo", "-arch=sm_90", "-std=c++17", "-O3", "-DNDEBUG",
                        "-I", os.path.join(root, "src"), "-I", os.path.join(root, "include"), src, "-o", ptx],
                       check=True)
        for e in ("decode_split_kernelILi128ELi4E", "decode_merge_kernelILi128ELi4E"):
            lines = [] if "merge" in e else ["--lines", "173-241", "--lines", "249-344", "--lines", "376-458",
                                             "--lines", "495-541", "--lines", "542-567", "--lines", "576-615"]
            subprocess.run([sys.executable, os.path.join(root, "scripts", "ptx_count.py"), ptx, e] + lines, check=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--from-ptx", action="store_true", help="compile and list the PTX counts first")
    ap.add_argument("--ptx-model", action="store_true",
                    help="use the hand-mapped PTX constants for the tile loop instead of scripts/sass_count.py")
    ap.add_argument("--measure", action="store_true", help="re-derive the geometry with the library")
    ap.add_argument("--shared-weights", action="store_true",
                    help="what-if: every anchor's weight in shared memory wherever it fits (the plan before segment "
                         "weights; SHARED_WEIGHTS_ONLY)")
    ap.add_argument("--count-dispersion", type=float, default=None,
                    help="what-if: the variance / mean of a tile's residual counts (sass_count.py: measured on "
                         "SmolLM2, COUNT_DISPERSION; 1: Poisson, residuals spread evenly)")
    ap.add_argument("--gptj", action="store_true",
                    help="the caches' RoPE pairs are GPT-J's (2j, 2j + 1): price that kernel's tile loop")
    ap.add_argument("--scores", action="store_true",
                    help="the caches have no RoPE: price the lookup of their anchors' scores (sass_count.py --scores)")
    a = ap.parse_args()
    global SHARED_WEIGHTS_ONLY, COUNT_DISPERSION, GPTJ, SCORES
    GPTJ = a.gptj
    SCORES = a.scores
    SHARED_WEIGHTS_ONLY = a.shared_weights
    COUNT_DISPERSION = a.count_dispersion
    if a.measure:
        return measure()
    if a.from_ptx:
        from_ptx()
    use_sass = not a.ptx_model and sass_phases(0.052, 0.052, 815, 16) is not None
    source = ("tile loop: SASS counts (scripts/sass_count.py, its trip-count and warp model); merge kernels: "
              "their SASS walk (merge_walk); set-up, partial write and window: their SASS walks (prologue_walk, tail_walk)" if use_sass else "PTX counts, not SASS (scripts/sass_count.py unavailable or "
              "--ptx-model)")
    print(f"Assumptions: {SMS} SMs x {SCHED} schedulers x {CLOCK_GHZ} GHz x IPC {IPC} (the tile loop: at most its "
          "latency bound, sass_count.py's warp_latency: the gathered anchor rows from L1 at its GATHER_L1_SHARE, the "
          "streamed metadata, codes and scales from L2 where the loop prefetches them, else from memory (its 'hbm' "
          "latency, from the first device run); in brackets every load from L1; a tile's residual counts at variance / mean "
          f"{'sass_count.py COUNT_DISPERSION' if COUNT_DISPERSION is None else COUNT_DISPERSION}); "
          f"HBM {HBM_TBS} TB/s; "
          f"L2 {L2_TBS} TB/s; shared memory a 128-byte wavefront a clock per SM (the tile loop's, conflict-free, "
          f"from sass_count.py); launch {LAUNCH_US} us; {source}.\n")
    rows = [predict(S, b, use_sass) for S, b in ((32768, 1), (131072, 1), (131072, 8), (32768, 32))]
    print("| S | batch | k | f_K/f_V | splits x blocks (res/SM) | thr instr /tok/head (tiles) | warp instr /tok/head (tiles) "
          "| total warp instr | IPC (L1) | issue us | HBM MB | HBM us | L2 us | smem us | merge us | pred us (L1) "
          "| SDPA us | speedup (L1) | target | met |")
    print("|" + "---|" * 20)
    for r in rows:
        tok = r["tile"] / T
        sd = SDPA[(r["S"], r["batch"])]
        sp = f"{sd / r['t']:.1f}x ({sd / r['t_l1']:.1f}x)" if sd else "n/a"
        tg = TARGET[(r["S"], r["batch"])]
        met = "yes" if sd / r["t"] >= tg else "NO"
        pl = r["pl"]
        print(f"| {r['S']} | {r['batch']} | {r['g']['k']} | {r['fk']:.4f}/{r['fv']:.4f} | {pl['splits']} x "
              f"{pl['blocks']} ({pl['resident']}{', seg' if pl['segments'] else ''}) | {32 * tok:.0f} | {tok:.1f} | {r['total'] / 1e6:.1f}M | "
              f"{r['ipc']['mixed']:.2f} ({r['ipc']['l1']:.2f}) | "
              f"{r['issue']:.1f} | {r['hbm'] / 1e6:.1f} | {r['mem']:.1f} | {r['l2_us']:.1f} | "
              f"{'-' if r['smem_us'] is None else format(r['smem_us'], '.1f')} | {r['merge']:.1f} | "
              f"{r['t']:.1f} ({r['t_l1']:.1f}) | {sd or '-'} | {sp} | {tg}x | {met} |")
    r = rows[1]
    print(f"\nPhase breakdown, {r['S']} x {r['batch']} (4 rows), per token and head "
          "(thread instr = 32 x warp instr / 64 tokens):")
    print("| phase | thread instr | warp instr | share |")
    print("|---|---|---|---|")
    ph = dict(r["ph"])
    per_tok_fixed = (r["total"] / (r["pl"]["blocks"] * r["pl"]["tiles"] / r["pl"]["splits"]) - r["tile"])
    ph["per-block fixed (prologue, partial, window)"] = per_tok_fixed
    tot = sum(ph.values())
    for name, v in sorted(ph.items(), key=lambda x: -x[1]):
        print(f"| {name} | {32 * v / T:.0f} | {v / T:.1f} | {100 * v / tot:.0f}% |")
    print(f"| total | {32 * tot / T:.0f} | {tot / T:.1f} | 100% |")
    for r in rows:
        per = r["per_part"]
        parts = math.ceil(r['g']['k'] / per)
        k, splits = r['g']['k'], r['pl']['splits']
        print(f"Merge {r['S']} x {r['batch']} (k={k}, {splits} splits): {H * r['batch'] * parts} "
              f"anchor-value blocks of {per} anchors, then {H * r['batch'] * ROWS} merge blocks (a row each); "
              f"{r['merge']:.1f} us ({r['merge_src']}); L2 gather traffic {r['l2'] / 1e6:.0f} MB.")
    for r in rows:
        if r["pro"] and r["tail"]:
            t = r["tail"]
            print(f"Set-up and partial write {r['S']} x {r['batch']}: {r['pro']['issue']:.0f} and "
                  f"{t['partial']['issue']:.0f} warp instructions a split block, {r['pro']['block_cycles']:.0f} cycles to "
                  f"its first tile (prologue_walk) and {t['partial']['block_cycles']:.0f} for the partial write "
                  f"(tail_walk): {r['setup_us']:.1f} us beyond their issue; the window's tile {t['window']['issue']:.0f} "
                  f"warp instructions, {t['window']['block_cycles']:.0f} cycles (counted as {WINDOW_UNITS} prefix tiles in "
                  "the busiest block).")


if __name__ == "__main__":
    sys.exit(main())
