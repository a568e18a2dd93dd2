// Kernels of storage format 3's part of the AnchorKV compression pass (docs/design.md §2.2 step
// 5 and §3.7; the CPU reference is cpu/local_anchors.cpp and restrict_to_tables in
// cpu/compress_anchorkv.cpp): every token compared with its local candidate anchors only, the
// segment tables, and the one-byte coefficient codes. The orchestration is in
// cuda/compress_anchorkv_pass.hpp.
#pragma once
#include "cuda/compress_kernels.cuh"

namespace akv {
namespace cuda {

// The positions [first, last) whose anchors the tokens of segment `seg` may use besides the
// window (CPU: candidate_range): the segment widened by `reach` positions on each side, the
// whole prefix when reach < 0 (no tables).
struct LocalRange {
  int64_t prefix, reach;
  int32_t segment_shift;
};
__device__ __forceinline__ void candidate_positions(const LocalRange &r, int64_t seg, int64_t *first, int64_t *last) {
  if (r.reach < 0) {
    *first = 0;
    *last = r.prefix;
    return;
  }
  const int64_t t0 = seg << r.segment_shift, end = t0 + (int64_t{1} << r.segment_shift);
  const int64_t t1 = end < r.prefix ? end : r.prefix;
  *first = t0 > r.reach ? t0 - r.reach : 0;
  *last = t1 + r.reach < r.prefix ? t1 + r.reach : r.prefix;
}

// local_nearest_kernel's candidate chunk for an absorb of n_sorted prefix candidates (spread
// over the prefix) and n_tail of the window's: 16 when a segment's tokens expect at most 16 in
// reach (a coverage round's: about 8 at the default anchor share; half the chunk's rows, products
// and offers of 32), else 32. Either gives the same nearest candidates.
inline int local_chunk(const LocalRange &r, int64_t n_sorted, int64_t n_tail) {
  const int64_t span = (int64_t{1} << r.segment_shift) + 2 * r.reach;
  const int64_t width = r.reach < 0 || span > r.prefix ? r.prefix : span;
  const double expected = r.prefix > 0 ? static_cast<double>(n_sorted) * width / r.prefix + n_tail : 0.0;
  return expected <= 16 ? 16 : 32;
}

// The first i in [0, n) with ids[i] >= value (n if none); ids increasing. One warp, every lane
// calling with the same arguments (the same result in every lane): 32 probes a round, whose
// ballot is a prefix of the lanes, narrow the range to one probe's step, so a search takes
// about log32(n) rounds of one load each instead of log2(n) dependent loads of one thread.
__device__ __forceinline__ int64_t warp_lower_bound_u32(const uint32_t *ids, int64_t n, int64_t value, int lane) {
  int64_t lo = 0, hi = n;  // the answer is in [lo, hi]
  while (lo < hi) {
    const int64_t step = (hi - lo + 31) / 32, probe = lo + lane * step;
    const int below = __popc(__ballot_sync(kFullMask, probe < hi && static_cast<int64_t>(ids[probe]) < value));
    if (below == 0) return lo;
    const int64_t at = lo + (below - 1) * step;  // ids[at] < value <= ids[at + step] (if below hi)
    lo = at + 1;
    hi = at + step < hi ? at + step : hi;
  }
  return lo;
}

// Lane l's share of the fp32 x . row of local_nearest_kernel's rescoring: dims l, l + 32, ...
// in order.
template <int D>
__device__ __forceinline__ float strided_partial(const float *x, const float *row, int l) {
  float acc = 0.0f;
#pragma unroll
  for (int j = 0; j < D / 32; ++j) acc += x[l + 32 * j] * row[l + 32 * j];
  return acc;
}

// The fp32 x . row of one lane, in the order of the warp's (local_nearest_kernel's rescoring):
// the 32 strided partials p_l, combined as warp_sum's butterfly combines the lanes' (p_l +
// p_{l+16}, then those 8 apart, 4, 2, 1), so both give the same bits.
template <int D>
__device__ __forceinline__ float lane_dot(const float *x, const float *row) {
  auto p = [&](int l) { return strided_partial<D>(x, row, l); };
  auto a = [&](int l) { return p(l) + p(l + 16); };
  auto b = [&](int l) { return a(l) + a(l + 8); };
  auto c = [&](int l) { return b(l) + b(l + 4); };
  auto d = [&](int l) { return c(l) + c(l + 2); };
  return d(0) + d(1);
}

// Above this many candidates to rescore in a warp, its lanes rescore their own (lane_dot, about
// 450 SASS instructions at D 128, the lanes in parallel) instead of the warp rescoring them one
// at a time (about 70 each).
constexpr int kWarpRescoreMost = 8;

// A candidate (|c|, token) beats the best so far: larger |c|, ties to the lower token; none
// yet: token < 0.
__device__ __forceinline__ bool local_better(float v, int32_t token, float best_v, int32_t best_token) {
  return best_token < 0 || v > best_v || (v == best_v && token < best_token);
}

// Raises every prefix token's nearest candidate with the anchor tokens ids[0..n_sorted)
// (increasing; only those inside the token's candidate positions count) and
// ids[n_sorted..n_sorted + n_tail) (the window: every token's candidates). rows: the
// candidates' rows as stored (rounded to the storage dtype), divided by their norms, in fp32 and
// (rows_b) bf16; row_norm_sq their squared norms (0: never chosen). A token keeps the token of
// largest |x . row| (ties: the lower token) in near_token (-1: none yet) and x . row in
// near_dot, x its pre-RoPE key or value (x_b: the rows in bf16, x_norm_sq: ||x||^2).
// The search is nearest_anchor_kernel's: bf16 tensor-core products of a TOK-token x
// CH-candidate tile (CH 16 or 32, local_chunk: a coverage round's few candidates in reach fill
// a chunk of 16; a tile of tokens lies inside one segment: segments are multiples of 256
// positions), each token keeping its kNearKeep best approximate |c| per part; those within
// kNearMargin ||x|| of the best (every candidate, when a part dropped one there) are rescored
// in fp32. A token whose approximate best is below its best so far by more than the margin is
// left as it is (the usual case in later coverage rounds). Both sides (keys, values) in one
// launch: grid (ceil(P / TOK), 2 x heads) blocks of 128, side y / heads, head y % heads: its X
// at y x_stride, x_b at y P D, ids at y ids_stride, rows and rows_b at y rows_stride,
// row_norm_sq at y rows_stride / D, x_norm_sq and the outputs at y P.
// With `energy_parts` (a coverage round's ranking follows: coverage_chunk_kernel's means), each
// block also sums its tokens' residual energies after the search (||x||^2 - best^2, 0 past the
// prefix; a butterfly over the warp's tokens, then the warps in order: the same on every run)
// into energy_parts[(head y x ceil(P / TOK) + tile) x 2 + side].
// With `stats` (profiling: ANCHORKV_COMPRESS_PROFILE), over the tokens that had a best
// already: stats[0] += such tokens, stats[1] += those left alone, stats[2] += candidates
// rescored for them, stats[3] += those that needed the full scan.
struct LocalSide {
  const float *X;          // the prefix rows (pre-RoPE keys or values), fp32
  const uint16_t *x_b;     // the same in bf16
  const float *x_norm_sq;  // their squared norms
  const float *rows;       // the candidates' unit rows, fp32 and bf16, and squared norms
  const uint16_t *rows_b;
  const float *row_norm_sq;
  int32_t *near_token;  // each token's nearest candidate so far (-1: none) and x . its unit row
  float *near_dot;
};
template <int D, int CH>
__global__ void __launch_bounds__(128) local_nearest_kernel(const LocalSide side0, const LocalSide side1,
                                                            int64_t x_stride, const LocalRange range,
                                                            const uint32_t *ids, int64_t ids_stride, int64_t n_sorted,
                                                            int64_t n_tail, int64_t rows_stride, float *energy_parts,
                                                            uint32_t *stats) {
  constexpr int TOK = near_tokens(D), PARTS = 128 / TOK, PER = CH / PARTS;
  AKV_STATIC_SHARED(__align__(32) uint16_t, xs, [TOK][D + 8]);
  AKV_STATIC_SHARED(__align__(32) uint16_t, as, [CH][D + 8]);
  AKV_STATIC_SHARED(__align__(32) float, cs, [TOK][kNearAnchors + 4]);
  AKV_STATIC_SHARED(int32_t, usable, [CH]);
  AKV_STATIC_SHARED(int64_t, bounds, [2]);
  AKV_STATIC_SHARED(float, warp_energy, [4]);
  const int64_t P = range.prefix, t0 = static_cast<int64_t>(blockIdx.x) * TOK;
  const int heads = static_cast<int>(gridDim.y) / 2;
  const bool second = static_cast<int>(blockIdx.y) >= heads;
  const int64_t y = static_cast<int64_t>(blockIdx.y) - (second ? heads : 0);
  const float *X = (second ? side1.X : side0.X) + y * x_stride;
  const uint16_t *x_b = (second ? side1.x_b : side0.x_b) + y * P * D;
  const float *x_norm_sq = (second ? side1.x_norm_sq : side0.x_norm_sq) + y * P;
  const float *rows = (second ? side1.rows : side0.rows) + y * rows_stride;
  const uint16_t *rows_b = (second ? side1.rows_b : side0.rows_b) + y * rows_stride;
  const float *row_norm_sq = (second ? side1.row_norm_sq : side0.row_norm_sq) + y * (rows_stride / D);
  int32_t *near_token = (second ? side1.near_token : side0.near_token) + y * P;
  float *near_dot = (second ? side1.near_dot : side0.near_dot) + y * P;
  ids += y * ids_stride;
  const int tid = threadIdx.x;
  if (tid < 32) {  // warp 0: the candidate range, while the others start on the token rows
    int64_t first, last;
    candidate_positions(range, t0 >> range.segment_shift, &first, &last);
    const int64_t b0 = warp_lower_bound_u32(ids, n_sorted, first, tid);
    const int64_t b1 = warp_lower_bound_u32(ids, n_sorted, last, tid);
    if (tid == 0) {
      bounds[0] = b0;
      bounds[1] = b1;
    }
  }
  copy_tile_rows<D, TOK>(xs, P - t0, x_b + t0 * D);  // zeros past the prefix
  __syncthreads();
  const int64_t lo = bounds[0], in_range = bounds[1] - bounds[0], count = in_range + n_tail;
  // Candidate c (in token order: the range's, then the window's) is row row_of(c).
  auto row_of = [&](int64_t c) { return c < in_range ? lo + c : n_sorted + (c - in_range); };
  const int mine = tid / PARTS, part = tid % PARTS;  // token of the block, part of each tile
  const int64_t t = t0 + mine;
  const float norm_sq = t < P ? x_norm_sq[t] : 0.0f, x_norm = sqrtf(norm_sq);
  auto chunk_products = [&](int64_t c0) {
    gather_tile_rows<D, CH>(as, count - c0, [&](int j) { return rows_b + row_of(c0 + j) * D; });
    if (tid < CH) usable[tid] = c0 + tid < count && row_norm_sq[row_of(c0 + tid)] > 0.0f;
    __syncthreads();
    nearest_tile_products<D, TOK, CH>(xs, as, cs);
    __syncthreads();
  };
  NearKeep keep;
  float top, worst_drop;
  if (count > 0 && count <= CH) {
    // One chunk (a coverage round's usual case: about 8 candidates in reach): the part's
    // values, the token's largest, then the candidates within the margin of it taken as they
    // come, no running top kNearKeep (its insertions were half the chunk's instructions). More
    // than kNearKeep of a part within the margin: the full scan, as a drop there would give.
    chunk_products(0);
    float v[PER];
    top = -INFINITY;
#pragma unroll
    for (int jj = 0; jj < PER; ++jj) {
      const int j = part * PER + jj;
      v[jj] = usable[j] ? fabsf(cs[mine][j]) : -INFINITY;
      top = fmaxf(top, v[jj]);
    }
    for (int m = 1; m < PARTS; m <<= 1) top = fmaxf(top, __shfl_xor_sync(kFullMask, top, m));
    const float floor_v = top - kNearMargin * x_norm;
    unsigned near = 0;
#pragma unroll
    for (int jj = 0; jj < PER; ++jj) near |= (v[jj] != -INFINITY && v[jj] >= floor_v ? 1u : 0u) << jj;
    worst_drop = __popc(near) > kNearKeep ? top : -INFINITY;
    for (int m = 1; m < PARTS; m <<= 1) worst_drop = fmaxf(worst_drop, __shfl_xor_sync(kFullMask, worst_drop, m));
#pragma unroll
    for (int q = 0; q < kNearKeep; ++q) {
      keep.a[q] = near ? part * PER + __ffs(static_cast<int>(near)) - 1 : -1;
      keep.v[q] = near ? top : -INFINITY;  // at least floor_v: rescored
      near &= near - 1;
    }
  } else {
    for (int64_t c0 = 0; c0 < count; c0 += CH) {
      __syncthreads();  // the previous tile's products are consumed
      chunk_products(c0);
      for (int jj = 0; jj < PER; ++jj) {
        const int j = part * PER + jj;
        if (usable[j]) keep.offer(fabsf(cs[mine][j]), static_cast<int>(c0 + j));
      }
    }
    top = keep.top<PARTS>();
    worst_drop = keep.worst_drop<PARTS>();
  }
  const int32_t had = t < P ? near_token[t] : -1;
  const float had_dot = t < P ? near_dot[t] : 0.0f, had_v = fabsf(had_dot);
  // Nothing to rescore: no usable candidate, or none can reach the best so far.
  const bool skip = t >= P || top == -INFINITY || (had >= 0 && top + kNearMargin * x_norm < had_v);
  const float floor_v = top - kNearMargin * x_norm;
  const bool full_scan = worst_drop >= floor_v;
  float best_v = -1.0f, best_dot = 0.0f;
  int best_c = 0x7fffffff, rescored = 0;
  auto keep_exact = [&](float dot, int64_t c) {
    ++rescored;
    if (nearest_better(fabsf(dot), static_cast<int>(c), best_v, best_c)) {
      best_v = fabsf(dot);
      best_dot = dot;
      best_c = static_cast<int>(c);
    }
  };
  // The candidates to rescore: the kept ones within the margin, or (a part that dropped one
  // there) all of the part's own. With few of them in the warp (later rounds leave most tokens
  // alone), the warp rescores them together, one (lane, candidate) at a time, every lane D / 32
  // dims (coalesced) and a butterfly sum; with many, each lane its own (lane_dot: the same
  // bits).
  const int lane = tid & 31;
  unsigned want[kNearKeep];
  int pairs = 0;
#pragma unroll
  for (int q = 0; q < kNearKeep; ++q) {
    want[q] = __ballot_sync(kFullMask, !skip && !full_scan && keep.a[q] >= 0 && keep.v[q] >= floor_v);
    pairs += __popc(want[q]);
  }
  const unsigned scans = __ballot_sync(kFullMask, !skip && full_scan);
  pairs += __popc(scans) * static_cast<int>((count + PARTS - 1) / PARTS);
  if (pairs > kWarpRescoreMost) {
    auto rescore = [&](int64_t c) {
      const int64_t r = row_of(c);
      if (row_norm_sq[r] > 0.0f) keep_exact(lane_dot<D>(X + t * D, rows + r * D), c);
    };
    // The lane's kept candidates through a rotation (constant indices, one product in the
    // loop's body).
    static_assert(kNearKeep == 4, "the rotation below");
    unsigned mine = 0;
#pragma unroll
    for (int q = 0; q < kNearKeep; ++q) mine |= ((want[q] >> lane) & 1u) << q;
    int c0 = keep.a[0], c1 = keep.a[1], c2 = keep.a[2], c3 = keep.a[3];
#pragma unroll 1
    for (; mine; mine >>= 1) {
      if (mine & 1u) rescore(c0);
      c0 = c1, c1 = c2, c2 = c3;
    }
    if ((scans >> lane) & 1u)
      for (int64_t c = part; c < count; c += PARTS) rescore(c);
  } else {
    auto rescore = [&](int src, int64_t c) {  // every lane calls, with the same src and c
      const int64_t r = row_of(c);
      if (!(row_norm_sq[r] > 0.0f)) return;
      const float dot = warp_sum(strided_partial<D>(X + __shfl_sync(kFullMask, t, src) * D, rows + r * D, lane));
      if (lane == src) keep_exact(dot, c);
    };
#pragma unroll
    for (int q = 0; q < kNearKeep; ++q)
      for (unsigned m = want[q]; m; m &= m - 1) {
        const int src = __ffs(static_cast<int>(m)) - 1;
        rescore(src, __shfl_sync(kFullMask, keep.a[q], src));
      }
    for (unsigned m = scans; m; m &= m - 1) {
      const int src = __ffs(static_cast<int>(m)) - 1;
      for (int64_t c = src % PARTS; c < count; c += PARTS) rescore(src, c);
    }
  }
  if (stats) {  // warp sums, then one atomic each from lane 0
    const bool counted = t < P && had >= 0, mine_counted = counted && part == 0;
    uint32_t c[4] = {mine_counted ? 1u : 0u, mine_counted && skip ? 1u : 0u,
                     counted ? static_cast<uint32_t>(rescored) : 0u, mine_counted && !skip && full_scan ? 1u : 0u};
    for (int i = 0; i < 4; ++i) {
      for (int m = 16; m > 0; m >>= 1) c[i] += __shfl_xor_sync(kFullMask, c[i], m);
      if ((tid & 31) == 0 && c[i]) atomicAdd(&stats[i], c[i]);
    }
  }
  for (int m = 1; m < PARTS; m <<= 1) {
    const float ov = __shfl_xor_sync(kFullMask, best_v, m), od = __shfl_xor_sync(kFullMask, best_dot, m);
    const int oc = __shfl_xor_sync(kFullMask, best_c, m);
    if (nearest_better(ov, oc, best_v, best_c)) best_v = ov, best_dot = od, best_c = oc;
  }
  float dot = had_dot;  // the token's best after the search
  if (part == 0 && !skip && best_c != 0x7fffffff) {
    const int32_t token = static_cast<int32_t>(ids[row_of(best_c)]);
    if (local_better(best_v, token, had_v, had)) {
      near_token[t] = token;
      near_dot[t] = best_dot;
      dot = best_dot;
    }
  }
  if (energy_parts) {  // a tile of each (head, side) a block: gridDim.x tiles a head
    float e = part == 0 && t < P ? uncovered_energy(norm_sq, dot, 1) : 0.0f;
    for (int m = 16; m >= PARTS; m >>= 1) e += __shfl_xor_sync(kFullMask, e, m);  // the warp's tokens
    if (lane == 0) warp_energy[tid >> 5] = e;
    __syncthreads();
    if (tid == 0)  // 32-bit offsets: the partials are far fewer than 2^32 floats of scratch
      energy_parts[(static_cast<unsigned>(y) * gridDim.x + blockIdx.x) * 2u + (second ? 1u : 0u)] =
          ((warp_energy[0] + warp_energy[1]) + warp_energy[2]) + warp_energy[3];
  }
}

// Every prefix token's anchor and coefficient from its nearest candidate (CPU: the local branch
// of step 5): anchors point at themselves with 1, a token whose candidates all have zero norm
// takes anchor 0 with 0, else the candidate's anchor index (a prefix anchor through
// anchor_of_token, a window token P + j as k - W + j) with near_dot / ||anchor||. Grid y over
// heads: arrays at y P, norms at y k.
__global__ void local_assign_kernel(const int32_t *near_token, const float *near_dot, const int32_t *anchor_of_token,
                                    const float *norms, int64_t P, int k, int64_t free_anchors, int32_t *assigned,
                                    float *coef) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= P) return;
  const int64_t y = blockIdx.y;
  near_token += y * P;
  near_dot += y * P;
  anchor_of_token += y * P;
  norms += y * k;
  assigned += y * P;
  coef += y * P;
  int32_t a = anchor_of_token[t];
  float g = 1.0f;
  if (a < 0) {
    const int32_t near = near_token[t];
    if (near < 0) {
      a = 0;
      g = 0.0f;
    } else {
      a = near < P ? anchor_of_token[near] : static_cast<int32_t>(free_anchors + (near - P));
      g = norms[a] > 0.0f ? near_dot[t] / norms[a] : 0.0f;
    }
  }
  assigned[t] = a;
  coef[t] = g;
}

