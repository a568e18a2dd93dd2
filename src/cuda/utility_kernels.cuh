// The utilities (Eq. 6) of the AnchorKV pass's prefix tokens in one kernel on the tensor cores
// (docs/gpu.md, the compression pass; the CPU reference is the utilities stage of
// cpu/compress_anchorkv.cpp):
//   u_K(t) = sum_r A[r][t]^2 (q_r . rk_t)^2 max(0, ||v_t||^2 - 2 v_t . y_r + ||y_r||^2) / (m D)
//   u_V(t) = alpha_t^2 ||r_V(t)||^2
// over the m window query rows r (queries q_r, attention A, outputs y_r). The two m x P
// products Z = Q RK^T and VY = Y V^T are taken per tile of tokens with mma.m16n8k16 on bf16
// hi + lo splits of the fp32 operands (three products: about 16 significant bits, where the
// two SGEMMs they replace had 24) and folded into the sums at once, so neither m x P matrix
// is written. Operands exact in bf16 (the queries and values of bf16 inputs) skip their lo
// part: two products.
#pragma once
#include "cuda/compress_kernels.cuh"

namespace akv {
namespace cuda {

// Tokens per block of utility_tc_kernel: the tile's four bf16 arrays (D + 16 values a row) stay
// under 48 KB of static shared memory.
__host__ __device__ constexpr int utility_tokens(int D) { return 4096 / D; }

// Rows of the window padded to whole mma tiles of 16 (the padding's splits are zeros).
__host__ __device__ constexpr int utility_rows(int m) { return (m + 15) / 16 * 16; }

// The window rows' part of the utilities, once a batch (a warp a row of the padded
// heads x utility_rows(m)): ||y_r||^2, and the queries and outputs as bf16 hi + lo words (dim
// pairs) laid out as utility_tc_kernel's A fragments, so that a lane's fragment is one 16-byte
// load: split[0..3] = q hi, q lo, y hi, y lo, each [heads][tile of 16 rows][k16 slab][lane][4].
__global__ void utility_rows_kernel(const float *Q, const float *Y, int heads, int m, int D, float *y_norm_sq,
                                    uint32_t *split) {
  const int mp = utility_rows(m), rows = heads * mp;
  const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= rows) return;
  const int h = row / mp, r = row % mp;
  const int64_t n = static_cast<int64_t>(rows) * (D / 2), src = (static_cast<int64_t>(h) * m + r) * D;
  // Fragment of row r: tile r / 16, a[0], a[2] for rows g = r % 8, a[1], a[3] for g + 8.
  const int64_t tile = static_cast<int64_t>(h) * (mp / 16) + r / 16;
  const int g = r % 8, low = (r % 16) / 8;
  float s = 0.0f;
  for (int c = lane; c < D / 2; c += 32) {  // dims 2c, 2c + 1: slab c / 8, lane g * 4 + c % 4
    float2 q{0.0f, 0.0f}, y = q;
    if (r < m) {
      q = *reinterpret_cast<const float2 *>(Q + src + 2 * c);
      y = *reinterpret_cast<const float2 *>(Y + src + 2 * c);
    }
    const int64_t w = ((tile * (D / 16) + c / 8) * 32 + g * 4 + c % 4) * 4 + low + 2 * (c % 8 / 4);
    split_bf16x2(q.x, q.y, split[w], split[n + w]);
    split_bf16x2(y.x, y.y, split[2 * n + w], split[3 * n + w]);
    s += y.x * y.x + y.y * y.y;
  }
  s = warp_sum(s);
  if (lane == 0 && r < m) y_norm_sq[h * m + r] = s;
}

// Utilities of the prefix tokens of head h = h0 + blockIdx.y (grid: (ceil(P / TT), heads of the
// batch), 128 threads). Per-head inputs are [y][...] arrays: A [m][S], the splits of Q and Y
// (utility_rows_kernel's), y_norm_sq [m], RK [P][D] (the key residuals rotated to their
// positions), V [S][D], alpha_sq, the residual norms and anchor_of_token [P]. Writes the keys the
// residual selection sorts (descending utility; anchors -1, never candidates), the guard's keys
// (descending residual energy; anchors last) and the ids h * P + t. EXACT: Q and V hold bf16
// values (their lo parts are zero and skipped). Warp w takes the 16-row chunks w, w + 4, ... of
// the m rows against the whole token tile (rows are the mma's M, tokens its N); each lane sums
// its tokens' terms over its rows, then the lanes of a column and the warps meet in a fixed
// order.
template <int D, bool EXACT>
__global__ void __launch_bounds__(128)
    utility_tc_kernel(const float *A, int64_t S, int64_t P, int m, const uint32_t *split, const float *y_norm_sq,
                      const float *RK, const float *V, const float *alpha_sq, const float *rk_norm_sq,
                      const float *rv_norm_sq, const int32_t *anchor_of_token, int h0,
                      uint32_t *key_keys, uint32_t *value_keys, uint32_t *key_ids, uint32_t *value_ids,
                      uint32_t *key_energy, uint32_t *value_energy, uint32_t *key_energy_ids,
                      uint32_t *value_energy_ids) {
  // Tokens, n8 tiles, words a row: D / 2 + 8 words, so that the 8-byte B loads of a half warp
  // (4 tokens, 4 lanes a token) fall in distinct banks.
  constexpr int TT = utility_tokens(D), NT = TT / 8, RW = D / 2 + 8;
  static_assert(TT % 8 == 0 && D % 16 == 0, "n8 tiles of tokens, k16 slabs of dims");
  // bf16x2 words: the key residuals' hi and lo, the values' hi and lo (lo unused when EXACT).
  AKV_STATIC_SHARED(__align__(16) uint32_t, rows_s, [4][TT * RW]);
  AKV_STATIC_SHARED(float, vn_s, [TT]);
  AKV_STATIC_SHARED(float, part_s, [4][TT]);
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * TT, y = blockIdx.y;
  const int h = h0 + static_cast<int>(y);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane >> 2, tq = lane & 3;
  A += y * m * S;
  const int mp = utility_rows(m);
  const int64_t n_split = static_cast<int64_t>(gridDim.y) * mp * (D / 2);  // words of each split array
  const uint32_t *qh_g = split + y * mp * (D / 2), *ql_g = qh_g + n_split, *yh_g = ql_g + n_split,
                 *yl_g = yh_g + n_split;
  y_norm_sq += y * m;
  RK += y * P * D;
  V += y * S * D;

  // The tile's rows into shared memory as bf16 splits (zeros past the prefix), ||v_t||^2 in fp32.
  // Within each k16 slab the words (dim pairs) are in slab_word order: a lane's two B words
  // (dims 2 tq and 2 tq + 8) are then one 8-byte load.
  for (int i = warp; i < TT; i += 4) {
    const int64_t t = t0 + i;
    float vn = 0.0f;
#pragma unroll
    for (int pass = 0; pass < (D / 4 + 31) / 32; ++pass) {
      const int c = pass * 32 + lane;  // dims 4c .. 4c + 3: words 2c, 2c + 1
      if (D < 128 && c >= D / 4) break;
      float4 k4{0.0f, 0.0f, 0.0f, 0.0f}, v4 = k4;
      if (t < P) {
        k4 = *reinterpret_cast<const float4 *>(RK + t * D + 4 * c);
        v4 = *reinterpret_cast<const float4 *>(V + t * D + 4 * c);
      }
      vn += v4.x * v4.x + v4.y * v4.y + v4.z * v4.z + v4.w * v4.w;
      const int w0 = i * RW + slab_word(2 * c), w1 = i * RW + slab_word(2 * c + 1);
      split_bf16x2(k4.x, k4.y, rows_s[0][w0], rows_s[1][w0]);
      split_bf16x2(k4.z, k4.w, rows_s[0][w1], rows_s[1][w1]);
      if (EXACT) {
        rows_s[2][w0] = pack_bf16x2(v4.x, v4.y);
        rows_s[2][w1] = pack_bf16x2(v4.z, v4.w);
      } else {
        split_bf16x2(v4.x, v4.y, rows_s[2][w0], rows_s[3][w0]);
        split_bf16x2(v4.z, v4.w, rows_s[2][w1], rows_s[3][w1]);
      }
    }
    vn = warp_sum(vn);
    if (lane == 0) vn_s[i] = vn;
  }
  __syncthreads();

  // A fragment of a split array: tile `chunk` of 16 rows, slab ks.
  auto fragment = [&](const uint32_t *X, int chunk, int ks, uint32_t (&a)[4]) {
    const uint4 x = *reinterpret_cast<const uint4 *>(X + ((chunk * (D / 16) + ks) * 32 + lane) * 4);
    a[0] = x.x;
    a[1] = x.y;
    a[2] = x.z;
    a[3] = x.w;
  };

  float u[NT][2];  // this lane's tokens nt * 8 + 2 tq, + 1: its rows' terms
  for (int nt = 0; nt < NT; ++nt) u[nt][0] = u[nt][1] = 0.0f;
  for (int chunk = warp; chunk * 16 < m; chunk += 4) {
    const int r0 = chunk * 16 + g, r1 = r0 + 8;  // rows past m: zero splits, weight 0
    float z[NT][4], vy[NT][4];
    for (int nt = 0; nt < NT; ++nt)
      for (int i = 0; i < 4; ++i) z[nt][i] = vy[nt][i] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      uint32_t qh[4], ql[4], yh[4], yl[4];
      fragment(qh_g, chunk, ks, qh);
      if (!EXACT) fragment(ql_g, chunk, ks, ql);
      fragment(yh_g, chunk, ks, yh);
      fragment(yl_g, chunk, ks, yl);
      for (int nt = 0; nt < NT; ++nt) {
        const int w = (nt * 8 + g) * RW + ks * 8 + 2 * tq;  // B: token nt * 8 + g, dims 2 tq, 2 tq + 8
        uint32_t kh[2], kl[2], vh[2];
        load_b_pair(kh, &rows_s[0][w]);
        load_b_pair(kl, &rows_s[1][w]);
        load_b_pair(vh, &rows_s[2][w]);
        mma_bf16_16816(z[nt], qh, kl);
        if (!EXACT) mma_bf16_16816(z[nt], ql, kh);
        mma_bf16_16816(z[nt], qh, kh);
        mma_bf16_16816(vy[nt], yl, vh);
        if (!EXACT) {
          uint32_t vl[2];
          load_b_pair(vl, &rows_s[3][w]);
          mma_bf16_16816(vy[nt], yh, vl);
        }
        mma_bf16_16816(vy[nt], yh, vh);
      }
    }
    // d[0], d[1]: row r0, tokens 2 tq, 2 tq + 1 of the n8 tile; d[2], d[3]: row r1.
    const float yn0 = r0 < m ? y_norm_sq[r0] : 0.0f, yn1 = r1 < m ? y_norm_sq[r1] : 0.0f;
    for (int nt = 0; nt < NT; ++nt)
      for (int j = 0; j < 2; ++j) {
        const int i = nt * 8 + 2 * tq + j;
        const int64_t t = t0 + i;
        const float a0 = r0 < m && t < P ? A[static_cast<int64_t>(r0) * S + t] : 0.0f;
        const float a1 = r1 < m && t < P ? A[static_cast<int64_t>(r1) * S + t] : 0.0f;
        const float z0 = z[nt][j], z1 = z[nt][2 + j];
        u[nt][j] += a0 * a0 * z0 * z0 * fmaxf(0.0f, vn_s[i] - 2.0f * vy[nt][j] + yn0);
        u[nt][j] += a1 * a1 * z1 * z1 * fmaxf(0.0f, vn_s[i] - 2.0f * vy[nt][2 + j] + yn1);
      }
  }
  // The rows' sums: over the 8 lanes of a column, then over the warps.
  for (int nt = 0; nt < NT; ++nt)
    for (int j = 0; j < 2; ++j) {
      float v = u[nt][j];
      for (int off = 4; off < 32; off <<= 1) v += __shfl_xor_sync(kFullMask, v, off);
      if (g == 0) part_s[warp][nt * 8 + 2 * tq + j] = v;
    }
  __syncthreads();
  if (tid >= TT) return;
  const int64_t t = t0 + tid;
  if (t >= P) return;
  alpha_sq += y * P;
  rk_norm_sq += y * P;
  rv_norm_sq += y * P;
  anchor_of_token += y * P;
  const bool anchor = anchor_of_token[t] >= 0;
  const float uk = anchor ? -1.0f : (part_s[0][tid] + part_s[1][tid] + part_s[2][tid] + part_s[3][tid]) /
                                        (static_cast<float>(m) * D);
  const float uv = anchor ? -1.0f : alpha_sq[t] * rv_norm_sq[t];
  const int64_t at = h * P + t;
  key_keys[at] = descending_key(uk);
  value_keys[at] = descending_key(uv);
  key_energy[at] = anchor ? 0xFFFFFFFFu : descending_key(rk_norm_sq[t]);
  value_energy[at] = anchor ? 0xFFFFFFFFu : descending_key(rv_norm_sq[t]);
  const uint32_t id = static_cast<uint32_t>(at);
  key_ids[at] = value_ids[at] = key_energy_ids[at] = value_energy_ids[at] = id;
}

}  // namespace cuda
}  // namespace akv
