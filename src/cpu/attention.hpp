// CPU decode attention and reconstruction over a cache (reference backend).
#pragma once
#include <cstdint>
#include "core/context.hpp"

namespace akv {

class ThreadPool;

// Attention of q_len queries for every KV head of `batch` caches of one shape, shared out over
// pool's threads. q: [batch][Hq][q_len][D] fp32 rows (each KV head's group of query heads
// consecutive), out: the same layout; lse (optional): [batch][Hq][q_len], each row's
// log(sum_t exp(scale * q.k_t)) over what it sees. Never materialises dense K/V for
// AnchorKV, whose heads are split into fixed chunks of the prefix (the result does not depend
// on the number of threads).
void decode_cpu(const akv_cache *const *caches, int32_t batch, const float *q, int32_t q_len, float *out,
                float *lse, ThreadPool &pool);

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
