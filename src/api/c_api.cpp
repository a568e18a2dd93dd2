// The C ABI: argument validation, handles, dispatch to the backend. Every function body runs
// in guard() so no exception crosses the boundary, and nothing is modified before all
// validation has passed (a failed call leaves every handle usable and unchanged).
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "api/guard.hpp"
#include "core/context.hpp"
#include "core/dtype.hpp"
#include "core/layout.hpp"
#include "core/options.hpp"
#include "core/serialize.hpp"
#include "cpu/attention.hpp"
#include "core/thread_pool.hpp"
#include "cuda/backend.hpp"
#include "cuda/plan.hpp"
#include "cuda/runtime.hpp"
#include "cpu/compress.hpp"
#include "methods/methods.hpp"

using namespace akv;

namespace {

template <typename T>
void check_not_null(const T *p, const char *name) {
  if (!p) fail(AKV_ERR_INVALID_ARGUMENT, name, " is NULL");
}

// Copy a caller's option struct over defaults, honouring struct_size (older, smaller
// structs get defaults for the fields they lack; unknown larger ones are rejected).
template <typename T>
T versioned_copy(const T *user, T defaults, const char *name) {
  if (!user) return defaults;
  if (user->struct_size == 0 || user->struct_size > sizeof(T))
    fail(AKV_ERR_INVALID_ARGUMENT, name, "->struct_size ", user->struct_size,
         " is not valid (expected sizeof = ", sizeof(T), "; call the matching *_init first)");
  std::memcpy(static_cast<void *>(&defaults), user, user->struct_size);
  defaults.struct_size = sizeof(T);
  return defaults;
}

// An enum as the integer the caller stored. A C caller can store any int in an enum field,
// and reading an out-of-range value through the C++ enum type is undefined behaviour, so
// validation looks at the bytes before anything reads the enum.
template <typename E>
int32_t raw_enum(const E &e) {
  static_assert(sizeof(E) == sizeof(int32_t), "C enums are int-sized");
  int32_t v;
  std::memcpy(&v, &e, sizeof v);
  return v;
}

void check_enum(int32_t value, int32_t first, int32_t last, const char *name) {
  if (value < first || value > last) fail(AKV_ERR_INVALID_ARGUMENT, name, " ", value, " is not a known value");
}

// A raw dtype value by its name when it is one ("f32"), else by its number.
std::string dtype_label(int32_t v) {
  if (v >= AKV_DTYPE_AUTO && v <= AKV_DTYPE_BF16) return dtype_name(static_cast<akv_dtype>(v));
  return "value " + std::to_string(v);
}

void check_input_dtype(const akv_dtype &t, const char *name) {
  const int32_t v = raw_enum(t);
  if (v != AKV_DTYPE_F32 && v != AKV_DTYPE_F16 && v != AKV_DTYPE_BF16)
    fail(AKV_ERR_INVALID_ARGUMENT, name, " ", dtype_label(v), " is not f32, f16 or bf16");
}

bool on_cuda(const akv_context *ctx) { return ctx->backend == AKV_BACKEND_CUDA; }

// CUDA: the context's device is current until the end of the caller's scope (copies and
// allocations go to that device; the legacy default stream is the one of that device).
std::optional<cuda::DeviceScope> device_scope(const akv_context *ctx) {
  if (!on_cuda(ctx)) return std::nullopt;
  return std::optional<cuda::DeviceScope>(std::in_place, ctx->device);
}

void *default_host_alloc(void *, size_t bytes) {
  return std::aligned_alloc(256, (bytes + 255) / 256 * 256);
}
void default_host_free(void *, void *p, size_t) { std::free(p); }
void *default_device_alloc(void *user, size_t bytes) {
  const int device = static_cast<int>(reinterpret_cast<intptr_t>(user));
  return cuda::device_malloc(device, bytes);
}
void default_device_free(void *user, void *p, size_t) {
  cuda::device_free(static_cast<int>(reinterpret_cast<intptr_t>(user)), p);
}

// Convert a caller tensor to fp32 and check it is finite.
std::vector<float> to_float(const void *src, akv_dtype dtype, size_t n, const char *name) {
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) {
    out[i] = load_as_float(src, dtype, i);
    if (!std::isfinite(out[i]))
      fail(AKV_ERR_NON_FINITE, name, " contain a non-finite value (", out[i], ") at element ", i);
  }
  return out;
}

void validate_cache(const akv_cache *cache, const char *name = "cache") { check_not_null(cache, name); }

