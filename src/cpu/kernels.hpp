// Small vector kernels shared by the CPU decode paths.
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <new>
#include <vector>
#ifdef __AVX2__
#include <immintrin.h>
#endif
#include "core/dtype.hpp"

namespace akv {

// Storage on 64-byte boundaries for rows that the kernels read or write sixteen lanes at a
// time: a vector load or store that straddles two cache lines costs more than one, and
// malloc's 16-byte alignment left it to chance (a dense decode at S = 16K, one thread, 7.9 ms
// or 8.8 ms depending on where its scratch row landed).
template <class T>
struct CacheLineAllocator {
  using value_type = T;
  CacheLineAllocator() = default;
  template <class U>
  CacheLineAllocator(const CacheLineAllocator<U> &) {}
  T *allocate(size_t n) { return static_cast<T *>(::operator new(n * sizeof(T), std::align_val_t{64})); }
  void deallocate(T *p, size_t) { ::operator delete(p, std::align_val_t{64}); }
  template <class U>
  bool operator==(const CacheLineAllocator<U> &) const { return true; }
  template <class U>
  bool operator!=(const CacheLineAllocator<U> &) const { return false; }
};
using AlignedFloats = std::vector<float, CacheLineAllocator<float>>;

#ifdef __AVX2__
// The sum of a vector's eight lanes.
inline float hsum8(__m256 v) {
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}
#endif

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

// acc[r][d] += sum_j w[r * ldw + j] * x[j * D + d] for r < rows, j < n, d < D: a weighted sum
// of n rows of x into each of `rows` accumulators (acc rows D apart). The AVX2 path keeps a
// 4 x 16 block of acc in registers while it walks the n rows (D a multiple of 16), instead of
// loading and storing acc for every row of x.
inline void accumulate_weighted_rows(float *acc, int rows, const float *w, int64_t ldw, const float *x, int n,
                                     int D) {
  int r0 = 0;
#ifdef __AVX2__
  if (D % 16 == 0) {
    for (; r0 + 4 <= rows; r0 += 4) {
      const float *w0 = w + r0 * ldw, *w1 = w0 + ldw, *w2 = w1 + ldw, *w3 = w2 + ldw;
      for (int d0 = 0; d0 < D; d0 += 16) {
        float *a0 = acc + r0 * D + d0, *a1 = a0 + D, *a2 = a1 + D, *a3 = a2 + D;
        __m256 s00 = _mm256_loadu_ps(a0), s01 = _mm256_loadu_ps(a0 + 8), s10 = _mm256_loadu_ps(a1),
               s11 = _mm256_loadu_ps(a1 + 8), s20 = _mm256_loadu_ps(a2), s21 = _mm256_loadu_ps(a2 + 8),
               s30 = _mm256_loadu_ps(a3), s31 = _mm256_loadu_ps(a3 + 8);
        for (int j = 0; j < n; ++j) {
          const __m256 x0 = _mm256_loadu_ps(x + static_cast<int64_t>(j) * D + d0);
          const __m256 x1 = _mm256_loadu_ps(x + static_cast<int64_t>(j) * D + d0 + 8);
          __m256 b = _mm256_broadcast_ss(w0 + j);
          s00 = _mm256_fmadd_ps(b, x0, s00);
          s01 = _mm256_fmadd_ps(b, x1, s01);
          b = _mm256_broadcast_ss(w1 + j);
          s10 = _mm256_fmadd_ps(b, x0, s10);
          s11 = _mm256_fmadd_ps(b, x1, s11);
          b = _mm256_broadcast_ss(w2 + j);
          s20 = _mm256_fmadd_ps(b, x0, s20);
          s21 = _mm256_fmadd_ps(b, x1, s21);
          b = _mm256_broadcast_ss(w3 + j);
          s30 = _mm256_fmadd_ps(b, x0, s30);
          s31 = _mm256_fmadd_ps(b, x1, s31);
        }
        _mm256_storeu_ps(a0, s00);
        _mm256_storeu_ps(a0 + 8, s01);
        _mm256_storeu_ps(a1, s10);
        _mm256_storeu_ps(a1 + 8, s11);
        _mm256_storeu_ps(a2, s20);
        _mm256_storeu_ps(a2 + 8, s21);
        _mm256_storeu_ps(a3, s30);
        _mm256_storeu_ps(a3 + 8, s31);
      }
    }
  }
#endif
  for (int r = r0; r < rows; ++r)
    for (int j = 0; j < n; ++j) {
      const float wj = w[r * ldw + j];
      const float *xj = x + static_cast<int64_t>(j) * D;
      float *a = acc + r * D;
#pragma omp simd
      for (int d = 0; d < D; ++d) a[d] += wj * xj[d];
    }
}

// The largest of l[0..n) (n >= 1), eight lanes at a time.
inline float max_of(const float *l, int64_t n) {
  float m = l[0];
#pragma omp simd reduction(max : m)
  for (int64_t t = 0; t < n; ++t) m = l[t] > m ? l[t] : m;
  return m;
}

// l[t] = exp(l[t] - shift) for t < n; returns the sum. Eight lanes at a time with the
// Cephes expf polynomial (about 1 ulp; arguments below -87.3 give ~1e-38 instead of 0), the
// tail with std::exp. The softmax of every decode path runs through this.
inline float exp_shifted_sum(float *l, int64_t n, float shift) {
  int64_t t = 0;
  float sum = 0.0f;
#ifdef __AVX2__
  const __m256 lo = _mm256_set1_ps(-87.3365f), hi = _mm256_set1_ps(88.3762f), sh = _mm256_set1_ps(shift);
  const __m256 log2e = _mm256_set1_ps(1.44269504088896341f), c1 = _mm256_set1_ps(0.693359375f),
               c2 = _mm256_set1_ps(-2.12194440e-4f), one = _mm256_set1_ps(1.0f);
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  auto exp8 = [&](__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(_mm256_sub_ps(x, sh), lo), hi);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(n, c1, x);
    x = _mm256_fnmadd_ps(n, c2, x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, one));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
  };
  for (; t + 16 <= n; t += 16) {
    const __m256 a = exp8(_mm256_loadu_ps(l + t)), b = exp8(_mm256_loadu_ps(l + t + 8));
    _mm256_storeu_ps(l + t, a);
    _mm256_storeu_ps(l + t + 8, b);
    acc0 = _mm256_add_ps(acc0, a);
    acc1 = _mm256_add_ps(acc1, b);
  }
  sum = hsum8(_mm256_add_ps(acc0, acc1));
