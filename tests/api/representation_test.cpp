// The anchor-residual representation seen from outside (paper §3.1-3.4, SPEC 2.2-2.6), read
// back through akv_cache_reconstruct:
//  - the window and the anchors are stored exactly (in the storage dtype);
//  - every other row is gamma * (its anchor), plus a decoded residual for the rows that got one;
//  - anchors are the best-scored positions (plus seeded uniform samples);
//  - residuals go to the positions with the largest utilities (Eq. 6), pooled over heads.
#include <array>
#include <map>
#include <numeric>
#include <set>

#include "api/api_test_util.hpp"

namespace akv_test {
namespace {

enum RowKind : uint8_t { kAnchor = 0, kProjectionOnly = 1, kWithResidual = 2 };

// Below this distance from 1, |cos| means "the same direction" for a float reconstruction of
// gamma * anchor; rows carrying a 2-bit residual are orders of magnitude further away.
constexpr double kCollinear = 1e-4;

double cosine(const double *a, const double *b, int n) {
  const double na = norm(a, n), nb = norm(b, n);
  return (na == 0.0 || nb == 0.0) ? 0.0 : dot(a, b, n) / (na * nb);
}

std::vector<double> row(const float *x, int n) { return std::vector<double>(x, x + n); }

// x - gamma x_a for the stored row x_a (head h of [H][S][D]) of the anchor with the largest
// |cos| to x (ties: the first), gamma = <x, x_a> / ||x_a||^2: the residual AnchorKV encodes.
std::vector<double> residual_against_best_anchor(const std::vector<double> &x, const std::vector<float> &stored, int h,
                                                 int64_t S, int D, const std::vector<int64_t> &anchors) {
  double best = -1.0, gamma = 0.0;
  std::vector<double> best_anchor;
  for (int64_t a : anchors) {
    const std::vector<double> xa = row(&stored[(static_cast<size_t>(h) * S + a) * D], D);
    const double c = std::fabs(cosine(x.data(), xa.data(), D));
    if (c > best) best = c, gamma = dot(x.data(), xa.data(), D) / dot(xa.data(), xa.data(), D), best_anchor = xa;
  }
  std::vector<double> r(D);
  for (int d = 0; d < D; ++d) r[d] = x[d] - gamma * best_anchor[d];
  return r;
}

// Per head: which positions are anchors (K and V both exact), and per side whether every
// other position is a pure projection (collinear with an anchor) or carries a residual.
struct RowAnalysis {
  std::vector<std::vector<int64_t>> anchors;                 // [H] sorted positions
  std::vector<std::vector<uint8_t>> key_kind, value_kind;    // [H][S]
  std::vector<std::vector<int64_t>> key_partner, value_partner;  // [H][S]: collinear anchor or -1
  std::vector<int64_t> window_rows_not_exact;                // [H]
};

RowAnalysis analyse_rows(const Dense &recon, const std::vector<float> &stored_keys,
                         const std::vector<float> &stored_values, int64_t S, int W) {
  const int H = recon.kv_heads, D = recon.head_dim;
  RowAnalysis out;
  out.anchors.resize(H);
  out.key_kind.assign(H, std::vector<uint8_t>(S, kAnchor));
  out.value_kind = out.key_kind;
  out.key_partner.assign(H, std::vector<int64_t>(S, -1));
  out.value_partner = out.key_partner;
  out.window_rows_not_exact.assign(H, 0);
  auto same = [&](const float *a, const float *b) { return std::equal(a, a + D, b); };
  for (int h = 0; h < H; ++h) {
    std::vector<uint8_t> key_exact(S), value_exact(S);
    for (int64_t t = 0; t < S; ++t) {
      const size_t offset = (static_cast<size_t>(h) * S + t) * D;
      key_exact[t] = same(recon.key_row(h, t), &stored_keys[offset]);
      value_exact[t] = same(recon.value_row(h, t), &stored_values[offset]);
      if (key_exact[t] && value_exact[t]) out.anchors[h].push_back(t);
      if (t >= S - W && !(key_exact[t] && value_exact[t])) ++out.window_rows_not_exact[h];
    }
    for (int side = 0; side < 2; ++side) {
      auto &kind = side == 0 ? out.key_kind[h] : out.value_kind[h];
      auto &partner = side == 0 ? out.key_partner[h] : out.value_partner[h];
      auto row_of = [&](int64_t t) { return row(side == 0 ? recon.key_row(h, t) : recon.value_row(h, t), D); };
      std::vector<std::vector<double>> anchor_rows;
      for (int64_t a : out.anchors[h]) anchor_rows.push_back(row_of(a));
      for (int64_t t = 0; t < S; ++t) {
        if (key_exact[t] && value_exact[t]) continue;
        const std::vector<double> x = row_of(t);
        double best = -1.0;
        int64_t best_anchor = -1;
        for (size_t i = 0; i < anchor_rows.size(); ++i) {
          const double c = std::fabs(cosine(x.data(), anchor_rows[i].data(), D));
          if (c > best) best = c, best_anchor = out.anchors[h][i];
        }
        kind[t] = best >= 1.0 - kCollinear ? kProjectionOnly : kWithResidual;
        if (kind[t] == kProjectionOnly) partner[t] = best_anchor;
      }
    }
  }
  return out;
}

std::vector<float> rounded(const std::vector<float> &x, akv_dtype dtype) {
  std::vector<float> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = round_to_dtype(x[i], dtype);
  return out;
}

akv_dtype storage_for(akv_dtype input) { return input == AKV_DTYPE_F16 ? AKV_DTYPE_F16 : AKV_DTYPE_BF16; }

// ---- exactness, projections, residuals ------------------------------------------------------

struct RepresentationCase {
  const char *name;
  akv_dtype dtype;
  int group;
  int head_dim;
};

class Representation : public ::testing::TestWithParam<RepresentationCase> {};

TEST_P(Representation, AnchorsExactOthersProjectedResidualsWhereCounted) {
  const RepresentationCase &c = GetParam();
  const uint64_t seed = fresh_seed();
  AKV_TRACE_SEED(seed);
  Rng rng(seed);
  PrefillSpec spec;
  spec.seq_len = 512;
  spec.kv_heads = 2;
  spec.group = c.group;
  spec.head_dim = c.head_dim;
  spec.dtype = c.dtype;
  const PrefillData data = make_prefill(rng, spec);
  const int W = 32, k = 48, H = spec.kv_heads, D = spec.head_dim;
  const int64_t S = spec.seq_len;
  const akv_compress_options options = anchorkv_options(workable_retain_fraction(data.shape, W, k, 0.07), W, k);
  const AnchorBudget budget = anchorkv_budget(S, H, D, W, k, options.retain_fraction);
  // The setup must leave both kinds of rows on both sides, or the test proves nothing.
  ASSERT_GT(budget.key_residuals, budget.residuals_per_side_cap / 10);
  ASSERT_LT(budget.key_residuals, budget.residuals_per_side_cap * 9 / 10);

  const ContextPtr context = make_context();
  const CachePtr cache = compress(context.get(), data, options);
  const Dense recon = reconstruct(cache.get(), /*rotated=*/0);
  ASSERT_EQ(recon.tokens, S);
  const akv_dtype storage = storage_for(c.dtype);
  const std::vector<float> stored_keys = rounded(data.keys.values, storage);
  const std::vector<float> stored_values = rounded(data.values.values, storage);
  const RowAnalysis rows = analyse_rows(recon, stored_keys, stored_values, S, W);
  const std::vector<akv_head_stats> heads = head_stats(cache.get(), H);

  EXPECT_TRUE(std::all_of(recon.present.begin(), recon.present.end(), [](uint8_t p) { return p == 1; }))
      << "AnchorKV keeps every position";

  double error_projection_sum = 0.0, error_residual_sum = 0.0;
  int64_t projection_rows = 0, residual_rows = 0;
  for (int h = 0; h < H; ++h) {
    SCOPED_TRACE("head " + std::to_string(h));
    EXPECT_EQ(rows.window_rows_not_exact[h], 0) << "window rows must reconstruct exactly";
    // Random continuous data: a non-anchor reproducing its input bit for bit in all D
    // coordinates has probability ~0, so the exact rows are the anchors, exactly k of them.
    EXPECT_EQ(static_cast<int64_t>(rows.anchors[h].size()), k) << "exact rows (K and V) != k anchors";
    for (int side = 0; side < 2; ++side) {
      const auto &kind = side == 0 ? rows.key_kind[h] : rows.value_kind[h];
      const auto &partner = side == 0 ? rows.key_partner[h] : rows.value_partner[h];
      const std::vector<float> &input = side == 0 ? data.keys.values : data.values.values;
      const std::vector<float> &recon_side = side == 0 ? recon.keys : recon.values;
      const std::vector<float> &stored = side == 0 ? stored_keys : stored_values;
      int64_t with_residual = 0, wrong_anchor = 0, wrong_gamma = 0;
      for (int64_t t = 0; t < S; ++t) {
        if (kind[t] == kAnchor) continue;
        const size_t offset = (static_cast<size_t>(h) * S + t) * D;
        const std::vector<double> x(&input[offset], &input[offset] + D);
        const std::vector<double> x_hat(&recon_side[offset], &recon_side[offset] + D);
        std::vector<double> diff(D);
        for (int d = 0; d < D; ++d) diff[d] = x_hat[d] - x[d];
        const double relative_error = norm(diff.data(), D) / norm(x.data(), D);
        if (kind[t] == kWithResidual) {
          ++with_residual;
          error_residual_sum += relative_error;
          ++residual_rows;
          continue;
        }
        error_projection_sum += relative_error;
        ++projection_rows;
        // Eq. 1-2: the anchor is the one of largest |cos| with x (near-ties allowed), and
        // gamma = <x, x_a> / ||x_a||^2 up to the coefficient's bf16 rounding.
        double best = 0.0;
        for (int64_t a : rows.anchors[h]) {
          const std::vector<double> xa(&stored[(static_cast<size_t>(h) * S + a) * D],
                                       &stored[(static_cast<size_t>(h) * S + a) * D] + D);
          best = std::max(best, std::fabs(cosine(x.data(), xa.data(), D)));
        }
        const size_t partner_offset = (static_cast<size_t>(h) * S + partner[t]) * D;
        const std::vector<double> xa(&stored[partner_offset], &stored[partner_offset] + D);
        if (std::fabs(cosine(x.data(), xa.data(), D)) < best - 1e-3) ++wrong_anchor;
        const double gamma_expected = dot(x.data(), xa.data(), D) / dot(xa.data(), xa.data(), D);
        const double gamma_stored = dot(x_hat.data(), xa.data(), D) / dot(xa.data(), xa.data(), D);
        const double scale = norm(x.data(), D) / norm(xa.data(), D);
        if (std::fabs(gamma_stored - gamma_expected) > 0.01 * std::fabs(gamma_expected) + 1e-3 * scale) ++wrong_gamma;
      }
      const int64_t counted = side == 0 ? heads[h].key_residuals : heads[h].value_residuals;
      EXPECT_EQ(with_residual, counted) << (side == 0 ? "keys" : "values")
                                        << ": rows off every anchor direction != residuals in head stats";
      EXPECT_EQ(wrong_anchor, 0) << (side == 0 ? "keys" : "values")
                                 << ": rows projected on an anchor that is not the closest in direction";
      EXPECT_EQ(wrong_gamma, 0) << (side == 0 ? "keys" : "values") << ": gamma is not <x,x_a>/||x_a||^2";
    }
  }
  ASSERT_GT(projection_rows, 0);
  ASSERT_GT(residual_rows, 0);
  const double mean_projection = error_projection_sum / projection_rows;
  const double mean_residual = error_residual_sum / residual_rows;
  note("mean_relative_error_projection_only", mean_projection);
  note("mean_relative_error_with_residual", mean_residual);
  // A 2-bit residual leaves ~sqrt(0.115) of the residual norm; without it all of it remains.
  EXPECT_LT(mean_residual, 0.75 * mean_projection)
      << "mean relative error with residual " << mean_residual << ", projection only " << mean_projection;
}

INSTANTIATE_TEST_SUITE_P(
    Inputs, Representation,
    ::testing::Values(RepresentationCase{"F32_G1_D64", AKV_DTYPE_F32, 1, 64},
                      RepresentationCase{"F16_G2_D64", AKV_DTYPE_F16, 2, 64},
                      RepresentationCase{"BF16_G4_D128", AKV_DTYPE_BF16, 4, 128}),
    [](const ::testing::TestParamInfo<RepresentationCase> &info) { return std::string(info.param.name); });

// ---- anchor selection -----------------------------------------------------------------------

// Data where the window queries of each head share a direction u_h and a few "hot" positions
// carry keys along u_h: they take most of the attention, so score-based selection must pick
// them. RoPE off so that direction is what the scoring sees.
struct HotData {
  PrefillData data;
  std::vector<std::vector<int64_t>> hot_centers;  // [H]
};

HotData make_hot_data(Rng &rng, int64_t S, int H, int G, int D, int W, int runs, int run_length,
                      const std::vector<double> &strength_per_run) {
  HotData hot;
  PrefillData &data = hot.data;
  data.shape = akv_shape{S, H, H * G, D};
  data.window = W;
  data.dtype = AKV_DTYPE_F32;
  data.positions = default_positions(S);
  std::vector<float> keys = rng.normal_vector(static_cast<size_t>(H) * S * D);
  std::vector<float> queries(static_cast<size_t>(H) * G * W * D);
  hot.hot_centers.resize(H);
  const int64_t P = S - W, spacing = P / runs;
  for (int h = 0; h < H; ++h) {
    const std::vector<float> u = rng.normal_vector(D);
    for (int g = 0; g < G; ++g)
      for (int w = 0; w < W; ++w)
        for (int d = 0; d < D; ++d)
          queries[((static_cast<size_t>(h) * G + g) * W + w) * D + d] = static_cast<float>(rng.normal() + 0.5 * u[d]);
    for (int r = 0; r < runs; ++r) {
      // One run per slot of the non-window range, away from its edges and from the others.
      const int64_t center = r * spacing + spacing / 2 + rng.uniform_int(-spacing / 8, spacing / 8);
      hot.hot_centers[h].push_back(center);
      for (int64_t t = center - run_length / 2; t <= center + run_length / 2; ++t)
        for (int d = 0; d < D; ++d)
          keys[(static_cast<size_t>(h) * S + t) * D + d] =
              static_cast<float>(strength_per_run[r] * u[d] + rng.normal(0.0, 0.05));
    }
  }
  data.keys_pre_rope = keys;
  data.keys = make_tensor(keys, AKV_DTYPE_F32);
  data.values = make_tensor(nonzero_normal(rng, static_cast<size_t>(H) * S * D), AKV_DTYPE_F32);
  data.queries = make_tensor(queries, AKV_DTYPE_F32);
  return hot;
}

std::vector<std::vector<int64_t>> anchors_of(const akv_cache *cache, const PrefillData &data) {
  const Dense recon = reconstruct(cache, 0);
  const akv_dtype storage = storage_for(data.dtype);
  return analyse_rows(recon, rounded(data.keys.values, storage), rounded(data.values.values, storage),
                      data.seq_len(), data.window)
      .anchors;
}

struct SelectionCase {
  const char *name;
  int pool_kernel;
  int run_length;
  double scored_fraction;
};

class AnchorSelection : public ::testing::TestWithParam<SelectionCase> {};

TEST_P(AnchorSelection, HighestScoredPositionsBecomeAnchors) {
  const SelectionCase &c = GetParam();
  const uint64_t seed = fresh_seed();
  AKV_TRACE_SEED(seed);
  Rng rng(seed);
  const int64_t S = 512;
  const int H = 2, G = 2, D = 64, W = 32, extra = 8;
  const int scored = static_cast<int>(std::lround(c.scored_fraction * extra));
  // The first `scored` runs are much hotter than the rest, so they are the top scores even when
  // only some slots go by score.
  std::vector<double> strength(extra);
  for (int r = 0; r < extra; ++r) strength[r] = r < scored ? 1.8 : 1.2;
  const HotData hot = make_hot_data(rng, S, H, G, D, W, extra, c.run_length, strength);

  akv_compress_options options = anchorkv_options(workable_retain_fraction(hot.data.shape, W, W + extra, 0.05), W, W + extra);
  options.rope.style = AKV_ROPE_NONE;
  options.scored_fraction = c.scored_fraction;
  options.pool_kernel = c.pool_kernel;
  const ContextPtr context = make_context();
  const CachePtr cache = compress(context.get(), hot.data, options);
  const auto anchors = anchors_of(cache.get(), hot.data);
  for (int h = 0; h < H; ++h) {
    SCOPED_TRACE("head " + std::to_string(h));
    const std::set<int64_t> anchor_set(anchors[h].begin(), anchors[h].end());
    EXPECT_EQ(anchor_set.size(), static_cast<size_t>(W + extra));
    for (int64_t t = S - W; t < S; ++t) EXPECT_EQ(anchor_set.count(t), 1u) << "window position " << t;
    for (int r = 0; r < scored; ++r)
      EXPECT_EQ(anchor_set.count(hot.hot_centers[h][r]), 1u)
          << "hot position " << hot.hot_centers[h][r] << " (pooled score maximum) is not an anchor";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Pooling, AnchorSelection,
    ::testing::Values(SelectionCase{"NoPooling_AllScored", 1, 1, 1.0},
                      SelectionCase{"AvgPool7_AllScored", 7, 7, 1.0},
                      SelectionCase{"AvgPool7_HalfScored", 7, 7, 0.5},
                      SelectionCase{"DefaultRho", 7, 7, 0.7}),
    [](const ::testing::TestParamInfo<SelectionCase> &info) { return std::string(info.param.name); });

// The uniformly sampled anchors come from a generator keyed by (seed, layer, head): identical
// heads get different samples, as do other layers and seeds; the same key repeats exactly.
TEST(AnchorSampling, KeyedBySeedLayerAndHead) {
  const uint64_t seed = fresh_seed();
  AKV_TRACE_SEED(seed);
  Rng rng(seed);
  const int64_t S = 512;
  const int H = 2, G = 1, D = 64, W = 32, extra = 12;
  PrefillSpec spec;
  spec.seq_len = S;
  spec.kv_heads = 1;
  spec.group = G;
  spec.head_dim = D;
  const PrefillData one_head = make_prefill(rng, spec);
  // Two identical heads.
  PrefillData data = one_head;
  data.shape.num_kv_heads = H;
  data.shape.num_q_heads = H * G;
  auto twice = [](const std::vector<float> &x) {
    std::vector<float> y = x;
    y.insert(y.end(), x.begin(), x.end());
    return y;
  };
  data.keys_pre_rope = twice(one_head.keys_pre_rope);
  data.keys = make_tensor(twice(one_head.keys.values), AKV_DTYPE_F32);
  data.values = make_tensor(twice(one_head.values.values), AKV_DTYPE_F32);
  data.queries = make_tensor(twice(one_head.queries.values), AKV_DTYPE_F32);

  akv_compress_options options = anchorkv_options(workable_retain_fraction(data.shape, W, W + extra, 0.05), W, W + extra);
  options.scored_fraction = 0.0;  // every non-window anchor is sampled
  options.layer_count = 4;
  const ContextPtr context = make_context();
  auto anchors_with = [&](uint64_t sampler_seed, int layer) {
    akv_compress_options o = options;
    o.seed = sampler_seed;
    o.layer_index = layer;
    const CachePtr cache = compress(context.get(), data, o);
    return anchors_of(cache.get(), data);
  };
  const auto base = anchors_with(42, 0);
  ASSERT_EQ(base[0].size(), static_cast<size_t>(W + extra));
  ASSERT_EQ(base[1].size(), static_cast<size_t>(W + extra));
  EXPECT_NE(base[0], base[1]) << "identical heads drew the same samples: the head is not part of the key";
  EXPECT_NE(anchors_with(42, 1)[0], base[0]) << "layer_index does not change the samples";
  EXPECT_NE(anchors_with(43, 0)[0], base[0]) << "seed does not change the samples";
  EXPECT_EQ(anchors_with(42, 0), base) << "same seed, layer and data gave different anchors";
}

// ---- residual allocation by utility (Eq. 6, pooled over heads) ------------------------------

TEST(ResidualAllocation, LargestUtilitiesPooledOverHeads) {
  const uint64_t seed = fresh_seed();
  AKV_TRACE_SEED(seed);
  Rng rng(seed);
  const int64_t S = 512;
  const int H = 2, G = 2, D = 64, W = 32, k = 48;
  PrefillSpec spec;
  spec.seq_len = S;
  spec.kv_heads = H;
  spec.group = G;
  spec.head_dim = D;
  PrefillData data = make_prefill(rng, spec);
  // Head 0's values are 3x larger: its value utilities dominate, so pooling over heads gives it
  // most value residuals (a per-head split would not).
  std::vector<float> values = data.values.values;
  for (size_t i = 0; i < static_cast<size_t>(S) * D; ++i) values[i] *= 3.0f;
  data.values = make_tensor(values, AKV_DTYPE_F32);

  const akv_compress_options options = anchorkv_options(workable_retain_fraction(data.shape, W, k, 0.05), W, k);
  const ContextPtr context = make_context();
  const CachePtr cache = compress(context.get(), data, options);
  const Dense recon = reconstruct(cache.get(), 0);
  const std::vector<float> stored_keys = rounded(data.keys.values, AKV_DTYPE_BF16);
  const std::vector<float> stored_values = rounded(data.values.values, AKV_DTYPE_BF16);
  const RowAnalysis rows = analyse_rows(recon, stored_keys, stored_values, S, W);

  // Reference utilities in double from the inputs: window attention over post-RoPE keys.
  const RopeReference rope = rope_reference(options.rope);
  const std::vector<double> keys_post = rope.apply(data.keys.values, H, S, D, data.positions);
  const std::vector<double> values_d(data.values.values.begin(), data.values.values.end());
  AttentionShape shape{H, H * G, D, S, W};
  std::vector<double> alpha;  // [Hq][W][S]
  const std::vector<double> y =
      reference_attention(keys_post, values_d, data.queries.values, shape, 1.0 / std::sqrt(double(D)), &alpha);
  const std::vector<double> freq = rope.frequencies(D);

  struct Candidate {
    double utility;
    int h;
    int64_t t;
  };
  std::vector<Candidate> key_candidates, value_candidates;
  const int64_t P = S - W;
  for (int h = 0; h < H; ++h) {
    const std::set<int64_t> anchor_set(rows.anchors[h].begin(), rows.anchors[h].end());
    for (int64_t t = 0; t < P; ++t) {
      if (anchor_set.count(t)) continue;
      double residual_utility[2];
      for (int side = 0; side < 2; ++side) {
        const std::vector<float> &input = side == 0 ? data.keys.values : data.values.values;
        const std::vector<float> &stored = side == 0 ? stored_keys : stored_values;
        const std::vector<double> x = row(&input[(static_cast<size_t>(h) * S + t) * D], D);
        std::vector<double> r = residual_against_best_anchor(x, stored, h, S, D, rows.anchors[h]);
        if (side == 0) rope.rotate_row(r.data(), D, data.positions[t], freq);
        double utility = 0.0;
        for (int g = 0; g < G; ++g)
          for (int w = 0; w < W; ++w) {
            const int qh = h * G + g;
            const double a = alpha[(static_cast<size_t>(qh) * W + w) * S + t];
            if (side == 1) {
              utility += a * a * dot(r.data(), r.data(), D);
            } else {
              std::vector<double> q(&data.queries.values[(static_cast<size_t>(qh) * W + w) * D],
                                    &data.queries.values[(static_cast<size_t>(qh) * W + w) * D] + D);
              const double qr = dot(q.data(), r.data(), D);
              double spread = 0.0;
              for (int d = 0; d < D; ++d) {
                const double e = values_d[(static_cast<size_t>(h) * S + t) * D + d] - y[(static_cast<size_t>(qh) * W + w) * D + d];
                spread += e * e;
              }
              utility += a * a * qr * qr / D * spread;
            }
          }
        residual_utility[side] = utility / (W * G);
      }
      key_candidates.push_back({residual_utility[0], h, t});
      value_candidates.push_back({residual_utility[1], h, t});
    }
  }
  const akv_cache_stats stats = cache_stats(cache.get());
  for (int side = 0; side < 2; ++side) {
    SCOPED_TRACE(side == 0 ? "keys" : "values");
    auto &candidates = side == 0 ? key_candidates : value_candidates;
    const int64_t count = side == 0 ? stats.key_residuals : stats.value_residuals;
    ASSERT_GT(count, 20);
    ASSERT_LT(count, static_cast<int64_t>(candidates.size()) * 9 / 10);
    std::sort(candidates.begin(), candidates.end(), [](const Candidate &a, const Candidate &b) { return a.utility > b.utility; });
    int64_t agree = 0, expected_head0 = 0, stored_head0 = 0;
    for (int64_t i = 0; i < count; ++i) {
      const Candidate &c = candidates[i];
      const auto &kind = side == 0 ? rows.key_kind[c.h] : rows.value_kind[c.h];
      agree += kind[c.t] == kWithResidual;
      expected_head0 += c.h == 0;
    }
    for (int64_t t = 0; t < P; ++t) stored_head0 += (side == 0 ? rows.key_kind[0][t] : rows.value_kind[0][t]) == kWithResidual;
    note(std::string(side == 0 ? "key" : "value") + "_top_utility_agreement", static_cast<double>(agree) / count);
    // Rounding (fp32 softmax, bf16 storage) may swap near-ties at the cut; a wrong utility or a
    // per-head split moves far more than 10% of the set.
    EXPECT_GE(agree, count * 9 / 10) << agree << " of the top-" << count << " utilities got a residual";
    if (side == 1) {
      EXPECT_GT(expected_head0, count * 6 / 10) << "test setup: head 0 should dominate the value utilities";
      EXPECT_NEAR(static_cast<double>(stored_head0), static_cast<double>(expected_head0), 0.1 * count)
          << "value residuals are not pooled over heads";
    }
  }
}

// ---- additions beyond the paper (akv_compress_options_init) ---------------------------------

// A prefill whose token `needle` (in every head) has key and value in a direction u of their
// own (coordinates 0..3, zero in every other token), 4x the typical norm, and that the window
// queries avoid (their coordinates 0..3 are -3u: the needle's logits are about -12 with RoPE
// off): only a query-agnostic rule can find it.
// The unit direction (first four dimensions) of needle_prefill's needle key.
std::array<float, 4> needle_direction() {
  const float raw[4] = {1.0f, -2.0f, 3.0f, 0.5f};
  const float length = std::sqrt(1.0f + 4.0f + 9.0f + 0.25f);
  std::array<float, 4> u;
  for (int i = 0; i < 4; ++i) u[i] = raw[i] / length;
  return u;
}

PrefillData needle_prefill(Rng &rng, int64_t S, int H, int G, int D, int64_t needle) {
  PrefillSpec spec;
  spec.seq_len = S;
  spec.kv_heads = H;
  spec.group = G;
  spec.head_dim = D;
  PrefillData data = make_prefill(rng, spec);
  std::vector<float> keys = data.keys.values, values = data.values.values, queries = data.queries.values;
  const std::array<float, 4> u = needle_direction();
  for (int h = 0; h < H; ++h) {
    for (int64_t t = 0; t < S; ++t) {
      const size_t row = (static_cast<size_t>(h) * S + t) * D;
      for (int i = 0; i < 4; ++i) keys[row + i] = values[row + i] = 0.0f;
    }
    const size_t row = (static_cast<size_t>(h) * S + needle) * D;
    for (int d = 0; d < D; ++d) keys[row + d] = values[row + d] = 0.0f;
    for (int i = 0; i < 4; ++i) keys[row + i] = values[row + i] = 4.0f * std::sqrt(static_cast<float>(D)) * u[i];
  }
  for (size_t q = 0; q < queries.size(); q += D)
    for (int i = 0; i < 4; ++i) queries[q + i] = -3.0f * u[i];
  data.keys_pre_rope = keys;
  data.keys = make_tensor(keys, AKV_DTYPE_F32);
  data.values = make_tensor(values, AKV_DTYPE_F32);
  data.queries = make_tensor(queries, AKV_DTYPE_F32);
  return data;
}

TEST(Additions, SinkTokensAreAnchors) {
  const uint64_t seed = fresh_seed();
  AKV_TRACE_SEED(seed);
  Rng rng(seed);
  PrefillSpec spec;
  spec.seq_len = 700;
  spec.kv_heads = 2;
  spec.group = 2;
  spec.head_dim = 64;
  const PrefillData data = make_prefill(rng, spec);
  for (int sinks : {1, 4, 9}) {
    akv_compress_options options;
    akv_compress_options_init(&options);
    options.retain_fraction = 0.2;
    options.sink_tokens = sinks;
    options.scored_fraction = 0.0;  // the sinks still take scored slots
    const ContextPtr context = make_context();
    const CachePtr cache = compress(context.get(), data, options);
    const auto anchors = anchors_of(cache.get(), data);
    for (int h = 0; h < 2; ++h) {
      const std::set<int64_t> anchor_set(anchors[h].begin(), anchors[h].end());
      for (int64_t t = 0; t < sinks; ++t)
        EXPECT_EQ(anchor_set.count(t), 1u) << "sink " << t << " of " << sinks << " is not an anchor in head " << h;
      EXPECT_EQ(static_cast<int64_t>(anchor_set.size()), cache_stats(cache.get()).anchors);
    }
  }
}

TEST(Additions, CoverageAnchorsTakeTheWorstRepresentedToken) {
  const uint64_t seed = fresh_seed();
  AKV_TRACE_SEED(seed);
  Rng rng(seed);
  const int64_t S = 900, needle = 437;
  const PrefillData data = needle_prefill(rng, S, 2, 2, 64, needle);
  akv_compress_options options;
  akv_compress_options_init(&options);
  options.rope.style = AKV_ROPE_NONE;
  options.retain_fraction = 0.2;
  options.scored_fraction = 0.5;
  const ContextPtr context = make_context();
  const CachePtr cache = compress(context.get(), data, options);
  const auto anchors = anchors_of(cache.get(), data);
  for (int h = 0; h < 2; ++h)
    EXPECT_TRUE(std::binary_search(anchors[h].begin(), anchors[h].end(), needle))
        << "head " << h << ": the token no anchor represents did not become one";
}

// follow_tokens: the window attends to one token (the question's match); the tokens after it
// (where the answer would be written) share its score and become anchors with it. Without
// follow_tokens they are anchors only by chance.
TEST(Additions, FollowTokensAnchorWhatFollowsTheAttendedToken) {
  const uint64_t seed = fresh_seed();
  AKV_TRACE_SEED(seed);
  Rng rng(seed);
  const int64_t S = 900, match = 300;
  const int H = 2, G = 2, D = 64, follow = 6;
  PrefillData data = needle_prefill(rng, S, H, G, D, match);
  std::vector<float> queries(static_cast<size_t>(H) * G * data.window * D);
  for (size_t q = 0; q < queries.size(); ++q) queries[q] = 0.05f * static_cast<float>(rng.normal());
  const std::array<float, 4> u = needle_direction();
  for (size_t q = 0; q < queries.size(); q += D)
    for (int i = 0; i < 4; ++i) queries[q + i] = 3.0f * u[i];  // every window row looks at `match`
  data.queries = make_tensor(queries, AKV_DTYPE_F32);
  akv_compress_options options;
  akv_compress_options_init(&options);
  options.rope.style = AKV_ROPE_NONE;
  options.retain_fraction = 0.2;
  options.scored_fraction = 1.0;  // every free anchor by score: no sample, no coverage
  options.coverage_rounds = 0;
  options.pool_kernel = 1;
  options.sink_tokens = 0;
  const ContextPtr context = make_context();
  auto anchors_with = [&](int follow_tokens) {
    akv_compress_options o = options;
    o.follow_tokens = follow_tokens;
    const CachePtr cache = compress(context.get(), data, o);
    EXPECT_GT(cache_stats(cache.get()).anchors, 4 * follow);
    return anchors_of(cache.get(), data);
  };
  const auto following = anchors_with(follow), plain = anchors_with(0);
  for (int h = 0; h < H; ++h) {
    int plain_followers = 0;
    for (int64_t t = match; t <= match + follow; ++t) {
      EXPECT_TRUE(std::binary_search(following[h].begin(), following[h].end(), t)) << "head " << h << " token " << t;
      plain_followers += t > match && std::binary_search(plain[h].begin(), plain[h].end(), t);
    }
    EXPECT_TRUE(std::binary_search(plain[h].begin(), plain[h].end(), match)) << "head " << h;
    EXPECT_LT(plain_followers, follow) << "head " << h << ": without follow_tokens the followers are not all anchors";
  }
}

// guard_fraction: a share of the residual slots by residual energy. The needle (orthogonal to
// every anchor, unattended) gets no anchor (coverage off, all anchors scored) and no
// residual from the utilities, but one from the guard. With guard_fraction 1, the tokens with
// key residuals are the ones of largest energy ||x - gamma x_a||^2.
TEST(Additions, GuardResidualsGoToTheLargestResidualEnergy) {
  const uint64_t seed = fresh_seed();
  AKV_TRACE_SEED(seed);
  Rng rng(seed);
  const int64_t S = 900, needle = 300;
  const int H = 2, D = 64, W = 32;
  const PrefillData data = needle_prefill(rng, S, H, 2, D, needle);
  akv_compress_options options;
  akv_compress_options_init(&options);
  options.rope.style = AKV_ROPE_NONE;
  options.coverage_rounds = 0;
  options.scored_fraction = 1.0;
  options.pool_kernel = 1;  // pooling would lift the needle with a hot neighbour into the anchors
  options.follow_tokens = 0;  // and so would carrying a hot token's score over the 8 after it
  options.sink_tokens = 0;
  options.fill_budget = 0;
  options.retain_fraction = 0.08;
  const ContextPtr context = make_context();
  const std::vector<float> stored_keys = rounded(data.keys.values, AKV_DTYPE_BF16);
  const std::vector<float> stored_values = rounded(data.values.values, AKV_DTYPE_BF16);
  auto compress_with = [&](double guard) {
    akv_compress_options o = options;
    o.guard_fraction = guard;
    CachePtr cache = compress(context.get(), data, o);
    const akv_cache_stats stats = cache_stats(cache.get());
    EXPECT_LT(stats.key_residuals, static_cast<int64_t>(H) * (S - stats.anchors)) << "the test needs a scarce budget";
    return cache;
  };
  // The needle is orthogonal to every anchor: gamma is about 0, so without a residual its
  // rows reconstruct to about 0, with one to about themselves.
  auto needle_error = [&](const Dense &recon, int h, int side) {
    const float *got = side == 0 ? recon.key_row(h, needle) : recon.value_row(h, needle);
    const float *want = &(side == 0 ? data.keys.values : data.values.values)[(static_cast<size_t>(h) * S + needle) * D];
    double err = 0.0, ref = 0.0;
    for (int d = 0; d < D; ++d) err += (got[d] - want[d]) * (got[d] - want[d]), ref += want[d] * want[d];
    return std::sqrt(err / ref);
  };
  {
    const CachePtr cache = compress_with(0.0);
    const Dense recon = reconstruct(cache.get(), 0);
    const auto anchors = anchors_of(cache.get(), data);
    for (int h = 0; h < H; ++h) {
      ASSERT_FALSE(std::binary_search(anchors[h].begin(), anchors[h].end(), needle));
      for (int side = 0; side < 2; ++side)
        EXPECT_GT(needle_error(recon, h, side), 0.9) << "head " << h << " side " << side << ": the utilities kept it";
    }
  }
  {
    const CachePtr cache = compress_with(0.5);
    const Dense recon = reconstruct(cache.get(), 0);
    for (int h = 0; h < H; ++h)
      for (int side = 0; side < 2; ++side)
        EXPECT_LT(needle_error(recon, h, side), 0.5) << "head " << h << " side " << side << ": the guard missed it";
  }
  const CachePtr guard_only = compress_with(1.0);
  const RowAnalysis all = analyse_rows(reconstruct(guard_only.get(), 0), stored_keys, stored_values, S, W);

  // guard 1: every chosen key residual has at least the energy of every unchosen one.
  const int64_t P = S - W;
  for (int h = 0; h < H; ++h) {
    std::vector<double> chosen, unchosen;
    for (int64_t t = 0; t < P; ++t) {
      if (std::binary_search(all.anchors[h].begin(), all.anchors[h].end(), t)) continue;
      const std::vector<double> x = row(&data.keys.values[(static_cast<size_t>(h) * S + t) * D], D);
      const std::vector<double> r = residual_against_best_anchor(x, stored_keys, h, S, D, all.anchors[h]);
      (all.key_kind[h][t] == kWithResidual ? chosen : unchosen).push_back(dot(r.data(), r.data(), D));
    }
    ASSERT_FALSE(chosen.empty());
    ASSERT_FALSE(unchosen.empty());
    const double least_chosen = *std::min_element(chosen.begin(), chosen.end());
    const double most_unchosen = *std::max_element(unchosen.begin(), unchosen.end());
    EXPECT_GE(least_chosen, most_unchosen * (1.0 - 1e-2)) << "head " << h;  // bf16 coefficient rounding
  }
}

}  // namespace
}  // namespace akv_test
