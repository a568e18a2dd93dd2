#include "cpu/gemm.hpp"

#include <algorithm>
#include <vector>
#ifdef ANCHORKV_HAVE_BLAS
#include <cblas.h>
#endif

namespace akv {

void sgemm(bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float *A, int64_t lda,
           const float *B, int64_t ldb, float beta, float *C, int64_t ldc) {
  if (M <= 0 || N <= 0) return;
#ifdef ANCHORKV_HAVE_BLAS
  cblas_sgemm(CblasRowMajor, CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
              static_cast<int>(M), static_cast<int>(N), static_cast<int>(K), alpha, A,
              static_cast<int>(lda), B, static_cast<int>(ldb), beta, C, static_cast<int>(ldc));
#else
  // Blocked fallback: C rows accumulate over k in the order that keeps B rows contiguous.
  constexpr int64_t kBlock = 64;
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) C[i * ldc + j] = beta == 0.0f ? 0.0f : beta * C[i * ldc + j];
  if (trans_b) {
    for (int64_t i0 = 0; i0 < M; i0 += kBlock)
      for (int64_t j0 = 0; j0 < N; j0 += kBlock)
        for (int64_t i = i0; i < std::min(M, i0 + kBlock); ++i)
          for (int64_t j = j0; j < std::min(N, j0 + kBlock); ++j) {
            const float *a = A + i * lda, *b = B + j * ldb;
            float acc = 0.0f;
            for (int64_t k = 0; k < K; ++k) acc += a[k] * b[k];
            C[i * ldc + j] += alpha * acc;
          }
  } else {
    for (int64_t i = 0; i < M; ++i)
      for (int64_t k = 0; k < K; ++k) {
        const float a = alpha * A[i * lda + k];
        if (a == 0.0f) continue;
        const float *b = B + k * ldb;
        float *c = C + i * ldc;
        for (int64_t j = 0; j < N; ++j) c[j] += a * b[j];
      }
  }
#endif
}

}  // namespace akv
