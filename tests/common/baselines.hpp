// Naive double-precision references of the eviction baselines (SPEC 5), written from the
// specification, independently of the library: window attention, SnapKV's pooled scores,
// PyramidKV's layer schedule, AdaKV's per-head counts and AnDPro's chunk scores.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

namespace akv_test {

// Window attention of one KV head: rows r = g*W + w (query head g of the group, window
// position w), each a softmax over the tokens t <= S-W+w. keys: [S][D] post-RoPE; queries:
// [G][W][D]. Returns [G*W][S] (zero where a row cannot see).
inline std::vector<double> window_attention_rows(const double *keys, int64_t S, int D, const double *queries, int G,
                                                 int W, double scale) {
  std::vector<double> a(static_cast<size_t>(G) * W * S, 0.0);
  for (int g = 0; g < G; ++g)
    for (int w = 0; w < W; ++w) {
      const double *q = queries + (static_cast<size_t>(g) * W + w) * D;
      double *row = &a[(static_cast<size_t>(g) * W + w) * S];
      const int64_t visible = S - W + w + 1;
      double mx = -INFINITY;
      for (int64_t t = 0; t < visible; ++t) {
        double z = 0.0;
        for (int d = 0; d < D; ++d) z += q[d] * keys[t * D + d];
        row[t] = z * scale;
        mx = std::max(mx, row[t]);
      }
      double sum = 0.0;
      for (int64_t t = 0; t < visible; ++t) sum += (row[t] = std::exp(row[t] - mx));
      for (int64_t t = 0; t < visible; ++t) row[t] /= sum;
    }
  return a;
}

// Pooling with kernel/2 padding: the average divides by the full kernel (zero padding), the
// max ignores the padding.
inline std::vector<double> pool_reference(const std::vector<double> &x, int kernel, bool max_pool) {
  const int64_t n = static_cast<int64_t>(x.size());
  std::vector<double> out(n);
  for (int64_t t = 0; t < n; ++t) {
    double acc = max_pool ? -INFINITY : 0.0;
    for (int64_t u = t - kernel / 2; u <= t + kernel / 2; ++u) {
      if (u < 0 || u >= n) continue;
      acc = max_pool ? std::max(acc, x[u]) : acc + x[u];
    }
    out[t] = max_pool ? acc : acc / kernel;
  }
  return out;
}

// SnapKV's score of the P = S-W evictable tokens: mean over the rows, then pooled.
inline std::vector<double> snapkv_scores(const std::vector<double> &rows, int64_t m, int64_t S, int W, int kernel,
                                         bool max_pool) {
  const int64_t P = S - W;
  std::vector<double> raw(P, 0.0);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t t = 0; t < P; ++t) raw[t] += rows[r * S + t] / m;
  return pool_reference(raw, kernel, max_pool);
}

// AnDPro's per-token contributions sum_r a'_r(t) <V_t, y_r> over the evictable prompt
// (a' = pooled rows, y_r = sum of a'_r(t) V_t over t in [first_chunk, P)).
inline std::vector<double> andpro_contributions(const std::vector<double> &rows, int64_t m, int64_t S, int W,
                                                const double *values, int D, int kernel, bool max_pool,
                                                int64_t first_chunk) {
  const int64_t P = S - W;
  std::vector<double> contrib(P, 0.0), y(D);
  for (int64_t r = 0; r < m; ++r) {
    const std::vector<double> pooled =
        pool_reference(std::vector<double>(rows.begin() + r * S, rows.begin() + r * S + P), kernel, max_pool);
    std::fill(y.begin(), y.end(), 0.0);
    for (int64_t t = first_chunk; t < P; ++t)
      for (int d = 0; d < D; ++d) y[d] += pooled[t] * values[t * D + d];
    for (int64_t t = 0; t < P; ++t) {
      double vy = 0.0;
      for (int d = 0; d < D; ++d) vy += values[t * D + d] * y[d];
      contrib[t] += pooled[t] * vy;
    }
  }
  return contrib;
}

// PyramidKV's real-valued evictable budget of layer l: linear from max = 2*base - min at layer
// 0 to min = base/beta at the last layer, max clamped to P (then min = 2*base - max).
inline double pyramid_real_budget(double base, double P, double beta, int layer, int layers) {
  if (layers == 1) return base;
  double mn = base / beta, mx = 2 * base - mn;
  if (mx >= P) {
    mx = P;
    mn = 2 * base - P;
  }
  return mx - (mx - mn) * layer / (layers - 1);
}

// AdaKV's per-head counts: round(cnt_h*(1-alpha) + alpha*base), largest remainder so the sum
// is exactly H*base.
inline std::vector<int64_t> adakv_reference_counts(const std::vector<int64_t> &cnt, int64_t base, double alpha) {
  const size_t H = cnt.size();
  std::vector<double> real(H);
  std::vector<int64_t> out(H);
  int64_t assigned = 0;
  for (size_t h = 0; h < H; ++h) {
    real[h] = cnt[h] * (1 - alpha) + alpha * base;
    out[h] = static_cast<int64_t>(std::floor(real[h] + 1e-9));
    assigned += out[h];
  }
  std::vector<size_t> order(H);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return real[a] - out[a] > real[b] - out[b]; });
  for (size_t i = 0; assigned < static_cast<int64_t>(H) * base && i < H; ++i, ++assigned) ++out[order[i]];
  return out;
}

}  // namespace akv_test