// Room for `tokens` appended tokens; copies what is there. CUDA: device buffers, and the
// device view is rebuilt (synchronous; not for use while capturing).
void reserve_suffix(akv_cache &c, int64_t tokens, void *stream) {
  if (tokens <= c.suffix_capacity) return;
  if (tokens > INT32_MAX) fail(AKV_ERR_INVALID_ARGUMENT, "tokens ", tokens, " exceeds int32");
  const auto scope = device_scope(c.context);
  const int64_t H = c.meta.shape.num_kv_heads, D = c.meta.shape.head_dim;
  const size_t row = static_cast<size_t>(D) * 2;
  Buffer keys(c.context, H * tokens * row), values(c.context, H * tokens * row);
  if (on_cuda(c.context)) {
    cuda::copy_rows(keys.data(), tokens * row, c.suffix_keys.data(), c.suffix_capacity * row, c.suffix_len * row, H, stream);
    cuda::copy_rows(values.data(), tokens * row, c.suffix_values.data(), c.suffix_capacity * row, c.suffix_len * row, H,
                    stream);
    cuda::synchronize(stream);  // before the old buffers are freed
  } else {
    for (int64_t h = 0; h < H; ++h) {
      if (c.suffix_len == 0) break;
      std::memcpy(keys.data() + h * tokens * row, c.suffix_keys.data() + h * c.suffix_capacity * row, c.suffix_len * row);
      std::memcpy(values.data() + h * tokens * row, c.suffix_values.data() + h * c.suffix_capacity * row, c.suffix_len * row);
    }
  }
  c.suffix_keys = std::move(keys);
  c.suffix_values = std::move(values);
  c.suffix_capacity = tokens;
  if (on_cuda(c.context)) cuda::upload_view(c, stream);
}

// A CPU context for work a CUDA context stages through the host (compression, reconstruct).
akv_context &host_staging(akv_context &ctx) {
  std::lock_guard<std::mutex> lock(ctx.workspace_mutex);
  if (!ctx.host_staging) {
    auto host = std::make_unique<akv_context>();
    host->allocator = {default_host_alloc, default_host_free, nullptr};
    host->pool = std::make_unique<ThreadPool>(ctx.pool->size());
    ctx.host_staging = std::move(host);
  }
  return *ctx.host_staging;
}

// Serialized bytes of any cache; a CUDA cache's buffers are copied to the host first.
std::vector<uint8_t> serialize_any(const akv_cache &c, void *stream) {
  if (!on_cuda(c.context))
    return serialize_cache(c, c.data.data(), c.suffix_keys.data(), c.suffix_values.data());
  std::vector<uint8_t> data(c.data.size()), keys(c.suffix_keys.size()), values(c.suffix_values.size());
  cuda::copy(data.data(), c.data.data(), data.size(), stream, false);
  cuda::copy(keys.data(), c.suffix_keys.data(), keys.size(), stream, false);
  cuda::copy(values.data(), c.suffix_values.data(), values.size(), stream, true);
  return serialize_cache(c, data.data(), keys.data(), values.data());
}

// A parsed cache placed in `context` (host or device memory).
std::unique_ptr<akv_cache> place(akv_context *context, ParsedCache parsed, void *stream) {
  akv_cache &c = *parsed.cache;
  c.context = context;
  const bool cuda = on_cuda(context);
  if (cuda) cuda::check_decodable(c);
  const auto scope = device_scope(context);
  c.data = Buffer(context, parsed.data.size());
  if (cuda)
    cuda::copy(c.data.data(), parsed.data.data(), parsed.data.size(), stream, false);
  else if (!parsed.data.empty())
    std::memcpy(c.data.data(), parsed.data.data(), parsed.data.size());
  const int64_t len = static_cast<int64_t>(c.suffix_positions.size());
  c.suffix_len = 0;
  reserve_suffix(c, len, stream);
  if (len) {  // exactly sized: [H][len][D], the capacity is len
    if (cuda) {
      cuda::copy(c.suffix_keys.data(), parsed.suffix_keys.data(), parsed.suffix_keys.size(), stream, false);
      cuda::copy(c.suffix_values.data(), parsed.suffix_values.data(), parsed.suffix_values.size(), stream, false);
    } else {
      std::memcpy(c.suffix_keys.data(), parsed.suffix_keys.data(), parsed.suffix_keys.size());
      std::memcpy(c.suffix_values.data(), parsed.suffix_values.data(), parsed.suffix_values.size());
    }
  }
  c.suffix_len = len;
  if (cuda) cuda::upload_view(c, stream);  // waits: the host copies above are then complete
  return std::move(parsed.cache);
}

ParsedCache parse_bytes(const std::vector<uint8_t> &bytes) { return deserialize_cache(bytes.data(), bytes.size()); }

