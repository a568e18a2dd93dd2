// Kernels of the AnchorKV compression pass on the GPU (docs/design.md §2.2, the CPU reference is
// cpu/compress_anchorkv.cpp): loading the prefill tensors, the window softmax, scores and
// pooling, anchors, nearest-anchor assignment, residual bitmasks and the residual encoding (the
// window outputs and the utilities on the tensor cores: window_outputs_kernels.cuh,
// utility_kernels.cuh). The orchestration is in cuda/compress_pipeline.hpp.
#pragma once
#include "core/codebook.hpp"
#include "core/rng.hpp"
#include "cuda/device_common.cuh"

namespace akv {
namespace cuda {

struct PrefillArgs {
  const void *keys = nullptr, *values = nullptr, *queries = nullptr;
  int32_t dtype = 0;
  int64_t kv_head_stride = 0, kv_token_stride = 0, q_head_stride = 0, q_token_stride = 0;
  int64_t seq_len = 0;
  int32_t heads = 0, q_heads = 0, head_dim = 0, window = 0;
  int32_t keys_post_rope = 0, rope_pairs = 0;
  const int32_t *positions = nullptr;                          // device [S]
  const float *inv_freq = nullptr;                             // device [pairs]
  const int32_t *rope_first = nullptr, *rope_second = nullptr;  // device [pairs]
  int32_t *bad = nullptr;                                      // device flag: non-finite input
  const int32_t *block_table = nullptr;  // device [ceil(S / block_size)]; null = not paged
  int64_t block_size = 0, kv_block_stride = 0;
};

// Element offset of (head h, token t, dim 0) in keys/values, through the block table if paged
// (the same arithmetic as cpu/prefill_reader.hpp).
__device__ __forceinline__ int64_t kv_offset(const PrefillArgs &a, int h, int64_t t) {
  if (!a.block_table) return h * a.kv_head_stride + t * a.kv_token_stride;
  return a.block_table[t / a.block_size] * a.kv_block_stride + (t % a.block_size) * a.kv_token_stride +
         h * a.kv_head_stride;
}

__device__ __forceinline__ bool finite(float x) { return (x - x) == 0.0f; }

// What format 3's candidate search reads of every prefix token (t < prefix) besides its rows:
// the squared norms of the pre-RoPE key and the value (side 0, 1; head y's at y prefix) and
// both rows in bf16 (at y prefix D). norm_sq[0] nullptr: none.
struct PrefixRows {
  float *norm_sq[2];
  uint16_t *rows_b[2];
  int64_t prefix;
};

// One token per warp (4 per block): pre- and post-RoPE keys and values of head h + blockIdx.y,
// in float (grid y over heads: head h + y's rows start at y * S * D), and when asked the prefix
// rows' squared norms (unit_row's, summed in its order) and bf16 copies, made here
// rather than by reading the rows back. kpost_b (when given, at y S D; only for bf16 keys given
// post-RoPE or without RoPE, so exact): the post-RoPE keys in bf16 instead of kpost, the keys
// rotated back in place in kpre.
__global__ void load_head_kernel(const __grid_constant__ PrefillArgs a, int h0, float *kpre, float *kpost, float *v,
                                 const PrefixRows prefix, uint16_t *kpost_b) {
  const int lane = threadIdx.x & 31;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * 4 + (threadIdx.x >> 5);
  if (t >= a.seq_len) return;
  const int D = a.head_dim;
  const int h = h0 + static_cast<int>(blockIdx.y);
  const int64_t head_rows = static_cast<int64_t>(blockIdx.y) * a.seq_len * D;
  kpre += head_rows;
  kpost += head_rows;
  v += head_rows;
  if (kpost_b) kpost_b += head_rows + t * D;
  const int64_t src = kv_offset(a, h, t);
  // The keys as given, and their other form (the same row with kpost_b: each rotary pair is
  // read and written by one lane).
  float *given = (a.keys_post_rope && !kpost_b ? kpost : kpre) + t * D;
  float *other = kpost_b ? given : (a.keys_post_rope ? kpre : kpost) + t * D;
  bool bad = false;
  for (int d = lane; d < D; d += 32) {
    const float k = load_elem(a.keys, a.dtype, src + d), x = load_elem(a.values, a.dtype, src + d);
    bad = bad || !finite(k) || !finite(x);
    given[d] = k;
    v[t * D + d] = x;
    if (kpost_b) kpost_b[d] = float_to_bits(k, true);
  }
  __syncwarp();
  if (other != given)
    for (int d = 2 * a.rope_pairs + lane; d < D; d += 32) other[d] = given[d];
  const int64_t pos = a.positions[t];
  for (int j = lane; j < a.rope_pairs; j += 32) {
    const int f = a.rope_first[j], s = a.rope_second[j];
    float c, sn;
    rope_angle(pos, a.inv_freq[j], &c, &sn);
    if (a.keys_post_rope) sn = -sn;  // pre-RoPE from post-RoPE: rotate back
    const float x0 = given[f], x1 = given[s];
    other[f] = x0 * c - x1 * sn;
    other[s] = x0 * sn + x1 * c;
  }
  if (bad) atomicAdd(a.bad, 1);
  if (!prefix.norm_sq[0] || t >= prefix.prefix) return;
  __syncwarp();  // the warp's pre-RoPE key row is written
  const int64_t at = static_cast<int64_t>(blockIdx.y) * prefix.prefix + t;
  const float *row[2] = {kpre + t * D, v + t * D};
  for (int side = 0; side < 2; ++side) {
    float n2 = 0.0f;
    for (int d = lane; d < D; d += 32) {
      const float x = row[side][d];
      n2 += x * x;
      prefix.rows_b[side][at * D + d] = float_to_bits(x, true);
    }
    n2 = warp_sum(n2);
    if (lane == 0) prefix.norm_sq[side][at] = n2;
  }
}

// The window queries of KV head h's group: Q[g * W + w][D] (one row per block of 32); grid y
// over heads: head h0 + y's m = gridDim.x rows start at y * m * D. q_b (when given): the rows
// in bf16 too (bf16 queries: exact).
__global__ void load_queries_kernel(const __grid_constant__ PrefillArgs a, int h0, float *q, uint16_t *q_b) {
  const int r = blockIdx.x, lane = threadIdx.x;
  const int G = a.q_heads / a.heads, W = a.window, D = a.head_dim;
  const int h = h0 + static_cast<int>(blockIdx.y);
  q += static_cast<int64_t>(blockIdx.y) * gridDim.x * D;
  if (q_b) q_b += static_cast<int64_t>(blockIdx.y) * gridDim.x * D;
  const int hq = h * G + r / W, w = r % W;
  const int64_t src = hq * a.q_head_stride + static_cast<int64_t>(w) * a.q_token_stride;
  bool bad = false;
  for (int d = lane; d < D; d += 32) {
    const float x = load_elem(a.queries, a.dtype, src + d);
    bad = bad || !finite(x);
    q[static_cast<int64_t>(r) * D + d] = x;
    if (q_b) q_b[static_cast<int64_t>(r) * D + d] = float_to_bits(x, true);
  }
  if (bad) atomicAdd(a.bad, 1);
}

// Block-wide reductions over 128 threads (scratch: 4 floats of shared memory).
__device__ __forceinline__ float block_sum128(float v, float *scratch) {
  v = warp_sum(v);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  return (scratch[0] + scratch[1]) + (scratch[2] + scratch[3]);
}
__device__ __forceinline__ float block_max128(float v, float *scratch) {
  v = warp_max(v);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  return fmaxf(fmaxf(scratch[0], scratch[1]), fmaxf(scratch[2], scratch[3]));
}

// Window attention rows in place: row r of A [m][S] sees tokens 0..P + r % W (causal window
// mask), softmax over them, zeros after. One block of 128 per row, two passes over the row: an
// online max and sum (a thread's sum rescaled when its max rises; the threads' pairs combined
// at the block's max), then every entry exp(a - max) / sum. (Three passes before: max, then
// the exponentials written and summed, then the scaling; the row crosses HBM three times now,
// five then.)
__global__ void __launch_bounds__(128) window_softmax_kernel(float *A, int64_t S, int64_t P, int W) {
  AKV_STATIC_SHARED(float, scratch, [4]);
  const int64_t r = blockIdx.x;
  float *row = A + r * S;
  const int64_t visible = P + r % W + 1;
  float mx = -INFINITY, sum = 0.0f;
  for (int64_t t = threadIdx.x; t < visible; t += 128) {
    const float a = row[t];
    if (a > mx) {
      sum = sum * expf(mx - a) + 1.0f;  // expf(-inf) = 0 for the first
      mx = a;
    } else {
      sum += expf(a - mx);
    }
  }
  const float block_mx = block_max128(mx, scratch);
  sum = block_sum128(mx == -INFINITY ? 0.0f : sum * expf(mx - block_mx), scratch);
  const float inv = 1.0f / sum;
  for (int64_t t = threadIdx.x; t < S; t += 128) row[t] = t < visible ? expf(row[t] - block_mx) * inv : 0.0f;
}

// Mean attention over the m rows (raw scores) and mean squared attention, per prefix token
// (grid y over heads: A [y][m][S], raw and alpha_sq [y][P]).
__global__ void scores_kernel(const float *A, int64_t S, int64_t P, int m, float *raw, float *alpha_sq) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= P) return;
  A += static_cast<int64_t>(blockIdx.y) * m * S;
  raw += static_cast<int64_t>(blockIdx.y) * P;
  alpha_sq += static_cast<int64_t>(blockIdx.y) * P;
  float s = 0.0f, s2 = 0.0f;
  for (int r = 0; r < m; ++r) {
    const float a = A[r * S + t];
    s += a;
    s2 += a * a;
  }
  raw[t] = s / m;
  alpha_sq[t] = s2 / m;
}

