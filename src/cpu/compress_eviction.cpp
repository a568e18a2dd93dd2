// The eviction baselines on the CPU (docs/design.md §5), all through one scoring pass per head:
//   window attention A = softmax(scale * Qwin Kpost^T) over t <= S-W+w (causal inside the
//   window), for the m = G*W observation rows of the head (every query head of its group);
//  - SnapKV: score(t) = pool_kappa(mean over the m rows of A[r][t]), t < P; keep the
//    top-(B-W) per head plus the window (KVPress: W=64, kappa=5, avg).
//  - PyramidKV: SnapKV scores, top-b_l per head with the layer's budget (eviction.hpp).
//  - AdaKV: SnapKV scores; the layer-wide top-H*(B-W) gives head h cnt_h; it keeps the top
//    round(cnt_h*(1-alpha) + alpha*(B-W)) of its own scores (Feng et al., alpha = 0.2).
//  - AnDPro (rebuttal seed and the authors' code): per row, the attention is pooled along
//    the prompt (max, kernel 7); the pooled weights times the values, summed per chunk of 4
//    tokens, are the chunk's contribution c_r(j); y_r = sum of c_r(j) over the evictable
//    chunks (not the first chunk, not the window); score(j) = sum_r <c_r(j), y_r>. Chunks of
//    all heads compete for the layer's H*(B-W-first chunk) tokens, best first; the chunk that
//    does not fit whole gives its best tokens (by their own contribution), so the layer keeps
//    exactly H*B tokens. The first chunk (the attention sink) and the window are always kept.
//  - TOVA (KVPress TOVAPress): score(t) = mean over all the layer's query heads of the last
//    window row's attention A[gi*W + W-1][t]: one score and so one kept set for every head;
//    no pooling; default window 1 (the last token).
//  - Knorm (KnormPress): score(t) = -|K_t| (rotation keeps the norm); no queries.
//  - StreamingLLM (StreamingLLMPress): the first sink_tokens, then the most recent; no queries.
//  The last three keep the top-(B-W) per head, as SnapKV.
// Kept tokens are stored exactly: keys post-RoPE, values, storage dtype, in token order per
// head (the dense ragged layout of FullKV), with their token indices kept host-side.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "core/codebook.hpp"
#include "core/dtype.hpp"
#include "core/error.hpp"
#include "cpu/gemm.hpp"
#include "core/thread_pool.hpp"
#include "methods/eviction.hpp"
#include "cpu/compress.hpp"
#include "cpu/prefill_reader.hpp"
#include "cpu/scores.hpp"

