// Section-by-section comparison of two AnchorKV caches of the same geometry (GPU and CPU
// compression of the same inputs), counting where a floating-point near-tie flipped a choice.
// White-box: needs the library's internals (link anchorkv_internal).
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <iterator>
#include <vector>

#include "core/anchor_access.hpp"
#include "core/context.hpp"
#include "core/dtype.hpp"

namespace akv_test {

struct Compared {
  // anchor_diff: anchors one cache has and the other has not (per head, counted once per
  // swap); index_diff: tokens whose anchor (as a token, not as an index into the list) differs.
  int64_t tokens = 0, index_diff = 0, gamma_diff = 0, mask_diff = 0, anchor_diff = 0, free_anchors = 0;
  int64_t codes_compared = 0, codes_diff = 0;
  double worst_scale = 0.0;
};

// Section-by-section comparison of two AnchorKV caches of the same geometry and storage format
// (2 or 3: assignments are read through AnchorAccess; a coefficient is its bf16 bits or its
// one-byte code).
inline Compared compare_anchor_caches(const akv_cache &a, const akv_cache &b) {
  const akv::AnchorGeometry &g = a.geometry;
  const int64_t H = g.heads, P = g.prefix, D = g.dim, k = g.anchors, W = g.window;
  Compared r;
  r.tokens = H * P;
  auto sec = [](const akv_cache &c, int i) { return c.data.data() + c.layout.sections[i].offset; };
  const int64_t *ta = reinterpret_cast<const int64_t *>(sec(a, akv::kAnchorTokens));
  const int64_t *tb = reinterpret_cast<const int64_t *>(sec(b, akv::kAnchorTokens));
  r.free_anchors = k - W;
  for (int64_t h = 0; h < H; ++h) {  // the lists are increasing
    std::vector<int64_t> only;
    std::set_difference(ta + h * (k - W), ta + (h + 1) * (k - W), tb + h * (k - W), tb + (h + 1) * (k - W),
                        std::back_inserter(only));
    r.anchor_diff += static_cast<int64_t>(only.size());
  }
  // A token's anchor as a token: list entry idx < k-W, else window position P + idx - (k-W).
  auto anchor_token = [&](const int64_t *list, int64_t h, int idx) {
    return idx < k - W ? list[h * (k - W) + idx] : P + idx - (k - W);
  };
  const akv::AnchorAccess xa(a), xb(b);
  for (int side = 0; side < 2; ++side) {
    const int gam = side ? akv::kValueGamma : akv::kKeyGamma;
    auto coefficient = [&](const akv_cache &c, int64_t i) {  // its raw bits or code
      return g.format == 3 ? static_cast<int>(sec(c, gam)[i]) : static_cast<int>(reinterpret_cast<const uint16_t *>(sec(c, gam))[i]);
    };
    std::vector<char> same(static_cast<size_t>(H * P));
    for (int64_t i = 0; i < H * P; ++i) {
      const int h = static_cast<int>(i / P);
      same[i] = anchor_token(ta, h, xa.anchor(side, h, i % P)) == anchor_token(tb, h, xb.anchor(side, h, i % P));
      r.index_diff += !same[i];
      if (same[i]) r.gamma_diff += std::abs(coefficient(a, i) - coefficient(b, i)) > 1;
    }
    const int rows_sec = side ? akv::kAnchorValues : akv::kAnchorKeys;
    auto same_row = [&](int64_t h, int ia, int ib) {  // the side's stored anchor rows, bit for bit
      const uint16_t *ra = reinterpret_cast<const uint16_t *>(sec(a, rows_sec)) + (static_cast<int64_t>(h) * k + ia) * D;
      const uint16_t *rb = reinterpret_cast<const uint16_t *>(sec(b, rows_sec)) + (static_cast<int64_t>(h) * k + ib) * D;
      return std::equal(ra, ra + D, rb);
    };
    const int msk = side ? akv::kValueMask : akv::kKeyMask;
    const uint64_t *ma = reinterpret_cast<const uint64_t *>(sec(a, msk)), *mb = reinterpret_cast<const uint64_t *>(sec(b, msk));
    for (int64_t w = 0; w < H * g.words; ++w) r.mask_diff += __builtin_popcountll(ma[w] ^ mb[w]);
    // Codes and scales of the residuals both caches store (same head, token, slot order).
    const int off = side ? akv::kValueOffsets : akv::kKeyOffsets, pre = side ? akv::kValuePrefix : akv::kKeyPrefix;
    const int cod = side ? akv::kValueCodes : akv::kKeyCodes, scl = side ? akv::kValueScales : akv::kKeyScales;
    const uint32_t *oa = reinterpret_cast<const uint32_t *>(sec(a, off)), *ob = reinterpret_cast<const uint32_t *>(sec(b, off));
    const uint32_t *pa = reinterpret_cast<const uint32_t *>(sec(a, pre)), *pb = reinterpret_cast<const uint32_t *>(sec(b, pre));
    for (int64_t h = 0; h < H; ++h)
      for (int64_t w = 0; w < g.words; ++w) {
        const uint64_t both = ma[h * g.words + w] & mb[h * g.words + w];
        for (int bit = 0; bit < 64; ++bit) {
          if (!(both >> bit & 1)) continue;
          const uint64_t below = (bit ? (~0ull >> (64 - bit)) : 0ull);
          const int64_t t = w * 64 + bit;
          const int64_t i = h * P + t;
          // A different residual altogether: another anchor or coefficient, or the same anchor
          // whose stored row differs (an fp32 rounding apart before the bf16 store, one unit of
          // an element: the residual moves by gamma x that unit there, its scale up to ~1e-3).
          if (!same[i] || coefficient(a, i) != coefficient(b, i) || xa.gamma(side, static_cast<int>(h), t) != xb.gamma(side, static_cast<int>(h), t) ||
              !same_row(h, xa.anchor(side, static_cast<int>(h), t), xb.anchor(side, static_cast<int>(h), t)))
            continue;
          const uint32_t sa = oa[h] + pa[h * g.words + w] + __builtin_popcountll(ma[h * g.words + w] & below);
          const uint32_t sb = ob[h] + pb[h * g.words + w] + __builtin_popcountll(mb[h * g.words + w] & below);
          const uint8_t *ca = sec(a, cod) + static_cast<int64_t>(sa) * (D / 4), *cb = sec(b, cod) + static_cast<int64_t>(sb) * (D / 4);
          int64_t flipped = 0;
          for (int64_t d = 0; d < D; ++d) {
            r.codes_compared++;
            flipped += ((ca[d / 4] >> (2 * (d % 4))) & 3) != ((cb[d / 4] >> (2 * (d % 4))) & 3);
          }
          r.codes_diff += flipped;
          if (flipped) continue;  // a flipped code moves the least-squares scale by design
          const float xa = reinterpret_cast<const float *>(sec(a, scl))[sa], xb = reinterpret_cast<const float *>(sec(b, scl))[sb];
          r.worst_scale = std::max(r.worst_scale, std::fabs(static_cast<double>(xa) - xb) / std::max(1e-30, std::fabs(static_cast<double>(xb))));
        }
      }
  }
  return r;
}

// The bounds the GPU compression is held to against the CPU: anchors agree except near-ties
// (at most 2, or 2% of a head's free anchors: a near-tie in one coverage round changes that
// round's pick and the ones after it), assignments except near-ties (1 token in 200) and the
// dependents of swapped anchors (up to 8 x P / (k-W) each), coefficients within one bf16 step,
// the residual choice within 1% of the tokens (plus the swapped anchors' dependents), codes of
// the same residual (same anchor, coefficient and stored anchor row) within 0.5%, scales within
// 1e-3 relative.
inline ::testing::AssertionResult anchor_caches_agree(const akv_cache &got, const akv_cache &expected) {
  const Compared r = compare_anchor_caches(got, expected);
  ::testing::Test::RecordProperty("assignments_differing", std::to_string(r.index_diff));
  ::testing::Test::RecordProperty("residual_bits_differing", std::to_string(r.mask_diff));
  const int64_t heads = got.geometry.heads;
  const int64_t swapped_dependents = r.anchor_diff * 8 * got.geometry.prefix / std::max<int64_t>(r.free_anchors, 1);
  const bool ok = r.anchor_diff <= std::max<int64_t>(2, heads * r.free_anchors / 50) &&
                  r.index_diff <= r.tokens / 200 + 2 + swapped_dependents && r.gamma_diff <= r.tokens / 200 + 2 &&
                  r.mask_diff <= r.tokens / 100 + 4 + swapped_dependents && r.codes_diff <= r.codes_compared / 200 + 2 &&
                  r.worst_scale < 1e-3;
  auto result = ok ? ::testing::AssertionSuccess() : ::testing::AssertionFailure();
  return result << "of " << r.tokens << " tokens per side: anchors differing " << r.anchor_diff << ", assignments "
                << r.index_diff << ", coefficients (> 1 bf16 step) " << r.gamma_diff << ", residual bits " << r.mask_diff
                << ", codes " << r.codes_diff << " of " << r.codes_compared << ", worst scale error " << r.worst_scale;
}

// Dense caches from the device and the CPU: same counts and positions, values bit for bit,
// keys (rotated in float with differently computed angles) within one storage step
// (relative, plus 1e-4 absolute for keys near zero).
inline ::testing::AssertionResult dense_caches_agree(const akv_cache &got, const akv_cache &expected) {
  if (got.data.size() != expected.data.size() || got.meta.dense_counts != expected.meta.dense_counts ||
      got.dense_positions != expected.dense_positions)
    return ::testing::AssertionFailure() << "sizes, counts or positions differ";
  const uint16_t *a = reinterpret_cast<const uint16_t *>(got.data.data());
  const uint16_t *b = reinterpret_cast<const uint16_t *>(expected.data.data());
  const size_t half = expected.data.size() / 4;  // elements per side
  size_t key_steps = 0, value_diff = 0;
  const akv_dtype storage = expected.meta.storage;
  const double step = storage == AKV_DTYPE_BF16 ? 1.0 / 128 : 1.0 / 1024;  // relative storage step
  for (size_t i = 0; i < half; ++i) {
    // A key near zero can differ by many ulps for a tiny absolute error: compare values.
    const double x = akv::half_to_float(a[i], storage), y = akv::half_to_float(b[i], storage);
    key_steps += std::fabs(x - y) > step * std::fabs(y) + 1e-4;
    value_diff += a[half + i] != b[half + i];
  }
  if (key_steps == 0 && value_diff == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << key_steps << " keys differ by more than one step, " << value_diff
                                       << " values differ";
}

// Eviction caches from the device and the CPU: the same kept tokens except near-tie swaps
// (at most 1 in 100 kept tokens), and when the kept sets agree, the same rows.
inline ::testing::AssertionResult eviction_caches_agree(const akv_cache &got, const akv_cache &expected) {
  const size_t heads = expected.meta.dense_counts.size();
  if (got.dense_tokens.size() != expected.dense_tokens.size() || got.meta.dense_counts.size() != heads)
    return ::testing::AssertionFailure() << "kept " << got.dense_tokens.size() << " tokens, expected "
                                         << expected.dense_tokens.size();
  int64_t swapped = 0, at_got = 0, at_expected = 0;
  for (size_t h = 0; h < heads; ++h) {
    const int64_t n = expected.meta.dense_counts[h], m = got.meta.dense_counts[h];
    std::vector<int32_t> common;
    std::set_intersection(got.dense_tokens.begin() + at_got, got.dense_tokens.begin() + at_got + m,
                          expected.dense_tokens.begin() + at_expected, expected.dense_tokens.begin() + at_expected + n,
                          std::back_inserter(common));
    swapped += n - static_cast<int64_t>(common.size());
    at_got += m;
    at_expected += n;
  }
  const int64_t bound = static_cast<int64_t>(expected.dense_tokens.size()) / 100 + 1;
  if (swapped > bound)
    return ::testing::AssertionFailure() << swapped << " kept tokens differ (bound " << bound << ")";
  if (got.dense_tokens == expected.dense_tokens) return dense_caches_agree(got, expected);
  return ::testing::AssertionSuccess() << swapped << " kept tokens differ";
}

}  // namespace akv_test
