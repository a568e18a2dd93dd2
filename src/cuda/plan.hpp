// Host-side preparation for the CUDA kernels, in plain C++ (compiled in every build): the
// CacheView of a cache and its small tables, and the launch plan of a decode. The CUDA
// backend (cuda/backend.cu) places these in device memory; the SIMT emulation tests place
// them in host memory and run the same kernels on the CPU.
#pragma once
#include <cstdint>
#include <functional>
#include <vector>
#include "core/context.hpp"
#include "cuda/cache_view.hpp"

namespace akv {
namespace cuda {

// Throw AKV_ERR_UNSUPPORTED (with the reason) when the CUDA kernels cannot decode such a cache.
void check_supported(akv_method method, int head_dim);
void check_decodable(const akv_cache &cache);

// Where a cache's buffers live in the memory the kernels read.
struct ViewAddresses {
  const uint8_t *data = nullptr;   // cache.data
  uint16_t *suffix_keys = nullptr;  // cache.suffix_keys
  uint16_t *suffix_values = nullptr;
  uint8_t *aux = nullptr;  // where the returned bytes will be copied
  // Storage format 3: the anchor token list ([H][k-W], the kAnchorTokens section) in host
  // memory, from which the per-tile anchor masks are derived; else null.
  const int64_t *host_anchor_tokens = nullptr;
};

// The bytes of the cache's auxiliary block: a CacheView (first, at offset 0) followed by the
// tables it points to (RoPE frequencies and pairs, Hadamard signs, dense head starts; for
// storage format 3 the coefficient units and the per-tile anchor masks). Every pointer in
// the view is expressed in `at`'s address space.
std::vector<uint8_t> build_view_block(const akv_cache &cache, const ViewAddresses &at);

struct DecodePlan {
  int maxrows = 4;      // template row chunk (4, 8, 16): more rows are split into chunks
  int row_chunks = 1;
  int splits = 1;
  int max_anchors = 0;
  int anchor_parts = 0;  // blocks of decode_anchor_values_kernel per (request, head, row chunk)
  int anchors_per_part = kMergeMaxAnchorsPerPart;  // anchors of one such block
  // Where a split block sums the per-anchor weights (DecodeLaunch::smem_anchors): all k in
  // shared memory; a segment table's entries at a time there (caches without tables: the
  // workspace); or the workspace.
  enum class Weights { kShared, kSegments, kWorkspace } weights = Weights::kShared;
  int smem_anchors = 0;  // weights per row in shared memory
  int resident = 1;       // split blocks resident per multiprocessor
  size_t smem_bytes = 0;  // dynamic shared memory of decode_split_kernel
  int64_t blocks = 0;     // split blocks of one launch (kMaxBatchPerLaunch requests at most)
  bool scores = false;    // a cache without RoPE may take the register-gather path (DecodeLaunch::scores)
  size_t workspace_bytes = 0;
};

// The decode kernels' grids, spelled once for the CUDA backend (backend.cu's launch_decode) and
// the SIMT emulation (tests/emu): split blocks (splits, heads x row chunks, requests),
// anchor-value blocks (anchor parts, heads x row chunks, requests; launched only with parts)
// and merge blocks (heads x row chunks, requests, maxrows); and decode_scores_kernel's
// (kScoreAnchors anchors, heads x row chunks, requests; launched only on the register-gather
// path with DecodeLaunch::scores).
struct Grid3 {
  unsigned x, y, z;
};
struct DecodeGrids {
  Grid3 split, anchor_values, merge, scores;
};
inline DecodeGrids decode_grids(const DecodePlan &plan, int heads, int32_t requests) {
  const unsigned hr = static_cast<unsigned>(heads * plan.row_chunks), r = static_cast<unsigned>(requests);
  return DecodeGrids{{static_cast<unsigned>(plan.splits), hr, r},
                     {static_cast<unsigned>(plan.anchor_parts), hr, r},
                     {hr, r, static_cast<unsigned>(plan.maxrows)},
                     {static_cast<unsigned>((plan.max_anchors + kScoreAnchors - 1) / kScoreAnchors), hr, r}};
}

// sm_count: multiprocessors; smem_limit: the opt-in dynamic shared memory per block.
// resident(maxrows, smem_bytes): split blocks of that instantiation resident on one
// multiprocessor (the CUDA backend asks cudaOccupancyMaxActiveBlocksPerMultiprocessor); when
// empty, estimated from 228 KB of shared memory per multiprocessor.
using ResidentBlocks = std::function<int(int maxrows, size_t smem_bytes)>;
DecodePlan plan_decode(const akv_cache *const *caches, int32_t batch, int32_t q_len, int sm_count, size_t smem_limit,
                       const ResidentBlocks &resident = nullptr);

// Whether every cache of a decode takes the split kernel's register-gather path with queries in
// `dtype` (decode_split_kernel<D, MAXROWS, true>): bf16 queries and storage, NeoX or GPT-J
// RoPE over every dimension, storage format 3, an AnchorKV cache with anchors. The kernel's other
// instantiation takes every other cache.
// One pairing for them all: a batch that mixes NeoX and GPT-J caches takes the other path.
bool fast_decode_path(const akv_cache *const *caches, int32_t batch, akv_dtype dtype);
// Where fast_decode_path holds: whether its caches have GPT-J pairs
// (decode_split_kernel<D, MAXROWS, true, true>).
bool fast_decode_gptj(const akv_cache *const *caches);

// The parameters of a decode launch under `plan` (views left for the caller): queries and
// out of its first request, the workspace of plan.workspace_bytes.
DecodeLaunch decode_launch(const DecodePlan &plan, const akv_shape &shape, int32_t q_len, akv_dtype dtype,
                           const void *queries, void *out, float *workspace);

}  // namespace cuda
}  // namespace akv
