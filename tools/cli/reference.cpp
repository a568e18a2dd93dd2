#include "reference.hpp"

#include <algorithm>
#include <cmath>
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

// logits[i][t] = scale * q_i . k_t for t < n (keys outer so each key is loaded once).
void scaled_logits(const double *keys, int64_t n, int D, const double *queries, int nq, double scale,
                   double *logits, int64_t row_stride) {
  for (int64_t t = 0; t < n; ++t) {
    const double *key = keys + t * D;
    for (int i = 0; i < nq; ++i) logits[i * row_stride + t] = scale * dot(queries + static_cast<int64_t>(i) * D, key, D);
  }
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
