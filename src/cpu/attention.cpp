#include "cpu/attention.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <utility>
#include <vector>
#include "core/dtype.hpp"
#include "core/anchor_access.hpp"
#include "core/error.hpp"
#include "core/method_traits.hpp"
#include "core/thread_pool.hpp"
#include "cpu/kernels.hpp"
#include "cpu/quantized_attention.hpp"

namespace akv {
namespace {

// The decodes' query rows are padded with zero rows to a multiple of four, so that tokens
// and rows are contracted four by four (G = 3 would otherwise go one row at a time).
inline int rows_in_fours(int rows) { return (rows + 3) / 4 * 4; }

#ifdef AKV_HAVE_AVX512_KERNELS
// The logits of four tokens (xs) against `rows` query rows, four rows per block: L[r * ldl + j]
// for r < rows, j < 4. q holds rows_in_fours(rows) rows. Staged through a block: vector
// stores straight into L were slower.
AKV_TARGET_AVX512 inline __attribute__((always_inline)) void logits4x4_avx512(const float *q, int D, int rows,
                                                                              const float *const (&xs)[4], float *L,
                                                                              int64_t ldl) {
  for (int r0 = 0; r0 < rows; r0 += 4) {
    alignas(64) float block[16];
    float *const out[4] = {block, block + 4, block + 8, block + 12};
    dot_rows4x4_avx512(q + static_cast<size_t>(r0) * D, D, xs, D, out);
    for (int r = 0; r < 4 && r0 + r < rows; ++r)
      for (int j = 0; j < 4; ++j) L[(r0 + r) * ldl + j] = block[r * 4 + j];
  }
}

// dense_logits' whole blocks of four tokens; returns the tokens done.
AKV_TARGET_AVX512 int64_t dense_logits_avx512(const uint16_t *keys, int64_t n, int D, akv_dtype storage, const float *q,
                                              int rows, float *L, int64_t ldl, int64_t offset) {
  AlignedFloats buf(static_cast<size_t>(4) * D);
  const float *const xs[4] = {buf.data(), buf.data() + D, buf.data() + 2 * D, buf.data() + 3 * D};
  int64_t t = 0;
  for (; t + 4 <= n; t += 4) {
    for (int j = 0; j < 4; ++j) half_row(keys + (t + j) * D, storage, D, buf.data() + j * D);
    logits4x4_avx512(q, D, rows, xs, L + offset + t, ldl);
  }
  return t;
}
#endif

// Dense keys/values [n][D] (post-RoPE, storage dtype): logits into L[i][offset + t] for the
// `rows` query rows of q, which holds rows_in_fours(rows) rows.
void dense_logits(const uint16_t *keys, int64_t n, int D, akv_dtype storage, const float *q, int rows,
                  float *L, int64_t ldl, int64_t offset) {
  int64_t t = 0;
#ifdef AKV_HAVE_AVX512_KERNELS
  if (has_avx512() && D % 16 == 0) t = dense_logits_avx512(keys, n, D, storage, q, rows, L, ldl, offset);
#endif
  AlignedFloats k(D), logit(rows);
  for (; t < n; ++t) {
    half_row(keys + t * D, storage, D, k.data());
    dot_rows(q, D, rows, k.data(), D, logit.data());
    for (int i = 0; i < rows; ++i) L[i * ldl + offset + t] = logit[i];
  }
}

// acc[i] += sum_t P[i][offset + t] v_t over n dense value rows, 64 rows widened at a time and
// added by the register-blocked kernel (four accumulator rows at a time: callers may pad the
// rows with zero weights to use it).
void dense_values(const uint16_t *values, int64_t n, int D, akv_dtype storage, const float *P, int rows,
                  int64_t ldp, int64_t offset, float *acc) {
  constexpr int kBlock = 64;
  AlignedFloats block(static_cast<size_t>(kBlock) * D);
  for (int64_t t0 = 0; t0 < n; t0 += kBlock) {
    const int nb = static_cast<int>(std::min<int64_t>(kBlock, n - t0));
    for (int j = 0; j < nb; ++j) half_row(values + (t0 + j) * D, storage, D, &block[static_cast<size_t>(j) * D]);
    const float *w = P + offset + t0;
#ifdef AKV_HAVE_AVX512_KERNELS
    if (has_avx512() && accumulate_weighted_rows_avx512(acc, rows, w, ldp, block.data(), nb, D)) continue;
#endif
    accumulate_weighted_rows(acc, rows, w, ldp, block.data(), nb, D);
  }
}

constexpr int64_t kTile = Rope::kTile;
static_assert(kTile <= 256, "a tile of positions lies in one format-3 segment (segments have >= 256)");
// The AnchorKV decode's coefficient table is used while it fits here and each anchor serves
// at least kTokensPerAnchor prompt tokens on average (see AnchorHead).
constexpr size_t kCoefficientTableBytes = size_t{1} << 20;
constexpr int64_t kTokensPerAnchor = 16;
// The AnchorKV decode's unit of work over the prefix (AnchorHead::chunks): a multiple of
// kTile, long enough that a chunk's start (exact RoPE angles, the walk's set-up, its part of
// the value side) costs little beside its walk.
constexpr int64_t kDecodeChunk = 4096;
static_assert(kDecodeChunk % kTile == 0, "chunks of whole tiles");
inline int64_t decode_chunks(int64_t prefix) { return (prefix + kDecodeChunk - 1) / kDecodeChunk; }
std::atomic<int> forced_prefix_logits{static_cast<int>(PrefixLogits::kAuto)};

}  // namespace

namespace {

// What one walk over a run of a head's prefix tiles changes (AnchorHead::begin_walk): the
// format-3 segment it is in and that segment's key coefficients, the anchor-token cursor and
// the scratch rows. The chunks of a head are walked by as many threads as share them out.
struct PrefixWalk {
  int64_t lut_segment = -1;  // format 3: the segment of segment_table and key_gamma
  const uint16_t *segment_table = nullptr;
  float key_gamma[256] = {};
  std::vector<float> seg_scores;  // no RoPE with segment tables: the segment's scores by entry, [crows][256]
  int64_t next_anchor = 0, next_anchor_token = -1;  // format 3: the next anchor token at or after the walk
  AlignedFloats x, x2, x3, x4, logit, logit2;  // rebuilt keys, logits of a token or two
  AlignedFloats r;                             // a decoded key residual
};

// Decode state of one AnchorKV head: this step's queries (and the per-anchor RoPE coefficients
// where that path is taken) and the logits of every cached token. The work is split so that a
// thread pool can share one head out (decode_cpu): the prefix in chunks, each walked tile by
// tile by prefix_tile() (the heads of a group share each tile's RoPE angles) and closed
// (close_chunk: penalties, row maxima), the window and suffix (tail_logits); then each
// chunk's softmax numerators and value residuals (chunk_values, tail_values); then combine()
// adds the parts, the per-anchor weights and the anchor values.
class AnchorHead {
 public:
  AnchorHead(const akv_cache &cache, int h, const float *q, int32_t q_len)
      : c_(cache), h_(h), q_len_(q_len), D_(cache.meta.shape.head_dim),
        rows_(cache.meta.shape.num_q_heads / cache.meta.shape.num_kv_heads * q_len),
        rope_(cache.rope), g_(cache.geometry), storage_(cache.meta.storage),
        pairs_(cache.rope.enabled() ? cache.rope.pairs() : 0), two_p_(2 * pairs_) {
    const int k = g_.anchors;
    const int64_t P = g_.prefix, words = g_.words;
    total_ = cache.meta.shape.seq_len + cache.suffix_len;
    chunks_ = decode_chunks(P);
    max_.assign(static_cast<size_t>(chunks_ + 1) * rows_, 0.0f);
    sums_.assign(static_cast<size_t>(chunks_ + 1) * rows_, 0.0f);
    wpart_.resize(chunks_);
    wlo_.assign(chunks_, 0);
    // Fold the softmax scale into the queries once instead of scaling every logit.
    crows_ = rows_in_fours(rows_);
    racc_.assign(static_cast<size_t>(chunks_) * crows_ * cache.codec.rotated_dim(), 0.0f);
    tail_acc_.assign(static_cast<size_t>(crows_) * D_, 0.0f);
    q_.assign(static_cast<size_t>(crows_) * D_, 0.0f);
    for (size_t e = 0; e < static_cast<size_t>(rows_) * D_; ++e) q_[e] = q[e] * cache.meta.softmax_scale;
    L_.resize(static_cast<size_t>(rows_) * total_);
    ak_ = cache.section<uint16_t>(kAnchorKeys) + static_cast<int64_t>(h) * k * D_;
    kidx_ = cache.section<uint16_t>(kKeyIndex) + h * P;
    kgam_ = cache.section<uint16_t>(kKeyGamma) + h * P;
    kmask_ = cache.section<uint64_t>(kKeyMask) + h * words;
    kprefix_ = cache.section<uint32_t>(kKeyPrefix) + h * words;
    kbase_ = cache.section<uint32_t>(kKeyOffsets)[h];
    kcodes_ = cache.section<uint8_t>(kKeyCodes);
    kscales_ = cache.section<float>(kKeyScales);
    if (g_.format == 3) {  // one-byte indices into the segment's table, coefficient codes
      kidx8_ = cache.section<uint8_t>(kKeyIndex) + h * P;
      kcode_ = cache.section<uint8_t>(kKeyGamma) + h * P;
      tables_ = g_.table_size ? cache.section<uint16_t>(kSegmentTables) + static_cast<int64_t>(h) * g_.segments * g_.table_size
                              : nullptr;
      scales_ = cache.section<float>(kGammaScales) + static_cast<int64_t>(h) * g_.segments * 2;
      free_anchors_ = k - g_.window;
      anchor_tokens_ = cache.section<int64_t>(kAnchorTokens) + h * free_anchors_;
    }
    neox_ = pairs_ && rope_.style == AKV_ROPE_NEOX;
    wide_ = has_avx512() &&
            forced_prefix_logits.load(std::memory_order_relaxed) != static_cast<int>(PrefixLogits::kGatherAvx2);
    const bool gptj = pairs_ && rope_.style == AKV_ROPE_GPTJ;
    wide_walk_ = wide_ && (neox_ || gptj) && D_ % 16 == 0 && pairs_ % 16 == 0;
    if (wide_walk_ && gptj) {  // the walk rebuilds GPT-J keys in NeoX order: the queries' dims to match
      gptj_walk_ = true;
      walk_q_gptj_.assign(q_.size(), 0.0f);
      for (int i = 0; i < crows_; ++i) {
        const float *from = &q_[static_cast<size_t>(i) * D_];
        float *to = &walk_q_gptj_[static_cast<size_t>(i) * D_];
        for (int j = 0; j < pairs_; ++j) {
          to[j] = from[2 * j];
          to[pairs_ + j] = from[2 * j + 1];
        }
        for (int d = 2 * pairs_; d < D_; ++d) to[d] = from[d];
      }
    }
    const size_t rdim = cache.codec.rotated_dim();
    if (wide_ && (rdim == 64 || rdim == 128 || rdim == 256)) {  // decode_residual_avx512's norm * sign
      const float norm = 1.0f / std::sqrt(static_cast<float>(rdim));
      for (float sgn : cache.codec.signs()) norm_signs_.push_back(norm * sgn);
    }
    // Two ways to the prefix logits. The coefficient table (build_coefficients) costs
    // entries*rows*D per step and as many floats, then rows*D multiply-adds per token read
    // from it; the gather path rebuilds each token's key from its anchor row instead (D*2
    // bytes from a table that stays in L2), rotates it and contracts it with every row. The
    // table wins when it stays in this core's L2 and each entry serves enough tokens to pay
    // for its row (format 2, S = 16K on a 2 MiB-L2 Xeon, one thread: 5x 71 -> 17 ms per
    // decode, 10x 16 -> 12 ms with the gather path; 20x 8.0 ms with the table, 9.5 ms
    // without). Format 3 always gathers: with segment tables (k > 256) a table built per
    // segment (256 entries for at most 4096 tokens) was measured slower than the walk, and
    // without them (k <= 256) the walk with rows blocked in fours is faster too (one thread,
    // 20x: 2K 833 -> 655 us, 8K 3.49 -> 2.40 ms at H 8, Hq 32, D 128; 8K 927 -> 624 us at
    // H 3, Hq 9, D 64).
    //
    // Without RoPE (keys handed post-RoPE with the cache told there is none: the anchors and
    // residuals fitted after the rotation) the table is one score q.K_a per anchor and row,
    // k x rows x D multiply-adds a step, and a token's logit is gamma times its anchor's score
    // plus its residual's term: the table then always wins (P >= k), with or without segment
    // tables (prefix_tile_scores).
    const bool segment_tables = g_.format == 3 && g_.table_size;
    const size_t table = static_cast<size_t>(k) * rows_ * std::max(two_p_, 1) * sizeof(float);
    switch (static_cast<PrefixLogits>(forced_prefix_logits.load(std::memory_order_relaxed))) {
      case PrefixLogits::kTable: gather_ = segment_tables && pairs_; break;
      case PrefixLogits::kGather:
      case PrefixLogits::kGatherAvx2: gather_ = true; break;
      case PrefixLogits::kAuto:
        gather_ = pairs_ && (g_.format == 3 || table > kCoefficientTableBytes || P < kTokensPerAnchor * k);
        break;
    }
    if (gather_) return;
    if (!pairs_) {  // every anchor's score, [crows][k]: the blocked dense contraction
      scores_.assign(static_cast<size_t>(crows_) * k, 0.0f);
      dense_logits(ak_, k, D_, storage_, q_.data(), rows_, scores_.data(), k, 0);
      return;
    }
    std::vector<uint8_t> in_pair(D_, 0);
    for (int j = 0; j < pairs_; ++j) in_pair[rope_.first[j]] = in_pair[rope_.second[j]] = 1;
    for (int d = 0; d < D_; ++d)
      if (!in_pair[d]) plain_.push_back(d);
    coef_.resize(static_cast<size_t>(k) * rows_ * two_p_);
    coefC_.assign(static_cast<size_t>(k) * rows_, 0.0f);
    build_coefficients(k);
  }

