// FullKV and the eviction baselines on the GPU (cuda/compress_pipeline.hpp describes the
// device policy).
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/context.hpp"
#include "core/error.hpp"
#include "cuda/compress_common.hpp"
#include "cuda/compress_kernels.cuh"
#include "methods/eviction.hpp"
#include "methods/methods.hpp"

namespace akv {
namespace cuda {

// FullKV on the device: every token stored exactly (keys post-RoPE) into `data` (device, the
// cache's 4*S*H*D bytes); scratch: FullScratch::bytes(S, pairs). The host parts of the cache
// (counts, positions) are set here. Waits at the end (non-finite check).
struct FullScratch {
  int32_t *positions, *rope_first, *rope_second, *bad, *block_table;
  float *inv_freq;
  size_t carve(uint8_t *base, int64_t S, int pairs, int64_t table_blocks = 0) {
    Carver take(base);
    take(positions, S);
    take(rope_first, pairs);
    take(rope_second, pairs);
    take(inv_freq, pairs);
    take(bad, 1);
    take(block_table, table_blocks);  // paged prefill: the block table on the device
    return take.bytes();
  }
};

template <class Dev>
void compress_fullkv(Dev &dev, const akv_prefill &p, const akv_compress_options &o, akv_cache &cache, uint8_t *data,
                     uint8_t *scratch_base) {
  const int64_t S = p.shape.seq_len;
  const int H = p.shape.num_kv_heads, D = p.shape.head_dim;
  const int pairs = cache.rope.enabled() ? cache.rope.pairs() : 0;
  FullScratch s;
  s.carve(scratch_base, S, pairs, paged_blocks(p));
  const std::vector<int32_t> positions = prompt_positions(p);
  cache.meta.dense_counts.assign(H, S);
  cache.dense_positions = positions;
  cache.next_position = static_cast<int64_t>(positions[S - 1]) + 1;
  cache.footprint = 4ull * static_cast<uint64_t>(S) * H * D;
  dev.copy(s.positions, positions.data(), S * sizeof(int32_t));
  upload_rope(dev, cache.rope, s.inv_freq, s.rope_first, s.rope_second);
  dev.fill(s.bad, 0, sizeof(int32_t));
  const PrefillArgs a = prefill_args(p, o, cache, s.positions, s.inv_freq, s.rope_first, s.rope_second, s.bad,
                                     upload_block_table(dev, p, s.block_table));
  uint16_t *keys = reinterpret_cast<uint16_t *>(data), *values = keys + static_cast<int64_t>(H) * S * D;
  for (int h = 0; h < H; ++h)
    dev.launch(dense_store_kernel, grid_blocks(S, 4), 1, 128, a, h, static_cast<const int32_t *>(nullptr), S,
               cache.meta.storage == AKV_DTYPE_BF16 ? 1 : 0, keys + static_cast<int64_t>(h) * S * D,
               values + static_cast<int64_t>(h) * S * D);
  if (dev.read_int(s.bad) != 0)
    fail(AKV_ERR_NON_FINITE, "the keys or values contain NaN or Inf (CUDA compression)");
}

// The eviction baselines on the device: the window attention of every head; SnapKV,
// PyramidKV, AdaKV: pooled scores and a per-head radix sort (AdaKV: also the layer-wide
// one); AnDPro: pooled rows, contributions and a layer-wide sort of chunk scores. The kept
// tokens are downloaded (the cache keeps them host-side) and their rows gathered into the
// ragged dense storage.
struct EvictionScratch {
  float *kpre, *kpost, *v, *q, *attn, *raw, *alpha_sq, *inv_freq, *pooled, *y, *vy, *contrib;
  uint32_t *keys, *index, *all_keys, *all_ids;
  int32_t *positions, *rope_first, *rope_second, *bad, *kept, *block_table;
  // andpro: room for AnDPro's pooled rows, window outputs and per-token contributions.
  size_t carve(uint8_t *base, int64_t S, int64_t P, int H, int D, int m, int pairs, int64_t kept_tokens, bool andpro,
               int64_t table_blocks = 0) {
    Carver take(base);
    take(kpre, S * D);
    take(kpost, S * D);
    take(v, S * D);
    take(q, int64_t{m} * D);
    take(attn, int64_t{m} * S);
    take(raw, P);
    take(alpha_sq, P);
    take(inv_freq, pairs);
    take(keys, int64_t{H} * P);
    take(index, int64_t{H} * P);
    take(all_keys, int64_t{H} * P);
    take(all_ids, int64_t{H} * P);
    take(positions, S);
    take(rope_first, pairs);
    take(rope_second, pairs);
    take(bad, 1);
    take(kept, kept_tokens);
    take(pooled, andpro ? int64_t{m} * P : 0);
    take(y, andpro ? int64_t{m} * D : 0);
    take(vy, andpro ? int64_t{m} * P : 0);
    take(contrib, andpro ? int64_t{H} * P : 0);
    take(block_table, table_blocks);  // paged prefill: the block table on the device
    return take.bytes();
  }
};

// `data`: device memory of budget.footprint bytes. Sets the cache's counts, kept tokens,
// positions and footprint. Waits for the work (downloads, non-finite check).
template <class Dev>
void compress_eviction(Dev &dev, const akv_prefill &p, const akv_compress_options &o, akv_cache &cache,
                       const EvictionBudget &b, uint8_t *data, uint8_t *scratch_base) {
  const int64_t S = b.seq_len, P = b.prefix;
  const int H = b.heads, W = b.window, D = p.shape.head_dim;
  const int m = p.shape.num_q_heads / H * W;
  const int pairs = cache.rope.enabled() ? cache.rope.pairs() : 0;
  const EvictionScore score_kind = eviction_score(o.method);
  const bool attention = eviction_reads_queries(o.method);
  require(!attention || p.queries != nullptr, AKV_ERR_INVALID_ARGUMENT,
          "queries is NULL (this eviction method scores tokens with the window queries)");
  const bool andpro = o.method == AKV_METHOD_ANDPRO;
  const int chunk = andpro ? o.andpro_chunk : 1;
  const int64_t chunks = andpro ? (P + chunk - 1) / chunk : 0, c0 = b.first_chunk;
  EvictionScratch s;
  s.carve(scratch_base, S, P, H, D, m, pairs, b.layer_tokens, andpro, paged_blocks(p));
  const std::vector<int32_t> positions = prompt_positions(p);
  dev.copy(s.positions, positions.data(), S * sizeof(int32_t));
  upload_rope(dev, cache.rope, s.inv_freq, s.rope_first, s.rope_second);
  dev.fill(s.bad, 0, sizeof(int32_t));
  const PrefillArgs a = prefill_args(p, o, cache, s.positions, s.inv_freq, s.rope_first, s.rope_second, s.bad,
                                     upload_block_table(dev, p, s.block_table));
  const bool adakv = o.method == AKV_METHOD_ADAKV;
  const bool tova = score_kind == EvictionScore::kLastQuery;  // one score for the layer (alpha_sq: its sum)
  if (tova) dev.fill(s.alpha_sq, 0, sizeof(float) * P);
  for (int h = 0; h < H; ++h) {
    dev.launch(load_head_kernel, grid_blocks(S, 4), 1, 128, a, h, s.kpre, s.kpost, s.v, PrefixRows{},
               static_cast<uint16_t *>(nullptr));
    if (attention) {
      dev.launch(load_queries_kernel, m, 1, 32, a, h, s.q, static_cast<uint16_t *>(nullptr));
      dev.gemm_nt(m, S, D, cache.meta.softmax_scale, s.q, D, s.kpost, D, s.attn, S);
      dev.launch(window_softmax_kernel, m, 1, 128, s.attn, S, P, W);
    }
    if (andpro) {  // pooled rows, y over the evictable chunks, contributions, chunk scores
      dev.launch(pool_rows_kernel, grid_blocks(P, 128), m, 128, static_cast<const float *>(s.attn), S, P, o.pool_kernel,
                 o.pool_type == AKV_POOL_MAX ? 1 : 0, s.pooled);
      if (P > c0)
        dev.gemm_nn(m, D, P - c0, 1.0f, s.pooled + c0, P, s.v + c0 * D, D, s.y, D);
      else
        dev.fill(s.y, 0, sizeof(float) * m * D);
      dev.gemm_nt(m, P, D, 1.0f, s.y, D, s.v, D, s.vy, P);
      dev.launch(andpro_contrib_kernel, grid_blocks(P, 128), 1, 128, static_cast<const float *>(s.pooled),
                 static_cast<const float *>(s.vy), P, m, s.contrib + h * P);
      dev.launch(andpro_chunks_kernel, grid_blocks(chunks, 128), 1, 128, static_cast<const float *>(s.contrib + h * P), P,
                 chunk, chunks, h, s.all_keys, s.all_ids);
      continue;
    }
    if (tova) {  // summed over the heads; ranked once after the loop
      dev.launch(last_row_scores_kernel, grid_blocks(P, 128), 1, 128, static_cast<const float *>(s.attn), S, P, m / W, W,
                 H * (m / W), s.alpha_sq);
      continue;
    }
    if (!attention)  // Knorm, StreamingLLM
      dev.launch(key_scores_kernel, grid_blocks(P, 128), 1, 128, static_cast<const float *>(s.kpost), P, D,
                 score_kind == EvictionScore::kRecency ? 1 : 0, static_cast<int64_t>(b.first_chunk), s.raw);
    else
      dev.launch(scores_kernel, grid_blocks(P, 128), 1, 128, static_cast<const float *>(s.attn), S, P, m, s.raw,
                 s.alpha_sq);
    uint32_t *keys = s.keys + h * P, *index = s.index + h * P;
    // TOVA, Knorm and StreamingLLM do not pool (kernel 1).
    const int pool = score_kind == EvictionScore::kPooledWindow ? o.pool_kernel : 1;
    dev.launch(pool_kernel, grid_blocks(P, 128), 1, 128, static_cast<const float *>(s.raw), P, pool,
               o.pool_type == AKV_POOL_MAX ? 1 : 0, 0, int64_t{0}, keys, index);
    if (adakv) {
      dev.copy(s.all_keys + h * P, keys, P * sizeof(uint32_t));
      dev.launch(iota_kernel, grid_blocks(P, 128), 1, 128, s.all_ids + h * P, static_cast<uint32_t>(h * P), P);
    }
    dev.sort_u32(keys, index, P);  // best first, ties to the lower index
  }
  if (tova) {  // the layer's ranking, kept by every head
    dev.launch(pool_kernel, grid_blocks(P, 128), 1, 128, static_cast<const float *>(s.alpha_sq), P, 1, 0, 0, int64_t{0},
               s.keys, s.index);
    dev.sort_u32(s.keys, s.index, P);
  }
  // Evictable tokens kept per head.
  std::vector<int64_t> counts(H, b.head_tokens - W);
  if (adakv) {
    const int64_t base = b.per_head - W;
    const int64_t n = std::min<int64_t>(static_cast<int64_t>(H) * base, static_cast<int64_t>(H) * P);
    dev.sort_u32(s.all_keys, s.all_ids, static_cast<int64_t>(H) * P);  // ties: head, then token
    std::vector<uint32_t> best(n);
    dev.read(best.data(), s.all_ids, n * sizeof(uint32_t));
    std::vector<int64_t> selected(H, 0);
    for (uint32_t id : best) ++selected[id / P];
    counts = adakv_counts(selected, base, o.adakv_alpha);
    cap_counts(counts, P);
  }
  std::vector<std::vector<int32_t>> kept(H);
  if (andpro) {
    // Chunks of all heads, best first (ties: head, then chunk), until the layer's tokens are
    // spent; the chunk that does not fit whole gives its best tokens. Then the first chunk.
    dev.sort_u32(s.all_keys, s.all_ids, static_cast<int64_t>(H) * chunks);
    std::vector<uint32_t> order(static_cast<size_t>(H) * chunks);
    dev.read(order.data(), s.all_ids, order.size() * sizeof(uint32_t));
    andpro_fill(order, b, chunk, chunks, nullptr,
                [&](int h, int64_t t0, int64_t t1, int64_t n) {
                  std::vector<float> contrib(t1 - t0);
                  dev.read(contrib.data(), s.contrib + h * P + t0, contrib.size() * sizeof(float));
                  std::vector<int32_t> idx(contrib.size());
                  for (size_t u = 0; u < idx.size(); ++u) idx[u] = static_cast<int32_t>(u);
                  std::stable_sort(idx.begin(), idx.end(), [&](int32_t x, int32_t y) { return contrib[x] > contrib[y]; });
                  idx.resize(n);
                  for (int32_t &u : idx) u += static_cast<int32_t>(t0);
                  return idx;
                },
                kept);
  } else {
    for (int h = 0; h < H; ++h) {
      std::vector<uint32_t> top(std::min<int64_t>(counts[h], P));
      dev.read(top.data(), s.index + (tova ? 0 : h * P), top.size() * sizeof(uint32_t));  // TOVA: one ranking
      kept[h].assign(top.begin(), top.end());
    }
  }
  const std::vector<int64_t> first = adopt_kept_tokens(kept, b, positions, cache);
  const int64_t total = first[H];
  cache.footprint = 4ull * static_cast<uint64_t>(total) * D;
  dev.copy(s.kept, cache.dense_tokens.data(), total * sizeof(int32_t));
  uint16_t *keys = reinterpret_cast<uint16_t *>(data), *values = keys + total * D;
  for (int h = 0; h < H; ++h)
    dev.launch(dense_store_kernel, grid_blocks(first[h + 1] - first[h], 4), 1, 128, a, h,
               static_cast<const int32_t *>(s.kept + first[h]), first[h + 1] - first[h],
               cache.meta.storage == AKV_DTYPE_BF16 ? 1 : 0, keys + first[h] * D, values + first[h] * D);
  if (dev.read_int(s.bad) != 0)
    fail(AKV_ERR_NON_FINITE, "the keys, values or queries contain NaN or Inf (CUDA compression)");
}

}  // namespace cuda
}  // namespace akv