// TOVA: acc[t] += (sum over the head's G query heads of the last window row's attention,
// rows gi * W + W - 1 of A [m][S]) / heads_q, t < P: over the layer's heads, the mean over
// all its query heads, summed in the CPU's order.
__global__ void last_row_scores_kernel(const float *A, int64_t S, int64_t P, int G, int W, int heads_q, float *acc) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= P) return;
  float s = 0.0f;
  for (int gi = 0; gi < G; ++gi) s += A[(static_cast<int64_t>(gi) * W + W - 1) * S + t];
  acc[t] += s / static_cast<float>(heads_q);
}

// Knorm (recency = 0): raw[t] = -|K_t| of the post-RoPE keys [S][D], summed in order as the
// CPU does; StreamingLLM (recency = 1): recency_score (core/codebook.hpp).
__global__ void key_scores_kernel(const float *K, int64_t P, int D, int recency, int64_t sinks, float *raw) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= P) return;
  if (recency) {
    raw[t] = recency_score(t, sinks);
    return;
  }
  float s = 0.0f;
  for (int d = 0; d < D; ++d) s += K[t * D + d] * K[t * D + d];
  raw[t] = -sqrtf(s);
}

// Order-preserving map of a float to uint32, inverted so that ascending = descending value.
__device__ __forceinline__ uint32_t descending_key(float value) {
  uint32_t bits;
  memcpy(&bits, &value, 4);
  bits = (bits & 0x80000000u) ? ~bits : bits | 0x80000000u;
  return ~bits;
}

// Pooling over a window of `kernel` tokens (zero padding; the average divides by kernel),
// then the largest pooled score of the token and the `follow` tokens before it (AnchorKV's
// follow_tokens; CPU: pool_scores, follow_scores). Also the sort keys of the anchor selection:
// descending score as an ascending key; the first `sinks` tokens get key 0, ahead of every
// score (ties: lower index). Grid y over heads: raw, keys and index [y][P] (index: the token
// within the head).
__global__ void pool_kernel(const float *raw, int64_t P, int kernel, int max_pool, int follow, int64_t sinks,
                            uint32_t *keys, uint32_t *index) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= P) return;
  raw += static_cast<int64_t>(blockIdx.y) * P;
  keys += static_cast<int64_t>(blockIdx.y) * P;
  index += static_cast<int64_t>(blockIdx.y) * P;
  const int half = kernel / 2;
  float score = -INFINITY;
  for (int64_t c = t; c >= 0 && c >= t - follow; --c) {
    float acc = max_pool ? -INFINITY : 0.0f;
    for (int64_t u = c - half; u <= c + half; ++u) {
      if (u < 0 || u >= P) continue;
      acc = max_pool ? fmaxf(acc, raw[u]) : acc + raw[u];
    }
    score = fmaxf(score, max_pool ? acc : acc / static_cast<float>(kernel));
  }
  keys[t] = t < sinks ? 0u : descending_key(score);
  index[t] = static_cast<uint32_t>(t);
}

// The uniform share's keys: tokens ranked after the top share get their counter hash
// (core/rng.hpp's hash_keys, as the CPU's select_anchors).
__global__ void sample_keys_kernel(const uint32_t *ranked, int64_t from, int64_t P, uint64_t seed, uint64_t stream,
                                   uint64_t layer_head, uint64_t *keys, uint32_t *index) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= P - from) return;
  const uint32_t t = ranked[from + i];
  keys[i] = hash_keys(seed, stream, layer_head, t);
  index[i] = t;
}

