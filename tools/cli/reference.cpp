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

// logits[i][t] = scale * q_i . k_t for t < n. Keys outer, four queries at a time with
// independent accumulators per query, so each key is loaded once per block and the
// compiler can keep several vector FMA chains in flight.
void scaled_logits(const double *keys, int64_t n, int D, const double *queries, int nq, double scale,
                   double *logits, int64_t row_stride) {
  constexpr int kBlock = 4, kLanes = 4;
  for (int64_t t = 0; t < n; ++t) {
    const double *key = keys + t * D;
    int i = 0;
    for (; i + kBlock <= nq; i += kBlock) {
      const double *q0 = queries + static_cast<int64_t>(i) * D;
      const double *q1 = q0 + D, *q2 = q1 + D, *q3 = q2 + D;
      double a0[kLanes] = {}, a1[kLanes] = {}, a2[kLanes] = {}, a3[kLanes] = {};
      int d = 0;
      for (; d + kLanes <= D; d += kLanes)
        for (int l = 0; l < kLanes; ++l) {
          const double k = key[d + l];
          a0[l] += q0[d + l] * k;
          a1[l] += q1[d + l] * k;
          a2[l] += q2[d + l] * k;
          a3[l] += q3[d + l] * k;
        }
      for (; d < D; ++d) {
        a0[0] += q0[d] * key[d];
        a1[0] += q1[d] * key[d];
        a2[0] += q2[d] * key[d];
        a3[0] += q3[d] * key[d];
      }
      logits[(i + 0) * row_stride + t] = scale * ((a0[0] + a0[1]) + (a0[2] + a0[3]));
      logits[(i + 1) * row_stride + t] = scale * ((a1[0] + a1[1]) + (a1[2] + a1[3]));
      logits[(i + 2) * row_stride + t] = scale * ((a2[0] + a2[1]) + (a2[2] + a2[3]));
      logits[(i + 3) * row_stride + t] = scale * ((a3[0] + a3[1]) + (a3[2] + a3[3]));
    }
    for (; i < nq; ++i) logits[i * row_stride + t] = scale * dot(queries + static_cast<int64_t>(i) * D, key, D);
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
