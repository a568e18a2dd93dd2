// `anchorkv eval --generate N`: a synthetic long generation. A prompt of S tokens is
// compressed, then N generated tokens are appended one at a time, each decoded with its own
// query, and the caches are compared at the end and along the way:
//   - FullKV (exact), the reference and M_full;
//   - AnchorKV with the dense suffix (the paper: every generated token stays exact);
//   - AnchorKV with compaction (compact_after = --compact-after: the policy folds the suffix
//     back into the compressed form, headroom as the policy sets it);
//   - SnapKV with a dense suffix, and the decode-time variants of SnapKV and AnDPro (the same
//     policy re-evicts at the budget of the current length);
//   - the dense-suffix cache compacted once at the end (akv_cache_compact, headroom 0);
//   - the compacted cache with its last suffix folded too (akv_cache_compact, headroom 0):
//     the same length and budget as
//   - AnchorKV compressed in one go at the final length (the target of the fidelity bound).
// Data: K/V of S + N tokens from the synthetic generator of `anchorkv eval` (topic segments
// over the whole sequence, so the generated text moves through topics too). Queries (post-RoPE)
// are made here: a query at position p points at the post-RoPE keys of a "focus" stretch of
// 128 tokens (the mean direction of 8 of its tokens, scaled to logit ~5) plus N(0, 0.8) noise.
// The focus drifts: every 256 steps it moves to the recent text or to a random earlier
// stretch (50/50), and 30% of the queries look at another random earlier stretch. The window
// queries of the prompt come from the same recipe; the held-out probes at the end look at
// random stretches of the whole sequence (recall).
// Reported: mean cosine of each cache's decode against FullKV over the probes (per layer and
// query head), the footprint at the end, the largest footprint / (theta M_full) over the steps
// after the first compaction, and the time of one compaction per 1K suffix tokens. --curve
// writes the memory curve (CSV: step, tokens, bytes per method, theta*M_full).
#include <cxxopts.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iostream>

#include "commands.hpp"
#include "common.hpp"
#include "rope.hpp"
#include "synthetic.hpp"

namespace akvcli {
namespace {

struct GenerateSettings {
  int64_t prompt = 4096, steps = 2048, compact_after = 256;
  int layers = 1, heads = 2, q_heads = 8, head_dim = 128, window = 32, probes = 16, every = 16;
  double retain = 0.1;
  uint64_t seed = 1;
  int threads = 0;
  std::string curve;
};

// Post-RoPE queries of the recipe above.
class QueryMaker {
 public:
  QueryMaker(const std::vector<float> &keys_post, int64_t tokens, const GenerateSettings &s, int layer)
      : k_(keys_post), T_(tokens), s_(s), rng_(Rng::keyed(s.seed, 0x9e7, layer)) {}

  // Queries [Hq][D] for position index p (0-based token index), given the focus stretch.
  std::vector<float> at(int64_t p, int64_t focus_begin) {
    const int D = s_.head_dim, G = s_.q_heads / s_.heads;
    std::vector<float> q(static_cast<size_t>(s_.q_heads) * D);
    for (int hq = 0; hq < s_.q_heads; ++hq) {
      const int h = hq / G;
      int64_t begin = focus_begin;
      if (rng_.uniform() < 0.3) begin = stretch_before(p);
      const int64_t end = std::min(begin + 128, p);
      std::vector<double> dir(D, 0.0);
      for (int i = 0; i < 8; ++i) {
        const int64_t t = begin + rng_.below(std::max<int64_t>(1, end - begin));
        for (int d = 0; d < D; ++d) dir[d] += k_[(h * T_ + t) * D + d];
      }
      const double n = std::sqrt(dot(dir.data(), dir.data(), D));
      double along = 0.0;  // mean key component along the direction
      for (int i = 0; i < 8; ++i) {
        const int64_t t = begin + rng_.below(std::max<int64_t>(1, end - begin));
        for (int d = 0; d < D; ++d) along += k_[(h * T_ + t) * D + d] * dir[d] / n / 8.0;
      }
      const double c = 5.0 * std::sqrt(static_cast<double>(D)) / std::max(1e-3, along);
      for (int d = 0; d < D; ++d) q[hq * D + d] = static_cast<float>(c * dir[d] / n + 0.8 * rng_.normal());
    }
    return q;
  }
  int64_t stretch_before(int64_t p) { return rng_.below(std::max<int64_t>(1, p - 128)); }
  Rng &rng() { return rng_; }

