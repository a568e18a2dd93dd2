// Single-precision GEMM for the compression pass: CBLAS (OpenBLAS) when the build found it,
// otherwise a cache-blocked fallback. Row-major throughout.
#pragma once
#include <cstdint>

namespace akv {

// C[M][N] = alpha * A[M][K] * (trans_b ? B[N][K]^T : B[K][N]) + beta * C.
void sgemm(bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float *A, int64_t lda,
           const float *B, int64_t ldb, float beta, float *C, int64_t ldc);

}  // namespace akv