#endif
  for (; t < n; ++t) sum += (l[t] = std::exp(l[t] - shift));
  return sum;
}

// x = rope(gamma * half(anchor) + residual) for a NeoX (rotate-half) key: pairs (j, j + h),
// dims from 2h on pass through. One pass over the row instead of convert, scale, add and
// rotate in turn. residual may be null (zero). False when this shape has no vector path
// (the caller then takes the general one).
inline bool neox_key_row(const uint16_t *anchor, akv_dtype storage, float gamma, const float *residual,
                         const float *cos_row, const float *sin_row, int h, int D, float *x) {
#ifdef __AVX2__
  if (h % 8 != 0 || (D - 2 * h) % 8 != 0) return false;
  auto load = [&](int d) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i *>(anchor + d));
    const __m256 v = storage == AKV_DTYPE_BF16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16))
                                               : _mm256_cvtph_ps(raw);
    const __m256 g = _mm256_set1_ps(gamma);
    return residual ? _mm256_fmadd_ps(v, g, _mm256_loadu_ps(residual + d)) : _mm256_mul_ps(v, g);
  };
  for (int j = 0; j < h; j += 8) {
    const __m256 x0 = load(j), x1 = load(j + h), c = _mm256_loadu_ps(cos_row + j), s = _mm256_loadu_ps(sin_row + j);
    _mm256_storeu_ps(x + j, _mm256_fmsub_ps(x0, c, _mm256_mul_ps(x1, s)));
    _mm256_storeu_ps(x + j + h, _mm256_fmadd_ps(x0, s, _mm256_mul_ps(x1, c)));
  }
  for (int d = 2 * h; d < D; d += 8) _mm256_storeu_ps(x + d, load(d));
  return true;
