#include "cpu/local_anchors.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "core/thread_pool.hpp"
#include "cpu/gemm.hpp"

namespace akv {

CandidateRange candidate_range(const AnchorGeometry &g, int64_t seg) {
  const int64_t P = g.prefix;
  if (g.table_size == 0) return {0, P};
  const int64_t free_anchors = int64_t{g.anchors} - g.window;
  // kReachAnchors anchors on each side at the layer's mean density: with the segment's own (at
  // most about 64, segment_length()) and the window's 32, the candidates fit in one table.
  const int64_t reach = (kReachAnchors * P + free_anchors - 1) / std::max<int64_t>(free_anchors, 1);
  const int64_t t0 = seg * g.segment_len, t1 = std::min(P, t0 + g.segment_len);
  return {std::max<int64_t>(0, t0 - reach), std::min(P, t1 + reach)};
}

void local_coverage(const std::vector<float> &Kpre, const std::vector<float> &V, const AnchorGeometry &g,
                    akv_dtype storage, int rounds, int64_t count, std::vector<int32_t> &anchors,
                    LocalNearest &nearest, ThreadPool &pool) {
  const int64_t S = g.seq_len, P = g.prefix, L = g.segment_len;
  const int D = g.dim;
  const std::vector<float> *X[2] = {&Kpre, &V};
  std::vector<float> norm_sq[2] = {std::vector<float>(P), std::vector<float>(P)};
  for (int side = 0; side < 2; ++side) {
    nearest.token[side].assign(P, -1);
    nearest.dot[side].assign(P, 0.0f);
    pool.parallel_for(P, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        const float *x = &(*X[side])[t * D];
        double n2 = 0.0;
        for (int d = 0; d < D; ++d) n2 += static_cast<double>(x[d]) * x[d];
        norm_sq[side][t] = static_cast<float>(n2);
      }
    });
  }
  std::vector<char> is_anchor(P, 0);
  for (int32_t a : anchors) is_anchor[a] = 1;

  // Compares every token with the new anchors: `fresh` (prefix positions) where its segment's
  // range holds them, `everywhere` (the window) in every segment.
  std::vector<float> rows[2];  // their rows as stored, normalised (zero rows: zero norm)
  std::vector<char> usable[2];
  auto absorb = [&](std::vector<int32_t> fresh, const std::vector<int32_t> &everywhere) {
    std::sort(fresh.begin(), fresh.end());
    const std::vector<int32_t> *list[2] = {&fresh, &everywhere};
    for (int side = 0; side < 2; ++side) {
      for (int l = 0; l < 2; ++l) {
        const std::vector<int32_t> &tokens = *list[l];
        const int64_t n = static_cast<int64_t>(tokens.size());
        rows[l].resize(n * D);
        usable[l].resize(n);
        pool.parallel_for(n, [&](int64_t b, int64_t e) {
          for (int64_t i = b; i < e; ++i) {
            const float *src = &(*X[side])[static_cast<int64_t>(tokens[i]) * D];
            float *row = &rows[l][i * D];
            double n2 = 0.0;
            for (int d = 0; d < D; ++d) {
              row[d] = round_to_storage(src[d], storage);
              n2 += static_cast<double>(row[d]) * row[d];
            }
            const float norm = static_cast<float>(std::sqrt(n2));
            usable[l][i] = norm > 0.0f;
            const float inv = norm > 0.0f ? 1.0f / norm : 0.0f;
            for (int d = 0; d < D; ++d) row[d] *= inv;
          }
        });
      }
      pool.parallel_for(g.segments, [&](int64_t sb, int64_t se) {
        std::vector<float> C;
        for (int64_t seg = sb; seg < se; ++seg) {
          const CandidateRange r = candidate_range(g, seg);
          const int64_t t0 = seg * L, m = std::min(P, t0 + L) - t0;
          const int64_t lo = std::lower_bound(fresh.begin(), fresh.end(), static_cast<int32_t>(r.first)) - fresh.begin();
          const int64_t hi = std::lower_bound(fresh.begin() + lo, fresh.end(), static_cast<int32_t>(r.last)) - fresh.begin();
          const int64_t blocks[2][3] = {{0, lo, hi}, {1, 0, static_cast<int64_t>(everywhere.size())}};
          for (const auto &blk : blocks) {
            const int l = static_cast<int>(blk[0]);
            const int64_t first = blk[1], c = blk[2] - blk[1];
            if (c <= 0) continue;
            C.resize(m * c);
            sgemm(true, m, c, D, 1.0f, &(*X[side])[t0 * D], D, &rows[l][first * D], D, 0.0f, C.data(), c);
            for (int64_t i = 0; i < m; ++i) {
              int32_t &best = nearest.token[side][t0 + i];
              float &best_dot = nearest.dot[side][t0 + i];
              const float *row = &C[i * c];
              // A vectorised pass first (most rows gain nothing): the largest |value| as the
              // largest of the bit patterns with the sign cleared, which order as the values do.
              uint32_t most = 0;
              for (int64_t j = 0; j < c; ++j) {
                uint32_t bits;
                std::memcpy(&bits, &row[j], sizeof(bits));
                most = std::max(most, bits & 0x7FFFFFFFu);
              }
              uint32_t have;
              const float best_abs = std::fabs(best_dot);
              std::memcpy(&have, &best_abs, sizeof(have));
              if (best >= 0 && most < have) continue;
              for (int64_t j = 0; j < c; ++j) {
                if (!usable[l][first + j]) continue;
                const float v = row[j], a = std::fabs(v), b = std::fabs(best_dot);
                const int32_t tok = (*list[l])[first + j];
                if (best < 0 || a > b || (a == b && tok < best)) {
                  best = tok;
                  best_dot = v;
                }
              }
            }
          }
        }
      });
    }
  };

  std::vector<int32_t> fresh(anchors), everywhere;
  for (int64_t t = P; t < S; ++t) everywhere.push_back(static_cast<int32_t>(t));
  absorb(fresh, everywhere);
  everywhere.clear();
  int64_t left = count;
  std::vector<std::pair<float, int32_t>> order;
  for (int round = 0; round < rounds && left > 0; ++round) {
    const int64_t take = (left + (rounds - round) - 1) / (rounds - round);
    std::vector<float> error[2] = {std::vector<float>(P), std::vector<float>(P)};
    double mean[2] = {0.0, 0.0};
    for (int side = 0; side < 2; ++side) {
      for (int64_t t = 0; t < P; ++t) {
        const float c = nearest.dot[side][t];
        error[side][t] = std::max(0.0f, norm_sq[side][t] - c * c);
        mean[side] += error[side][t];
      }
      mean[side] = mean[side] > 0.0 ? mean[side] / P : 1.0;
    }
    order.clear();
    for (int64_t t = 0; t < P; ++t)
      if (!is_anchor[t])
        order.emplace_back(static_cast<float>(error[0][t] / mean[0] + error[1][t] / mean[1]), static_cast<int32_t>(t));
    const int64_t n = std::min<int64_t>(take, static_cast<int64_t>(order.size()));
    std::nth_element(order.begin(), order.begin() + n, order.end(), [](const auto &a, const auto &b) {
      return a.first != b.first ? a.first > b.first : a.second < b.second;
    });
    fresh.clear();
    for (int64_t i = 0; i < n; ++i) {
      fresh.push_back(order[i].second);
      is_anchor[order[i].second] = 1;
      anchors.push_back(order[i].second);
    }
    absorb(fresh, everywhere);
    left -= n;
  }
}

}  // namespace akv
