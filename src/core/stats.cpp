#include "core/stats.hpp"

#include <cmath>
#include <cstring>
#include "core/method_traits.hpp"
#include "core/shape.hpp"

namespace akv {

akv_cache_stats cache_stats(const akv_cache &c) {
  const bool anchor = storage_of(c.meta.method) == Storage::kAnchor;
  akv_cache_stats s;
  std::memset(&s, 0, sizeof s);
  s.struct_size = sizeof s;
  s.method = c.meta.method;
  s.shape = c.meta.shape;
  s.storage_dtype = c.meta.storage;
  s.window = c.meta.method == AKV_METHOD_FULLKV ? 0 : c.meta.window;
  s.anchors = c.meta.anchors;
  s.appended_tokens = c.suffix_len;
  s.append_capacity = c.suffix_capacity;
  s.full_bytes = full_bytes(c.meta.shape);
  s.budget_bytes = anchor ? c.geometry.budget_bytes
                   : c.meta.method == AKV_METHOD_FULLKV
                       ? s.full_bytes
                       : static_cast<uint64_t>(std::floor(c.meta.retain_fraction * static_cast<double>(s.full_bytes)));
  s.base_bytes = anchor ? c.geometry.base_bytes : 0;
  s.compressed_bytes = c.footprint;
  s.appended_bytes = dense_bytes(c.suffix_len, c.meta.shape.num_kv_heads, c.meta.shape.head_dim);
  s.allocated_bytes = c.allocated_bytes();
  s.ratio = static_cast<double>(s.full_bytes) / static_cast<double>(c.footprint);
  s.key_residuals = c.meta.key_residuals;
  s.value_residuals = c.meta.value_residuals;
  s.compactions = c.compactions;
  s.storage_format = anchor ? c.geometry.format : 0;
  s.segment_tokens = anchor && c.geometry.format == 3 ? static_cast<int32_t>(c.geometry.segment_len) : 0;
  return s;
}

void head_stats(const akv_cache &c, const uint32_t *offsets, akv_head_stats *out) {
  const int H = c.meta.shape.num_kv_heads;
  const Storage kind = storage_of(c.meta.method);
  for (int h = 0; h < H; ++h) {
    akv_head_stats s{};
    if (kind == Storage::kAnchor) {
      s.kept_tokens = c.meta.shape.seq_len;
      s.anchors = c.meta.anchors;
      const uint32_t *ko = offsets, *vo = offsets + H + 1;
      s.key_residuals = ko[h + 1] - ko[h];
      s.value_residuals = vo[h + 1] - vo[h];
    } else if (kind == Storage::kQuantized) {
      s.kept_tokens = c.meta.shape.seq_len;  // every token, the window exact
      s.anchors = c.meta.window;
    } else {  // FullKV and eviction: exact kept tokens
      s.kept_tokens = c.meta.dense_counts[h];
      s.anchors = c.meta.dense_counts[h];
    }
    out[h] = s;
  }
}

}  // namespace akv
