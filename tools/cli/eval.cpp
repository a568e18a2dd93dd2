// `anchorkv eval`: compares every method against exact attention.
//
// Per layer: load (or generate) K/V/Q, plant needles, compute the exact reference in double
// precision from the uncompressed post-RoPE keys, then for every method row compress the
// layer through akv_compress, decode the held-out queries and the needle probes through
// akv_decode, and compare. Metrics (all against the exact reference):
//  - fidelity: per (layer, query head) cell, the mean over the F held-out queries of
//    cos(decode output, exact output); the table gives the mean over cells, the 1st
//    percentile and the share of cells below 0.9 (paper App. D.1);
//  - reach: needles planted at spread depths; a needle is reached when the decode output of
//    its probe query has cos(out, v_needle) >= --reach-threshold (0.9).
#include <cxxopts.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <sstream>

#include "commands.hpp"
#include "common.hpp"
#include "methods.hpp"
#include "reference.hpp"
#include "rope.hpp"
#include "safetensors.hpp"
#include "synthetic.hpp"

namespace akvcli {
namespace {

const char *const kNeedleHelp = R"(Needles (reach): per KV head, --needles tokens at depths spread evenly over the prompt
  (jittered, never the window or the first 4 tokens) get a random key direction of the
  head's median key norm and a distinctive value (orthogonal to the mean value, 1.5x the
  median value norm). A needle is kept only if the observation window does not single it
  out: its window-attention score (mean softmax weight over the window rows of its query
  group) must be at most the median score of the head. Each needle gets a probe query along
  its post-RoPE key, scaled so that exact attention puts 95% of its weight on the needle.
  Probes are decoded like any query; a needle is reached when cos(probe output, needle
  value) >= --reach-threshold (default 0.9). Exact attention reaches every needle by
  construction (printed as a self-check).
Fidelity: held-out queries (F per query head, never part of the window) are decoded with
  q_len 1 over each method's cache; per (layer, query head) cell the mean over them of
  cos(output, exact output). Exact = double-precision softmax attention over the
  uncompressed post-RoPE keys. Columns: mean over cells, 1st percentile, share of cells
  below 0.9. FullKV should be ~1.0 (bf16/fp16 storage rounding only).
Ratios: target = 1/retain_fraction; measured = M_full / compressed bytes from
  akv_cache_stats (all layers). Quantized runs once at its default bits (target "-": its
  ratio follows from the bits). Times: compress per layer (mean), decode per call (median,
  one query per head, all Hq heads), and decode time relative to FullKV.
Methods: each starts from its paper defaults (akv_compress_options_init_method); methods
  that score with window queries get the last min(default window, W) window queries.
  Quantized is 3 bits + 4 outlier channels (the paper's TurboQuant). A method that fails
  (e.g. AKV_ERR_BUDGET) is shown with the library's message and makes the exit status 1.
  Default methods: )";

struct EvalSettings {
  std::string methods;
  std::vector<double> fractions;
  int needles_per_head = 8;
  double reach_threshold = 0.9;
  double needle_weight = 0.95;  // exact-attention weight of a probe on its needle
  int threads = 0;
  uint64_t seed = 1;
  bool quiet = false, csv = false, json = false, check = false;
  bool verify_decode = false;  // also compare decode with attention over akv_cache_reconstruct
};

struct Needle {
  int layer = 0, head = 0, index = 0;
  int64_t position = -1;     // -1: could not be planted
  double window_quantile = 0;  // share of the head's tokens with a lower window score
  double exact_weight = 0;     // exact attention weight of the probe on the needle
  double exact_cosine = 0;     // cos(exact probe output, needle value)
  std::vector<double> value;
};

struct PreparedLayer {
  LayerTensors tensors;               // needles planted, rounded to the input dtype
  std::vector<double> exact_future;   // [Hq][F][D]
  int probe_calls = 0;
  std::vector<float> probes;          // [probe_calls][Hq][D]
  std::vector<Needle> needles;        // [H][needles_per_head]
  AttentionProfile profile;           // exact attention of the held-out queries
};

struct Row {
  explicit Row(const MethodRun &run_) : run(run_) {}
  MethodRun run;
  std::string error;                  // non-empty: the method failed (reason)
  double compress_seconds = 0.0;      // summed over layers
  std::vector<double> decode_seconds; // every decode call
  uint64_t full_bytes = 0, compressed_bytes = 0, budget_bytes = 0;
  std::vector<double> layer_ratios;   // akv_cache_stats.ratio per layer
  int64_t key_residuals = 0, value_residuals = 0;
  std::vector<double> cell_cosines;   // [layer][Hq]
  std::vector<double> query_cosines;  // [layer][Hq][F], for --cells-csv
  std::vector<double> needle_cosines; // per planted needle, in the JSON needle_list order
  std::vector<double> self_cosines;   // --verify-decode: cos(decode, attention over reconstruction)
  int window = 0;                     // observation window the method used
  int layers_done = 0;

  bool failed() const { return !error.empty(); }
  double ratio() const {
    return compressed_bytes ? static_cast<double>(full_bytes) / compressed_bytes : std::nan("");
  }
  double decode_median() const { return median(decode_seconds); }
  int64_t reached(double threshold) const {
    return std::count_if(needle_cosines.begin(), needle_cosines.end(),
                         [&](double c) { return c >= threshold; });
  }
};

class Progress {
 public:
  explicit Progress(bool quiet) : quiet_(quiet) {}
  template <typename... Parts>
  void say(const Parts &...parts) const {
    if (quiet_) return;
    std::ostringstream line;
    line << "anchorkv eval: ";
    (line << ... << parts);
    std::cerr << line.str() << std::endl;
  }