#else
  (void)anchor, (void)storage, (void)gamma, (void)residual, (void)cos_row, (void)sin_row, (void)h, (void)D, (void)x;
  return false;
#endif
}

// dot_rows for two vectors at once: out0[r] = rows_r . b0, out1[r] = rows_r . b1. Each row is
// loaded once for both, so the contraction needs 6 loads per 8 multiply-adds instead of 10.
inline void dot_rows2(const float *rows, int64_t stride, int count, const float *b0, const float *b1, int n,
                      float *out0, float *out1) {
  int r = 0;
#ifdef __AVX2__
  if (n % 8 == 0) {
    for (; r + 4 <= count; r += 4) {
      const float *a0 = rows + r * stride, *a1 = a0 + stride, *a2 = a1 + stride, *a3 = a2 + stride;
      __m256 s00 = _mm256_setzero_ps(), s10 = s00, s20 = s00, s30 = s00, s01 = s00, s11 = s00, s21 = s00, s31 = s00;
      for (int i = 0; i < n; i += 8) {
        const __m256 x0 = _mm256_loadu_ps(b0 + i), x1 = _mm256_loadu_ps(b1 + i);
        __m256 a = _mm256_loadu_ps(a0 + i);
        s00 = _mm256_fmadd_ps(a, x0, s00);
        s01 = _mm256_fmadd_ps(a, x1, s01);
        a = _mm256_loadu_ps(a1 + i);
        s10 = _mm256_fmadd_ps(a, x0, s10);
        s11 = _mm256_fmadd_ps(a, x1, s11);
        a = _mm256_loadu_ps(a2 + i);
        s20 = _mm256_fmadd_ps(a, x0, s20);
        s21 = _mm256_fmadd_ps(a, x1, s21);
        a = _mm256_loadu_ps(a3 + i);
        s30 = _mm256_fmadd_ps(a, x0, s30);
        s31 = _mm256_fmadd_ps(a, x1, s31);
      }
      out0[r] = hsum8(s00), out0[r + 1] = hsum8(s10), out0[r + 2] = hsum8(s20), out0[r + 3] = hsum8(s30);
      out1[r] = hsum8(s01), out1[r + 1] = hsum8(s11), out1[r + 2] = hsum8(s21), out1[r + 3] = hsum8(s31);
    }
  }
#endif
  for (; r < count; ++r) {
    out0[r] = dot(rows + r * stride, b0, n);
    out1[r] = dot(rows + r * stride, b1, n);
  }
}

// ---- AVX-512 variants, chosen at run time (has_avx512()) --------------------------------
// The library is built for x86-64-v3 (AVX2); these functions carry their own target, so they
// may only run where has_avx512() is true. They do the work of their AVX2 namesakes with
// sixteen lanes and return false (or are not called) where a shape does not fit.
#if defined(__AVX2__) && defined(__GNUC__) && defined(__x86_64__)
#define AKV_HAVE_AVX512_KERNELS 1
#define AKV_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))
// GCC 12 flags the undefined pass-through operand inside the conversion and set intrinsics.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

inline bool has_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return yes;
}

// Sixteen storage-dtype elements as fp32, times g, plus residual[0..15] when given.
AKV_TARGET_AVX512 inline __m512 scaled_row16(const uint16_t *src, bool bf16, __m512 g, const float *residual) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(src));
  const __m512 v = bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16)) : _mm512_cvtph_ps(raw);
  return residual ? _mm512_fmadd_ps(v, g, _mm512_loadu_ps(residual)) : _mm512_mul_ps(v, g);
}

