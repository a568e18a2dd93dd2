// `anchorkv eval --reach-grid`: needle reach over context lengths and needle depths, in the
// spirit of the paper's Figure 4 (a passkey at depths 0-100% of contexts of growing length).
//
// Per context length S, the synthetic generator of `anchorkv eval` makes --layers layers;
// in every (layer, KV head) one needle is planted per depth d, at token
//     p(d) = 4 + round(d * (S - 5))        (depth 0: token 4, past the attention sink and
//                                           every method's sink protection; depth 1: S-1)
// (moved to the nearest position, within 256 tokens, whose +-8 neighbours all score below the
// head's 90th percentile of window attention, so that no needle sits next to the sink or a
// heavy hitter, which methods that pool scores or keep whole chunks would keep by accident)
// with the recipe of `anchorkv eval`'s needles: a random key direction of the head's median
// key norm, a distinctive value (orthogonal to the head's mean value, 1.5x its median
// norm), and a probe query along the needle's post-RoPE key scaled so that exact attention
// puts --needle-weight (0.95) of its mass on the needle. The generator must not favour any
// method: a needle outside the window is kept only if the window queries do not single it
// out (its window-attention score, the mean softmax weight over the head's window rows, is
// at most the head's median). After all needles are in place the window attention is
// recomputed and each needle's score quantile (share of the head's evictable tokens that
// score lower) is reported: every quantile stays below 0.5, so no score-based eviction
// method sees the needles as important. Needles at depth 100% lie inside every method's
// recent window and are kept by all. A needle is reached when cos(probe output, needle
// value) >= --reach-threshold (0.9); exact attention reaches every needle (self-check).
// Each cell (method, ratio, S, depth) is the share of its layers x KV heads needles reached.
#include <cxxopts.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <map>
#include <sstream>

#include "commands.hpp"
#include "common.hpp"
#include "methods.hpp"
#include "reference.hpp"
#include "rope.hpp"
#include "synthetic.hpp"

