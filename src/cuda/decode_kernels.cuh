// Fused compact decode attention (SPEC 4) for AnchorKV caches, and flash-decoding over the
// dense caches (FullKV, eviction methods), in one kernel family:
//
//   decode_split_kernel  grid (splits x slices, H x row chunks, requests), 128 threads. A
//       block takes one KV head of one request, all query rows of its GQA group (G x q_len,
//       in chunks of MAXROWS), one contiguous range of prompt tokens and one slice of the
//       head's anchors, staged in shared memory (one slice when they fit; otherwise each
//       token's logit comes from the block holding its anchor and the others see -inf);
//       split 0 also takes the exact window and the appended suffix. Tiles of TILE tokens:
//         A. logits, one thread per RUN consecutive tokens. AnchorKV keys are never written
//            out: gamma_t * (q . R_t K_a) from the anchor row (swizzled pair words in shared
//            memory) rotated pair by pair, with the angles of consecutive positions stepped
//            by one complex product; dense keys are read as stored (post-RoPE).
//         B. key residuals: one warp per stored residual, inverse Hadamard across the warp,
//            RoPE, dot with the rows, added to the token's logit.
//         C. online softmax (base 2; the scale and log2(e) are folded into the queries).
//         D. values: per-anchor weights w_a += p_t gamma_t (shared-memory atomics), value
//            residuals accumulated in the rotated domain, dense values accumulated directly.
//       The block writes its running max, sum, sum_a w_a V_a + dense part, and the rotated
//       residual sum to the workspace.
//   decode_merge_kernel  grid (H x row chunks, requests): merges the splits and slices,
//       applies the one inverse Hadamard per row, normalises and stores in the caller's dtype.
//
// Everything a kernel reads about a cache is in its CacheView (device memory), including the
// appended length that akv_append advances on the device, so a captured decode replays
// correctly after appends. Compiled by nvcc (cuda/backend.cu) and, on the host, by the SIMT
// emulation tests (tests/emu).
#pragma once
#include "cuda/cache_view.hpp"
#include "cuda/device_common.cuh"

namespace akv {
namespace cuda {

template <int D, int MAXROWS>
struct SplitBlock {
  static constexpr int RUN = run_for_rows(MAXROWS);
  static constexpr int TILE = kThreads * RUN;
  static constexpr int TPD = D < kThreads ? D : kThreads;  // threads per row of D dims
  static constexpr int SG = kThreads / TPD;                // slot groups (D < 128)
  static constexpr int DPT = D / TPD;                      // dims per thread
  static constexpr int EPL = D / 32;                       // dims per lane (warp paths)

  const CacheView &c;
  const DecodeLaunch &p;
  int tid, lane, warp, h, rows, row0;
  bool bf16;
  int k, pairs;
  float *q_s, *w_s, *L_s, *red_s, *inv_s, *stepc_s, *steps_s, *resid_s;
  int32_t *first_s, *second_s, *pair_of_s;
  const uint16_t *akeys;           // anchor keys of this head in global memory
  const uint32_t *aw = nullptr;    // this block's slice of them in shared memory (or null)
  int a0 = 0, a1 = 0;              // the anchors this block handles

  float m_run[MAXROWS], l_part[MAXROWS], racc[MAXROWS][DPT], dacc[MAXROWS][DPT];

