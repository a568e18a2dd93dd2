// The CUDA compression pass's device policy on host memory (the Dev of
// cuda/compress_pipeline.hpp): kernels through the SIMT emulation, GEMMs and sorts on the host.
// Include after cuda/compress_pipeline.hpp (built with AKV_SIMT_EMULATION).
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "core/dtype.hpp"

namespace akv_test {

// The device policy of the pipeline on host memory.
struct EmulatedDevice {
  template <typename... KArgs, typename... Args>
  void launch(void (*kernel)(KArgs...), int gx, int gy, int block, Args &&...args) {
    simt::launch(simt::dim3(gx, gy), simt::dim3(block), 0, kernel, static_cast<KArgs>(args)...);
  }
  // GEMMs on the host (cuBLAS's part of the pipeline).
  static void gemm(int64_t M, int64_t N, int64_t K, float alpha, const float *A, int64_t a_i, int64_t a_k,
                   const float *B, int64_t b_k, int64_t b_j, float *C, int64_t ldc) {
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) {
        float acc = 0.0f;
        for (int64_t k = 0; k < K; ++k) acc += A[i * a_i + k * a_k] * B[k * b_k + j * b_j];
        C[i * ldc + j] = alpha * acc;
      }
  }
  void gemm_nt(int64_t M, int64_t N, int64_t K, float alpha, const float *A, int64_t lda, const float *B, int64_t ldb,
               float *C, int64_t ldc) {
    gemm(M, N, K, alpha, A, lda, 1, B, 1, ldb, C, ldc);
  }
  void gemm_nn(int64_t M, int64_t N, int64_t K, float alpha, const float *A, int64_t lda, const float *B, int64_t ldb,
               float *C, int64_t ldc) {
    gemm(M, N, K, alpha, A, lda, 1, B, ldb, 1, C, ldc);
  }
  void gemm_nt_batched(int64_t M, int64_t N, int64_t K, float alpha, const float *A, int64_t lda, int64_t sa,
                       const float *B, int64_t ldb, int64_t sb, float *C, int64_t ldc, int64_t sc, int batch) {
    for (int i = 0; i < batch; ++i) gemm_nt(M, N, K, alpha, A + i * sa, lda, B + i * sb, ldb, C + i * sc, ldc);
  }
  // bf16 operands (exact in float): the fp32 form on their values.
  void gemm_nt_batched_bf16(int64_t M, int64_t N, int64_t K, float alpha, const uint16_t *A, int64_t lda, int64_t sa,
                            const uint16_t *B, int64_t ldb, int64_t sb, float *C, int64_t ldc, int64_t sc, int batch) {
    auto widen = [](const uint16_t *x, int64_t n) {
      std::vector<float> out(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) out[i] = akv::bf16_to_float(x[i]);
      return out;
    };
    for (int i = 0; i < batch; ++i) {
      const std::vector<float> a = widen(A + i * sa, (M - 1) * lda + K), b = widen(B + i * sb, (N - 1) * ldb + K);
      gemm_nt(M, N, K, alpha, a.data(), lda, b.data(), ldb, C + i * sc, ldc);
    }
  }
  // The device's segmented sort composes 64-bit keys (segment << 32 | key) with the
  // emulated segment_keys_kernel, sorts them stably, and splits them with
  // split_segment_keys_kernel: the same here, with std::stable_sort for the radix sort.
  void sort_segments_u32(uint32_t *keys, uint32_t *values, int segments, int64_t n) {
    const int64_t total = segments * n;
    if (total <= 1) return;
    std::vector<uint64_t> wide(total);
    std::vector<uint32_t> ids(values, values + total);
    launch(akv::cuda::segment_keys_kernel, akv::cuda::grid_blocks(total, 128), 1, 128,
           static_cast<const uint32_t *>(keys), n, total, wide.data());
    sort(wide.data(), ids.data(), total);
    launch(akv::cuda::split_segment_keys_kernel, akv::cuda::grid_blocks(total, 128), 1, 128,
           static_cast<const uint64_t *>(wide.data()), static_cast<const uint32_t *>(ids.data()), total, keys, values);
  }
  template <typename K>
  void sort(K *keys, uint32_t *values, int64_t n) {
    std::vector<std::pair<K, uint32_t>> v(n);
    for (int64_t i = 0; i < n; ++i) v[i] = {keys[i], values[i]};
    std::stable_sort(v.begin(), v.end(), [](const auto &x, const auto &y) { return x.first < y.first; });
    for (int64_t i = 0; i < n; ++i) keys[i] = v[i].first, values[i] = v[i].second;
  }
  void sort_u32(uint32_t *keys, uint32_t *values, int64_t n) { sort(keys, values, n); }
  void sort_u64(uint64_t *keys, uint32_t *values, int64_t n) { sort(keys, values, n); }
  void copy(void *dst, const void *src, size_t bytes) { std::memmove(dst, src, bytes); }
  void fill(void *dst, int byte, size_t bytes) { std::memset(dst, byte, bytes); }
  void read(void *host, const void *src, size_t bytes) { std::memcpy(host, src, bytes); }
  int read_int(const int32_t *p) { return *p; }
  void stage(int) {}
  bool profiling = false;  // as CudaDevice's: the candidate searches' counts
  uint32_t search_counts[6] = {};
};

}  // namespace akv_test
