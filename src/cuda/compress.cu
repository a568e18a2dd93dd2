// The AnchorKV compression pass on a CUDA device: the pipeline of cuda/compress_pipeline.hpp
// with GEMMs through cuBLAS (fp32, strided-batched over heads where the pipeline batches) and
// sorts through CUB's radix sort (a segmented sort as one sort of composite keys), on the caller's
// stream, with scratch memory from the context's per-stream workspace.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cub/device/device_radix_sort.cuh>
#include <cxxabi.h>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <utility>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "cuda/backend.hpp"
#include "cuda/compress_pipeline.hpp"
#include "cuda/cuda_util.cuh"
#include "methods/methods.hpp"

namespace akv {
namespace cuda {
namespace {

using cuda::check;  // the cudaError_t overload (cuda_util.cuh) beside this one
void check(cublasStatus_t status, const char *what) {
  if (status != CUBLAS_STATUS_SUCCESS) fail(AKV_ERR_BACKEND, what, " failed: cuBLAS status ", static_cast<int>(status));
}

// The context's cuBLAS handle, created on first use with a workspace from the context's
// allocator (so every device allocation goes through the allocator hooks).
cublasHandle_t blas_handle(akv_context &ctx) {
  std::lock_guard<std::mutex> lock(state(ctx).mutex);
  if (!state(ctx).blas) {
    cublasHandle_t handle = nullptr;
    check(cublasCreate(&handle), "cublasCreate");
    constexpr size_t kBlasWorkspace = 32u << 20;  // cuBLAS's recommendation for Hopper
    void *ws = nullptr;
    try {
      ws = ctx.allocate(kBlasWorkspace);
      check(cublasSetWorkspace(handle, ws, kBlasWorkspace), "cublasSetWorkspace");
    } catch (...) {
      cublasDestroy(handle);
      ctx.deallocate(ws, kBlasWorkspace);
      throw;
    }
    akv_context *owner = &ctx;
    state(ctx).blas = std::shared_ptr<void>(handle, [owner, ws](void *h) {
      cublasDestroy(static_cast<cublasHandle_t>(h));
      owner->deallocate(ws, kBlasWorkspace);
    });
  }
  return static_cast<cublasHandle_t>(state(ctx).blas.get());
}

struct CudaDevice {
  // blas may be null (no GEMMs); otherwise its work goes on `stream`.
  CudaDevice(void *raw_stream, cublasHandle_t handle) : stream(static_cast<cudaStream_t>(raw_stream)), blas(handle) {
    if (blas) check(cublasSetStream(blas, stream), "cublasSetStream");
  }
  cudaStream_t stream;
  cublasHandle_t blas;
  void *sort_temp = nullptr;
  size_t sort_temp_bytes = 0;
  uint32_t *alt_keys32 = nullptr, *alt_values = nullptr;
  uint64_t *alt_keys64 = nullptr, *wide_keys = nullptr;  // wide_keys: sort_segments_u32's composite keys
  // Operations put on the stream (kernels, cuBLAS calls, CUB sorts, copies, fills), and with
  // ANCHORKV_COMPRESS_PROFILE set, an event at every stage mark (stage()).
  int64_t operations = 0;
  bool profiling = false;
  // With profiling, format 3's candidate searches over the coverage rounds (local_nearest_kernel's
  // stats): tokens searched, left alone, candidates rescored, full scans; then the token-sides
  // outside their segment's table, and the most in one segment (segment_tables_kernel's).
  uint32_t search_counts[6] = {};
  std::vector<std::pair<int, cudaEvent_t>> marks;
  // With profiling, each kernel launch between two events: the report adds the kernels' own
  // times by kernel (a stage's time is a few kernels; the first device run gave only stages).
  struct Timed {
    const void *kernel;
    cudaEvent_t start, stop;
  };
  std::vector<Timed> timed;