  __device__ __forceinline__ SplitBlock(const CacheView &view, const DecodeLaunch &launch, unsigned char *smem, int head, int rc,
                                        int slice)
      : c(view), p(launch) {
    tid = threadIdx.x;
    lane = tid & 31;
    warp = tid >> 5;
    h = head;
    row0 = rc * MAXROWS;
    rows = p.rows - row0 < MAXROWS ? p.rows - row0 : MAXROWS;
    bf16 = c.storage_bf16 != 0;
    k = c.kind == kKindAnchor ? c.anchors : 0;
    pairs = c.rope_pairs;
    const SplitSmem lay(D, MAXROWS, TILE, p.max_anchors, p.max_pairs, p.slice_anchors);
    q_s = reinterpret_cast<float *>(smem + lay.q);
    w_s = reinterpret_cast<float *>(smem + lay.w);
    L_s = reinterpret_cast<float *>(smem + lay.logits);
    red_s = reinterpret_cast<float *>(smem + lay.red);
    inv_s = reinterpret_cast<float *>(smem + lay.inv);
    stepc_s = reinterpret_cast<float *>(smem + lay.stepc);
    steps_s = reinterpret_cast<float *>(smem + lay.steps);
    first_s = reinterpret_cast<int32_t *>(smem + lay.first);
    second_s = reinterpret_cast<int32_t *>(smem + lay.second);
    pair_of_s = reinterpret_cast<int32_t *>(smem + lay.pair_of);
    resid_s = reinterpret_cast<float *>(smem + lay.resid);

    // Queries of this row chunk, scaled so that exp2(logit) is the softmax weight.
    const int G = p.q_heads / p.heads;
    const int64_t qbase = ((static_cast<int64_t>(blockIdx.z) * p.q_heads + static_cast<int64_t>(h) * G) * p.q_len + row0) * D;
    const float qscale = c.softmax_scale * kLog2e;
    for (int e = tid; e < MAXROWS * D; e += kThreads)
      q_s[e] = e / D < rows ? load_elem(p.queries, p.dtype, qbase + e) * qscale : 0.0f;
    for (int e = tid; e < MAXROWS * k; e += kThreads) w_s[e] = 0.0f;
    for (int d = tid; d < D; d += kThreads) pair_of_s[d] = -1;
    __syncthreads();
    for (int j = tid; j < pairs; j += kThreads) {
      inv_s[j] = c.inv_freq[j];
      first_s[j] = c.rope_first[j];
      second_s[j] = c.rope_second[j];
      pair_of_s[c.rope_first[j]] = 2 * j;
      pair_of_s[c.rope_second[j]] = 2 * j + 1;
      rope_angle(1, c.inv_freq[j], &stepc_s[j], &steps_s[j]);
    }
    akeys = k ? c.anchor_keys + static_cast<int64_t>(h) * k * D : nullptr;
    // This block's anchors: slice `slice` of the head's anchors (all of them when they are
    // read from global memory). Tokens of other anchors are left to the other slices.
    a0 = p.slice_anchors ? slice * p.slice_anchors : 0;
    a1 = p.slice_anchors ? (a0 + p.slice_anchors < k ? a0 + p.slice_anchors : k) : k;
    if (a1 > a0 && p.slice_anchors) {
      // Anchor rows as D/2 words: word j < pairs holds the rotary pair (first[j], second[j]),
      // the rest consecutive pairs of the unrotated dimensions, so a pair is one 32-bit load.
      // Row a is rotated by a words: threads reading the same word of different rows hit
      // different banks.
      __syncthreads();  // the pair tables
      uint32_t *dst = reinterpret_cast<uint32_t *>(smem + lay.anchors);
      constexpr int W2 = D / 2;
      for (int e = tid; e < (a1 - a0) * W2; e += kThreads) {
        const int a = e / W2, j = e % W2;  // a: row within the slice
        const int d0 = j < pairs ? first_s[j] : 2 * pairs + 2 * (j - pairs);
        const int d1 = j < pairs ? second_s[j] : d0 + 1;
        const uint16_t *row = akeys + static_cast<int64_t>(a0 + a) * D;
        dst[a * W2 + ((j + a) & (W2 - 1))] = static_cast<uint32_t>(row[d0]) | (static_cast<uint32_t>(row[d1]) << 16);
      }
      aw = dst;
    }
    for (int i = 0; i < MAXROWS; ++i) {
      m_run[i] = -INFINITY;
      l_part[i] = 0.0f;
      for (int e = 0; e < DPT; ++e) racc[i][e] = dacc[i][e] = 0.0f;
    }
    __syncthreads();
  }

  // ---- phase A -------------------------------------------------------------------------

