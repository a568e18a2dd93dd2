// Synthetic LLM-like K/V/Q, generated in code (the default data of `anchorkv eval`).
//
// The generator (documented for users in kSyntheticDataHelp, printed by `eval --help`):
//
// Text structure, shared by every layer and head (it is a property of the prompt):
//   - the prompt is cut into topic segments of geometric length (mean 256 tokens, at least
//     16); each segment draws one of 24 topics, so topics recur far apart;
//   - token 0 is the attention sink; 0.5% of the other tokens are "heavy hitters"
//     (delimiter-like tokens that many heads attend to).
// Keys of one (layer, KV head), pre-RoPE, per token t:
//     k_t = mu_k + T[topic(t)] + sum_r a_r(t) B_r + n_t + outliers + magnet(t)
//   - mu_k: head mean, N(0, 0.5^2) per dimension;
//   - T[c]: topic centroids; B_r: 4 shared directions with slowly varying coefficients
//     a_r(t), AR(1) over tokens with rho = 0.995. Both carry more energy in low-frequency
//     rotary pairs (weight 0.25 at the highest to 1.0 at the lowest frequency), where real
//     models keep their semantic matching;
//   - n_t: per-dimension AR(1) noise over tokens (rho = 0.7, std 0.5): correlated neighbours;
//   - outliers: 2 low-frequency rotary pairs (4 channels) with a large per-head offset
//     (|3..5|) and 3x the noise, like the outlier channels of real keys;
//   - magnet(t): the sink and the heavy hitters add beta * R(-t) u, where u is a per-head
//     unit direction in the low-frequency pairs, so that after RoPE all of them share the
//     direction u that every query partly points at (sink beta = 30, heavy hitters
//     beta = 30 * U(0.4, 0.7)).
// Values: v_t = mu_v + U[topic(t)] + sum_r a'_r(t) C_r + m_t (AR(1) noise rho = 0.5), and the
// sink's value is scaled by 0.1 (sinks carry near-zero values in real models).
// Queries (post-RoPE, positions S-W.. for the window, S.. for the held-out ones), per query
// head and position:  q = a u + content + noise(0.8 per dimension), where a puts the sink
// near logit 9-11 and content points at the post-RoPE centroid of chosen segments:
//   - "local" queries: the last prompt segment (logit about 5) and the one before (about 3);
//   - "recall" queries: one random earlier segment (logit about 6).
// Window queries are 75% local / 25% recall; held-out queries 40% local / 60% recall, so the
// held-out queries look at parts of the prompt the window did not single out.
// RoPE: NeoX rotate-half, base --rope-base (10000), full head_dim. Keys are handed to the
// library pre-RoPE. Deterministic for a seed, independent of the thread count.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "layer_source.hpp"

namespace akvcli {

extern const char *const kSyntheticDataHelp;

struct SyntheticConfig {
  EvalShape shape;
  uint64_t seed = 1;
  double rope_base = 10000.0;
  akv_dtype dtype = AKV_DTYPE_F32;  // inputs rounded to this and handed over in it
  int threads = 0;
};

class SyntheticSource : public LayerSource {
 public:
  explicit SyntheticSource(const SyntheticConfig &config);

  const EvalShape &shape() const override { return config_.shape; }
  const PositionConfig &positions() const override { return positions_; }
  akv_dtype input_dtype() const override { return config_.dtype; }
  std::string describe() const override;
  LayerTensors load(int layer) override;

 private:
  struct Segment {
    int64_t begin, end;  // [begin, end)
    int topic;
  };
  SyntheticConfig config_;
  PositionConfig positions_;
  std::vector<Segment> segments_;
  std::vector<int> segment_of_token_;
  std::vector<uint8_t> heavy_hitter_;  // per token
};

}  // namespace akvcli