  // Per (anchor, row): q.R_t K_a = C + sum_j A_j cos(t w_j) + B_j sin(t w_j)  (docs/design.md §4.1),
  // laid out [anchor][row][A_0..A_{pairs-1}, B_0..B_{pairs-1}] so that, with a token's angles
  // stored as [cos | sin], its logit is one dot product of length 2*pairs. The dimensions
  // outside the rotary pairs (partial rotary) add the constant C.
  void build_coefficients(int count) {
    std::vector<float> x(D_);
    const int P2 = pairs_;
    for (int e = 0; e < count; ++e) {
      half_row(ak_ + static_cast<int64_t>(e) * D_, storage_, D_, x.data());
      const float *x0 = x.data(), *x1 = x.data() + P2;
      for (int i = 0; i < rows_; ++i) {
        const float *qi = &q_[static_cast<size_t>(i) * D_];
        float *A = coef_.data() + (static_cast<size_t>(e) * rows_ + i) * two_p_, *B = A + P2;
        if (neox_) {
          const float *q0 = qi, *q1 = qi + P2;
#pragma omp simd
          for (int j = 0; j < P2; ++j) {
            A[j] = q0[j] * x0[j] + q1[j] * x1[j];
            B[j] = q1[j] * x0[j] - q0[j] * x1[j];
          }
        } else {
          for (int j = 0; j < P2; ++j) {
            const int f = rope_.first[j], s = rope_.second[j];
            A[j] = qi[f] * x[f] + qi[s] * x[s];
            B[j] = qi[s] * x[f] - qi[f] * x[s];
          }
        }
        float cst = 0.0f;
        for (int d : plain_) cst += qi[d] * x[d];
        coefC_[static_cast<size_t>(e) * rows_ + i] = cst;
      }
    }
  }

  // Logits of prefix tokens t0..t0+n-1; trig holds [cos | sin] (2*pairs floats) per token.
  // Keys are never materialised except the decoded residual of tokens that store one.
  void prefix_tile(PrefixWalk &w, int64_t t0, int64_t n, const float *trig) {
    const int64_t seg = g_.format == 3 ? g_.segment_of(t0) : 0;  // a tile lies in one segment
    if (g_.format == 3 && seg != w.lut_segment) enter_segment(w, seg);
    if (gather_) return prefix_tile_gather(w, t0, n, trig);
    if (!pairs_) return prefix_tile_scores(w, t0, n);
    for (int64_t u = 0; u < n; ++u) {
      const int64_t t = t0 + u;
      const float *cs = trig + u * two_p_;
      int a;
      float gam;
      if (g_.format == 2) {
        a = kidx_[t];
        gam = bf16_to_float(kgam_[t]);
      } else {
        a = format3_anchor(w, t, &gam);  // no segment tables on this path (k <= 256)
      }
      dot_rows(coef_.data() + static_cast<size_t>(a) * rows_ * two_p_, two_p_, rows_, cs, two_p_, w.logit.data());
      const float *C = &coefC_[static_cast<size_t>(a) * rows_];
      for (int i = 0; i < rows_; ++i) L_[i * total_ + t] = gam * (C[i] + w.logit[i]);
      if (decode_key_residual(w, t)) {
        if (pairs_) rope_.apply(w.r.data(), cs, cs + pairs_);
        dot_rows(q_.data(), D_, rows_, w.r.data(), D_, w.logit.data());
        for (int i = 0; i < rows_; ++i) L_[i * total_ + t] += w.logit[i];
      }
    }
  }

