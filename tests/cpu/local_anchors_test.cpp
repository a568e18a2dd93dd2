// Storage format 3's local anchor search (cpu/local_anchors.hpp) against brute force on random
// rows: every token's nearest anchor is the best of its candidates (its segment's range and the
// window), the coverage share is new, distinct prefix tokens, and planted outliers get anchors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <set>
#include <vector>

#include "api/api_test_util.hpp"
#include "core/context.hpp"
#include "core/dtype.hpp"
#include "core/thread_pool.hpp"
#include "cpu/local_anchors.hpp"

namespace {

akv::AnchorGeometry geometry(int64_t S, int W, int k, int D, int64_t L) {
  akv::AnchorGeometry g;
  g.seq_len = S;
  g.prefix = S - W;
  g.window = W;
  g.anchors = k;
  g.dim = D;
  g.format = 3;
  g.segment_len = L;
  while ((int64_t{1} << g.segment_shift) < L) ++g.segment_shift;
  g.segments = (g.prefix + L - 1) / L;
  g.table_size = k > 256 ? 256 : 0;
  return g;
}

// Rows around a few shared directions (so that nearest anchors are meaningful), non-zero.
std::vector<float> rows(std::mt19937_64 &rng, int64_t S, int D) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> centers(8 * D), x(S * D);
  for (float &c : centers) c = normal(rng);
  for (int64_t t = 0; t < S; ++t) {
    const float *c = &centers[(rng() % 8) * D];
    for (int d = 0; d < D; ++d) x[t * D + d] = c[d] + 0.7f * normal(rng);
  }
  return x;
}

// D 64 takes the AVX-512 dot blocks where the CPU has them, D 40 the SGEMM path.
class LocalAnchorsDim : public ::testing::TestWithParam<int> {};

TEST_P(LocalAnchorsDim, NearestIsTheBestCandidateAndCoverageAddsDistinctTokens) {
  const uint64_t seed = akv_test::fresh_seed();
  AKV_TRACE_SEED(seed);
  std::mt19937_64 rng(seed);
  const int64_t S = 6144;
  const int W = 32, k = 600, D = GetParam();
  const akv::AnchorGeometry g = geometry(S, W, k, D, 256);
  const int64_t P = g.prefix, free_anchors = k - W;
  const std::vector<float> K = rows(rng, S, D), V = rows(rng, S, D);
  // A range is a real restriction here: it leaves most of the prefix out.
  const akv::CandidateRange mid = akv::candidate_range(g, g.segments / 2);
  ASSERT_GT(mid.first, 0);
  ASSERT_LT(mid.last - mid.first, P / 2);

  std::vector<int32_t> anchors;
  std::set<int32_t> initial;
  while (static_cast<int64_t>(initial.size()) < 200) initial.insert(static_cast<int32_t>(rng() % P));
  anchors.assign(initial.begin(), initial.end());
  std::shuffle(anchors.begin(), anchors.end(), rng);
  akv::ThreadPool pool(2);
  akv::LocalNearest nearest;
  akv::local_coverage(K, V, g, AKV_DTYPE_BF16, 3, free_anchors - 200, anchors, nearest, pool);

  ASSERT_EQ(static_cast<int64_t>(anchors.size()), free_anchors);
  const std::set<int32_t> all(anchors.begin(), anchors.end());
  ASSERT_EQ(static_cast<int64_t>(all.size()), free_anchors) << "coverage added a token twice";
  for (int32_t a : anchors) ASSERT_TRUE(a >= 0 && a < P);

  const std::vector<float> *X[2] = {&K, &V};
  for (int side = 0; side < 2; ++side) {
    // Each anchor's row as stored (bf16), normalised, in double.
    auto unit = [&](int32_t a) {
      std::vector<double> u(D);
      double n2 = 0.0;
      for (int d = 0; d < D; ++d) {
        u[d] = akv::round_to_storage((*X[side])[a * D + d], AKV_DTYPE_BF16);
        n2 += u[d] * u[d];
      }
      for (double &v : u) v /= std::sqrt(n2);
      return u;
    };
    std::vector<std::vector<double>> units(S);
    for (int32_t a : anchors) units[a] = unit(a);
    for (int64_t t = P; t < S; ++t) units[t] = unit(static_cast<int32_t>(t));
    int checked = 0;
    for (int64_t t = 0; t < P; t += 7) {
      const akv::CandidateRange r = akv::candidate_range(g, t / g.segment_len);
      std::vector<int32_t> cands;
      for (int32_t a : anchors)
        if (a >= r.first && a < r.last) cands.push_back(a);
      for (int64_t w = P; w < S; ++w) cands.push_back(static_cast<int32_t>(w));
      double best = -1.0;
      for (int32_t a : cands) {
        double dot = 0.0;
        for (int d = 0; d < D; ++d) dot += (*X[side])[t * D + d] * units[a][d];
        best = std::max(best, std::fabs(dot));
      }
      const int32_t got = nearest.token[side][t];
      ASSERT_TRUE(std::find(cands.begin(), cands.end(), got) != cands.end())
          << "side " << side << " token " << t << ": anchor " << got << " is not a candidate";
      double dot = 0.0;
      for (int d = 0; d < D; ++d) dot += (*X[side])[t * D + d] * units[got][d];
      EXPECT_NEAR(nearest.dot[side][t], dot, 1e-3 * (1.0 + std::fabs(dot))) << "side " << side << " token " << t;
      EXPECT_GE(std::fabs(dot), best - 1e-3 * (1.0 + best)) << "side " << side << " token " << t << " missed its best";
      ++checked;
    }
    EXPECT_GT(checked, 800);
  }
}

