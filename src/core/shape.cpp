#include "core/shape.hpp"

#include "core/error.hpp"

namespace akv {

void check_shape(const akv_shape &s, akv_status invalid, akv_status unsupported, const char *prefix) {
  if (s.seq_len <= 0) fail(invalid, prefix, "seq_len ", s.seq_len, " must be positive");
  if (s.seq_len > (int64_t{1} << 31) - 1) fail(unsupported, prefix, "seq_len ", s.seq_len, " exceeds int32 positions");
  if (s.num_kv_heads <= 0) fail(invalid, prefix, "num_kv_heads ", s.num_kv_heads, " must be positive");
  if (s.num_q_heads <= 0 || s.num_q_heads % s.num_kv_heads != 0)
    fail(invalid, prefix, "num_q_heads ", s.num_q_heads, " must be a positive multiple of num_kv_heads ",
         s.num_kv_heads);
  if (s.num_kv_heads > kMaxKvHeads) fail(unsupported, prefix, "num_kv_heads ", s.num_kv_heads, " exceeds ", kMaxKvHeads);
  if (s.num_q_heads > kMaxQHeads) fail(unsupported, prefix, "num_q_heads ", s.num_q_heads, " exceeds ", kMaxQHeads);
  if (s.head_dim <= 0 || s.head_dim % 2 != 0)
    fail(invalid, prefix, "head_dim ", s.head_dim, " must be positive and even");
  if (s.head_dim > kMaxHeadDim) fail(unsupported, prefix, "head_dim ", s.head_dim, " exceeds ", kMaxHeadDim);
}

}  // namespace akv
