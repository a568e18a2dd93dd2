#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/error.hpp"
#include "core/layout.hpp"
#include "methods/eviction.hpp"

namespace akv {

std::vector<int64_t> pyramid_schedule(int64_t base, int64_t prefix, int32_t beta, int32_t layer_count) {
  const int64_t L = layer_count;
  if (L <= 1) return std::vector<int64_t>(std::max<int64_t>(L, 1), base);
  // Budgets as numerators over beta: max = base(2 beta - 1)/beta, min = base/beta; clamped:
  // max = P, min = 2 base - P. Both cases keep (max + min)/2 = base.
  __int128 mx = static_cast<__int128>(base) * (2 * beta - 1), mn = base;
  if (base * (2 * static_cast<int64_t>(beta) - 1) >= prefix * static_cast<int64_t>(beta)) {
    mx = static_cast<__int128>(prefix) * beta;
    mn = static_cast<__int128>(2 * base - prefix) * beta;
  }
  // Running sum of the first n real budgets, times beta(L-1):
  //   n*mx*(L-1) - (mx - mn)*n(n-1)/2.
  const __int128 denom = static_cast<__int128>(beta) * (L - 1);
  auto floor_running = [&](int64_t n) -> int64_t {
    const __int128 num = static_cast<__int128>(n) * mx * (L - 1) - (mx - mn) * (static_cast<__int128>(n) * (n - 1) / 2);
    __int128 q = num / denom;
    if (num % denom != 0 && num < 0) --q;
    return static_cast<int64_t>(q);
  };
  std::vector<int64_t> out(L);
  for (int64_t l = 0; l < L; ++l)
    out[l] = std::clamp<int64_t>(floor_running(l + 1) - floor_running(l), 0, prefix);
  return out;
}

std::vector<int64_t> adakv_counts(const std::vector<int64_t> &selected, int64_t base, double alpha) {
  const int64_t H = static_cast<int64_t>(selected.size());
  const int64_t target = H * base;
  std::vector<int64_t> out(H);
  std::vector<std::pair<double, int64_t>> remainders(H);
  int64_t assigned = 0;
  for (int64_t h = 0; h < H; ++h) {
    const double real = static_cast<double>(selected[h]) * (1.0 - alpha) + alpha * static_cast<double>(base);
    out[h] = static_cast<int64_t>(std::floor(real + 1e-9));
    remainders[h] = {real - static_cast<double>(out[h]), h};
    assigned += out[h];
  }
  // Largest remainder: the heads whose rounding was cut most get the missing tokens.
  std::stable_sort(remainders.begin(), remainders.end(),
                   [](const auto &a, const auto &b) { return a.first > b.first; });
  for (int64_t i = 0; assigned < target && i < H; ++i, ++assigned) ++out[remainders[i].second];
  for (int64_t i = H - 1; assigned > target && i >= 0; --i)  // floating slack only
    if (out[remainders[i].second] > 0) --out[remainders[i].second], --assigned;
  return out;
}

EvictionScore eviction_score(akv_method method) {
  switch (method) {
    case AKV_METHOD_ANDPRO: return EvictionScore::kAnDPro;
    case AKV_METHOD_TOVA: return EvictionScore::kLastQuery;
    case AKV_METHOD_KNORM: return EvictionScore::kKeyNorm;
    case AKV_METHOD_STREAMINGLLM: return EvictionScore::kRecency;
    default: return EvictionScore::kPooledWindow;
  }
}

EvictionBudget eviction_budget(const akv_compress_options &o, const akv_shape &s) {
  require(s.seq_len > o.window, AKV_ERR_INVALID_ARGUMENT, "seq_len ", s.seq_len, " must exceed the window ",
          o.window, " for the eviction methods");
  if (o.method == AKV_METHOD_ADAKV)
    require(std::isfinite(o.adakv_alpha) && o.adakv_alpha >= 0.0 && o.adakv_alpha <= 1.0, AKV_ERR_INVALID_ARGUMENT,
            "adakv_alpha ", o.adakv_alpha, " must be in [0, 1]");
  if (o.method == AKV_METHOD_PYRAMIDKV)
    require(o.pyramid_beta >= 1, AKV_ERR_INVALID_ARGUMENT, "pyramid_beta ", o.pyramid_beta, " must be >= 1");
  if (o.method == AKV_METHOD_ANDPRO)
    require(o.andpro_chunk >= 1 && o.andpro_chunk <= 64, AKV_ERR_INVALID_ARGUMENT, "andpro_chunk ", o.andpro_chunk,
            " must be in [1, 64]");
  EvictionBudget b;
  b.seq_len = s.seq_len;
  b.heads = s.num_kv_heads;
  b.window = o.window;
  b.prefix = s.seq_len - o.window;
  const int64_t always_first = o.method == AKV_METHOD_ANDPRO         ? o.andpro_chunk
                               : o.method == AKV_METHOD_STREAMINGLLM ? o.sink_tokens
                                                                     : 0;
  b.first_chunk = static_cast<int32_t>(std::min<int64_t>(always_first, b.prefix));
  const uint64_t token_bytes = 4ull * s.head_dim;  // key + value, 2 bytes per coordinate
  b.full_bytes = token_bytes * s.seq_len * s.num_kv_heads;
  const double budget = o.retain_fraction * static_cast<double>(b.full_bytes);
  b.budget_bytes = static_cast<uint64_t>(std::floor(budget));
  b.per_head = static_cast<int64_t>(std::floor(o.retain_fraction * static_cast<double>(s.seq_len)));
  while (b.per_head > 0 && static_cast<double>(token_bytes * b.per_head * s.num_kv_heads) > budget) --b.per_head;
  const int64_t always = b.window + b.first_chunk;
  if (b.per_head < always)
    fail(AKV_ERR_BUDGET, "retain_fraction ", o.retain_fraction, " keeps ", b.per_head, " tokens per head (floor(",
         o.retain_fraction, " * S=", s.seq_len, ")), fewer than the ", always, " always kept (window ", b.window,
         b.first_chunk ? (o.method == AKV_METHOD_ANDPRO ? " and the first chunk" : " and the sink tokens") : "",
         "); the smallest workable retain_fraction is ",
         minimum_retain_fraction(token_bytes * always * s.num_kv_heads, b.full_bytes));
  const int64_t base = b.per_head - b.window;  // evictable budget per head, SnapKV's C - W
  switch (o.method) {
    case AKV_METHOD_SNAPKV:
    case AKV_METHOD_TOVA:
    case AKV_METHOD_KNORM:
    case AKV_METHOD_STREAMINGLLM:
      b.head_tokens = b.per_head;
      break;
    case AKV_METHOD_PYRAMIDKV:
      b.head_tokens = b.window + pyramid_schedule(base, b.prefix, o.pyramid_beta, o.layer_count)[o.layer_index];
      break;
    default:
      b.head_tokens = -1;  // ragged over heads
  }
  b.layer_tokens = b.head_tokens >= 0 ? b.head_tokens * b.heads : b.per_head * b.heads;
  b.footprint = token_bytes * static_cast<uint64_t>(b.layer_tokens);
  return b;
}

void cap_counts(std::vector<int64_t> &counts, int64_t prefix) {
  int64_t excess = 0;
  for (int64_t &c : counts)
    if (c > prefix) excess += c - prefix, c = prefix;
  for (size_t h = 0; h < counts.size() && excess > 0; ++h) {
    const int64_t add = std::min(excess, prefix - counts[h]);
    counts[h] += add;
    excess -= add;
  }
}

std::vector<int64_t> adopt_kept_tokens(std::vector<std::vector<int32_t>> &kept, const EvictionBudget &b,
                                       const std::vector<int32_t> &positions, akv_cache &cache) {
  const int H = b.heads;
  std::vector<int64_t> first(H + 1, 0);
  cache.meta.dense_counts.assign(H, 0);
  for (int h = 0; h < H; ++h) {
    std::sort(kept[h].begin(), kept[h].end());
    for (int64_t t = b.prefix; t < b.seq_len; ++t) kept[h].push_back(static_cast<int32_t>(t));
    cache.meta.dense_counts[h] = static_cast<int64_t>(kept[h].size());
    first[h + 1] = first[h] + cache.meta.dense_counts[h];
  }
  const int64_t total = first[H];
  require(total == b.layer_tokens, AKV_ERR_INTERNAL, "eviction kept ", total, " tokens, the budget says ",
          b.layer_tokens);
  cache.dense_tokens.clear();
  cache.dense_tokens.reserve(total);
  for (int h = 0; h < H; ++h) cache.dense_tokens.insert(cache.dense_tokens.end(), kept[h].begin(), kept[h].end());
  cache.dense_positions = positions;
  cache.next_position = static_cast<int64_t>(positions[b.seq_len - 1]) + 1;
  return first;
}

void andpro_fill(const std::vector<uint32_t> &order, const EvictionBudget &b, int chunk, int64_t chunks,
                 const uint8_t *present, const BestTokens &best, std::vector<std::vector<int32_t>> &kept) {
  const int64_t P = b.prefix, S = b.seq_len, c0 = b.first_chunk;
  const int64_t first_evictable = (c0 + chunk - 1) / chunk;  // chunk 0 is the protected one
  int64_t left = static_cast<int64_t>(b.heads) * (b.per_head - b.window - c0);
  for (uint32_t id : order) {
    if (left == 0) break;
    const int h = static_cast<int>(id / chunks);
    const int64_t j = id % chunks;
    if (j < first_evictable) continue;
    const int64_t t0 = j * chunk, t1 = std::min<int64_t>(t0 + chunk, P);
    const uint8_t *here_present = present ? present + static_cast<size_t>(h) * S : nullptr;
    int64_t here = 0;  // tokens of the chunk that can be kept (compaction: not evicted before)
    for (int64_t t = t0; t < t1; ++t) here += !here_present || here_present[t];
    if (here <= left) {
      for (int64_t t = t0; t < t1; ++t)
        if (!here_present || here_present[t]) kept[h].push_back(static_cast<int32_t>(t));
      left -= here;
    } else {
      for (int32_t t : best(h, t0, t1, left)) kept[h].push_back(t);
      left = 0;
    }
  }
  for (int h = 0; h < b.heads; ++h)
    for (int64_t t = 0; t < c0; ++t) kept[h].push_back(static_cast<int32_t>(t));
}

}  // namespace akv
