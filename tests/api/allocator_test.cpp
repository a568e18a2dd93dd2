// The bytes a cache really holds, counted through the context's allocator hooks, against the
// footprint the stats and akv_compressed_size report.
#include "api/api_test_util.hpp"
#include "api/counting_allocator.hpp"

namespace akv_test {
namespace {

// Per array the library may round its allocation (alignment, padding); 20 arrays is more than
// the layout of SPEC 3 has, plus 4 KiB for a cache header. Documented slack, not a fudge.
constexpr uint64_t kAllowedOverheadBytes = 20 * 64 + 4096;

struct FootprintCase {
  const char *name;
  akv_method method;
  int64_t S;
  int H, G, D;
  double margin_over_minimum_theta;  // AnchorKV: theta = minimum + this
  akv_dtype dtype;
};

class CacheFootprint : public ::testing::TestWithParam<FootprintCase> {};

TEST_P(CacheFootprint, AllocatedBytesMatchTheHookAndTheReportedFootprint) {
  const FootprintCase &c = GetParam();
  const uint64_t seed = fresh_seed();
  AKV_TRACE_SEED(seed);
  Rng rng(seed);
  PrefillSpec spec;
  spec.seq_len = c.S;
  spec.kv_heads = c.H;
  spec.group = c.G;
  spec.head_dim = c.D;
  spec.dtype = c.dtype;
  const PrefillData data = make_prefill(rng, spec);
  const akv_compress_options options =
      c.method == AKV_METHOD_FULLKV
          ? fullkv_options()
          : anchorkv_options(workable_retain_fraction(data.shape, 32, 0, c.margin_over_minimum_theta));

  CountingAllocator counter;
  const akv_allocator hooks = counter.hooks();
  {
    ContextPtr context = make_context(0, &hooks);
    const uint64_t before_compress = counter.live_bytes();
    CachePtr cache = compress(context.get(), data, options);
    const uint64_t after_compress = counter.live_bytes();
    const akv_cache_stats stats = cache_stats(cache.get());
    size_t predicted = 0;
    ASSERT_EQ(akv_compressed_size(&options, &data.shape, &predicted), AKV_OK) << akv_last_error_message();
    EXPECT_EQ(stats.compressed_bytes, predicted);
    if (c.method == AKV_METHOD_FULLKV) {
      EXPECT_EQ(stats.compressed_bytes, stats.full_bytes);
    }
    EXPECT_LE(static_cast<double>(stats.compressed_bytes), options.retain_fraction * stats.full_bytes);

    // Reserve room for appended tokens: the dense suffix (storage dtype, K and V) goes
    // through the hook too.
    const int reserve_tokens = 100;
    ASSERT_EQ(akv_cache_reserve(cache.get(), reserve_tokens, nullptr), AKV_OK) << akv_last_error_message();
    const akv_cache_stats reserved = cache_stats(cache.get());
    const uint64_t after_reserve = counter.live_bytes();
    EXPECT_GE(reserved.append_capacity, reserve_tokens);
    EXPECT_EQ(reserved.appended_tokens, 0);

    cache.reset();
    const uint64_t after_destroy = counter.live_bytes();
    const uint64_t held_after_compress = after_compress - after_destroy;
    const uint64_t held_after_reserve = after_reserve - after_destroy;
    EXPECT_LE(after_destroy, after_compress);
    EXPECT_GE(after_destroy, before_compress) << "destroying the cache freed more than it allocated";

    EXPECT_EQ(stats.allocated_bytes, held_after_compress)
        << "stats.allocated_bytes disagrees with what the allocator hook handed out";
    EXPECT_GE(stats.allocated_bytes, stats.compressed_bytes) << "the footprint is not physically held";
    EXPECT_LE(stats.allocated_bytes, stats.compressed_bytes + kAllowedOverheadBytes)
        << "the cache holds more than its reported footprint (+" << kAllowedOverheadBytes << " B slack)";

    const uint64_t suffix_bytes = 4ull * reserved.append_capacity * c.H * c.D;
    EXPECT_EQ(reserved.allocated_bytes, held_after_reserve);
    EXPECT_GE(reserved.allocated_bytes, stats.compressed_bytes + 4ull * reserve_tokens * c.H * c.D);
    EXPECT_LE(reserved.allocated_bytes, stats.compressed_bytes + suffix_bytes + kAllowedOverheadBytes);
  }
  EXPECT_EQ(counter.live_bytes(), 0u) << "bytes still allocated after the context was destroyed";
  EXPECT_EQ(counter.live_blocks(), 0u);
  EXPECT_EQ(counter.bad_frees(), 0u) << "free() got an unknown pointer or the wrong size";
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CacheFootprint,
    ::testing::Values(FootprintCase{"AnchorKV_S512", AKV_METHOD_ANCHORKV, 512, 2, 2, 64, 0.1, AKV_DTYPE_F32},
                      FootprintCase{"AnchorKV_S1001_Odd", AKV_METHOD_ANCHORKV, 1001, 3, 1, 128, 0.05, AKV_DTYPE_BF16},
                      FootprintCase{"AnchorKV_S33", AKV_METHOD_ANCHORKV, 33, 2, 4, 64, 0.01, AKV_DTYPE_F16},
                      FootprintCase{"AnchorKV_S4096", AKV_METHOD_ANCHORKV, 4096, 2, 4, 128, 0.03, AKV_DTYPE_BF16},
                      FootprintCase{"FullKV_S777", AKV_METHOD_FULLKV, 777, 2, 2, 64, 0.0, AKV_DTYPE_F32}),
    [](const ::testing::TestParamInfo<FootprintCase> &info) { return std::string(info.param.name); });

TEST(AllocatorHook, AppendWithoutReserveGrowsThroughTheHook) {
  const uint64_t seed = fresh_seed();
  AKV_TRACE_SEED(seed);
  Rng rng(seed);
  PrefillSpec spec;
  spec.seq_len = 300;
  const PrefillData data = make_prefill(rng, spec);
  CountingAllocator counter;
  const akv_allocator hooks = counter.hooks();
  {
    ContextPtr context = make_context(0, &hooks);
    CachePtr cache = compress(context.get(), data, anchorkv_options(workable_retain_fraction(data.shape, 32, 0, 0.1)));
    const uint64_t base_live = counter.live_bytes();
    const akv_cache_stats before = cache_stats(cache.get());
    const int tokens = 37;
    const Tensor keys = make_tensor(nonzero_normal(rng, 2ull * tokens * 64), AKV_DTYPE_F32);
    const Tensor values = make_tensor(nonzero_normal(rng, 2ull * tokens * 64), AKV_DTYPE_F32);
    ASSERT_EQ(akv_append(cache.get(), keys.data(), values.data(), AKV_DTYPE_F32, tokens, nullptr, nullptr), AKV_OK)
        << akv_last_error_message();
    const akv_cache_stats after = cache_stats(cache.get());
    EXPECT_EQ(after.appended_tokens, tokens);
    EXPECT_EQ(after.appended_bytes, 4ull * tokens * 2 * 64);
    EXPECT_GE(after.append_capacity, tokens);
    EXPECT_EQ(after.compressed_bytes, before.compressed_bytes) << "appending changes the prompt footprint";
    EXPECT_EQ(after.allocated_bytes - before.allocated_bytes, counter.live_bytes() - base_live);
    EXPECT_GE(after.allocated_bytes, before.allocated_bytes + after.appended_bytes);
  }
  EXPECT_EQ(counter.live_bytes(), 0u);
  EXPECT_EQ(counter.bad_frees(), 0u);
}

// Every allocation the compression makes may fail: each failure is reported as
// AKV_ERR_OUT_OF_MEMORY, no cache comes back, nothing leaks, and the context still works.
TEST(AllocatorHook, EveryFailedAllocationIsReportedAndLeaksNothing) {
  const uint64_t seed = fresh_seed();
  AKV_TRACE_SEED(seed);
  Rng rng(seed);
  PrefillSpec spec;
  spec.seq_len = 256;
  const PrefillData data = make_prefill(rng, spec);
  const akv_compress_options options = anchorkv_options(workable_retain_fraction(data.shape, 32, 0, 0.1));
  CountingAllocator counter;
  const akv_allocator hooks = counter.hooks();
  {
    ContextPtr context = make_context(0, &hooks);
    bool succeeded = false;
    long failure_point = 0;
    for (; failure_point < 400 && !succeeded; ++failure_point) {
      SCOPED_TRACE("allocation #" + std::to_string(failure_point) + " fails");
      counter.fail_from(failure_point);
      const akv_prefill prefill = data.view();
      akv_cache *cache = nullptr;
      const akv_status status = akv_compress(context.get(), &prefill, &options, &cache, nullptr);
      counter.fail_from(-1);
      if (status == AKV_OK) {
        ASSERT_NE(cache, nullptr);
        akv_cache_destroy(cache);
        succeeded = true;
        break;
      }
      ASSERT_EQ(status, AKV_ERR_OUT_OF_MEMORY) << akv_last_error_message();
      EXPECT_EQ(cache, nullptr);
      EXPECT_STRNE(akv_last_error_message(), "");
    }
    EXPECT_TRUE(succeeded) << "compress still failing after " << failure_point << " refused allocations";
    EXPECT_GT(counter.refused(), 0u) << "the allocator hook was never used by akv_compress";
    // The context survived all of it.
    CachePtr cache = compress(context.get(), data, options);
    EXPECT_GT(cache_stats(cache.get()).allocated_bytes, 0u);
  }
  EXPECT_EQ(counter.live_bytes(), 0u) << "failed compressions leaked through the hook";
  EXPECT_EQ(counter.bad_frees(), 0u);
}

}  // namespace
}  // namespace akv_test
