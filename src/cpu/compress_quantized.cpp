// The TurboQuant-style quantized cache on the CPU (docs/design.md §5; layout and codec in
// core/quantizer.hpp). Query-agnostic: the window queries are not read.
#include <cstring>
#include <vector>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "core/thread_pool.hpp"
#include "cpu/compress.hpp"
#include "cpu/prefill_reader.hpp"

namespace akv {

std::unique_ptr<akv_cache> compress_quantized_cpu(const CompressRequest &req) {
  const akv_compress_options &o = *req.options;
  const akv_prefill &p = *req.prefill;
  const QuantGeometry &g = req.plan->quant;
  std::unique_ptr<akv_cache> cache = new_cache(req);
  CacheMeta &meta = cache->meta;
  meta.window = g.window;
  meta.quant_bits = g.bits;
  meta.quant_outliers = g.outliers;
  meta.dense_counts.assign(g.heads, g.seq_len);
  cache->quant = g;
  cache->quantizer = TokenQuantizer(o.seed, g.dim, g.bits, g.outliers);
  PrefillReader in(p, o.window, cache->rope, o.keys_post_rope != 0);
  cache->dense_positions = in.positions();
  cache->next_position = static_cast<int64_t>(in.positions()[g.seq_len - 1]) + 1;
  cache->footprint = g.footprint;
  cache->data = Buffer(req.context, g.total_bytes);
  std::memset(cache->data.data(), 0, g.total_bytes);  // padding is deterministic

  const akv_cache &c = *cache;
  const int64_t S = g.seq_len, P = g.prefix, W = g.window, cb = g.code_bytes();
  const int H = g.heads, D = g.dim, n = g.outliers;
  const akv_dtype storage = meta.storage;
  uint16_t *window_keys = c.quant_section<uint16_t>(kQuantWindowKeys);
  uint16_t *window_values = c.quant_section<uint16_t>(kQuantWindowValues);
  uint8_t *key_codes = c.quant_section<uint8_t>(kQuantKeyCodes);
  float *key_scales = c.quant_section<float>(kQuantKeyScales);
  uint8_t *outlier_index = c.quant_section<uint8_t>(kQuantKeyOutlierIndex);
  uint16_t *outlier_value = c.quant_section<uint16_t>(kQuantKeyOutlierValue);
  uint8_t *value_codes = c.quant_section<uint8_t>(kQuantValueCodes);
  float *value_scales = c.quant_section<float>(kQuantValueScales);
  const TokenQuantizer &quantizer = c.quantizer;
  req.context->pool->parallel_for(static_cast<int64_t>(H) * S, [&](int64_t b, int64_t e) {
    std::vector<float> k(D), v(D), ov(n);
    std::vector<int32_t> oi(n);
    for (int64_t i = b; i < e; ++i) {
      const int h = static_cast<int>(i / S);
      const int64_t t = i % S;
      in.key_row(h, t, nullptr, k.data());
      in.value_row(h, t, v.data());
      if (t >= P) {
        const int64_t dst = (static_cast<int64_t>(h) * W + (t - P)) * D;
        for (int d = 0; d < D; ++d) {
          window_keys[dst + d] = float_to_half(k[d], storage);
          window_values[dst + d] = float_to_half(v[d], storage);
        }
        continue;
      }
      const int64_t slot = static_cast<int64_t>(h) * P + t;
      quantizer.encode_key(k.data(), key_codes + slot * cb, &key_scales[slot], oi.data(), ov.data());
      for (int j = 0; j < n; ++j) {
        const int64_t o_slot = slot * n + j;
        if (g.index_bytes == 1) {
          outlier_index[o_slot] = static_cast<uint8_t>(oi[j]);
        } else {
          const uint16_t idx = static_cast<uint16_t>(oi[j]);
          std::memcpy(outlier_index + 2 * o_slot, &idx, 2);
        }
        outlier_value[o_slot] = float_to_half(ov[j], storage);
      }
      quantizer.encode_value(v.data(), value_codes + slot * cb, &value_scales[slot]);
    }
  });
  return cache;
}

}  // namespace akv