// Anchor rows of head h for one side: storage-dtype copies into the cache, float copies,
// norms and normalised rows. One block of 128 per anchor; anchor a's token is picks[a]
// (sorted non-window picks) or P + a - free for the window. Grid (k, heads): head y's rows
// at X + y x_stride, its picks and anchor_tokens at y free_anchors, out, anchor_f, anchor_n,
// anchor_b at y k D, norms at y k, anchor_of_token at y P.
__global__ void __launch_bounds__(128) anchors_kernel(const float *X, int64_t x_stride, const uint32_t *picks,
                                                      int64_t free_anchors, int64_t P, int D, int storage_bf16,
                                                      uint16_t *out, float *anchor_f, float *anchor_n,
                                                      uint16_t *anchor_b, float *norms, int64_t *anchor_tokens,
                                                      int32_t *anchor_of_token) {
  AKV_STATIC_SHARED(float, scratch, [4]);
  const int64_t a = blockIdx.x;
  {
    const int64_t y = blockIdx.y, k = gridDim.x;
    X += y * x_stride;
    picks += y * free_anchors;
    out += y * k * D;
    anchor_f += y * k * D;
    anchor_n += y * k * D;
    anchor_b += y * k * D;
    norms += y * k;
    if (anchor_tokens) anchor_tokens += y * free_anchors;
    anchor_of_token += y * P;
  }
  const int64_t token = a < free_anchors ? static_cast<int64_t>(picks[a]) : P + (a - free_anchors);
  if (threadIdx.x == 0 && a < free_anchors) {
    if (anchor_tokens) anchor_tokens[a] = token;
    anchor_of_token[token] = static_cast<int32_t>(a);
  }
  float n2 = 0.0f;
  for (int d = threadIdx.x; d < D; d += 128) {
    const uint16_t bits = float_to_bits(X[token * D + d], storage_bf16 != 0);
    out[a * D + d] = bits;
    const float f = bits_to_float(bits, storage_bf16 != 0);
    anchor_f[a * D + d] = f;
    n2 += f * f;
  }
  const float norm = sqrtf(block_sum128(n2, scratch));
  const float inv = norm > 0.0f ? 1.0f / norm : 0.0f;
  for (int d = threadIdx.x; d < D; d += 128) {
    anchor_n[a * D + d] = anchor_f[a * D + d] * inv;
    anchor_b[a * D + d] = float_to_bits(anchor_f[a * D + d] * inv, true);
  }
  if (threadIdx.x == 0) norms[a] = norm;
}

// ---- Nearest anchor by |cos|, fused (the n x k score matrix is never written) -------------
//
// One block of 128 threads per TOK tokens (64 for D <= 128, else 32: the tiles stay in 48 KB
// of static shared memory). Anchor tiles of 32 unit anchors go through shared memory in bf16
// with the block's token rows (bf16); the TOK x 32 products come from the tensor cores
// (ldmatrix and mma.m16n8k16, fp32 accumulation; the emulation runs the same fragments) and
// each token keeps, per part of a tile (128 / TOK threads per token), its 4 best approximate
// |c| and the best one it had to drop. The approximation is within (2u + u^2) sum |x_d a_d| <= 0.0079 ||x||
// of the fp32 dot (bf16 unit roundoff u = 2^-8, ||a|| <= 1), so the fp32 argmax is among the
// anchors whose approximate |c| is at least max - 2 * 0.0079 ||x||; those candidates are
// rescored with fp32 dots (first index of the largest, zero-norm anchors below every other, as
// the CPU). If a part dropped a value inside that margin, the token falls back to an fp32 scan
// of every anchor.
constexpr int kNearAnchors = 32, kNearKeep = 4;
constexpr float kNearMargin = 0.02f;  // relative to ||x||: 2 * 0.0079, rounded up
__host__ __device__ constexpr int near_tokens(int D) { return D <= 128 ? 64 : 32; }

// Rows 0 .. N - 1 of a bf16 tile in shared memory (rows of D + 8: 16-byte aligned) from
// global memory, 16 bytes a load: thread t (of 128) copies octet t % (D / 8) of tile rows
// t / (D / 8) + i 128 / (D / 8) (constant trips, unrolled). Rows i < valid come from row(i)
// (a pointer to the row's first element), the others are zeros.
template <int D, int N, class Row>
__device__ __forceinline__ void gather_tile_rows(uint16_t (*dst)[D + 8], int64_t valid, Row row) {
  constexpr int OCTS = D / 8, ROWS = 128 / OCTS;
  static_assert(N % ROWS == 0, "whole passes");
  const int row0 = threadIdx.x / OCTS, oct = threadIdx.x % OCTS;
#pragma unroll
  for (int it = 0; it < N / ROWS; ++it) {
    const int i = row0 + it * ROWS;
    reinterpret_cast<uint4 *>(&dst[i][0])[oct] =
        i < valid ? reinterpret_cast<const uint4 *>(row(i))[oct] : uint4{0, 0, 0, 0};
  }
}

// gather_tile_rows for consecutive rows: row i at src + i D.
template <int D, int N>
__device__ __forceinline__ void copy_tile_rows(uint16_t (*dst)[D + 8], int64_t valid, const uint16_t *src) {
  constexpr int OCTS = D / 8, ROWS = 128 / OCTS;
  static_assert(N % ROWS == 0, "whole passes");
  const int row0 = threadIdx.x / OCTS, oct = threadIdx.x % OCTS;
  const uint4 *from = reinterpret_cast<const uint4 *>(src + static_cast<int64_t>(row0) * D) + oct;
#pragma unroll
  for (int it = 0; it < N / ROWS; ++it)
    reinterpret_cast<uint4 *>(&dst[row0 + it * ROWS][0])[oct] =
        row0 + it * ROWS < valid ? from[it * ROWS * OCTS] : uint4{0, 0, 0, 0};
}

