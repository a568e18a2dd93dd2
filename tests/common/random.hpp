// Random test data with a fresh seed per test (print it with SCOPED_TRACE so a failure can be
// replayed: AKV_TEST_SEED=<seed> reruns with that seed).
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

namespace akv_test {

// A new seed on every call unless AKV_TEST_SEED is set (then that seed, to replay a failure).
inline uint64_t fresh_seed() {
  if (const char *fixed = std::getenv("AKV_TEST_SEED"); fixed != nullptr && *fixed != '\0')
    return std::strtoull(fixed, nullptr, 0);
  std::random_device device;
  const uint64_t entropy = (static_cast<uint64_t>(device()) << 32) ^ device();
  const uint64_t clock =
      static_cast<uint64_t>(std::chrono::high_resolution_clock::now().time_since_epoch().count());
  return entropy ^ (clock * 0x9E3779B97F4A7C15ull);
}

inline std::string seed_note(uint64_t seed) {
  return "random seed " + std::to_string(seed) + " (replay: AKV_TEST_SEED=" + std::to_string(seed) +
         ")";
}

class Rng {
 public:
  explicit Rng(uint64_t seed) : engine_(seed) {}

  double normal(double mean = 0.0, double stddev = 1.0) {
    return std::normal_distribution<double>(mean, stddev)(engine_);
  }
  double uniform(double low, double high) {
    return std::uniform_real_distribution<double>(low, high)(engine_);
  }
  int64_t uniform_int(int64_t low, int64_t high) {  // inclusive
    return std::uniform_int_distribution<int64_t>(low, high)(engine_);
  }
  uint64_t next() { return engine_(); }

  std::vector<float> normal_vector(size_t count, double stddev = 1.0) {
    std::vector<float> out(count);
    for (float &x : out) x = static_cast<float>(normal(0.0, stddev));
    return out;
  }

 private:
  std::mt19937_64 engine_;
};

// LLM-flavoured keys [heads][tokens][dim]: Gaussian plus a per-head mean direction (keys of a
// head share a bias in real models) and a few outlier channels. Never a zero row.
inline std::vector<float> llm_like_keys(Rng &rng, int heads, int64_t tokens, int dim) {
  std::vector<float> keys(static_cast<size_t>(heads) * tokens * dim);
  for (int h = 0; h < heads; ++h) {
    std::vector<double> bias(dim), channel_scale(dim, 1.0);
    for (int d = 0; d < dim; ++d) bias[d] = rng.normal(0.0, 0.6);
    for (int outlier = 0; outlier < 2; ++outlier)
      channel_scale[static_cast<size_t>(rng.uniform_int(0, dim - 1))] = 4.0;
    for (int64_t t = 0; t < tokens; ++t)
      for (int d = 0; d < dim; ++d)
        keys[(static_cast<size_t>(h) * tokens + t) * dim + d] =
            static_cast<float>(channel_scale[d] * (bias[d] + rng.normal()));
  }
  return keys;
}

// Rows are made non-zero with overwhelming probability; guard anyway so "non-zero data" holds.
inline std::vector<float> nonzero_normal(Rng &rng, size_t count, double stddev = 1.0) {
  std::vector<float> out = rng.normal_vector(count, stddev);
  for (float &x : out)
    if (x == 0.0f) x = static_cast<float>(stddev * 0.5);
  return out;
}

// Strictly increasing positions starting at `start`, with gaps of 1..max_gap.
inline std::vector<int32_t> gapped_positions(Rng &rng, int64_t count, int32_t start, int max_gap) {
  std::vector<int32_t> positions(static_cast<size_t>(count));
  int32_t position = start;
  for (int64_t i = 0; i < count; ++i) {
    positions[static_cast<size_t>(i)] = position;
    position += static_cast<int32_t>(rng.uniform_int(1, max_gap));
  }
  return positions;
}

}  // namespace akv_test