  // acc[r][i] = q_i . R_{pos[r]} (anchor row a[r]) for the thread's RUN tokens.
  __device__ __forceinline__ void anchor_dots(const int *a, const int64_t *pos, const bool *valid, float (*acc)[MAXROWS]) const {
    for (int r = 0; r < RUN; ++r)
      for (int i = 0; i < MAXROWS; ++i) acc[r][i] = 0.0f;
    for (int j = 0; j < pairs; ++j) {
      const int f = first_s[j], s = second_s[j];
      float qf[MAXROWS], qs[MAXROWS];
      for (int i = 0; i < MAXROWS; ++i) {
        qf[i] = q_s[i * D + f];
        qs[i] = q_s[i * D + s];
      }
      float cs = 1.0f, sn = 0.0f;
      for (int r = 0; r < RUN; ++r) {
        if (!valid[r]) continue;
        if (r > 0 && valid[r - 1] && pos[r] == pos[r - 1] + 1) {  // step by one position
          const float c2 = cs * stepc_s[j] - sn * steps_s[j];
          sn = sn * stepc_s[j] + cs * steps_s[j];
          cs = c2;
        } else {
          rope_angle(pos[r], inv_s[j], &cs, &sn);
        }
        float x0, x1;
        word_pair(a[r], j, f, s, x0, x1);
        const float y0 = x0 * cs - x1 * sn, y1 = x0 * sn + x1 * cs;
        for (int i = 0; i < MAXROWS; ++i) acc[r][i] += qf[i] * y0 + qs[i] * y1;
      }
    }
    for (int j = pairs; j < D / 2; ++j) {  // dimensions outside the rotary part, two at a time
      const int d = 2 * pairs + 2 * (j - pairs);
      for (int r = 0; r < RUN; ++r) {
        if (!valid[r]) continue;
        float x0, x1;
        word_pair(a[r], j, d, d + 1, x0, x1);
        for (int i = 0; i < MAXROWS; ++i) acc[r][i] += q_s[i * D + d] * x0 + q_s[i * D + d + 1] * x1;
      }
    }
  }

  // Dimensions d0, d1 (word j of the pair layout) of anchor a.
  __device__ __forceinline__ void word_pair(int a, int j, int d0, int d1, float &x0, float &x1) const {
    if (aw) {
      a -= a0;
      const uint32_t w = aw[a * (D / 2) + ((j + a) & (D / 2 - 1))];
      x0 = bits_to_float(static_cast<uint16_t>(w & 0xffffu), bf16);
      x1 = bits_to_float(static_cast<uint16_t>(w >> 16), bf16);
    } else {
      const uint16_t *row = akeys + static_cast<int64_t>(a) * D;
      x0 = bits_to_float(row[d0], bf16);
      x1 = bits_to_float(row[d1], bf16);
    }
  }

  // Prefix tokens t0.. (AnchorKV): logits gamma_t (q . R_t K_a) into L_s.
  __device__ __forceinline__ void prefix_logits(int64_t t0, int64_t end) {
    const int64_t P = c.prefix;
    int a[RUN];
    int64_t pos[RUN];
    bool valid[RUN];
    float gam[RUN];
    for (int r = 0; r < RUN; ++r) {
      const int64_t t = t0 + tid * RUN + r;
      a[r] = t < end ? c.key_index[h * P + t] : 0;
      valid[r] = t < end && a[r] >= a0 && a[r] < a1;
      gam[r] = valid[r] ? bits_to_float(c.key_gamma[h * P + t], true) : 0.0f;
      pos[r] = valid[r] ? c.positions[t] : 0;
    }
    float acc[RUN][MAXROWS];
    anchor_dots(a, pos, valid, acc);
    for (int r = 0; r < RUN; ++r)
      for (int i = 0; i < MAXROWS; ++i) L_s[i * TILE + tid * RUN + r] = valid[r] ? gam[r] * acc[r][i] : -INFINITY;
  }

