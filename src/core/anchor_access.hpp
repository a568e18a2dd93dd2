// A token's anchor assignment, read the same way from either storage format (core/layout.hpp):
// the anchor, the coefficient and the position of prefix token t of head h. Host-side readers
// (reconstruct, compaction, the CUDA view, tests) use it; the CPU decode reads the sections
// directly. In format 3 an anchor token stores index 0 and coefficient code 0 and is exact
// through the anchor list: here it reads as its own anchor with coefficient 1, as in format 2.
#pragma once
#include <cstdint>
#include "core/layout.hpp"

struct akv_cache;

namespace akv {

class AnchorAccess {
 public:
  // data: the cache's sections laid out by `layout` (host memory).
  AnchorAccess(const AnchorGeometry &g, const AnchorLayout &layout, const uint8_t *data, int64_t window_first_position);
  explicit AnchorAccess(const akv_cache &cache);  // a CPU cache's own data

  int32_t anchor(int side, int h, int64_t t) const;
  float gamma(int side, int h, int64_t t) const;
  int32_t position(int64_t t) const {
    return positions_ ? positions_[t] : static_cast<int32_t>(first_position_ + t);
  }

 private:
  const AnchorGeometry &g_;
  const uint8_t *index_[2], *gamma_[2];
  const uint16_t *tables_ = nullptr;
  const float *scales_ = nullptr;
  const int32_t *positions_ = nullptr;
  int64_t first_position_ = 0;
  // Format 3: the anchor token list, [H][k-W] increasing; own_anchor() finds a token in it.
  const int64_t *tokens_ = nullptr;
  int64_t free_anchors_ = 0;
  int32_t own_anchor(int side, int h, int64_t t) const;  // the anchor t is, else -1
};

class Backend;

// The logit-penalty class of each prefix token of one head (docs/design.md §4.5), from the
// head's key residual mask and its increasing anchor token list: kReconstructed, kKeyResidual
// (the token stores a key residual) or kExact (an anchor). out: [prefix].
enum KeyClass : uint8_t { kReconstructed = 0, kKeyResidual = 1, kExact = 2 };
void key_classes(const uint64_t *key_mask, const int64_t *anchor_tokens, int64_t free_anchors, int64_t prefix,
                 uint8_t *out);
// The same for tokens [t0, t1) of the prefix: out[t - t0].
void key_classes(const uint64_t *key_mask, const int64_t *anchor_tokens, int64_t free_anchors, int64_t t0,
                 int64_t t1, uint8_t *out);

// akv_cache_logit_penalty: [H][T] (T = prompt + appended tokens) into host memory, what the
// decode subtracts from each token's logit per |scale q|^2 (CacheMeta::logit_penalty for the
// reconstructed prefix tokens, 0 for anchors, the window, appended tokens and other caches).
// The sections it needs are read through the backend (device memory on a CUDA context).
void logit_penalties(const akv_cache &cache, Backend &backend, float *out, void *stream);

}  // namespace akv
