#include "core/layout.hpp"

#include <algorithm>
#include <cmath>
#include "core/codec.hpp"
#include "core/error.hpp"

namespace akv {

int64_t default_anchor_count(int64_t seq_len, int32_t window) {
  return std::min<int64_t>(seq_len, std::max<int64_t>(window, seq_len / 128));
}

double minimum_retain_fraction(uint64_t base_bytes, uint64_t full_bytes) {
  double theta = std::ceil(static_cast<double>(base_bytes) / full_bytes * 1e6) / 1e6;
  while (theta * static_cast<double>(full_bytes) < static_cast<double>(base_bytes)) theta += 1e-6;
  return std::min(theta, 1.0);
}

AnchorGeometry anchor_geometry(const akv_compress_options &o, const akv_shape &s) {
  AnchorGeometry g;
  require(s.seq_len > 0, AKV_ERR_INVALID_ARGUMENT, "shape.seq_len ", s.seq_len, " must be positive");
  require(s.num_kv_heads > 0, AKV_ERR_INVALID_ARGUMENT, "shape.num_kv_heads ", s.num_kv_heads,
          " must be positive");
  require(s.num_q_heads > 0 && s.num_q_heads % s.num_kv_heads == 0, AKV_ERR_INVALID_ARGUMENT,
          "shape.num_q_heads ", s.num_q_heads, " must be a positive multiple of num_kv_heads ",
          s.num_kv_heads);
  require(s.head_dim > 0, AKV_ERR_INVALID_ARGUMENT, "shape.head_dim ", s.head_dim, " must be positive");
  require(is_power_of_two(s.head_dim) && s.head_dim >= 16 && s.head_dim <= 512, AKV_ERR_UNSUPPORTED,
          "head_dim ", s.head_dim, " is not supported by the residual codec: it must be a power of"
          " two in [16, 512]");
  require(std::isfinite(o.retain_fraction) && o.retain_fraction > 0.0 && o.retain_fraction <= 1.0,
          AKV_ERR_INVALID_ARGUMENT, "retain_fraction ", o.retain_fraction, " must be in (0, 1]");
  require(o.window > 0, AKV_ERR_INVALID_ARGUMENT, "window ", o.window, " must be positive");
  require(s.seq_len > o.window, AKV_ERR_INVALID_ARGUMENT, "seq_len ", s.seq_len,
          " must exceed the window ", o.window, " for AnchorKV");
  const int64_t k = o.anchors == 0 ? default_anchor_count(s.seq_len, o.window) : o.anchors;
  require(k >= o.window && k <= s.seq_len && k <= 65536, AKV_ERR_INVALID_ARGUMENT, "anchors ", k,
          " must be within [window=", o.window, ", min(seq_len=", s.seq_len, ", 65536)]");
  g.seq_len = s.seq_len;
  g.prefix = s.seq_len - o.window;
  g.heads = s.num_kv_heads;
  g.q_heads = s.num_q_heads;
  g.dim = s.head_dim;
  g.window = o.window;
  g.anchors = static_cast<int32_t>(k);
  g.words = (g.prefix + 63) / 64;

  const uint64_t H = g.heads, D = g.dim, P = g.prefix, W = g.window;
  g.full_bytes = 4ull * s.seq_len * H * D;
  const double budget = o.retain_fraction * static_cast<double>(g.full_bytes);
  g.budget_bytes = static_cast<uint64_t>(std::floor(budget));
  const uint64_t index_bytes = 2, gamma_bytes = 2;  // b_a, b_gamma
  g.base_bytes = H * (4ull * k * D + 8ull * (k - W) + 2ull * P * (index_bytes + gamma_bytes)) +
                 24ull * H * static_cast<uint64_t>(g.words) + 8ull * (H + 1) + 4ull * P;
  if (static_cast<double>(g.base_bytes) > budget) {
    fail(AKV_ERR_BUDGET, "retain_fraction ", o.retain_fraction, " leaves ", g.budget_bytes,
         " bytes, less than the ", g.base_bytes, " bytes the anchors and metadata need (S=",
         s.seq_len, ", H=", H, ", D=", D, ", k=", k, ", W=", W,
         "); the smallest workable retain_fraction is ",
         minimum_retain_fraction(g.base_bytes, g.full_bytes));
  }
  const double per_residual = (g.key_residual_bytes() + g.value_residual_bytes()) / 2.0;
  int64_t n = static_cast<int64_t>(std::floor((budget - static_cast<double>(g.base_bytes)) / per_residual));
  n = std::max<int64_t>(0, n);
  const int64_t candidates = static_cast<int64_t>(H) * (g.prefix - (k - W));  // non-anchor tokens
  for (;; --n) {
    g.key_residuals = std::min(n / 2, candidates);
    g.value_residuals = std::min(n - n / 2, candidates);
    g.footprint = g.base_bytes + g.key_residuals * g.key_residual_bytes() +
                  g.value_residuals * g.value_residual_bytes();
    if (static_cast<double>(g.footprint) <= budget || n == 0) break;
  }
  return g;
}

AnchorLayout anchor_layout(const AnchorGeometry &g) {
  const uint64_t H = g.heads, k = g.anchors, D = g.dim, P = g.prefix, W = g.window;
  const uint64_t words = g.words, nk = g.key_residuals, nv = g.value_residuals;
  std::array<uint64_t, kAnchorSectionCount> bytes{};
  bytes[kAnchorKeys] = H * k * D * 2;
  bytes[kAnchorValues] = H * k * D * 2;
  bytes[kAnchorTokens] = H * (k - W) * 8;
  bytes[kKeyIndex] = bytes[kValueIndex] = H * P * 2;
  bytes[kKeyGamma] = bytes[kValueGamma] = H * P * 2;
  bytes[kPositions] = P * 4;
  bytes[kKeyMask] = bytes[kValueMask] = H * words * 8;
  bytes[kKeyPrefix] = bytes[kValuePrefix] = H * words * 4;
  bytes[kKeyOffsets] = bytes[kValueOffsets] = (H + 1) * 4;
  bytes[kKeyCodes] = nk * (D / 4);
  bytes[kKeyScales] = nk * 4;
  bytes[kValueCodes] = nv * (D / 4);
  bytes[kValueScales] = nv * 4;
  bytes[kValueChunkPos] = nv;
  AnchorLayout layout;
  uint64_t offset = 0;
  for (int i = 0; i < kAnchorSectionCount; ++i) {
    layout.sections[i].offset = offset;
    layout.sections[i].bytes = bytes[i];
    offset += (bytes[i] + kSectionAlignment - 1) / kSectionAlignment * kSectionAlignment;
  }
  layout.total_bytes = offset;
  return layout;
}

}  // namespace akv
