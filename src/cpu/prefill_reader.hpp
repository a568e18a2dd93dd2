// Reads the engine's prefill tensors (host memory, any supported dtype and strides) row by
// row as fp32, checking that every value is finite and converting keys between the pre- and
// post-RoPE forms. The methods' CPU implementations read their inputs only through this.
#pragma once
#include <cstdint>
#include <vector>
#include "anchorkv/anchorkv.h"
#include "core/rope.hpp"

namespace akv {

class PrefillReader {
 public:
  PrefillReader(const akv_prefill &prefill, int32_t window, const Rope &rope, bool keys_post_rope);

  int64_t seq_len() const { return S_; }
  const std::vector<int32_t> &positions() const { return positions_; }

  // Either output may be null. Pre-RoPE is what AnchorKV stores; post-RoPE what attention uses.
  void key_row(int h, int64_t t, float *pre_rope, float *post_rope) const;
  void value_row(int h, int64_t t, float *out) const;
  // x (pre-RoPE) rotated to token t's position, with the reader's precomputed angles.
  void rotate(float *x, int64_t t) const {
    if (rope_.enabled()) rope_.apply(x, &cos_[t * rope_.pairs()], &sin_[t * rope_.pairs()]);
  }
  // Query head hq, window row w (0..W-1).
  void query_row(int hq, int w, float *out) const;

 private:
  void load(const void *base, int64_t offset, const char *what, int head, int64_t row, float *out) const;
  // Element offset of (head h, token t, dim 0) in keys/values, through the block table if paged.
  int64_t kv_offset(int h, int64_t t) const {
    if (!p_.block_table) return h * kv_head_stride_ + t * kv_token_stride_;
    return p_.block_table[t / block_size_] * kv_block_stride_ + (t % block_size_) * kv_token_stride_ + h * kv_head_stride_;
  }

  const akv_prefill &p_;
  int64_t S_;
  int D_;
  int W_;
  int64_t kv_head_stride_, kv_token_stride_, q_head_stride_, q_token_stride_;
  int64_t block_size_ = 0, kv_block_stride_ = 0;  // paged prefill only
  const Rope &rope_;
  bool keys_post_rope_;
  std::vector<int32_t> positions_;
  std::vector<float> cos_, sin_;  // [S][pairs] angles of every position, computed once
};

}  // namespace akv
