// AnchorKV compression on the CPU (paper §3, Algorithm 1; docs/design.md §2.2). One layer:
//   per head: window attention -> pooled scores -> anchors (top rho share + seeded uniform
//   share + the window) -> per-side nearest-anchor assignment by |cos| -> utilities (Eq. 6);
//   then residual slots chosen over all heads by utility; then Hadamard + 2-bit encoding.
// GEMM-shaped steps go through sgemm (OpenBLAS when available); the rest is parallel over
// tokens with the context's thread pool.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "core/compress_stages.hpp"
#include "core/dtype.hpp"
#include "core/error.hpp"
#include "core/anchor_access.hpp"
#include "core/rng.hpp"
#include "cpu/gemm.hpp"
#include "cpu/kernels.hpp"
#include "cpu/local_anchors.hpp"
#include "core/thread_pool.hpp"
#include "cpu/attention.hpp"
#include "cpu/compress.hpp"
#include "cpu/prefill_reader.hpp"
#include "cpu/scores.hpp"

namespace akv {
namespace {

struct Candidate {
  float utility;
  int32_t head;
  int32_t token;
};

// Higher utility first; ties by head, then position, so the choice is deterministic.
bool better(const Candidate &a, const Candidate &b) {
  if (a.utility != b.utility) return a.utility > b.utility;
  if (a.head != b.head) return a.head < b.head;
  return a.token < b.token;
}

// Anchor token indices (sorted, non-window only) for one head: the n_top best pooled scores
// (the sinks score +inf, so they come first), then a seeded uniform sample of the rest.
std::vector<int32_t> select_anchors(const std::vector<float> &score, int64_t count, int64_t n_top,
                                    uint64_t seed, int layer, int head) {
  const int64_t P = static_cast<int64_t>(score.size());
  std::vector<int32_t> order(P);
  std::iota(order.begin(), order.end(), 0);
  auto by_score = [&](int32_t a, int32_t b) {
    return score[a] != score[b] ? score[a] > score[b] : a < b;
  };
  std::nth_element(order.begin(), order.begin() + n_top, order.end(), by_score);
  std::vector<int32_t> anchors(order.begin(), order.begin() + n_top);
  // The uniform share: the smallest counter-based keys among the remaining positions are a
  // uniform sample without replacement, reproducible on any backend.
  std::vector<std::pair<uint64_t, int32_t>> rest;
  rest.reserve(P - n_top);
  for (int64_t i = n_top; i < P; ++i)
    rest.emplace_back(hash_keys(seed, kStreamAnchorSample, (static_cast<uint64_t>(layer) << 32) | head,
                                static_cast<uint64_t>(order[i])),
                      order[i]);
  const int64_t n_rand = count - n_top;
  std::nth_element(rest.begin(), rest.begin() + n_rand, rest.end());
  for (int64_t i = 0; i < n_rand; ++i) anchors.push_back(rest[i].second);
  std::sort(anchors.begin(), anchors.end());
  return anchors;
}

// The coverage share: `count` more anchors for one head, chosen in `rounds` rounds as the
// tokens that the anchors so far (`anchors` plus the window P..S-1) represent worst. A token's
// error on one side is its residual energy against the anchor of largest |cos|,
// ||x||^2 (1 - cos^2); keys and values count each relative to their mean over the prefix.
// Ties go to the lower index. Only tokens with eligible[t] != 0 are chosen (null: all). Appends
// to `anchors` (unsorted).
void add_coverage_anchors(const std::vector<float> &Kpre, const std::vector<float> &V, int64_t S, int64_t P, int D,
                          int rounds, int64_t count, std::vector<int32_t> &anchors, ThreadPool &pool,
                          const int8_t *eligible = nullptr) {
  const std::vector<float> *X[2] = {&Kpre, &V};
  std::vector<float> unit[2] = {std::vector<float>(S * D), std::vector<float>(S * D)};
  std::vector<float> norm_sq[2] = {std::vector<float>(P), std::vector<float>(P)};
  std::vector<float> best_cos_sq[2] = {std::vector<float>(P, 0.0f), std::vector<float>(P, 0.0f)};
  for (int side = 0; side < 2; ++side) {
    pool.parallel_for(S, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        const float *x = &(*X[side])[t * D];
        double n2 = 0.0;
        for (int d = 0; d < D; ++d) n2 += static_cast<double>(x[d]) * x[d];
        const float inv = n2 > 0.0 ? static_cast<float>(1.0 / std::sqrt(n2)) : 0.0f;
        for (int d = 0; d < D; ++d) unit[side][t * D + d] = x[d] * inv;
        if (t < P) norm_sq[side][t] = static_cast<float>(n2);
      }
    });
  }
  std::vector<char> is_anchor(P, 0);
  for (int32_t a : anchors) is_anchor[a] = 1;
  // Raise every token's best |cos| with the anchor tokens `fresh`.
  auto absorb = [&](const std::vector<int32_t> &fresh) {
    const int64_t n = static_cast<int64_t>(fresh.size());
    if (n == 0) return;
    std::vector<float> rows(n * D);
    for (int side = 0; side < 2; ++side) {
      for (int64_t i = 0; i < n; ++i)
        std::memcpy(&rows[i * D], &unit[side][static_cast<int64_t>(fresh[i]) * D], D * sizeof(float));
      constexpr int64_t kBlock = 1024;
      pool.parallel_for((P + kBlock - 1) / kBlock, [&](int64_t b, int64_t e) {
        std::vector<float> C(kBlock * n);
        for (int64_t blk = b; blk < e; ++blk) {
          const int64_t t0 = blk * kBlock, m = std::min(kBlock, P - t0);
          sgemm(true, m, n, D, 1.0f, &unit[side][t0 * D], D, rows.data(), D, 0.0f, C.data(), n);
          for (int64_t i = 0; i < m; ++i)
            for (int64_t j = 0; j < n; ++j)
              best_cos_sq[side][t0 + i] = std::max(best_cos_sq[side][t0 + i], C[i * n + j] * C[i * n + j]);
        }
      });
    }
  };
  const int64_t cap = static_cast<int64_t>(anchors.size()) + count;  // the head's non-window anchors
  std::vector<int32_t> fresh(anchors);
  for (int64_t t = P; t < S; ++t) fresh.push_back(static_cast<int32_t>(t));
  absorb(fresh);
  int64_t left = count;
  for (int round = 0; round < rounds && left > 0; ++round) {
    const int64_t take = (left + (rounds - round) - 1) / (rounds - round);
    std::vector<float> error[2] = {std::vector<float>(P), std::vector<float>(P)};
    for (int side = 0; side < 2; ++side)
      for (int64_t t = 0; t < P; ++t)
        error[side][t] = norm_sq[side][t] * std::max(0.0f, 1.0f - best_cos_sq[side][t]);
    const CoveragePool round_pool = coverage_pool(error, take, cap, is_anchor, eligible);
    auto row = [&](int64_t i, int side) {
      return static_cast<const float *>(&unit[side][static_cast<int64_t>(round_pool.tokens[i]) * D]);
    };
    const std::vector<char> covered =
        covered_members(round_pool, D, nullptr, row, row, [&](int64_t i, int side, float c) {
          const int32_t t = round_pool.tokens[i];
          const float c2 = c * c;
          return c2 > best_cos_sq[side][t] ? norm_sq[side][t] * std::max(0.0f, 1.0f - c2) : error[side][t];
        });
    fresh = pool_picks(round_pool, covered, is_anchor, anchors);
    const int64_t n = static_cast<int64_t>(fresh.size());
    absorb(fresh);
    left -= n;
  }
}

