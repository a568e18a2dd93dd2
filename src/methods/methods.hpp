// The backend-free side of the compression methods: the request both backends execute, the
// cache a method starts from, and each method's plan (what it keeps, its budget, its layout),
// computed from the shape and the options alone. The executors are cpu/compress.hpp and
// cuda/backend.hpp.
#pragma once
#include <memory>
#include <vector>
#include "anchorkv/anchorkv.h"
#include "core/backend.hpp"
#include "core/context.hpp"
#include "core/layout.hpp"
#include "core/quantizer.hpp"
#include "methods/eviction.hpp"

namespace akv {

// A method's plan for one compression: what it keeps, its budget and its layout, from the
// options and the shape alone. plan_method validates what the method reads (AKV_ERR_BUDGET
// names the smallest workable retain_fraction); akv_compress computes the plan once and
// hands it to the backend's executor in the CompressRequest.
struct MethodPlan {
  akv_method method = AKV_METHOD_FULLKV;
  uint64_t footprint = 0;   // exact bytes of the compressed cache (akv_compressed_size)
  AnchorGeometry anchor;    // AnchorKV
  EvictionBudget eviction;  // SnapKV, PyramidKV, AdaKV, AnDPro
  QuantGeometry quant;      // Quantized
};
MethodPlan plan_method(const akv_compress_options &options, const akv_shape &shape);

// A new cache of the request's context with what every method shares: the meta fields
// (shape, storage dtype, rope, scale, seed...) and the resolved RoPE.
std::unique_ptr<akv_cache> new_cache(const CompressRequest &req);

// The prompt positions (host): the prefill's, or 0..S-1.
std::vector<int32_t> prompt_positions(const akv_prefill &prefill);
// The first t whose position is not positions[0] + t, or -1 when they are consecutive (storage
// format 3 stores them implicitly).
int64_t first_position_gap(const std::vector<int32_t> &positions);

// AnchorKV, either backend: sets the cache's host-side parts from the plan's geometry (meta,
// geometry, layout, codec, footprint, window and next positions); no tensor is read. Returns the prompt positions. Throws AKV_ERR_UNSUPPORTED when the last `window`
// positions are not consecutive (the window is stored by its first position).
std::vector<int32_t> prepare_anchor_cache(const akv_prefill &prefill, const AnchorGeometry &geometry,
                                          const akv_compress_options &options,
                                          akv_cache &cache);

// Exact bytes a method's compressed cache holds (footprint), from shape and options only.
inline uint64_t compressed_footprint(const akv_compress_options &options, const akv_shape &shape) {
  return plan_method(options, shape).footprint;
}

}  // namespace akv