  // Without RoPE: per row, gamma times its anchor's score a token, then the tokens with a key
  // residual add its term. Format 3 reads the segment's scores by table entry (w.seg_scores,
  // enter_segment) and the coefficient by code, with no branch a token: the anchor tokens
  // (stored as entry 0, code 0) are then overwritten with their own scores.
  void prefix_tile_scores(PrefixWalk &w, int64_t t0, int64_t n) {
    const int k = g_.anchors;
    if (g_.format == 2) {
      for (int64_t u = 0; u < n; ++u) {
        const int64_t t = t0 + u;
        const float gam = bf16_to_float(kgam_[t]);
        const float *s = &scores_[kidx_[t]];
        for (int i = 0; i < rows_; ++i) L_[i * total_ + t] = gam * s[static_cast<size_t>(i) * k];
      }
    } else {
      const float *sc = w.segment_table ? w.seg_scores.data() : scores_.data();
      const int64_t stride = w.segment_table ? kTableEntries : k;
      int64_t u = 0;
#ifdef AKV_HAVE_AVX512_KERNELS
      if (wide_) u = scores_tile_avx512(w, t0, n, sc, stride);
#endif
      for (; u < n; ++u) {
        const int64_t t = t0 + u;
        const float gam = w.key_gamma[kcode_[t]];
        for (int i = 0; i < rows_; ++i) L_[i * total_ + t] = gam * sc[i * stride + kidx8_[t]];
      }
      for (; w.next_anchor_token >= 0 && w.next_anchor_token < t0 + n; ++w.next_anchor) {  // format3_anchor's list
        for (int i = 0; i < rows_; ++i)
          L_[i * total_ + w.next_anchor_token] = scores_[static_cast<size_t>(i) * k + w.next_anchor];
        w.next_anchor_token = w.next_anchor + 1 < free_anchors_ ? anchor_tokens_[w.next_anchor + 1] : -1;
      }
    }
    for (int64_t t = t0; t < t0 + n; ++t) {
      if (!decode_key_residual(w, t)) continue;
      dot_rows(q_.data(), D_, rows_, w.r.data(), D_, w.logit.data());
      for (int i = 0; i < rows_; ++i) L_[i * total_ + t] += w.logit[i];
    }
  }
#ifdef AKV_HAVE_AVX512_KERNELS
  // The same, sixteen tokens at a time (entries and codes widened, the scores and the
  // coefficients gathered); returns the tokens done.
  AKV_TARGET_AVX512 int64_t scores_tile_avx512(PrefixWalk &w, int64_t t0, int64_t n, const float *sc, int64_t stride) {
    int64_t u = 0;
    // Masked forms with all lanes set: the plain ones' undefined source operands make GCC 12
    // warn (-Wmaybe-uninitialized).
    const __m512 zero = _mm512_setzero_ps();
    for (; u + 16 <= n; u += 16) {
      const __m128i entries = _mm_loadu_si128(reinterpret_cast<const __m128i *>(kidx8_ + t0 + u));
      const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i *>(kcode_ + t0 + u));
      const __m512i entry = _mm512_maskz_cvtepu8_epi32(0xffff, entries);
      const __m512 gam = _mm512_mask_i32gather_ps(zero, 0xffff, _mm512_maskz_cvtepu8_epi32(0xffff, codes), w.key_gamma, 4);
      for (int i = 0; i < rows_; ++i)
        _mm512_storeu_ps(&L_[i * total_ + t0 + u],
                         _mm512_mul_ps(gam, _mm512_mask_i32gather_ps(zero, 0xffff, entry, sc + i * stride, 4)));
    }
    return u;
  }
#endif

  // The same logits with each token's key rebuilt pre-RoPE (gamma K_a plus its decoded
  // residual), rotated once and contracted with the group's rows.
  void prefix_tile_gather(PrefixWalk &w, int64_t t0, int64_t n, const float *trig) {
#ifdef AKV_HAVE_AVX512_KERNELS
    if (wide_walk_) return prefix_tile_gather_avx512(w, t0, n, trig);
#endif
    // Two tokens at a time share the loads of the query rows in the contraction.
    int64_t u = 0;
    for (; u + 2 <= n; u += 2) {
      rebuild_key(w, t0 + u, trig + u * two_p_, w.x.data());
      rebuild_key(w, t0 + u + 1, trig + (u + 1) * two_p_, w.x2.data());
      dot_rows2(q_.data(), D_, crows_, w.x.data(), w.x2.data(), D_, w.logit.data(), w.logit2.data());
      store_pair(w, t0 + u);
    }
    for (; u < n; ++u) {
      rebuild_key(w, t0 + u, trig + u * two_p_, w.x.data());
      dot_rows(q_.data(), D_, rows_, w.x.data(), D_, w.logit.data());
      for (int i = 0; i < rows_; ++i) L_[i * total_ + t0 + u] = w.logit[i];
    }
  }

#ifdef AKV_HAVE_AVX512_KERNELS
  // The same walk with sixteen-lane kernels (NeoX or GPT-J pairs, D and pairs multiples of 16;
  // GPT-J keys rebuilt in NeoX order and contracted with the queries' dims reordered to match,
  // walk_q()): keys rebuilt sixteen lanes at a time and, where the rows come in fours, four
  // tokens contracted against four rows per block; the remaining tokens (and other row
  // counts) in pairs as above.
  // Always inlined into the walk (a call a token otherwise): 2-7% of the decode at SmolLM2's
  // shape (H 3, D 64, 32K, one thread), 1-2% at D 128.
  AKV_TARGET_AVX512 inline __attribute__((always_inline)) void rebuild_key_avx512(PrefixWalk &w, int64_t t, const float *cs,
                                                                                float *x) {
    const KeySource k = key_source(w, t);
    const bool done = gptj_walk_ ? key_row_avx512<true>(k.anchor, storage_, k.gamma, k.residual, cs, cs + pairs_, pairs_, D_, x)
                                 : key_row_avx512<false>(k.anchor, storage_, k.gamma, k.residual, cs, cs + pairs_, pairs_, D_, x);
    if (!done) generic_key(k, cs, x);  // not for GPT-J: wide_walk_ takes it only where the row kernel applies
  }
  AKV_TARGET_AVX512 void prefix_tile_gather_avx512(PrefixWalk &w, int64_t t0, int64_t n, const float *trig) {
    int64_t u = 0;
    {  // four tokens against four rows at a time (rows padded to fours): one reduction per block
      float *x[4] = {w.x.data(), w.x2.data(), w.x3.data(), w.x4.data()};
      const float *const xs[4] = {x[0], x[1], x[2], x[3]};
      for (; u + 4 <= n; u += 4) {
        for (int j = 0; j < 4; ++j) rebuild_key_avx512(w, t0 + u + j, trig + (u + j) * two_p_, x[j]);
        logits4x4_avx512(walk_q(), D_, rows_, xs, L_.data() + t0 + u, total_);
      }
    }
    for (; u + 2 <= n; u += 2) {
      rebuild_key_avx512(w, t0 + u, trig + u * two_p_, w.x.data());
      rebuild_key_avx512(w, t0 + u + 1, trig + (u + 1) * two_p_, w.x2.data());
      dot_rows2(walk_q(), D_, crows_, w.x.data(), w.x2.data(), D_, w.logit.data(), w.logit2.data());
      store_pair(w, t0 + u);
    }
    for (; u < n; ++u) {
      rebuild_key_avx512(w, t0 + u, trig + u * two_p_, w.x.data());
      dot_rows(walk_q(), D_, rows_, w.x.data(), D_, w.logit.data());
      for (int i = 0; i < rows_; ++i) L_[i * total_ + t0 + u] = w.logit[i];
    }
  }
#endif

  void store_pair(PrefixWalk &w, int64_t t) {
    for (int i = 0; i < rows_; ++i) {
      L_[i * total_ + t] = w.logit[i];
      L_[i * total_ + t + 1] = w.logit2[i];
    }
  }