// Ascending sort of n (a power of two, at most the array's size) 32-bit keys by the block's
// threads (bitonic network), in shared memory or in global memory only this block touches.
// A thread takes its pairs of a step kBitonicBatch at a time, every load of a batch before any
// store (the compiler cannot tell that the pairs are disjoint, so a loop of load, compare, store
// waits on every load in turn). Ends with a barrier.
constexpr int kBitonicBatch = 4;
__device__ __forceinline__ void block_bitonic_sort(uint32_t *a, int n) {
  for (int size = 2; size <= n; size <<= 1)
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      __syncthreads();
      for (int i0 = threadIdx.x; i0 < n / 2; i0 += kBitonicBatch * blockDim.x) {
        int lo[kBitonicBatch];
        uint32_t x[kBitonicBatch], y[kBitonicBatch];
#pragma unroll
        for (int b = 0; b < kBitonicBatch; ++b) {
          const int i = i0 + b * static_cast<int>(blockDim.x);
          lo[b] = 2 * i - (i & (stride - 1));
          if (i < n / 2) x[b] = a[lo[b]], y[b] = a[lo[b] + stride];
        }
#pragma unroll
        for (int b = 0; b < kBitonicBatch; ++b)
          if (i0 + b * static_cast<int>(blockDim.x) < n / 2 && (x[b] > y[b]) == ((lo[b] & size) == 0)) {
            a[lo[b]] = y[b];
            a[lo[b] + stride] = x[b];
          }
      }
    }
  __syncthreads();
}

