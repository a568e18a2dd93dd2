// The CUDA backend: its state per context (CudaBackend, implementing core/backend.hpp in
// cuda_backend.cpp) and the device operations it is made of: memory movement, the device-side
// view of a cache, compression, decode and append. The device operations are implemented in
// backend.cu and compress.cu when the build has the CUDA backend; the stubs in
// runtime_stub.cpp report the backend as unavailable (a CUDA context cannot exist in such a
// build, so they are never reached through the API).
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <utility>
#include "core/backend.hpp"
#include "core/context.hpp"
#include "methods/methods.hpp"

namespace akv {
namespace cuda {

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(akv_context &context);
  ~CudaBackend() override;

  void *allocate(size_t bytes) override;
  void deallocate(void *ptr, size_t bytes) noexcept override;
  void check_compress(const akv_compress_options &options, const akv_shape &shape) override;
  std::unique_ptr<akv_cache> compress(const CompressRequest &request, void *stream) override;
  void reserve(akv_cache &cache, int64_t tokens, void *stream) override;
  void append(akv_cache &cache, const void *keys, const void *values, akv_dtype dtype, int32_t n,
              const int32_t *positions, bool implicit, void *stream) override;
  void sync_appended(akv_cache &cache, void *stream) override;
  void decode(akv_cache *const *caches, int32_t batch, const void *queries, akv_dtype dtype, int32_t q_len, void *out,
              float *lse, void *stream) override;
  void compact(akv_cache &cache, const void *queries, akv_dtype dtype, int64_t headroom, void *stream) override;
  void reconstruct(const akv_cache &cache, akv_dtype dtype, int32_t rotated, void *keys, void *values,
                   uint8_t *present, void *stream) override;
  void read(void *host_dst, const void *src, size_t bytes, void *stream) override;
  std::vector<uint8_t> serialize(const akv_cache &cache, void *stream) override;
  std::unique_ptr<akv_cache> place(ParsedCache parsed, void *stream) override;

  akv_context &context;
  // Device properties (read once) and scratch memory per (stream, use), grown on demand and
  // kept so that a decode can be captured in a CUDA graph. Decode and compression have
  // separate workspaces: compressing a new request on a stream never moves the memory a
  // captured decode on that stream uses.
  int sm_count = 0;
  size_t smem_optin = 0;
  bool memory_pools = false;  // stream-ordered allocation (a captured decode's workspace)
  bool programmatic_launch = false;  // the decode's later kernels by programmatic dependent launch (sm_90+)
  std::mutex mutex;  // guards smem_kernels, workspaces, host_staging and blas
  // The kernels whose dynamic shared memory limit is raised to smem_optin on this device
  // (the attribute is per device and kernel).
  std::set<const void *> smem_kernels;
  struct Workspace {
    void *ptr = nullptr;
    size_t bytes = 0;
  };
  enum WorkspaceUse : int { kDecodeWorkspace = 0, kCompressWorkspace = 1 };
  std::map<std::pair<void *, int>, Workspace> workspaces;
  // A CPU context for the work staged through the host (compaction, reconstruct).
  std::unique_ptr<akv_context> host_staging;
  // The cuBLAS handle of the compression pass (created on first use).
  std::shared_ptr<void> blas;

 private:
  akv_context &staging();
};

// The CUDA state of a CUDA context.
inline CudaBackend &state(akv_context &context) { return static_cast<CudaBackend &>(*context.impl); }

// Copy between any host or device pointers (unified addressing), ordered on `stream`;
// `wait` returns only once the copy is complete (needed before host memory is read or freed).
void copy(void *dst, const void *src, size_t bytes, void *stream, bool wait);
// Copy `rows` rows of `row_bytes` between pitched buffers, ordered on `stream`.
void copy_rows(void *dst, size_t dst_pitch, const void *src, size_t src_pitch, size_t row_bytes, size_t rows,
               void *stream);
void synchronize(void *stream);

// The stream's scratch memory for one use (CudaBackend::kDecodeWorkspace or
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

// Writes n tokens (device keys/values [H][n][D]) after the cache's appended tokens and
// advances the device-side length and next position. positions: validated host positions,
// baked into the launch; null: the tokens continue from the device-side next position (a
// captured append then advances on every replay). Capacity must be reserved; tokens past it
// are dropped and counted on the device (read_appended).
void append(akv_cache &cache, const void *keys, const void *values, akv_dtype dtype, int32_t n,
            const int32_t *positions, void *stream);

// Whether `stream` is being captured into a CUDA graph.
bool capturing(void *stream);

// The appended tokens as the device has them (after cudaDeviceSynchronize): length, next
// position, the positions of tokens [known, length), and the tokens dropped past the
// capacity since the last call (the device count is reset).
struct AppendedOnDevice {
  int64_t length = 0, next_position = 0, dropped = 0;
  std::vector<int32_t> positions;
};
AppendedOnDevice read_appended(akv_cache &cache, int64_t known);

}  // namespace cuda
}  // namespace akv