// Compaction (akv_cache_compact): the `free_anchors` non-window anchors of one head by
// priority level (methods.hpp CompressRequest::anchor_priority). The old anchors (3 and the
// old window 2), the most leaned-on first (weight: their dependents), in the slots left after
// the appended tokens' share (their fraction of the prefix: a fold must be able to give a
// needle in the new text an anchor); then the appended tokens (1) as at prefill (the scored
// share of the slots left, at least scored_min, by score; the rest for coverage or by the
// seeded sample); then, only if slots are still left, the other old tokens (0) by score.
// local (format 3): coverage through local_coverage with `storage` and `nearest` as scratch.
std::vector<int32_t> ranked_anchors(const int8_t *priority, const float *weight, const std::vector<float> &pooled,
                                    int64_t free_anchors,
                                    const akv_compress_options &o, const std::vector<float> &Kpre,
                                    const std::vector<float> &V, int64_t S, int64_t P, int D, int head,
                                    ThreadPool &pool, const AnchorGeometry *local, akv_dtype storage,
                                    LocalNearest &nearest) {
  std::vector<int32_t> picks;
  std::vector<char> taken(P, 0);
  auto take_best = [&](int level, int64_t n) {
    std::vector<int32_t> tokens;
    for (int64_t t = 0; t < P; ++t)
      if (priority[t] == level && !taken[t]) tokens.push_back(static_cast<int32_t>(t));
    n = std::min<int64_t>(n, static_cast<int64_t>(tokens.size()));
    std::partial_sort(tokens.begin(), tokens.begin() + n, tokens.end(), [&](int32_t a, int32_t b) {
      return pooled[a] != pooled[b] ? pooled[a] > pooled[b] : a < b;
    });
    for (int64_t i = 0; i < n; ++i) {
      picks.push_back(tokens[i]);
      taken[tokens[i]] = 1;
    }
  };
  auto left = [&] { return free_anchors - static_cast<int64_t>(picks.size()); };
  {  // the old anchors, most leaned-on first, leaving the appended tokens their share of slots
    std::vector<int32_t> old;
    int64_t appended = 0;
    for (int64_t t = 0; t < P; ++t) {
      if (priority[t] >= 2) old.push_back(static_cast<int32_t>(t));
      appended += priority[t] == 1;
    }
    const int64_t share = std::llround(free_anchors * static_cast<double>(appended) / P);
    const int64_t n = std::max<int64_t>(0, std::min<int64_t>(left() - share, static_cast<int64_t>(old.size())));
    std::partial_sort(old.begin(), old.begin() + n, old.end(), [&](int32_t a, int32_t b) {
      if (weight[a] != weight[b]) return weight[a] > weight[b];
      return pooled[a] != pooled[b] ? pooled[a] > pooled[b] : a < b;
    });
    for (int64_t i = 0; i < n; ++i) {
      picks.push_back(old[i]);
      taken[old[i]] = 1;
    }
  }
  const int64_t slots = left();
  if (slots > 0) {
    take_best(1, scored_share(o, slots));
    std::vector<int8_t> eligible(P);
    for (int64_t t = 0; t < P; ++t) eligible[t] = priority[t] == 1 && !taken[t];
    if (o.coverage_rounds > 0 && local) {
      local_coverage(Kpre, V, *local, storage, o.coverage_rounds, left(), picks, nearest, pool, eligible.data());
    } else if (o.coverage_rounds > 0) {
      add_coverage_anchors(Kpre, V, S, P, D, o.coverage_rounds, left(), picks, pool, eligible.data());
    } else {
      std::vector<std::pair<uint64_t, int32_t>> rest;
      for (int64_t t = 0; t < P; ++t)
        if (eligible[t])
          rest.emplace_back(hash_keys(o.seed, kStreamAnchorSample, (static_cast<uint64_t>(o.layer_index) << 32) | head,
                                      static_cast<uint64_t>(t)),
                            static_cast<int32_t>(t));
      const int64_t n = std::min<int64_t>(left(), static_cast<int64_t>(rest.size()));
      std::nth_element(rest.begin(), rest.begin() + n, rest.end());
      for (int64_t i = 0; i < n; ++i) picks.push_back(rest[i].second);
    }
    for (int32_t t : picks) taken[t] = 1;
    take_best(0, left());
  }
  std::sort(picks.begin(), picks.end());
  return picks;
}