INSTANTIATE_TEST_SUITE_P(HeadDims, LocalAnchorsDim, ::testing::Values(64, 40));

TEST(LocalAnchors, CoverageAnchorsThePlantedOutliers) {
  const uint64_t seed = akv_test::fresh_seed();
  AKV_TRACE_SEED(seed);
  std::mt19937_64 rng(seed);
  const int64_t S = 6144;
  const int W = 32, k = 600, D = 64;
  const akv::AnchorGeometry g = geometry(S, W, k, D, 256);
  const int64_t P = g.prefix;
  std::vector<float> K = rows(rng, S, D), V = rows(rng, S, D);
  // Six tokens, one per part of the prompt, along their own axis with a large norm: no other
  // row resembles them, so the first coverage round must take them.
  std::vector<int32_t> planted;
  for (int i = 0; i < 6; ++i) planted.push_back(static_cast<int32_t>((2 * i + 1) * P / 12));
  for (size_t i = 0; i < planted.size(); ++i)
    for (int d = 0; d < D; ++d) {
      K[planted[i] * D + d] = d == static_cast<int>(i) ? 40.0f : 0.0f;
      V[planted[i] * D + d] = d == static_cast<int>(i) + 10 ? 40.0f : 0.0f;
    }
  std::vector<int32_t> anchors;
  for (int64_t t = 0; t < P && anchors.size() < 300; t += 17)
    if (std::find(planted.begin(), planted.end(), t) == planted.end()) anchors.push_back(static_cast<int32_t>(t));
  akv::ThreadPool pool(1);
  akv::LocalNearest nearest;
  akv::local_coverage(K, V, g, AKV_DTYPE_F32, 4, 40, anchors, nearest, pool);
  for (int32_t p : planted) {
    EXPECT_TRUE(std::find(anchors.begin(), anchors.end(), p) != anchors.end()) << "token " << p;
    EXPECT_EQ(nearest.token[0][p], p);
    EXPECT_EQ(nearest.token[1][p], p);
  }
}

// A round's pool (core/coverage.hpp): twelve near-copies of one outlier, all in one segment and
// ranked above five distinct outliers elsewhere, and a round of six picks. Taking the six
// worst-represented tokens would spend five picks on copies that the first makes redundant;
// the pool's cover test skips them, so the round takes one copy and the five others.
TEST(LocalAnchors, ARoundSkipsWhatAnEarlierPickCovers) {
  const uint64_t seed = akv_test::fresh_seed();
  AKV_TRACE_SEED(seed);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> noise(0.0f, 0.05f);
  const int64_t S = 6144;
  const int W = 32, k = 600, D = 64;
  const akv::AnchorGeometry g = geometry(S, W, k, D, 256);
  const int64_t P = g.prefix;
  std::vector<float> K = rows(rng, S, D), V = rows(rng, S, D);
  auto plant = [&](int64_t t, int axis, float norm) {
    for (int d = 0; d < D; ++d) {
      K[t * D + d] = (d == axis ? norm : 0.0f) + noise(rng);
      V[t * D + d] = (d == axis + 16 ? norm : 0.0f) + noise(rng);
    }
  };
  std::vector<int32_t> copies, singles;
  for (int i = 0; i < 12; ++i) copies.push_back(static_cast<int32_t>(P / 2 + 3 * i));  // one segment
  for (int32_t t : copies) plant(t, 0, 40.0f);
  for (int i = 0; i < 5; ++i) singles.push_back(static_cast<int32_t>((2 * i + 1) * P / 10 + 7));
  for (size_t i = 0; i < singles.size(); ++i) plant(singles[i], 1 + static_cast<int>(i), 30.0f);
  std::vector<int32_t> anchors;
  for (int64_t t = 1; t < P && anchors.size() < 300; t += 17)
    if (std::count(copies.begin(), copies.end(), t) + std::count(singles.begin(), singles.end(), t) == 0)
      anchors.push_back(static_cast<int32_t>(t));
  const size_t before = anchors.size();
  akv::ThreadPool pool(2);
  akv::LocalNearest nearest;
  akv::local_coverage(K, V, g, AKV_DTYPE_F32, 1, 6, anchors, nearest, pool);
  ASSERT_EQ(anchors.size(), before + 6);
  const std::vector<int32_t> fresh(anchors.begin() + static_cast<int64_t>(before), anchors.end());
  int64_t copies_taken = 0;
  for (int32_t t : fresh) copies_taken += std::count(copies.begin(), copies.end(), t);
  EXPECT_EQ(copies_taken, 1);
  for (int32_t t : singles) EXPECT_TRUE(std::find(fresh.begin(), fresh.end(), t) != fresh.end()) << "token " << t;
}

}  // namespace