// neox_key_row with sixteen lanes, or (kGptj) the same key for GPT-J (interleaved) pairs
// (2j, 2j + 1), dims from 2h on passing through, written in NeoX order: x[j] and x[j + h] are
// pair j's rotated dims 2j and 2j + 1. Its dot products are the interleaved key's when the
// query's dims are reordered the same way (the CPU decode's walk_q()). GPT-J loads each 32
// dims as two rows of sixteen and splits them into their even and odd dims with one
// two-source permute each; the rotation is NeoX's.
template <bool kGptj>
AKV_TARGET_AVX512 inline bool key_row_avx512(const uint16_t *anchor, akv_dtype storage, float gamma,
                                             const float *residual, const float *cos_row, const float *sin_row, int h,
                                             int D, float *x) {
  if (h % 16 != 0 || (D - 2 * h) % 16 != 0) return false;
  const __m512 g = _mm512_set1_ps(gamma);
  const bool bf16 = storage == AKV_DTYPE_BF16;
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  for (int j = 0; j < h; j += 16) {
    __m512 x0, x1;
    if constexpr (kGptj) {
      const int d = 2 * j;
      const __m512 lo = scaled_row16(anchor + d, bf16, g, residual ? residual + d : nullptr);
      const __m512 hi = scaled_row16(anchor + d + 16, bf16, g, residual ? residual + d + 16 : nullptr);
      x0 = _mm512_permutex2var_ps(lo, even, hi);
      x1 = _mm512_permutex2var_ps(lo, odd, hi);
    } else {
      x0 = scaled_row16(anchor + j, bf16, g, residual ? residual + j : nullptr);
      x1 = scaled_row16(anchor + j + h, bf16, g, residual ? residual + j + h : nullptr);
    }
    const __m512 c = _mm512_loadu_ps(cos_row + j), s = _mm512_loadu_ps(sin_row + j);
    _mm512_storeu_ps(x + j, _mm512_fmsub_ps(x0, c, _mm512_mul_ps(x1, s)));
    _mm512_storeu_ps(x + j + h, _mm512_fmadd_ps(x0, s, _mm512_mul_ps(x1, c)));
  }
  for (int d = 2 * h; d < D; d += 16)
    _mm512_storeu_ps(x + d, scaled_row16(anchor + d, bf16, g, residual ? residual + d : nullptr));
  return true;
}

// The sixteen horizontal sums of v[0..15] in one vector, transposed: lane 4k + j holds the sum
// of v[4j + k].
AKV_TARGET_AVX512 inline __m512 sum16(const __m512 (&v)[16]) {
  // Halve 16 lanes to 8 (pairs of vectors share a register), then to 4, then within 128 bits.
  __m512 h8[8], h4[4];
  for (int i = 0; i < 8; ++i) {
    const __m512 a = v[2 * i], b = v[2 * i + 1];
    h8[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));  // [a lo+hi | b lo+hi]
  }
  for (int i = 0; i < 4; ++i) {
    const __m512 a = h8[2 * i], b = h8[2 * i + 1];
    h4[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));  // [a0 a1 b0 b1] (128-bit)
  }
  // h4[i] 128-bit lane k holds four partial sums of vector 4i + k; finish like SSE hadd.
  const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(h4[0], h4[1]), _mm512_unpackhi_ps(h4[0], h4[1]));
  const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(h4[2], h4[3]), _mm512_unpackhi_ps(h4[2], h4[3]));
  const __m512 lo = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23)));
  const __m512 hi = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23)));
  return _mm512_add_ps(lo, hi);
}

// sum16 of a 4 x 4 block (lane 4r + t) as four rows of four: out[r][0..3] = lanes 4r..4r+3.
AKV_TARGET_AVX512 inline void store_rows4(__m512 v, float *const (&out)[4]) {
  _mm_storeu_ps(out[0], _mm512_castps512_ps128(v));
  _mm_storeu_ps(out[1], _mm512_extractf32x4_ps(v, 1));
  _mm_storeu_ps(out[2], _mm512_extractf32x4_ps(v, 2));
  _mm_storeu_ps(out[3], _mm512_extractf32x4_ps(v, 3));
}