// The candidates of one absorb in token order, for local_nearest_kernel: out[0..n) = ids[0..n)
// sorted, then the window's tokens P..P + tail - 1. A bitonic sort by one block of
// kFreshThreads per head (n is a coverage round's few hundred picks, or the scored share),
// instead of a device-wide sort's half a dozen launches: in shared memory up to kFreshShared
// keys, else in `out` itself. out_stride: at least n + tail and the power of two from n up (the
// padding sorts last). Grid y over heads: ids at y ids_stride, out at y out_stride.
constexpr int kFreshThreads = 1024, kFreshShared = 8192;
__host__ __device__ constexpr int64_t fresh_stride(int64_t n, int64_t tail) {
  int64_t np = 1;
  while (np < n) np <<= 1;
  return np > n + tail ? np : n + tail;
}
__global__ void __launch_bounds__(kFreshThreads) sort_fresh_kernel(const uint32_t *ids, int64_t ids_stride, int64_t n,
                                                                   int64_t P, int64_t tail, uint32_t *out,
                                                                   int64_t out_stride) {
  AKV_STATIC_SHARED(uint32_t, keys, [kFreshShared]);
  ids += blockIdx.y * ids_stride;
  out += blockIdx.y * out_stride;
  int np = 1;
  while (np < n) np <<= 1;
  uint32_t *a = np <= kFreshShared ? keys : out;
  for (int i = threadIdx.x; i < np; i += kFreshThreads) a[i] = i < n ? ids[i] : 0xFFFFFFFFu;
  block_bitonic_sort(a, np);
  if (a == keys)
    for (int i = threadIdx.x; i < n; i += kFreshThreads) out[i] = keys[i];
  for (int j = threadIdx.x; j < tail; j += kFreshThreads) out[n + j] = static_cast<uint32_t>(P + j);
}

