#include "core/quantizer.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>
#include "core/error.hpp"
#include "core/layout.hpp"

namespace akv {

std::vector<float> lloyd_max_levels(int bits) {
  const float *half = bits == 2 ? kLloydMax2 : bits == 3 ? kLloydMax3 : kLloydMax4;
  const int n = 1 << bits, h = n / 2;
  std::vector<float> levels(n);
  for (int i = 0; i < h; ++i) {
    levels[h + i] = half[i];
    levels[h - 1 - i] = -half[i];
  }
  return levels;
}

QuantGeometry quant_geometry_for_bits(const akv_shape &s, int32_t window, int32_t bits, int32_t outliers) {
  QuantGeometry g;
  g.seq_len = s.seq_len;
  g.heads = s.num_kv_heads;
  g.q_heads = s.num_q_heads;
  g.dim = s.head_dim;
  g.window = static_cast<int32_t>(std::min<int64_t>(window, s.seq_len));
  g.prefix = s.seq_len - g.window;
  g.bits = bits;
  g.outliers = outliers;
  g.index_bytes = s.head_dim > 256 ? 2 : 1;
  const uint64_t H = g.heads, P = g.prefix, W = g.window, D = g.dim, n = outliers;
  const uint64_t cb = static_cast<uint64_t>(g.code_bytes());
  g.bytes[kQuantWindowKeys] = g.bytes[kQuantWindowValues] = H * W * D * 2;
  g.bytes[kQuantKeyCodes] = g.bytes[kQuantValueCodes] = H * P * cb;
  g.bytes[kQuantKeyScales] = g.bytes[kQuantValueScales] = H * P * 4;
  g.bytes[kQuantKeyOutlierIndex] = H * P * n * g.index_bytes;
  g.bytes[kQuantKeyOutlierValue] = H * P * n * 2;
  uint64_t offset = 0;
  for (int i = 0; i < kQuantSectionCount; ++i) {
    g.offsets[i] = offset;
    g.footprint += g.bytes[i];
    offset += (g.bytes[i] + kSectionAlignment - 1) / kSectionAlignment * kSectionAlignment;
  }
  g.total_bytes = offset;
  g.full_bytes = 4ull * s.seq_len * H * D;
  return g;
}

QuantGeometry quant_geometry(const akv_compress_options &o, const akv_shape &s) {
  require(codec_head_dim(s.head_dim), AKV_ERR_UNSUPPORTED, "head_dim ", s.head_dim,
          " is not supported by the quantizer's Hadamard rotation: it must be a multiple of 16 in"
          " [16, 512] (padded to the next power of two)");
  require(o.quant_bits == 0 || (o.quant_bits >= 2 && o.quant_bits <= 4), AKV_ERR_INVALID_ARGUMENT,
          "quant_bits ", o.quant_bits, " must be 2, 3 or 4 (0 = the most that fit the budget)");
  const int32_t max_outliers = std::min(32, s.head_dim / 2);
  require(o.quant_outliers >= 0 && o.quant_outliers <= max_outliers, AKV_ERR_INVALID_ARGUMENT,
          "quant_outliers ", o.quant_outliers, " must be in [0, ", max_outliers, "] for head_dim ", s.head_dim);
  require(o.window > 0, AKV_ERR_INVALID_ARGUMENT, "window ", o.window, " must be positive");
  const double budget = o.retain_fraction * 4.0 * static_cast<double>(s.seq_len) * s.num_kv_heads * s.head_dim;
  for (int32_t bits = o.quant_bits ? o.quant_bits : 4; bits >= 2; --bits) {
    QuantGeometry g = quant_geometry_for_bits(s, o.window, bits, o.quant_outliers);
    g.budget_bytes = static_cast<uint64_t>(std::floor(budget));
    if (static_cast<double>(g.footprint) <= budget) return g;
    if (o.quant_bits != 0 || bits == 2)
      fail(AKV_ERR_BUDGET, "retain_fraction ", o.retain_fraction, " leaves ", g.budget_bytes, " bytes, less than the ",
           g.footprint, " bytes of the ", bits, "-bit quantized cache (S=", s.seq_len, ", H=", s.num_kv_heads,
           ", D=", s.head_dim, ", W=", g.window, ", ", o.quant_outliers,
           " outlier channels); the smallest workable retain_fraction is ",
           minimum_retain_fraction(g.footprint, g.full_bytes));
  }
  fail(AKV_ERR_INTERNAL, "quant_geometry: no bit width examined");
}

void pack_codes(const uint8_t *codes, int n, int bits, uint8_t *out) {
  const int bytes = n * bits / 8;
  std::fill(out, out + bytes, uint8_t{0});
  for (int i = 0; i < n; ++i) {
    const int bit = i * bits;
    const uint32_t v = static_cast<uint32_t>(codes[i]) << (bit & 7);
    out[bit >> 3] |= static_cast<uint8_t>(v);
    if ((bit & 7) + bits > 8) out[(bit >> 3) + 1] |= static_cast<uint8_t>(v >> 8);
  }
}

void unpack_codes(const uint8_t *packed, int n, int bits, uint8_t *codes) {
  const uint32_t mask = (1u << bits) - 1u;
  if (bits == 2 || bits == 4) {  // codes never straddle a byte
    const int per = 8 / bits;
    for (int i = 0; i < n; ++i) codes[i] = (packed[i / per] >> ((i % per) * bits)) & mask;
    return;
  }
  for (int i = 0; i < n; ++i) {
    const int bit = i * bits, byte = bit >> 3;
    uint32_t v = packed[byte];
    if ((bit & 7) + bits > 8) v |= static_cast<uint32_t>(packed[byte + 1]) << 8;
    codes[i] = static_cast<uint8_t>((v >> (bit & 7)) & mask);
  }
}

TokenQuantizer::TokenQuantizer(uint64_t seed, int head_dim, int bits, int outliers)
    : dim_(head_dim), rdim_(static_cast<int>(padded_dim(head_dim))), bits_(bits), outliers_(outliers),
      rotation_(seed, head_dim, AKV_SCALE_LEAST_SQUARES), levels_(lloyd_max_levels(bits)) {
  for (size_t i = 0; i + 1 < levels_.size(); ++i) thresholds_.push_back(0.5f * (levels_[i] + levels_[i + 1]));
}

float TokenQuantizer::code_rotated(float *y, uint8_t *packed) const {
  double sumsq = 0.0;
  for (int d = 0; d < rdim_; ++d) sumsq += static_cast<double>(y[d]) * y[d];
  const double rms = std::sqrt(sumsq / rdim_);
  const double inv = rms > 0.0 ? 1.0 / rms : 0.0;
  uint8_t codes[512];
  double dot = 0.0, levels_sq = 0.0;
  for (int d = 0; d < rdim_; ++d) {
    const float z = static_cast<float>(y[d] * inv);
    const int c = static_cast<int>(std::upper_bound(thresholds_.begin(), thresholds_.end(), z) - thresholds_.begin());
    codes[d] = static_cast<uint8_t>(c);
    dot += static_cast<double>(y[d]) * levels_[c];
    levels_sq += static_cast<double>(levels_[c]) * levels_[c];
  }
  pack_codes(codes, rdim_, bits_, packed);
  // Least squares: the scale minimising ||y - s*levels||^2 for the chosen codes.
  return levels_sq > 0.0 ? static_cast<float>(dot / levels_sq) : 0.0f;
}

void TokenQuantizer::encode_key(const float *key, uint8_t *packed, float *scale, int32_t *outlier_index,
                                float *outlier_value) const {
  std::vector<float> y(rdim_, 0.0f);
  std::copy(key, key + dim_, y.begin());
  if (outliers_ > 0) {
    // The largest magnitudes, ties to the lower channel; stored in channel order.
    std::vector<int32_t> order(dim_);
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + outliers_, order.end(), [&](int32_t a, int32_t b) {
      const float fa = std::fabs(key[a]), fb = std::fabs(key[b]);
      return fa != fb ? fa > fb : a < b;
    });
    std::sort(order.begin(), order.begin() + outliers_);
    for (int i = 0; i < outliers_; ++i) {
      outlier_index[i] = order[i];
      outlier_value[i] = key[order[i]];
      y[order[i]] = 0.0f;
    }
  }
  rotation_.rotate(y.data());
  *scale = code_rotated(y.data(), packed);
}

