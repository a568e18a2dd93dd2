#include "core/codec.hpp"

#include <algorithm>
#include <cmath>
#ifdef __AVX2__
#include <immintrin.h>
#endif
#include "core/rng.hpp"

namespace akv {

void fwht(float *x, int n) {
  int len = 1;
#ifdef __AVX2__
  if (n >= 8) {
    // The first three stages inside each block of 8 with in-register permutes:
    // y = x * sign + partner, with partner one, two and four lanes away.
    const __m256 m1 = _mm256_setr_ps(1, -1, 1, -1, 1, -1, 1, -1);
    const __m256 m2 = _mm256_setr_ps(1, 1, -1, -1, 1, 1, -1, -1);
    const __m256 m4 = _mm256_setr_ps(1, 1, 1, 1, -1, -1, -1, -1);
    for (int i = 0; i < n; i += 8) {
      __m256 v = _mm256_loadu_ps(x + i);
      v = _mm256_fmadd_ps(v, m1, _mm256_permute_ps(v, 0xB1));
      v = _mm256_fmadd_ps(v, m2, _mm256_permute_ps(v, 0x4E));
      v = _mm256_fmadd_ps(v, m4, _mm256_permute2f128_ps(v, v, 1));
      _mm256_storeu_ps(x + i, v);
    }
    len = 8;
  }
#else
  if (n >= 8) {  // the first three stages as one 8-point kernel per block
    for (int i = 0; i < n; i += 8) {
      float *b = x + i;
      const float a0 = b[0] + b[1], a1 = b[0] - b[1], a2 = b[2] + b[3], a3 = b[2] - b[3];
      const float a4 = b[4] + b[5], a5 = b[4] - b[5], a6 = b[6] + b[7], a7 = b[6] - b[7];
      const float c0 = a0 + a2, c1 = a1 + a3, c2 = a0 - a2, c3 = a1 - a3;
      const float c4 = a4 + a6, c5 = a5 + a7, c6 = a4 - a6, c7 = a5 - a7;
      b[0] = c0 + c4; b[1] = c1 + c5; b[2] = c2 + c6; b[3] = c3 + c7;
      b[4] = c0 - c4; b[5] = c1 - c5; b[6] = c2 - c6; b[7] = c3 - c7;
    }
    len = 8;
  }
#endif
  for (; len < n; len <<= 1) {
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
    : dim_(head_dim), rdim_(static_cast<int>(padded_dim(head_dim))), mode_(mode), signs_(rdim_), byte_levels_(256 * 4) {
  for (int b = 0; b < 256; ++b)
    for (int i = 0; i < 4; ++i) byte_levels_[b * 4 + i] = kLloydMaxLevels[(b >> (2 * i)) & 3];
  for (int d = 0; d < rdim_; ++d)
    signs_[d] = (hash_keys(seed, kStreamHadamardSigns, static_cast<uint64_t>(d)) & 1u) ? -1.0f : 1.0f;
}

void ResidualCodec::rotate(float *x) const {
  const float norm = 1.0f / std::sqrt(static_cast<float>(rdim_));
  for (int d = dim_; d < rdim_; ++d) x[d] = 0.0f;
  for (int d = 0; d < dim_; ++d) x[d] *= signs_[d];
  fwht(x, rdim_);
  for (int d = 0; d < rdim_; ++d) x[d] *= norm;
}

void ResidualCodec::unrotate(float *y) const {
  const float norm = 1.0f / std::sqrt(static_cast<float>(rdim_));
  fwht(y, rdim_);
  for (int d = 0; d < rdim_; ++d) y[d] *= norm * signs_[d];
}

float ResidualCodec::encode(const float *residual, uint8_t *codes) const {
  // On the stack up to D' = 256 (every common head dim), so that encoding allocates nothing;
  // float sums in vector lanes (the CUDA encoder sums in float too).
  float small_y[256];
  uint8_t small_c[256];
  std::vector<float> large_y(rdim_ > 256 ? rdim_ : 0);
  std::vector<uint8_t> large_c(rdim_ > 256 ? rdim_ : 0);
  float *y = rdim_ > 256 ? large_y.data() : small_y;
  uint8_t *code = rdim_ > 256 ? large_c.data() : small_c;
  std::copy(residual, residual + dim_, y);
  rotate(y);
  float sumsq = 0.0f, absmax = 0.0f;
#pragma omp simd reduction(+ : sumsq) reduction(max : absmax)
  for (int d = 0; d < rdim_; ++d) {
    sumsq += y[d] * y[d];
    absmax = std::max(absmax, std::fabs(y[d]));
  }
  float scale = mode_ == AKV_SCALE_ABSMAX ? absmax / kLloydMaxLevels[3] : std::sqrt(sumsq / rdim_);
  const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
  float dot = 0.0f, levels_sq = 0.0f;
#pragma omp simd reduction(+ : dot, levels_sq)
  for (int d = 0; d < rdim_; ++d) {
    const int c = lloyd_max_code(y[d] * inv);
    const float level = lloyd_max_level(c);
    code[d] = static_cast<uint8_t>(c);
    dot += y[d] * level;
    levels_sq += level * level;
  }
  for (int b = 0; b < rdim_ / 4; ++b)
    codes[b] = static_cast<uint8_t>(code[4 * b] | code[4 * b + 1] << 2 | code[4 * b + 2] << 4 | code[4 * b + 3] << 6);
  // Least squares: the scale that minimises ||y - s*levels||^2 for the chosen codes.
  if (mode_ == AKV_SCALE_LEAST_SQUARES && levels_sq > 0.0f) scale = dot / levels_sq;
  return scale;
}

void ResidualCodec::decode_rotated(const uint8_t *codes, float scale, float *y) const {
  int b = 0;
#ifdef __AVX2__
  const __m256 s = _mm256_set1_ps(scale);
  for (; b + 2 <= rdim_ / 4; b += 2) {  // two packed bytes: eight levels
    const __m128 lo = _mm_loadu_ps(&byte_levels_[codes[b] * 4]), hi = _mm_loadu_ps(&byte_levels_[codes[b + 1] * 4]);
    _mm256_storeu_ps(y + 4 * b, _mm256_mul_ps(s, _mm256_insertf128_ps(_mm256_castps128_ps256(lo), hi, 1)));
  }
#endif
  for (; b < rdim_ / 4; ++b) {
    const float *lv = &byte_levels_[codes[b] * 4];
    for (int i = 0; i < 4; ++i) y[4 * b + i] = scale * lv[i];
  }
}

void ResidualCodec::decode(const uint8_t *codes, float scale, float *residual) const {
#ifdef __AVX2__
  if (rdim_ == 128) {  // the common head dim: the whole transform in sixteen registers
    // The same arithmetic as decode_rotated + unrotate (levels times scale, the butterflies
    // in fwht's order, then norm * sign), without storing between the stages.
    const __m256 s = _mm256_set1_ps(scale);
    __m256 v[16];
    for (int i = 0; i < 16; ++i) {
      const __m128 lo = _mm_loadu_ps(&byte_levels_[codes[2 * i] * 4]);
      const __m128 hi = _mm_loadu_ps(&byte_levels_[codes[2 * i + 1] * 4]);
      v[i] = _mm256_mul_ps(s, _mm256_insertf128_ps(_mm256_castps128_ps256(lo), hi, 1));
    }
    const __m256 m1 = _mm256_setr_ps(1, -1, 1, -1, 1, -1, 1, -1);
    const __m256 m2 = _mm256_setr_ps(1, 1, -1, -1, 1, 1, -1, -1);
    const __m256 m4 = _mm256_setr_ps(1, 1, 1, 1, -1, -1, -1, -1);
    for (int i = 0; i < 16; ++i) {
      v[i] = _mm256_fmadd_ps(v[i], m1, _mm256_permute_ps(v[i], 0xB1));
      v[i] = _mm256_fmadd_ps(v[i], m2, _mm256_permute_ps(v[i], 0x4E));
      v[i] = _mm256_fmadd_ps(v[i], m4, _mm256_permute2f128_ps(v[i], v[i], 1));
    }
    for (int step = 1; step < 16; step <<= 1)
      for (int i = 0; i < 16; ++i)
        if (!(i & step)) {
          const __m256 a = v[i], b = v[i + step];
          v[i] = _mm256_add_ps(a, b);
          v[i + step] = _mm256_sub_ps(a, b);
        }
    const float norm = 1.0f / std::sqrt(static_cast<float>(rdim_));
    const __m256 n = _mm256_set1_ps(norm);
    for (int i = 0; i < 16; ++i)
      _mm256_storeu_ps(residual + 8 * i, _mm256_mul_ps(v[i], _mm256_mul_ps(n, _mm256_loadu_ps(&signs_[8 * i]))));
    return;
  }
#endif
  decode_rotated(codes, scale, residual);
  unrotate(residual);
}

}  // namespace akv
