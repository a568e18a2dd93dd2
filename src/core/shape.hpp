// The shapes the library accepts, one rule for akv_compress and friends (bad input) and the
// deserializer (damage): every cache the library makes reads back.
#pragma once
#include <cstdint>
#include "anchorkv/anchorkv.h"

namespace akv {

// Shape limits: beyond them akv_compress refuses a shape (AKV_ERR_UNSUPPORTED) and the
// deserializer treats one as damage.
constexpr int32_t kMaxKvHeads = 4096, kMaxQHeads = 65536, kMaxHeadDim = 1024;

// Fails at the first field out of range: with `invalid` for a value that can never be right
// (non-positive, an odd head_dim, Hq not a multiple of H), with `unsupported` for one beyond
// the limits above; the message reads "<prefix><field> <value> ...".
void check_shape(const akv_shape &shape, akv_status invalid, akv_status unsupported, const char *prefix);

// M_full = 4*S*H*D: the bytes of the dense 16-bit K and V a compressed cache is measured
// against (retain_fraction theta buys theta*M_full), and what `tokens` exact tokens of H
// heads cost.
inline uint64_t dense_bytes(int64_t tokens, int64_t heads, int64_t head_dim) {
  return 4ull * static_cast<uint64_t>(tokens) * static_cast<uint64_t>(heads) * static_cast<uint64_t>(head_dim);
}
inline uint64_t full_bytes(const akv_shape &s) { return dense_bytes(s.seq_len, s.num_kv_heads, s.head_dim); }

}  // namespace akv
