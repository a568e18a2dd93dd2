// The CPU AnchorKV decode has two ways to the prefix logits (cpu/attention.hpp, PrefixLogits):
// a per-step coefficient table, or every key rebuilt from its anchor row (with AVX-512 where
// the CPU has it, and the AVX2 walk). Each is forced in turn on the same caches, in storage
// formats 2 and 3 (without and with segment tables: there the table path is offered without
// RoPE only, as the anchors' scores, and otherwise the walk runs), and must equal exact
// attention over akv_cache_reconstruct's K/V.
// The shapes cover NeoX, GPT-J, partial rotary, no RoPE, several query rows per KV head,
// q_len > 1 with appended tokens, and both storage dtypes.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "api/api_test_util.hpp"
#include "common/attention.hpp"
#include "cpu/attention.hpp"

namespace {

using namespace akv_test;

// Outputs come back in the queries' dtype: its rounding bounds the relative error.
double output_rel_tolerance(akv_dtype dtype) {
  return dtype == AKV_DTYPE_F16 ? 1.5e-3 : dtype == AKV_DTYPE_BF16 ? 8e-3 : 1e-4;
}

struct PathCase {
  akv_rope_style rope;
  int rotary_dim;
  int G;
  int q_len;
  akv_dtype dtype;
};

class PrefixLogitPaths : public ::testing::TestWithParam<PathCase> {
 protected:
  void TearDown() override { akv::force_prefix_logits(akv::PrefixLogits::kAuto); }
};

TEST_P(PrefixLogitPaths, TableAndGatherEqualExactAttention) {
  const PathCase &c = GetParam();
  const uint64_t seed = fresh_seed();
  AKV_TRACE_SEED(seed);
  Rng rng(seed);
  PrefillSpec spec;
  spec.seq_len = 1500;
  spec.kv_heads = 2;
  spec.group = c.G;
  spec.head_dim = 64;
  spec.dtype = c.dtype;
  const PrefillData data = make_prefill(rng, spec);
  for (int format : {2, 3, 33}) {  // 33: format 3 with segment tables
    SCOPED_TRACE("storage format " + std::to_string(format));
    akv_compress_options options;
    akv_compress_options_init(&options);
    options.retain_fraction = 0.25;
    options.rope.style = c.rope;
    options.rope.rotary_dim = c.rotary_dim;
    options.storage_format = format == 2 ? 2 : 3;
    options.anchors = format == 33 ? 300 : 0;  // > 256: segment tables
    const ContextPtr context = make_context(2);
    const CachePtr cache = compress(context.get(), data, options);
    if (format != 2) {  // the logit_correction path, whatever factor compression chose per head
      cache->meta.logit_penalty.resize(static_cast<size_t>(2) * spec.kv_heads);
      Rng penalties(seed + 7);
      for (float &p : cache->meta.logit_penalty) p = static_cast<float>(penalties.uniform(0.05, 0.25));
    }
    ASSERT_GT(cache_stats(cache.get()).key_residuals, 0);
    if (format == 3) ASSERT_LE(cache_stats(cache.get()).anchors, 256) << "meant to run without segment tables";
    if (format == 33) ASSERT_GT(cache_stats(cache.get()).anchors, 256) << "meant to run with segment tables";

    const int H = spec.kv_heads, Hq = H * c.G, D = spec.head_dim;
    const int appended = c.q_len + 2;
    Rng local(seed + format);
    const Tensor keys = make_tensor(llm_like_keys(local, H, appended, D), c.dtype);
    const Tensor values = make_tensor(nonzero_normal(local, static_cast<size_t>(H) * appended * D), c.dtype);
    ok(akv_append(cache.get(), keys.data(), values.data(), c.dtype, appended, nullptr, nullptr), "akv_append");

    const Dense rotated = reconstruct(cache.get(), 1);
    const Tensor queries = make_tensor(nonzero_normal(local, static_cast<size_t>(Hq) * c.q_len * D, 1.5), c.dtype);
    const AttentionShape shape{H, Hq, D, spec.seq_len + appended, c.q_len};
    const std::vector<double> penalty = logit_penalties(cache.get());  // format 3: logit_correction
    const std::vector<double> expected = reference_attention(rotated.keys, rotated.values, queries.values, shape,
                                                             effective_softmax_scale(options, D), nullptr, &penalty);
    double value_rms = 0.0;
    for (float v : rotated.values) value_rms += static_cast<double>(v) * v;
    value_rms = std::sqrt(value_rms / static_cast<double>(rotated.values.size()));
    const double abs_tolerance = (c.dtype == AKV_DTYPE_F32 ? 2e-5 : 2e-4) * value_rms;

    std::vector<std::vector<float>> outs;
    const char *names[] = {"table", "gather", "gather (AVX2)"};
    int i = 0;
    for (akv::PrefixLogits path : {akv::PrefixLogits::kTable, akv::PrefixLogits::kGather, akv::PrefixLogits::kGatherAvx2}) {
      akv::force_prefix_logits(path);
      outs.push_back(decode(cache.get(), queries, c.q_len));
      EXPECT_TRUE(all_near(outs.back(), expected, abs_tolerance, output_rel_tolerance(c.dtype)))
          << names[i] << " path differs from exact attention";
      ++i;
    }
    EXPECT_TRUE(all_near(outs[0], outs[1], abs_tolerance, output_rel_tolerance(c.dtype))) << "the paths disagree";
    EXPECT_TRUE(all_near(outs[1], outs[2], abs_tolerance, output_rel_tolerance(c.dtype))) << "the gather walks disagree";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, PrefixLogitPaths,
    // NeoX G = 3 (rows padded to four in the AVX-512 walk; SmolLM2's shape) and 2 x 3 rows;
    // GPT-J whole and partial (the AVX-512 walk rebuilds its keys in NeoX order).
    ::testing::Values(PathCase{AKV_ROPE_NEOX, 0, 4, 1, AKV_DTYPE_F32}, PathCase{AKV_ROPE_GPTJ, 0, 3, 1, AKV_DTYPE_BF16},
                      PathCase{AKV_ROPE_NEOX, 0, 3, 1, AKV_DTYPE_BF16},
                      PathCase{AKV_ROPE_NEOX, 32, 2, 3, AKV_DTYPE_F16}, PathCase{AKV_ROPE_GPTJ, 32, 4, 2, AKV_DTYPE_F32}, PathCase{AKV_ROPE_NONE, 0, 1, 2, AKV_DTYPE_F32},
                      PathCase{AKV_ROPE_NONE, 0, 3, 1, AKV_DTYPE_BF16}));

}  // namespace
