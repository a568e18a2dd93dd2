#include "core/options.hpp"

#include <cmath>
#include <cstdint>
#include <cstring>
#include "core/context.hpp"
#include "core/error.hpp"
#include "core/layout.hpp"
#include "core/method_traits.hpp"

namespace akv {

akv_prefill default_prefill() {
  akv_prefill p;
  std::memset(&p, 0, sizeof p);
  p.struct_size = sizeof p;
  p.dtype = AKV_DTYPE_BF16;
  return p;
}

akv_compress_options default_options() {
  akv_compress_options options;
  std::memset(&options, 0, sizeof options);
  akv_compress_options *o = &options;
  o->struct_size = sizeof *o;
  o->method = AKV_METHOD_ANCHORKV;
  o->retain_fraction = 0.05;
  o->window = 32;
  o->anchors = 0;
  o->scored_fraction = 0.3;
  o->pool_kernel = 7;
  o->pool_type = AKV_POOL_AVG;
  o->residual_scale = AKV_SCALE_LEAST_SQUARES;
  o->seed = 42;
  o->layer_index = 0;
  o->layer_count = 1;
  o->rope.style = AKV_ROPE_NEOX;
  o->rope.rotary_dim = 0;
  o->rope.base = 10000.0;
  o->rope.inv_freq = nullptr;
  o->keys_post_rope = 0;
  o->softmax_scale = 0.0f;
  o->storage_dtype = AKV_DTYPE_AUTO;
  o->adakv_alpha = 0.2;
  o->quant_bits = 0;
  o->quant_outliers = 4;
  o->pyramid_beta = 20;
  o->andpro_chunk = 4;
  o->sink_tokens = 4;
  o->fill_budget = 1;
  o->anchor_share = 0.7;
  o->guard_fraction = 0.75;
  o->coverage_rounds = 8;
  o->scored_min = 64;
  o->follow_tokens = 8;
  o->logit_correction = 0.5;
  return options;
}

akv_compress_options paper_options() {
  akv_compress_options options = default_options();
  akv_compress_options *o = &options;
  o->scored_fraction = 0.7;
  o->sink_tokens = 0;
  o->fill_budget = 0;
  o->anchor_share = 0.0;
  o->guard_fraction = 0.0;
  o->coverage_rounds = 0;
  o->scored_min = 0;
  o->follow_tokens = 0;
  o->logit_correction = 0.0;
  o->storage_format = 2;
  return options;
}

akv_compress_options method_options(akv_method method) {
  akv_compress_options options = default_options();
  akv_compress_options *o = &options;
  o->method = method;
  switch (method) {
    case AKV_METHOD_SNAPKV:
    case AKV_METHOD_PYRAMIDKV:
    case AKV_METHOD_ADAKV:  // KVPress defaults (paper App. B.4)
      o->window = 64;
      o->pool_kernel = 5;
      o->pool_type = AKV_POOL_AVG;
      break;
    case AKV_METHOD_ANDPRO:  // the authors' setup (rebuttal: window 32, chunks of 4)
      o->window = 32;
      o->pool_kernel = 7;
      o->pool_type = AKV_POOL_MAX;
      o->andpro_chunk = 4;
      break;
    case AKV_METHOD_TOVA:  // KVPress's presses: no pooling; the window is the last token
    case AKV_METHOD_KNORM:
    case AKV_METHOD_STREAMINGLLM:
      o->window = 1;
      o->pool_kernel = 1;
      o->sink_tokens = method == AKV_METHOD_STREAMINGLLM ? 4 : 0;
      break;
    case AKV_METHOD_QUANTIZED:  // the paper's TurboQuant reproduction (App. B.5): b=3, k=4
      o->window = 128;
      o->quant_bits = 3;
      o->quant_outliers = 4;
      o->retain_fraction = 1.0;
      break;
    default:
      break;
  }
  return options;
}

void check_option_ranges(const akv_compress_options &o, akv_status status, const char *prefix) {
  auto unit = [](double x) { return std::isfinite(x) && x >= 0.0 && x <= 1.0; };
  if (!std::isfinite(o.softmax_scale) || o.softmax_scale < 0.0f)
    fail(status, prefix, "softmax_scale ", o.softmax_scale, " must be finite and >= 0 (0 = 1/sqrt(D))");
  if (o.layer_count < 1 || o.layer_index < 0 || o.layer_index >= o.layer_count)
    fail(status, prefix, "layer_index ", o.layer_index, " must be in [0, layer_count=", o.layer_count, ")");
  if (o.window < 1) fail(status, prefix, "window ", o.window, " must be positive");
  if (!std::isfinite(o.retain_fraction) || o.retain_fraction <= 0.0 || o.retain_fraction > 1.0)
    fail(status, prefix, "retain_fraction ", o.retain_fraction, " must be in (0, 1]");
  if (o.anchors < 0) fail(status, prefix, "anchors ", o.anchors, " must be >= 0 (0 = from the budget)");
  if (!unit(o.scored_fraction)) fail(status, prefix, "scored_fraction ", o.scored_fraction, " must be in [0, 1]");
  if (o.pool_kernel < 1 || o.pool_kernel % 2 != 1)
    fail(status, prefix, "pool_kernel ", o.pool_kernel, " must be a positive odd number");
  if (o.sink_tokens < 0) fail(status, prefix, "sink_tokens ", o.sink_tokens, " must be >= 0");
  if (!unit(o.anchor_share)) fail(status, prefix, "anchor_share ", o.anchor_share, " must be in [0, 1]");
  if (o.fill_budget != 0 && o.fill_budget != 1) fail(status, prefix, "fill_budget ", o.fill_budget, " must be 0 or 1");
  if (!unit(o.guard_fraction)) fail(status, prefix, "guard_fraction ", o.guard_fraction, " must be in [0, 1]");
  if (o.coverage_rounds < 0 || o.coverage_rounds > 64)
    fail(status, prefix, "coverage_rounds ", o.coverage_rounds, " must be in [0, 64]");
  if (o.scored_min < 0) fail(status, prefix, "scored_min ", o.scored_min, " must be >= 0");
  if (o.follow_tokens < 0 || o.follow_tokens > 64)
    fail(status, prefix, "follow_tokens ", o.follow_tokens, " must be in [0, 64]");
  if (!(o.logit_correction >= 0.0 && o.logit_correction <= 4.0))
    fail(status, prefix, "logit_correction ", o.logit_correction, " must be in [0, 4]");
  if (o.storage_format != 0 && o.storage_format != 2 && o.storage_format != 3)
    fail(status, prefix, "storage_format ", o.storage_format, " must be 0, 2 or 3 (0 = 3)");
  if (o.pool_heads < 0) fail(status, prefix, "pool_heads ", o.pool_heads, " must be >= 0 (0 = every head)");
  if (o.head_offset < 0 || o.head_offset > INT32_MAX - kMaxKvHeads)
    fail(status, prefix, "head_offset ", o.head_offset, " must be in [0, ", INT32_MAX - kMaxKvHeads, "]");
  if (o.compact_after < 0 || o.compact_after > INT32_MAX)
    fail(status, prefix, "compact_after ", o.compact_after, " must be in [0, 2^31) (0 = never)");
  if (o.compact_after > 0 && !compactable(o.method))
    fail(status == AKV_ERR_INVALID_ARGUMENT ? AKV_ERR_UNSUPPORTED : status, prefix,
         "compact_after is for AnchorKV, SnapKV, PyramidKV and AnDPro caches (method ", static_cast<int>(o.method), ")");
}

}  // namespace akv
