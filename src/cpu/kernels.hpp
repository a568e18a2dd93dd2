// Small vector kernels shared by the CPU decode paths.
#pragma once
#include <cstdint>
#include <cstring>
#ifdef __AVX2__
#include <immintrin.h>
#endif
#include "core/dtype.hpp"

namespace akv {

inline float dot(const float *a, const float *b, int n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// out[r] = dot(rows + r * stride, b, n) for r < count: four rows at a time share the loads of
// b and one horizontal reduction (n a multiple of 8 on the AVX2 path).
inline void dot_rows(const float *rows, int64_t stride, int count, const float *b, int n, float *out) {
  int r = 0;
#ifdef __AVX2__
  if (n % 8 == 0) {
    for (; r + 4 <= count; r += 4) {
      const float *a0 = rows + r * stride, *a1 = a0 + stride, *a2 = a1 + stride, *a3 = a2 + stride;
      __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
      for (int i = 0; i < n; i += 8) {
        const __m256 bv = _mm256_loadu_ps(b + i);
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a0 + i), bv, s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a1 + i), bv, s1);
        s2 = _mm256_fmadd_ps(_mm256_loadu_ps(a2 + i), bv, s2);
        s3 = _mm256_fmadd_ps(_mm256_loadu_ps(a3 + i), bv, s3);
      }
      const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(s0, s1), _mm256_hadd_ps(s2, s3));
      _mm_storeu_ps(out + r, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
    }
  }
#endif
  for (; r < count; ++r) out[r] = dot(rows + r * stride, b, n);
}

inline void half_row(const uint16_t *src, akv_dtype storage, int n, float *dst) {
  if (storage == AKV_DTYPE_BF16) {
    for (int i = 0; i < n; ++i) {
      const uint32_t bits = static_cast<uint32_t>(src[i]) << 16;
      std::memcpy(&dst[i], &bits, 4);
    }
  } else {
    for (int i = 0; i < n; ++i) dst[i] = fp16_to_float(src[i]);
  }
}

}  // namespace akv
