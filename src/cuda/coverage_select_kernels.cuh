// One coverage round's ranking on the GPU (CPU: coverage_pool, covered_members and pool_picks
// in cpu/local_anchors.hpp): the `take` tokens of a head that its anchors so far represent worst
// (largest summed relative error, ties the lower token; anchors never), in token order, from a
// pool (core/coverage.hpp) whose covered members go last. Three launches a round (three more
// with a pool, below), each over every head, instead of a means kernel, a keys kernel, a
// device-wide segmented sort (a radix sort between a compose and a split kernel), the take and
// (format 3) a sort by token:
//   coverage_energy_kernel  each chunk of kSelectChunk tokens sums both sides' residual
//                           energies (fixed order, so every run gives the same means; storage
//                           format 3's candidate search sums its tiles' as it ends instead,
//                           local_nearest_kernel's energy_parts, and this launch goes);
//   coverage_chunk_kernel   each chunk sums the partials into the means (all chunks alike),
//                           makes its tokens' keys and selects its own `take` smallest (a
//                           chunk's share of the round can be no larger), in token order;
//   coverage_merge_kernel   one block per head selects the `take` smallest of the chunks'
//                           candidates (which are in token order) and writes the picks (two
//                           levels where that takes fewer passes: merge_groups);
// then, with a pool: the merge writes the pool instead (<true>), coverage_cover_kernel marks
// its covered members, and a second merge over the pool takes the picks.
// A select is a radix select (digits of 11, 11 and 10 bits, most significant first: each a
// histogram of the keys that share the digits so far, and the bin where the count reaches the
// wanted rank) followed by a pass in order that takes the keys below the threshold T and the
// first `need` keys equal to it.
#pragma once
#include "core/coverage.hpp"
#include "cuda/compress_kernels.cuh"
#include "cuda/compress_local_kernels.cuh"