  // Format 3: the table and the key coefficient of every code in segment seg.
  void enter_segment(PrefixWalk &w, int64_t seg) {
    w.lut_segment = seg;
    w.segment_table = tables_ ? tables_ + seg * g_.table_size : nullptr;
    gamma_values(scales_[seg * 2], w.key_gamma);
    if (!scores_.empty() && w.segment_table) {  // no RoPE: the table's scores by entry, [crows][256]
      const int k = g_.anchors;
      w.seg_scores.resize(static_cast<size_t>(crows_) * kTableEntries);
      for (int i = 0; i < crows_; ++i)
        for (int e = 0; e < kTableEntries; ++e)
          w.seg_scores[static_cast<size_t>(i) * kTableEntries + e] =
              e < g_.table_size ? scores_[static_cast<size_t>(i) * k + w.segment_table[e]] : 0.0f;
    }
  }

  // Format 3: token t's key anchor and coefficient. Tokens come in increasing order within a
  // walk: anchor tokens (stored as index 0, code 0) are exact and found by following the
  // anchor list with a cursor; the others read t's segment table (enter_segment) and code.
  int format3_anchor(PrefixWalk &w, int64_t t, float *gamma) {
    if (t == w.next_anchor_token) {
      *gamma = 1.0f;
      const int a = static_cast<int>(w.next_anchor++);
      w.next_anchor_token = w.next_anchor < free_anchors_ ? anchor_tokens_[w.next_anchor] : -1;
      return a;
    }
    *gamma = w.key_gamma[kcode_[t]];
    return w.segment_table ? w.segment_table[kidx8_[t]] : kidx8_[t];
  }

  // What token t's key is built from: gamma K_a plus its decoded residual (null: none).
  // Format 3 reads the anchor through the segment's table (a few hundred rows that stay in
  // L1/L2) and the coefficient from its code (format3_anchor).
  struct KeySource {
    const uint16_t *anchor;
    float gamma;
    const float *residual;
  };
  KeySource key_source(PrefixWalk &w, int64_t t) {
    const int D = D_;
    KeySource k;
    if (g_.format == 2) {
      k.gamma = bf16_to_float(kgam_[t]);
      k.anchor = ak_ + static_cast<int64_t>(kidx_[t]) * D;
    } else {
      k.anchor = ak_ + static_cast<int64_t>(format3_anchor(w, t, &k.gamma)) * D;
    }
    k.residual = decode_key_residual(w, t) ? w.r.data() : nullptr;
    return k;
  }

  // Whether token t stores a key residual; if so it is decoded into w.r (its slot: the word's
  // prefix count plus a popcount inside the word).
  bool decode_key_residual(PrefixWalk &w, int64_t t) {
    const uint64_t word = kmask_[t >> 6];
    if (!(word >> (t & 63) & 1u)) return false;
    const uint32_t slot = kbase_ + kprefix_[t >> 6] +
                          static_cast<uint32_t>(__builtin_popcountll(word & ((1ull << (t & 63)) - 1)));
    decode_residual(w, kcodes_ + static_cast<int64_t>(slot) * c_.codec.code_bytes(), kscales_[slot]);
    return true;
  }

  // ResidualCodec::decode into w.r, with sixteen lanes where they may run (D' = 64, 128, 256:
  // norm_signs_ set); bit for bit the codec's result either way.
  void decode_residual(PrefixWalk &w, const uint8_t *codes, float scale) {
#ifdef AKV_HAVE_AVX512_KERNELS
    if (!norm_signs_.empty()) return decode_residual_wide(w, codes, scale);
#endif
    c_.codec.decode(codes, scale, w.r.data());
  }
#ifdef AKV_HAVE_AVX512_KERNELS
  AKV_TARGET_AVX512 void decode_residual_wide(PrefixWalk &w, const uint8_t *codes, float scale) {
    switch (norm_signs_.size()) {
      case 64: return decode_residual_avx512<4>(codes, scale, kLloydMaxLevels, norm_signs_.data(), w.r.data());
      case 128: return decode_residual_avx512<8>(codes, scale, kLloydMaxLevels, norm_signs_.data(), w.r.data());
      default: return decode_residual_avx512<16>(codes, scale, kLloydMaxLevels, norm_signs_.data(), w.r.data());
    }
  }
#endif

  // Token t's key, post-RoPE, into x (cs: its cos | sin).
  void rebuild_key(PrefixWalk &w, int64_t t, const float *cs, float *x) {
    const KeySource k = key_source(w, t);
    if (neox_ && neox_key_row(k.anchor, storage_, k.gamma, k.residual, cs, cs + pairs_, pairs_, D_, x)) return;
    generic_key(k, cs, x);
  }

  void generic_key(const KeySource &k, const float *cs, float *x) const {
    const int D = D_;
    half_row(k.anchor, storage_, D, x);
    if (k.residual) {
      const float *r = k.residual;
#pragma omp simd
      for (int d = 0; d < D; ++d) x[d] = k.gamma * x[d] + r[d];
    } else {
#pragma omp simd
      for (int d = 0; d < D; ++d) x[d] *= k.gamma;
    }
    if (pairs_) rope_.apply(x, cs, cs + pairs_);
  }

  // accumulate_weighted_rows over this head's rows padded to fours (crows_: w and acc hold
  // that many rows, the padding zero), with sixteen lanes where they may run.
  void weighted_rows(float *acc, const float *w, int64_t ldw, const float *x, int n, int width) const {
#ifdef AKV_HAVE_AVX512_KERNELS
    if (wide_ && accumulate_weighted_rows_avx512(acc, crows_, w, ldw, x, n, width)) return;
#endif
    accumulate_weighted_rows(acc, crows_, w, ldw, x, n, width);
  }

  // A walk over this head's prefix tiles from token t0 on (tiles in increasing order): its
  // scratch rows and the anchor-token cursor at t0.
  void begin_walk(PrefixWalk &w, int64_t t0) const {
    for (AlignedFloats *x : {&w.x, &w.x2, &w.x3, &w.x4}) x->assign(D_, 0.0f);
    w.logit.assign(crows_, 0.0f);
    w.logit2.assign(crows_, 0.0f);
    w.r.assign(c_.codec.rotated_dim(), 0.0f);
    w.lut_segment = -1;
    w.segment_table = nullptr;
    w.next_anchor = anchor_from(t0);
    w.next_anchor_token = w.next_anchor < free_anchors_ ? anchor_tokens_[w.next_anchor] : -1;
  }

  // The prefix in chunks of kDecodeChunk tokens (the last one shorter); index chunks() is the
  // window and the suffix. The split depends on the cache only, so the result does not
  // depend on how many threads share the chunks out.
  int64_t chunks() const { return chunks_; }
  int64_t chunk_begin(int64_t c) const { return std::min(g_.prefix, c * kDecodeChunk); }
  int64_t chunk_end(int64_t c) const { return std::min(g_.prefix, (c + 1) * kDecodeChunk); }

  // Chunk c's logits are all there (walked): its logit penalties, and each row's maximum.
  void close_chunk(int64_t c) {
    const int64_t t0 = chunk_begin(c), t1 = chunk_end(c);
    if (!c_.meta.logit_penalty.empty()) correct_logits(t0, t1);
    for (int i = 0; i < rows_; ++i) max_[c * rows_ + i] = max_of(&L_[static_cast<size_t>(i) * total_ + t0], t1 - t0);
  }
  // window_trig: the window's cos | sin, [W][2*pairs]. The window's and the suffix's logits,
  // and each row's maximum over those it sees.
  void tail_logits(const float *window_trig);
  // Chunk c's softmax numerators (against each row's maximum over every chunk and the tail),
  // their sums and its value residuals weighted by them (racc_'s part c).
  void chunk_values(int64_t c);
  // The same for the window and the suffix (the suffix's values into tail_acc_).
  void tail_values();
  // Chunk c's per-anchor value weights (wpart_[c], wlo_[c]): chunk_values's last step.
  void chunk_weights(int64_t c);
  // The sums of the parts, the per-anchor weights, and the output rows.
  void combine(float *out, float *lse);

  // Format 3 with logit penalties (docs/design.md §4.5): every reconstructed prefix token's
  // logit in [t0, t1) lowered by its head's penalty times |q|^2 (q scaled), the one of tokens
  // with a key residual for those; anchors are exact and keep theirs.
  void correct_logits(int64_t t0, int64_t t1) {
    const float *beta = &c_.meta.logit_penalty[static_cast<size_t>(h_) * 2];
    std::vector<uint8_t> kind(t1 - t0);  // KeyClass
    key_classes(kmask_, anchor_tokens_, free_anchors_, t0, t1, kind.data());
    for (int i = 0; i < rows_; ++i) {
      const float *qi = &q_[static_cast<size_t>(i) * D_];
      const float q2 = dot(qi, qi, D_);
      const float penalty[4] = {beta[0] * q2, beta[1] * q2, 0.0f, 0.0f};
      float *l = &L_[static_cast<size_t>(i) * total_ + t0];
#ifdef AKV_HAVE_AVX512_KERNELS
      if (wide_) {
        subtract_by_class_avx512(l, kind.data(), t1 - t0, penalty);
        continue;
      }
#endif
      for (int64_t t = 0; t < t1 - t0; ++t) l[t] -= penalty[kind[t]];
    }
  }

