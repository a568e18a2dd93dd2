#include "reference.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "common.hpp"

namespace akvcli {

void AttentionProfile::add(const double *weights, int64_t n) {
  if (n <= 0) return;
  sink_mass += weights[0];
  double entropy = 0.0;
  for (int64_t t = 0; t < n; ++t)
    if (weights[t] > 0.0) entropy -= weights[t] * std::log(weights[t]);
  effective_tokens += std::exp(entropy);
  const int64_t top = std::max<int64_t>(1, (n + 99) / 100);
  std::vector<double> sorted(weights, weights + n);
  std::nth_element(sorted.begin(), sorted.begin() + (top - 1), sorted.end(), std::greater<double>());
  double mass = 0.0;
  for (int64_t i = 0; i < top; ++i) mass += sorted[i];
  top_percent_mass += mass;
  ++count;
}

void AttentionProfile::merge(const AttentionProfile &other) {
  sink_mass += other.sink_mass;
  top_percent_mass += other.top_percent_mass;
  effective_tokens += other.effective_tokens;
  count += other.count;
}

namespace {

// GCC/Clang vector extension: 4 doubles (one AVX2 register with -march=x86-64-v3, two SSE2
// registers otherwise).
typedef double Vec4 __attribute__((vector_size(32)));
inline Vec4 load4(const double *p) {
  Vec4 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline double sum4(Vec4 v) { return (v[0] + v[1]) + (v[2] + v[3]); }

// logits[i][t] = scale * q_i . k_t for t < n. Register-blocked over 4 queries x 2 keys so
// each loaded vector feeds several independent FMA chains.
void scaled_logits(const double *keys, int64_t n, int D, const double *queries, int nq, double scale,
                   double *logits, int64_t row_stride) {
  const int vector_dims = D - D % 4;
  auto tail_dot = [&](const double *q, const double *k) {
    double acc = 0.0;
    for (int d = vector_dims; d < D; ++d) acc += q[d] * k[d];
    return acc;
  };
  int64_t t = 0;
  for (; t + 2 <= n; t += 2) {
    const double *k0 = keys + t * D, *k1 = k0 + D;
    int i = 0;
    for (; i + 4 <= nq; i += 4) {
      const double *q[4];
      for (int j = 0; j < 4; ++j) q[j] = queries + static_cast<int64_t>(i + j) * D;
      Vec4 acc0[4] = {}, acc1[4] = {};
      for (int d = 0; d < vector_dims; d += 4) {
        const Vec4 a = load4(k0 + d), b = load4(k1 + d);
        for (int j = 0; j < 4; ++j) {
          const Vec4 x = load4(q[j] + d);
          acc0[j] += x * a;
          acc1[j] += x * b;
        }
      }
      for (int j = 0; j < 4; ++j) {
        logits[(i + j) * row_stride + t] = scale * (sum4(acc0[j]) + tail_dot(q[j], k0));
        logits[(i + j) * row_stride + t + 1] = scale * (sum4(acc1[j]) + tail_dot(q[j], k1));
      }
    }
    for (; i < nq; ++i) {
      const double *q = queries + static_cast<int64_t>(i) * D;
      logits[i * row_stride + t] = scale * dot(q, k0, D);
      logits[i * row_stride + t + 1] = scale * dot(q, k1, D);
    }
  }
  for (; t < n; ++t)
    for (int i = 0; i < nq; ++i)
      logits[i * row_stride + t] = scale * dot(queries + static_cast<int64_t>(i) * D, keys + t * D, D);
}

// In-place softmax of the first n entries; returns the log-sum-exp.
double softmax_in_place(double *row, int64_t n) {
  double max_logit = -std::numeric_limits<double>::infinity();
  for (int64_t t = 0; t < n; ++t) max_logit = std::max(max_logit, row[t]);
  double sum = 0.0;
  for (int64_t t = 0; t < n; ++t) sum += (row[t] = std::exp(row[t] - max_logit));
  const double inverse = 1.0 / sum;
  for (int64_t t = 0; t < n; ++t) row[t] *= inverse;
  return max_logit + std::log(sum);
}

}  // namespace

void exact_attention(const double *keys, const double *values, int64_t n, int D, const double *queries,
                     int nq, double scale, double *out, AttentionProfile *profile,
                     std::vector<double> *weights_out) {
  std::vector<double> local;
  std::vector<double> &weights = weights_out != nullptr ? *weights_out : local;
  weights.assign(static_cast<size_t>(nq) * n, 0.0);
  scaled_logits(keys, n, D, queries, nq, scale, weights.data(), n);
  for (int i = 0; i < nq; ++i) {
    softmax_in_place(weights.data() + static_cast<int64_t>(i) * n, n);
    if (profile != nullptr) profile->add(weights.data() + static_cast<int64_t>(i) * n, n);
  }
  std::fill(out, out + static_cast<int64_t>(nq) * D, 0.0);
  for (int64_t t = 0; t < n; ++t) {
    const double *value = values + t * D;
    for (int i = 0; i < nq; ++i) {
      const double a = weights[static_cast<int64_t>(i) * n + t];
      double *o = out + static_cast<int64_t>(i) * D;
      for (int d = 0; d < D; ++d) o[d] += a * value[d];
    }
  }
}

WindowAttention window_attention(const double *keys, int64_t S, int D, const double *window_queries,
                                 int group, int window, double scale) {
  const int rows = group * window;
  const int64_t evictable = S - window;
  std::vector<double> logits(static_cast<size_t>(rows) * S);
  scaled_logits(keys, S, D, window_queries, rows, scale, logits.data(), S);
  WindowAttention result;
  result.row_lse.resize(rows);
  result.score.assign(static_cast<size_t>(std::max<int64_t>(evictable, 0)), 0.0);
  for (int r = 0; r < rows; ++r) {
    const int w = r % window;
    const int64_t visible = S - window + w + 1;  // causal inside the window
    double *row = logits.data() + static_cast<int64_t>(r) * S;
    result.row_lse[r] = softmax_in_place(row, visible);
    for (int64_t t = 0; t < evictable; ++t) result.score[t] += row[t] / rows;
  }
  result.median_score = evictable > 0 ? median(result.score) : 0.0;
  return result;
}

}  // namespace akvcli