constexpr int kTableThreads = 256;
constexpr int kTableSlots = 256;  // core/layout.hpp's kTableEntries (one-byte entries)
constexpr int kMaxSegment = 4096;  // segment_length()'s largest
constexpr uint32_t kNoEntry = 0xFFFFFFFFu;
constexpr int kTableBatch = 4;  // segment_tables_kernel's token-sides a thread per batch of loads

// One segment of one head, both sides (CPU: restrict_to_tables and the code scales). With
// tables (table_size 256): the table lists the anchors the segment's non-anchor tokens use
// most, both sides counted (ties: the lower anchor; a short table repeats its first entry); a
// token whose anchor is not in it goes on the `outside` list (outside[0]: the count, zero
// before; then pairs (head y x 2 + side, token)) for table_misses_kernel. Without tables an
// entry is the anchor index itself. Then each side's code scale, the largest |coefficient| of
// the segment's non-anchor tokens (table_misses_kernel raises it with those outside). Anchor
// tokens keep entry 0. One block of 256 threads per (segment, head): the (at most 8192)
// assignments are sorted in shared memory, the run lengths become (count, anchor) keys and
// those are sorted again. Grid y over heads: token arrays at y P, tables at y segments 256,
// scales at y segments 2. With `stats` (profiling), local_nearest_kernel's array: stats[4] +=
// the tokens (both sides) outside their table, stats[5] = the most in one block.
__global__ void __launch_bounds__(kTableThreads, 4) segment_tables_kernel(
    int64_t P, int32_t segment_shift, int64_t segments, int table_size, const int32_t *anchor_of_token,
    const int32_t *assigned0, const int32_t *assigned1, const float *coef0, const float *coef1, uint8_t *entry0,
    uint8_t *entry1, uint16_t *tables, float *scales, uint32_t *outside, uint32_t *stats) {
  AKV_STATIC_SHARED(uint32_t, buf, [2 * kMaxSegment]);
  AKV_STATIC_SHARED(int32_t, missing, [1]);
  AKV_STATIC_SHARED(uint32_t, lut, [kTableSlots]);
  AKV_STATIC_SHARED(uint16_t, table, [kTableSlots]);
  AKV_STATIC_SHARED(int32_t, distinct, [1]);
  AKV_STATIC_SHARED(float, warp_max_v, [2][kTableThreads / 32]);
  const int64_t seg = blockIdx.x, t0 = seg << segment_shift;
  const int64_t end = t0 + (int64_t{1} << segment_shift), n = (end < P ? end : P) - t0;
  {
    const int64_t y = blockIdx.y;
    anchor_of_token += y * P;
    assigned0 += y * P;
    assigned1 += y * P;
    coef0 += y * P;
    coef1 += y * P;
    entry0 += y * P;
    entry1 += y * P;
    tables += (y * segments + seg) * table_size;
    scales += (y * segments + seg) * 2;
  }
  // Each side's arrays by a select, not an array of pointers indexed at run time (which ptxas
  // kept in local memory: an 80-byte stack, 17 local accesses).
  const auto assigned = [=](int side) { return side ? assigned1 : assigned0; };
  const auto coef = [=](int side) { return side ? coef1 : coef0; };
  const auto entry = [=](int side) { return side ? entry1 : entry0; };
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (tid == 0) missing[0] = 0;  // the barriers of the table's sorts come before its first use
  int nt = 0;  // table entries in use
  if (table_size > 0) {
    int np = 2;
    while (np < 2 * n) np <<= 1;
    for (int i0 = tid; i0 < np; i0 += kTableBatch * kTableThreads) {  // the loads of a batch together
      int32_t own[kTableBatch], a[kTableBatch];
#pragma unroll
      for (int b = 0; b < kTableBatch; ++b) {
        const int i = i0 + b * kTableThreads, side = i >= n ? 1 : 0;
        const int64_t t = t0 + (i - side * n);
        own[b] = i < 2 * n ? anchor_of_token[t] : 0;
        a[b] = i < 2 * n ? assigned(side)[t] : 0;
      }
#pragma unroll
      for (int b = 0; b < kTableBatch; ++b) {
        const int i = i0 + b * kTableThreads;
        if (i < np) buf[i] = i < 2 * n && own[b] < 0 ? static_cast<uint32_t>(a[b]) : kNoEntry;
      }
    }
    block_bitonic_sort(buf, np);
    // Each run of one anchor becomes one key (count descending, then anchor ascending) at its
    // first element; the rest become kNoEntry. A thread owns `per` consecutive elements.
    const int per = np >= kTableThreads ? np / kTableThreads : 1;
    uint32_t run_key[2 * kMaxSegment / kTableThreads];
#pragma unroll
    for (int j = 0; j < 2 * kMaxSegment / kTableThreads; ++j) {
      const int i = tid * per + j;
      run_key[j] = kNoEntry;
      if (j >= per || i >= np) continue;
      const uint32_t v = buf[i];
      if (v == kNoEntry || (i > 0 && buf[i - 1] == v)) continue;
      int c = 1;
      while (i + c < np && buf[i + c] == v) ++c;
      run_key[j] = (static_cast<uint32_t>(0x3FFF - c) << 16) | v;
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < 2 * kMaxSegment / kTableThreads; ++j)
      if (j < per && tid * per + j < np) buf[tid * per + j] = run_key[j];
    if (tid == 0) distinct[0] = 0;
    block_bitonic_sort(buf, np);
    for (int i = tid; i < np; i += kTableThreads)
      if (buf[i] != kNoEntry && (i + 1 == np || buf[i + 1] == kNoEntry)) distinct[0] = i + 1;
    __syncthreads();
    const int nd = distinct[0];
    nt = nd < table_size ? nd : table_size;
    for (int j = tid; j < table_size; j += kTableThreads) {
      const uint16_t a = static_cast<uint16_t>(j < nd ? buf[j] & 0xFFFFu : (nd ? buf[0] & 0xFFFFu : 0u));
      tables[j] = a;
      table[j] = a;
      lut[j] = j < nt ? (static_cast<uint32_t>(a) << 16 | static_cast<uint32_t>(j)) : kNoEntry;
    }
    block_bitonic_sort(lut, kTableSlots);
  }
  // Entries, kTableBatch token-sides a thread at a time (their loads issued together), and the
  // largest |coefficient| of each side. A token whose anchor has no entry goes on the `outside`
  // list for table_misses_kernel. (One warp a token, in turn, made 512 dependent trips to
  // memory a warp per segment at 2048 positions, and each token outside its table a scan of
  // 256 entries on its warp, an entry a trip: the stage took 30x its prediction on the first
  // device.)
  float mx[2] = {0.0f, 0.0f};  // indexed by constants only (a run-time index puts it on the stack)
  for (int64_t i0 = tid; i0 < 2 * n; i0 += kTableBatch * kTableThreads) {
    int32_t own[kTableBatch], a[kTableBatch];
    float c[kTableBatch];
#pragma unroll
    for (int b = 0; b < kTableBatch; ++b) {
      const int64_t i = i0 + b * kTableThreads;
      const int side = i >= n ? 1 : 0;
      const int64_t t = t0 + (i - side * n);
      const bool in = i < 2 * n;
      own[b] = in ? anchor_of_token[t] : 0;
      a[b] = in ? assigned(side)[t] : 0;
      c[b] = in ? coef(side)[t] : 0.0f;
    }
#pragma unroll
    for (int b = 0; b < kTableBatch; ++b) {
      const int64_t i = i0 + b * kTableThreads;
      if (i >= 2 * n || own[b] >= 0) continue;
      const int side = i >= n ? 1 : 0;
      const int64_t t = t0 + (i - side * n);
      int slot = a[b];  // without tables an entry is the anchor index itself
      if (table_size > 0) {
        int lo = 0, hi = nt;  // the first lut key >= a's
        while (lo < hi) {
          const int mid = (lo + hi) >> 1;
          if ((lut[mid] >> 16) < static_cast<uint32_t>(a[b])) lo = mid + 1;
          else hi = mid;
        }
        if (lo == nt || static_cast<int32_t>(lut[lo] >> 16) != a[b]) {  // table_misses_kernel's
          atomicAdd(&missing[0], 1);
          const uint32_t at = atomicAdd(&outside[0], 1u);
          outside[1 + 2 * at] = static_cast<uint32_t>(blockIdx.y * 2 + side);
          outside[2 + 2 * at] = static_cast<uint32_t>(t);
          continue;
        }
        slot = static_cast<int>(lut[lo] & 0xFFFFu);
      }
      entry(side)[t] = static_cast<uint8_t>(slot);
      if (side) mx[1] = fmaxf(mx[1], fabsf(c[b]));
      else mx[0] = fmaxf(mx[0], fabsf(c[b]));
    }
  }
  __syncthreads();  // the count is complete
  const int listed = missing[0];
  if (stats && tid == 0 && listed > 0) {
    atomicAdd(&stats[4], static_cast<uint32_t>(listed));
    atomicMax(&stats[5], static_cast<uint32_t>(listed));
  }
  for (int side = 0; side < 2; ++side) {
    const float m = warp_max(mx[side]);
    if (lane == 0) warp_max_v[side][warp] = m;
  }
  __syncthreads();
  if (tid < 2) {
    float m = 0.0f;
    for (int w = 0; w < kTableThreads / 32; ++w) m = fmaxf(m, warp_max_v[tid][w]);
    scales[tid] = m;
  }
}

