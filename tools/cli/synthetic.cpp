#include "synthetic.hpp"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "common.hpp"

namespace akvcli {

const char *const kSyntheticDataHelp = R"(Synthetic data (default, no --data): LLM-like K/V/Q generated in code, per layer.
  Prompt structure (shared by layers and heads): topic segments of geometric length (mean
  256, min 16) drawn from 24 recurring topics; token 0 is an attention sink; 0.5% of tokens
  are heavy hitters.
  Keys (pre-RoPE) = head mean + topic centroid + 4 slowly varying shared directions
  (AR(1), rho 0.995) + per-dimension AR(1) noise (rho 0.7: correlated neighbours) + 4
  outlier channels (2 low-frequency rotary pairs, large offset, 3x noise) + for the sink
  and heavy hitters a large component that after RoPE points along one per-head direction
  u. Topic and shared parts carry more energy in low-frequency rotary pairs.
  Values = head mean + topic centroid + shared directions + AR(1) noise (rho 0.5); the
  sink's value is near zero.
  Queries (post-RoPE) = a*u (sink logit about 9-11) + content + noise. "Local" queries
  point at the last segment(s), "recall" queries at one random earlier segment. Window
  queries are 75% local, held-out queries 60% recall, so held-out queries need parts of
  the prompt the window did not single out.
  RoPE: NeoX rotate-half, base --rope-base (10000). Deterministic for a given --seed.
)";

namespace {

constexpr int kTopics = 24;
constexpr double kSegmentMeanLength = 256.0;
constexpr int64_t kSegmentMinLength = 16;
constexpr double kHeavyHitterRate = 0.005;
constexpr int kSharedDirections = 4;
constexpr double kMagnetBeta = 30.0;  // size of the sink's magnet component in its key
constexpr double kQueryNoise = 0.8;

// Purposes keying independent random streams.
enum Purpose : uint64_t {
  kPurposeText = 1,
  kPurposeKeys = 2,
  kPurposeValues = 3,
  kPurposeQueries = 4,
  kPurposeHeavy = 5
};

// Parameters of one (layer, KV head) that queries need after the K/V are generated.
struct HeadModel {
  std::vector<double> magnet;     // unit, post-RoPE direction shared by sink and heavy hitters
  std::vector<double> centroids;  // [kTopics][D] key topic centroids (pre-RoPE)
};

// Spectral weight of dimension d: NeoX pair j = d mod D/2 has frequency base^(-2j/D); low
// frequencies (large j) carry the semantic energy.
double spectral_weight(int d, int head_dim) {
  const int half = head_dim / 2;
  const int pair = d % half;
  return half > 1 ? 0.25 + 0.75 * static_cast<double>(pair) / (half - 1) : 1.0;
}

// Dimensions of the lowest-frequency quarter of the rotary pairs.
std::vector<int> low_frequency_dims(int head_dim) {
  const int half = head_dim / 2;
  const int count = std::max(2, half / 4);
  std::vector<int> dims;
  for (int pair = half - count; pair < half; ++pair) {
    dims.push_back(pair);
    dims.push_back(pair + half);
  }
  return dims;
}

void normalize(std::vector<double> &x) {
  double norm = 0.0;
  for (double v : x) norm += v * v;
  norm = std::sqrt(norm);
  if (norm > 0.0)
    for (double &v : x) v /= norm;
}

// AR(1) process with marginal standard deviation `std`: x_t = rho x_{t-1} + sqrt(1-rho^2) std e.
struct Ar1 {
  double rho, innovation, value;
  Ar1(double rho_, double std, Rng &rng)
      : rho(rho_), innovation(std * std::sqrt(1.0 - rho_ * rho_)), value(std * rng.normal()) {}
  double step(Rng &rng) { return value = rho * value + innovation * rng.normal(); }
};

}  // namespace

SyntheticSource::SyntheticSource(const SyntheticConfig &config) : config_(config) {
  const EvalShape &s = config_.shape;
  if (s.head_dim < 4 || s.head_dim % 2 != 0)
    throw CliError("the synthetic generator needs an even head_dim >= 4", kExitUsage);
  positions_.rope.style = AKV_ROPE_NEOX;
  positions_.rope.base = config_.rope_base;
  positions_.keys_post_rope = false;

  // Text structure: segments with recurring topics, heavy hitters.
  Rng rng = Rng::keyed(config_.seed, kPurposeText);
  segment_of_token_.assign(static_cast<size_t>(s.seq_len), 0);
  int64_t begin = 0;
  while (begin < s.seq_len) {
    // Geometric length with the given mean, at least the minimum.
    const double u = std::max(rng.uniform(), 1e-12);
    int64_t length = kSegmentMinLength +
                     static_cast<int64_t>(-std::log(u) * (kSegmentMeanLength - kSegmentMinLength));
    const int64_t end = std::min(s.seq_len, begin + length);
    const int topic = static_cast<int>(rng.below(kTopics));
    for (int64_t t = begin; t < end; ++t) segment_of_token_[t] = static_cast<int>(segments_.size());
    segments_.push_back({begin, end, topic});
    begin = end;
  }
  heavy_hitter_.assign(static_cast<size_t>(s.seq_len), 0);
  for (int64_t t = 1; t < s.seq_len; ++t) heavy_hitter_[t] = rng.uniform() < kHeavyHitterRate;
}