// The approximate products of the tile: C[i][j] = bf16 row i . bf16 anchor j (fp32 sums), for
// the first CH (16 or 32) anchors of the tile. Warp w makes fragments (16 x 16) w x F .. w x F
// + F - 1 of the (TOK / 16) x (CH / 16), F = their count / 4 rounded up (a fragment's sums do
// not depend on the warp that makes it).
template <int D, int TOK, int CH = kNearAnchors>
__device__ __forceinline__ void nearest_tile_products(const uint16_t (*xs)[D + 8], const uint16_t (*as)[D + 8],
                                                      float (*cs)[kNearAnchors + 4]) {
  static_assert(CH % 16 == 0 && CH <= kNearAnchors && TOK % 16 == 0, "whole fragments");
  constexpr int kColumns = CH / 16, kFragments = TOK / 16 * kColumns, kPerWarp = (kFragments + 3) / 4;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  // The rows this lane addresses for ldmatrix: A's four matrices are (rows 0-7, dims 0-7),
  // (rows 8-15, dims 0-7), (rows 0-7, dims 8-15), (rows 8-15, dims 8-15) of the slab; B's are
  // (anchors 0-7, dims 0-7), (anchors 0-7, dims 8-15), then anchors 8-15 likewise: the two
  // n8 halves' fragments. Rows are D + 8 bf16 apart: 8 rows meet 32 distinct banks.
  const int a_row = (lane & 7) + ((lane >> 3) & 1) * 8, a_dim = (lane >> 4) * 8;
  const int b_row = (lane & 7) + (lane >> 4) * 8, b_dim = ((lane >> 3) & 1) * 8;
#pragma unroll
  for (int f = 0; f < kPerWarp; ++f) {
    const int q = warp * kPerWarp + f;
    if (kFragments % 4 != 0 && q >= kFragments) break;
    const int r0 = q / kColumns * 16, c0 = q % kColumns * 16;
    float acc[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
    for (int d0 = 0; d0 < D; d0 += 16) {
      uint32_t a[4], b[4];
      ldmatrix_x4(a, &xs[r0 + a_row][d0 + a_dim]);
      ldmatrix_x4(b, &as[c0 + b_row][d0 + b_dim]);
      mma_bf16_16816(acc[0], a, {b[0], b[1]});
      mma_bf16_16816(acc[1], a, {b[2], b[3]});
    }
    // acc[h]: rows g, g, g + 8, g + 8 and columns 2t, 2t + 1 (twice) of the n8 half h.
#pragma unroll
    for (int i = 0; i < 8; ++i) cs[r0 + g + 8 * (i / 2 % 2)][c0 + 8 * (i / 4) + 2 * t + i % 2] = acc[i / 4][i % 4];
  }
}

// The fp32 ranking value of anchor a for row x: |x . anchor_n[a]|, and with norms given,
// -0.5 for a zero-norm anchor (assign_kernel's rule).
__device__ __forceinline__ float nearest_value(const float *x, const float *anchor_n, const float *norms, int a, int D) {
  if (norms && !(norms[a] > 0.0f)) return -0.5f;
  const float *an = anchor_n + static_cast<int64_t>(a) * D;
  float dot = 0.0f;
  for (int d = 0; d < D; ++d) dot += x[d] * an[d];
  return fabsf(dot);
}

// One thread's share of a token's approximate products: the kNearKeep largest values (in
// order) with their indices, and the largest value it had to drop.
struct NearKeep {
  float v[kNearKeep];
  int a[kNearKeep];
  float dropped = -INFINITY;
  __device__ NearKeep() {
    for (int c = 0; c < kNearKeep; ++c) v[c] = -INFINITY, a[c] = -1;
  }
  __device__ __forceinline__ void offer(float value, int index) {
    if (value <= v[kNearKeep - 1]) {
      dropped = fmaxf(dropped, value);
      return;
    }
    dropped = fmaxf(dropped, v[kNearKeep - 1]);
    // Insertion with constant indices only (a run-time index would put the arrays in local
    // memory): the entries below the new value move down one.
    bool placed = false;
#pragma unroll
    for (int c = kNearKeep - 1; c >= 0; --c) {
      if (placed) continue;
      if (c > 0 && value > v[c - 1]) {
        v[c] = v[c - 1];
        a[c] = a[c - 1];
      } else {
        v[c] = value;
        a[c] = index;
        placed = true;
      }
    }
  }
  // Over the PARTS consecutive lanes that share a token: the largest kept and dropped values.
  template <int PARTS>
  __device__ __forceinline__ float top() const {
    float x = v[0];
    for (int m = 1; m < PARTS; m <<= 1) x = fmaxf(x, __shfl_xor_sync(kFullMask, x, m));
    return x;
  }
  template <int PARTS>
  __device__ __forceinline__ float worst_drop() const {
    float x = dropped;
    for (int m = 1; m < PARTS; m <<= 1) x = fmaxf(x, __shfl_xor_sync(kFullMask, x, m));
    return x;
  }
};

// Better (value, index) under "largest value, then lower index".
__device__ __forceinline__ bool nearest_better(float v, int a, float bv, int ba) {
  return v > bv || (v == bv && a < ba);
}

// For the rows t < n of X [n][D] against the k anchors (anchor_n [k][D], unit or zero rows in
// fp32): nearest[t], the first anchor of largest |cos| (norms [k] given: zero-norm anchors
// below every other), and/or best_sq[t] = max(best_sq[t], largest |x . anchor_n|^2) (the
// coverage anchors' best |cos|^2 of unit rows). Both fp32 values, as if from an fp32 product.
// anchor_b: the same rows in bf16 (what the tensor cores read, 8-byte aligned rows).
// D in {64, 128, 256}; k >= 1; grid (ceil(n / near_tokens(D)), heads) blocks of 128: head y's
// rows at X + y x_stride, its anchors at y anchor_stride rows (anchor_n, anchor_b; norms at
// y anchor_stride), its outputs at y out_stride (nearest, best_sq).
template <int D>
__global__ void __launch_bounds__(128) nearest_anchor_kernel(const float *X, int64_t x_stride, int64_t n, int k,
                                                             const float *anchor_n, const uint16_t *anchor_b,
                                                             const float *norms, int32_t *nearest, float *best_sq,
                                                             int64_t out_stride, int64_t anchor_stride) {
  constexpr int TOK = near_tokens(D), PARTS = 128 / TOK, PER = kNearAnchors / PARTS;
  // ldmatrix reads 16-byte-aligned rows.
  AKV_STATIC_SHARED(__align__(32) uint16_t, xs, [TOK][D + 8]);
  AKV_STATIC_SHARED(__align__(32) uint16_t, as, [kNearAnchors][D + 8]);
  AKV_STATIC_SHARED(__align__(32) float, cs, [TOK][kNearAnchors + 4]);
  AKV_STATIC_SHARED(float, xnorm, [TOK]);
  const int tid = threadIdx.x;
  {
    const int64_t y = blockIdx.y;
    X += y * x_stride;
    anchor_n += y * anchor_stride * D;
    anchor_b += y * anchor_stride * D;
    if (norms) norms += y * anchor_stride;
    if (nearest) nearest += y * out_stride;
    if (best_sq) best_sq += y * out_stride;
  }
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * TOK;
  // The block's rows in bf16 (zeros past n), and their fp32 norms (one warp per row).
  for (int e = tid; e < TOK * D; e += 128) {
    const int i = e / D, d = e % D;
    xs[i][d] = t0 + i < n ? float_to_bits(X[(t0 + i) * D + d], true) : uint16_t{0};
  }
  {
    const int warp = tid >> 5, lane = tid & 31;
    for (int i = warp; i < TOK; i += 4) {
      float s = 0.0f;
      if (t0 + i < n)
        for (int d = lane; d < D; d += 32) s += X[(t0 + i) * D + d] * X[(t0 + i) * D + d];
      s = warp_sum(s);
      if (lane == 0) xnorm[i] = sqrtf(s);
    }
  }
  const int mine = tid / PARTS, part = tid % PARTS;  // token of the block, part of each tile
  NearKeep keep;
  for (int a0 = 0; a0 < k; a0 += kNearAnchors) {
    __syncthreads();  // the previous tile's products are consumed (and xs is written)
    // The anchor tile (zeros past k).
    copy_tile_rows<D, kNearAnchors>(as, k - a0, anchor_b + static_cast<int64_t>(a0) * D);
    __syncthreads();
    nearest_tile_products<D, TOK>(xs, as, cs);
    __syncthreads();
    for (int jj = 0; jj < PER; ++jj) {
      const int j = part * PER + jj, a = a0 + j;
      if (a >= k) break;
      keep.offer(norms && !(norms[a] > 0.0f) ? -0.5f : fabsf(cs[mine][j]), a);
    }
  }
  // The token's approximate best and margin over its PARTS threads (consecutive lanes).
  const float top = keep.top<PARTS>(), worst_drop = keep.worst_drop<PARTS>();
  const int64_t t = t0 + mine;
  const float floor_v = top - kNearMargin * xnorm[mine];
  const bool full_scan = worst_drop >= floor_v;
  float best_v = -INFINITY;
  int best_a = 0x7fffffff;
  if (t < n) {
    const float *x = X + t * D;
    if (full_scan) {
      for (int a = part; a < k; a += PARTS) {
        const float v = nearest_value(x, anchor_n, norms, a, D);
        if (nearest_better(v, a, best_v, best_a)) best_v = v, best_a = a;
      }
    } else {
      for (int c = 0; c < kNearKeep; ++c) {
        if (keep.a[c] < 0 || keep.v[c] < floor_v) continue;
        const float v = nearest_value(x, anchor_n, norms, keep.a[c], D);
        if (nearest_better(v, keep.a[c], best_v, best_a)) best_v = v, best_a = keep.a[c];
      }
    }
  }
  for (int m = 1; m < PARTS; m <<= 1) {
    const float ov = __shfl_xor_sync(kFullMask, best_v, m);
    const int oa = __shfl_xor_sync(kFullMask, best_a, m);
    if (nearest_better(ov, oa, best_v, best_a)) best_v = ov, best_a = oa;
  }
  if (t < n && part == 0) {
    if (nearest) nearest[t] = best_a == 0x7fffffff ? 0 : best_a;
    if (best_sq && best_a != 0x7fffffff) best_sq[t] = fmaxf(best_sq[t], best_v * best_v);
  }
}

// One warp's residual r = x - gq * anchor(d) over the D dims: ||r||^2 into *r_norm_sq (lane
// 0) and, for keys (side 0), r rotated to position `pos` into out (the utilities' R_t r).
template <class Anchor>
__device__ __forceinline__ void store_residual(const float *x, float gq, Anchor anchor, int D, int side, int64_t pos,
                                               int pairs, const float *inv_freq, const int32_t *rope_first,
                                               const int32_t *rope_second, float *out, float *r_norm_sq) {
  const int lane = threadIdx.x & 31;
  float n2 = 0.0f;
  for (int d = lane; d < D; d += 32) {
    const float r = x[d] - gq * anchor(d);
    n2 += r * r;
  }
  n2 = warp_sum(n2);
  if (lane == 0) *r_norm_sq = n2;
  if (side == 1) return;
  for (int d = lane; d < D; d += 32) out[d] = x[d] - gq * anchor(d);
  __syncwarp();
  for (int j = lane; j < pairs; j += 32) {
    const int f = rope_first[j], s = rope_second[j];
    float c, sn;
    rope_angle(pos, inv_freq[j], &c, &sn);
    const float x0 = out[f], x1 = out[s];
    out[f] = x0 * c - x1 * sn;
    out[s] = x0 * sn + x1 * c;
  }
}

// The bf16 coefficient of every prefix token t0..t0+n against its nearest anchor (nearest[t],
// from nearest_anchor_kernel; anchors point to themselves with gamma 1), and the residual: its
// squared norm into r_norm_sq, and keys rotated to the token's position into rk (for the
// utilities). One warp per token.
// Grid y over heads: head y's token arrays (nearest, anchor_of_token, index_out, gamma_out,
// r_norm_sq) at y P, rk at y P D, X at y x_stride, anchor_f and anchor_n at y k D, norms at y k.
__global__ void assign_kernel(const int32_t *nearest, int64_t t0, int64_t n, int64_t P, int k, int D, const float *X,
                              int64_t x_stride, const float *anchor_f, const float *anchor_n, const float *norms,
                              const int32_t *anchor_of_token, uint16_t *index_out, uint16_t *gamma_out, int side,
                              const int32_t *positions, int pairs, const float *inv_freq, const int32_t *rope_first,
                              const int32_t *rope_second, float *rk, float *r_norm_sq) {
  const int lane = threadIdx.x & 31;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + (threadIdx.x >> 5);
  if (i >= n) return;
  {
    const int64_t y = blockIdx.y;
    nearest += y * P;
    anchor_of_token += y * P;
    index_out += y * P;
    gamma_out += y * P;
    r_norm_sq += y * P;
    rk += y * P * D;
    X += y * x_stride;
    anchor_f += y * k * D;
    anchor_n += y * k * D;
    norms += y * k;
  }
  const int64_t t = t0 + i;
  const float *x = X + t * D;
  int best;
  float g;
  if (anchor_of_token[t] >= 0) {
    best = anchor_of_token[t];
    g = 1.0f;
  } else {
    best = nearest[t];
    // The coefficient from an fp32 dot with the chosen anchor.
    float dot = 0.0f;
    for (int d = lane; d < D; d += 32) dot += x[d] * anchor_n[static_cast<int64_t>(best) * D + d];
    dot = warp_sum(dot);
    g = norms[best] > 0.0f ? dot / norms[best] : 0.0f;
  }
  const uint16_t gbits = float_to_bits(g, true);
  if (lane == 0) {
    index_out[t] = static_cast<uint16_t>(best);
    gamma_out[t] = gbits;
  }
  store_residual(x, bits_to_float(gbits, true), [&](int d) { return anchor_f[static_cast<int64_t>(best) * D + d]; }, D,
                 side, positions[t], pairs, inv_freq, rope_first, rope_second, rk + t * D, r_norm_sq + t);
}

// Segmented sort through one device-wide radix sort: keys of segment i (n each) become
// (i << 32) | key, so that a stable sort of the 64-bit keys orders every segment by key, ties
// in their given order; split_segment_keys_kernel writes the 32-bit keys back.
__global__ void segment_keys_kernel(const uint32_t *keys, int64_t n, int64_t total, uint64_t *wide) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < total) wide[i] = (static_cast<uint64_t>(i / n) << 32) | keys[i];
}
__global__ void split_segment_keys_kernel(const uint64_t *wide, const uint32_t *values_in, int64_t total,
                                          uint32_t *keys, uint32_t *values) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= total) return;
  keys[i] = static_cast<uint32_t>(wide[i]);
  values[i] = values_in[i];
}

