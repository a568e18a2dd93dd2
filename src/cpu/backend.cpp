// The CPU backend: caches in host memory, every method's CPU executor, the reference decode,
// and automatic compaction (compress_options.compact_after).
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "core/backend.hpp"
#include "core/context.hpp"
#include "core/dtype.hpp"
#include "core/error.hpp"
#include "core/method_traits.hpp"
#include "core/serialize.hpp"
#include "cpu/attention.hpp"
#include "cpu/compress.hpp"

namespace akv {
namespace {

void *default_alloc(void *, size_t bytes) { return std::aligned_alloc(256, (bytes + 255) / 256 * 256); }
void default_free(void *, void *p, size_t) { std::free(p); }

// A caller tensor as fp32, checked finite.
std::vector<float> to_float(const void *src, akv_dtype dtype, size_t n, const char *name) {
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) {
    out[i] = load_as_float(src, dtype, i);
    if (!std::isfinite(out[i]))
      fail(AKV_ERR_NON_FINITE, name, " contain a non-finite value (", out[i], ") at element ", i);
  }
  return out;
}

// The method's CPU executor, from the method table.
std::unique_ptr<akv_cache> compress_method_cpu(const CompressRequest &req) {
  const MethodTraits &traits = method_traits(req.options->method);
  switch (traits.storage) {
    case Storage::kAnchor:
      return compress_anchorkv_cpu(req);
    case Storage::kQuantized:
      return compress_quantized_cpu(req);
    case Storage::kDense:
      break;
  }
  return traits.evicting ? compress_eviction_cpu(req) : compress_fullkv_cpu(req);
}

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(akv_context &context) : ctx_(context) {
    if (!ctx_.allocator.alloc) ctx_.allocator = {default_alloc, default_free, nullptr};
  }

  void *allocate(size_t bytes) override {
    if (bytes == 0) return nullptr;
    void *p = ctx_.allocator.alloc(ctx_.allocator.user_data, bytes);
    if (!p) fail(AKV_ERR_OUT_OF_MEMORY, "the allocator returned NULL for ", bytes, " bytes");
    return p;
  }
  void deallocate(void *ptr, size_t bytes) noexcept override {
    if (ptr) ctx_.allocator.free(ctx_.allocator.user_data, ptr, bytes);
  }

  void check_compress(const akv_compress_options &, const akv_shape &) override {}

  std::unique_ptr<akv_cache> compress(const CompressRequest &req, void *) override {
    std::unique_ptr<akv_cache> cache = compress_method_cpu(req);
    // Finite inputs can still overflow: f32 keys above 65504 stored as f16, or values near the
    // fp32 limit through RoPE and the coefficients. A stored NaN or Inf would make every
    // decode NaN and the serialized cache unreadable (the deserializer refuses it).
    require_finite_storage(*cache, cache->data.data(), AKV_ERR_NON_FINITE,
                           "an input overflows the storage dtype or fp32: the compressed cache would hold");
    return cache;
  }

  void reserve(akv_cache &c, int64_t tokens, void *) override {
    if (tokens <= c.suffix_capacity) return;
    if (tokens > INT32_MAX) fail(AKV_ERR_INVALID_ARGUMENT, "tokens ", tokens, " exceeds int32");
    const int64_t H = c.meta.shape.num_kv_heads, D = c.meta.shape.head_dim;
    const size_t row = static_cast<size_t>(D) * 2;
    Buffer keys(c.context, H * tokens * row), values(c.context, H * tokens * row);
    for (int64_t h = 0; h < H; ++h) {
      if (c.suffix_len == 0) break;
      std::memcpy(keys.data() + h * tokens * row, c.suffix_keys.data() + h * c.suffix_capacity * row, c.suffix_len * row);
      std::memcpy(values.data() + h * tokens * row, c.suffix_values.data() + h * c.suffix_capacity * row,
                  c.suffix_len * row);
    }
    c.suffix_keys = std::move(keys);
    c.suffix_values = std::move(values);
    c.suffix_capacity = tokens;
  }