// The tokens segment_tables_kernel listed as outside their tables (outside[0] of them, then
// pairs (head y x 2 + side, token)): each takes the entry of its segment's table (table_size
// entries, all in use: a table that holds every anchor its tokens use leaves none out) of
// largest |cos| (zero-norm anchors last, ties the lower entry) with its coefficient, from the
// stored anchor rows (bf16 when BF16, else fp16), and raises its segment's code scale. One warp
// a token (its row staged in shared memory), a lane an entry at a time (the whole row's loads
// issued together, its dot product and norm), then the warp's best. Any grid (the warps take the
// list in turn), so that a segment with many such tokens spreads over the device. Head y's X at
// y x_stride, token arrays at y P, stored anchor rows at y k D, tables at y segments
// table_size, scales at y segments 2.
constexpr int kMissThreads = 256;
template <int D, bool BF16>
__global__ void __launch_bounds__(kMissThreads) table_misses_kernel(
    const uint32_t *outside, const float *keys, const float *values, int64_t x_stride, int64_t P,
    int32_t segment_shift, int64_t segments, int table_size, int k, const uint16_t *anchors0,
    const uint16_t *anchors1, const uint16_t *tables, int32_t *assigned0, int32_t *assigned1, float *coef0,
    float *coef1, uint8_t *entry0, uint8_t *entry1, float *scales) {
  AKV_STATIC_SHARED(__align__(16) float, xs, [kMissThreads / 32][D]);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kMissThreads / 32);
  const uint32_t listed = outside[0];
  float *x = xs[warp];
  for (int64_t m = static_cast<int64_t>(blockIdx.x) * (kMissThreads / 32) + warp; m < listed; m += warps) {
    const uint32_t code = outside[1 + 2 * m];
    const int64_t y = code >> 1, t = outside[2 + 2 * m];
    const int side = code & 1;
    const int64_t seg = t >> segment_shift;
    const uint16_t *table = tables + (y * segments + seg) * table_size;
    const float *src = (side ? values : keys) + y * x_stride + t * D;
    __syncwarp();  // the previous token's reads of x are done
#pragma unroll
    for (int d = lane; d < D; d += 32) x[d] = src[d];
    __syncwarp();
    const uint16_t *rows = (side ? anchors1 : anchors0) + y * k * D;
    int best = 0x7FFFFFFF;
    float best_v = -1.0f, best_c = 0.0f, best_norm = 0.0f;
    for (int j = lane; j < table_size; j += 32) {
      const uint4 *row = reinterpret_cast<const uint4 *>(rows + static_cast<int64_t>(table[j]) * D);
      uint4 r[D / 8];
#pragma unroll
      for (int q = 0; q < D / 8; ++q) r[q] = load_ro(row + q);
      float xa = 0.0f, aa = 0.0f;
#pragma unroll
      for (int q = 0; q < D / 8; ++q) {
        float f[8];
        unpack8(r[q], BF16, f);
        const float4 x0 = reinterpret_cast<const float4 *>(x)[2 * q], x1 = reinterpret_cast<const float4 *>(x)[2 * q + 1];
        const float xv[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          xa += xv[e] * f[e];
          aa += f[e] * f[e];
        }
      }
      const float norm = sqrtf(aa);
      const float c = norm > 0.0f ? xa / norm : 0.0f;
      const float v = norm > 0.0f ? fabsf(c) : -0.5f;
      if (v > best_v) {  // j increases: the lane keeps its lowest among equals
        best_v = v;
        best = j;
        best_c = c;
        best_norm = norm;
      }
    }
    float v = best_v;
    int j = best;
    for (int s = 16; s > 0; s >>= 1) {
      const float ov = __shfl_xor_sync(kFullMask, v, s);
      const int oj = __shfl_xor_sync(kFullMask, j, s);
      if (ov > v || (ov == v && oj < j)) v = ov, j = oj;
    }
    if (best == j) {  // the lane that holds the warp's best (j % 32 == lane)
      const float g = best_norm > 0.0f ? best_c / best_norm : 0.0f;
      (side ? assigned1 : assigned0)[y * P + t] = table[j];
      (side ? coef1 : coef0)[y * P + t] = g;
      (side ? entry1 : entry0)[y * P + t] = static_cast<uint8_t>(j);
      // |g| as bits: a non-negative float's order is its bits' order
      atomicMax(reinterpret_cast<uint32_t *>(scales) + (y * segments + seg) * 2 + side, float_as_bits(fabsf(g)));
    }
  }
}