// The guard ranks the tokens the utilities left: the n already chosen (sorted ids) go last.
__global__ void exclude_chosen_kernel(const uint32_t *sorted_ids, int64_t n, uint32_t *energy_keys) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) energy_keys[sorted_ids[i]] = 0xFFFFFFFFu;
}

// Bits of the n best candidates (sorted ids h * P + t) into the per-head masks.
__global__ void mask_kernel(const uint32_t *sorted_ids, int64_t n, int64_t P, int64_t words,
                            unsigned long long *mask) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int64_t id = sorted_ids[i], h = id / P, t = id % P;
  atomicOr(&mask[h * words + t / 64], 1ull << (t % 64));
}

// Exclusive scan of one value per thread over a block of NT threads (a multiple of 32, at most
// 1024), in thread order: returns the sum of the values of the threads before this one and
// sets `total` to the block's sum. Warp scans, then a scan of the warp totals by warp 0;
// warp_sums: NT / 32 + 1 words of shared memory, free again on return (every thread calls).
template <int NT>
__device__ __forceinline__ uint32_t block_exclusive_scan(uint32_t own, uint32_t *warp_sums, uint32_t &total) {
  constexpr int NW = NT / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  uint32_t incl = own;  // inclusive scan within the warp
  for (int d = 1; d < 32; d <<= 1) {
    const uint32_t up = __shfl_sync(kFullMask, incl, lane >= d ? lane - d : lane);
    if (lane >= d) incl += up;
  }
  if (lane == 31) warp_sums[warp] = incl;
  __syncthreads();
  if (warp == 0) {  // exclusive scan of the warp totals; their sum in warp_sums[NW]
    const uint32_t v = lane < NW ? warp_sums[lane] : 0u;
    uint32_t x = v;
    for (int d = 1; d < 32; d <<= 1) {
      const uint32_t up = __shfl_sync(kFullMask, x, lane >= d ? lane - d : lane);
      if (lane >= d) x += up;
    }
    if (lane < NW) warp_sums[lane] = x - v;
    if (lane == 31) warp_sums[NW] = x;
  }
  __syncthreads();
  const uint32_t before = warp_sums[warp] + incl - own;
  total = warp_sums[NW];
  __syncthreads();  // warp_sums is rewritten by the next call
  return before;
}