  ~CudaDevice() {
    for (auto &m : marks) cudaEventDestroy(m.second);
    for (auto &t : timed) {
      if (t.start) cudaEventDestroy(t.start);
      if (t.stop) cudaEventDestroy(t.stop);
    }
  }
  // A kernel's name without namespaces, template arguments or parameters.
  static std::string kernel_name(const void *kernel) {
    const char *raw = nullptr;
    if (cudaFuncGetName(&raw, kernel) != cudaSuccess || !raw) return "?";
    int status = 0;
    char *demangled = abi::__cxa_demangle(raw, nullptr, nullptr, &status);
    std::string name = status == 0 && demangled ? demangled : raw;
    std::free(demangled);
    name = name.substr(0, name.find_first_of("<("));
    const size_t colon = name.rfind("::"), space = name.rfind(' ');
    if (colon != std::string::npos) name = name.substr(colon + 2);
    else if (space != std::string::npos) name = name.substr(space + 1);
    return name;
  }
  // "; kernels: name ms (launches), ...", the most expensive first.
  std::string kernel_times() const {
    std::vector<std::pair<const void *, std::pair<double, int>>> sums;
    for (const Timed &t : timed) {
      float ms = 0.0f;
      check(cudaEventElapsedTime(&ms, t.start, t.stop), "cudaEventElapsedTime");
      auto it = std::find_if(sums.begin(), sums.end(), [&](const auto &x) { return x.first == t.kernel; });
      if (it == sums.end()) sums.push_back({t.kernel, {ms, 1}});
      else it->second.first += ms, it->second.second += 1;
    }
    std::sort(sums.begin(), sums.end(), [](const auto &a, const auto &b) { return a.second.first > b.second.first; });
    std::string out = sums.empty() ? "" : "; kernels:";
    for (const auto &x : sums) {
      char item[160];
      std::snprintf(item, sizeof item, " %s %.3f ms (%d),", kernel_name(x.first).c_str(), x.second.first, x.second.second);
      out += item;
    }
    if (!sums.empty()) out.pop_back();
    return out;
  }
  void stage(int id) {
    if (!profiling) return;
    cudaEvent_t e = nullptr;
    check(cudaEventCreate(&e), "cudaEventCreate");
    marks.emplace_back(id, e);
    check(cudaEventRecord(e, stream), "cudaEventRecord");
  }
  // After the pass (the stream has been waited for): one line on stderr, milliseconds per stage
  // summed over heads and sides, and the operation count.
  void report(const char *what, int64_t seq_len) {
    if (!profiling || marks.empty()) return;
    check(cudaEventSynchronize(marks.back().second), "cudaEventSynchronize");
    double per_stage[kStageCount] = {};
    for (size_t i = 0; i + 1 < marks.size(); ++i) {
      float ms = 0.0f;
      check(cudaEventElapsedTime(&ms, marks[i].second, marks[i + 1].second), "cudaEventElapsedTime");
      if (marks[i].first >= 0 && marks[i].first < kStageCount) per_stage[marks[i].first] += ms;
    }
    std::string tail = "; " + std::to_string(operations) + " stream operations";
    if (search_counts[0] > 0) {
      const double n = search_counts[0], searched = n - search_counts[1];
      char line[200];
      std::snprintf(line, sizeof line,
                    "; rounds' searches: %.3f of %u tokens left alone, %.2f candidates rescored and %.3f full scans "
                    "per token searched",
                    search_counts[1] / n, search_counts[0], searched > 0 ? search_counts[2] / searched : 0.0,
                    searched > 0 ? search_counts[3] / searched : 0.0);
      tail += line;
      std::snprintf(line, sizeof line, "; outside their tables: %u token-sides, at most %u in a segment",
                    search_counts[4], search_counts[5]);
      tail += line;
    }
    tail += kernel_times();
    print_stage_profile(what, seq_len, per_stage, tail.c_str());
  }

