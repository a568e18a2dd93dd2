// Storage format 3's anchor choice and assignment with local candidates (docs/design.md §2.2
// step 5, "Local candidates"): a token is compared only with the anchors its segment's table
// can hold, so the work per token no longer grows with k.
#pragma once
#include <cstdint>
#include <vector>

#include "core/coverage.hpp"
#include "core/dtype.hpp"
#include "core/layout.hpp"
#include "core/thread_pool.hpp"

namespace akv {

// Per side and prefix token: the anchor token of largest |cos| among the token's candidates
// (-1: none with a non-zero norm) and x . x_a / ||x_a|| against the anchor rounded to storage.
struct LocalNearest {
  std::vector<int32_t> token[2];
  std::vector<float> dot[2];
};

// The positions [first, last) whose anchors segment `seg`'s tokens may use, besides the window
// (every table may hold the window): the segment widened on both sides by
// g.candidate_reach() positions; the whole prefix when k <= 256 (no tables).
struct CandidateRange {
  int64_t first, last;
};
CandidateRange candidate_range(const AnchorGeometry &g, int64_t seg);

// A coverage round's picks come from a pool of the worst-represented tokens (core/coverage.hpp,
// docs/design.md §2.2 step 5): coverage_pool_size(take, cap) of them (cap: the head's
// non-window anchors), ranked by key (error[0]/mean + error[1]/mean, each side's error relative
// to its mean over the prefix; ties: lower position). A member is *covered* when a member ranked
// before it, in its reach, would as an anchor lower its key below kCoverageCut times its own.
// The round takes the uncovered members in rank order, then (if fewer than take) the covered
// ones, so that its picks spread over what the anchors so far miss instead of crowding on
// near-copies of one token.
struct CoveragePool {
  std::vector<int32_t> tokens;  // in rank order
  std::vector<float> keys;
  double mean[2] = {1.0, 1.0};
  int64_t take = 0;             // the round's picks (take, or fewer tokens left)
};
// The pool of one round: of the prefix tokens that are not anchors (and are eligible, eligible
// null: all).
CoveragePool coverage_pool(const std::vector<float> (&error)[2], int64_t take, int64_t cap,
                           const std::vector<char> &is_anchor, const int8_t *eligible);

// Which members are covered. left[side] and right[side] hold the members' rows in pool order
// (C x D): a member as the search compares a token (left) and as an anchor (right), so that
// left_i . right_j is what absorbing j would give i. lowered(i, side, c) is member i's error on
// that side with such a product c (its current one where c does not beat its best). With
// `local` (format 3's geometry) only members in i's candidate range count; null: all.
template <class Lowered>
std::vector<char> covered_members(const CoveragePool &pool, const std::vector<float> (&error)[2],
                                  const float *const (&left)[2], const float *const (&right)[2], int D,
                                  const AnchorGeometry *local, ThreadPool &tp, const Lowered &lowered);

// The round's picks from the pool and its covered flags: marked in is_anchor, appended to
// `anchors` and returned.
std::vector<int32_t> pool_picks(const CoveragePool &pool, const std::vector<char> &covered,
                                std::vector<char> &is_anchor, std::vector<int32_t> &anchors);

// Chooses the coverage share and finds every token's nearest candidate anchor in one pass:
// starting from `anchors` (non-window prefix positions, any order) and the window P..S-1,
// `count` more anchors are added in `rounds` rounds (0 rounds or count 0: none), each round
// taking the tokens their candidates represent worst (residual energy against the candidate of
// largest |cos|, keys and values each relative to their mean, summed; ties: lower position).
// Rows are [S][D] fp32, pre-RoPE keys and values; anchors are compared as stored (rounded to
// `storage`). Only tokens with eligible[t] != 0 are added (null: all). Appends the new anchors
// to `anchors` and fills `nearest`.
void local_coverage(const std::vector<float> &Kpre, const std::vector<float> &V, const AnchorGeometry &g,
                    akv_dtype storage, int rounds, int64_t count, std::vector<int32_t> &anchors,
                    LocalNearest &nearest, ThreadPool &pool, const int8_t *eligible = nullptr);

// covered_members' order of work: the members sorted by token, cut into blocks of one segment
// (without `local`: of 256 members), each with the run of members in its candidate range (all).
struct CoverBlocks {
  std::vector<int64_t> by_token;                 // member indices, by token
  std::vector<int64_t> begin, end, first, last;  // per block: [begin, end) and its range [first, last) in by_token
};
CoverBlocks cover_blocks(const CoveragePool &pool, const AnchorGeometry *local);
// rows[by_token[r]] gathered in by_token order (C x D, then 3 zero rows).
std::vector<float> rows_by_token(const float *rows, const std::vector<int64_t> &by_token, int D);
// out[r][q] = left_r . right_q for r < m, q < n, out's rows cover_width(n) apart (right readable
// for that many rows).
int64_t cover_width(int64_t n);
void cover_products(const float *left, int64_t m, const float *right, int64_t n, int D, float *out);

template <class Lowered>
std::vector<char> covered_members(const CoveragePool &pool, const std::vector<float> (&error)[2],
                                  const float *const (&left)[2], const float *const (&right)[2], int D,
                                  const AnchorGeometry *local, ThreadPool &tp, const Lowered &lowered) {
  const int64_t C = static_cast<int64_t>(pool.tokens.size());
  std::vector<char> covered(C, 0);
  if (C == 0) return covered;
  const CoverBlocks cb = cover_blocks(pool, local);
  const std::vector<float> L[2] = {rows_by_token(left[0], cb.by_token, D), rows_by_token(left[1], cb.by_token, D)};
  const std::vector<float> R[2] = {rows_by_token(right[0], cb.by_token, D), rows_by_token(right[1], cb.by_token, D)};
  tp.parallel_for(static_cast<int64_t>(cb.begin.size()), [&](int64_t b0, int64_t b1) {
    std::vector<float> G[2];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t m = cb.end[b] - cb.begin[b], n = cb.last[b] - cb.first[b], w = cover_width(n);
      for (int side = 0; side < 2; ++side) {
        G[side].resize(static_cast<size_t>(m * w));
        cover_products(&L[side][cb.begin[b] * D], m, &R[side][cb.first[b] * D], n, D, G[side].data());
      }
      for (int64_t r = 0; r < m; ++r) {
        const int64_t i = cb.by_token[cb.begin[b] + r];
        const int32_t t = pool.tokens[i];
        const float bar = kCoverageCut * pool.keys[i];
        for (int64_t q = 0; q < n && !covered[i]; ++q) {
          if (cb.by_token[cb.first[b] + q] >= i) continue;  // ranked after i (or i)
          float e[2] = {error[0][t], error[1][t]};
          for (int side = 0; side < 2; ++side) e[side] = lowered(i, side, G[side][r * w + q]);
          covered[i] = static_cast<float>(e[0] / pool.mean[0] + e[1] / pool.mean[1]) < bar;
        }
      }
    }
  });
  return covered;
}

}  // namespace akv