namespace akv {
namespace {

// Top-n indices of score[0..count) (higher first, ties to the lower index), returned sorted.
std::vector<int32_t> top_indices(const float *score, int64_t count, int64_t n) {
  std::vector<int32_t> order(count);
  std::iota(order.begin(), order.end(), 0);
  n = std::min(n, count);
  std::nth_element(order.begin(), order.begin() + n, order.end(), [&](int32_t a, int32_t b) {
    return score[a] != score[b] ? score[a] > score[b] : a < b;
  });
  order.resize(n);
  std::sort(order.begin(), order.end());
  return order;
}

struct Candidate {
  float score;
  int32_t head;
  int32_t index;  // token (AdaKV) or chunk (AnDPro)
};
bool better(const Candidate &a, const Candidate &b) {
  if (a.score != b.score) return a.score > b.score;
  if (a.head != b.head) return a.head < b.head;
  return a.index < b.index;
}

}  // namespace

std::unique_ptr<akv_cache> compress_eviction_cpu(const CompressRequest &req) {
  const akv_compress_options &o = *req.options;
  const akv_prefill &p = *req.prefill;
  ThreadPool &pool = *req.context->pool;
  const EvictionBudget &budget = req.plan->eviction;
  const EvictionScore score_kind = eviction_score(o.method);
  const bool attention = eviction_reads_queries(o.method);
  require(!attention || p.queries != nullptr, AKV_ERR_INVALID_ARGUMENT, "queries is NULL (this eviction method scores"
          " tokens with the window queries)");
  std::unique_ptr<akv_cache> cache = new_cache(req);
  CacheMeta &meta = cache->meta;
  PrefillReader in(p, o.window, cache->rope, o.keys_post_rope != 0);

  const int64_t S = budget.seq_len, P = budget.prefix;
  const int H = budget.heads, D = p.shape.head_dim, W = budget.window;
  const int G = p.shape.num_q_heads / H;
  const int64_t m = static_cast<int64_t>(G) * W;
  const int64_t base = budget.per_head - W;  // evictable tokens per head (on average)
  const int64_t c0 = budget.first_chunk;
  const bool andpro = o.method == AKV_METHOD_ANDPRO;
  const int chunk = andpro ? o.andpro_chunk : 1;
  const int64_t chunks = andpro ? (P + chunk - 1) / chunk : 0;
  const float scale = meta.softmax_scale;

  // Per head: SnapKV-family pooled scores [P], or AnDPro token contributions [P] and chunk
  // scores [chunks].
  std::vector<float> scores(static_cast<size_t>(H) * P), chunk_scores(static_cast<size_t>(H) * chunks);
  std::vector<float> K(S * D), V(andpro ? P * D : 0), Q(attention ? m * D : 0), A(attention ? m * S : 0);
  std::vector<float> pooled(andpro ? m * P : 0), Y(andpro ? m * D : 0), VY(andpro ? m * P : 0);
  std::vector<float> raw(P);
  std::vector<float> layer_scores(score_kind == EvictionScore::kLastQuery ? P : 0, 0.0f);  // TOVA
  for (int h = 0; h < H; ++h) {
    pool.parallel_for(S, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        in.key_row(h, t, nullptr, &K[t * D]);
        if (andpro && t < P) in.value_row(h, t, &V[t * D]);
      }
    });
    const uint8_t *present = req.present ? req.present + static_cast<size_t>(h) * S : nullptr;
    float *head_scores = &scores[static_cast<size_t>(h) * P];
    if (!attention) {  // Knorm, StreamingLLM: no window attention
      for (int64_t t = 0; t < P; ++t) {
        if (score_kind == EvictionScore::kRecency) {
          head_scores[t] = recency_score(t, budget.first_chunk);
          continue;
        }
        float s = 0.0f;  // in order, as the CUDA pass sums
        for (int d = 0; d < D; ++d) s += K[t * D + d] * K[t * D + d];
        head_scores[t] = -std::sqrt(s);
      }
      continue;
    }
    for (int gi = 0; gi < G; ++gi)
      for (int w = 0; w < W; ++w) in.query_row(h * G + gi, w, &Q[(gi * W + w) * D]);
    window_attention(Q.data(), K.data(), m, S, D, P, W, scale, present, A.data(), pool);
    if (score_kind == EvictionScore::kLastQuery) {  // TOVA: the last window row of every query head
      for (int64_t t = 0; t < P; ++t) {  // the CUDA pass's order: per head, then over heads
        float s = 0.0f;
        for (int gi = 0; gi < G; ++gi) s += A[(static_cast<int64_t>(gi) * W + W - 1) * S + t];
        layer_scores[t] += s / static_cast<float>(H * G);
      }
      continue;
    }
    if (!andpro) {
      mean_attention(A.data(), m, S, P, raw.data(), nullptr, pool);
      pool_scores(raw.data(), P, o.pool_kernel, o.pool_type, head_scores);
      if (present)
        for (int64_t t = 0; t < P; ++t)
          if (!present[t]) head_scores[t] = -std::numeric_limits<float>::infinity();
      continue;
    }
    // AnDPro: pooled rows, y over the evictable chunks, contributions <a'_r(t) V_t, y_r>.
    pool.parallel_for(m, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) pool_scores(&A[r * S], P, o.pool_kernel, o.pool_type, &pooled[r * P]);
    });
    if (P > c0)
      sgemm(pool, false, m, D, P - c0, 1.0f, &pooled[c0], P, &V[c0 * D], D, 0.0f, Y.data(), D);
    else
      std::fill(Y.begin(), Y.end(), 0.0f);
    sgemm(pool, true, m, P, D, 1.0f, Y.data(), D, V.data(), D, 0.0f, VY.data(), P);
    pool.parallel_for(P, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        double s = 0.0;
        for (int64_t r = 0; r < m; ++r) s += static_cast<double>(pooled[r * P + t]) * VY[r * P + t];
        head_scores[t] = static_cast<float>(s);
      }
    });
    for (int64_t j = 0; j < chunks; ++j) {
      double s = 0.0;
      for (int64_t t = j * chunk; t < std::min<int64_t>((j + 1) * chunk, P); ++t) s += head_scores[t];
      chunk_scores[static_cast<size_t>(h) * chunks + j] = static_cast<float>(s);
    }
  }

  if (score_kind == EvictionScore::kLastQuery)  // TOVA: the layer's score for every head
    for (int h = 0; h < H; ++h) std::copy(layer_scores.begin(), layer_scores.end(), &scores[static_cast<size_t>(h) * P]);
  // Kept evictable tokens per head (sorted), then the window (and AnDPro's first chunk).
  std::vector<std::vector<int32_t>> kept(H);
  if (o.method != AKV_METHOD_ADAKV && !andpro) {  // SnapKV, PyramidKV, TOVA, Knorm, StreamingLLM
    for (int h = 0; h < H; ++h) kept[h] = top_indices(&scores[static_cast<size_t>(h) * P], P, budget.head_tokens - W);
  } else if (o.method == AKV_METHOD_ADAKV) {
    std::vector<Candidate> cands;
    cands.reserve(static_cast<size_t>(H) * P);
    for (int h = 0; h < H; ++h)
      for (int64_t t = 0; t < P; ++t) cands.push_back({scores[static_cast<size_t>(h) * P + t], h, static_cast<int32_t>(t)});
    const int64_t n = std::min<int64_t>(static_cast<int64_t>(H) * base, static_cast<int64_t>(cands.size()));
    std::nth_element(cands.begin(), cands.begin() + n, cands.end(), better);
    std::vector<int64_t> selected(H, 0);
    for (int64_t i = 0; i < n; ++i) ++selected[cands[i].head];
    std::vector<int64_t> counts = adakv_counts(selected, base, o.adakv_alpha);
    cap_counts(counts, P);
    for (int h = 0; h < H; ++h) kept[h] = top_indices(&scores[static_cast<size_t>(h) * P], P, counts[h]);
  } else {  // AnDPro
    // Chunks best first (ties: head, then chunk); the chunk that does not fit gives its
    // best contributions.
    std::vector<Candidate> cands;
    cands.reserve(static_cast<size_t>(H) * chunks);
    for (int h = 0; h < H; ++h)
      for (int64_t j = 0; j < chunks; ++j)
        cands.push_back({chunk_scores[static_cast<size_t>(h) * chunks + j], h, static_cast<int32_t>(j)});
    std::sort(cands.begin(), cands.end(), better);
    std::vector<uint32_t> order(cands.size());
    for (size_t i = 0; i < cands.size(); ++i) order[i] = static_cast<uint32_t>(cands[i].head * chunks + cands[i].index);
    andpro_fill(order, budget, chunk, chunks, req.present,
                [&](int h, int64_t t0, int64_t t1, int64_t n) {
                  const uint8_t *present = req.present ? req.present + static_cast<size_t>(h) * S : nullptr;
                  std::vector<float> contrib(&scores[static_cast<size_t>(h) * P + t0], &scores[static_cast<size_t>(h) * P + t1]);
                  for (int64_t t = t0; t < t1; ++t)
                    if (present && !present[t]) contrib[t - t0] = -std::numeric_limits<float>::infinity();
                  std::vector<int32_t> best = top_indices(contrib.data(), t1 - t0, n);
                  for (int32_t &u : best) u += static_cast<int32_t>(t0);
                  return best;
                },
                kept);  // sorted on adoption
  }
  // Dense ragged storage: keys [sum counts][D] then values, head after head.
  const std::vector<int64_t> first = adopt_kept_tokens(kept, budget, in.positions(), *cache);
  store_dense_tokens(req, in, first, cache->dense_tokens.data(), *cache);
  require(cache->footprint == budget.footprint, AKV_ERR_INTERNAL, "eviction stored ", cache->footprint,
          " bytes, the budget says ", budget.footprint);
  return cache;
}

}  // namespace akv
