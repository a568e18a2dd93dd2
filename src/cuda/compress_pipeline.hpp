// The AnchorKV compression pass on the GPU, step by step (docs/design.md §2.2; the CPU reference is
// cpu/compress_anchorkv.cpp), written once over a small device policy so that the same
// orchestration runs on a CUDA device (cuda/compress.cu: launches on a stream, cuBLAS GEMMs,
// CUB radix sorts) and on the CPU through the SIMT emulation (tests/emu: the kernels run as
// fibers, sorts are std::stable_sort, GEMMs the plain kernel).
//
// The policy provides:
//   launch(kernel, gx, gy, block, args...)          a kernel over a (gx, gy) grid
//   gemm_nt(M, N, K, alpha, A, lda, B, ldb, C, ldc)  C = alpha A B^T  (row-major)
//   gemm_nn(M, N, K, alpha, A, lda, B, ldb, C, ldc)  C = alpha A B
//   gemm_nt_batched(M, N, K, alpha, A, lda, sa, B, ldb, sb, C, ldc, sc, batch)
//   gemm_nn_batched(...)                             the same for `batch` problems, operand i at
//                                                    A + i sa, B + i sb, C + i sc (strided batch)
//   sort_u32(keys, values, n), sort_u64(keys, values, n)  stable ascending, in place
//   sort_segments_u32(keys, values, segments, n)     each of `segments` runs of n, stable, in place
//   copy(dst, src, bytes), fill(dst, byte, bytes)    ordered with the kernels
//   read(host_dst, src, bytes)                        waits for the work so far, then copies
//   int read_int(const int32_t *)                    the same for one int
//   stage(CompressStage)                             the work from here on belongs to this stage
//                                                    (timed on a device when profiling; else a no-op)
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "core/context.hpp"
#include "core/error.hpp"
#include "core/rng.hpp"
#include "cuda/compress_kernels.cuh"
#include "cuda/head_dim.hpp"
#include "methods/eviction.hpp"
#include "methods/methods.hpp"

namespace akv {
namespace cuda {

// The stages of the AnchorKV pass as the profile reports them (issue 15).
enum CompressStage : int {
  kStageSetup = 0,
  kStageLoad,
  kStageWindowAttention,
  kStageScores,
  kStageAnchorSelection,
  kStageAssignment,
  kStageUtilities,
  kStageResidualSelection,
  kStageEncoding,
  kStageCount
};
inline const char *stage_name(int stage) {
  static const char *const names[kStageCount] = {"setup",         "load",       "window attention",
                                                 "scores+pooling", "anchor selection", "assignment",
                                                 "utilities",     "residual selection", "encoding"};
  return stage >= 0 && stage < kStageCount ? names[stage] : "?";
}

// Lays arrays out one after another (256-byte aligned) from `base`; with a null base it only
// measures.
class Carver {
 public:
  explicit Carver(uint8_t *base) : base_(base) {}
  template <typename T>
  void operator()(T *&ptr, int64_t count) {
    at_ = (at_ + 255) / 256 * 256;
    ptr = base_ ? reinterpret_cast<T *>(base_ + at_) : nullptr;
    at_ += sizeof(T) * static_cast<size_t>(std::max<int64_t>(count, 1));
  }
  size_t bytes() const { return at_; }

