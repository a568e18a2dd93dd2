// The AnchorKV byte accounting of SPEC 2.5 / paper Eq. 9 and 13, written out independently
// of the library so tests can compare akv_compressed_size and the cache stats against it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace akv_test {

struct AnchorBudget {
  int64_t anchors = 0;      // k, window included
  int64_t non_window = 0;   // P = S - W
  uint64_t full_bytes = 0;  // M_full = 4*S*H*D
  uint64_t base_bytes = 0;  // M_base
  double budget = 0.0;      // theta * M_full
  bool fits = false;        // budget >= M_base
  int64_t key_residual_bytes = 0;    // c_K
  int64_t value_residual_bytes = 0;  // c_V
  int64_t residuals_per_side_cap = 0;  // H * (P - (k - W)) non-anchor candidates per side
  int64_t key_residuals = 0;    // N_K
  int64_t value_residuals = 0;  // N_V
  uint64_t compressed_bytes = 0;  // M_base + N_K c_K + N_V c_V
  double min_retain_fraction = 0.0;  // M_base / M_full
};

// Storage format 3's segments (docs/design.md §3.2): 1024 positions when k <= 256 (no
// tables), else the largest of 256, 512, ..., 4096 with segment * k <= 64 * P.
inline int64_t format3_segment(int64_t P, int64_t k) {
  if (k <= 256) return 1024;
  int64_t len = 4096;
  while (len > 256 && len * k > 64 * P) len /= 2;
  return len;
}

// anchors_option 0 = the default k = max(W, S/128). format: the storage format, 2 (the
// paper's: u16 index and bf16 coefficient per token and side, int32 positions) or 3 (a byte
// each; per segment a 256-entry u16 table when k > 256 and two f32 scales; no positions).
inline AnchorBudget anchorkv_budget(int64_t S, int64_t H, int64_t D, int64_t W,
                                    int64_t anchors_option, double retain_fraction, int format = 2) {
  AnchorBudget b;
  b.anchors = anchors_option > 0 ? anchors_option : std::max<int64_t>(W, S / 128);
  const int64_t k = b.anchors, P = S - W;
  b.non_window = P;
  b.full_bytes = static_cast<uint64_t>(4 * S * H * D);
  if (format == 2) {
    const int64_t index_bytes = 2, coefficient_bytes = 2;
    b.base_bytes = static_cast<uint64_t>(H * (4 * k * D + 8 * (k - W) + 2 * P * (index_bytes + coefficient_bytes)) +
                                         24 * H * ((P + 63) / 64) + 8 * (H + 1) + 4 * P);
  } else {
    const int64_t segment = format3_segment(P, k), segments = (P + segment - 1) / segment;
    const int64_t per_segment = (k > 256 ? 2 * 256 : 0) + 2 * 4;
    b.base_bytes = static_cast<uint64_t>(H * (4 * k * D + 8 * (k - W) + 2 * P * (1 + 1) + segments * per_segment) +
                                         24 * H * ((P + 63) / 64) + 8 * (H + 1));
  }
  b.budget = retain_fraction * static_cast<double>(b.full_bytes);
  b.min_retain_fraction = static_cast<double>(b.base_bytes) / static_cast<double>(b.full_bytes);
  int64_t padded = 1;  // the codec rotates D padded to a power of two (80, 96, 112 -> 128)
  while (padded < D) padded <<= 1;
  b.key_residual_bytes = padded / 4 + 4;
  b.value_residual_bytes = padded / 4 + 5;
  b.residuals_per_side_cap = std::max<int64_t>(0, H * (P - (k - W)));
  b.fits = b.budget >= static_cast<double>(b.base_bytes);
  if (!b.fits) return b;
  const double spare = b.budget - static_cast<double>(b.base_bytes);
  const double mean_cost = (b.key_residual_bytes + b.value_residual_bytes) / 2.0;
  int64_t total = std::max<int64_t>(0, static_cast<int64_t>(std::floor(spare / mean_cost)));
  auto cost = [&](int64_t n) {
    return static_cast<double>((n / 2) * b.key_residual_bytes + (n - n / 2) * b.value_residual_bytes);
  };
  while (total > 0 && cost(total) > spare) --total;
  b.key_residuals = std::min(total / 2, b.residuals_per_side_cap);
  b.value_residuals = std::min(total - total / 2, b.residuals_per_side_cap);
  b.compressed_bytes = b.base_bytes + static_cast<uint64_t>(b.key_residuals * b.key_residual_bytes +
                                                            b.value_residuals * b.value_residual_bytes);
  return b;
}

// The automatic k of akv_compress_options_init (anchors = 0), by linear search: the paper's
// max(W, S/128), plus as many anchors as anchor_share of the budget left after its M_base
// pays for (one anchor adds H (4D + 8) bytes to M_base; clamped to S); then, with
// fill_budget, while every non-anchor token holds both residuals, the largest k that still
// fits with that true. 0 when even the paper's k does not fit.
inline int64_t anchorkv_auto_anchors(int64_t S, int64_t H, int64_t D, int64_t W, double anchor_share,
                                     bool fill_budget, double retain_fraction, int format = 2) {
  const int64_t cap = std::min<int64_t>(S, 65536);
  int64_t k = std::min<int64_t>(cap, std::max<int64_t>(W, S / 128));
  const AnchorBudget paper = anchorkv_budget(S, H, D, W, k, retain_fraction, format);
  if (!paper.fits) return 0;
  const double spare = anchor_share * (paper.budget - static_cast<double>(paper.base_bytes));
  while (k < cap && static_cast<double>((k + 1 - paper.anchors) * H * (4 * D + 8)) <= spare) ++k;
  auto saturated = [&](int64_t anchors) {
    const AnchorBudget b = anchorkv_budget(S, H, D, W, anchors, retain_fraction, format);
    return b.fits && b.key_residuals >= b.residuals_per_side_cap && b.value_residuals >= b.residuals_per_side_cap;
  };
  if (fill_budget && saturated(k))
    while (k < cap && saturated(k + 1)) ++k;
  return k;
}

}  // namespace akv_test
