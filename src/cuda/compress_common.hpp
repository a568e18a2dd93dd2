// What the GPU compression passes share, written over the device policy of
// cuda/compress_pipeline.hpp: scratch carving, grid sizes, the paged block table, the
// kernels' view of the prefill tensors and the RoPE tables.
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/context.hpp"
#include "core/error.hpp"
#include "cuda/compress_kernels.cuh"

namespace akv {
namespace cuda {

// Lays arrays out one after another (256-byte aligned) from `base`; with a null base it only
// measures.
class Carver {
 public:
  explicit Carver(uint8_t *base) : base_(base) {}
  template <typename T>
  void operator()(T *&ptr, int64_t count) {
    at_ = (at_ + 255) / 256 * 256;
    ptr = base_ ? reinterpret_cast<T *>(base_ + at_) : nullptr;
    at_ += sizeof(T) * static_cast<size_t>(std::max<int64_t>(count, 1));
  }
  size_t bytes() const { return at_; }

 private:
  uint8_t *base_;
  size_t at_ = 0;
};

// Blocks of `per` items covering n.
inline int grid_blocks(int64_t n, int per) { return static_cast<int>((n + per - 1) / per); }

// Entries of a paged prefill's block table (0 when not paged).
inline int64_t paged_blocks(const akv_prefill &p) {
  return p.block_table ? (p.shape.seq_len + p.block_size - 1) / p.block_size : 0;
}

// Copies a paged prefill's host block table to `device_table` (scratch of paged_blocks(p)
// entries); returns it, or null when the prefill is not paged.
template <class Dev>
const int32_t *upload_block_table(Dev &dev, const akv_prefill &p, int32_t *device_table) {
  if (!p.block_table) return nullptr;
  dev.copy(device_table, p.block_table, paged_blocks(p) * sizeof(int32_t));
  return device_table;
}

// The kernels' view of the prefill tensors (device pointers) and of the device constants.
inline PrefillArgs prefill_args(const akv_prefill &p, const akv_compress_options &o, const akv_cache &cache,
                                const int32_t *positions, const float *inv_freq, const int32_t *rope_first,
                                const int32_t *rope_second, int32_t *bad, const int32_t *block_table) {
  const int64_t S = p.shape.seq_len;
  const int D = p.shape.head_dim, W = o.window;
  const int pairs = cache.rope.enabled() ? cache.rope.pairs() : 0;
  PrefillArgs a;
  a.keys = p.keys;
  a.values = p.values;
  a.queries = p.queries;
  a.dtype = p.dtype;
  if (p.block_table) {  // vLLM's [block][token][head][dim] unless strides say otherwise
    a.block_table = block_table;
    a.block_size = p.block_size;
    a.kv_head_stride = p.kv_head_stride ? p.kv_head_stride : D;
    a.kv_token_stride = p.kv_token_stride ? p.kv_token_stride : int64_t{p.shape.num_kv_heads} * D;
    a.kv_block_stride = p.kv_block_stride ? p.kv_block_stride : a.block_size * a.kv_token_stride;
  } else {
    a.kv_token_stride = p.kv_token_stride ? p.kv_token_stride : D;
    a.kv_head_stride = p.kv_head_stride ? p.kv_head_stride : S * D;
  }
  a.q_token_stride = p.q_token_stride ? p.q_token_stride : D;
  a.q_head_stride = p.q_head_stride ? p.q_head_stride : static_cast<int64_t>(W) * D;
  a.seq_len = S;
  a.heads = p.shape.num_kv_heads;
  a.q_heads = p.shape.num_q_heads;
  a.head_dim = D;
  a.window = W;
  a.keys_post_rope = o.keys_post_rope ? 1 : 0;
  a.rope_pairs = pairs;
  a.positions = positions;
  a.inv_freq = inv_freq;
  a.rope_first = rope_first;
  a.rope_second = rope_second;
  a.bad = bad;
  return a;
}

// Copies the RoPE tables into device memory (the scratch arrays of the given pointers).
template <class Dev>
void upload_rope(Dev &dev, const Rope &rope, float *inv_freq, int32_t *first, int32_t *second) {
  if (!rope.enabled()) return;
  const int pairs = rope.pairs();
  const std::vector<int32_t> f(rope.first.begin(), rope.first.end()), s(rope.second.begin(), rope.second.end());
  dev.copy(inv_freq, rope.inv_freq.data(), pairs * sizeof(float));
  dev.copy(first, f.data(), pairs * sizeof(int32_t));
  dev.copy(second, s.data(), pairs * sizeof(int32_t));
}

}  // namespace cuda
}  // namespace akv
