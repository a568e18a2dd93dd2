#include "cpu/local_anchors.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "core/thread_pool.hpp"
#include "cpu/gemm.hpp"
#include "cpu/kernels.hpp"

namespace akv {
namespace {

#ifdef AKV_HAVE_AVX512_KERNELS
// C[i][j] = X_i . A_j for i < m, j < ldc (C rows ldc apart, ldc a multiple of 4, A readable
// for ldc rows), D a multiple of 16: 4 x 4 blocks with no packing. A round adds a dozen
// anchors to a segment, too few for a GEMM to pay for packing the segment's rows every time
// (OpenBLAS spent a third of its time packing here).
AKV_TARGET_AVX512 void dot_block_avx512(const float *X, int64_t m, const float *A, int64_t ldc, int D, float *C) {
  int64_t i = 0;
  for (; i + 4 <= m; i += 4)
    for (int64_t j = 0; j < ldc; j += 4) {
      const float *const b[4] = {A + j * D, A + (j + 1) * D, A + (j + 2) * D, A + (j + 3) * D};
      float *const out[4] = {C + i * ldc + j, C + (i + 1) * ldc + j, C + (i + 2) * ldc + j, C + (i + 3) * ldc + j};
      dot_rows4x4_avx512(X + i * D, D, b, D, out);
    }
  for (; i < m; ++i)
    for (int64_t j = 0; j < ldc; ++j) C[i * ldc + j] = dot(X + i * D, A + j * D, D);
}
#endif

// C = X A^T for the first c rows of A; C's rows are ldc = dot_width(c) apart, and A must be
// readable for ldc rows (the candidate rows carry 3 zero rows of padding at their end).
int64_t dot_width(int64_t c) { return (c + 3) / 4 * 4; }
void dot_block(const float *X, int64_t m, const float *A, int64_t c, int D, float *C) {
  const int64_t ldc = dot_width(c);
#ifdef AKV_HAVE_AVX512_KERNELS
  if (has_avx512() && D % 16 == 0) {
    dot_block_avx512(X, m, A, ldc, D, C);
    return;
  }
#endif
  sgemm(true, m, c, D, 1.0f, X, D, A, D, 0.0f, C, ldc);
}

// out = x rounded to storage, divided by its norm (zero stays zero); returns the norm.
float stored_unit_row(const float *x, akv_dtype storage, int D, float *out) {
  double n2 = 0.0;
  for (int d = 0; d < D; ++d) {
    out[d] = round_to_storage(x[d], storage);
    n2 += static_cast<double>(out[d]) * out[d];
  }
  const float norm = static_cast<float>(std::sqrt(n2));
  const float inv = norm > 0.0f ? 1.0f / norm : 0.0f;
  for (int d = 0; d < D; ++d) out[d] *= inv;
  return norm;
}

}  // namespace

CandidateRange candidate_range(const AnchorGeometry &g, int64_t seg) {
  const int64_t P = g.prefix, reach = g.candidate_reach();
  if (reach < 0) return {0, P};
  const int64_t t0 = seg * g.segment_len, t1 = std::min(P, t0 + g.segment_len);
  return {std::max<int64_t>(0, t0 - reach), std::min(P, t1 + reach)};
}

CoveragePool coverage_pool(const std::vector<float> (&error)[2], int64_t take, int64_t cap,
                           const std::vector<char> &is_anchor, const int8_t *eligible) {
  const int64_t P = static_cast<int64_t>(error[0].size());
  CoveragePool pool;
  for (int side = 0; side < 2; ++side) {
    double sum = 0.0;
    for (int64_t t = 0; t < P; ++t) sum += error[side][t];
    pool.mean[side] = sum > 0.0 ? sum / P : 1.0;
  }
  std::vector<std::pair<float, int32_t>> order;
  order.reserve(P);
  for (int64_t t = 0; t < P; ++t)
    if (!is_anchor[t] && (!eligible || eligible[t]))
      order.emplace_back(static_cast<float>(error[0][t] / pool.mean[0] + error[1][t] / pool.mean[1]),
                         static_cast<int32_t>(t));
  const int64_t left = static_cast<int64_t>(order.size());
  pool.take = std::min(take, left);
  const int64_t C = std::min(left, coverage_pool_size(take, cap));
  auto ranked = [](const auto &a, const auto &b) { return a.first != b.first ? a.first > b.first : a.second < b.second; };
  std::nth_element(order.begin(), order.begin() + C, order.end(), ranked);
  std::sort(order.begin(), order.begin() + C, ranked);
  for (int64_t i = 0; i < C; ++i) {
    pool.keys.push_back(order[i].first);
    pool.tokens.push_back(order[i].second);
  }
  return pool;
}

std::vector<int32_t> pool_picks(const CoveragePool &pool, const std::vector<char> &covered,
                                std::vector<char> &is_anchor, std::vector<int32_t> &anchors) {
  std::vector<int32_t> picked;
  for (int pass = 0; pass < 2; ++pass)
    for (size_t i = 0; i < pool.tokens.size() && static_cast<int64_t>(picked.size()) < pool.take; ++i)
      if (covered[i] == pass) picked.push_back(pool.tokens[i]);
  for (int32_t t : picked) {
    is_anchor[t] = 1;
    anchors.push_back(t);
  }
  return picked;
}

void local_coverage(const std::vector<float> &Kpre, const std::vector<float> &V, const AnchorGeometry &g,
                    akv_dtype storage, int rounds, int64_t count, std::vector<int32_t> &anchors,
                    LocalNearest &nearest, ThreadPool &pool, const int8_t *eligible) {
  const int64_t S = g.seq_len, P = g.prefix, L = g.segment_len;
  const int D = g.dim;
  const std::vector<float> *X[2] = {&Kpre, &V};
  std::vector<float> norm_sq[2] = {std::vector<float>(P), std::vector<float>(P)};
  for (int side = 0; side < 2; ++side) {
    nearest.token[side].assign(P, -1);
    nearest.dot[side].assign(P, 0.0f);
    if (rounds == 0 || count == 0) continue;  // the norms only rank the rounds' picks
    pool.parallel_for(P, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        const float *x = &(*X[side])[t * D];
        norm_sq[side][t] = dot(x, x, D);
      }
    });
  }
  std::vector<char> is_anchor(P, 0);
  for (int32_t a : anchors) is_anchor[a] = 1;

  // Compares every token with the new anchors: `fresh` (prefix positions) where its segment's
  // range holds them, `everywhere` (the window) in every segment.
  std::vector<float> rows[2][2];  // [side][list]: rows as stored, normalised (zero rows: zero norm)
  std::vector<char> usable[2][2];
  auto absorb = [&](std::vector<int32_t> fresh, const std::vector<int32_t> &everywhere) {
    std::sort(fresh.begin(), fresh.end());
    const std::vector<int32_t> *list[2] = {&fresh, &everywhere};
    for (int side = 0; side < 2; ++side) {
      for (int l = 0; l < 2; ++l) {
        const std::vector<int32_t> &tokens = *list[l];
        const int64_t n = static_cast<int64_t>(tokens.size());
        rows[side][l].assign((n + 3) * D, 0.0f);  // 3 zero rows: dot_block's padding
        usable[side][l].resize(n);
        // A round's few hundred rows: not worth waking the pool for.
        for (int64_t i = 0; i < n; ++i) {
          const float *src = &(*X[side])[static_cast<int64_t>(tokens[i]) * D];
          usable[side][l][i] = stored_unit_row(src, storage, D, &rows[side][l][i * D]) > 0.0f;
        }
      }
    }
    // Segments dealt round robin (a round's new anchors crowd where the error was, so equal
    // runs of segments would not be equal work), both sides in one call.
    {
      const int64_t lanes = std::min<int64_t>(pool.size(), g.segments);
      pool.parallel_for(lanes, [&](int64_t lb, int64_t le) {
        std::vector<float> C;
        for (int64_t lane = lb; lane < le; ++lane)
        for (int64_t seg = lane; seg < g.segments; seg += lanes)
        for (int side = 0; side < 2; ++side) {
          const CandidateRange r = candidate_range(g, seg);
          const int64_t t0 = seg * L, m = std::min(P, t0 + L) - t0;
          const int64_t lo = std::lower_bound(fresh.begin(), fresh.end(), static_cast<int32_t>(r.first)) - fresh.begin();
          const int64_t hi = std::lower_bound(fresh.begin() + lo, fresh.end(), static_cast<int32_t>(r.last)) - fresh.begin();
          const int64_t blocks[2][3] = {{0, lo, hi}, {1, 0, static_cast<int64_t>(everywhere.size())}};
          for (const auto &blk : blocks) {
            const int l = static_cast<int>(blk[0]);
            const int64_t first = blk[1], c = blk[2] - blk[1];
            if (c <= 0) continue;
            const int64_t ldc = dot_width(c);
            C.resize(m * ldc);
            dot_block(&(*X[side])[t0 * D], m, &rows[side][l][first * D], c, D, C.data());
            for (int64_t i = 0; i < m; ++i) {
              int32_t &best = nearest.token[side][t0 + i];
              float &best_dot = nearest.dot[side][t0 + i];
              const float *row = &C[i * ldc];
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
              // The first column at the maximum: the lowest token there (a block's tokens
              // increase). Only a zero-norm anchor (product 0) needs the full scan below.
              int64_t at = 0;
              for (;; ++at) {
                uint32_t bits;
                std::memcpy(&bits, &row[at], sizeof(bits));
                if ((bits & 0x7FFFFFFFu) == most) break;
              }
              if (usable[side][l][first + at]) {
                const int32_t tok = (*list[l])[first + at];
                if (best < 0 || most > have || tok < best) {
                  best = tok;
                  best_dot = row[at];
                }
                continue;
              }
              for (int64_t j = 0; j < c; ++j) {
                if (!usable[side][l][first + j]) continue;
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

  const int64_t cap = static_cast<int64_t>(anchors.size()) + count;  // the head's non-window anchors
  std::vector<int32_t> fresh(anchors), everywhere;
  for (int64_t t = P; t < S; ++t) everywhere.push_back(static_cast<int32_t>(t));
  absorb(fresh, everywhere);
  everywhere.clear();
  int64_t left = count;
  for (int round = 0; round < rounds && left > 0; ++round) {
    const int64_t take = (left + (rounds - round) - 1) / (rounds - round);
    std::vector<float> error[2] = {std::vector<float>(P), std::vector<float>(P)};
    for (int side = 0; side < 2; ++side)
      for (int64_t t = 0; t < P; ++t) {
        const float c = nearest.dot[side][t];
        error[side][t] = std::max(0.0f, norm_sq[side][t] - c * c);
      }
    // The pool's members as anchors: rows as stored, normalised (as absorb compares them),
    // made as the cover test reaches them.
    const CoveragePool round_pool = coverage_pool(error, take, cap, is_anchor, eligible);
    std::vector<float> pool_rows[2] = {std::vector<float>(round_pool.tokens.size() * D),
                                       std::vector<float>(round_pool.tokens.size() * D)};
    int64_t made = 0;
    auto row = [&](int side, int64_t i) { return &(*X[side])[static_cast<int64_t>(round_pool.tokens[i]) * D]; };
    const std::vector<char> covered = covered_members(
        round_pool, D, &g, [&](int64_t i, int side) { return row(side, i); },
        [&](int64_t j, int side) {
          for (; made <= j; ++made)
            for (int s = 0; s < 2; ++s) stored_unit_row(row(s, made), storage, D, &pool_rows[s][made * D]);
          return static_cast<const float *>(&pool_rows[side][j * D]);
        },
        [&](int64_t i, int side, float c) {
          const int32_t t = round_pool.tokens[i];
          return std::fabs(c) > std::fabs(nearest.dot[side][t]) ? std::max(0.0f, norm_sq[side][t] - c * c)
                                                                 : error[side][t];
        });
    fresh = pool_picks(round_pool, covered, is_anchor, anchors);
    const int64_t n = static_cast<int64_t>(fresh.size());
    absorb(fresh, everywhere);
    left -= n;
  }
}

}  // namespace akv
