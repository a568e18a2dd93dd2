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
