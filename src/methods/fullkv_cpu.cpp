// FullKV: the exact dense cache (keys post-RoPE, storage dtype), the reference every other
// method is compared against and the fallback for layers an engine does not compress.
#include <cstring>
#include <vector>
#include "core/dtype.hpp"
#include "cpu/thread_pool.hpp"
#include "methods/methods.hpp"
#include "methods/prefill_reader.hpp"

namespace akv {

std::unique_ptr<akv_cache> compress_fullkv_cpu(const CompressRequest &req) {
  const akv_prefill &p = *req.prefill;
  auto cache = std::make_unique<akv_cache>();
  cache->context = req.context;
  fill_common_meta(req, cache->meta);
  CacheMeta &meta = cache->meta;
  cache->rope = Rope(req.options->rope, p.shape.head_dim);
  const int64_t S = p.shape.seq_len;
  const int H = p.shape.num_kv_heads, D = p.shape.head_dim;
  PrefillReader in(p, req.options->window, cache->rope, req.options->keys_post_rope != 0);
  meta.dense_counts.assign(H, S);
  cache->dense_positions = in.positions();
  cache->next_position = static_cast<int64_t>(in.positions()[S - 1]) + 1;
  cache->footprint = 4ull * S * H * D;
  cache->data = Buffer(req.context, cache->footprint);
  uint16_t *keys = reinterpret_cast<uint16_t *>(cache->data.data());
  uint16_t *values = keys + static_cast<int64_t>(H) * S * D;
  const akv_dtype storage = meta.storage;
  req.context->pool->parallel_for(static_cast<int64_t>(H) * S, [&](int64_t b, int64_t e) {
    std::vector<float> k(D), v(D);
    for (int64_t i = b; i < e; ++i) {
      const int h = static_cast<int>(i / S);
      const int64_t t = i % S;
      in.key_row(h, t, nullptr, k.data());
      in.value_row(h, t, v.data());
      for (int d = 0; d < D; ++d) {
        keys[i * D + d] = float_to_half(k[d], storage);
        values[i * D + d] = float_to_half(v[d], storage);
      }
    }
  });
  return cache;
}

}  // namespace akv
