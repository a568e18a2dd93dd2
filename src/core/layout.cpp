#include "core/layout.hpp"

#include <algorithm>
#include <cmath>
#include "core/codec.hpp"
#include "core/error.hpp"

namespace akv {

int64_t default_anchor_count(int64_t seq_len, int32_t window) {
  return std::min<int64_t>({seq_len, int64_t{65536}, std::max<int64_t>(window, seq_len / 128)});
}

int64_t sink_anchor_count(const akv_compress_options &o, const AnchorGeometry &g) {
  return std::min<int64_t>({int64_t{o.sink_tokens}, int64_t{g.anchors} - g.window, g.prefix});
}

int64_t scored_anchor_count(const akv_compress_options &o, const AnchorGeometry &g) {
  return std::max(scored_share(o, g.anchors - g.window), sink_anchor_count(o, g));
}

int64_t scored_share(const akv_compress_options &o, int64_t slots) {
  const int64_t by_share = std::llround(o.scored_fraction * static_cast<double>(slots));
  return std::min<int64_t>(slots, std::max<int64_t>(by_share, o.scored_min));
}

ResidualSplit residual_split(const akv_compress_options &o, int64_t n) {
  ResidualSplit split;
  split.by_energy = std::min<int64_t>(n, std::llround(o.guard_fraction * static_cast<double>(n)));
  split.by_utility = n - split.by_energy;
  return split;
}

int64_t AnchorGeometry::candidate_reach() const {
  if (table_size == 0) return -1;
  const int64_t free_anchors = int64_t{anchors} - window;
  return (kReachAnchors * prefix + free_anchors - 1) / std::max<int64_t>(free_anchors, 1);
}

int64_t segment_length(int64_t prefix, int64_t anchors) {
  if (anchors <= kTableEntries) return 1024;
  int64_t len = 256;
  while (len < 4096 && 2 * len * anchors <= 64 * prefix) len *= 2;
  return len;
}

namespace {
struct GammaUnits {
  float value[256];
  GammaUnits() {
    value[0] = 0.0f;
    for (int c = 1; c < 256; ++c) {
      const float mag = std::exp2(static_cast<float>((c & 127) - 127) / kGammaStepsPerOctave);
      value[c] = c & 128 ? -mag : mag;
    }
  }
};
}  // namespace

const float *gamma_units() {
  static const GammaUnits units;
  return units.value;
}

double minimum_retain_fraction(uint64_t base_bytes, uint64_t full_bytes) {
  double theta = std::ceil(static_cast<double>(base_bytes) / full_bytes * 1e6) / 1e6;
  while (theta * static_cast<double>(full_bytes) < static_cast<double>(base_bytes)) theta += 1e-6;
  return std::min(theta, 1.0);
}

namespace {

// The accounting for k anchors per head (shape and options already validated). fits is false
// when M_base exceeds the budget.
AnchorGeometry geometry_for(const akv_compress_options &o, const akv_shape &s, int64_t k, bool *fits) {
  AnchorGeometry g;
  g.seq_len = s.seq_len;
  g.prefix = s.seq_len - o.window;
  g.heads = s.num_kv_heads;
  g.q_heads = s.num_q_heads;
  g.dim = s.head_dim;
  g.window = o.window;
  g.anchors = static_cast<int32_t>(k);
  g.pool_heads = s.num_kv_heads;
  g.words = (g.prefix + 63) / 64;
  g.format = o.storage_format == 2 ? 2 : 3;

  const uint64_t H = g.heads, D = g.dim, P = g.prefix, W = g.window;
  g.full_bytes = 4ull * s.seq_len * H * D;
  const double budget = o.retain_fraction * static_cast<double>(g.full_bytes);
  g.budget_bytes = static_cast<uint64_t>(std::floor(budget));
  const uint64_t mask_bytes = 24ull * H * static_cast<uint64_t>(g.words) + 8ull * (H + 1);
  if (g.format == 2) {
    const uint64_t index_bytes = 2, gamma_bytes = 2;  // b_a, b_gamma
    g.base_bytes = H * (4ull * k * D + 8ull * (k - W) + 2ull * P * (index_bytes + gamma_bytes)) + mask_bytes + 4ull * P;
  } else {
    // One-byte indices and coefficient codes per side; per segment a table (k > 256) and two
    // f32 code scales; no positions.
    g.segment_len = segment_length(g.prefix, k);
    g.segments = (g.prefix + g.segment_len - 1) / g.segment_len;
    while ((int64_t{1} << g.segment_shift) < g.segment_len) ++g.segment_shift;
    g.table_size = k > kTableEntries ? kTableEntries : 0;
    const uint64_t per_segment = 2ull * g.table_size + 8ull;
    g.base_bytes = H * (4ull * k * D + 8ull * (k - W) + 4ull * P + per_segment * static_cast<uint64_t>(g.segments)) +
                   mask_bytes;
  }
  *fits = static_cast<double>(g.base_bytes) <= budget;
  if (!*fits) return g;
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

// Every non-anchor token holds both residuals: the budget has room the residuals cannot use.
bool residuals_saturated(const AnchorGeometry &g) {
  const int64_t candidates = static_cast<int64_t>(g.heads) * (g.prefix - (g.anchors - g.window));
  return g.key_residuals >= candidates && g.value_residuals >= candidates;
}

}  // namespace

AnchorGeometry anchor_geometry(const akv_compress_options &o, const akv_shape &s) {
  require(s.seq_len > 0, AKV_ERR_INVALID_ARGUMENT, "shape.seq_len ", s.seq_len, " must be positive");
  require(s.num_kv_heads > 0, AKV_ERR_INVALID_ARGUMENT, "shape.num_kv_heads ", s.num_kv_heads,
          " must be positive");
  require(s.num_q_heads > 0 && s.num_q_heads % s.num_kv_heads == 0, AKV_ERR_INVALID_ARGUMENT,
          "shape.num_q_heads ", s.num_q_heads, " must be a positive multiple of num_kv_heads ",
          s.num_kv_heads);
  require(s.head_dim > 0, AKV_ERR_INVALID_ARGUMENT, "shape.head_dim ", s.head_dim, " must be positive");
  require(codec_head_dim(s.head_dim), AKV_ERR_UNSUPPORTED, "head_dim ", s.head_dim,
          " is not supported by the residual codec: it must be a multiple of 16 in [16, 512] (padded"
          " to the next power of two)");
  require(std::isfinite(o.retain_fraction) && o.retain_fraction > 0.0 && o.retain_fraction <= 1.0,
          AKV_ERR_INVALID_ARGUMENT, "retain_fraction ", o.retain_fraction, " must be in (0, 1]");
  require(o.window > 0, AKV_ERR_INVALID_ARGUMENT, "window ", o.window, " must be positive");
  require(s.seq_len > o.window, AKV_ERR_INVALID_ARGUMENT, "seq_len ", s.seq_len,
          " must exceed the window ", o.window, " for AnchorKV");
  require(std::isfinite(o.anchor_share) && o.anchor_share >= 0.0 && o.anchor_share <= 1.0,
          AKV_ERR_INVALID_ARGUMENT, "anchor_share ", o.anchor_share, " must be in [0, 1]");
  require(o.pool_heads >= 0 && (o.pool_heads == 0 || s.num_kv_heads % o.pool_heads == 0), AKV_ERR_INVALID_ARGUMENT,
          "pool_heads ", o.pool_heads, " must divide num_kv_heads ", s.num_kv_heads, " (0 = every head)");
  if (o.pool_heads != 0 && o.pool_heads != s.num_kv_heads) {
    // Groups of pool_heads heads, each with the accounting of a call over its heads alone
    // (a TP rank's): the same k, N_K and N_V per group. Positions and the last offsets are
    // stored once instead of per group, so the footprint stays within theta * M_full.
    akv_compress_options alone = o;
    alone.pool_heads = 0;
    akv_shape part = s;
    part.num_kv_heads = o.pool_heads;
    part.num_q_heads = s.num_q_heads / s.num_kv_heads * o.pool_heads;
    const AnchorGeometry one = anchor_geometry(alone, part);
    bool fits = false;
    AnchorGeometry g = geometry_for(o, s, one.anchors, &fits);
    const int64_t groups = s.num_kv_heads / o.pool_heads;
    g.pool_heads = o.pool_heads;
    g.key_residuals = groups * one.key_residuals;
    g.value_residuals = groups * one.value_residuals;
    g.footprint = g.base_bytes + g.key_residuals * g.key_residual_bytes() + g.value_residuals * g.value_residual_bytes();
    require(fits && g.footprint <= g.budget_bytes, AKV_ERR_INTERNAL, "pooled geometry exceeds the budget");
    return g;
  }
  // Automatic anchors: the paper's k, raised by what anchor_share of the spare budget buys.
  int64_t k = o.anchors == 0 ? default_anchor_count(s.seq_len, o.window) : o.anchors;
  require(k >= o.window && k <= s.seq_len && k <= 65536, AKV_ERR_INVALID_ARGUMENT, "anchors ", k,
          " must be within [window=", o.window, ", min(seq_len=", s.seq_len, ", 65536)]");
  bool fits = false;
  AnchorGeometry g = geometry_for(o, s, k, &fits);
  if (fits && o.anchors == 0 && o.anchor_share > 0.0) {
    const double spare = o.retain_fraction * static_cast<double>(g.full_bytes) - static_cast<double>(g.base_bytes);
    const double per_anchor = static_cast<double>(g.heads) * (4.0 * g.dim + 8.0);  // M_base per extra anchor
    const int64_t extra = static_cast<int64_t>(std::floor(o.anchor_share * spare / per_anchor));
    const int64_t raised = std::min<int64_t>({k + extra, s.seq_len, int64_t{65536}});
    if (raised > k) {
      k = raised;
      g = geometry_for(o, s, k, &fits);
    }
  }
  if (!fits) {
    fail(AKV_ERR_BUDGET, "retain_fraction ", o.retain_fraction, " leaves ", g.budget_bytes,
         " bytes, less than the ", g.base_bytes, " bytes the anchors and metadata need (S=",
         s.seq_len, ", H=", g.heads, ", D=", g.dim, ", k=", k, ", W=", o.window,
         "); the smallest workable retain_fraction is ",
         minimum_retain_fraction(g.base_bytes, g.full_bytes));
  }
  if (o.anchors == 0 && o.fill_budget && residuals_saturated(g)) {
    // The largest k that still fits with every non-anchor token holding both residuals: both
    // conditions hold up to some k and fail beyond it, so a binary search finds it.
    int64_t lo = k, hi = std::min<int64_t>(s.seq_len, 65536);
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo + 1) / 2;
      const AnchorGeometry trial = geometry_for(o, s, mid, &fits);
      if (fits && residuals_saturated(trial)) lo = mid;
      else hi = mid - 1;
    }
    if (lo != k) g = geometry_for(o, s, lo, &fits);
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
  const uint64_t per_token = g.format == 2 ? 2 : 1;
  bytes[kKeyIndex] = bytes[kValueIndex] = H * P * per_token;
  bytes[kKeyGamma] = bytes[kValueGamma] = H * P * per_token;
  bytes[kPositions] = g.format == 2 ? P * 4 : 0;
  bytes[kKeyMask] = bytes[kValueMask] = H * words * 8;
  bytes[kKeyPrefix] = bytes[kValuePrefix] = H * words * 4;
  bytes[kKeyOffsets] = bytes[kValueOffsets] = (H + 1) * 4;
  bytes[kKeyCodes] = nk * g.code_bytes();
  bytes[kKeyScales] = nk * 4;
  bytes[kValueCodes] = nv * g.code_bytes();
  bytes[kValueScales] = nv * 4;
  bytes[kValueChunkPos] = nv;
  bytes[kSegmentTables] = H * static_cast<uint64_t>(g.segments) * g.table_size * 2;
  bytes[kGammaScales] = H * static_cast<uint64_t>(g.segments) * 8;
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