// Dense K^/V^ of a host cache into host tensors [H][T][D] (see akv_cache_reconstruct).
void reconstruct_host(const akv_cache &c, akv_dtype dtype, int32_t rotated, void *keys, void *values,
                      uint8_t *present) {
  const int64_t H = c.meta.shape.num_kv_heads, D = c.meta.shape.head_dim, T = c.total_tokens();
  c.context->pool->parallel_for(H, [&](int64_t b, int64_t e) {
    std::vector<float> k(T * D), v(T * D);
    for (int64_t h = b; h < e; ++h) {
      reconstruct_head_cpu(c, static_cast<int>(h), rotated != 0, k.data(), v.data(), present ? present + h * T : nullptr);
      for (int64_t i = 0; i < T * D; ++i) {
        store_from_float(keys, dtype, h * T * D + i, k[i]);
        store_from_float(values, dtype, h * T * D + i, v[i]);
      }
    }
  });
}

void record_and_maybe_compact(akv_cache &c, const float *q, int32_t q_len);

void decode_batch_cpu(akv_cache *const *caches, int32_t batch, const void *queries, akv_dtype dtype,
                      int32_t q_len, void *out, float *lse = nullptr) {
  const akv_shape &s0 = caches[0]->meta.shape;
  const int H = s0.num_kv_heads, Hq = s0.num_q_heads, D = s0.head_dim, G = Hq / H;
  const size_t per_request = static_cast<size_t>(Hq) * q_len * D;
  const std::vector<float> q = to_float(queries, dtype, per_request * batch, "queries");
  std::vector<float> o(per_request * batch);
  // Work items are (request, group of heads): as many groups per request as it takes to keep
  // every worker busy, so that heads in a group share their walk over the prefix.
  ThreadPool &pool = *caches[0]->context->pool;
  const int groups = std::min(H, std::max(1, (pool.size() + batch - 1) / batch));
  pool.parallel_for(static_cast<int64_t>(batch) * groups, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const int64_t r = i / groups;
      const int grp = static_cast<int>(i % groups);
      const int h0 = H * grp / groups, h1 = H * (grp + 1) / groups;
      const size_t off = r * per_request + static_cast<size_t>(h0) * G * q_len * D;
      float *row_lse = lse ? lse + (r * Hq + static_cast<size_t>(h0) * G) * q_len : nullptr;
      decode_heads_cpu(*caches[r], h0, h1, q.data() + off, q_len, o.data() + off, row_lse);
    }
  });
  for (size_t i = 0; i < o.size(); ++i) store_from_float(out, dtype, i, o[i]);
  for (int32_t r = 0; r < batch; ++r) record_and_maybe_compact(*caches[r], q.data() + r * per_request, q_len);
}

void validate_decode(const akv_cache *c, int32_t q_len) {
  if (q_len < 1) fail(AKV_ERR_INVALID_ARGUMENT, "q_len ", q_len, " must be at least 1");
  if (q_len - 1 > c->suffix_len)
    fail(AKV_ERR_INVALID_ARGUMENT, "q_len ", q_len, " needs at least ", q_len - 1,
         " appended tokens (the new queries' own keys), but the cache has ", c->suffix_len);
}

akv_status decode_one(const char *function, akv_cache *cache, const void *queries, akv_dtype dtype, int32_t q_len,
                      void *out, float *lse, void *stream) {
  return guard(function, [&] {
    validate_cache(cache);
    check_not_null(queries, "queries");
    check_not_null(out, "out");
    check_input_dtype(dtype, "dtype");
    validate_decode(cache, q_len);
    if (on_cuda(cache->context))
      cuda::decode(*cache->context, &cache, 1, queries, dtype, q_len, out, lse, stream);
    else
      decode_batch_cpu(&cache, 1, queries, dtype, q_len, out, lse);
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
    if (on_cuda(context))
      cuda::decode(*context, caches, batch, queries, dtype, q_len, out, lse, stream);
    else
      decode_batch_cpu(caches, batch, queries, dtype, q_len, out, lse);
  });
}

// The compacted form of `c` swapped into it (akv_cache_compact). q: [Hq][W][D] fp32 host. The
// suffix reservation is kept. A CUDA cache goes through the host staging context: copied
// down, compacted by the CPU code, placed back in new device buffers. `c` is unchanged on
// failure.
void compact_in_place(akv_cache &c, const float *q, int64_t headroom, void *stream) {
  const int64_t capacity = c.suffix_capacity;
  std::unique_ptr<akv_cache> fresh;
  if (on_cuda(c.context)) {
    std::unique_ptr<akv_cache> host = place(&host_staging(*c.context), parse_bytes(serialize_any(c, stream)), stream);
    std::unique_ptr<akv_cache> compact = compact_cache_cpu(*host, host->context, q, headroom);
    fresh = place(c.context, parse_bytes(serialize_cache(*compact, compact->data.data(), nullptr, nullptr)), stream);
  } else {
    fresh = compact_cache_cpu(c, c.context, q, headroom);
    require_finite_storage(*fresh, fresh->data.data(), AKV_ERR_NON_FINITE,
                           "the compacted cache would hold");  // reconstruction overflow (f16)
  }
  reserve_suffix(*fresh, capacity, stream);
  fresh->recent_queries = std::move(c.recent_queries);
  fresh->recent_tokens = std::move(c.recent_tokens);
  c = std::move(*fresh);
}

