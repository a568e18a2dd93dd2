// The CUDA backend behind an akv_context (core/backend.hpp): caches in device memory, the
// device passes of backend.cu and compress.cu, and the host staging of what runs on the CPU
// (compaction, reconstruct), which goes through a CPU context by the same interface. Plain
// C++: in a build without CUDA the device operations are stubs and no CUDA context exists.
#include <algorithm>
#include <cstring>
#include <memory>
#include <optional>
#include <vector>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "core/method_traits.hpp"
#include "core/serialize.hpp"
#include "cuda/backend.hpp"
#include "cuda/plan.hpp"
#include "cuda/runtime.hpp"

namespace akv {
namespace cuda {
namespace {

void *default_alloc(void *user, size_t bytes) {
  return device_malloc(static_cast<int>(reinterpret_cast<intptr_t>(user)), bytes);
}
void default_free(void *user, void *p, size_t) { device_free(static_cast<int>(reinterpret_cast<intptr_t>(user)), p); }

ParsedCache parse_bytes(const std::vector<uint8_t> &bytes) { return deserialize_cache(bytes.data(), bytes.size()); }

}  // namespace

CudaBackend::CudaBackend(akv_context &ctx) : context(ctx) {
  check_device(ctx.device);
  if (!ctx.allocator.alloc)
    ctx.allocator = {default_alloc, default_free, reinterpret_cast<void *>(static_cast<intptr_t>(ctx.device))};
}

CudaBackend::~CudaBackend() {
  blas.reset();
  for (auto &entry : workspaces) deallocate(entry.second.ptr, entry.second.bytes);
}

// The hooks run with the context's device current (a torch-style allocator places memory on
// the current device), and the caller's current device is left as it was.
void *CudaBackend::allocate(size_t bytes) {
  if (bytes == 0) return nullptr;
  DeviceScope scope(context.device);
  void *p = context.allocator.alloc(context.allocator.user_data, bytes);
  if (!p) fail(AKV_ERR_OUT_OF_MEMORY, "the allocator returned NULL for ", bytes, " bytes");
  return p;
}

void CudaBackend::deallocate(void *ptr, size_t bytes) noexcept {
  if (!ptr) return;
  std::optional<DeviceScope> scope;
  try {
    scope.emplace(context.device);
  } catch (...) {  // free from the current device rather than leak
  }
  context.allocator.free(context.allocator.user_data, ptr, bytes);
}

void CudaBackend::check_compress(const akv_compress_options &o, const akv_shape &shape) {
  if (o.compact_after > 0)
    fail(AKV_ERR_UNSUPPORTED, "compact_after (automatic compaction) needs a CPU context: on CUDA, call "
         "akv_cache_compact between decodes (it synchronises)");
  check_supported(o.method, shape.head_dim);
}

std::unique_ptr<akv_cache> CudaBackend::compress(const CompressRequest &req, void *stream) {
  const MethodTraits &traits = method_traits(req.options->method);  // check_compress: not quantized
  std::unique_ptr<akv_cache> cache = traits.storage == Storage::kAnchor ? compress_anchorkv_cuda(req, stream)
                                     : traits.evicting                  ? compress_eviction_cuda(req, stream)
                                                                        : compress_fullkv_cuda(req, stream);
  upload_view(*cache, stream);
  return cache;
}

// Device buffers; the device view is rebuilt (synchronous; not for use while capturing).
void CudaBackend::reserve(akv_cache &c, int64_t tokens, void *stream) {
  if (tokens <= c.suffix_capacity) return;
  if (tokens > INT32_MAX) fail(AKV_ERR_INVALID_ARGUMENT, "tokens ", tokens, " exceeds int32");
  DeviceScope scope(context.device);
  const int64_t H = c.meta.shape.num_kv_heads, D = c.meta.shape.head_dim;
  const size_t row = static_cast<size_t>(D) * 2;
  Buffer keys(&context, H * tokens * row), values(&context, H * tokens * row);
  copy_rows(keys.data(), tokens * row, c.suffix_keys.data(), c.suffix_capacity * row, c.suffix_len * row, H, stream);
  copy_rows(values.data(), tokens * row, c.suffix_values.data(), c.suffix_capacity * row, c.suffix_len * row, H,
            stream);
  synchronize(stream);  // before the old buffers are freed
  c.suffix_keys = std::move(keys);
  c.suffix_values = std::move(values);
  c.suffix_capacity = tokens;
  upload_view(c, stream);
}

// Device tensors: not scanned for NaN/Inf (that would need a sync). Under graph capture the
// tokens take their positions on the device (so every replay continues from the last one)
// and the host's record stays as it was until sync_appended reads the device's.
void CudaBackend::append(akv_cache &c, const void *keys, const void *values, akv_dtype dtype, int32_t n,
                         const int32_t *positions, bool implicit, void *stream) {
  if (cuda::capturing(stream)) {
    if (!implicit)
      fail(AKV_ERR_INVALID_ARGUMENT, "akv_append under CUDA-graph capture takes positions = NULL (each replay continues "
           "from the cache's last position on the device); explicit positions would be replayed unchanged");
    if (c.suffix_len + n > c.suffix_capacity)
      fail(AKV_ERR_INVALID_ARGUMENT, "akv_append under CUDA-graph capture cannot grow the reservation (", c.suffix_capacity,
           " tokens, ", c.suffix_len, " used); call akv_cache_reserve with room for every replay before capturing");
    cuda::append(c, keys, values, dtype, n, nullptr, stream);
    c.appended_on_device = true;
    return;
  }
  if (c.suffix_len + n > c.suffix_capacity)
    reserve(c, std::max<int64_t>(c.suffix_len + n, 2 * c.suffix_capacity + 16), stream);
  cuda::append(c, keys, values, dtype, n, positions, stream);  // the record is current (sync_appended ran)
  c.record_appended(positions, n);
}

void CudaBackend::sync_appended(akv_cache &c, void *stream) {
  if (!c.appended_on_device || cuda::capturing(stream)) return;
  const cuda::AppendedOnDevice d = cuda::read_appended(c, c.suffix_len);
  c.suffix_positions.resize(static_cast<size_t>(c.suffix_len));
  c.suffix_positions.insert(c.suffix_positions.end(), d.positions.begin(), d.positions.end());
  c.suffix_len = d.length;
  c.next_position = d.next_position;
  c.appended_on_device = false;
  if (d.dropped)
    fail(AKV_ERR_CAPACITY, d.dropped, " appended tokens were dropped: replays of a captured akv_append ran past the ",
         "reservation of ", c.suffix_capacity, " tokens (the cache keeps the first ", c.suffix_len,
         "); reserve room for every replay (akv_cache_reserve) before capturing");
}

void CudaBackend::decode(akv_cache *const *caches, int32_t batch, const void *queries, akv_dtype dtype, int32_t q_len,
                         void *out, float *lse, void *stream) {
  cuda::decode(context, caches, batch, queries, dtype, q_len, out, lse, stream);
}

akv_context &CudaBackend::staging() {
  std::lock_guard<std::mutex> lock(mutex);
  if (!host_staging) {
    auto host = std::make_unique<akv_context>();
    host->impl = make_cpu_backend(*host);
    host->pool = std::make_unique<ThreadPool>(context.pool->size());
    host_staging = std::move(host);
  }
  return *host_staging;
}

// Copied down, compacted by the CPU backend, placed back in new device buffers. The suffix
// reservation is kept; `c` is unchanged on failure.
void CudaBackend::compact(akv_cache &c, const void *queries, akv_dtype dtype, int64_t headroom, void *stream) {
  const size_t n = static_cast<size_t>(c.meta.shape.num_q_heads) * c.meta.window * c.meta.shape.head_dim;
  std::vector<uint8_t> q(n * dtype_size(dtype));
  read(q.data(), queries, q.size(), stream);
  Backend &host = *staging().impl;
  std::unique_ptr<akv_cache> staged = host.place(parse_bytes(serialize(c, stream)), stream);
  host.compact(*staged, q.data(), dtype, headroom, stream);
  std::unique_ptr<akv_cache> fresh = place(parse_bytes(host.serialize(*staged, stream)), stream);
  reserve(*fresh, c.suffix_capacity, stream);
  fresh->recent_queries = std::move(c.recent_queries);
  fresh->recent_tokens = std::move(c.recent_tokens);
  c = std::move(*fresh);
}

// Through a host copy of the cache (a test and tooling path).
void CudaBackend::reconstruct(const akv_cache &c, akv_dtype dtype, int32_t rotated, void *keys, void *values,
                              uint8_t *present, void *stream) {
  Backend &host = *staging().impl;
  std::unique_ptr<akv_cache> staged = host.place(parse_bytes(serialize(c, stream)), stream);
  const int64_t n = static_cast<int64_t>(staged->meta.shape.num_kv_heads) * staged->total_tokens();
  const size_t bytes = static_cast<size_t>(n) * staged->meta.shape.head_dim * dtype_size(dtype);
  std::vector<uint8_t> k(bytes), v(bytes), pr(present ? n : 0);
  host.reconstruct(*staged, dtype, rotated, k.data(), v.data(), present ? pr.data() : nullptr, stream);
  copy(keys, k.data(), bytes, stream, false);
  copy(values, v.data(), bytes, stream, false);
  if (present) copy(present, pr.data(), pr.size(), stream, false);
  synchronize(stream);  // the host vectors go out of scope
}

void CudaBackend::read(void *host_dst, const void *src, size_t bytes, void *stream) {
  copy(host_dst, src, bytes, stream, true);
}

std::vector<uint8_t> CudaBackend::serialize(const akv_cache &c, void *stream) {
  std::vector<uint8_t> data(c.data.size()), keys(c.suffix_keys.size()), values(c.suffix_values.size());
  copy(data.data(), c.data.data(), data.size(), stream, false);
  copy(keys.data(), c.suffix_keys.data(), keys.size(), stream, false);
  copy(values.data(), c.suffix_values.data(), values.size(), stream, true);
  return serialize_cache(c, data.data(), keys.data(), values.data());
}

std::unique_ptr<akv_cache> CudaBackend::place(ParsedCache parsed, void *stream) {
  akv_cache &c = *parsed.cache;
  c.context = &context;
  check_decodable(c);
  DeviceScope scope(context.device);
  c.data = Buffer(&context, parsed.data.size());
  copy(c.data.data(), parsed.data.data(), parsed.data.size(), stream, false);
  const int64_t len = static_cast<int64_t>(c.suffix_positions.size());
  c.suffix_len = 0;
  reserve(c, len, stream);
  if (len) {  // exactly sized: [H][len][D], the capacity is len
    copy(c.suffix_keys.data(), parsed.suffix_keys.data(), parsed.suffix_keys.size(), stream, false);
    copy(c.suffix_values.data(), parsed.suffix_values.data(), parsed.suffix_values.size(), stream, false);
  }
  c.suffix_len = len;
  upload_view(c, stream);  // waits: the host copies above are then complete
  return std::move(parsed.cache);
}

}  // namespace cuda

std::unique_ptr<Backend> make_cuda_backend(akv_context &context) {
  return std::make_unique<cuda::CudaBackend>(context);
}

}  // namespace akv
