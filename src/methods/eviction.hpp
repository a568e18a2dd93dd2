// Token budgets of the eviction baselines at matched bytes (docs/design.md §5). An eviction cache keeps
// exact tokens (post-RoPE keys and values in the storage dtype), 4*D bytes per token and
// head, so retain fraction theta buys B = floor(theta*S) tokens per head, the window
// included. Everything here depends only on the shape and the options.
#pragma once
#include <cstdint>
#include <functional>
#include <vector>
#include "anchorkv/anchorkv.h"
#include "core/context.hpp"

namespace akv {

struct EvictionBudget {
  int64_t seq_len = 0;        // S
  int64_t prefix = 0;         // P = S - W, the evictable positions
  int32_t heads = 0;          // H
  int32_t window = 0;         // W, always kept
  int32_t first_chunk = 0;    // AnDPro, StreamingLLM: tokens 0..first_chunk-1 always kept (0 otherwise)
  int64_t per_head = 0;       // B = floor(theta*S): tokens per head incl. the window
  int64_t head_tokens = 0;    // SnapKV, PyramidKV: tokens every head keeps (this layer)
  int64_t layer_tokens = 0;   // tokens kept by the layer, all heads (data-independent)
  uint64_t full_bytes = 0;    // M_full = 4*S*H*D
  uint64_t budget_bytes = 0;  // floor(theta * M_full)
  uint64_t footprint = 0;     // 4*D*layer_tokens
};

// How an eviction method scores the evictable tokens t < P (both backends; higher is kept).
enum class EvictionScore {
  kPooledWindow,  // SnapKV, PyramidKV, AdaKV: pooled mean window attention
  kAnDPro,        // AnDPro: chunk contributions
  kLastQuery,     // TOVA: mean over all the layer's query heads of the last window row's attention
  kKeyNorm,       // Knorm: minus the key's norm
  kRecency,       // StreamingLLM: recency_score (core/codebook.hpp), sinks = first_chunk
};
EvictionScore eviction_score(akv_method method);
// Whether the method reads the window queries (the others take queries = NULL).
inline bool eviction_reads_queries(akv_method method) {
  const EvictionScore s = eviction_score(method);
  return s != EvictionScore::kKeyNorm && s != EvictionScore::kRecency;
}

// Validates the options the eviction methods read and computes the budget; AKV_ERR_BUDGET
// (naming the smallest workable retain_fraction) when B cannot hold what is always kept.
EvictionBudget eviction_budget(const akv_compress_options &options, const akv_shape &shape);

// PyramidKV: evictable tokens per head of every layer (index 0..layer_count-1) for a base
// budget B-W, beta and P: linear from max = 2(B-W) - min to min = (B-W)/beta, max clamped to
// P (then min = 2(B-W) - max). Integer counts are differences of the floored running sum, so
// they add up to exactly layer_count*(B-W).
std::vector<int64_t> pyramid_schedule(int64_t base, int64_t prefix, int32_t beta, int32_t layer_count);

// AdaKV: per-head counts round(cnt_h*(1-alpha) + alpha*base) by largest remainder, so they
// sum to exactly H*base (cnt_h sum to H*base too).
std::vector<int64_t> adakv_counts(const std::vector<int64_t> &selected_per_head, int64_t base, double alpha);

// Counts above `prefix` (floating rounding; never in exact arithmetic) capped, the excess
// moved to the first heads with room.
void cap_counts(std::vector<int64_t> &counts, int64_t prefix);

// AnDPro's selection, given the chunks of every head best first (ids h * chunks + j; ids of
// protected chunks are skipped): whole chunks while the layer's H*(B-W-first_chunk) tokens
// last, the chunk that does not fit gives its best tokens (best(h, t0, t1, n): n token
// indices in [t0, t1), none of them absent), then every head's first chunk. present ([H][S],
// null = every token): tokens evicted before a compaction are never kept and cost nothing.
// Appends to kept[h] (any order). Both backends select through this; they differ only in
// how they rank the chunks and the tokens.
using BestTokens = std::function<std::vector<int32_t>(int head, int64_t t0, int64_t t1, int64_t n)>;
void andpro_fill(const std::vector<uint32_t> &order, const EvictionBudget &budget, int chunk, int64_t chunks,
                 const uint8_t *present, const BestTokens &best, std::vector<std::vector<int32_t>> &kept);

// The kept prompt tokens of each head (any order; the window is appended here) as the
// cache's ragged dense layout: counts, token indices, positions. Returns the first row of
// each head (H+1). AKV_ERR_INTERNAL when the total is not the budget's.
std::vector<int64_t> adopt_kept_tokens(std::vector<std::vector<int32_t>> &kept, const EvictionBudget &budget,
                                       const std::vector<int32_t> &positions, akv_cache &cache);

}  // namespace akv