 private:
  bool gather_ = false;
  bool neox_ = false;  // rotary pairs (j, j + pairs): neox_key_row applies
  bool wide_ = false;       // AVX-512 kernels may run (has_avx512, not forced off by a test)
  bool wide_walk_ = false;  // and the AVX-512 gather walk applies to this shape
  bool gptj_walk_ = false;  // which rebuilds GPT-J keys in NeoX order (key_row_avx512<true>)
  AlignedFloats walk_q_gptj_;  // q_'s dims in that order
  const float *walk_q() const { return gptj_walk_ ? walk_q_gptj_.data() : q_.data(); }
  AlignedFloats norm_signs_;  // decode_residual_avx512's norm * sign (D' floats)
  const akv_cache &c_;
  int h_;
  int32_t q_len_;
  int D_, rows_;
  int crows_;  // rows_ rounded up to a multiple of four: q_'s rows (the padding is zero)
  const Rope &rope_;
  const AnchorGeometry &g_;
  akv_dtype storage_;
  int pairs_, two_p_;
  int64_t total_ = 0;
  AlignedFloats q_, L_, coef_, coefC_;
  std::vector<float> scores_;  // no RoPE, table path: q.K_a, [crows_][k] (prefix_tile_scores)
  std::vector<int> plain_;       // dimensions outside the rotary pairs
  const uint16_t *ak_, *kidx_, *kgam_;
  // Format 3.
  const int64_t *anchor_tokens_ = nullptr;
  int64_t free_anchors_ = 0;
  const uint8_t *kidx8_ = nullptr, *kcode_ = nullptr;
  const uint16_t *tables_ = nullptr;
  const float *scales_ = nullptr;
  const uint64_t *kmask_;
  const uint32_t *kprefix_;
  uint32_t kbase_;
  const uint8_t *kcodes_;
  const float *kscales_;
  // The split of the softmax and the value side (chunks()): each part's row maxima and sums
  // ([chunks + 1][rows], the tail last), value-residual sums ([chunks][crows][D'], in the
  // codec's rotated domain) and the suffix's values ([crows][D]).
  int64_t chunks_ = 0;
  AlignedFloats max_, sums_, racc_, tail_acc_;
  // Each chunk's per-anchor value weights, [crows][n] over the anchors [wlo_, wlo_ + n) that
  // its tokens use (chunk_weights).
  std::vector<AlignedFloats> wpart_;
  std::vector<int64_t> wlo_;
  // Format 3: the index of the first free anchor whose token is at or after t (free_anchors_
  // when none; 0 without format 3's list).
  int64_t anchor_from(int64_t t) const {
    return free_anchors_ ? std::lower_bound(anchor_tokens_, anchor_tokens_ + free_anchors_, t) - anchor_tokens_ : 0;
  }
  // The end of what row i = g * q_len + qi sees: every prompt token and the first
  // suffix - (q_len - 1 - qi) appended tokens.
  int64_t row_end(int i) const { return total_ - (q_len_ - 1 - i % q_len_); }
  float row_max(int i) const {
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t c = 0; c <= chunks_; ++c) m = std::max(m, max_[c * rows_ + i]);
    return m;
  }
};

// Softmax of each row over its visible tokens, unnormalised (divided at the end); returns
// the row sums, and each row's log-sum-exp in lse when given. Row i = g * q_len + qi sees
// every prompt token and the first suffix - (q_len - 1 - qi) appended tokens.
std::vector<float> softmax_rows(float *L, int rows, int64_t total, int64_t prompt, int64_t suffix, int32_t q_len,
                                float *lse) {
  std::vector<float> sums(rows);
  for (int i = 0; i < rows; ++i) {
    const int64_t end = prompt + suffix - (q_len - 1 - i % q_len);
    float *l = L + i * total;
    const float mx = max_of(l, end);
    sums[i] = exp_shifted_sum(l, end, mx);
    for (int64_t t = end; t < total; ++t) l[t] = 0.0f;
    if (lse) lse[i] = mx + std::log(sums[i]);
  }
  return sums;
}

void AnchorHead::tail_logits(const float *window_trig) {
  const akv_cache &cache = c_;
  const int D = D_, rows = rows_, k = g_.anchors, W = g_.window;
  const int64_t P = g_.prefix, total = total_;
  const int64_t prompt = cache.meta.shape.seq_len, suffix = cache.suffix_len;
  float *L = L_.data();
  std::vector<float> x(D);
  // The exact window: anchors k-W..k-1 at consecutive positions.
  for (int w = 0; w < W; ++w) {
    if (!scores_.empty()) {  // no RoPE: the window's anchors' scores are computed
      for (int i = 0; i < rows; ++i) L[i * total + P + w] = scores_[static_cast<size_t>(i) * k + k - W + w];
      continue;
    }
    half_row(ak_ + static_cast<int64_t>(k - W + w) * D, storage_, D, x.data());
    if (pairs_) rope_.apply(x.data(), window_trig + w * two_p_, window_trig + w * two_p_ + pairs_);
    for (int i = 0; i < rows; ++i) L[i * total + P + w] = dot(q_.data() + i * D, x.data(), D);
  }
  if (suffix) {
    const uint16_t *sk = reinterpret_cast<const uint16_t *>(cache.suffix_keys.data());
    dense_logits(sk + static_cast<int64_t>(h_) * cache.suffix_capacity * D, suffix, D, storage_, q_.data(), rows, L,
                 total, prompt);
  }
  for (int i = 0; i < rows; ++i) {
    const int64_t end = row_end(i);
    max_[chunks_ * rows + i] =
        end > P ? max_of(L + i * total + P, end - P) : -std::numeric_limits<float>::infinity();
  }
}

void AnchorHead::chunk_values(int64_t c) {
  const akv_cache &cache = c_;
  const int64_t t0 = chunk_begin(c), t1 = chunk_end(c);
  for (int i = 0; i < rows_; ++i)
    sums_[c * rows_ + i] = exp_shifted_sum(&L_[static_cast<size_t>(i) * total_ + t0], t1 - t0, row_max(i));
  // The chunk's value residuals in the rotated domain, in blocks: up to kBlock decoded rows
  // and their probabilities, then one weighted sum into every row's accumulator. Chunks are
  // whole mask words (kDecodeChunk % 64 == 0).
  const int RD = cache.codec.rotated_dim();  // residuals' rotated domain (D padded to a power of two)
  const int h = h_, rows = rows_;
  const int64_t words = g_.words;
  const uint64_t *vmask = cache.section<uint64_t>(kValueMask) + h * words;
  const uint32_t *vprefix = cache.section<uint32_t>(kValuePrefix) + h * words;
  const uint32_t vbase = cache.section<uint32_t>(kValueOffsets)[h];
  const uint8_t *vcodes = cache.section<uint8_t>(kValueCodes);
  const float *vscales = cache.section<float>(kValueScales);
  const uint8_t *vchunk = cache.section<uint8_t>(kValueChunkPos);
  float *racc = &racc_[static_cast<size_t>(c) * crows_ * RD];
  constexpr int kBlock = 64;
  AlignedFloats block(static_cast<size_t>(kBlock) * RD), p(static_cast<size_t>(crows_) * kBlock, 0.0f);
  int filled = 0;
  for (int64_t wd = t0 / 64; wd < (t1 + 63) / 64; ++wd) {
    const uint32_t first = vbase + vprefix[wd];
    const uint32_t count = static_cast<uint32_t>(__builtin_popcountll(vmask[wd]));
    for (uint32_t sl = first; sl < first + count; ++sl) {
      const int64_t t = wd * 64 + vchunk[sl];
      const uint8_t *codes = vcodes + static_cast<int64_t>(sl) * cache.codec.code_bytes();
      float *into = &block[static_cast<size_t>(filled) * RD];
#ifdef AKV_HAVE_AVX512_KERNELS
      if (wide_ && RD % 16 == 0)
        decode_rotated_avx512(codes, vscales[sl], kLloydMaxLevels, RD, into);
      else
#endif
        cache.codec.decode_rotated(codes, vscales[sl], into);
      for (int i = 0; i < rows; ++i) p[static_cast<size_t>(i) * kBlock + filled] = L_[i * total_ + t];
      if (++filled == kBlock) {
        weighted_rows(racc, p.data(), kBlock, block.data(), filled, RD);
        filled = 0;
      }
    }
  }
  if (filled) weighted_rows(racc, p.data(), kBlock, block.data(), filled, RD);
  chunk_weights(c);
}