// The token-sides outside their segment's table (each takes a scan of the table), for the
// profile: in all, and the most in one segment of one head.
struct TableMisses {
  std::atomic<uint32_t> total{0}, most{0};
  void add(uint32_t n) {
    total += n;
    for (uint32_t m = most.load(); n > m && !most.compare_exchange_weak(m, n);) {
    }
  }
};

// Format 3: each segment's table (written to `tables`, [H][segments][256]) holds the anchors
// its non-anchor tokens use most, both sides counted (ties: lower anchor); a token whose
// nearest anchor is not in it takes the nearest one that is (largest |cos|, lower entry on
// ties), with its coefficient. Short tables repeat their first entry. entry[side][t] gets the
// token's table entry; `misses` counts the tokens outside their tables.
void restrict_to_tables(const AnchorGeometry &g, int h, const std::vector<float> &Kpre, const std::vector<float> &V,
                        const std::vector<float> (&anchor_n)[2], const std::vector<float> (&anchor_norm)[2],
                        const std::vector<int32_t> &anchor_of_token, std::vector<int32_t> (&assigned)[2],
                        std::vector<float> (&coef)[2], std::vector<uint8_t> (&entry)[2], uint16_t *tables,
                        ThreadPool &pool, TableMisses &misses) {
  const int64_t P = g.prefix, L = g.segment_len, T = g.table_size;
  const int D = g.dim, k = g.anchors;
  const std::vector<float> *X[2] = {&Kpre, &V};
  pool.parallel_for(g.segments, [&](int64_t sb, int64_t se) {
    std::vector<int32_t> count(k, 0), slot(k, -1), used;
    for (int64_t seg = sb; seg < se; ++seg) {
      const int64_t t0 = seg * L, t1 = std::min(P, t0 + L);
      uint32_t outside = 0;
      used.clear();
      for (int side = 0; side < 2; ++side)
        for (int64_t t = t0; t < t1; ++t) {
          if (anchor_of_token[t] >= 0) continue;
          const int32_t a = assigned[side][t];
          if (count[a]++ == 0) used.push_back(a);
        }
      std::sort(used.begin(), used.end(), [&](int32_t a, int32_t b) { return count[a] != count[b] ? count[a] > count[b] : a < b; });
      const int64_t n = std::min<int64_t>(T, static_cast<int64_t>(used.size()));
      uint16_t *table = tables + (static_cast<int64_t>(h) * g.segments + seg) * T;
      for (int64_t j = 0; j < T; ++j) table[j] = static_cast<uint16_t>(j < n ? used[j] : (n ? used[0] : 0));
      for (int64_t j = 0; j < n; ++j) slot[used[j]] = static_cast<int32_t>(j);
      for (int side = 0; side < 2; ++side) {
        const std::vector<float> &an = anchor_n[side], &norm = anchor_norm[side];
        for (int64_t t = t0; t < t1; ++t) {
          if (anchor_of_token[t] >= 0) {
            entry[side][t] = 0;
            continue;
          }
          const int32_t a = assigned[side][t];
          if (slot[a] >= 0) {
            entry[side][t] = static_cast<uint8_t>(slot[a]);
            continue;
          }
          ++outside;
          const float *x = &(*X[side])[t * D];
          int64_t best = 0;
          float best_abs = -1.0f, best_c = 0.0f;
          for (int64_t j = 0; j < n; ++j) {
            const float c = dot(x, &an[static_cast<int64_t>(table[j]) * D], D);
            const float v = norm[table[j]] > 0.0f ? std::fabs(c) : -0.5f;
            if (v > best_abs) {
              best_abs = v;
              best = j;
              best_c = c;
            }
          }
          assigned[side][t] = table[best];
          coef[side][t] = norm[table[best]] > 0.0f ? best_c / norm[table[best]] : 0.0f;
          entry[side][t] = static_cast<uint8_t>(best);
        }
      }
      for (int32_t a : used) {
        count[a] = 0;
        slot[a] = -1;
      }
      misses.add(outside);
    }
  });
}

// The arrays of one head's steps 1-6 (compress_anchorkv_cpu), allocated on first use.
struct HeadScratch {
  std::vector<float> Kpre, Kpost, V, Q, Y, A, Z, VY;
  std::vector<float> anchor_f[2], anchor_n[2], anchor_norm[2], coef[2];
  std::vector<int32_t> assigned[2];
  std::vector<uint8_t> entry[2];  // format 3
  std::vector<float> raw, pooled, alpha_sq;
  LocalNearest nearest;
  void allocate(int64_t S, int64_t P, int D, int64_t m, int64_t k) {
    if (!Kpre.empty()) return;
    for (auto *v : {&Kpre, &Kpost, &V}) v->resize(S * D);
    Q.resize(m * D);
    Y.resize(m * D);
    A.resize(m * S);
    Z.resize(m * P);
    VY.resize(m * P);
    for (int side = 0; side < 2; ++side) {
      anchor_f[side].resize(k * D);
      anchor_n[side].resize(k * D);
      anchor_norm[side].resize(k);
      coef[side].resize(P);
      assigned[side].resize(P);
      entry[side].resize(P);
    }
    raw.resize(P);
    pooled.resize(P);
    alpha_sq.resize(P);
  }
  // About what allocate() and local_coverage take.
  static uint64_t bytes(int64_t S, int64_t P, int D, int64_t m, int64_t k) {
    return 4ull * static_cast<uint64_t>(3 * S * D + 2 * m * D + m * S + 2 * m * P + 5 * k * D + 16 * P);
  }
};
// The extra memory head workers may take (besides the first head's arrays).
constexpr uint64_t kHeadWorkerBytes = uint64_t{1} << 30;

}  // namespace

