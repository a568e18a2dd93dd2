// The AVX-512 kernels of cpu/kernels.hpp against the AVX2/scalar code they stand in for, on
// random data (runs where the CPU has AVX-512; skips elsewhere).
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "api/api_test_util.hpp"
#include "core/codec.hpp"
#include "cpu/kernels.hpp"

namespace {

#ifdef AKV_HAVE_AVX512_KERNELS
TEST(Avx512Kernels, ResidualDecodeEqualsTheCodecBitForBit) {
  if (!akv::has_avx512()) GTEST_SKIP() << "no AVX-512 on this CPU";
  const uint64_t seed = akv_test::fresh_seed();
  AKV_TRACE_SEED(seed);
  std::mt19937_64 rng(seed);
  for (const int dim : {64, 128, 256}) {
    SCOPED_TRACE("dim " + std::to_string(dim));
    const akv::ResidualCodec codec(seed + dim, dim, AKV_SCALE_LEAST_SQUARES);
    std::vector<float> norm_signs;
    for (float s : codec.signs()) norm_signs.push_back(s / std::sqrt(static_cast<float>(dim)));
    std::vector<uint8_t> codes(codec.code_bytes());
    std::vector<float> want(dim, -7.0f), got(dim, -9.0f), rot_want(dim, -7.0f), rot_got(dim, -9.0f);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (int trial = 0; trial < 200; ++trial) {
      for (uint8_t &b : codes) b = static_cast<uint8_t>(rng());
      const float scale = std::fabs(normal(rng)) + 1e-3f;
      codec.decode(codes.data(), scale, want.data());
      if (dim == 64) akv::decode_residual_avx512<4>(codes.data(), scale, akv::kLloydMaxLevels, norm_signs.data(), got.data());
      if (dim == 128) akv::decode_residual_avx512<8>(codes.data(), scale, akv::kLloydMaxLevels, norm_signs.data(), got.data());
      if (dim == 256) akv::decode_residual_avx512<16>(codes.data(), scale, akv::kLloydMaxLevels, norm_signs.data(), got.data());
      ASSERT_EQ(0, std::memcmp(want.data(), got.data(), dim * sizeof(float))) << "trial " << trial;
      codec.decode_rotated(codes.data(), scale, rot_want.data());
      akv::decode_rotated_avx512(codes.data(), scale, akv::kLloydMaxLevels, dim, rot_got.data());
      ASSERT_EQ(0, std::memcmp(rot_want.data(), rot_got.data(), dim * sizeof(float))) << "trial " << trial;
    }
  }
}

TEST(Avx512Kernels, WeightedRowSumsEqualTheAvx2Ones) {
  if (!akv::has_avx512()) GTEST_SKIP() << "no AVX-512 on this CPU";
  const uint64_t seed = akv_test::fresh_seed();
  AKV_TRACE_SEED(seed);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int rows = 8, D = 128, n = 37;
  std::vector<float> w(rows * n), x(n * D), a(rows * D), b;
  for (float &v : w) v = normal(rng);
  for (float &v : x) v = normal(rng);
  for (float &v : a) v = normal(rng);
  b = a;
  akv::accumulate_weighted_rows(a.data(), rows, w.data(), n, x.data(), n, D);
  ASSERT_TRUE(akv::accumulate_weighted_rows_avx512(b.data(), rows, w.data(), n, x.data(), n, D));
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float)));  // the same products in the same order
  EXPECT_FALSE(akv::accumulate_weighted_rows_avx512(b.data(), 3, w.data(), n, x.data(), n, D)) << "rows not in fours";
}
#endif

}  // namespace
