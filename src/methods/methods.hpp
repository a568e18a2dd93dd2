// The backend-free side of the compression methods: the request both backends execute, the
// cache a method starts from, and each method's plan (what it keeps, its budget, its layout),
// computed from the shape and the options alone. The executors are cpu/compress.hpp and
// cuda/backend.hpp.
#pragma once
#include <memory>
#include <vector>
#include "anchorkv/anchorkv.h"
#include "core/context.hpp"

namespace akv {

struct CompressRequest {
  akv_context *context;
  const akv_prefill *prefill;
  const akv_compress_options *options;  // complete (defaults filled)
  // Compaction (AnchorKV): per head and token [H][S], which tokens may become anchors, best
  // first: 3 the old cache's non-window anchors, 2 its window, 1 exact appended tokens, 0
  // tokens only known through their old representation. Null = every token alike (prefill).
  const int8_t *anchor_priority = nullptr;
  // With anchor_priority: [H][S], how much the old anchors (3 and 2) are leaned on (their
  // dependents); they keep their slots in this order (then by score) when slots are short.
  const float *anchor_weight = nullptr;
  // With anchor_priority, per side (keys, values): [H][S], the anchor token an old token was
  // assigned to (-1: none) and its bf16 coefficient. While that token stays an anchor the
  // assignment is kept as it was, so the old residual is re-encoded from its own decoded
  // codes (nearly the same codes) instead of drifting to another anchor at every compaction.
  const int32_t *sticky_anchor[2] = {nullptr, nullptr};
  const uint16_t *sticky_gamma[2] = {nullptr, nullptr};
  // Compaction (SnapKV, PyramidKV, AnDPro): [H][S], 0 for tokens evicted before; they are
  // left out of the window attention and never kept. Null = every token present.
  const uint8_t *present = nullptr;
};

// A new cache of the request's context with what every method shares: the meta fields
// (shape, storage dtype, rope, scale, seed...) and the resolved RoPE.
std::unique_ptr<akv_cache> new_cache(const CompressRequest &req);

// The prompt positions (host): the prefill's, or 0..S-1.
std::vector<int32_t> prompt_positions(const akv_prefill &prefill);

// AnchorKV, either backend: validates the options it reads and sets the cache's host-side
// parts (meta, geometry, layout, codec, footprint, window and next positions); no tensor is
// read. Returns the prompt positions. Throws AKV_ERR_UNSUPPORTED when the last `window`
// positions are not consecutive (the window is stored by its first position).
std::vector<int32_t> prepare_anchor_cache(const akv_prefill &prefill, const akv_compress_options &options,
                                          akv_cache &cache);

// Exact bytes a method's compressed cache holds (footprint), from shape and options only.
uint64_t compressed_footprint(const akv_compress_options &options, const akv_shape &shape);

}  // namespace akv
