// Storage format 3's anchor choice and assignment with local candidates (docs/design.md §2.2
// step 5, "Local candidates"): a token is compared only with the anchors its segment's table
// can hold, so the work per token no longer grows with k.
#pragma once
#include <cstdint>
#include <limits>
#include <vector>

#include "core/coverage.hpp"
#include "core/dtype.hpp"
#include "core/layout.hpp"
#include "cpu/kernels.hpp"

namespace akv {

class ThreadPool;

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

// a . b for covered_members: two eight-lane accumulators where n is a multiple of 16 (dot's
// reduction loop stays scalar where it is inlined there, a chain of n dependent adds).
inline float cover_dot(const float *a, const float *b, int n) {
#ifdef __AVX2__
  if (n % 16 == 0) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 16) {
      s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
      s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    return hsum8(_mm256_add_ps(s0, s1));
  }
#endif
  return dot(a, b, n);
}

// Which members are covered, in rank order until take of them are not (the round's picks are
// then known; the members after are marked covered, and are not taken). token_row(i, side) and
// anchor_row(j, side) give member i's row as the search compares a token and member j's as an
// anchor, so that their product is what absorbing j would give i; anchor_row is asked for the
// members in increasing order (j < i), so it can make them as they come. lowered(i, side, c) is
// member i's error on that side with such a product c (its current one where c does not beat
// its best). With `local` (format 3's geometry) only members in i's candidate range count;
// null: all.
template <class TokenRow, class AnchorRow, class Lowered>
std::vector<char> covered_members(const CoveragePool &pool, int D, const AnchorGeometry *local,
                                  const TokenRow &token_row, const AnchorRow &anchor_row, const Lowered &lowered) {
  const int64_t C = static_cast<int64_t>(pool.tokens.size());
  std::vector<char> covered(C, 1);
  int64_t uncovered = 0;
  for (int64_t i = 0; i < C && uncovered < pool.take; ++i) {
    CandidateRange r{0, std::numeric_limits<int64_t>::max()};
    if (local) r = candidate_range(*local, pool.tokens[i] / local->segment_len);
    const float bar = kCoverageCut * pool.keys[i];
    const float *x[2] = {token_row(i, 0), token_row(i, 1)};
    covered[i] = 0;
    for (int64_t j = 0; j < i && !covered[i]; ++j) {
      if (pool.tokens[j] < r.first || pool.tokens[j] >= r.last) continue;
      float e[2];
      for (int side = 0; side < 2; ++side) e[side] = lowered(i, side, cover_dot(x[side], anchor_row(j, side), D));
      covered[i] = static_cast<float>(e[0] / pool.mean[0] + e[1] / pool.mean[1]) < bar;
    }
    uncovered += !covered[i];
  }
  return covered;
}

}  // namespace akv
