#!/usr/bin/env python3
"""Predicted cost of the CUDA AnchorKV compression pass, per profiler stage (issues 15, 25).

This is a MODEL, not a measurement. From the shape (H=8 KV heads, Hq=32, D=128, bf16, W=32,
theta=0.05, akv_compress_options_init defaults) it re-derives the geometry of src/core/layout.cpp
(k, residual counts), the heads per batch of compress_anchorkv_pass.hpp (2 GiB scratch budget), and
walks the launches of compress_anchorkv() in src/cuda/compress_anchorkv_pass.hpp, giving each kernel
its FLOPs (by kind), HBM bytes and launches read off src/cuda/compress_kernels.cuh. Per kernel,
time = max(compute, HBM) + launches x LAUNCH_S (+ a latency term where a kernel is a serial
chain); a stage is the sum of its kernels.

Compare with a device run: `ANCHORKV_COMPRESS_PROFILE=1` makes the pass print one stderr line,
"anchorkv AnchorKV compress S=...: setup x ms; load x ms; ...; total x ms; N stream operations",
with the stage names used here; scripts/bench_compress.py prints that line after its timed runs.
The "ops" column is the library's own operation count (CudaDevice::operations) and is checked
against tests/emu CompressLaunchCount.PerLayerAtBenchShapes (format 2: 119 per layer up to 64K,
232 at 128K; format 3: 113 and 220).

Storage format 3 (the default) searches each token's local candidates (local_nearest_kernel in
src/cuda/compress_local_kernels.cuh): its cost comes from the kernel's SASS, counted by
scripts/sass_count.py (--sass JSON from `sass_count.py --json`; without it, the counts below,
taken from it at the commit that added them): warp instructions per 32-candidate chunk and per
64-token tile, and the fp32 rescoring loop, issued at IPC of 4 schedulers x SMS at CLOCK_HZ.
The share of tokens that a coverage round's candidates cannot improve (their approximate best
stays below the token's best by the margin: no rescoring, no fp32 row read; SKIP_SHARE) and the
candidates rescored per token searched (RESCORED) are MEASURED through the SIMT emulation on the
eval's synthetic data at 32K (tests/emu_data, `anchorkv_emulation_data_tests`, which prints
them; one head, bf16, the defaults at 20x); a device run with ANCHORKV_COMPRESS_PROFILE=1
prints the same counts on real data. A coverage round's ranking (the three kernels of
src/cuda/coverage_select_kernels.cuh, blocks of 1024 threads) is issue-bound per block: 32 warps
times the kernel's hot SASS (sass_count.py's select_cost: an upper bound, warp 0's lines counted
for every warp) over a multiprocessor's 4 schedulers. The window outputs and the utilities
(window_outputs_kernels.cuh, utility_kernels.cuh: bf16 splits on the tensor cores) take the
longest of their tensor-core time, their HBM bytes and their SASS count's issue time.
Usage: python3 scripts/predict_compress.py [--seq-lens 32768 65536 131072] [--format 2|3] [--sass JSON]
"""
import argparse
import json
import math

# ---- Hardware assumptions (NVIDIA H200 SXM) ---------------------------------------------------
SMS = 132                 # streaming multiprocessors
HBM_BPS = 3.6e12          # streaming kernels: ~3.6 TB/s achievable (4.3 TB/s measured copy, 4.8 peak)
SGEMM_FLOPS = 50e12       # fp32 SIMT peak 67 TFLOP/s; cuBLAS SGEMM reaches ~50 on large tiles
SIMT_FLOPS = 67e12 * 0.5  # hand-written elementwise/reduction code: ~half of FMA peak (no FMA pairing)
TC_BF16_FLOPS = 989e12 * 0.25  # dense bf16 peak 989 TFLOP/s; nearest_anchor_kernel's mma reaches ~25%:
                          # 16x16x16 mma.sync (not Hopper wgmma, which alone gets near peak),
                          # single-buffered smem tiles, 3 __syncthreads per 32-anchor tile, and the
                          # SIMT top-4 selection of each tile serialised with the MMAs
# CUB onesweep radix sort is HBM-bound: each 8-bit digit pass reads and writes keys and values.
# libcusort's note (frontpage-app.vercel.app/newest/46618441): CUB sorts 67M u32 pairs in 3.10 ms
# on an RTX 5090 (1.8 TB/s), i.e. 21.6 G pairs/s at ~64 B/pair; scaled to an H200 that is ~40-50 G/s
# for u32 pairs and ~15-20 G/s for u64 keys + u32 values (5 passes at 35 bits, 120 B/pair).
SORT_PAIRS_PER_S = {4: 30e9, 8: 15e9}  # by key bytes; taken conservatively (issue 15: 10-20 G/s)
RADIX_BITS = 8            # bits per onesweep pass
LAUNCH_S = 4e-6           # per dependent launch / cuBLAS call / memcpy / memset on one stream
PREFIX_CHUNK_S = 1.5e-6   # prefix_kernel: one 1024-word chunk of a head (a global load, 3 barriers)
ENCODE_RESIDUAL_S = 1.0e-6  # one residual in encode_kernel: dependent loads, FWHT shuffles, 3 reductions
RESIDENT_WARPS = SMS * 32   # encode_kernel blocks (one warp each) resident at once (32 blocks/SM)