std::string SyntheticSource::describe() const {
  std::ostringstream text;
  text << "synthetic LLM-like data (seed " << config_.seed << ", " << segments_.size()
       << " topic segments, " << std::count(heavy_hitter_.begin(), heavy_hitter_.end(), 1)
       << " heavy hitters, rope " << positions_.rope.describe(config_.shape.head_dim)
       << ", inputs " << dtype_label(config_.dtype) << ")";
  return text.str();
}

LayerTensors SyntheticSource::load(int layer) {
  const EvalShape &s = config_.shape;
  const int D = s.head_dim;
  const int64_t S = s.seq_len;
  const Rotary rotary(positions_.rope, D);
  const std::vector<int> low_dims = low_frequency_dims(D);
  std::vector<double> weight(D);
  for (int d = 0; d < D; ++d) weight[d] = spectral_weight(d, D);

  LayerTensors out;
  out.keys.resize(static_cast<size_t>(s.heads) * S * D);
  out.values.resize(out.keys.size());
  std::vector<HeadModel> models(s.heads);

  parallel_for(s.heads, config_.threads, [&](int64_t h) {
    HeadModel &model = models[h];
    // ---- keys ----
    Rng rng = Rng::keyed(config_.seed, kPurposeKeys, static_cast<uint64_t>(layer), h);
    std::vector<double> mean(D), offset(D, 0.0), noise_scale(D, 0.5);
    for (int d = 0; d < D; ++d) mean[d] = 0.5 * rng.normal();
    // Two outlier pairs among the low-frequency quarter.
    const int low_pairs = static_cast<int>(low_dims.size() / 2);
    const int first_pair = static_cast<int>(rng.below(low_pairs));
    const int second_pair = (first_pair + 1 + static_cast<int>(rng.below(low_pairs - 1))) % low_pairs;
    for (int pair : {first_pair, second_pair}) {
      for (int d : {low_dims[2 * pair], low_dims[2 * pair + 1]}) {
        offset[d] = (rng.uniform() < 0.5 ? -1.0 : 1.0) * (3.0 + 2.0 * rng.uniform());
        noise_scale[d] *= 3.0;
      }
    }
    model.centroids.resize(static_cast<size_t>(kTopics) * D);
    for (int c = 0; c < kTopics; ++c)
      for (int d = 0; d < D; ++d) model.centroids[c * D + d] = weight[d] * rng.normal();
    std::vector<double> shared(static_cast<size_t>(kSharedDirections) * D);
    for (int r = 0; r < kSharedDirections; ++r)
      for (int d = 0; d < D; ++d) shared[r * D + d] = 0.6 * weight[d] * rng.normal();
    model.magnet.assign(D, 0.0);
    for (int d : low_dims) model.magnet[d] = rng.normal();
    normalize(model.magnet);

    std::vector<Ar1> coefficients, noise;
    for (int r = 0; r < kSharedDirections; ++r) coefficients.emplace_back(0.995, 1.0, rng);
    for (int d = 0; d < D; ++d) noise.emplace_back(0.7, noise_scale[d], rng);
    Rng heavy_rng = Rng::keyed(config_.seed, kPurposeHeavy, static_cast<uint64_t>(layer), h);
    std::vector<double> key(D), magnet_pre(D);
    float *keys = out.keys.data() + static_cast<size_t>(h) * S * D;
    for (int64_t t = 0; t < S; ++t) {
      const double *centroid = &model.centroids[segments_[segment_of_token_[t]].topic * D];
      double a[kSharedDirections];
      for (int r = 0; r < kSharedDirections; ++r) a[r] = coefficients[r].step(rng);
      for (int d = 0; d < D; ++d) {
        double value = mean[d] + offset[d] + centroid[d] + noise[d].step(rng);
        for (int r = 0; r < kSharedDirections; ++r) value += a[r] * shared[r * D + d];
        key[d] = value;
      }
      double magnet_size = 0.0;
      if (t == 0) magnet_size = kMagnetBeta;
      else if (heavy_hitter_[t]) magnet_size = kMagnetBeta * (0.4 + 0.3 * heavy_rng.uniform());
      if (magnet_size > 0.0) {
        // Pre-RoPE component R(-t) u, so that after RoPE it is exactly u.
        magnet_pre = model.magnet;
        rotary.apply(magnet_pre.data(), static_cast<double>(t), /*inverse=*/true);
        for (int d = 0; d < D; ++d) key[d] += magnet_size * magnet_pre[d];
      }
      for (int d = 0; d < D; ++d) keys[t * D + d] = static_cast<float>(key[d]);
    }

    // ---- values ----
    Rng vrng = Rng::keyed(config_.seed, kPurposeValues, static_cast<uint64_t>(layer), h);
    std::vector<double> vmean(D), vcentroids(static_cast<size_t>(kTopics) * D),
        vshared(static_cast<size_t>(kSharedDirections) * D);
    for (int d = 0; d < D; ++d) vmean[d] = 0.3 * vrng.normal();
    for (double &v : vcentroids) v = 0.8 * vrng.normal();
    for (double &v : vshared) v = 0.5 * vrng.normal();
    std::vector<Ar1> vcoefficients, vnoise;
    for (int r = 0; r < kSharedDirections; ++r) vcoefficients.emplace_back(0.995, 1.0, vrng);
    for (int d = 0; d < D; ++d) vnoise.emplace_back(0.5, 0.6, vrng);
    float *values = out.values.data() + static_cast<size_t>(h) * S * D;
    for (int64_t t = 0; t < S; ++t) {
      const double *centroid = &vcentroids[segments_[segment_of_token_[t]].topic * D];
      double a[kSharedDirections];
      for (int r = 0; r < kSharedDirections; ++r) a[r] = vcoefficients[r].step(vrng);
      const double sink_scale = t == 0 ? 0.1 : 1.0;
      for (int d = 0; d < D; ++d) {
        double value = vmean[d] + centroid[d] + vnoise[d].step(vrng);
        for (int r = 0; r < kSharedDirections; ++r) value += a[r] * vshared[r * D + d];
        values[t * D + d] = static_cast<float>(sink_scale * value);
      }
    }
  });

  // ---- queries (post-RoPE) ----
  const int G = s.group();
  const int64_t segment_count = static_cast<int64_t>(segments_.size());
  out.q_window.resize(static_cast<size_t>(s.q_heads) * s.window * D);
  out.q_future.resize(static_cast<size_t>(s.q_heads) * s.future * D);
  // Post-RoPE unit direction of a segment's key centroid at the segment's middle.
  auto segment_direction = [&](const HeadModel &model, int64_t segment, std::vector<double> &dir) {
    const Segment &seg = segments_[segment];
    dir.assign(model.centroids.begin() + seg.topic * D, model.centroids.begin() + (seg.topic + 1) * D);
    rotary.apply(dir.data(), 0.5 * static_cast<double>(seg.begin + seg.end - 1));
    normalize(dir);
  };
  const double sqrt_d = std::sqrt(static_cast<double>(D));
  parallel_for(s.q_heads, config_.threads, [&](int64_t qh) {
    const HeadModel &model = models[qh / G];
    Rng rng = Rng::keyed(config_.seed, kPurposeQueries, static_cast<uint64_t>(layer), qh);
    const double sink_logit = 9.0 + 2.0 * rng.uniform();
    // Typical norm of a centroid, to turn a target logit into a query length.
    double centroid_norm = 0.0;
    for (int d = 0; d < D; ++d) centroid_norm += weight[d] * weight[d];
    centroid_norm = std::sqrt(centroid_norm);
    std::vector<double> q(D), dir;
    auto make_query = [&](double recall_probability, float *dst) {
      for (int d = 0; d < D; ++d) q[d] = kQueryNoise * rng.normal() +
                                         sink_logit * sqrt_d / kMagnetBeta * model.magnet[d];
      auto add_target = [&](int64_t segment, double logit) {
        segment_direction(model, segment, dir);
        for (int d = 0; d < D; ++d) q[d] += logit * sqrt_d / centroid_norm * dir[d];
      };
      if (rng.uniform() < recall_probability && segment_count > 2) {
        add_target(rng.below(segment_count - 2), 5.5 + rng.uniform());
      } else {
        add_target(segment_count - 1, 4.5 + rng.uniform());
        if (segment_count > 1) add_target(segment_count - 2, 2.5 + rng.uniform());
      }
      for (int d = 0; d < D; ++d) dst[d] = static_cast<float>(q[d]);
    };
    for (int w = 0; w < s.window; ++w)
      make_query(0.25, out.q_window.data() + (static_cast<size_t>(qh) * s.window + w) * D);
    for (int f = 0; f < s.future; ++f)
      make_query(0.6, out.q_future.data() + (static_cast<size_t>(qh) * s.future + f) * D);
  });

  round_to_dtype(out.keys, config_.dtype);
  round_to_dtype(out.values, config_.dtype);
  round_to_dtype(out.q_window, config_.dtype);
  round_to_dtype(out.q_future, config_.dtype);
  return out;
}

}  // namespace akvcli