// Automatic compaction (compress_options.compact_after, CPU): records the queries of the
// q_len tokens just decoded, then compacts once the suffix exceeds the threshold and the
// queries of the last W tokens are all recorded. q: [Hq][q_len][D] fp32.
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
      std::memcpy(&window[(hq * W + w) * D], &c.recent_queries[(((T - W + w) % W) * Hq + hq) * D], D * sizeof(float));
  compact_in_place(c, window.data(), n, nullptr);
}

}  // namespace

extern "C" {

AKV_API unsigned akv_version_number(void) { return AKV_VERSION_NUMBER; }
AKV_API const char *akv_version_string(void) { return AKV_VERSION_STRING; }

AKV_API void akv_context_options_init(akv_context_options *o) {
  if (!o) return;
  std::memset(o, 0, sizeof *o);
  o->struct_size = sizeof *o;
  o->backend = AKV_BACKEND_CPU;
}

AKV_API akv_status akv_context_create(const akv_context_options *options, akv_context **out) {
  return guard(__func__, [&] {
    check_not_null(out, "out_context");
    akv_context_options defaults;
    akv_context_options_init(&defaults);
    const akv_context_options o = versioned_copy(options, defaults, "options");
    check_enum(raw_enum(o.backend), AKV_BACKEND_CPU, AKV_BACKEND_CUDA, "backend");
    if ((o.allocator.alloc == nullptr) != (o.allocator.free == nullptr))
      fail(AKV_ERR_INVALID_ARGUMENT, "allocator: set both alloc and free, or neither");
    if (o.num_threads < 0 || o.num_threads > kMaxThreads)
      fail(AKV_ERR_INVALID_ARGUMENT, "num_threads ", o.num_threads, " must be in [0, ", kMaxThreads,
           "] (0 = every hardware thread)");
    auto ctx = std::make_unique<akv_context>();
    ctx->backend = o.backend;
    ctx->device = o.device;
    if (o.backend == AKV_BACKEND_CUDA) {
      cuda::check_device(o.device);
      ctx->allocator = {default_device_alloc, default_device_free,
                        reinterpret_cast<void *>(static_cast<intptr_t>(o.device))};
    } else {
      ctx->allocator = {default_host_alloc, default_host_free, nullptr};
    }
    if (o.allocator.alloc) ctx->allocator = o.allocator;
    ctx->pool = std::make_unique<ThreadPool>(o.num_threads);
    *out = ctx.release();
  });
}

AKV_API void akv_context_destroy(akv_context *context) { delete context; }

AKV_API void akv_compress_options_init(akv_compress_options *o) {
  if (!o) return;
  std::memset(o, 0, sizeof *o);
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
  o->coverage_rounds = 4;
}

AKV_API void akv_compress_options_init_paper(akv_compress_options *o) {
  if (!o) return;
  akv_compress_options_init(o);
  o->scored_fraction = 0.7;
  o->sink_tokens = 0;
  o->fill_budget = 0;
  o->anchor_share = 0.0;
  o->guard_fraction = 0.0;
  o->coverage_rounds = 0;
}

AKV_API void akv_compress_options_init_method(akv_compress_options *o, akv_method method) {
  if (!o) return;
  akv_compress_options_init(o);
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
    case AKV_METHOD_QUANTIZED:  // the paper's TurboQuant reproduction (App. B.5): b=3, k=4
      o->window = 128;
      o->quant_bits = 3;
      o->quant_outliers = 4;
      o->retain_fraction = 1.0;
      break;
    default:
      break;
  }
}

AKV_API void akv_prefill_init(akv_prefill *p) {
  if (!p) return;
  std::memset(p, 0, sizeof *p);
  p->struct_size = sizeof *p;
  p->dtype = AKV_DTYPE_BF16;
}