namespace akv {
namespace cuda {

constexpr int kSelectThreads = 1024, kSelectBins = 2 * kSelectThreads;
constexpr int kSelectChunk = 4 * kSelectThreads;  // tokens per chunk: 4 a thread
constexpr uint32_t kNotRanked = 0xFFFFFFFFu;       // the key of an anchor (and of padding)

// Chunks of the prefix, and the candidate slots each chunk gets (the round's take, at most
// the chunk's tokens): the merge reads chunks x slots keys per head.
__host__ __device__ constexpr int64_t select_chunks(int64_t P) { return (P + kSelectChunk - 1) / kSelectChunk; }
__host__ __device__ constexpr int64_t select_slots(int64_t take) { return take < kSelectChunk ? take : kSelectChunk; }

// Adds one to hist[bin] for every lane of the warp with `valid` (every lane calls): the lanes
// with the same bin add together, through their lowest lane, so a warp whose keys share a
// digit (a round's first digit mostly does) makes one atomic instead of 32.
__device__ __forceinline__ void warp_histogram_add(uint32_t *hist, uint32_t bin, bool valid) {
  const unsigned peers = __match_any_sync(kFullMask, valid ? bin : 0xFFFFFFFFu);
  if (valid && (threadIdx.x & 31) == static_cast<unsigned>(__ffs(static_cast<int>(peers)) - 1))
    atomicAdd(&hist[bin], static_cast<unsigned>(__popc(peers)));
}

// The shared memory of a block select (every thread of a kSelectThreads block calls).
struct SelectShared {
  uint32_t *hist;       // kSelectBins, zero on entry to block_select_threshold and on return
  uint32_t *warp_sums;  // kSelectThreads / 32 + 1
  uint32_t *found;      // 2
};

// The threshold of the `take` smallest keys key_at(0..n) (kNotRanked never counted): returns T
// and sets `need` (how many keys equal to T are taken) and `count` (take, or the keys counted if
// fewer). Each pass loads 4 keys a thread at a time, issued together.
template <class KeyAt>
__device__ uint32_t block_select_threshold(KeyAt key_at, int64_t n, uint32_t take, const SelectShared &sh,
                                           uint32_t &need, uint32_t &count) {
  constexpr int B = 4;
  constexpr int64_t kStep = int64_t{kSelectThreads} * B;
  const int tid = threadIdx.x;
  uint32_t prefix = 0;
  need = count = 0;
#pragma unroll
  for (int digit = 0; digit < 3; ++digit) {
    const int shift = digit == 0 ? 21 : digit == 1 ? 10 : 0;
    const int above = digit == 0 ? 32 : digit == 1 ? 21 : 10;  // the digits found so far
    for (int64_t i0 = 0; i0 < n; i0 += kStep) {
      uint32_t key[B];
#pragma unroll
      for (int b = 0; b < B; ++b) {
        const int64_t i = i0 + b * kSelectThreads + tid;
        key[b] = i < n ? key_at(i) : kNotRanked;
      }
#pragma unroll
      for (int b = 0; b < B; ++b) {
        const bool in_play = key[b] != kNotRanked && (digit == 0 || (key[b] >> above) == (prefix >> above));
        warp_histogram_add(sh.hist, (key[b] >> shift) & ((1u << (above - shift)) - 1u), in_play);
      }
    }
    __syncthreads();
    // The bin where the count of smaller keys reaches `want`: two bins a thread, a block scan.
    const uint32_t c0 = sh.hist[2 * tid], c1 = sh.hist[2 * tid + 1];
    uint32_t counted = 0;
    const uint32_t below = block_exclusive_scan<kSelectThreads>(c0 + c1, sh.warp_sums, counted);
    // First digit: never more than the keys counted (the CPU's min); then the keys still
    // wanted among those that share the digits so far.
    const uint32_t want = digit == 0 ? (take < counted ? take : counted) : need;
    if (digit == 0) count = want;
    if (below < want && below + c0 + c1 >= want) {
      const bool first = below + c0 >= want;
      sh.found[0] = static_cast<uint32_t>(2 * tid + (first ? 0 : 1));
      sh.found[1] = first ? below : below + c0;
    }
    sh.hist[2 * tid] = sh.hist[2 * tid + 1] = 0u;  // for the next digit (and the next select)
    __syncthreads();
    if (want > 0) {  // else nothing is taken: no key is below T = 0 and need stays 0
      prefix |= sh.found[0] << shift;
      need = want - sh.found[1];
    }
    __syncthreads();  // found is rewritten by the next digit
  }
  return prefix;
}

// The keys taken by the select (below T, and the first `need` equal to T), in index order:
// emit(at, i) for the at-th of them. kSelectChunk keys at a time, 4 consecutive ones a
// thread: a block scan of the equal keys (their ranks), then one of the keys taken.
template <class KeyAt, class Emit>
__device__ void block_select_emit(KeyAt key_at, int64_t n, uint32_t T, uint32_t need, const SelectShared &sh,
                                  Emit emit) {
  uint32_t equal_before = 0, taken_before = 0;
  for (int64_t i0 = 0; i0 < n; i0 += kSelectChunk) {
    const int64_t first = i0 + 4 * static_cast<int64_t>(threadIdx.x);
    uint32_t key[4], equal_own = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      key[j] = first + j < n ? key_at(first + j) : kNotRanked;
      equal_own += key[j] == T && key[j] != kNotRanked ? 1u : 0u;
    }
    uint32_t equal_total = 0, taken_total = 0;
    uint32_t rank = equal_before + block_exclusive_scan<kSelectThreads>(equal_own, sh.warp_sums, equal_total);
    bool take[4];
    uint32_t taken_own = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const bool equal = key[j] == T && key[j] != kNotRanked;
      take[j] = key[j] < T || (equal && rank < need);
      rank += equal ? 1u : 0u;
      taken_own += take[j] ? 1u : 0u;
    }
    uint32_t at = taken_before + block_exclusive_scan<kSelectThreads>(taken_own, sh.warp_sums, taken_total);
#pragma unroll
    for (int j = 0; j < 4; ++j)
      if (take[j]) emit(at++, first + j);
    equal_before += equal_total;
    taken_before += taken_total;
  }
}

