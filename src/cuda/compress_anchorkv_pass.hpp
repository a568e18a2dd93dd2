// The AnchorKV compression pass on the GPU (cuda/compress_pipeline.hpp describes the device
// policy): its profile stages, its scratch and the heads per batch, the nearest-anchor and
// coverage steps (storage format 2's global search, format 3's local candidates), and
// compress_anchorkv itself.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "core/compress_stages.hpp"
#include "core/context.hpp"
#include "core/error.hpp"
#include "core/rng.hpp"
#include "cuda/compress_common.hpp"
#include "cuda/compress_kernels.cuh"
#include "cuda/compress_local_kernels.cuh"
#include "cuda/coverage_select_kernels.cuh"
#include "cuda/head_dim.hpp"
#include "cuda/utility_kernels.cuh"
#include "cuda/window_outputs_kernels.cuh"
#include "methods/methods.hpp"

namespace akv {
namespace cuda {

// Scratch of one compression, carved out of one allocation. The arrays of the stages batched
// over heads (loading, window attention, scores, anchor ranking, residual rows, utilities)
// hold every head (of a batch), head h's part at h times the per-head size.
struct CompressScratch {
  uint16_t *anchor_b;  // anchor_n in bf16 (the tensor-core operand of nearest_anchor_kernel)
  // The window queries in bf16: the window attention scores on the tensor cores when the
  // queries and keys are exact in bf16 (bf16 inputs, keys given post-RoPE or without RoPE).
  uint16_t *q_b;
  float *kpre, *kpost, *v, *q, *attn, *y, *raw, *alpha_sq, *anchor_f, *anchor_n, *norms, *rk, *rk_norm_sq, *rv_norm_sq,
      *y_norm_sq, *inv_freq, *signs;
  uint32_t *rank_keys, *rank_index, *sample_index, *picks, *picks_dummy, *util_keys[2], *util_ids[2], *energy_keys[2],
      *energy_ids[2];
  uint64_t *sample_keys;
  int32_t *anchor_of_token, *nearest, *positions, *rope_first, *rope_second, *bad;
  // Coverage anchors: squared norms and best |cos|^2 per side, a round's energy partials and
  // candidates (coverage_select_kernels.cuh), flags, the rows absorbed next (the unit prefix
  // rows reuse rk and kpost, free at that point).
  float *cover_norm_sq[2], *cover_best[2], *select_partials;
  uint32_t *cover_keys, *cover_ids, *cover_fresh;
  uint32_t *pool_ids, *pool_keys, *pool_final;  // a round's pool (core/coverage.hpp), at most k a head
  uint32_t *merge_ids, *merge_keys;  // a two-level merge's group picks (merge_groups), at most kMergeGroupsMost k a head
  int32_t *cover_anchor;
  int32_t *block_table;
  // Storage format 3: each token's nearest candidate per side (its x . unit row in cover_best),
  // its anchor and coefficient, and (every head) the anchor index and coded coefficient in
  // bf16 that encode_kernel reads; the code units (gamma_units).
  int32_t *near_token[2], *assigned[2];
  float *coef[2], *units;
  uint32_t *outside;  // the token-sides outside their tables: a count, then (head x 2 + side, token) pairs
  uint16_t *index16[2], *gamma16[2];
  float *y_parts;           // window_outputs_kernel's partial sums, a chunk of tokens each
  uint32_t *utility_split;  // utility_rows_kernel's bf16 splits of the window queries and outputs
  uint32_t *search_stats;  // profiling: local_nearest_kernel's and segment_tables_kernel's counts (Dev::search_counts)
  // The candidate rows an absorb compares (unit rows, in bf16, squared norms), per side: side
  // 0's in anchor_n, anchor_b and norms (free until the assignment), side 1's their own.
  float *cand_n[2], *cand_norm_sq[2];
  uint16_t *cand_b[2];

  // Format 3: the prefix rows in bf16 of a batch of H heads (side 0 keys, 1 values), in rk
  // (free until the residuals); load_head_kernel writes them with their norms (cover_norm_sq).
  uint16_t *prefix_rows_b(int side, int H, int64_t P, int D) const {
    return reinterpret_cast<uint16_t *>(rk) + side * (int64_t{H} * P * D);
  }
  PrefixRows prefix_rows(int H, int64_t P, int D) const {
    return PrefixRows{{cover_norm_sq[0], cover_norm_sq[1]}, {prefix_rows_b(0, H, P, D), prefix_rows_b(1, H, P, D)}, P};
  }
  // On that bf16 path the post-RoPE keys in bf16, in kpost (no fp32 post-RoPE keys then).
  uint16_t *kpost_b() const { return reinterpret_cast<uint16_t *>(kpost); }