namespace {

akv_compress_options resolve_options(const akv_compress_options *options) {
  akv_compress_options defaults;
  akv_compress_options_init(&defaults);
  akv_compress_options o = versioned_copy(options, defaults, "options");
  // Every enum field first, as integers (see raw_enum).
  check_enum(raw_enum(o.method), AKV_METHOD_FULLKV, AKV_METHOD_QUANTIZED, "method");
  check_enum(raw_enum(o.pool_type), AKV_POOL_AVG, AKV_POOL_MAX, "pool_type");
  check_enum(raw_enum(o.residual_scale), AKV_SCALE_LEAST_SQUARES, AKV_SCALE_ABSMAX, "residual_scale");
  check_enum(raw_enum(o.rope.style), AKV_ROPE_NONE, AKV_ROPE_GPTJ, "rope.style");
  const int32_t storage = raw_enum(o.storage_dtype);
  if (storage != AKV_DTYPE_AUTO && storage != AKV_DTYPE_BF16 && storage != AKV_DTYPE_F16)
    fail(AKV_ERR_INVALID_ARGUMENT, "storage_dtype ", dtype_label(storage), " must be auto, f16 or bf16");
  check_option_ranges(o, AKV_ERR_INVALID_ARGUMENT, "");
  return o;
}

void validate_shape(const akv_shape &s) {
  if (s.seq_len <= 0) fail(AKV_ERR_INVALID_ARGUMENT, "shape.seq_len ", s.seq_len, " must be positive");
  if (s.seq_len > (int64_t{1} << 31) - 1) fail(AKV_ERR_UNSUPPORTED, "shape.seq_len ", s.seq_len, " exceeds int32 positions");
  if (s.num_kv_heads <= 0) fail(AKV_ERR_INVALID_ARGUMENT, "shape.num_kv_heads ", s.num_kv_heads, " must be positive");
  if (s.num_q_heads <= 0 || s.num_q_heads % s.num_kv_heads != 0)
    fail(AKV_ERR_INVALID_ARGUMENT, "shape.num_q_heads ", s.num_q_heads, " must be a positive multiple of num_kv_heads ", s.num_kv_heads);
  if (s.num_kv_heads > kMaxKvHeads) fail(AKV_ERR_UNSUPPORTED, "shape.num_kv_heads ", s.num_kv_heads, " exceeds ", kMaxKvHeads);
  if (s.num_q_heads > kMaxQHeads) fail(AKV_ERR_UNSUPPORTED, "shape.num_q_heads ", s.num_q_heads, " exceeds ", kMaxQHeads);
  if (s.head_dim <= 0 || s.head_dim % 2 != 0)
    fail(AKV_ERR_INVALID_ARGUMENT, "shape.head_dim ", s.head_dim, " must be positive and even");
  if (s.head_dim > kMaxHeadDim) fail(AKV_ERR_UNSUPPORTED, "shape.head_dim ", s.head_dim, " exceeds ", kMaxHeadDim);
}

// A paged prefill (akv_prefill.block_table): the table and its ids, before any data is read.
void validate_paged(const akv_prefill &p) {
  if (!p.block_table)
    fail(AKV_ERR_INVALID_ARGUMENT, "prefill.block_table is NULL but block_size, num_blocks or kv_block_stride is set"
         " (a paged prefill needs its block table)");
  if (p.block_size < 1) fail(AKV_ERR_INVALID_ARGUMENT, "prefill.block_size ", p.block_size, " must be at least 1 (paged prefill)");
  if (p.num_blocks < 1) fail(AKV_ERR_INVALID_ARGUMENT, "prefill.num_blocks ", p.num_blocks, " must be at least 1 (paged prefill)");
  if (p.kv_block_stride < 0) fail(AKV_ERR_INVALID_ARGUMENT, "prefill.kv_block_stride ", p.kv_block_stride, " must be >= 0");
  const int64_t blocks = (p.shape.seq_len + p.block_size - 1) / p.block_size;
  for (int64_t i = 0; i < blocks; ++i)
    if (p.block_table[i] < 0 || p.block_table[i] >= p.num_blocks)
      fail(AKV_ERR_INVALID_ARGUMENT, "prefill.block_table[", i, "] = ", p.block_table[i], " is outside [0, num_blocks=",
           p.num_blocks, ")");
}

}  // namespace

AKV_API akv_status akv_compressed_size(const akv_compress_options *options, const akv_shape *shape,
                                       size_t *out_bytes) {
  return guard(__func__, [&] {
    check_not_null(shape, "shape");
    check_not_null(out_bytes, "out_bytes");
    const akv_compress_options o = resolve_options(options);
    validate_shape(*shape);
    *out_bytes = static_cast<size_t>(compressed_footprint(o, *shape));
  });
}

