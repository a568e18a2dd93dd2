// akv_cache_compact on the CPU: fold the dense suffix back into the anchor-residual form.
//
// The compacted cache is what compression at length T = S + appended would build, from what
// the cache still knows: the reconstruction of the old compressed part (its anchors and window
// exact, the other tokens gamma x_a + decoded residual) and the exact appended tokens. It runs
// the prefill compression (cpu/compress_anchorkv.cpp) over that sequence with the queries of the last W
// tokens and one change, the anchor priority: the old anchors stay anchors first (they are
// exact, and the old tokens lean on them; the old window is one of them, and when slots are
// short the least leaned-on give way), then appended tokens are picked as at prefill; a token known only through its old representation becomes an anchor
// only if slots are left over. An old token whose anchor stays keeps its assignment and
// coefficient (sticky), so its residual is its decoded residual re-encoded (codes on the same
// codebook, so close to lossless); an old token whose anchor gave way is re-assigned from its
// reconstruction. Every residual, old or new, competes in one pool per side.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "core/anchor_access.hpp"
#include "core/dtype.hpp"
#include "core/error.hpp"
#include "core/method_traits.hpp"
#include "core/options.hpp"
#include "cpu/attention.hpp"
#include "core/thread_pool.hpp"
#include "cpu/compress.hpp"

