#include "cpu/scores.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/thread_pool.hpp"
#include "cpu/gemm.hpp"
#include "cpu/kernels.hpp"

namespace akv {

void window_attention(const float *Q, const float *Kpost, int64_t m, int64_t S, int D, int64_t P, int W, float scale,
                      const uint8_t *present, float *A, ThreadPool &pool) {
  sgemm(pool, true, m, S, D, scale, Q, D, Kpost, D, 0.0f, A, S);
  pool.parallel_for(m, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      float *row = &A[r * S];
      const int64_t visible = P + (r % W) + 1;
      if (present)
        for (int64_t t = 0; t < visible; ++t)
          if (!present[t]) row[t] = -std::numeric_limits<float>::infinity();
      const float mx = max_of(row, visible);
      if (mx == -std::numeric_limits<float>::infinity()) {  // nothing present: no weight anywhere
        std::fill(row, row + S, 0.0f);
        continue;
      }
      const float inv = 1.0f / exp_shifted_sum(row, visible, mx);  // the decode paths' softmax
      for (int64_t t = 0; t < visible; ++t) row[t] *= inv;
      if (present)  // the vector exp leaves ~1e-38 where it was given -inf
        for (int64_t t = 0; t < visible; ++t)
          if (!present[t]) row[t] = 0.0f;
      for (int64_t t = visible; t < S; ++t) row[t] = 0.0f;
    }
  });
}

void mean_attention(const float *A, int64_t m, int64_t S, int64_t P, float *raw, float *alpha_sq, ThreadPool &pool) {
  pool.parallel_for(P, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      double s = 0.0, s2 = 0.0;
      for (int64_t r = 0; r < m; ++r) {
        const double a = A[r * S + t];
        s += a;
        s2 += a * a;
      }
      raw[t] = static_cast<float>(s / m);
      if (alpha_sq) alpha_sq[t] = static_cast<float>(s2 / m);
    }
  });
}

void pool_scores(const float *raw, int64_t n, int kernel, akv_pool_type type, float *out) {
  const int half = kernel / 2;
  for (int64_t t = 0; t < n; ++t) {
    const int64_t lo = std::max<int64_t>(0, t - half), hi = std::min<int64_t>(n - 1, t + half);
    float acc = type == AKV_POOL_MAX ? -std::numeric_limits<float>::infinity() : 0.0f;
    for (int64_t u = lo; u <= hi; ++u) acc = type == AKV_POOL_MAX ? std::max(acc, raw[u]) : acc + raw[u];
    out[t] = type == AKV_POOL_MAX ? acc : acc / static_cast<float>(kernel);
  }
}

void follow_scores(float *scores, int64_t n, int follow) {
  if (follow <= 0) return;
  for (int64_t t = n - 1; t > 0; --t)  // backwards: scores[u < t] still hold their own score
    for (int64_t u = std::max<int64_t>(0, t - follow); u < t; ++u) scores[t] = std::max(scores[t], scores[u]);
}

}  // namespace akv
