// The C ABI, part 3: what is done with a cache (append, decode, compaction, stats,
// reconstruct, serialization); see api/context.cpp.
#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "api/guard.hpp"
#include "api/validate.hpp"
#include "core/anchor_access.hpp"
#include "core/backend.hpp"
#include "core/context.hpp"
#include "core/method_traits.hpp"
#include "core/serialize.hpp"
#include "core/stats.hpp"

using namespace akv;

namespace {

// Backend::sync_appended: the host's record of appended tokens, current before it is read
// (a const handle's record is brought up to date too: it is the same cache).
void sync_appended(const akv_cache *cache, void *stream) {
  akv_cache &c = const_cast<akv_cache &>(*cache);
  c.context->impl->sync_appended(c, stream);
}

akv_status decode_one(const char *function, akv_cache *cache, const void *queries, akv_dtype dtype, int32_t q_len,
                      void *out, float *lse, void *stream) {
  return guard(function, [&] {
    validate_cache(cache);
    check_not_null(queries, "queries");
    check_not_null(out, "out");
    check_input_dtype(dtype, "dtype");
    validate_decode(cache, q_len);
    cache->context->impl->decode(&cache, 1, queries, dtype, q_len, out, lse, stream);
  });
}

akv_status decode_many(const char *function, akv_context *context, akv_cache *const *caches, int32_t batch,
                       const void *queries, akv_dtype dtype, int32_t q_len, void *out, float *lse, void *stream) {
  return guard(function, [&] {
    check_not_null(context, "context");
    check_not_null(caches, "caches");
    check_not_null(queries, "queries");
    check_not_null(out, "out");
    check_input_dtype(dtype, "dtype");
    if (batch < 1) fail(AKV_ERR_INVALID_ARGUMENT, "batch ", batch, " must be at least 1");
    for (int32_t b = 0; b < batch; ++b) {
      if (!caches[b]) fail(AKV_ERR_INVALID_ARGUMENT, "caches[", b, "] is NULL");
      if (caches[b]->context != context)
        fail(AKV_ERR_MISMATCH, "caches[", b, "] belongs to a different context");
      const akv_shape &s = caches[b]->meta.shape, &s0 = caches[0]->meta.shape;
      if (s.num_kv_heads != s0.num_kv_heads || s.num_q_heads != s0.num_q_heads || s.head_dim != s0.head_dim)
        fail(AKV_ERR_MISMATCH, "caches[", b, "] has H=", s.num_kv_heads, ", Hq=", s.num_q_heads, ", D=", s.head_dim,
             " but caches[0] has H=", s0.num_kv_heads, ", Hq=", s0.num_q_heads, ", D=", s0.head_dim);
      validate_decode(caches[b], q_len);
    }
    context->impl->decode(caches, batch, queries, dtype, q_len, out, lse, stream);
  });
}

// The compacted form of `c` swapped into it (akv_cache_compact). q: [Hq][W][D] fp32 host. The
// suffix reservation is kept. A CUDA cache goes through the host staging context: copied
// down, compacted by the CPU code, placed back in new device buffers. `c` is unchanged on

}  // namespace