namespace akv {

namespace {

// The prefill compaction compresses: the cache's T tokens [H][T][D] fp32 (the reconstruction
// of the old part, post-RoPE, and the appended tokens), the last W queries and every position.
akv_prefill reconstructed_prefill(const CacheMeta &m, int64_t T, const std::vector<float> &keys,
                                  const std::vector<float> &values, const float *queries,
                                  const std::vector<int32_t> &pos) {
  akv_prefill p = default_prefill();
  p.shape = akv_shape{T, m.shape.num_kv_heads, m.shape.num_q_heads, m.shape.head_dim};
  p.dtype = AKV_DTYPE_F32;
  p.keys = keys.data();
  p.values = values.data();
  p.queries = queries;
  p.positions = pos.data();
  return p;
}

// The decode-time variant of the eviction baselines (AnDPro's rebuttal: "online updates during
// decoding" at a fixed budget and step): the kept prompt tokens and the appended ones are
// scored again with the queries of the last W tokens, as at prefill, and the method keeps its
// budget of T tokens among those still present (what was evicted stays evicted).
std::unique_ptr<akv_cache> reevict(const akv_cache &old, akv_context *context, const float *queries,
                                   akv_compress_options o, const std::vector<int32_t> &pos) {
  const CacheMeta &m = old.meta;
  const int64_t T = old.total_tokens();
  const int H = m.shape.num_kv_heads, D = m.shape.head_dim;
  std::vector<float> keys(static_cast<size_t>(H) * T * D), values(keys.size());
  std::vector<uint8_t> present(static_cast<size_t>(H) * T);
  context->pool->parallel_for(H, [&](int64_t b, int64_t e) {
    for (int64_t h = b; h < e; ++h)
      reconstruct_head_cpu(old, static_cast<int>(h), true, &keys[h * T * D], &values[h * T * D], &present[h * T]);
  });
  o.keys_post_rope = 1;  // the reconstruction is post-RoPE: the kept keys go back unchanged
  akv_prefill p = reconstructed_prefill(m, T, keys, values, queries, pos);
  const MethodPlan plan = plan_method(o, p.shape);
  CompressRequest req{context, &p, &o, &plan};
  req.present = present.data();
  return compress_eviction_cpu(req);
}

}  // namespace

std::unique_ptr<akv_cache> compact_cache_cpu(const akv_cache &old, akv_context *context, const float *queries,
                                             int64_t headroom) {
  const CacheMeta &m = old.meta;
  const bool anchor = m.method == AKV_METHOD_ANCHORKV;
  require(compactable(m.method), AKV_ERR_UNSUPPORTED, "compaction folds AnchorKV, SnapKV, PyramidKV and AnDPro caches only (method ",
          static_cast<int>(m.method), "; AdaKV has no decode-time variant)");
  const int64_t S = m.shape.seq_len, L = old.suffix_len, T = S + L;
  const int H = m.shape.num_kv_heads, Hq = m.shape.num_q_heads, D = m.shape.head_dim, W = m.window;
  require(L >= W, AKV_ERR_INVALID_ARGUMENT, "compaction needs at least window=", W,
          " appended tokens (the new window), but the cache has ", L);
  require(headroom >= 0, AKV_ERR_INVALID_ARGUMENT, "headroom_tokens ", headroom, " is negative");
  require(T <= INT32_MAX, AKV_ERR_UNSUPPORTED, "compacted length ", T, " exceeds int32");

  // Positions of all T tokens: the prompt's (AnchorKV: the prefix, then the consecutive
  // window), then the suffix.
  const AnchorGeometry &g = old.geometry;
  std::vector<int32_t> pos(T);
  if (anchor) {
    const AnchorAccess access(old);
    for (int64_t t = 0; t < g.prefix; ++t) pos[t] = access.position(t);
    for (int w = 0; w < W; ++w) pos[g.prefix + w] = static_cast<int32_t>(m.window_first_position + w);
  } else {
    std::copy(old.dense_positions.begin(), old.dense_positions.end(), pos.begin());
  }
  std::copy(old.suffix_positions.begin(), old.suffix_positions.end(), pos.begin() + S);

  // The budget: theta of M_full(T), less what `headroom` dense tokens cost beyond their share.
  akv_compress_options o = old.compress_options;
  // Format 3 stores positions implicitly: a suffix appended at other positions compacts into
  // the paper's layout.
  if (anchor && first_position_gap(pos) >= 0) o.storage_format = 2;
  const double theta = o.retain_fraction;
  const double full = 4.0 * static_cast<double>(T) * H * D;
  const double reserve = (1.0 - theta) * 4.0 * static_cast<double>(headroom) * H * D;
  const double effective = theta - reserve / full;
  if (!(effective > 0.0))
    fail(AKV_ERR_BUDGET, "headroom_tokens ", headroom, " leaves no budget: retain_fraction ", theta, " of T=", T,
         " tokens pays for ", theta * full, " bytes, and ", headroom, " dense tokens need ", reserve,
         " of them beyond their share");
  o.retain_fraction = effective;
  o.storage_dtype = m.storage;
  o.softmax_scale = m.softmax_scale;
  o.rope.style = m.rope_style;
  o.rope.rotary_dim = m.rotary_dim;
  o.rope.inv_freq = m.inv_freq.empty() ? nullptr : m.inv_freq.data();
  try {
    compressed_footprint(o, akv_shape{T, H, Hq, D});
  } catch (const Error &e) {
    if (e.status() != AKV_ERR_BUDGET || headroom == 0) throw;
    fail(AKV_ERR_BUDGET, "with headroom_tokens ", headroom, " the compacted cache of T=", T,
         " tokens gets retain_fraction ", effective, " of theta ", theta, ": ", e.what());
  }

  if (anchor && o.anchors == 0 && anchor_geometry(o, akv_shape{T, H, Hq, D}).anchors < m.anchors) {
    // The automatic count at this budget (lower than the prompt's with headroom) would demote
    // old anchors, and their tokens lean on them: keep the old count when it fits.
    akv_compress_options keep = o;
    keep.anchors = m.anchors;
    try {
      anchor_geometry(keep, akv_shape{T, H, Hq, D});
      o = keep;
    } catch (const Error &) {
    }
  }
  if (!anchor) {  // dense caches keep exact tokens: re-evict
    std::unique_ptr<akv_cache> cache = reevict(old, context, queries, o, pos);
    cache->meta.keys_post_rope = m.keys_post_rope;
    cache->compress_options = old.compress_options;
    cache->compactions = old.compactions + 1;
    return cache;
  }

  // Dense pre-RoPE K^ and V^ of every token, [H][T][D] fp32, and who may become an anchor.
  o.keys_post_rope = 0;  // the reconstruction is pre-RoPE
  std::vector<float> keys(static_cast<size_t>(H) * T * D), values(keys.size());
  std::vector<int8_t> priority(static_cast<size_t>(H) * T, 0);
  std::vector<float> weight(static_cast<size_t>(H) * T, 0.0f);  // old anchors: their dependents
  std::vector<int32_t> sticky[2] = {std::vector<int32_t>(static_cast<size_t>(H) * T, -1),
                                    std::vector<int32_t>(static_cast<size_t>(H) * T, -1)};
  std::vector<uint16_t> sticky_gamma[2] = {std::vector<uint16_t>(static_cast<size_t>(H) * T),
                                           std::vector<uint16_t>(static_cast<size_t>(H) * T)};
  const AnchorAccess access(old);
  const int64_t free_old = m.anchors - W;
  const int64_t *anchor_tokens = old.section<int64_t>(kAnchorTokens);
  const int64_t sinks = o.sink_tokens;
  context->pool->parallel_for(H, [&](int64_t b, int64_t e) {
    for (int64_t h = b; h < e; ++h) {
      reconstruct_head_cpu(old, static_cast<int>(h), false, &keys[h * T * D], &values[h * T * D], nullptr);
      int8_t *pr = &priority[h * T];
      float *wt = &weight[h * T];
      std::vector<float> dependents(m.anchors, 0.0f);
      for (int side = 0; side < 2; ++side)
        for (int64_t t = 0; t < g.prefix; ++t) {
          const int64_t a = access.anchor(side, static_cast<int>(h), t);
          dependents[a] += 1.0f;
          sticky[side][h * T + t] = static_cast<int32_t>(a < free_old ? anchor_tokens[h * free_old + a]
                                                                      : g.prefix + (a - free_old));
          sticky_gamma[side][h * T + t] = float_to_bf16(access.gamma(side, static_cast<int>(h), t));
        }
      for (int64_t a = 0; a < free_old; ++a) {
        const int64_t t = anchor_tokens[h * free_old + a];
        pr[t] = 3;
        wt[t] = t < sinks ? std::numeric_limits<float>::infinity() : dependents[a];  // the sinks stay
      }
      for (int64_t t = g.prefix; t < S; ++t) {
        pr[t] = 2;
        wt[t] = dependents[free_old + (t - g.prefix)];
      }
      for (int64_t t = S; t < T; ++t) pr[t] = 1;
    }
  });

  akv_prefill p = reconstructed_prefill(m, T, keys, values, queries, pos);
  const MethodPlan plan = plan_method(o, p.shape);
  CompressRequest req{context, &p, &o, &plan, priority.data()};
  req.anchor_weight = weight.data();
  for (int side = 0; side < 2; ++side) {
    req.sticky_anchor[side] = sticky[side].data();
    req.sticky_gamma[side] = sticky_gamma[side].data();
  }
  std::unique_ptr<akv_cache> cache = compress_anchorkv_cpu(req);
  // The cache keeps its caller-facing conventions and target.
  cache->meta.keys_post_rope = m.keys_post_rope;
  cache->compress_options = old.compress_options;
  cache->compactions = old.compactions + 1;
  return cache;
}

}  // namespace akv
