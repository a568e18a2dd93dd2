// Decode (SPEC 4) against exact attention in double precision:
//  - AnchorKV: over akv_cache_reconstruct's K^/V^ (the fused kernel must equal attention over
//    what the cache represents), whose RoPE is checked against the double-precision reference;
//  - FullKV: over the original inputs (as stored), with the reference RoPE;
//  - appended tokens, q_len > 1 (causal among the new tokens), GQA, RoPE variants, explicit
//    positions, keys_post_rope, softmax_scale, F32/F16/BF16;
//  - akv_decode_batch == a loop of akv_decode, bitwise;
//  - logit_correction: the penalties akv_cache_logit_penalty reports, and the decode with them.
#include <map>
#include <thread>

#include "api/api_test_util.hpp"
#include "api/counting_allocator.hpp"

namespace akv_test {
namespace {

// Output tolerance: |out - ref| <= abs + rel*|ref|, abs scaled by the RMS of the values. F32
// leaves fp32 accumulation error (measured ~1e-6 of the RMS); F16/BF16 outputs add one
// rounding of the output (unit roundoff 2^-11 and 2^-8).
double output_rel_tolerance(akv_dtype dtype) {
  switch (dtype) {
    case AKV_DTYPE_F16: return 1.5e-3;
    case AKV_DTYPE_BF16: return 8e-3;
    default: return 1e-4;
  }
}

struct DecodeCase {
  const char *name;
  akv_method method;
  akv_dtype dtype;  // prefill, appended tokens, queries and output
  int64_t S;
  int H, G, D;
  akv_rope_style rope;
  int rotary_dim;        // 0 = head_dim
  bool inv_freq_table;   // explicit frequencies (Llama-3 style scaled) instead of base
  bool explicit_positions;
  bool keys_post_rope;
  float softmax_scale;   // 0 = default
  int appended;
  bool explicit_append_positions;
  int q_len;
  int window = 32;
  int storage_format = 2;  // the paper preset's layout; 3: segment tables and one-byte codes
  int anchors = 0;         // 0 = automatic
};

std::vector<float> llama3_style_frequencies(int rotary_dim, double base) {
  // Low frequencies divided by 8, a smooth ramp in between: not expressible through `base`.
  std::vector<float> freq(static_cast<size_t>(rotary_dim / 2));
  for (int i = 0; i < rotary_dim / 2; ++i) {
    const double f = std::pow(base, -2.0 * i / rotary_dim);
    const double ramp = std::min(1.0, std::max(0.0, (i - rotary_dim / 8.0) / (rotary_dim / 4.0)));
    freq[i] = static_cast<float>(f / (1.0 + 7.0 * ramp));
  }
  return freq;
}

class DecodeMatchesReference : public ::testing::TestWithParam<DecodeCase> {};

TEST_P(DecodeMatchesReference, AfterCompressAppendAndDecode) {
  const DecodeCase &c = GetParam();
  const uint64_t seed = fresh_seed();
  AKV_TRACE_SEED(seed);
  Rng rng(seed);

  akv_compress_options options = c.method == AKV_METHOD_FULLKV ? fullkv_options(c.window) : anchorkv_options(0.5, c.window);
  options.rope.style = c.rope;
  options.rope.rotary_dim = c.rotary_dim;
  options.rope.base = 500000.0;
  options.keys_post_rope = c.keys_post_rope ? 1 : 0;
  options.softmax_scale = c.softmax_scale;
  options.storage_format = c.storage_format;
  if (c.storage_format == 3) options.logit_correction = 0.5;  // the default preset's decode
  options.anchors = c.anchors;
  const int rotary = c.rotary_dim == 0 ? c.D : c.rotary_dim;
  const std::vector<float> frequency_table = llama3_style_frequencies(rotary, options.rope.base);
  if (c.inv_freq_table) options.rope.inv_freq = frequency_table.data();
  RopeReference rope = rope_reference(options.rope);
  if (c.inv_freq_table) rope.inv_freq.assign(frequency_table.begin(), frequency_table.end());

  PrefillSpec spec;
  spec.seq_len = c.S;
  spec.kv_heads = c.H;
  spec.group = c.G;
  spec.head_dim = c.D;
  spec.window = c.window;
  spec.dtype = c.dtype;
  spec.explicit_positions = c.explicit_positions;
  spec.gaps_in_window = c.method == AKV_METHOD_FULLKV;  // only AnchorKV needs a consecutive window
  const PrefillData data = make_prefill(rng, spec, c.keys_post_rope ? &rope : nullptr);
  if (c.method == AKV_METHOD_ANCHORKV)
    options.retain_fraction = workable_retain_fraction(data.shape, c.window, c.anchors, 0.05);

  const ContextPtr context = make_context();
  const CachePtr cache = compress(context.get(), data, options);

  // Append tokens: keys follow the cache's convention (post-RoPE when keys_post_rope).
  std::vector<int32_t> positions = data.positions;
  const std::vector<float> appended_keys_pre = llm_like_keys(rng, c.H, c.appended, c.D);
  const std::vector<float> appended_values = nonzero_normal(rng, static_cast<size_t>(c.H) * c.appended * c.D);
  const std::vector<int32_t> appended_positions =
      c.explicit_append_positions ? gapped_positions(rng, c.appended, positions.back() + 1 + static_cast<int32_t>(rng.uniform_int(0, 4)), 4)
                                  : default_positions(c.appended, positions.back() + 1);
  Tensor appended_keys, appended_value_tensor;
  if (c.appended > 0) {
    std::vector<float> handed = appended_keys_pre;
    if (c.keys_post_rope) {
      const std::vector<double> rotated = rope.apply(appended_keys_pre, c.H, c.appended, c.D, appended_positions);
      handed.assign(rotated.begin(), rotated.end());
    }
    appended_keys = make_tensor(handed, c.dtype);
    appended_value_tensor = make_tensor(appended_values, c.dtype);
    ASSERT_EQ(akv_append(cache.get(), appended_keys.data(), appended_value_tensor.data(), c.dtype, c.appended,
                         c.explicit_append_positions ? appended_positions.data() : nullptr, nullptr),
              AKV_OK)
        << akv_last_error_message();
    positions.insert(positions.end(), appended_positions.begin(), appended_positions.end());
  }
  const akv_cache_stats stats = cache_stats(cache.get());
  ASSERT_EQ(stats.appended_tokens, c.appended);
  if (c.method == AKV_METHOD_ANCHORKV) EXPECT_EQ(stats.storage_format, c.storage_format);
  if (c.anchors) EXPECT_EQ(stats.anchors, c.anchors);
  const int64_t T = c.S + c.appended;
  const int Hq = c.H * c.G;

  const Dense rotated = reconstruct(cache.get(), 1);
  const Dense unrotated = reconstruct(cache.get(), 0);
  ASSERT_EQ(rotated.tokens, T);

  // What was handed over, [H][T][D] (prompt then appended), and those keys after RoPE.
  const akv_dtype storage = c.dtype == AKV_DTYPE_F16 ? AKV_DTYPE_F16 : AKV_DTYPE_BF16;
  std::vector<float> handed_keys(static_cast<size_t>(c.H) * T * c.D), stored_values(handed_keys.size());
  for (int h = 0; h < c.H; ++h)
    for (int64_t t = 0; t < T; ++t)
      for (int d = 0; d < c.D; ++d) {
        const size_t dst = (static_cast<size_t>(h) * T + t) * c.D + d;
        const bool prompt = t < c.S;
        const size_t src = prompt ? (static_cast<size_t>(h) * c.S + t) * c.D + d
                                  : (static_cast<size_t>(h) * c.appended + (t - c.S)) * c.D + d;
        handed_keys[dst] = prompt ? data.keys.values[src] : appended_keys.values[src];
        stored_values[dst] = round_to_dtype(prompt ? data.values.values[src] : appended_value_tensor.values[src], storage);
      }
  const std::vector<double> handed_keys_post =
      c.keys_post_rope ? std::vector<double>(handed_keys.begin(), handed_keys.end())
                       : rope.apply(handed_keys, c.H, T, c.D, positions);
  const double key_rms = root_mean_square(handed_keys), value_rms = root_mean_square(stored_values);

  // (1) RoPE: rotated = R_t(unrotated) at every cached position.
  const std::vector<double> rerotated = rope.apply(unrotated.keys, c.H, T, c.D, positions);
  note("rope_max_error_over_key_rms", max_error(rotated.keys, rerotated, key_rms));
  EXPECT_TRUE(all_near(rotated.keys, rerotated, 2e-3 * key_rms, 2e-3))
      << "reconstruct(rotated=1) is not RoPE(reconstruct(rotated=0)) at the cached positions";

  // (2) Exact rows: the window and the appended tokens (every row for FullKV). Values come back
  // bit for bit in the storage dtype. Keys may be stored before or after RoPE (the AnchorKV
  // window is an anchor: before, bit for bit); either way the post-RoPE row is the handed
  // one up to the storage rounding (one rounding, two when keys_post_rope is de-rotated).
  const int64_t first_exact = c.method == AKV_METHOD_FULLKV ? 0 : c.S - c.window;
  const double row_tolerance = c.keys_post_rope ? 1.2e-2 : 6e-3;
  int64_t value_mismatches = 0, window_key_mismatches = 0, key_rows_off = 0;
  double worst_row_error = 0.0;
  for (int h = 0; h < c.H; ++h)
    for (int64_t t = first_exact; t < T; ++t) {
      double error = 0.0, reference = 0.0;
      for (int d = 0; d < c.D; ++d) {
        const size_t i = (static_cast<size_t>(h) * T + t) * c.D + d;
        value_mismatches += rotated.values[i] != stored_values[i];
        const bool anchor_window_row = c.method == AKV_METHOD_ANCHORKV && t < c.S;
        if (anchor_window_row && !c.keys_post_rope)
          window_key_mismatches += unrotated.keys[i] != round_to_dtype(handed_keys[i], storage);
        error += std::pow(rotated.keys[i] - handed_keys_post[i], 2);
        reference += handed_keys_post[i] * handed_keys_post[i];
      }
      const double relative = std::sqrt(error / reference);
      worst_row_error = std::max(worst_row_error, relative);
      key_rows_off += relative > row_tolerance;
    }
  note("exact_rows_worst_relative_key_error", worst_row_error);
  EXPECT_EQ(value_mismatches, 0) << "window/appended values are not stored exactly";
  EXPECT_EQ(window_key_mismatches, 0) << "window keys (anchors) are not stored exactly before RoPE";
  EXPECT_EQ(key_rows_off, 0) << "window/appended keys differ from the handed keys beyond storage rounding"
                             << " (worst relative row error " << worst_row_error << ")";

  // (3) Decode equals exact attention over the reconstructed cache, each token's logit lowered
  // by akv_cache_logit_penalty's share (format 3 with logit_correction; 0 elsewhere).
  const Tensor queries = make_tensor(nonzero_normal(rng, static_cast<size_t>(Hq) * c.q_len * c.D, 1.5), c.dtype);
  const std::vector<float> out = decode(cache.get(), queries, c.q_len);
  const double scale = effective_softmax_scale(options, c.D);
  const AttentionShape shape{c.H, Hq, c.D, T, c.q_len};
  const std::vector<double> penalty = logit_penalties(cache.get());
  if (c.storage_format != 3)
    EXPECT_EQ(*std::max_element(penalty.begin(), penalty.end()), 0.0) << "a logit penalty without logit_correction";
  const std::vector<double> expected =
      reference_attention(rotated.keys, rotated.values, queries.values, shape, scale, nullptr, &penalty);
  note("decode_vs_reconstruct_max_error_over_value_rms", max_error(out, expected, value_rms));
  const double abs_tolerance = (c.dtype == AKV_DTYPE_F32 ? 2e-5 : 2e-4) * value_rms;
  EXPECT_TRUE(all_near(out, expected, abs_tolerance, output_rel_tolerance(c.dtype)))
      << "decode differs from exact attention over akv_cache_reconstruct's K/V";

  // (4) FullKV: exact attention over the original inputs, rotated by the reference RoPE. The
  // keys' storage rounding (bf16: 2^-9 per element, before or after RoPE) moves logits by
  // ~0.005 here, so this bound is loose; (3) is the tight one. It catches a wrong RoPE
  // convention, GQA mapping, scale or causal mask, which move outputs by ~0.1-1.
  if (c.method == AKV_METHOD_FULLKV) {
    const std::vector<double> values_d(stored_values.begin(), stored_values.end());
    const std::vector<double> original = reference_attention(handed_keys_post, values_d, queries.values, shape, scale);
    const double abs_tol = (storage == AKV_DTYPE_F16 ? 5e-3 : 3e-2) * value_rms;
    note("fullkv_vs_original_max_error_over_value_rms", max_error(out, original, value_rms));
    EXPECT_TRUE(all_near(out, original, abs_tol, output_rel_tolerance(c.dtype) + 1e-3))
        << "FullKV decode differs from exact attention over the original inputs";
  }

  // (5) Decoding does not change the cache: a second call is bitwise identical.
  const std::vector<uint8_t> first = decode_raw(cache.get(), queries, c.q_len);
  EXPECT_EQ(decode_raw(cache.get(), queries, c.q_len), first);
}

constexpr akv_method A = AKV_METHOD_ANCHORKV, F = AKV_METHOD_FULLKV;

INSTANTIATE_TEST_SUITE_P(
    Variants, DecodeMatchesReference,
    ::testing::Values(
        //         name                                     meth dtype            S    H  G  D    rope            rot inv  pos    post   scale  app  app_pos q_len
        DecodeCase{"AnchorKV_F32_G1_D64_NeoX",               A, AKV_DTYPE_F32,  300, 2, 1, 64,  AKV_ROPE_NEOX, 0,  false, false, false, 0.0f,  0, false, 1},
        DecodeCase{"AnchorKV_F32_G4_D128_GptJ_Positions",    A, AKV_DTYPE_F32,  333, 2, 4, 128, AKV_ROPE_GPTJ, 0,  false, true,  false, 0.0f,  3, false, 1},
        DecodeCase{"AnchorKV_BF16_G4_D64_Partial_InvFreq",   A, AKV_DTYPE_BF16, 400, 2, 4, 64,  AKV_ROPE_NEOX, 32, true,  true,  false, 0.0f,  5, true,  4},
        DecodeCase{"AnchorKV_F16_G1_D128_PostRope_Scale",    A, AKV_DTYPE_F16,  257, 3, 1, 128, AKV_ROPE_NEOX, 0,  false, true,  true,  0.05f, 2, true,  3},
        DecodeCase{"AnchorKV_F32_G4_D64_GptJ_Partial_Post",  A, AKV_DTYPE_F32,  500, 1, 4, 64,  AKV_ROPE_GPTJ, 48, true,  false, true,  0.0f,  6, false, 6},
        DecodeCase{"AnchorKV_BF16_G1_D128_NoRope_Qlen2",     A, AKV_DTYPE_BF16, 301, 2, 1, 128, AKV_ROPE_NONE, 0,  false, false, false, 0.2f,  2, false, 2},
        DecodeCase{"AnchorKV_F32_S4096_G4_D128",             A, AKV_DTYPE_F32, 4096, 2, 4, 128, AKV_ROPE_NEOX, 0,  false, false, false, 0.0f,  1, false, 2},
        DecodeCase{"AnchorKV_F16_W16",                       A, AKV_DTYPE_F16,  260, 2, 2, 64,  AKV_ROPE_NEOX, 0,  false, false, false, 0.0f,  1, false, 1, 16},
        // Storage format 3: k <= 256 (the index is the anchor), and k = 600 > 256 (segment tables).
        DecodeCase{"AnchorKV3_F32_G1_D64_NeoX",              A, AKV_DTYPE_F32,  300, 2, 1, 64,  AKV_ROPE_NEOX, 0,  false, false, false, 0.0f,  0, false, 1, 32, 3},
        DecodeCase{"AnchorKV3_BF16_G4_D64_Partial_InvFreq",  A, AKV_DTYPE_BF16, 400, 2, 4, 64,  AKV_ROPE_NEOX, 32, true,  false, false, 0.0f,  5, true,  4, 32, 3},
        DecodeCase{"AnchorKV3_F16_G1_D128_PostRope_GptJ",    A, AKV_DTYPE_F16,  257, 3, 1, 128, AKV_ROPE_GPTJ, 0,  false, false, true,  0.05f, 2, true,  3, 32, 3},
        DecodeCase{"AnchorKV3_F32_S4096_G4_D128_Tables",     A, AKV_DTYPE_F32, 4096, 2, 4, 128, AKV_ROPE_NEOX, 0,  false, false, false, 0.0f,  1, false, 2, 32, 3, 600},
        // Prefixes of three decode chunks (4096 tokens each, the last one shorter).
        DecodeCase{"AnchorKV3_BF16_S9000_G4_D128_Chunks",    A, AKV_DTYPE_BF16, 9000, 2, 4, 128, AKV_ROPE_NEOX, 0, false, false, false, 0.0f,  3, false, 2, 32, 3},
        DecodeCase{"AnchorKV_F32_S9000_G2_D64_GptJ_Chunks",  A, AKV_DTYPE_F32, 9000, 2, 2, 64,  AKV_ROPE_GPTJ, 0,  false, false, false, 0.0f,  2, false, 3},
        DecodeCase{"AnchorKV3_F32_S9000_G2_D64_NoRope_Chunks", A, AKV_DTYPE_F32, 9000, 1, 2, 64, AKV_ROPE_NONE, 0, false, false, false, 0.0f, 4, false, 1, 32, 3},
        DecodeCase{"FullKV_F32_G4_D64_NeoX",                 F, AKV_DTYPE_F32,  200, 2, 4, 64,  AKV_ROPE_NEOX, 0,  false, false, false, 0.0f,  4, false, 3},
        DecodeCase{"FullKV_BF16_G1_D128_GptJ_Positions_Post",F, AKV_DTYPE_BF16, 150, 2, 1, 128, AKV_ROPE_GPTJ, 0,  false, true,  true,  0.0f,  2, true,  2},
        DecodeCase{"FullKV_F16_G4_D64_Partial_InvFreq_Scale",F, AKV_DTYPE_F16,  180, 1, 4, 64,  AKV_ROPE_NEOX, 16, true,  true,  false, 0.1f,  3, true,  1},
        DecodeCase{"FullKV_F32_D96_AnyHeadDim",              F, AKV_DTYPE_F32,  100, 2, 2, 96,  AKV_ROPE_NEOX, 0,  false, false, false, 0.0f,  1, false, 2}),
    [](const ::testing::TestParamInfo<DecodeCase> &info) { return std::string(info.param.name); });

// ---- logit_correction (docs/design.md §4.5) ----------------------------------------------------

// The default preset's penalties: per head, f times the mean squared pre-RoPE key error per
// dimension of its reconstructed prompt tokens, one value without and one with a key residual,
// with one factor f of 0, c/2, c, 2c per head (c = logit_correction); 0 for anchors, the window
// and appended tokens; 0 everywhere with logit_correction 0 (decode = attention over the
// reconstruction); kept by serialization.
TEST(LogitCorrection, PenaltyIsAFactorOfTheMeanKeyErrorOfTheReconstructedTokens) {
  const uint64_t seed = fresh_seed();
  AKV_TRACE_SEED(seed);
  Rng rng(seed);
  PrefillSpec spec;
  spec.seq_len = 700;
  spec.group = 2;
  const PrefillData data = make_prefill(rng, spec);
  const int H = spec.kv_heads, D = spec.head_dim, W = spec.window;
  const int64_t S = spec.seq_len;
  const ContextPtr context = make_context(2);
  auto with = [&](double correction) {
    akv_compress_options o;
    akv_compress_options_init(&o);
    o.retain_fraction = workable_retain_fraction(data.shape, W, 0, 0.15);
    o.logit_correction = correction;
    return compress(context.get(), data, o);
  };
  const double c = 0.5;
  const CachePtr cache = with(c), none = with(0.0);
  const std::vector<double> penalty = logit_penalties(cache.get()), p_none = logit_penalties(none.get());
  EXPECT_EQ(*std::max_element(p_none.begin(), p_none.end()), 0.0);
  const Dense plain = reconstruct(cache.get(), 0), plain_none = reconstruct(none.get(), 0);
  EXPECT_EQ(plain.keys, plain_none.keys) << "logit_correction changed the compression";
  // Window tokens are exact; the others hold one of two values per head (by key residual) or 0
  // (anchors), and those values are f x the class's mean squared error per dimension.
  int64_t classes_seen = 0;
  for (int h = 0; h < H; ++h) {
    std::map<double, std::pair<double, int64_t>> groups;  // penalty -> (sum of squared errors, tokens)
    double error_sum = 0.0;
    int64_t reconstructed = 0;
    for (int64_t t = 0; t < S; ++t) {
      const double p = penalty[h * S + t];
      if (t >= S - W) EXPECT_EQ(p, 0.0) << "window token " << t;
      double e = 0.0;
      for (int d = 0; d < D; ++d) {
        const double diff = data.keys_pre_rope[(static_cast<size_t>(h) * S + t) * D + d] - plain.key_row(h, t)[d];
        e += diff * diff;
      }
      if (t < S - W && e > 1e-6) {  // not an anchor (those are exact up to storage rounding)
        error_sum += e;
        ++reconstructed;
      }
      if (p == 0.0) continue;
      groups[p].first += e;
      groups[p].second += 1;
    }
    EXPECT_LE(groups.size(), 2u) << "head " << h << ": one penalty without and one with a key residual";
    EXPECT_GT(reconstructed, S / 2) << "head " << h;
    const double factors[] = {0.5 * c, c, 2 * c};
    for (const auto &[p, sum] : groups) {
      const double mean = sum.first / (static_cast<double>(sum.second) * D);
      bool matched = false;
      for (double f : factors) matched = matched || std::abs(f * mean - p) <= 1e-4 * p;
      EXPECT_TRUE(matched) << "head " << h << ": penalty " << p << " is not c/2, c or 2c times " << mean;
      ++classes_seen;
    }
  }
  note("penalised_classes", static_cast<double>(classes_seen));
  // The appended tokens are exact.
  Rng more(seed + 1);
  const Tensor k = make_tensor(llm_like_keys(more, H, 3, D), AKV_DTYPE_F32);
  const Tensor v = make_tensor(nonzero_normal(more, static_cast<size_t>(H) * 3 * D), AKV_DTYPE_F32);
  ok(akv_append(cache.get(), k.data(), v.data(), AKV_DTYPE_F32, 3, nullptr, nullptr), "akv_append");
  const std::vector<double> appended = logit_penalties(cache.get());
  for (int h = 0; h < H; ++h)
    for (int64_t t = 0; t < S + 3; ++t)
      EXPECT_EQ(appended[h * (S + 3) + t], t < S ? penalty[h * S + t] : 0.0) << "head " << h << " token " << t;
  // Serialization keeps the penalties, so the decode is bit for bit the same.
  const CachePtr back = deserialize(context.get(), serialize(cache.get()));
  EXPECT_EQ(logit_penalties(back.get()), appended);
  const Tensor q = make_tensor(nonzero_normal(more, static_cast<size_t>(H) * spec.group * D, 1.5), AKV_DTYPE_F32);
  EXPECT_EQ(decode_raw(back.get(), q, 1), decode_raw(cache.get(), q, 1));
}

// ---- incremental decoding like an engine, with a reservation --------------------------------

TEST(Append, TokenByTokenAfterReserveMatchesReferenceWithoutAllocating) {
  const uint64_t seed = fresh_seed();
  AKV_TRACE_SEED(seed);
  Rng rng(seed);
  PrefillSpec spec;
  spec.seq_len = 320;
  spec.kv_heads = 2;
  spec.group = 2;
  spec.head_dim = 64;
  spec.explicit_positions = true;
  const PrefillData data = make_prefill(rng, spec);
  CountingAllocator counter;
  const akv_allocator hooks = counter.hooks();
  const ContextPtr context = make_context(0, &hooks);
  const akv_compress_options options = anchorkv_options(workable_retain_fraction(data.shape, 32, 0, 0.05));
  const CachePtr cache = compress(context.get(), data, options);
  const int steps = 8, Hq = 4, H = 2, D = 64;
  const Tensor warmup = make_tensor(nonzero_normal(rng, static_cast<size_t>(Hq) * D), AKV_DTYPE_F32);
  (void)decode(cache.get(), warmup, 1);  // lets a lazy workspace appear before counting
  ASSERT_EQ(akv_cache_reserve(cache.get(), steps, nullptr), AKV_OK) << akv_last_error_message();
  const RopeReference rope = rope_reference(options.rope);
  for (int step = 0; step < steps; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    const size_t allocations_before = counter.allocations();
    const Tensor keys = make_tensor(llm_like_keys(rng, H, 1, D), AKV_DTYPE_F32);
    const Tensor values = make_tensor(nonzero_normal(rng, static_cast<size_t>(H) * D), AKV_DTYPE_F32);
    ASSERT_EQ(akv_append(cache.get(), keys.data(), values.data(), AKV_DTYPE_F32, 1, nullptr, nullptr), AKV_OK)
        << akv_last_error_message();
    const Tensor query = make_tensor(nonzero_normal(rng, static_cast<size_t>(Hq) * D, 1.5), AKV_DTYPE_F32);
    const std::vector<float> out = decode(cache.get(), query, 1);
    EXPECT_EQ(counter.allocations(), allocations_before) << "append/decode allocated inside the reservation";
    const Dense rotated = reconstruct(cache.get(), 1);
    ASSERT_EQ(rotated.tokens, spec.seq_len + step + 1);
    // The appended token sits right after the last prompt position (positions NULL).
    const Dense unrotated = reconstruct(cache.get(), 0);
    const int32_t position = data.positions.back() + 1 + step;
    std::vector<double> expected_row(unrotated.key_row(0, rotated.tokens - 1), unrotated.key_row(0, rotated.tokens - 1) + D);
    rope.rotate_row(expected_row.data(), D, position, rope.frequencies(D));
    const std::vector<float> actual_row(rotated.key_row(0, rotated.tokens - 1), rotated.key_row(0, rotated.tokens - 1) + D);
    EXPECT_TRUE(all_near(actual_row, expected_row, 1e-3, 1e-3)) << "appended token not at position " << position;
    const AttentionShape shape{H, Hq, D, rotated.tokens, 1};
    const std::vector<double> expected =
        reference_attention(rotated.keys, rotated.values, query.values, shape, 1.0 / std::sqrt(double(D)));
    EXPECT_TRUE(all_near(out, expected, 2e-5, 1e-4));
  }
  const akv_cache_stats stats = cache_stats(cache.get());
  EXPECT_EQ(stats.appended_tokens, steps);
  EXPECT_GE(stats.append_capacity, steps);
  EXPECT_EQ(stats.appended_bytes, 4ull * steps * H * D);
}

// ---- batched decode -------------------------------------------------------------------------

class DecodeBatch : public ::testing::TestWithParam<std::tuple<akv_dtype, int>> {};

TEST_P(DecodeBatch, BitwiseEqualsALoopOfDecode) {
  const akv_dtype dtype = std::get<0>(GetParam());
  const int q_len = std::get<1>(GetParam());
  const uint64_t seed = fresh_seed();
  AKV_TRACE_SEED(seed);
  Rng rng(seed);
  const int H = 2, G = 2, D = 64, Hq = H * G;
  const ContextPtr context = make_context();
  struct Request {
    int64_t S;
    akv_method method;
    int appended;
  };
  const std::vector<Request> requests = {{300, AKV_METHOD_ANCHORKV, 2}, {200, AKV_METHOD_FULLKV, 3},
                                         {520, AKV_METHOD_ANCHORKV, 1}, {97, AKV_METHOD_FULLKV, 4}};
  std::vector<CachePtr> caches;
  for (const Request &r : requests) {
    PrefillSpec spec;
    spec.seq_len = r.S;
    spec.kv_heads = H;
    spec.group = G;
    spec.head_dim = D;
    spec.dtype = dtype;
    const PrefillData data = make_prefill(rng, spec);
    const akv_compress_options options = r.method == AKV_METHOD_FULLKV
                                             ? fullkv_options()
                                             : anchorkv_options(workable_retain_fraction(data.shape, 32, 0, 0.05));
    caches.push_back(compress(context.get(), data, options));
    const Tensor keys = make_tensor(llm_like_keys(rng, H, r.appended, D), dtype);
    const Tensor values = make_tensor(nonzero_normal(rng, static_cast<size_t>(H) * r.appended * D), dtype);
    ASSERT_EQ(akv_append(caches.back().get(), keys.data(), values.data(), dtype, r.appended, nullptr, nullptr), AKV_OK)
        << akv_last_error_message();
  }
  const int batch = static_cast<int>(caches.size());
  const size_t per_request = static_cast<size_t>(Hq) * q_len * D;
  const Tensor queries = make_tensor(nonzero_normal(rng, per_request * batch, 1.5), dtype);
  std::vector<akv_cache *> handles;
  for (const CachePtr &cache : caches) handles.push_back(cache.get());
  std::vector<uint8_t> batched = poisoned(per_request * batch, dtype);
  ASSERT_EQ(akv_decode_batch(context.get(), handles.data(), batch, queries.data(), dtype, q_len, batched.data(), nullptr),
            AKV_OK)
      << akv_last_error_message();
  const size_t bytes_per_request = per_request * dtype_size(dtype);
  for (int b = 0; b < batch; ++b) {
    SCOPED_TRACE("request " + std::to_string(b));
    Tensor one;
    one.dtype = dtype;
    one.bytes.assign(queries.bytes.begin() + b * bytes_per_request, queries.bytes.begin() + (b + 1) * bytes_per_request);
    one.values.assign(queries.values.begin() + b * per_request, queries.values.begin() + (b + 1) * per_request);
    const std::vector<uint8_t> single = decode_raw(caches[b].get(), one, q_len);
    EXPECT_EQ(count_non_finite(decode_bytes(single, dtype)), 0u);
    const std::vector<uint8_t> slice(batched.begin() + b * bytes_per_request, batched.begin() + (b + 1) * bytes_per_request);
    EXPECT_TRUE(slice == single) << "akv_decode_batch differs from akv_decode for this request";
  }
  // A batch of one is the single decode as well.
  std::vector<uint8_t> single_batch = poisoned(per_request, dtype);
  ASSERT_EQ(akv_decode_batch(context.get(), handles.data() + 2, 1, queries.bytes.data() + 2 * bytes_per_request, dtype,
                             q_len, single_batch.data(), nullptr),
            AKV_OK);
  EXPECT_TRUE(std::equal(single_batch.begin(), single_batch.end(), batched.begin() + 2 * bytes_per_request));
}

INSTANTIATE_TEST_SUITE_P(DtypesAndQueryLengths, DecodeBatch,
                         ::testing::Combine(::testing::Values(AKV_DTYPE_F32, AKV_DTYPE_BF16, AKV_DTYPE_F16),
                                            ::testing::Values(1, 2)),
                         [](const ::testing::TestParamInfo<std::tuple<akv_dtype, int>> &info) {
                           return std::string(dtype_name(std::get<0>(info.param))) + "_qlen" +
                                  std::to_string(std::get<1>(info.param));
                         });

// ---- different handles may run concurrently -------------------------------------------------

TEST(Concurrency, DifferentCachesDecodeInParallelLikeSerially) {
  const uint64_t seed = fresh_seed();
  AKV_TRACE_SEED(seed);
  Rng rng(seed);
  const ContextPtr context = make_context();
  PrefillSpec spec;
  spec.seq_len = 400;
  spec.kv_heads = 2;
  spec.group = 2;
  std::vector<CachePtr> caches;
  std::vector<Tensor> queries;
  for (int i = 0; i < 4; ++i) {
    const PrefillData data = make_prefill(rng, spec);
    caches.push_back(compress(context.get(), data, anchorkv_options(workable_retain_fraction(data.shape, 32, 0, 0.05))));
    queries.push_back(make_tensor(nonzero_normal(rng, 4 * 64, 1.5), AKV_DTYPE_F32));
  }
  std::vector<std::vector<uint8_t>> serial;
  for (int i = 0; i < 4; ++i) serial.push_back(decode_raw(caches[i].get(), queries[i], 1));
  std::vector<std::vector<uint8_t>> parallel(4);
  std::vector<akv_status> status(4, AKV_ERR_INTERNAL);
  std::vector<std::thread> threads;
  for (int i = 0; i < 4; ++i)
    threads.emplace_back([&, i] {
      for (int repeat = 0; repeat < 20; ++repeat) {
        parallel[i] = poisoned(queries[i].count(), AKV_DTYPE_F32);
        status[i] = akv_decode(caches[i].get(), queries[i].data(), AKV_DTYPE_F32, 1, parallel[i].data(), nullptr);
        if (status[i] != AKV_OK || parallel[i] != serial[i]) return;
      }
    });
  for (std::thread &t : threads) t.join();
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(status[i], AKV_OK) << "cache " << i;
    EXPECT_TRUE(parallel[i] == serial[i]) << "cache " << i << ": concurrent decode differs from serial decode";
  }
}

}  // namespace
}  // namespace akv_test
