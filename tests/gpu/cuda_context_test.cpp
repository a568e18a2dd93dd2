// CUDA contexts (skip without a CUDA build and a device). The CUDA kernels arrive with the
// CUDA backend issues; until then a CUDA context is created on its device, allocates through
// its allocator, and every data call answers AKV_ERR_UNSUPPORTED naming CUDA, leaving the
// context usable.
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

TEST(GpuContext, CreatesOnADeviceAndRefusesUnimplementedCallsCleanly) {
  CudaContext cuda;
  if (cuda.status == AKV_ERR_BACKEND_UNAVAILABLE) GTEST_SKIP() << akv_last_error_message();
  ASSERT_EQ(cuda.status, AKV_OK) << akv_last_error_message();
  ASSERT_NE(cuda.ctx, nullptr);

  // A small FullKV cache built on the CPU, serialized; the CUDA context must refuse to
  // deserialize it (not implemented yet) without crashing, and then still refuse cleanly.
  akv_context *cpu = nullptr;
  ASSERT_EQ(akv_context_create(nullptr, &cpu), AKV_OK);
  const int64_t S = 64;
  const int H = 1, Hq = 2, D = 64;
  std::vector<float> k(H * S * D, 0.25f), v(H * S * D, -0.5f);
  akv_prefill p;
  akv_prefill_init(&p);
  p.shape = {S, H, Hq, D};
  p.dtype = AKV_DTYPE_F32;
  p.keys = k.data();
  p.values = v.data();
  akv_compress_options o;
  akv_compress_options_init_method(&o, AKV_METHOD_FULLKV);
  akv_cache *cache = nullptr;
  ASSERT_EQ(akv_compress(cpu, &p, &o, &cache, nullptr), AKV_OK) << akv_last_error_message();
  size_t n = 0;
  ASSERT_EQ(akv_cache_serialized_size(cache, &n), AKV_OK);
  std::vector<uint8_t> bytes(n);
  ASSERT_EQ(akv_cache_serialize(cache, bytes.data(), n, &n, nullptr), AKV_OK);
  for (int attempt = 0; attempt < 2; ++attempt) {
    akv_cache *gpu_cache = nullptr;
    const akv_status s = akv_cache_deserialize(cuda.ctx, bytes.data(), n, &gpu_cache, nullptr);
    EXPECT_EQ(s, AKV_ERR_UNSUPPORTED) << akv_status_string(s);
    EXPECT_EQ(gpu_cache, nullptr);
    EXPECT_NE(std::string(akv_last_error_message()).find("CUDA"), std::string::npos) << akv_last_error_message();
  }
  akv_cache_destroy(cache);
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
