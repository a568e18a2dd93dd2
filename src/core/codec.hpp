// Residual codec (paper App. A.1): randomized Walsh-Hadamard rotation U = H diag(s)/sqrt(D),
// a per-token fp32 scale, the 4-level Lloyd-Max quantizer for N(0,1), 4 codes per byte.
#pragma once
#include <cstdint>
#include <vector>
#include "anchorkv/anchorkv.h"

namespace akv {

// Lloyd-Max 4-level quantizer for a unit Gaussian.
constexpr float kLloydMaxLevels[4] = {-1.5104f, -0.4528f, 0.4528f, 1.5104f};
constexpr float kLloydMaxThreshold = 0.9816f;

inline bool is_power_of_two(int64_t x) { return x > 0 && (x & (x - 1)) == 0; }

// In-place unnormalised fast Walsh-Hadamard transform of n (power of two) floats.
void fwht(float *x, int n);

class ResidualCodec {
 public:
  ResidualCodec() = default;
  ResidualCodec(uint64_t seed, int head_dim, akv_residual_scale mode);

  int head_dim() const { return dim_; }
  int code_bytes() const { return dim_ / 4; }
  const std::vector<float> &signs() const { return signs_; }

  // x (head_dim floats, clobbered) -> U x in place.
  void rotate(float *x) const;
  // y in the rotated domain -> U^T y in place.
  void unrotate(float *y) const;

  // Encode a residual (original domain): writes code_bytes() bytes, returns the scale.
  float encode(const float *residual, uint8_t *codes) const;
  // Rotated-domain reconstruction scale * level(code), no inverse rotation.
  void decode_rotated(const uint8_t *codes, float scale, float *y) const;
  // Full reconstruction in the original domain.
  void decode(const uint8_t *codes, float scale, float *residual) const;

 private:
  int dim_ = 0;
  akv_residual_scale mode_ = AKV_SCALE_LEAST_SQUARES;
  std::vector<float> signs_;
  std::vector<float> byte_levels_;  // [256][4]: the four levels a packed byte decodes to
};

inline int lloyd_max_code(float z) {
  return z < 0.0f ? (z < -kLloydMaxThreshold ? 0 : 1) : (z < kLloydMaxThreshold ? 2 : 3);
}

}  // namespace akv
