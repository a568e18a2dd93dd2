// CUDA contexts through the C API alone (skip without a CUDA build and a device): a context
// is created on its device, holds caches in device memory and round-trips them through
// serialization byte for byte. Decode with device tensors is in cuda_decode_test.cpp.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "anchorkv/anchorkv.h"

namespace {

struct CudaContext {
  akv_context *ctx = nullptr;
  akv_status status = AKV_OK;
  CudaContext() {
    akv_context_options o;
    akv_context_options_init(&o);
    o.backend = AKV_BACKEND_CUDA;
    status = akv_context_create(&o, &ctx);
  }
  ~CudaContext() { akv_context_destroy(ctx); }
};

TEST(GpuContext, HoldsCachesAndRoundTripsThemByteForByte) {
  CudaContext cuda;
  if (cuda.status == AKV_ERR_BACKEND_UNAVAILABLE) GTEST_SKIP() << akv_last_error_message();
  ASSERT_EQ(cuda.status, AKV_OK) << akv_last_error_message();
  ASSERT_NE(cuda.ctx, nullptr);

  akv_context *cpu = nullptr;
  ASSERT_EQ(akv_context_create(nullptr, &cpu), AKV_OK);
  const int64_t S = 640;
  const int H = 1, Hq = 2, D = 64;
  std::vector<float> k(H * S * D), v(H * S * D), q(Hq * 32 * D);
  for (size_t i = 0; i < k.size(); ++i) {
    k[i] = static_cast<float>((i * 2654435761u) % 1000) / 500.0f - 1.0f;
    v[i] = static_cast<float>((i * 40503u) % 997) / 498.5f - 1.0f;
  }
  for (size_t i = 0; i < q.size(); ++i) q[i] = static_cast<float>((i * 69069u) % 991) / 495.5f - 1.0f;
  akv_prefill p;
  akv_prefill_init(&p);
  p.shape = {S, H, Hq, D};
  p.dtype = AKV_DTYPE_F32;
  p.keys = k.data();
  p.values = v.data();
  p.queries = q.data();
  for (akv_method method : {AKV_METHOD_FULLKV, AKV_METHOD_ANCHORKV}) {
    akv_compress_options o;
    akv_compress_options_init_method(&o, method);
    if (method == AKV_METHOD_ANCHORKV) o.retain_fraction = 0.25;
    akv_cache *cache = nullptr;
    ASSERT_EQ(akv_compress(cpu, &p, &o, &cache, nullptr), AKV_OK) << akv_last_error_message();
    size_t n = 0;
    ASSERT_EQ(akv_cache_serialized_size(cache, &n), AKV_OK);
    std::vector<uint8_t> bytes(n);
    ASSERT_EQ(akv_cache_serialize(cache, bytes.data(), n, &n, nullptr), AKV_OK);
    akv_cache *gpu_cache = nullptr;
    ASSERT_EQ(akv_cache_deserialize(cuda.ctx, bytes.data(), n, &gpu_cache, nullptr), AKV_OK) << akv_last_error_message();
    size_t m = 0;
    ASSERT_EQ(akv_cache_serialized_size(gpu_cache, &m), AKV_OK);
    std::vector<uint8_t> again(m);
    ASSERT_EQ(akv_cache_serialize(gpu_cache, again.data(), m, &m, nullptr), AKV_OK);
    EXPECT_EQ(again, bytes);
    akv_cache_stats gs, cs;
    gs.struct_size = cs.struct_size = sizeof(akv_cache_stats);
    ASSERT_EQ(akv_cache_stats_get(gpu_cache, &gs), AKV_OK);
    ASSERT_EQ(akv_cache_stats_get(cache, &cs), AKV_OK);
    EXPECT_EQ(gs.compressed_bytes, cs.compressed_bytes);
    EXPECT_GE(gs.allocated_bytes, cs.allocated_bytes);  // plus the device view's tables
    akv_cache_destroy(gpu_cache);
    akv_cache_destroy(cache);
  }
  akv_context_destroy(cpu);
}

// The allocator hooks of a CUDA context are used for device memory: a context with hooks
// that count calls is created and destroyed without the hooks being misused.
TEST(GpuContext, AllocatorHooksAreAccepted) {
  struct Counter {
    int allocs = 0, frees = 0;
  } counter;
  akv_context_options o;
  akv_context_options_init(&o);
  o.backend = AKV_BACKEND_CUDA;
  o.allocator.user_data = &counter;
  o.allocator.alloc = [](void *user, size_t) -> void * {
    static_cast<Counter *>(user)->allocs++;
    return nullptr;
  };
  o.allocator.free = [](void *user, void *, size_t) { static_cast<Counter *>(user)->frees++; };
  akv_context *ctx = nullptr;
  const akv_status s = akv_context_create(&o, &ctx);
  if (s == AKV_ERR_BACKEND_UNAVAILABLE) GTEST_SKIP() << akv_last_error_message();
  ASSERT_EQ(s, AKV_OK) << akv_last_error_message();
  akv_context_destroy(ctx);
  EXPECT_EQ(counter.allocs, counter.frees);
}

}  // namespace