 private:
  bool quiet_;
};

// ---- preparing one layer: needles and the exact reference ----------------------------------

struct HeadWork {
  std::vector<double> keys;    // [S][D] post-RoPE, double
  std::vector<double> values;  // [S][D]
};

void plant_needles_for_head(int layer, int h, const EvalShape &s, const PositionConfig &pc,
                            const Rotary &rotary, akv_dtype dtype, const EvalSettings &settings,
                            HeadWork &work, PreparedLayer &prep) {
  const int D = s.head_dim, G = s.group(), W = s.window;
  const int64_t S = s.seq_len, evictable = S - W;
  const double scale = pc.scale(D);
  const int n = settings.needles_per_head;
  std::vector<double> window_queries(static_cast<size_t>(G) * W * D);
  for (int g = 0; g < G; ++g)
    for (int64_t i = 0; i < static_cast<int64_t>(W) * D; ++i)
      window_queries[g * W * D + i] = prep.tensors.q_window[(static_cast<int64_t>(h) * G + g) * W * D + i];
  WindowAttention window = window_attention(work.keys.data(), S, D, window_queries.data(), G, W, scale);
  const int rows = G * W;

  std::vector<double> key_norms(evictable), value_norms(evictable), mean_value(D, 0.0);
  for (int64_t t = 0; t < evictable; ++t) {
    key_norms[t] = std::sqrt(dot(&work.keys[t * D], &work.keys[t * D], D));
    value_norms[t] = std::sqrt(dot(&work.values[t * D], &work.values[t * D], D));
    for (int d = 0; d < D; ++d) mean_value[d] += work.values[t * D + d] / evictable;
  }
  const double key_norm = std::max(median(key_norms), 1e-3);
  const double value_norm = std::max(median(value_norms), 1e-3);
  const double mean_value_norm = std::sqrt(dot(mean_value.data(), mean_value.data(), D));

  Rng rng = Rng::keyed(settings.seed, 0x6e656564ull /* "need" */, static_cast<uint64_t>(layer), h);
  const double spacing = static_cast<double>(evictable - 4) / n;
  std::set<int64_t> taken;
  std::vector<double> direction(D), key_post(D), logits(rows);
  std::vector<float> stored(D);
  for (int i = 0; i < n; ++i) {
    Needle &needle = prep.needles[static_cast<size_t>(h) * n + i];
    needle.layer = layer;
    needle.head = h;
    needle.index = i;
    int64_t p = 4 + static_cast<int64_t>((i + 0.5 + 0.6 * (rng.uniform() - 0.5)) * spacing);
    p = std::min(std::max<int64_t>(p, 4), evictable - 1);
    while (taken.count(p)) p = p + 1 < evictable ? p + 1 : 4;
    const double position = static_cast<double>(pc.position_offset + p);

    for (int attempt = 0; attempt < 64 && needle.position < 0; ++attempt) {
      for (int d = 0; d < D; ++d) direction[d] = rng.normal();
      const double norm = std::sqrt(dot(direction.data(), direction.data(), D));
      // The key as the library receives it (pre-RoPE unless keys_post_rope), rounded to the
      // input dtype; the reference then uses exactly that key.
      for (int d = 0; d < D; ++d) stored[d] = static_cast<float>(direction[d] / norm * key_norm);
      if (!pc.keys_post_rope) rotary.apply(stored.data(), position, /*inverse=*/true);
      std::vector<float> rounded(stored.begin(), stored.end());
      round_to_dtype(rounded, dtype);
      for (int d = 0; d < D; ++d) key_post[d] = rounded[d];
      if (!pc.keys_post_rope) rotary.apply(key_post.data(), position);

      // Window score with the needle in place of token p: must not stand out.
      double score = 0.0;
      for (int r = 0; r < rows; ++r) {
        const double *q = &window_queries[static_cast<size_t>(r) * D];
        const double old_logit = scale * dot(q, &work.keys[p * D], D);
        logits[r] = scale * dot(q, key_post.data(), D);
        const double lse = window.row_lse[r];
        const double rest = std::max(1.0 - std::exp(old_logit - lse), 1e-300);
        const double new_lse = lse + std::log(rest + std::exp(logits[r] - lse));
        score += std::exp(logits[r] - new_lse) / rows;
      }
      if (score > window.median_score) continue;

      // Probe along the needle's post-RoPE key: lambda such that exact attention puts
      // `needle_weight` on the needle, i.e. sum_{t != p} exp(lambda (z_t - z_p)) = (1-w)/w.
      const double key_length = std::sqrt(dot(key_post.data(), key_post.data(), D));
      if (key_length <= 0.0) continue;
      std::vector<double> gaps;
      gaps.reserve(S);
      const double z_needle = scale * key_length;
      bool separable = true;
      for (int64_t t = 0; t < S && separable; ++t) {
        if (t == p) continue;
        const double z = scale * dot(key_post.data(), &work.keys[t * D], D) / key_length;
        gaps.push_back(z - z_needle);
        if (z >= z_needle) separable = false;
      }
      if (!separable) continue;
      const double target = (1.0 - settings.needle_weight) / settings.needle_weight;
      auto mass = [](const std::vector<double> &terms, double lambda) {
        double sum = 0.0;
        for (double gap : terms) sum += std::exp(lambda * gap);
        return sum;
      };
      double high = 1.0;
      while (mass(gaps, high) > target && high < 1e6) high *= 2.0;
      if (mass(gaps, high) > target) continue;
      // The answer lies in [high/2, high]; gaps whose term is below e^-60 there do not count.
      double low = high > 1.0 ? 0.5 * high : 0.0;
      if (low > 0.0)
        gaps.erase(std::remove_if(gaps.begin(), gaps.end(), [&](double gap) { return low * gap < -60.0; }),
                   gaps.end());
      for (int iteration = 0; iteration < 50; ++iteration) {
        const double mid = 0.5 * (low + high);
        (mass(gaps, mid) > target ? low : high) = mid;
      }
      const double lambda = high;

      // Accept: write the key, a distinctive value and the probe.
      needle.position = p;
      taken.insert(p);
      float *key_dst = &prep.tensors.keys[(static_cast<size_t>(h) * S + p) * D];
      std::copy(rounded.begin(), rounded.end(), key_dst);
      for (int r = 0; r < rows; ++r) {
        const double lse = window.row_lse[r];
        const double old_logit = scale * dot(&window_queries[static_cast<size_t>(r) * D], &work.keys[p * D], D);
        const double rest = std::max(1.0 - std::exp(old_logit - lse), 1e-300);
        window.row_lse[r] = lse + std::log(rest + std::exp(logits[r] - lse));
      }
      std::copy(key_post.begin(), key_post.end(), work.keys.begin() + p * D);
      int64_t below = 0;
      for (int64_t t = 0; t < evictable; ++t) below += window.score[t] < score;
      needle.window_quantile = static_cast<double>(below) / evictable;

      std::vector<float> value(D);
      for (int d = 0; d < D; ++d) direction[d] = rng.normal();
      if (mean_value_norm > 0.0) {
        const double along = dot(direction.data(), mean_value.data(), D) / (mean_value_norm * mean_value_norm);
        for (int d = 0; d < D; ++d) direction[d] -= along * mean_value[d];
      }
      const double direction_norm = std::sqrt(dot(direction.data(), direction.data(), D));
      for (int d = 0; d < D; ++d) value[d] = static_cast<float>(direction[d] / direction_norm * 1.5 * value_norm);
      round_to_dtype(value, dtype);
      std::copy(value.begin(), value.end(), &prep.tensors.values[(static_cast<size_t>(h) * S + p) * D]);
      needle.value.assign(value.begin(), value.end());
      std::copy(needle.value.begin(), needle.value.end(), work.values.begin() + p * D);

      const int call = i / G, slot = h * G + i % G;
      float *probe = &prep.probes[(static_cast<size_t>(call) * s.q_heads + slot) * D];
      for (int d = 0; d < D; ++d) probe[d] = static_cast<float>(lambda * key_post[d] / key_length);
    }
  }
}

PreparedLayer prepare_layer(LayerSource &source, int layer, const EvalSettings &settings,
                            int *unplaced_needles) {
  const EvalShape &s = source.shape();
  const PositionConfig &pc = source.positions();
  const int D = s.head_dim, G = s.group(), F = s.future;
  const int64_t S = s.seq_len;
  PreparedLayer prep;
  prep.tensors = source.load(layer);
  const Rotary rotary(pc.rope, D);
  const RotaryTable rotary_table(rotary, pc.position_offset, rotary.enabled() ? S : 0);
  const double scale = pc.scale(D);

  int n = settings.needles_per_head;
  if (S - s.window < 4 + 4 * static_cast<int64_t>(n)) n = 0;  // prompt too short for needles
  prep.probe_calls = n > 0 ? (n + G - 1) / G : 0;
  prep.probes.assign(static_cast<size_t>(prep.probe_calls) * s.q_heads * D, 0.0f);
  // Slots without a needle of their own decode an ordinary held-out query.
  for (int call = 0; call < prep.probe_calls; ++call)
    for (int qh = 0; qh < s.q_heads; ++qh)
      std::copy_n(&prep.tensors.q_future[static_cast<size_t>(qh) * F * D], D,
                  &prep.probes[(static_cast<size_t>(call) * s.q_heads + qh) * D]);
  prep.needles.resize(static_cast<size_t>(s.heads) * n);
  prep.exact_future.assign(static_cast<size_t>(s.q_heads) * F * D, 0.0);
  std::vector<AttentionProfile> profiles(s.heads);
  EvalSettings head_settings = settings;
  head_settings.needles_per_head = n;

  parallel_for(s.heads, settings.threads, [&](int64_t h) {
    HeadWork work;
    work.keys.resize(static_cast<size_t>(S) * D);
    work.values.resize(static_cast<size_t>(S) * D);
    const float *keys = &prep.tensors.keys[static_cast<size_t>(h) * S * D];
    const float *values = &prep.tensors.values[static_cast<size_t>(h) * S * D];
    for (int64_t t = 0; t < S; ++t) {
      double *key = &work.keys[t * D];
      for (int d = 0; d < D; ++d) key[d] = keys[t * D + d];
      if (!pc.keys_post_rope && rotary.enabled()) rotary_table.apply(key, t);
      for (int d = 0; d < D; ++d) work.values[t * D + d] = values[t * D + d];
    }
    if (n > 0)
      plant_needles_for_head(layer, static_cast<int>(h), s, pc, rotary, source.input_dtype(),
                             head_settings, work, prep);

    // Exact outputs of the held-out queries of the head's query group.
    std::vector<double> queries(static_cast<size_t>(G) * F * D), out(queries.size());
    for (size_t i = 0; i < queries.size(); ++i)
      queries[i] = prep.tensors.q_future[static_cast<size_t>(h) * G * F * D + i];
    exact_attention(work.keys.data(), work.values.data(), S, D, queries.data(), G * F, scale,
                    out.data(), &profiles[h]);
    std::copy(out.begin(), out.end(), prep.exact_future.begin() + static_cast<size_t>(h) * G * F * D);

    // Exact outputs of the probes: self-check that every planted needle is reachable.
    for (int i = 0; i < n; ++i) {
      Needle &needle = prep.needles[static_cast<size_t>(h) * n + i];
      if (needle.position < 0) continue;
      const int call = i / G, slot = static_cast<int>(h) * G + i % G;
      std::vector<double> probe(&prep.probes[(static_cast<size_t>(call) * s.q_heads + slot) * D],
                                &prep.probes[(static_cast<size_t>(call) * s.q_heads + slot) * D] + D);
      std::vector<double> probe_out(D), weights;
      exact_attention(work.keys.data(), work.values.data(), S, D, probe.data(), 1, scale,
                      probe_out.data(), nullptr, &weights);
      needle.exact_weight = weights[needle.position];
      needle.exact_cosine = cosine(probe_out.data(), needle.value.data(), D);
    }
  });
  for (const AttentionProfile &profile : profiles) prep.profile.merge(profile);
  for (const Needle &needle : prep.needles) *unplaced_needles += needle.position < 0;
  return prep;
}

// ---- running one method on one layer ----------------------------------------------------------

struct LibraryInputs {
  std::vector<uint8_t> keys, values, q_window;
  std::vector<int32_t> positions;  // empty: 0..S-1
};

// Appends a library inconsistency (reported once per method and kind).
class Anomalies {
 public:
  void add(const std::string &method, const std::string &text) {
    if (seen_.insert(method + ": " + text.substr(0, text.find(':'))).second)
      list_.push_back(method + ": " + text);
  }
  const std::vector<std::string> &list() const { return list_; }