// Four rows against four vectors (n a multiple of 16): out[r][t] = rows_r . b_t (four
// consecutive logits of each row), with one sixteen-way reduction instead of sixteen
// horizontal sums.
// Always inlined: out of line (three callers) the call and the sixteen accumulators' setup
// cost as much as the work at D = 64.
AKV_TARGET_AVX512 inline __attribute__((always_inline)) void dot_rows4x4_avx512(const float *rows, int64_t stride,
                                                                                const float *const (&b)[4], int n,
                                                                                float *const (&out)[4]) {
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  for (int i = 0; i < n; i += 16) {
    const __m512 x0 = _mm512_loadu_ps(b[0] + i), x1 = _mm512_loadu_ps(b[1] + i), x2 = _mm512_loadu_ps(b[2] + i),
                 x3 = _mm512_loadu_ps(b[3] + i);
    for (int r = 0; r < 4; ++r) {
      const __m512 a = _mm512_loadu_ps(rows + r * stride + i);
      acc[0 * 4 + r] = _mm512_fmadd_ps(a, x0, acc[0 * 4 + r]);
      acc[1 * 4 + r] = _mm512_fmadd_ps(a, x1, acc[1 * 4 + r]);
      acc[2 * 4 + r] = _mm512_fmadd_ps(a, x2, acc[2 * 4 + r]);
      acc[3 * 4 + r] = _mm512_fmadd_ps(a, x3, acc[3 * 4 + r]);
    }
  }
  store_rows4(sum16(acc), out);
}

// The residual codec's levels for sixteen dims: lane i of word w (the sixteen dims' four code
// bytes) has code (w >> 2i) & 3; lv holds the four levels, already times the scale.
AKV_TARGET_AVX512 inline __m512 residual_levels16(const uint8_t *codes, __m512 lv) {
  uint32_t w;
  std::memcpy(&w, codes, 4);
  const __m512i shifts = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i idx = _mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32(static_cast<int>(w)), shifts), _mm512_set1_epi32(3));
  return _mm512_permutexvar_ps(idx, lv);
}
AKV_TARGET_AVX512 inline __m512 scaled_levels(const float (&levels)[4], float scale) {
  return _mm512_mul_ps(_mm512_set1_ps(scale), _mm512_zextps128_ps512(_mm_loadu_ps(levels)));
}

// ResidualCodec::decode_rotated with sixteen lanes (n a multiple of 16): the same products.
AKV_TARGET_AVX512 inline void decode_rotated_avx512(const uint8_t *codes, float scale, const float (&levels)[4], int n,
                                                    float *y) {
  const __m512 lv = scaled_levels(levels, scale);
  for (int i = 0; i < n; i += 16) _mm512_storeu_ps(y + i, residual_levels16(codes + i / 4, lv));
}