// The norms and bests of both sides (key ||x||^2, key best, value ||x||^2, value best) of a
// chunk's tokens c0 + b kSelectThreads + threadIdx.x, b < 4, 0 past the prefix (no residual
// energy): the loads issued together. The arrays are one head's.
__device__ __forceinline__ void load_chunk(const float *key_norm_sq, const float *key_best, const float *value_norm_sq,
                                           const float *value_best, int64_t P, int64_t c0, float (&x)[4][4]) {
#pragma unroll
  for (int b = 0; b < 4; ++b) {
    const int64_t t = c0 + b * kSelectThreads + threadIdx.x;
    const bool in = t < P;
    x[b][0] = in ? key_norm_sq[t] : 0.0f;
    x[b][1] = in ? key_best[t] : 0.0f;
    x[b][2] = in ? value_norm_sq[t] : 0.0f;
    x[b][3] = in ? value_best[t] : 0.0f;
  }
}

// A round's means of both sides' residual energies from a head's `parts` partials (every lane of
// a warp calls and gets them): lane l sums partials l, l + 32, ..., then the lanes in order, so
// that every kernel that ranks the round sees the same means.
__device__ __forceinline__ void round_means(const float *partials, int64_t parts, int64_t P, float (&mean)[2]) {
  const int lane = threadIdx.x & 31;
  float sum[2] = {0.0f, 0.0f};
  for (int64_t c = lane; c < parts; c += 32)
    for (int side = 0; side < 2; ++side) sum[side] += partials[c * 2 + side];
  for (int side = 0; side < 2; ++side) {
    float total = 0.0f;
    for (int l = 0; l < 32; ++l) total += __shfl_sync(kFullMask, sum[side], l);
    mean[side] = total > 0.0f ? total / static_cast<float>(P) : 1.0f;
  }
}

// Each chunk's sums of both sides' residual energies (||x||^2 - best^2 with local candidates,
// LOCAL 1; ||x||^2 (1 - best) without): partials[y][chunk][2]. Grid (chunks, heads): arrays at
// y P.
template <int LOCAL>
__global__ void __launch_bounds__(kSelectThreads) coverage_energy_kernel(const float *key_norm_sq,
                                                                         const float *key_best,
                                                                         const float *value_norm_sq,
                                                                         const float *value_best, int64_t P,
                                                                         float *partials) {
  constexpr int NW = kSelectThreads / 32;
  AKV_STATIC_SHARED(float, warp_part, [2][NW]);
  const int64_t y = blockIdx.y, c0 = static_cast<int64_t>(blockIdx.x) * kSelectChunk;
  const int tid = threadIdx.x;
  float x[4][4];
  load_chunk(key_norm_sq + y * P, key_best + y * P, value_norm_sq + y * P, value_best + y * P, P, c0, x);
  float acc[2] = {0.0f, 0.0f};
#pragma unroll
  for (int b = 0; b < 4; ++b) {
    acc[0] += uncovered_energy(x[b][0], x[b][1], LOCAL);
    acc[1] += uncovered_energy(x[b][2], x[b][3], LOCAL);
  }
  for (int side = 0; side < 2; ++side) {
    const float w = warp_sum(acc[side]);
    if ((tid & 31) == 0) warp_part[side][tid >> 5] = w;
  }
  __syncthreads();
  if (tid < 2) {
    float sum = 0.0f;
    for (int w = 0; w < NW; ++w) sum += warp_part[tid][w];
    partials[(y * gridDim.x + blockIdx.x) * 2 + tid] = sum;
  }
}

