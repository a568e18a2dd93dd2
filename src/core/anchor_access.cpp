#include "core/anchor_access.hpp"

#include <algorithm>
#include <vector>

#include "core/backend.hpp"
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
  free_anchors_ = g.anchors - g.window;
  tokens_ = reinterpret_cast<const int64_t *>(sec(kAnchorTokens));
}

AnchorAccess::AnchorAccess(const akv_cache &c)
    : AnchorAccess(c.geometry, c.layout, c.data.data(), c.meta.window_first_position) {}

int32_t AnchorAccess::own_anchor(int side, int h, int64_t t) const {
  const int64_t i = static_cast<int64_t>(h) * g_.prefix + t;
  if (index_[side][i] != 0 || gamma_[side][i] != 0) return -1;  // what every anchor token stores
  const int64_t *first = tokens_ + static_cast<int64_t>(h) * free_anchors_, *last = first + free_anchors_;
  const int64_t *at = std::lower_bound(first, last, t);  // the list is increasing (deserializer-checked)
  return at != last && *at == t ? static_cast<int32_t>(at - first) : -1;
}

int32_t AnchorAccess::anchor(int side, int h, int64_t t) const {
  const int64_t i = static_cast<int64_t>(h) * g_.prefix + t;
  if (g_.format == 2) return reinterpret_cast<const uint16_t *>(index_[side])[i];
  if (const int32_t own = own_anchor(side, h, t); own >= 0) return own;
  const uint8_t entry = index_[side][i];
  return tables_ ? tables_[(static_cast<int64_t>(h) * g_.segments + g_.segment_of(t)) * g_.table_size + entry] : entry;
}

float AnchorAccess::gamma(int side, int h, int64_t t) const {
  const int64_t i = static_cast<int64_t>(h) * g_.prefix + t;
  if (g_.format == 2) return bf16_to_float(reinterpret_cast<const uint16_t *>(gamma_[side])[i]);
  if (own_anchor(side, h, t) >= 0) return 1.0f;
  return gamma_value(gamma_[side][i], scales_[(static_cast<int64_t>(h) * g_.segments + g_.segment_of(t)) * 2 + side]);
}

void key_classes(const uint64_t *key_mask, const int64_t *anchor_tokens, int64_t free_anchors, int64_t prefix,
                 uint8_t *out) {
  key_classes(key_mask, anchor_tokens, free_anchors, 0, prefix, out);
}

void key_classes(const uint64_t *key_mask, const int64_t *anchor_tokens, int64_t free_anchors, int64_t t0,
                 int64_t t1, uint8_t *out) {
  for (int64_t t = t0; t < t1; ++t) out[t - t0] = (key_mask[t >> 6] >> (t & 63) & 1u) ? kKeyResidual : kReconstructed;
  const int64_t *end = anchor_tokens + free_anchors;
  for (const int64_t *a = std::lower_bound(anchor_tokens, end, t0); a != end && *a < t1; ++a) out[*a - t0] = kExact;
}

void logit_penalties(const akv_cache &cache, Backend &backend, float *out, void *stream) {
  const int64_t H = cache.meta.shape.num_kv_heads, T = cache.meta.shape.seq_len + cache.suffix_len;
  std::fill(out, out + H * T, 0.0f);
  if (cache.meta.logit_penalty.empty()) return;
  const AnchorGeometry &g = cache.geometry;
  const int64_t free_anchors = g.anchors - g.window;
  std::vector<uint64_t> mask(static_cast<size_t>(H * g.words));
  std::vector<int64_t> anchors(static_cast<size_t>(H * free_anchors));
  backend.read(mask.data(), cache.section<uint64_t>(kKeyMask), mask.size() * sizeof(uint64_t), stream);
  backend.read(anchors.data(), cache.section<int64_t>(kAnchorTokens), anchors.size() * sizeof(int64_t), stream);
  std::vector<uint8_t> cls(static_cast<size_t>(g.prefix));
  for (int64_t h = 0; h < H; ++h) {
    key_classes(mask.data() + h * g.words, anchors.data() + h * free_anchors, free_anchors, g.prefix, cls.data());
    const float penalty[3] = {cache.meta.logit_penalty[2 * h], cache.meta.logit_penalty[2 * h + 1], 0.0f};
    float *row = out + h * T;
    for (int64_t t = 0; t < g.prefix; ++t) row[t] = penalty[cls[t]];
  }
}

}  // namespace akv
