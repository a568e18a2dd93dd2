// The CUDA backend as the C shims see it: memory movement, the device-side view of a cache,
// decode and append. Implemented in backend.cu when the build has the CUDA backend; the
// stubs in runtime_stub.cpp report the backend as unavailable (a CUDA context cannot exist
// in such a build, so they are never reached through the API).
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include "core/context.hpp"
#include "methods/methods.hpp"

namespace akv {
namespace cuda {

// Copy between any host or device pointers (unified addressing), ordered on `stream`;
// `wait` returns only once the copy is complete (needed before host memory is read or freed).
void copy(void *dst, const void *src, size_t bytes, void *stream, bool wait);
// Copy `rows` rows of `row_bytes` between pitched buffers, ordered on `stream`.
void copy_rows(void *dst, size_t dst_pitch, const void *src, size_t src_pitch, size_t row_bytes, size_t rows,
               void *stream);
void synchronize(void *stream);

// The stream's scratch memory for one use (akv_context::kDecodeWorkspace or
// kCompressWorkspace), grown through the context's allocator when `bytes` exceed it; growing
// synchronises the stream and is refused while the stream is being captured.
void *workspace(akv_context &context, size_t bytes, void *stream, int use);

// AnchorKV compression of device tensors on the device (cuda/compress.cu); waits for the
// work at the end (the non-finite input check). The cache is returned without its view.
std::unique_ptr<akv_cache> compress_anchorkv_cuda(const CompressRequest &request, void *stream);
// FullKV on the device: keys rotated and both sides stored in the storage dtype.
std::unique_ptr<akv_cache> compress_fullkv_cuda(const CompressRequest &request, void *stream);
// The eviction baselines on the device (scores, radix sorts, gathered storage).
std::unique_ptr<akv_cache> compress_eviction_cuda(const CompressRequest &request, void *stream);

// (Re)builds cache.device_view from the cache's device buffers and host length; call after
// any change of those buffers (deserialize, reserve). Synchronous.
void upload_view(akv_cache &cache, void *stream);

// akv_decode_batch for caches of one CUDA context (validated by the caller): queries and out
// are device tensors [batch][Hq][q_len][D]. Asynchronous; no allocation once this batch
// shape has run on this stream (the workspace is kept per stream), so it can be captured.
// lse: optional device [batch][Hq][q_len] fp32, each row's natural log-sum-exp.
void decode(akv_context &context, akv_cache *const *caches, int32_t batch, const void *queries, akv_dtype dtype,
            int32_t q_len, void *out, float *lse, void *stream);

// Writes n tokens (device keys/values [H][n][D], positions already validated) after the
// cache's appended tokens and advances the device-side length. Capacity must be reserved.
void append(akv_cache &cache, const void *keys, const void *values, akv_dtype dtype, int32_t n,
            const int32_t *positions, void *stream);

}  // namespace cuda
}  // namespace akv