// Each chunk's candidates for the round: the means from a head's `parts` energy partials (the
// energy kernel's chunks or the search's tiles; summed in order by warp 0: the same in every
// block), the keys of the chunk's tokens (anchors kNotRanked), and the chunk's `take` smallest
// (ties the lower token) in token order into its slots of cand_keys / cand_ids (slots:
// select_slots(take); the slots left over get kNotRanked). Grid (chunks, heads): arrays at
// y P, partials at y parts 2, candidates at y chunks slots.
template <int LOCAL>
__global__ void __launch_bounds__(kSelectThreads) coverage_chunk_kernel(
    const float *key_norm_sq, const float *key_best, const float *value_norm_sq, const float *value_best, int64_t P,
    const float *partials, int64_t parts, int64_t take, const int32_t *is_anchor, uint32_t *cand_keys,
    uint32_t *cand_ids) {
  AKV_STATIC_SHARED(uint32_t, keys, [kSelectChunk]);
  AKV_STATIC_SHARED(uint32_t, hist, [kSelectBins]);
  AKV_STATIC_SHARED(uint32_t, warp_sums, [kSelectThreads / 32 + 1]);
  AKV_STATIC_SHARED(uint32_t, found, [2]);
  AKV_STATIC_SHARED(float, mean, [2]);
  const int64_t y = blockIdx.y, chunks = gridDim.x, c0 = static_cast<int64_t>(blockIdx.x) * kSelectChunk;
  const int64_t slots = select_slots(take);
  const int tid = threadIdx.x;
  for (int i = tid; i < kSelectBins; i += kSelectThreads) hist[i] = 0u;
  if (tid < 32) {
    float m[2];
    round_means(partials + y * parts * 2, parts, P, m);
    if (tid == 0) mean[0] = m[0], mean[1] = m[1];
  }
  int32_t anchor[4];
#pragma unroll
  for (int b = 0; b < 4; ++b) {
    const int64_t t = c0 + b * kSelectThreads + tid;
    anchor[b] = t < P ? is_anchor[y * P + t] : 1;
  }
  float x[4][4];
  load_chunk(key_norm_sq + y * P, key_best + y * P, value_norm_sq + y * P, value_best + y * P, P, c0, x);
  __syncthreads();
  const float m0 = mean[0], m1 = mean[1];
#pragma unroll
  for (int b = 0; b < 4; ++b)
    keys[b * kSelectThreads + tid] =
        anchor[b] ? kNotRanked
                  : descending_key(uncovered_energy(x[b][0], x[b][1], LOCAL) / m0 +
                                   uncovered_energy(x[b][2], x[b][3], LOCAL) / m1);
  __syncthreads();
  const SelectShared sh{hist, warp_sums, found};
  const int64_t n = P - c0 < kSelectChunk ? P - c0 : kSelectChunk;
  auto key_at = [&](int64_t i) { return keys[i]; };
  uint32_t need = 0, count = 0;
  const uint32_t T = block_select_threshold(key_at, n, static_cast<uint32_t>(slots), sh, need, count);
  uint32_t *out_keys = cand_keys + (y * chunks + blockIdx.x) * slots, *out_ids = cand_ids + (y * chunks + blockIdx.x) * slots;
  block_select_emit(key_at, n, T, need, sh, [&](uint32_t at, int64_t i) {
    out_keys[at] = keys[i];
    out_ids[at] = static_cast<uint32_t>(c0 + i);
  });
  for (int64_t j = count + tid; j < slots; j += kSelectThreads) out_keys[j] = kNotRanked;
}