  // Lays the arrays out from `base` (nullptr: only measures); returns the bytes used. The
  // per-head staging holds `head_batch` heads (0: all H); the residual selection's keys, all H.
  // kpost_bf16: kpost holds only the bf16 post-RoPE keys (kpost_b; storage format 3 with
  // bf16_window_scores: format 2's coverage reuses kpost for fp32 rows), half its fp32 size.
  size_t carve(uint8_t *base, int64_t S, int64_t P, int H_all, int D, int m, int k, int pairs, int64_t table_blocks = 0,
               int head_batch = 0, bool kpost_bf16 = false) {
    const int H = head_batch > 0 ? std::min(head_batch, H_all) : H_all;
    Carver take(base);
    take(kpre, H * S * D);
    take(kpost, kpost_bf16 ? H * S * D / 2 : H * S * D);
    take(v, H * S * D);
    take(q, int64_t{H} * m * D);
    take(attn, int64_t{H} * m * S);
    take(y, int64_t{H} * m * D);
    take(y_parts, int64_t{H} * window_chunks(S) * m * D);  // window_outputs_kernel's partial sums
    take(raw, H * P);
    take(alpha_sq, H * P);
    take(anchor_f, int64_t{H} * k * D);
    take(anchor_n, int64_t{H} * k * D);
    take(anchor_b, int64_t{H} * k * D);
    take(norms, int64_t{H} * k);
    take(rk, H * P * D);
    take(rk_norm_sq, H * P);
    take(rv_norm_sq, H * P);
    take(y_norm_sq, int64_t{H} * m);
    take(utility_split, int64_t{H} * utility_rows(m) * D * 2);  // q hi, q lo, y hi, y lo (D / 2 words a row)
    take(inv_freq, pairs);
    take(signs, D);
    take(rank_keys, H * P);
    take(rank_index, H * P);
    take(sample_index, P);
    take(picks, int64_t{H} * k);  // head h's free_anchors picks at h * free_anchors
    take(picks_dummy, int64_t{H} * k);
    for (int side = 0; side < 2; ++side) {
      take(util_keys[side], int64_t{H_all} * P);
      take(util_ids[side], int64_t{H_all} * P);
      take(energy_keys[side], int64_t{H_all} * P);
      take(energy_ids[side], int64_t{H_all} * P);
    }
    take(sample_keys, P);
    take(anchor_of_token, H * P);
    take(nearest, H * P);
    take(positions, S);
    take(rope_first, pairs);
    take(rope_second, pairs);
    take(bad, 1);
    for (int side = 0; side < 2; ++side) {
      take(cover_norm_sq[side], H * P);
      take(cover_best[side], H * P);
    }
    // coverage_energy_kernel's partials (format 2), or the candidate search's (a tile of 32 or 64)
    take(select_partials, H * std::max(select_chunks(P), (P + 31) / 32) * 2);
    take(cover_keys, H * (P + kSelectChunk));  // select_chunks(P) x select_slots(take) a head
    take(cover_ids, H * (P + kSelectChunk));
    take(cover_fresh, int64_t{H} * fresh_stride(k, 0));  // the next absorb's candidates (sort_fresh_kernel's padding)
    take(pool_ids, int64_t{H} * k);
    take(pool_keys, int64_t{H} * k);
    take(pool_final, int64_t{H} * k);
    take(merge_ids, int64_t{H} * kMergeGroupsMost * k);
    take(merge_keys, int64_t{H} * kMergeGroupsMost * k);
    take(cover_anchor, H * P);
    take(block_table, table_blocks);  // paged prefill: the block table on the device
    for (int side = 0; side < 2; ++side) {
      take(near_token[side], H * P);
      take(assigned[side], H * P);
      take(coef[side], H * P);
      take(index16[side], int64_t{H_all} * P);
      take(gamma16[side], int64_t{H_all} * P);
    }
    take(units, 256);
    take(outside, 1 + 2 * 2 * H * P);
    take(search_stats, 6);
    take(q_b, int64_t{H} * m * D);
    cand_n[0] = anchor_n;
    cand_b[0] = anchor_b;
    cand_norm_sq[0] = norms;
    take(cand_n[1], int64_t{H} * k * D);
    take(cand_b[1], int64_t{H} * k * D);
    take(cand_norm_sq[1], int64_t{H} * k);
    return take.bytes();
  }
};

// Whether the window scores' GEMM takes bf16 operands (the products exact, fp32 sums): bf16
// inputs whose keys the GEMM takes as given (post-RoPE, or no RoPE: `pairs` 0), the queries
// then written in bf16 too (load_queries_kernel) and the keys in bf16 only (load_head_kernel).
inline bool bf16_window_scores(const akv_prefill &p, const akv_compress_options &o, int pairs) {
  return p.dtype == AKV_DTYPE_BF16 && (o.keys_post_rope || pairs == 0);
}

// CompressScratch::carve's kpost_bf16 for a pass: storage format 3 on that bf16 path (format 2's
// coverage rounds reuse kpost for fp32 rows).
inline bool kpost_bf16_for(const AnchorGeometry &g, const akv_prefill &p, const akv_compress_options &o, int pairs) {
  return g.format == 3 && bf16_window_scores(p, o, pairs);
}

// The CUDA pass's scratch budget for choosing the heads per batch (2 GiB: H = 8, Hq = 32,
// D = 128 batches all 8 heads up to 64K, fewer at 128K).
constexpr size_t kHeadBatchBudget = size_t{2} << 30;

// Heads per batch of the AnchorKV pass: all of them when the scratch fits in budget_bytes,
// else as few batches as fit, with their heads spread evenly (8 heads in two batches: 4 and 4,
// not 5 and 3, whose larger batch would take more waves of blocks). The stages before the
// residual selection run once per batch (each kernel over the batch's heads), so fewer heads
// per batch means more launches.
inline int anchor_head_batch(const AnchorGeometry &g, int pairs, int64_t table_blocks, size_t budget_bytes,
                             bool kpost_bf16) {
  CompressScratch measure;
  int most = 1;
  for (int hb = g.heads; hb > 1 && most == 1; --hb)
    if (measure.carve(nullptr, g.seq_len, g.prefix, g.heads, g.dim, g.group() * g.window, g.anchors, pairs, table_blocks,
                      hb, kpost_bf16) <= budget_bytes)
      most = hb;
  const int batches = (g.heads + most - 1) / most;
  return (g.heads + batches - 1) / batches;
}

// nearest_anchor_kernel for head dim D (64, 128 or 256) over the rows X[0..n); with heads > 1,
// head h's rows at X + h x_stride, anchors at h k D (norms: h k), outputs at h out_stride.
template <class Dev>
void nearest_anchors(Dev &dev, int D, const float *X, int64_t n, int k, const float *anchor_n, const uint16_t *anchor_b,
                     const float *norms, int32_t *nearest, float *best_sq, int heads = 1, int64_t x_stride = 0,
                     int64_t out_stride = 0, int64_t anchor_stride = 0) {
  auto go = [&](auto kernel, int tokens) {
    dev.launch(kernel, grid_blocks(n, tokens), heads, 128, X, x_stride, n, k, anchor_n, anchor_b, norms, nearest,
               best_sq, out_stride, anchor_stride);
  };
  with_head_dim(D, [&](auto d) { go(nearest_anchor_kernel<decltype(d)::value>, near_tokens(decltype(d)::value)); });
}

// The `take` smallest of n candidates a head (keys and ids in token order, head h's at h n) by
// coverage_merge_kernel<POOL>, the other arguments its own: in one level, or in two where
// merge_groups says so (the groups' picks in s.merge_ids and s.merge_keys first).
template <bool POOL, class Dev>
void merge_candidates(Dev &dev, const CompressScratch &s, int H, const uint32_t *keys, const uint32_t *ids, int64_t n,
                      int64_t take, int64_t P, int32_t *is_anchor, uint32_t *picks, int64_t picks_stride,
                      uint32_t *fresh, int64_t fresh_stride) {
  if (const int groups = merge_groups(n, take); groups > 1) {
    const int64_t m = groups * take;
    dev.launch(coverage_merge_kernel<true>, groups, H, kSelectThreads, keys, ids, n, take, P, is_anchor, s.merge_ids,
               m, s.merge_keys, m);
    keys = s.merge_keys;
    ids = s.merge_ids;
    n = m;
  }
  dev.launch(coverage_merge_kernel<POOL>, 1, H, kSelectThreads, keys, ids, n, take, P, is_anchor, picks, picks_stride,
             fresh, fresh_stride);
}

// One coverage round's ranking (coverage_select_kernels.cuh), batched over the H heads: the
// `take` picks of each head's pool of the `pool` tokens its anchors so far represent worst
// (core/coverage.hpp: uncovered members first), flagged in s.cover_anchor, appended to its picks
// at `at` and written in token order to `fresh` (head h's at h fresh_stride). local_tiles > 0:
// format 3's energies (x . unit row), whose partials the last candidate search left in
// s.select_partials, local_tiles of them a head; 0: format 2's (|cos|^2), summed by
// coverage_energy_kernel first. `cover`: the rows of the cover test (null, or pool <= take: the
// pool is the picks).
template <class Dev>
void coverage_round(Dev &dev, const CompressScratch &s, int H, int64_t P, int64_t local_tiles, int64_t take,
                    int64_t pool, int64_t at, int64_t free_anchors, uint32_t *fresh, int64_t fresh_stride,
                    const CoverRows *cover = nullptr, int D = 0, const LocalRange &range = LocalRange{}) {
  const int chunks = static_cast<int>(select_chunks(P));
  const bool pooled = cover && pool > take;
  const int64_t wanted = pooled ? pool : take;
  const float *norm_sq[2] = {s.cover_norm_sq[0], s.cover_norm_sq[1]}, *best[2] = {s.cover_best[0], s.cover_best[1]};
  const int64_t parts = local_tiles > 0 ? local_tiles : chunks;
  auto rank = [&](auto chunk) {
    dev.launch(chunk, chunks, H, kSelectThreads, norm_sq[0], best[0], norm_sq[1], best[1], P,
               static_cast<const float *>(s.select_partials), parts, wanted,
               static_cast<const int32_t *>(s.cover_anchor), s.cover_keys, s.cover_ids);
  };
  if (local_tiles > 0) {
    rank(coverage_chunk_kernel<1>);
  } else {
    dev.launch(coverage_energy_kernel<0>, chunks, H, kSelectThreads, norm_sq[0], best[0], norm_sq[1], best[1], P,
               s.select_partials);
    rank(coverage_chunk_kernel<0>);
  }
  const int64_t candidates = chunks * select_slots(wanted);
  if (!pooled) {
    merge_candidates<false>(dev, s, H, s.cover_keys, s.cover_ids, candidates, take, P, s.cover_anchor, s.picks + at,
                            free_anchors, fresh, fresh_stride);
    return;
  }
  // The pool (tokens and keys, in token order), its cover test, then the picks from it.
  merge_candidates<true>(dev, s, H, s.cover_keys, s.cover_ids, candidates, pool, P, s.cover_anchor, s.pool_ids, pool,
                         s.pool_keys, pool);
  CoverRows rows = *cover;
  if (local_tiles > 0) {  // format 3: the members as stored anchors, in pool order (side_rows_kernel's rows)
    const SideRows sides{{rows.token[0], rows.token[1]}, {s.cand_n[0], s.cand_n[1]}, {nullptr, nullptr}, {nullptr, nullptr}};
    dev.launch(side_rows_kernel, grid_blocks(pool, 4), 2 * H, 128, sides, rows.token_stride[0],
               static_cast<const uint32_t *>(s.pool_ids), pool, pool, D, rows.storage, rows.anchor_stride, int64_t{0});
    rows.anchor[0] = s.cand_n[0];
    rows.anchor[1] = s.cand_n[1];
  }
  auto test = [&](auto kernel) {
    dev.launch(kernel, static_cast<int>((pool + 7) / 8), H, 256, rows, D, norm_sq[0], best[0], norm_sq[1], best[1], P,
               static_cast<const float *>(s.select_partials), parts, range, static_cast<const uint32_t *>(s.pool_keys),
               static_cast<const uint32_t *>(s.pool_ids), pool, s.pool_final);
  };
  if (local_tiles > 0) test(coverage_cover_kernel<1>);
  else test(coverage_cover_kernel<0>);
  merge_candidates<false>(dev, s, H, s.pool_final, s.pool_ids, pool, take, P, s.cover_anchor, s.picks + at,
                          free_anchors, fresh, fresh_stride);
}

// The coverage share of every head's anchors (CPU: add_coverage_anchors), batched over the H
// heads: head h's n_top scored picks are at s.picks + h free_anchors and flagged in
// s.cover_anchor (zeroed before); appends `count` more, chosen in `rounds` rounds as the tokens
// the anchors so far (and the window) represent worst. Uses s.rk and s.kpost (free before the
// assignment) for the unit prefix rows of keys and values, and s.cand_n / s.cand_b for the
// rows being absorbed.
template <class Dev>
void coverage_anchors(Dev &dev, const CompressScratch &s, int H, int64_t S, int64_t P, int D, int W, int k,
                      int64_t free_anchors, int64_t n_top, int64_t count, int rounds) {
  const float *X[2] = {s.kpre, s.v};
  float *unit[2] = {s.rk, s.kpost};
  const int64_t unit_stride[2] = {P * D, S * D};
  for (int side = 0; side < 2; ++side) {
    dev.launch(unit_rows_kernel, grid_blocks(P, 4), H, 128, X[side], S * D, P, D, unit[side], unit_stride[side],
               s.cover_norm_sq[side]);
    dev.fill(s.cover_best[side], 0, H * P * sizeof(float));
  }
  // Raise every prefix token's best |cos|^2 with the n anchor tokens ids[0..n) of each head
  // (head h's at ids + h ids_stride): both sides' unit rows in one launch, then per side the
  // fused search (tensor-core products, fp32 rescoring).
  const SideRows rows{{X[0], X[1]}, {s.cand_n[0], s.cand_n[1]}, {s.cand_b[0], s.cand_b[1]}, {nullptr, nullptr}};
  auto absorb = [&](const uint32_t *ids, int64_t ids_stride, int64_t n) {
    if (n == 0) return;
    dev.launch(side_rows_kernel, grid_blocks(n, 4), 2 * H, 128, rows, S * D, ids, ids_stride, n, D, -1,
               int64_t{k} * D, int64_t{0});
    for (int side = 0; side < 2; ++side)
      nearest_anchors(dev, D, unit[side], P, static_cast<int>(n), s.cand_n[side], s.cand_b[side], nullptr, nullptr,
                      s.cover_best[side], H, unit_stride[side], P, k);
  };
  // The scored picks and the window tokens first.
  dev.launch(coverage_take_kernel, grid_blocks(n_top + W, 128), H, 128, static_cast<const uint32_t *>(s.picks),
             free_anchors, n_top, s.cover_anchor, P, s.cover_fresh, int64_t{k}, int64_t{W});
  absorb(s.cover_fresh, k, n_top + W);
  int64_t left = count, at = n_top;
  for (int round = 0; round < rounds && left > 0; ++round) {
    const int64_t take = std::min<int64_t>((left + (rounds - round) - 1) / (rounds - round), P - at);
    if (take <= 0) break;
    const CoverRows cover{{unit[0], unit[1]}, {unit_stride[0], unit_stride[1]}, {nullptr, nullptr}, 0, -1};
    coverage_round(dev, s, H, P, 0, take, coverage_pool_size(take, free_anchors), at, free_anchors, s.cover_fresh, k,
                   &cover, D);
    absorb(s.cover_fresh, k, take);
    at += take;
    left -= take;
  }
}

// Storage format 3's anchor choice and nearest candidates (CPU: local_coverage), batched over
// the H heads: head h's first n0 picks are at s.picks + h free_anchors. They and the window are
// compared with every token whose candidates they are; then `count` more anchors are chosen in
// `rounds` rounds (flagged in s.cover_anchor, zeroed before, and appended to the picks), each
// the tokens their candidates represent worst, and compared in turn. Each token ends with its
// nearest candidate in s.near_token and its x . unit row in s.cover_best. The candidates' rows
// (rounded to the storage dtype: 0 f16, 1 bf16) go through s.cand_n, s.cand_b, s.cand_norm_sq.
template <class Dev>
void local_coverage(Dev &dev, const CompressScratch &s, int H, int64_t S, int64_t P, int D, int W, int k,
                    int64_t free_anchors, int64_t n0, int64_t count, int rounds, const LocalRange &range, int storage) {
  const float *X[2] = {s.kpre, s.v};
  // The prefix rows in bf16 and their squared norms (the margin of the candidate search and the
  // rounds' ranking), from load_head_kernel.
  const uint16_t *x_b[2] = {s.prefix_rows_b(0, H, P, D), s.prefix_rows_b(1, H, P, D)};
  for (int side = 0; side < 2; ++side) {
    dev.fill(s.near_token[side], 0xFF, H * P * sizeof(int32_t));  // -1: none yet
    dev.fill(s.cover_best[side], 0, H * P * sizeof(float));
  }
  // Compares every token with the candidates s.cover_fresh (sort_fresh_kernel's [H][stride]:
  // n_sorted increasing prefix tokens, then n_tail of the window's): both sides' candidate rows
  // in one launch, both sides' search in another.
  const SideRows rows{{X[0], X[1]}, {s.cand_n[0], s.cand_n[1]}, {s.cand_b[0], s.cand_b[1]},
                      {s.cand_norm_sq[0], s.cand_norm_sq[1]}};
  LocalSide sides[2];
  for (int side = 0; side < 2; ++side)
    sides[side] = LocalSide{X[side], x_b[side], s.cover_norm_sq[side], s.cand_n[side], s.cand_b[side],
                            s.cand_norm_sq[side], s.near_token[side], s.cover_best[side]};
  auto absorb = [&](int64_t n_sorted, int64_t n_tail, int64_t stride) {
    const int64_t n = n_sorted + n_tail;
    if (n == 0) return;
    dev.launch(side_rows_kernel, grid_blocks(n, 4), 2 * H, 128, rows, S * D,
               static_cast<const uint32_t *>(s.cover_fresh), stride, n, D, storage, int64_t{k} * D, int64_t{k});
    with_head_dim(D, [&](auto d) {
      constexpr int DD = decltype(d)::value;
      auto search = [&](auto kernel) {
        dev.launch(kernel, grid_blocks(P, near_tokens(DD)), 2 * H, 128, sides[0], sides[1], S * D, range,
                   static_cast<const uint32_t *>(s.cover_fresh), stride, n_sorted, n_tail, int64_t{k} * D,
                   s.select_partials, dev.profiling ? s.search_stats : nullptr);
      };
      if (local_chunk(range, n_sorted, n_tail) == 16) search(local_nearest_kernel<DD, 16>);
      else search(local_nearest_kernel<DD, 32>);
    });
  };
  dev.launch(sort_fresh_kernel, 1, H, kFreshThreads, static_cast<const uint32_t *>(s.picks), free_anchors, n0, P,
             int64_t{W}, s.cover_fresh, fresh_stride(n0, W));
  absorb(n0, W, fresh_stride(n0, W));
  int64_t left = count, at = n0;
  for (int round = 0; round < rounds && left > 0; ++round) {
    const int64_t take = std::min<int64_t>((left + (rounds - round) - 1) / (rounds - round), P - at);
    if (take <= 0) break;
    const CoverRows cover{{X[0], X[1]}, {S * D, S * D}, {nullptr, nullptr}, int64_t{k} * D, storage};
    coverage_round(dev, s, H, P, grid_blocks(P, near_tokens(D)), take, coverage_pool_size(take, free_anchors), at,
                   free_anchors, s.cover_fresh, fresh_stride(take, 0), &cover, D, range);
    absorb(take, 0, fresh_stride(take, 0));
    at += take;
    left -= take;
  }
}

// Compresses into `data` (device memory of cache.layout.total_bytes) with scratch memory of
// at least scratch_bytes(); the prefill tensors are device pointers. Throws
// AKV_ERR_NON_FINITE (after waiting for the work) when an input holds NaN or Inf.
template <class Dev>
void compress_anchorkv(Dev &dev, const akv_prefill &p, const akv_compress_options &o, const akv_cache &cache,
                       const std::vector<int32_t> &positions, uint8_t *data, uint8_t *scratch_base,
                       int head_batch = 0) {
  const AnchorGeometry &g = cache.geometry;
  const int64_t S = g.seq_len, P = g.prefix, words = g.words;
  const int H = g.heads, G = g.group(), D = g.dim, W = g.window, k = g.anchors;
  const int m = G * W;
  const int64_t free_anchors = k - W;
  const Rope &rope = cache.rope;
  const int pairs = rope.enabled() ? rope.pairs() : 0;
  const int HB = head_batch > 0 ? std::min(head_batch, H) : H;  // heads per batch
  const bool local = g.format == 3;  // local candidates, tables and coefficient codes
  // The scores' GEMM on the tensor cores when its operands are exact in bf16.
  const bool bf16_scores = bf16_window_scores(p, o, pairs);
  CompressScratch s;
  s.carve(scratch_base, S, P, H, D, m, k, pairs, paged_blocks(p), HB, kpost_bf16_for(g, p, o, pairs));
  auto section = [&](int index) { return data + cache.layout.sections[index].offset; };

  // Constants: positions, RoPE tables, Hadamard signs; the cache starts zeroed.
  dev.stage(kStageSetup);
  dev.fill(data, 0, cache.layout.total_bytes);
  dev.copy(s.positions, positions.data(), S * sizeof(int32_t));
  if (local) dev.copy(s.units, gamma_units(), 256 * sizeof(float));
  else dev.copy(section(kPositions), positions.data(), P * sizeof(int32_t));
  upload_rope(dev, rope, s.inv_freq, s.rope_first, s.rope_second);
  dev.copy(s.signs, cache.codec.signs().data(), D * sizeof(float));
  dev.fill(s.bad, 0, sizeof(int32_t));
  if (dev.profiling && local) dev.fill(s.search_stats, 0, sizeof dev.search_counts);

  const PrefillArgs a = prefill_args(p, o, cache, s.positions, s.inv_freq, s.rope_first, s.rope_second, s.bad,
                                     upload_block_table(dev, p, s.block_table));

  const bool bf16 = cache.meta.storage == AKV_DTYPE_BF16;
  const int64_t n_sink = sink_anchor_count(o, g), n_top = scored_anchor_count(o, g);
  const int64_t n_rand = free_anchors - n_top;
  uint16_t *index[2] = {reinterpret_cast<uint16_t *>(section(kKeyIndex)), reinterpret_cast<uint16_t *>(section(kValueIndex))};
  uint16_t *gamma[2] = {reinterpret_cast<uint16_t *>(section(kKeyGamma)), reinterpret_cast<uint16_t *>(section(kValueGamma))};
  uint16_t *anchors_out[2] = {reinterpret_cast<uint16_t *>(section(kAnchorKeys)),
                              reinterpret_cast<uint16_t *>(section(kAnchorValues))};
  int64_t *anchor_tokens = reinterpret_cast<int64_t *>(section(kAnchorTokens));
  // Format 3: one-byte entries and codes in the index and gamma sections; encode_kernel reads
  // the anchor indices and coded coefficients from scratch instead.
  uint8_t *entry_bytes[2] = {section(kKeyIndex), section(kValueIndex)};
  uint8_t *code_bytes[2] = {section(kKeyGamma), section(kValueGamma)};
  const uint16_t *encode_index[2] = {local ? s.index16[0] : index[0], local ? s.index16[1] : index[1]};
  const uint16_t *encode_gamma[2] = {local ? s.gamma16[0] : gamma[0], local ? s.gamma16[1] : gamma[1]};
  static_assert(kTableSlots == kTableEntries, "one-byte table entries");
  const LocalRange range{P, g.candidate_reach(), g.segment_shift};
  uint16_t *tables = local && g.table_size ? reinterpret_cast<uint16_t *>(section(kSegmentTables)) : nullptr;
  float *code_scales = local ? reinterpret_cast<float *>(section(kGammaScales)) : nullptr;

  // 1-6 per batch of HB heads (all of them unless the scratch budget splits them): H below is
  // the batch's head count, h0 its first head.
  for (int h0 = 0; h0 < g.heads; h0 += HB) {
    const int H = std::min(HB, g.heads - h0);
    // 1. Every head's keys (both forms), values and its group's window queries.
    dev.stage(kStageLoad);
    dev.launch(load_head_kernel, grid_blocks(S, 4), H, 128, a, h0, s.kpre, s.kpost, s.v,
               local ? s.prefix_rows(H, P, D) : PrefixRows{}, bf16_scores ? s.kpost_b() : nullptr);
    dev.launch(load_queries_kernel, m, H, 32, a, h0, s.q, bf16_scores ? s.q_b : nullptr);
    // 2. Window attention with the causal window mask, and its outputs y (batched over heads;
    // the softmax rows of all heads are one [H m][S] array, m a multiple of W).
    dev.stage(kStageWindowAttention);
    if (bf16_scores)  // the same products (exact), fp32 sums, on the tensor cores
      dev.gemm_nt_batched_bf16(m, S, D, cache.meta.softmax_scale, s.q_b, D, int64_t{m} * D, s.kpost_b(), D, S * D,
                               s.attn, S, int64_t{m} * S, H);
    else
      dev.gemm_nt_batched(m, S, D, cache.meta.softmax_scale, s.q, D, int64_t{m} * D, s.kpost, D, S * D, s.attn, S,
                          int64_t{m} * S, H);
    dev.launch(window_softmax_kernel, H * m, 1, 128, s.attn, S, P, W);
    // y = A V on the tensor cores: the chunks' partial sums, then their sum in chunk order.
    const int chunks = window_chunks(S);
    with_head_dim(D, [&](auto d) {
      constexpr int DD = decltype(d)::value;
      auto outputs = [&](auto kernel) {
        dev.launch(kernel, chunks, H * grid_blocks(m, window_block_rows(DD)), 256, static_cast<const float *>(s.attn),
                   static_cast<const float *>(s.v), S, m, s.y_parts);
      };
      if (p.dtype == AKV_DTYPE_BF16) outputs(window_outputs_kernel<DD, true>);  // V holds bf16 values
      else outputs(window_outputs_kernel<DD, false>);
    });
    dev.launch(window_outputs_reduce_kernel, grid_blocks(int64_t{H} * m * D, 256), 1, 256,
               static_cast<const float *>(s.y_parts), chunks, int64_t{m} * D, int64_t{H} * m * D, s.y);
    // 3. Scores, pooled; 4. anchors: the top share by pooled score (ties: lower index), then
    // the smallest counter hashes among the rest, sorted by token.
    dev.stage(kStageScores);
    dev.launch(scores_kernel, grid_blocks(P, 128), H, 128, static_cast<const float *>(s.attn), S, P, m, s.raw,
               s.alpha_sq);
    dev.launch(pool_kernel, grid_blocks(P, 128), H, 128, static_cast<const float *>(s.raw), P, o.pool_kernel,
               o.pool_type == AKV_POOL_MAX ? 1 : 0, o.follow_tokens, n_sink, s.rank_keys, s.rank_index);
    dev.stage(kStageAnchorSelection);
    dev.sort_segments_u32(s.rank_keys, s.rank_index, H, P);

    if (o.coverage_rounds > 0 || local) dev.fill(s.cover_anchor, 0, H * P * sizeof(int32_t));
    if (o.coverage_rounds > 0) {
      // Every head's scored picks (flagged as anchors), then the coverage share.
      if (n_top > 0)
        dev.launch(coverage_take_kernel, grid_blocks(n_top, 128), H, 128, static_cast<const uint32_t *>(s.rank_index), P,
                   n_top, s.cover_anchor, P, s.picks, free_anchors, int64_t{0});
      if (n_rand > 0 && !local) coverage_anchors(dev, s, H, S, P, D, W, k, free_anchors, n_top, n_rand, o.coverage_rounds);
    }
    for (int h = 0; h < H && o.coverage_rounds == 0; ++h) {
      const uint32_t *ranked = s.rank_index + h * P;  // head h's ranking and picks
      uint32_t *picks = s.picks + h * free_anchors;
      if (P > n_top) {
        dev.launch(sample_keys_kernel, grid_blocks(P - n_top, 128), 1, 128, ranked, n_top, P, o.seed,
                   static_cast<uint64_t>(kStreamAnchorSample),
                   (static_cast<uint64_t>(o.layer_index) << 32) | static_cast<uint64_t>(o.head_offset + h0 + h), s.sample_keys,
                   s.sample_index);
        dev.sort_u64(s.sample_keys, s.sample_index, P - n_top);
      }
      dev.copy(picks, ranked, n_top * sizeof(uint32_t));
      dev.copy(picks + n_top, s.sample_index, n_rand * sizeof(uint32_t));
    }
    // Format 3: the coverage share (if any) and every token's nearest candidate.
    if (local) {
      const bool cover = o.coverage_rounds > 0;
      local_coverage(dev, s, H, S, P, D, W, k, free_anchors, cover ? n_top : free_anchors, cover ? n_rand : 0,
                     o.coverage_rounds, range, bf16 ? 1 : 0);
    }
    // Every head's picks by token; 5. per side: anchors into the cache, nearest anchor of every
    // prefix token (batched over heads).
    dev.sort_segments_u32(s.picks, s.picks_dummy, H, free_anchors);
    dev.fill(s.anchor_of_token, 0xFF, H * P * sizeof(int32_t));  // -1: not an anchor
    dev.stage(kStageAssignment);
    for (int side = 0; side < 2; ++side) {
      const float *X = side == 0 ? s.kpre : s.v;
      dev.launch(anchors_kernel, k, H, 128, X, S * D, static_cast<const uint32_t *>(s.picks), free_anchors, P, D,
                 bf16 ? 1 : 0, anchors_out[side] + static_cast<int64_t>(h0) * k * D, s.anchor_f, s.anchor_n, s.anchor_b,
                 s.norms, side == 0 ? anchor_tokens + h0 * free_anchors : static_cast<int64_t *>(nullptr),
                 s.anchor_of_token);
      if (local) {  // the nearest candidates local_coverage found
        dev.launch(local_assign_kernel, grid_blocks(P, 128), H, 128, static_cast<const int32_t *>(s.near_token[side]),
                   static_cast<const float *>(s.cover_best[side]), static_cast<const int32_t *>(s.anchor_of_token),
                   static_cast<const float *>(s.norms), P, k, free_anchors, s.assigned[side], s.coef[side]);
        continue;
      }
      // Nearest anchor by |cos| (tensor-core products, fp32 rescoring; no score matrix), then
      // coefficients and residual norms.
      nearest_anchors(dev, D, X, P, k, s.anchor_n, s.anchor_b, s.norms, s.nearest, nullptr, H, S * D, P, k);
      dev.launch(assign_kernel, grid_blocks(P, 4), H, 128, static_cast<const int32_t *>(s.nearest), int64_t{0}, P, P, k,
                 D, X, S * D, static_cast<const float *>(s.anchor_f), static_cast<const float *>(s.anchor_n),
                 static_cast<const float *>(s.norms), static_cast<const int32_t *>(s.anchor_of_token), index[side] + h0 * P,
                 gamma[side] + h0 * P, side, static_cast<const int32_t *>(s.positions), pairs,
                 static_cast<const float *>(s.inv_freq), static_cast<const int32_t *>(s.rope_first),
                 static_cast<const int32_t *>(s.rope_second), s.rk, side == 0 ? s.rk_norm_sq : s.rv_norm_sq);
    }
    if (local) {
      // Format 3: each segment's table and code scales, then every token's code and residual.
      uint16_t *batch_tables = tables ? tables + h0 * g.segments * g.table_size : nullptr;
      float *batch_scales = code_scales + h0 * g.segments * 2;
      if (tables) dev.fill(s.outside, 0, sizeof(uint32_t));
      dev.launch(segment_tables_kernel, static_cast<int>(g.segments), H, kTableThreads, P, g.segment_shift, g.segments,
                 g.table_size, static_cast<const int32_t *>(s.anchor_of_token),
                 static_cast<const int32_t *>(s.assigned[0]), static_cast<const int32_t *>(s.assigned[1]),
                 static_cast<const float *>(s.coef[0]), static_cast<const float *>(s.coef[1]), entry_bytes[0] + h0 * P,
                 entry_bytes[1] + h0 * P, batch_tables, batch_scales, s.outside,
                 dev.profiling ? s.search_stats : nullptr);
      if (tables)  // the tokens outside their tables, over the whole device
        with_head_dim(D, [&](auto d) {
          constexpr int DD = decltype(d)::value;
          auto scan = [&](auto kernel) {
            dev.launch(kernel, static_cast<int>(g.segments) * H, 1, kMissThreads, static_cast<const uint32_t *>(s.outside),
                       static_cast<const float *>(s.kpre), static_cast<const float *>(s.v), S * D, P, g.segment_shift,
                       g.segments, g.table_size, k,
                       static_cast<const uint16_t *>(anchors_out[0] + static_cast<int64_t>(h0) * k * D),
                       static_cast<const uint16_t *>(anchors_out[1] + static_cast<int64_t>(h0) * k * D),
                       static_cast<const uint16_t *>(batch_tables), s.assigned[0], s.assigned[1], s.coef[0],
                       s.coef[1], entry_bytes[0] + h0 * P, entry_bytes[1] + h0 * P, batch_scales);
          };
          if (bf16) scan(table_misses_kernel<DD, true>);
          else scan(table_misses_kernel<DD, false>);
        });
      for (int side = 0; side < 2; ++side)
        dev.launch(code_coefficients_kernel, grid_blocks(P, 4), H, 128, static_cast<const int32_t *>(s.assigned[side]),
                   static_cast<const float *>(s.coef[side]),
                   static_cast<const float *>(code_scales + h0 * g.segments * 2), static_cast<const float *>(s.units),
                   P, g.segment_shift, g.segments, side, k, D, side == 0 ? s.kpre : s.v, S * D,
                   static_cast<const uint16_t *>(anchors_out[side] + static_cast<int64_t>(h0) * k * D), bf16 ? 1 : 0,
                   static_cast<const int32_t *>(s.anchor_of_token), code_bytes[side] + h0 * P,
                   s.index16[side] + h0 * P, s.gamma16[side] + h0 * P, static_cast<const int32_t *>(s.positions),
                   pairs, static_cast<const float *>(s.inv_freq), static_cast<const int32_t *>(s.rope_first),
                   static_cast<const int32_t *>(s.rope_second), s.rk, side == 0 ? s.rk_norm_sq : s.rv_norm_sq);
    }
    // 6. Utilities (Eq. 6) of every head: ||y||^2 and the window rows' bf16 splits, then
    // Z = Q (R r_K)^T and V.y per tile of tokens on the tensor cores, folded into the sums in
    // the same kernel (utility_kernels.cuh).
    dev.stage(kStageUtilities);
    dev.launch(utility_rows_kernel, grid_blocks(int64_t{H} * utility_rows(m), 4), 1, 128,
               static_cast<const float *>(s.q), static_cast<const float *>(s.y), H, m, D, s.y_norm_sq,
               s.utility_split);
    with_head_dim(D, [&](auto d) {
      constexpr int DD = decltype(d)::value;
      auto utilities = [&](auto kernel) {
        dev.launch(kernel, grid_blocks(P, utility_tokens(DD)), H, 128, static_cast<const float *>(s.attn), S, P, m,
                   static_cast<const uint32_t *>(s.utility_split), static_cast<const float *>(s.y_norm_sq),
                   static_cast<const float *>(s.rk), static_cast<const float *>(s.v),
                   static_cast<const float *>(s.alpha_sq),
                   static_cast<const float *>(s.rk_norm_sq), static_cast<const float *>(s.rv_norm_sq),
                   static_cast<const int32_t *>(s.anchor_of_token), h0, s.util_keys[0], s.util_keys[1],
                   s.util_ids[0], s.util_ids[1], s.energy_keys[0], s.energy_keys[1], s.energy_ids[0],
                   s.energy_ids[1]);
      };
      // bf16 inputs: the queries and values as loaded hold bf16 values (neither is rotated here).
      if (p.dtype == AKV_DTYPE_BF16) utilities(utility_tc_kernel<DD, true>);
      else utilities(utility_tc_kernel<DD, false>);
    });
  }

  // 7-8. Per side and pooling group (every head unless pool_heads splits them): the best
  // utilities over the group's heads (ties: head, then token), then the guard share by
  // residual energy among the rest; bitmasks, prefix counts and offsets, then every stored
  // residual encoded.
  const int groups = g.pool_groups();
  const int64_t wanted[2] = {g.key_residuals / groups, g.value_residuals / groups};
  const int mask_sec[2] = {kKeyMask, kValueMask}, prefix_sec[2] = {kKeyPrefix, kValuePrefix};
  const int offsets_sec[2] = {kKeyOffsets, kValueOffsets}, codes_sec[2] = {kKeyCodes, kValueCodes};
  const int scales_sec[2] = {kKeyScales, kValueScales};
  for (int side = 0; side < 2; ++side) {
    const ResidualSplit split =
        residual_split(o, std::min<int64_t>(wanted[side], static_cast<int64_t>(g.pool_heads) * (P - free_anchors)));
    const int64_t candidates = static_cast<int64_t>(g.pool_heads) * P;  // per group
    auto *mask = reinterpret_cast<unsigned long long *>(section(mask_sec[side]));
    auto *prefix = reinterpret_cast<uint32_t *>(section(prefix_sec[side]));
    auto *offsets = reinterpret_cast<uint32_t *>(section(offsets_sec[side]));
    dev.stage(kStageResidualSelection);
    for (int group = 0; group < groups; ++group) {
      // The group's candidates are one contiguous run of keys and ids (id = h * P + t).
      const int64_t first = group * candidates;
      uint32_t *util_keys = s.util_keys[side] + first, *util_ids = s.util_ids[side] + first;
      uint32_t *energy_keys = s.energy_keys[side] + first, *energy_ids = s.energy_ids[side] + first;
      dev.sort_u32(util_keys, util_ids, candidates);
      if (split.by_utility > 0)
        dev.launch(mask_kernel, grid_blocks(split.by_utility, 128), 1, 128, static_cast<const uint32_t *>(util_ids),
                   split.by_utility, P, words, mask);
      if (split.by_energy > 0) {
        if (split.by_utility > 0)  // energy keys are indexed by id: the whole array
          dev.launch(exclude_chosen_kernel, grid_blocks(split.by_utility, 128), 1, 128,
                     static_cast<const uint32_t *>(util_ids), split.by_utility, s.energy_keys[side]);
        dev.sort_u32(energy_keys, energy_ids, candidates);
        dev.launch(mask_kernel, grid_blocks(split.by_energy, 128), 1, 128, static_cast<const uint32_t *>(energy_ids),
                   split.by_energy, P, words, mask);
      }
    }
    dev.launch(prefix_kernel, 1, 1, kPrefixThreads, reinterpret_cast<const uint64_t *>(mask), H, words, prefix, offsets);
    uint8_t *chunk = side == 1 ? section(kValueChunkPos) : nullptr;
    dev.stage(kStageEncoding);
    auto encode = [&](auto kernel) {
      dev.launch(kernel, static_cast<int>(words), H, 32, a, side, P, words, k, bf16 ? 1 : 0,
                 static_cast<int>(o.residual_scale), reinterpret_cast<const uint64_t *>(mask),
                 static_cast<const uint32_t *>(prefix), static_cast<const uint32_t *>(offsets),
                 static_cast<const uint16_t *>(anchors_out[side]), encode_index[side], encode_gamma[side],
                 static_cast<const float *>(s.signs),
                 section(codes_sec[side]), reinterpret_cast<float *>(section(scales_sec[side])), chunk);
    };
    if (words > 0) with_head_dim(D, [&](auto d) { encode(encode_kernel<decltype(d)::value>); });
  }
  dev.stage(kStageCount);  // the end of the last stage
  if (dev.profiling && local) dev.read(dev.search_counts, s.search_stats, sizeof dev.search_counts);
  if (dev.read_int(s.bad) != 0)
    fail(AKV_ERR_NON_FINITE, "the keys, values or queries contain NaN or Inf (CUDA compression)");
}

}  // namespace cuda
}  // namespace akv
