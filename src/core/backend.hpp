// The interface a backend implements behind akv_context: everything the C API asks of the
// memory a context owns and of the caches in it. The shims in api/ validate arguments, guard
// errors and dispatch here; they do no backend work. A backend is one folder implementing
// this (cpu/backend.cpp, cuda/cuda_backend.cpp), created by its factory below.
//
// Pointers named "backend memory" are host pointers for the CPU backend and device pointers
// for CUDA. `stream` is the caller's cudaStream_t (CPU: ignored). Every call either completes
// or throws akv::Error with the cache unchanged.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>
#include "anchorkv/anchorkv.h"

struct akv_cache;
struct akv_context;

namespace akv {

struct ParsedCache;
struct MethodPlan;  // methods/methods.hpp

// What a compression executes: validated inputs (prefill in backend memory, complete options)
// and, for a compaction, what the old cache says about each token.
struct CompressRequest {
  akv_context *context;
  const akv_prefill *prefill;
  const akv_compress_options *options;  // complete (defaults filled)
  const MethodPlan *plan;                // the method's plan for this shape and these options
  // Compaction (AnchorKV): per head and token [H][S], which tokens may become anchors, best
  // first: 3 the old cache's non-window anchors, 2 its window, 1 exact appended tokens, 0
  // tokens only known through their old representation. Null = every token alike (prefill).
  const int8_t *anchor_priority = nullptr;
  // With anchor_priority: [H][S], how much the old anchors (3 and 2) are leaned on (their
  // dependents); they keep their slots in this order (then by score) when slots are short.
  const float *anchor_weight = nullptr;
  // With anchor_priority, per side (keys, values): [H][S], the anchor token an old token was
  // assigned to (-1: none) and its bf16 coefficient. While that token stays an anchor the
  // assignment is kept as it was, so the old residual is re-encoded from its own decoded
  // codes (nearly the same codes) instead of drifting to another anchor at every compaction.
  const int32_t *sticky_anchor[2] = {nullptr, nullptr};
  const uint16_t *sticky_gamma[2] = {nullptr, nullptr};
  // Compaction (SnapKV, PyramidKV, AnDPro): [H][S], 0 for tokens evicted before; they are
  // left out of the window attention and never kept. Null = every token present.
  const uint8_t *present = nullptr;
};

class Backend {
 public:
  virtual ~Backend() = default;

  // Memory through the context's allocator hooks (CUDA: with the context's device current).
  // allocate throws AKV_ERR_OUT_OF_MEMORY; zero bytes gives nullptr.
  virtual void *allocate(size_t bytes) = 0;
  virtual void deallocate(void *ptr, size_t bytes) noexcept = 0;

  // AKV_ERR_UNSUPPORTED when this backend cannot compress with these options and shape;
  // called before any tensor is read.
  virtual void check_compress(const akv_compress_options &options, const akv_shape &shape) = 0;
  virtual std::unique_ptr<akv_cache> compress(const CompressRequest &request, void *stream) = 0;

  // Room for `tokens` appended tokens (what is there is kept).
  virtual void reserve(akv_cache &cache, int64_t tokens, void *stream) = 0;
  // n tokens, keys/values [H][n][D] in backend memory, at validated positions (strictly
  // increasing, after every cached one); grows the reservation when needed. implicit: the
  // caller passed no positions (these continue from the last one).
  virtual void append(akv_cache &cache, const void *keys, const void *values, akv_dtype dtype, int32_t n,
                      const int32_t *positions, bool implicit, void *stream) = 0;
  // Brings the host's record of appended tokens (suffix_len, suffix_positions,
  // next_position) up to date where tokens were appended without it (CUDA: replays of an
  // append captured in a graph). The API calls it before any call that reads that record.
  // Throws AKV_ERR_CAPACITY, the record up to date, when such appends ran past the
  // reservation and tokens were dropped.
  virtual void sync_appended(akv_cache &cache, void *stream) { (void)cache, (void)stream; }
  // Caches of this context with one shape, validated; queries/out [batch][Hq][q_len][D] and
  // lse (optional) [batch][Hq][q_len] in backend memory.
  virtual void decode(akv_cache *const *caches, int32_t batch, const void *queries, akv_dtype dtype, int32_t q_len,
                      void *out, float *lse, void *stream) = 0;
  // akv_cache_compact, validated: queries [Hq][W][D] in backend memory.
  virtual void compact(akv_cache &cache, const void *queries, akv_dtype dtype, int64_t headroom, void *stream) = 0;
  // Dense K^/V^ [H][T][D] (and present [H][T]) into backend memory.
  virtual void reconstruct(const akv_cache &cache, akv_dtype dtype, int32_t rotated, void *keys, void *values,
                           uint8_t *present, void *stream) = 0;

  // `bytes` of backend memory at `src` into host memory (complete on return).
  virtual void read(void *host_dst, const void *src, size_t bytes, void *stream) = 0;
  // The serialized bytes of a cache of this context (core/serialize.hpp).
  virtual std::vector<uint8_t> serialize(const akv_cache &cache, void *stream) = 0;
  // A parsed cache (host buffers) moved into this context's memory.
  virtual std::unique_ptr<akv_cache> place(ParsedCache parsed, void *stream) = 0;
};

// The factories: each sets the context's default allocator when the caller gave none.
// CUDA: AKV_ERR_BACKEND_UNAVAILABLE in a build without it or on a machine without a device.
std::unique_ptr<Backend> make_cpu_backend(akv_context &context);
std::unique_ptr<Backend> make_cuda_backend(akv_context &context);

}  // namespace akv