// The round's picks of each head: the `take` smallest of its chunks' candidates (n keys a head
// in token order: chunks x slots, kNotRanked in the unused slots), flagged in is_anchor and
// written in token order to picks and fresh (the next absorb's candidates). POOL: the round's
// pool instead, nothing flagged: the keys to fresh and the tokens to picks, in token order, and
// the slots past the candidates kNotRanked (tokens kNoToken). Grid (groups, heads): block x of
// head y selects among its group's keys, [x g, x g + g) of the head's n with g =
// merge_group_keys(n, groups), and writes at x take (the first level of a two-level merge,
// POOL: merge_groups); one group, the whole head. Candidates at y n, flags at y P, picks at
// y picks_stride, fresh at y fresh_stride. (Bounds with one block a multiprocessor: else ptxas
// keeps it to 32 registers and spills one.)
// Two-level merges: a head's n candidates in `groups` groups of whole kSelectChunk passes
// (the last one shorter), each group's `take` smallest by a block (POOL, in token order, padded
// to take), then the take smallest of those groups x take. The groups' picks hold every pick of
// the whole (a key among the take smallest of all, ties the lower token, is among them in its
// group), so both levels pick what one would. A block's select walks its keys kSelectChunk at a
// time (a pass), once for each of three digits and once to emit: at 128K a pool of 2.8K from 32
// chunks is 22 passes in one block a head; in 4 groups side by side, 6 passes each, then 3.
constexpr int kMergeGroupsMost = 8;
__host__ __device__ constexpr int64_t merge_group_keys(int64_t n, int64_t groups) {
  return ((n + groups - 1) / groups + kSelectChunk - 1) / kSelectChunk * kSelectChunk;
}
// The groups for n candidates a head and `take` picks: the count whose passes (a group's, then
// the second level's over groups x take, plus about three passes' worth for its launch and
// set-up) are fewest, 1 (one level) where splitting saves nothing.
inline int merge_groups(int64_t n, int64_t take) {
  const auto passes = [](int64_t x) { return (x + kSelectChunk - 1) / kSelectChunk; };
  int best = 1;
  int64_t fewest = passes(n);
  for (int g = 2; g <= kMergeGroupsMost; ++g) {
    const int64_t group = merge_group_keys(n, g);
    if ((g - 1) * group >= n) continue;  // a group would be empty
    const int64_t cost = passes(group) + passes(g * take) + 3;
    if (cost < fewest) fewest = cost, best = g;
  }
  return best;
}
template <bool POOL>
__global__ void __launch_bounds__(kSelectThreads, 1) coverage_merge_kernel(const uint32_t *cand_keys,
                                                                        const uint32_t *cand_ids, int64_t n,
                                                                        int64_t take, int64_t P, int32_t *is_anchor,
                                                                        uint32_t *picks, int64_t picks_stride,
                                                                        uint32_t *fresh, int64_t fresh_stride) {
  AKV_STATIC_SHARED(uint32_t, hist, [kSelectBins]);
  AKV_STATIC_SHARED(uint32_t, warp_sums, [kSelectThreads / 32 + 1]);
  AKV_STATIC_SHARED(uint32_t, found, [2]);
  const int64_t y = blockIdx.y, group = merge_group_keys(n, gridDim.x), first = blockIdx.x * group;
  cand_keys += y * n + first;
  cand_ids += y * n + first;
  picks += y * picks_stride + blockIdx.x * take;
  fresh += y * fresh_stride + blockIdx.x * take;
  n = n - first < group ? n - first : group;
  for (int i = threadIdx.x; i < kSelectBins; i += kSelectThreads) hist[i] = 0u;
  __syncthreads();
  const SelectShared sh{hist, warp_sums, found};
  auto key_at = [&](int64_t i) { return cand_keys[i]; };
  uint32_t need = 0, count = 0;
  const uint32_t T = block_select_threshold(key_at, n, static_cast<uint32_t>(take), sh, need, count);
  block_select_emit(key_at, n, T, need, sh, [&](uint32_t at, int64_t i) {
    const uint32_t t = cand_ids[i];
    picks[at] = t;
    if (POOL) {
      fresh[at] = cand_keys[i];
    } else {
      fresh[at] = t;
      is_anchor[y * P + t] = 1;
    }
  });
  if (POOL)
    for (int64_t j = count + threadIdx.x; j < take; j += kSelectThreads) {
      picks[j] = kNoToken;
      fresh[j] = kNotRanked;
    }
}

// What coverage_cover_kernel compares, per side (keys 0, values 1): a member as a token
// (`token`: format 3 its row X, format 2 its unit row; head y at y token_stride, token t at t D)
// and as an anchor (`anchor`: format 3 the pool's unit rows as stored, in pool order, head y at y
// anchor_stride; null: the token rows, format 2's unit rows).
struct CoverRows {
  const float *token[2];
  int64_t token_stride[2];
  const float *anchor[2];
  int64_t anchor_stride;
  int storage;  // format 3: the dtype the anchors are stored in (unit_row's: 0 f16, 1 bf16)
};

// The value of a key (descending_key of a non-negative float).
__device__ __forceinline__ float key_value(uint32_t key) {
  const uint32_t bits = ~key & 0x7FFFFFFFu;
  float value;
  memcpy(&value, &bits, 4);
  return value;
}