  // Window tokens w0.. (AnchorKV): exact anchors k-W+w at consecutive positions.
  __device__ __forceinline__ void window_logits(int w0, int end) {
    int a[RUN];
    int64_t pos[RUN];
    bool valid[RUN];
    for (int r = 0; r < RUN; ++r) {
      const int w = w0 + tid * RUN + r;
      a[r] = k - c.window + w;
      valid[r] = w < end && a[r] >= a0 && a[r] < a1;
      pos[r] = c.window_first_position + w;
    }
    float acc[RUN][MAXROWS];
    anchor_dots(a, pos, valid, acc);
    for (int r = 0; r < RUN; ++r)
      for (int i = 0; i < MAXROWS; ++i) L_s[i * TILE + tid * RUN + r] = valid[r] ? acc[r][i] : -INFINITY;
  }

  // Dense rows keys[t0..end) (post-RoPE). causal: these are appended tokens, and row i
  // (query qi of its head) sees the first suffix_len - (q_len - 1 - qi) of them.
  __device__ __forceinline__ void dense_logits(const uint16_t *keys, int64_t t0, int64_t end, bool causal, int64_t suffix_len) {
    for (int r = 0; r < RUN; ++r) {
      const int64_t t = t0 + tid * RUN + r;
      float acc[MAXROWS];
      for (int i = 0; i < MAXROWS; ++i) acc[i] = 0.0f;
      if (t < end) {
        const uint4 *row = reinterpret_cast<const uint4 *>(keys + t * D);
        for (int v = 0; v < D / 8; ++v) {
          const uint4 chunk = row[v];
          const uint32_t words[4] = {chunk.x, chunk.y, chunk.z, chunk.w};
          for (int e = 0; e < 8; ++e) {
            const float x = bits_to_float(static_cast<uint16_t>(words[e / 2] >> (16 * (e % 2))), bf16);
            for (int i = 0; i < MAXROWS; ++i) acc[i] += q_s[i * D + v * 8 + e] * x;
          }
        }
      }
      for (int i = 0; i < MAXROWS; ++i) {
        bool visible = t < end;
        if (causal) visible = visible && t < suffix_len - (p.q_len - 1 - (row0 + i) % p.q_len);
        L_s[i * TILE + tid * RUN + r] = visible ? acc[i] : -INFINITY;
      }
    }
  }

  // ---- phase B: key residuals of prefix tokens t0..end (words t0/64..) ----------------------

  __device__ __forceinline__ void key_residuals(int64_t t0, int64_t end) {
    const int64_t words = c.words;
    const int64_t wb = t0 / 64, we = (end + 63) / 64;
    const float norm = 1.0f / sqrtf(static_cast<float>(D));
    float *scratch = resid_s + warp * D;
    for (int64_t wd = wb + warp; wd < we; wd += kThreads / 32) {
      uint64_t mask = c.key_mask[h * words + wd];
      const uint32_t base = c.key_offsets[h] + c.key_prefix[h * words + wd];
      for (uint32_t slot = base; mask; ++slot) {
        const int bit = __ffsll(static_cast<long long>(mask)) - 1;
        mask &= mask - 1;
        const int64_t t = wd * 64 + bit;
        const int an = c.key_index[h * c.prefix + t];
        if (an < a0 || an >= a1) continue;  // another slice's token (its logit stays -inf here)
        const uint8_t *codes = c.key_codes + static_cast<int64_t>(slot) * (D / 4);
        const float scale = c.key_scales[slot];
        float x[EPL];
        for (int e = 0; e < EPL; ++e) {
          const int d = lane * EPL + e;
          x[e] = scale * lloyd_max_level((codes[d >> 2] >> ((d & 3) * 2)) & 3);
        }
        // Inverse rotation U^T y = diag(signs) H y / sqrt(D).
        warp_fwht<EPL>(x, lane);
        for (int e = 0; e < EPL; ++e) {
          const int d = lane * EPL + e;
          x[e] *= norm * c.signs[d];
          scratch[d] = x[e];
        }
        __syncwarp();
        const int64_t pos = c.positions[t];
        float part[MAXROWS];
        for (int i = 0; i < MAXROWS; ++i) part[i] = 0.0f;
        for (int e = 0; e < EPL; ++e) {
          const int d = lane * EPL + e;
          float y = x[e];
          const int info = pair_of_s[d];
          if (info >= 0) {
            const int j = info >> 1;
            float cs, sn;
            rope_angle(pos, inv_s[j], &cs, &sn);
            y = (info & 1) ? scratch[first_s[j]] * sn + x[e] * cs : x[e] * cs - scratch[second_s[j]] * sn;
          }
          for (int i = 0; i < MAXROWS; ++i) part[i] += q_s[i * D + d] * y;
        }
        for (int i = 0; i < MAXROWS; ++i) {
          const float sum = warp_sum(part[i]);
          if (lane == 0 && i < rows) L_s[i * TILE + (t - t0)] += sum;
        }
        __syncwarp();
      }
    }
  }