  void append(akv_cache &c, const void *keys, const void *values, akv_dtype dtype, int32_t num_tokens,
              const int32_t *pos, bool /*implicit*/, void *stream) override {
    const int64_t H = c.meta.shape.num_kv_heads, D = c.meta.shape.head_dim;
    const size_t n = static_cast<size_t>(H) * num_tokens * D;
    std::vector<float> k = to_float(keys, dtype, n, "keys");
    const std::vector<float> v = to_float(values, dtype, n, "values");
    // Rows in the storage dtype first: a value that overflows it (f32 above 65504 into f16)
    // is refused before the cache changes.
    std::vector<uint16_t> hk(n), hv(n);
    for (int64_t h = 0; h < H; ++h)
      for (int32_t i = 0; i < num_tokens; ++i) {
        const size_t row = static_cast<size_t>(h * num_tokens + i) * D;
        if (!c.meta.keys_post_rope) c.rope.apply(&k[row], pos[i]);
        for (int64_t d = 0; d < D; ++d) {
          hk[row + d] = float_to_half(k[row + d], c.meta.storage);
          hv[row + d] = float_to_half(v[row + d], c.meta.storage);
        }
      }
    for (const std::vector<uint16_t> *half : {&hk, &hv})
      for (size_t e = 0; e < n; ++e)
        if (!std::isfinite(half_to_float((*half)[e], c.meta.storage)))
          fail(AKV_ERR_NON_FINITE, half == &hk ? "keys" : "values", " element ", e, " (",
               (half == &hk ? k[e] : v[e]), (half == &hk && !c.meta.keys_post_rope ? " after RoPE" : ""),
               ") overflows the ", c.meta.storage == AKV_DTYPE_F16 ? "f16" : "bf16", " storage dtype");
    if (c.suffix_len + num_tokens > c.suffix_capacity)
      reserve(c, std::max<int64_t>(c.suffix_len + num_tokens, 2 * c.suffix_capacity + 16), stream);
    uint16_t *sk = reinterpret_cast<uint16_t *>(c.suffix_keys.data());
    uint16_t *sv = reinterpret_cast<uint16_t *>(c.suffix_values.data());
    for (int64_t h = 0; h < H; ++h)
      for (int32_t i = 0; i < num_tokens; ++i) {
        const size_t row = static_cast<size_t>(h * num_tokens + i) * D;
        const int64_t dst = (h * c.suffix_capacity + c.suffix_len + i) * D;
        std::memcpy(sk + dst, &hk[row], D * sizeof(uint16_t));
        std::memcpy(sv + dst, &hv[row], D * sizeof(uint16_t));
      }
    c.record_appended(pos, num_tokens);
  }

  void decode(akv_cache *const *caches, int32_t batch, const void *queries, akv_dtype dtype, int32_t q_len, void *out,
              float *lse, void *) override {
    const akv_shape &s0 = caches[0]->meta.shape;
    const size_t per_request = static_cast<size_t>(s0.num_q_heads) * q_len * s0.head_dim;
    const std::vector<float> q = to_float(queries, dtype, per_request * batch, "queries");
    std::vector<float> o(per_request * batch);
    decode_cpu(caches, batch, q.data(), q_len, o.data(), lse, *ctx_.pool);
    for (size_t i = 0; i < o.size(); ++i) store_from_float(out, dtype, i, o[i]);
    for (int32_t r = 0; r < batch; ++r) record_and_maybe_compact(*caches[r], q.data() + r * per_request, q_len);
  }

  void compact(akv_cache &c, const void *queries, akv_dtype dtype, int64_t headroom, void *) override {
    const size_t n = static_cast<size_t>(c.meta.shape.num_q_heads) * c.meta.window * c.meta.shape.head_dim;
    const std::vector<float> q = to_float(queries, dtype, n, "queries");
    compact_in_place(c, q.data(), headroom);
  }

  void reconstruct(const akv_cache &c, akv_dtype dtype, int32_t rotated, void *keys, void *values, uint8_t *present,
                   void *) override {
    const int64_t H = c.meta.shape.num_kv_heads, D = c.meta.shape.head_dim, T = c.total_tokens();
    ctx_.pool->parallel_for(H, [&](int64_t b, int64_t e) {
      std::vector<float> k(T * D), v(T * D);
      for (int64_t h = b; h < e; ++h) {
        reconstruct_head_cpu(c, static_cast<int>(h), rotated != 0, k.data(), v.data(),
                             present ? present + h * T : nullptr);
        for (int64_t i = 0; i < T * D; ++i) {
          store_from_float(keys, dtype, h * T * D + i, k[i]);
          store_from_float(values, dtype, h * T * D + i, v[i]);
        }
      }
    });
  }