// Per-word prefix counts within each head and the per-head offsets (H+1): one block of
// kPrefixThreads walks the heads in order, kPrefixThreads words at a time, with a block-wide
// scan of the words' popcounts.
constexpr int kPrefixThreads = 1024;
__global__ void __launch_bounds__(kPrefixThreads) prefix_kernel(const uint64_t *mask, int H, int64_t words,
                                                                uint32_t *prefix, uint32_t *offsets) {
  AKV_STATIC_SHARED(uint32_t, warp_sums, [kPrefixThreads / 32 + 1]);
  const int tid = threadIdx.x;
  uint32_t total = 0;  // residuals of the heads before h (uniform across the block)
  for (int h = 0; h < H; ++h) {
    offsets[h] = total;  // every thread writes the same value
    uint32_t carry = 0;  // residuals of head h before this chunk
    for (int64_t w0 = 0; w0 < words; w0 += kPrefixThreads) {
      const int64_t wd = w0 + tid;
      const uint32_t own = wd < words ? static_cast<uint32_t>(__popcll(mask[h * words + wd])) : 0u;
      uint32_t chunk = 0;
      const uint32_t before = block_exclusive_scan<kPrefixThreads>(own, warp_sums, chunk);
      if (wd < words) prefix[h * words + wd] = carry + before;
      carry += chunk;
    }
    total += carry;
  }
  if (tid == 0) offsets[H] = total;
}