void AnchorHead::chunk_weights(int64_t c) {
  const akv_cache &cache = c_;
  const int h = h_, rows = rows_, k = g_.anchors;
  const int64_t P = g_.prefix, total = total_, t0 = chunk_begin(c), t1 = chunk_end(c);
  const float *L = L_.data();
  // The anchors the chunk's tokens use: format 3's segment tables there and its own anchor
  // tokens (format 2 and format 3 without tables: any).
  const int64_t first_anchor = anchor_from(t0), last_anchor = anchor_from(t1);
  int64_t lo = 0, hi = k;
  if (g_.format == 3 && tables_) {
    lo = first_anchor < last_anchor ? first_anchor : k;
    hi = first_anchor < last_anchor ? last_anchor : 0;
    for (int64_t seg = g_.segment_of(t0); seg <= g_.segment_of(t1 - 1); ++seg)
      for (int e = 0; e < g_.table_size; ++e) {
        const int64_t a = tables_[seg * g_.table_size + e];
        lo = std::min(lo, a);
        hi = std::max(hi, a + 1);
      }
    if (lo >= hi) lo = hi = 0;
  }
  const int64_t n = hi - lo;
  wlo_[c] = lo;
  AlignedFloats &part = wpart_[c];
  part.assign(static_cast<size_t>(crows_) * n, 0.0f);
  float *wt = part.data();  // wt[i * n + a - lo] for anchors a in [lo, hi)
  if (g_.format == 2) {
    const uint16_t *vidx = cache.section<uint16_t>(kValueIndex) + h * P;
    const uint16_t *vgam = cache.section<uint16_t>(kValueGamma) + h * P;
    for (int64_t t = t0; t < t1; ++t) {
      const int a = vidx[t];
      const float gam = bf16_to_float(vgam[t]);
      for (int i = 0; i < rows; ++i) wt[i * n + a - lo] += L[i * total + t] * gam;
    }
    return;
  }
  const uint8_t *vidx8 = cache.section<uint8_t>(kValueIndex) + h * P;
  const uint8_t *vcode = cache.section<uint8_t>(kValueGamma) + h * P;
  for (int64_t seg = g_.segment_of(t0); seg <= g_.segment_of(t1 - 1); ++seg) {
    const int64_t s0 = std::max(t0, seg * g_.segment_len), s1 = std::min(t1, (seg + 1) * g_.segment_len);
    const uint16_t *table = tables_ ? tables_ + seg * g_.table_size : nullptr;
    float value_gamma[256];
    gamma_values(scales_[seg * 2 + 1], value_gamma);
    for (int64_t t = s0; t < s1; ++t) {
      const int a = table ? table[vidx8[t]] : vidx8[t];
      const float gam = value_gamma[vcode[t]];  // 0 for anchor tokens
      for (int i = 0; i < rows; ++i) wt[i * n + a - lo] += L[i * total + t] * gam;
    }
  }
  for (int64_t a = first_anchor; a < last_anchor; ++a)
    for (int i = 0; i < rows; ++i) wt[i * n + a - lo] += L[i * total + anchor_tokens_[a]];
}

void AnchorHead::tail_values() {
  const akv_cache &cache = c_;
  const int64_t P = g_.prefix, total = total_;
  const int64_t prompt = cache.meta.shape.seq_len, suffix = cache.suffix_len;
  for (int i = 0; i < rows_; ++i) {
    const int64_t end = row_end(i);
    float *l = &L_[static_cast<size_t>(i) * total];
    sums_[chunks_ * rows_ + i] = end > P ? exp_shifted_sum(l + P, end - P, row_max(i)) : 0.0f;
    for (int64_t t = end; t < total; ++t) l[t] = 0.0f;
  }
  if (suffix) {
    const uint16_t *sv = reinterpret_cast<const uint16_t *>(cache.suffix_values.data());
    dense_values(sv + static_cast<int64_t>(h_) * cache.suffix_capacity * D_, suffix, D_, storage_, L_.data(), rows_,
                 total, prompt, tail_acc_.data());
  }
}

void AnchorHead::combine(float *out, float *lse) {
  const akv_cache &cache = c_;
  const int h = h_, D = D_, rows = rows_;
  const int k = g_.anchors, W = g_.window;
  const int64_t P = g_.prefix, total = total_;
  const float *L = L_.data();
  const uint16_t *av = cache.section<uint16_t>(kAnchorValues) + static_cast<int64_t>(h) * k * D;
  std::vector<float> sums(rows, 0.0f);
  for (int64_t c = 0; c <= chunks_; ++c)
    for (int i = 0; i < rows; ++i) sums[i] += sums_[c * rows + i];
  if (lse)
    for (int i = 0; i < rows; ++i) lse[i] = row_max(i) + std::log(sums[i]);

  // Values are never reconstructed: per-anchor weights (the chunks' and the window's), then
  // residuals in the rotated domain with one inverse Hadamard per row.
  // Rows padded to fours with zero weights (weighted_rows' blocks); only rows < rows are read.
  const int crows = crows_;
  AlignedFloats weights(static_cast<size_t>(crows) * k, 0.0f), acc(static_cast<size_t>(crows) * D, 0.0f);
  for (int64_t c = 0; c < chunks_; ++c) {  // the chunks' weights, in chunk order
    const int64_t lo = wlo_[c], n = static_cast<int64_t>(wpart_[c].size()) / crows;
    for (int i = 0; i < rows; ++i) {
      const float *from = &wpart_[c][static_cast<size_t>(i) * n];
      float *to = &weights[static_cast<size_t>(i) * k + lo];
      for (int64_t a = 0; a < n; ++a) to[a] += from[a];
    }
  }
  for (int w = 0; w < W; ++w)
    for (int i = 0; i < rows; ++i) weights[i * k + k - W + w] += L[i * total + P + w];
  // The chunks' value residuals, added in chunk order, then out of the rotated domain.
  const int RD = cache.codec.rotated_dim();
  AlignedFloats racc(static_cast<size_t>(crows) * RD, 0.0f);
  for (int64_t c = 0; c < chunks_; ++c) {
    const float *part = &racc_[static_cast<size_t>(c) * crows * RD];
    for (size_t e = 0; e < racc.size(); ++e) racc[e] += part[e];
  }
  for (int i = 0; i < rows; ++i) cache.codec.unrotate(&racc[static_cast<size_t>(i) * RD]);
  // sum_a w_a V_a, kBlock anchors at a time.
  constexpr int kBlock = 64;
  AlignedFloats block(static_cast<size_t>(kBlock) * D);
  for (int a0 = 0; a0 < k; a0 += kBlock) {
    const int n = std::min(kBlock, k - a0);
    for (int a = 0; a < n; ++a) half_row(av + static_cast<int64_t>(a0 + a) * D, storage_, D, &block[static_cast<size_t>(a) * D]);
    weighted_rows(acc.data(), &weights[a0], k, block.data(), n, D);
  }
  for (int i = 0; i < rows; ++i)
    for (int d = 0; d < D; ++d)
      out[i * D + d] = (acc[static_cast<size_t>(i) * D + d] + racc[static_cast<size_t>(i) * RD + d] +
                        tail_acc_[static_cast<size_t>(i) * D + d]) / sums[i];
}

}  // namespace

void force_prefix_logits(PrefixLogits path) {
  forced_prefix_logits.store(static_cast<int>(path), std::memory_order_relaxed);
}

namespace {

// A dense or quantized cache's head h: q [G][q_len][D] fp32 rows of the group's query heads,
// out the same; lse (optional) [G][q_len].
void decode_head_cpu(const akv_cache &cache, int h, const float *q, int32_t q_len, float *out, float *lse);

// Runs f(i) for every i in [0, n) on the pool's threads, each thread taking the next item
// when it is done with one (the items' costs differ: chunks, tails, whole dense requests).
template <class F>
void share_out(ThreadPool &pool, int64_t n, const F &f) {
  std::atomic<int64_t> next{0};
  pool.parallel_for(std::min<int64_t>(n, pool.size()), [&](int64_t, int64_t) {
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) f(i);
  });
}