AKV_API akv_status akv_compressed_size_model(const akv_compress_options *options, const akv_shape *shape,
                                             int32_t num_layers, const double *retain_fractions,
                                             size_t *out_layer_bytes, size_t *out_total_bytes) {
  return guard(__func__, [&] {
    check_not_null(shape, "shape");
    check_not_null(out_total_bytes, "out_total_bytes");
    if (num_layers < 1) fail(AKV_ERR_INVALID_ARGUMENT, "num_layers ", num_layers, " must be at least 1");
    akv_compress_options o = resolve_options(options);
    validate_shape(*shape);
    std::vector<size_t> bytes(num_layers);
    size_t total = 0;
    for (int32_t l = 0; l < num_layers; ++l) {
      o.layer_index = l;
      o.layer_count = num_layers;
      if (retain_fractions) {
        o.retain_fraction = retain_fractions[l];
        if (!std::isfinite(o.retain_fraction) || o.retain_fraction <= 0.0 || o.retain_fraction > 1.0)
          fail(AKV_ERR_INVALID_ARGUMENT, "retain_fractions[", l, "] = ", o.retain_fraction, " must be in (0, 1]");
      }
      try {
        bytes[l] = static_cast<size_t>(compressed_footprint(o, *shape));
      } catch (const Error &e) {
        fail(e.status(), "layer ", l, ": ", e.what());
      }
      if (bytes[l] > SIZE_MAX - total) fail(AKV_ERR_INVALID_ARGUMENT, "the model's compressed size overflows size_t");
      total += bytes[l];
    }
    if (out_layer_bytes) std::copy(bytes.begin(), bytes.end(), out_layer_bytes);
    *out_total_bytes = total;
  });
}

AKV_API akv_status akv_compress(akv_context *context, const akv_prefill *prefill,
                                const akv_compress_options *options, akv_cache **out_cache, void *stream) {
  return guard(__func__, [&] {
    check_not_null(context, "context");
    check_not_null(prefill, "prefill");
    check_not_null(out_cache, "out_cache");
    akv_prefill defaults;
    akv_prefill_init(&defaults);
    const akv_prefill p = versioned_copy(prefill, defaults, "prefill");
    const akv_compress_options o = resolve_options(options);
    validate_shape(p.shape);
    check_input_dtype(p.dtype, "prefill.dtype");
    check_not_null(p.keys, "prefill.keys");
    check_not_null(p.values, "prefill.values");
    if (p.kv_head_stride < 0 || p.kv_token_stride < 0 || p.q_head_stride < 0 || p.q_token_stride < 0)
      fail(AKV_ERR_INVALID_ARGUMENT, "prefill strides must be >= 0 (0 = contiguous)");
    if ((p.kv_token_stride && p.kv_token_stride < p.shape.head_dim) || (p.q_token_stride && p.q_token_stride < p.shape.head_dim))
      fail(AKV_ERR_INVALID_ARGUMENT, "prefill token strides must be at least head_dim ", p.shape.head_dim);
    if (p.block_table || p.block_size || p.num_blocks || p.kv_block_stride) validate_paged(p);
    compressed_footprint(o, p.shape);  // shape/budget checks for the method, before reading data
    if (p.positions) {
      for (int64_t t = 1; t < p.shape.seq_len; ++t)
        if (p.positions[t] <= p.positions[t - 1])
          fail(AKV_ERR_INVALID_ARGUMENT, "prefill.positions are not strictly increasing at index ", t, " (",
               p.positions[t - 1], " then ", p.positions[t], ")");
      if (p.positions[0] < 0) fail(AKV_ERR_INVALID_ARGUMENT, "prefill.positions[0] ", p.positions[0], " is negative");
    }
    if (on_cuda(context)) {
      if (o.compact_after > 0)
        fail(AKV_ERR_UNSUPPORTED, "compact_after (automatic compaction) needs a CPU context: on CUDA, call "
             "akv_cache_compact between decodes (it synchronises)");
      cuda::check_supported(o.method, p.shape.head_dim);
      const CompressRequest req{context, &p, &o};
      std::unique_ptr<akv_cache> cache = o.method == AKV_METHOD_ANCHORKV ? cuda::compress_anchorkv_cuda(req, stream)
                                         : o.method == AKV_METHOD_FULLKV ? cuda::compress_fullkv_cuda(req, stream)
                                                                         : cuda::compress_eviction_cuda(req, stream);
      cuda::upload_view(*cache, stream);
      *out_cache = cache.release();
      return;
    }
    CompressRequest req{context, &p, &o};
    std::unique_ptr<akv_cache> cache = compress_method_cpu(req);
    // Finite inputs can still overflow: f32 keys above 65504 stored as f16, or values near the
    // fp32 limit through RoPE and the coefficients. A stored NaN or Inf would make every
    // decode NaN and the serialized cache unreadable (the deserializer refuses it).
    require_finite_storage(*cache, cache->data.data(), AKV_ERR_NON_FINITE,
                           "an input overflows the storage dtype or fp32: the compressed cache would hold");
    *out_cache = cache.release();
  });
}

AKV_API void akv_cache_destroy(akv_cache *cache) { delete cache; }