// A round's cover test (CPU: covered_members in cpu/local_anchors.hpp) over its pool (pool_keys,
// pool_ids: C a head, in token order, kNotRanked / kNoToken past its members): member i is
// covered when a member ranked before it (a smaller key, or an equal key and a lower token), in
// its candidate range (format 3, LOCAL 1: range; format 2: every member), would as an anchor
// lower i's key below kCoverageCut times its own, with the round's means (round_means over the
// head's `parts` partials). final_keys: the member's key, covered ones with the top bit set (so
// that a select takes every uncovered member first; a key's top bit is clear), kNotRanked past
// the members. A warp a member, 8 a block; grid (ceil(C / 8), heads): norms and bests at y P.
template <int LOCAL>
__global__ void __launch_bounds__(256) coverage_cover_kernel(const CoverRows rows, int D, const float *key_norm_sq,
                                                             const float *key_best, const float *value_norm_sq,
                                                             const float *value_best, int64_t P, const float *partials,
                                                             int64_t parts, LocalRange range, const uint32_t *pool_keys,
                                                             const uint32_t *pool_ids, int64_t C, uint32_t *final_keys) {
  const int lane = threadIdx.x & 31;
  const int64_t y = blockIdx.y, i = static_cast<int64_t>(blockIdx.x) * 8 + (threadIdx.x >> 5);
  if (i >= C) return;  // the whole warp
  pool_keys += y * C;
  pool_ids += y * C;
  const uint32_t ki = pool_keys[i];
  if (ki == kNotRanked) {
    if (lane == 0) final_keys[y * C + i] = kNotRanked;
    return;
  }
  float mean[2];
  round_means(partials + y * parts * 2, parts, P, mean);
  const int64_t ti = pool_ids[i];
  const float bar = kCoverageCut * key_value(ki);
  int64_t lo = 0, hi = C;
  if (LOCAL) {
    int64_t first = 0, last = P;
    candidate_positions(range, ti >> range.segment_shift, &first, &last);
    lo = warp_lower_bound_u32(pool_ids, C, first, lane);  // the whole warp, the same member
    hi = warp_lower_bound_u32(pool_ids, C, last, lane);
  }
  const float *norm_sq[2] = {key_norm_sq + y * P, value_norm_sq + y * P}, *best[2] = {key_best + y * P, value_best + y * P};
  float n2[2], b[2], e[2];
  for (int side = 0; side < 2; ++side) {
    n2[side] = norm_sq[side][ti];
    b[side] = best[side][ti];
    e[side] = uncovered_energy(n2[side], b[side], LOCAL);
  }
  bool covered = false;
  // 32 members a trip, a lane each: its key and token, and where it is ranked before i (a smaller
  // key, or an equal key and a lower token) its two products with i, each a serial dot in the
  // lane (no shuffle a pair: the emulation's fibers switch at every one).
  const float *x[2] = {rows.token[0] + y * rows.token_stride[0] + ti * D, rows.token[1] + y * rows.token_stride[1] + ti * D};
  for (int64_t j0 = lo; j0 < hi && !covered; j0 += 32) {
    const int64_t j = j0 + lane;
    const uint32_t kj = j < hi ? pool_keys[j] : kNotRanked;
    const int64_t tj = j < hi ? static_cast<int64_t>(pool_ids[j]) : P;
    bool mine = false;
    if (j < hi && (kj < ki || (kj == ki && tj < ti))) {
      float lowered[2];
      for (int side = 0; side < 2; ++side) {
        const float *a = rows.anchor[side] ? rows.anchor[side] + y * rows.anchor_stride + j * D
                                           : rows.token[side] + y * rows.token_stride[side] + tj * D;
        float c = 0.0f;
        for (int d = 0; d < D; ++d) c += x[side][d] * a[d];
        lowered[side] = LOCAL ? (fabsf(c) > fabsf(b[side]) ? fmaxf(0.0f, n2[side] - c * c) : e[side])
                              : (c * c > b[side] ? n2[side] * fmaxf(0.0f, 1.0f - c * c) : e[side]);
      }
      mine = lowered[0] / mean[0] + lowered[1] / mean[1] < bar;
    }
    covered = __any_sync(kFullMask, mine);
  }
  if (lane == 0) final_keys[y * C + i] = covered ? (ki | 0x80000000u) : ki;
}

}  // namespace cuda
}  // namespace akv
