// The CPU executors of the compression methods (plans: methods/methods.hpp) and of compaction.
#pragma once
#include <memory>
#include <vector>
#include "methods/methods.hpp"

namespace akv {

class PrefillReader;
// Allocates the dense ragged storage of a cache (keys [total][D] post-RoPE, then values, in
// the storage dtype) and fills it: kept row i of head h is token tokens[i] (tokens == null:
// every token of each head in order). head_start: H+1 offsets of each head's first row.
void store_dense_tokens(const CompressRequest &req, const PrefillReader &in, const std::vector<int64_t> &head_start,
                        const int32_t *tokens, akv_cache &cache);

std::unique_ptr<akv_cache> compress_fullkv_cpu(const CompressRequest &req);
std::unique_ptr<akv_cache> compress_anchorkv_cpu(const CompressRequest &req);
// SnapKV, PyramidKV, AdaKV, AnDPro (cpu/compress_eviction.cpp).
std::unique_ptr<akv_cache> compress_eviction_cpu(const CompressRequest &req);
std::unique_ptr<akv_cache> compress_quantized_cpu(const CompressRequest &req);

// akv_cache_compact on the CPU (cpu/compact.cpp): a new cache of the same method that
// holds the whole of `cache` (T = S + appended tokens) in the compressed form with an empty
// suffix (AnchorKV; SnapKV, PyramidKV and AnDPro re-evict at the budget of T).
// queries: [Hq][W][D] fp32, post-RoPE, of the last W cached tokens. headroom: dense
// tokens to leave budget for (the compressed part gets theta*M_full(T) minus what `headroom`
// dense tokens cost beyond their theta share). `cache` is not modified.
std::unique_ptr<akv_cache> compact_cache_cpu(const akv_cache &cache, akv_context *context, const float *queries,
                                             int64_t headroom);

}  // namespace akv
