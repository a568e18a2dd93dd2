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

}  // namespace akv
