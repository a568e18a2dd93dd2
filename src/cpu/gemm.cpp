#include "cpu/gemm.hpp"

#include <algorithm>
#include <mutex>
#include <vector>
#include "core/thread_pool.hpp"
#ifdef ANCHORKV_HAVE_BLAS
#include <cblas.h>
// OpenBLAS's; weak, so that another CBLAS (without it) links too.
extern "C" void openblas_set_num_threads(int) __attribute__((weak));
#endif

namespace akv {

void sgemm(bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float *A, int64_t lda,
           const float *B, int64_t ldb, float beta, float *C, int64_t ldc) {
  if (M <= 0 || N <= 0) return;
#ifdef ANCHORKV_HAVE_BLAS
  static std::once_flag single_threaded;
  std::call_once(single_threaded, [] {
    if (openblas_set_num_threads) openblas_set_num_threads(1);
  });
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

void sgemm(ThreadPool &pool, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float *A,
           int64_t lda, const float *B, int64_t ldb, float beta, float *C, int64_t ldc) {
  // Blocks of at least 16 rows, as many as the pool has threads.
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(pool.size(), M / 16));
  pool.parallel_for(blocks, [&](int64_t b, int64_t e) {
    const int64_t r0 = M * b / blocks, r1 = M * e / blocks;
    sgemm(trans_b, r1 - r0, N, K, alpha, A + r0 * lda, lda, B, ldb, beta, C + r0 * ldc, ldc);
  });
}

}  // namespace akv
