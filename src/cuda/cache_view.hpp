// The launch-facing types of the CUDA kernels: what a kernel knows about a cache (CacheView),
// the parameters of a decode or append launch, and the shared-memory carve-up. Plain C++ so
// that host code (launch planning, view building, the SIMT emulation tests) shares them
// with the kernels.
#pragma once
#include <cstddef>
#include <cstdint>
#include "core/host_device.hpp"

namespace akv {
namespace cuda {

constexpr int kThreads = 128;         // merge-independent small kernels (append)
constexpr int kDecodeThreads = 256;   // the split, anchor-values and merge kernels of a decode
constexpr int kDecodeTile = 64;       // tokens per tile: one residual mask word
// The split kernel's softmax slack (DecodeLaunch::rescale_slack; SplitBlock::softmax_tile).
constexpr float kRescaleSlack = 32.0f;
constexpr int kMaxSplits = 64;        // splits of one (request, head, row chunk)
// Anchors per block of decode_anchor_values_kernel: a multiple of 64 (its chunk) up to 256,
// the plan's choice (DecodePlan::anchors_per_part).
constexpr int kMergeAnchorChunk = 64, kMergeMaxAnchorsPerPart = 256;
constexpr int kMaxBatchPerLaunch = 128;
constexpr int kScoreAnchors = 64;  // anchors per block of decode_scores_kernel (4 threads an anchor)
constexpr int kSegmentEntries = 256;  // entries of a format-3 segment table (one-byte indices)

enum CacheKind : int32_t { kKindAnchor = 0, kKindDense = 1 };

// One cache as the kernels see it. Per-head arrays start at the head's offset inside each
// array (e.g. key_index + h * prefix). 16-byte aligned: the split kernel copies it into shared
// memory 16 bytes a thread (SplitSmem::view).
struct alignas(16) CacheView {
  int32_t kind = kKindDense;
  int32_t storage_bf16 = 1;  // storage dtype of keys/values: 1 bf16, 0 fp16
  int32_t heads = 0;
  int32_t head_dim = 0;
  int32_t prefix = 0;   // AnchorKV: P = S - W
  int32_t anchors = 0;  // AnchorKV: k (window included)
  int32_t window = 0;   // AnchorKV: W
  int32_t words = 0;    // AnchorKV: ceil(P / 64)
  int64_t window_first_position = 0;
  float softmax_scale = 1.0f;
  int32_t rope_pairs = 0;      // 0: no rotation
  int32_t keys_post_rope = 0;  // append: keys arrive rotated
  int32_t suffix_capacity = 0;
  // Advanced on the device by append, so that a captured append replays correctly: the
  // appended length, the next implicit position, the positions of the appended tokens
  // ([suffix_capacity], in the view block) and the tokens dropped past the capacity (replays
  // beyond the reservation; CudaBackend::sync_appended reports them).
  int32_t suffix_len = 0;
  int32_t next_position = 0;
  int32_t dropped = 0;
  int32_t *suffix_positions = nullptr;
  const uint16_t *anchor_keys = nullptr, *anchor_values = nullptr;
  const uint16_t *key_index = nullptr, *key_gamma = nullptr, *value_index = nullptr, *value_gamma = nullptr;
  const int32_t *positions = nullptr;
  const uint64_t *key_mask = nullptr, *value_mask = nullptr;
  const uint32_t *key_prefix = nullptr, *value_prefix = nullptr, *key_offsets = nullptr, *value_offsets = nullptr;
  const uint8_t *key_codes = nullptr, *value_codes = nullptr, *value_chunk = nullptr;
  const float *key_scales = nullptr, *value_scales = nullptr;
  const uint16_t *dense_keys = nullptr, *dense_values = nullptr;
  const int64_t *dense_start = nullptr;  // [H+1] first row of each head
  uint16_t *suffix_keys = nullptr, *suffix_values = nullptr;  // [H][capacity][D]
  // NeoX pairs (j, j + pairs) with pairs % 4 == 0 and pairs / (D / 8) in {1, 2, 4} (or no
  // RoPE): the split kernel rotates anchor rows as it gathers them (decided on the host).
  int32_t rope_fused = 0;
  const float *rope_step = nullptr;  // [kDecodeTile][pairs] (cos, sin) of d * inv_freq[j], d < tile
  const float *inv_freq = nullptr;                            // [pairs]
  const int32_t *rope_first = nullptr, *rope_second = nullptr;  // [pairs]
  const float *signs = nullptr;                               // [D] Hadamard signs
  // Storage format 3 (docs/design.md §3.7), read as stored: per token and side a one-byte
  // entry of the segment's table (the anchor itself without tables) and a one-byte
  // coefficient code, per segment the table and the two code scales; positions are
  // first_position + t. Two per-tile arrays [H][words] come from the host with the view: the
  // tile's anchor tokens as a bit mask and the anchor index of the first of them (anchor
  // tokens are exact, their own anchors, in token order).
  int32_t format = 2;
  int32_t segment_shift = 0;
  int32_t table_size = 0;  // entries per table; 0: no tables (k <= 256)
  int64_t segments = 0;
  int64_t first_position = 0;
  const uint8_t *key_entry = nullptr, *value_entry = nullptr, *key_code = nullptr, *value_code = nullptr;
  const uint16_t *segment_tables = nullptr;  // [H][segments][table_size]
  const float *gamma_scales = nullptr;       // [H][segments][2]: keys', values' code scale
  const float *gamma_units = nullptr;        // [256]: each code's coefficient for scale 1
  const uint64_t *anchor_mask = nullptr;     // [H][words]
  const int32_t *anchor_first = nullptr;     // [H][words]
  // Format 3 with logit_correction: [H][2] the logit penalty per |q|^2 of a reconstructed
  // prefix token without, then with, a key residual (CacheMeta::logit_penalty); null: none.
  const float *logit_penalty = nullptr;
  // Residual slots of all heads, keys' and values' (N_K, N_V): the bound of the split kernel's
  // L2 prefetches of the codes and scales.
  uint32_t key_slots = 0, value_slots = 0;
};

// A split block's pointers to its head's arrays, offset once and kept in shared memory: the
// view lives in global memory, whose fields the kernel would otherwise reload (and offset
// with 64-bit products) every tile.
struct HeadArrays {
  const uint16_t *anchor_keys;                          // [k][D]
  const uint64_t *anchor_mask, *key_mask, *value_mask;  // format 3: [words]
  const int32_t *anchor_first;                          // format 3: [words]
  const uint8_t *key_entry, *value_entry, *key_code, *value_code;  // format 3: [prefix]
  // The view's residual arrays and sizes the per-tile staging reads (shared-memory loads
  // side by side, where the view's fields are dependent loads through L1).
  const uint8_t *key_codes, *value_codes, *value_chunk;
  const float *key_scales, *value_scales;
  int32_t prefix, segment_shift;
  uint32_t key_slots, value_slots;  // CacheView's
  const float *scores;  // DecodeLaunch::scores' rows of this (request, head, row chunk), or null
};

struct DecodeLaunch {
  const CacheView *views[kMaxBatchPerLaunch];
  const void *queries;  // [requests][Hq][q_len][D], this launch's first request
  void *out;
  int32_t dtype;        // akv_dtype of queries and out
  int32_t heads, q_heads, q_len, rows, row_chunks, splits;
  int32_t max_anchors;
  // Per-anchor weights a split block's shared memory holds per row (SplitSmem's smem_anchors):
  // a cache with at most that many anchors sums them there and writes them to ws_w at the
  // end. One with more sums them in its block's own ws_w rows (global atomics), so that shared
  // memory does not grow with the anchor count: with segment tables (storage format 3) and
  // room for a table's 256 entries, a segment at a time in shared memory by table entry,
  // added to ws_w when the segment ends (kSegmentEntries); otherwise token by token.
  int32_t smem_anchors;
  // Per split block: dense part of the output, rotated residual sum, running max and sum, and
  // the per-anchor weights w_a = sum p_t gamma_t (reduced across splits, and sum_a w_a V_a
  // computed once per request, head and row, by decode_anchor_values_kernel).
  float *ws_o, *ws_r, *ws_ml, *ws_w;  // [blocks][MAXROWS][D], same, [blocks][MAXROWS][2], [blocks][MAXROWS][max_anchors]
  // sum_a w_a V_a per part of anchors_per_part anchors, summed by the merge:
  // [requests][heads * row_chunks][anchor_parts][MAXROWS][D].
  int32_t anchor_parts, anchors_per_part;
  float *ws_av;
  // Caches without RoPE on the register-gather path (docs/design.md §4.6): each anchor's logit
  // for each row, decode_scores_kernel's, which the split kernel looks up by token instead of
  // gathering the anchor's row: [requests][heads * row_chunks][max_anchors][MAXROWS]; null
  // where no cache of the decode is such.
  float *scores;
  float *lse;                  // optional [requests][Hq][q_len]: natural log-sum-exp per row
  // How far (base-2 logits) a tile's max may pass a row's reference max before the reference
  // is raised and what is accumulated rescaled: kRescaleSlack (decode_launch); the emulation
  // tests lower it to take the rescale path on every rise.
  float rescale_slack;
};

AKV_HD constexpr size_t align16(size_t x) { return (x + 15) / 16 * 16; }

// Shared-memory carve-up of decode_split_kernel; the host sizes the launch with the same code.
// Every offset but the total depends only on D and the row chunk (room for D / 2 rotary
// pairs; the per-anchor weights last), so that in the kernel they are constants.
struct SplitSmem {
  size_t view = 0, q = 0, qr = 0, logits = 0, logits_part = 0, red = 0, row_max = 0, inv = 0, first = 0, second = 0, basec = 0, bases = 0,
         carry_step = 0, carry_next = 0, carry_left = 0, head_arrays = 0, step = 0, signs = 0,
         meta_a = 0, meta_off = 0, meta_g = 0, meta_pos = 0, meta_bit = 0, meta_va = 0, meta_vg = 0, meta_kind = 0,
         penalty = 0, segment = 0, segment_table = 0, segment_gammas = 0, qb = 0, res_logits = 0, residuals = 0, tile_words = 0, entries = 0,
         value_codes = 0, value_positions = 0, value_levels = 0, key_codes = 0, key_scales = 0, keys = 0, w = 0,
         total = 0;
  AKV_HD static constexpr int key_stride(int D) { return D + 4; }  // floats per key row (16-byte rows, no bank conflicts)
  // The fast path's bf16 cos and sin of d * omega_j, d < T, every pair (SplitBlock::cs_s): rows
  // of D / 8 16-byte entries padded by 4, at the start of the key tile, followed by the value
  // residuals' probabilities (MAXROWS T floats).
  AKV_HD static constexpr int trig_stride(int D) { return D / 8 + 4; }
  AKV_HD static constexpr int fast_tables_bytes(int D) { return 16 * kDecodeTile * trig_stride(D); }
  // The fast path's bf16 rotated queries (SplitBlock::qb_s): rows of D padded by 16 (32 bytes),
  // so that the four rows a warp's mma B fragments read at once start 8 banks apart (unpadded
  // they share the banks: a 4-way conflict on every load).
  AKV_HD static constexpr int qb_stride(int D) { return D + 16; }
  // smem_anchors: per-anchor weights per row in shared memory (DecodeLaunch::smem_anchors).
  AKV_HD constexpr SplitSmem(int D, int maxrows, int smem_anchors) {
    const int T = kDecodeTile, max_pairs = D / 2;
    size_t o = 0;
    view = o; o = align16(o + sizeof(CacheView));  // the cache's view, copied once a block
    q = o; o = align16(o + sizeof(float) * maxrows * D);
    qr = o; o = align16(o + sizeof(float) * maxrows * D);  // queries rotated by minus the tile's first position
    logits = o; o = align16(o + sizeof(float) * maxrows * T);
    logits_part = o; o = align16(o + sizeof(float) * maxrows * T);  // the second half of the dims' logits
    red = o; o = align16(o + sizeof(float) * (kDecodeThreads / 32) * maxrows);
    row_max = o; o = align16(o + sizeof(float) * maxrows);  // each row's reference max (SplitBlock::mref_s)
    inv = o; o = align16(o + sizeof(float) * max_pairs);
    first = o; o = align16(o + sizeof(int32_t) * max_pairs);
    second = o; o = align16(o + sizeof(int32_t) * max_pairs);
    basec = o; o = align16(o + sizeof(float) * max_pairs);
    bases = o; o = align16(o + sizeof(float) * max_pairs);
    // Per pair, how its tile's first angle is carried to the next tile: e^{i T omega_j}
    // (float2), the next tile's first position if consecutive (int64), tiles left before the
    // next exact angle (int32).
    carry_step = o; o = align16(o + 2 * sizeof(float) * max_pairs);
    carry_next = o; o = align16(o + sizeof(int64_t) * max_pairs);
    carry_left = o; o = align16(o + sizeof(int32_t) * max_pairs);
    head_arrays = o; o = align16(o + sizeof(HeadArrays));  // the head's array pointers
    step = o; o = align16(o + 2 * sizeof(float) * T * max_pairs);  // (cos, sin) of d * omega_j, d < T
    signs = o; o = align16(o + sizeof(float) * D);  // Hadamard signs / sqrt(D)
    meta_a = o; o = align16(o + sizeof(int32_t) * T);
    meta_bit = o; o = align16(o + sizeof(int32_t) * T);  // token of the tile's n-th key residual
    meta_off = o; o = align16(o + sizeof(int32_t) * T);
    meta_g = o; o = align16(o + sizeof(float) * T);
    meta_pos = o; o = align16(o + sizeof(int64_t) * T);
    meta_va = o; o = align16(o + sizeof(int32_t) * T);  // value anchor and coefficient of each token
    meta_vg = o; o = align16(o + sizeof(float) * T);
    meta_kind = o; o = align16(o + sizeof(int32_t) * T);  // logit penalty of each token: 0, 1 or none (2)
    // Minus the logit penalty per row: without, with a key residual, and none (zeros).
    penalty = o; o = align16(o + sizeof(float) * 3 * maxrows);
    // Storage format 3: the segment whose tables follow and whether an even and an odd tile is
    // its last (three ints), its table (256 u16), its key and value coefficients by code and
    // the codes' units (256 f32 each: keys, values, units).
    segment = o; o = align16(o + 3 * sizeof(int32_t));
    segment_table = o; o = align16(o + sizeof(uint16_t) * 256);
    segment_gammas = o; o = align16(o + sizeof(float) * 3 * 256);
    // Register-gather path (SplitBlock::fast): the rotated queries in bf16, and each key
    // residual's logit term by row and token. Its bf16 cos and sin table takes the start of
    // the key tile, which that path leaves free (fast_tables_bytes).
    qb = o; o = align16(o + 2 * maxrows * qb_stride(D));
    res_logits = o; o = align16(o + sizeof(float) * maxrows * T);
    residuals = o; o = align16(o + sizeof(uint32_t) * 4);  // the tile's key and value residuals: first slot, count
    tile_words = o; o = align16(o + sizeof(uint64_t) * 2 * 4);  // format 3: two tiles' mask words and first anchor
    entries = o; o = align16(o + sizeof(uint32_t) * 2 * T);       // and two tiles' entries and codes, a word a token
    value_codes = o; o = align16(o + T * (D / 4));  // the tile's value residuals' codes, copied from the cache
    value_positions = o; o = align16(o + sizeof(int32_t) * T);  // and their positions in the tile
    value_levels = o; o = align16(o + sizeof(float) * 4 * T);   // and their four scaled levels
    key_codes = o; o = align16(o + T * (D / 4));                 // the fast path's: the tile's key residuals' codes
    key_scales = o; o = align16(o + sizeof(float) * T);          // and their scales
    keys = o; o = align16(o + sizeof(float) * T * key_stride(D));  // also write_partial's scratch
    w = o; o = align16(o + sizeof(float) * maxrows * smem_anchors);
    total = o;
  }
};

constexpr int kMaxAppendPerLaunch = 64;
struct AppendLaunch {
  CacheView *view;
  const void *keys, *values;  // [H][n_total][D], this launch's tokens start at token0
  int32_t dtype, n_total, token0, n;
  // 1: the tokens continue from the view's next_position (read on the device, so a replayed
  // graph advances); 0: at positions[].
  int32_t implicit;
  int32_t positions[kMaxAppendPerLaunch];
};

}  // namespace cuda
}  // namespace akv
