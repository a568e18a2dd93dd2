// Rotary position embedding: NeoX (rotate-half) and GPT-J (interleaved) pairings, partial
// rotary dimension, frequencies from a base or an explicit table.
#pragma once
#include <cstdint>
#include <vector>
#include "anchorkv/anchorkv.h"

namespace akv {

struct Rope {
  akv_rope_style style = AKV_ROPE_NONE;
  int head_dim = 0;
  int rotary_dim = 0;            // even, <= head_dim
  std::vector<float> inv_freq;   // rotary_dim / 2
  std::vector<int> first, second;  // the two coordinates of each rotated pair

  Rope() = default;
  // Validates and builds; throws akv::Error with a message naming the bad field.
  Rope(const akv_rope &config, int head_dim);

  int pairs() const { return static_cast<int>(inv_freq.size()); }
  bool enabled() const { return style != AKV_ROPE_NONE && !inv_freq.empty(); }

  // Angle of pair j at a position, computed in double so large positions keep precision.
  double angle(int64_t position, int j) const {
    return static_cast<double>(position) * static_cast<double>(inv_freq[j]);
  }
  // x (head_dim floats) rotated to `position` in place; inverse = rotate by -position.
  void apply(float *x, int64_t position, bool inverse = false) const;
};

}  // namespace akv