// Encodes the residuals of one side (docs/design.md §2.2 step 8, §3.3): grid (words, H), one warp per block walking
// the word's set bits. The residual x - gamma * anchor is rebuilt from the prefill input
// (pre-RoPE keys or values), rotated (signs, Walsh-Hadamard, 1/sqrt(D)), scaled (least
// squares, RMS or absmax) and packed 4 codes per byte.
template <int D>
__global__ void __launch_bounds__(32) encode_kernel(const __grid_constant__ PrefillArgs a, int side, int64_t P,
                                                    int64_t words, int k, int storage_bf16, int scale_mode,
                                                    const uint64_t *mask, const uint32_t *prefix,
                                                    const uint32_t *offsets, const uint16_t *anchors,
                                                    const uint16_t *index, const uint16_t *gamma, const float *signs,
                                                    uint8_t *codes, float *scales, uint8_t *chunk_pos) {
  constexpr int EPL = D / 32;
  const int lane = threadIdx.x;
  const int64_t wd = blockIdx.x;
  const int h = blockIdx.y;
  uint64_t bits = mask[h * words + wd];
  uint32_t slot = offsets[h] + prefix[h * words + wd];
  const float norm = 1.0f / sqrtf(static_cast<float>(D));
  for (; bits; ++slot) {
    const int bit = __ffsll(static_cast<long long>(bits)) - 1;
    bits &= bits - 1;
    const int64_t t = wd * 64 + bit;
    const int64_t src = kv_offset(a, h, t);
    const int an = index[h * P + t];
    const float gq = bits_to_float(gamma[h * P + t], true);
    const uint16_t *av = anchors + (static_cast<int64_t>(h) * k + an) * D;
    const int64_t pos = a.positions[t];
    float x[EPL];
    // Lane l holds dims l*EPL.., the layout of the cross-lane Hadamard stages.
    if (side == 0 && a.keys_post_rope && a.rope_pairs > 0) {
      // Keys given rotated: pre-RoPE rows need the partner dimension of each pair.
      for (int e = 0; e < EPL; ++e) {
        const int d = lane * EPL + e;
        float v = load_elem(a.keys, a.dtype, src + d);
        for (int j = 0; j < a.rope_pairs; ++j) {
          const int f = a.rope_first[j], s = a.rope_second[j];
          if (d != f && d != s) continue;
          float c, sn;
          rope_angle(pos, a.inv_freq[j], &c, &sn);
          const float x0 = load_elem(a.keys, a.dtype, src + f), x1 = load_elem(a.keys, a.dtype, src + s);
          v = d == f ? x0 * c + x1 * sn : -x0 * sn + x1 * c;
        }
        x[e] = v;
      }
    } else {
      for (int e = 0; e < EPL; ++e) x[e] = load_elem(side == 0 ? a.keys : a.values, a.dtype, src + lane * EPL + e);
    }
    for (int e = 0; e < EPL; ++e) {
      const int d = lane * EPL + e;
      x[e] = (x[e] - gq * bits_to_float(av[d], storage_bf16 != 0)) * signs[d];
    }
    warp_fwht<EPL>(x, lane);
    float sumsq = 0.0f, absmax = 0.0f;
    for (int e = 0; e < EPL; ++e) {
      x[e] *= norm;
      sumsq += x[e] * x[e];
      absmax = fmaxf(absmax, fabsf(x[e]));
    }
    sumsq = warp_sum(sumsq);
    absmax = warp_max(absmax);
    float scale = scale_mode == 2 ? absmax / kLloydMaxOuter : sqrtf(sumsq / D);
    const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
    int code[EPL];
    float dot = 0.0f, levels_sq = 0.0f;
    for (int e = 0; e < EPL; ++e) {
      const float z = x[e] * inv;
      code[e] = lloyd_max_code(z);
      const float level = lloyd_max_level(code[e]);
      dot += x[e] * level;
      levels_sq += level * level;
    }
    dot = warp_sum(dot);
    levels_sq = warp_sum(levels_sq);
    if (scale_mode == 0 && levels_sq > 0.0f) scale = dot / levels_sq;
    // Pack: code of dim d at bits 2*(d%4) of byte d/4. Lanes gather whole bytes.
    uint8_t *out = codes + static_cast<int64_t>(slot) * (D / 4);
    if (EPL >= 4) {
      for (int b = 0; b < EPL / 4; ++b) {
        uint8_t byte = 0;
        for (int i = 0; i < 4; ++i) byte |= static_cast<uint8_t>(code[4 * b + i] << (2 * i));
        out[lane * (EPL / 4) + b] = byte;
      }
    } else {  // EPL == 2 (D == 64): two lanes per byte
      const int mine = code[0] | (code[1] << 2);
      const int other = __shfl_xor_sync(kFullMask, mine, 1);
      if (!(lane & 1)) out[lane / 2] = static_cast<uint8_t>(mine | (other << 4));
    }
    if (lane == 0) {
      scales[slot] = scale;
      if (chunk_pos) chunk_pos[slot] = static_cast<uint8_t>(bit);
    }
    __syncwarp();
  }
}

// Dense storage of head h (FullKV, eviction): row i of the outputs is token tokens[i] (or i
// when tokens is null), keys post-RoPE, values, both in the storage dtype. One token per warp.
__global__ void dense_store_kernel(const __grid_constant__ PrefillArgs a, int h, const int32_t *tokens, int64_t n,
                                   int storage_bf16, uint16_t *keys_out, uint16_t *values_out) {
  const int lane = threadIdx.x & 31;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * 4 + (threadIdx.x >> 5);
  if (i >= n) return;
  const int64_t t = tokens ? tokens[i] : i;
  const int D = a.head_dim;
  const bool bf16 = storage_bf16 != 0;
  const int64_t src = kv_offset(a, h, t), dst = i * D;
  const bool rotate = !a.keys_post_rope && a.rope_pairs > 0;
  bool bad = false;
  for (int d = lane; d < D; d += 32) {
    const float k = load_elem(a.keys, a.dtype, src + d), v = load_elem(a.values, a.dtype, src + d);
    bad = bad || !finite(k) || !finite(v);
    values_out[dst + d] = float_to_bits(v, bf16);
    if (!rotate || d >= 2 * a.rope_pairs) keys_out[dst + d] = float_to_bits(k, bf16);
  }
  if (rotate) {
    const int64_t pos = a.positions[t];
    for (int j = lane; j < a.rope_pairs; j += 32) {
      const int f = a.rope_first[j], s = a.rope_second[j];
      float c, sn;
      rope_angle(pos, a.inv_freq[j], &c, &sn);
      const float x0 = load_elem(a.keys, a.dtype, src + f), x1 = load_elem(a.keys, a.dtype, src + s);
      keys_out[dst + f] = float_to_bits(x0 * c - x1 * sn, bf16);
      keys_out[dst + s] = float_to_bits(x0 * sn + x1 * c, bf16);
    }
  }
  if (bad) atomicAdd(a.bad, 1);
}

// AnDPro: row r of the window attention pooled along the prompt (first P tokens), into
// pooled [m][P]. grid (ceil(P/128), m).
__global__ void pool_rows_kernel(const float *A, int64_t S, int64_t P, int kernel, int max_pool, float *pooled) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t r = blockIdx.y;
  if (t >= P) return;
  const int half = kernel / 2;
  const float *row = A + r * S;
  float acc = max_pool ? -INFINITY : 0.0f;
  for (int64_t u = t - half; u <= t + half; ++u) {
    if (u < 0 || u >= P) continue;
    acc = max_pool ? fmaxf(acc, row[u]) : acc + row[u];
  }
  pooled[r * P + t] = max_pool ? acc : acc / static_cast<float>(kernel);
}