// The walk of chunk c over the prefix of a group of AnchorKV heads of one cache: each tile's
// RoPE angles computed once for all of them.
void walk_chunk(const akv_cache &cache, const std::vector<std::unique_ptr<AnchorHead>> &heads, int h0, int h1,
                int64_t c) {
  const Rope &rope = cache.rope;
  const int pairs = rope.enabled() ? rope.pairs() : 0;
  const int64_t P = cache.geometry.prefix;
  const int64_t begin = heads[h0]->chunk_begin(c), end = heads[h0]->chunk_end(c);
  std::vector<PrefixWalk> walks(h1 - h0);
  for (int h = h0; h < h1; ++h) heads[h]->begin_walk(walks[h - h0], begin);
  // Format 3: implicit positions, consecutive up to the window's.
  const int32_t *pos = cache.geometry.format == 2 ? cache.section<int32_t>(kPositions) : nullptr;
  std::vector<int32_t> implicit(pos ? 0 : kTile);
  const int64_t first = cache.meta.window_first_position - P;
  AlignedFloats trig(kTile * std::max(2 * pairs, 1));
  RopeSweep sweep(rope);
  for (int64_t t0 = begin; t0 < end; t0 += kTile) {
    const int64_t n = std::min(kTile, end - t0);
    const int32_t *tile_pos = pos ? pos + t0 : implicit.data();
    if (!pos)
      for (int64_t u = 0; u < n; ++u) implicit[u] = static_cast<int32_t>(first + t0 + u);
    if (pairs) sweep.next(tile_pos, n, trig.data(), trig.data() + pairs, 2 * pairs);
    for (int h = h0; h < h1; ++h) heads[h]->prefix_tile(walks[h - h0], t0, n, trig.data());
  }
  for (int h = h0; h < h1; ++h) heads[h]->close_chunk(c);
}

// The window's angles of a cache, exact (as Rope::apply computes them): [W][2 pairs].
std::vector<float> window_angles(const akv_cache &cache) {
  const int pairs = cache.rope.enabled() ? cache.rope.pairs() : 0, W = cache.geometry.window;
  std::vector<float> trig(static_cast<size_t>(W) * std::max(2 * pairs, 1));
  for (int w = 0; w < W && pairs; ++w) {
    float *row = &trig[static_cast<size_t>(w) * 2 * pairs];
    cache.rope.exact_angles(cache.meta.window_first_position + w, row, row + pairs);
  }
  return trig;
}

}  // namespace

void decode_cpu(const akv_cache *const *caches, int32_t batch, const float *q, int32_t q_len, float *out,
                float *lse, ThreadPool &pool) {
  const akv_shape &s0 = caches[0]->meta.shape;
  const int H = s0.num_kv_heads, G = s0.num_q_heads / H, D = s0.head_dim;
  const int64_t rows = static_cast<int64_t>(G) * q_len, per_head = rows * D, per_request = H * per_head;
  const int threads = pool.size();
  auto q_of = [&](int32_t r, int h) { return q + r * per_request + h * per_head; };
  auto out_of = [&](int32_t r, int h) { return out + r * per_request + h * per_head; };
  auto lse_of = [&](int32_t r, int h) { return lse ? lse + (static_cast<int64_t>(r) * H + h) * rows : nullptr; };
  auto is_anchor = [&](int32_t r) { return storage_of(caches[r]->meta.method) == Storage::kAnchor; };
  auto chunks_of = [&](int32_t r) {
    return is_anchor(r) ? decode_chunks(caches[r]->geometry.prefix) : int64_t{0};
  };
  int64_t most_chunks = 0;
  for (int32_t r = 0; r < batch; ++r) most_chunks = std::max(most_chunks, chunks_of(r));

  // Whole heads, one group of a request's heads an item, in one pass through the pool: where
  // there are heads enough for the threads (two a thread) or no prefix spans two chunks. The
  // heads of a group share their walks' RoPE angles.
  if (threads == 1 || most_chunks <= 1 || static_cast<int64_t>(batch) * H >= 2 * threads) {
    const int groups = std::min(H, std::max(1, (threads + batch - 1) / batch));
    share_out(pool, static_cast<int64_t>(batch) * groups, [&](int64_t i) {
      const int32_t r = static_cast<int32_t>(i / groups);
      const int grp = static_cast<int>(i % groups), h0 = H * grp / groups, h1 = H * (grp + 1) / groups;
      const akv_cache &cache = *caches[r];
      if (!is_anchor(r)) {
        for (int h = h0; h < h1; ++h) decode_head_cpu(cache, h, q_of(r, h), q_len, out_of(r, h), lse_of(r, h));
        return;
      }
      std::vector<std::unique_ptr<AnchorHead>> heads(H);
      for (int h = h0; h < h1; ++h) heads[h] = std::make_unique<AnchorHead>(cache, h, q_of(r, h), q_len);
      const std::vector<float> window_trig = window_angles(cache);
      const int64_t chunks = chunks_of(r);
      for (int64_t c = 0; c < chunks; ++c) walk_chunk(cache, heads, h0, h1, c);
      for (int h = h0; h < h1; ++h) {
        AnchorHead &head = *heads[h];
        head.tail_logits(window_trig.data());
        for (int64_t c = 0; c < chunks; ++c) head.chunk_values(c);
        head.tail_values();
        head.combine(out_of(r, h), lse_of(r, h));
      }
    });
    return;
  }

  // Else the AnchorKV heads' chunks are items too, in four passes: the heads' states; each
  // chunk's walk (a group of heads a chunk) and each head's window and suffix logits; each
  // chunk's softmax numerators, value residuals and weights; each head's sums and output. The
  // results are the same bits as above (the same chunks, added in the same order).
  struct Request {
    bool anchor = false;
    int groups = 1;
    int64_t parts = 1;  // AnchorKV: its chunks and the tail (chunks + 1); else the whole decode
    std::vector<std::unique_ptr<AnchorHead>> heads;
    std::vector<float> window_trig;
  };
  std::vector<Request> req(batch);
  std::vector<std::pair<int32_t, int>> anchor_heads;
  for (int32_t r = 0; r < batch; ++r) {
    Request &x = req[r];
    x.anchor = is_anchor(r);
    const int64_t chunks = chunks_of(r);
    x.parts = x.anchor ? chunks + 1 : 1;
    // As many groups as it takes for every thread to have an item.
    const int64_t per_group = static_cast<int64_t>(batch) * std::max<int64_t>(chunks, 1);
    x.groups = static_cast<int>(std::min<int64_t>(H, std::max<int64_t>(1, (threads + per_group - 1) / per_group)));
    if (x.anchor) x.heads.resize(H);
    for (int h = 0; h < H && x.anchor; ++h) anchor_heads.push_back({r, h});
  }
  std::vector<std::array<int64_t, 3>> items;  // (request, group, part)
  for (int32_t r = 0; r < batch; ++r)
    for (int grp = 0; grp < req[r].groups; ++grp)
      for (int64_t part = 0; part < req[r].parts; ++part) items.push_back({r, grp, part});
  auto group_heads = [&](int32_t r, int grp) {
    return std::pair<int, int>{H * grp / req[r].groups, H * (grp + 1) / req[r].groups};
  };
  share_out(pool, static_cast<int64_t>(anchor_heads.size()), [&](int64_t i) {
    const auto [r, h] = anchor_heads[i];
    req[r].heads[h] = std::make_unique<AnchorHead>(*caches[r], h, q_of(r, h), q_len);
    if (h == 0) req[r].window_trig = window_angles(*caches[r]);
  });
  share_out(pool, static_cast<int64_t>(items.size()), [&](int64_t i) {  // the other methods' whole decode too
    const int32_t r = static_cast<int32_t>(items[i][0]);
    const int64_t part = items[i][2];
    const auto [h0, h1] = group_heads(r, static_cast<int>(items[i][1]));
    Request &x = req[r];
    if (!x.anchor) {
      for (int h = h0; h < h1; ++h) decode_head_cpu(*caches[r], h, q_of(r, h), q_len, out_of(r, h), lse_of(r, h));
    } else if (part + 1 < x.parts) {
      walk_chunk(*caches[r], x.heads, h0, h1, part);
    } else {
      for (int h = h0; h < h1; ++h) x.heads[h]->tail_logits(x.window_trig.data());
    }
  });
  share_out(pool, static_cast<int64_t>(items.size()), [&](int64_t i) {
    const int32_t r = static_cast<int32_t>(items[i][0]);
    const int64_t part = items[i][2];
    const auto [h0, h1] = group_heads(r, static_cast<int>(items[i][1]));
    Request &x = req[r];
    for (int h = h0; h < h1 && x.anchor; ++h) {
      if (part + 1 < x.parts) x.heads[h]->chunk_values(part);
      else x.heads[h]->tail_values();
    }
  });
  share_out(pool, static_cast<int64_t>(anchor_heads.size()), [&](int64_t i) {
    const auto [r, h] = anchor_heads[i];
    req[r].heads[h]->combine(out_of(r, h), lse_of(r, h));
  });
}

