// Single-precision GEMM for the compression pass: CBLAS (OpenBLAS) when the build found it,
// otherwise a cache-blocked fallback. Row-major throughout.
//
// Every call runs on the calling thread only: the first one sets OpenBLAS to one thread
// (openblas_set_num_threads(1), process-wide for the OpenBLAS this library links). OpenBLAS's
// own threads busy-wait between calls; beside the context's pool and the caller's threads
// (torch's, in anchorkv.transformers) they took the 2-core machine from every other thread:
// SmolLM2 through transformers compressed 3.6x and decoded 4.2x slower. The parallelism
// is the context's pool instead (num_threads is honoured), splitting C's rows.
#pragma once
#include <cstdint>

namespace akv {

class ThreadPool;

// C[M][N] = alpha * A[M][K] * (trans_b ? B[N][K]^T : B[K][N]) + beta * C.
void sgemm(bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float *A, int64_t lda,
           const float *B, int64_t ldb, float beta, float *C, int64_t ldc);
// The same with C's rows split over the pool's threads.
void sgemm(ThreadPool &pool, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float *A,
           int64_t lda, const float *B, int64_t ldb, float beta, float *C, int64_t ldc);

}  // namespace akv