 private:
  std::set<std::string> seen_;
  std::vector<std::string> list_;
};

// --verify-decode: akv_decode must equal attention over the cache's own reconstruction
// (akv_cache_reconstruct, post-RoPE keys, tokens the method keeps). A gap here is a decode
// bug, independent of how good the compression is.
void verify_decode(const akv_cache *cache, const EvalShape &s, const PreparedLayer &prep,
                   const std::vector<float> &decoded, double scale, const std::string &label,
                   const EvalSettings &settings, Row &row, Anomalies &anomalies) {
  const int D = s.head_dim, G = s.group(), F = s.future, Hq = s.q_heads;
  const int64_t S = s.seq_len;
  std::vector<float> keys(static_cast<size_t>(s.heads) * S * D), values(keys.size());
  std::vector<uint8_t> present(static_cast<size_t>(s.heads) * S);
  check(akv_cache_reconstruct(cache, AKV_DTYPE_F32, 1, keys.data(), values.data(), present.data(), nullptr),
        label + ": akv_cache_reconstruct");
  std::vector<double> head_min(s.heads, 1.0), head_sum(s.heads, 0.0);
  parallel_for(s.heads, settings.threads, [&](int64_t h) {
    std::vector<double> k, v;
    for (int64_t t = 0; t < S; ++t) {
      if (!present[static_cast<size_t>(h) * S + t]) continue;
      k.insert(k.end(), &keys[(static_cast<size_t>(h) * S + t) * D], &keys[(static_cast<size_t>(h) * S + t) * D] + D);
      v.insert(v.end(), &values[(static_cast<size_t>(h) * S + t) * D], &values[(static_cast<size_t>(h) * S + t) * D] + D);
    }
    const int64_t kept = static_cast<int64_t>(k.size() / D);
    std::vector<double> queries(static_cast<size_t>(G) * F * D), out(queries.size());
    for (size_t i = 0; i < queries.size(); ++i) queries[i] = prep.tensors.q_future[static_cast<size_t>(h) * G * F * D + i];
    exact_attention(k.data(), v.data(), kept, D, queries.data(), G * F, scale, out.data());
    for (int g = 0; g < G; ++g)
      for (int f = 0; f < F; ++f) {
        const int qh = static_cast<int>(h) * G + g;
        const double c = cosine(&decoded[(static_cast<size_t>(f) * Hq + qh) * D], &out[(static_cast<size_t>(g) * F + f) * D], D);
        head_min[h] = std::min(head_min[h], c);
        head_sum[h] += c / (G * F);
      }
  });
  double worst = 1.0;
  for (int h = 0; h < s.heads; ++h) {
    worst = std::min(worst, head_min[h]);
    row.self_cosines.push_back(head_sum[h]);
  }
  if (worst < 0.999)
    anomalies.add(label, "decode vs attention over akv_cache_reconstruct: worst cosine " + format_fixed(worst, 6) +
                             " (< 0.999)");
}

void run_layer(akv_context *context, const EvalShape &s, const PositionConfig &pc, akv_dtype dtype,
               int layer, const PreparedLayer &prep, const LibraryInputs &inputs,
               const EvalSettings &settings, Row &row, Anomalies &anomalies) {
  const int D = s.head_dim, F = s.future, Hq = s.q_heads;
  const std::string label = std::string(row.run.entry->name) + " " + row.run.target_label();

  akv_compress_options options = method_options(row.run, s.window, layer, s.layers);
  row.window = options.window;
  options.rope = pc.rope.to_library();
  options.keys_post_rope = pc.keys_post_rope ? 1 : 0;
  options.softmax_scale = static_cast<float>(pc.softmax_scale);

  akv_shape shape{s.seq_len, s.heads, s.q_heads, s.head_dim};
  akv_prefill prefill;
  akv_prefill_init(&prefill);
  prefill.shape = shape;
  prefill.dtype = dtype;
  prefill.keys = inputs.keys.data();
  prefill.values = inputs.values.data();
  if (row.run.entry->uses_window_queries) {
    // The method's window: the last options.window of the data's window queries.
    const size_t element = dtype_bytes(dtype);
    prefill.queries = inputs.q_window.data() + static_cast<size_t>(s.window - options.window) * D * element;
    prefill.q_head_stride = static_cast<int64_t>(s.window) * D;
  }
  prefill.positions = inputs.positions.empty() ? nullptr : inputs.positions.data();

  size_t predicted_bytes = 0;
  check(akv_compressed_size(&options, &shape, &predicted_bytes), label + ": akv_compressed_size");
  akv_cache *raw = nullptr;
  Stopwatch compress_clock;
  check(akv_compress(context, &prefill, &options, &raw, nullptr), label + ": akv_compress");
  row.compress_seconds += compress_clock.seconds();
  CacheHandle cache(raw);

  akv_cache_stats stats{};
  stats.struct_size = sizeof stats;
  check(akv_cache_stats_get(cache.get(), &stats), label + ": akv_cache_stats_get");
  const uint64_t full = 4ull * static_cast<uint64_t>(s.seq_len) * s.heads * D;
  const uint64_t budget = static_cast<uint64_t>(std::floor(row.run.retain_fraction * static_cast<double>(full)));
  if (stats.method != options.method) anomalies.add(label, "stats.method differs from the requested method");
  if (stats.full_bytes != full)
    anomalies.add(label, "stats.full_bytes: " + std::to_string(stats.full_bytes) + ", 4*S*H*D = " + std::to_string(full));
  if (stats.compressed_bytes != predicted_bytes)
    anomalies.add(label, "compressed_bytes vs akv_compressed_size: " + std::to_string(stats.compressed_bytes) +
                             " != " + std::to_string(predicted_bytes));
  // PyramidKV may exceed the budget in one layer (the layers average it): checked over all
  // layers at the end.
  if (stats.compressed_bytes > budget && options.method != AKV_METHOD_PYRAMIDKV)
    anomalies.add(label, "footprint over budget: compressed_bytes " + std::to_string(stats.compressed_bytes) +
                             " > theta*M_full " + std::to_string(budget));
  if (stats.compressed_bytes > 0 &&
      std::fabs(stats.ratio - static_cast<double>(stats.full_bytes) / stats.compressed_bytes) > 1e-9 * stats.ratio)
    anomalies.add(label, "stats.ratio: " + std::to_string(stats.ratio) + " is not full_bytes/compressed_bytes");
  row.full_bytes += stats.full_bytes;
  row.compressed_bytes += stats.compressed_bytes;
  row.budget_bytes += stats.budget_bytes;
  row.layer_ratios.push_back(stats.ratio);
  row.key_residuals += stats.key_residuals;
  row.value_residuals += stats.value_residuals;

  // Held-out queries, one position at a time (q_len 1: each sees the whole prompt).
  std::vector<float> query(static_cast<size_t>(Hq) * D), out(query.size());
  std::vector<double> cosines(static_cast<size_t>(Hq) * F);
  std::vector<float> decoded;  // [F][Hq][D], kept for --verify-decode
  auto decode = [&](const std::string &what) {
    Stopwatch clock;
    check(akv_decode(cache.get(), query.data(), AKV_DTYPE_F32, 1, out.data(), nullptr), label + ": akv_decode (" + what + ")");
    row.decode_seconds.push_back(clock.seconds());
    for (float v : out)
      if (!std::isfinite(v)) {
        anomalies.add(label, "akv_decode: non-finite output");
        break;
      }
  };
  for (int f = 0; f < F; ++f) {
    for (int qh = 0; qh < Hq; ++qh)
      std::copy_n(&prep.tensors.q_future[(static_cast<size_t>(qh) * F + f) * D], D, &query[static_cast<size_t>(qh) * D]);
    decode("held-out query");
    if (settings.verify_decode) decoded.insert(decoded.end(), out.begin(), out.end());
    for (int qh = 0; qh < Hq; ++qh)
      cosines[static_cast<size_t>(qh) * F + f] =
          cosine(&out[static_cast<size_t>(qh) * D], &prep.exact_future[(static_cast<size_t>(qh) * F + f) * D], D);
  }
  for (int qh = 0; qh < Hq; ++qh) {
    double sum = 0.0;
    for (int f = 0; f < F; ++f) sum += cosines[static_cast<size_t>(qh) * F + f];
    row.cell_cosines.push_back(sum / F);
  }
  row.query_cosines.insert(row.query_cosines.end(), cosines.begin(), cosines.end());
  if (settings.verify_decode) verify_decode(cache.get(), s, prep, decoded, pc.scale(D), label, settings, row, anomalies);

  // Needle probes.
  const int G = s.group();
  const int n = prep.probe_calls > 0 ? static_cast<int>(prep.needles.size() / s.heads) : 0;
  std::vector<double> needle_cosines(prep.needles.size(), std::nan(""));  // [H][n], as prep.needles
  for (int call = 0; call < prep.probe_calls; ++call) {
    std::copy_n(&prep.probes[static_cast<size_t>(call) * Hq * D], Hq * D, query.begin());
    decode("needle probe");
    for (int h = 0; h < s.heads; ++h)
      for (int g = 0; g < G; ++g) {
        const int i = call * G + g;
        if (i >= n) continue;
        const Needle &needle = prep.needles[static_cast<size_t>(h) * n + i];
        if (needle.position < 0) continue;
        needle_cosines[static_cast<size_t>(h) * n + i] =
            cosine(&out[static_cast<size_t>(h * G + g) * D], needle.value.data(), D);
      }
  }
  for (size_t i = 0; i < prep.needles.size(); ++i)  // the order of the JSON needle_list
    if (prep.needles[i].position >= 0) row.needle_cosines.push_back(needle_cosines[i]);
  ++row.layers_done;
}

// ---- output ---------------------------------------------------------------------------------------

struct Summary {
  std::string source;
  EvalShape shape;
  akv_dtype dtype;
  int needles_per_head = 0;
  int64_t needles_planted = 0, needles_unplaced = 0, exact_reached = 0;
  double mean_window_quantile = 0, mean_exact_weight = 0;
  AttentionProfile profile;
  double seconds = 0;
};

double mean_of(const std::vector<double> &values) {
  if (values.empty()) return std::nan("");
  double sum = 0;
  for (double v : values) sum += v;
  return sum / values.size();
}

double share_below(const std::vector<double> &values, double threshold) {
  if (values.empty()) return std::nan("");
  return static_cast<double>(std::count_if(values.begin(), values.end(), [&](double v) { return v < threshold; })) /
         values.size();
}

std::string percent(double fraction) { return format_fixed(100.0 * fraction, 1) + "%"; }

void print_table(const Summary &summary, const std::vector<Row> &rows, const EvalSettings &settings,
                 const std::vector<std::string> &anomalies) {
  const EvalShape &s = summary.shape;
  std::printf("anchorkv eval: %s\n", summary.source.c_str());
  std::printf("shape: L=%d S=%lld H=%d Hq=%d D=%d W=%d; held-out queries F=%d per query head; %lld needles "
              "(%d per KV head), reached when cos(probe output, needle value) >= %.2f\n",
              s.layers, static_cast<long long>(s.seq_len), s.heads, s.q_heads, s.head_dim, s.window, s.future,
              static_cast<long long>(summary.needles_planted), summary.needles_per_head, settings.reach_threshold);
  const AttentionProfile &p = summary.profile;
  std::printf("exact attention of the held-out queries: sink weight %.3f, top-1%% tokens %.3f, effective tokens %.0f\n",
              p.mean(p.sink_mass), p.mean(p.top_percent_mass), p.mean(p.effective_tokens));
  if (summary.needles_planted > 0)
    std::printf("exact reference self-check: needles reached %lld/%lld (probe weight on needle %.3f; needle window-score "
                "quantile %.2f, <= 0.5 by construction)\n",
                static_cast<long long>(summary.exact_reached), static_cast<long long>(summary.needles_planted),
                summary.mean_exact_weight, summary.mean_window_quantile);
  std::printf("\n");

  const char *headers[] = {"method", "target", "ratio", "bytes", "compress/layer", "decode/call", "vs FullKV",
                           "cos mean", "cos p1", "cos<0.9", "reach"};
  constexpr int kColumns = 11;
  std::vector<std::vector<std::string>> cells;
  double fullkv_decode = std::nan("");
  for (const Row &row : rows)
    if (row.run.entry->method == AKV_METHOD_FULLKV && !row.failed()) fullkv_decode = row.decode_median();
  for (const Row &row : rows) {
    std::vector<std::string> line = {row.run.entry->name, row.run.target_label()};
    if (row.failed()) {
      line.push_back("FAILED: " + row.error);
      cells.push_back(line);
      continue;
    }
    line.push_back(format_fixed(row.ratio(), 2) + "x");
    line.push_back(std::to_string(row.compressed_bytes));
    line.push_back(format_seconds(row.compress_seconds / std::max(row.layers_done, 1)));
    line.push_back(format_seconds(row.decode_median()));
    line.push_back(format_fixed(row.decode_median() / fullkv_decode, 2) + "x");
    line.push_back(format_fixed(mean_of(row.cell_cosines), 4));
    line.push_back(format_fixed(percentile(row.cell_cosines, 0.01), 4));
    line.push_back(percent(share_below(row.cell_cosines, 0.9)));
    if (row.needle_cosines.empty())
      line.push_back("-");
    else
      line.push_back(std::to_string(row.reached(settings.reach_threshold)) + "/" +
                     std::to_string(row.needle_cosines.size()) + " (" +
                     percent(static_cast<double>(row.reached(settings.reach_threshold)) / row.needle_cosines.size()) + ")");
    cells.push_back(line);
  }
  std::vector<size_t> width(kColumns);
  for (int c = 0; c < kColumns; ++c) width[c] = std::string(headers[c]).size();
  for (const auto &line : cells)  // failed rows: name, target, then the error unaligned
    for (size_t c = 0; c < (line.size() == kColumns ? line.size() : line.size() - 1); ++c)
      width[c] = std::max(width[c], line[c].size());
  auto print_line = [&](const std::vector<std::string> &line) {
    std::string text;
    for (size_t c = 0; c < line.size(); ++c) {
      const std::string &cell = line[c];
      if (c > 0) text += "  ";
      if (line.size() < kColumns && c == line.size() - 1) {
        text += cell;
      } else if (c == 0) {
        text += cell + std::string(width[c] - cell.size(), ' ');
      } else {
        text += std::string(width[c] - cell.size(), ' ') + cell;
      }
    }
    std::printf("%s\n", text.c_str());
  };
  print_line(std::vector<std::string>(headers, headers + kColumns));
  for (const auto &line : cells) print_line(line);
  std::printf("\nratio: M_full / compressed bytes (akv_cache_stats, all layers); bytes: all layers; decode: one query "
              "per head, median per call; cos: per (layer, query head) cell, mean over held-out queries, vs exact "
              "attention; p1: 1st percentile of cells; cos<0.9: share of cells; took %s\n",
              format_seconds(summary.seconds).c_str());
  if (settings.verify_decode) {
    std::printf("decode vs attention over akv_cache_reconstruct (per layer and KV head, mean cos):");
    for (const Row &row : rows)
      if (!row.failed())
        std::printf(" %s %s min %.6f;", row.run.entry->name, row.run.target_label().c_str(),
                    percentile(row.self_cosines, 0.0));
    std::printf("\n");
  }
  for (const std::string &anomaly : anomalies) std::printf("LIBRARY ANOMALY: %s\n", anomaly.c_str());
}

nlohmann::json number_or_null(double value) {
  return std::isfinite(value) ? nlohmann::json(value) : nlohmann::json(nullptr);
}

nlohmann::json to_json(const Summary &summary, const std::vector<Row> &rows, const EvalSettings &settings,
                       const std::vector<std::string> &anomalies, const std::vector<Needle> &needles) {
  nlohmann::json out;
  const EvalShape &s = summary.shape;
  out["tool"] = "anchorkv eval";
  out["library_version"] = akv_version_string();
  out["source"] = summary.source;
  out["shape"] = {{"layers", s.layers}, {"seq_len", s.seq_len}, {"kv_heads", s.heads}, {"q_heads", s.q_heads},
                  {"head_dim", s.head_dim}, {"window", s.window}, {"future_queries", s.future}};
  out["input_dtype"] = dtype_label(summary.dtype);
  out["reach_threshold"] = settings.reach_threshold;
  const AttentionProfile &p = summary.profile;
  out["exact_profile"] = {{"sink_weight", p.mean(p.sink_mass)}, {"top_1_percent_mass", p.mean(p.top_percent_mass)},
                          {"effective_tokens", p.mean(p.effective_tokens)}};
  out["needles"] = {{"per_kv_head", summary.needles_per_head}, {"planted", summary.needles_planted},
                    {"unplaced", summary.needles_unplaced}, {"exact_reached", summary.exact_reached},
                    {"mean_exact_weight", number_or_null(summary.mean_exact_weight)},
                    {"mean_window_quantile", number_or_null(summary.mean_window_quantile)}};
  nlohmann::json needle_list = nlohmann::json::array();
  for (const Needle &needle : needles)
    if (needle.position >= 0)
      needle_list.push_back({{"layer", needle.layer}, {"kv_head", needle.head}, {"position", needle.position},
                             {"depth", static_cast<double>(needle.position) / s.seq_len},
                             {"window_quantile", needle.window_quantile}, {"exact_weight", needle.exact_weight},
                             {"exact_cosine", needle.exact_cosine}});
  out["needle_list"] = needle_list;
  double fullkv_decode = std::nan("");
  for (const Row &row : rows)
    if (row.run.entry->method == AKV_METHOD_FULLKV && !row.failed()) fullkv_decode = row.decode_median();
  nlohmann::json json_rows = nlohmann::json::array();
  for (const Row &row : rows) {
    nlohmann::json r = {{"method", row.run.entry->name}, {"retain_fraction", row.run.retain_fraction},
                        {"target_ratio", row.run.entry->sweeps_ratios || row.run.entry->method == AKV_METHOD_FULLKV
                                             ? nlohmann::json(row.run.target_ratio())
                                             : nlohmann::json(nullptr)},
                        {"window", row.window}};
    if (row.failed()) {
      r["error"] = row.error;
      json_rows.push_back(r);
      continue;
    }
    r["ratio"] = number_or_null(row.ratio());
    r["layer_ratios"] = row.layer_ratios;
    r["full_bytes"] = row.full_bytes;
    r["compressed_bytes"] = row.compressed_bytes;
    r["budget_bytes"] = row.budget_bytes;
    r["key_residuals"] = row.key_residuals;
    r["value_residuals"] = row.value_residuals;
    r["compress_seconds_per_layer"] = row.compress_seconds / std::max(row.layers_done, 1);
    r["decode_seconds_median"] = number_or_null(row.decode_median());
    r["decode_vs_fullkv"] = number_or_null(row.decode_median() / fullkv_decode);
    r["cosine_mean"] = number_or_null(mean_of(row.cell_cosines));
    r["cosine_p1"] = number_or_null(percentile(row.cell_cosines, 0.01));
    r["share_cells_below_0_9"] = number_or_null(share_below(row.cell_cosines, 0.9));
    r["cell_cosines"] = row.cell_cosines;  // [layer][q_head], for CDF plots
    r["needles_reached"] = row.reached(settings.reach_threshold);
    r["needles_total"] = row.needle_cosines.size();
    r["needle_cosines"] = row.needle_cosines;  // in needle_list order
    if (settings.verify_decode) r["decode_vs_reconstruction_cosines"] = row.self_cosines;  // [layer][kv_head]
    json_rows.push_back(r);
  }
  out["rows"] = json_rows;
  out["library_anomalies"] = anomalies;
  out["seconds"] = summary.seconds;
  return out;
}

std::string csv_target(const MethodRun &run) {
  if (run.target_label() == "-") return "";  // the ratio follows from the method's bits
  char buffer[32];
  std::snprintf(buffer, sizeof buffer, "%.6g", run.target_ratio());
  return buffer;
}

void print_csv(const std::vector<Row> &rows, const EvalSettings &settings) {
  double fullkv_decode = std::nan("");
  for (const Row &row : rows)
    if (row.run.entry->method == AKV_METHOD_FULLKV && !row.failed()) fullkv_decode = row.decode_median();
  std::printf("method,target_ratio,retain_fraction,ratio,compressed_bytes,compress_s_per_layer,decode_s_median,"
              "decode_vs_fullkv,cos_mean,cos_p1,share_cells_below_0_9,needles_reached,needles_total,error\n");
  for (const Row &row : rows) {
    if (row.failed()) {
      std::string error = row.error;
      std::replace(error.begin(), error.end(), '"', '\'');
      std::printf("%s,%s,%.6g,,,,,,,,,,,\"%s\"\n", row.run.entry->name, csv_target(row.run).c_str(),
                  row.run.retain_fraction, error.c_str());
      continue;
    }
    std::printf("%s,%s,%.6g,%.6f,%llu,%.6g,%.6g,%.4f,%.6f,%.6f,%.6f,%lld,%zu,\n", row.run.entry->name,
                csv_target(row.run).c_str(), row.run.retain_fraction, row.ratio(),
                static_cast<unsigned long long>(row.compressed_bytes),
                row.compress_seconds / std::max(row.layers_done, 1), row.decode_median(),
                row.decode_median() / fullkv_decode, mean_of(row.cell_cosines), percentile(row.cell_cosines, 0.01),
                share_below(row.cell_cosines, 0.9), static_cast<long long>(row.reached(settings.reach_threshold)),
                row.needle_cosines.size());
  }
}

// --cells-csv: one line per (row, layer, query head, held-out query), the raw cosines; a
// fidelity cell (table and plots alike) is a (layer, query head), the mean over its queries.
void write_cells_csv(const std::string &path, const std::vector<Row> &rows, const EvalShape &s) {
  std::FILE *file = std::fopen(path.c_str(), "w");
  if (file == nullptr) throw CliError("--cells-csv: cannot write \"" + path + "\"");
  std::fprintf(file, "method,target,target_ratio,ratio,layer,q_head,query,cosine\n");
  for (const Row &row : rows) {
    if (row.failed()) continue;
    const size_t per_layer = static_cast<size_t>(s.q_heads) * s.future;
    for (size_t i = 0; i < row.query_cosines.size(); ++i)
      std::fprintf(file, "%s,%s,%.6g,%.6f,%zu,%zu,%zu,%.9f\n", row.run.entry->name, row.run.target_label().c_str(),
                   row.run.target_ratio(), row.ratio(), i / per_layer, i % per_layer / s.future, i % s.future,
                   row.query_cosines[i]);
  }
  if (std::fclose(file) != 0) throw CliError("--cells-csv: error writing \"" + path + "\"");
}

akv_dtype parse_dtype(const std::string &text) {
  if (text == "auto") return AKV_DTYPE_AUTO;
  if (text == "f32") return AKV_DTYPE_F32;
  if (text == "f16") return AKV_DTYPE_F16;
  if (text == "bf16") return AKV_DTYPE_BF16;
  throw CliError("--dtype must be auto, f32, f16 or bf16, got \"" + text + "\"", kExitUsage);
}

}  // namespace