  // ---- phase C: online softmax over the tile; L_s becomes p = exp2(logit - max) -------------

  __device__ __forceinline__ void softmax_tile() {
    __syncthreads();
    float tmax[MAXROWS];
    for (int i = 0; i < MAXROWS; ++i) {
      float m = -INFINITY;
      for (int r = 0; r < RUN; ++r) m = fmaxf(m, L_s[i * TILE + tid * RUN + r]);
      m = warp_max(m);
      if (lane == 0) red_s[warp * MAXROWS + i] = m;
    }
    __syncthreads();
    bool rescale = false;
    float alpha[MAXROWS];
    for (int i = 0; i < MAXROWS; ++i) {
      tmax[i] = red_s[i];
      for (int wp = 1; wp < kThreads / 32; ++wp) tmax[i] = fmaxf(tmax[i], red_s[wp * MAXROWS + i]);
      const float m_new = fmaxf(m_run[i], tmax[i]);
      alpha[i] = m_new == -INFINITY ? 1.0f : exp2f(m_run[i] - m_new);  // exp2(-inf) = 0
      if (alpha[i] != 1.0f) rescale = true;
      m_run[i] = m_new;
    }
    if (rescale) {  // uniform across the block: every thread holds the same alpha
      for (int i = 0; i < MAXROWS; ++i) {
        l_part[i] *= alpha[i];
        for (int e = 0; e < DPT; ++e) {
          racc[i][e] *= alpha[i];
          dacc[i][e] *= alpha[i];
        }
      }
      for (int e = tid; e < MAXROWS * k; e += kThreads) w_s[e] *= alpha[e / k];
    }
    for (int i = 0; i < MAXROWS; ++i)
      for (int r = 0; r < RUN; ++r) {
        float &l = L_s[i * TILE + tid * RUN + r];
        const float pv = m_run[i] == -INFINITY ? 0.0f : exp2f(l - m_run[i]);
        l = pv;
        l_part[i] += pv;
      }
    __syncthreads();
  }

  // ---- phase D: values -----------------------------------------------------------------

  __device__ __forceinline__ void prefix_values(int64_t t0, int64_t end) {
    const int64_t P = c.prefix, words = c.words;
    for (int r = 0; r < RUN; ++r) {
      const int64_t t = t0 + tid * RUN + r;
      if (t >= end) continue;
      const int a = c.value_index[h * P + t];
      const float g = bits_to_float(c.value_gamma[h * P + t], true);
      for (int i = 0; i < rows; ++i) atomicAdd(&w_s[i * k + a], L_s[i * TILE + tid * RUN + r] * g);
    }
    const int group = tid / TPD, dim = tid % TPD;
    for (int64_t wd = t0 / 64; wd < (end + 63) / 64; ++wd) {
      const uint32_t base = c.value_offsets[h] + c.value_prefix[h * words + wd];
      const uint32_t count = static_cast<uint32_t>(__popcll(c.value_mask[h * words + wd]));
      for (uint32_t sl = base + group; sl < base + count; sl += SG) {
        const int64_t u = wd * 64 + c.value_chunk[sl] - t0;
        const uint8_t *codes = c.value_codes + static_cast<int64_t>(sl) * (D / 4);
        const float scale = c.value_scales[sl];
        for (int e = 0; e < DPT; ++e) {
          const int d = dim + e * TPD;
          const float lv = scale * lloyd_max_level((codes[d >> 2] >> ((d & 3) * 2)) & 3);
          for (int i = 0; i < MAXROWS; ++i) racc[i][e] += L_s[i * TILE + u] * lv;
        }
      }
    }
    __syncthreads();
  }