// One side's coefficient codes and residuals (CPU: the format-3 branch of step 5): a
// non-anchor token codes its coefficient against its segment's scale (gamma_code), stores the
// code, and its residual x - gamma_value * anchor (the stored anchor row) gives r_norm_sq and,
// for keys, the residual rotated to the token's position in rk (for the utilities). index_out
// and gamma_out get the anchor index and the coded coefficient in bf16 (what encode_kernel
// reads: format 2's arrays, in scratch). Anchor tokens: code 0, residual 0. One warp per
// token; grid y over heads (token arrays at y P, X at y x_stride, anchors at y k D, scales at y
// segments 2, rk at y P D).
__global__ void code_coefficients_kernel(const int32_t *assigned, const float *coef, const float *scales,
                                         const float *units, int64_t P, int32_t segment_shift, int64_t segments,
                                         int side, int k, int D, const float *X, int64_t x_stride,
                                         const uint16_t *anchors, int storage_bf16, const int32_t *anchor_of_token,
                                         uint8_t *code_out, uint16_t *index_out, uint16_t *gamma_out,
                                         const int32_t *positions, int pairs, const float *inv_freq,
                                         const int32_t *rope_first, const int32_t *rope_second, float *rk,
                                         float *r_norm_sq) {
  const int lane = threadIdx.x & 31;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + (threadIdx.x >> 5);
  if (t >= P) return;
  {
    const int64_t y = blockIdx.y;
    assigned += y * P;
    coef += y * P;
    scales += y * segments * 2;
    X += y * x_stride;
    anchors += y * k * D;
    anchor_of_token += y * P;
    code_out += y * P;
    index_out += y * P;
    gamma_out += y * P;
    rk += y * P * D;
    r_norm_sq += y * P;
  }
  if (anchor_of_token[t] >= 0) {  // exact through the anchor list
    if (lane == 0) {
      index_out[t] = static_cast<uint16_t>(anchor_of_token[t]);
      gamma_out[t] = float_to_bits(1.0f, true);
      r_norm_sq[t] = 0.0f;
    }
    if (side == 0)
      for (int d = lane; d < D; d += 32) rk[t * D + d] = 0.0f;
    return;
  }
  const int32_t a = assigned[t];
  const float scale = scales[(t >> segment_shift) * 2 + side];
  const uint8_t code = gamma_code(coef[t], scale);
  const uint16_t gbits = float_to_bits(scale * units[code], true);
  if (lane == 0) {
    code_out[t] = code;
    index_out[t] = static_cast<uint16_t>(a);
    gamma_out[t] = gbits;
  }
  store_residual(X + t * D, bits_to_float(gbits, true), [&](int d) {
    return bits_to_float(anchors[static_cast<int64_t>(a) * D + d], storage_bf16 != 0);
  }, D, side, positions[t], pairs, inv_freq, rope_first, rope_second, rk + t * D, r_norm_sq + t);
}

}  // namespace cuda
}  // namespace akv