  template <typename... KArgs, typename... Args>
  void launch(void (*kernel)(KArgs...), int gx, int gy, int block, Args &&...args) {
    if (profiling) {  // the destructor destroys what was created
      timed.push_back(Timed{reinterpret_cast<const void *>(kernel), nullptr, nullptr});
      check(cudaEventCreate(&timed.back().start), "cudaEventCreate");
      check(cudaEventCreate(&timed.back().stop), "cudaEventCreate");
      check(cudaEventRecord(timed.back().start, stream), "cudaEventRecord");
    }
    kernel<<<dim3(gx, gy), block, 0, stream>>>(static_cast<KArgs>(args)...);
    check(cudaGetLastError(), "a compression kernel launch");
    if (profiling) check(cudaEventRecord(timed.back().stop, stream), "cudaEventRecord");
    ++operations;
  }
  // Row-major C = alpha A B^T (op_b T) and C = alpha A B (op_b N) as column-major cuBLAS calls
  // on the transposes.
  void gemm_nt(int64_t M, int64_t N, int64_t K, float alpha, const float *A, int64_t lda, const float *B, int64_t ldb,
               float *C, int64_t ldc) {
    gemm(CUBLAS_OP_T, M, N, K, alpha, A, lda, 0, B, ldb, 0, C, ldc, 0, 0);
  }
  void gemm_nn(int64_t M, int64_t N, int64_t K, float alpha, const float *A, int64_t lda, const float *B, int64_t ldb,
               float *C, int64_t ldc) {
    gemm(CUBLAS_OP_N, M, N, K, alpha, A, lda, 0, B, ldb, 0, C, ldc, 0, 0);
  }
  // Strided-batched forms: problem i's operands at A + i sa, B + i sb, C + i sc.
  void gemm_nt_batched(int64_t M, int64_t N, int64_t K, float alpha, const float *A, int64_t lda, int64_t sa,
                       const float *B, int64_t ldb, int64_t sb, float *C, int64_t ldc, int64_t sc, int batch) {
    gemm(CUBLAS_OP_T, M, N, K, alpha, A, lda, sa, B, ldb, sb, C, ldc, sc, batch);
  }
  // gemm_nt_batched with bf16 operands: the products exact, fp32 accumulation and output (the
  // tensor cores; cuBLAS's own order of the sums, as for the SGEMM).
  void gemm_nt_batched_bf16(int64_t M, int64_t N, int64_t K, float alpha, const uint16_t *A, int64_t lda, int64_t sa,
                            const uint16_t *B, int64_t ldb, int64_t sb, float *C, int64_t ldc, int64_t sc, int batch) {
    const float beta = 0.0f;
    ++operations;
    check(cublasGemmStridedBatchedEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(N), static_cast<int>(M),
                                     static_cast<int>(K), &alpha, B, CUDA_R_16BF, static_cast<int>(ldb), sb, A,
                                     CUDA_R_16BF, static_cast<int>(lda), sa, &beta, C, CUDA_R_32F,
                                     static_cast<int>(ldc), sc, batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
          "cublasGemmStridedBatchedEx");
  }
  // The one cuBLAS call of each form (batch 0: a plain SGEMM, else strided-batched).
  void gemm(cublasOperation_t op_b, int64_t M, int64_t N, int64_t K, float alpha, const float *A, int64_t lda,
            int64_t sa, const float *B, int64_t ldb, int64_t sb, float *C, int64_t ldc, int64_t sc, int batch) {
    const float beta = 0.0f;
    ++operations;
    if (batch == 0)
      check(cublasSgemm(blas, op_b, CUBLAS_OP_N, static_cast<int>(N), static_cast<int>(M), static_cast<int>(K), &alpha, B,
                        static_cast<int>(ldb), A, static_cast<int>(lda), &beta, C, static_cast<int>(ldc)),
            "cublasSgemm");
    else
      check(cublasSgemmStridedBatched(blas, op_b, CUBLAS_OP_N, static_cast<int>(N), static_cast<int>(M),
                                      static_cast<int>(K), &alpha, B, static_cast<int>(ldb), sb, A, static_cast<int>(lda),
                                      sa, &beta, C, static_cast<int>(ldc), sc, batch),
            "cublasSgemmStridedBatched");
  }
  template <typename K>
  void sort(K *keys, K *alt, uint32_t *values, int64_t n, int end_bit = 8 * sizeof(K)) {
    if (n <= 1) return;
    cub::DoubleBuffer<K> dk(keys, alt);
    cub::DoubleBuffer<uint32_t> dv(values, alt_values);
    size_t bytes = sort_temp_bytes;
    ++operations;
    check(cub::DeviceRadixSort::SortPairs(sort_temp, bytes, dk, dv, static_cast<int>(n), 0, end_bit, stream),
          "cub::DeviceRadixSort::SortPairs");
    if (dk.Current() != keys) copy(keys, dk.Current(), n * sizeof(K));
    if (dv.Current() != values) copy(values, dv.Current(), n * sizeof(uint32_t));
  }
  // `segments` runs of n keys, each sorted stably: composite keys (segment << 32 | key) in one
  // device-wide radix sort over the bits in use (a segmented sort would give each segment one
  // block), split back into keys and values.
  void sort_segments_u32(uint32_t *keys, uint32_t *values, int segments, int64_t n) {
    if (segments <= 1) return sort_u32(keys, values, n);
    const int64_t total = static_cast<int64_t>(segments) * n;
    if (total <= 1) return;
    int segment_bits = 0;
    while ((int64_t{1} << segment_bits) < segments) ++segment_bits;
    launch(segment_keys_kernel, grid_blocks(total, 256), 1, 256, static_cast<const uint32_t *>(keys), n, total,
           wide_keys);
    cub::DoubleBuffer<uint64_t> dk(wide_keys, alt_keys64);
    cub::DoubleBuffer<uint32_t> dv(values, alt_values);
    size_t bytes = sort_temp_bytes;
    ++operations;
    check(cub::DeviceRadixSort::SortPairs(sort_temp, bytes, dk, dv, static_cast<int>(total), 0, 32 + segment_bits,
                                          stream),
          "cub::DeviceRadixSort::SortPairs");
    launch(split_segment_keys_kernel, grid_blocks(total, 256), 1, 256, static_cast<const uint64_t *>(dk.Current()),
           static_cast<const uint32_t *>(dv.Current()), total, keys, values);
  }
  void sort_u32(uint32_t *keys, uint32_t *values, int64_t n) { sort(keys, alt_keys32, values, n); }
  void sort_u64(uint64_t *keys, uint32_t *values, int64_t n) { sort(keys, alt_keys64, values, n); }
  void copy(void *dst, const void *src, size_t bytes) {
    if (bytes) check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream), "cudaMemcpyAsync");
    operations += bytes != 0;
  }
  void fill(void *dst, int byte, size_t bytes) {
    if (bytes) check(cudaMemsetAsync(dst, byte, bytes, stream), "cudaMemsetAsync");
    operations += bytes != 0;
  }
  void read(void *host, const void *src, size_t bytes) {
    if (bytes) check(cudaMemcpyAsync(host, src, bytes, cudaMemcpyDeviceToHost, stream), "cudaMemcpyAsync");
    check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  }
  int read_int(const int32_t *p) {
    int32_t value = 0;
    check(cudaMemcpyAsync(&value, p, sizeof value, cudaMemcpyDeviceToHost, stream), "cudaMemcpyAsync");
    check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    return value;
  }
};

// The stream's workspace for a pipeline of `pipeline_bytes` plus the radix sorts of up to
// `most` items (second buffers and CUB's temporary storage), wired into `dev`.
uint8_t *reserve_sort_scratch(akv_context &ctx, CudaDevice &dev, size_t pipeline_bytes, int64_t most, void *stream) {
  size_t temp32 = 0, temp64 = 0;
  cub::DoubleBuffer<uint32_t> k32(nullptr, nullptr), v(nullptr, nullptr);
  cub::DoubleBuffer<uint64_t> k64(nullptr, nullptr);
  check(cub::DeviceRadixSort::SortPairs(nullptr, temp32, k32, v, static_cast<int>(most), 0, 32, dev.stream), "cub sizing");
  check(cub::DeviceRadixSort::SortPairs(nullptr, temp64, k64, v, static_cast<int>(most), 0, 64, dev.stream), "cub sizing");
  auto up = [](size_t x) { return (x + 255) / 256 * 256; };
  dev.sort_temp_bytes = std::max(temp32, temp64);
  const size_t total = up(pipeline_bytes) + up(most * 4) * 2 + up(most * 8) * 2 + up(dev.sort_temp_bytes);
  uint8_t *base = static_cast<uint8_t *>(workspace(ctx, total, stream, CudaBackend::kCompressWorkspace));
  uint8_t *extra = base + up(pipeline_bytes);
  dev.alt_keys32 = reinterpret_cast<uint32_t *>(extra);
  dev.alt_values = reinterpret_cast<uint32_t *>(extra + up(most * 4));
  dev.alt_keys64 = reinterpret_cast<uint64_t *>(extra + 2 * up(most * 4));
  dev.wide_keys = reinterpret_cast<uint64_t *>(extra + 2 * up(most * 4) + up(most * 8));
  dev.sort_temp = extra + 2 * up(most * 4) + 2 * up(most * 8);
  return base;
}

}  // namespace

