// The scoring steps that AnchorKV (cpu/compress_anchorkv.cpp) and the eviction baselines
// (cpu/compress_eviction.cpp) share on the CPU: the window attention of one KV head's
// observation rows, its mean over the rows, and pooling along the prompt.
#pragma once
#include <cstdint>
#include "anchorkv/anchorkv.h"

namespace akv {

class ThreadPool;

// A[m][S] = softmax(scale * Q Kpost^T) for the m = G*W window queries of one KV head (Q
// [m][D], row r = group member r / W, window query r % W; Kpost [S][D]): row r sees tokens
// t <= P + r % W (causal inside the window), the rest is 0. present (null: all): tokens with
// present[t] == 0 (evicted before a compaction) get no attention.
void window_attention(const float *Q, const float *Kpost, int64_t m, int64_t S, int D, int64_t P, int W, float scale,
                      const uint8_t *present, float *A, ThreadPool &pool);

// Per prompt token t < P: raw[t] = mean of A[r][t] over the m rows and, if alpha_sq is not
// null, alpha_sq[t] = mean of A[r][t]^2 (sums in double).
void mean_attention(const float *A, int64_t m, int64_t S, int64_t P, float *raw, float *alpha_sq, ThreadPool &pool);

// Pooling of raw[0..n) along the prompt with kernel/2 zero padding: the average divides by
// the full kernel (PyTorch avg_pool1d with count_include_pad, as KVPress calls it), the max
// ignores the padding.
void pool_scores(const float *raw, int64_t n, int kernel, akv_pool_type type, float *out);

// In place: scores[t] = max(scores[t - follow .. t]) (AnchorKV's follow_tokens).
void follow_scores(float *scores, int64_t n, int follow);

}  // namespace akv