 private:
  uint8_t *base_;
  size_t at_ = 0;
};

// Scratch of one compression, carved out of one allocation. The arrays of the stages batched
// over heads (loading, window attention, scores, anchor ranking, residual rows, utilities)
// hold every head (of a batch), head h's part at h times the per-head size.
struct CompressScratch {
  uint16_t *anchor_b;  // anchor_n in bf16 (the tensor-core operand of nearest_anchor_kernel)
  float *kpre, *kpost, *v, *q, *attn, *y, *raw, *alpha_sq, *anchor_f, *anchor_n, *norms, *rk, *rk_norm_sq, *rv_norm_sq, *z,
      *vy, *y_norm_sq, *inv_freq, *signs;
  uint32_t *rank_keys, *rank_index, *sample_index, *picks, *picks_dummy, *util_keys[2], *util_ids[2], *energy_keys[2],
      *energy_ids[2];
  uint64_t *sample_keys;
  int32_t *anchor_of_token, *nearest, *positions, *rope_first, *rope_second, *bad;
  // Coverage anchors: squared norms and best |cos|^2 per side, ranking, flags, the rows
  // absorbed next (the unit prefix rows reuse rk and kpost, free at that point).
  float *cover_norm_sq[2], *cover_best[2], *cover_means;
  uint32_t *cover_keys, *cover_ids, *cover_fresh;
  int32_t *cover_anchor;
  int32_t *block_table;