std::unique_ptr<akv_cache> compress_fullkv_cuda(const CompressRequest &req, void *stream) {
  akv_context &ctx = *req.context;
  const akv_prefill &p = *req.prefill;
  DeviceScope scope(ctx.device);
  std::unique_ptr<akv_cache> cache = new_cache(req);
  cache->data = Buffer(&ctx, full_bytes(p.shape));
  FullScratch measure;
  const int pairs = cache->rope.enabled() ? cache->rope.pairs() : 0;
  uint8_t *base = static_cast<uint8_t *>(workspace(ctx, measure.carve(nullptr, p.shape.seq_len, pairs, paged_blocks(p)), stream, CudaBackend::kCompressWorkspace));
  CudaDevice dev(stream, nullptr);
  compress_fullkv(dev, p, *req.options, *cache, cache->data.data(), base);
  return cache;
}

std::unique_ptr<akv_cache> compress_eviction_cuda(const CompressRequest &req, void *stream) {
  akv_context &ctx = *req.context;
  const akv_prefill &p = *req.prefill;
  const akv_compress_options &o = *req.options;
  DeviceScope scope(ctx.device);
  const EvictionBudget &budget = req.plan->eviction;
  std::unique_ptr<akv_cache> cache = new_cache(req);
  cache->data = Buffer(&ctx, budget.footprint);
  CudaDevice dev(stream, blas_handle(ctx));
  const int H = p.shape.num_kv_heads, D = p.shape.head_dim, pairs = cache->rope.enabled() ? cache->rope.pairs() : 0;
  EvictionScratch measure;
  const size_t pipeline_bytes = measure.carve(nullptr, budget.seq_len, budget.prefix, H, D,
                                              p.shape.num_q_heads / H * budget.window, pairs, budget.layer_tokens,
                                              o.method == AKV_METHOD_ANDPRO, paged_blocks(p));
  const int64_t most = std::max<int64_t>(static_cast<int64_t>(H) * budget.prefix, 2);
  uint8_t *base = reserve_sort_scratch(ctx, dev, pipeline_bytes, most, stream);
  compress_eviction(dev, p, o, *cache, budget, cache->data.data(), base);
  return cache;
}

