// White-box checks of the baselines' building blocks: the Lloyd-Max tables satisfy both
// optimality conditions for N(0,1), code packing round-trips, PyramidKV's integer schedule and
// AdaKV's rounding keep their sums, and deserialization rejects checksummed data whose
// eviction indices or quantizer outlier channels are out of range.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "core/context.hpp"
#include "core/quantizer.hpp"
#include "core/serialize.hpp"
#include "methods/eviction.hpp"

namespace {

double pdf(double x) { return std::isinf(x) ? 0.0 : std::exp(-0.5 * x * x) / std::sqrt(2 * M_PI); }
double cdf(double x) { return 0.5 * std::erfc(-x / std::sqrt(2.0)); }

TEST(LloydMax, LevelsAreCentroidsAndThresholdsMidpoints) {
  const double expected_mse[5] = {0, 0, 0.117482, 0.034548, 0.009501};
  for (int bits : {2, 3, 4}) {
    const std::vector<float> levels = akv::lloyd_max_levels(bits);
    const int n = static_cast<int>(levels.size());
    ASSERT_EQ(n, 1 << bits);
    double mse = 1.0;
    for (int i = 0; i < n; ++i) {
      const double lo = i == 0 ? -INFINITY : 0.5 * (levels[i - 1] + levels[i]);
      const double hi = i == n - 1 ? INFINITY : 0.5 * (levels[i] + levels[i + 1]);
      const double mass = cdf(hi) - cdf(lo);
      const double centroid = (pdf(lo) - pdf(hi)) / mass;  // E[X | lo < X < hi]
      EXPECT_NEAR(levels[i], centroid, 2e-6) << bits << " bits, level " << i;
      if (i > 0) EXPECT_LT(levels[i - 1], levels[i]);
      mse -= mass * levels[i] * levels[i];  // with centroids: E[(X-Q)^2] = 1 - sum p_i l_i^2
    }
    EXPECT_NEAR(mse, expected_mse[bits], 2e-6) << bits << " bits";
  }
  // The 2-bit table is the codec's (SPEC 2.7, four decimals there).
  EXPECT_NEAR(akv::lloyd_max_levels(2)[3], akv::kLloydMaxLevels[3], 1e-4);
}

TEST(QuantizerCodes, PackUnpackRoundTrip) {
  std::mt19937 rng(3);
  for (int bits : {2, 3, 4})
    for (int n : {16, 64, 128, 512}) {
      std::vector<uint8_t> codes(n), back(n), packed(n * bits / 8 + 1, 0xAB);
      for (uint8_t &c : codes) c = static_cast<uint8_t>(rng() % (1u << bits));
      akv::pack_codes(codes.data(), n, bits, packed.data());
      EXPECT_EQ(packed.back(), 0xAB) << "wrote past n*bits/8 bytes";
      akv::unpack_codes(packed.data(), n, bits, back.data());
      EXPECT_EQ(codes, back) << bits << " bits, n " << n;
    }
}

TEST(QuantizerCodes, KeyOutliersAreKeptExactly) {
  const int D = 64;
  akv::TokenQuantizer q(42, D, 3, 4);
  std::vector<float> key(D, 0.25f), y(D);
  key[5] = 40.0f, key[17] = -35.0f, key[30] = 20.0f, key[63] = -18.0f, key[0] = 1.0f;
  std::vector<uint8_t> packed(D * 3 / 8);
  float scale = 0;
  int32_t index[4];
  float value[4];
  q.encode_key(key.data(), packed.data(), &scale, index, value);
  EXPECT_EQ(std::vector<int32_t>(index, index + 4), (std::vector<int32_t>{5, 17, 30, 63}));
  EXPECT_EQ(std::vector<float>(value, value + 4), (std::vector<float>{40.0f, -35.0f, 20.0f, -18.0f}));
  q.decode_rotated(packed.data(), scale, y.data());
  q.rotation().unrotate(y.data());
  for (int j = 0; j < 4; ++j) y[index[j]] += value[j];
  double err = 0, energy = 0;
  for (int d = 0; d < D; ++d) err += std::pow(y[d] - key[d], 2), energy += key[d] * key[d];
  EXPECT_LT(err / energy, 1e-3);  // the outliers carry almost all the energy
}

TEST(PyramidSchedule, SumsToTheLayersTimesTheBase) {
  for (int64_t P : {100, 1000, 5000})
    for (int64_t base : {0, 1, 7, 50, 333, 999})
      for (int beta : {1, 2, 20})
        for (int L : {1, 2, 3, 7, 32, 80}) {
          if (base > P) continue;
          const std::vector<int64_t> b = akv::pyramid_schedule(base, P, beta, L);
          ASSERT_EQ(static_cast<int>(b.size()), L);
          EXPECT_EQ(std::accumulate(b.begin(), b.end(), int64_t{0}), L * base)
              << "P " << P << " base " << base << " beta " << beta << " L " << L;
          for (int l = 0; l < L; ++l) {
            EXPECT_GE(b[l], 0);
            EXPECT_LE(b[l], P);
            if (l > 0) EXPECT_LE(b[l], b[l - 1] + 1);  // non-increasing up to rounding
          }
        }
}

TEST(AdaKVCounts, SumToTheLayerBudgetAndRespectTheFloor) {
  std::mt19937 rng(5);
  for (int trial = 0; trial < 200; ++trial) {
    const int H = 1 + static_cast<int>(rng() % 16);
    const int64_t base = rng() % 300;
    std::vector<int64_t> cnt(H, 0);
    for (int64_t i = 0; i < H * base; ++i) ++cnt[rng() % H];
    const double alpha = (rng() % 11) / 10.0;
    const std::vector<int64_t> n = akv::adakv_counts(cnt, base, alpha);
    EXPECT_EQ(std::accumulate(n.begin(), n.end(), int64_t{0}), H * base);
    for (int h = 0; h < H; ++h) {
      const double real = cnt[h] * (1 - alpha) + alpha * base;
      EXPECT_LE(std::fabs(n[h] - real), 1.0);
      EXPECT_GE(n[h], static_cast<int64_t>(std::floor(alpha * base)));
    }
  }
}

// A checksummed cache whose internal arrays were tampered with before serialization.
akv_cache *compress_small(akv_context *ctx, akv_method method, std::vector<float> &kv, std::vector<float> &q) {
  const int64_t S = 200;
  const int H = 2, D = 32, W = 16;
  std::mt19937 rng(9);
  std::normal_distribution<float> normal;
  kv.resize(static_cast<size_t>(H) * S * D);
  q.resize(static_cast<size_t>(H) * W * D);
  for (float &x : kv) x = normal(rng);
  for (float &x : q) x = normal(rng);
  akv_prefill p;
  akv_prefill_init(&p);
  p.shape = {S, H, H, D};
  p.dtype = AKV_DTYPE_F32;
  p.keys = p.values = kv.data();
  p.queries = q.data();
  akv_compress_options o;
  akv_compress_options_init_method(&o, method);
  o.window = W;
  o.retain_fraction = method == AKV_METHOD_QUANTIZED ? 1.0 : 0.3;
  akv_cache *cache = nullptr;
  EXPECT_EQ(akv_compress(ctx, &p, &o, &cache, nullptr), AKV_OK) << akv_last_error_message();
  return cache;
}

akv_status reload(akv_context *ctx, const akv_cache *cache) {
  size_t size = 0;
  EXPECT_EQ(akv_cache_serialized_size(cache, &size), AKV_OK);
  std::vector<uint8_t> bytes(size);
  EXPECT_EQ(akv_cache_serialize(cache, bytes.data(), size, nullptr, nullptr), AKV_OK);
  akv_cache *out = nullptr;
  const akv_status status = akv_cache_deserialize(ctx, bytes.data(), size, &out, nullptr);
  akv_cache_destroy(out);
  return status;
}

TEST(BaselineDeserialize, RejectsBadIndicesUnderAValidChecksum) {
  akv_context *ctx = nullptr;
  ASSERT_EQ(akv_context_create(nullptr, &ctx), AKV_OK);
  std::vector<float> kv, q;
  akv_cache *cache = compress_small(ctx, AKV_METHOD_ADAKV, kv, q);
  ASSERT_NE(cache, nullptr);
  EXPECT_EQ(reload(ctx, cache), AKV_OK);
  std::vector<int32_t> saved = cache->dense_tokens;
  cache->dense_tokens[3] = 100000;  // beyond the prompt
  EXPECT_EQ(reload(ctx, cache), AKV_ERR_CORRUPT_DATA);
  cache->dense_tokens = saved;
  std::swap(cache->dense_tokens[1], cache->dense_tokens[2]);  // not increasing
  EXPECT_EQ(reload(ctx, cache), AKV_ERR_CORRUPT_DATA);
  cache->dense_tokens = saved;
  cache->meta.dense_counts[0] += 1, cache->meta.dense_counts[1] -= 1;  // counts disagree with the tokens
  EXPECT_EQ(reload(ctx, cache), AKV_ERR_CORRUPT_DATA);
  akv_cache_destroy(cache);

  akv_cache *quant = compress_small(ctx, AKV_METHOD_QUANTIZED, kv, q);
  ASSERT_NE(quant, nullptr);
  EXPECT_EQ(reload(ctx, quant), AKV_OK);
  quant->quant_section<uint8_t>(akv::kQuantKeyOutlierIndex)[7] = 32;  // channel beyond D
  EXPECT_EQ(reload(ctx, quant), AKV_ERR_CORRUPT_DATA);
  quant->quant_section<uint8_t>(akv::kQuantKeyOutlierIndex)[7] = 3;
  quant->meta.quant_bits = 5;
  EXPECT_EQ(reload(ctx, quant), AKV_ERR_CORRUPT_DATA);
  akv_cache_destroy(quant);
  akv_context_destroy(ctx);
}

}  // namespace
