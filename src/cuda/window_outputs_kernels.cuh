// The window attention's outputs y = A V of the AnchorKV pass on the tensor cores (docs/gpu.md,
// the compression pass): A is the causal-window softmax [m][S] of a head, V its values [S][D].
// Each block takes a chunk of the tokens for up to 128 rows (mma.m16n8k16: rows are M, tokens
// K, dims N), A split into bf16 hi + lo, V as bf16 (hi + lo unless its values are bf16
// already): two or three products, about 16 significant bits. The chunks' partial sums go to
// scratch and window_outputs_reduce_kernel adds them in chunk order, so the result does not
// depend on scheduling.
#pragma once
#include "cuda/compress_kernels.cuh"

namespace akv {
namespace cuda {

// Tokens a block of window_outputs_kernel sums (its chunk), and per shared-memory stage.
constexpr int kWindowChunk = 2048;
__host__ __device__ constexpr int window_chunks(int64_t S) {
  return static_cast<int>((S + kWindowChunk - 1) / kWindowChunk);
}
__host__ __device__ constexpr int window_stage_tokens(int D) { return D <= 128 ? 64 : 32; }
// Rows of the window a block takes: 8 warps of 16 rows, each warp 128 dims (D 256: two warps a
// tile of rows).
__host__ __device__ constexpr int window_block_rows(int D) { return D <= 128 ? 128 : 64; }

// Partial outputs over tokens chunk * kWindowChunk .. (grid: (window_chunks(S), heads of the
// batch x ceil(m / window_block_rows(D))), 256 threads; head y of the batch, its row group rg):
// parts[(y * chunks + chunk) * m + r][d]. A [heads][m][S], V [heads][S][D].
// EXACT: V holds bf16 values.
template <int D, bool EXACT>
__global__ void __launch_bounds__(256)
    window_outputs_kernel(const float *A, const float *V, int64_t S, int m, float *parts) {
  constexpr int KS = window_stage_tokens(D), TW = KS / 2 + 8;  // tokens a stage, words a dim row
  constexpr int ND = D < 128 ? D : 128, NT = ND / 8, SPLITS = D / ND;  // a warp's dims, n8 tiles
  static_assert(TW % 32 == 8 || TW % 32 == 24, "a half warp's 8-byte B loads in distinct banks");
  // V^T of the stage as bf16x2 words (token pairs): hi, then lo (unused when EXACT); a 16-token
  // slab's pairs in slab_word order, so that a lane's two B words (tokens 2 tq.., 2 tq + 8..)
  // are one 8-byte load, then XOR-swizzled by an even amount per pair of dims
  // (swizzle()), so that the stores of a warp (32 dim pairs, one token pair) meet at most 2-way
  // bank conflicts (4-way at D 256) while the loads stay conflict-free.
  auto swizzle = [](int dim) { return 2 * ((dim >> 1) % (KS / 4)); };
  AKV_STATIC_SHARED(__align__(16) uint32_t, vt_s, [EXACT ? 1 : 2][D * TW]);
  const int groups = (m + window_block_rows(D) - 1) / window_block_rows(D);
  const int chunk = blockIdx.x, y = blockIdx.y / groups, rg = blockIdx.y % groups;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane >> 2, tq = lane & 3;
  const int r0 = rg * window_block_rows(D) + (warp / SPLITS) * 16 + g, r1 = r0 + 8;
  const int d0 = (warp % SPLITS) * ND;
  A += static_cast<int64_t>(y) * m * S;
  V += static_cast<int64_t>(y) * S * D;
  const int64_t first = static_cast<int64_t>(chunk) * kWindowChunk;
  const int64_t last = first + kWindowChunk < S ? first + kWindowChunk : S;
  const float *a0 = A + static_cast<int64_t>(r0 < m ? r0 : 0) * S, *a1 = A + static_cast<int64_t>(r1 < m ? r1 : 0) * S;
  float acc[NT][4];
  for (int nt = 0; nt < NT; ++nt)
    for (int i = 0; i < 4; ++i) acc[nt][i] = 0.0f;
  for (int64_t t0 = first; t0 < last; t0 += KS) {
    __syncthreads();  // the previous stage's words are consumed
    for (int i = tid; i < (KS / 2) * (D / 2); i += 256) {  // token pair p, dims 2 dp, 2 dp + 1
      const int p = i / (D / 2), dp = i % (D / 2);
      const int64_t t = t0 + 2 * p;
      float2 x0{0.0f, 0.0f}, x1 = x0;
      if (t < last) x0 = *reinterpret_cast<const float2 *>(V + t * D + 2 * dp);
      if (t + 1 < last) x1 = *reinterpret_cast<const float2 *>(V + (t + 1) * D + 2 * dp);
      const int w = slab_word(p) ^ swizzle(2 * dp);
      uint32_t *at0 = &vt_s[0][(2 * dp) * TW + w], *at1 = &vt_s[0][(2 * dp + 1) * TW + w];
      if (EXACT) {
        *at0 = pack_bf16x2(x0.x, x1.x);
        *at1 = pack_bf16x2(x0.y, x1.y);
      } else {
        split_bf16x2(x0.x, x1.x, at0[0], at0[D * TW]);
        split_bf16x2(x0.y, x1.y, at1[0], at1[D * TW]);
      }
    }
    __syncthreads();
#pragma unroll
    for (int ks = 0; ks < KS / 16; ++ks) {
      // A fragment: rows r0, r1; tokens 2 tq, 2 tq + 1 and + 8 of the slab (zero past the chunk).
      const int64_t t = t0 + ks * 16 + 2 * tq;
      float x[8];
      for (int j = 0; j < 4; ++j) {
        const int64_t tj = t + (j & 1) + (j >> 1) * 8;
        x[j] = r0 < m && tj < last ? a0[tj] : 0.0f;
        x[4 + j] = r1 < m && tj < last ? a1[tj] : 0.0f;
      }
      uint32_t ah[4], al[4];
      split_bf16x2(x[0], x[1], ah[0], al[0]);
      split_bf16x2(x[4], x[5], ah[1], al[1]);
      split_bf16x2(x[2], x[3], ah[2], al[2]);
      split_bf16x2(x[6], x[7], ah[3], al[3]);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int dim = d0 + nt * 8 + g, w = dim * TW + ((ks * 8 + 2 * tq) ^ swizzle(dim));
        uint32_t bh[2];
        load_b_pair(bh, &vt_s[0][w]);
        mma_bf16_16816(acc[nt], al, bh);
        if (!EXACT) {
          uint32_t bl[2];
          load_b_pair(bl, &vt_s[EXACT ? 0 : 1][w]);
          mma_bf16_16816(acc[nt], ah, bl);
        }
        mma_bf16_16816(acc[nt], ah, bh);
      }
    }
  }
  // d[0], d[1]: row r0, dims 2 tq, 2 tq + 1 of the n8 tile; d[2], d[3]: row r1.
  float *out = parts + (static_cast<int64_t>(y) * gridDim.x + chunk) * m * D;
  for (int nt = 0; nt < NT; ++nt) {
    const int d = d0 + nt * 8 + 2 * tq;
    if (r0 < m) *reinterpret_cast<float2 *>(out + static_cast<int64_t>(r0) * D + d) = float2{acc[nt][0], acc[nt][1]};
    if (r1 < m) *reinterpret_cast<float2 *>(out + static_cast<int64_t>(r1) * D + d) = float2{acc[nt][2], acc[nt][3]};
  }
}

// y[h][r][d] = the chunks' partial sums in chunk order (n = heads x m x D outputs).
__global__ void window_outputs_reduce_kernel(const float *parts, int chunks, int64_t per_head, int64_t n, float *y) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int64_t h = i / per_head, j = i % per_head;
  const float *p = parts + h * chunks * per_head + j;
  float s = 0.0f;
  for (int c = 0; c < chunks; ++c) s += p[c * per_head];
  y[i] = s;
}

}  // namespace cuda
}  // namespace akv