AKV_API akv_status akv_cache_reserve(akv_cache *cache, int64_t tokens, void *stream) {
  return guard(__func__, [&] {
    validate_cache(cache);
    if (tokens < 0) fail(AKV_ERR_INVALID_ARGUMENT, "tokens ", tokens, " is negative");
    reserve_suffix(*cache, tokens, stream);
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
    akv_cache &c = *cache;
    const int64_t H = c.meta.shape.num_kv_heads, D = c.meta.shape.head_dim;
    std::vector<int32_t> pos(num_tokens);
    for (int32_t i = 0; i < num_tokens; ++i) {
      const int64_t p = positions ? positions[i] : c.next_position + i;
      const int64_t floor = i == 0 ? c.next_position : static_cast<int64_t>(pos[i - 1]) + 1;
      if (p < floor) fail(AKV_ERR_INVALID_ARGUMENT, "positions[", i, "] = ", p, " must be at least ", floor,
                          " (strictly increasing, after every cached position)");
      if (p > INT32_MAX) fail(AKV_ERR_INVALID_ARGUMENT, "positions exceed int32");
      pos[i] = static_cast<int32_t>(p);
    }
    if (on_cuda(c.context)) {  // device tensors: not scanned for NaN/Inf (that would need a sync)
      if (c.suffix_len + num_tokens > c.suffix_capacity)
        reserve_suffix(c, std::max<int64_t>(c.suffix_len + num_tokens, 2 * c.suffix_capacity + 16), stream);
      cuda::append(c, keys, values, dtype, num_tokens, pos.data(), stream);
      c.suffix_positions.insert(c.suffix_positions.end(), pos.begin(), pos.end());
      c.suffix_len += num_tokens;
      c.next_position = static_cast<int64_t>(pos.back()) + 1;
      return;
    }
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
      reserve_suffix(c, std::max<int64_t>(c.suffix_len + num_tokens, 2 * c.suffix_capacity + 16), stream);
    uint16_t *sk = reinterpret_cast<uint16_t *>(c.suffix_keys.data());
    uint16_t *sv = reinterpret_cast<uint16_t *>(c.suffix_values.data());
    for (int64_t h = 0; h < H; ++h)
      for (int32_t i = 0; i < num_tokens; ++i) {
        const size_t row = static_cast<size_t>(h * num_tokens + i) * D;
        const int64_t dst = (h * c.suffix_capacity + c.suffix_len + i) * D;
        std::memcpy(sk + dst, &hk[row], D * sizeof(uint16_t));
        std::memcpy(sv + dst, &hv[row], D * sizeof(uint16_t));
      }
    c.suffix_positions.insert(c.suffix_positions.end(), pos.begin(), pos.end());
    c.suffix_len += num_tokens;
    c.next_position = static_cast<int64_t>(pos.back()) + 1;
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
    if (c.suffix_len < c.meta.window)
      fail(AKV_ERR_INVALID_ARGUMENT, "compaction needs at least window=", c.meta.window,
           " appended tokens (they become the new window), but the cache has ", c.suffix_len);
    const size_t n = static_cast<size_t>(c.meta.shape.num_q_heads) * c.meta.window * c.meta.shape.head_dim;
    std::vector<float> q(n);
    if (on_cuda(c.context)) {
      std::vector<uint8_t> raw(n * dtype_size(dtype));
      cuda::copy(raw.data(), queries, raw.size(), stream, true);
      q = to_float(raw.data(), dtype, n, "queries");
    } else {
      q = to_float(queries, dtype, n, "queries");
    }
    compact_in_place(c, q.data(), headroom_tokens, stream);
  });
}

