// Exact attention in double precision: the reference every decode is compared against.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <vector>

namespace akv_test {

struct AttentionShape {
  int kv_heads = 0;  // H
  int q_heads = 0;   // Hq = G*H; query head j reads KV head j / G (repeat_kv grouping)
  int head_dim = 0;  // D
  int64_t tokens = 0;  // T, rows of K and V per head
  int q_len = 1;     // query i sits at position T - q_len + i and sees rows 0..T-q_len+i
};

// keys, values: [H][T][D] (keys post-RoPE); queries: [Hq][q_len][D]. Returns [Hq][q_len][D].
// probabilities (optional): [Hq][q_len][T], zero for rows a query cannot see.
// logit_penalty (optional): [H][T], token t's logit lowered by logit_penalty * |scale q|^2
// (AnchorKV's logit_correction: akv_cache_logit_penalty).
template <typename KT, typename QT>
std::vector<double> reference_attention(const std::vector<KT> &keys, const std::vector<KT> &values,
                                        const std::vector<QT> &queries, const AttentionShape &shape,
                                        double softmax_scale,
                                        std::vector<double> *probabilities = nullptr,
                                        const std::vector<double> *logit_penalty = nullptr) {
  const int H = shape.kv_heads, Hq = shape.q_heads, D = shape.head_dim, q_len = shape.q_len;
  const int64_t T = shape.tokens;
  if (H <= 0 || Hq % H != 0 || q_len < 1 || q_len > T)
    throw std::invalid_argument("reference_attention: bad shape");
  if (keys.size() != static_cast<size_t>(H) * T * D || values.size() != keys.size() ||
      queries.size() != static_cast<size_t>(Hq) * q_len * D)
    throw std::invalid_argument("reference_attention: tensor sizes do not match the shape");
  const int group = Hq / H;
  std::vector<double> out(static_cast<size_t>(Hq) * q_len * D, 0.0);
  if (probabilities) probabilities->assign(static_cast<size_t>(Hq) * q_len * T, 0.0);
  std::vector<double> logits(static_cast<size_t>(T));
  for (int qh = 0; qh < Hq; ++qh) {
    const int h = qh / group;
    for (int i = 0; i < q_len; ++i) {
      const int64_t visible = T - q_len + i + 1;
      const QT *q = &queries[(static_cast<size_t>(qh) * q_len + i) * D];
      double q2 = 0.0;
      for (int d = 0; d < D; ++d) q2 += static_cast<double>(q[d]) * static_cast<double>(q[d]);
      q2 *= softmax_scale * softmax_scale;
      double max_logit = -INFINITY;
      for (int64_t t = 0; t < visible; ++t) {
        const KT *k = &keys[(static_cast<size_t>(h) * T + t) * D];
        double dot = 0.0;
        for (int d = 0; d < D; ++d) dot += static_cast<double>(q[d]) * static_cast<double>(k[d]);
        logits[t] = dot * softmax_scale;
        if (logit_penalty) logits[t] -= (*logit_penalty)[static_cast<size_t>(h) * T + t] * q2;
        max_logit = std::max(max_logit, logits[t]);
      }
      double total = 0.0;
      for (int64_t t = 0; t < visible; ++t) total += (logits[t] = std::exp(logits[t] - max_logit));
      double *o = &out[(static_cast<size_t>(qh) * q_len + i) * D];
      for (int64_t t = 0; t < visible; ++t) {
        const double p = logits[t] / total;
        if (probabilities) (*probabilities)[(static_cast<size_t>(qh) * q_len + i) * T + t] = p;
        const KT *v = &values[(static_cast<size_t>(h) * T + t) * D];
        for (int d = 0; d < D; ++d) o[d] += p * static_cast<double>(v[d]);
      }
    }
  }
  return out;
}

inline double root_mean_square(const std::vector<float> &x) {
  double sum = 0.0;
  for (float v : x) sum += static_cast<double>(v) * v;
  return x.empty() ? 0.0 : std::sqrt(sum / x.size());
}

inline double dot(const double *a, const double *b, int n) {
  double s = 0.0;
  for (int i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline double norm(const double *a, int n) { return std::sqrt(dot(a, a, n)); }

}  // namespace akv_test
