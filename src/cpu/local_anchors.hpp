// Storage format 3's anchor choice and assignment with local candidates (docs/design.md §2.2
// step 5, "Local candidates"): a token is compared only with the anchors its segment's table
// can hold, so the work per token no longer grows with k.
#pragma once
#include <cstdint>
#include <vector>

#include "core/dtype.hpp"
#include "core/layout.hpp"

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

// One coverage round's picks: of the prefix tokens that are not anchors (and are eligible,
// eligible null: all), the `take` of largest error[0]/mean + error[1]/mean (each side's error
// relative to its mean over the prefix; ties: lower position). Marks them in is_anchor,
// appends them to `anchors` and returns them.
std::vector<int32_t> worst_represented(const std::vector<float> (&error)[2], int64_t take, std::vector<char> &is_anchor,
                                       const int8_t *eligible, std::vector<int32_t> &anchors);

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

}  // namespace akv
