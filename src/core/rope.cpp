#include "core/rope.hpp"

#include <cmath>
#include "core/error.hpp"

namespace akv {

Rope::Rope(const akv_rope &config, int dim) : style(config.style), head_dim(dim) {
  require(style == AKV_ROPE_NONE || style == AKV_ROPE_NEOX || style == AKV_ROPE_GPTJ,
          AKV_ERR_INVALID_ARGUMENT, "rope.style ", static_cast<int>(style), " is not a known style");
  if (style == AKV_ROPE_NONE) return;
  rotary_dim = config.rotary_dim == 0 ? dim : config.rotary_dim;
  require(rotary_dim > 0 && rotary_dim <= dim && rotary_dim % 2 == 0, AKV_ERR_INVALID_ARGUMENT,
          "rope.rotary_dim ", config.rotary_dim, " must be even and within (0, head_dim=", dim, "]");
  const int half = rotary_dim / 2;
  inv_freq.resize(half);
  if (config.inv_freq) {
    for (int j = 0; j < half; ++j) {
      require(std::isfinite(config.inv_freq[j]), AKV_ERR_NON_FINITE,
              "rope.inv_freq[", j, "] is not finite");
      inv_freq[j] = config.inv_freq[j];
    }
  } else {
    require(std::isfinite(config.base) && config.base > 1.0, AKV_ERR_INVALID_ARGUMENT,
            "rope.base ", config.base, " must be a finite number above 1");
    for (int j = 0; j < half; ++j)
      inv_freq[j] = static_cast<float>(std::pow(config.base, -2.0 * j / rotary_dim));
  }
  first.resize(half);
  second.resize(half);
  for (int j = 0; j < half; ++j) {
    if (style == AKV_ROPE_NEOX) {
      first[j] = j;
      second[j] = j + half;
    } else {
      first[j] = 2 * j;
      second[j] = 2 * j + 1;
    }
  }
}

void Rope::apply(float *x, int64_t position, bool inverse) const {
  if (!enabled()) return;
  for (int j = 0; j < pairs(); ++j) {
    const double a = angle(position, j);
    const float c = static_cast<float>(std::cos(a));
    const float s = static_cast<float>(inverse ? -std::sin(a) : std::sin(a));
    const float x0 = x[first[j]], x1 = x[second[j]];
    x[first[j]] = x0 * c - x1 * s;
    x[second[j]] = x0 * s + x1 * c;
  }
}

}  // namespace akv
