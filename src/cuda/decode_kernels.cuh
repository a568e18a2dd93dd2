// Fused compact decode attention (docs/design.md §4) for AnchorKV caches, and flash-decoding over the
// dense caches (FullKV, eviction methods), in one kernel family:
//
//   decode_split_kernel  grid (splits, H x row chunks, requests), 256 threads. A block takes
//       one KV head of one request, the query rows of its GQA group (G x q_len, in chunks of
//       MAXROWS <= 16), and one contiguous range of tiles of T = 64 prompt tokens (one
//       residual mask word per tile), the prefix's and then the exact window's (a window tile
//       counted as two: SplitBlock::split_unit), then the appended suffix's tiles split s,
//       s + splits, ... Two
//       instantiations a shape: FAST (fast_decode_path: every cache of the launch on the
//       register-gather path) and the rest. Per tile, everything in shared memory:
//         1. the tile's anchor indices, gammas and positions; the RoPE angle of the tile's
//            first position for every pair (exact, once per tile and pair);
//         2. the unrotated key tile gamma_t * K_a(t) in fp32, the anchor rows read through
//            L2 as the tile needs them (256 B a token at D = 128; no anchor slices);
//         3. key residuals decoded cooperatively (warp w takes the tile's residuals w, w+8,
//            ...: inverse Hadamard across the warp) and added to their token's row;
//         4. RoPE applied in place: the angle of position p0 + d is the tile's first angle
//            times a per-block table e^{i d omega_j}, d < T (one complex product; gapped
//            positions fall back to the exact angle); dense keys are read as stored;
//         5. the key tile contracted with all rows of the chunk on the tensor cores
//            (mma.m16n8k16, bf16 operands, f32 accumulation; bf16 queries: one product,
//            other dtypes: hi + lo splits and three products, fp32-level accuracy);
//         6. online softmax (base 2; the scale and log2(e) are folded into the queries);
//         7. values: per-anchor weights w_a += p_t gamma_t (shared-memory atomics; with more
//            anchors than shared memory holds, by segment table entry in shared memory and
//            added to the block's own workspace rows when the segment ends, or global atomics
//            into those rows: DecodeLaunch::smem_anchors), value residuals accumulated in the
//            rotated domain, dense values accumulated directly.
//       The block writes its running max and sum, the dense part, the rotated residual sum
//       and its per-anchor weights to the workspace.
//   decode_anchor_values_kernel  grid (anchor parts x H x row chunks, requests), AnchorKV
//       only: reduces the per-anchor weights across splits and computes sum_a w_a V_a over
//       parts of 256 anchors.
//   decode_merge_kernel  grid (H x row chunks, requests), 256 threads: merges the splits,
//       sums the anchor-value parts, applies the one inverse Hadamard per row, normalises and
//       stores in the caller's dtype.
//
// Everything a kernel reads about a cache is in its CacheView (device memory), including the
// appended length that akv_append advances on the device, so a captured decode replays
// correctly after appends. Compiled by nvcc (cuda/backend.cu) and, on the host, by the SIMT
// emulation tests (tests/emu).
#pragma once
#include <cstring>
#include <type_traits>
#include "core/codebook.hpp"
#include "cuda/cache_view.hpp"
#include "cuda/device_common.cuh"