AKV_API akv_status akv_cache_stats_get(const akv_cache *cache, akv_cache_stats *out) {
  return guard(__func__, [&] {
    validate_cache(cache);
    check_not_null(out, "out_stats");
    if (out->struct_size == 0 || out->struct_size > sizeof(akv_cache_stats))
      fail(AKV_ERR_INVALID_ARGUMENT, "out_stats->struct_size ", out->struct_size, " is not valid (expected ",
           sizeof(akv_cache_stats), ")");
    const akv_cache &c = *cache;
    akv_cache_stats s;
    std::memset(&s, 0, sizeof s);
    s.struct_size = out->struct_size;
    s.method = c.meta.method;
    s.shape = c.meta.shape;
    s.storage_dtype = c.meta.storage;
    s.window = c.meta.method == AKV_METHOD_FULLKV ? 0 : c.meta.window;
    s.anchors = c.meta.anchors;
    s.appended_tokens = c.suffix_len;
    s.append_capacity = c.suffix_capacity;
    s.full_bytes = 4ull * c.meta.shape.seq_len * c.meta.shape.num_kv_heads * c.meta.shape.head_dim;
    s.budget_bytes = c.meta.method == AKV_METHOD_ANCHORKV ? c.geometry.budget_bytes
                     : c.meta.method == AKV_METHOD_FULLKV
                         ? s.full_bytes
                         : static_cast<uint64_t>(std::floor(c.meta.retain_fraction * static_cast<double>(s.full_bytes)));
    s.base_bytes = c.meta.method == AKV_METHOD_ANCHORKV ? c.geometry.base_bytes : 0;
    s.compressed_bytes = c.footprint;
    s.appended_bytes = 4ull * c.suffix_len * c.meta.shape.num_kv_heads * c.meta.shape.head_dim;
    s.allocated_bytes = c.allocated_bytes();
    s.ratio = static_cast<double>(s.full_bytes) / static_cast<double>(c.footprint);
    s.key_residuals = c.meta.key_residuals;
    s.value_residuals = c.meta.value_residuals;
    s.compactions = c.compactions;
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
    if (c.meta.method == AKV_METHOD_ANCHORKV) {
      offsets.resize(2 * (H + 1));
      const size_t bytes = (H + 1) * sizeof(uint32_t);
      if (on_cuda(c.context)) {
        cuda::copy(offsets.data(), c.section<uint32_t>(kKeyOffsets), bytes, nullptr, false);
        cuda::copy(offsets.data() + H + 1, c.section<uint32_t>(kValueOffsets), bytes, nullptr, true);
      } else {
        std::memcpy(offsets.data(), c.section<uint32_t>(kKeyOffsets), bytes);
        std::memcpy(offsets.data() + H + 1, c.section<uint32_t>(kValueOffsets), bytes);
      }
    }
    for (int h = 0; h < H; ++h) {
      akv_head_stats s{};
      if (c.meta.method == AKV_METHOD_ANCHORKV) {
        s.kept_tokens = c.meta.shape.seq_len;
        s.anchors = c.meta.anchors;
        const uint32_t *ko = offsets.data(), *vo = offsets.data() + H + 1;
        s.key_residuals = ko[h + 1] - ko[h];
        s.value_residuals = vo[h + 1] - vo[h];
      } else if (c.meta.method == AKV_METHOD_QUANTIZED) {
        s.kept_tokens = c.meta.shape.seq_len;  // every token, the window exact
        s.anchors = c.meta.window;
      } else {  // FullKV and eviction: exact kept tokens
        s.kept_tokens = c.meta.dense_counts[h];
        s.anchors = c.meta.dense_counts[h];
      }
      out[h] = s;
    }
  });
}

AKV_API akv_status akv_cache_reconstruct(const akv_cache *cache, akv_dtype dtype, int32_t rotated,
                                         void *keys, void *values, uint8_t *present, void *stream) {
  return guard(__func__, [&] {
    validate_cache(cache);
    check_not_null(keys, "keys");
    check_not_null(values, "values");
    check_input_dtype(dtype, "dtype");
    if (on_cuda(cache->context)) {  // through a host copy of the cache (a test and tooling path)
      std::unique_ptr<akv_cache> host = place(&host_staging(*cache->context), parse_bytes(serialize_any(*cache, stream)), stream);
      const int64_t n = static_cast<int64_t>(host->meta.shape.num_kv_heads) * host->total_tokens();
      const size_t bytes = static_cast<size_t>(n) * host->meta.shape.head_dim * dtype_size(dtype);
      std::vector<uint8_t> k(bytes), v(bytes), pr(present ? n : 0);
      reconstruct_host(*host, dtype, rotated, k.data(), v.data(), present ? pr.data() : nullptr);
      cuda::copy(keys, k.data(), bytes, stream, false);
      cuda::copy(values, v.data(), bytes, stream, false);
      if (present) cuda::copy(present, pr.data(), pr.size(), stream, false);
      cuda::synchronize(stream);  // the host vectors go out of scope
      return;
    }
    reconstruct_host(*cache, dtype, rotated, keys, values, present);
  });
}

AKV_API akv_status akv_cache_serialized_size(const akv_cache *cache, size_t *out_bytes) {
  return guard(__func__, [&] {
    validate_cache(cache);
    check_not_null(out_bytes, "out_bytes");
    *out_bytes = serialized_size(*cache);
  });
}

AKV_API akv_status akv_cache_serialize(const akv_cache *cache, void *buffer, size_t capacity,
                                       size_t *out_written, void *stream) {
  return guard(__func__, [&] {
    validate_cache(cache);
    check_not_null(buffer, "buffer");
    const std::vector<uint8_t> bytes = serialize_any(*cache, stream);
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
    *out_cache = place(context, deserialize_cache(static_cast<const uint8_t *>(buffer), size), stream).release();
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