// AnDPro: each prompt token's contribution sum_r pooled[r][t] * (V_t . y_r), then its chunk's
// score with the layer-wide sort key (descending score) and candidate id h * chunks + j.
__global__ void andpro_contrib_kernel(const float *pooled, const float *vy, int64_t P, int m, float *contrib) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= P) return;
  float s = 0.0f;
  for (int r = 0; r < m; ++r) s += pooled[r * P + t] * vy[r * P + t];
  contrib[t] = s;
}
__global__ void andpro_chunks_kernel(const float *contrib, int64_t P, int chunk, int64_t chunks, int h, uint32_t *keys,
                                     uint32_t *ids) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= chunks) return;
  float s = 0.0f;
  for (int64_t t = j * chunk; t < (j + 1) * chunk && t < P; ++t) s += contrib[t];
  uint32_t bits;
  memcpy(&bits, &s, 4);
  bits = (bits & 0x80000000u) ? ~bits : bits | 0x80000000u;
  keys[h * chunks + j] = ~bits;
  ids[h * chunks + j] = static_cast<uint32_t>(h * chunks + j);
}

// ids[i] = first + i (candidate ids h * P + t of the layer-wide selections).
__global__ void iota_kernel(uint32_t *ids, uint32_t first, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) ids[i] = first + static_cast<uint32_t>(i);
}

// ---- Coverage anchors (coverage_rounds > 0; CPU: add_coverage_anchors) ----------------------

// One warp's unit row (every lane calls): row = x / ||x|| (a zero x stays zero) and, when
// given, row_b = row in bf16 and *norm_sq = ||x||^2. storage (0 f16, 1 bf16; -1 none): x is
// first rounded to the storage dtype (format 3's candidates are compared as stored). row null:
// only the norm.
__device__ __forceinline__ void unit_row(const float *x, int D, int storage, float *row, uint16_t *row_b,
                                         float *norm_sq) {
  const int lane = threadIdx.x & 31;
  auto value = [&](int d) { return storage < 0 ? x[d] : bits_to_float(float_to_bits(x[d], storage == 1), storage == 1); };
  float n2 = 0.0f;
  for (int d = lane; d < D; d += 32) n2 += value(d) * value(d);
  n2 = warp_sum(n2);
  const float inv = n2 > 0.0f ? 1.0f / sqrtf(n2) : 0.0f;
  for (int d = lane; d < D && row; d += 32) {
    row[d] = value(d) * inv;
    if (row_b) row_b[d] = float_to_bits(value(d) * inv, true);
  }
  if (norm_sq && lane == 0) *norm_sq = n2;
}

// rows[i] = X[i] / ||X[i]|| and norm_sq[i] = ||X[i]||^2 for i < n (unit_row): format 2's unit
// prefix rows. One warp per row. Grid y over heads: head y's X at y x_stride, rows at
// y rows_stride, norm_sq at y n.
__global__ void unit_rows_kernel(const float *X, int64_t x_stride, int64_t n, int D, float *rows, int64_t rows_stride,
                                 float *norm_sq) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + (threadIdx.x >> 5);
  if (i >= n) return;
  const int64_t y = blockIdx.y;
  unit_row(X + y * x_stride + i * D, D, -1, rows + y * rows_stride + i * D, nullptr, norm_sq + y * n + i);
}

// The unit rows an absorb compares, both sides (keys 0, values 1) in one launch: side s's rows
// of X[s] for the tokens ids[0..n) into rows[s], rows_b[s] and norm_sq[s] (nullptr: none).
struct SideRows {
  const float *X[2];
  float *rows[2];
  uint16_t *rows_b[2];
  float *norm_sq[2];
};

// A token id that names no token: a coverage pool's empty slot (coverage_merge_kernel<true>).
constexpr uint32_t kNoToken = 0xFFFFFFFFu;

// unit_row over both sides: grid y over 2 x heads (side y / heads, head y % heads);
// head h's X at h x_stride, ids at h ids_stride, rows at h rows_stride, norms at h norm_stride;
// an id of kNoToken is skipped.
__global__ void side_rows_kernel(const SideRows sides, int64_t x_stride, const uint32_t *ids, int64_t ids_stride,
                                 int64_t n, int D, int storage, int64_t rows_stride, int64_t norm_stride) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + (threadIdx.x >> 5);
  if (i >= n) return;
  // The side's pointers by selects (an indexed parameter array would go to the stack).
  const int heads = static_cast<int>(gridDim.y / 2);
  const bool second = static_cast<int>(blockIdx.y) >= heads;
  const int64_t y = static_cast<int64_t>(blockIdx.y) - (second ? heads : 0);
  float *norm_sq = second ? sides.norm_sq[1] : sides.norm_sq[0];
  uint16_t *rows_b = second ? sides.rows_b[1] : sides.rows_b[0];
  const float *X = second ? sides.X[1] : sides.X[0];
  float *rows = second ? sides.rows[1] : sides.rows[0];
  const uint32_t id = ids[y * ids_stride + i];
  if (id == kNoToken) return;
  unit_row(X + y * x_stride + static_cast<int64_t>(id) * D, D, storage,
           rows + y * rows_stride + i * D, rows_b ? rows_b + y * rows_stride + i * D : nullptr,
           norm_sq ? norm_sq + y * norm_stride + i : nullptr);
}

// best[t0 + i] = max(best, C[i][j]^2 over the n new anchors): the best |cos| so far, squared.
__global__ void coverage_update_kernel(const float *C, int64_t t0, int64_t count, int64_t n, float *best) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= count) return;
  float b = best[t0 + i];
  for (int64_t j = 0; j < n; ++j) b = fmaxf(b, C[i * n + j] * C[i * n + j]);
  best[t0 + i] = b;
}

// A token's residual energy against its best anchor so far: ||x||^2 (1 - best |cos|^2), or
// with local candidates (format 3, best = x . unit anchor) ||x||^2 - best^2.
__device__ __forceinline__ float uncovered_energy(float norm_sq, float best, int local) {
  return local ? fmaxf(0.0f, norm_sq - best * best) : norm_sq * fmaxf(0.0f, 1.0f - best);
}

// The n tokens ids[0..n) become anchors: flagged, and copied to out[0..n); then (tail > 0)
// out[n + j] = P + j for j < tail (the window tokens). Grid y over heads: head y's ids at
// y ids_stride, flags at y P, out at y out_stride.
__global__ void coverage_take_kernel(const uint32_t *ids, int64_t ids_stride, int64_t n, int32_t *is_anchor, int64_t P,
                                     uint32_t *out, int64_t out_stride, int64_t tail) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n + tail) return;
  const int64_t y = blockIdx.y;
  out += y * out_stride;
  if (i >= n) {
    out[i] = static_cast<uint32_t>(P + (i - n));
    return;
  }
  ids += y * ids_stride;
  is_anchor[y * P + ids[i]] = 1;
  out[i] = ids[i];
}

}  // namespace cuda
}  // namespace akv