std::unique_ptr<akv_cache> compress_anchorkv_cpu(const CompressRequest &req) {
  const akv_compress_options &o = *req.options;
  const akv_prefill &p = *req.prefill;
  ThreadPool &pool = *req.context->pool;
  StageClock clock;  // ANCHORKV_COMPRESS_PROFILE: milliseconds per stage on stderr
  clock.stage(kStageSetup);
  TableMisses misses;  // format 3 with tables: for the profile's line
  std::unique_ptr<akv_cache> cache = new_cache(req);
  CacheMeta &meta = cache->meta;
  prepare_anchor_cache(p, req.plan->anchor, o, *cache);
  const AnchorGeometry &g = cache->geometry;
  const Rope &rope = cache->rope;
  PrefillReader in(p, g.window, rope, o.keys_post_rope != 0);
  const std::vector<int32_t> &pos = in.positions();

  const int64_t S = g.seq_len, P = g.prefix;
  const int H = g.heads, G = g.group(), D = g.dim, W = g.window, k = g.anchors;
  const int64_t m = static_cast<int64_t>(G) * W;  // observation rows per KV head
  const int64_t free_anchors = k - W;

  cache->data = Buffer(req.context, cache->layout.total_bytes);
  std::memset(cache->data.data(), 0, cache->layout.total_bytes);  // padding is deterministic
  const akv_dtype storage = meta.storage;
  uint16_t *anchor_keys = cache->section<uint16_t>(kAnchorKeys);
  uint16_t *anchor_values = cache->section<uint16_t>(kAnchorValues);
  int64_t *anchor_tokens = cache->section<int64_t>(kAnchorTokens);
  // Format 2: u16 indices and bf16 coefficients; format 3: one byte each (core/layout.hpp).
  uint8_t *index_bytes[2] = {cache->section<uint8_t>(kKeyIndex), cache->section<uint8_t>(kValueIndex)};
  uint8_t *gamma_bytes[2] = {cache->section<uint8_t>(kKeyGamma), cache->section<uint8_t>(kValueGamma)};
  if (g.format == 2) std::memcpy(cache->section<int32_t>(kPositions), pos.data(), P * sizeof(int32_t));

  const float scale = meta.softmax_scale;
  const int64_t n_sink = sink_anchor_count(o, g), n_top = scored_anchor_count(o, g);
  std::vector<float> utility[2] = {std::vector<float>(H * P), std::vector<float>(H * P)};
  std::vector<float> energy[2] = {std::vector<float>(H * P), std::vector<float>(H * P)};  // ||r||^2

  // Format 3 chooses and assigns anchors with local candidates (cpu/local_anchors.hpp); in
  // compaction a token whose old anchor stays an anchor keeps it (the sticky assignment).
  const bool local = g.format == 3;
  // Steps 1-6 for head h with the arrays of `s` and the threads of `pool` (the context's, or
  // one of the head workers' own single thread); `timed`: this call marks the profile stages.
  auto compress_head = [&](int h, HeadScratch &s, ThreadPool &pool, bool timed) {
    auto stage = [&](int id) {
      if (timed) clock.stage(id);
    };
    s.allocate(S, P, D, m, k);
    std::vector<float> &Kpre = s.Kpre, &Kpost = s.Kpost, &V = s.V, &Q = s.Q, &Y = s.Y, &A = s.A, &Z = s.Z, &VY = s.VY;
    std::vector<float>(&anchor_f)[2] = s.anchor_f, (&anchor_n)[2] = s.anchor_n, (&anchor_norm)[2] = s.anchor_norm;
    std::vector<int32_t>(&assigned)[2] = s.assigned;
    std::vector<float>(&coef)[2] = s.coef;
    std::vector<uint8_t>(&entry)[2] = s.entry;
    std::vector<float> &raw = s.raw, &pooled = s.pooled, &alpha_sq = s.alpha_sq;
    LocalNearest &nearest = s.nearest;
    // 1. Load this head: pre- and post-RoPE keys, values, and the group's window queries.
    stage(kStageLoad);
    pool.parallel_for(S, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        in.key_row(h, t, &Kpre[t * D], &Kpost[t * D]);
        in.value_row(h, t, &V[t * D]);
      }
    });
    for (int gi = 0; gi < G; ++gi)
      for (int w = 0; w < W; ++w) in.query_row(h * G + gi, w, &Q[(gi * W + w) * D]);

    stage(kStageWindowAttention);
    // 2. Window attention: A = softmax(scale * Q Kpost^T) with the causal window mask.
    window_attention(Q.data(), Kpost.data(), m, S, D, P, W, scale, nullptr, A.data(), pool);
    sgemm(pool, false, m, D, S, 1.0f, A.data(), S, V.data(), D, 0.0f, Y.data(), D);  // y^(w)

    stage(kStageScores);
    // 3. Scores: mean attention over the m rows, pooled (Eq. 14), then carried forward over
    // follow_tokens tokens; sum of alpha^2 for Eq. 6.
    mean_attention(A.data(), m, S, P, raw.data(), alpha_sq.data(), pool);
    pool_scores(raw.data(), P, o.pool_kernel, o.pool_type, pooled.data());
    follow_scores(pooled.data(), P, o.follow_tokens);
    for (int64_t t = 0; t < n_sink; ++t) pooled[t] = std::numeric_limits<float>::infinity();

    stage(kStageAnchorSelection);
    // 4. Anchors: sorted non-window picks, then the window (indices k-W..k-1). The share
    // after the scored one is a uniform sample (paper) or chosen for coverage.
    std::vector<int32_t> picks;
    if (req.anchor_priority) {
      picks = ranked_anchors(req.anchor_priority + static_cast<int64_t>(h) * S, req.anchor_weight + static_cast<int64_t>(h) * S,
                             pooled, free_anchors, o, Kpre, V, S, P, D, h, pool, local ? &g : nullptr, storage, nearest);
      if (local)  // the nearest candidates among the final anchors
        local_coverage(Kpre, V, g, storage, 0, 0, picks, nearest, pool);
    } else if (local) {
      const bool cover = o.coverage_rounds > 0;
      picks = select_anchors(pooled, cover ? n_top : free_anchors, n_top, o.seed, o.layer_index, o.head_offset + h);
      local_coverage(Kpre, V, g, storage, o.coverage_rounds, cover ? free_anchors - n_top : 0, picks, nearest, pool);
      std::sort(picks.begin(), picks.end());
    } else if (o.coverage_rounds > 0) {
      picks = select_anchors(pooled, n_top, n_top, o.seed, o.layer_index, o.head_offset + h);
      add_coverage_anchors(Kpre, V, S, P, D, o.coverage_rounds, free_anchors - n_top, picks, pool);
      std::sort(picks.begin(), picks.end());
    } else {
      picks = select_anchors(pooled, free_anchors, n_top, o.seed, o.layer_index, o.head_offset + h);
    }
    std::vector<int32_t> anchor_of_token(P, -1);
    for (int64_t a = 0; a < free_anchors; ++a) {
      anchor_tokens[h * free_anchors + a] = picks[a];
      anchor_of_token[picks[a]] = static_cast<int32_t>(a);
    }
    auto anchor_token = [&](int64_t a) { return a < free_anchors ? static_cast<int64_t>(picks[a]) : P + (a - free_anchors); };

    stage(kStageAssignment);
    // 5. Per side: store the anchors and assign every prefix token to its nearest anchor by
    // |cos| with the least-squares coefficient; format 3 then restricts each segment's tokens
    // to its table (restrict_to_tables); then the coefficients are stored (bf16 or a one-byte
    // code) and the residuals against the stored coefficient measured.
    for (int side = 0; side < 2; ++side) {
      const std::vector<float> &X = side == 0 ? Kpre : V;
      uint16_t *anchors_out = (side == 0 ? anchor_keys : anchor_values) + static_cast<int64_t>(h) * k * D;
      std::vector<float> &af = anchor_f[side], &an = anchor_n[side], &norm = anchor_norm[side];
      for (int64_t a = 0; a < k; ++a) {
        const float *src = &X[anchor_token(a) * D];
        double n2 = 0.0;
        for (int d = 0; d < D; ++d) {
          anchors_out[a * D + d] = float_to_half(src[d], storage);
          af[a * D + d] = half_to_float(anchors_out[a * D + d], storage);
          n2 += static_cast<double>(af[a * D + d]) * af[a * D + d];
        }
        norm[a] = static_cast<float>(std::sqrt(n2));
        const float inv = norm[a] > 0.0f ? 1.0f / norm[a] : 0.0f;
        for (int d = 0; d < D; ++d) an[a * D + d] = af[a * D + d] * inv;
      }
      const int32_t *sticky = req.sticky_anchor[side] ? req.sticky_anchor[side] + static_cast<int64_t>(h) * S : nullptr;
      // Anchors point at themselves with gamma 1; in compaction a token whose old anchor is
      // still an anchor keeps it and its old coefficient. False: t needs its nearest anchor.
      auto assign_fixed = [&](int64_t t) {
        const int32_t stuck = sticky ? sticky[t] : -1;
        if (anchor_of_token[t] >= 0) {
          assigned[side][t] = anchor_of_token[t];
          coef[side][t] = 1.0f;
        } else if (stuck >= 0 && stuck < P && anchor_of_token[stuck] >= 0) {
          assigned[side][t] = anchor_of_token[stuck];
          coef[side][t] = bf16_to_float(req.sticky_gamma[side][static_cast<int64_t>(h) * S + t]);
        } else {
          return false;
        }
        return true;
      };
      if (local) {  // the nearest candidates local_coverage found
        pool.parallel_for(P, [&](int64_t b, int64_t e) {
          for (int64_t t = b; t < e; ++t) {
            const int32_t near = nearest.token[side][t];
            if (assign_fixed(t)) {
              continue;
            } else if (near < 0) {  // every candidate has zero norm
              assigned[side][t] = 0;
              coef[side][t] = 0.0f;
            } else {
              const int32_t a = near < P ? anchor_of_token[near] : static_cast<int32_t>(free_anchors + (near - P));
              assigned[side][t] = a;
              coef[side][t] = norm[a] > 0.0f ? nearest.dot[side][t] / norm[a] : 0.0f;
            }
          }
        });
        continue;
      }
      constexpr int64_t kBlock = 1024;
      pool.parallel_for((P + kBlock - 1) / kBlock, [&](int64_t b, int64_t e) {
        std::vector<float> C(kBlock * k);
        for (int64_t blk = b; blk < e; ++blk) {
          const int64_t t0 = blk * kBlock, n = std::min(kBlock, P - t0);
          sgemm(true, n, k, D, 1.0f, &X[t0 * D], D, an.data(), D, 0.0f, C.data(), k);
          for (int64_t i = 0; i < n; ++i) {
            const int64_t t = t0 + i;
            if (!assign_fixed(t)) {
              const float *c = &C[i * k];
              int32_t best = 0;
              float best_abs = -1.0f;
              for (int64_t a = 0; a < k; ++a) {
                const float v = norm[a] > 0.0f ? std::fabs(c[a]) : -0.5f;
                if (v > best_abs) {
                  best_abs = v;
                  best = static_cast<int32_t>(a);
                }
              }
              assigned[side][t] = best;
              coef[side][t] = norm[best] > 0.0f ? c[best] / norm[best] : 0.0f;
            }
          }
        }
      });
    }
    if (g.format == 3) {
      if (g.table_size) restrict_to_tables(g, h, Kpre, V, anchor_n, anchor_norm, anchor_of_token, assigned, coef,
                                           entry, cache->section<uint16_t>(kSegmentTables), pool, misses);
      else
        for (int side = 0; side < 2; ++side)
          for (int64_t t = 0; t < P; ++t) entry[side][t] = static_cast<uint8_t>(assigned[side][t]);
      float *scales = cache->section<float>(kGammaScales) + static_cast<int64_t>(h) * g.segments * 2;
      for (int64_t seg = 0; seg < g.segments; ++seg)
        for (int side = 0; side < 2; ++side) {
          float mx = 0.0f;
          for (int64_t t = seg * g.segment_len; t < std::min(P, (seg + 1) * g.segment_len); ++t)
            if (anchor_of_token[t] < 0) mx = std::max(mx, std::fabs(coef[side][t]));
          scales[seg * 2 + side] = mx;
        }
    }
    for (int side = 0; side < 2; ++side) {
      const std::vector<float> &X = side == 0 ? Kpre : V;
      const float *scales = g.format == 3 ? cache->section<float>(kGammaScales) + static_cast<int64_t>(h) * g.segments * 2 : nullptr;
      pool.parallel_for(P, [&](int64_t b, int64_t e) {
        std::vector<float> r(D);
        for (int64_t t = b; t < e; ++t) {
          const int32_t best = assigned[side][t];
          float gq;
          if (g.format == 2) {
            uint16_t *gamma_out = reinterpret_cast<uint16_t *>(gamma_bytes[side]) + static_cast<int64_t>(h) * P;
            reinterpret_cast<uint16_t *>(index_bytes[side])[static_cast<int64_t>(h) * P + t] = static_cast<uint16_t>(best);
            gamma_out[t] = float_to_bf16(coef[side][t]);
            gq = bf16_to_float(gamma_out[t]);
          } else if (anchor_of_token[t] >= 0) {
            continue;  // exact through the anchor list: index 0, code 0 (the memset)
          } else {
            const float scale = scales[g.segment_of(t) * 2 + side];
            const uint8_t code = gamma_code(coef[side][t], scale);
            index_bytes[side][static_cast<int64_t>(h) * P + t] = entry[side][t];
            gamma_bytes[side][static_cast<int64_t>(h) * P + t] = code;
            gq = gamma_value(code, scale);
          }
          const float *x = &X[t * D];
          const float *av = &anchor_f[side][static_cast<int64_t>(best) * D];
          for (int d = 0; d < D; ++d) r[d] = x[d] - gq * av[d];
          energy[side][h * P + t] = dot(r.data(), r.data(), D);  // float lanes, as on the GPU
          if (side == 0) {
            // The key residual as attention sees it: rotated to the token's position.
            in.rotate(r.data(), t);
            std::memcpy(&Kpost[t * D], r.data(), D * sizeof(float));
          }
        }
      });
    }
    if (g.format == 3)  // anchor tokens: their key residual is zero (they are exact)
      for (int64_t a = 0; a < free_anchors; ++a) {
        std::memset(&Kpost[static_cast<int64_t>(picks[a]) * D], 0, D * sizeof(float));
        energy[0][h * P + picks[a]] = energy[1][h * P + picks[a]] = 0.0f;
      }

    stage(kStageUtilities);
    // 6. Utilities (Eq. 6). Z = Q (R r_K)^T; ||V_t - y||^2 = ||V_t||^2 - 2 V_t.y + ||y||^2.
    sgemm(pool, true, m, P, D, 1.0f, Q.data(), D, Kpost.data(), D, 0.0f, Z.data(), P);
    sgemm(pool, true, m, P, D, 1.0f, Y.data(), D, V.data(), D, 0.0f, VY.data(), P);
    std::vector<double> y_norm_sq(m);
    for (int64_t r = 0; r < m; ++r) {
      double s = 0.0;
      for (int d = 0; d < D; ++d) s += static_cast<double>(Y[r * D + d]) * Y[r * D + d];
      y_norm_sq[r] = s;
    }
    float *u_key = &utility[0][static_cast<int64_t>(h) * P];
    float *u_value = &utility[1][static_cast<int64_t>(h) * P];
    // In float over blocks of tokens, the rows in order (as the CUDA utility_kernel sums).
    constexpr int64_t kTokens = 256;
    pool.parallel_for((P + kTokens - 1) / kTokens, [&](int64_t b, int64_t e) {
      float vn[kTokens], uk[kTokens];
      for (int64_t blk = b; blk < e; ++blk) {
        const int64_t t0 = blk * kTokens, n = std::min(kTokens, P - t0);
        for (int64_t i = 0; i < n; ++i) {
          vn[i] = dot(&V[(t0 + i) * D], &V[(t0 + i) * D], D);
          uk[i] = 0.0f;
        }
        for (int64_t r = 0; r < m; ++r) {
          const float *a = &A[r * S + t0], *z = &Z[r * P + t0], *vy = &VY[r * P + t0];
          const float yn = static_cast<float>(y_norm_sq[r]);
          for (int64_t i = 0; i < n; ++i) {
            const float dist = std::max(0.0f, vn[i] - 2.0f * vy[i] + yn);
            uk[i] += a[i] * a[i] * z[i] * z[i] * dist;
          }
        }
        for (int64_t i = 0; i < n; ++i) {
          const int64_t t = t0 + i;
          const bool anchor = anchor_of_token[t] >= 0;  // anchors are exact: never candidates
          u_key[t] = anchor ? -1.0f : uk[i] / (static_cast<float>(m) * D);
          u_value[t] = anchor ? -1.0f : alpha_sq[t] * energy[1][h * P + t];
        }
      }
    });
  };
  // Heads run side by side, one per thread with its own arrays, where there are at least as
  // many heads as threads and the arrays fit in kHeadWorkerBytes; else one head at a time over
  // every thread. Each head's result is the same either way.
  const int threads = pool.size();
  const int workers = threads > 1 && H >= threads &&
                              static_cast<uint64_t>(threads - 1) * HeadScratch::bytes(S, P, D, m, k) <= kHeadWorkerBytes
                          ? threads
                          : 1;
  if (workers == 1) {
    HeadScratch s;
    for (int h = 0; h < H; ++h) compress_head(h, s, pool, true);
  } else {
    // The profile marks are worker 0's: its heads run while the others run theirs.
    pool.parallel_for(workers, [&](int64_t wb, int64_t we) {
      for (int64_t w = wb; w < we; ++w) {
        HeadScratch s;
        ThreadPool own(1);
        for (int h = static_cast<int>(w); h < H; h += workers) compress_head(h, s, own, w == 0);
      }
    });
  }

  clock.stage(kStageResidualSelection);
  // 7. Residual slots per side, pooled over the heads of each pooling group (all heads of the
  // layer unless pool_heads splits them): the largest utilities, then (guard share) the
  // largest residual energies among the tokens left.
  const int groups = g.pool_groups();
  const int64_t wanted[2] = {g.key_residuals / groups, g.value_residuals / groups};
  std::vector<std::vector<uint64_t>> masks(2, std::vector<uint64_t>(static_cast<size_t>(H) * g.words, 0));
  for (int job = 0; job < 2 * groups; ++job) {
    const int side = job / groups, group = job % groups;
    std::vector<Candidate> cands;
    cands.reserve(static_cast<size_t>(g.pool_heads) * P);
    for (int h = group * g.pool_heads; h < (group + 1) * g.pool_heads; ++h)
      for (int64_t t = 0; t < P; ++t)
        if (utility[side][h * P + t] >= 0.0f)
          cands.push_back({utility[side][h * P + t], h, static_cast<int32_t>(t)});
    const ResidualSplit split = residual_split(o, std::min<int64_t>(wanted[side], static_cast<int64_t>(cands.size())));
    std::nth_element(cands.begin(), cands.begin() + split.by_utility, cands.end(), better);
    if (split.by_energy > 0) {
      for (auto c = cands.begin() + split.by_utility; c != cands.end(); ++c)
        c->utility = energy[side][c->head * P + c->token];
      std::nth_element(cands.begin() + split.by_utility, cands.begin() + split.by_utility + split.by_energy,
                       cands.end(), better);
    }
    for (int64_t i = 0; i < split.by_utility + split.by_energy; ++i)
      masks[side][cands[i].head * g.words + cands[i].token / 64] |= 1ull << (cands[i].token % 64);
  }

  clock.stage(kStageEncoding);
  // 8. Bitmasks, prefix counts, per-head offsets, then encode each stored residual.
  const int sections_mask[2] = {kKeyMask, kValueMask}, sections_prefix[2] = {kKeyPrefix, kValuePrefix};
  const int sections_offsets[2] = {kKeyOffsets, kValueOffsets};
  const int sections_codes[2] = {kKeyCodes, kValueCodes}, sections_scales[2] = {kKeyScales, kValueScales};
  uint8_t *chunk_pos = cache->section<uint8_t>(kValueChunkPos);
  const ResidualCodec &codec = cache->codec;
  const AnchorAccess access(*cache);
  for (int side = 0; side < 2; ++side) {
    uint64_t *mask = cache->section<uint64_t>(sections_mask[side]);
    uint32_t *prefix = cache->section<uint32_t>(sections_prefix[side]);
    uint32_t *offsets = cache->section<uint32_t>(sections_offsets[side]);
    uint8_t *codes = cache->section<uint8_t>(sections_codes[side]);
    float *scales = cache->section<float>(sections_scales[side]);
    std::memcpy(mask, masks[side].data(), masks[side].size() * sizeof(uint64_t));
    uint32_t total = 0;
    for (int h = 0; h < H; ++h) {
      offsets[h] = total;
      uint32_t count = 0;
      for (int64_t wd = 0; wd < g.words; ++wd) {
        prefix[h * g.words + wd] = count;
        count += static_cast<uint32_t>(__builtin_popcountll(mask[h * g.words + wd]));
      }
      total += count;
    }
    offsets[H] = total;
    const uint16_t *anchors_in = side == 0 ? anchor_keys : anchor_values;
    pool.parallel_for(H, [&](int64_t hb, int64_t he) {
      std::vector<float> x(D);
      for (int64_t h = hb; h < he; ++h) {
        uint32_t slot = offsets[h];
        for (int64_t wd = 0; wd < g.words; ++wd) {
          uint64_t bits = mask[h * g.words + wd];
          while (bits) {
            const int bit = __builtin_ctzll(bits);
            bits &= bits - 1;
            const int64_t t = wd * 64 + bit;
            if (side == 0) in.key_row(static_cast<int>(h), t, x.data(), nullptr);
            else in.value_row(static_cast<int>(h), t, x.data());
            const int64_t a = access.anchor(side, static_cast<int>(h), t);
            const float gq = access.gamma(side, static_cast<int>(h), t);
            const uint16_t *av = anchors_in + (h * k + a) * D;
            for (int d = 0; d < D; ++d) x[d] -= gq * half_to_float(av[d], storage);
            scales[slot] = codec.encode(x.data(), codes + static_cast<int64_t>(slot) * codec.code_bytes());
            if (side == 1) chunk_pos[slot] = static_cast<uint8_t>(bit);
            ++slot;
          }
        }
      }
    });
  }
  // 9. The decode's logit penalties (format 3; docs/design.md §4.5): per head, the mean squared
  // error per dimension of the reconstructed keys of the prefix tokens that are not anchors,
  // without and with a key residual, times a factor c: the one of 0, c/2, c and 2c (c =
  // logit_correction) whose attention of the last kRows window rows of each query head is
  // closest to their exact attention (total variation; ties: the smaller).
  if (g.format == 3 && o.logit_correction > 0.0) {
    constexpr int kRows = 4;
    std::vector<float> &penalty = cache->meta.logit_penalty;
    penalty.assign(static_cast<size_t>(2) * H, 0.0f);
    const uint64_t *key_mask = cache->section<uint64_t>(kKeyMask);
    const int rows_per_q = std::min(kRows, W);
    pool.parallel_for(H, [&](int64_t hb, int64_t he) {
      std::vector<float> keys(static_cast<size_t>(S + cache->suffix_len) * D), x(D);
      std::vector<float> exact(static_cast<size_t>(S) * D), approx(static_cast<size_t>(S) * D);
      const int nr = G * rows_per_q;
      std::vector<float> q(static_cast<size_t>(nr) * D), ze(static_cast<size_t>(nr) * S), za(ze.size());
      std::vector<uint8_t> kind(S, kExact);  // KeyClass; the window is exact
      std::vector<double> pe(S), pa(S);
      for (int64_t h = hb; h < he; ++h) {
        reconstruct_head_cpu(*cache, static_cast<int>(h), false, keys.data(), nullptr, nullptr);
        key_classes(key_mask + h * g.words, anchor_tokens + h * free_anchors, free_anchors, P, kind.data());
        double sum[2] = {0.0, 0.0};
        int64_t count[2] = {0, 0};
        for (int64_t t = 0; t < S; ++t) {
          in.key_row(static_cast<int>(h), t, x.data(), &exact[t * D]);
          std::copy(&keys[t * D], &keys[t * D] + D, &approx[t * D]);
          in.rotate(&approx[t * D], t);
          if (kind[t] == kExact) continue;
          double e = 0.0;
          for (int d = 0; d < D; ++d) {
            const double diff = static_cast<double>(x[d]) - keys[t * D + d];
            e += diff * diff;
          }
          sum[kind[t]] += e;
          ++count[kind[t]];
        }
        const double mean[2] = {count[0] ? sum[0] / (static_cast<double>(count[0]) * D) : 0.0,
                                count[1] ? sum[1] / (static_cast<double>(count[1]) * D) : 0.0};
        // The last rows_per_q window rows of each of the group's query heads.
        for (int gi = 0; gi < G; ++gi)
          for (int r = 0; r < rows_per_q; ++r)
            in.query_row(static_cast<int>(h) * G + gi, W - rows_per_q + r, &q[(gi * rows_per_q + r) * D]);
        sgemm(true, nr, S, D, scale, q.data(), D, exact.data(), D, 0.0f, ze.data(), S);
        sgemm(true, nr, S, D, scale, q.data(), D, approx.data(), D, 0.0f, za.data(), S);
        // Per row: the exact and the reconstructed softmax weights once; a factor scales the
        // weights of each token class by exp(-penalty), so no exponential per factor.
        const double factors[4] = {0.0, 0.5, 1.0, 2.0};
        double tv[4] = {0.0, 0.0, 0.0, 0.0};
        for (int row = 0; row < nr; ++row) {
          const int r = row % rows_per_q;
          const int64_t visible = P + (W - rows_per_q + r) + 1;
          const float *qr = &q[static_cast<size_t>(row) * D];
          const double q2 = static_cast<double>(scale) * scale * dot(qr, qr, D);
          double me = -INFINITY, ma = -INFINITY;
          for (int64_t t = 0; t < visible; ++t) {
            me = std::max(me, static_cast<double>(ze[row * S + t]));
            ma = std::max(ma, static_cast<double>(za[row * S + t]));
          }
          double se = 0.0, sa[3] = {0.0, 0.0, 0.0};  // sa per token class
          for (int64_t t = 0; t < visible; ++t) {
            se += (pe[t] = std::exp(ze[row * S + t] - me));
            sa[kind[t]] += (pa[t] = std::exp(za[row * S + t] - ma));
          }
          for (int f = 0; f < 4; ++f) {
            const double c = factors[f] * o.logit_correction;
            const double w[3] = {std::exp(-c * q2 * mean[0]), std::exp(-c * q2 * mean[1]), 1.0};
            const double total = w[0] * sa[0] + w[1] * sa[1] + sa[2];
            const double scaled[3] = {w[0] / total, w[1] / total, 1.0 / total};
            double d = 0.0;
            for (int64_t t = 0; t < visible; ++t) d += std::abs(pe[t] / se - pa[t] * scaled[kind[t]]);
            tv[f] += 0.5 * d;
          }
        }
        int chosen = 0;
        for (int f = 1; f < 4; ++f)
          if (tv[f] < tv[chosen]) chosen = f;
        const double best = factors[chosen] * o.logit_correction;
        for (int i = 0; i < 2; ++i) penalty[2 * h + i] = static_cast<float>(best * mean[i]);
      }
    });
  }
  char tail[96] = "";
  if (g.format == 3 && g.table_size)  // as the CUDA profile's
    std::snprintf(tail, sizeof tail, "; outside their tables: %u token-sides, at most %u in a segment",
                  misses.total.load(), misses.most.load());
  clock.report("AnchorKV compress (cpu)", S, tail);
  return cache;
}

}  // namespace akv