// ResidualCodec::decode for a rotated domain of 16 * R dims (R = 4, 8, 16: D' = 64, 128, 256)
// in R registers: levels times scale, the Walsh-Hadamard butterflies in fwht's stage order
// (so the same sums, bit for bit), then times norm * sign (norm_signs: 16 * R floats).
template <int R>
AKV_TARGET_AVX512 inline void decode_residual_avx512(const uint8_t *codes, float scale, const float (&levels)[4],
                                                     const float *norm_signs, float *out) {
  static_assert(R == 4 || R == 8 || R == 16, "64, 128 or 256 dims");
  const __m512 lv = scaled_levels(levels, scale);
  __m512 v[R];
  for (int i = 0; i < R; ++i) v[i] = residual_levels16(codes + 4 * i, lv);
  const __m512 m1 = _mm512_setr_ps(1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1);
  const __m512 m2 = _mm512_setr_ps(1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1);
  const __m512 m4 = _mm512_setr_ps(1, 1, 1, 1, -1, -1, -1, -1, 1, 1, 1, 1, -1, -1, -1, -1);
  const __m512 m8 = _mm512_setr_ps(1, 1, 1, 1, 1, 1, 1, 1, -1, -1, -1, -1, -1, -1, -1, -1);
  for (int i = 0; i < R; ++i) {  // y = x * sign + partner: the partner one, two, four, eight lanes away
    v[i] = _mm512_fmadd_ps(v[i], m1, _mm512_permute_ps(v[i], 0xB1));
    v[i] = _mm512_fmadd_ps(v[i], m2, _mm512_permute_ps(v[i], 0x4E));
    v[i] = _mm512_fmadd_ps(v[i], m4, _mm512_shuffle_f32x4(v[i], v[i], 0xB1));
    v[i] = _mm512_fmadd_ps(v[i], m8, _mm512_shuffle_f32x4(v[i], v[i], 0x4E));
  }
  for (int step = 1; step < R; step <<= 1)
    for (int i = 0; i < R; ++i)
      if (!(i & step)) {
        const __m512 a = v[i], b = v[i + step];
        v[i] = _mm512_add_ps(a, b);
        v[i + step] = _mm512_sub_ps(a, b);
      }
  for (int i = 0; i < R; ++i) _mm512_storeu_ps(out + 16 * i, _mm512_mul_ps(v[i], _mm512_loadu_ps(norm_signs + 16 * i)));
}

// l[t] -= table[cls[t]] for t < n (cls[t] < 4), sixteen lanes at a time.
AKV_TARGET_AVX512 inline void subtract_by_class_avx512(float *l, const uint8_t *cls, int64_t n, const float (&table)[4]) {
  const __m512 tab = _mm512_setr_ps(table[0], table[1], table[2], table[3], 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  int64_t t = 0;
  for (; t + 16 <= n; t += 16) {
    const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(cls + t)));
    _mm512_storeu_ps(l + t, _mm512_sub_ps(_mm512_loadu_ps(l + t), _mm512_permutexvar_ps(idx, tab)));
  }
  for (; t < n; ++t) l[t] -= table[cls[t]];
}

// accumulate_weighted_rows with sixteen lanes: a 4 x 32 block of acc in registers (D a
// multiple of 32); other row counts and widths go to the AVX2 version.
AKV_TARGET_AVX512 inline bool accumulate_weighted_rows_avx512(float *acc, int rows, const float *w, int64_t ldw,
                                                              const float *x, int n, int D) {
  if (rows % 4 != 0 || D % 32 != 0) return false;
  for (int r0 = 0; r0 < rows; r0 += 4) {
    const float *wr[4] = {w + r0 * ldw, w + (r0 + 1) * ldw, w + (r0 + 2) * ldw, w + (r0 + 3) * ldw};
    for (int d0 = 0; d0 < D; d0 += 32) {
      __m512 s[4][2];
      for (int r = 0; r < 4; ++r)
        for (int c = 0; c < 2; ++c) s[r][c] = _mm512_loadu_ps(acc + (r0 + r) * D + d0 + 16 * c);
      for (int j = 0; j < n; ++j) {
        const __m512 x0 = _mm512_loadu_ps(x + static_cast<int64_t>(j) * D + d0);
        const __m512 x1 = _mm512_loadu_ps(x + static_cast<int64_t>(j) * D + d0 + 16);
        for (int r = 0; r < 4; ++r) {
          const __m512 b = _mm512_set1_ps(wr[r][j]);
          s[r][0] = _mm512_fmadd_ps(b, x0, s[r][0]);
          s[r][1] = _mm512_fmadd_ps(b, x1, s[r][1]);
        }
      }
      for (int r = 0; r < 4; ++r)
        for (int c = 0; c < 2; ++c) _mm512_storeu_ps(acc + (r0 + r) * D + d0 + 16 * c, s[r][c]);
    }
  }
  return true;
}
#pragma GCC diagnostic pop
#else
inline bool has_avx512() { return false; }
#endif

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