  __device__ __forceinline__ void window_values(int w0, int end) {
    for (int r = 0; r < RUN; ++r) {
      const int w = w0 + tid * RUN + r;
      if (w >= end) continue;
      for (int i = 0; i < rows; ++i) atomicAdd(&w_s[i * k + k - c.window + w], L_s[i * TILE + tid * RUN + r]);
    }
    __syncthreads();
  }

  __device__ __forceinline__ void dense_values(const uint16_t *values, int64_t t0, int64_t end) {
    const int group = tid / TPD, dim = tid % TPD;
    for (int64_t u = group; t0 + u < end && u < TILE; u += SG)
      for (int e = 0; e < DPT; ++e) {
        const float v = bits_to_float(values[(t0 + u) * D + dim + e * TPD], bf16);
        for (int i = 0; i < MAXROWS; ++i) dacc[i][e] += L_s[i * TILE + u] * v;
      }
    __syncthreads();
  }

  // ---- the block's partial result --------------------------------------------------------

  __device__ __forceinline__ void write_partial(int64_t blk) {
    const int group = tid / TPD, dim = tid % TPD;
    float o[MAXROWS][DPT];
    for (int i = 0; i < MAXROWS; ++i)
      for (int e = 0; e < DPT; ++e) o[i][e] = dacc[i][e];
    if (k) {
      const uint16_t *av = c.anchor_values + static_cast<int64_t>(h) * k * D;
      for (int a = group; a < k; a += SG)
        for (int e = 0; e < DPT; ++e) {
          const float v = bits_to_float(av[static_cast<int64_t>(a) * D + dim + e * TPD], bf16);
          for (int i = 0; i < MAXROWS; ++i) o[i][e] += w_s[i * k + a] * v;
        }
    }
    // Sum over slot groups (D < 128) through shared memory, then write.
    float *scratch = L_s;  // SG * MAXROWS * D <= MAXROWS * max(TILE, D) floats
    for (int part = 0; part < 2; ++part) {
      for (int i = 0; i < MAXROWS; ++i)
        for (int e = 0; e < DPT; ++e) scratch[(group * MAXROWS + i) * D + dim + e * TPD] = part == 0 ? o[i][e] : racc[i][e];
      __syncthreads();
      float *dst = part == 0 ? p.ws_o : p.ws_r;
      for (int e = tid; e < MAXROWS * D; e += kThreads) {
        float sum = 0.0f;
        for (int g = 0; g < SG; ++g) sum += scratch[g * MAXROWS * D + e];
        dst[blk * MAXROWS * D + e] = sum;
      }
      __syncthreads();
    }
    for (int i = 0; i < MAXROWS; ++i) {
      const float l = warp_sum(l_part[i]);
      if (lane == 0) red_s[warp * MAXROWS + i] = l;
    }
    __syncthreads();
    for (int i = 0; i < MAXROWS; ++i)  // static indices keep m_run in registers
      if (tid == i) {
        float l = 0.0f;
        for (int wp = 0; wp < kThreads / 32; ++wp) l += red_s[wp * MAXROWS + i];
        p.ws_ml[(blk * MAXROWS + i) * 2] = m_run[i];
        p.ws_ml[(blk * MAXROWS + i) * 2 + 1] = l;
      }
  }
};

template <int D, int MAXROWS>
__global__ void __launch_bounds__(kThreads) decode_split_kernel(const __grid_constant__ DecodeLaunch p) {
#ifdef AKV_SIMT_EMULATION
  unsigned char *smem = ::simt::tl_block->dynamic.data();
#else
  extern __shared__ __align__(16) unsigned char smem[];
#endif
  using Block = SplitBlock<D, MAXROWS>;
  const int split = blockIdx.x / p.slices, slice = blockIdx.x % p.slices;
  const int h = blockIdx.y / p.row_chunks, rc = blockIdx.y % p.row_chunks;
  const CacheView &c = *p.views[blockIdx.z];
  Block blk(c, p, smem, h, rc, slice);
  const int splits = p.splits;
  const int64_t suffix_len = c.suffix_len;

  if (c.kind == kKindAnchor) {
    const int64_t P = c.prefix;
    const int64_t tiles = (P + Block::TILE - 1) / Block::TILE;
    for (int64_t tile = tiles * split / splits; tile < tiles * (split + 1) / splits; ++tile) {
      const int64_t t0 = tile * Block::TILE, end = t0 + Block::TILE < P ? t0 + Block::TILE : P;
      blk.prefix_logits(t0, end);
      __syncthreads();
      blk.key_residuals(t0, end);
      blk.softmax_tile();
      blk.prefix_values(t0, end);
    }
    if (split == 0)
      for (int w0 = 0; w0 < c.window; w0 += Block::TILE) {
        const int end = w0 + Block::TILE < c.window ? w0 + Block::TILE : c.window;
        blk.window_logits(w0, end);
        blk.softmax_tile();
        blk.window_values(w0, end);
      }
  } else if (slice == 0) {
    const int64_t first = c.dense_start[h], count = c.dense_start[h + 1] - first;
    const uint16_t *keys = c.dense_keys + first * D, *values = c.dense_values + first * D;
    const int64_t tiles = (count + Block::TILE - 1) / Block::TILE;
    for (int64_t tile = tiles * split / splits; tile < tiles * (split + 1) / splits; ++tile) {
      const int64_t t0 = tile * Block::TILE, end = t0 + Block::TILE < count ? t0 + Block::TILE : count;
      blk.dense_logits(keys, t0, end, false, 0);
      blk.softmax_tile();
      blk.dense_values(values, t0, end);
    }
  }
  if (split == 0 && slice == 0 && suffix_len > 0) {
    const uint16_t *keys = c.suffix_keys + static_cast<int64_t>(h) * c.suffix_capacity * D;
    const uint16_t *values = c.suffix_values + static_cast<int64_t>(h) * c.suffix_capacity * D;
    for (int64_t t0 = 0; t0 < suffix_len; t0 += Block::TILE) {
      const int64_t end = t0 + Block::TILE < suffix_len ? t0 + Block::TILE : suffix_len;
      blk.dense_logits(keys, t0, end, true, suffix_len);
      blk.softmax_tile();
      blk.dense_values(values, t0, end);
    }
  }
  blk.write_partial((static_cast<int64_t>(blockIdx.z) * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x);
}

template <int D, int MAXROWS>
__global__ void __launch_bounds__(kThreads) decode_merge_kernel(const __grid_constant__ DecodeLaunch p) {
  AKV_STATIC_SHARED(float, buf, [D]);
  constexpr int TPD = D < kThreads ? D : kThreads;
  constexpr int DPT = D / TPD;
  const int tid = threadIdx.x;
  const int h = blockIdx.x / p.row_chunks, rc = blockIdx.x % p.row_chunks;
  const int b = blockIdx.y;
  const CacheView &c = *p.views[b];
  const int row0 = rc * MAXROWS, rows = p.rows - row0 < MAXROWS ? p.rows - row0 : MAXROWS;
  const int G = p.q_heads / p.heads;
  const int parts = p.splits * p.slices;
  const int64_t first_blk = (static_cast<int64_t>(b) * p.heads * p.row_chunks + blockIdx.x) * parts;
  const bool anchor = c.kind == kKindAnchor;
  const float norm = 1.0f / sqrtf(static_cast<float>(D));
  for (int i = 0; i < rows; ++i) {
    float m = -INFINITY;
    for (int s = 0; s < parts; ++s) m = fmaxf(m, p.ws_ml[((first_blk + s) * MAXROWS + i) * 2]);
    float l = 0.0f, o[DPT], r[DPT];
    for (int e = 0; e < DPT; ++e) o[e] = r[e] = 0.0f;
    for (int s = 0; s < parts; ++s) {
      const int64_t at = (first_blk + s) * MAXROWS + i;
      const float ms = p.ws_ml[at * 2];
      if (ms == -INFINITY) continue;
      const float f = exp2f(ms - m);
      l += f * p.ws_ml[at * 2 + 1];
      if (tid < TPD)
        for (int e = 0; e < DPT; ++e) {
          o[e] += f * p.ws_o[at * D + tid + e * TPD];
          r[e] += f * p.ws_r[at * D + tid + e * TPD];
        }
    }
    if (anchor) {  // the one inverse Hadamard of this row: U^T r = diag(signs) H r / sqrt(D)
      if (tid < TPD)
        for (int e = 0; e < DPT; ++e) buf[tid + e * TPD] = r[e];
      __syncthreads();
      for (int len = 1; len < D; len <<= 1) {
        for (int q = tid; q < D / 2; q += kThreads) {
          const int j = (q / len) * 2 * len + q % len;
          const float u = buf[j], v = buf[j + len];
          buf[j] = u + v;
          buf[j + len] = u - v;
        }
        __syncthreads();
      }
      if (tid < TPD)
        for (int e = 0; e < DPT; ++e) {
          const int d = tid + e * TPD;
          r[e] = buf[d] * norm * c.signs[d];
        }
      __syncthreads();
    }
    // m and l are base 2 (log2(e) folded into the queries): lse = ln(2) * (m + log2(l)).
    if (p.lse && tid == 0)
      p.lse[(static_cast<int64_t>(b) * p.q_heads + static_cast<int64_t>(h) * G) * p.q_len + row0 + i] =
          l > 0.0f ? 0.69314718f * (m + log2f(l)) : -INFINITY;
    if (tid < TPD) {
      const int64_t base = ((static_cast<int64_t>(b) * p.q_heads + static_cast<int64_t>(h) * G) * p.q_len + row0 + i) * D;
      for (int e = 0; e < DPT; ++e) {
        const int d = tid + e * TPD;
        store_elem(p.out, p.dtype, base + d, l > 0.0f ? (o[e] + r[e]) / l : 0.0f);
      }
    }
  }
}

// Append: rows [suffix_len, suffix_len + n) of every head, RoPE applied to keys unless they
// arrive rotated. grid (n, H), 64 threads. The length itself advances in append_commit.
__global__ void append_rows_kernel(const __grid_constant__ AppendLaunch a) {
  const CacheView &c = *a.view;
  const int i = blockIdx.x, h = blockIdx.y, D = c.head_dim;
  const int64_t row = static_cast<int64_t>(c.suffix_len) + i;
  if (row >= c.suffix_capacity) return;  // the host reserved; a stale replay must not overrun
  const int64_t src = (static_cast<int64_t>(h) * a.n_total + a.token0 + i) * D;
  const int64_t dst = (static_cast<int64_t>(h) * c.suffix_capacity + row) * D;
  const bool bf16 = c.storage_bf16 != 0;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    c.suffix_values[dst + d] = float_to_bits(load_elem(a.values, a.dtype, src + d), bf16);
    if (c.keys_post_rope || d >= 2 * c.rope_pairs)
      c.suffix_keys[dst + d] = float_to_bits(load_elem(a.keys, a.dtype, src + d), bf16);
  }
  if (!c.keys_post_rope)
    for (int j = threadIdx.x; j < c.rope_pairs; j += blockDim.x) {
      const int f = c.rope_first[j], s = c.rope_second[j];
      float cs, sn;
      rope_angle(a.positions[i], c.inv_freq[j], &cs, &sn);
      const float x0 = load_elem(a.keys, a.dtype, src + f), x1 = load_elem(a.keys, a.dtype, src + s);
      c.suffix_keys[dst + f] = float_to_bits(x0 * cs - x1 * sn, bf16);
      c.suffix_keys[dst + s] = float_to_bits(x0 * sn + x1 * cs, bf16);
    }
}

__global__ void append_commit_kernel(CacheView *view, int32_t n) {
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    const int32_t len = view->suffix_len + n;
    view->suffix_len = len < view->suffix_capacity ? len : view->suffix_capacity;
  }
}

}  // namespace cuda
}  // namespace akv