int run_eval(int argc, char **argv) {
  for (int i = 1; i < argc; ++i)
    if (std::string(argv[i]) == "--reach-grid") return run_reach_grid(argc, argv);
  for (int i = 1; i < argc; ++i)
    if (std::string(argv[i]) == "--generate") return run_generate(argc, argv);
  cxxopts::Options options("anchorkv eval",
                           "Compare FullKV, AnchorKV and the baselines (see --methods) against exact attention:\n"
                           "compression ratio, bytes, compress and decode time, attention-output fidelity on\n"
                           "held-out queries and needle reach. Without --data it runs on synthetic LLM-like data.\n");
  options.custom_help("[OPTION...]");
  options.set_width(100);
  // clang-format off
  options.add_options("Data")
    ("data", "Evaluate K/V/Q from a safetensors file instead of synthetic data", cxxopts::value<std::string>(), "FILE")
    ("seq-len", "Synthetic: prompt length S", cxxopts::value<int64_t>()->default_value("16384"), "S")
    ("layers", "Synthetic: layers; with --data: evaluate only the first N layers (0 = all)", cxxopts::value<int>()->default_value("2"), "N")
    ("heads", "Synthetic: KV heads H", cxxopts::value<int>()->default_value("8"), "H")
    ("q-heads", "Synthetic: query heads Hq (a multiple of H)", cxxopts::value<int>()->default_value("32"), "HQ")
    ("head-dim", "Synthetic: head dimension D", cxxopts::value<int>()->default_value("128"), "D")
    ("window", "Synthetic: window queries per head (default: the widest default window of the methods; each method gets the last min(its window, W))", cxxopts::value<int>(), "W")
    ("future", "Synthetic: held-out queries F per query head", cxxopts::value<int>()->default_value("16"), "F")
    ("rope-base", "Synthetic: RoPE base (NeoX style)", cxxopts::value<double>()->default_value("10000"), "BASE")
    ("dtype", "dtype handed to akv_compress: auto (f32 synthetic, file's dtype), f32, f16, bf16", cxxopts::value<std::string>()->default_value("auto"), "T")
    ("seed", "Seed of the synthetic data and of the needles", cxxopts::value<uint64_t>()->default_value("1"), "N");
  options.add_options("Comparison")
    ("ratios", "Compression ratios (5,10,20) or retain fractions (0.2,0.1,0.05)", cxxopts::value<std::string>()->default_value("5,10,20"), "LIST")
    ("methods", "Methods besides FullKV: default, all, or names (" + method_names() + ")", cxxopts::value<std::string>()->default_value("default"), "LIST")
    ("needles", "Needles per KV head and layer (0: no reach test)", cxxopts::value<int>()->default_value("8"), "N")
    ("reach-threshold", "A needle is reached when cos(probe output, needle value) >= this", cxxopts::value<double>()->default_value("0.9"), "C")
    ("threads", "CPU threads for the library and the reference (0 = all)", cxxopts::value<int>()->default_value("0"), "N");
  options.add_options("Output")
    ("csv", "Print CSV instead of the table")
    ("json", "Print JSON (with per-cell cosines and per-needle results) instead of the table")
    ("quiet", "No progress on stderr")
    ("verify-decode", "Also compare akv_decode with attention over akv_cache_reconstruct (a decode-kernel check, slower)")
    ("cells-csv", "Also write every row's per-(layer, query head, held-out query) cosine to FILE (CSV; "
                  "scripts/plot_eval.py averages them into the table's (layer, query head) cells and draws their "
                  "fidelity CDFs)", cxxopts::value<std::string>(), "FILE")
    ("reach-grid", "Instead of the comparison, the needle-reach grid over context lengths and depths "
                   "(anchorkv eval --reach-grid --help)")
    ("generate", "Instead of the comparison, a synthetic generation of N tokens: the memory curve and the "
                 "fidelity with and without compaction (anchorkv eval --generate N --help)", cxxopts::value<int64_t>(), "N")
    ("check", "Exit 3 unless FullKV matches exact attention (mean cos >= 0.999), every needle is reached by "
              "exact attention and FullKV, and the library stats are consistent")
    ("h,help", "Show this help");
  // clang-format on
  const cxxopts::ParseResult args = parse_arguments(options, argc, argv, "anchorkv eval --help");
  if (args.count("help")) {
    std::printf("%s\n%s\n%s\n%s%s.\n", options.help({"Data", "Comparison", "Output"}).c_str(), kSyntheticDataHelp,
                kDataFormatHelp, kNeedleHelp, default_method_names().c_str());
    return kExitOk;
  }
  if (!args.unmatched().empty())
    throw CliError("unexpected argument \"" + args.unmatched().front() + "\" (see anchorkv eval --help)", kExitUsage);

  EvalSettings settings;
  settings.methods = args["methods"].as<std::string>();
  settings.fractions = parse_ratios(args["ratios"].as<std::string>());
  settings.needles_per_head = args["needles"].as<int>();
  settings.reach_threshold = args["reach-threshold"].as<double>();
  settings.threads = args["threads"].as<int>();
  settings.seed = args["seed"].as<uint64_t>();
  settings.quiet = args.count("quiet") > 0;
  settings.csv = args.count("csv") > 0;
  settings.json = args.count("json") > 0;
  settings.check = args.count("check") > 0;
  settings.verify_decode = args.count("verify-decode") > 0;
  const std::string cells_csv = args.count("cells-csv") ? args["cells-csv"].as<std::string>() : "";
  if (settings.csv && settings.json) throw CliError("--csv and --json are exclusive", kExitUsage);
  if (settings.needles_per_head < 0) throw CliError("--needles must be >= 0", kExitUsage);
  if (!(settings.reach_threshold > 0.0 && settings.reach_threshold <= 1.0))
    throw CliError("--reach-threshold must be in (0, 1]", kExitUsage);
  if (settings.threads < 0) throw CliError("--threads must be >= 0", kExitUsage);
  const akv_dtype dtype_option = parse_dtype(args["dtype"].as<std::string>());
  const std::vector<MethodRun> plan = plan_methods(settings.methods, settings.fractions);

  std::unique_ptr<LayerSource> source;
  int layers_to_run = 0;
  if (args.count("data")) {
    for (const char *synthetic_only : {"seq-len", "heads", "q-heads", "head-dim", "window", "future", "rope-base"})
      if (args.count(synthetic_only))
        throw CliError(std::string("--") + synthetic_only + " applies to synthetic data only; the shape comes from --data",
                       kExitUsage);
    source = std::make_unique<SafetensorsSource>(args["data"].as<std::string>(), dtype_option);
    const int limit = args.count("layers") ? args["layers"].as<int>() : 0;
    if (limit < 0) throw CliError("--layers must be >= 0", kExitUsage);
    layers_to_run = limit == 0 ? source->shape().layers : std::min(limit, source->shape().layers);
  } else {
    SyntheticConfig config;
    config.shape.seq_len = args["seq-len"].as<int64_t>();
    config.shape.layers = args["layers"].as<int>();
    config.shape.heads = args["heads"].as<int>();
    config.shape.q_heads = args["q-heads"].as<int>();
    config.shape.head_dim = args["head-dim"].as<int>();
    config.shape.window = args.count("window") ? args["window"].as<int>() : widest_window(plan);
    config.shape.future = args["future"].as<int>();
    config.seed = settings.seed;
    config.rope_base = args["rope-base"].as<double>();
    config.dtype = dtype_option == AKV_DTYPE_AUTO ? AKV_DTYPE_F32 : dtype_option;
    config.threads = settings.threads;
    const EvalShape &s = config.shape;
    if (s.layers < 1 || s.heads < 1 || s.q_heads < 1 || s.head_dim < 4 || s.window < 1 || s.future < 1)
      throw CliError("--layers, --heads, --q-heads, --window, --future must be >= 1 and --head-dim >= 4", kExitUsage);
    if (s.q_heads % s.heads != 0) throw CliError("--q-heads must be a multiple of --heads", kExitUsage);
    if (s.seq_len <= s.window) throw CliError("--seq-len must exceed --window", kExitUsage);
    source = std::make_unique<SyntheticSource>(config);
    layers_to_run = s.layers;
  }

  EvalShape shape = source->shape();
  shape.layers = layers_to_run;
  const PositionConfig &pc = source->positions();
  const Progress progress(settings.quiet);
  Stopwatch total_clock;
  progress.say(source->describe());
  ContextHandle context = create_context(AKV_BACKEND_CPU, settings.threads);

  std::vector<Row> rows;
  for (const MethodRun &run : plan) rows.emplace_back(run);
  Anomalies anomalies;
  std::vector<Needle> all_needles;
  Summary summary;
  summary.source = source->describe();
  summary.shape = shape;
  summary.dtype = source->input_dtype();
  summary.needles_per_head = settings.needles_per_head;
  int unplaced = 0;
  const int64_t steps_total = static_cast<int64_t>(layers_to_run) * static_cast<int64_t>(rows.size());
  int64_t steps_done = 0;

  for (int layer = 0; layer < layers_to_run; ++layer) {
    Stopwatch layer_clock;
    PreparedLayer prep = prepare_layer(*source, layer, settings, &unplaced);
    summary.profile.merge(prep.profile);
    if (prep.needles.empty() && settings.needles_per_head > 0 && layer == 0)
      progress.say("prompt too short for ", settings.needles_per_head, " needles per head: reach not measured");
    progress.say("layer ", layer + 1, "/", layers_to_run, ": data, needles and exact reference ready (",
                 format_seconds(layer_clock.seconds()), ")");
    LibraryInputs inputs;
    inputs.keys = encode_dtype(prep.tensors.keys, source->input_dtype());
    inputs.values = encode_dtype(prep.tensors.values, source->input_dtype());
    inputs.q_window = encode_dtype(prep.tensors.q_window, source->input_dtype());
    if (pc.position_offset != 0) {
      inputs.positions.resize(static_cast<size_t>(shape.seq_len));
      for (int64_t t = 0; t < shape.seq_len; ++t)
        inputs.positions[t] = static_cast<int32_t>(pc.position_offset + t);
    }
    for (Row &row : rows) {
      if (row.failed()) continue;
      Stopwatch clock;
      try {
        run_layer(context.get(), shape, pc, source->input_dtype(), layer, prep, inputs, settings, row, anomalies);
      } catch (const CliError &error) {
        row.error = error.what();
        std::cerr << "anchorkv eval: " << row.error << std::endl;
        continue;
      }
      // Steps done of all (layer, method) steps, the time so far and an estimate of what is left
      // (the mean step so far times the steps left; later layers repeat the first one's work).
      ++steps_done;
      const double elapsed = total_clock.seconds();
      const double left = elapsed / steps_done * static_cast<double>(steps_total - steps_done);
      const std::string eta = steps_done < steps_total ? ", ~" + format_seconds(left) + " left" : "";
      progress.say("[", steps_done, "/", steps_total, ", ", format_seconds(elapsed), eta, "] layer ", layer + 1, "/", layers_to_run, ": ", row.run.entry->name, " ",
                   row.run.target_label(), " (window ", row.window, ") done (", format_seconds(clock.seconds()), ")");
    }
    for (Needle &needle : prep.needles) {
      if (needle.position < 0) continue;
      ++summary.needles_planted;
      summary.exact_reached += needle.exact_cosine >= settings.reach_threshold;
      summary.mean_exact_weight += needle.exact_weight;
      summary.mean_window_quantile += needle.window_quantile;
      all_needles.push_back(std::move(needle));
    }
  }
  for (const Row &row : rows)
    if (!row.failed() && row.compressed_bytes > row.budget_bytes)
      anomalies.add(std::string(row.run.entry->name) + " " + row.run.target_label(),
                    "footprint over budget over all layers: " + std::to_string(row.compressed_bytes) + " > " +
                        std::to_string(row.budget_bytes));
  summary.needles_unplaced = unplaced;
  if (summary.needles_planted > 0) {
    summary.mean_exact_weight /= summary.needles_planted;
    summary.mean_window_quantile /= summary.needles_planted;
  } else {
    summary.mean_exact_weight = summary.mean_window_quantile = std::nan("");
  }
  if (unplaced > 0)
    progress.say(unplaced, " needle(s) could not be planted (no direction the window ignores and a probe can single out)");
  summary.seconds = total_clock.seconds();

  if (settings.json)
    std::printf("%s\n", to_json(summary, rows, settings, anomalies.list(), all_needles).dump(2).c_str());
  else if (settings.csv)
    print_csv(rows, settings);
  else
    print_table(summary, rows, settings, anomalies.list());
  for (const std::string &anomaly : anomalies.list()) std::cerr << "anchorkv eval: library anomaly: " << anomaly << std::endl;
  if (!cells_csv.empty()) write_cells_csv(cells_csv, rows, shape);

  bool any_failed = false;
  for (const Row &row : rows) any_failed |= row.failed();
  if (settings.check) {
    std::vector<std::string> problems;
    const Row &fullkv = rows.front();
    if (fullkv.failed()) {
      problems.push_back("FullKV failed");
    } else {
      if (!(mean_of(fullkv.cell_cosines) >= 0.999))
        problems.push_back("FullKV mean cosine " + format_fixed(mean_of(fullkv.cell_cosines), 6) + " < 0.999");
      if (fullkv.reached(settings.reach_threshold) != static_cast<int64_t>(fullkv.needle_cosines.size()))
        problems.push_back("FullKV reached " + std::to_string(fullkv.reached(settings.reach_threshold)) + "/" +
                           std::to_string(fullkv.needle_cosines.size()) + " needles");
    }
    if (summary.exact_reached != summary.needles_planted)
      problems.push_back("exact attention reached " + std::to_string(summary.exact_reached) + "/" +
                         std::to_string(summary.needles_planted) + " needles");
    if (settings.needles_per_head > 0 && summary.needles_planted == 0) problems.push_back("no needle could be planted");
    if (!anomalies.list().empty()) problems.push_back("library anomalies (above)");
    if (any_failed) problems.push_back("a method failed");
    for (const std::string &problem : problems) std::cerr << "anchorkv eval: check failed: " << problem << std::endl;
    if (!problems.empty()) return kExitCheck;
  }
  return any_failed ? kExitFailure : kExitOk;
}

}  // namespace akvcli
