// A coverage round's pool (docs/design.md §2.2 step 5), shared by the CPU's rounds
// (cpu/local_anchors.cpp, cpu/compress_anchorkv.cpp) and the CUDA pass's
// (cuda/coverage_select_kernels.cuh): a round of `take` picks chooses them from the
// coverage_pool_size(take, cap) worst-represented tokens, skipping a member that one ranked
// before it, in its reach, would as an anchor leave with a key below kCoverageCut times its own.
#pragma once
#include <cstdint>

#include "core/host_device.hpp"

namespace akv {

constexpr int64_t kCoveragePool = 8;  // pool members per pick
constexpr float kCoverageCut = 0.7f;  // covered: the key lowered below this share of its own

// The pool of a round of `take` picks: kCoveragePool x take tokens, at most cap (the head's
// non-window anchors) and at least take (before the tokens left to rank bound it).
AKV_HD constexpr int64_t coverage_pool_size(int64_t take, int64_t cap) {
  const int64_t most = cap > take ? cap : take;
  return kCoveragePool * take < most ? kCoveragePool * take : most;
}

}  // namespace akv
