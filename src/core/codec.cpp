#include "core/codec.hpp"

#include <cmath>
#include "core/rng.hpp"

namespace akv {

void fwht(float *x, int n) {
  for (int len = 1; len < n; len <<= 1) {
    for (int i = 0; i < n; i += len << 1) {
      for (int j = i; j < i + len; ++j) {
        const float a = x[j], b = x[j + len];
        x[j] = a + b;
        x[j + len] = a - b;
      }
    }
  }
}

ResidualCodec::ResidualCodec(uint64_t seed, int head_dim, akv_residual_scale mode)
    : dim_(head_dim), mode_(mode), signs_(head_dim) {
  for (int d = 0; d < head_dim; ++d)
    signs_[d] = (hash_keys(seed, kStreamHadamardSigns, static_cast<uint64_t>(d)) & 1u) ? -1.0f : 1.0f;
}

void ResidualCodec::rotate(float *x) const {
  const float norm = 1.0f / std::sqrt(static_cast<float>(dim_));
  for (int d = 0; d < dim_; ++d) x[d] *= signs_[d];
  fwht(x, dim_);
  for (int d = 0; d < dim_; ++d) x[d] *= norm;
}

void ResidualCodec::unrotate(float *y) const {
  const float norm = 1.0f / std::sqrt(static_cast<float>(dim_));
  fwht(y, dim_);
  for (int d = 0; d < dim_; ++d) y[d] *= norm * signs_[d];
}

float ResidualCodec::encode(const float *residual, uint8_t *codes) const {
  std::vector<float> y(residual, residual + dim_);
  rotate(y.data());
  double sumsq = 0.0, absmax = 0.0;
  for (int d = 0; d < dim_; ++d) {
    sumsq += static_cast<double>(y[d]) * y[d];
    absmax = std::fmax(absmax, std::fabs(static_cast<double>(y[d])));
  }
  double scale = mode_ == AKV_SCALE_ABSMAX ? absmax / kLloydMaxLevels[3]
                                           : std::sqrt(sumsq / dim_);
  const double inv = scale > 0.0 ? 1.0 / scale : 0.0;
  for (int b = 0; b < dim_ / 4; ++b) codes[b] = 0;
  double dot = 0.0, levels_sq = 0.0;
  for (int d = 0; d < dim_; ++d) {
    const int c = lloyd_max_code(static_cast<float>(y[d] * inv));
    codes[d >> 2] |= static_cast<uint8_t>(c << ((d & 3) * 2));
    dot += static_cast<double>(y[d]) * kLloydMaxLevels[c];
    levels_sq += static_cast<double>(kLloydMaxLevels[c]) * kLloydMaxLevels[c];
  }
  // Least squares: the scale that minimises ||y - s*levels||^2 for the chosen codes.
  if (mode_ == AKV_SCALE_LEAST_SQUARES && levels_sq > 0.0) scale = dot / levels_sq;
  return static_cast<float>(scale);
}

void ResidualCodec::decode_rotated(const uint8_t *codes, float scale, float *y) const {
  for (int d = 0; d < dim_; ++d) y[d] = scale * kLloydMaxLevels[(codes[d >> 2] >> ((d & 3) * 2)) & 3];
}

void ResidualCodec::decode(const uint8_t *codes, float scale, float *residual) const {
  decode_rotated(codes, scale, residual);
  unrotate(residual);
}

}  // namespace akv