namespace {

void decode_head_cpu(const akv_cache &cache, int h, const float *q, int32_t q_len, float *out, float *lse) {
  switch (storage_of(cache.meta.method)) {
    case Storage::kQuantized: return decode_quantized_head_cpu(cache, h, q, q_len, out, lse);
    case Storage::kAnchor: throw Error(AKV_ERR_INTERNAL, "decode_head_cpu: AnchorKV caches are decode_cpu's");
    case Storage::kDense: break;
  }
  const CacheMeta &meta = cache.meta;
  const int D = meta.shape.head_dim;
  const int G = meta.shape.num_q_heads / meta.shape.num_kv_heads;
  const int rows = G * q_len;
  const int crows = rows_in_fours(rows);  // the padding: zero queries, zero weights
  const akv_dtype storage = meta.storage;
  // Fold the softmax scale into the queries once instead of scaling every logit.
  AlignedFloats q_scaled(static_cast<size_t>(crows) * D, 0.0f);
  for (size_t e = 0; e < static_cast<size_t>(rows) * D; ++e) q_scaled[e] = q[e] * meta.softmax_scale;
  q = q_scaled.data();
  const int64_t suffix = cache.suffix_len;
  const int64_t suffix_base = (static_cast<int64_t>(h) * cache.suffix_capacity) * D;
  const uint16_t *sk = reinterpret_cast<const uint16_t *>(cache.suffix_keys.data());
  const uint16_t *sv = reinterpret_cast<const uint16_t *>(cache.suffix_values.data());
  const int64_t prompt = meta.dense_counts[h];
  const int64_t total = prompt + suffix;
  AlignedFloats L(static_cast<size_t>(crows) * total, 0.0f);  // the padding rows stay 0
  AlignedFloats acc(static_cast<size_t>(crows) * D, 0.0f);
  // Dense methods: prompt tokens [count][D] for this head, then the suffix.
  int64_t before = 0;
  for (int hh = 0; hh < h; ++hh) before += meta.dense_counts[hh];
  int64_t kept = 0;
  for (int64_t c : meta.dense_counts) kept += c;
  const uint16_t *dk = reinterpret_cast<const uint16_t *>(cache.data.data()) + before * D;
  const uint16_t *dv = reinterpret_cast<const uint16_t *>(cache.data.data()) + (kept + before) * D;
  dense_logits(dk, prompt, D, storage, q, rows, L.data(), total, 0);
  if (suffix) dense_logits(sk + suffix_base, suffix, D, storage, q, rows, L.data(), total, prompt);
  const std::vector<float> sums = softmax_rows(L.data(), rows, total, prompt, suffix, q_len, lse);
  dense_values(dv, prompt, D, storage, L.data(), crows, total, 0, acc.data());
  if (suffix) dense_values(sv + suffix_base, suffix, D, storage, L.data(), crows, total, prompt, acc.data());
  for (int i = 0; i < rows; ++i)
    for (int d = 0; d < D; ++d) out[i * D + d] = acc[i * D + d] / sums[i];
}

}  // namespace

void reconstruct_head_cpu(const akv_cache &cache, int h, bool rotated, float *keys, float *values,
                          uint8_t *present) {
  const CacheMeta &meta = cache.meta;
  const int D = meta.shape.head_dim;
  const akv_dtype storage = meta.storage;
  const Rope &rope = cache.rope;
  const int64_t S = meta.shape.seq_len;
  const Storage storage_kind = storage_of(meta.method);
  if (storage_kind == Storage::kAnchor) {
    const AnchorGeometry &g = cache.geometry;
    const int k = g.anchors, W = g.window;
    const int64_t P = g.prefix, words = g.words;
    const uint16_t *anchors[2] = {cache.section<uint16_t>(kAnchorKeys) + static_cast<int64_t>(h) * k * D,
                                  cache.section<uint16_t>(kAnchorValues) + static_cast<int64_t>(h) * k * D};
    const uint64_t *mask[2] = {cache.section<uint64_t>(kKeyMask) + h * words, cache.section<uint64_t>(kValueMask) + h * words};
    const uint32_t *prefix[2] = {cache.section<uint32_t>(kKeyPrefix) + h * words, cache.section<uint32_t>(kValuePrefix) + h * words};
    const uint32_t base[2] = {cache.section<uint32_t>(kKeyOffsets)[h], cache.section<uint32_t>(kValueOffsets)[h]};
    const uint8_t *codes[2] = {cache.section<uint8_t>(kKeyCodes), cache.section<uint8_t>(kValueCodes)};
    const float *scales[2] = {cache.section<float>(kKeyScales), cache.section<float>(kValueScales)};
    const AnchorAccess access(cache);
    std::vector<float> a(D), r(cache.codec.rotated_dim());
    for (int side = 0; side < (values ? 2 : 1); ++side) {  // null values: keys only
      float *dst = side == 0 ? keys : values;
      for (int64_t t = 0; t < P; ++t) {
        half_row(anchors[side] + static_cast<int64_t>(access.anchor(side, h, t)) * D, storage, D, a.data());
        const float gq = access.gamma(side, h, t);
        float *o = dst + t * D;
        for (int d = 0; d < D; ++d) o[d] = gq * a[d];
        const uint64_t word = mask[side][t >> 6];
        if (word >> (t & 63) & 1u) {
          const uint32_t slot = base[side] + prefix[side][t >> 6] +
                                static_cast<uint32_t>(__builtin_popcountll(word & ((1ull << (t & 63)) - 1)));
          cache.codec.decode(codes[side] + static_cast<int64_t>(slot) * cache.codec.code_bytes(), scales[side][slot],
                             r.data());
          for (int d = 0; d < D; ++d) o[d] += r[d];
        }
        if (side == 0 && rotated) rope.apply(o, access.position(t));
      }
      for (int w = 0; w < W; ++w) {
        float *o = dst + (P + w) * D;
        half_row(anchors[side] + static_cast<int64_t>(k - W + w) * D, storage, D, o);
        if (side == 0 && rotated) rope.apply(o, meta.window_first_position + w);
      }
    }
  } else if (storage_kind == Storage::kQuantized) {
    reconstruct_quantized_prompt_cpu(cache, h, rotated, keys, values);
  } else {
    // Dense methods: the head's kept tokens in token order; dense_tokens names them for the
    // eviction methods (empty: every token, FullKV). Evicted tokens read as zeros, absent.
    int64_t before = 0, kept = 0;
    for (int hh = 0; hh < static_cast<int>(meta.dense_counts.size()); ++hh) {
      if (hh < h) before += meta.dense_counts[hh];
      kept += meta.dense_counts[hh];
    }
    const uint16_t *dk = reinterpret_cast<const uint16_t *>(cache.data.data()) + before * D;
    const uint16_t *dv = reinterpret_cast<const uint16_t *>(cache.data.data()) + (kept + before) * D;
    const bool evicting = !cache.dense_tokens.empty();
    if (evicting) {
      std::memset(keys, 0, static_cast<size_t>(S) * D * sizeof(float));
      std::memset(values, 0, static_cast<size_t>(S) * D * sizeof(float));
      if (present) std::memset(present, 0, static_cast<size_t>(S));
    }
    for (int64_t i = 0; i < meta.dense_counts[h]; ++i) {
      const int64_t t = evicting ? cache.dense_tokens[before + i] : i;
      half_row(dk + i * D, storage, D, keys + t * D);
      half_row(dv + i * D, storage, D, values + t * D);
      if (!rotated) rope.apply(keys + t * D, cache.dense_positions[t], /*inverse=*/true);
      if (evicting && present) present[t] = 1;
    }
  }
  const int64_t suffix_base = (static_cast<int64_t>(h) * cache.suffix_capacity) * D;
  const uint16_t *sk = reinterpret_cast<const uint16_t *>(cache.suffix_keys.data());
  const uint16_t *sv = reinterpret_cast<const uint16_t *>(cache.suffix_values.data());
  for (int64_t u = 0; u < cache.suffix_len; ++u) {
    half_row(sk + suffix_base + u * D, storage, D, keys + (S + u) * D);
    if (values) half_row(sv + suffix_base + u * D, storage, D, values + (S + u) * D);
    if (!rotated) rope.apply(keys + (S + u) * D, cache.suffix_positions[u], /*inverse=*/true);
  }
  if (present) {
    const bool evicting = storage_kind != Storage::kAnchor && !cache.dense_tokens.empty();
    std::memset(present + (evicting ? S : 0), 1, static_cast<size_t>((evicting ? 0 : S) + cache.suffix_len));
  }
}

}  // namespace akv