extern "C" {

AKV_API void akv_cache_destroy(akv_cache *cache) { delete cache; }

AKV_API akv_status akv_cache_reserve(akv_cache *cache, int64_t tokens, void *stream) {
  return guard(__func__, [&] {
    validate_cache(cache);
    if (tokens < 0) fail(AKV_ERR_INVALID_ARGUMENT, "tokens ", tokens, " is negative");
    sync_appended(cache, stream);
    cache->context->impl->reserve(*cache, tokens, stream);
  });
}

AKV_API akv_status akv_append(akv_cache *cache, const void *keys, const void *values, akv_dtype dtype,
                              int32_t num_tokens, const int32_t *positions, void *stream) {
  return guard(__func__, [&] {
    validate_cache(cache);
    check_not_null(keys, "keys");
    check_not_null(values, "values");
    check_input_dtype(dtype, "dtype");
    if (num_tokens < 1) fail(AKV_ERR_INVALID_ARGUMENT, "num_tokens ", num_tokens, " must be at least 1");
    sync_appended(cache, stream);
    akv_cache &c = *cache;
    std::vector<int32_t> pos(num_tokens);
    for (int32_t i = 0; i < num_tokens; ++i) {
      const int64_t p = positions ? positions[i] : c.next_position + i;
      const int64_t floor = i == 0 ? c.next_position : static_cast<int64_t>(pos[i - 1]) + 1;
      if (p < floor) fail(AKV_ERR_INVALID_ARGUMENT, "positions[", i, "] = ", p, " must be at least ", floor,
                          " (strictly increasing, after every cached position)");
      if (p > INT32_MAX) fail(AKV_ERR_INVALID_ARGUMENT, "positions exceed int32");
      pos[i] = static_cast<int32_t>(p);
    }
    c.context->impl->append(c, keys, values, dtype, num_tokens, pos.data(), positions == nullptr, stream);
  });
}

AKV_API akv_status akv_decode(akv_cache *cache, const void *queries, akv_dtype dtype, int32_t q_len,
                              void *out, void *stream) {
  return decode_one(__func__, cache, queries, dtype, q_len, out, nullptr, stream);
}

AKV_API akv_status akv_decode_batch(akv_context *context, akv_cache *const *caches, int32_t batch,
                                    const void *queries, akv_dtype dtype, int32_t q_len, void *out,
                                    void *stream) {
  return decode_many(__func__, context, caches, batch, queries, dtype, q_len, out, nullptr, stream);
}

AKV_API akv_status akv_cache_compact(akv_cache *cache, const void *queries, akv_dtype dtype,
                                     int64_t headroom_tokens, void *stream) {
  return guard(__func__, [&] {
    validate_cache(cache);
    check_not_null(queries, "queries");
    check_input_dtype(dtype, "dtype");
    akv_cache &c = *cache;
    if (!compactable(c.meta.method))
      fail(AKV_ERR_UNSUPPORTED, "compaction folds AnchorKV, SnapKV, PyramidKV and AnDPro caches only (method ",
           static_cast<int>(c.meta.method), "; AdaKV has no decode-time variant)");
    if (headroom_tokens < 0 || headroom_tokens > INT32_MAX)
      fail(AKV_ERR_INVALID_ARGUMENT, "headroom_tokens ", headroom_tokens, " must be in [0, 2^31)");
    sync_appended(cache, stream);
    if (c.suffix_len < c.meta.window)
      fail(AKV_ERR_INVALID_ARGUMENT, "compaction needs at least window=", c.meta.window,
           " appended tokens (they become the new window), but the cache has ", c.suffix_len);
    c.context->impl->compact(c, queries, dtype, headroom_tokens, stream);
  });
}

AKV_API akv_status akv_cache_stats_get(const akv_cache *cache, akv_cache_stats *out) {
  return guard(__func__, [&] {
    validate_cache(cache);
    check_not_null(out, "out_stats");
    if (out->struct_size == 0 || out->struct_size > sizeof(akv_cache_stats))
      fail(AKV_ERR_INVALID_ARGUMENT, "out_stats->struct_size ", out->struct_size, " is not valid (expected ",
           sizeof(akv_cache_stats), ")");
    sync_appended(cache, nullptr);
    akv_cache_stats s = cache_stats(*cache);
    s.struct_size = out->struct_size;
    std::memcpy(static_cast<void *>(out), &s, out->struct_size);
  });
}

AKV_API akv_status akv_cache_head_stats(const akv_cache *cache, akv_head_stats *out) {
  return guard(__func__, [&] {
    validate_cache(cache);
    check_not_null(out, "out_heads");
    const akv_cache &c = *cache;
    const int H = c.meta.shape.num_kv_heads;
    std::vector<uint32_t> offsets;  // AnchorKV: key then value residual offsets [H+1] each
    if (storage_of(c.meta.method) == Storage::kAnchor) {
      offsets.resize(2 * (H + 1));
      const size_t bytes = (H + 1) * sizeof(uint32_t);
      c.context->impl->read(offsets.data(), c.section<uint32_t>(kKeyOffsets), bytes, nullptr);
      c.context->impl->read(offsets.data() + H + 1, c.section<uint32_t>(kValueOffsets), bytes, nullptr);
    }
    head_stats(c, offsets.data(), out);
  });
}

AKV_API akv_status akv_cache_reconstruct(const akv_cache *cache, akv_dtype dtype, int32_t rotated,
                                         void *keys, void *values, uint8_t *present, void *stream) {
  return guard(__func__, [&] {
    validate_cache(cache);
    check_not_null(keys, "keys");
    check_not_null(values, "values");
    check_input_dtype(dtype, "dtype");
    sync_appended(cache, stream);
    cache->context->impl->reconstruct(*cache, dtype, rotated, keys, values, present, stream);
  });
}

AKV_API akv_status akv_cache_logit_penalty(const akv_cache *cache, float *out, void *stream) {
  return guard(__func__, [&] {
    validate_cache(cache);
    check_not_null(out, "out");
    sync_appended(cache, stream);
    logit_penalties(*cache, *cache->context->impl, out, stream);
  });
}

AKV_API akv_status akv_cache_serialized_size(const akv_cache *cache, size_t *out_bytes) {
  return guard(__func__, [&] {
    validate_cache(cache);
    check_not_null(out_bytes, "out_bytes");
    sync_appended(cache, nullptr);
    *out_bytes = serialized_size(*cache);
  });
}

AKV_API akv_status akv_cache_serialize(const akv_cache *cache, void *buffer, size_t capacity,
                                       size_t *out_written, void *stream) {
  return guard(__func__, [&] {
    validate_cache(cache);
    check_not_null(buffer, "buffer");
    sync_appended(cache, stream);
    const std::vector<uint8_t> bytes = cache->context->impl->serialize(*cache, stream);
    if (bytes.size() > capacity)
      fail(AKV_ERR_CAPACITY, "buffer capacity ", capacity, " is smaller than the ", bytes.size(),
           " bytes needed (akv_cache_serialized_size)");
    std::memcpy(buffer, bytes.data(), bytes.size());
    if (out_written) *out_written = bytes.size();
  });
}

AKV_API akv_status akv_cache_deserialize(akv_context *context, const void *buffer, size_t size,
                                         akv_cache **out_cache, void *stream) {
  return guard(__func__, [&] {
    check_not_null(context, "context");
    check_not_null(buffer, "buffer");
    check_not_null(out_cache, "out_cache");
    *out_cache = context->impl->place(deserialize_cache(static_cast<const uint8_t *>(buffer), size), stream).release();
  });
}

/* ---- Decode with the log-sum-exp of each row (appended in 0.2) ---- */

AKV_API akv_status akv_decode_lse(akv_cache *cache, const void *queries, akv_dtype dtype, int32_t q_len,
                                  void *out, float *out_lse, void *stream) {
  return decode_one(__func__, cache, queries, dtype, q_len, out, out_lse, stream);
}

AKV_API akv_status akv_decode_batch_lse(akv_context *context, akv_cache *const *caches, int32_t batch,
                                        const void *queries, akv_dtype dtype, int32_t q_len, void *out,
                                        float *out_lse, void *stream) {
  return decode_many(__func__, context, caches, batch, queries, dtype, q_len, out, out_lse, stream);
}

}  // extern "C"
