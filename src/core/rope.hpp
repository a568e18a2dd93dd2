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
  // cos and sin of every pair's angle at `position` (pairs() each), exact: from the angle in
  // double, as apply(x, position) rotates.
  void exact_angles(int64_t position, float *cos_out, float *sin_out) const;
  // x (head_dim floats) rotated to `position` in place; inverse = rotate by -position.
  void apply(float *x, int64_t position, bool inverse = false) const;
  // Same rotation with precomputed cos/sin of the position (pairs() each).
  void apply(float *x, const float *cos_row, const float *sin_row, bool inverse = false) const {
    if (style == AKV_ROPE_NEOX) {  // contiguous halves: vectorises
      const int h = pairs();
      for (int j = 0; j < h; ++j) {
        const float s = inverse ? -sin_row[j] : sin_row[j];
        const float x0 = x[j], x1 = x[j + h];
        x[j] = x0 * cos_row[j] - x1 * s;
        x[j + h] = x0 * s + x1 * cos_row[j];
      }
      return;
    }
    for (int j = 0; j < pairs(); ++j) {
      const float s = inverse ? -sin_row[j] : sin_row[j];
      const float x0 = x[first[j]], x1 = x[second[j]];
      x[first[j]] = x0 * cos_row[j] - x1 * s;
      x[second[j]] = x0 * s + x1 * cos_row[j];
    }
  }
  // cos/sin of position * inv_freq for n positions (n x pairs() each).
  void table(const int32_t *positions, int64_t n, float *cos_out, float *sin_out) const;

  static constexpr int kTile = 64;
  std::vector<float> fine_cos, fine_sin;  // [kTile][pairs]: angle of offsets 0..kTile-1
  std::vector<double> tile_cos, tile_sin;  // [pairs]: rotation by kTile positions
};

// cos/sin tables for a walk over increasing positions, tile by tile, without a sincos per
// token: each tile's base angle is the previous base rotated by kTile positions (in double,
// so it does not drift), and each token is base x fine[offset] (one complex product in
// float). Runs that are not consecutive fall back to exact angles.
class RopeSweep {
 public:
  explicit RopeSweep(const Rope &rope)
      : rope_(rope), base_cos_(rope.pairs()), base_sin_(rope.pairs()) {}
  // n <= Rope::kTile positions; writes pairs() cos and sin per position, rows `stride`
  // floats apart (stride >= pairs()).
  void next(const int32_t *positions, int64_t n, float *cos_out, float *sin_out, int64_t stride);

 private:
  const Rope &rope_;
  std::vector<double> base_cos_, base_sin_;
  int64_t expected_ = -1;  // position at which the next tile continues this one
};

}  // namespace akv
