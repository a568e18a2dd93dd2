#include "cpu/prefill_reader.hpp"

#include <cmath>
#include <cstring>
#include "core/dtype.hpp"
#include "core/error.hpp"

namespace akv {

PrefillReader::PrefillReader(const akv_prefill &prefill, int32_t window, const Rope &rope,
                             bool keys_post_rope)
    : p_(prefill), S_(prefill.shape.seq_len), D_(prefill.shape.head_dim), W_(window),
      rope_(rope), keys_post_rope_(keys_post_rope) {
  if (p_.block_table) {  // vLLM's [block][token][head][dim] unless strides say otherwise
    const int64_t H = p_.shape.num_kv_heads;
    block_size_ = p_.block_size;
    kv_head_stride_ = p_.kv_head_stride ? p_.kv_head_stride : D_;
    kv_token_stride_ = p_.kv_token_stride ? p_.kv_token_stride : H * D_;
    kv_block_stride_ = p_.kv_block_stride ? p_.kv_block_stride : block_size_ * kv_token_stride_;
  } else {
    kv_token_stride_ = p_.kv_token_stride ? p_.kv_token_stride : D_;
    kv_head_stride_ = p_.kv_head_stride ? p_.kv_head_stride : S_ * D_;
  }
  q_token_stride_ = p_.q_token_stride ? p_.q_token_stride : D_;
  q_head_stride_ = p_.q_head_stride ? p_.q_head_stride : static_cast<int64_t>(W_) * D_;
  positions_.resize(S_);
  if (p_.positions) {
    std::memcpy(positions_.data(), p_.positions, S_ * sizeof(int32_t));
  } else {
    for (int64_t t = 0; t < S_; ++t) positions_[t] = static_cast<int32_t>(t);
  }
  if (rope_.enabled()) {
    cos_.resize(S_ * rope_.pairs());
    sin_.resize(S_ * rope_.pairs());
    rope_.table(positions_.data(), S_, cos_.data(), sin_.data());
  }
}

void PrefillReader::load(const void *base, int64_t offset, const char *what, int head, int64_t row,
                         float *out) const {
  // Widen the row (one loop per dtype, so that each vectorises), then look for NaN/Inf: an
  // exponent of all ones.
  if (p_.dtype == AKV_DTYPE_F32) {
    std::memcpy(out, static_cast<const float *>(base) + offset, D_ * sizeof(float));
  } else {
    const uint16_t *in = static_cast<const uint16_t *>(base) + offset;
    if (p_.dtype == AKV_DTYPE_BF16)
      for (int d = 0; d < D_; ++d) out[d] = bf16_to_float(in[d]);
    else
      for (int d = 0; d < D_; ++d) out[d] = fp16_to_float(in[d]);
  }
  uint32_t bad = 0;
  for (int d = 0; d < D_; ++d) {
    uint32_t bits;
    std::memcpy(&bits, &out[d], sizeof(bits));
    bad |= static_cast<uint32_t>((bits & 0x7F800000u) == 0x7F800000u);
  }
  if (!bad) return;
  for (int d = 0; d < D_; ++d)
    if (!std::isfinite(out[d]))
      fail(AKV_ERR_NON_FINITE, what, " contain a non-finite value (", out[d], ") at head ", head,
           ", row ", row, ", dim ", d);
}

void PrefillReader::key_row(int h, int64_t t, float *pre, float *post) const {
  float *row = pre ? pre : post;
  if (!row) return;
  load(p_.keys, kv_offset(h, t), "keys", h, t, row);
  if (!rope_.enabled()) {
    if (post && post != row) std::memcpy(post, row, D_ * sizeof(float));
    return;
  }
  const float *c = &cos_[t * rope_.pairs()], *s = &sin_[t * rope_.pairs()];
  if (post && post != row) std::memcpy(post, row, D_ * sizeof(float));
  if (keys_post_rope_) {
    if (pre) rope_.apply(pre, c, s, /*inverse=*/true);
  } else if (post) {
    rope_.apply(post, c, s);
  }
}

void PrefillReader::value_row(int h, int64_t t, float *out) const {
  load(p_.values, kv_offset(h, t), "values", h, t, out);
}

void PrefillReader::query_row(int hq, int w, float *out) const {
  load(p_.queries, hq * q_head_stride_ + static_cast<int64_t>(w) * q_token_stride_, "queries", hq, w,
       out);
}

}  // namespace akv