namespace akvcli {
namespace {

struct GridSettings {
  std::vector<int64_t> lengths;
  std::vector<double> depths;  // fractions in [0, 1]
  int layers = 2, heads = 8, q_heads = 32, head_dim = 128, window = 64;
  double rope_base = 10000.0, threshold = 0.9, needle_weight = 0.95;
  uint64_t seed = 1;
  int threads = 0;
  bool csv = false, quiet = false;
};

struct GridNeedle {
  int head = 0;
  int depth_index = 0;
  int64_t position = -1;        // -1: could not be planted
  double window_quantile = 0;   // after every needle is in place
  bool in_window = false;       // inside the data's window (depth ~100%)
  double exact_cosine = 0;
  std::vector<double> value;
  std::vector<float> probe;     // [D] post-RoPE
};

// Tokens on each side of a needle whose window score must stay below the head's 90th
// percentile (covers every method's pooling kernel and AnDPro's chunk-mates).
constexpr int64_t kNeighbourhood = 8;

// One cell's tally.
struct Tally {
  int64_t reached = 0, total = 0;
  double cosine_sum = 0;
};

std::vector<int64_t> parse_lengths(const std::string &text) {
  std::vector<int64_t> out;
  std::stringstream stream(text);
  std::string part;
  while (std::getline(stream, part, ',')) {
    if (part.empty()) continue;
    int64_t scale = 1;
    if (part.back() == 'k' || part.back() == 'K') scale = 1024, part.pop_back();
    size_t used = 0;
    int64_t value = 0;
    try {
      value = std::stoll(part, &used);
    } catch (const std::exception &) {
      used = 0;
    }
    if (used == 0 || used != part.size() || value <= 0) throw CliError("--lengths: \"" + part + "\" is not a length", kExitUsage);
    out.push_back(value * scale);
  }
  if (out.empty()) throw CliError("--lengths: no length given", kExitUsage);
  return out;
}

std::vector<double> parse_depths(const std::string &text) {
  std::vector<double> out;
  std::stringstream stream(text);
  std::string part;
  while (std::getline(stream, part, ',')) {
    if (part.empty()) continue;
    size_t used = 0;
    double value = -1;
    try {
      value = std::stod(part, &used);
    } catch (const std::exception &) {
      used = 0;
    }
    if (used == 0 || used != part.size() || !(value >= 0.0 && value <= 100.0))
      throw CliError("--depths: \"" + part + "\" is not a percentage in [0, 100]", kExitUsage);
    out.push_back(value / 100.0);
  }
  if (out.empty()) throw CliError("--depths: no depth given", kExitUsage);
  return out;
}

// Plants one needle per depth in head h of `tensors` (keys pre-RoPE, values), filling
// `needles` (one per depth). keys_post/values: the head's double copies, updated in place.
void plant_head(int layer, int h, const EvalShape &s, const Rotary &rotary, const GridSettings &g,
                LayerTensors &tensors, std::vector<double> &keys_post, std::vector<double> &values,
                std::vector<GridNeedle> &needles) {
  const int D = s.head_dim, G = s.group(), W = s.window;
  const int64_t S = s.seq_len, evictable = S - W;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  std::vector<double> wq(static_cast<size_t>(G) * W * D);
  for (size_t i = 0; i < wq.size(); ++i) wq[i] = tensors.q_window[static_cast<size_t>(h) * G * W * D + i];
  WindowAttention window = window_attention(keys_post.data(), S, D, wq.data(), G, W, scale);
  const int rows = G * W;

  std::vector<double> key_norms(evictable), value_norms(evictable), mean_value(D, 0.0);
  for (int64_t t = 0; t < evictable; ++t) {
    key_norms[t] = std::sqrt(dot(&keys_post[t * D], &keys_post[t * D], D));
    value_norms[t] = std::sqrt(dot(&values[t * D], &values[t * D], D));
    for (int d = 0; d < D; ++d) mean_value[d] += values[t * D + d] / evictable;
  }
  const double key_norm = std::max(median(key_norms), 1e-3), value_norm = std::max(median(value_norms), 1e-3);
  const double mean_value_norm = std::sqrt(dot(mean_value.data(), mean_value.data(), D));
  const double quiet_score = percentile(window.score, 0.9);  // a needle's neighbours stay below
  Rng rng = Rng::keyed(g.seed, 0x67726964ull /* "grid" */, (static_cast<uint64_t>(S) << 16) | layer, h);
  std::vector<double> direction(D), key_post(D), logits(rows);
  std::vector<float> stored(D);
  for (size_t di = 0; di < g.depths.size(); ++di) {
    GridNeedle &needle = needles[di];
    needle.head = h;
    needle.depth_index = static_cast<int>(di);
    const int64_t nominal = 4 + std::llround(g.depths[di] * static_cast<double>(S - 5));
    int64_t p = nominal;
    if (nominal < evictable) {
      // The nearest free position whose neighbourhood is not singled out either: a sink or a
      // heavy hitter within kNeighbourhood tokens would keep the needle in any method that
      // pools scores or keeps whole chunks around it, by accident of the grid.
      for (int64_t shift = 0; shift < 256; ++shift) {
        const int64_t candidates[2] = {nominal + shift, nominal - shift};
        bool found = false;
        for (int64_t c : candidates) {
          if (c < 4 || c >= evictable) continue;
          if (std::any_of(needles.begin(), needles.begin() + di, [&](const GridNeedle &n) {
                return n.position >= 0 && std::llabs(n.position - c) <= kNeighbourhood;
              }))
            continue;
          double loudest = 0.0;
          for (int64_t t = std::max<int64_t>(0, c - kNeighbourhood); t <= std::min(evictable - 1, c + kNeighbourhood); ++t)
            loudest = std::max(loudest, window.score[t]);
          if (loudest <= quiet_score) {
            p = c;
            found = true;
            break;
          }
        }
        if (found) break;
      }
    }
    needle.in_window = p >= evictable;
    for (int attempt = 0; attempt < 64 && needle.position < 0; ++attempt) {
      for (int d = 0; d < D; ++d) direction[d] = rng.normal();
      const double norm = std::sqrt(dot(direction.data(), direction.data(), D));
      for (int d = 0; d < D; ++d) stored[d] = static_cast<float>(direction[d] / norm * key_norm);
      rotary.apply(stored.data(), static_cast<double>(p), /*inverse=*/true);  // handed over pre-RoPE
      for (int d = 0; d < D; ++d) key_post[d] = stored[d];
      rotary.apply(key_post.data(), static_cast<double>(p));
      if (!needle.in_window) {
        // Window score with the needle in place of token p: must not stand out.
        double score = 0.0;
        for (int r = 0; r < rows; ++r) {
          const double *q = &wq[static_cast<size_t>(r) * D];
          const double old_logit = scale * dot(q, &keys_post[p * D], D);
          logits[r] = scale * dot(q, key_post.data(), D);
          const double lse = window.row_lse[r];
          const double rest = std::max(1.0 - std::exp(old_logit - lse), 1e-300);
          score += std::exp(logits[r] - (lse + std::log(rest + std::exp(logits[r] - lse)))) / rows;
        }
        if (score > window.median_score) continue;
        for (int r = 0; r < rows; ++r) {
          const double lse = window.row_lse[r];
          const double old_logit = scale * dot(&wq[static_cast<size_t>(r) * D], &keys_post[p * D], D);
          const double rest = std::max(1.0 - std::exp(old_logit - lse), 1e-300);
          window.row_lse[r] = lse + std::log(rest + std::exp(logits[r] - lse));
        }
      }
      // The needle must be separable along its own key (the probe direction).
      bool separable = true;
      for (int64_t t = 0; t < S && separable; ++t)
        if (t != p && dot(key_post.data(), &keys_post[t * D], D) >= dot(key_post.data(), key_post.data(), D))
          separable = false;
      if (!separable) continue;
      needle.position = p;
      std::copy(stored.begin(), stored.end(), &tensors.keys[(static_cast<size_t>(h) * S + p) * D]);
      std::copy(key_post.begin(), key_post.end(), keys_post.begin() + p * D);
      for (int d = 0; d < D; ++d) direction[d] = rng.normal();
      if (mean_value_norm > 0.0) {
        const double along = dot(direction.data(), mean_value.data(), D) / (mean_value_norm * mean_value_norm);
        for (int d = 0; d < D; ++d) direction[d] -= along * mean_value[d];
      }
      const double direction_norm = std::sqrt(dot(direction.data(), direction.data(), D));
      needle.value.resize(D);
      for (int d = 0; d < D; ++d) {
        const float v = static_cast<float>(direction[d] / direction_norm * 1.5 * value_norm);
        tensors.values[(static_cast<size_t>(h) * S + p) * D + d] = v;
        values[p * D + d] = v;
        needle.value[d] = v;
      }
    }
  }

  // Probes against the final keys: lambda with exact weight `needle_weight` on the needle.
  for (GridNeedle &needle : needles) {
    if (needle.position < 0) continue;
    const int64_t p = needle.position;
    const double *k = &keys_post[p * D];
    const double length = std::sqrt(dot(k, k, D));
    const double z_needle = scale * length;
    std::vector<double> gaps;
    gaps.reserve(S);
    bool separable = true;
    for (int64_t t = 0; t < S; ++t) {
      if (t == p) continue;
      const double z = scale * dot(k, &keys_post[t * D], D) / length;
      if (z >= z_needle) separable = false;
      gaps.push_back(z - z_needle);
    }
    const double target = (1.0 - g.needle_weight) / g.needle_weight;
    auto mass = [&](double lambda) {
      double sum = 0.0;
      for (double gap : gaps) sum += std::exp(lambda * gap);
      return sum;
    };
    double high = 1.0;
    while (separable && mass(high) > target && high < 1e6) high *= 2.0;
    if (!separable || mass(high) > target) {
      needle.position = -1;  // a later needle broke separability: not counted
      continue;
    }
    double low = high > 1.0 ? 0.5 * high : 0.0;
    for (int iteration = 0; iteration < 60; ++iteration) {
      const double mid = 0.5 * (low + high);
      (mass(mid) > target ? low : high) = mid;
    }
    needle.probe.resize(D);
    for (int d = 0; d < D; ++d) needle.probe[d] = static_cast<float>(high * k[d] / length);
    std::vector<double> probe(needle.probe.begin(), needle.probe.end()), out(D);
    exact_attention(keys_post.data(), values.data(), S, D, probe.data(), 1, scale, out.data());
    needle.exact_cosine = cosine(out.data(), needle.value.data(), D);
  }

  // Final window attention with every needle in place: the needles' score quantiles.
  const WindowAttention final_window = window_attention(keys_post.data(), S, D, wq.data(), G, W, scale);
  for (GridNeedle &needle : needles) {
    if (needle.position < 0 || needle.in_window) continue;
    const double score = final_window.score[needle.position];
    int64_t below = 0;
    for (int64_t t = 0; t < evictable; ++t) below += final_window.score[t] < score;
    needle.window_quantile = static_cast<double>(below) / evictable;
  }
}

}  // namespace

int run_reach_grid(int argc, char **argv) {
  cxxopts::Options options("anchorkv eval --reach-grid",
                           "Needle reach of every method over context lengths and needle depths (paper Fig. 4):\n"
                           "synthetic LLM-like layers, one needle per (layer, KV head, depth).\n");
  options.custom_help("[OPTION...]");
  options.set_width(100);
  // clang-format off
  options.add_options()
    ("reach-grid", "Run the grid (this mode)")
    ("lengths", "Context lengths S (k = 1024)", cxxopts::value<std::string>()->default_value("4k,8k,16k,32k"), "LIST")
    ("depths", "Needle depths in percent of the prompt", cxxopts::value<std::string>()->default_value("0,10,20,30,40,50,60,70,80,90,100"), "LIST")
    ("layers", "Synthetic layers per length (samples per cell = layers x heads)", cxxopts::value<int>()->default_value("2"), "N")
    ("heads", "KV heads H", cxxopts::value<int>()->default_value("8"), "H")
    ("q-heads", "Query heads Hq", cxxopts::value<int>()->default_value("32"), "HQ")
    ("head-dim", "Head dimension D", cxxopts::value<int>()->default_value("128"), "D")
    ("window", "Window queries per query head (each method uses the last min(its window, W))", cxxopts::value<int>()->default_value("64"), "W")
    ("rope-base", "RoPE base (NeoX)", cxxopts::value<double>()->default_value("10000"), "BASE")
    ("seed", "Seed of the data and of the needles", cxxopts::value<uint64_t>()->default_value("1"), "N")
    ("ratios", "Compression ratios", cxxopts::value<std::string>()->default_value("5"), "LIST")
    ("methods", "Methods besides FullKV: default, all, or names (" + method_names() + ")", cxxopts::value<std::string>()->default_value("default"), "LIST")
    ("reach-threshold", "A needle is reached when cos(probe output, needle value) >= this", cxxopts::value<double>()->default_value("0.9"), "C")
    ("threads", "CPU threads (0 = all)", cxxopts::value<int>()->default_value("0"), "N")
    ("csv", "Print the per-cell CSV instead of the table")
    ("quiet", "No progress on stderr")
    ("h,help", "Show this help");
  // clang-format on
  const cxxopts::ParseResult args = parse_arguments(options, argc, argv, "anchorkv eval --reach-grid --help");
  if (args.count("help")) {
    std::printf("%s\n", options.help().c_str());
    std::printf("Needles: one per (layer, KV head, depth) at token 4 + round(depth * (S - 5)); a random key of the\n"
                "  head's median norm, kept only if the window queries score it at most at the head's median;\n"
                "  a distinctive value; a probe along its key with 95%% exact attention on it. Reached: cos(probe\n"
                "  output, needle value) >= --reach-threshold. CSV columns: method, target, ratio (measured), seq_len,\n"
                "  depth_percent, needles, reached, reach, mean_cosine, in_window (inside the W window queries'\n"
                "  positions), mean/max_window_quantile (share of the head's evictable tokens the window scores below\n"
                "  the needle; empty in the window).\n");
    return kExitOk;
  }
  if (!args.unmatched().empty())
    throw CliError("unexpected argument \"" + args.unmatched().front() + "\" (see anchorkv eval --reach-grid --help)",
                   kExitUsage);
  GridSettings g;
  g.lengths = parse_lengths(args["lengths"].as<std::string>());
  g.depths = parse_depths(args["depths"].as<std::string>());
  g.layers = args["layers"].as<int>();
  g.heads = args["heads"].as<int>();
  g.q_heads = args["q-heads"].as<int>();
  g.head_dim = args["head-dim"].as<int>();
  g.window = args["window"].as<int>();
  g.rope_base = args["rope-base"].as<double>();
  g.seed = args["seed"].as<uint64_t>();
  g.threshold = args["reach-threshold"].as<double>();
  g.threads = args["threads"].as<int>();
  g.csv = args.count("csv") > 0;
  g.quiet = args.count("quiet") > 0;
  if (g.layers < 1 || g.heads < 1 || g.q_heads < 1 || g.q_heads % g.heads != 0 || g.head_dim < 4 || g.window < 1)
    throw CliError("--layers, --heads, --window must be >= 1, --q-heads a multiple of --heads, --head-dim >= 4", kExitUsage);
  for (int64_t S : g.lengths)
    if (S <= g.window + 4 + static_cast<int64_t>(g.depths.size()))
      throw CliError("--lengths: " + std::to_string(S) + " is too short for the window and the depths", kExitUsage);
  const std::vector<MethodRun> plan = plan_methods(args["methods"].as<std::string>(),
                                                   parse_ratios(args["ratios"].as<std::string>()));
  ContextHandle context = create_context(AKV_BACKEND_CPU, g.threads);
  auto say = [&](const std::string &text) {
    if (!g.quiet) std::cerr << "anchorkv eval --reach-grid: " << text << std::endl;
  };

  // cells[(row, length, depth)], measured ratio per (row, length); needle statistics.
  std::map<std::tuple<size_t, size_t, size_t>, Tally> cells;
  std::map<std::pair<size_t, size_t>, std::pair<uint64_t, uint64_t>> bytes;  // full, compressed
  std::vector<std::string> failures(plan.size());
  int64_t planted = 0, unplaced = 0, exact_reached = 0;
  double max_quantile = 0, quantile_sum = 0;
  int64_t quantile_count = 0;
  // Per (length, depth): sum, max and count of the needles' window-score quantiles.
  std::map<std::pair<size_t, size_t>, std::tuple<double, double, int64_t>> quantiles;
  const Stopwatch clock;
  for (size_t li = 0; li < g.lengths.size(); ++li) {
    SyntheticConfig config;
    config.shape = {g.layers, g.lengths[li], g.heads, g.q_heads, g.head_dim, g.window, 1};
    config.seed = g.seed;
    config.rope_base = g.rope_base;
    config.threads = g.threads;
    SyntheticSource source(config);
    const EvalShape &s = source.shape();
    const int D = s.head_dim, G = s.group();
    const int64_t S = s.seq_len;
    const Rotary rotary(source.positions().rope, D);
    for (int layer = 0; layer < g.layers; ++layer) {
      LayerTensors tensors = source.load(layer);
      std::vector<std::vector<GridNeedle>> needles(s.heads, std::vector<GridNeedle>(g.depths.size()));
      parallel_for(s.heads, g.threads, [&](int64_t h) {
        std::vector<double> keys_post(static_cast<size_t>(S) * D), values(keys_post.size());
        for (int64_t t = 0; t < S; ++t) {
          for (int d = 0; d < D; ++d) {
            keys_post[t * D + d] = tensors.keys[(static_cast<size_t>(h) * S + t) * D + d];
            values[t * D + d] = tensors.values[(static_cast<size_t>(h) * S + t) * D + d];
          }
          rotary.apply(&keys_post[t * D], static_cast<double>(t));
        }
        plant_head(layer, static_cast<int>(h), s, rotary, g, tensors, keys_post, values, needles[h]);
      });
      for (const auto &head : needles)
        for (const GridNeedle &n : head) {
          if (n.position < 0) {
            ++unplaced;
            continue;
          }
          ++planted;
          exact_reached += n.exact_cosine >= g.threshold;
          if (!n.in_window) {
            max_quantile = std::max(max_quantile, n.window_quantile);
            quantile_sum += n.window_quantile;
            ++quantile_count;
            auto &[sum, mx, count] = quantiles[{li, static_cast<size_t>(n.depth_index)}];
            sum += n.window_quantile;
            mx = std::max(mx, n.window_quantile);
            ++count;
          }
        }
      const std::vector<uint8_t> keys = encode_dtype(tensors.keys, AKV_DTYPE_F32);
      const std::vector<uint8_t> values = encode_dtype(tensors.values, AKV_DTYPE_F32);
      const std::vector<uint8_t> q_window = encode_dtype(tensors.q_window, AKV_DTYPE_F32);
      say("S=" + std::to_string(S) + " layer " + std::to_string(layer + 1) + "/" + std::to_string(g.layers) +
          ": needles planted (" + format_seconds(clock.seconds()) + ")");
      for (size_t ri = 0; ri < plan.size(); ++ri) {
        if (!failures[ri].empty()) continue;
        const MethodRun &run = plan[ri];
        akv_compress_options o = method_options(run, s.window, layer, g.layers);
        o.rope = source.positions().rope.to_library();
        akv_prefill prefill;
        akv_prefill_init(&prefill);
        prefill.shape = {S, s.heads, s.q_heads, D};
        prefill.dtype = AKV_DTYPE_F32;
        prefill.keys = keys.data();
        prefill.values = values.data();
        if (run.entry->uses_window_queries) {
          prefill.queries = q_window.data() + static_cast<size_t>(s.window - o.window) * D * sizeof(float);
          prefill.q_head_stride = static_cast<int64_t>(s.window) * D;
        }
        const std::string label = std::string(run.entry->name) + " " + run.target_label();
        akv_cache *raw = nullptr;
        try {
          check(akv_compress(context.get(), &prefill, &o, &raw, nullptr), label + ": akv_compress");
        } catch (const CliError &error) {
          failures[ri] = error.what();
          std::cerr << "anchorkv eval --reach-grid: " << failures[ri] << std::endl;
          continue;
        }
        CacheHandle cache(raw);
        akv_cache_stats stats{};
        stats.struct_size = sizeof stats;
        check(akv_cache_stats_get(cache.get(), &stats), label + ": akv_cache_stats_get");
        bytes[{ri, li}].first += stats.full_bytes;
        bytes[{ri, li}].second += stats.compressed_bytes;
        std::vector<float> query(static_cast<size_t>(s.q_heads) * D, 0.0f), out(query.size());
        for (size_t di = 0; di < g.depths.size(); ++di) {
          // Every query head of a group carries its KV head's probe; slot h*G is read.
          for (int h = 0; h < s.heads; ++h) {
            const GridNeedle &n = needles[h][di];
            for (int gi = 0; gi < G; ++gi)
              for (int d = 0; d < D; ++d)
                query[(static_cast<size_t>(h) * G + gi) * D + d] = n.position >= 0 ? n.probe[d] : 0.0f;
          }
          check(akv_decode(cache.get(), query.data(), AKV_DTYPE_F32, 1, out.data(), nullptr), label + ": akv_decode");
          for (int h = 0; h < s.heads; ++h) {
            const GridNeedle &n = needles[h][di];
            if (n.position < 0) continue;
            std::vector<double> o_row(out.begin() + static_cast<size_t>(h) * G * D,
                                      out.begin() + (static_cast<size_t>(h) * G + 1) * D);
            const double c = cosine(o_row.data(), n.value.data(), D);
            Tally &cell = cells[{ri, li, di}];
            ++cell.total;
            cell.reached += c >= g.threshold;
            cell.cosine_sum += c;
          }
        }
      }
      say("S=" + std::to_string(S) + " layer " + std::to_string(layer + 1) + ": methods done (" +
          format_seconds(clock.seconds()) + ")");
    }
  }

  auto measured_ratio = [&](size_t ri, size_t li) {
    const auto it = bytes.find({ri, li});
    return it == bytes.end() || it->second.second == 0 ? std::nan("")
                                                        : static_cast<double>(it->second.first) / it->second.second;
  };
  if (g.csv) {
    std::printf("method,target,ratio,seq_len,depth_percent,needles,reached,reach,mean_cosine,in_window,"
                "mean_window_quantile,max_window_quantile\n");
    for (size_t ri = 0; ri < plan.size(); ++ri)
      for (size_t li = 0; li < g.lengths.size(); ++li)
        for (size_t di = 0; di < g.depths.size(); ++di) {
          const auto it = cells.find({ri, li, di});
          if (it == cells.end()) continue;
          const Tally &t = it->second;
          const int64_t p = 4 + std::llround(g.depths[di] * static_cast<double>(g.lengths[li] - 5));
          const auto q = quantiles.find({li, di});
          const bool has_q = q != quantiles.end() && std::get<2>(q->second) > 0;
          std::printf("%s,%s,%.4f,%lld,%.6g,%lld,%lld,%.4f,%.6f,%d,%s,%s\n", plan[ri].entry->name,
                      plan[ri].target_label().c_str(), measured_ratio(ri, li), static_cast<long long>(g.lengths[li]),
                      100.0 * g.depths[di], static_cast<long long>(t.total), static_cast<long long>(t.reached),
                      t.total ? static_cast<double>(t.reached) / t.total : std::nan(""),
                      t.total ? t.cosine_sum / t.total : std::nan(""), p >= g.lengths[li] - g.window ? 1 : 0,
                      has_q ? format_fixed(std::get<0>(q->second) / std::get<2>(q->second), 4).c_str() : "",
                      has_q ? format_fixed(std::get<1>(q->second), 4).c_str() : "");
        }
  } else {
    std::printf("anchorkv eval --reach-grid: synthetic data (seed %llu), H=%d Hq=%d D=%d, window queries %d, %d layers;"
                " %lld needles planted (%lld not plantable), exact attention reaches %lld; needles' window-score"
                " quantile mean %.2f, max %.2f (the window does not single them out); reached: cos >= %.2f\n\n",
                static_cast<unsigned long long>(g.seed), g.heads, g.q_heads, g.head_dim, g.window, g.layers,
                static_cast<long long>(planted), static_cast<long long>(unplaced), static_cast<long long>(exact_reached),
                quantile_count ? quantile_sum / quantile_count : std::nan(""), max_quantile, g.threshold);
    std::printf("%-14s %6s", "method", "target");
    for (int64_t S : g.lengths) std::printf(" %9s", ("S=" + std::to_string(S)).c_str());
    std::printf(" %9s\n", "mean");
    for (size_t ri = 0; ri < plan.size(); ++ri) {
      std::printf("%-14s %6s", plan[ri].entry->name, plan[ri].target_label().c_str());
      if (!failures[ri].empty()) {
        std::printf("  FAILED: %s\n", failures[ri].c_str());
        continue;
      }
      int64_t all_reached = 0, all_total = 0;
      for (size_t li = 0; li < g.lengths.size(); ++li) {
        int64_t reached = 0, total = 0;
        for (size_t di = 0; di < g.depths.size(); ++di) {
          const auto it = cells.find({ri, li, di});
          if (it == cells.end()) continue;
          reached += it->second.reached;
          total += it->second.total;
        }
        all_reached += reached;
        all_total += total;
        std::printf(" %9s", total ? format_fixed(static_cast<double>(reached) / total, 3).c_str() : "-");
      }
      std::printf(" %9s\n", all_total ? format_fixed(static_cast<double>(all_reached) / all_total, 3).c_str() : "-");
    }
    std::printf("\nshare of needles reached per context length (mean over depths); per-depth cells: --csv; took %s\n",
                format_seconds(clock.seconds()).c_str());
  }
  bool failed = false;
  for (const std::string &f : failures) failed |= !f.empty();
  return failed ? kExitFailure : kExitOk;
}

}  // namespace akvcli
