#include "core/anchor_access.hpp"

#include "core/context.hpp"
#include "core/dtype.hpp"

namespace akv {

AnchorAccess::AnchorAccess(const AnchorGeometry &g, const AnchorLayout &layout, const uint8_t *data,
                           int64_t window_first_position)
    : g_(g) {
  auto sec = [&](int i) { return data + layout.sections[i].offset; };
  index_[0] = sec(kKeyIndex);
  index_[1] = sec(kValueIndex);
  gamma_[0] = sec(kKeyGamma);
  gamma_[1] = sec(kValueGamma);
  if (g.format == 2) {
    positions_ = reinterpret_cast<const int32_t *>(sec(kPositions));
    return;
  }
  first_position_ = window_first_position - g.prefix;
  if (g.table_size) tables_ = reinterpret_cast<const uint16_t *>(sec(kSegmentTables));
  scales_ = reinterpret_cast<const float *>(sec(kGammaScales));
  const int64_t free_anchors = g.anchors - g.window;
  const int64_t *tokens = reinterpret_cast<const int64_t *>(sec(kAnchorTokens));
  own_.assign(static_cast<size_t>(g.heads) * g.prefix, -1);
  for (int64_t h = 0; h < g.heads; ++h)
    for (int64_t a = 0; a < free_anchors; ++a) own_[h * g.prefix + tokens[h * free_anchors + a]] = static_cast<int32_t>(a);
}

AnchorAccess::AnchorAccess(const akv_cache &c)
    : AnchorAccess(c.geometry, c.layout, c.data.data(), c.meta.window_first_position) {}

int32_t AnchorAccess::anchor(int side, int h, int64_t t) const {
  const int64_t i = static_cast<int64_t>(h) * g_.prefix + t;
  if (g_.format == 2) return reinterpret_cast<const uint16_t *>(index_[side])[i];
  if (own_[i] >= 0) return own_[i];
  const uint8_t entry = index_[side][i];
  return tables_ ? tables_[(static_cast<int64_t>(h) * g_.segments + g_.segment_of(t)) * g_.table_size + entry] : entry;
}

float AnchorAccess::gamma(int side, int h, int64_t t) const {
  const int64_t i = static_cast<int64_t>(h) * g_.prefix + t;
  if (g_.format == 2) return bf16_to_float(reinterpret_cast<const uint16_t *>(gamma_[side])[i]);
  if (own_[i] >= 0) return 1.0f;
  return gamma_value(gamma_[side][i], scales_[(static_cast<int64_t>(h) * g_.segments + g_.segment_of(t)) * 2 + side]);
}

}  // namespace akv
