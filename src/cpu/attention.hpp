// CPU decode attention and reconstruction over a cache (reference backend).
#pragma once
#include <cstdint>
#include "core/context.hpp"

namespace akv {

// Attention of q_len queries for KV head h of one cache. q: [G][q_len][D] fp32 rows of the
// group's query heads, out: same layout. Never materialises dense K/V for AnchorKV.
// lse (optional): [G][q_len], each row's log(sum_t exp(scale * q.k_t)) over what it sees.
void decode_head_cpu(const akv_cache &cache, int h, const float *q, int32_t q_len, float *out,
                     float *lse = nullptr);
// The same for heads [h_begin, h_end) (q and out: consecutive heads' [G][q_len][D] blocks).
// AnchorKV heads share one walk over the prefix, so RoPE angles are computed once per tile.
void decode_heads_cpu(const akv_cache &cache, int h_begin, int h_end, const float *q, int32_t q_len,
                      float *out, float *lse = nullptr);

// How the AnchorKV decode computes its prefix logits (AnchorHead in attention.cpp): a
// per-step coefficient table, or each key rebuilt from its anchor row. kAuto picks per call
// from the cache's shape; the others force one way for the whole process (tests compare them).
enum class PrefixLogits : int { kAuto = 0, kTable, kGather, kGatherAvx2 /* the gather path without AVX-512 */ };
void force_prefix_logits(PrefixLogits path);

// Dense K^ (post-RoPE when rotated) and V^ of head h: [T][D] fp32 each, T = S + appended.
// present: [T] (may be null). values may be null for an AnchorKV cache (keys only).
void reconstruct_head_cpu(const akv_cache &cache, int h, bool rotated, float *keys, float *values,
                          uint8_t *present);

}  // namespace akv