std::unique_ptr<akv_cache> compress_anchorkv_cuda(const CompressRequest &req, void *stream) {
  akv_context &ctx = *req.context;
  const akv_prefill &p = *req.prefill;
  const akv_compress_options &o = *req.options;
  DeviceScope scope(ctx.device);

  std::unique_ptr<akv_cache> cache = new_cache(req);
  const std::vector<int32_t> positions = prepare_anchor_cache(p, req.plan->anchor, o, *cache);
  const AnchorGeometry &g = cache->geometry;
  cache->data = Buffer(&ctx, cache->layout.total_bytes);

  CudaDevice dev(stream, blas_handle(ctx));
  dev.profiling = compress_profiling();
  // Scratch: the pipeline's arrays, then the sorts' second buffers and temporary storage.
  CompressScratch measure;
  const int pairs = cache->rope.enabled() ? cache->rope.pairs() : 0;
  const bool half_kpost = kpost_bf16_for(g, p, o, pairs);
  // Heads per batch: all of them while the pipeline's scratch stays within kHeadBatchBudget.
  const int head_batch = anchor_head_batch(g, pairs, paged_blocks(p), kHeadBatchBudget, half_kpost);
  const size_t pipeline_bytes = measure.carve(nullptr, g.seq_len, g.prefix, g.heads, g.dim, g.group() * g.window,
                                              g.anchors, pairs, paged_blocks(p), head_batch, half_kpost);
  // The largest sort: a ranking of every head's prefix, or (format 3) every head's candidates.
  const int64_t most = std::max<int64_t>(static_cast<int64_t>(g.heads) * std::max<int64_t>(g.prefix, g.anchors), 2);
  uint8_t *base = reserve_sort_scratch(ctx, dev, pipeline_bytes, most, stream);
  compress_anchorkv(dev, p, o, *cache, positions, cache->data.data(), base, head_batch);  // waits at the end (NaN check)
  dev.report("AnchorKV compress", g.seq_len);
  return cache;
}

}  // namespace cuda
}  // namespace akv