CLOCK_HZ = 1.98e9        # boost clock
IPC = 0.7                 # warp instructions issued per scheduler per cycle (scripts/predict_decode.py's)
ISSUE_PER_S = SMS * 4 * CLOCK_HZ * IPC
SKIP_SHARE = 0.868        # MEASURED (emulation, synthetic data, 32K): a round's tokens left alone
# local_nearest_kernel<128, CH> from scripts/sass_count.py (used without --sass), per candidate
# chunk CH (16 or 32): warp instructions per chunk, the one-chunk path's (a tile whose candidates
# fit one chunk, as a coverage round's do) and per tile (per warp, 4 warps a block), the
# candidate range's two searches (warp 0, 32 probes a round; a round each), the rescoring loops' static
# SASS (the warp's: a pass per candidate; the lanes' own: a pass per candidate of the busiest lane).
LOCAL = {"32": {"warp_instr_per_chunk": 474, "one_chunk_static": 414, "warp_instr_per_tile": 547,
                "search_loops_static": 104, "rescore_loop_static": 70, "serial_rescore_static": 456},
         "16": {"warp_instr_per_chunk": 358, "one_chunk_static": 261, "warp_instr_per_tile": 551,
                "search_loops_static": 104, "rescore_loop_static": 70, "serial_rescore_static": 456}}
WARP_RESCORE_MOST = 8     # kWarpRescoreMost: past this many candidates a warp's lanes rescore their own
RESCORED = 1.84           # MEASURED (same run, chunks of 16): candidates rescored in fp32 per token searched
WARP_TOKENS = 16          # tokens of a warp in local_nearest_kernel (64 a block of 4 warps, 2 lanes each)
# coverage_select_kernels.cuh from scripts/sass_count.py (used without --sass): per kernel, the hot
# SASS a warp runs in one pass, the merge's histogram loops (one a digit) and emit loop.
SELECT = {"coverage_energy_kernel": {"hot_static": 170},
          "coverage_chunk_kernel": {"hot_static": 1697},
          "coverage_merge_kernel": {"hot_static": 1077, "hist_loops": [104, 99, 96], "emit_loop": 315}}
# utility_tc_kernel<128, EXACT> from scripts/sass_count.py (used without --sass): a warp's chunk loop
# (16 window rows against the 32-token tile), its staging loop (tokens a trip) and the rest.
UTILITY = {"exact": {"chunk_static": 527, "staging_static": 118, "staging_tokens_per_trip": 2, "rest_static": 414},
           "split": {"chunk_static": 701, "staging_static": 77, "staging_tokens_per_trip": 1, "rest_static": 335}}
# window_outputs_kernel<128, EXACT> from scripts/sass_count.py (used without --sass): a warp's stage loop
# (64 tokens), its staging loop (float2 pairs a trip), the rest.
WINDOW = {"exact": {"stage_static": 628, "staging_static": 86, "staging_per_trip": 2, "rest_static": 550},
          "split": {"stage_static": 864, "staging_static": 110, "staging_per_trip": 2, "rest_static": 545}}
WINDOW_CHUNK = 2048       # kWindowChunk: tokens a block
STAGING_ITERS = 32 * 64 // 256  # a stage's token pairs x dim pairs over 256 threads (D 128)
EXACT_UTILITY = True      # bf16 inputs: the queries and values are exact in bf16 (2 products a side)
SELECT_CHUNK = 4096       # kSelectChunk: tokens per chunk (and per pass of a block)

SDPA_PREFILL_MS = {32768: 25.5, 65536: 102.5, 131072: 445.0}  # measured on the H200 (the layer's causal attention)
TARGET_MS = {s: 0.02 * ms for s, ms in SDPA_PREFILL_MS.items()}  # issue 25: 2% of it
STAGES = ["setup", "load", "window attention", "scores+pooling", "anchor selection", "assignment",
          "utilities", "residual selection", "encoding"]  # compress_anchorkv_pass.hpp stage_name()

# ---- Options (akv_compress_options_init) and shape ------------------------------------------
H, HQ, D, W, THETA = 8, 32, 128, 32, 0.05
OPT = dict(scored_fraction=0.3, pool_kernel=7, sink_tokens=4, fill_budget=1, anchor_share=0.7,
           guard_fraction=0.75, coverage_rounds=8)
PAIRS = D // 2            # NeoX RoPE over the whole head (rotary_dim 0 = D)
HEAD_BATCH_BUDGET = 2 << 30


FORMAT = 3  # set by --format
# The window scores' GEMM (Q K^T) on bf16 operands (cublasGemmStridedBatchedEx, fp32 sums): the
# inputs are bf16 and the keys are given post-RoPE (an engine's usual case; --pre-rope-keys: the
# fp32 SGEMM on the de-rotated keys).
BF16_SCORES = True


def segment_length(P, k):
    """layout.cpp segment_length()."""
    if k <= 256:
        return 1024
    n = 256
    while n < 4096 and 2 * n * k <= 64 * P:
        n *= 2
    return n


