// Rotary position embedding of the tool's exact reference, kept to the convention the library
// documents for akv_rope:
//   NeoX (rotate-half): pairs (i, i + rot/2);  GPT-J (interleaved): pairs (2i, 2i + 1);
//   inv_freq[i] = base^(-2i/rot) rounded to fp32 (as Hugging Face stores it) unless an
//   explicit table is given; angle = position * inv_freq[i], evaluated in double;
//   x'_a = x_a cos - x_b sin,  x'_b = x_a sin + x_b cos  for each pair (a, b).
// Dimensions at and beyond rotary_dim are not rotated.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "anchorkv/anchorkv.h"

namespace akvcli {

struct RopeConfig {
  akv_rope_style style = AKV_ROPE_NEOX;
  int rotary_dim = 0;            // 0 = head_dim
  double base = 10000.0;
  std::vector<float> inv_freq;   // optional explicit table of rotary_dim/2 entries

  // Fills an akv_rope that points into this object's inv_freq (keep it alive).
  akv_rope to_library() const;
  std::string describe(int head_dim) const;
};

// Precomputed rotation for one head dimension and a list of positions.
class Rotary {
 public:
  Rotary(const RopeConfig &config, int head_dim);

  bool enabled() const { return !first_.empty(); }
  int pairs() const { return static_cast<int>(first_.size()); }
  const std::vector<double> &inv_freq() const { return inv_freq_; }

  const std::vector<int> &first() const { return first_; }
  const std::vector<int> &second() const { return second_; }

  // Rotates x (head_dim values) to `position`, or back from it when inverse.
  void apply(double *x, double position, bool inverse = false) const;
  void apply(float *x, double position, bool inverse = false) const;

 private:
  std::vector<int> first_, second_;
  std::vector<double> inv_freq_;
};

// cos/sin of every pair at positions first_position .. first_position + count - 1, so that
// rotating many heads at the same positions evaluates the trigonometry once.
class RotaryTable {
 public:
  RotaryTable(const Rotary &rotary, int64_t first_position, int64_t count);
  // Rotates x to the position of `index` (0-based from first_position).
  void apply(double *x, int64_t index) const;

 private:
  const Rotary &rotary_;
  std::vector<double> cos_, sin_;  // [count][pairs]
};

}  // namespace akvcli
