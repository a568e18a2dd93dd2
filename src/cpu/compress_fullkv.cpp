// FullKV: the exact dense cache (keys post-RoPE, storage dtype), the reference every other
// method is compared against and the fallback for layers an engine does not compress.
#include <algorithm>
#include <vector>
#include "core/dtype.hpp"
#include "core/thread_pool.hpp"
#include "cpu/compress.hpp"
#include "cpu/prefill_reader.hpp"

namespace akv {

void store_dense_tokens(const CompressRequest &req, const PrefillReader &in, const std::vector<int64_t> &head_start,
                        const int32_t *tokens, akv_cache &cache) {
  const int D = req.prefill->shape.head_dim;
  const int64_t total = head_start.back();
  cache.footprint = dense_bytes(total, 1, D);
  cache.data = Buffer(req.context, cache.footprint);
  uint16_t *keys = reinterpret_cast<uint16_t *>(cache.data.data());
  uint16_t *values = keys + total * D;
  const akv_dtype storage = cache.meta.storage;
  req.context->pool->parallel_for(total, [&](int64_t b, int64_t e) {
    std::vector<float> k(D), v(D);
    int h = static_cast<int>(std::upper_bound(head_start.begin(), head_start.end(), b) - head_start.begin()) - 1;
    for (int64_t i = b; i < e; ++i) {
      while (i >= head_start[h + 1]) ++h;
      const int64_t t = tokens ? tokens[i] : i - head_start[h];
      in.key_row(h, t, nullptr, k.data());
      in.value_row(h, t, v.data());
      for (int d = 0; d < D; ++d) {
        keys[i * D + d] = float_to_half(k[d], storage);
        values[i * D + d] = float_to_half(v[d], storage);
      }
    }
  });
}


std::unique_ptr<akv_cache> compress_fullkv_cpu(const CompressRequest &req) {
  const akv_prefill &p = *req.prefill;
  std::unique_ptr<akv_cache> cache = new_cache(req);
  CacheMeta &meta = cache->meta;
  const int64_t S = p.shape.seq_len;
  const int H = p.shape.num_kv_heads;
  PrefillReader in(p, req.options->window, cache->rope, req.options->keys_post_rope != 0);
  meta.dense_counts.assign(H, S);
  cache->dense_positions = in.positions();
  cache->next_position = static_cast<int64_t>(in.positions()[S - 1]) + 1;
  std::vector<int64_t> head_start(H + 1);
  for (int h = 0; h <= H; ++h) head_start[h] = h * S;
  store_dense_tokens(req, in, head_start, nullptr, *cache);
  return cache;
}

}  // namespace akv
