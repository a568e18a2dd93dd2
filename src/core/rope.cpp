#include "core/rope.hpp"

#include <algorithm>
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
  fine_cos.resize(kTile * half);
  fine_sin.resize(kTile * half);
  tile_cos.resize(half);
  tile_sin.resize(half);
  for (int j = 0; j < half; ++j) {
    for (int u = 0; u < kTile; ++u) {
      fine_cos[u * half + j] = static_cast<float>(std::cos(angle(u, j)));
      fine_sin[u * half + j] = static_cast<float>(std::sin(angle(u, j)));
    }
    tile_cos[j] = std::cos(angle(kTile, j));
    tile_sin[j] = std::sin(angle(kTile, j));
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

void Rope::exact_angles(int64_t position, float *cos_out, float *sin_out) const {
  for (int j = 0; j < pairs(); ++j) {
    const double a = angle(position, j);
    cos_out[j] = static_cast<float>(std::cos(a));
    sin_out[j] = static_cast<float>(std::sin(a));
  }
}

void Rope::apply(float *x, int64_t position, bool inverse) const {
  if (!enabled()) return;
  float cs[512], sn[512];  // pairs <= head_dim/2 <= 512 (validated with the shape)
  exact_angles(position, cs, sn);
  for (int j = 0; j < pairs(); ++j) {
    const float c = cs[j];
    const float s = inverse ? -sn[j] : sn[j];
    const float x0 = x[first[j]], x1 = x[second[j]];
    x[first[j]] = x0 * c - x1 * s;
    x[second[j]] = x0 * s + x1 * c;
  }
}

void Rope::table(const int32_t *positions, int64_t n, float *cos_out, float *sin_out) const {
  RopeSweep sweep(*this);
  for (int64_t t0 = 0; t0 < n; t0 += kTile) {
    const int64_t len = std::min<int64_t>(kTile, n - t0);
    sweep.next(positions + t0, len, cos_out + t0 * pairs(), sin_out + t0 * pairs(), pairs());
  }
}

void RopeSweep::next(const int32_t *positions, int64_t n, float *cos_out, float *sin_out,
                     int64_t stride) {
  const int np = rope_.pairs();
  if (positions[0] == expected_) {
    for (int j = 0; j < np; ++j) {
      const double c = base_cos_[j] * rope_.tile_cos[j] - base_sin_[j] * rope_.tile_sin[j];
      base_sin_[j] = base_sin_[j] * rope_.tile_cos[j] + base_cos_[j] * rope_.tile_sin[j];
      base_cos_[j] = c;
    }
  } else {
    for (int j = 0; j < np; ++j) {
      const double a = rope_.angle(positions[0], j);
      base_cos_[j] = std::cos(a);
      base_sin_[j] = std::sin(a);
    }
  }
  bool consecutive = true;
  float bc[512], bs[512];  // pairs <= head_dim/2 <= 512 (validated with the shape)
  for (int j = 0; j < np; ++j) {
    bc[j] = static_cast<float>(base_cos_[j]);
    bs[j] = static_cast<float>(base_sin_[j]);
  }
  for (int64_t u = 0; u < n; ++u) {
    float *c = cos_out + u * stride, *s = sin_out + u * stride;
    if (positions[u] == positions[0] + u) {
      const float *fc = &rope_.fine_cos[u * np], *fs = &rope_.fine_sin[u * np];
      for (int j = 0; j < np; ++j) {
        c[j] = bc[j] * fc[j] - bs[j] * fs[j];
        s[j] = bs[j] * fc[j] + bc[j] * fs[j];
      }
    } else {
      consecutive = false;
      for (int j = 0; j < np; ++j) {
        const double a = rope_.angle(positions[u], j);
        c[j] = static_cast<float>(std::cos(a));
        s[j] = static_cast<float>(std::sin(a));
      }
    }
  }
  expected_ = consecutive && n == Rope::kTile ? static_cast<int64_t>(positions[0]) + Rope::kTile : -1;
}

}  // namespace akv