  void read(void *host_dst, const void *src, size_t bytes, void *) override {
    if (bytes) std::memcpy(host_dst, src, bytes);
  }

  std::vector<uint8_t> serialize(const akv_cache &c, void *) override {
    return serialize_cache(c, c.data.data(), c.suffix_keys.data(), c.suffix_values.data());
  }

  std::unique_ptr<akv_cache> place(ParsedCache parsed, void *stream) override {
    akv_cache &c = *parsed.cache;
    c.context = &ctx_;
    c.data = Buffer(&ctx_, parsed.data.size());
    if (!parsed.data.empty()) std::memcpy(c.data.data(), parsed.data.data(), parsed.data.size());
    const int64_t len = static_cast<int64_t>(c.suffix_positions.size());
    c.suffix_len = 0;
    reserve(c, len, stream);
    if (len) {  // exactly sized: [H][len][D], the capacity is len
      std::memcpy(c.suffix_keys.data(), parsed.suffix_keys.data(), parsed.suffix_keys.size());
      std::memcpy(c.suffix_values.data(), parsed.suffix_values.data(), parsed.suffix_values.size());
    }
    c.suffix_len = len;
    return std::move(parsed.cache);
  }

 private:
  // The compacted form of `c` swapped into it; q: [Hq][W][D] fp32. The suffix reservation
  // and the recorded queries are kept. `c` is unchanged on failure.
  void compact_in_place(akv_cache &c, const float *q, int64_t headroom) {
    const int64_t capacity = c.suffix_capacity;
    std::unique_ptr<akv_cache> fresh = compact_cache_cpu(c, &ctx_, q, headroom);
    require_finite_storage(*fresh, fresh->data.data(), AKV_ERR_NON_FINITE,
                           "the compacted cache would hold");  // reconstruction overflow (f16)
    reserve(*fresh, capacity, nullptr);
    fresh->recent_queries = std::move(c.recent_queries);
    fresh->recent_tokens = std::move(c.recent_tokens);
    c = std::move(*fresh);
  }

  // Automatic compaction (compress_options.compact_after): records the queries of the q_len
  // tokens just decoded, then compacts once the suffix exceeds the threshold and the queries
  // of the last W tokens are all recorded. q: [Hq][q_len][D] fp32.
  void record_and_maybe_compact(akv_cache &c, const float *q, int32_t q_len) {
    const int64_t n = c.compress_options.compact_after;
    if (n <= 0) return;
    const int64_t W = c.meta.window, Hq = c.meta.shape.num_q_heads, D = c.meta.shape.head_dim, T = c.total_tokens();
    if (c.recent_tokens.empty()) {
      c.recent_tokens.assign(W, -1);
      c.recent_queries.assign(static_cast<size_t>(W * Hq * D), 0.0f);
    }
    for (int32_t i = std::max<int32_t>(0, q_len - static_cast<int32_t>(W)); i < q_len; ++i) {
      const int64_t token = T - q_len + i, slot = token % W;
      c.recent_tokens[slot] = token;
      for (int64_t hq = 0; hq < Hq; ++hq)
        std::memcpy(&c.recent_queries[(slot * Hq + hq) * D], q + (hq * q_len + i) * D, D * sizeof(float));
    }
    if (c.suffix_len <= n || c.suffix_len < W) return;
    for (int64_t token = T - W; token < T; ++token)
      if (c.recent_tokens[token % W] != token) return;  // a token appended without its query
    std::vector<float> window(static_cast<size_t>(Hq * W * D));  // [Hq][W][D], oldest first
    for (int64_t hq = 0; hq < Hq; ++hq)
      for (int64_t w = 0; w < W; ++w)
        std::memcpy(&window[(hq * W + w) * D], &c.recent_queries[(((T - W + w) % W) * Hq + hq) * D],
                    D * sizeof(float));
    compact_in_place(c, window.data(), n);
  }

  akv_context &ctx_;
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(akv_context &context) { return std::make_unique<CpuBackend>(context); }

}  // namespace akv
