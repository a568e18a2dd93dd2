#include <cmath>
#include "core/error.hpp"
#include "core/quantizer.hpp"
#include "methods/eviction.hpp"
#include <algorithm>
#include "core/dtype.hpp"
#include "methods/methods.hpp"

namespace akv {

std::unique_ptr<akv_cache> new_cache(const CompressRequest &req) {
  const akv_compress_options &o = *req.options;
  const akv_prefill &p = *req.prefill;
  auto cache = std::make_unique<akv_cache>();
  cache->context = req.context;
  cache->rope = Rope(o.rope, p.shape.head_dim);
  CacheMeta &meta = cache->meta;
  meta.method = o.method;
  meta.shape = p.shape;
  meta.storage = o.storage_dtype != AKV_DTYPE_AUTO ? o.storage_dtype
                 : (p.dtype == AKV_DTYPE_F16 ? AKV_DTYPE_F16 : AKV_DTYPE_BF16);
  meta.keys_post_rope = o.keys_post_rope ? 1 : 0;
  meta.softmax_scale = o.softmax_scale != 0.0f ? o.softmax_scale
                                               : 1.0f / std::sqrt(static_cast<float>(p.shape.head_dim));
  meta.retain_fraction = o.retain_fraction;
  meta.seed = o.seed;
  meta.layer_index = o.layer_index;
  meta.layer_count = o.layer_count;
  meta.residual_scale = o.residual_scale;
  meta.rope_style = cache->rope.style;
  meta.rotary_dim = cache->rope.rotary_dim;
  meta.inv_freq = cache->rope.inv_freq;
  meta.window = o.window;
  cache->compress_options = o;
  cache->compress_options.rope.inv_freq = nullptr;  // the caller's pointer: meta.inv_freq has the table
  return cache;
}

std::vector<int32_t> prompt_positions(const akv_prefill &p) {
  std::vector<int32_t> pos(p.shape.seq_len);
  for (int64_t t = 0; t < p.shape.seq_len; ++t) pos[t] = p.positions ? p.positions[t] : static_cast<int32_t>(t);
  return pos;
}

int64_t first_position_gap(const std::vector<int32_t> &positions) {
  for (size_t t = 1; t < positions.size(); ++t)
    if (positions[t] != positions[0] + static_cast<int64_t>(t)) return static_cast<int64_t>(t);
  return -1;
}

std::vector<int32_t> prepare_anchor_cache(const akv_prefill &p, const AnchorGeometry &g, const akv_compress_options &o,
                                          akv_cache &cache) {
  CacheMeta &meta = cache.meta;
  require(p.queries != nullptr, AKV_ERR_INVALID_ARGUMENT, "queries is NULL (AnchorKV scores with the window queries)");
  meta.anchors = g.anchors;
  meta.pool_heads = g.pool_heads;
  meta.storage_format = g.format;
  meta.key_residuals = g.key_residuals;
  meta.value_residuals = g.value_residuals;
  cache.geometry = g;
  cache.layout = anchor_layout(g);
  cache.codec = ResidualCodec(o.seed, g.dim, o.residual_scale);
  cache.footprint = g.footprint;
  std::vector<int32_t> pos = prompt_positions(p);
  const int64_t S = g.seq_len, P = g.prefix;
  require(pos[S - 1] - pos[P] == g.window - 1, AKV_ERR_UNSUPPORTED, "positions of the last window=", g.window,
          " tokens must be consecutive (got ", pos[P], "..", pos[S - 1], ")");
  if (g.format == 3) {  // positions are implicit: first + t
    if (const int64_t t = first_position_gap(pos); t >= 0)
      fail(AKV_ERR_UNSUPPORTED, "storage_format 3 stores positions implicitly and needs them consecutive; positions[", t,
           "] = ", pos[t], " after ", pos[t - 1], " (set storage_format 2)");
  }
  meta.window_first_position = pos[P];
  cache.next_position = static_cast<int64_t>(pos[S - 1]) + 1;
  return pos;
}

MethodPlan plan_method(const akv_compress_options &o, const akv_shape &s) {
  if (o.method != AKV_METHOD_ANCHORKV && o.pool_heads != 0 && o.pool_heads != s.num_kv_heads)
    fail(AKV_ERR_UNSUPPORTED, "pool_heads ", o.pool_heads, " (groups smaller than the call's ", s.num_kv_heads,
         " heads) is supported by AnchorKV only: compress each group in its own call");
  MethodPlan plan;
  plan.method = o.method;
  switch (o.method) {
    case AKV_METHOD_FULLKV:
      plan.footprint = full_bytes(s);
      break;
    case AKV_METHOD_ANCHORKV:
      plan.anchor = anchor_geometry(o, s);
      plan.footprint = plan.anchor.footprint;
      break;
    case AKV_METHOD_SNAPKV:
    case AKV_METHOD_PYRAMIDKV:
    case AKV_METHOD_ADAKV:
    case AKV_METHOD_ANDPRO:
    case AKV_METHOD_TOVA:
    case AKV_METHOD_KNORM:
    case AKV_METHOD_STREAMINGLLM:
      plan.eviction = eviction_budget(o, s);
      plan.footprint = plan.eviction.footprint;
      break;
    case AKV_METHOD_QUANTIZED:
      plan.quant = quant_geometry(o, s);
      plan.footprint = plan.quant.footprint;
      break;
    default:
      fail(AKV_ERR_UNSUPPORTED, "method ", static_cast<int>(o.method), " is not implemented in this version");
  }
  return plan;
}

}  // namespace akv
