// Compress one layer's KV cache ~10x, decode a new token, compare with exact attention.
// The C API wrapped in RAII owners and exceptions, as a C++ engine would hold it.
#include <anchorkv/anchorkv.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

constexpr int H = 2, HQ = 4, S = 1024, D = 64, W = 32;  // KV heads, query heads, prompt, head dim, window

struct Error : std::runtime_error {
  akv_status status;
  Error(akv_status s, const std::string &what)
      : std::runtime_error(std::string(akv_status_string(s)) + ": " + akv_last_error_message() + " (" + what + ")"),
        status(s) {}
};
void check(akv_status status, const char *what) {
  if (status != AKV_OK) throw Error(status, what);
}

struct ContextDeleter {
  void operator()(akv_context *c) const { akv_context_destroy(c); }
};
struct CacheDeleter {
  void operator()(akv_cache *c) const { akv_cache_destroy(c); }
};
using Context = std::unique_ptr<akv_context, ContextDeleter>;
using Cache = std::unique_ptr<akv_cache, CacheDeleter>;  // destroy caches before their context

Context make_context() {
  akv_context *raw = nullptr;
  check(akv_context_create(nullptr, &raw), "akv_context_create");
  return Context(raw);
}

struct Rng {  // xorshift64 + Box-Muller
  uint64_t state = 0x2545f4914f6cdd1dULL;
  double uniform() {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return (static_cast<double>(state >> 11) + 0.5) / 9007199254740992.0;
  }
  double gaussian() { return std::sqrt(-2.0 * std::log(uniform())) * std::cos(6.283185307179586 * uniform()); }
};

// NeoX RoPE (base 10000) of one row at `position`: what the model applied to its keys.
std::vector<double> rope(const float *row, int position) {
  std::vector<double> out(row, row + D);
  for (int i = 0; i < D / 2; ++i) {
    const double angle = position * std::pow(10000.0, -static_cast<double>(i) / (D / 2));
    const double a = out[i], b = out[i + D / 2];
    out[i] = a * std::cos(angle) - b * std::sin(angle);
    out[i + D / 2] = b * std::cos(angle) + a * std::sin(angle);
  }
  return out;
}

}  // namespace

int main() try {
  Rng rng;
  // Synthetic layer: keys drift smoothly over 8 directions per head; values are noise.
  std::vector<double> basis(H * 8 * D);
  for (double &b : basis) b = rng.gaussian();
  std::vector<float> keys(size_t{H} * S * D), values(size_t{H} * S * D);
  std::vector<std::vector<double>> rotated(size_t{H} * S);
  for (int h = 0; h < H; ++h) {
    double walk[8] = {};
    for (int t = 0; t < S; ++t) {
      for (double &w : walk) w += rng.gaussian() / std::sqrt(S);
      float *row = &keys[(size_t{1} * h * S + t) * D];
      for (int d = 0; d < D; ++d) {
        double drift = 0;
        for (int r = 0; r < 8; ++r) drift += walk[r] * basis[(h * 8 + r) * D + d];
        row[d] = static_cast<float>(drift + 0.3 * rng.gaussian());
      }
      rotated[size_t{1} * h * S + t] = rope(row, t);
    }
  }
  for (float &v : values) v = static_cast<float>(rng.gaussian());
  std::vector<int> topics(HQ * 4);
  for (int &t : topics) t = static_cast<int>(rng.uniform() * (S - W));
  auto query_row = [&](int j, float *row) {  // head j looks for one of its "topic" tokens
    const std::vector<double> &key = rotated[size_t{1} * (j / (HQ / H)) * S + topics[j * 4 + static_cast<int>(rng.uniform() * 4)]];
    double norm = 0;
    for (double k : key) norm += k * k;
    for (int d = 0; d < D; ++d) row[d] = static_cast<float>(3.0 * key[d] / std::sqrt(norm) * std::pow(D, 0.25) + 0.5 * rng.gaussian());
  };
  std::vector<float> window(size_t{HQ} * W * D), query(HQ * D), out(HQ * D);
  for (int j = 0; j < HQ; ++j)
    for (int w = 0; w < W; ++w) query_row(j, &window[(size_t{1} * j * W + w) * D]);
  for (int j = 0; j < HQ; ++j) query_row(j, &query[j * D]);

  Context context = make_context();
  akv_compress_options options;
  akv_compress_options_init(&options);
  options.retain_fraction = 0.1;
  akv_prefill prefill;
  akv_prefill_init(&prefill);
  prefill.shape = akv_shape{S, H, HQ, D};
  prefill.dtype = AKV_DTYPE_F32;
  prefill.keys = keys.data();
  prefill.values = values.data();
  prefill.queries = window.data();
  Cache cache = [&] {
    akv_cache *raw = nullptr;
    check(akv_compress(context.get(), &prefill, &options, &raw, nullptr), "akv_compress");
    return Cache(raw);
  }();
  check(akv_decode(cache.get(), query.data(), AKV_DTYPE_F32, 1, out.data(), nullptr), "akv_decode");

  // Exact attention over the original keys and values.
  std::vector<double> expected(HQ * D, 0.0), logits(S);
  for (int j = 0; j < HQ; ++j) {
    const int h = j / (HQ / H);
    double max = -INFINITY, total = 0;
    for (int t = 0; t < S; ++t) {
      double dot = 0;
      for (int d = 0; d < D; ++d) dot += rotated[size_t{1} * h * S + t][d] * query[j * D + d];
      logits[t] = dot / std::sqrt(D);
      max = std::max(max, logits[t]);
    }
    for (double &l : logits) total += (l = std::exp(l - max));
    for (int t = 0; t < S; ++t)
      for (int d = 0; d < D; ++d) expected[j * D + d] += logits[t] / total * values[(size_t{1} * h * S + t) * D + d];
  }
  double dot = 0, norm_out = 0, norm_expected = 0;
  for (int i = 0; i < HQ * D; ++i) {
    dot += out[i] * expected[i];
    norm_out += double{out[i]} * out[i];
    norm_expected += expected[i] * expected[i];
  }
  const double cosine = dot / std::sqrt(norm_out * norm_expected);

  akv_cache_stats stats{};
  stats.struct_size = sizeof stats;
  check(akv_cache_stats_get(cache.get(), &stats), "akv_cache_stats_get");

  // An error is an exception carrying the status and the library's message.
  bool budget_error_seen = false;
  try {
    akv_compress_options tiny = options;
    tiny.retain_fraction = 0.001;
    akv_cache *raw = nullptr;
    check(akv_compress(context.get(), &prefill, &tiny, &raw, nullptr), "akv_compress at 0.1%");
  } catch (const Error &error) {
    budget_error_seen = error.status == AKV_ERR_BUDGET;
  }

  std::printf("anchorkv C++: %.1fx smaller (%llu of %llu bytes), cosine to exact attention %.4f\n", stats.ratio,
              static_cast<unsigned long long>(stats.compressed_bytes), static_cast<unsigned long long>(stats.full_bytes),
              cosine);
  const bool ok = budget_error_seen && stats.compressed_bytes <= stats.budget_bytes && cosine > 0.8;
  if (!ok) std::fprintf(stderr, "check failed\n");
  return ok ? 0 : 1;
} catch (const std::exception &error) {
  std::fprintf(stderr, "%s\n", error.what());
  return 1;
}