def geometry_for(S, k):
    """layout.cpp geometry_for(): base bytes and residual counts for k anchors per head."""
    P, words = S - W, (S - W + 63) // 64
    full = 4 * S * H * D
    budget = THETA * full
    if FORMAT == 3:  # design.md 3.7: one-byte entries and codes, tables, code scales, no positions
        L = segment_length(P, k)
        segs, T = -(-P // L), (256 if k > 256 else 0)
        base = H * (4 * k * D + 8 * (k - W) + 4 * P + segs * (2 * T + 8)) + 24 * H * words + 8 * (H + 1)
    else:
        base = H * (4 * k * D + 8 * (k - W) + 2 * P * 4) + 24 * H * words + 8 * (H + 1) + 4 * P
    g = dict(S=S, P=P, words=words, k=k, full=full, base=base, fits=base <= budget, nk=0, nv=0)
    if not g["fits"]:
        return g
    code = D // 4
    n = max(0, math.floor((budget - base) / ((code + 4 + code + 5) / 2)))
    cand = H * (P - (k - W))
    while True:
        nk, nv = min(n // 2, cand), min(n - n // 2, cand)
        if base + nk * (code + 4) + nv * (code + 5) <= budget or n == 0:
            break
        n -= 1
    g.update(nk=nk, nv=nv, saturated=nk >= cand and nv >= cand)
    return g


def anchor_geometry(S):
    """layout.cpp anchor_geometry() for anchors = 0, pool_heads = 0."""
    k = min(S, 65536, max(W, S // 128))
    g = geometry_for(S, k)
    assert g["fits"], "theta too small"
    spare = THETA * g["full"] - g["base"]
    extra = math.floor(OPT["anchor_share"] * spare / (H * (4.0 * D + 8.0)))
    if min(k + extra, S, 65536) > k:
        k = min(k + extra, S, 65536)
        g = geometry_for(S, k)
    if OPT["fill_budget"] and g["saturated"]:
        lo, hi = k, min(S, 65536)
        while lo < hi:
            mid = lo + (hi - lo + 1) // 2
            t = geometry_for(S, mid)
            lo, hi = (mid, hi) if t["fits"] and t["saturated"] else (lo, mid - 1)
        g = geometry_for(S, lo)
    free = g["k"] - W
    sinks = min(OPT["sink_tokens"], free, g["P"])
    g["n_top"] = max(min(free, round(OPT["scored_fraction"] * free)), sinks)
    g["n_rand"] = free - g["n_top"]
    return g


def utility_rows(m):
    """utility_kernels.cuh utility_rows(): the window rows padded to whole tiles of 16."""
    return -(-m // 16) * 16


def scratch_bytes(S, P, k, hb, m=(HQ // H) * W):
    """CompressScratch::carve(): every array 256-byte aligned, element counts as in the code."""
    f, u2, i4, u8 = 4, 2, 4, 8
    kpost = hb * S * D // 2 if FORMAT == 3 and BF16_SCORES else hb * S * D  # bf16 keys only (kpost_bf16)
    arrays = [(f, hb * S * D), (f, kpost), (f, hb * S * D), (f, hb * m * D), (f, hb * m * S), (f, hb * m * D),
              (f, hb * P), (f, hb * P), (f, hb * k * D), (f, hb * k * D), (u2, hb * k * D), (f, hb * k),
              (f, hb * P * D), (f, hb * P), (f, hb * P), (f, hb * m), (i4, hb * utility_rows(m) * D * 2),
              (f, PAIRS), (f, D), (i4, hb * P), (i4, hb * P), (i4, P), (i4, hb * k), (i4, hb * k)]
    arrays += [(i4, H * P)] * 8 + [(u8, P), (i4, hb * P), (i4, hb * P), (i4, S), (i4, PAIRS), (i4, PAIRS),
               (i4, 1)] + [(f, hb * P)] * 4
    arrays += [(f, hb * max(-(-P // SELECT_CHUNK), -(-P // 32)) * 2)]  # select_partials (chunks, or tiles of 32+)
    arrays += [(i4, hb * P), (i4, hb * P), (i4, hb * k)] + [(i4, hb * k)] * 3  # + the pool's
    arrays += [(i4, hb * 8 * k)] * 2 + [(i4, hb * P), (i4, 0)]  # a two-level merge's group picks
    arrays += [(i4, hb * P), (i4, hb * P), (f, hb * P), (u2, H * P), (u2, H * P)] * 2 + [(f, 256)]  # format 3's
    arrays += [(i4, 1 + 4 * hb * P)]  # the token-sides outside their tables
    arrays += [(i4, 6), (u2, hb * m * D)]  # search_stats (utility_split before it), q_b
    arrays += [(f, hb * k * D), (u2, hb * k * D), (f, hb * k)]  # side 1's candidate rows
    at = 0
    for size, count in arrays:
        at = (at + 255) // 256 * 256 + size * max(count, 1)
    return at


def head_batch(g):
    """anchor_head_batch(): as few batches as fit the budget, their heads spread evenly."""
    most = next((hb for hb in range(H, 1, -1) if scratch_bytes(g["S"], g["P"], g["k"], hb) <= HEAD_BATCH_BUDGET), 1)
    batches = -(-H // most)
    return -(-H // batches)


class Pass:
    """Accumulates per-stage counters; each method is one device operation of the pipeline."""
    KEYS = ["gemm", "tc", "simt", "sort_keyB", "hbm", "ops", "kernels", "time"]

    def __init__(self):
        self.rows = {s: dict.fromkeys(self.KEYS, 0.0) for s in STAGES}
        self.stage = STAGES[0]

    def op(self, gemm=0, tc=0, simt=0, hbm=0, kernels=1, sort_keyB=0, sort_s=0.0, latency=0.0, ops=1):
        r = self.rows[self.stage]
        compute = gemm / SGEMM_FLOPS + tc / TC_BF16_FLOPS + simt / SIMT_FLOPS + sort_s
        r["time"] += max(compute, hbm / HBM_BPS, latency) + kernels * LAUNCH_S
        for key, v in (("gemm", gemm), ("tc", tc), ("simt", simt), ("hbm", hbm), ("ops", ops),
                       ("kernels", kernels), ("sort_keyB", sort_keyB)):
            r[key] += v

    def copy(self, nbytes):  # cudaMemcpyAsync / cudaMemsetAsync (setup and fills)
        self.op(hbm=nbytes)

    def sort(self, n, key_bytes, bits, ops=1):
        """CUB onesweep SortPairs (u32 values): histogram + scan kernels, then one per digit pass."""
        passes = -(-bits // RADIX_BITS)
        hbm = n * (key_bytes + 4) * (2 * passes + 1)
        self.op(hbm=hbm, kernels=passes + 2, sort_keyB=n * key_bytes, sort_s=n / SORT_PAIRS_PER_S[key_bytes], ops=ops)

    def sort_segments(self, segments, n):  # CudaDevice::sort_segments_u32: compose, sort u64, split
        total = segments * n
        self.op(simt=total, hbm=12 * total)
        self.sort(total, 8, 32 + max(1, math.ceil(math.log2(segments))))
        self.op(hbm=20 * total)

    def nearest(self, hb, rows, anchors):
        """nearest_anchor_kernel: bf16 mma products of 64-token x 32-anchor tiles, top-4 per part,
        fp32 rescoring of <= 4 candidates (the full-scan fallback is assumed rare)."""
        tc = 2 * hb * (-(-rows // 64) * 64) * (-(-anchors // 32) * 32) * D
        simt = hb * rows * (4 * anchors + 2 * 4 * D + 3 * D)
        self.op(tc=tc, simt=simt, hbm=hb * rows * (D * 4 + 8))  # X once (re-read from L1/L2), outputs

    def coverage_round(self, hb, P, take, local, pool=0, share=1.0):
        """A coverage round's ranking (coverage_round() in compress_anchorkv_pass.hpp): each chunk's
        energy sums (format 2; format 3's come from the last search, local_nearest_kernel's
        energy_parts), each chunk's candidates (keys, a select in shared memory), the merge (one
        block a head over chunks x slots candidates: extra digit and emit trips past one chunk).
        A block: 32 warps of the kernel's SASS on one multiprocessor (one block a multiprocessor).
        With a pool (core/coverage.hpp: pool > take) the chunks and the merge select the pool,
        then (format 3) its rows as stored anchors, the cover test and a second merge over the
        pool take the picks. The cover test (coverage_cover_kernel) is a warp a member walking
        the members in its reach (`share` of the pool), 32 a trip to L2 (COVER_TRIP_S), each lane
        one member's two products as serial dots (2 D dependent FMAs, 4 cycles each), every
        head's members side by side."""
        chunks = -(-P // SELECT_CHUNK)
        wanted = pool if pool > take else take
        n = chunks * min(wanted, SELECT_CHUNK)
        block_s = lambda warp_instr: 32 * warp_instr / (4 * IPC * CLOCK_HZ)
        waves = -(-(hb * chunks) // SMS)
        if not local:
            self.op(hbm=hb * P * 16 + hb * chunks * 8,
                    latency=waves * block_s(SELECT["coverage_energy_kernel"]["hot_static"]))
        self.op(hbm=hb * P * 20 + hb * n * 8, latency=waves * block_s(SELECT["coverage_chunk_kernel"]["hot_static"]))
        m = SELECT["coverage_merge_kernel"]

        def merge(n, want):  # merge_candidates(): one block a head, or a group's first (merge_groups)
            def level(n, want, blocks):
                waves = -(-(hb * blocks) // SMS)
                self.op(hbm=hb * n * 8 * 4 + hb * blocks * want * 12,
                        latency=waves * block_s(m["hot_static"] + (-(-merge_group_keys(n, blocks) // SELECT_CHUNK) - 1) *
                                                (sum(m["hist_loops"]) + m["emit_loop"])))
            groups = merge_groups(n, want)
            if groups > 1:
                level(n, want, groups)
                n = groups * want
            level(n, want, 1)
        merge(n, wanted)
        if pool <= take:
            return
        if local:
            self.unit_rows(2 * hb, pool, False)
        pairs = pool * share / 2
        self.op(simt=hb * pool * pairs * 2 * 2 * D, hbm=hb * pool * 2 * D * 4 * 2,
                latency=math.ceil(pool * share / 32) * (COVER_TRIP_S + 2 * D * 4 / CLOCK_HZ))
        merge(pool, take)

    def unit_rows(self, hb, n, bf16_copy):  # unit_rows_kernel: read X rows, write unit rows (+bf16)
        self.op(simt=hb * n * 3 * D, hbm=hb * n * (D * 4 + D * 4 + (D * 2 if bf16_copy else 4)))

    def local_search(self, hb, g, in_reach, tail, fresh, n_sorted):
        """local_nearest_kernel<128, CH> over every token of hb heads against the absorbed rows in
        its reach (in_reach on average: a segment's count taken as Poisson) and `tail` of the
        window's; CH as local_chunk() picks it (16 when the mean is at most 16, else 32): per
        64-token tile, the two searches of its range in the n_sorted candidates (warp 0, 32 probes a
        round: a quarter of the tile's 4 warps), the token rows in bf16, the one-chunk path where a
        tile's candidates fit one chunk and E[ceil(candidates / CH)] chunks of the loop elsewhere, and
        fp32 rescoring of the tokens not left alone (RESCORED candidates each, over a token's 2
        lanes): with at most WARP_RESCORE_MOST in the warp it rescores them together, a pass each;
        with more, each lane its own (the busiest lane taken as the mean). The fp32 rows are read
        for those tokens only."""
        P = g["P"]
        tiles = hb * -(-P // 64)
        ch = 16 if in_reach + tail <= 16 else 32
        local = LOCAL[str(ch)]
        one, chunks = expected_chunks(in_reach, tail, ch)
        rescore = 0.0 if fresh else SKIP_SHARE
        steps = warp_search_rounds(n_sorted)
        pairs = WARP_TOKENS * (1 - rescore) * RESCORED
        rescoring = (pairs * local["rescore_loop_static"] if pairs <= WARP_RESCORE_MOST
                     else RESCORED / 2 * local["serial_rescore_static"])
        per_warp = (local["warp_instr_per_tile"] + local["search_loops_static"] * steps / 4
                    + one * local["one_chunk_static"] + chunks * local["warp_instr_per_chunk"]
                    + rescoring)
        # bf16 rows, fp32 rescoring rows; every token's norm and best so far read, the searched ones' written
        hbm = tiles * 64 * D * 2 + (1 - rescore) * hb * P * D * 4 + hb * P * 12 + (1 - rescore) * hb * P * 8
        self.op(tc=2 * tiles * 64 * (one + chunks) * ch * D, hbm=hbm, latency=tiles * 4 * per_warp / ISSUE_PER_S)

    def utilities(self, hb, P, m):
        """utility_rows_kernel (||y||^2, the window rows' bf16 splits as A fragments), then
        utility_tc_kernel<128, EXACT> over tiles of 32 tokens: per warp the staging of its tokens'
        rows (TT / 4 tokens, the staging loop's tokens a trip), a 16-row chunk of the mp window
        rows at a time against the tile (ceil(mp / 64) chunks a warp), the rest once; 2 (bf16
        inputs: q and v exact) or 3 bf16 products a side on the tensor cores; A, the key residuals
        and the values read once, 8 words written a token."""
        mp, tt = utility_rows(m), 4096 // D
        self.op(simt=hb * mp * D * 4, hbm=hb * m * D * 8 + hb * mp * D * 8)
        u = UTILITY["exact" if EXACT_UTILITY else "split"]
        tiles = hb * -(-P // tt)
        per_warp = (u["rest_static"] + tt / 4 / u["staging_tokens_per_trip"] * u["staging_static"]
                    + -(-mp // 64) * u["chunk_static"])
        products = 2 if EXACT_UTILITY else 3
        self.op(tc=2 * products * 2 * tiles * tt * mp * D,
                hbm=hb * (m * P * 4 + 2 * P * D * 4 + 4 * P * 4 + 8 * P * 4),
                latency=tiles * 4 * per_warp / ISSUE_PER_S)

    def window_outputs(self, hb, S, m):
        """window_outputs_kernel<128, EXACT>: blocks of 8 warps (16 rows each, all 128 dims) over a
        chunk of WINDOW_CHUNK tokens in stages of 64 (a stage: the values' staging, STAGING_ITERS
        float2 pairs a thread in trips of the loop's unrolling, then 4 mma slabs); 2 (V exact in
        bf16) or 3 bf16 products; A and V read once, the chunks' partials written and read back by
        window_outputs_reduce_kernel."""
        mp, chunks = utility_rows(m), -(-S // WINDOW_CHUNK)
        blocks = hb * chunks * -(-m // 128)
        w = WINDOW["exact" if EXACT_UTILITY else "split"]
        trips = STAGING_ITERS / w["staging_per_trip"]
        per_warp = w["rest_static"] + WINDOW_CHUNK / 64 * (w["stage_static"] + (trips - 1) * w["staging_static"])
        products = 2 if EXACT_UTILITY else 3
        parts = hb * chunks * m * D * 4
        self.op(tc=2 * products * hb * mp * S * D, hbm=hb * (m * S + S * D) * 4 + parts,
                latency=blocks * 8 * per_warp / ISSUE_PER_S)
        self.op(hbm=parts + hb * m * D * 4)


def merge_group_keys(n, groups):
    """coverage_select_kernels.cuh merge_group_keys(): a group's keys, whole passes of SELECT_CHUNK."""
    return -(-(-(-n // groups)) // SELECT_CHUNK) * SELECT_CHUNK


def merge_groups(n, take):
    """coverage_select_kernels.cuh merge_groups(): 1, or the groups (at most 8) of a two-level
    merge with the fewest passes (a group's, the second level's, 3 for its launch)."""
    passes = lambda x: -(-x // SELECT_CHUNK)
    best, fewest = 1, passes(n)
    for g in range(2, 9):
        group = merge_group_keys(n, g)
        if (g - 1) * group >= n:
            continue
        cost = passes(group) + passes(g * take) + 3
        if cost < fewest:
            best, fewest = g, cost
    return best


def coverage_pool(take, free):
    """core/coverage.hpp coverage_pool_size(): kCoveragePool (8) x take, at most the free
    anchors, at least take."""
    return min(8 * take, max(take, free))


def warp_search_rounds(n):
    """warp_lower_bound_u32's rounds over n ids at most: each narrows the range to a probe's
    step, ceil(length / 32), less one."""
    rounds = 0
    while n > 0:
        n, rounds = -(-n // 32) - 1, rounds + 1
    return rounds


def expected_chunks(mean, tail, ch):
    """For N Poisson with the given mean (a segment's candidates) and c = N + tail: the share of
    tiles on the one-chunk path (0 < c <= ch) and E[ceil(c / ch)] over the rest (the loop)."""
    n_max = int(mean + 12 * math.sqrt(mean) + 30)
    p, one, loop = math.exp(-mean), 0.0, 0.0
    for n in range(n_max + 1):
        c = n + tail
        if 0 < c <= ch:
            one += p
        else:
            loop += p * -(-c // ch)
        p *= mean / (n + 1)
    return one, loop


def global_pass(x, g, hb):
    """Format 2 from the coverage on: every token against every anchor (nearest_anchor_kernel)."""
    P, k = g["P"], g["k"]
    free, n_top, n_rand = k - W, g["n_top"], g["n_rand"]
    for side in range(2):                       # unit prefix rows, cover_best = 0
        x.unit_rows(hb, P, False)
        x.copy(hb * P * 4)
    x.op(hbm=hb * (n_top + W) * 12)             # coverage_take_kernel (+ window)
    absorbed = [n_top + W]
    left, at, R = n_rand, n_top, OPT["coverage_rounds"]
    for rnd in range(R):
        take = min(-(-left // (R - rnd)), P - at)
        x.coverage_round(hb, P, take, False, coverage_pool(take, free))
        absorbed.append(take)
        left, at = left - take, at + take
    for n in absorbed:                          # absorb(): both sides' anchor unit rows, per side nearest
        x.unit_rows(2 * hb, n, True)
        for side in range(2):
            x.nearest(hb, P, n)
    # absorb() calls run in program order between the rounds; summing them here is the same.
    x.sort_segments(hb, free)                   # picks by token
    x.copy(hb * P * 4)                          # anchor_of_token = -1
    x.stage = "assignment"
    for side in range(2):
        x.op(simt=hb * k * 4 * D, hbm=hb * k * D * (4 + 2 + 4 + 4 + 2))  # anchors_kernel
        x.nearest(hb, P, k)
        rk = side == 0  # keys: residual rows rotated to their positions (for the utilities)
        x.op(simt=hb * P * (6 * D + (2 * D + PAIRS * 26 if rk else 0)),
             hbm=hb * P * (D * 4 + 16 + (D * 4 if rk else 0)))     # assign_kernel


def bitonic_s(n):
    """sort_fresh_kernel: one block's bitonic network, a barrier and a shared-memory
    compare-exchange per step (0.3 us ASSUMED, 1 us past its 8192 keys in shared memory)."""
    steps = math.ceil(math.log2(max(n, 2)))
    return steps * (steps + 1) / 2 * (0.3e-6 if n <= 8192 else 1e-6)


# The token-sides outside their segment's table (all heads), on the benchmark's data
# (scripts/bench_compress.py's tensors, bf16, made by torch on the CPU and compressed by the CPU
# backend with ANCHORKV_COMPRESS_PROFILE=1: "outside their tables"; at most 362 / 606 / 718 in
# one segment). Each costs a warp of table_misses_kernel a scan of the table's 256 entries: about
# 435 SASS instructions a lane an entry, 8 entries a lane (sm_90, D 128, bf16).
TABLE_MISSES = {32768: 1281, 65536: 5147, 131072: 12471}
TABLE_MISS_INSTR = 8 * 435
SHARED_STEP_CYCLES = 120          # a bitonic step: a batch of shared loads, compare, stores, barrier
TRIP_CYCLES = 900                 # a dependent trip to memory (scripts/sass_count.py's LATENCY["hbm"])
COVER_TRIP_S = 300 / CLOCK_HZ     # ASSUMED: a dependent trip to L2 (~300 cycles): the cover test's, for 32 members
L2_BPS = 10e12                    # ASSUMED: L2 reads (the tables' rows, reread by each scan)


def table_blocks_s(hb, P, L):
    """segment_tables_kernel as a latency walk of a block (a wave: up to 4 blocks a
    multiprocessor, __launch_bounds__(256, 4)): 3 bitonic sorts (2L, 2L, 256 keys; a step per batch of 4 pairs a thread),
    then the entries' batches of loads."""
    steps = lambda n: math.log2(n) * (math.log2(n) + 1) / 2
    batches = -(-(2 * L) // (256 * 4))
    cycles = (2 * steps(2 * L) * batches + steps(256)) * SHARED_STEP_CYCLES + batches * (2 * TRIP_CYCLES + 8 * 30)
    waves = -(-hb * -(-P // L) // (4 * SMS))
    return waves * cycles / CLOCK_HZ


def local_pass(x, g, hb):
    """Format 3 from the coverage on (compress_anchorkv_pass.hpp local_coverage(), then the
    assignment with tables and codes)."""
    P, k, S = g["P"], g["k"], g["S"]
    free, n_top, n_rand = k - W, g["n_top"], g["n_rand"]
    L = segment_length(P, k)
    reach = (64 * P + free - 1) // free if k > 256 else P
    share = min(1.0, (L + 2 * reach) / P)  # of an absorb's prefix rows, those in a token's reach
    for side in range(2):  # near_token = -1, best = 0 (the bf16 rows and norms: load_head_kernel)
        x.copy(hb * P * 4)
        x.copy(hb * P * 4)
    x.op(hbm=hb * (n_top + W) * 8, latency=bitonic_s(n_top))  # sort_fresh_kernel: the candidates by token
    absorbs = [(n_top, True)]
    left, at, R = n_rand, n_top, OPT["coverage_rounds"]
    for rnd in range(R):
        take = min(-(-left // (R - rnd)), P - at)
        x.coverage_round(hb, P, take, True, coverage_pool(take, free), share)  # the picks in token order
        absorbs.append((take, False))
        left, at = left - take, at + take
    for i, (n, fresh) in enumerate(absorbs):        # absorb(): both sides' candidate rows, both sides' search
        x.unit_rows(2 * hb, n + (W if i == 0 else 0), True)
        x.local_search(2 * hb, g, n * share, W if i == 0 else 0, fresh, n)
    x.sort_segments(hb, free)                       # picks by token
    x.copy(hb * P * 4)                              # anchor_of_token = -1
    x.stage = "assignment"
    for side in range(2):
        x.op(simt=hb * k * 4 * D, hbm=hb * k * D * (4 + 2 + 4 + 4 + 2))  # anchors_kernel
        x.op(simt=hb * P * 4, hbm=hb * P * 24)                          # local_assign_kernel
    # segment_tables_kernel: two bitonic sorts of 2L keys per segment in shared memory
    sort_steps = math.log2(2 * L) * (math.log2(2 * L) + 1) / 2
    x.copy(4)                                       # the count of the token-sides outside their tables
    x.op(simt=hb * 2 * P * sort_steps * 2 * 6, hbm=hb * P * 2 * 12, latency=table_blocks_s(hb, P, L))
    misses = TABLE_MISSES.get(S, 0) * hb / H        # table_misses_kernel: a warp each, over the device
    x.op(hbm=misses * D * 4, latency=TRIP_CYCLES / CLOCK_HZ + max(misses * TABLE_MISS_INSTR / ISSUE_PER_S,
                                                                 misses * 256 * D * 2 / L2_BPS))
    for side in range(2):                           # code_coefficients_kernel (keys: rotated residuals)
        rk = side == 0
        x.op(simt=hb * P * (6 * D + (2 * D + PAIRS * 26 if rk else 0)),
             hbm=hb * P * (D * 4 + D * 2 + 16 + (D * 4 if rk else 0)))



def predict(S):
    g = anchor_geometry(S)
    P, k, words = g["P"], g["k"], g["words"]
    free, n_top, n_rand = k - W, g["n_top"], g["n_rand"]
    m = (HQ // H) * W
    HB = head_batch(g)
    x = Pass()
    # setup: fill the cache, positions (scratch and section), RoPE tables (3), signs, NaN flag
    x.stage = "setup"
    x.copy(g["base"] + g["nk"] * (D // 4 + 4) + g["nv"] * (D // 4 + 5))
    for nbytes in (4 * S, 4 * P, 4 * PAIRS, 4 * PAIRS, 4 * PAIRS, 4 * D, 4):
        x.copy(nbytes)
    for h0 in range(0, H, HB):
        hb = min(HB, H - h0)
        x.stage = "load"  # load_head_kernel: bf16 K, V in; kpre, kpost, v fp32 out; RoPE ~26 flops/pair
        # format 3: also the prefix rows in bf16 and their squared norms, both sides
        prefix_rows = hb * P * 2 * (D * 2 + 4) if FORMAT == 3 else 0
        x.op(simt=hb * S * PAIRS * 26 + (hb * P * 2 * 3 * D if FORMAT == 3 else 0),
             hbm=hb * S * D * (2 * 2 + 3 * 4 - (2 if BF16_SCORES else 0)) + prefix_rows)  # (post-RoPE keys in bf16)
        x.op(hbm=hb * m * D * (8 if BF16_SCORES else 6))  # load_queries_kernel (+ bf16 rows)
        x.stage = "window attention"  # Q K^T [m][S], causal-window softmax in place, A V
        if BF16_SCORES:
            x.op(tc=2 * hb * m * S * D, hbm=hb * (S * D * 2 + m * S * 4))
        else:
            x.op(gemm=2 * hb * m * S * D, hbm=hb * (S * D + m * S) * 4)
        x.op(simt=hb * m * S * 8, hbm=hb * m * S * 4 * 3)  # window_softmax_kernel: 2 reads, 1 write of each row
        x.window_outputs(hb, S, m)
        x.stage = "scores+pooling"
        x.op(simt=hb * m * P * 3, hbm=hb * (m * P + 2 * P) * 4)  # scores_kernel: column means of A, A^2
        x.op(simt=hb * P * OPT["pool_kernel"], hbm=hb * P * 12)  # pool_kernel: keys + token index
        x.stage = "anchor selection"
        x.sort_segments(hb, P)                      # rank by pooled score
        x.copy(hb * P * 4)                          # cover_anchor = 0
        x.op(hbm=hb * n_top * 12)                   # coverage_take_kernel (scored picks)
        (local_pass if FORMAT == 3 else global_pass)(x, g, hb)
        x.stage = "utilities"
        x.utilities(hb, P, m)
    by_energy = lambda n: min(n, round(OPT["guard_fraction"] * n))
    for side, wanted in enumerate((g["nk"], g["nv"])):
        n = min(wanted, H * (P - free))
        n_energy = by_energy(n)
        n_util = n - n_energy
        x.stage = "residual selection"
        x.sort(H * P, 4, 32)                        # by utility over every head
        x.op(hbm=n_util * 12)                       # mask_kernel (atomicOr)
        x.op(hbm=n_util * 8)                        # exclude_chosen_kernel
        x.sort(H * P, 4, 32)                        # guard: by residual energy
        x.op(hbm=n_energy * 12)                     # mask_kernel
        x.op(hbm=H * words * 12, latency=H * -(-words // 1024) * PREFIX_CHUNK_S)  # prefix_kernel: one block scan
        x.stage = "encoding"  # encode_kernel: grid (words, H), one warp walks its word's residuals
        per_word = -(-n // (H * words))
        waves = -(-(H * words) // RESIDENT_WARPS)
        x.op(simt=n * (D * 7 + 12 * D), hbm=n * (D * 2 + 8 + D // 4 + 5) + H * words * 12,
             latency=waves * per_word * ENCODE_RESIDUAL_S)
    return g, HB, x


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[32768, 65536, 131072])
    ap.add_argument("--format", type=int, choices=(2, 3), default=3, help="storage_format (3: the default)")
    ap.add_argument("--pre-rope-keys", action="store_true",
                    help="keys given pre-RoPE: the window scores' GEMM in fp32 (SGEMM), as for f16 or f32 inputs")
    ap.add_argument("--sass", help="scripts/sass_count.py --json output (its local_search and coverage_select counts)")
    args = ap.parse_args()
    global FORMAT, BF16_SCORES
    FORMAT = args.format
    BF16_SCORES = not args.pre_rope_keys
    if args.sass:
        with open(args.sass) as fh:
            counts = json.load(fh)
        LOCAL.update(counts["local_search"])
        SELECT.update(counts["coverage_select"])
        for kind in UTILITY:
            UTILITY[kind].update(counts["utility"][kind])
            WINDOW[kind].update(counts["window"][kind])
    keys = "post" if BF16_SCORES else "pre"
    print(f"Model of the CUDA AnchorKV pass (storage format {FORMAT}, H={H}, Hq={HQ}, D={D}, bf16, {keys}-RoPE keys, "
          f"W={W}, theta={THETA}, default options) "
          f"on an H200: SGEMM {SGEMM_FLOPS / 1e12:.0f} TF, mma {TC_BF16_FLOPS / 1e12:.0f} TF, SIMT "
          f"{SIMT_FLOPS / 1e12:.1f} TF, HBM {HBM_BPS / 1e12:.1f} TB/s, {LAUNCH_S * 1e6:.0f} us/launch.")
    print("GFLOP columns: fp32 cuBLAS GEMM | bf16 tensor cores (mma; the scores' cuBLAS GEMM) | SIMT fp32; "
          "sort MB = key bytes sorted; "
          "ops = library count, kernels = GPU launches incl. CUB internals.\n")
    for S in args.seq_lens:
        g, HB, x = predict(S)
        total = {key: sum(r[key] for r in x.rows.values()) for key in Pass.KEYS}
        if S in (32768, 65536, 131072):  # tests/emu CompressLaunchCount.PerLayerAtBenchShapes
            expected = {(2, 8): 119, (2, 4): 232, (3, 8): 113, (3, 4): 220}[(FORMAT, HB)]
            assert HB == (8 if S <= 65536 else 4) and total["ops"] == expected, (HB, total["ops"])
        print(f"### S = {S}: k = {g['k']} anchors/head ({g['n_top']} scored, {g['n_rand']} coverage), "
              f"N_K = {g['nk']}, N_V = {g['nv']}, {HB} heads per batch ({-(-H // HB)} batches)\n")
        print("| stage | GEMM GF | bf16 TC GF | SIMT GF | sort MB | HBM MB | ops | kernels | predicted ms |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for name in STAGES + ["total"]:
            r = total if name == "total" else x.rows[name]
            print(f"| {name} | {r['gemm'] / 1e9:.1f} | {r['tc'] / 1e9:.1f} | {r['simt'] / 1e9:.1f} | "
                  f"{r['sort_keyB'] / 1e6:.1f} | {r['hbm'] / 1e6:.0f} | {r['ops']:.0f} | {r['kernels']:.0f} | "
                  f"{r['time'] * 1e3:.3f} |")
        top = max(STAGES, key=lambda s: x.rows[s]["time"])
        target = TARGET_MS.get(S)
        verdict = f"target {target} ms ({total['time'] * 1e3 / target:.1f}x)" if target else "no target"
        print(f"\nS={S}: predicted {total['time'] * 1e3:.2f} ms vs {verdict}; dominant stage: {top} "
              f"({x.rows[top]['time'] * 1e3:.2f} ms, {100 * x.rows[top]['time'] / total['time']:.0f}%)\n")


if __name__ == "__main__":
    main()
