#include "cpu/quantized_attention.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>
#include "core/dtype.hpp"
#include "cpu/kernels.hpp"

namespace akv {
namespace {

inline int outlier_channel(const akv_cache &c, int64_t slot) {
  const uint8_t *idx = c.quant_section<uint8_t>(kQuantKeyOutlierIndex);
  if (c.quant.index_bytes == 1) return idx[slot];
  uint16_t v;
  std::memcpy(&v, idx + 2 * slot, 2);
  return v;
}

}  // namespace

void decode_quantized_head_cpu(const akv_cache &c, int h, const float *q, int32_t q_len, float *out, float *lse) {
  const QuantGeometry &g = c.quant;
  const int D = g.dim, G = g.q_heads / g.heads, n = g.outliers, rows = G * q_len;
  const int64_t P = g.prefix, W = g.window, cb = g.code_bytes();
  const int64_t prompt = g.seq_len, suffix = c.suffix_len, total = prompt + suffix;
  const akv_dtype storage = c.meta.storage;
  const TokenQuantizer &tq = c.quantizer;
  const int RD = tq.rotation().rotated_dim();  // D padded to a power of two
  std::vector<float> qs(q, q + static_cast<size_t>(rows) * D), qr(static_cast<size_t>(rows) * RD);
  for (float &x : qs) x *= c.meta.softmax_scale;
  for (int i = 0; i < rows; ++i) {
    std::copy(&qs[static_cast<size_t>(i) * D], &qs[static_cast<size_t>(i + 1) * D], &qr[static_cast<size_t>(i) * RD]);
    tq.rotation().rotate(&qr[static_cast<size_t>(i) * RD]);
  }

  const uint8_t *key_codes = c.quant_section<uint8_t>(kQuantKeyCodes) + static_cast<int64_t>(h) * P * cb;
  const float *key_scales = c.quant_section<float>(kQuantKeyScales) + static_cast<int64_t>(h) * P;
  const uint16_t *outlier_values = c.quant_section<uint16_t>(kQuantKeyOutlierValue) + static_cast<int64_t>(h) * P * n;
  const uint8_t *value_codes = c.quant_section<uint8_t>(kQuantValueCodes) + static_cast<int64_t>(h) * P * cb;
  const float *value_scales = c.quant_section<float>(kQuantValueScales) + static_cast<int64_t>(h) * P;
  const uint16_t *wk = c.quant_section<uint16_t>(kQuantWindowKeys) + static_cast<int64_t>(h) * W * D;
  const uint16_t *wv = c.quant_section<uint16_t>(kQuantWindowValues) + static_cast<int64_t>(h) * W * D;
  const int64_t suffix_base = static_cast<int64_t>(h) * c.suffix_capacity * D;
  const uint16_t *sk = reinterpret_cast<const uint16_t *>(c.suffix_keys.data()) + suffix_base;
  const uint16_t *sv = reinterpret_cast<const uint16_t *>(c.suffix_values.data()) + suffix_base;

  std::vector<float> L(static_cast<size_t>(rows) * total), y(RD), x(D);
  std::vector<int> channel(n);
  std::vector<float> outlier(n);
  for (int64_t t = 0; t < P; ++t) {
    tq.decode_rotated(key_codes + t * cb, key_scales[t], y.data());
    for (int j = 0; j < n; ++j) {
      channel[j] = outlier_channel(c, (static_cast<int64_t>(h) * P + t) * n + j);
      outlier[j] = half_to_float(outlier_values[t * n + j], storage);
    }
    for (int i = 0; i < rows; ++i) {
      const float *qi = &qs[static_cast<size_t>(i) * D];
      float logit = dot(&qr[static_cast<size_t>(i) * RD], y.data(), RD);
      for (int j = 0; j < n; ++j) logit += qi[channel[j]] * outlier[j];
      L[i * total + t] = logit;
    }
  }
  auto exact_logits = [&](const uint16_t *keys, int64_t count, int64_t offset) {
    for (int64_t t = 0; t < count; ++t) {
      half_row(keys + t * D, storage, D, x.data());
      for (int i = 0; i < rows; ++i) L[i * total + offset + t] = dot(&qs[static_cast<size_t>(i) * D], x.data(), D);
    }
  };
  exact_logits(wk, W, P);
  exact_logits(sk, suffix, prompt);

  // Row i = g * q_len + qi sees the prompt and the first visible(i) appended tokens.
  std::vector<double> sums(rows);
  for (int i = 0; i < rows; ++i) {
    const int64_t end = prompt + suffix - (q_len - 1 - i % q_len);
    float *l = &L[i * total];
    const float mx = *std::max_element(l, l + end);
    double sum = 0.0;
    for (int64_t t = 0; t < end; ++t) sum += (l[t] = std::exp(l[t] - mx));
    for (int64_t t = end; t < total; ++t) l[t] = 0.0f;
    sums[i] = sum;
    if (lse) lse[i] = mx + static_cast<float>(std::log(sum));
  }

  // Values: p * scale * levels accumulate in the rotated domain, one inverse rotation per
  // row; exact tokens directly.
  std::vector<float> racc(static_cast<size_t>(rows) * RD, 0.0f), acc(static_cast<size_t>(rows) * D, 0.0f);
  for (int64_t t = 0; t < P; ++t) {
    tq.decode_rotated(value_codes + t * cb, 1.0f, y.data());
    for (int i = 0; i < rows; ++i) {
      const float w = L[i * total + t] * value_scales[t];
      if (w == 0.0f) continue;
      float *r = &racc[static_cast<size_t>(i) * RD];
      for (int d = 0; d < RD; ++d) r[d] += w * y[d];
    }
  }
  for (int i = 0; i < rows; ++i) tq.rotation().unrotate(&racc[static_cast<size_t>(i) * RD]);
  auto exact_values = [&](const uint16_t *values, int64_t count, int64_t offset) {
    for (int64_t t = 0; t < count; ++t) {
      half_row(values + t * D, storage, D, x.data());
      for (int i = 0; i < rows; ++i) {
        const float p = L[i * total + offset + t];
        if (p == 0.0f) continue;
        float *a = &acc[static_cast<size_t>(i) * D];
        for (int d = 0; d < D; ++d) a[d] += p * x[d];
      }
    }
  };
  exact_values(wv, W, P);
  exact_values(sv, suffix, prompt);
  for (int i = 0; i < rows; ++i)
    for (int d = 0; d < D; ++d)
      out[static_cast<size_t>(i) * D + d] =
          static_cast<float>((acc[static_cast<size_t>(i) * D + d] + racc[static_cast<size_t>(i) * RD + d]) / sums[i]);
}

void reconstruct_quantized_prompt_cpu(const akv_cache &c, int h, bool rotated, float *keys, float *values) {
  const QuantGeometry &g = c.quant;
  const int D = g.dim, n = g.outliers;
  const int64_t P = g.prefix, W = g.window, cb = g.code_bytes();
  const akv_dtype storage = c.meta.storage;
  const TokenQuantizer &tq = c.quantizer;
  const int64_t hp = static_cast<int64_t>(h) * P;
  const uint8_t *key_codes = c.quant_section<uint8_t>(kQuantKeyCodes);
  const float *key_scales = c.quant_section<float>(kQuantKeyScales);
  const uint16_t *outlier_values = c.quant_section<uint16_t>(kQuantKeyOutlierValue);
  const uint8_t *value_codes = c.quant_section<uint8_t>(kQuantValueCodes);
  const float *value_scales = c.quant_section<float>(kQuantValueScales);
  std::vector<float> y(tq.rotation().rotated_dim());  // D padded to a power of two
  for (int64_t t = 0; t < P; ++t) {
    const int64_t slot = hp + t;
    float *k = keys + t * D, *v = values + t * D;
    tq.decode_rotated(key_codes + slot * cb, key_scales[slot], y.data());
    tq.rotation().unrotate(y.data());
    std::copy(y.begin(), y.begin() + D, k);
    for (int j = 0; j < n; ++j) k[outlier_channel(c, slot * n + j)] += half_to_float(outlier_values[slot * n + j], storage);
    tq.decode_rotated(value_codes + slot * cb, value_scales[slot], y.data());
    tq.rotation().unrotate(y.data());
    std::copy(y.begin(), y.begin() + D, v);
  }
  const uint16_t *wk = c.quant_section<uint16_t>(kQuantWindowKeys) + static_cast<int64_t>(h) * W * D;
  const uint16_t *wv = c.quant_section<uint16_t>(kQuantWindowValues) + static_cast<int64_t>(h) * W * D;
  for (int64_t w = 0; w < W; ++w) {
    half_row(wk + w * D, storage, D, keys + (P + w) * D);
    half_row(wv + w * D, storage, D, values + (P + w) * D);
  }
  if (!rotated)
    for (int64_t t = 0; t < P + W; ++t) c.rope.apply(keys + t * D, c.dense_positions[t], /*inverse=*/true);
}

}  // namespace akv