void TokenQuantizer::encode_value(const float *value, uint8_t *packed, float *scale) const {
  std::vector<float> y(rdim_, 0.0f);
  std::copy(value, value + dim_, y.begin());
  rotation_.rotate(y.data());
  *scale = code_rotated(y.data(), packed);
}

void TokenQuantizer::decode_rotated(const uint8_t *packed, float scale, float *y) const {
  // Decode sits in the attention loop: whole bytes (2 and 4 bits) or 3-byte groups of eight
  // codes (3 bits) at a time. rdim_ is a power of two >= 16, so groups never straddle the end.
  const float *lv = levels_.data();
  if (bits_ == 3) {
    for (int g = 0; g < rdim_ / 8; ++g) {
      const uint32_t v = packed[3 * g] | (static_cast<uint32_t>(packed[3 * g + 1]) << 8) |
                         (static_cast<uint32_t>(packed[3 * g + 2]) << 16);
      for (int i = 0; i < 8; ++i) y[8 * g + i] = scale * lv[(v >> (3 * i)) & 7u];
    }
    return;
  }
  if (bits_ == 2) {
    for (int b = 0; b < rdim_ / 4; ++b) {
      const uint32_t v = packed[b];
      for (int i = 0; i < 4; ++i) y[4 * b + i] = scale * lv[(v >> (2 * i)) & 3u];
    }
    return;
  }
  for (int b = 0; b < rdim_ / 2; ++b) {
    const uint32_t v = packed[b];
    y[2 * b] = scale * lv[v & 15u];
    y[2 * b + 1] = scale * lv[v >> 4];
  }
}

}  // namespace akv