 private:
  const std::vector<float> &k_;
  int64_t T_;
  const GenerateSettings &s_;
  Rng rng_;
};

std::vector<float> slice(const std::vector<float> &x, int H, int64_t T, int D, int64_t from, int64_t count) {
  std::vector<float> out(static_cast<size_t>(H) * count * D);
  for (int h = 0; h < H; ++h) std::copy_n(&x[(h * T + from) * D], count * D, &out[h * count * D]);
  return out;
}

uint64_t bytes_of(akv_cache *cache) {
  akv_cache_stats s{};
  s.struct_size = sizeof s;
  check(akv_cache_stats_get(cache, &s), "akv_cache_stats_get");
  return s.compressed_bytes + s.appended_bytes;
}

akv_cache_stats stats_of(akv_cache *cache) {
  akv_cache_stats s{};
  s.struct_size = sizeof s;
  check(akv_cache_stats_get(cache, &s), "akv_cache_stats_get");
  return s;
}

CacheHandle clone(akv_context *ctx, akv_cache *cache) {
  size_t n = 0;
  check(akv_cache_serialized_size(cache, &n), "akv_cache_serialized_size");
  std::vector<uint8_t> bytes(n);
  check(akv_cache_serialize(cache, bytes.data(), n, nullptr, nullptr), "akv_cache_serialize");
  akv_cache *copy = nullptr;
  check(akv_cache_deserialize(ctx, bytes.data(), n, &copy, nullptr), "akv_cache_deserialize");
  return CacheHandle(copy);
}

CacheHandle compress(akv_context *ctx, const std::vector<float> &keys, const std::vector<float> &values,
                     const std::vector<float> &window_q, const EvalShape &shape, int64_t tokens,
                     const akv_compress_options &o) {
  akv_prefill p;
  akv_prefill_init(&p);
  p.shape = akv_shape{tokens, shape.heads, shape.q_heads, shape.head_dim};
  p.dtype = AKV_DTYPE_F32;
  p.keys = keys.data();
  p.values = values.data();
  p.queries = o.method == AKV_METHOD_FULLKV ? nullptr : window_q.data();
  akv_cache *cache = nullptr;
  check(akv_compress(ctx, &p, &o, &cache, nullptr), "akv_compress");
  return CacheHandle(cache);
}

}  // namespace

int run_generate(int argc, char **argv) {
  cxxopts::Options options("anchorkv eval --generate", "A synthetic long generation: the memory curve and the "
                                                       "fidelity at the end with and without compaction (akv_cache_compact).\n");
  GenerateSettings st;
  // clang-format off
  options.add_options()
    ("generate", "generated tokens N", cxxopts::value<int64_t>(st.steps))
    ("seq-len", "prompt tokens S", cxxopts::value<int64_t>(st.prompt)->default_value("4096"))
    ("compact-after", "AnchorKV policy: compact when the suffix exceeds this many tokens", cxxopts::value<int64_t>(st.compact_after)->default_value("256"))
    ("retain", "retained fraction theta", cxxopts::value<double>(st.retain)->default_value("0.1"))
    ("layers", "layers", cxxopts::value<int>(st.layers)->default_value("1"))
    ("heads", "KV heads", cxxopts::value<int>(st.heads)->default_value("2"))
    ("q-heads", "query heads", cxxopts::value<int>(st.q_heads)->default_value("8"))
    ("head-dim", "head dim", cxxopts::value<int>(st.head_dim)->default_value("128"))
    ("window", "observation window W", cxxopts::value<int>(st.window)->default_value("32"))
    ("probes", "held-out probe queries at the end, per query head", cxxopts::value<int>(st.probes)->default_value("16"))
    ("curve", "write the memory curve (CSV) here", cxxopts::value<std::string>(st.curve))
    ("every", "curve: one row every this many steps", cxxopts::value<int>(st.every)->default_value("16"))
    ("seed", "data seed", cxxopts::value<uint64_t>(st.seed)->default_value("1"))
    ("threads", "CPU threads (0 = all)", cxxopts::value<int>(st.threads)->default_value("0"))
    ("h,help", "this help");
  // clang-format on
  const cxxopts::ParseResult args = parse_arguments(options, argc, argv, "anchorkv eval --generate --help");
  if (args.count("help")) {
    std::cout << options.help() << std::endl;
    return 0;
  }
  if (st.steps <= st.window || st.prompt <= st.window || st.compact_after < st.window || st.every < 1 ||
      st.probes < 1 || st.layers < 1 || st.heads < 1 || st.q_heads % st.heads != 0)
    throw CliError("--generate and --seq-len must exceed --window, --compact-after must be at least --window, "
                   "--q-heads a multiple of --heads",
                   kExitUsage);
  const int64_t S = st.prompt, N = st.steps, T = S + N;
  const int H = st.heads, Hq = st.q_heads, D = st.head_dim, W = st.window;
  SyntheticConfig cfg;
  cfg.shape = EvalShape{st.layers, T, H, Hq, D, W, 1};
  cfg.seed = st.seed;
  cfg.threads = st.threads;
  SyntheticSource source(cfg);
  ContextHandle ctx = create_context(AKV_BACKEND_CPU, st.threads);
  const Rotary rotary(source.positions().rope, D);

  // The caches that follow the generation step by step (kLive of them), then the ones made at
  // the end.
  enum { kFull, kDense, kCompact, kSnapDense, kSnapDecode, kAndproDecode, kLive, kFolded = kLive, kOnce, kOneShot,
         kMethods };
  const char *names[kMethods] = {"FullKV", "AnchorKV (dense suffix)", "AnchorKV (compacted)",
                                 "SnapKV (dense suffix)", "SnapKV (decode-time)", "AnDPro (decode-time)",
                                 "AnchorKV (compacted, folded)", "AnchorKV (dense, folded at T)",
                                 "AnchorKV (one shot at T)"};
  std::vector<double> cos_sum(kMethods, 0.0), worst(kMethods, 0.0);
  std::vector<uint64_t> final_bytes(kMethods, 0);
  std::vector<std::vector<uint64_t>> curve;  // rows: step, tokens, then bytes of the live caches (all layers)
  double compact_seconds = 0.0, compact_suffix_tokens = 0.0, policy_seconds = 0.0;
  int64_t policy_compactions = 0, cells = 0;

  for (int layer = 0; layer < st.layers; ++layer) {
    const LayerTensors lt = source.load(layer);
    std::vector<float> post = lt.keys;  // post-RoPE, for the queries
    for (int h = 0; h < H; ++h)
      for (int64_t t = 0; t < T; ++t) rotary.apply(&post[(h * T + t) * D], static_cast<double>(t));
    QueryMaker qm(post, T, st, layer);
    auto window_queries = [&](const std::vector<std::vector<float>> &rows) {  // [W][Hq][D] -> [Hq][W][D]
      std::vector<float> q(static_cast<size_t>(Hq) * W * D);
      for (int w = 0; w < W; ++w)
        for (int hq = 0; hq < Hq; ++hq) std::copy_n(&rows[w][hq * D], D, &q[(hq * W + w) * D]);
      return q;
    };
    // Focus drift, then the prompt's window queries (positions S-W..S-1).
    int64_t focus = std::max<int64_t>(0, S - 128);
    std::vector<std::vector<float>> recent;
    for (int64_t p = S - W; p < S; ++p) recent.push_back(qm.at(p, focus));
    const std::vector<float> pk = slice(lt.keys, H, T, D, 0, S), pv = slice(lt.values, H, T, D, 0, S);
    const std::vector<float> pq = window_queries(recent);

    akv_compress_options full, anchor;
    akv_compress_options_init_method(&full, AKV_METHOD_FULLKV);
    akv_compress_options_init(&anchor);
    anchor.retain_fraction = st.retain;
    anchor.window = W;
    anchor.layer_index = layer;
    anchor.layer_count = st.layers;
    akv_compress_options policy = anchor;
    policy.compact_after = st.compact_after;
    auto eviction = [&](akv_method method, int64_t compact_after) {
      akv_compress_options o;
      akv_compress_options_init_method(&o, method);
      o.retain_fraction = st.retain;
      o.window = W;  // the queries made here cover W positions
      o.compact_after = compact_after;
      return o;
    };
    CacheHandle caches[kLive] = {compress(ctx.get(), pk, pv, pq, cfg.shape, S, full),
                                 compress(ctx.get(), pk, pv, pq, cfg.shape, S, anchor),
                                 compress(ctx.get(), pk, pv, pq, cfg.shape, S, policy),
                                 compress(ctx.get(), pk, pv, pq, cfg.shape, S, eviction(AKV_METHOD_SNAPKV, 0)),
                                 compress(ctx.get(), pk, pv, pq, cfg.shape, S,
                                          eviction(AKV_METHOD_SNAPKV, st.compact_after)),
                                 compress(ctx.get(), pk, pv, pq, cfg.shape, S,
                                          eviction(AKV_METHOD_ANDPRO, st.compact_after))};
    std::vector<float> out(static_cast<size_t>(Hq) * D);
    std::vector<float> k(static_cast<size_t>(H) * D), v(k.size());
    for (int64_t i = 0; i < N; ++i) {
      const int64_t p = S + i;
      if (i % 256 == 0) focus = qm.rng().uniform() < 0.5 ? std::max<int64_t>(0, p - 128) : qm.stretch_before(p);
      for (int h = 0; h < H; ++h) {
        std::copy_n(&lt.keys[(h * T + p) * D], D, &k[h * D]);
        std::copy_n(&lt.values[(h * T + p) * D], D, &v[h * D]);
      }
      const std::vector<float> q = qm.at(p, focus);
      recent.push_back(q);
      for (int m = 0; m < kLive; ++m) {
        check(akv_append(caches[m].get(), k.data(), v.data(), AKV_DTYPE_F32, 1, nullptr, nullptr), "akv_append");
        const int64_t before = m == kCompact ? stats_of(caches[m].get()).compactions : 0;
        Stopwatch sw;
        check(akv_decode(caches[m].get(), q.data(), AKV_DTYPE_F32, 1, out.data(), nullptr), "akv_decode");
        if (m == kCompact && stats_of(caches[m].get()).compactions > before) {
          policy_seconds += sw.seconds();
          ++policy_compactions;
        }
      }
      if (i % st.every == 0 || i == N - 1) {
        const size_t row = static_cast<size_t>(i / st.every + (i == N - 1 && i % st.every ? 1 : 0));
        if (layer == 0) {
          curve.push_back({static_cast<uint64_t>(i + 1), static_cast<uint64_t>(p + 1)});
          curve.back().resize(2 + kLive, 0);
        }
        for (int m = 0; m < kLive; ++m) curve[row][2 + m] += bytes_of(caches[m].get());
      }
    }
    // One-shot compression at T with the queries of the last W generated tokens.
    const std::vector<float> last_w = window_queries({recent.end() - W, recent.end()});
    CacheHandle one_shot = compress(ctx.get(), lt.keys, lt.values, last_w, cfg.shape, T, anchor);
    // The explicit call's time on a copy of the dense-suffix cache (the whole N-token suffix).
    CacheHandle whole = clone(ctx.get(), caches[kDense].get());
    Stopwatch sw;
    check(akv_cache_compact(whole.get(), last_w.data(), AKV_DTYPE_F32, 0, nullptr), "akv_cache_compact");
    compact_seconds += sw.seconds();
    compact_suffix_tokens += static_cast<double>(N);
    // The compacted cache with its last suffix folded too (headroom 0): the same length and
    // budget as the one-shot compression, for the fidelity bound.
    CacheHandle folded = clone(ctx.get(), caches[kCompact].get());
    if (stats_of(folded.get()).appended_tokens >= W)
      check(akv_cache_compact(folded.get(), last_w.data(), AKV_DTYPE_F32, 0, nullptr), "akv_cache_compact");
    akv_cache *all[kMethods];
    for (int m = 0; m < kLive; ++m) all[m] = caches[m].get();
    all[kFolded] = folded.get();
    all[kOnce] = whole.get();
    all[kOneShot] = one_shot.get();
    for (int m = 0; m < kMethods; ++m) final_bytes[m] += bytes_of(all[m]);
    std::vector<float> exact(out.size());
    for (int j = 0; j < st.probes; ++j) {
      const std::vector<float> q = qm.at(T - 1, qm.stretch_before(T - 1));
      check(akv_decode(all[kFull], q.data(), AKV_DTYPE_F32, 1, exact.data(), nullptr), "akv_decode");
      for (int m = 0; m < kMethods; ++m) {
        check(akv_decode(all[m], q.data(), AKV_DTYPE_F32, 1, out.data(), nullptr), "akv_decode");
        for (int hq = 0; hq < Hq; ++hq) {
          std::vector<double> e(exact.begin() + hq * D, exact.begin() + (hq + 1) * D);
          const double c = cosine(&out[hq * D], e.data(), D);
          cos_sum[m] += c;
          if (c < 0.9) worst[m] += 1.0;
        }
      }
      cells += Hq;
    }
  }

  // The budget after the first compaction: footprint / (theta M_full) over the steps.
  const double per_token = 4.0 * H * D * st.layers;
  double worst_ratio[kLive] = {};
  for (const auto &row : curve) {
    const double budget = st.retain * per_token * static_cast<double>(row[1]);
    if (row[1] <= static_cast<uint64_t>(S + st.compact_after)) continue;  // before the first compaction
    for (int m = 0; m < kLive; ++m) worst_ratio[m] = std::max(worst_ratio[m], row[2 + m] / budget);
  }
  std::printf("Generation: prompt S=%lld, N=%lld generated tokens, %d layer(s), H=%d, Hq=%d, D=%d, W=%d, "
              "theta=%g (%gx), compact_after=%lld, %d probes per query head\n",
              static_cast<long long>(S), static_cast<long long>(N), st.layers, H, Hq, D, W, st.retain,
              1.0 / st.retain, static_cast<long long>(st.compact_after), st.probes);
  std::printf("%-30s %14s %10s %10s %12s %16s\n", "method", "bytes at end", "x M_full", "mean cos", "cells<0.9",
              "max/(theta M)");
  const double m_full = per_token * static_cast<double>(T);
  for (int m = 0; m < kMethods; ++m)
    std::printf("%-30s %14llu %10.4f %10.4f %11.1f%% %16s\n", names[m], static_cast<unsigned long long>(final_bytes[m]),
                final_bytes[m] / m_full, cos_sum[m] / cells, 100.0 * worst[m] / cells,
                m < kLive && m != kFull ? format_fixed(worst_ratio[m], 4).c_str() : "");
  std::printf("mean cos against one shot at T: compacted %+.4f, compacted and folded %+.4f, dense folded once "
              "%+.4f (target: within 0.005)\n",
              (cos_sum[kCompact] - cos_sum[kOneShot]) / cells, (cos_sum[kFolded] - cos_sum[kOneShot]) / cells,
              (cos_sum[kOnce] - cos_sum[kOneShot]) / cells);
  std::printf("max/(theta M): the largest footprint / (theta M_full) over the steps after the first compaction"
              " (target <= 1 for the compacted caches)\n");
  std::printf("policy compactions: %lld, %.1f ms each (inside akv_decode)\n", static_cast<long long>(policy_compactions),
              policy_compactions ? 1e3 * policy_seconds / policy_compactions : 0.0);
  std::printf("one compaction of the whole %lld-token suffix at T=%lld: %.1f ms per 1K suffix tokens (CPU, %d threads)\n",
              static_cast<long long>(N), static_cast<long long>(T), 1e3 * compact_seconds / (compact_suffix_tokens / 1000.0),
              resolve_threads(st.threads));
  if (!st.curve.empty()) {
    std::FILE *f = std::fopen(st.curve.c_str(), "w");
    if (!f) throw CliError("--curve: cannot write \"" + st.curve + "\"");
    std::fprintf(f, "step,tokens,full,anchorkv_dense_suffix,anchorkv_compacted,snapkv_dense_suffix,snapkv_decode_time,"
                 "andpro_decode_time,theta_full\n");
    for (const auto &row : curve) {
      for (size_t c = 0; c < row.size(); ++c) std::fprintf(f, "%llu,", static_cast<unsigned long long>(row[c]));
      std::fprintf(f, "%.0f\n", st.retain * per_token * static_cast<double>(row[1]));
    }
    if (std::fclose(f) != 0) throw CliError("--curve: error writing \"" + st.curve + "\"");
  }
  return 0;
}

}  // namespace akvcli
