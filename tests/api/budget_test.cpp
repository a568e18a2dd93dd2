// Byte accounting (SPEC 2.5, paper Eq. 9/13 and the worked example of App. A.1): the exact
// size before compression, the footprint invariant, the budget error and the cache stats.
#include <sstream>

#include "api/api_test_util.hpp"

namespace akv_test {
namespace {

std::string describe(const akv_shape &shape, const akv_compress_options &options) {
  std::ostringstream text;
  text << "S=" << shape.seq_len << " H=" << shape.num_kv_heads << " Hq=" << shape.num_q_heads
       << " D=" << shape.head_dim << " W=" << options.window << " k=" << options.anchors
       << " theta=" << options.retain_fraction;
  return text.str();
}

// ---- the paper's worked example ------------------------------------------------------------

TEST(PaperWorkedExample, FormulaReproducesThePaperNumbers) {
  // Guards the test-side formula itself against the numbers printed in App. A.1.
  const AnchorBudget b = anchorkv_budget(32768, 8, 128, 32, 0, 0.05);
  EXPECT_EQ(b.anchors, 256);
  EXPECT_EQ(b.full_bytes, 134217728u);
  EXPECT_EQ(b.base_bytes, 3387336u);
  EXPECT_EQ(b.key_residuals + b.value_residuals, 91056);
  EXPECT_EQ(2 * 8 * b.non_window, 523776);  // token-sides that hold an assignment
}

TEST(PaperWorkedExample, CompressedSizeWithoutData) {
  const int64_t M_base = 3387336, N = 91056, N_K = N / 2, N_V = N - N_K, D = 128;
  const uint64_t expected = static_cast<uint64_t>(M_base + N_K * (D / 4 + 4) + N_V * (D / 4 + 5));
  const akv_shape shape{32768, 8, 32, 128};
  akv_compress_options options = anchorkv_options(0.05, 32, 0);  // k = S/128 = 256 by default
  size_t bytes = 0;
  ASSERT_EQ(akv_compressed_size(&options, &shape, &bytes), AKV_OK) << akv_last_error_message();
  EXPECT_EQ(bytes, expected);
  EXPECT_LE(static_cast<double>(bytes), 0.05 * 134217728.0);

  options.anchors = 256;  // explicit k gives the same answer
  size_t explicit_bytes = 0;
  ASSERT_EQ(akv_compressed_size(&options, &shape, &explicit_bytes), AKV_OK) << akv_last_error_message();
  EXPECT_EQ(explicit_bytes, expected);
}

// The same example with real data: 2 x 64 MiB of bf16 K/V and a full compression. Slow on the
// CPU backend (~20 s); ctest label "long" (skipped under sanitizers), --gtest_filter=-Slow*.
TEST(SlowPaperExample, CacheStatsAtFullSize) {
  const uint64_t seed = fresh_seed();
  AKV_TRACE_SEED(seed);
  Rng rng(seed);
  PrefillSpec spec;
  spec.seq_len = 32768;
  spec.kv_heads = 8;
  spec.group = 4;
  spec.head_dim = 128;
  spec.dtype = AKV_DTYPE_BF16;
  const PrefillData data = make_prefill(rng, spec);
  const ContextPtr context = make_context();
  const akv_compress_options options = anchorkv_options(0.05);
  const CachePtr cache = compress(context.get(), data, options);
  const akv_cache_stats stats = cache_stats(cache.get());
  EXPECT_EQ(stats.full_bytes, 134217728u);
  EXPECT_EQ(stats.base_bytes, 3387336u);
  EXPECT_EQ(stats.budget_bytes, 6710886u);
  EXPECT_EQ(stats.key_residuals, 45528);
  EXPECT_EQ(stats.value_residuals, 45528);
  EXPECT_EQ(stats.anchors, 256);
  EXPECT_EQ(stats.compressed_bytes, 6710880u);
  size_t predicted = 0;
  ASSERT_EQ(akv_compressed_size(&options, &data.shape, &predicted), AKV_OK);
  EXPECT_EQ(stats.compressed_bytes, predicted);
  EXPECT_NEAR(stats.ratio, 134217728.0 / 6710880.0, 1e-9);
}

// ---- footprint sweep through akv_compressed_size -------------------------------------------

// Checks one configuration; returns "" or a description of what went wrong.
std::string check_size_or_budget_error(const akv_shape &shape, akv_compress_options options) {
  const AnchorBudget expected = anchorkv_budget(shape.seq_len, shape.num_kv_heads, shape.head_dim, options.window,
                                                options.anchors, options.retain_fraction);
  const std::string where = describe(shape, options) + ": ";
  size_t bytes = 0;
  const akv_status status = akv_compressed_size(&options, &shape, &bytes);
  if (expected.fits) {
    if (status != AKV_OK)
      return where + "expected success, got " + akv_status_string(status) + " | " + akv_last_error_message();
    if (static_cast<double>(bytes) > options.retain_fraction * static_cast<double>(expected.full_bytes))
      return where + "footprint " + std::to_string(bytes) + " exceeds theta*M_full";
    if (bytes != expected.compressed_bytes)
      return where + "size " + std::to_string(bytes) + " != formula " + std::to_string(expected.compressed_bytes);
    return "";
  }
  if (status != AKV_ERR_BUDGET)
    return where + "expected AKV_ERR_BUDGET, got " + akv_status_string(status);
  const std::string message = akv_last_error_message();
  // The message must name the smallest workable theta: a number >= M_base/M_full (so that a
  // retry with it succeeds) and close to it (within 1%).
  double named_minimum = -1.0;
  for (double number : numbers_in(message))
    if (number >= expected.min_retain_fraction && number <= expected.min_retain_fraction * 1.01 + 1e-6 &&
        number > options.retain_fraction)
      named_minimum = named_minimum < 0 ? number : std::min(named_minimum, number);
  if (named_minimum < 0)
    return where + "budget message does not name the minimum retain_fraction (" +
           std::to_string(expected.min_retain_fraction) + ", rounded up): \"" + message + "\"";
  options.retain_fraction = named_minimum;
  const akv_status retry = akv_compressed_size(&options, &shape, &bytes);
  if (retry != AKV_OK)
    return where + "retry with the named minimum " + std::to_string(named_minimum) + " failed: " +
           akv_status_string(retry) + " | " + akv_last_error_message();
  if (static_cast<double>(bytes) > named_minimum * static_cast<double>(expected.full_bytes))
    return where + "retry footprint exceeds the budget";
  return "";
}

TEST(CompressedSize, FootprintNeverExceedsTheBudgetAcrossShapes) {
  std::vector<std::string> failures;
  size_t checked = 0, budget_errors = 0;
  const int64_t lengths[] = {33, 34, 40, 63, 64, 65, 100, 127, 129, 255, 257, 1000, 1023, 4095, 4097,
                             8191, 32768, 100003, 131072, 1 << 20};
  for (int64_t S : lengths)
    for (int H : {1, 2, 8})
      for (int D : {16, 64, 128, 256})
        for (int W : {32, 8})
          for (int explicit_extra_anchors : {0, 16, 300})
            for (double theta : {0.01, 0.037, 0.05, 0.1, 0.2, 0.25, 0.5, 1.0}) {
              if (S <= W) continue;
              const int anchors = explicit_extra_anchors == 0 ? 0 : W + explicit_extra_anchors;
              if (anchors > S) continue;
              const AnchorBudget at_one = anchorkv_budget(S, H, D, W, anchors, 1.0);
              if (!at_one.fits) continue;  // no theta in (0,1] works: nothing to retry with
              const akv_shape shape{S, H, H, D};
              akv_compress_options options = anchorkv_options(theta, W, anchors);
              const std::string failure = check_size_or_budget_error(shape, options);
              ++checked;
              budget_errors += anchorkv_budget(S, H, D, W, anchors, theta).fits ? 0 : 1;
              if (!failure.empty()) failures.push_back(failure);
            }
  ASSERT_GT(checked, 1000u);
  ASSERT_GT(budget_errors, 50u);  // the sweep covers the error path too
  std::ostringstream first;
  for (size_t i = 0; i < std::min<size_t>(failures.size(), 12); ++i) first << "\n  " << failures[i];
  EXPECT_TRUE(failures.empty()) << failures.size() << " of " << checked << " configurations failed:" << first.str();
}

TEST(CompressedSize, DoesNotDependOnQueryHeads) {
  akv_compress_options options = anchorkv_options(0.1);
  for (int group : {1, 2, 4, 8}) {
    const akv_shape shape{5000, 4, 4 * group, 128};
    size_t bytes = 0;
    ASSERT_EQ(akv_compressed_size(&options, &shape, &bytes), AKV_OK) << akv_last_error_message();
    EXPECT_EQ(bytes, anchorkv_budget(5000, 4, 128, 32, 0, 0.1).compressed_bytes) << "G=" << group;
  }
}

// akv_compress_options_init's automatic anchors (anchor floor, budget filling) against the
// linear search of common/budget.hpp, and the footprint following retain_fraction where the
// residuals alone cannot spend it.
TEST(CompressedSize, AutomaticAnchorsFollowTheBudget) {
  size_t checked = 0, filled = 0, raised = 0;
  for (int64_t S : {100, 1000, 2048, 4096, 8192, 20000})
    for (int H : {1, 3, 8})
      for (int D : {64, 128})
        for (double theta : {0.05, 0.1, 0.2, 0.25, 0.5, 0.9}) {
          akv_compress_options options;
          akv_compress_options_init(&options);
          options.retain_fraction = theta;
          const akv_shape shape{S, H, H, D};
          const int64_t k = anchorkv_auto_anchors(S, H, D, 32, options.anchor_share, options.fill_budget != 0, theta, 3);
          size_t bytes = 0;
          const akv_status status = akv_compressed_size(&options, &shape, &bytes);
          const std::string where = "S=" + std::to_string(S) + " H=" + std::to_string(H) + " D=" + std::to_string(D) +
                                    " theta=" + std::to_string(theta);
          if (k == 0) {
            EXPECT_EQ(status, AKV_ERR_BUDGET) << where;
            continue;
          }
          ASSERT_EQ(status, AKV_OK) << where << ": " << akv_last_error_message();
          const AnchorBudget expected = anchorkv_budget(S, H, D, 32, k, theta, 3);
          EXPECT_EQ(bytes, expected.compressed_bytes) << where << " k=" << k;
          EXPECT_LE(static_cast<double>(bytes), theta * expected.full_bytes) << where;
          ++checked;
          raised += k > std::max<int64_t>(32, S / 128);
          if (expected.key_residuals >= expected.residuals_per_side_cap && k < S) {
            // Filled: what is left is less than one more anchor and its metadata.
            ++filled;
            EXPECT_LT(expected.budget - static_cast<double>(bytes), static_cast<double>(H * (4 * D + 8 + D / 2 + 9)))
                << where << ": budget left unspent";
          }
        }
  EXPECT_GT(checked, 150u);
  EXPECT_GT(filled, 20u);
  EXPECT_GT(raised, 40u);
}

// The paper preset keeps the paper's k and leaves budget the residuals cannot use unspent.
TEST(CompressedSize, PaperPresetKeepsThePaperAnchors) {
  akv_compress_options options;
  akv_compress_options_init_paper(&options);
  EXPECT_EQ(options.scored_fraction, 0.7);
  EXPECT_EQ(options.sink_tokens, 0);
  EXPECT_EQ(options.anchor_share, 0.0);
  EXPECT_EQ(options.fill_budget, 0);
  EXPECT_EQ(options.guard_fraction, 0.0);
  EXPECT_EQ(options.coverage_rounds, 0);
  EXPECT_EQ(options.scored_min, 0);
  EXPECT_EQ(options.follow_tokens, 0);
  options.retain_fraction = 0.5;
  const akv_shape shape{4096, 3, 9, 64};
  size_t bytes = 0;
  ASSERT_EQ(akv_compressed_size(&options, &shape, &bytes), AKV_OK) << akv_last_error_message();
  EXPECT_EQ(bytes, anchorkv_budget(4096, 3, 64, 32, 0, 0.5).compressed_bytes);
  EXPECT_LT(static_cast<double>(bytes), 0.25 * 4 * 4096 * 3 * 64) << "the paper's k cannot spend half the cache";
}

TEST(CompressedSize, FullKvIsTheDenseBf16Cache) {
  const akv_compress_options options = fullkv_options();
  const akv_shape shape{1000, 3, 6, 96};  // FullKV takes any head_dim
  size_t bytes = 0;
  ASSERT_EQ(akv_compressed_size(&options, &shape, &bytes), AKV_OK) << akv_last_error_message();
  EXPECT_EQ(bytes, 4u * 1000 * 3 * 96);
}

// FullKV is the exact reference: it keeps every token whatever retain_fraction says (the
// header states the exception; engines and benchmarks create it with default options, whose
// theta is 0.05), validates theta like every method, and its stats say the budget is M_full.
TEST(FullKvBudget, IgnoresRetainFractionAndTheStatsSaySo) {
  const uint64_t seed = fresh_seed();
  AKV_TRACE_SEED(seed);
  Rng rng(seed);
  PrefillSpec spec;
  spec.seq_len = 300;
  spec.kv_heads = 2;
  spec.group = 2;
  spec.head_dim = 64;
  const PrefillData data = make_prefill(rng, spec);
  const uint64_t full = 4ull * 300 * 2 * 64;
  const ContextPtr context = make_context();
  akv_compress_options defaults;
  akv_compress_options_init_method(&defaults, AKV_METHOD_FULLKV);
  for (double theta : {defaults.retain_fraction, 0.3, 1.0}) {
    SCOPED_TRACE("retain_fraction " + std::to_string(theta));
    akv_compress_options options = defaults;
    options.retain_fraction = theta;
    size_t predicted = 0;
    ASSERT_EQ(akv_compressed_size(&options, &data.shape, &predicted), AKV_OK) << akv_last_error_message();
    EXPECT_EQ(predicted, full);
    const CachePtr cache = compress(context.get(), data, options);
    const akv_cache_stats stats = cache_stats(cache.get());
    EXPECT_EQ(stats.full_bytes, full);
    EXPECT_EQ(stats.compressed_bytes, full);
    EXPECT_EQ(stats.budget_bytes, full) << "budget_bytes must say that FullKV's budget is M_full";
    EXPECT_EQ(stats.ratio, 1.0);
  }
  for (double theta : {0.0, 1.5, std::nan("")}) {
    akv_compress_options options = defaults;
    options.retain_fraction = theta;
    size_t bytes = 0;
    EXPECT_EQ(akv_compressed_size(&options, &data.shape, &bytes), AKV_ERR_INVALID_ARGUMENT) << theta;
  }
}

// akv_compress itself: the budget error names the minimum, and compressing at that minimum
// works and fits.
TEST(CompressBudget, ErrorNamesTheMinimumAndRetryingWithItSucceeds) {
  const uint64_t seed = fresh_seed();
  AKV_TRACE_SEED(seed);
  Rng rng(seed);
  PrefillSpec spec;
  spec.seq_len = 777;
  spec.kv_heads = 2;
  spec.group = 2;
  spec.head_dim = 128;
  const PrefillData data = make_prefill(rng, spec);
  const AnchorBudget expected = anchorkv_budget(777, 2, 128, 32, 0, 1.0);
  akv_compress_options options = anchorkv_options(expected.min_retain_fraction * 0.9);
  const ContextPtr context = make_context();
  const akv_prefill prefill = data.view();
  akv_cache *cache = nullptr;
  ASSERT_EQ(akv_compress(context.get(), &prefill, &options, &cache, nullptr), AKV_ERR_BUDGET);
  EXPECT_EQ(cache, nullptr);
  const std::string message = akv_last_error_message();
  double named = -1.0;
  for (double number : numbers_in(message))
    if (number >= expected.min_retain_fraction && number <= expected.min_retain_fraction * 1.01 + 1e-6) named = number;
  ASSERT_GT(named, 0.0) << "no minimum retain_fraction near " << expected.min_retain_fraction << " in \"" << message << "\"";
  options.retain_fraction = named;
  const CachePtr retried = compress(context.get(), data, options);
  const akv_cache_stats stats = cache_stats(retried.get());
  EXPECT_LE(static_cast<double>(stats.compressed_bytes), named * stats.full_bytes);
  EXPECT_EQ(stats.base_bytes, expected.base_bytes);
}

// ---- stats on real data against the formula ------------------------------------------------

struct StatsCase {
  const char *name;
  int64_t S;
  int H, G, D, W, anchors;
  double theta;
  akv_dtype dtype;
};

class StatsMatchFormula : public ::testing::TestWithParam<StatsCase> {};

TEST_P(StatsMatchFormula, OnRealData) {
  const StatsCase &c = GetParam();
  const uint64_t seed = fresh_seed();
  AKV_TRACE_SEED(seed);
  Rng rng(seed);
  PrefillSpec spec;
  spec.seq_len = c.S;
  spec.kv_heads = c.H;
  spec.group = c.G;
  spec.head_dim = c.D;
  spec.window = c.W;
  spec.dtype = c.dtype;
  const PrefillData data = make_prefill(rng, spec);
  const akv_compress_options options = anchorkv_options(c.theta, c.W, c.anchors);
  const AnchorBudget expected = anchorkv_budget(c.S, c.H, c.D, c.W, c.anchors, c.theta);
  ASSERT_TRUE(expected.fits) << "test case must fit its budget";

  const ContextPtr context = make_context();
  const CachePtr cache = compress(context.get(), data, options);
  const akv_cache_stats stats = cache_stats(cache.get());
  size_t predicted = 0;
  ASSERT_EQ(akv_compressed_size(&options, &data.shape, &predicted), AKV_OK) << akv_last_error_message();

  EXPECT_EQ(stats.struct_size, sizeof stats);
  EXPECT_EQ(stats.method, AKV_METHOD_ANCHORKV);
  EXPECT_EQ(stats.shape.seq_len, c.S);
  EXPECT_EQ(stats.shape.num_kv_heads, c.H);
  EXPECT_EQ(stats.shape.num_q_heads, c.H * c.G);
  EXPECT_EQ(stats.shape.head_dim, c.D);
  EXPECT_EQ(stats.storage_dtype, c.dtype == AKV_DTYPE_F16 ? AKV_DTYPE_F16 : AKV_DTYPE_BF16)
      << "AUTO storage resolves to bf16, or fp16 for fp16 input";
  EXPECT_EQ(stats.window, c.W);
  EXPECT_EQ(stats.anchors, expected.anchors);
  EXPECT_EQ(stats.appended_tokens, 0);
  EXPECT_EQ(stats.appended_bytes, 0u);
  EXPECT_EQ(stats.full_bytes, expected.full_bytes);
  EXPECT_EQ(stats.budget_bytes, static_cast<uint64_t>(std::floor(c.theta * expected.full_bytes)));
  EXPECT_EQ(stats.base_bytes, expected.base_bytes);
  EXPECT_EQ(stats.compressed_bytes, expected.compressed_bytes);
  EXPECT_EQ(stats.compressed_bytes, predicted) << "stats and akv_compressed_size disagree";
  EXPECT_LE(static_cast<double>(stats.compressed_bytes), c.theta * expected.full_bytes);
  EXPECT_EQ(stats.key_residuals + stats.value_residuals, expected.key_residuals + expected.value_residuals);
  EXPECT_EQ(stats.key_residuals, expected.key_residuals) << "keys get floor(N/2)";
  EXPECT_EQ(stats.value_residuals, expected.value_residuals);
  EXPECT_NEAR(stats.ratio, static_cast<double>(stats.full_bytes) / stats.compressed_bytes, 1e-9 * stats.ratio);

  const std::vector<akv_head_stats> heads = head_stats(cache.get(), c.H);
  int64_t key_sum = 0, value_sum = 0;
  for (int h = 0; h < c.H; ++h) {
    EXPECT_EQ(heads[h].kept_tokens, c.S) << "head " << h << ": AnchorKV drops no position";
    EXPECT_EQ(heads[h].anchors, expected.anchors) << "head " << h;
    EXPECT_GE(heads[h].key_residuals, 0);
    EXPECT_LE(heads[h].key_residuals, expected.non_window - (expected.anchors - c.W));
    EXPECT_GE(heads[h].value_residuals, 0);
    EXPECT_LE(heads[h].value_residuals, expected.non_window - (expected.anchors - c.W));
    key_sum += heads[h].key_residuals;
    value_sum += heads[h].value_residuals;
  }
  EXPECT_EQ(key_sum, stats.key_residuals);
  EXPECT_EQ(value_sum, stats.value_residuals);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, StatsMatchFormula,
    ::testing::Values(StatsCase{"S1000_G2_F32", 1000, 2, 2, 64, 32, 0, 0.3, AKV_DTYPE_F32},
                      StatsCase{"S777_W16_k50_BF16", 777, 3, 1, 32, 16, 50, 0.45, AKV_DTYPE_BF16},
                      StatsCase{"S33_JustAboveWindow_F16", 33, 2, 2, 64, 32, 0, 1.0, AKV_DTYPE_F16},
                      StatsCase{"S4096_G4_D128", 4096, 2, 4, 128, 32, 0, 0.1, AKV_DTYPE_BF16},
                      StatsCase{"S520_D256_k40", 520, 1, 4, 256, 32, 40, 0.25, AKV_DTYPE_F32},
                      StatsCase{"S300_D16", 300, 2, 1, 16, 32, 0, 0.5, AKV_DTYPE_F32},
                      StatsCase{"S200_Theta1_CapsResiduals", 200, 2, 1, 64, 32, 0, 1.0, AKV_DTYPE_F32},
                      StatsCase{"S999_NoRoomForResiduals", 999, 2, 1, 64, 32, 0, 0.0714, AKV_DTYPE_F32}),
    [](const ::testing::TestParamInfo<StatsCase> &info) { return std::string(info.param.name); });

}  // namespace
}  // namespace akv_test
