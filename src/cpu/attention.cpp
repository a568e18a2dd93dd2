#include "cpu/attention.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>
#include "core/dtype.hpp"
#include "cpu/quantized_attention.hpp"

namespace akv {
namespace {

inline float dot(const float *a, const float *b, int n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void half_row(const uint16_t *src, akv_dtype storage, int n, float *dst) {
  if (storage == AKV_DTYPE_BF16) {
    for (int i = 0; i < n; ++i) {
      const uint32_t bits = static_cast<uint32_t>(src[i]) << 16;
      std::memcpy(&dst[i], &bits, 4);
    }
  } else {
    for (int i = 0; i < n; ++i) dst[i] = fp16_to_float(src[i]);
  }
}

// Dense keys/values [n][D] (post-RoPE, storage dtype): logits into L[i][offset + t].
void dense_logits(const uint16_t *keys, int64_t n, int D, akv_dtype storage, const float *q, int rows,
                  float *L, int64_t ldl, int64_t offset) {
  std::vector<float> k(D);
  for (int64_t t = 0; t < n; ++t) {
    half_row(keys + t * D, storage, D, k.data());
    for (int i = 0; i < rows; ++i) L[i * ldl + offset + t] = dot(q + i * D, k.data(), D);
  }
}

void dense_values(const uint16_t *values, int64_t n, int D, akv_dtype storage, const float *P, int rows,
                  int64_t ldp, int64_t offset, float *acc) {
  std::vector<float> v(D);
  for (int64_t t = 0; t < n; ++t) {
    half_row(values + t * D, storage, D, v.data());
    for (int i = 0; i < rows; ++i) {
      const float p = P[i * ldp + offset + t];
      if (p == 0.0f) continue;
      float *a = acc + i * D;
      for (int d = 0; d < D; ++d) a[d] += p * v[d];
    }
  }
}

constexpr int64_t kTile = Rope::kTile;

}  // namespace

void decode_head_cpu(const akv_cache &cache, int h, const float *q, int32_t q_len, float *out) {
  if (cache.meta.method == AKV_METHOD_QUANTIZED) return decode_quantized_head_cpu(cache, h, q, q_len, out);
  const CacheMeta &meta = cache.meta;
  const int D = meta.shape.head_dim;
  const int G = meta.shape.num_q_heads / meta.shape.num_kv_heads;
  const int rows = G * q_len;
  const akv_dtype storage = meta.storage;
  const float scale = meta.softmax_scale;
  const Rope &rope = cache.rope;
  const bool anchor = meta.method == AKV_METHOD_ANCHORKV;
  // Fold the softmax scale into the queries once instead of scaling every logit.
  std::vector<float> q_scaled(q, q + static_cast<size_t>(rows) * D);
  for (float &x : q_scaled) x *= scale;
  q = q_scaled.data();
  const int64_t prompt = anchor ? meta.shape.seq_len : meta.dense_counts[h];
  const int64_t suffix = cache.suffix_len;
  const int64_t total = prompt + suffix;
  std::vector<float> L(static_cast<size_t>(rows) * total);
  std::vector<float> acc(static_cast<size_t>(rows) * D, 0.0f);
  const int64_t suffix_base = (static_cast<int64_t>(h) * cache.suffix_capacity) * D;
  const uint16_t *sk = reinterpret_cast<const uint16_t *>(cache.suffix_keys.data());
  const uint16_t *sv = reinterpret_cast<const uint16_t *>(cache.suffix_values.data());
  // Row i = g * q_len + qi sees every prompt token and the first visible(i) appended tokens.
  auto visible = [&](int i) { return suffix - (q_len - 1 - i % q_len); };

  std::vector<float> weights;  // AnchorKV: per-anchor value weights [rows][k]
  std::vector<float> racc;     // AnchorKV: value residuals accumulated in the rotated domain
  if (anchor) {
    const AnchorGeometry &g = cache.geometry;
    const int k = g.anchors, W = g.window;
    const int64_t P = g.prefix, words = g.words;
    const uint16_t *ak = cache.section<uint16_t>(kAnchorKeys) + static_cast<int64_t>(h) * k * D;
    const uint16_t *av = cache.section<uint16_t>(kAnchorValues) + static_cast<int64_t>(h) * k * D;
    const uint16_t *kidx = cache.section<uint16_t>(kKeyIndex) + h * P;
    const uint16_t *vidx = cache.section<uint16_t>(kValueIndex) + h * P;
    const uint16_t *kgam = cache.section<uint16_t>(kKeyGamma) + h * P;
    const uint16_t *vgam = cache.section<uint16_t>(kValueGamma) + h * P;
    const int32_t *pos = cache.section<int32_t>(kPositions);
    const uint64_t *kmask = cache.section<uint64_t>(kKeyMask) + h * words;
    const uint64_t *vmask = cache.section<uint64_t>(kValueMask) + h * words;
    const uint32_t *kprefix = cache.section<uint32_t>(kKeyPrefix) + h * words;
    const uint32_t *vprefix = cache.section<uint32_t>(kValuePrefix) + h * words;
    const uint32_t kbase = cache.section<uint32_t>(kKeyOffsets)[h];
    const uint32_t vbase = cache.section<uint32_t>(kValueOffsets)[h];
    const uint8_t *kcodes = cache.section<uint8_t>(kKeyCodes);
    const float *kscales = cache.section<float>(kKeyScales);
    const uint8_t *vcodes = cache.section<uint8_t>(kValueCodes);
    const float *vscales = cache.section<float>(kValueScales);
    const uint8_t *vchunk = cache.section<uint8_t>(kValueChunkPos);
    const int pairs = rope.enabled() ? rope.pairs() : 0;
    // Per (anchor, row): q.R_t K_a = C + sum_j A_j cos(t w_j) + B_j sin(t w_j)  (SPEC 4).
    std::vector<uint8_t> in_pair(D, 0);
    for (int j = 0; j < pairs; ++j) in_pair[rope.first[j]] = in_pair[rope.second[j]] = 1;
    // Layout [anchor][row][A_0..A_{pairs-1}, B_0..B_{pairs-1}] so that, with a token's angles
    // stored as [cos | sin], its logit is one dot product of length 2*pairs.
    const int two_p = 2 * pairs;
    std::vector<float> coef(static_cast<size_t>(k) * rows * two_p), coefC(static_cast<size_t>(k) * rows);
    std::vector<float> x(D);
    for (int a = 0; a < k; ++a) {
      half_row(ak + static_cast<int64_t>(a) * D, storage, D, x.data());
      for (int i = 0; i < rows; ++i) {
        const float *qi = q + i * D;
        float *AB = &coef[(static_cast<size_t>(a) * rows + i) * two_p];
        for (int j = 0; j < pairs; ++j) {
          const int f = rope.first[j], s = rope.second[j];
          AB[j] = qi[f] * x[f] + qi[s] * x[s];
          AB[pairs + j] = qi[s] * x[f] - qi[f] * x[s];
        }
        float c = 0.0f;
        for (int d = 0; d < D; ++d)
          if (!in_pair[d]) c += qi[d] * x[d];
        coefC[static_cast<size_t>(a) * rows + i] = c;
      }
    }
    // Prefix logits, tile by tile: RoPE angles once per tile, keys never materialised
    // except the decoded residual of tokens that store one.
    std::vector<float> trig(kTile * std::max(two_p, 1)), r(D);
    RopeSweep sweep(rope);
    for (int64_t t0 = 0; t0 < P; t0 += kTile) {
      const int64_t n = std::min(kTile, P - t0);
      if (pairs) sweep.next(pos + t0, n, trig.data(), trig.data() + pairs, two_p);
      for (int64_t u = 0; u < n; ++u) {
        const int64_t t = t0 + u;
        const int a = kidx[t];
        const float gam = bf16_to_float(kgam[t]);
        const float *cs = &trig[u * two_p];
        const float *c = cs, *s = cs + pairs;
        const float *AB = &coef[static_cast<size_t>(a) * rows * two_p];
        const float *C = &coefC[static_cast<size_t>(a) * rows];
        for (int i = 0; i < rows; ++i) L[i * total + t] = gam * (C[i] + dot(AB + i * two_p, cs, two_p));
        const uint64_t word = kmask[t >> 6];
        if (word >> (t & 63) & 1u) {
          const uint32_t slot = kbase + kprefix[t >> 6] +
                                static_cast<uint32_t>(__builtin_popcountll(word & ((1ull << (t & 63)) - 1)));
          cache.codec.decode(kcodes + static_cast<int64_t>(slot) * (D / 4), kscales[slot], r.data());
          if (pairs) rope.apply(r.data(), c, s);
          for (int i = 0; i < rows; ++i) L[i * total + t] += dot(q + i * D, r.data(), D);
        }
      }
    }
    // The exact window: anchors k-W..k-1 at consecutive positions.
    for (int w = 0; w < W; ++w) {
      half_row(ak + static_cast<int64_t>(k - W + w) * D, storage, D, x.data());
      rope.apply(x.data(), meta.window_first_position + w);
      for (int i = 0; i < rows; ++i) L[i * total + P + w] = dot(q + i * D, x.data(), D);
    }
    if (suffix) dense_logits(sk + suffix_base, suffix, D, storage, q, rows, L.data(), total, prompt);

    // Softmax (unnormalised; divided at the end).
    std::vector<float> sums(rows);
    for (int i = 0; i < rows; ++i) {
      const int64_t end = prompt + visible(i);
      float *l = &L[i * total];
      const float mx = *std::max_element(l, l + end);
      double sum = 0.0;
      for (int64_t t = 0; t < end; ++t) {
        l[t] = std::exp(l[t] - mx);
        sum += l[t];
      }
      for (int64_t t = end; t < total; ++t) l[t] = 0.0f;
      sums[i] = static_cast<float>(sum);
    }
    // Values are never reconstructed: per-anchor weights, then residuals in the rotated
    // domain with one inverse Hadamard per row.
    weights.assign(static_cast<size_t>(rows) * k, 0.0f);
    racc.assign(static_cast<size_t>(rows) * D, 0.0f);
    for (int64_t t = 0; t < P; ++t) {
      const int a = vidx[t];
      const float gam = bf16_to_float(vgam[t]);
      for (int i = 0; i < rows; ++i) weights[i * k + a] += L[i * total + t] * gam;
    }
    for (int w = 0; w < W; ++w)
      for (int i = 0; i < rows; ++i) weights[i * k + k - W + w] += L[i * total + P + w];
    for (int64_t wd = 0; wd < words; ++wd) {
      const uint32_t first = vbase + vprefix[wd];
      const uint32_t count = static_cast<uint32_t>(__builtin_popcountll(vmask[wd]));
      for (uint32_t sl = first; sl < first + count; ++sl) {
        const int64_t t = wd * 64 + vchunk[sl];
        cache.codec.decode_rotated(vcodes + static_cast<int64_t>(sl) * (D / 4), vscales[sl], r.data());
        for (int i = 0; i < rows; ++i) {
          const float p = L[i * total + t];
          float *ra = &racc[static_cast<size_t>(i) * D];
          for (int d = 0; d < D; ++d) ra[d] += p * r[d];
        }
      }
    }
    for (int i = 0; i < rows; ++i) cache.codec.unrotate(&racc[static_cast<size_t>(i) * D]);
    for (int a = 0; a < k; ++a) {
      half_row(av + static_cast<int64_t>(a) * D, storage, D, x.data());
      for (int i = 0; i < rows; ++i) {
        const float wgt = weights[i * k + a];
        if (wgt == 0.0f) continue;
        float *o = &acc[static_cast<size_t>(i) * D];
        for (int d = 0; d < D; ++d) o[d] += wgt * x[d];
      }
    }
    for (size_t e = 0; e < acc.size(); ++e) acc[e] += racc[e];
    if (suffix) dense_values(sv + suffix_base, suffix, D, storage, L.data(), rows, total, prompt, acc.data());
    for (int i = 0; i < rows; ++i)
      for (int d = 0; d < D; ++d) out[i * D + d] = acc[i * D + d] / sums[i];
    return;
  }

  // Dense methods: prompt tokens [count][D] for this head, then the suffix.
  int64_t before = 0;
  for (int hh = 0; hh < h; ++hh) before += meta.dense_counts[hh];
  int64_t kept = 0;
  for (int64_t c : meta.dense_counts) kept += c;
  const uint16_t *dk = reinterpret_cast<const uint16_t *>(cache.data.data()) + before * D;
  const uint16_t *dv = reinterpret_cast<const uint16_t *>(cache.data.data()) + (kept + before) * D;
  dense_logits(dk, prompt, D, storage, q, rows, L.data(), total, 0);
  if (suffix) dense_logits(sk + suffix_base, suffix, D, storage, q, rows, L.data(), total, prompt);
  std::vector<float> sums(rows);
  for (int i = 0; i < rows; ++i) {
    const int64_t end = prompt + visible(i);
    float *l = &L[i * total];
    const float mx = *std::max_element(l, l + end);
    double sum = 0.0;
    for (int64_t t = 0; t < end; ++t) {
      l[t] = std::exp(l[t] - mx);
      sum += l[t];
    }
    for (int64_t t = end; t < total; ++t) l[t] = 0.0f;
    sums[i] = static_cast<float>(sum);
  }
  dense_values(dv, prompt, D, storage, L.data(), rows, total, 0, acc.data());
  if (suffix) dense_values(sv + suffix_base, suffix, D, storage, L.data(), rows, total, prompt, acc.data());
  for (int i = 0; i < rows; ++i)
    for (int d = 0; d < D; ++d) out[i * D + d] = acc[i * D + d] / sums[i];
}

void reconstruct_head_cpu(const akv_cache &cache, int h, bool rotated, float *keys, float *values,
                          uint8_t *present) {
  const CacheMeta &meta = cache.meta;
  const int D = meta.shape.head_dim;
  const akv_dtype storage = meta.storage;
  const Rope &rope = cache.rope;
  const int64_t S = meta.shape.seq_len;
  if (meta.method == AKV_METHOD_ANCHORKV) {
    const AnchorGeometry &g = cache.geometry;
    const int k = g.anchors, W = g.window;
    const int64_t P = g.prefix, words = g.words;
    const uint16_t *anchors[2] = {cache.section<uint16_t>(kAnchorKeys) + static_cast<int64_t>(h) * k * D,
                                  cache.section<uint16_t>(kAnchorValues) + static_cast<int64_t>(h) * k * D};
    const uint16_t *idx[2] = {cache.section<uint16_t>(kKeyIndex) + h * P, cache.section<uint16_t>(kValueIndex) + h * P};
    const uint16_t *gam[2] = {cache.section<uint16_t>(kKeyGamma) + h * P, cache.section<uint16_t>(kValueGamma) + h * P};
    const uint64_t *mask[2] = {cache.section<uint64_t>(kKeyMask) + h * words, cache.section<uint64_t>(kValueMask) + h * words};
    const uint32_t *prefix[2] = {cache.section<uint32_t>(kKeyPrefix) + h * words, cache.section<uint32_t>(kValuePrefix) + h * words};
    const uint32_t base[2] = {cache.section<uint32_t>(kKeyOffsets)[h], cache.section<uint32_t>(kValueOffsets)[h]};
    const uint8_t *codes[2] = {cache.section<uint8_t>(kKeyCodes), cache.section<uint8_t>(kValueCodes)};
    const float *scales[2] = {cache.section<float>(kKeyScales), cache.section<float>(kValueScales)};
    const int32_t *pos = cache.section<int32_t>(kPositions);
    std::vector<float> a(D), r(D);
    for (int side = 0; side < 2; ++side) {
      float *dst = side == 0 ? keys : values;
      for (int64_t t = 0; t < P; ++t) {
        half_row(anchors[side] + static_cast<int64_t>(idx[side][t]) * D, storage, D, a.data());
        const float gq = bf16_to_float(gam[side][t]);
        float *o = dst + t * D;
        for (int d = 0; d < D; ++d) o[d] = gq * a[d];
        const uint64_t word = mask[side][t >> 6];
        if (word >> (t & 63) & 1u) {
          const uint32_t slot = base[side] + prefix[side][t >> 6] +
                                static_cast<uint32_t>(__builtin_popcountll(word & ((1ull << (t & 63)) - 1)));
          cache.codec.decode(codes[side] + static_cast<int64_t>(slot) * (D / 4), scales[side][slot], r.data());
          for (int d = 0; d < D; ++d) o[d] += r[d];
        }
        if (side == 0 && rotated) rope.apply(o, pos[t]);
      }
      for (int w = 0; w < W; ++w) {
        float *o = dst + (P + w) * D;
        half_row(anchors[side] + static_cast<int64_t>(k - W + w) * D, storage, D, o);
        if (side == 0 && rotated) rope.apply(o, meta.window_first_position + w);
      }
    }
  } else if (meta.method == AKV_METHOD_QUANTIZED) {
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
    half_row(sv + suffix_base + u * D, storage, D, values + (S + u) * D);
    if (!rotated) rope.apply(keys + (S + u) * D, cache.suffix_positions[u], /*inverse=*/true);
  }
  if (present) {
    const bool evicting = meta.method != AKV_METHOD_ANCHORKV && !cache.dense_tokens.empty();
    std::memset(present + (evicting ? S : 0), 1, static_cast<size_t>((evicting ? 0 : S) + cache.suffix_len));
  }
}

}  // namespace akv
