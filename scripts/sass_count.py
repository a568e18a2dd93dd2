#!/usr/bin/env python3
"""SASS counts of the CUDA kernels for sm_90, without a GPU.

Compiles the decode kernels (decode_kernels.cuh: split <128,4>, anchor values, merge, append)
and the compression kernels (compress_kernels.cuh) for sm_90 with line info, disassembles
them (nvdisasm/cuobjdump: the CUDA toolkit's, or PyPI's nvidia-cuda-nvdisasm and
nvidia-cuda-cuobjdump, which scripts/install-deps.sh installs) and prints per kernel:
registers, stack, spills (ptxas -v), SASS instructions, local-memory accesses, barriers,
atomics, and whether tensor-core (HMMA) or packed half2/bf16x2 arithmetic is present.

For decode_split_kernel<128, 4, true> (the register-gather path's instantiation the library
launches for the default caches: bf16, fused NeoX RoPE, format 3; 4 rows: compiled with
AKV_SASS_PIN_BF16_FUSED, which makes the rest of that path (a full row chunk, segment tables) a
constant so that the SASS holds only the code that runs; the per-kernel table is of that build
too; its per-anchor weights in shared
memory, or with --segment-weights a segment table's entries at a time, AKV_SASS_PIN_SEGMENT_WEIGHTS:
the library's plan at 128K; with --scores its path for caches without RoPE, AKV_SASS_PIN_SCORES: the
anchors' scores looked up, not their rows gathered) it also counts the AnchorKV
prefix tile loop: the loop is found in the control flow (the innermost backward branch whose
body holds both the key residuals and the per-anchor weights), each instruction is put in a
phase by its source line (nvdisasm -gi: its innermost frame in decode_kernels.cuh, through
every inlined helper) and weighted by
  - the trip count of each inner loop around it, from the loop's source line (table TRIPS:
    derived from the kernel's constants and the residual fractions --fk/--fv; loops nvcc
    unrolled are not loops in SASS and count once);
  - the warps that execute it (table WARPS: e.g. the tile metadata runs on 2 of 8 warps);
and summed per tile over the block's 8 warps, then divided by the tile's 64 tokens: warp
instructions per token and head. Predicated-off instructions count (they issue); branch
divergence inside a warp is not modelled beyond WARPS. The counts are static SASS with a
stated dynamic model, not a profile.

The issue rate those instructions can reach comes from the same SASS (warp_latency): nvdisasm
-hex gives each instruction's scheduling fields (the stall count ptxas set, the scoreboards it
sets and waits on); each warp walks the loop's lines it runs with stated Hopper latencies
(LATENCY), and the tile's barriers make the block wait for its slowest warp between them, tile
by tile: the walk with its barriers is repeated for each pair of a tile's key and value residual
counts and averaged over their odds (count_walks: overdispersed counts, as measured on a real
model, COUNT_DISPERSION), since the mean of a tile's slowest warp is above the slowest at the
mean counts. It prints a warp's cycles a tile, the barrier
segments and the bound on instructions a scheduler issues a cycle, which predict_decode.py
applies.

It also walks the split kernel's set-up before its first tile (prologue_walk) and its window
tile and partial write (tail_walk), and the two merge kernels (merge_walk), which
predict_decode.py prices beside the tile loop.

Then it compiles the library's own decode_split_kernel instantiations (D 64/128/256 x 4/8/16
rows x the register-gather path's and the rest, no pinning) and prints their registers, stack,
spills and local-memory accesses: what ships, where the pinned count leaves paths out.

  scripts/sass_count.py [--fk 0.052 --fv 0.052] [--segment-weights] [--json out.json] [--keep DIR]

scripts/predict_decode.py reads the tile-loop phases and the latency bound from here (--json)
instead of PTX.
"""
import argparse
import collections
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNELS = os.path.join(ROOT, "src", "cuda", "decode_kernels.cuh")
T, NT, NW, ROWS, D, PAIRS = 64, 256, 8, 4, 128, 64
ROWS_WARPS = min(ROWS, NW)  # warps that own a row (softmax_tile, write_partial)
ENTRY_WARP = (T + D // 2 + 31) // 32  # SplitBlock::kEntryWarp: stage_entries's warp (4 at D 128; stage_tile_words's the next)
STAGE_RESIDUALS = min(32, 128 // (D // 16))  # SplitBlock::kStageResiduals: residuals a trip of the staging loops
VALUE_GROUPS = 4  # SplitBlock::kValueGroups: slot groups (of D / 2 threads at D 128, 4 rows) that take value residuals

# Phases of the tile loop by SplitBlock member (the function whose body holds the line).
PHASES = [
    ("metadata", ["anchor_meta", "format3_meta", "stage_entries", "stage_tile_words", "stage_next", "tile_words"]),
    ("anchor gather + RoPE + query rotation", ["gather_anchor_rows", "gather_rotate_neox", "gather_anchor_rows_as",
                                               "put8", "exact_angle", "rotate_queries", "rotate_query_pair", "rotate_pairs4",
                                               "rotate_gptj4", "gptj_position"]),
    ("key residuals", ["key_residuals", "key_residuals_tc", "residual_logit_terms", "stage_keys"]),
    ("RoPE pass (unfused only)", ["rotate_keys", "offset_angle"]),
    ("contraction", ["contract", "contract_tile", "contract_gathered", "lookup_scores"]),
    ("softmax", ["softmax_tile", "settle_tile", "rescale", "new_reference"]),
    ("per-anchor weights", ["prefix_values:weights", "flush_segment"]),
    ("value residuals", ["prefix_values:residuals", "stage_values"]),
    ("loop control and barriers", ["decode_split_kernel", "SplitBlock"]),  # SplitBlock: indices the loop recomputes
]

# A tile's residual counts on each side are overdispersed: residuals go to the tokens their
# anchors represent worst, which cluster (a tile without any beside one with a dozen), where
# residuals spread evenly would make the count Poisson(T f). MEASURED
# (tools/realmodel/anchor_sharing.cpp, SmolLM2-135M, 6 of 30 layers, every KV head, default
# options at 20x, 1710-2286 tiles of 64 tokens): variance / mean of the key and value counts
# 6.5 / 5.9 on 8K tokens of the GPL, 5.3 / 5.3 on 8K of the paper, 6.7 / 5.6 on 6K of the
# rebuttal (5-9 at 5x and 10x), at 4.7% residuals on each side: 36-43% of the tiles have none
# (Poisson at that mean: 5%) and 9-11% have 9 or more (Poisson: 1%); key and value counts
# correlate (0.37-0.38), which the walk leaves out (the sides are independent there; only
# segment 0's two staging warps see both). A negative binomial with the plan's mean and this
# variance / mean (1: Poisson) is the walk's distribution (count_pmf); 5.7, the first two
# texts' mean (all three: 5.9), gives at 4.65% 33% of the tiles none and 9% 9 or more.
COUNT_DISPERSION = 5.7


def tile_floor(fk, fv):
    """The tile loop's arithmetic floor by phase, warp instructions per token and head: what any
    kernel that decodes format 3 as this one does (each token's anchor row rotated to its position
    in bf16x2, keys and queries contracted on the tensor cores, fp32 softmax and sums) must issue
    with every lane busy and nothing else: no address arithmetic, loop control, staging through
    shared memory or barriers. A yardstick for the counts above (how far each phase is from what
    its data and operations need), not a prediction. At D 128 and 4 rows; fk and fv: residuals a
    token on each side."""
    lanes = 32
    per_pass = T / lanes  # warp passes over a tile's tokens, a token a lane
    floor = {}
    # Per tile: the four per-token byte arrays in 4-byte loads, the three mask words and the
    # first anchor (one load); per token: its packed word's four bytes, the two table lookups
    # (key and value anchor), the two coefficients by code, whether it is an anchor token
    # (a popcount below it in the mask).
    floor["metadata"] = (4 * T / (4 * lanes) + 1 + per_pass * (4 + 2 + 2 + 2)) / T
    # The anchor row (2 D bytes) and the cos / sin of its D / 2 pairs (2 D bytes) in 16-byte
    # loads; each pair's two outputs a multiply and a fused multiply-add, two pairs an
    # instruction (bf16x2); the queries rotated to the tile's start in fp32, once a tile.
    loads = 2 * (2 * D) / (16 * lanes)
    rotate = (D // 2) * 2 * 2 / 2 / lanes
    queries = ROWS * (D // 2) * 2 * 2 / lanes / T
    floor["anchor gather + RoPE + query rotation"] = loads + rotate + queries
    # m16n8k16: T / 16 x D / 16 a tile (up to 8 rows in n8), the queries' B fragments (one
    # 8-byte load a k16 slab and warp of 16 tokens), the coefficient times each logit.
    floor["contraction"] = ((T // 16) * (D // 16) + (T // 16) * (D // 16) + T * ROWS / lanes) / T
    # Per token and row: the running max, the subtraction and exp2, the sum, the probability's
    # store for the value side.
    floor["softmax"] = 5 * ROWS / lanes
    # Per token and row: the probability's load, its product with the value coefficient, and a
    # shared-memory float add (sm_90 has none: a compare-and-swap loop of a load, an add, the
    # CAS, a compare and a branch).
    floor["per-anchor weights"] = (1 + 1 + 5) * ROWS / lanes
    # A key residual: its codes and scale (two loads), D / 32 2-bit levels a lane into f16 pairs
    # (three operations a pair), the inverse Hadamard (two m16n8k16 at D 128), the scale and the
    # rotation in fp32 (D / 2 pairs x 2 outputs x 2 operations), its cos / sin, its logit term
    # batched 16 residuals to an mma (D / 16 a batch, with their B fragments), the term added.
    key = 2 + (D // 32) // 2 * 3 + 2 + (D // 2) * 2 * 2 / lanes + loads / 2 + 2 * (D // 16) / 16 + ROWS / lanes
    floor["key residuals"] = fk * key
    # A value residual: its codes (one load), D / 32 levels a lane (an extract and a lookup
    # each), the row's probabilities (one load), rows x D fp32 multiply-adds.
    value = 1 + 2 * (D // 32) + 1 + ROWS * D / lanes
    floor["value residuals"] = fv * value
    floor["loop control and barriers"] = 0.0
    return floor


def count_pmf(mean, dispersion):
    """P(c), c = 0 .. T: a tile's residual count with that mean and variance / mean (a negative
    binomial; Poisson at dispersion 1), the mass past T at T."""
    if mean <= 0:
        return [1.0] + [0.0] * T
    if dispersion <= 1.0:
        p = [math.exp(-mean + c * math.log(mean) - math.lgamma(c + 1)) for c in range(T)]
    else:
        r, q = mean / (dispersion - 1.0), 1.0 / dispersion
        p = [math.exp(math.lgamma(c + r) - math.lgamma(r) - math.lgamma(c + 1) + r * math.log(q) + c * math.log1p(-q))
             for c in range(T)]
    return p + [max(0.0, 1.0 - sum(p))]


class Counts:
    """A tile's key and value residual counts: count_pmf(T fk) and count_pmf(T fv) at the
    dispersion, or one pair of counts (fixed), for the walk of tiles by their counts
    (count_walks)."""

    def __init__(self, fk, fv, fixed=None, dispersion=COUNT_DISPERSION):
        self.fk, self.fv, self.fixed = fk, fv, fixed
        self.mean_key = T * fk if fixed is None else fixed[0]
        self.mean_value = T * fv if fixed is None else fixed[1]
        if fixed is None:
            self.pmf_key, self.pmf_value = count_pmf(T * fk, dispersion), count_pmf(T * fv, dispersion)

    def key(self, f):
        return sum(p * f(c) for c, p in enumerate(self.pmf_key)) if self.fixed is None else f(self.fixed[0])

    def value(self, f):
        return sum(p * f(c) for c, p in enumerate(self.pmf_value)) if self.fixed is None else f(self.fixed[1])


# The walk of tiles by their residual counts (count_walks). Every trip count the walk takes
# (the busiest warp's: key_residuals_tc's warp 4 ceil(c / 4) residuals in ceil(c / 16) passes,
# the value residuals' busiest slot group ceil(c / 4), the staging loops ceil(c / 8) trips)
# depends on c only through ceil(c / 4), so a class of counts 4 m - 3 .. 4 m is walked once, at
# 4 m; classes 0 .. COUNT_CLASSES - 1, the tail (past 28 residuals: 0.1-0.3% of the tiles at
# 5.2% and dispersion 6) walked with the last class, at 32.
COUNT_CLASSES = 9


def count_walks(fk, fv, dispersion=COUNT_DISPERSION):
    """[(probability, Counts fixed at one (key, value) pair)] over a tile's residual counts."""
    def classes(pmf):
        out = [0.0] * COUNT_CLASSES
        for c, p in enumerate(pmf):
            out[min(-(-c // 4), COUNT_CLASSES - 1)] += p
        return out
    pk, pv = classes(count_pmf(T * fk, dispersion)), classes(count_pmf(T * fv, dispersion))
    return [(pk[a] * pv[b], Counts(fk, fv, (4 * a, 4 * b)))
            for a in range(COUNT_CLASSES) for b in range(COUNT_CLASSES) if pk[a] * pv[b] > 0.0]


# Rounds of the per-anchor weights' compare-and-swap loop (a shared-memory float add): one
# success per address a round, so as many as the warp's tokens have on their most shared
# anchor (a warp takes 8 tokens 8 apart, for four rows). MEASURED
# (tools/realmodel/anchor_sharing.cpp, SmolLM2-135M, 6 of 30 layers, default options at
# 5x / 10x / 20x): 1.57 / 1.64 / 1.62 on 8K tokens of the paper, 1.56 / 1.58 / 1.55 on 6K of the
# rebuttal; 32 consecutive tokens of one row (the warp's tokens before) had 4.0-4.6. Counted
# once before.
CAS_ROUNDS = 1.6


# Trip counts per tile and warp of the inner loops that survive in SASS, by the source line of
# the loop's backward branch (a substring of it). fk, fv: residual fractions; a tile holds
# T * f residuals on average. rescale: the share of tiles that rescale (rescale_rate()).
def key_warp_residuals(c, w):
    """key_residuals_tc's residuals of warp 4 + w for c in the tile (R 1 at D 128,
    slot_residual): w, w + 4, w + 8, ... below c."""
    return max(0, -(-(c - w) // 4))


def key_warp_passes(c, w):
    """Passes of key_residuals_tc's warp 4 + w: the tile's residuals [16 p, 16 p + 16) a pass,
    while 16 p + w is below c."""
    return max(0, -(-(c - w) // 16))


def trips(src, counts, k, rescale):
    ck, cv = counts.mean_key, counts.mean_value
    # Key residuals: warp 4 + w (w < 4) takes residuals w, w + 4, .. in passes of 16 residuals
    # of the tile, so the passes of a tile are the sum over the warps of key_warp_passes; the
    # mean over the four warps. (c / 16, the mean count, would assume full passes.)
    key_passes = counts.key(lambda c: sum(key_warp_passes(c, w) for w in range(4)) / 4)
    table = [
        ("p0 + R * w < count; p0 += 4 * RW", key_passes),   # key residuals: warps 4-7, passes of 16
        ("p0 + slot_residual(w, s * R) < count; ++s", ck / 4 / key_passes if key_passes else 0.0),  # key_residuals_tc: a pass's residuals in turn
        ("t < T; t += STEP", T / (NT // (D // 8))),           # gather: T / STEP tokens a thread
        ("e < rows * T; e += NT", ROWS * T / NT),             # per-anchor weights: (row, token) a thread
        ("r0 < count; r0 += kStageResiduals", counts.value(lambda c: -(-c // STAGE_RESIDUALS))),  # value residuals' staging
        ("k0 < count; k0 += kStageResiduals", counts.key(lambda c: -(-c // STAGE_RESIDUALS))),  # key residuals' staging
        ("n < count; n += VG) {", cv / VALUE_GROUPS),          # value residuals: VG slot groups in turn (the mean)
        ("u < T; u += 32", T / 32),
        ("s < 2 * SP; ++s", D / 32),                          # fast contraction: slab pairs of a token's row
        ("j < pairs; j += NT", 1.0),
        ("e < MAXROWS * k; e += NT", rescale * ROWS * k / NT),  # weight rescale (global weights)
        ("e < k; e += NT", k / NT),                           # weight rescale: a row's k weights (a cold block)
        ("e < MAXROWS * D; e += NT", 0.0),                    # zero query rows: none in a full chunk
        ("e < kSegmentEntries; e += 32", 256 / 32),           # a new segment's coefficients: 8 entries a lane
        ("e < kSegmentEntries; e += NT", 256 / NT),           # a segment's weights flushed: an entry a thread
        ("e < MAXROWS * kSegmentEntries; e += NT", ROWS * 256 / NT),  # and rescaled (a cold block)
        ("v < D / 4; v += 4", D / 16),
        ("i < MAXROWS; ++i", ROWS),                           # rows loops that stay rolled
        ("atomicAdd(", CAS_ROUNDS),                           # the CAS retry loop: a round a token on one address
    ]
    for pattern, n in table:
        if pattern in src:
            return n, pattern
    return 1.0, None


def busiest_trips(src, counts):
    """The trips of the warp that waits longest, for the loops whose trips differ between the
    warps that run them (trips() gives the mean, which the issue count wants; the walk's
    barrier waits for the busiest): key_residuals_tc's warp 4, which takes residuals 0, 4, 8, ..
    (a pass for each 16 of the tile's, the pass's residuals in turn), and the value
    residuals' busiest slot group (ceil(count / VG) of them). None: the same as trips()."""
    passes = counts.key(lambda c: key_warp_passes(c, 0))
    own = lambda c: key_warp_residuals(c, 0)  # warp 4's residuals
    table = [
        ("p0 + R * w < count; p0 += 4 * RW", passes),
        ("p0 + slot_residual(w, s * R) < count; ++s", counts.key(own) / passes if passes else 0.0),
        ("n < count; n += VG) {", counts.value(lambda c: -(-c // VALUE_GROUPS))),
    ]
    for pattern, n in table:
        if pattern in src:
            return n
    return None


# Tiles that rescale what is accumulated (softmax_tile's rare block: the accumulators and the
# k per-anchor weights of each row): a row's max passing its reference by more than
# kRescaleSlack (32; a block's first tile only sets it). MEASURED on real prompts
# (tools/realmodel/rescale_rate.py: SmolLM2-135M, exact logits, the 4 held-out queries of 8K
# tokens of the paper's text and 6K of the rebuttal): no tile in 75,600 (blocks of 16 tiles)
# or 79,920 (blocks of 128) rose past its reference by 32; the largest rise was 27.1. The
# count charges 0.01 raises a block, above what those walks allow (about 0.0006 for 16 tiles).
# Slack 8 (the rule before) measured 0.0393 / 0.0051 of the tiles (about 0.66 raises a block),
# every rise 0.321 / 0.056.
RAISES_PER_BLOCK = 0.01
# The share of prefix tokens that are anchors (the default geometry: (k - W) / P, 783 of 32736
# at 32K, 3226 of 131040 at 128K).
ANCHOR_SHARE = 0.024


def rescale_rate(block_tiles):
    """The share of a block's tiles that rescale, for blocks of block_tiles tiles."""
    return min(1.0, RAISES_PER_BLOCK / max(1, block_tiles))


# Blocks that the default path (consecutive positions, every dim rotary, tokens inside the
# prompt) does not take, or takes rarely: (substring of the line that opens the block, the
# fraction of tiles that run it). The block is the braces opened on that line.
def cold_blocks(rescale, block_tiles):
    return [
        ("if (__syncthreads_or(rose)) {", rescale),  # a row's reference max rose (softmax_tile)
        # A prefix tile's logit passed its row's reference (settle_tile): a block's first tile,
        # where the rows take their first reference, then the rare raises.
        ("if (__syncthreads_or(rose)) {  // rare", min(1.0, 1.0 / max(1, block_tiles) + rescale)),
        ("if (__syncthreads_or(scaled)) {", rescale),  # and of those only the raises rescale
        # A logit passed its row's reference by more than the slack: a block's first tile sets
        # the reference, then the rare raises.
        ("if (__any_sync(kFullMask, l_max > m_old + p.rescale_slack)) {", min(1.0, 1.0 / max(1, block_tiles) + rescale)),
        ("if (!blk.fused || blk.gapped) {", 0.0),   # the RoPE pass: gapped positions (format 2) only
        ("if (q >= P4)", 0.0),                      # dims past the rotary pairs only
        ("if (a < 0) {", 0.0),                      # tokens past the prompt's end (last tile only)
        # --segment-weights: a segment's weights added to the workspace, after its last tile in the
        # block (1024 tokens at 32K and 128K) and the block's last
        ("if (flush) {", min(1.0, 1.0 / 16 + 1.0 / max(1, block_tiles))),
        # --segment-weights: an anchor token's own weight (a global atomic), where one of the
        # 8 tokens of a warp's pass is an anchor
        ("if (own) {", 1.0 - (1.0 - ANCHOR_SHARE) ** (32 // (NT // T))),
        ("} else {  // exact: the first tile", 1.0 / 16),  # the tile's first angle exactly: every 16th tile
        ("if (seg_s[0] != si) {", 1.0 / 16),        # a new segment (format 3): 1024 tokens at 32K and 128K
        # Called only in the rare blocks above; where ptxas's line table leaves its inlined
        # instructions without the caller's lines, the function's own lines say so.
        ("void rescale() {", rescale),
        # The set-up (SplitBlock's constructor), which ptxas may place inside the loop's address
        # span (the loop entered in its middle): it runs before the first tile.
        (": c(view), p(launch) {", 0.0),
    ]


# Blocks that only some of the 8 warps run: (substring of the line that opens the block,
# warps); the block is the braces opened on that line, as for cold_blocks().
WARP_BLOCKS = [
    ("if (half == 1) {", 4.0),                     # contraction: the second half of the dims' warps
    ("if (half == 0) {", 4.0),                     # contraction: the first half's warps finish the logits
    ("for (int j = tid; j < pairs; j += NT) {", PAIRS / 32),  # the query rotation: one thread a pair
    ("if (const int i = warp + r * NW; i < MAXROWS) {", ROWS_WARPS),  # softmax: each owned row in its warp
    ("} else if (warp == NW - 1 && !window && !format3 && lane < 4) {", 1.0),  # format 2's residual slots: one warp
    ("} else if (warp == NW - 1 && !window) {", 1.0),  # the value residuals' staging (stage_values)
    ("if (group < VG) {", VALUE_GROUPS * (D // 2) / 32),  # value residuals: VG slot groups of TPD = D / 2 threads
]


# Set-up that a warp skips when an early return leaves it nothing to do: (substring of the
# guard's line, substring of the line that ends the set-up, the share of the warps that stay).
# Weighted by source line, outside inner loops: this assumes ptxas keeps the set-up's
# instructions after the guard's branch, as the CUDA 13 SASS of key_residuals_tc does.
def guarded_spans(counts, busiest=False):
    # key_residuals_tc: warp 4 + w returns unless the tile holds more than w key residuals (the
    # mean over the four warps; busiest: warp 4's, which stays whenever there is one).
    key_warps = (counts.key(lambda c: 1 if c > 0 else 0) if busiest
                 else counts.key(lambda c: sum(1 for w in range(4) if c > w)) / 4)
    return [("if (R * w >= count) return;", "for (int p0 = 0; p0 + R * w < count;", key_warps)]


def guarded_lines(lines, table):
    """line number -> weight for the lines after each guard of `table` (guarded_spans()), up to
    the line that ends its set-up."""
    weight = {}
    for guard, end, w in table:
        for n, ln in enumerate(lines, 1):
            if guard in ln:
                m = n + 1
                while m <= len(lines) and end not in lines[m - 1]:
                    weight[m] = w
                    m += 1
    return weight


def cold_lines(lines, table):
    """line number -> weight for the lines inside the blocks of `table` (cold_blocks(),
    WARP_BLOCKS: the braces opened on the pattern's line, up to the line that closes them)."""
    weight = {}
    for pattern, w in table:
        for n, ln in enumerate(lines, 1):
            at = ln.find(pattern)
            if at < 0:
                continue
            rest = ln[at:].lstrip("}")  # "} else {": the block the pattern opens
            depth = rest.count("{") - rest.count("}")
            m = n
            while depth > 0 and m < len(lines):  # up to the brace that closes it ("} else {" too)
                m += 1
                for ch in lines[m - 1]:
                    depth += (ch == "{") - (ch == "}")
                    if depth == 0:
                        break
                if depth > 0:
                    weight[m] = w
    return weight


# Helpers of the tile loop whose instructions belong to their caller (phase, warps, trips):
# stage_trip runs on the key staging's warp from stage_keys and on the value staging's from
# stage_values.
CALLER_HELPERS = {"stage_trip", "prefetch_tiles", "prefetch_slots", "prefetch_table"}


# Warps of 8 that execute a line, by its function and a substring of the enclosing condition
# (the lines just above it); default 8.
def warps(func, cond_text):
    if func == "format3_meta":
        return 2.0  # warps 0-1: a token a thread
    if func in ("stage_keys", "stage_values", "stage_entries", "stage_tile_words", "stage_next"):
        return 1.0  # warps 6 and 7: the key and value residuals' staging; 4 and 5: the next tile's entries and words
    if func in ("contract_gathered", "rotate_pairs4", "rotate_gptj4", "key_residuals", "key_residuals_tc",
                "residual_logit_terms"):
        return 4.0  # fast path: warps 0-3 contract, warps 4-7 take the key residuals meanwhile
    if func == "anchor_meta":
        return 2.0  # tid < T (warps 0-1) or T <= tid < T + pairs (warps 2-3): 2 of 8 each
    if func == "new_reference":
        return ROWS_WARPS  # the rows' owner warps (softmax_tile, settle_tile)
    if func == "rotate_query_pair":
        return PAIRS / 32  # the fast path's query rotation: the angle's thread, a pair each (warps 2-3)
    if func == "gather_anchor_rows" and "pairs" in cond_text:
        return PAIRS / 32  # the query rotation: one thread a pair
    return 8.0


def find_tool(name):
    cands = [os.environ.get("ANCHORKV_CUDA_BINUTILS", ""), "/usr/local/cuda/bin"]
    try:
        import nvidia  # PyPI nvidia-cuda-* wheels
        cands += [os.path.join(p, "cu13", "bin") for p in nvidia.__path__]
        cands += [os.path.join(p, "cuda_nvdisasm", "bin") for p in nvidia.__path__]
        cands += [os.path.join(p, "cuda_cuobjdump", "bin") for p in nvidia.__path__]
    except ImportError:
        pass
    for c in cands:
        if c and os.path.isfile(os.path.join(c, name)):
            return os.path.join(c, name)
    return shutil.which(name)


def function_spans(path):
    """(name, first line, last line) of each function body in the file (1-based)."""
    text = open(path).read()
    lines = text.split("\n")
    spans = []
    sig = re.compile(r"(?:__device__|__global__)(?:[^;{]*?__launch_bounds__\([^)]*\))?[^;{(]*?\b(\w+)\s*\(")
    for i, ln in enumerate(lines):
        m = sig.search(ln)
        if not m or ln.strip().startswith("//"):
            continue
        # the body: from the first '{' after the signature to its match
        depth, started, j = 0, False, i
        while j < len(lines):
            for ch in lines[j][(m.end() if j == i else 0):]:
                if ch == "{":
                    depth += 1
                    started = True
                elif ch == "}":
                    depth -= 1
            if started and depth == 0:
                break
            if not started and lines[j].rstrip().endswith(";"):
                break
            j += 1
        if started:
            spans.append((m.group(1), i + 1, j + 1))
    return spans, lines


def owner(spans, line):
    best = None
    for name, a, b in spans:
        if a <= line <= b and (best is None or b - a < best[2] - best[1]):
            best = (name, a, b)
    return best


def nvcc_cubin(workdir, nvcc, name, source, flags=()):
    """Compiles `source` (text) for sm_90 with ptxas -v: the cubin's path and ptxas's log."""
    src, cubin = os.path.join(workdir, name + ".cu"), os.path.join(workdir, name + ".cubin")
    with open(src, "w") as f:
        f.write(source)
    r = subprocess.run([nvcc, "-cubin", "-arch=sm_90", "-std=c++17", "-O3", "-DNDEBUG", "-Xptxas", "-v", *flags,
                        "-I", os.path.join(ROOT, "src"), "-I", os.path.join(ROOT, "include"), src, "-o", cubin],
                       capture_output=True, text=True)
    if r.returncode:
        sys.exit(r.stderr)
    return cubin, r.stderr


LOCAL_CHUNKS = (32, 16)  # local_nearest_kernel's candidate chunks (local_chunk picks one per absorb)


def compile_cubin(workdir, nvcc, segment_weights=False, gptj=False, scores=False):
    source = ('#include "cuda/decode_kernels.cuh"\n#include "cuda/compress_local_kernels.cuh"\n'
              '#include "cuda/coverage_select_kernels.cuh"\n#include "cuda/utility_kernels.cuh"\n'
              '#include "cuda/window_outputs_kernels.cuh"\n'
              'template __global__ void akv::cuda::coverage_energy_kernel<0>(const float *, const float *, '
              'const float *, const float *, int64_t, float *);\n'
              'template __global__ void akv::cuda::coverage_chunk_kernel<1>(const float *, const float *, '
              'const float *, const float *, int64_t, const float *, int64_t, int64_t, const int32_t *, '
              'uint32_t *, uint32_t *);\n'
              'template __global__ void akv::cuda::coverage_merge_kernel<false>(const uint32_t *, const uint32_t *, '
              'int64_t, int64_t, int64_t, int32_t *, uint32_t *, int64_t, uint32_t *, int64_t);\n')
    split = "decode_split_kernel<128, 4, true, true>" if gptj else "decode_split_kernel<128, 4, true>"
    for k in (split, "decode_anchor_values_kernel<128, 4>", "decode_merge_kernel<128, 4>"):
        source += f"template __global__ void akv::cuda::{k}(const __grid_constant__ akv::cuda::DecodeLaunch);\n"
    for ch in LOCAL_CHUNKS:
        source += (f"template __global__ void akv::cuda::local_nearest_kernel<128, {ch}>(const akv::cuda::LocalSide, "
                   "const akv::cuda::LocalSide, int64_t, const akv::cuda::LocalRange, const uint32_t *, int64_t, "
                   "int64_t, int64_t, int64_t, float *, uint32_t *);\n")
    for exact in ("true", "false"):
        source += (f"template __global__ void akv::cuda::utility_tc_kernel<128, {exact}>(const float *, int64_t, "
                   "int64_t, int, const uint32_t *, const float *, const float *, const float *, "
                   "const float *, const float *, const float *, const int32_t *, int, uint32_t *, uint32_t *, "
                   "uint32_t *, uint32_t *, uint32_t *, uint32_t *, uint32_t *, uint32_t *);\n")
        source += (f"template __global__ void akv::cuda::window_outputs_kernel<128, {exact}>(const float *, "
                   "const float *, int64_t, int, float *);\n")
    pins = (("-DAKV_SASS_PIN_BF16_FUSED",) + (("-DAKV_SASS_PIN_SEGMENT_WEIGHTS",) if segment_weights else ())
            + (("-DAKV_SASS_PIN_SCORES",) if scores else ()))
    return nvcc_cubin(workdir, nvcc, "k", source, ("-lineinfo",) + pins)


# (D, rows, fast, GPT-J): the register-gather path in its NeoX and GPT-J kernels, and the rest.
SHIPPED = [(d, r, f, g) for d in (64, 128, 256) for r in (4, 8, 16) for f, g in ((True, False), (False, False), (True, True))]


def compile_shipped(workdir, nvcc):
    """The library's own decode_split_kernel instantiations (no pinning: each with every path of
    its kind, the register-gather path's or the others, as the CUDA build compiles them): the
    cubin and ptxas's log."""
    source = '#include "cuda/decode_kernels.cuh"\n'
    for d, r, f, g in SHIPPED:
        source += (f"template __global__ void akv::cuda::decode_split_kernel<{d}, {r}, {str(f).lower()}, {str(g).lower()}>"
                   "(const __grid_constant__ akv::cuda::DecodeLaunch);\n")
    return nvcc_cubin(workdir, nvcc, "shipped", source)


def ptxas_info(log):
    info, cur = {}, None
    for ln in log.splitlines():
        m = re.search(r"Function properties for (\S+)", ln) or re.search(r"Compiling entry function '(\S+)'", ln)
        if m:
            cur = m.group(1)
            info.setdefault(cur, {})
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", ln)
        if m and cur:
            info[cur].update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        m = re.search(r"Used (\d+) registers", ln)
        if m and cur:
            info[cur]["registers"] = int(m.group(1))
            sm = re.search(r"(\d+) bytes smem", ln)
            info[cur]["smem"] = int(sm.group(1)) if sm else 0
    return info


def control(word):
    """The scheduling fields ptxas sets in an sm_70+ instruction's top 23 bits (bits 41-63 of its
    second 64-bit word, as nvdisasm -hex prints it): the stall count (cycles before the warp's next
    instruction may issue), the scoreboard a variable-latency result (wbar) or source read (rbar)
    releases (7: none), and the scoreboards it waits on (a mask of 6)."""
    c = word >> 41
    return {"stall": c & 15, "wbar": (c >> 5) & 7, "rbar": (c >> 8) & 7, "wait": (c >> 11) & 63}


def disassemble(nvdisasm, cubin):
    out = subprocess.run([nvdisasm, "-gi", "-hex", "-c", cubin], capture_output=True, text=True, check=True).stdout
    funcs = collections.OrderedDict()
    cur, loc, outer, chain, fresh = None, (None, None, None, None), (None, None), [], True
    ins_re = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
    for ln in out.splitlines():
        m = re.match(r"\s*\.text\.(\S+):", ln)
        if m:
            cur = m.group(1)
            funcs[cur] = {"ins": [], "labels": {}}
            fresh = True
            continue
        if cur is None:
            continue
        m = re.match(r'\s*//## File "([^"]+)", line (\d+)(?: inlined at "([^"]+)", line (\d+))?', ln)
        if m:
            # -gi lists the innermost location first, then the frames it was inlined into:
            # keep the first of a run (with the line it was inlined at), and the last (the
            # kernel's own line)
            if fresh:
                loc = (m.group(1), int(m.group(2)), m.group(3), int(m.group(4)) if m.group(4) else None)
                chain, fresh = [], False
            # every frame, innermost first (a load_ro: the intrinsic, device_common.cuh, then
            # the kernel line that calls it)
            chain += [(m.group(1), int(m.group(2)))] + ([(m.group(3), int(m.group(4)))] if m.group(3) else [])
            outer = (m.group(1), int(m.group(2)))
            continue
        m = re.match(r"(\.L_x_\d+):", ln.strip())
        if m:
            funcs[cur]["labels"][m.group(1)] = len(funcs[cur]["ins"])
            continue
        m = re.match(r"\s*/\* 0x([0-9a-f]{16}) \*/\s*$", ln)
        if m and funcs[cur]["ins"] and "stall" not in funcs[cur]["ins"][-1]:  # -hex: the second word
            funcs[cur]["ins"][-1].update(control(int(m.group(1), 16)))
            continue
        m = ins_re.search(ln)
        if m:
            text = m.group(2)
            op = re.sub(r"^@!?U?P\w+\s+", "", text).split()[0]
            tgt = re.search(r"`\((\.L_x_\d+)\)", text)
            funcs[cur]["ins"].append({"op": op, "text": text, "loc": loc, "outer": outer, "chain": tuple(chain),
                                      "target": tgt.group(1) if tgt else None})
            fresh = True
    return funcs


def demangle(names):
    r = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True)
    return r.stdout.splitlines() if r.returncode == 0 else names


def kernel_summary(f):
    ops = collections.Counter(i["op"].split(".")[0] for i in f["ins"])
    # Packed half2/bf16x2 arithmetic; not the compiler's idioms that use these opcodes for a
    # conversion (HADD2.F32 x, -RZ, y.H0_H0) or a move (HFMA2.MMA x, -RZ, RZ, ...).
    packed = sum(1 for i in f["ins"] if i["op"].split(".")[0] in ("HFMA2", "HADD2", "HMUL2", "HMNMX2")
                 and not i["op"].endswith(".F32") and "-RZ" not in i["text"])
    return {
        "instructions": len(f["ins"]),
        "hmma": sum(n for o, n in ops.items() if o in ("HMMA", "HGMMA", "IMMA")),
        "packed_half2": packed,
        "local_accesses": ops["LDL"] + ops["STL"],
        "barriers": ops["BAR"],
        "shared_atomics": ops["ATOMS"],
        "global_atomics": ops["RED"] + ops["ATOMG"] + ops["ATOM"],
    }


def loops(f):
    """The loops of a kernel (each backward branch to a label before it): (first, last
    instruction, static instructions, opcode counts), outermost first."""
    out = []
    for i, x in enumerate(f["ins"]):
        if x["op"].startswith("BRA") and x["target"] in f["labels"] and f["labels"][x["target"]] <= i:
            a = f["labels"][x["target"]]
            ops = collections.Counter(y["op"].split(".")[0] for y in f["ins"][a:i + 1])
            out.append((a, i, i + 1 - a, ops))
    return sorted(out, key=lambda l: (l[0], -l[1]))


def block_lines(opening):
    """First and last line (1-based) of the block of compress_local_kernels.cuh that opens with
    the line starting `opening` (its closing brace at the same indent, or `} else {`)."""
    lines = open(os.path.join(ROOT, "src", "cuda", "compress_local_kernels.cuh")).read().split("\n")
    first = next(i for i, ln in enumerate(lines) if ln.strip().startswith(opening))
    indent = lines[first][:len(lines[first]) - len(lines[first].lstrip())]
    last = next(i for i in range(first + 1, len(lines)) if lines[i] in (indent + "}", indent + "} else {"))
    return first + 1, last + 1


def profiling_lines():
    """local_nearest_kernel's `if (stats) {` block."""
    return block_lines("if (stats) {")


def hot_loops(f):
    """The index of a kernel's last EXIT and its loops before it: the out-of-line fallbacks of
    the warp collectives after that EXIT never run in converged code, and their branches back
    into the code before them would read as loops around everything."""
    end = max(i for i, x in enumerate(f["ins"]) if x["op"].startswith("EXIT"))
    return end, [l for l in loops(f) if l[1] <= end]


def local_search_cost(f, ch):
    """local_nearest_kernel<128, ch> (format 3's candidate search, 64 tokens x ch candidates a
    chunk, 4 warps): warp instructions per chunk and per tile, from the static SASS of its loops
    and the trip counts of the source. The loop holding the HMMAs is the chunk loop: its
    candidate rows (16-byte copies) and tile products are unrolled, its one inner loop is the
    offers (ch / 2 a thread, unrolled by the factor read off the comparisons against the 4th
    kept). Before it, the tile's token rows (unrolled) count once a tile, and the candidate
    range's two searches (warp 0, 32 probes a round) are reported apart (a round each). After the
    chunks, the tile's end (the token's decision, the parts' reduction, the writes; up to the
    last EXIT, without its loops and without the profiling block, which production skips)
    counts once a tile. A tile whose candidates fit one chunk (a coverage round's) runs the
    one-chunk path instead of the loop (its static SASS, found by the kernel lines it was
    inlined at). The warp's rescoring loop (the first one
    there with FFMAs: the whole warp rescoring one lane's candidate) once a candidate rescored,
    or with many candidates in a warp, the lanes' own (the loop with the most FFMAs: one lane's
    fp32 product) once a candidate of the busiest lane."""
    end, ls = hot_loops(f)
    chunk = next(l for l in ls if l[3]["HMMA"])
    inner = [l for l in ls if chunk[0] < l[0] and l[1] < chunk[1]]
    if any(l[3]["HMMA"] for l in inner):
        sys.exit("local_search_cost: the tile products are a loop of their own (the model counts them unrolled)")
    per_chunk = chunk[2] - sum(l[2] for l in inner)
    for a, b, n, ops in inner:
        if not ops["FSETP"]:
            sys.exit("local_search_cost: an inner loop of the chunk other than the offers")
        # the offers: ch / 2 a thread, unrolled by the comparisons against the 4th kept
        per_chunk += n * (ch // 2) / max(1, ops["FSETP"] // 3)
    before = [l for l in ls if l[1] < chunk[0]]
    # The candidate range's two searches (warp 0: one load a lane and a ballot a round, no
    # stores); the model gives them their rounds, about log32 of the sorted candidates.
    searches = [l for l in before if l[3]["LDG"] + l[3]["LD"] == 1 and l[3]["VOTE"] and not l[3]["STS"]]
    if len(searches) != 2:
        sys.exit("local_search_cost: expected the candidate range's two warp searches before the chunks")
    # The token rows (16-byte copies into shared memory) are unrolled; a loop of them would
    # need its trip count.
    if any(l[3]["STS"] for l in before):
        sys.exit("local_search_cost: the token rows are a loop (the model counts them unrolled)")
    after = [l for l in ls if l[0] > chunk[1]]
    outer = [l for l in after if not any(o[0] < l[0] and l[1] <= o[1] for o in after)]
    tail = end - chunk[1] - sum(l[2] for l in outer)
    # The profiling block (`if (stats)`: warp sums and atomics) is skipped in production.
    first, last = profiling_lines()
    in_block = lambda loc: any(fl and fl.endswith("compress_local_kernels.cuh") and ln and first <= ln <= last
                               for fl, ln in ((loc[0], loc[1]), (loc[2], loc[3])))
    inside = set(i for l in outer for i in range(l[0], l[1] + 1))
    profiling = sum(1 for i in range(chunk[1] + 1, end + 1)
                    if i not in inside and f["ins"][i]["loc"][0] and in_block(f["ins"][i]["loc"]))
    if not profiling:
        sys.exit("local_search_cost: no instruction of the profiling block found")
    tail -= profiling
    # The one-chunk path (`if (count > 0 && count <= CH) {`: a coverage round's tiles) runs
    # instead of the chunk loop: its instructions (by the kernel line they were inlined at,
    # outside every loop) come out of the tile's count.
    first, last = block_lines("if (count > 0 && count <= CH) {")
    in_loop = set(i for l in ls for i in range(l[0], l[1] + 1))
    in_path = lambda o: o[0] and o[0].endswith("compress_local_kernels.cuh") and first <= o[1] <= last
    one = [i for i in range(end + 1) if i not in in_loop and in_path(f["ins"][i]["outer"])]
    if not any(f["ins"][i]["op"].startswith("HMMA") for i in one):
        sys.exit("local_search_cost: no tile products found in the one-chunk path")
    tail -= sum(1 for i in one if i > chunk[1])
    per_tile = (chunk[0] - sum(l[2] for l in before)) + tail - sum(1 for i in one if i < chunk[0])
    rescore = next((l for l in after if l[3]["FFMA"]), None)
    serial = max(after, key=lambda l: l[3]["FFMA"], default=None)
    return {"chunk_loop_static": chunk[2], "warp_instr_per_chunk": per_chunk, "warp_instr_per_tile": per_tile,
            "one_chunk_static": len(one),
            "profiling_static": profiling,
            "search_loops_static": sum(l[2] for l in searches), "tile_end_static": tail,
            "rescore_loop_static": rescore[2] if rescore else 0,
            "serial_rescore_static": serial[2] if serial else 0,
            "loops": [(a, b, n) for a, b, n, _ in ls]}


def select_cost(f):
    """A kernel of coverage_select_kernels.cuh (a block of 1024 threads): its hot code (the
    instructions before its last EXIT; the out-of-line fallbacks of the warp collectives after it
    never run in converged code), taken once a warp as an upper bound of a pass (format 3's
    instantiations; warp 0's lines, the means, count for every warp); its histogram
    loops (one a digit: MATCH.ANY inside) and its emit loop (the global stores) for the extra
    trips of a merge over more than one chunk of keys."""
    end, hot = hot_loops(f)
    hist = [l[2] for l in hot if l[3]["MATCH"]]
    emit = [l[2] for l in hot if l[3]["STG"] and l[3]["BAR"]]
    return {"hot_static": end + 1, "hist_loops": hist, "emit_loop": max(emit) if emit else 0}


def utility_cost(f):
    """utility_tc_kernel<128, EXACT> (a block of 4 warps, one tile of tokens): its hot code (before
    the last EXIT) split into the staging loop (a warp's token rows into shared memory: a
    warp_sum, 5 SHFL, per token of a trip), the chunk loop (16 window rows against the tile: the
    innermost loop with HMMA) and the rest, taken once a warp."""
    end, hot = hot_loops(f)
    chunk = min((l for l in hot if l[3]["HMMA"]), key=lambda l: l[2])
    if chunk[3]["BAR"] or chunk[3]["SHFL"]:
        sys.exit("utility_cost: the chunk loop holds a barrier or a shuffle (the model takes it as the mma loop)")
    staging = [l for l in hot if l[1] < chunk[0] and l[3]["SHFL"] and l[3]["STS"] and not l[3]["HMMA"]]
    if len(staging) != 1 or staging[0][3]["SHFL"] % 5:
        sys.exit("utility_cost: expected one staging loop of whole warp sums before the chunk loop")
    st = staging[0]
    return {"chunk_static": chunk[2], "hmma_per_chunk": chunk[3]["HMMA"], "staging_static": st[2],
            "staging_tokens_per_trip": st[3]["SHFL"] // 5, "rest_static": end + 1 - chunk[2] - st[2]}


def window_cost(f):
    """window_outputs_kernel<128, EXACT> (8 warps, a chunk of tokens): its hot code split into the
    stage loop (64 tokens: the values' staging, then the mma slabs; the loop with HMMA and BAR),
    the staging loop inside it (2 float2 loads a pair of tokens and dims: LDG / 2 iterations a
    trip) and the rest, taken once a warp."""
    end, hot = hot_loops(f)
    stage = [l for l in hot if l[3]["HMMA"] and l[3]["BAR"]]
    if len(stage) != 1:
        sys.exit("window_cost: expected one stage loop (HMMA and barriers)")
    stage = stage[0]
    inner = [l for l in hot if stage[0] < l[0] and l[1] < stage[1]]
    if len(inner) != 1 or inner[0][3]["HMMA"] or inner[0][3]["LDG"] % 2:
        sys.exit("window_cost: expected one staging loop of float2 pairs inside the stage loop")
    return {"stage_static": stage[2], "hmma_per_stage": stage[3]["HMMA"], "staging_static": inner[0][2],
            "staging_per_trip": inner[0][3]["LDG"] // 2, "rest_static": end + 1 - stage[2]}


def exact_split_table(result, funcs, pinfo, key, kernel, cost, title, columns):
    """Prints and stores (result[key]["exact" / "split"]) a kernel<128, EXACT>'s cost for both
    variants: ptxas's registers, stack and spills, then `columns` (header, field[, field shown in
    parentheses]) of cost(f)."""
    result[key] = {}
    print(f"\n{title}")
    print("| kernel | regs | stack B | spill st/ld B | " + " | ".join(c[0] for c in columns) + " |")
    print("|---" * (4 + len(columns)) + "|")
    for exact in ("true", "false"):
        m = next(x for x in funcs if f"{kernel}ILi128ELb{1 if exact == 'true' else 0}E" in x)
        c = cost(funcs[m])
        pi = pinfo.get(m, {})
        c.update(registers=pi.get("registers"), stack=pi.get("stack"), spill_stores=pi.get("spill_stores"),
                 spill_loads=pi.get("spill_loads"))
        result[key]["exact" if exact == "true" else "split"] = c
        cells = [f"{c[col[1]]}" + (f" ({c[col[2]]})" if len(col) > 2 else "") for col in columns]
        print(f"| {kernel}<128, {exact}> | {c['registers']} | {c['stack']} | {c['spill_stores']}/{c['spill_loads']} | "
              + " | ".join(cells) + " |")


# The fewest shared-memory wavefronts (128 bytes each; a multiprocessor serves one a clock) of
# one warp instruction: 32 lanes of 4, 8 or 16 bytes. Bank conflicts add more; the fast path's
# hot reads are checked free of them (EmulatedDecode.FastPathTablesReadWithoutBankConflicts),
# the per-anchor weights' atomics (ATOMS.CAST, random anchors) are not.
def shared_wavefronts(op):
    if op.startswith("LDSM"):  # ldmatrix: one wavefront an 8 x 8 matrix (.x4: four)
        return 4 if op.endswith(".4") else 2 if op.endswith(".2") else 1
    if not op.startswith(("LDS", "STS", "ATOMS")):
        return 0
    return 4 if ".128" in op else 2 if ".64" in op else 1


# Latencies (cycles from issue to a dependent's issue) of the results that ptxas tracks on a
# scoreboard instead of a stall count, ASSUMED from published Hopper microbenchmarks (Luo et
# al., arXiv 2402.13499 and 2501.12084): shared memory ~30, an L2 hit ~270 (an L1 hit ~40: the
# optimistic case), the special-function and conversion units ~20; a store's or load's source
# registers are read ~12 cycles after issue.
LATENCY = {"shared": 30, "shuffle": 24, "global": 270, "global_l1": 40, "special": 20, "read": 12, "hbm": 900}
# "hbm": a load that misses L2. MEASURED, indirectly: on the first device run (H100, cold L2)
# the split kernel's dense tile took about 10 us, which then made about 20 dependent trips to
# memory a tile (a load a 16-byte key chunk, one a value token): ~0.5 us, ~900 cycles a trip.
# A decode reads each byte of a tile's metadata, codes and scales once, and a layer's cache is
# not in L2 when its decode starts: those loads ("streams") miss L2 unless the kernel
# prefetched them (CCTL.E.PF2, prefetch.global.L2, in the tile loop), which the headline case
# ("mixed") prices.
# The anchor rows a tile gathers: a segment's 1024 tokens (32K and 128K) use at most its 256
# table entries, so at least 3 of 4 row reads find the row in L1 (64 KB of rows a segment, which
# L1 holds beside the block's shared memory), ASSUMED. Plain LDG loads are the view's fields
# (ptxas emits LDG for the loads through the launch's view pointer, LD for the cache's data
# through the pointers read from it, LDG.CONSTANT for load_ro's): the same addresses every tile,
# L1 hits. The other global loads (metadata, codes, scales: each read once) come from L2.
GATHER_L1_SHARE = 0.75
GATHER_PHASE = "anchor gather + RoPE + query rotation"


def latency_class(op):
    o = op.split(".")[0]
    if o in ("LDS", "LDSM", "ATOMS"):
        return "shared"
    if o == "SHFL":
        return "shuffle"
    if o == "LDG" and ".CONSTANT" not in op:  # LDG.*.CONSTANT: load_ro's data loads
        return "view"
    if o in ("LD", "LDG", "ATOM", "ATOMG", "RED", "LDL", "QSPC"):
        return "global"
    return "special"  # MUFU, F2F, POPC, FRND, F2I, S2R, S2UR, B2R, ...


def warp_set(func, w, upper, last=False):
    """The warps (of NW) that run a line executed by w of them (warps()/WARP_BLOCKS): every one;
    the last warp's branch of anchor_meta and the value staging (last, stage_values) on 7, the key
    staging (stage_keys) on 6, the next tile's entries (stage_entries) on ENTRY_WARP and words
    (stage_tile_words) on the next; the key residuals' and the upper half's 4 - 7; the first
    angles' and the fast path's query rotation 2 - 3 (anchor_meta's T <= tid < T + pairs); else
    the first ones (the contraction, the softmax rows and the value groups on 0 - 3,
    format3_meta on 0 - 1)."""
    if w >= NW:
        return tuple(range(NW))
    if last or func == "stage_values":
        return (NW - 1,)
    if func == "stage_keys":
        return (NW - 2,)
    if func == "stage_entries":
        return (ENTRY_WARP,)
    if func == "stage_tile_words":
        return (ENTRY_WARP + 1,)
    if upper or func in ("key_residuals", "key_residuals_tc", "residual_logit_terms"):
        return tuple(range(NW // 2, NW))
    if func in ("anchor_meta", "rotate_query_pair"):
        return (2, 3)
    return tuple(range(max(1, round(w))))


def block_barrier(x):
    """Whether SASS instruction x is a barrier of the whole block (barrier 0: __syncthreads and
    its reductions), not a named barrier of some warps (bar.sync 1, 64)."""
    if not x["op"].startswith("BAR."):
        return False
    operands = x["text"][len(x["op"]):].strip()
    return operands.split(",")[0].strip() in ("0x0", "")


def warp_latency(ins, weighted, view_from_l2=False, streams=None):
    """The tile loop's cycles from the SASS's scheduling fields. Each warp's pass over the loop's
    instructions it runs (warp_set), in address order (each once; the cold ones, weight 0, left
    out), gives each instruction its cycles since the warp's previous issue: it issues when the
    previous one's stall count has passed and the scoreboards it waits on are released (a result
    LATENCY[class] after its issue, a source read LATENCY["read"]). weighted: (instruction,
    phase, warp instructions a tile, the warps that run it, the same as the walk counts them:
    the busiest warp's where the warps' trips differ). Three cases: every data load from L2
    ("l2"), from L1 ("l1"), and the gathered anchor rows from L1 at GATHER_L1_SHARE, the rest from
    L2 ("mixed"; streams: the other data loads' latency there, L2's by default); the view's
    fields (LDG) from L1 in each. Per case:
      - cycles: a warp's cycles a tile, averaged over the NW warps (by phase too); with n warps
        on a scheduler, at least max(n x issue, cycles) a tile, whatever the barriers do;
      - block_cycles: the tile with its barriers, one resident block: between two barriers each
        scheduler (warps s and s + 4) takes the longer of its two warps' issue together and
        either warp's own cycles, and the segment the slowest scheduler's (warps wait for the
        slowest at the barrier); summed over the segments.
    The warps are walked a barrier segment at a time, each starting a segment when the slowest
    reached its barrier, so that a load issued before a barrier and used after it has had the
    wait at the barrier to complete (the scored path's lookups, lookup_scores); the wait itself
    is no instruction's. (Walking each warp's whole tile on its own clock charged such a load's
    full latency after the barrier: 2168 cycles a tile for that path, 1986 now; the NeoX path
    has no such load, 1989 either way.)
    Bank conflicts, dispatch stalls and the barriers' own latency are not in it (upper bounds on
    the issue rate). view_from_l2: plain LDG loads from L2 as well (the merge kernels': the
    split kernel's workspace, in L2 when the next kernel starts; the set-up's view fields, in L2
    once its copy of the view has been read), whatever `streams` says."""
    out = {"unread": sum(1 for i, _, wt, _, _ in weighted if wt > 0 and "stall" not in ins[i])}
    l1, l2 = LATENCY["global_l1"], LATENCY["global"]
    # the barrier segment of each instruction (a block barrier, BAR 0, ends its segment; a named
    # one of a few warps, format3_meta's, does not)
    seg_of, n_seg = {}, 0
    for i, phase, wt, warps_of, _ in weighted:
        seg_of[i] = n_seg
        if wt > 0 and block_barrier(ins[i]):
            n_seg += 1
    n_seg += 1
    for name, glob, gather in (("l2", l2, l2), ("l1", l1, l1),
                               ("mixed", l2 if streams is None else streams, GATHER_L1_SHARE * l1 + (1 - GATHER_L1_SHARE) * l2)):
        seg_issue = [[0.0] * NW for _ in range(n_seg)]
        seg_path = [[0.0] * NW for _ in range(n_seg)]
        seg_phases = [collections.Counter() for _ in range(n_seg)]
        by_phase, mean_path = collections.Counter(), 0.0
        clock, readies, released = [0.0] * NW, [[0.0] * 6 for _ in range(NW)], 0.0
        for sg_run in range(n_seg):
            for wp in range(NW):
                t, ready = max(clock[wp], released), readies[wp]
                for i, phase, wt, warps_of, wt_path in weighted:
                    x = ins[i]
                    if wt <= 0 or "stall" not in x or wp not in warps_of or seg_of[i] != sg_run:
                        continue
                    start = t
                    for b in range(6):
                        if (x["wait"] >> b) & 1:
                            t = max(t, ready[b])
                    if x["wbar"] < 6:
                        c = latency_class(x["op"])
                        ready[x["wbar"]] = t + ((gather if phase == GATHER_PHASE else glob) if c == "global"
                                                else (l2 if view_from_l2 else l1) if c == "view" else LATENCY[c])
                    if x["rbar"] < 6:
                        ready[x["rbar"]] = t + LATENCY["read"]
                    t += max(1, x["stall"])
                    share = wt / len(warps_of)  # this warp's instructions a tile (the mean)
                    busy = wt_path / len(warps_of)  # the busiest warp's, for the barrier segments
                    sg = seg_of[i]
                    seg_issue[sg][wp] += share
                    seg_path[sg][wp] += busy * (t - start)
                    seg_phases[sg][phase] += busy * (t - start)
                    by_phase[phase] += share * (t - start) / NW
                    mean_path += share * (t - start) / NW
                clock[wp] = t
            released = max(clock)
        block, segments = 0.0, []
        for sg in range(n_seg):
            iss, path = seg_issue[sg], seg_path[sg]
            per = [max(iss[s] + iss[s + 4], path[s], path[s + 4]) for s in range(4)]
            slow = max(range(NW), key=lambda wp: path[wp])
            block += max(per)
            segments.append({"cycles": max(per), "slowest_warp": slow, "its_cycles": path[slow],
                             "phases": [p for p, _ in seg_phases[sg].most_common(3)]})
        out[name] = {"cycles": mean_path, "block_cycles": block, "by_phase": dict(by_phase),
                     "segments": segments}
    out["issue"] = sum(map(sum, seg_issue)) / NW  # the same in every case
    return out


def tile_loop(f, spans, lines, fk, fv, k, block_tiles, dispersion=COUNT_DISPERSION):
    """Per-phase warp instructions per tile of the AnchorKV prefix loop, in blocks of
    block_tiles tiles (the share that rescales)."""
    rescale = rescale_rate(block_tiles)
    ins = f["ins"]

    def where(i):  # (function, line in decode_kernels.cuh) of instruction i: its innermost frame there
        for fl, ln in ins[i]["chain"]:
            if fl and fl.endswith("decode_kernels.cuh") and ln:
                o = owner(spans, ln)
                if o and o[0] in CALLER_HELPERS:
                    continue  # counted where it is called: its callers run on different warps
                return (o[0] if o else None), ln, (o[1] if o else None)
        return None, None, None

    back = {}  # loop header -> last backward branch to it: (start, end) of each loop
    for i, x in enumerate(ins):
        if x["op"].startswith("BRA") and x["target"] in f["labels"] and f["labels"][x["target"]] <= i:
            back[f["labels"][x["target"]]] = i
    back = sorted(back.items())
    funcs_in = lambda a, b: {where(i)[0] for i in range(a, b + 1)}
    cands = [(a, b) for a, b in back
             if "prefix_values" in funcs_in(a, b) and funcs_in(a, b) & {"key_residuals", "key_residuals_tc"}]
    if not cands:
        raise SystemExit("sass_count: the tile loop was not found (key residuals and weights in one loop)")
    a0, b0 = min(cands, key=lambda ab: ab[1] - ab[0])
    inner = [(a, b) for a, b in back if a0 <= a and b <= b0 and (a, b) != (a0, b0)]
    phase_of = {}
    for name, members in PHASES:
        for m in members:
            phase_of[m] = name
    # prefix_values: the per-anchor weights end where the value residuals start (their count,
    # read before the weights' atomics, is the residuals')
    weights_end = None
    for name, a, b in spans:
        if name == "prefix_values":
            weights_end = next(n for n in range(a, b + 1) if "racc's dims: the thread's DPT consecutive dims" in lines[n - 1])
    # SASS unroll factor of each inner loop, read off the body: the fewest loads any one source
    # line of the body issues (a line loads once per source iteration).
    unrolls, unknown = {}, set()
    for a, b in inner:
        bf, bl, _ = where(b)
        if trips(lines[bl - 1] if bl else "", Counts(fk, fv, dispersion=dispersion), k, rescale)[1] is None:
            unknown.add((bf, bl, lines[bl - 1].strip() if bl else "?"))
        loads = collections.Counter(where(i)[1] for i in range(a, b + 1)
                                    if ins[i]["op"].startswith(("LDS", "LDG", "LD.")) and where(i)[1] != bl)
        # A loop marked AKV_NO_UNROLL is not unrolled, whatever its lines load (a line that
        # loads twice an iteration read as a loop unrolled twice: key_residuals_tc's passes
        # were counted at a third of their trips, 4.7 warp instructions instead of 6.8).
        unrolls[(a, b)] = 1 if bl and "AKV_NO_UNROLL" in lines[bl - 2] else min(loads.values()) if loads else 1
    # Rematerialised set-up values: ptxas, short of registers, rebuilds a value of the set-up (the
    # block's constructor, the kernel's lines before the tile loop) where it is used, with the
    # set-up's line. Such an instruction runs as often, and on the warps, as the basic block it
    # sits in, which the nearest instruction of the loop's own lines in that block tells (a
    # workspace pointer rebuilt in the rare rescale's branch read as 56 instructions a tile).
    tile_line = next(n for n, t in enumerate(lines, 1) if "for (int tile = first_tile;" in t)
    def is_remat(i):
        func, ln, _ = where(i)
        return func == "SplitBlock" or (func == "decode_split_kernel" and ln < tile_line)
    starts = set(f["labels"].values())
    block_id, blk = {}, 0
    for i in range(a0, b0 + 1):
        if i in starts or (i > a0 and ins[i - 1]["op"].startswith(("BRA", "EXIT", "RET", "BRX", "JMP"))):
            blk += 1
        block_id[i] = blk
    members = collections.defaultdict(list)
    for i in range(a0, b0 + 1):
        members[block_id[i]].append(i)
    donor = {}
    for i in range(a0, b0 + 1):
        own = [j for j in members[block_id[i]] if not is_remat(j) and where(j)[0] is not None] if is_remat(i) else []
        donor[i] = min(own, key=lambda j: (abs(j - i), j < i)) if own else i  # the nearest, the next first
    cold = cold_lines(lines, cold_blocks(rescale, block_tiles))
    warp_blocks = cold_lines(lines, WARP_BLOCKS)
    upper = cold_lines(lines, [("if (half == 1) {", 1.0)])  # lines of warps 4 - 7
    last = cold_lines(lines, [("} else if (warp == NW - 1 && !window) {", 1.0)])  # lines of warp 7

    def weigh(counts):
        """The tile loop's instructions weighted for a tile's residual counts (counts: their
        distribution, or one pair): "weighted", for warp_latency: (instruction, phase, warp
        instructions a tile, the warps that run it, the same for the walk: the busiest warp's
        trips where they differ, busiest_trips); the warp instructions a tile by phase
        ("per_tile") and line ("by_line"), the static count by phase and the shared-memory
        wavefronts a tile."""
        loop_trips, path_trips = {}, {}
        for (a, b), unroll in unrolls.items():
            bl = where(b)[1]
            n, _ = trips(lines[bl - 1] if bl else "", counts, k, rescale)
            loop_trips[(a, b)] = n / unroll
            busy = busiest_trips(lines[bl - 1] if bl else "", counts)
            path_trips[(a, b)] = (busy if busy is not None else n) / unroll
        guarded = guarded_lines(lines, guarded_spans(counts))
        guarded_busy = guarded_lines(lines, guarded_spans(counts, busiest=True))
        totals, static, by_line = collections.Counter(), collections.Counter(), collections.Counter()
        smem = 0.0  # shared-memory wavefronts a tile, conflict-free (shared_wavefronts)
        prev = (8.0, 1.0, 1.0, tuple(range(NW)))  # warps, cold weights (mean, busiest) and warp set of the last instruction with a line
        weighted, attrs = [], {}
        for i in range(a0, b0 + 1):
            func, ln, start = where(i)
            if func == "prefix_values":
                weights = ln < weights_end and "res_s[3]" not in lines[ln - 1]
                func = "prefix_values:weights" if weights else "prefix_values:residuals"
            phase = phase_of.get(func, "other (%s)" % func) if func else "library code (no line of decode_kernels.cuh)"
            mult, mult_path, looped = 1.0, 1.0, False
            for a, b in inner:
                if a <= i <= b:
                    mult *= loop_trips[(a, b)]
                    mult_path *= path_trips[(a, b)]
                    looped = True
            # the enclosing condition: the six lines up to this one, inside its function
            cond = "\n".join(lines[max(start - 1, ln - 6):ln]) if start and ln else ""
            w = warp_blocks.get(ln) or warps(func.split(":")[0] if func else "", cond)
            # Cold where the line is, or where any frame around it was inlined (put8 called in a
            # cold block; an atomicAdd of flush_segment, called in one).
            weight = min([cold.get(ln, 1.0)] + [cold.get(cl, 1.0) for cf, cl in ins[i]["chain"]
                                                if cf and cf.endswith("decode_kernels.cuh") and cl])
            weight_path = weight
            if not looped:  # a guarded set-up's own lines (a lambda it defines runs in the loop)
                weight *= guarded.get(ln, 1.0)
                weight_path *= guarded_busy.get(ln, 1.0)
            warps_of = warp_set(func.split(":")[0] if func else "", w, ln in upper, ln in last)
            if func is None:  # library code inlined without a line: the block it sits in
                w, weight, weight_path, warps_of = prev
            else:
                prev = (w, weight, weight_path, warps_of)
            attrs[i] = (func, ln, phase, mult, mult_path, w, weight, weight_path, warps_of)
        for i in range(a0, b0 + 1):
            func, ln, phase, mult, mult_path, w, weight, weight_path, warps_of = attrs[i]
            if donor[i] != i:  # a set-up value rebuilt in the loop: as often, on the warps, as its block runs
                w, weight, weight_path, warps_of = attrs[donor[i]][5:]
            totals[phase] += mult * w * weight
            smem += mult * w * weight * shared_wavefronts(ins[i]["op"])
            static[phase] += 1
            by_line[(phase, ln)] += mult * w * weight
            weighted.append((i, phase, mult * w * weight, warps_of, mult_path * w * weight_path))
        return {"static": dict(static), "per_tile": dict(totals), "smem": smem, "weighted": weighted,
                "by_line": [(ph, ln, lines[ln - 1].strip() if ln else "", v) for (ph, ln), v in by_line.most_common()]}

    out = weigh(Counts(fk, fv, dispersion=dispersion))
    # Whether the loop prefetches its streamed data into L2 (else each such load misses L2).
    prefetched = any(ins[i]["op"].startswith("CCTL") and ".PF2" in ins[i]["op"] for i, _, wt, _, _ in out["weighted"] if wt > 0)
    streams = LATENCY["global"] if prefetched else LATENCY["hbm"]
    # The walk with its barriers, tile by tile: each barrier waits for that tile's slowest warp,
    # and the mean over tiles of a segment's slowest is above the slowest at the mean counts
    # (a tile with twice the residuals takes a warp twice as long). So the tile's cycles with
    # its barriers are the expectation over the tiles' key and value residual counts
    # (count_walks), the walk at the mean counts kept beside it ("block_cycles_at_mean").
    latency = warp_latency(ins, out["weighted"], streams=streams)
    latency["streams_prefetched"] = prefetched
    expected = {c: {"block": 0.0, "segments": collections.Counter()} for c in ("l2", "l1", "mixed")}
    for prob, counts in count_walks(fk, fv, dispersion):
        lat = warp_latency(ins, weigh(counts)["weighted"], streams=streams)
        for c in expected:
            expected[c]["block"] += prob * lat[c]["block_cycles"]
            for n, sg in enumerate(lat[c]["segments"]):
                expected[c]["segments"][n] += prob * sg["cycles"]
    for c, e in expected.items():
        latency[c]["block_cycles_at_mean"] = latency[c]["block_cycles"]
        latency[c]["block_cycles"] = e["block"]
        for n, sg in enumerate(latency[c]["segments"]):
            sg["cycles_at_mean"], sg["cycles"] = sg["cycles"], e["segments"][n]
    return {"first": a0, "last": b0, "static": out["static"], "per_tile": out["per_tile"], "inner_loops": len(inner),
            "smem_wavefronts": out["smem"], "by_line": out["by_line"], "unknown_loops": sorted(unknown, key=str),
            "latency": latency}


MERGE_BATCH = 8  # kMergeBatch (decode_kernels.cuh)
MERGE_ROW_BATCH = 4  # kMergeRowBatch


# The merge kernels (decode_anchor_values_kernel, decode_merge_kernel <128, 4>): each loop's
# source trip count by its source line (D 128, 4 rows, 256 threads: both kernels' thread groups
# SG 8 of 4 dims a thread; CH 64 anchors a chunk), from the plan's splits, anchor parts and
# anchors a part: (trips, the source's step a trip).
def merge_trips(text, splits, parts, per_part, sg):
    table = (("for (int i = warp; i < rows; i += kDecodeThreads / 32)", 1, 8),  # split_factors: a warp a row
             ("for (int i = warp; i < rows; i += NT / 32)", 1, 8),  # the merge's rows: a warp a row
             ("for (int a0 = a_begin; a0 < a_end; a0 += CH)", math.ceil(per_part / 64), 64),
             # the weights: 4 threads a quad of anchors, kMergeBatch / 2 of a thread's splits a batch
             ("for (int s0 = j; s0 < p.splits; s0 += TPQ * B)", math.ceil(splits / (2 * MERGE_BATCH)), 2 * MERGE_BATCH),
             ("for (int a = a0 + group; a < a1; a += SG)", 64 / sg, sg),
             ("for (int e = tid; e < MAXROWS * D; e += NT)", ROWS * D / NT, NT),
             # the part's value rows asked into L2 (bf16: 2 bytes a dim, 128 a line) before the wait
             ("for (int at = 128 * tid; at < bytes; at += 128 * NT)", per_part * D * 2 / 128 / NT, NT),
             # the merge's row: kMergeRowBatch of a group's splits (anchor parts) a batch
             ("for (int s0 = group; s0 < parts; s0 += SG * B)", math.ceil(splits / (sg * MERGE_ROW_BATCH)),
              sg * MERGE_ROW_BATCH),
             ("for (int q0 = group; q0 < n; q0 += SG * B)", math.ceil(parts / (sg * MERGE_ROW_BATCH)),
              sg * MERGE_ROW_BATCH))
    for key, n, step in table:
        if key in text:
            return n, step
    return None, None


def decode_frames(ins, i):
    """The lines of instruction i's frames in decode_kernels.cuh, innermost first (the kernel's
    last)."""
    return [ln for fl, ln in ins[i]["chain"] if fl and fl.endswith("decode_kernels.cuh") and ln]


def decode_line_of(ins, i):
    """The line of instruction i's innermost frame in decode_kernels.cuh (None: no line there)."""
    fr = decode_frames(ins, i)
    return fr[0] if fr else None


def loop_trips(f, hot, lines, trips_of):
    """Each loop of hot (hot_loops) with its SASS trips: its source loop's trips (trips_of(the
    source line's text) -> (trips, the source's step a trip), or (None, None): unknown) divided
    by its unroll factor, read off its induction variable's increment (or, where none is found,
    off its loads against its unrolled siblings': nvcc splits a loop of unknown count into an
    unrolled body and remainder loops, each taking what the larger ones leave). Returns
    {(first, last): dict(n, u, trips, line)}."""
    ins = f["ins"]
    line_of = lambda i: decode_line_of(ins, i)
    info, groups = {}, collections.defaultdict(list)
    for a, b, n_static, ops in hot:
        ln = line_of(b)
        n, step = trips_of(lines[ln - 1] if ln else "")
        if n is None:
            sys.exit(f"sass_count: no trip count for the loop at line {ln}: {lines[ln - 1].strip() if ln else '?'}")
        m = re.match(r"@!?(U?P\d+)", ins[b]["text"])
        u = None
        at = next((i for i in range(b - 1, a - 1, -1)
                   if m and re.search(r"ISETP\S*\s+" + m.group(1) + r",", ins[i]["text"])), None)
        cmp_ = ins[at]["text"] if at is not None else None
        if cmp_:
            regs = re.findall(r"\bR\d+\b", cmp_.split(",", 2)[2])
            for r in regs:
                # the compared register's last definition before the compare, if an increment of
                # itself (a register loaded or computed afresh there is no induction variable)
                d = next((i for i in range(at - 1, a - 1, -1)
                          if re.match(r"(?:@\S+\s+)?\S+\s+" + r + r"\b", ins[i]["text"])), None)
                x = d is not None and re.match(
                    r"(?:@\S+\s+)?(?:IADD3|VIADD)\s+(R\d+),\s*(R\d+),\s*(-?0x[0-9a-f]+|-?\d+)(?:,\s*RZ)?\s*$",
                    ins[d]["text"])
                if x and x.group(2) == x.group(1):
                    inc = int(x.group(3), 0)
                    inc = inc - (1 << 32) if inc >= 1 << 31 else inc
                    # a count of trips left (down, or to zero), or the source's induction variable
                    down = inc < 0 or (".NE." in cmp_ and cmp_.rstrip().endswith("RZ, PT"))
                    u = abs(inc) if down or not step else max(1, abs(inc) // step)
                    break
        loads = collections.Counter(line_of(i) for i in range(a, b + 1) if ins[i]["op"].startswith(("LDG", "LDS", "LD.")))
        info[(a, b)] = dict(n=n, u=u, loads=loads, line=ln)
        groups[ln].append((a, b))
    for ln, members in groups.items():
        base = min(members, key=lambda ab: ab[1] - ab[0])
        for ab in members:
            if info[ab]["u"] is None:
                lb, lo = info[base]["loads"], info[ab]["loads"]
                common = [x for x in lb if x in lo and lb[x]]
                info[ab]["u"] = max(1, round(lo[common[0]] / lb[common[0]])) if common and ab != base else 1
        left = info[members[0]]["n"]
        for ab in sorted(members, key=lambda ab: -info[ab]["u"]):  # the unrolled body first, then the remainders
            # a lone loop: its trips over the copies in its body (fewer trips than copies: the
            # share of the body they run before the exit, as in the tile loop's walk)
            info[ab]["trips"] = math.floor(left / info[ab]["u"]) if len(members) > 1 else left / info[ab]["u"]
            left -= info[ab]["trips"] * info[ab]["u"]
    return info


def merge_cold_lines(lines, spans, few_splits, few_parts):
    """decode_merge_kernel's lines that do not run: the side of its `if (few_splits)` and `if
    (anchor && few_parts)` branches (at most a split, an anchor part, a thread group) that the
    counts leave out."""
    kern = next(x for x in spans if x[0] == "decode_merge_kernel")
    cold = set()
    for n in range(kern[1], kern[2] + 1):
        t = lines[n - 1].strip()
        for opening, few in (("if (few_splits) {", few_splits), ("if (anchor && few_parts) {", few_parts)):
            if t == opening:
                ind = lines[n - 1][:len(lines[n - 1]) - len(lines[n - 1].lstrip())]
                mid = next(j for j in range(n + 1, kern[2] + 1) if lines[j - 1].startswith(ind + "} else"))
                end = block_end(lines, mid)
                cold |= set(range(mid + 1, end)) if few else set(range(n + 1, mid))
        if t.startswith("if (anchor && few_parts) x[0] ="):  # one-line pair: this, then `else if`
            cold.add(n + 1 if few_parts else n)
    return cold


def merge_walk(f, spans, lines, splits, parts, per_part, sg):
    """A merge kernel's warp instructions and latency, one block (8 warps), from its SASS: each
    loop (a backward branch before the kernel's last EXIT) runs its source loop's trips
    (merge_trips) divided by its unroll factor (loop_trips); split_factors runs on warps 0-3 (a
    warp a row: row_factors), the merge's one row's factors and its output (row_factors and
    merge_row_out outside split_factors) on warp 0, the rest on every warp. The walk
    (warp_latency, every load from L2) gives the block's cycles with its barriers."""
    end, hot = hot_loops(f)
    ins = f["ins"]
    line_of = lambda i: decode_line_of(ins, i)
    cold = merge_cold_lines(lines, spans, splits <= sg, parts <= sg)
    hot = [h for h in hot if line_of(h[1]) not in cold]
    info = loop_trips(f, hot, lines, lambda text: merge_trips(text, splits, parts, per_part, sg))
    weighted, issue = [], 0.0
    for i in range(end + 1):
        if cold & set(decode_frames(ins, i)):  # the other side of a branch on the split count
            continue
        mult = 1.0
        for (a, b), x in info.items():
            if a <= i <= b:
                mult *= x["trips"]
        owners = [o[0] for o in (owner(spans, ln) for ln in decode_frames(ins, i)) if o]
        if "split_factors" in owners:
            warps_of = tuple(range(ROWS))
        elif "row_factors" in owners or "merge_row_out" in owners:
            warps_of = (0,)
        else:
            warps_of = tuple(range(NW))
        weighted.append((i, "merge", mult * len(warps_of), warps_of, mult * len(warps_of)))
        issue += mult * len(warps_of)
    lat = warp_latency(ins, weighted, view_from_l2=True)
    return {"issue": issue, "block_cycles": lat["mixed"]["block_cycles"], "block_cycles_l1": lat["l1"]["block_cycles"],
            "loops": [dict(first=a, last=b, line=line_of(b), unroll=x["u"], trips=x["trips"]) for (a, b), x in sorted(info.items())]}

# The split kernel's set-up before its first tile (prologue_walk): each loop's source trips a
# thread (D 128, 4 rows, 256 threads, 64 pairs) by its source line, and the warps that run a
# line inside a block (or a one-line statement) that opens with the key.
def prologue_trips(text, k):
    table = (("for (int e = tid; e < MAXROWS * D; e += NT)", ROWS * D / NT, NT),  # the queries
             ("e < MAXROWS * static_cast<int>(wstride) / 4; e += NT)", ROWS * k / 4 / NT, NT),  # the weights zeroed
             ("for (int e = tid; e < MAXROWS * kSegmentEntries; e += NT)", ROWS * 256 / NT, NT),
             ("for (int e = tid; e < kSegmentEntries; e += NT)", 256 / NT, NT),
             ("for (int i = warp; i < MAXROWS; i += NW)", 1, NW),
             ("for (int d = lane; d < D; d += 32)", D / 32, 32),
             ("for (int e = rows * QS + tid; e < MAXROWS * QS; e += NT)", 0, NT))  # every row a query's
    for key, n, step in table:
        if key in text:
            return n, step
    return None, None


PROLOGUE_WARPS = (("if (tid == 0 || (stage && stager))", (0, ENTRY_WARP, ENTRY_WARP + 1)),
                  ("if (tid == 0)", (0,)),
                  ("if (stage && stager)", (ENTRY_WARP, ENTRY_WARP + 1)),
                  ("if (warp == kEntryWarp)", (ENTRY_WARP,)),
                  ("if (warp == kWordsWarp)", (ENTRY_WARP + 1,)),
                  ("if (warp == kWordsWarp && lane == 0)", (ENTRY_WARP + 1,)),
                  ("if (angle_thread)", (T // 32, T // 32 + 1)),
                  ("if (pair_thread)", tuple(range(PAIRS // 32))),
                  ("if (k && tid < D)", tuple(range(D // 32))),
                  ("for (int i = warp; i < MAXROWS; i += NW)", tuple(range(ROWS))))


def openings(lines, n, first):
    """Line n (1-based) and the lines that open the blocks around it, up to line first: each
    earlier line indented less than the last one taken (a brace-less `if` or `for` the same)."""
    out, indent = [lines[n - 1]], len(lines[n - 1]) - len(lines[n - 1].lstrip())
    for j in range(n - 1, first - 1, -1):
        t = lines[j - 1]
        if not t.strip() or t.strip().startswith(("//", "#")):
            continue
        ind = len(t) - len(t.lstrip())
        if ind < indent:
            out.append(t)
            indent = ind
    return out


def prologue_walk(f, spans, lines, k, first):
    """decode_split_kernel<128, 4>'s set-up, from the kernel's entry to its first tile (the SASS
    before the tile loop, instruction first; the pinned path, so only code that runs; the
    dense-cache branch, the window and the suffix, whose kernel lines follow the tile loop's, left
    out): each loop its source trips (prologue_trips) over its unroll factor (loop_trips), each
    line on the warps its condition leaves (PROLOGUE_WARPS), and the walk (warp_latency, every
    load from memory, LATENCY["hbm"]: a block's first reads of the view, its tables, the queries
    and its first tile, all cold when the decode starts) gives a block's cycles to its first
    tile, with its barriers."""
    ins = f["ins"]
    kern = next(x for x in spans if x[0] == "decode_split_kernel")
    tile_line = next(n for n in range(kern[1], kern[2] + 1) if "for (int tile = first_tile;" in lines[n - 1])
    tile_end = block_end(lines, tile_line)
    frames = lambda i: decode_frames(ins, i)

    def after_loop(fr):  # the kernel's frame (the outermost) follows the tile loop
        return bool(fr) and kern[1] <= fr[-1] <= kern[2] and fr[-1] > tile_end

    _, hot = hot_loops(f)
    hot = [l for l in hot if l[1] < first and not after_loop(frames(l[1]))]
    info = loop_trips(f, hot, lines, lambda text: prologue_trips(text, k))

    weighted, issue, prev = [], 0.0, None
    for i in range(first):
        fr = frames(i)
        if not fr:  # library code inlined without a line: as the instruction before it
            if prev:
                weighted.append((i, "prologue") + prev)
                issue += prev[0]
            continue
        if after_loop(fr):
            prev = None
            continue  # the kernel's code after the tile loop (window, dense caches, suffix)
        warps_of = set(range(NW))
        for ln in fr:
            o = owner(spans, ln)
            for t in openings(lines, ln, o[1] if o else 1):
                for key, ws in PROLOGUE_WARPS:
                    if key in t:
                        warps_of &= set(ws)
        mult = 1.0
        for (a, b), x in info.items():
            if a <= i <= b:
                mult *= x["trips"]
        warps_of = tuple(sorted(warps_of))
        prev = (mult * len(warps_of), warps_of, mult * len(warps_of))
        weighted.append((i, "prologue") + prev)
        issue += prev[0]
    lat = warp_latency(ins, weighted, view_from_l2=True, streams=LATENCY["hbm"])
    return {"issue": issue, "block_cycles": lat["mixed"]["block_cycles"],
            "segments": [round(sg["cycles"]) for sg in lat["mixed"]["segments"]],
            "loops": [dict(first=a, last=b, line=x["line"], unroll=x["u"], trips=x["trips"])
                      for (a, b), x in sorted(info.items())]}


# The split kernel after its prefix tiles (tail_walk): the window's tiles (split 0), the
# suffix's start and the partial write, each loop's source trips a thread by its source line.
def tail_trips(text, k):
    table = (("for (int w0 = Block::window_tile(u0, tiles) * T;", 1, T),  # W 32: one window tile, in one block
             ("for (int e = tid; e < MAXROWS * D; e += NT)", ROWS * D / NT, NT),  # a part's sums
             ("for (int e = tid; e < k4; e += NT)", (k + 3) // 4 * 4 / NT, NT),  # the weights' copy, a row
             ("for (int e = tid; e < k; e += NT)", k / NT, NT),  # a rescale's, a row
             ("for (int i = 0; i < MAXROWS; ++i)", ROWS, 1),
             ("for (int i0 = 0; i0 < MAXROWS; i0 += NT / T)", ROWS * T / NT, NT // T),
             ("for (int part = 0; part < 2; ++part)", 2, 1),
             ("for (int e = tid; e < MAXROWS * kSegmentEntries; e += NT)", ROWS * 256 / NT, NT))  # a rescale's
    for key, n, step in table:
        if key in text:
            return n, step
    return None, None


def block_end(lines, n):
    """The line (1-based) that closes the block opened on line n (its indent and a brace)."""
    ind = lines[n - 1][:len(lines[n - 1]) - len(lines[n - 1].lstrip())]
    return next(j for j in range(n + 1, len(lines) + 1) if lines[j - 1] == ind + "}")


def tail_walk(f, spans, lines, k, loop_span, block_tiles, segment_weights):
    """decode_split_kernel<128, 4>'s code after its prefix tiles (the pinned build, outside the
    tile loop's instructions loop_span): the window's tiles ("window", the blocks that take one)
    and the suffix's start and the partial write ("partial", every block), the dense branch and
    the suffix's tiles left out (no suffix in the predicted rows). Each loop at its source trips
    (tail_trips) over its unroll (loop_trips), each line on the warps the tile loop's model gives
    its function (warps, warp_set) and, in write_partial, the rows' owners (warps 0-3) for their
    running sums, and weighted as in the tile loop where it runs only sometimes (cold_blocks: a
    rescale as often as a tile of a block of block_tiles; with segment_weights, the shared-memory
    weights' copy not at all); every load from L2. Returns each part's issue and cycles with its
    barriers."""
    ins = f["ins"]
    kern = next(x for x in spans if x[0] == "decode_split_kernel")
    at = lambda text: next(n for n in range(kern[1], kern[2] + 1) if text in lines[n - 1])
    w_first = at("for (int w0 = Block::window_tile(u0, tiles) * T;")
    parts = {"window": set(range(w_first, block_end(lines, w_first) + 1)),
             "partial": {at("blk.start_dense();  // the suffix's"), at("blk.write_partial(block_index);")}}
    frames = lambda i: decode_frames(ins, i)

    def part_of(i):
        fr = frames(i)
        if not fr or loop_span[0] <= i <= loop_span[1]:
            return None
        return next((name for name, ls in parts.items() if fr[-1] in ls), None)

    _, hot = hot_loops(f)
    hot = [l for l in hot if part_of(l[1]) and not (l[0] <= loop_span[0] and loop_span[1] <= l[1])]
    info = loop_trips(f, hot, lines, lambda text: tail_trips(text, k))
    upper = cold_lines(lines, [("if (half == 1) {", 1.0)])
    last = cold_lines(lines, [("} else if (warp == NW - 1 && !window) {", 1.0)])
    warp_blocks = cold_lines(lines, WARP_BLOCKS)
    owners = cold_lines(lines, [("if (const int i = warp + r * NW; i < MAXROWS) {", 1.0)])
    cold = cold_lines(lines, cold_blocks(rescale_rate(block_tiles), block_tiles)
                      + [("if (w == w_s) {", 0.0 if segment_weights else 1.0)])
    out = {}
    for name in parts:
        weighted, issue, prev = [], 0.0, None
        for i in range(len(ins)):
            part = part_of(i)
            if part is None and not frames(i) and prev is not None and i - 1 >= 0 and part_of(i - 1) == name:
                part = name  # library code inlined without a line: as the instruction before it
            if part != name:
                continue
            fr = frames(i)
            if fr:
                o = owner(spans, fr[0])
                func = o[0] if o else ""
                cond = "\n".join(lines[max(o[1] - 1, fr[0] - 6):fr[0]]) if o else ""
                w = warp_blocks.get(fr[0]) or warps(func, cond)
                warps_of = tuple(range(ROWS)) if fr[0] in owners else warp_set(func, w, fr[0] in upper, fr[0] in last)
                mult = min(cold.get(ln, 1.0) for ln in fr)
                for (a, b), x in info.items():
                    if a <= i <= b:
                        mult *= x["trips"]
                prev = (mult * len(warps_of), warps_of, mult * len(warps_of))
            weighted.append((i, name) + prev)
            issue += prev[0]
        lat = warp_latency(ins, weighted, view_from_l2=True)
        out[name] = {"issue": issue, "block_cycles": lat["mixed"]["block_cycles"],
                     "segments": [round(sg["cycles"]) for sg in lat["mixed"]["segments"]]}
    out["loops"] = [dict(first=a, last=b, line=x["line"], unroll=x["u"], trips=x["trips"]) for (a, b), x in sorted(info.items())]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fk", type=float, default=0.052, help="key residual fraction (32K default geometry: 0.052)")
    ap.add_argument("--fv", type=float, default=0.052, help="value residual fraction")
    ap.add_argument("--count-dispersion", type=float, default=COUNT_DISPERSION,
                    help="variance / mean of a tile's residual counts on each side (1: Poisson; measured on "
                         "SmolLM2: about 6)")
    ap.add_argument("--anchors", type=int, default=815, help="k per head (weight rescale cost; 32K default: 815)")
    ap.add_argument("--block-tiles", type=int, default=16,
                    help="tiles a split block walks (the share that rescales; 32K x 1: 16)")
    ap.add_argument("--segment-weights", action="store_true",
                    help="the per-anchor weights a segment table's entries at a time (the plan at 128K), not all k in "
                         "shared memory")
    ap.add_argument("--splits", type=int, default=33, help="split blocks a head (the merge kernels; 32K x 1: 33)")
    ap.add_argument("--anchor-parts", type=int, default=13,
                    help="anchor-value blocks a head (the merge kernels; 32K x 1: 13 of 64 anchors)")
    ap.add_argument("--anchors-per-part", type=int, default=64, help="anchors an anchor-value block sums")
    ap.add_argument("--gptj", action="store_true",
                    help="count the register-gather path's GPT-J kernel (decode_split_kernel<128, 4, true, true>) "
                         "instead of its NeoX one")
    ap.add_argument("--scores", action="store_true",
                    help="count the NeoX kernel's path for caches without RoPE (decode_scores_kernel's scores "
                         "looked up, lookup_scores, where the default caches' anchor rows are gathered and contracted)")
    ap.add_argument("--json", help="write the counts here")
    ap.add_argument("--by-line", type=int, default=0, metavar="N",
                    help="also print the tile loop's N costliest source lines (warp instructions per tile)")
    ap.add_argument("--keep", help="keep the cubin and the disassembly in this folder")
    a = ap.parse_args()
    nvcc = find_tool("nvcc")
    nvdisasm = find_tool("nvdisasm")
    if not nvcc or not nvdisasm:
        print(f"sass_count: skipped: needs nvcc ({nvcc or 'not found'}) and nvdisasm ({nvdisasm or 'not found'}; "
              "pip install nvidia-cuda-nvdisasm)")
        return 0
    workdir = a.keep or tempfile.mkdtemp()
    os.makedirs(workdir, exist_ok=True)
    if a.scores and a.gptj:
        ap.error("--scores counts the NeoX kernel (caches without RoPE take it), not --gptj's")
    cubin, log = compile_cubin(workdir, nvcc, a.segment_weights, a.gptj, a.scores)
    pinfo = ptxas_info(log)
    funcs = disassemble(nvdisasm, cubin)
    names = dict(zip(funcs, demangle(list(funcs))))
    spans, lines = function_spans(KERNELS)
    result = {"assumptions": {"fk": a.fk, "fv": a.fv, "anchors": a.anchors, "block_tiles": a.block_tiles,
                              "segment_weights": a.segment_weights, "count_dispersion": a.count_dispersion,
                              "rescale": rescale_rate(a.block_tiles), "tile": T, "threads": NT, "rows": ROWS,
                              "head_dim": D, "pairs": PAIRS}, "kernels": {}}
    print(f"SASS of {os.path.relpath(cubin, workdir) if a.keep else 'the decode and compression kernels'} for sm_90 "
          f"({os.path.basename(nvdisasm)} {nvdisasm})\n")
    print("| kernel | regs | stack B | spill st/ld B | SASS instr | LDL/STL | BAR | shared atomics | global atomics "
          "| HMMA | packed half2 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for mangled, f in funcs.items():
        s = kernel_summary(f)
        p = pinfo.get(mangled, {})
        s.update(p)
        result["kernels"][names[mangled]] = s
        short = re.sub(r"\(.*", "", names[mangled]).replace("akv::cuda::", "")
        print(f"| {short} | {p.get('registers', '?')} | {p.get('stack', '?')} | {p.get('spill_stores', '?')}/"
              f"{p.get('spill_loads', '?')} | {s['instructions']} | {s['local_accesses']} | {s['barriers']} | "
              f"{s['shared_atomics']} | {s['global_atomics']} | {'yes' if s['hmma'] else 'no'} | "
              f"{'yes' if s['packed_half2'] else 'no'} |")
    split = next(m for m in funcs if "decode_split_kernelILi128ELi4E" in m)
    loop = tile_loop(funcs[split], spans, lines, a.fk, a.fv, a.anchors, a.block_tiles, a.count_dispersion)
    result["tile_loop"] = loop
    total = sum(loop["per_tile"].values())
    print(f"\ndecode_split_kernel<128,4>, AnchorKV prefix tile loop ({T} tokens, {NW} warps, {ROWS} rows, "
          f"f_K {a.fk}, f_V {a.fv} (a tile's counts at variance / mean {a.count_dispersion:g}), k {a.anchors}, "
          f"{a.block_tiles} tiles a block, "
          f"{rescale_rate(a.block_tiles):.4f} of them rescaling): {sum(loop['static'].values())} static SASS "
          f"instructions, {loop['inner_loops']} inner loops")
    floor = tile_floor(a.fk, a.fv)
    print("| phase | static SASS | warp instr per tile | per token and head | floor (tile_floor) |")
    print("|---|---|---|---|---|")
    for name, v in sorted(loop["per_tile"].items(), key=lambda x: -x[1]):
        fl = f"{floor[name]:.2f}" if name in floor else ""
        print(f"| {name} | {loop['static'][name]} | {v:.0f} | {v / T:.1f} | {fl} |")
    print(f"| total | {sum(loop['static'].values())} | {total:.0f} | {total / T:.1f} | {sum(floor.values()):.2f} |")
    print("floor: the arithmetic any kernel decoding format 3 this way must issue at these residual fractions, "
          "every lane busy, no addressing, staging, loop control or barriers (tile_floor's comments)")
    pro = prologue_walk(funcs[split], spans, lines, a.anchors, loop["first"])
    result["prologue"] = pro
    print(f"\nThe split kernel's set-up to its first tile (prologue_walk; k {a.anchors}, weights "
          f"{'by segment in the workspace' if a.segment_weights else 'in shared memory'}): {pro['issue']:.0f} warp "
          f"instructions a block, {pro['block_cycles']:.0f} cycles with its barriers (every load from memory; barrier "
          f"segments {' + '.join(map(str, pro['segments']))}); loops: "
          + ", ".join(f"{l['line']} {l['unroll']}x{l['trips']:g}" for l in pro["loops"] if l["trips"]))
    tail = tail_walk(funcs[split], spans, lines, a.anchors, (loop["first"], loop["last"]), a.block_tiles,
                     a.segment_weights)
    result["tail"] = tail
    print(f"After the prefix tiles (tail_walk): the window's tile (the blocks that take it) {tail['window']['issue']:.0f} warp "
          f"instructions, {tail['window']['block_cycles']:.0f} cycles; the partial write (every block) "
          f"{tail['partial']['issue']:.0f}, {tail['partial']['block_cycles']:.0f} cycles (every load from L2); loops: "
          + ", ".join(f"{l['line']} {l['unroll']}x{l['trips']:g}" for l in tail["loops"] if l["trips"]))
    # The merge kernels at the plan's splits and anchor parts (predict_decode.py passes its own).
    result["merge"] = {}
    print(f"\nThe merge kernels <128, 4> ({a.splits} splits, {a.anchor_parts} anchor parts of {a.anchors_per_part}; "
          "a block of 8 warps): warp instructions a block and its cycles with its barriers (merge_walk)")
    print("| kernel | regs | warp instr a block | cycles a block (L1) | loops: line unroll x trips |")
    print("|---|---|---|---|---|")
    for name, sg in (("decode_anchor_values_kernel", NT * 4 // D), ("decode_merge_kernel", NT * 4 // D)):  # 4 dims a thread
        m = next(x for x in funcs if f"{name}ILi128ELi4E" in x)
        c = merge_walk(funcs[m], spans, lines, a.splits, a.anchor_parts, a.anchors_per_part, sg)
        c["registers"] = pinfo.get(m, {}).get("registers")
        c["smem"] = pinfo.get(m, {}).get("smem")
        result["merge"][name] = c
        print(f"| {name} | {c['registers']} | {c['issue']:.0f} | {c['block_cycles']:.0f} ({c['block_cycles_l1']:.0f}) | "
              + ", ".join(f"{l['line']} {l['unroll']}x{l['trips']:g}" for l in c["loops"]) + " |")
    wf = loop["smem_wavefronts"]
    print(f"shared memory: at least {wf:.0f} wavefronts a tile ({wf / T:.1f} per token and head; bank conflicts "
          f"add to it), which predict_decode.py prices beside the issue time")
    lat = loop["latency"]
    if lat["unread"]:
        print(f"note: {lat['unread']} of the tile loop's instructions had no scheduling fields (nvdisasm -hex's "
              "second word): the latency bound leaves them out")
    iw = lat["issue"]
    cyc = {c: lat[c]["cycles"] for c in ("mixed", "l2", "l1")}
    print(f"latency (warp_latency): the streamed data (metadata, codes, scales) "
          + ("prefetched into L2 (the loop's CCTL.E.PF2)" if lat["streams_prefetched"] else
             f"from memory (no prefetch in the loop: {LATENCY['hbm']} cycles a load)")
          + f"; a warp issues {iw:.0f} instructions a tile in {cyc['mixed']:.0f} cycles when it "
          f"runs alone ({cyc['l2']:.0f} with every global load from L2, {cyc['l1']:.0f} from L1): with 2 and 4 warps "
          "a scheduler (1 and 2 resident blocks) it issues at most "
          + " and ".join("/".join(f"{min(1.0, n * iw / cyc[c]):.2f}" for c in cyc) for n in (2, 4))
          + " instructions a cycle (mixed/L2/L1)")
    blk = {c: lat[c]["block_cycles"] for c in cyc}
    print(f"with its barriers (one resident block, warps waiting for the slowest; the mean over the tiles' residual "
          f"counts): {blk['mixed']:.0f} cycles a tile ({blk['l2']:.0f} / {blk['l1']:.0f}), "
          f"{iw * NW / (4 * blk['mixed']):.2f} instructions a scheduler a cycle "
          f"({iw * NW / (4 * blk['l2']):.2f} / {iw * NW / (4 * blk['l1']):.2f}); a tile at the mean counts "
          f"{lat['mixed']['block_cycles_at_mean']:.0f} ({lat['l2']['block_cycles_at_mean']:.0f} / "
          f"{lat['l1']['block_cycles_at_mean']:.0f})")
    print("| barrier segment | cycles (mixed) | at the mean counts | its slowest warp there | its phases |")
    print("|---|---|---|---|---|")
    for n, sg in enumerate(lat["mixed"]["segments"]):
        print(f"| {n} | {sg['cycles']:.0f} | {sg['cycles_at_mean']:.0f} | {sg['slowest_warp']} | "
              f"{', '.join(sg['phases'])} |")
    print("| phase | cycles a warp (mixed) | (L2) | (L1) |")
    print("|---|---|---|---|")
    for name, v in sorted(lat["mixed"]["by_phase"].items(), key=lambda x: -x[1]):
        print(f"| {name} | {v:.0f} | {lat['l2']['by_phase'].get(name, 0):.0f} | "
              f"{lat['l1']['by_phase'].get(name, 0):.0f} |")
    print(f"| total | {cyc['mixed']:.0f} | {cyc['l2']:.0f} | {cyc['l1']:.0f} |")
    if a.by_line:
        print(f"\nThe tile loop's {a.by_line} costliest lines of decode_kernels.cuh (warp instructions per tile)")
        print("| phase | line | source | per tile |")
        print("|---|---|---|---|")
        for ph, ln, src, v in loop["by_line"][:a.by_line]:
            print(f"| {ph} | {ln} | `{src[:70]}` | {v:.1f} |")
    for u in loop["unknown_loops"]:
        print(f"note: inner loop at {u[0]} line {u[1]} ({u[2]}) has no trip-count model: counted once")
    result["tile_loop"]["per_token_head"] = total / T
    result["tile_loop"]["floor_per_token_head"] = floor
    result["local_search"] = {}
    for ch in LOCAL_CHUNKS:
        local = next(m for m in funcs if f"local_nearest_kernelILi128ELi{ch}E" in m)
        cost = local_search_cost(funcs[local], ch)
        result["local_search"][str(ch)] = cost
        print(f"\nlocal_nearest_kernel<128, {ch}> (format 3's candidate search; per warp, 4 warps a block of 64 "
              f"tokens): chunk loop {cost['chunk_loop_static']} static SASS, {cost['warp_instr_per_chunk']:.0f} warp "
              f"instructions per {ch}-candidate chunk, or {cost['one_chunk_static']} for the one-chunk path; "
              f"{cost['warp_instr_per_tile']:.0f} per tile outside the chunks "
              f"(token rows, {cost['tile_end_static']} at the end, without the profiling block's "
              f"{cost['profiling_static']}); the candidate range's two searches "
              f"{cost['search_loops_static']} a round (warp 0); fp32 rescoring {cost['rescore_loop_static']} a "
              f"candidate (the warp), {cost['serial_rescore_static']} a candidate (each lane its own)")
    exact_split_table(result, funcs, pinfo, "utility", "utility_tc_kernel", utility_cost,
                      "The utilities (utility_kernels.cuh; a block of 4 warps, 32 tokens, 16-row chunks of the "
                      "window rows)",
                      [("chunk loop (a warp)", "chunk_static"), ("HMMA a chunk", "hmma_per_chunk"),
                       ("staging a trip (tokens)", "staging_static", "staging_tokens_per_trip"),
                       ("rest", "rest_static")])
    exact_split_table(result, funcs, pinfo, "window", "window_outputs_kernel", window_cost,
                      "The window outputs y = A V (window_outputs_kernels.cuh; 8 warps, 2048 tokens a block, "
                      "stages of 64)",
                      [("stage loop (a warp)", "stage_static"), ("HMMA a stage", "hmma_per_stage"),
                       ("staging loop a trip (iterations)", "staging_static", "staging_per_trip"),
                       ("rest", "rest_static")])
    result["coverage_select"] = {}
    print("\nA coverage round's ranking (coverage_select_kernels.cuh; a block of 1024 threads)")
    print("| kernel | regs | stack B | hot SASS (a warp, one pass) | histogram loops | emit loop |")
    print("|---|---|---|---|---|---|")
    for name in ("coverage_energy_kernel", "coverage_chunk_kernel", "coverage_merge_kernel"):
        m = next(x for x in funcs if name in x)
        c = select_cost(funcs[m])
        c.update(registers=pinfo.get(m, {}).get("registers"), stack=pinfo.get(m, {}).get("stack"))
        result["coverage_select"][name] = c
        print(f"| {name} | {c['registers']} | {c['stack']} | {c['hot_static']} | {c['hist_loops']} | {c['emit_loop']} |")
    # The shipped instantiations: local memory where ptxas runs out of registers (up to 8
    # rows: 128 registers, two blocks per multiprocessor) on a path the pinned count leaves out.
    cubin2, log2 = compile_shipped(workdir, nvcc)
    info2, funcs2 = ptxas_info(log2), disassemble(nvdisasm, cubin2)
    print("\nShipped decode_split_kernel instantiations (each with every path of its kind, as the library builds "
          "them; fast: the register-gather path's, fast_decode_path, with NeoX or GPT-J pairs)")
    print("| D, rows, fast | regs | stack B | spill st/ld B | LDL/STL | LDL/STL in the prefix tile loop |")
    print("|---|---|---|---|---|---|")
    result["shipped"] = {}
    for d, r, fa, gj in SHIPPED:
        m = next(x for x in funcs2 if f"decode_split_kernelILi{d}ELi{r}ELb{int(fa)}ELb{int(gj)}E" in x)
        pi, local = info2.get(m, {}), kernel_summary(funcs2[m])["local_accesses"]
        # The AnchorKV prefix tile loop of every path: the innermost loop that holds both the
        # contraction (HMMA) and the per-anchor weights' shared-memory atomics (the window and
        # dense loops have no atomics, the CAS retry loop no HMMA).
        hot = min((l for l in loops(funcs2[m]) if l[3]["HMMA"] and l[3]["ATOMS"]), key=lambda l: l[2], default=None)
        in_loop = hot[3]["LDL"] + hot[3]["STL"] if hot else "?"
        result["shipped"][f"{d},{r},{int(fa)}" + (",gptj" if gj else "")] = dict(pi, local_accesses=local, local_in_tile_loop=in_loop)
        print(f"| {d}, {r}, {('yes, GPT-J' if gj else 'yes') if fa else 'no'} | {pi.get('registers', '?')} | {pi.get('stack', '?')} | {pi.get('spill_stores', '?')}/"
              f"{pi.get('spill_loads', '?')} | {local} | {in_loop} |")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(result, fh, indent=1)
    if not a.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