  // Lays the arrays out from `base` (nullptr: only measures); returns the bytes used. The
  // per-head staging holds `head_batch` heads (0: all H); the residual selection's keys, all H.
  size_t carve(uint8_t *base, int64_t S, int64_t P, int H_all, int D, int m, int k, int pairs, int64_t table_blocks = 0,
               int head_batch = 0) {
    const int H = head_batch > 0 ? std::min(head_batch, H_all) : H_all;
    Carver take(base);
    take(kpre, H * S * D);
    take(kpost, H * S * D);
    take(v, H * S * D);
    take(q, int64_t{H} * m * D);
    take(attn, int64_t{H} * m * S);
    take(y, int64_t{H} * m * D);
    take(raw, H * P);
    take(alpha_sq, H * P);
    take(anchor_f, int64_t{H} * k * D);
    take(anchor_n, int64_t{H} * k * D);
    take(anchor_b, int64_t{H} * k * D);
    take(norms, int64_t{H} * k);
    take(rk, H * P * D);
    take(rk_norm_sq, H * P);
    take(rv_norm_sq, H * P);
    take(z, int64_t{H} * m * P);
    take(vy, int64_t{H} * m * P);
    take(y_norm_sq, int64_t{H} * m);
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
    take(cover_means, 2 * H);
    take(cover_keys, H * P);
    take(cover_ids, H * P);
    take(cover_fresh, int64_t{H} * k);
    take(cover_anchor, H * P);
    take(block_table, table_blocks);  // paged prefill: the block table on the device
    return take.bytes();
  }
};

// The CUDA pass's scratch budget for choosing the heads per batch (2 GiB: H = 8, Hq = 32,
// D = 128 batches all 8 heads up to 64K, fewer at 128K).
constexpr size_t kHeadBatchBudget = size_t{2} << 30;

// Heads per batch of the AnchorKV pass: all of them when the scratch fits in budget_bytes,
// else the most that do (at least 1). The stages before the residual selection run once per
// batch (each kernel over the batch's heads), so fewer heads per batch means more launches.
inline int anchor_head_batch(const AnchorGeometry &g, int pairs, int64_t table_blocks, size_t budget_bytes) {
  CompressScratch measure;
  for (int hb = g.heads; hb > 1; --hb)
    if (measure.carve(nullptr, g.seq_len, g.prefix, g.heads, g.dim, g.group() * g.window, g.anchors, pairs, table_blocks,
                      hb) <= budget_bytes)
      return hb;
  return 1;
}

// Blocks of `per` items covering n.
inline int grid_blocks(int64_t n, int per) { return static_cast<int>((n + per - 1) / per); }

// Entries of a paged prefill's block table (0 when not paged).
inline int64_t paged_blocks(const akv_prefill &p) {
  return p.block_table ? (p.shape.seq_len + p.block_size - 1) / p.block_size : 0;
}

// Copies a paged prefill's host block table to `device_table` (scratch of paged_blocks(p)
// entries); returns it, or null when the prefill is not paged.
template <class Dev>
const int32_t *upload_block_table(Dev &dev, const akv_prefill &p, int32_t *device_table) {
  if (!p.block_table) return nullptr;
  dev.copy(device_table, p.block_table, paged_blocks(p) * sizeof(int32_t));
  return device_table;
}

// The kernels' view of the prefill tensors (device pointers) and of the device constants.
inline PrefillArgs prefill_args(const akv_prefill &p, const akv_compress_options &o, const akv_cache &cache,
                                const int32_t *positions, const float *inv_freq, const int32_t *rope_first,
                                const int32_t *rope_second, int32_t *bad, const int32_t *block_table) {
  const int64_t S = p.shape.seq_len;
  const int D = p.shape.head_dim, W = o.window;
  const int pairs = cache.rope.enabled() ? cache.rope.pairs() : 0;
  PrefillArgs a;
  a.keys = p.keys;
  a.values = p.values;
  a.queries = p.queries;
  a.dtype = p.dtype;
  if (p.block_table) {  // vLLM's [block][token][head][dim] unless strides say otherwise
    a.block_table = block_table;
    a.block_size = p.block_size;
    a.kv_head_stride = p.kv_head_stride ? p.kv_head_stride : D;
    a.kv_token_stride = p.kv_token_stride ? p.kv_token_stride : int64_t{p.shape.num_kv_heads} * D;
    a.kv_block_stride = p.kv_block_stride ? p.kv_block_stride : a.block_size * a.kv_token_stride;
  } else {
    a.kv_token_stride = p.kv_token_stride ? p.kv_token_stride : D;
    a.kv_head_stride = p.kv_head_stride ? p.kv_head_stride : S * D;
  }
  a.q_token_stride = p.q_token_stride ? p.q_token_stride : D;
  a.q_head_stride = p.q_head_stride ? p.q_head_stride : static_cast<int64_t>(W) * D;
  a.seq_len = S;
  a.heads = p.shape.num_kv_heads;
  a.q_heads = p.shape.num_q_heads;
  a.head_dim = D;
  a.window = W;
  a.keys_post_rope = o.keys_post_rope ? 1 : 0;
  a.rope_pairs = pairs;
  a.positions = positions;
  a.inv_freq = inv_freq;
  a.rope_first = rope_first;
  a.rope_second = rope_second;
  a.bad = bad;
  return a;
}

// Copies the RoPE tables into device memory (the scratch arrays of the given pointers).
template <class Dev>
void upload_rope(Dev &dev, const Rope &rope, float *inv_freq, int32_t *first, int32_t *second) {
  if (!rope.enabled()) return;
  const int pairs = rope.pairs();
  const std::vector<int32_t> f(rope.first.begin(), rope.first.end()), s(rope.second.begin(), rope.second.end());
  dev.copy(inv_freq, rope.inv_freq.data(), pairs * sizeof(float));
  dev.copy(first, f.data(), pairs * sizeof(int32_t));
  dev.copy(second, s.data(), pairs * sizeof(int32_t));
}

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
  require(p.queries != nullptr, AKV_ERR_INVALID_ARGUMENT,
          "queries is NULL (the eviction methods score tokens with the window queries)");
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
  for (int h = 0; h < H; ++h) {
    dev.launch(load_head_kernel, grid_blocks(S, 4), 1, 128, a, h, s.kpre, s.kpost, s.v);
    dev.launch(load_queries_kernel, m, 1, 32, a, h, s.q);
    dev.gemm_nt(m, S, D, cache.meta.softmax_scale, s.q, D, s.kpost, D, s.attn, S);
    dev.launch(window_softmax_kernel, m, 1, 128, s.attn, S, P, W);
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
    dev.launch(scores_kernel, grid_blocks(P, 128), 1, 128, static_cast<const float *>(s.attn), S, P, m, s.raw, s.alpha_sq);
    uint32_t *keys = s.keys + h * P, *index = s.index + h * P;
    dev.launch(pool_kernel, grid_blocks(P, 128), 1, 128, static_cast<const float *>(s.raw), P, o.pool_kernel,
               o.pool_type == AKV_POOL_MAX ? 1 : 0, int64_t{0}, keys, index);
    if (adakv) {
      dev.copy(s.all_keys + h * P, keys, P * sizeof(uint32_t));
      dev.launch(iota_kernel, grid_blocks(P, 128), 1, 128, s.all_ids + h * P, static_cast<uint32_t>(h * P), P);
    }
    dev.sort_u32(keys, index, P);  // best first, ties to the lower index
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
    const int64_t first_evictable = (c0 + chunk - 1) / chunk;
    int64_t left = static_cast<int64_t>(H) * (b.per_head - W - c0);
    for (uint32_t id : order) {
      if (left == 0) break;
      const int h = static_cast<int>(id / chunks);
      const int64_t j = id % chunks;
      if (j < first_evictable) continue;
      const int64_t t0 = j * chunk, t1 = std::min<int64_t>(t0 + chunk, P);
      if (t1 - t0 <= left) {
        for (int64_t t = t0; t < t1; ++t) kept[h].push_back(static_cast<int32_t>(t));
        left -= t1 - t0;
      } else {
        std::vector<float> contrib(t1 - t0);
        dev.read(contrib.data(), s.contrib + h * P + t0, contrib.size() * sizeof(float));
        std::vector<int32_t> idx(contrib.size());
        for (size_t u = 0; u < idx.size(); ++u) idx[u] = static_cast<int32_t>(u);
        std::stable_sort(idx.begin(), idx.end(), [&](int32_t x, int32_t y) { return contrib[x] > contrib[y]; });
        for (int64_t u = 0; u < left; ++u) kept[h].push_back(static_cast<int32_t>(t0 + idx[u]));
        left = 0;
      }
    }
    for (int h = 0; h < H; ++h)
      for (int64_t t = 0; t < c0; ++t) kept[h].push_back(static_cast<int32_t>(t));
  } else {
    for (int h = 0; h < H; ++h) {
      std::vector<uint32_t> top(std::min<int64_t>(counts[h], P));
      dev.read(top.data(), s.index + h * P, top.size() * sizeof(uint32_t));
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

// The coverage share of every head's anchors (CPU: add_coverage_anchors), batched over the H
// heads: head h's n_top scored picks are at s.picks + h free_anchors and flagged in
// s.cover_anchor (zeroed before); appends `count` more, chosen in `rounds` rounds as the tokens
// the anchors so far (and the window) represent worst. Uses s.rk and s.kpost (free before the
// assignment) for the unit prefix rows of keys and values, and s.anchor_n for the rows being
// absorbed.
template <class Dev>
void coverage_anchors(Dev &dev, const CompressScratch &s, int H, int64_t S, int64_t P, int D, int W, int k,
                      int64_t free_anchors, int64_t n_top, int64_t count, int rounds) {
  const float *X[2] = {s.kpre, s.v};
  float *unit[2] = {s.rk, s.kpost};
  const int64_t unit_stride[2] = {P * D, S * D};
  for (int side = 0; side < 2; ++side) {
    dev.launch(unit_rows_kernel, grid_blocks(P, 4), H, 128, X[side], S * D, static_cast<const uint32_t *>(nullptr),
               int64_t{0}, P, D, unit[side], static_cast<uint16_t *>(nullptr), unit_stride[side],
               s.cover_norm_sq[side], P);
    dev.fill(s.cover_best[side], 0, H * P * sizeof(float));
  }
  // Raise every prefix token's best |cos|^2 with the n anchor tokens ids[0..n) of each head
  // (head h's at ids + h ids_stride).
  auto absorb = [&](const uint32_t *ids, int64_t ids_stride, int64_t n) {
    if (n == 0) return;
    for (int side = 0; side < 2; ++side) {
      dev.launch(unit_rows_kernel, grid_blocks(n, 4), H, 128, X[side], S * D, ids, ids_stride, n, D, s.anchor_n,
                 s.anchor_b, int64_t{k} * D, static_cast<float *>(nullptr), int64_t{0});
      // best |cos|^2 with the new anchors (fused: tensor-core products, fp32 rescoring).
      nearest_anchors(dev, D, unit[side], P, static_cast<int>(n), s.anchor_n, s.anchor_b, nullptr, nullptr,
                      s.cover_best[side], H, unit_stride[side], P, k);
    }
  };
  // The scored picks and the window tokens first.
  dev.launch(coverage_take_kernel, grid_blocks(n_top + W, 128), H, 128, static_cast<const uint32_t *>(s.picks),
             free_anchors, n_top, s.cover_anchor, P, s.cover_fresh, int64_t{k}, int64_t{W});
  absorb(s.cover_fresh, k, n_top + W);
  int64_t left = count, at = n_top;
  for (int round = 0; round < rounds && left > 0; ++round) {
    const int64_t take = std::min<int64_t>((left + (rounds - round) - 1) / (rounds - round), P - at);
    if (take <= 0) break;
    dev.launch(coverage_means_kernel, 2, H, 128, static_cast<const float *>(s.cover_norm_sq[0]),
               static_cast<const float *>(s.cover_best[0]), static_cast<const float *>(s.cover_norm_sq[1]),
               static_cast<const float *>(s.cover_best[1]), P, s.cover_means);
    dev.launch(coverage_keys_kernel, grid_blocks(P, 128), H, 128, static_cast<const float *>(s.cover_norm_sq[0]),
               static_cast<const float *>(s.cover_best[0]), static_cast<const float *>(s.cover_norm_sq[1]),
               static_cast<const float *>(s.cover_best[1]), static_cast<const float *>(s.cover_means),
               static_cast<const int32_t *>(s.cover_anchor), P, s.cover_keys, s.cover_ids);
    dev.sort_segments_u32(s.cover_keys, s.cover_ids, H, P);  // ties: the lower token
    dev.launch(coverage_take_kernel, grid_blocks(take, 128), H, 128, static_cast<const uint32_t *>(s.cover_ids), P,
               take, s.cover_anchor, P, s.picks + at, free_anchors, int64_t{0});
    absorb(s.cover_ids, P, take);
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
  CompressScratch s;
  s.carve(scratch_base, S, P, H, D, m, k, pairs, paged_blocks(p), HB);
  auto section = [&](int index) { return data + cache.layout.sections[index].offset; };

  // Constants: positions, RoPE tables, Hadamard signs; the cache starts zeroed.
  dev.stage(kStageSetup);
  dev.fill(data, 0, cache.layout.total_bytes);
  dev.copy(s.positions, positions.data(), S * sizeof(int32_t));
  dev.copy(section(kPositions), positions.data(), P * sizeof(int32_t));
  upload_rope(dev, rope, s.inv_freq, s.rope_first, s.rope_second);
  dev.copy(s.signs, cache.codec.signs().data(), D * sizeof(float));
  dev.fill(s.bad, 0, sizeof(int32_t));

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

  // 1-6 per batch of HB heads (all of them unless the scratch budget splits them): H below is
  // the batch's head count, h0 its first head.
  for (int h0 = 0; h0 < g.heads; h0 += HB) {
    const int H = std::min(HB, g.heads - h0);
    // 1. Every head's keys (both forms), values and its group's window queries.
    dev.stage(kStageLoad);
    dev.launch(load_head_kernel, grid_blocks(S, 4), H, 128, a, h0, s.kpre, s.kpost, s.v);
    dev.launch(load_queries_kernel, m, H, 32, a, h0, s.q);
    // 2. Window attention with the causal window mask, and its outputs y (batched over heads;
    // the softmax rows of all heads are one [H m][S] array, m a multiple of W).
    dev.stage(kStageWindowAttention);
    dev.gemm_nt_batched(m, S, D, cache.meta.softmax_scale, s.q, D, int64_t{m} * D, s.kpost, D, S * D, s.attn, S,
                        int64_t{m} * S, H);
    dev.launch(window_softmax_kernel, H * m, 1, 128, s.attn, S, P, W);
    dev.gemm_nn_batched(m, D, S, 1.0f, s.attn, S, int64_t{m} * S, s.v, D, S * D, s.y, D, int64_t{m} * D, H);
    // 3. Scores, pooled; 4. anchors: the top share by pooled score (ties: lower index), then
    // the smallest counter hashes among the rest, sorted by token.
    dev.stage(kStageScores);
    dev.launch(scores_kernel, grid_blocks(P, 128), H, 128, static_cast<const float *>(s.attn), S, P, m, s.raw,
               s.alpha_sq);
    dev.launch(pool_kernel, grid_blocks(P, 128), H, 128, static_cast<const float *>(s.raw), P, o.pool_kernel,
               o.pool_type == AKV_POOL_MAX ? 1 : 0, n_sink, s.rank_keys, s.rank_index);
    dev.stage(kStageAnchorSelection);
    dev.sort_segments_u32(s.rank_keys, s.rank_index, H, P);

    if (o.coverage_rounds > 0) {
      // Every head's scored picks (flagged as anchors), then the coverage share.
      dev.fill(s.cover_anchor, 0, H * P * sizeof(int32_t));
      if (n_top > 0)
        dev.launch(coverage_take_kernel, grid_blocks(n_top, 128), H, 128, static_cast<const uint32_t *>(s.rank_index), P,
                   n_top, s.cover_anchor, P, s.picks, free_anchors, int64_t{0});
      if (n_rand > 0) coverage_anchors(dev, s, H, S, P, D, W, k, free_anchors, n_top, n_rand, o.coverage_rounds);
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
    // 6. Utilities (Eq. 6) of every head: Z = Q (R r_K)^T, V.y, ||y||^2 (batched over heads).
    dev.stage(kStageUtilities);
    dev.gemm_nt_batched(m, P, D, 1.0f, s.q, D, int64_t{m} * D, s.rk, D, P * D, s.z, P, int64_t{m} * P, H);
    dev.gemm_nt_batched(m, P, D, 1.0f, s.y, D, int64_t{m} * D, s.v, D, S * D, s.vy, P, int64_t{m} * P, H);
    dev.launch(row_norms_kernel, grid_blocks(int64_t{H} * m, 128), 1, 128, static_cast<const float *>(s.y), H * m, D,
               s.y_norm_sq);
    dev.launch(utility_kernel, grid_blocks(P, 128), H, 128, static_cast<const float *>(s.attn), S, P, m, D,
               static_cast<const float *>(s.z), static_cast<const float *>(s.vy), static_cast<const float *>(s.y_norm_sq),
               static_cast<const float *>(s.v), static_cast<const float *>(s.alpha_sq),
               static_cast<const float *>(s.rk_norm_sq), static_cast<const float *>(s.rv_norm_sq),
               static_cast<const int32_t *>(s.anchor_of_token), h0, s.util_keys[0], s.util_keys[1], s.util_ids[0],
               s.util_ids[1], s.energy_keys[0], s.energy_keys[1], s.energy_ids[0], s.energy_ids[1]);
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
                 static_cast<const uint16_t *>(anchors_out[side]), static_cast<const uint16_t *>(index[side]),
                 static_cast<const uint16_t *>(gamma[side]), static_cast<const float *>(s.signs),
                 section(codes_sec[side]), reinterpret_cast<float *>(section(scales_sec[side])), chunk);
    };
    if (words > 0) with_head_dim(D, [&](auto d) { encode(encode_kernel<decltype(d)::value>); });
  }
  dev.stage(kStageCount);  // the end of the last stage
  if (dev.read_int(s.bad) != 0)
    fail(AKV_ERR_NON_FINITE, "the keys, values or queries contain NaN or Inf (CUDA compression)");
}

}  // namespace cuda
}  // namespace akv
