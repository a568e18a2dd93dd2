// CPU decode and reconstruction of the quantized (TurboQuant-style) cache.
#pragma once
#include <cstdint>
#include "core/context.hpp"

namespace akv {

// Same contract as decode_head_cpu. Keys are never dequantized: each query is rotated once
// (q.U^T y = (U q).y) and value codes accumulate in the rotated domain with one inverse
// Hadamard per query row.
void decode_quantized_head_cpu(const akv_cache &cache, int h, const float *q, int32_t q_len, float *out,
                               float *lse = nullptr);

// Prompt part of reconstruct_head_cpu for the quantized cache: [S][D] keys (post-RoPE when
// rotated) and values of head h.
void reconstruct_quantized_prompt_cpu(const akv_cache &cache, int h, bool rotated, float *keys, float *values);

}  // namespace akv