namespace akv {
namespace cuda {

// The exact angle of a gapped position offset, out of line: a rare path whose double
// arithmetic would otherwise take registers from the unrolled loops around it.
#ifdef AKV_SIMT_EMULATION
#define AKV_NOINLINE inline
#else
#define AKV_NOINLINE static __noinline__
#endif
__device__ AKV_NOINLINE float2 exact_angle(int64_t offset, float inv_freq) {
  float2 r;
  rope_angle(offset, inv_freq, &r.x, &r.y);
  return r;
}

// A loop kept rolled (register pressure), or unrolled (per-row registers indexed by its
// counter); nothing in the emulation.
#ifdef AKV_SIMT_EMULATION
#define AKV_NO_UNROLL
#define AKV_UNROLL
#else
#define AKV_NO_UNROLL _Pragma("unroll 1")
#define AKV_UNROLL _Pragma("unroll")
#endif

// The split kernel's block, linearized (its workspace rows, its partial results).
__device__ __forceinline__ int64_t split_block_index() {
  return (static_cast<int64_t>(blockIdx.z) * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
}

template <int D, int MAXROWS, bool FAST, bool GPTJ = false>
struct SplitBlock {
  static_assert(FAST || !GPTJ, "GPT-J pairs have their own kernel on the register-gather path only");
  static constexpr int NT = kDecodeThreads;
  static constexpr int NW = NT / 32;
  static constexpr int T = kDecodeTile;
  static constexpr int KS = SplitSmem::key_stride(D);  // floats per key row
  // Threads per row of D dims: at D 128 with 4 rows half a row, so that a tile's few value
  // residuals (about 3) take slot groups of two warps, a residual a group and two dims a
  // thread (kValueGroups of them in turn), rather than groups of four. Elsewhere the two
  // dims' sums cost registers the kernels spill (8 rows at D 128, 4 at D 256), and at D 64
  // with 16 rows write_partial's scratch (SG x MAXROWS x D floats) would not fit.
  static constexpr int TPD = D == 128 && MAXROWS <= 4 ? D / 2 : D < NT ? D : NT;
  static_assert(TPD <= NT && NT % TPD == 0, "whole slot groups");
  static constexpr int SG = NT / TPD;                 // slot groups
  static constexpr int DPT = D / TPD;                 // dims per thread
  static constexpr int EPL = D / 32;                  // dims per lane (warp paths)
  // Slot groups that take a tile's value residuals (prefix_values): every one up to 4 (D 64
  // and 128 with 4 rows: all 8 warps, about one residual a group at the default budget; two a
  // group, on half the warps, left the others waiting at the barrier).
  static constexpr int kValueGroups = 4;
  static_assert(T == 64, "a tile is one residual mask word");
  static_assert(MAXROWS <= 16, "more rows spill: split them into row chunks");
  static_assert(MAXROWS % 4 == 0, "value residuals read a residual's rows as float4");
  static_assert(SplitSmem::fast_tables_bytes(D) + 4 * MAXROWS * T <= 4 * T * KS,
                "the fast path's tables and the tile's probabilities by token share the key tile");
  static_assert(D / 2 + T <= NT - 64, "anchor_meta: warps NW - 2, NW - 1 take no token nor pair (stage_keys, _values)");

  const CacheView &c;
  const DecodeLaunch &p;
  int tid, lane, warp, h, rows, row0;
  bool bf16;
  // No RoPE, or NeoX pairs with pairs % 4 == 0 and pairs / (D / 8) in {1, 2, 4}: anchor rows are rotated as
  // they are gathered, and key residuals rotated (partner dimension one shuffle away) before
  // they are added; no separate RoPE pass.
  bool fused;
  // This tile's positions do not all lie within T of its first (storage format 2 with explicit
  // positions): its rows are gathered unrotated, the key residuals added unrotated, and
  // rotate_keys rotates the tile with exact angles where the table has none.
  bool gapped = false;
  bool format3;  // AnchorKV storage format 3: metadata read as stored (CacheView)
  bool tables;   // format 3 with segment tables (more than 256 anchors): entries index a table
  // Queries not in bf16: the contraction splits keys and queries into bf16 hi + lo (three
  // mma products) so that it keeps fp32-level accuracy; bf16 queries: one product.
  bool precise;
  // The register-gather path of anchor tiles (format 3 prefix and every window): bf16 storage,
  // bf16 queries, NeoX or GPT-J over every dimension. Each of warps 0-3 gathers its 16 tokens' anchor
  // rows straight into mma fragments and rotates them there in packed bf16x2 arithmetic (no
  // key tile in shared memory); gamma scales the logit, and the key residuals (decoded by
  // warps 4-7 meanwhile) enter as logit terms.
  bool fast;
  int k, pairs;
  // Per-anchor weights [MAXROWS][wstride]: shared memory (w == w_s, wstride = k) when the
  // cache's k fit (DecodeLaunch::smem_anchors), else this block's rows of ws_w (wstride =
  // max_anchors).
  float *w;
  int64_t wstride;
  // Not in shared memory, and the cache has segment tables: the prefix tokens' weights are
  // summed in w_s by their segment's table entry, [MAXROWS][kSegmentEntries], and added to w
  // when the segment ends (flush_segment); an anchor token's own weight (it is exact, not an
  // entry) goes to w directly. format3_meta stores the entry, or kSegmentEntries + the anchor.
  bool segw;
  // fast: each token's additive logit term [MAXROWS][T]: its key residual's term, and with
  // kFoldedPenalty minus its logit penalty too (written with the tile's metadata; key_residuals
  // adds the term), so that the contraction's epilogue is one fma a logit.
  float *rl_s;
  // Not at D 256, where it costs the shipped kernels 24-32 more bytes of stack.
  static constexpr bool kFoldedPenalty = D <= 128;
  // fast: R_u's bf16x2 cos and sin of four pairs in one 16-byte entry, [T][kTrigStride] (the
  // rows padded by 64 bytes, so that the two tokens of a quarter warp's loads in
  // contract_gathered, u and u + 1, fall in the two halves of the banks); bf16 rotated queries.
  static constexpr int kTrigStride = SplitSmem::trig_stride(D);
  static constexpr int QS = SplitSmem::qb_stride(D);  // qb_s's row stride
  uint4 *cs_s;
  uint16_t *qb_s;
  float *q_s, *qr_s, *w_s, *L_s, *Lp_s, *red_s, *mref_s, *inv_s, *basec_s, *bases_s, *g_s, *vg_s, *K_s, *sgn_s, *pen_s;
  float2 *step_s;
  int32_t *first_s, *second_s, *a_s, *va_s, *off_s, *bit_s, *kind_s;
  // Storage format 3 (format3_meta): the segment whose table (tab_s) and coefficients by code
  // (kgam_s, vgam_s) shared memory holds, -1 before the first; whether an even and an odd tile
  // is its last ([1], [2]: segw).
  int32_t *seg_s;
  uint16_t *tab_s;
  float *kgam_s, *vgam_s, *units_s;  // units_s: CacheView::gamma_units, copied once a block
  int64_t *pos_s;

  // Rows owned by each warp: warp w holds row w + r NW's running max and its lanes' partial
  // sums in m_run[r], l_part[r] (only the owner keeps them: fewer live registers); the max is
  // mirrored in mref_s for the prefix tiles' logit pass (contract, settle_tile).
  static constexpr int RPW = (MAXROWS + NW - 1) / NW;
  // The per-anchor weights' passes (prefix_values): RP rows at a time, thread row lane % RP
  // and token warp + NW (lane / RP). The prefix tiles' sums of p are kept by those threads
  // (lacc[pass]), not the rows' owners, beside the weights they add anyway.
  static constexpr int RP = NT / T, PASSES = MAXROWS / RP;
  static_assert(NT % T == 0 && MAXROWS % RP == 0 && NW * (32 / RP) == T, "whole rows per pass, every token");
  // racc: the value residuals' sums (prefix tiles); dacc: the dense values' (dense and suffix
  // tiles), zeroed where those start (start_dense), so that it holds no registers across the
  // prefix tiles.
  float m_run[RPW], l_part[RPW], lacc[PASSES], racc[MAXROWS][DPT], dacc[MAXROWS][DPT];
  // Threads T .. T + pairs - 1 (pair j = tid - T): the tile's first angle (basec_s, bases_s),
  // carried from tile to tile by e^{i T omega_j} (tstep_s) while positions run on
  // (next_s), recomputed exactly at the first tile, after a gap and every kExactTiles tiles
  // (left_s); in shared memory, not registers every thread would hold.
  static constexpr int kExactTiles = 16;
  float2 *tstep_s;
  int64_t *next_s;
  int32_t *left_s;
  HeadArrays *ha_s;  // this head's array pointers
  uint32_t *res_s;       // the tile's key residuals (first slot, count), then the value residuals'
  uint64_t *tw_s;        // format 3: [tile parity][4] the tile's mask words and first anchor (tile_words)
  uint32_t *ent_s;       // format 3: [tile parity][T] each token's entries and codes (stage_entries)
  uint32_t *vc_s;        // the tile's value residuals' codes [count][D / 16] (32-bit words)
  int32_t *vpos_s;       // and their positions in the tile [count]
  float *vlev_s;         // and their four scaled levels [count][4]
  uint32_t *kc_s;        // fast: the tile's key residuals' codes [count][D / 16] (stage_keys)
  float *ks_s;           // and their scales [count]

  // A split block's share of an anchor cache's tiles: the prefix's tiles, then the window's,
  // a window tile counted as kWindowUnits prefix tiles (its rows from L2: about 1.4 tiles'
  // cycles by scripts/sass_count.py's tail_walk), split evenly by that count. Split `split` of
  // `splits` starts at unit split_unit(.., split, ..) and ends where split + 1 starts; window
  // tile w is unit tiles + kWindowUnits w. (Split 0 took the window on top of its share: its
  // blocks ran the longest, and the kernel with them.)
  static constexpr int kWindowUnits = 2;
  __device__ static __forceinline__ int split_unit(int P, int window, int split, int splits) {
    const int units = (P + T - 1) / T + kWindowUnits * ((window + T - 1) / T);
    return static_cast<int>(int64_t{units} * split / splits);
  }
  // The first window tile at or after unit u of a cache with `tiles` prefix tiles.
  __device__ static __forceinline__ int window_tile(int u, int tiles) {
    return u <= tiles ? 0 : (u - tiles + kWindowUnits - 1) / kWindowUnits;
  }

  // blk: this block's index among the launch's split blocks (its workspace rows).
  __device__ __forceinline__ SplitBlock(const CacheView &view, const DecodeLaunch &launch, unsigned char *smem, int head, int rc,
                                        int64_t blk)
      : c(view), p(launch) {
    tid = threadIdx.x;
    // The set-up reads the view's fields from a copy in shared memory (16 bytes a thread):
    // from global memory ptxas issued each field's load just before its use, and the set-up's
    // dependent fields took a trip to L2 each. The tiles read c, the view itself, as before
    // (tiles reading the copy cost the shipped kernels more spills).
    constexpr int kViewChunks = sizeof(CacheView) / sizeof(uint4);
    static_assert(sizeof(CacheView) % sizeof(uint4) == 0 && kViewChunks <= NT, "a 16-byte chunk a thread");
    constexpr SplitSmem lay(D, MAXROWS, 0);  // offsets are constants; the weights come last
    CacheView *view_s = reinterpret_cast<CacheView *>(smem + lay.view);
    if (tid < kViewChunks)
      reinterpret_cast<uint4 *>(view_s)[tid] = load_ro(reinterpret_cast<const uint4 *>(&view) + tid);
    __syncthreads();
    const CacheView &v = *view_s;
    lane = tid & 31;
    warp = tid >> 5;
    h = head;
    row0 = rc * MAXROWS;
    rows = p.rows - row0 < MAXROWS ? p.rows - row0 : MAXROWS;
    bf16 = v.storage_bf16 != 0;
    k = v.kind == kKindAnchor ? v.anchors : 0;
    pairs = v.rope_pairs;
    fused = v.rope_fused != 0;  // decided on the host (build_view_block)
    format3 = v.format == 3;
    tables = v.table_size != 0;
    precise = p.dtype != AKV_DTYPE_BF16;
    // FAST: the host found every cache of the launch on the register-gather path
    // (fast_decode_path: bf16 storage and queries, NeoX or GPT-J over every pair, format 3,
    // anchors), so those flags are constants and the kernel holds that path's code alone;
    // otherwise the kernel holds every other path and not that one. (One kernel with both spilled at 128
    // registers, and moved with any change to either.)
    fast = FAST;
    if (FAST) {
      bf16 = true;
      fused = true;
      format3 = true;
      precise = false;
      pairs = D / 2;
    }
#ifdef AKV_SASS_PIN_BF16_FUSED
    // scripts/sass_count.py (decode_split_kernel<D, MAXROWS, true>): the rest of the default
    // caches' path (a full row chunk, segment tables) as constants, so that the count holds
    // only the code that runs.
    rows = MAXROWS;
    tables = true;  // the predicted geometries' (k > 256)
#endif
    q_s = reinterpret_cast<float *>(smem + lay.q);
    qr_s = reinterpret_cast<float *>(smem + lay.qr);
    w_s = reinterpret_cast<float *>(smem + lay.w);
    L_s = reinterpret_cast<float *>(smem + lay.logits);
    Lp_s = reinterpret_cast<float *>(smem + lay.logits_part);
    red_s = reinterpret_cast<float *>(smem + lay.red);
    mref_s = reinterpret_cast<float *>(smem + lay.row_max);
    inv_s = reinterpret_cast<float *>(smem + lay.inv);
    first_s = reinterpret_cast<int32_t *>(smem + lay.first);
    second_s = reinterpret_cast<int32_t *>(smem + lay.second);
    basec_s = reinterpret_cast<float *>(smem + lay.basec);
    bases_s = reinterpret_cast<float *>(smem + lay.bases);
    step_s = reinterpret_cast<float2 *>(smem + lay.step);
    a_s = reinterpret_cast<int32_t *>(smem + lay.meta_a);
    off_s = reinterpret_cast<int32_t *>(smem + lay.meta_off);
    bit_s = reinterpret_cast<int32_t *>(smem + lay.meta_bit);
    sgn_s = reinterpret_cast<float *>(smem + lay.signs);
    g_s = reinterpret_cast<float *>(smem + lay.meta_g);
    va_s = reinterpret_cast<int32_t *>(smem + lay.meta_va);
    vg_s = reinterpret_cast<float *>(smem + lay.meta_vg);
    pos_s = reinterpret_cast<int64_t *>(smem + lay.meta_pos);
    K_s = reinterpret_cast<float *>(smem + lay.keys);
    kind_s = reinterpret_cast<int32_t *>(smem + lay.meta_kind);
    pen_s = reinterpret_cast<float *>(smem + lay.penalty);
    seg_s = reinterpret_cast<int32_t *>(smem + lay.segment);
    tab_s = reinterpret_cast<uint16_t *>(smem + lay.segment_table);
    kgam_s = reinterpret_cast<float *>(smem + lay.segment_gammas);
    vgam_s = kgam_s + kSegmentEntries;
    units_s = vgam_s + kSegmentEntries;
    cs_s = reinterpret_cast<uint4 *>(smem + lay.keys);  // the key tile is free on the fast path
    qb_s = reinterpret_cast<uint16_t *>(smem + lay.qb);
    rl_s = reinterpret_cast<float *>(smem + lay.res_logits);
    res_s = reinterpret_cast<uint32_t *>(smem + lay.residuals);
    tw_s = reinterpret_cast<uint64_t *>(smem + lay.tile_words);
    ent_s = reinterpret_cast<uint32_t *>(smem + lay.entries);
    vc_s = reinterpret_cast<uint32_t *>(smem + lay.value_codes);
    vpos_s = reinterpret_cast<int32_t *>(smem + lay.value_positions);
    vlev_s = reinterpret_cast<float *>(smem + lay.value_levels);
    kc_s = reinterpret_cast<uint32_t *>(smem + lay.key_codes);
    ks_s = reinterpret_cast<float *>(smem + lay.key_scales);
    ha_s = reinterpret_cast<HeadArrays *>(smem + lay.head_arrays);
    tstep_s = reinterpret_cast<float2 *>(smem + lay.carry_step);
    next_s = reinterpret_cast<int64_t *>(smem + lay.carry_next);
    left_s = reinterpret_cast<int32_t *>(smem + lay.carry_left);
    if (k <= p.smem_anchors) {
      w = w_s;
      wstride = k;
      segw = false;
    } else {
      w = p.ws_w + blk * MAXROWS * p.max_anchors;
      wstride = p.max_anchors;
      segw = tables && p.smem_anchors >= kSegmentEntries;
    }
#ifdef AKV_SASS_PIN_BF16_FUSED  // and where the weights are summed: shared memory, or by segment
#ifdef AKV_SASS_PIN_SEGMENT_WEIGHTS
    w = p.ws_w + blk * MAXROWS * p.max_anchors;
    wstride = p.max_anchors;
    segw = true;
#else
    w = w_s;
    wstride = k;
    segw = false;
#endif
#endif

    // The set-up's loads in two batches, each issued whole before its stores: ptxas issues a
    // load just before the store that waits on it, so the loops that copied the queries and the
    // view's tables an element at a time took a trip to L2 each, one after another (about
    // 7,500 cycles to the first barrier: scripts/sass_count.py's prologue_walk). First the
    // RoPE step table (32 floats a thread: with the second batch's loads in flight beside it,
    // the shipped kernels spilled), then the rest, at most one element of each table a thread.
    // (ptxas's allocation at 128 registers moves with small changes here: check the shipped
    // kernels' spills in sass_count.py's last table after any.)
    static_assert(D <= NT && kSegmentEntries <= NT && T + D / 2 <= NT && MAXROWS * D % NT == 0,
                  "an element of each table a thread");
    // e^{i d omega_j} for the offsets d < T inside a tile: the host's table (in double). On the
    // fast path (pairs == D / 2) cs_s's entry (u, j4) holds pairs 4 j4 .. 4 j4 + 3 of offset u,
    // and step_s the same four pairs' (cos, sin): a thread's entries in 16-byte loads (the
    // view's tables are 16-byte aligned).
    const float2 *step = reinterpret_cast<const float2 *>(v.rope_step);
    if (fast) {
      constexpr int E = T * (D / 8) / NT;  // entries a thread
      static_assert(E >= 1 && T * (D / 8) % NT == 0, "whole entries a thread");
      float4 sv[E][2];
      for (int x = 0; x < E; ++x) {
        const int e = tid + x * NT, u = e / (D / 8), j4 = e % (D / 8);
        const float4 *st = reinterpret_cast<const float4 *>(step + u * pairs + 4 * j4);
        sv[x][0] = load_ro(st);
        sv[x][1] = load_ro(st + 1);
      }
      for (int x = 0; x < E; ++x) {
        const int e = tid + x * NT, u = e / (D / 8), j4 = e % (D / 8);
        float4 *ss = reinterpret_cast<float4 *>(step_s + u * pairs + 4 * j4);
        ss[0] = sv[x][0];
        ss[1] = sv[x][1];
        cs_s[u * kTrigStride + j4] = uint4{pack_bf16x2(sv[x][0].x, sv[x][0].z), pack_bf16x2(sv[x][1].x, sv[x][1].z),
                                           pack_bf16x2(sv[x][0].y, sv[x][0].w), pack_bf16x2(sv[x][1].y, sv[x][1].w)};
      }
    } else {
      for (int e = tid; e < T * pairs; e += NT) step_s[e] = step[e];
    }
    constexpr int QPT = MAXROWS * D / NT;  // query elements a thread
    const int G = p.q_heads / p.heads;
    const int64_t qbase = ((static_cast<int64_t>(blockIdx.z) * p.q_heads + static_cast<int64_t>(h) * G) * p.q_len + row0) * D;
    const int qdtype = FAST ? AKV_DTYPE_BF16 : p.dtype;
    float qv[QPT];
    for (int x = 0; x < QPT; ++x) {
      const int e = tid + x * NT;
      qv[x] = e / D < rows ? load_elem(p.queries, qdtype, qbase + e) : 0.0f;
    }
    const float qscale = v.softmax_scale * kLog2e;  // exp2(logit) is the softmax weight
    const bool pair_thread = tid < pairs, angle_thread = tid >= T && tid - T < pairs;
    const float sign = k && tid < D ? v.signs[tid] : 0.0f;
    const float unit = format3 && tid < kSegmentEntries ? v.gamma_units[tid] : 0.0f;
    const float inv = pair_thread ? v.inv_freq[tid] : 0.0f, angle_inv = angle_thread ? v.inv_freq[tid - T] : 0.0f;
    const int32_t rope_first = pair_thread ? v.rope_first[tid] : 0, rope_second = pair_thread ? v.rope_second[tid] : 0;
    // The logit penalty's beta without and with a key residual (lanes 0 and 1; docs/design.md §4.5).
    const float beta = lane < 2 && v.logit_penalty && format3 && k ? v.logit_penalty[2 * h + lane] : 0.0f;
    // The block's first prefix tile (format 3; a barrier follows before any warp reads it):
    // its residual slots with counts 0, to which each tile adds its own (tiles run
    // consecutively: the key side format3_meta or stage_keys, the value side stage_values),
    // and its words and entries (stage_next; the next tiles' a tile ahead), on warps that build
    // the head's array pointers themselves rather than wait for thread 0's in ha_s.
    const int tiles = (v.prefix + T - 1) / T, u0 = split_unit(v.prefix, v.window, blockIdx.x, p.splits);
    const int first_tile = u0 < tiles ? u0 : tiles;
    const bool stage = v.kind == kKindAnchor && format3 && first_tile < v.words;
    const bool stager = warp == kEntryWarp || warp == kWordsWarp;
    if (tid == 0 || (stage && stager)) {
      const HeadArrays ha = head_arrays(v);
      if (tid == 0) {
        *ha_s = ha;
        ha_s->scores = head_scores(v);
        seg_s[0] = -1;
      }
      if (stage && stager) {
        stage_next(first_tile * T, ha);
        if (warp == kWordsWarp && lane == 0) {  // off thread 0's path
          const int64_t wd = static_cast<int64_t>(h) * v.words + first_tile;
          *reinterpret_cast<uint4 *>(res_s) =
              uint4{v.key_offsets[h] + v.key_prefix[wd], 0u, v.value_offsets[h] + v.value_prefix[wd], 0u};
        }
      }
    }

    if (angle_thread) {  // the tile step of the first angles (anchor_meta)
      const int j = tid - T;
      float tc, ts;
      rope_angle(T, angle_inv, &tc, &ts);
      tstep_s[j] = float2{tc, ts};
      next_s[j] = -1;
      left_s[j] = 0;
    }
    // Queries of this row chunk, scaled so that exp2(logit) is the softmax weight.
    for (int x = 0; x < QPT; ++x) q_s[tid + x * NT] = qr_s[tid + x * NT] = qv[x] * qscale;
    for (int e = rows * QS + tid; e < MAXROWS * QS; e += NT) qb_s[e] = 0;  // rows rotate_queries leaves
    // The weights' rows (their padding to wstride too: the block's own), 16 bytes a store (w_s
    // and ws_w's rows are 16-byte aligned, MAXROWS a multiple of 4).
    for (int e = tid; e < MAXROWS * static_cast<int>(wstride) / 4; e += NT) reinterpret_cast<float4 *>(w)[e] = float4{0.0f, 0.0f, 0.0f, 0.0f};
    if (segw)
      for (int e = tid; e < MAXROWS * kSegmentEntries; e += NT) w_s[e] = 0.0f;
    // Hadamard signs over sqrt(D): the signs are +-1, so the product with the reciprocal (a
    // constant) is the quotient.
    if (k && tid < D) sgn_s[tid] = sign * (1.0f / sqrtf(static_cast<float>(D)));
    if (format3 && tid < kSegmentEntries) units_s[tid] = unit;
    if (pair_thread) {
      inv_s[tid] = inv;
      first_s[tid] = rope_first;
      second_s[tid] = rope_second;
    }
    for (int r = 0; r < RPW; ++r) {
      m_run[r] = -INFINITY;
      l_part[r] = 0.0f;
      if (const int i = warp + r * NW; i < MAXROWS && lane == 0) mref_s[i] = -INFINITY;
    }
    for (int x = 0; x < PASSES; ++x) lacc[x] = 0.0f;
    for (int i = 0; i < MAXROWS; ++i)
      for (int e = 0; e < DPT; ++e) racc[i][e] = 0.0f;
    __syncthreads();
    // Logit penalties (docs/design.md §4.5) in the base-2 logits: beta |q scale|^2 log2(e)
    // = beta |q_s|^2 / log2(e), per row, without and with a key residual; zero without. Kept
    // negated, with a third kind (an exact token) of zeros: the logit adds pen_s[kind][row].
    for (int i = warp; i < MAXROWS; i += NW) {
      float q2 = 0.0f;
      for (int d = lane; d < D; d += 32) q2 += q_s[i * D + d] * q_s[i * D + d];
      q2 = warp_sum(q2);
      if (lane < 3) pen_s[lane * MAXROWS + i] = -beta * q2 / kLog2e;
    }
    __syncthreads();
  }

  // The head's array pointers (ha_s; format 2's format-3 arrays null).
  __device__ __forceinline__ HeadArrays head_arrays(const CacheView &v) const {
    const int64_t hw = static_cast<int64_t>(h) * v.words, hp = static_cast<int64_t>(h) * v.prefix;
    const bool f3 = format3;
    return HeadArrays{v.anchor_keys + static_cast<int64_t>(h) * k * D,
                      f3 ? v.anchor_mask + hw : nullptr, f3 ? v.key_mask + hw : nullptr,
                      f3 ? v.value_mask + hw : nullptr, f3 ? v.anchor_first + hw : nullptr,
                      f3 ? v.key_entry + hp : nullptr, f3 ? v.value_entry + hp : nullptr,
                      f3 ? v.key_code + hp : nullptr, f3 ? v.value_code + hp : nullptr,
                      v.key_codes, v.value_codes, v.value_chunk, v.key_scales, v.value_scales,
                      static_cast<int32_t>(v.prefix), v.segment_shift,
                      v.key_slots, v.value_slots, nullptr};  // scores: thread 0's (head_scores)
  }
  // The register-gather path over a cache without RoPE: this (request, head, row chunk)'s rows
  // of DecodeLaunch::scores (lookup_scores); null on every other path.
  __device__ __forceinline__ const float *head_scores(const CacheView &v) const {
#ifdef AKV_SASS_PIN_BF16_FUSED  // the count's caches have RoPE
    (void)v;
    return nullptr;
#else
    if (!FAST || v.rope_pairs != 0 || p.scores == nullptr) return nullptr;
    const int64_t x = (static_cast<int64_t>(blockIdx.z) * p.heads + h) * p.row_chunks + row0 / MAXROWS;
    return p.scores + x * p.max_anchors * MAXROWS;
#endif
  }

  // ---- 1. tile metadata: anchor, gamma and position of each token; the first angles ------

  // Storage format 3's prefix tokens t0..end on warps 0-1, thread u token u (warp 0 alone, two
  // tokens a lane, took twice the issue slots on the tile's longest serial path). A tile lies
  // in one segment: when it starts a new one, warp 0 copies the segment's table and its key
  // coefficients by code, warp 1 its value coefficients (bf16(scale * unit): the host's
  // gamma_value, core/layout.hpp) into shared memory, and the two meet at a barrier of their
  // own (kMetaBarrier) before any lookup, so that each token's lookups are shared-memory loads
  // with 32-bit indices. Branch-free: a token's entries are loaded for every thread (past the
  // tile's end the tile's first token's) and the results selected.
  static constexpr int kMetaBarrier = 1;  // bar.sync 1, 64: warps 0-1
  __device__ __forceinline__ void format3_meta(int t0, int end) {  // 32-bit: P < 2^31
    const int u = tid, n = end - t0;
    const int si = t0 >> ha_s->segment_shift;
    if (seg_s[0] != si) {  // uniform across warps 0-1: seg_s[0] is written after the barrier below
      const int64_t seg = static_cast<int64_t>(h) * c.segments + si;
      const float scale = load_ro(c.gamma_scales + 2 * seg + warp);  // warp 0 the keys', warp 1 the values'
      // The table in one 16-byte load a lane (tables are 512 bytes, sections 16-byte aligned).
      static_assert(kSegmentEntries * sizeof(uint16_t) == 32 * sizeof(uint4), "a table is a uint4 a lane");
      if (tables && warp == 0) {
        const uint4 entries = load_ro(reinterpret_cast<const uint4 *>(c.segment_tables + seg * c.table_size) + lane);
        reinterpret_cast<uint4 *>(tab_s)[lane] = entries;
        prefetch_table(entries, si, seg);
      }
      float *gam = warp == 0 ? kgam_s : vgam_s;
      AKV_UNROLL  // a constant trip count, unrolled: the units' loads side by side
      for (int r = 0; r < kSegmentEntries / 32; ++r) {
        const int e = lane + 32 * r;
        gam[e] = bits_to_float(float_to_bits(scale * units_s[e], true), true);
      }
      named_barrier<kMetaBarrier, 2 * 32>();
      if (tid == 0) seg_s[0] = si;  // both warps have read it
    }
    // The token's entries and codes (stage_entries's, a tile ahead: no trip to L2 here).
    const bool live = u < n;
    const uint32_t packed = ent_s[((t0 >> 6) & 1) * T + u];
    const uint32_t ke = packed & 0xffu, ve = packed >> 8 & 0xffu, kc = packed >> 16 & 0xffu, vc = packed >> 24;
    const uint64_t *words = tile_words(t0);  // stage_entries's, a tile ahead
    const uint64_t anchors = words[0], kmask = words[1], vmask = words[2];
    const int first = static_cast<int>(words[3]);
    // The tile's key residual slots: the last tile's first slot plus its count (the fast
    // path's: stage_keys, on warp NW - 2; the value side's: stage_values, on warp NW - 1).
    if (!fast && tid == 0) {
      const uint2 r = *reinterpret_cast<const uint2 *>(res_s);
      *reinterpret_cast<uint2 *>(res_s) = uint2{r.x + r.y, static_cast<uint32_t>(__popcll(kmask))};
    }
    const bool anchor = (anchors >> u) & 1u, residual = (kmask >> u) & 1u;
    // An anchor token is its own anchor (exact): its index, and the key residual's slot.
    const uint64_t below = (1ull << u) - 1;
    const int self = first + __popcll(anchors & below);
    const int ka = tables ? tab_s[ke] : static_cast<int>(ke);
    const int vaa = tables && !segw ? tab_s[ve] : static_cast<int>(ve);
    const int kind = !live || anchor ? 2 : static_cast<int>(residual);
    a_s[u] = !live ? -1 : anchor ? self : ka;
    va_s[u] = !live ? -1 : anchor ? self + (segw ? kSegmentEntries : 0) : vaa;
    g_s[u] = !live ? 0.0f : anchor ? 1.0f : kgam_s[kc];
    vg_s[u] = !live ? 0.0f : anchor ? 1.0f : vgam_s[vc];
    off_s[u] = live ? u : 0;  // pos_s is not written: format 3's positions are consecutive
    kind_s[u] = kind;
    if (live && residual) bit_s[__popcll(kmask & below)] = u;  // the key residuals in slot order
    // The value residuals' positions in the tile, likewise from the mask (stage_values reads the
    // stored ones for format 2 only: no trip to L2 for them).
    if (live && ((vmask >> u) & 1u)) vpos_s[__popcll(vmask & below)] = u;
    if (kFoldedPenalty && fast)
      for (int i = 0; i < MAXROWS; i += 4) {  // the kind's row penalties four at a time
        const float4 pen = *reinterpret_cast<const float4 *>(pen_s + kind * MAXROWS + i);
        rl_s[i * T + u] = pen.x;
        rl_s[(i + 1) * T + u] = pen.y;
        rl_s[(i + 2) * T + u] = pen.z;
        rl_s[(i + 3) * T + u] = pen.w;
      }
  }

  // Format 3: the tile's anchor, key residual and value residual mask words and the anchor index
  // of its first anchor (as a word), from shared memory (tile parity: stage_entries writes the
  // next tile's beside them).
  __device__ __forceinline__ const uint64_t *tile_words(int t0) const { return tw_s + 4 * ((t0 >> 6) & 1); }

  // The warps that read a tile's entries and its words a tile ahead, while warps 0-1 read the
  // metadata and warps 2-3 the first angles: the two warps after those (4 and 5 at D 128; at
  // D 256 the angles take warps 2-5: then both on the value staging's warp, after the values).
  static constexpr int kAfterAngles = (T + D / 2 + 31) / 32;
  static constexpr int kEntryWarp = kAfterAngles < NW - 2 ? kAfterAngles : NW - 1;
  static constexpr int kWordsWarp = kAfterAngles + 1 < NW - 2 ? kAfterAngles + 1 : kEntryWarp;
  // Format 3, the tile at tn (a prefix tile), by tile parity, each warp's loads independent of
  // one another (one trip to L2) and without a branch (ptxas sinks loads into one): its mask
  // words and first anchor (tile_words; lanes 4i + j word j, 3 the first anchor: the same
  // stores), and each token's key and value entries and codes, packed into a word (ent_s). Past
  // the prefix a token reads the tile's first token's, and a tile past it (the last tile's
  // next) the tile before's, into its parity's slots: not read.
  __device__ __forceinline__ void stage_tile_words(int tn, const HeadArrays &ha) {
    const int P = ha.prefix, par = (tn >> 6) & 1;
    const int wd = (tn < P ? tn : tn - T) >> 6, x4 = lane & 3;
    const uint64_t word = load_ro((x4 == 0 ? ha.anchor_mask : x4 == 1 ? ha.key_mask : ha.value_mask) + wd);
    const uint32_t first = static_cast<uint32_t>(load_ro(ha.anchor_first + wd));
    prefetch_tiles(tn, ha);  // while the loads above are in flight
    // Whether the tile before (this one, tn - T) is its segment's last, for the flush after
    // its values: by tile parity, so that a warp may write the next tile's while another
    // still reads this one's (no barrier between when the tile does not flush). From
    // the set-up it is the block's first tile less one's, a slot rewritten before it is read.
    if (segw && lane == 0) {
      const int shift = ha.segment_shift;
      seg_s[1 + ((tn / T - 1) & 1)] = tn >> shift != (tn - T) >> shift;
    }
    tw_s[4 * par + x4] = x4 == 3 ? first : word;
  }
  __device__ __forceinline__ void stage_entries(int tn, const HeadArrays &ha) {
    const int P = ha.prefix, par = (tn >> 6) & 1;
    const int tc = tn < P ? tn : tn - T;
    uint32_t packed[T / 32];
    AKV_UNROLL
    for (int x = 0; x < T / 32; ++x) {
      const int t = tc + lane + 32 * x, at = t < P ? t : tc;
      packed[x] = static_cast<uint32_t>(load_ro(ha.key_entry + at)) | static_cast<uint32_t>(load_ro(ha.value_entry + at)) << 8 |
                  static_cast<uint32_t>(load_ro(ha.key_code + at)) << 16 | static_cast<uint32_t>(load_ro(ha.value_code + at)) << 24;
    }
    AKV_UNROLL
    for (int x = 0; x < T / 32; ++x) ent_s[par * T + lane + 32 * x] = packed[x];
  }
  __device__ __forceinline__ void stage_next(int tn, const HeadArrays &ha) {  // both, on a warp that takes both
    if (warp == kEntryWarp) stage_entries(tn, ha);
    if (warp == kWordsWarp) stage_tile_words(tn, ha);
  }

  // ---- L2 prefetches of the streamed data (format 3 prefix tiles) ----------------------
  //
  // A decode reads each byte of a tile's metadata, codes and scales once, from memory (a
  // layer's cache is not in L2 when its decode starts), and the staging warps above wait for
  // those loads before the tile's first barrier: on the first device run (H100) a tile took
  // about 3x what the SASS walk gave with L2 latencies for them. So the staging warps ask for
  // them ahead (prefetch.global.L2, which nothing waits on): the per-token bytes and mask words
  // of the kPrefetchTiles tiles after the one they stage, each side's codes and scales of the
  // kPrefetchSlots slots after the tile's (the slots' stream is consecutive across tiles), and
  // a segment table's anchor rows when the table is read. Each tile asks again for what the
  // tiles before asked (an L2 hit), so that the block's first tiles need no set-up of their own.
  static constexpr int kPrefetchTiles = 3, kPrefetchSlots = 32;

  // Tiles tn + T .. tn + kPrefetchTiles T: lane 4 j + x the first byte of per-token array x
  // of tile j + 1 (a tile's 64 bytes end in its line or in the next tile's first), lanes
  // 12-15 the last tile's mask words and first anchor (a line holds 16 tiles' words); nothing
  // past the prefix.
  __device__ __forceinline__ void prefetch_tiles(int tn, const HeadArrays &ha) {
    static_assert(kPrefetchTiles == 3, "12 lanes of bytes, 4 of words");
    const int x = lane & 3, P = ha.prefix;
    const int tp = tn + T * (lane < 12 ? 1 + (lane >> 2) : kPrefetchTiles);
    const void *at;
    if (lane < 12) {
      at = (x == 0 ? ha.key_entry : x == 1 ? ha.value_entry : x == 2 ? ha.key_code : ha.value_code) + tp;
    } else {
      const int wd = tp >> 6;
      at = x == 3 ? static_cast<const void *>(ha.anchor_first + wd)
                  : static_cast<const void *>((x == 0 ? ha.anchor_mask : x == 1 ? ha.key_mask : ha.value_mask) + wd);
    }
    if (tp < P && lane < 16) prefetch_l2(at);
  }

  // A side's residual slots [s0, s0 + n), clamped to its `slots`: the codes' 128-byte lines
  // on lanes 0-23 (D / 4 bytes a slot), the scales' on lanes 24-31.
  __device__ __forceinline__ void prefetch_slots(const uint8_t *codes, const float *scales, uint32_t s0, int n,
                                                 uint32_t slots) const {
    const uint32_t a = s0 < slots ? s0 : slots, b = s0 + n < slots ? s0 + n : slots;
    if (a >= b) return;
    constexpr uintptr_t kLine = 128;
    const bool code_lane = lane < 24;
    const uintptr_t first = code_lane ? reinterpret_cast<uintptr_t>(codes + static_cast<uint64_t>(a) * (D / 4))
                                      : reinterpret_cast<uintptr_t>(scales + a);
    const uintptr_t last = code_lane ? reinterpret_cast<uintptr_t>(codes + static_cast<uint64_t>(b) * (D / 4) - 1)
                                     : reinterpret_cast<uintptr_t>(scales + b) - 1;
    const uintptr_t line = (first & ~(kLine - 1)) + kLine * static_cast<uintptr_t>(code_lane ? lane : lane - 24);
    if (line <= last) prefetch_l2(reinterpret_cast<const void *>(line));
  }

  // Warp 0, as it reads segment si's table (lane: entries 8 lane ..): those anchors' key rows,
  // which the tile's gathers read; lanes 0-3, the next segment's table.
  __device__ __forceinline__ void prefetch_table(const uint4 &entries, int si, int64_t seg) const {
    const uint16_t *ak = ha_s->anchor_keys;
    const uint32_t words[4] = {entries.x, entries.y, entries.z, entries.w};
    AKV_UNROLL
    for (int e = 0; e < 8; ++e) {
      const uint16_t *row = ak + static_cast<int64_t>(static_cast<uint16_t>(words[e / 2] >> (16 * (e % 2)))) * D;
      AKV_UNROLL
      for (int l = 0; l < D * 2 / 128; ++l) prefetch_l2(row + l * 64);
    }
    if (lane < 4 && si + 1 < c.segments) prefetch_l2(c.segment_tables + (seg + 1) * c.table_size + 64 * lane);
  }

  // Residuals a trip of the staging loops (stage_keys, stage_values): a lane four code words
  // (128 a trip, D / 16 a residual) and one residual's scale (and position): 32 / 16 / 8 at D 64
  // / 128 / 256. A tile's residuals cluster (a tenth of the tiles hold 9 or more on a side on
  // SmolLM2's prompts at 20x: scripts/sass_count.py, COUNT_DISPERSION), so a trip of 8 at D 128
  // left those tiles two waits on L2.
  static constexpr int kStageResiduals = 128 / (D / 16) < 32 ? 128 / (D / 16) : 32;

  // One trip of the staging loops from residual r0 (of the tile's count >= 1): the lane's four
  // code words into codes_s and its residual's scale, both loaded unconditionally with their
  // indices clamped into the tile's and the codes stored before the caller's stores (loads
  // under a condition, or codes stored after the others, were issued after the other stores:
  // two waits on L2). The lane's residual r0 + lane (n; nc clamped) is its own where `mine`.
  struct StageTrip {
    int n, nc;
    bool mine;
    float scale;
  };
  __device__ __forceinline__ StageTrip stage_trip(int r0, int count, const uint32_t *words, const float *scales,
                                                  uint32_t *codes_s) const {
    constexpr int W = D / 16;  // code words a residual
    const int n = r0 + lane, w4 = r0 * W + 4 * lane;
    const int nc = n < count ? n : count - 1, wc = w4 < count * W ? w4 : count * W - 4;
    const float sc = load_ro(scales + nc);
    const uint4 cw = load_ro(reinterpret_cast<const uint4 *>(words) + wc / 4);
    if (w4 < count * W) reinterpret_cast<uint4 *>(codes_s)[w4 / 4] = cw;
    return StageTrip{n, nc, lane < kStageResiduals && n < count, sc};
  }

  // Warp NW - 2 on the fast path, while warps 0-1 read the tile's metadata (anchor_meta): the
  // tile's key residual slots (res_s[0], res_s[1]), and the residuals' codes (kc_s) and scales
  // (ks_s), so that key_residuals_tc waits on no load.
  __device__ __forceinline__ void stage_keys(int64_t t0) {
    const uint2 r = *reinterpret_cast<const uint2 *>(res_s);  // every lane
    const uint32_t base = r.x + r.y;
    const int count = __popcll(tile_words(static_cast<int>(t0))[1]);
    __syncwarp();  // every lane has read it
    if (lane == 0) *reinterpret_cast<uint2 *>(res_s) = uint2{base, static_cast<uint32_t>(count)};
    prefetch_slots(ha_s->key_codes, ha_s->key_scales, base + count, kPrefetchSlots, ha_s->key_slots);
    const uint32_t *words = reinterpret_cast<const uint32_t *>(ha_s->key_codes) + static_cast<int64_t>(base) * (D / 16);
    const float *scales = ha_s->key_scales + base;  // both read before any store (stage_values)
    AKV_NO_UNROLL
    for (int k0 = 0; k0 < count; k0 += kStageResiduals) {  // a trip: the key residuals k0..
      const StageTrip st = stage_trip(k0, count, words, scales, kc_s);
      if (st.mine) ks_s[st.n] = st.scale;
    }
  }

  // Warp NW - 1, while warps 0-1 read the tile's metadata (anchor_meta): the tile's value
  // residual slots (res_s[2], res_s[3]) and, with nothing that waits on the softmax, each
  // residual's position in the tile (vpos_s), its four scaled levels (vlev_s) and its codes
  // (vc_s), so that prefix_values reads only shared memory.
  __device__ __forceinline__ void stage_values(int64_t t0) {
    uint32_t base;
    int count;
    if (format3) {  // the last tile's first slot plus its count
      const uint2 r = *reinterpret_cast<const uint2 *>(res_s + 2);  // every lane
      base = r.x + r.y;
      count = __popcll(tile_words(static_cast<int>(t0))[2]);
      __syncwarp();  // every lane has read the slots
      if (lane == 0) *reinterpret_cast<uint2 *>(res_s + 2) = uint2{base, static_cast<uint32_t>(count)};
      prefetch_slots(ha_s->value_codes, ha_s->value_scales, base + count, kPrefetchSlots, ha_s->value_slots);
    } else {  // format 2: from the tile's prefix counts (and the key side's too)
      const int64_t wd = static_cast<int64_t>(h) * c.words + t0 / 64;
      base = c.value_offsets[h] + c.value_prefix[wd];
      count = __popcll(c.value_mask[wd]);
      if (lane == 0)
        *reinterpret_cast<uint4 *>(res_s) = uint4{c.key_offsets[h] + static_cast<uint32_t>(c.key_prefix[wd]),
                                                   static_cast<uint32_t>(__popcll(c.key_mask[wd])), base,
                                                   static_cast<uint32_t>(count)};
    }
    // The codes as whole words (a residual's D / 4 bytes are consecutive and 4-byte aligned),
    // so that every thread reads its byte from shared memory with a 32-bit index.
    // The arrays read into registers before any store (a store to shared memory would keep
    // ptxas from reading them, hence issuing the next load, ahead of it).
    const uint32_t *words = reinterpret_cast<const uint32_t *>(ha_s->value_codes) + static_cast<int64_t>(base) * (D / 16);
    const uint8_t *chunk = ha_s->value_chunk + base;
    const float *scales = ha_s->value_scales + base;
    AKV_NO_UNROLL
    for (int r0 = 0; r0 < count; r0 += kStageResiduals) {  // a trip: the value residuals r0..
      const StageTrip st = stage_trip(r0, count, words, scales, vc_s);
      if (st.mine) {
        if (!format3) vpos_s[st.n] = load_ro(chunk + st.nc);  // the position inside the word (= tile); format 3: format3_meta's
        for (int l = 0; l < 4; ++l) vlev_s[4 * st.n + l] = st.scale * lloyd_max_level(l);
      }
    }
  }

  // Prefix tokens t0..end (window: window tokens t0..end, exact anchors k-W+w, gamma 1): the
  // key and value anchor and coefficient of each token, its position and offset in the tile.
  // Returns true in the threads of tokens whose offset is outside [0, T) (the kernel ORs it
  // over the block into `gapped`).
  __device__ __forceinline__ bool anchor_meta(int64_t t0, int64_t end, bool window) {
    bool gap = false;
    if (tid < T && format3 && !window) {
      format3_meta(static_cast<int>(t0), static_cast<int>(end));
    } else if (tid < T) {
      const int64_t t = t0 + tid;
      int a = -1, va = -1, off = 0;  // off: position - the tile's first; -1 outside [0, T); 0 for no token (zero row)
      int kind = 2;                  // logit penalty: 0 reconstructed, 1 with a key residual, 2 none (exact)
      float g = 0.0f, vg = 0.0f;
      int64_t pos = 0;
      if (tid < static_cast<int>(end - t0)) {
        if (window) {
          a = k - c.window + static_cast<int>(t);
          g = 1.0f;
          pos = c.window_first_position + t;
          off = tid;
        } else {
          const int64_t at = static_cast<int64_t>(h) * c.prefix + t;
          const int64_t wd = static_cast<int64_t>(h) * c.words + t0 / 64;
          // Storage format 2 (format 3's prefix tiles are format3_meta's).
            a = c.key_index[at];
            g = bits_to_float(c.key_gamma[at], true);
            va = c.value_index[at];
            vg = bits_to_float(c.value_gamma[at], true);
            pos = c.positions[t];
            const int64_t d = pos - c.positions[t0];
            off = d >= 0 && d < T ? static_cast<int>(d) : -1;
          // The key residuals of the tile (mask word t0 / 64) listed in slot order.
          const uint64_t mask = c.key_mask[wd];
          if ((mask >> tid) & 1) bit_s[__popcll(mask & ((1ull << tid) - 1))] = tid;
        }
      }
      a_s[tid] = a;
      va_s[tid] = va;
      if (kFoldedPenalty && fast)  // a window token: exact, no penalty (format 2 never takes the fast path)
        for (int i = 0; i < MAXROWS; ++i) rl_s[i * T + tid] = 0.0f;
      off_s[tid] = off;
      gap = off < 0;
      kind_s[tid] = kind;
      g_s[tid] = g;
      vg_s[tid] = vg;
      pos_s[tid] = pos;
    } else if (tid - T < pairs) {
      const int j = tid - T;
      const int64_t p0 = window ? c.window_first_position + t0
                                : format3 ? c.first_position + t0 : static_cast<int64_t>(c.positions[t0]);
      const int left = left_s[j];
      float run_c, run_s;
      if (p0 == next_s[j] && left > 0) {  // the previous tile's first angle times e^{i T omega_j}
        const float pc = basec_s[j], ps = bases_s[j];
        const float2 ts = tstep_s[j];
        run_c = pc * ts.x - ps * ts.y;
        run_s = ps * ts.x + pc * ts.y;
        left_s[j] = left - 1;
      } else {  // exact: the first tile, after a gap, or every kExactTiles
        rope_angle(p0, inv_s[j], &run_c, &run_s);
        left_s[j] = kExactTiles - 1;
      }
      next_s[j] = p0 + T;
      basec_s[j] = run_c;
      bases_s[j] = run_s;
      if (fast) rotate_query_pair(j, run_c, run_s);  // no pass after the barrier
    } else if (warp == NW - 2 && !window && fast) {  // off warp 0's path
      stage_keys(t0);
    } else if (warp == NW - 1 && !window) {  // off warps 0-1's path (format3_meta)
      stage_values(t0);
      if (kEntryWarp == NW - 1 && format3) stage_next(static_cast<int>(t0) + T, *ha_s);
    } else if ((warp == kEntryWarp || warp == kWordsWarp) && !window && format3) {
      stage_next(static_cast<int>(t0) + T, *ha_s);
    }
    return gap;
  }

  // ---- 2. unrotated key rows gamma_t K_a(t) (anchor rows through L2), or dense rows -------

  template <bool BF>
  __device__ __forceinline__ static void put8(float *dst, const uint4 &chunk, float g) {
    float x[8];
    unpack8(chunk, BF, x);
    for (int e = 0; e < 8; ++e) x[e] *= g;
    reinterpret_cast<float4 *>(dst)[0] = float4{x[0], x[1], x[2], x[3]};
    reinterpret_cast<float4 *>(dst)[1] = float4{x[4], x[5], x[6], x[7]};
  }

  // Dimensions d.. d + 7 of tokens tid / (D / 8), + NT / (D / 8), ...: gamma_t times their
  // anchor rows of `ak` (zeros without an anchor), every chunk loaded (read-only) before any is
  // stored: one trip to memory a tile (gather_dense_rows_as).
  template <bool BF>
  __device__ __forceinline__ void gather_chunks(const uint16_t *ak, int d) {
    constexpr int V8 = D / 8, STEP = NT / V8, N = T / STEP;
    static_assert(NT % V8 == 0 && T % STEP == 0, "whole tokens per pass");
    const int t1 = tid / V8;
    uint4 x[N];
    AKV_UNROLL
    for (int n = 0; n < N; ++n) {
      const int a = a_s[t1 + n * STEP];
      x[n] = a < 0 ? uint4{0, 0, 0, 0} : load_ro(reinterpret_cast<const uint4 *>(ak + a * D + d));
    }
    AKV_UNROLL
    for (int n = 0; n < N; ++n) {
      const int t = t1 + n * STEP, a = a_s[t];
      float *dst = K_s + t * KS + d;
      if (a < 0) put8<BF>(dst, uint4{0, 0, 0, 0}, 0.0f);
      else put8<BF>(dst, x[n], g_s[t]);
    }
  }
  // Thread: 16-byte chunk v = tid % V8 of its tokens (no division).
  template <bool BF>
  __device__ __forceinline__ void gather_anchor_rows_as() {
    gather_chunks<BF>(c.anchor_keys + static_cast<int64_t>(h) * k * D, (tid % (D / 8)) * 8);
  }
  // Fused NeoX gather: item (token t, pairs j0..j0+3) reads dimensions j0.. and j0 + pairs..
  // of the anchor row, scales by gamma and rotates by R_off; the dimensions past 2 * pairs are
  // copied in chunks of 8.
  template <bool BF>
  __device__ __forceinline__ void gather_rotate_neox() {
    // pairs / 4 rotary items and (D - 2 pairs) / 8 copied chunks: D / 8 = V8 items a token, so
    // thread tid takes item tid % V8 of tokens tid / V8, + STEP, ... (no division).
    constexpr int V8 = D / 8, STEP = NT / V8;
    // Each thread's rows are all loaded (read-only) before any is stored:
    // one trip to memory a tile (gather_dense_rows_as).
    constexpr int N = T / STEP;
    static_assert(NT % V8 == 0 && T % STEP == 0, "whole tokens per pass");
    const int q = tid % V8, P4 = pairs / 4, t1 = tid / V8;
    const uint16_t *ak = c.anchor_keys + static_cast<int64_t>(h) * k * D;
    if (q >= P4) {  // unrotated dimensions d.. d + 7
      gather_chunks<BF>(ak, 2 * pairs + 8 * (q - P4));
      return;
    }
    const int j0 = 4 * q;  // pairs j0 .. j0 + 3: dimensions j0.. and j0 + pairs..
    uint2 los[N], his[N];
    AKV_UNROLL
    for (int n = 0; n < N; ++n) {
      const int a = a_s[t1 + n * STEP];
      los[n] = a < 0 ? uint2{0, 0} : load_ro(reinterpret_cast<const uint2 *>(ak + a * D + j0));
      his[n] = a < 0 ? uint2{0, 0} : load_ro(reinterpret_cast<const uint2 *>(ak + a * D + j0 + pairs));
    }
    AKV_UNROLL
    for (int n = 0; n < N; ++n) {
      const int t = t1 + n * STEP, a = a_s[t];
      float *row = K_s + t * KS;
      if (a < 0) {
        *reinterpret_cast<float4 *>(row + j0) = float4{0.0f, 0.0f, 0.0f, 0.0f};
        *reinterpret_cast<float4 *>(row + j0 + pairs) = float4{0.0f, 0.0f, 0.0f, 0.0f};
        continue;
      }
      const float g = g_s[t];
      const uint2 lo = los[n], hi = his[n];
      const int off = off_s[t];  // >= 0: gapped tiles are not gathered here
      const float4 c01 = *reinterpret_cast<const float4 *>(step_s + off * pairs + j0);
      const float4 c23 = *reinterpret_cast<const float4 *>(step_s + off * pairs + j0 + 2);
      const float2 cs[4] = {float2{c01.x, c01.y}, float2{c01.z, c01.w}, float2{c23.x, c23.y}, float2{c23.z, c23.w}};
      const uint32_t lw[4] = {lo.x, lo.x >> 16, lo.y, lo.y >> 16}, hw[4] = {hi.x, hi.x >> 16, hi.y, hi.y >> 16};
      float y0[4], y1[4];
      for (int x = 0; x < 4; ++x) {
        const float x0 = g * bits_to_float(static_cast<uint16_t>(lw[x]), BF);
        const float x1 = g * bits_to_float(static_cast<uint16_t>(hw[x]), BF);
        y0[x] = x0 * cs[x].x - x1 * cs[x].y;
        y1[x] = x0 * cs[x].y + x1 * cs[x].x;
      }
      *reinterpret_cast<float4 *>(row + j0) = float4{y0[0], y0[1], y0[2], y0[3]};
      *reinterpret_cast<float4 *>(row + j0 + pairs) = float4{y1[0], y1[1], y1[2], y1[3]};
    }
  }

  __device__ __forceinline__ void gather_anchor_rows() {
    if (fused && !gapped) {
      if (bf16) gather_rotate_neox<true>();
      else gather_rotate_neox<false>();
    } else if (bf16) {
      gather_anchor_rows_as<true>();
    } else {
      gather_anchor_rows_as<false>();
    }
    rotate_queries();
  }

  // q . R_{p0 + off} x = (R_{p0}^T q) . (R_off x): the queries take the tile's first angle.
  // The fast path's, in bf16 only (its contraction and key-residual terms read them): NeoX
  // pair j, j + D / 2 by the thread that computed its angle (anchor_meta), beside the
  // metadata.
  // GPT-J (GPTJ: fast_decode_gptj, a kernel of its own so that the NeoX kernel's registers do
  // not pay for it): pair j's dims 2j, 2j + 1 at gptj_position(j) and + 2, as the key
  // residuals' rows, which contract_gathered's fragments take as they load the anchor rows.
  __device__ __forceinline__ void rotate_query_pair(int j, float cs, float sn) {
    constexpr int P = D / 2;
    const int f = GPTJ ? 2 * j : j, s = GPTJ ? 2 * j + 1 : P + j;
    const int pf = GPTJ ? gptj_position(j) : j, ps = GPTJ ? gptj_position(j) + 2 : P + j;
    for (int i = 0; i < MAXROWS; ++i) {
      if (i >= rows) break;  // rows past `rows` stay zero
      const float q0 = q_s[i * D + f], q1 = q_s[i * D + s];
      qb_s[i * QS + pf] = float_to_bits(q0 * cs + q1 * sn, true);
      qb_s[i * QS + ps] = float_to_bits(q1 * cs - q0 * sn, true);
    }
  }
  // GPT-J quad order: pairs j, j + 1 (j even) as a quad x, x', y, y' (dims 2j, 2j + 2, 2j + 1,
  // 2j + 3), a lane's k slots of an mma fragment, which the anchor row's four dims become after
  // two half-word permutes and one pair of bf16x2 products (rotate_gptj4). The quads of pairs
  // 4c, 4c + 1 fill the first half of a stored row (from 4c), those of pairs 4c + 2, 4c + 3 the
  // second (from D / 2 + 4c): a lane's two quads are then read as the NeoX path's slab and
  // partner slab are, with the same banks (no conflict). Pair j's first dim sits at
  // gptj_position(j), its second two on; the rotated queries and the key residuals' rows are
  // stored so.
  __device__ __forceinline__ static int gptj_position(int j) {
    return 4 * (j >> 2) + (j & 1) + ((j >> 1) & 1) * (D / 2);
  }
  // Elsewhere in fp32, one thread a pair, after the barrier that follows the angles.
  __device__ __forceinline__ void rotate_queries() {
    for (int j = tid; j < pairs; j += NT) {
      const float cs = basec_s[j], sn = bases_s[j];
      const int f = first_s[j], s = second_s[j];
      for (int i = 0; i < MAXROWS; ++i) {
        if (i >= rows) break;  // rows past `rows` stay zero
        const float q0 = q_s[i * D + f], q1 = q_s[i * D + s];
        const float r0 = q0 * cs + q1 * sn, r1 = q1 * cs - q0 * sn;
        qr_s[i * D + f] = r0;
        qr_s[i * D + s] = r1;
      }
    }
  }

  // The key and value rows [t0, end) of a dense tile into L2 (the next tile's, while this one is
  // computed): a 128-byte line a thread.
  __device__ __forceinline__ void prefetch_dense(const uint16_t *keys, const uint16_t *values, int64_t t0, int64_t end) {
    constexpr int kLines = T * D * 2 / 128;  // a full tile's rows of one side
    const int64_t bytes = (end - t0) * D * 2;
    for (int l = tid; l < 2 * kLines; l += NT) {
      const int64_t at = static_cast<int64_t>(l % kLines) * 128;
      if (at < bytes) prefetch_l2(reinterpret_cast<const uint8_t *>((l < kLines ? keys : values) + t0 * D) + at);
    }
  }

  // Dense rows keys[t0..end) as stored (post-RoPE). Thread: 16-byte chunk v = tid % V8 of
  // tokens tid / V8, + STEP, ...: every chunk loaded (read-only, rows past the end clamped to
  // the tile's first) before any is stored, so that the tile waits on one trip to memory, not
  // one a chunk (a generic load stays behind the shared-memory stores before it; the first
  // device run measured the dense decode at 3-4x SDPA's time: about a trip a chunk and one a
  // value token).
  template <bool BF>
  __device__ __forceinline__ void gather_dense_rows_as(const uint16_t *keys, int64_t t0, int64_t end) {
    constexpr int V8 = D / 8, STEP = NT / V8, N = T / STEP;
    static_assert(NT % V8 == 0 && T % STEP == 0, "whole tokens per pass");
    const int v = tid % V8, t1 = tid / V8;
    uint4 x[N];
    AKV_UNROLL
    for (int n = 0; n < N; ++n) {
      const int64_t t = t0 + t1 + n * STEP;
      x[n] = load_ro(reinterpret_cast<const uint4 *>(keys + (t < end ? t : t0) * D) + v);
    }
    AKV_UNROLL
    for (int n = 0; n < N; ++n) {
      const int t = t1 + n * STEP;
      put8<BF>(K_s + t * KS + v * 8, t0 + t < end ? x[n] : uint4{0, 0, 0, 0}, 1.0f);
    }
  }
  __device__ __forceinline__ void gather_dense_rows(const uint16_t *keys, int64_t t0, int64_t end) {
    if (bf16) gather_dense_rows_as<true>(keys, t0, end);
    else gather_dense_rows_as<false>(keys, t0, end);
  }

  // ---- 3. key residuals of the tile (mask word t0 / 64), added to the unrotated rows -------

  // The fast path's key residuals' rows R_off r~ in bf16, four a warp of warps 4-7 ([16][D / 2 +
  // 8] words: rows padded so that an mma fragment's four rows fall in distinct banks), after
  // the trig tables, where the logit pass writes the probabilities by token (pt_s) only later.
  static constexpr int kResRowWords = D / 2 + 8;
  static_assert(SplitSmem::fast_tables_bytes(D) + 16 * kResRowWords * 4 <= 4 * T * KS,
                "the rows fit the key tile");
  __device__ __forceinline__ uint32_t *K_s_residual_rows() const {
    return reinterpret_cast<uint32_t *>(K_s) + SplitSmem::fast_tables_bytes(D) / 4;
  }
  // A prefix tile's probabilities by token, [T][MAXROWS] (contract's logit pass and
  // settle_tile, beside L_s's rows), for prefix_values's value residuals: in the key tile, free
  // once the contraction is done (past the fast path's trig tables, where the key residuals'
  // rows were).
  __device__ __forceinline__ float *pt_s() const { return K_s + (fast ? SplitSmem::fast_tables_bytes(D) / 4 : 0); }

  // key_residuals_tc's residuals: warp kResWarps + w takes, in a pass of the tile's residuals
  // [16 p, 16 p + 16), slots q = 0-3 (its scratch rows and the mma's A rows), slot q holding
  // residual 16 p + slot_residual(w, q): w, w + 4, w + 8, w + 12 (pairs at D 64: 2 w, 2 w + 1,
  // 2 w + 8, 2 w + 9). A warp's residuals do not depend on the tile's count, so that its loads
  // need not wait for it, and every warp takes about a quarter of them.
  static constexpr int kResPair = D == 64 ? 2 : 1;  // residuals an mma pair takes
  static constexpr int kResWarps = NW / 2;          // warps kResWarps.. (the contraction has the others)
  __device__ __forceinline__ static int slot_residual(int w, int q) {
    return kResPair * w + q / kResPair * (kResPair * kResWarps) + q % kResPair;
  }

  // The fast path's logit terms q . R_off r~ of the pass's residuals first + slot_residual(0, q)
  // (those below count) with every row, from their rows R_off r~ in bf16 in the warp's scratch xs (row q): one
  // mma per 16 dims, A = the residuals (rows 0-3 of 16), B = the bf16 rotated queries; as in
  // contract_gathered a lane's k holds dims 4 tq .. 4 tq + 3 of the slab (one 8-byte load
  // each for A and B); added to rl_s.
  __device__ __forceinline__ void residual_logit_terms(const uint32_t *xs, int first, int count) {
    const int g = lane >> 2, tq = lane & 3;
    float acc[NR8][4];
    for (int m = 0; m < NR8; ++m)
      for (int e = 0; e < 4; ++e) acc[m][e] = 0.0f;
    // Rows g >= 4 are zero: every lane loads (row g & 3) and masks, so that the warp does
    // not split into two paths.
    const uint32_t *ra = xs + (g & 3) * kResRowWords + 2 * tq;
    const uint32_t live_row = g < 4 ? 0xffffffffu : 0u;
    // The epilogue's token, scale and folded penalties read first, beside the products (they
    // do not depend on them; read after, they were two trips to shared memory at the end).
    const int n = first + slot_residual(0, g & 3);
    const bool live = g < 4 && n < count;
    const int rn = live ? n : first, rt = bit_s[rn];
    const float rscale = ks_s[rn];  // unit levels (stage_keys's)
    float pen[NR8][2];
    for (int m = 0; m < NR8; ++m)
      for (int e = 0; e < 2; ++e) {
        const int i = (8 * m + 2 * tq + e) & (MAXROWS - 1);  // in range; used where < MAXROWS
        pen[m][e] = kFoldedPenalty ? rl_s[i * T + rt] : 0.0f;
      }
    for (int s16 = 0; s16 < D / 16; ++s16) {
      const uint2 av = *reinterpret_cast<const uint2 *>(ra + 8 * s16);
      const uint32_t a[4] = {av.x & live_row, 0u, av.y & live_row, 0u};
      for (int m = 0; m < NR8; ++m) {
        const int r = (m * 8 + g) & (MAXROWS - 1);  // this lane's B column's row (kB columns)
        const uint2 bv = *reinterpret_cast<const uint2 *>(qb_s + r * QS + 16 * s16 + 4 * tq);
        const uint32_t b[2] = {bv.x, bv.y};
        mma_bf16_16816(acc[m], a, b);
      }
    }
    __syncwarp();  // every lane has read the rows before the next pass writes them
    // acc[m][0..1]: slot g's residual's terms with rows 8 m + 2 tq and + 1.
    if (live) {
      for (int m = 0; m < NR8; ++m)
        for (int e = 0; e < 2; ++e)
          if (const int i = 8 * m + 2 * tq + e; i < MAXROWS) rl_s[i * T + rt] = pen[m][e] + acc[m][e] * rscale;
    }
  }

  // The fast path's key residuals with H y (the unnormalised inverse transform of a residual's
  // unit levels y) on the tensor cores. Sylvester's H is a Kronecker product, since
  // (-1)^popc(d & d') splits over d = C r + c: with Y[r][c] = y[C r + c] (C = 8, or 16 at D 256),
  // H y is H_(D/C) Y H_C, two f16 mma (the second's A is the first's accumulators, which hold
  // rows g, g + 8 and columns 2 tq, 2 tq + 1 of each n8 tile as an A fragment does; k 8 of 16
  // where C is 8). At D 128 one residual takes them, H_16 as A; at D 256 one, four mma (Y's
  // two n8 tiles of columns); at D 64 two, Y and Y' as B's rows 0-7 and 8-15 and an A that
  // puts H_8's rows r and r + 4 of Y in rows g and g + 8 of lanes g < 4, those of Y' in lanes
  // g >= 4. Each lane is left with whole NeoX pairs (dims j, j + 1 and their partners P on),
  // rotated without a shuffle. The unit levels are exact in f16, the first product's sums (at
  // most 16 x 1.51) rounded to f16 once, the rest in f32. A warp takes up to four residuals a
  // pass (slot_residual), in turn into its scratch rows (the pass's codes a coalesced word a
  // lane), then residual_logit_terms.
  static constexpr uint32_t h8_signs(int high) {  // bit ln: H_8[ln / 4][2 (ln % 4) + high] < 0
    uint32_t m = 0;
    for (int ln = 0; ln < 32; ++ln) {
      int x = (ln >> 2) & (2 * (ln & 3) + high), parity = 0;
      for (; x; x >>= 1) parity ^= x & 1;
      m |= static_cast<uint32_t>(parity) << ln;
    }
    return m;
  }
  static constexpr uint32_t kH8Low = h8_signs(0), kH8High = h8_signs(1);
  __device__ __forceinline__ void key_residuals_tc() {
    constexpr int RW = kResWarps, R = kResPair;
    constexpr int P = D / 2, W = D / 16;  // W: code words a residual
    constexpr int NCW = (4 * W + 31) / 32;  // a pass's code words a lane
    constexpr int C8 = D == 256 ? 2 : 1;  // n8 tiles of Y's columns
    static_assert(D == 64 || D == 128 || D == 256, "H_8 (x) H_8, H_16 (x) H_8 or H_16 (x) H_16");
    constexpr uint32_t kNeg = 0x80008000u;
    const int count = static_cast<int>(res_s[1]);  // the codes and scales: stage_keys's (kc_s, ks_s)
    const int w = warp - RW;
    if (R * w >= count) return;  // no residual for this warp: skip the set-up too
    // H_8[g][2 tq, 2 tq + 1] in f16: +-1, the sign bits ln of kH8Low and kH8High. The lane
    // index read where it is used: computed from `lane`, these words would be kept in registers
    // across the tile loop (128 at most), and ptxas spilled then.
    const int ln = lane_id();
    const uint32_t hg = 0x3c003c00u | (kH8Low >> ln & 1u) << 15 | (kH8High >> ln & 1u) << 31;
    const int mine = D == 64 ? lane >> 4 : 0;  // which of the pair's residuals the lane ends with
    // A of the first product: H_16 (rows g + 8 and columns 2 tq + 8.. repeat H_8's, negated
    // where both do). D 64: lanes g < 4 H_8's rows g and g + 4 on k 0-7 (Y), lanes g >= 4 rows
    // g - 4 and g on k 8-15 (Y'); H_8[g ^ 4][c] is H_8[g][c] negated for c >= 4 (tq >= 2).
    // B of the second: H_8 (symmetric: rows 2 tq, 2 tq + 1 of column g), rows 8.. zero; D 256
    // H_16's two n8 tiles (the second's rows 8.. negated).
    const uint32_t hs = (ln & 2) ? hg ^ kNeg : hg;
    uint32_t a1[4] = {hg, hg, hg, hg ^ kNeg};
    if (D == 64) {
      a1[0] = mine ? 0u : hg;
      a1[1] = mine ? 0u : hs;
      a1[2] = mine ? hs : 0u;
      a1[3] = mine ? hg : 0u;
    }
    uint32_t b2[C8][2];
    for (int m = 0; m < C8; ++m) {
      b2[m][0] = hg;
      b2[m][1] = D == 256 ? (m ? hg ^ kNeg : hg) : 0u;
    }
    const uint32_t lo16 = float_to_bits(-lloyd_max_level(3), false), in16 = float_to_bits(-lloyd_max_level(2), false);
    const uint32_t outer = lo16 | lo16 << 16, flip = outer ^ (in16 | in16 << 16);
    const auto level2 = [outer, flip](uint32_t x) {  // the codes at bits 0-1 and 16-17 as unit levels in f16x2
      const uint32_t inner = ((x ^ (x >> 1)) & 0x00010001u) * 0xffffu;
      return outer ^ (inner & flip) ^ ((x << 14) & kNeg);
    };
    // The lane's pairs j, j + 1 from each n8 tile m of H y's columns (and their partners P on).
    int j[C8];
    float2 sg0[C8], sg1[C8];
    for (int m = 0; m < C8; ++m) {
      j[m] = D == 64 ? 2 * (lane & 15) : D == 128 ? 2 * lane : 16 * (lane >> 2) + 8 * m + 2 * (lane & 3);
      sg0[m] = *reinterpret_cast<const float2 *>(sgn_s + j[m]);
      sg1[m] = *reinterpret_cast<const float2 *>(sgn_s + P + j[m]);
    }
    uint32_t *xs = K_s_residual_rows() + w * 4 * kResRowWords;
    for (int p0 = 0; p0 + R * w < count; p0 += 4 * RW) {  // uniform across the warp
      // The pass's codes, a coalesced word a lane (two at D 256): slot at / W's word at % W.
      uint32_t word[NCW];
      for (int h2 = 0; h2 < NCW; ++h2) {
        const int at = 32 * h2 + lane, n = p0 + slot_residual(w, at / W);
        word[h2] = at < 4 * W ? kc_s[n * W + at % W] : 0u;  // stage_keys's (past count: not read)
      }
      AKV_NO_UNROLL
      for (int s = 0; s < 4 / R && p0 + slot_residual(w, s * R) < count; ++s) {  // into rows s R ..
        // Y's B fragments: rows 2 tq, 2 tq + 1 (then + 8) of column g of each n8 tile. D 64 and
        // 128: the codes of dims 16 tq + g and + 8, bits 2 g and 2 g + 16 of a residual's word
        // tq; rows 8 + ..: D 128 the same residual's dims + 64 (word tq + 4), D 64 the second
        // residual's. D 256 (Y[r][c] = y[16 r + c]): words 2 tq and 2 tq + 1 (then + 8), bits
        // 2 g (then 2 g + 16 for columns 8..) of each.
        // The residual's token: its offset in the tile, since a prefix tile of format 3 (the only
        // caller) has consecutive positions (off_s[t] == t); its rotation read here, beside the
        // codes' shuffles rather than after the products.
        const int n = p0 + slot_residual(w, s * R + mine);
        const int t = bit_s[n < count ? n : p0 + R * w];
        float4 cs[C8];  // NeoX: pairs j, j + 1; GPT-J: pair j / 2, then (P + j) / 2
        for (int m = 0; m < C8; ++m) {
          if constexpr (GPTJ) {
            const float2 a = step_s[t * P + j[m] / 2], b = step_s[t * P + (P + j[m]) / 2];
            cs[m] = float4{a.x, a.y, b.x, b.y};
          } else {
            cs[m] = *reinterpret_cast<const float4 *>(step_s + t * P + j[m]);
          }
        }
        uint32_t yb[C8][2];
        if constexpr (D == 256) {
          const uint32_t wr = s < 2 ? word[0] : word[NCW - 1];  // a select: word[s / 2] would index registers
          for (int e = 0; e < 2; ++e) {
            const int at = (16 * s & 31) + 2 * (ln & 3) + 8 * e;
            const uint32_t wa = __shfl_sync(kFullMask, wr, at), wb = __shfl_sync(kFullMask, wr, at + 1);
            for (int m = 0; m < C8; ++m) {
              const int sh = 2 * (ln >> 2) + 16 * m;
              yb[m][e] = level2((wa >> sh & 3u) | (wb >> sh & 3u) << 16);
            }
          }
        } else {
          for (int e = 0; e < 2; ++e) {
            const int at = (s * R + (D == 64 ? e : 0)) * W + (ln & 3) + (D == 64 ? 0 : 4 * e);
            yb[0][e] = level2(__shfl_sync(kFullMask, word[0], at) >> (2 * (ln >> 2)));
          }
        }
        float c1[C8][4] = {}, hy[C8][4] = {};
        for (int m = 0; m < C8; ++m) mma_f16_16816(c1[m], a1, yb[m]);
        const uint32_t a2[4] = {pack_f16x2(c1[0][0], c1[0][1]), pack_f16x2(c1[0][2], c1[0][3]),
                                C8 > 1 ? pack_f16x2(c1[C8 - 1][0], c1[C8 - 1][1]) : 0u,
                                C8 > 1 ? pack_f16x2(c1[C8 - 1][2], c1[C8 - 1][3]) : 0u};
        for (int m = 0; m < C8; ++m) mma_f16_16816(hy[m], a2, b2[m]);  // dims j, j + 1, P + j, P + j + 1
        if (n < count) {  // D 64: the pair's second may be past the tile's
          for (int m = 0; m < C8; ++m) {
            // U^T y = diag(signs) H y / sqrt(D), then R_off: NeoX pairs j, j + 1 (one 16-byte
            // entry); GPT-J pairs j / 2 and (P + j) / 2, stored in quad order.
            const float x0 = hy[m][0] * sg0[m].x, x1 = hy[m][1] * sg0[m].y, y0 = hy[m][2] * sg1[m].x,
                        y1 = hy[m][3] * sg1[m].y;
            if constexpr (GPTJ) {
              uint16_t *row = reinterpret_cast<uint16_t *>(xs + (s * R + mine) * kResRowWords);
              const int pa = gptj_position(j[m] / 2), pb = gptj_position((P + j[m]) / 2);
              row[pa] = float_to_bits(x0 * cs[m].x - x1 * cs[m].y, true);
              row[pa + 2] = float_to_bits(x0 * cs[m].y + x1 * cs[m].x, true);
              row[pb] = float_to_bits(y0 * cs[m].z - y1 * cs[m].w, true);
              row[pb + 2] = float_to_bits(y0 * cs[m].w + y1 * cs[m].z, true);
            } else {
              uint32_t *row = xs + (s * R + mine) * kResRowWords;
              row[j[m] / 2] = pack_bf16x2(x0 * cs[m].x - y0 * cs[m].y, x1 * cs[m].z - y1 * cs[m].w);
              row[(P + j[m]) / 2] = pack_bf16x2(x0 * cs[m].y + y0 * cs[m].x, x1 * cs[m].w + y1 * cs[m].z);
            }
          }
        }
      }
      __syncwarp();
      residual_logit_terms(xs, p0 + R * w, count);
    }
  }

  // The other paths' key residuals, added to the f32 key tile: eight lanes per residual,
  // EPT = D / 8 dimensions each (lane l of the eight holds l * EPT ..), the in-register
  // butterflies, then three stages across the eight lanes. A warp takes four residuals at a
  // time, warp w the residuals 4w.., 4(w + NW).., ... Codes are decoded from whole words: the
  // scaled inner level where the code is 1 or 2 (its two bits differ), else the outer one,
  // negated where the code's high bit is clear.
  __device__ __forceinline__ void key_residuals() {
    constexpr int EPT = D / 8;
    static_assert(EPT % 8 == 0, "whole 16-bit code words and float4 rows per lane");
    const uint32_t base = res_s[0];
    const int count = static_cast<int>(res_s[1]);
    const int sub = lane >> 3, sl = lane & 7, d0 = sl * EPT;
    // Fused rotation: pairs % EPT == 0, so the lane's dimensions d0.. lie wholly below pairs
    // (x c - x' s), in [pairs, 2 pairs) (x c + x' s, pair j0 = d0 - pairs ..) or past 2 pairs
    // (not rotated: the table's offset-0 row, (1, 0)). The partner x' is lane sl ^ pm.
    const bool rope = fused && !gapped && pairs > 0;
    const bool rot = rope && d0 < 2 * pairs;
    const int pm = rope ? pairs / EPT : 0, j0 = rot && d0 >= pairs ? d0 - pairs : rot ? d0 : 0;
    const float rs = d0 < pairs ? -1.0f : 1.0f;
    for (int n0 = warp * 4; n0 < count; n0 += NW * 4) {  // uniform across the warp
      const int n = n0 + sub;
      const bool live = n < count;
      float x[EPT];
      if (live) {
        const uint8_t *codes = c.key_codes + static_cast<int64_t>(base + n) * (D / 4) + sl * (EPT / 4);
        const float scale = c.key_scales[base + n];
        // Negative levels: the sign bit is flipped back where the code's high bit is set.
        const uint32_t outer = float_as_bits(-scale * lloyd_max_level(3));
        const uint32_t flip = outer ^ float_as_bits(-scale * lloyd_max_level(2));
        for (int w0 = 0; w0 < EPT; w0 += 16) {  // 16 codes a 32-bit word (8 at EPT = 8)
          const uint32_t w = EPT - w0 >= 16 ? reinterpret_cast<const uint32_t *>(codes)[w0 / 16]
                                            : *reinterpret_cast<const uint16_t *>(codes);
          const uint32_t mid = w ^ (w >> 1);  // bit 2e: code e is 1 or 2 (inner)
          for (int e = 0; e < 16 && w0 + e < EPT; ++e) {
            const uint32_t im = static_cast<uint32_t>(static_cast<int32_t>(mid << (31 - 2 * e)) >> 31);
            x[w0 + e] = bits_as_float(outer ^ (im & flip) ^ ((w << (30 - 2 * e)) & 0x80000000u));
          }
        }
      } else {
        for (int e = 0; e < EPT; ++e) x[e] = 0.0f;
      }
      // Inverse rotation U^T y = diag(signs) H y / sqrt(D).
      lane_fwht(x);
      for (int lm = 1; lm < 8; lm <<= 1) {
        const float sign = (sl & lm) ? -1.0f : 1.0f;  // upper half: other - x, lower: x + other
        for (int e = 0; e < EPT; ++e) x[e] = fmaf(sign, x[e], __shfl_xor_sync(kFullMask, x[e], lm));
      }
      const float4 *sg = reinterpret_cast<const float4 *>(sgn_s + d0);
      for (int e = 0; e < EPT; e += 4) {
        const float4 s = sg[e / 4];
        x[e] *= s.x;
        x[e + 1] *= s.y;
        x[e + 2] *= s.z;
        x[e + 3] *= s.w;
      }
      const int t = live ? bit_s[n] : 0;
      if (rope) {  // uniform across the block
        const int off = rot && live ? off_s[t] : 0;  // >= 0: a gapped tile is rotated by rotate_keys
        // The partner x' one shuffle away, taken element by element (every lane reads its
        // partner's value before either writes it back).
        const float4 *st = reinterpret_cast<const float4 *>(step_s + off * pairs + j0);
        for (int e = 0; e < EPT; e += 2) {
          const float4 cs = st[e / 2];
          const float o0 = __shfl_xor_sync(kFullMask, x[e], pm), o1 = __shfl_xor_sync(kFullMask, x[e + 1], pm);
          x[e] = fmaf(x[e], cs.x, o0 * (rs * cs.y));
          x[e + 1] = fmaf(x[e + 1], cs.z, o1 * (rs * cs.w));
        }
      }
      if (live) {
        float4 *row = reinterpret_cast<float4 *>(K_s + t * KS + d0);
        for (int e = 0; e < EPT; e += 4) {
          float4 r = row[e / 4];
          r.x += x[e];
          r.y += x[e + 1];
          r.z += x[e + 2];
          r.w += x[e + 3];
          row[e / 4] = r;
        }
      }
    }
  }

  // (cos, sin) of R_off for token t (offset off from the tile's first position p0) and pair j:
  // the per-block table, or the exact angle where the tile's positions have a gap (off < 0).
  __device__ __forceinline__ float2 offset_angle(int t, int off, int j, int64_t p0) const {
    return off >= 0 ? step_s[off * pairs + j] : exact_angle(pos_s[t] - p0, inv_s[j]);
  }

  // ---- 4. RoPE in place ----------------------------------------------------------------------

  // R_off for the offset off of each token from the tile's first position (the queries took
  // R_{p0}^T): lane j of every warp takes pair j (then j + 32, ...), warp w the tokens w,
  // w + NW, ...
  __device__ __forceinline__ void rotate_keys() {
    constexpr int TPW = T / NW;  // tokens per warp
    int offs[TPW];
    for (int m = 0; m < TPW; ++m) offs[m] = off_s[warp + m * NW];
    const int64_t p0 = pos_s[0];
    for (int j = lane; j < pairs; j += 32) {
      const int f = first_s[j], s = second_s[j];
      for (int m = 0; m < TPW; ++m) {
        const int t = warp + m * NW;
        const float2 st = offset_angle(t, offs[m], j, p0);
        float *row = K_s + t * KS;
        const float x0 = row[f], x1 = row[s];
        row[f] = x0 * st.x - x1 * st.y;
        row[s] = x0 * st.y + x1 * st.x;
      }
    }
  }

  // ---- 5. logits: the key tile against every row, on the tensor cores ---------------------

  // mma.m16n8k16 (bf16 operands, f32 accumulation): A = the key tile (tokens x dims, from the
  // f32 rows of K_s), B = the rows' queries (dims x rows, n8 tiles). Warp w takes the 16
  // tokens 16 (w % 4).. and the dims of half w / 4; the second half's partial logits meet the
  // first's through Lp_s. With `precise`, hi + lo splits of both and three products.
  static constexpr int NR8 = (MAXROWS + 7) / 8;  // n8 tiles of rows
  // kB columns: with 4 rows, B columns 4-7 repeat rows 0-3 (no branch on the lane); their
  // outputs are never read.
  static_assert((MAXROWS & (MAXROWS - 1)) == 0, "B columns past MAXROWS repeat rows");
  static constexpr int KSL = D / 32;              // k16 slabs of dims per warp
  static_assert(NW == 8 && T == 64 && D % 32 == 0, "four m16 token tiles times two halves of the dims");

  // The key tile of K_s (f32 rows) against the rows' queries qs (f32): warp w's dims are
  // slabs half * KSL .. of 16, in their natural order within the mma's k16.
  __device__ __forceinline__ void contract_tile(const float *qs, float (&acc)[NR8][4]) const {
    const int g = lane >> 2, tq = lane & 3, m0 = (warp & 3) * 16, half = warp >> 2;
    const float *k0 = K_s + (m0 + g) * KS + 2 * tq, *k1 = k0 + 8 * KS;
    for (int s = 0; s < KSL; ++s) {
      const int d = (half * KSL + s) * 16;
      const float2 x0 = *reinterpret_cast<const float2 *>(k0 + d), x1 = *reinterpret_cast<const float2 *>(k1 + d);
      const float2 x2 = *reinterpret_cast<const float2 *>(k0 + d + 8), x3 = *reinterpret_cast<const float2 *>(k1 + d + 8);
      uint32_t ah[4], al[4];
      if (precise) {
        split_bf16x2(x0.x, x0.y, ah[0], al[0]);
        split_bf16x2(x1.x, x1.y, ah[1], al[1]);
        split_bf16x2(x2.x, x2.y, ah[2], al[2]);
        split_bf16x2(x3.x, x3.y, ah[3], al[3]);
      } else {
        ah[0] = pack_bf16x2(x0.x, x0.y);
        ah[1] = pack_bf16x2(x1.x, x1.y);
        ah[2] = pack_bf16x2(x2.x, x2.y);
        ah[3] = pack_bf16x2(x3.x, x3.y);
      }
      for (int n = 0; n < NR8; ++n) {
        const int r = (n * 8 + g) & (MAXROWS - 1);  // this lane's B column's row (kB columns)
        const float2 y0 = *reinterpret_cast<const float2 *>(qs + r * D + d + 2 * tq);
        const float2 y1 = *reinterpret_cast<const float2 *>(qs + r * D + d + 2 * tq + 8);
        uint32_t bh[2], bl[2];
        if (precise) {
          split_bf16x2(y0.x, y0.y, bh[0], bl[0]);
          split_bf16x2(y1.x, y1.y, bh[1], bl[1]);
          mma_bf16_16816(acc[n], al, bh);
          mma_bf16_16816(acc[n], ah, bl);
        } else {
          bh[0] = pack_bf16x2(y0.x, y0.y);
          bh[1] = pack_bf16x2(y1.x, y1.y);
        }
        mma_bf16_16816(acc[n], ah, bh);
      }
    }
  }

  // Pairs d..d+3 of token u's anchor row, rotated by R_u in bf16x2:
  // x' = x cos - y sin (dims d..), y' = x sin + y cos (dims D/2 + d..), each a product and one
  // fused multiply-add (x': x cos less the rounded y sin, no sign flip of the table's sines).
  __device__ __forceinline__ void rotate_pairs4(const uint16_t *row, int u, int d, uint32_t &x01, uint32_t &x23,
                                                uint32_t &y01, uint32_t &y23) const {
    constexpr int P = D / 2;
    const uint2 x = *reinterpret_cast<const uint2 *>(row + d);
    const uint2 y = *reinterpret_cast<const uint2 *>(row + P + d);
    const uint4 cs = cs_s[u * kTrigStride + d / 4];  // cos of the four pairs, then sin
    x01 = bf16x2_fms(x.x, cs.x, bf16x2_fma(y.x, cs.z, kBf16x2NegZero));
    x23 = bf16x2_fms(x.y, cs.y, bf16x2_fma(y.y, cs.w, kBf16x2NegZero));
    y01 = bf16x2_fma(x.x, cs.z, bf16x2_fma(y.x, cs.x, kBf16x2NegZero));
    y23 = bf16x2_fma(x.y, cs.w, bf16x2_fma(y.y, cs.y, kBf16x2NegZero));
  }
  // GPT-J: dims d .. d + 7 of token u's anchor row (pairs d / 2 .. d / 2 + 3, one 16-byte
  // load and one entry of cos | sin) rotated by R_u, in quad order: x01, y01 the first four
  // dims' (x, x' | y, y'), x23, y23 the next four's; rotate_pairs4's products on the halves.
  __device__ __forceinline__ void rotate_gptj4(const uint16_t *row, int u, int d, uint32_t &x01, uint32_t &y01,
                                               uint32_t &x23, uint32_t &y23) const {
    const uint4 w = *reinterpret_cast<const uint4 *>(row + d);
    const uint4 cs = cs_s[u * kTrigStride + d / 8];  // cos of the four pairs, then sin
    const uint32_t xa = low_halves(w.x, w.y), ya = high_halves(w.x, w.y);
    const uint32_t xb = low_halves(w.z, w.w), yb = high_halves(w.z, w.w);
    x01 = bf16x2_fms(xa, cs.x, bf16x2_fma(ya, cs.z, kBf16x2NegZero));
    y01 = bf16x2_fma(xa, cs.z, bf16x2_fma(ya, cs.x, kBf16x2NegZero));
    x23 = bf16x2_fms(xb, cs.y, bf16x2_fma(yb, cs.w, kBf16x2NegZero));
    y23 = bf16x2_fma(xb, cs.w, bf16x2_fma(yb, cs.y, kBf16x2NegZero));
  }

  // The fast path: warp w's (w < 4) tokens' anchor rows K_a(t) gathered (through L2) straight
  // into A fragments and rotated there by R_off (off = the token's place in the tile: format 3
  // and the window have consecutive positions), against the bf16 rotated queries qb_s. A warp
  // takes its 16 tokens' every slab of the first D/2 dims with its RoPE partner D/32 slabs on
  // (no exchange of partial logits), and a
  // fragment's k16 holds a slab's dims in the order 0, 1, 4, 5, 8, 9, ... | 2, 3, 6, 7, ...
  // (lane tq: dims 4tq .. 4tq + 3, one 8-byte load), the same for A and B. gamma is applied
  // to the logit afterwards.
  __device__ __forceinline__ void contract_gathered(float (&acc)[NR8][4]) const {
    constexpr int P = D / 2, SP = P / 32;
    static_assert(P % 32 == 0, "two halves of whole slabs of pairs");
    const int g = lane >> 2, tq = lane & 3;
    const int u0 = (warp & 3) * 16 + g, u1 = u0 + 8;
    const int a0 = a_s[u0], a1 = a_s[u1];
    // A token past the tile's end (a < 0) reads anchor 0's row: its logit is masked anyway.
    // This head's anchor keys: a pointer in shared memory, read once a tile, which the compiler
    // would otherwise rebuild from the view every tile (a load and a 64-bit product).
    const uint16_t *ak_h = ha_s->anchor_keys;
    const uint16_t *row0 = ak_h + (a0 < 0 ? 0 : a0) * D, *row1 = ak_h + (a1 < 0 ? 0 : a1) * D;
    if constexpr (GPTJ) {
      // Dims d .. d + 7 of the row a lane (pairs d / 2 ..): two quads, the lane's k slots of
      // two k16 slabs, whose queries sit at d / 2 and D / 2 + d / 2 (gptj_position).
      for (int s = 0; s < D / 32; ++s) {
        const int d = s * 32 + 8 * tq;
        uint32_t a01[4], a23[4];
        rotate_gptj4(row0, u0, d, a01[0], a01[2], a23[0], a23[2]);
        rotate_gptj4(row1, u1, d, a01[1], a01[3], a23[1], a23[3]);
        for (int n = 0; n < NR8; ++n) {
          const int r = (n * 8 + g) & (MAXROWS - 1);  // kB columns
          const uint2 bx = *reinterpret_cast<const uint2 *>(qb_s + r * QS + d / 2);
          const uint2 by = *reinterpret_cast<const uint2 *>(qb_s + r * QS + P + d / 2);
          const uint32_t b01[2] = {bx.x, bx.y}, b23[2] = {by.x, by.y};
          mma_bf16_16816(acc[n], a01, b01);
          mma_bf16_16816(acc[n], a23, b23);
        }
      }
    } else {
      for (int s = 0; s < 2 * SP; ++s) {
        const int d = s * 16 + 4 * tq;
        uint32_t ax[4], ay[4];  // slab s (dims d..) and its partner slab (dims P + d..)
        rotate_pairs4(row0, u0, d, ax[0], ax[2], ay[0], ay[2]);
        rotate_pairs4(row1, u1, d, ax[1], ax[3], ay[1], ay[3]);
        for (int n = 0; n < NR8; ++n) {
          const int r = (n * 8 + g) & (MAXROWS - 1);  // kB columns
          const uint2 bx = *reinterpret_cast<const uint2 *>(qb_s + r * QS + d);
          const uint2 by = *reinterpret_cast<const uint2 *>(qb_s + r * QS + P + d);
          const uint32_t b0[2] = {bx.x, bx.y}, b1[2] = {by.x, by.y};
          mma_bf16_16816(acc[n], ax, b0);
          mma_bf16_16816(acc[n], ay, b1);
        }
      }
    }
  }

  // A cache without RoPE (docs/design.md §4.6): a token's logits before its coefficient are its
  // anchor's scores q . K_a (sc: decode_scores_kernel's rows, MAXROWS floats an anchor), read
  // into contract_gathered's accumulators (token m0 + g + 8 (e / 2), row n 8 + 2 tq + e % 2,
  // the rows past MAXROWS its kB columns' repeats) instead of gathering and contracting rows.
  __device__ __forceinline__ void lookup_scores(const float *sc, float (&acc)[NR8][4]) const {
    const int g = lane >> 2, tq = lane & 3;
    const int u0 = (warp & 3) * 16 + g, u1 = u0 + 8;
    const int a0 = a_s[u0], a1 = a_s[u1];  // past the tile's end (a < 0): anchor 0's, masked
    const float *s0 = sc + (a0 < 0 ? 0 : a0) * MAXROWS, *s1 = sc + (a1 < 0 ? 0 : a1) * MAXROWS;
    for (int n = 0; n < NR8; ++n) {
      const int i = (n * 8 + 2 * tq) & (MAXROWS - 1);
      const float2 x0 = load_ro(reinterpret_cast<const float2 *>(s0 + i)), x1 = load_ro(reinterpret_cast<const float2 *>(s1 + i));
      acc[n][0] = x0.x;
      acc[n][1] = x0.y;
      acc[n][2] = x1.x;
      acc[n][3] = x1.y;
    }
  }

  // causal: these are appended tokens, and row i (query qi of its head) sees the first
  // suffix_len - (q_len - 1 - qi) of them. anchor: anchor tiles (R_off keys, rotated queries).
  // residuals: a prefix tile on the fast path, whose key residuals' logit terms warps 4-7
  // compute while warps 0-3 contract. prefix: a prefix tile, whose logits become p =
  // exp2(logit - the row's reference max) here (L_s, and by token pt_s), the logits kept in
  // Lp_s: returns whether one passed its row's reference by more than the slack, which
  // settle_tile puts right (a block vote).
  __device__ __forceinline__ bool contract(int64_t t0, int64_t end, bool causal, int64_t suffix_len, bool anchor,
                                           bool residuals = false, bool prefix = false) {
    bool rose = false;
    const int g = lane >> 2, tq = lane & 3, m0 = (warp & 3) * 16, half = warp >> 2;
    const bool gathered = anchor && fast;
    const int valid = static_cast<int>(end - t0);  // tokens of the tile (<= T)
    float acc[NR8][4];
    for (int n = 0; n < NR8; ++n)
      for (int e = 0; e < 4; ++e) acc[n][e] = 0.0f;
    if (!gathered) {
      contract_tile(anchor ? qr_s : q_s, acc);
    } else if (half == 0) {
#if defined(AKV_SASS_PIN_SCORES)  // sass_count.py --scores: the count's caches have no RoPE
      lookup_scores(ha_s->scores, acc);
#elif defined(AKV_SASS_PIN_BF16_FUSED)  // the count's caches have RoPE: no scores
      contract_gathered(acc);
#else
      if (const float *sc = ha_s->scores) lookup_scores(sc, acc);
      else contract_gathered(acc);
#endif
    } else if (residuals) {
      key_residuals_tc();
    }
    // acc[n][e]: token m0 + g + 8 (e / 2), row n * 8 + 2 tq + e % 2.
    if (half == 1 && !gathered) {
      for (int n = 0; n < NR8; ++n)
        for (int e = 0; e < 4; ++e) {
          const int i = n * 8 + 2 * tq + e % 2;
          if (i < MAXROWS) Lp_s[i * T + m0 + g + 8 * (e / 2)] = acc[n][e];
        }
    }
    // With 4 rows, B's columns 4-7 repeat rows 0-3 (kB columns), so lanes tq >= 2 hold token
    // g + 8's logits a second time: they finish those and lanes tq < 2 token g's, two logits
    // a lane, selected without a branch.
    constexpr bool kDup = MAXROWS == 4;
    // The lane's rows' reference maxima, read before the barrier (nothing writes them in
    // between): read after it, a row's second logit waited on its own shared-memory trip.
    float mrefs[NR8][2];
    for (int n = 0; n < NR8; ++n)
      for (int e = 0; e < 2; ++e) {
        const int i = kDup ? 2 * (tq & 1) + e : n * 8 + 2 * tq + e;
        mrefs[n][e] = prefix && half == 0 && i < MAXROWS ? mref_s[i] : 0.0f;
      }
    __syncthreads();
    if (half == 0) {
      constexpr int X = kDup ? 1 : 2;  // tokens a lane finishes
      int kinds[X];  // the lane's tokens m0 + g (+ 8): read once for all their rows
      float gammas[X];
      const int xd = kDup ? tq >> 1 : 0;
      for (int x = 0; x < X; ++x) {
        const int t = m0 + g + 8 * (x + xd);
        kinds[x] = anchor && !(gathered && kFoldedPenalty) ? kind_s[t] : 2;
        gammas[x] = gathered ? g_s[t] : 1.0f;
      }
      // Every logit read before any is written: stores to shared memory would otherwise keep
      // ptxas from issuing the next element's loads ahead.
      float vs[NR8][2 * X];
      for (int n = 0; n < NR8; ++n)
        for (int e = 0; e < 2 * X; ++e) {
          const int x = e / 2, i = kDup ? 2 * (tq & 1) + e : n * 8 + 2 * tq + e % 2, t = m0 + g + 8 * (x + xd);
          if (i >= MAXROWS) continue;
          const float a = kDup ? (xd ? acc[n][2 + e] : acc[n][e]) : acc[n][e];
          float v;
          const int kind = kinds[x];
          if (gathered && kFoldedPenalty) {  // gamma, then the key residual's term and the penalty at once
            v = fmaf(a, gammas[x], rl_s[i * T + t]);
          } else {
            v = gathered ? a * gammas[x] : a + Lp_s[i * T + t];
            if (gathered && kind == 1) v += rl_s[i * T + t];  // the key residual's term
            v += pen_s[kind * MAXROWS + i];  // kind 2: zero
          }
          bool visible = t < valid;
          if (causal) visible = visible && t0 + t < suffix_len - (p.q_len - 1 - (row0 + i) % p.q_len);
          vs[n][e] = visible ? v : -INFINITY;
        }
      for (int n = 0; n < NR8; ++n)
        for (int e = 0; e < 2 * X; ++e) {
          const int x = e / 2, i = kDup ? 2 * (tq & 1) + e : n * 8 + 2 * tq + e % 2, t = m0 + g + 8 * (x + xd);
          if (i >= MAXROWS) continue;
          const float v = vs[n][e];
          if (prefix) {  // -inf + slack is -inf: a row's first visible logit rises
            const float m = mrefs[n][kDup ? e : e % 2];
            rose = rose || v > m + p.rescale_slack;
            const float pv = m == -INFINITY ? 0.0f : fast_exp2(v - m);
            Lp_s[i * T + t] = v;  // this thread's own element (read above on the unfused path)
            L_s[i * T + t] = pv;
            pt_s()[t * MAXROWS + i] = pv;
          } else {
            L_s[i * T + t] = v;
          }
        }
    }
    return rose;
  }

  // ---- 6. online softmax over the tile; L_s becomes p = exp2(logit - max) -------------------

  // kDense: dacc is live (dense and suffix tiles); else only racc is rescaled.
  //
  // The reference max of a row (m_run) is raised only when a tile's max passes it by more than
  // kRescaleSlack (base-2 logits; DecodeLaunch::rescale_slack, which tests lower): p =
  // exp2(logit - m_run) then stays below 2^32, and every sum of p (times a coefficient or a
  // value) below 2^52 |gamma V| at a million tokens, far inside fp32's 2^128 (p is never
  // narrowed to fp16). What is accumulated is rescaled only when a
  // row's max jumps by more than that: never on SmolLM2's real prompts, whose largest rise of a
  // tile over its block's running max was 27 (tools/realmodel/rescale_rate.py). Whether any
  // row's reference moved is the block's vote at the barrier (__syncthreads_or), so a thread
  // reads the rows' factors only in the rare tile that rescales.

  // Row i's new reference, by its owner warp (row r of the warp's), from the tile's logits
  // l0, l1 (a lane's two tokens: T == 64): the tile's max only where one of its logits passes
  // the reference by more than the slack (a vote; -inf + slack is -inf: a row raises its
  // reference at its first visible logit, and nothing is accumulated before it, no rescale
  // then); its factor for what is accumulated in red_s[i], the reference in mref_s[i], and
  // p0, p1 against it. Returns whether a previous reference rose (a rescale).
  __device__ __forceinline__ bool new_reference(int r, int i, float l0, float l1, float &p0, float &p1) {
    const float m_old = m_run[r];
    const float l_max = fmaxf(l0, l1);
    float m_ref = m_old, alpha = 1.0f;
    bool rose = false;
    if (__any_sync(kFullMask, l_max > m_old + p.rescale_slack)) {
      m_ref = warp_max(l_max);
      if (m_old != -INFINITY) {
        alpha = fast_exp2(m_old - m_ref);
        rose = true;
      }
    }
    m_run[r] = m_ref;
    l_part[r] *= alpha;
    if (lane == 0) {
      red_s[i] = alpha;
      mref_s[i] = m_ref;
    }
    p0 = m_ref == -INFINITY ? 0.0f : fast_exp2(l0 - m_ref);
    p1 = m_ref == -INFINITY ? 0.0f : fast_exp2(l1 - m_ref);
    return rose;
  }

  template <bool kDense>
  __device__ __forceinline__ void softmax_tile() {
    __syncthreads();
    // Warp i % NW owns row i: the tile's max, the reference max and running sum, p in place,
    // and the factor of what is already accumulated (red_s[i]) for the other threads.
    bool rose = false;
    AKV_UNROLL
    for (int r = 0; r < RPW; ++r)
      if (const int i = warp + r * NW; i < MAXROWS) {
        float *l = L_s + i * T;
        float p0, p1;
        rose = new_reference(r, i, l[lane], l[lane + 32], p0, p1) || rose;
        l[lane] = p0;
        l[lane + 32] = p1;
        l_part[r] += p0;
        l_part[r] += p1;
      }
    if (__syncthreads_or(rose)) {  // uniform across the block: a row's reference max rose
      rescale<kDense>();
      __syncthreads();  // before the tile's values are added
    }
  }

  // What is accumulated, times red_s[i] for row i (a rise of its reference max).
  template <bool kDense>
  __device__ __forceinline__ void rescale() {
    for (int i = 0; i < MAXROWS; ++i) {  // static row indices: racc stays in registers
      const float alpha = red_s[i];
      for (int e = 0; e < DPT; ++e) {
        racc[i][e] *= alpha;
        if (kDense) dacc[i][e] *= alpha;
      }
      if (alpha != 1.0f) {  // a raise (not a row's first reference)
        for (int e = tid; e < k; e += NT) w[i * wstride + e] *= alpha;
      }
    }
    if (segw)  // apart: inside the loop above, racc went to local memory at 16 rows
      for (int e = tid; e < MAXROWS * kSegmentEntries; e += NT) w_s[e] *= red_s[e / kSegmentEntries];
    for (int x = 0; x < PASSES; ++x) lacc[x] *= red_s[x * RP + lane % RP];
  }

  // A prefix tile's p, which contract() computed against each row's reference max: the
  // block's vote on whether a logit passed it by more than the slack. Rarely (a row's first
  // visible logits, a block's first tile; then a jump): as softmax_tile does, each risen row
  // takes the tile's max from the logits in Lp_s, what is accumulated is rescaled and p
  // recomputed. The tile's sums of p are prefix_values's (lacc), after any rescale.
  __device__ __forceinline__ void settle_tile(bool rose) {
    if (__syncthreads_or(rose)) {  // rare: else p stands as contract() wrote it
      bool scaled = false;  // a row's reference rose past a previous one (not a first)
      AKV_UNROLL
      for (int r = 0; r < RPW; ++r)
        if (const int i = warp + r * NW; i < MAXROWS) {
          float p0, p1;
          scaled = new_reference(r, i, Lp_s[i * T + lane], Lp_s[i * T + lane + 32], p0, p1) || scaled;
          L_s[i * T + lane] = p0;
          L_s[i * T + lane + 32] = p1;
          pt_s()[lane * MAXROWS + i] = p0;
          pt_s()[(lane + 32) * MAXROWS + i] = p1;
        }
      if (__syncthreads_or(scaled)) {
        rescale<false>();
        __syncthreads();  // before the tile's weights are added
      }
    }
  }

  // ---- 7. values -------------------------------------------------------------------------

  // Value residuals: a thread reads a residual's rows with one float4 load (the probabilities
  // by token, pt_s) and each level with one shared-memory load (stage_values's).
  __device__ __forceinline__ void prefix_values(int64_t t0, int64_t end) {
    // w_a += p_t gamma_t. Shared memory (a compare-and-swap loop per add, a round for each
    // lane on the same address): all k, or the segment's table entries (segw; an anchor
    // token's own weight into the workspace rows); or the block's workspace rows (native
    // float adds); the address space known in each loop, so no generic atomics.
    // Thread: row lane % RP of each pass of RP = NT / T rows (a fixed count of passes:
    // MAXROWS / RP) and token warp + NW (lane / RP): a warp takes RP rows of 8 tokens 8 apart,
    // which share an anchor far less often than 32 consecutive tokens of one row (on SmolLM2's
    // prompts the most tokens on one anchor average 1.6 against 4.3: the loop's rounds).
    const int u = warp + NW * (lane / RP);
    const int count = static_cast<int>(res_s[3]);  // value residuals: read before the atomics
    const bool live = u < static_cast<int>(end - t0);
    const int va = va_s[u];
    const float vg = vg_s[u];
    if (segw) {
      const bool own = va >= kSegmentEntries;  // an anchor token: its own (exact) anchor
      for (int x = 0; x < PASSES; ++x) {
        const int i = x * RP + lane % RP;
        if (live && i < rows) {
          const float pr = L_s[i * T + u];
          lacc[x] += pr;
          if (own) {  // a warp's pass (8 tokens) holds an anchor token about a sixth of the time
            // The block's workspace rows rebuilt here, in the rare branch (w, kept across the
            // loop, costs a register ptxas gives up for a rebuild on the common path: 2196 ->
            // 2177 cycles a tile, scripts/sass_count.py --segment-weights).
            atomicAdd(p.ws_w + (split_block_index() * MAXROWS + i) * p.max_anchors + va - kSegmentEntries, pr * vg);
          } else {
            atomicAdd(&w_s[i * kSegmentEntries + va], pr * vg);
          }
        }
      }
    } else if (w != w_s) {
      for (int x = 0; x < PASSES; ++x) {
        const int i = x * RP + lane % RP;
        if (live && i < rows) {
          const float pr = L_s[i * T + u];
          lacc[x] += pr;
          atomicAdd(&w[i * wstride + va], pr * vg);
        }
      }
    } else {
      for (int x = 0; x < PASSES; ++x) {
        const int i = x * RP + lane % RP;
        if (live && i < rows) {
          const float pr = L_s[i * T + u];
          lacc[x] += pr;
          atomicAdd(&w_s[i * k + va], pr * vg);
        }
      }
    }
    // The residuals' positions, levels and codes are stage_values's, their probabilities by
    // token the logit pass's (pt_s): no barrier after the weights.
    // racc's dims: the thread's DPT consecutive dims dim * DPT.. (write_partial), whose codes
    // are one byte of the residual's (DPT divides 4), read once for all of them.
    const int group = tid / TPD, dim = tid % TPD;
    const int shift = (dim * DPT & 3) * 2;
    static_assert(4 % DPT == 0 && D % 16 == 0, "a thread's codes in one byte; whole code words per residual");
    const uint8_t *vcodes = reinterpret_cast<const uint8_t *>(vc_s) + (dim * DPT >> 2);
    // Slot groups 0 .. VG - 1 take the residuals, in turn (a tile holds a few, about 3); any
    // other groups' warps skip the loop and its per-tile cost (write_partial sums every
    // group's racc, theirs zero).
    constexpr int VG = SG < kValueGroups ? SG : kValueGroups;
    if (group < VG) {
      AKV_NO_UNROLL  // unrolled, ptxas spills more at 4 rows (32 bytes instead of 16)
      for (int n = group; n < count; n += VG) {  // everything indexed by n: one induction variable
        const uint32_t codes = vcodes[n * (D / 4)] >> shift;
        const float *lv = vlev_s + n * 4;
        const float4 *lr = reinterpret_cast<const float4 *>(pt_s() + vpos_s[n] * MAXROWS);
        for (int e = 0; e < DPT; ++e) {
          const float level = lv[(codes >> (2 * e)) & 3];
          for (int i = 0; i < MAXROWS; i += 4) {
            const float4 pr = lr[i / 4];
            racc[i][e] = fmaf(pr.x, level, racc[i][e]);
            racc[i + 1][e] = fmaf(pr.y, level, racc[i + 1][e]);
            racc[i + 2][e] = fmaf(pr.z, level, racc[i + 2][e]);
            racc[i + 3][e] = fmaf(pr.w, level, racc[i + 3][e]);
          }
        }
      }
    }
    __syncthreads();
  }

  // segw: the segment's weights added to the workspace rows by anchor, and cleared; after a
  // block's last tile of a segment (before format3_meta replaces the table).
  __device__ __forceinline__ void flush_segment() {
    for (int e = tid; e < kSegmentEntries; e += NT) {
      const int a = tab_s[e];
      for (int i = 0; i < MAXROWS; ++i) {
        float &x = w_s[i * kSegmentEntries + e];
        if (x != 0.0f) {  // an entry no token used (or a row past the chunk's)
          atomicAdd(&w[i * wstride + a], x);
          x = 0.0f;
        }
      }
    }
    __syncthreads();
  }

  __device__ __forceinline__ void window_values(int64_t w0, int64_t end) {
    const int u = tid % T;  // one anchor per token: no two threads share an entry
    for (int i0 = 0; i0 < MAXROWS; i0 += NT / T) {
      const int i = i0 + tid / T;
      if (w0 + u < end && i < rows) w[i * wstride + k - c.window + w0 + u] += L_s[i * T + u];
    }
    __syncthreads();
  }

  __device__ __forceinline__ void start_dense() {
    for (int i = 0; i < MAXROWS; ++i)
      for (int e = 0; e < DPT; ++e) dacc[i][e] = 0.0f;
  }

  // Thread (group, dim): tokens group, group + SG, ... of the tile, dims dim + e TPD. The
  // values of kDenseBatch of its tokens are loaded (read-only, rows past the end clamped to
  // the tile's first) before any is added: a trip to memory a batch, not a token (see
  // gather_dense_rows_as). The sums run in token order, as they did.
  static constexpr int kDenseBatch = 8;
  __device__ __forceinline__ void dense_values(const uint16_t *values, int64_t t0, int64_t end) {
    constexpr int U = T / SG, B = U < kDenseBatch ? U : kDenseBatch;  // tokens a thread, a batch
    static_assert(T % SG == 0 && U % B == 0, "whole batches");
    const int group = tid / TPD, dim = tid % TPD;
    AKV_NO_UNROLL
    for (int u0 = 0; u0 < U; u0 += B) {
      if (t0 + group + u0 * SG >= end) break;  // the batch's first token: none left
      uint16_t x[B][DPT];
      AKV_UNROLL
      for (int b = 0; b < B; ++b) {
        const int64_t t = t0 + group + (u0 + b) * SG;
        for (int e = 0; e < DPT; ++e) x[b][e] = load_ro(values + (t < end ? t : t0) * D + dim + e * TPD);
      }
      AKV_UNROLL
      for (int b = 0; b < B; ++b) {
        const int u = group + (u0 + b) * SG;
        if (t0 + u < end)
          for (int e = 0; e < DPT; ++e) {
            const float v = bits_to_float(x[b][e], bf16);
            for (int i = 0; i < MAXROWS; ++i) dacc[i][e] += L_s[i * T + u] * v;
          }
      }
    }
    __syncthreads();
  }

  // ---- the block's partial result --------------------------------------------------------

  __device__ __forceinline__ void write_partial(int64_t blk) {
    const int group = tid / TPD, dim = tid % TPD;
    // The prefix tiles' sums of p (lacc) by warp and row into red_s (free now; the barrier
    // below orders them before the rows' owners read them).
    for (int x = 0; x < PASSES; ++x) {
      float v = lacc[x];
      for (int o = RP; o < 32; o <<= 1) v += __shfl_xor_sync(kFullMask, v, o);
      if (lane < RP) red_s[warp * MAXROWS + x * RP + lane] = v;
    }
    // Sum over slot groups through shared memory (the key tile: SG * MAXROWS * D <= T * KS
    // floats), then write.
    float *scratch = K_s;
    for (int part = 0; part < 2; ++part) {
      // dacc's dims are dim + e TPD (coalesced value loads), racc's dim DPT + e (prefix_values).
      for (int i = 0; i < MAXROWS; ++i)
        for (int e = 0; e < DPT; ++e)
          scratch[(group * MAXROWS + i) * D + (part == 0 ? dim + e * TPD : dim * DPT + e)] = part == 0 ? dacc[i][e] : racc[i][e];
      __syncthreads();
      float *dst = part == 0 ? p.ws_o : p.ws_r;
      for (int e = tid; e < MAXROWS * D; e += NT) {
        float sum = 0.0f;
        for (int g = 0; g < SG; ++g) sum += scratch[g * MAXROWS * D + e];
        dst[blk * MAXROWS * D + e] = sum;
      }
      __syncthreads();
    }
    if (w == w_s) {  // else they are there already; a row at a time (no division an element)
      // With zeros up to a multiple of 4 (max_anchors is one): decode_anchor_values_kernel
      // reads a row's weights 16 bytes at a time and discards those past k, which were
      // otherwise never written (compute-sanitizer initcheck reported them).
      const int k4 = (k + 3) & ~3;
      for (int i = 0; i < MAXROWS; ++i)
        AKV_NO_UNROLL
        for (int e = tid; e < k4; e += NT) p.ws_w[(blk * MAXROWS + i) * p.max_anchors + e] = e < k ? w_s[i * k + e] : 0.0f;
    }
    for (int r = 0; r < RPW; ++r)  // the row's owner warp holds its running max and sum
      if (const int i = warp + r * NW; i < MAXROWS) {
        float l = warp_sum(l_part[r]);
        for (int w8 = 0; w8 < NW; ++w8) l += red_s[w8 * MAXROWS + i];
        if (lane == 0) {
          p.ws_ml[(blk * MAXROWS + i) * 2] = m_run[r];
          p.ws_ml[(blk * MAXROWS + i) * 2 + 1] = l;
        }
      }
  }
};

// Up to 8 rows and D 128: at most 128 registers, so that two blocks (16 warps) fit a
// multiprocessor. At D 256 a block's shared memory (SplitSmem: 157 KiB at 4 rows, 170 KiB at
// 8) leaves room for one, so the registers are not capped: capped, ptxas spilled inside the
// tile loop (10 and 3 local accesses at 4 and 8 rows).
template <int D, int MAXROWS, bool FAST, bool GPTJ = false>
__global__ void __launch_bounds__(kDecodeThreads, MAXROWS <= 8 && D <= 128 ? 2 : 1) decode_split_kernel(const __grid_constant__ DecodeLaunch p) {
#ifdef AKV_SIMT_EMULATION
  unsigned char *smem = ::simt::tl_block->dynamic.data();
#else
  extern __shared__ __align__(16) unsigned char smem[];
#endif
  using Block = SplitBlock<D, MAXROWS, FAST, GPTJ>;
  constexpr int T = Block::T;
  // The anchor values' and merge kernels may be placed once every split block has begun (they
  // wait for this grid to complete before they read what it writes): their launch and
  // set-up then run beside the last blocks instead of after them.
  launch_dependents();
  const int split = blockIdx.x;
  const int h = blockIdx.y / p.row_chunks, rc = blockIdx.y % p.row_chunks;
  const CacheView &c = *p.views[blockIdx.z];
  const int64_t block_index = split_block_index();
  const int splits = p.splits;
  Block blk(c, p, smem, h, rc, block_index);
  const int64_t suffix_len = c.suffix_len;

  if (c.kind == kKindAnchor) {
    const int P = c.prefix, tiles = (P + T - 1) / T;  // 32-bit tile bounds: fewer registers live across the loop
    const int u0 = Block::split_unit(P, c.window, split, splits), u1 = Block::split_unit(P, c.window, split + 1, splits);
    const int first_tile = u0 < tiles ? u0 : tiles, end_tile = u1 < tiles ? u1 : tiles;
    for (int tile = first_tile; tile < end_tile; ++tile) {
      const int t0 = tile * T, end = t0 + T < P ? t0 + T : P;
      if (blk.format3) {  // consecutive positions
        blk.anchor_meta(t0, end, false);
        __syncthreads();
      } else {
        blk.gapped = __syncthreads_or(blk.anchor_meta(t0, end, false)) != 0;
      }
      if (!blk.fast) {  // the fast path gathers the rows and takes the key residuals inside the contraction
        blk.gather_anchor_rows();
        __syncthreads();
        blk.key_residuals();
        __syncthreads();
      }
      if (!blk.fused || blk.gapped) {
        blk.rotate_keys();
        __syncthreads();
      }
      blk.settle_tile(blk.contract(t0, end, false, 0, true, true, true));
      // The block's last tile of the segment? Read before the values' loads and atomics (a
      // shared-memory load that would otherwise wait after their barrier).
      const bool flush = blk.segw && (blk.seg_s[1 + (tile & 1)] || tile + 1 == end_tile);
      blk.prefix_values(t0, end);
      if (flush) {
        blk.flush_segment();
      }
    }
    // This block's window tiles (split_unit), after its prefix tiles.
    const int w_end = Block::window_tile(u1, tiles) * T;
    for (int w0 = Block::window_tile(u0, tiles) * T; w0 < c.window && w0 < w_end; w0 += T) {
      const int end = w0 + T < c.window ? w0 + T : c.window;
      blk.gapped = false;  // a window's positions are consecutive
      blk.anchor_meta(w0, end, true);
      __syncthreads();
      if (!blk.fast) {
        blk.gather_anchor_rows();
        __syncthreads();
      }
      if (!blk.fused) {
        blk.rotate_keys();
        __syncthreads();
      }
      blk.contract(w0, end, false, 0, true);
      blk.template softmax_tile<false>();
      blk.window_values(w0, end);
    }
    blk.start_dense();  // the suffix's
  } else {
    blk.start_dense();
    const int64_t first = c.dense_start[h], count = c.dense_start[h + 1] - first;
    const uint16_t *keys = c.dense_keys + first * D, *values = c.dense_values + first * D;
    const int64_t tiles = (count + T - 1) / T;
    for (int64_t tile = tiles * split / splits; tile < tiles * (split + 1) / splits; ++tile) {
      const int64_t t0 = tile * T, end = t0 + T < count ? t0 + T : count;
      if constexpr (!FAST)  // dense caches never take the fast path; its tile loop's registers stay as they are
        if (end < count) blk.prefetch_dense(keys, values, end, end + T < count ? end + T : count);
      blk.gather_dense_rows(keys, t0, end);
      __syncthreads();
      blk.contract(t0, end, false, 0, false);
      blk.template softmax_tile<true>();
      blk.dense_values(values, t0, end);
    }
  }
  // The appended suffix's tiles, one a split in turn (split 0 alone took them all: a
  // straggler once a few hundred tokens were appended).
  {
    const uint16_t *keys = c.suffix_keys + static_cast<int64_t>(h) * c.suffix_capacity * D;
    const uint16_t *values = c.suffix_values + static_cast<int64_t>(h) * c.suffix_capacity * D;
    for (int64_t t0 = static_cast<int64_t>(split) * T; t0 < suffix_len; t0 += static_cast<int64_t>(splits) * T) {
      const int64_t end = t0 + T < suffix_len ? t0 + T : suffix_len;
      blk.gather_dense_rows(keys, t0, end);
      __syncthreads();
      blk.contract(t0, end, true, suffix_len, false);
      blk.template softmax_tile<true>();
      blk.dense_values(values, t0, end);
    }
  }
  blk.write_partial(block_index);
}

// Caches without RoPE on the register-gather path (DecodeLaunch::scores; docs/design.md §4.6):
// every anchor's logit for every row of a (request, head, row chunk), q . K_a with the queries
// scaled and rounded to bf16 as the split kernel's qb_s holds them (zero rows past `rows`) and
// fp32 sums, so that the split kernel looks a token's up (lookup_scores) where it would gather
// and contract its anchor's row. A block: kScoreAnchors anchors, four threads an anchor (rows
// x, x + 4, ...). Other caches' blocks return at once.
template <int D, int MAXROWS>
__global__ void __launch_bounds__(kDecodeThreads) decode_scores_kernel(const __grid_constant__ DecodeLaunch p) {
  static_assert(kDecodeThreads == 4 * kScoreAnchors && MAXROWS % 4 == 0 && D % 8 == 0, "four threads an anchor");
  AKV_STATIC_SHARED(float, q_s, [MAXROWS * D]);
  const int tid = threadIdx.x, x = blockIdx.y, b = blockIdx.z;
  const int h = x / p.row_chunks, rc = x % p.row_chunks;
  const CacheView &c = *p.views[b];
  if (c.kind != kKindAnchor || c.rope_pairs != 0) return;  // uniform across the block
  const int row0 = rc * MAXROWS, rows = p.rows - row0 < MAXROWS ? p.rows - row0 : MAXROWS;
  const int G = p.q_heads / p.heads;
  const int64_t qbase = ((static_cast<int64_t>(b) * p.q_heads + static_cast<int64_t>(h) * G) * p.q_len + row0) * D;
  const float qscale = c.softmax_scale * kLog2e;
  for (int e = tid; e < MAXROWS * D; e += kDecodeThreads)
    q_s[e] = e / D < rows ? bits_to_float(float_to_bits(load_elem(p.queries, AKV_DTYPE_BF16, qbase + e) * qscale, true), true)
                          : 0.0f;
  __syncthreads();
  const int a = blockIdx.x * kScoreAnchors + tid / 4, r0 = tid % 4;
  if (a >= c.anchors) return;
  const uint16_t *row = c.anchor_keys + (static_cast<int64_t>(h) * c.anchors + a) * D;
  constexpr int RPT = MAXROWS / 4;  // rows a thread
  float acc[RPT];
  for (int r = 0; r < RPT; ++r) acc[r] = 0.0f;
  for (int d = 0; d < D; d += 8) {
    float kf[8];
    unpack8(load_ro(reinterpret_cast<const uint4 *>(row + d)), true, kf);
    for (int r = 0; r < RPT; ++r)
      for (int j = 0; j < 8; ++j) acc[r] = fmaf(q_s[(r0 + 4 * r) * D + d + j], kf[j], acc[r]);
  }
  float *out = p.scores + ((static_cast<int64_t>(b) * p.heads + h) * p.row_chunks + rc) * p.max_anchors * MAXROWS +
               static_cast<int64_t>(a) * MAXROWS;
  for (int r = 0; r < RPT; ++r) out[r0 + 4 * r] = acc[r];
}

// decode_anchor_values_kernel's threads: thread (group, d0) takes DPT consecutive dims of every
// row (one vector load a row), so that SG = NT * DPT / D thread groups share the anchors;
// DPT x MAXROWS = 16 floats a thread and row set, so the groups' partial sums are NT x 16
// floats in shared memory.
template <int D, int MAXROWS>
struct MergeThreads {
  static constexpr int DPT = MAXROWS <= 4 ? 4 : MAXROWS <= 8 ? 2 : 1;
  static constexpr int TPR = D / DPT;  // threads a row set
  static constexpr int SG = kDecodeThreads / TPR;
  static_assert(TPR <= kDecodeThreads && kDecodeThreads % TPR == 0 && D % DPT == 0, "whole thread groups");
};

// decode_anchor_values_kernel's splits a batch of loads (kMergeBatch / 2 of a thread's, four
// anchors each).
constexpr int kMergeBatch = 8;

// Row i's overall max m and sum l over the splits of one (request, head, row chunk), and every
// split's factor exp2(m_s - m), by one warp: f[s], ml = {m, l}. A lane takes splits lane and
// lane + 32, each loaded once (one trip to L2; warp 0 walking the splits in turn took about
// ten, scripts/sass_count.py's merge_walk); the max and the sum by butterflies (a fixed order).
template <int MAXROWS>
__device__ __forceinline__ void row_factors(const DecodeLaunch &p, int64_t first_blk, int i, float *f, float *ml) {
  static_assert(kMaxSplits <= 64, "two splits a lane");
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int n = p.splits;
  const int s0 = lane, s1 = lane + 32;
  const float *ml0 = p.ws_ml + ((first_blk + (s0 < n ? s0 : n - 1)) * MAXROWS + i) * 2;
  const float *ml1 = p.ws_ml + ((first_blk + (s1 < n ? s1 : n - 1)) * MAXROWS + i) * 2;
  const float m0 = s0 < n ? ml0[0] : -INFINITY, m1 = s1 < n ? ml1[0] : -INFINITY;
  const float l0 = ml0[1], l1 = ml1[1];
  const float m = warp_max(fmaxf(m0, m1));
  const float f0 = m0 == -INFINITY ? 0.0f : exp2f(m0 - m), f1 = m1 == -INFINITY ? 0.0f : exp2f(m1 - m);
  if (s0 < n) f[s0] = f0;
  if (s1 < n) f[s1] = f1;
  const float l = warp_sum((f0 != 0.0f ? f0 * l0 : 0.0f) + (f1 != 0.0f ? f1 * l1 : 0.0f));
  if (lane == 0) {
    ml[0] = m;
    ml[1] = l;
  }
}
// Every row's: f_s[i], ml_s[i], a warp a row (rows warp, warp + 8, ...).
template <int MAXROWS>
__device__ __forceinline__ void split_factors(const DecodeLaunch &p, int64_t first_blk, int rows,
                                              float (*f_s)[kMaxSplits], float (*ml_s)[2]) {
  const int warp = static_cast<int>(threadIdx.x) / 32;
  for (int i = warp; i < rows; i += kDecodeThreads / 32) row_factors<MAXROWS>(p, first_blk, i, f_s[i], ml_s[i]);
}

// DPT floats from p (DPT | 4, 4 * DPT-byte aligned) in one load.
template <int DPT>
__device__ __forceinline__ void load_floats(const float *p, float (&x)[DPT]) {
  if constexpr (DPT == 4) {
    const float4 v = load_ro(reinterpret_cast<const float4 *>(p));
    x[0] = v.x, x[1] = v.y, x[2] = v.z, x[3] = v.w;
  } else if constexpr (DPT == 2) {
    const float2 v = load_ro(reinterpret_cast<const float2 *>(p));
    x[0] = v.x, x[1] = v.y;
  } else {
    static_assert(DPT == 1, "1, 2 or 4 floats");
    x[0] = load_ro(p);
  }
}

// DPT 16-bit values (bf16 or f16; 2 DPT-byte aligned) as one load's word, and as floats.
template <int DPT>
using HalvesWord = std::conditional_t<DPT == 4, uint2, std::conditional_t<DPT == 2, uint32_t, uint16_t>>;
template <int DPT>
__device__ __forceinline__ void unpack_halves(const HalvesWord<DPT> &v, bool bf16, float (&x)[DPT]) {
  if constexpr (DPT == 4) {
    x[0] = bits_to_float(static_cast<uint16_t>(v.x & 0xffffu), bf16), x[1] = bits_to_float(static_cast<uint16_t>(v.x >> 16), bf16);
    x[2] = bits_to_float(static_cast<uint16_t>(v.y & 0xffffu), bf16), x[3] = bits_to_float(static_cast<uint16_t>(v.y >> 16), bf16);
  } else if constexpr (DPT == 2) {
    x[0] = bits_to_float(static_cast<uint16_t>(v & 0xffffu), bf16), x[1] = bits_to_float(static_cast<uint16_t>(v >> 16), bf16);
  } else {
    static_assert(DPT == 1, "1, 2 or 4 values");
    x[0] = bits_to_float(v, bf16);
  }
}

// decode_anchor_values_kernel's blocks a multiprocessor, for ptxas's register budget: three
// (80 registers) where a thread's chunk of values (D / 8 registers) and accumulators fit them
// without spilling (D x rows 512: D 128 with 4 rows, the default, and D 64 with 8), two
// (128) up to D x rows 2048, else one (D 256 with 16 rows: 64 values a thread).
template <int D, int MAXROWS>
constexpr int kAnchorValueBlocks = D * MAXROWS == 512 ? 3 : D * MAXROWS <= 2048 ? 2 : 1;

// sum_a w_a V_a over the anchors [part * anchors_per_part, +anchors_per_part) of one
// (request, head, row chunk), w_a reduced across the splits: grid (anchor_parts, heads *
// row_chunks, requests), so that the anchors of a head spread over many blocks instead of
// one merge block walking all of them. Writes ws_av (zeros past the cache's anchors and for
// dense caches); the merge sums the parts. Thread (group, dim) as in the merge.
template <int D, int MAXROWS>
__global__ void __launch_bounds__(kDecodeThreads, kAnchorValueBlocks<D, MAXROWS>) decode_anchor_values_kernel(const __grid_constant__ DecodeLaunch p) {
  constexpr int NT = kDecodeThreads;
  // MergeThreads: the SG groups take the chunk's anchors in turn (8 at D 128 and 4 rows: 8
  // anchors a thread, whose loads ptxas issues together, against 32 one dim at a time).
  using MT = MergeThreads<D, MAXROWS>;
  constexpr int DPT = MT::DPT, TPR = MT::TPR, SG = MT::SG;
  constexpr int CH = kMergeAnchorChunk;  // anchors per chunk of combined weights
  AKV_STATIC_SHARED(float, f_s, [MAXROWS][kMaxSplits]);
  AKV_STATIC_SHARED(float, ml_s, [MAXROWS][2]);
  AKV_STATIC_SHARED(__align__(16) float, wc_s, [CH][MAXROWS]);  // by anchor: four rows a 16-byte load
  AKV_STATIC_SHARED(float, red_o, [SG * MAXROWS * D]);
  const int tid = threadIdx.x;
  const int group = tid / TPR, d0 = (tid % TPR) * DPT;
  const int part = blockIdx.x, x = blockIdx.y, b = blockIdx.z;
  const int h = x / p.row_chunks, rc = x % p.row_chunks;
  const CacheView &c = *p.views[b];
  const int row0 = rc * MAXROWS, rows = p.rows - row0 < MAXROWS ? p.rows - row0 : MAXROWS;
  const int64_t merge_blk = static_cast<int64_t>(b) * p.heads * p.row_chunks + x;
  const int64_t first_blk = merge_blk * p.splits;
  const int k = c.kind == kKindAnchor ? c.anchors : 0;
  const int a_begin = part * p.anchors_per_part;
  const int a_end = a_begin + p.anchors_per_part < k ? a_begin + p.anchors_per_part : k;
  float o[MAXROWS][DPT];
  for (int i = 0; i < MAXROWS; ++i)
    for (int e = 0; e < DPT; ++e) o[i][e] = 0.0f;
  // Launched while the split kernel may still run (programmatic dependent launch): the part's
  // value rows, which it does not write, asked into L2 first; then the wait for its sums.
  if (a_begin < a_end) {
    const char *rows_at = reinterpret_cast<const char *>(c.anchor_values + (static_cast<int64_t>(h) * k + a_begin) * D);
    const int bytes = (a_end - a_begin) * D * static_cast<int>(sizeof *c.anchor_values);  // at most 256 rows of 512 bytes
#pragma unroll 1
    for (int at = 128 * tid; at < bytes; at += 128 * NT) prefetch_l2(rows_at + at);
  }
  launch_dependents();  // the merge's blocks may be placed now; it waits for this grid's sums
  grid_dependency_wait();
  // The splits' factors whatever the cache (a dense one's are not used): their loads need not
  // wait for the view's anchor count.
  split_factors<MAXROWS>(p, first_blk, rows, f_s, ml_s);
  __syncthreads();
  if (a_begin < a_end) {  // uniform across the block
    const bool bf16 = c.storage_bf16 != 0;
    const uint16_t *av = c.anchor_values + static_cast<int64_t>(h) * k * D;
    constexpr int AV = CH / SG;  // a thread group's anchors of a chunk
    static_assert(CH % SG == 0 && MAXROWS % 4 == 0, "whole anchors a group, whole 16-byte loads of wc_s");
    for (int a0 = a_begin; a0 < a_end; a0 += CH) {
      const int a1 = a0 + CH < a_end ? a0 + CH : a_end;
      // The group's value rows of the chunk (anchors a0 + group + SG x), loaded first: they wait
      // on nothing the weights compute, so their trip to L2 runs beside the weights' (loaded
      // after the weights' barrier, two anchors a trip, they took four trips to L2 a chunk:
      // scripts/sass_count.py's merge_walk: 17128 -> 11232 cycles a block of 256 anchors).
      // Past a1 a group rereads its first row (anchor a0 where it has none), whose weight
      // there is 0.
      const int first = group < a1 - a0 ? group : 0, left = a1 - a0 - first;
      const HalvesWord<DPT> *vr = reinterpret_cast<const HalvesWord<DPT> *>(av + static_cast<int64_t>(a0 + first) * D + d0);
      HalvesWord<DPT> vw[AV];
      AKV_UNROLL
      for (int x = 0; x < AV; ++x) vw[x] = load_ro(vr + (SG * x < left ? SG * x : 0) * (D / DPT));
      {
        // The chunk's weights summed over the splits: thread (quad, j) takes four consecutive
        // anchors of one row (a 16-byte load a split: the plan keeps the workspace rows 16-byte
        // aligned) over splits j, j + TPQ, ..., B = kMergeBatch / 2 of them a batch, each batch
        // loaded while the one before is added (loaded under `f != 0`, one anchor a thread,
        // ptxas waited for each load before the next: a trip to L2 a split, 33 at 32K x 1;
        // scripts/sass_count.py's merge_walk); the TPQ partial sums then added by butterflies
        // (a fixed order). Indices clamped into the workspace; anchors past the part's end
        // (read, not written by the split kernels) give 0.
        constexpr int QUADS = MAXROWS * CH / 4, TPQ = NT / QUADS, B = kMergeBatch / 2;
        static_assert(NT % QUADS == 0 && (TPQ & (TPQ - 1)) == 0 && CH % 4 == 0, "whole quads of anchors");
        const int q = tid / TPQ, j = tid % TPQ;
        const int i = q / (CH / 4), a = a0 + (q % (CH / 4)) * 4;
        const float *wp = p.ws_w + (first_blk * MAXROWS + (i < rows ? i : rows - 1)) * p.max_anchors + (a < a_end ? a : a0);
        const int64_t stride = static_cast<int64_t>(MAXROWS) * p.max_anchors;  // a split's rows
        const int last = p.splits - 1;
        const auto load_batch = [&](int s0, float4 (&y)[B]) {
          for (int u = 0; u < B; ++u) {
            const int s = s0 + TPQ * u;
            y[u] = load_ro(reinterpret_cast<const float4 *>(wp + (s < last ? s : last) * stride));
          }
        };
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        float4 x[B];
        load_batch(j, x);
        for (int s0 = j; s0 < p.splits; s0 += TPQ * B) {
          float4 next[B];
          load_batch(s0 + TPQ * B, next);
          for (int u = 0; u < B; ++u) {
            const int s = s0 + TPQ * u;
            const float f = i < rows && s < p.splits ? f_s[i][s] : 0.0f;
            x[u] = f != 0.0f ? float4{f * x[u].x, f * x[u].y, f * x[u].z, f * x[u].w} : float4{0.0f, 0.0f, 0.0f, 0.0f};
          }
          for (int u = 0; u < B; ++u) {
            acc[0] += x[u].x, acc[1] += x[u].y, acc[2] += x[u].z, acc[3] += x[u].w;
            x[u] = next[u];
          }
        }
        for (int o = 1; o < TPQ; o <<= 1)
          for (int e = 0; e < 4; ++e) acc[e] += __shfl_xor_sync(kFullMask, acc[e], o);
        for (int e = j; e < 4; e += TPQ) wc_s[a - a0 + e][i] = a + e < a_end ? acc[e] : 0.0f;
      }
      __syncthreads();
      AKV_UNROLL
      for (int x = 0; x < AV; ++x) {  // past a1: a weight of 0 times a row read again (finite)
        float v[DPT];
        unpack_halves<DPT>(vw[x], bf16, v);
        const float4 *wa = reinterpret_cast<const float4 *>(wc_s[group + SG * x]);
        for (int i4 = 0; i4 < MAXROWS / 4; ++i4) {
          const float4 w4 = wa[i4];
          const float wi[4] = {w4.x, w4.y, w4.z, w4.w};
          for (int r = 0; r < 4; ++r)
            for (int e = 0; e < DPT; ++e) o[4 * i4 + r][e] += wi[r] * v[e];
        }
      }
      __syncthreads();
    }
  }
  for (int i = 0; i < MAXROWS; ++i)
    for (int e = 0; e < DPT; ++e) red_o[(group * MAXROWS + i) * D + d0 + e] = o[i][e];
  __syncthreads();
  float *out = p.ws_av + (merge_blk * p.anchor_parts + part) * MAXROWS * D;
  for (int e = tid; e < MAXROWS * D; e += NT) {
    float so = 0.0f;
    for (int g = 0; g < SG; ++g) so += red_o[g * MAXROWS * D + e];
    out[e] = so;
  }
}

// decode_merge_kernel's loads a batch (a thread's splits or anchor parts, one 16-byte load a
// side each), issued together while the batch before is added.
constexpr int kMergeRowBatch = 4;

// Row i of one (request, head, row chunk) after the splits' sums, by warp 0: the thread groups'
// sums (red_o, red_r: [SG][D]) added in group order, the one inverse Hadamard of the residual
// sums (U^T r = diag(signs) H r / sqrt(D)) in registers (warp_fwht: the same sums and
// differences in the same order as over shared memory, which took a barrier a stage), and the
// row written, a lane its D / 32 consecutive dims; its log-sum-exp where asked.
template <int D, int SG>
__device__ __forceinline__ void merge_row_out(const DecodeLaunch &p, const CacheView &c, bool anchor, int64_t base,
                                              int64_t lse_at, const float *red_o, const float *red_r, const float *ml) {
  constexpr int V = D / 32;
  constexpr int W = V % 4 == 0 ? 4 : 2;  // floats a shared-memory load
  static_assert(V % W == 0, "D / 32 a multiple of 2");
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const float norm = 1.0f / sqrtf(static_cast<float>(D));
  float sign[V], so[V], sr[V];
  for (int v = 0; v < V; ++v) {
    sign[v] = anchor ? c.signs[lane * V + v] : 1.0f;  // read before the sums: one wait on L2
    so[v] = sr[v] = 0.0f;
  }
  for (int g = 0; g < SG; ++g)
    for (int v = 0; v < V; v += W) {
      const int at = g * D + lane * V + v;
      if constexpr (W == 4) {
        const float4 x = *reinterpret_cast<const float4 *>(red_o + at), y = *reinterpret_cast<const float4 *>(red_r + at);
        so[v] += x.x, so[v + 1] += x.y, so[v + 2] += x.z, so[v + 3] += x.w;
        sr[v] += y.x, sr[v + 1] += y.y, sr[v + 2] += y.z, sr[v + 3] += y.w;
      } else {
        const float2 x = *reinterpret_cast<const float2 *>(red_o + at), y = *reinterpret_cast<const float2 *>(red_r + at);
        so[v] += x.x, so[v + 1] += x.y;
        sr[v] += y.x, sr[v + 1] += y.y;
      }
    }
  if (anchor) warp_fwht<V>(sr, lane);
  const float m = ml[0], l = ml[1], inv_l = l > 0.0f ? 1.0f / l : 0.0f;  // one division a lane
  for (int v = 0; v < V; ++v) {
    const int d = lane * V + v;
    const float rr = anchor ? sr[v] * norm * sign[v] : sr[v];
    store_elem(p.out, p.dtype, base + d, (so[v] + rr) * inv_l);
  }
  // m and l are base 2 (log2(e) folded into the queries): lse = ln(2) * (m + log2(l)).
  if (p.lse && lane == 0) p.lse[lse_at] = l > 0.0f ? 0.69314718f * (m + log2f(l)) : -INFINITY;
}

// Merge of the splits of one row of one (request, head, row chunk): grid (heads * row_chunks,
// requests, MAXROWS), a block a row (blocks past the chunk's rows leave at once), so that a
// small batch spreads over MAXROWS times the blocks and a thread holds one row: four dims of
// it (thread group, d0), SG = NT / (D / 4) groups taking the splits and then the anchor parts
// in turn, kMergeRowBatch of them a batch (all the splits of a group at 32K x 1 in two
// batches, where a block of all the chunk's rows waited on L2 once a split: five times;
// scripts/sass_count.py's merge_walk); the groups are summed through shared memory at the end.
// Two blocks a multiprocessor for ptxas's budget (128 registers): left to itself it took 80
// and waited on the loads more (4645 against 3942 cycles a block at 32K x 1).
template <int D, int MAXROWS>
__global__ void __launch_bounds__(kDecodeThreads, 2) decode_merge_kernel(const __grid_constant__ DecodeLaunch p) {
  constexpr int NT = kDecodeThreads, DPT = 4, TPR = D / DPT, SG = NT / TPR, B = kMergeRowBatch;
  static_assert(TPR <= NT && NT % TPR == 0, "whole thread groups");
  AKV_STATIC_SHARED(float, f_s, [kMaxSplits]);
  AKV_STATIC_SHARED(float, ml_s, [2]);
  AKV_STATIC_SHARED(__align__(16) float, red_o, [SG * D]);  // read 8 or 16 bytes a lane
  AKV_STATIC_SHARED(__align__(16) float, red_r, [SG * D]);
  const int tid = threadIdx.x;
  const int group = tid / TPR, d0 = (tid % TPR) * DPT;
  const int h = blockIdx.x / p.row_chunks, rc = blockIdx.x % p.row_chunks;
  const int b = blockIdx.y, i = blockIdx.z;  // i: the row of the chunk
  const int row0 = rc * MAXROWS;
  if (row0 + i >= p.rows) return;  // uniform across the block
  const CacheView &c = *p.views[b];
  const int G = p.q_heads / p.heads;
  const int parts = p.splits;
  const int64_t merge_blk = static_cast<int64_t>(b) * p.heads * p.row_chunks + blockIdx.x;
  const int64_t first_blk = merge_blk * parts;
  const bool anchor = c.kind == kKindAnchor;
  grid_dependency_wait();  // for the split (and anchor values) kernels' sums

  if (tid < 32) row_factors<MAXROWS>(p, first_blk, i, f_s, ml_s);
  __syncthreads();
  // A group's splits (then anchor parts) s, s + SG, ...: a batch loaded while the one before is
  // added (loaded under `f != 0`, or each product added as it came, ptxas waited for each load
  // before the next), the indices clamped into the written rows (every split block writes all
  // MAXROWS rows, decode_anchor_values_kernel every part's); the products taken apart from the
  // sums, added in split order.
  const int64_t stride = static_cast<int64_t>(MAXROWS) * D;  // a split's (a part's) rows
  const int64_t at = static_cast<int64_t>(i) * D + d0;
  const float *op = p.ws_o + first_blk * stride + at, *rp = p.ws_r + first_blk * stride + at;
  float o[DPT] = {}, r[DPT] = {};
  // sum_a w_a V_a: the parts of decode_anchor_values_kernel, their first batch loaded beside the
  // splits' (not after them: a third wait on L2).
  const float *av = p.ws_av + merge_blk * p.anchor_parts * stride + at;
  const int n = anchor ? p.anchor_parts : 0;
  const auto load_parts = [&](int q0, float4 (&y)[B]) {
    for (int u = 0; u < B; ++u) {
      const int q = q0 + SG * u;
      y[u] = load_ro(reinterpret_cast<const float4 *>(av + (q < n ? q : n - 1) * stride));
    }
  };
  // At most one split (part) a group, a large batch's few splits: one load a side, not a batch
  // of copies of it.
  const bool few_splits = parts <= SG, few_parts = n <= SG;
  float4 x[B];
  if (anchor && few_parts) x[0] = group < n ? load_ro(reinterpret_cast<const float4 *>(av + group * stride)) : float4{0.0f, 0.0f, 0.0f, 0.0f};
  else if (anchor) load_parts(group, x);
  if (few_splits) {
    if (group < parts) {
      const float4 yo = load_ro(reinterpret_cast<const float4 *>(op + group * stride));
      const float4 yr = load_ro(reinterpret_cast<const float4 *>(rp + group * stride));
      const float f = f_s[group];
      if (f != 0.0f) {
        o[0] = f * yo.x, o[1] = f * yo.y, o[2] = f * yo.z, o[3] = f * yo.w;
        r[0] = f * yr.x, r[1] = f * yr.y, r[2] = f * yr.z, r[3] = f * yr.w;
      }
    }
  } else {
    const auto load_batch = [&](int s0, float4 (&yo)[B], float4 (&yr)[B]) {
      for (int u = 0; u < B; ++u) {
        const int s = s0 + SG * u;
        const int64_t x = (s < parts ? s : parts - 1) * stride;
        yo[u] = load_ro(reinterpret_cast<const float4 *>(op + x));
        yr[u] = load_ro(reinterpret_cast<const float4 *>(rp + x));
      }
    };
    float4 xo[B], xr[B];
    load_batch(group, xo, xr);
    for (int s0 = group; s0 < parts; s0 += SG * B) {
      float4 no[B], nr[B];
      load_batch(s0 + SG * B, no, nr);
      for (int u = 0; u < B; ++u) {
        const int s = s0 + SG * u;
        const float f = s < parts ? f_s[s] : 0.0f;
        const float4 yo = f != 0.0f ? float4{f * xo[u].x, f * xo[u].y, f * xo[u].z, f * xo[u].w} : float4{0.0f, 0.0f, 0.0f, 0.0f};
        const float4 yr = f != 0.0f ? float4{f * xr[u].x, f * xr[u].y, f * xr[u].z, f * xr[u].w} : float4{0.0f, 0.0f, 0.0f, 0.0f};
        o[0] += yo.x, o[1] += yo.y, o[2] += yo.z, o[3] += yo.w;
        r[0] += yr.x, r[1] += yr.y, r[2] += yr.z, r[3] += yr.w;
        xo[u] = no[u];
        xr[u] = nr[u];
      }
    }
  }
  if (anchor && few_parts) {
    o[0] += x[0].x, o[1] += x[0].y, o[2] += x[0].z, o[3] += x[0].w;
  } else if (anchor) {
    for (int q0 = group; q0 < n; q0 += SG * B) {
      float4 nx[B];
      load_parts(q0 + SG * B, nx);
      for (int u = 0; u < B; ++u) {
        if (q0 + SG * u < n) o[0] += x[u].x, o[1] += x[u].y, o[2] += x[u].z, o[3] += x[u].w;
        x[u] = nx[u];
      }
    }
  }
  for (int e = 0; e < DPT; ++e) {
    red_o[group * D + d0 + e] = o[e];
    red_r[group * D + d0 + e] = r[e];
  }
  __syncthreads();
  if (tid < 32) {
    const int64_t row = (static_cast<int64_t>(b) * p.q_heads + static_cast<int64_t>(h) * G) * p.q_len + row0 + i;
    merge_row_out<D, SG>(p, c, anchor, row * D, row, red_o, red_r, ml_s);
  }
}

// Append: rows [suffix_len, suffix_len + n) of every head, RoPE applied to keys unless they
// arrive rotated. grid (n, H), 64 threads. The length itself advances in append_commit.
__global__ void append_rows_kernel(const __grid_constant__ AppendLaunch a) {
  CacheView &c = *a.view;
  const int i = blockIdx.x, h = blockIdx.y, D = c.head_dim;
  const int64_t row = static_cast<int64_t>(c.suffix_len) + i;
  // Past the capacity (replays beyond the reservation): dropped, counted by the commit.
  if (row >= c.suffix_capacity) return;
  const int32_t position = a.implicit ? c.next_position + i : a.positions[i];
  if (h == 0 && threadIdx.x == 0) c.suffix_positions[row] = position;
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
      rope_angle(position, c.inv_freq[j], &cs, &sn);
      const float x0 = load_elem(a.keys, a.dtype, src + f), x1 = load_elem(a.keys, a.dtype, src + s);
      c.suffix_keys[dst + f] = float_to_bits(x0 * cs - x1 * sn, bf16);
      c.suffix_keys[dst + s] = float_to_bits(x0 * sn + x1 * cs, bf16);
    }
}

// After append_rows_kernel with the same launch: the length and the next position advance;
// tokens past the capacity are counted in `dropped`, never written.
__global__ void append_commit_kernel(const __grid_constant__ AppendLaunch a) {
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    CacheView *view = a.view;
    int32_t len = view->suffix_len + a.n;
    if (len > view->suffix_capacity) {
      view->dropped += len - view->suffix_capacity;
      len = view->suffix_capacity;
    }
    view->suffix_len = len;
    view->next_position = a.implicit ? view->next_position + a.n : a.positions[a.n - 1] + 1;
  }
}

}  // namespace cuda
}  // namespace akv
