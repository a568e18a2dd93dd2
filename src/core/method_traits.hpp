// What the code asks about a compression method, one row per akv_method
// (core/method_traits.cpp): the switches in core/, methods/ and cpu/ read this table instead of
// listing methods.
#pragma once
#include <cstdint>
#include "anchorkv/anchorkv.h"

namespace akv {

// How a method's cache is stored, which decides how it is decoded, reconstructed and
// serialized: anchors, codes and residuals; exact rows (all tokens or a ragged subset per
// head); quantized rows.
enum class Storage { kAnchor, kDense, kQuantized };

struct MethodTraits {
  akv_method method;
  Storage storage;
  const char *name;    // "FullKV", "AnchorKV", ...
  bool evicting;       // keeps a ragged subset of exact prompt tokens per head (the eviction baselines)
  bool compactable;    // akv_cache_compact folds it: AnchorKV, and the eviction baselines with a
                       // decode-time variant (AnDPro's rebuttal: AnDPro and SnapKV; PyramidKV is
                       // SnapKV with a layer budget); not AdaKV
  bool cuda_compress;  // the CUDA backend compresses it (all but QUANTIZED)
};

// The row of a method, by the integer a caller or a serialized cache holds; null for a value
// that is no akv_method (checked before the integer becomes an enum).
const MethodTraits *find_method_traits(int32_t m);
// The row of a method; AKV_ERR_UNSUPPORTED for a value that is no akv_method.
const MethodTraits &method_traits(akv_method m);

inline Storage storage_of(akv_method m) { return method_traits(m).storage; }

// Whether akv_cache_compact folds m (false for an unknown value).
inline bool compactable(akv_method m) { const MethodTraits *t = find_method_traits(m); return t && t->compactable; }

}  // namespace akv
