#include "cuda/plan.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include "core/dtype.hpp"
#include "core/error.hpp"
#include "core/method_traits.hpp"
#include "cuda/head_dim.hpp"

namespace akv {
namespace cuda {

void check_supported(akv_method method, int head_dim) {
  const MethodTraits &traits = method_traits(method);
  if (!traits.cuda_compress)
    fail(AKV_ERR_UNSUPPORTED, "the CUDA backend does not hold the ", traits.name, " baseline in this version "
         "(use a CPU context)");
  with_head_dim(head_dim, [](auto) {});
}

void check_decodable(const akv_cache &cache) {
  const CacheMeta &m = cache.meta;
  check_supported(m.method, m.shape.head_dim);
  if (cache.rope.enabled()) {
    // The kernels rotate the first 2*pairs dimensions and pass the rest through.
    for (int j = 0; j < cache.rope.pairs(); ++j)
      require(cache.rope.first[j] < 2 * cache.rope.pairs() && cache.rope.second[j] < 2 * cache.rope.pairs(),
              AKV_ERR_UNSUPPORTED, "rotary pairs outside the first rotary_dim dimensions are not supported on CUDA");
  }
  if (m.shape.seq_len > INT32_MAX / 2) fail(AKV_ERR_UNSUPPORTED, "seq_len ", m.shape.seq_len, " is too long for the CUDA kernels");
}

namespace {

template <typename T>
size_t put(std::vector<uint8_t> &bytes, const T *src, size_t count) {
  const size_t at = align16(bytes.size());
  bytes.resize(at + sizeof(T) * count);
  if (count) std::memcpy(bytes.data() + at, src, sizeof(T) * count);
  return at;
}

// Whether the split kernel rotates a cache's anchor rows as it gathers them (CacheView::
// rope_fused): NeoX pairs (j, j + pairs) with pairs % 4 == 0 and pairs / (D / 8) in {1, 2, 4},
// or no RoPE.
bool rope_fused(const akv_cache &cache) {
  const int D = cache.meta.shape.head_dim, pairs = cache.rope.enabled() ? cache.rope.pairs() : 0;
  bool neox = true;
  for (int j = 0; j < pairs; ++j) neox = neox && cache.rope.first[j] == j && cache.rope.second[j] == j + pairs;
  const int ratio = pairs / (D / 8);
  return neox && pairs % 4 == 0 && pairs % (D / 8) == 0 && (pairs == 0 || ratio == 1 || ratio == 2 || ratio == 4);
}

// GPT-J pairs (2j, 2j + 1) over every dimension: the register-gather path takes them too, in
// its own kernel (decode_split_kernel<D, MAXROWS, true, true>); the other paths' fused gather
// does not.
bool rope_interleaved(const akv_cache &cache) {
  const int D = cache.meta.shape.head_dim, pairs = cache.rope.enabled() ? cache.rope.pairs() : 0;
  bool gptj = pairs > 0 && 2 * pairs == D;
  for (int j = 0; j < pairs; ++j) gptj = gptj && cache.rope.first[j] == 2 * j && cache.rope.second[j] == 2 * j + 1;
  return gptj;
}

// Whether bf16 queries decode the cache on the register-gather path: a bf16 format-3 anchor
// cache with NeoX or GPT-J pairs over every dimension, or without RoPE (keys handed rotated:
// its view then carries D / 2 NeoX pairs of zero frequency, which that path rotates by
// nothing; build_view_block).
bool register_gather_cache(const akv_cache &c) {
  const int D = c.meta.shape.head_dim;
  const bool rope = c.rope.enabled() && (rope_fused(c) || rope_interleaved(c)) && 2 * c.rope.pairs() == D;
  return storage_of(c.meta.method) == Storage::kAnchor && c.geometry.format == 3 && c.geometry.anchors > 0 &&
         c.meta.storage == AKV_DTYPE_BF16 && (rope || !c.rope.enabled()) && D % 2 == 0;
}

}  // namespace

bool fast_decode_path(const akv_cache *const *caches, int32_t batch, akv_dtype dtype) {
  if (dtype != AKV_DTYPE_BF16) return false;
  for (int32_t b = 0; b < batch; ++b) {
    const akv_cache &c = *caches[b];
    if (rope_interleaved(c) != rope_interleaved(*caches[0])) return false;  // one kernel: one pairing
    if (!register_gather_cache(c)) return false;
  }
  return true;
}

bool fast_decode_gptj(const akv_cache *const *caches) { return rope_interleaved(*caches[0]); }

std::vector<uint8_t> build_view_block(const akv_cache &cache, const ViewAddresses &at) {
  const CacheMeta &m = cache.meta;
  const int H = m.shape.num_kv_heads, D = m.shape.head_dim;
  CacheView v;
  v.kind = storage_of(m.method) == Storage::kAnchor ? kKindAnchor : kKindDense;
  v.storage_bf16 = m.storage == AKV_DTYPE_BF16 ? 1 : 0;
  v.heads = H;
  v.head_dim = D;
  v.softmax_scale = m.softmax_scale;
  v.rope_pairs = cache.rope.enabled() ? cache.rope.pairs() : 0;
  v.keys_post_rope = m.keys_post_rope;
  v.suffix_capacity = static_cast<int32_t>(cache.suffix_capacity);
  v.suffix_len = static_cast<int32_t>(cache.suffix_len);
  v.next_position = static_cast<int32_t>(cache.next_position);
  v.suffix_keys = at.suffix_keys;
  v.suffix_values = at.suffix_values;
  if (v.kind == kKindAnchor) {
    const AnchorGeometry &g = cache.geometry;
    v.prefix = static_cast<int32_t>(g.prefix);
    v.anchors = g.anchors;
    v.window = g.window;
    v.words = static_cast<int32_t>(g.words);
    v.window_first_position = m.window_first_position;
    auto sec = [&](int s) { return at.data + cache.layout.sections[s].offset; };
    v.anchor_keys = reinterpret_cast<const uint16_t *>(sec(kAnchorKeys));
    v.anchor_values = reinterpret_cast<const uint16_t *>(sec(kAnchorValues));
    v.key_index = reinterpret_cast<const uint16_t *>(sec(kKeyIndex));
    v.value_index = reinterpret_cast<const uint16_t *>(sec(kValueIndex));
    v.key_gamma = reinterpret_cast<const uint16_t *>(sec(kKeyGamma));
    v.value_gamma = reinterpret_cast<const uint16_t *>(sec(kValueGamma));
    v.positions = reinterpret_cast<const int32_t *>(sec(kPositions));
    v.key_mask = reinterpret_cast<const uint64_t *>(sec(kKeyMask));
    v.value_mask = reinterpret_cast<const uint64_t *>(sec(kValueMask));
    v.key_prefix = reinterpret_cast<const uint32_t *>(sec(kKeyPrefix));
    v.value_prefix = reinterpret_cast<const uint32_t *>(sec(kValuePrefix));
    v.key_offsets = reinterpret_cast<const uint32_t *>(sec(kKeyOffsets));
    v.value_offsets = reinterpret_cast<const uint32_t *>(sec(kValueOffsets));
    v.key_codes = sec(kKeyCodes);
    v.value_codes = sec(kValueCodes);
    v.value_chunk = sec(kValueChunkPos);
    v.key_scales = reinterpret_cast<const float *>(sec(kKeyScales));
    v.value_scales = reinterpret_cast<const float *>(sec(kValueScales));
    v.key_slots = static_cast<uint32_t>(g.key_residuals);
    v.value_slots = static_cast<uint32_t>(g.value_residuals);
  } else {
    int64_t kept = 0;
    for (int64_t count : m.dense_counts) kept += count;
    v.dense_keys = reinterpret_cast<const uint16_t *>(at.data);
    v.dense_values = reinterpret_cast<const uint16_t *>(at.data) + kept * D;
  }

  v.rope_fused = rope_fused(cache);
  // The register-gather path rotates every NeoX pair (its kernel takes pairs = D / 2 from these
  // tables): a cache without RoPE that takes it gets D / 2 pairs (j, j + D / 2) of zero
  // frequency, cos 1 and sin 0, which rotate nothing exactly (bf16x2 and fp32 alike);
  // rope_pairs stays 0 for every other reader (the other paths, append).
  std::vector<float> inv_freq;
  std::vector<int32_t> first, second;
  if (v.rope_pairs) {
    inv_freq.assign(cache.rope.inv_freq.begin(), cache.rope.inv_freq.end());
    first.assign(cache.rope.first.begin(), cache.rope.first.end());
    second.assign(cache.rope.second.begin(), cache.rope.second.end());
  } else if (register_gather_cache(cache)) {
    inv_freq.assign(D / 2, 0.0f);
    first.resize(D / 2);
    second.resize(D / 2);
    for (int j = 0; j < D / 2; ++j) {
      first[j] = j;
      second[j] = D / 2 + j;
    }
  }
  const int pairs = static_cast<int>(inv_freq.size());
  // e^{i d omega_j} for the offsets d inside a tile, in double (|d omega| < kDecodeTile rad).
  std::vector<float> step(static_cast<size_t>(2) * kDecodeTile * pairs);
  for (int d = 0; d < kDecodeTile; ++d)
    for (int j = 0; j < pairs; ++j) {
      const double a = static_cast<double>(d) * static_cast<double>(inv_freq[j]);
      step[2 * (static_cast<size_t>(d) * pairs + j)] = static_cast<float>(std::cos(a));
      step[2 * (static_cast<size_t>(d) * pairs + j) + 1] = static_cast<float>(std::sin(a));
    }

  std::vector<uint8_t> bytes(sizeof(CacheView));
  const size_t inv = put(bytes, inv_freq.data(), pairs);
  const size_t st = put(bytes, step.data(), step.size());
  const size_t f = put(bytes, first.data(), pairs);
  const size_t s = put(bytes, second.data(), pairs);
  size_t signs = 0, starts = 0;
  if (v.kind == kKindAnchor) {
    signs = put(bytes, cache.codec.signs().data(), D);
  } else {
    std::vector<int64_t> start(H + 1, 0);
    for (int h = 0; h < H; ++h) start[h + 1] = start[h] + m.dense_counts[h];
    starts = put(bytes, start.data(), start.size());
  }
  // The appended tokens' positions, room for the whole reservation (append writes them).
  std::vector<int32_t> positions(static_cast<size_t>(cache.suffix_capacity), 0);
  std::copy(cache.suffix_positions.begin(), cache.suffix_positions.end(), positions.begin());
  const size_t sp = put(bytes, positions.data(), positions.size());
  v.suffix_positions = reinterpret_cast<int32_t *>(at.aux + sp);
  v.inv_freq = reinterpret_cast<const float *>(at.aux + inv);
  v.rope_step = reinterpret_cast<const float *>(at.aux + st);
  v.rope_first = reinterpret_cast<const int32_t *>(at.aux + f);
  v.rope_second = reinterpret_cast<const int32_t *>(at.aux + s);
  if (v.kind == kKindAnchor) v.signs = reinterpret_cast<const float *>(at.aux + signs);
  else v.dense_start = reinterpret_cast<const int64_t *>(at.aux + starts);
  if (v.kind == kKindAnchor && cache.geometry.format == 3) {
    require(at.host_anchor_tokens != nullptr, AKV_ERR_INTERNAL, "a format-3 view needs the anchor token list");
    const AnchorGeometry &g = cache.geometry;
    auto sec = [&](int i) { return at.data + cache.layout.sections[i].offset; };
    v.format = 3;
    v.segment_shift = g.segment_shift;
    v.table_size = g.table_size;
    v.segments = g.segments;
    v.first_position = m.window_first_position - g.prefix;
    v.key_entry = sec(kKeyIndex);
    v.value_entry = sec(kValueIndex);
    v.key_code = sec(kKeyGamma);
    v.value_code = sec(kValueGamma);
    v.segment_tables = g.table_size ? reinterpret_cast<const uint16_t *>(sec(kSegmentTables)) : nullptr;
    v.gamma_scales = reinterpret_cast<const float *>(sec(kGammaScales));
    v.key_index = v.value_index = v.key_gamma = v.value_gamma = nullptr;  // format 2's arrays
    v.positions = nullptr;
    // Per tile (residual mask word) and head: which of its tokens are anchors, and the
    // anchor index of the first (the list is increasing: deserializer-checked).
    const int64_t free_anchors = g.anchors - g.window;
    std::vector<uint64_t> mask(static_cast<size_t>(H * g.words), 0);
    std::vector<int32_t> first_anchor(static_cast<size_t>(H * g.words), 0);
    for (int h = 0; h < H; ++h) {
      const int64_t *tokens = at.host_anchor_tokens + h * free_anchors;
      int64_t a = 0;
      for (int64_t wd = 0; wd < g.words; ++wd) {
        first_anchor[h * g.words + wd] = static_cast<int32_t>(a);
        for (; a < free_anchors && tokens[a] < 64 * (wd + 1); ++a) mask[h * g.words + wd] |= uint64_t{1} << (tokens[a] & 63);
      }
    }
    const size_t units = put(bytes, gamma_units(), 256);
    const size_t am = put(bytes, mask.data(), mask.size()), af = put(bytes, first_anchor.data(), first_anchor.size());
    v.gamma_units = reinterpret_cast<const float *>(at.aux + units);
    v.anchor_mask = reinterpret_cast<const uint64_t *>(at.aux + am);
    v.anchor_first = reinterpret_cast<const int32_t *>(at.aux + af);
    if (!m.logit_penalty.empty()) {
      const size_t pen = put(bytes, m.logit_penalty.data(), m.logit_penalty.size());
      v.logit_penalty = reinterpret_cast<const float *>(at.aux + pen);
    }
  }
  std::memcpy(bytes.data(), &v, sizeof v);
  return bytes;
}

DecodePlan plan_decode(const akv_cache *const *caches, int32_t batch, int32_t q_len, int sm_count, size_t smem_limit,
                       const ResidentBlocks &resident) {
  const akv_shape &s0 = caches[0]->meta.shape;
  const int D = s0.head_dim, H = s0.num_kv_heads, G = s0.num_q_heads / s0.num_kv_heads;
  const int rows = G * q_len;
  DecodePlan plan;
  int64_t max_work = 1;  // prompt tokens of the longest head
  for (int32_t b = 0; b < batch; ++b) {
    const akv_cache &c = *caches[b];
    check_decodable(c);
    if (storage_of(c.meta.method) == Storage::kAnchor) {
      plan.max_anchors = std::max(plan.max_anchors, c.geometry.anchors);
      max_work = std::max(max_work, c.geometry.prefix);
      plan.scores = plan.scores || (!c.rope.enabled() && register_gather_cache(c));
    } else {
      for (int64_t n : c.meta.dense_counts) max_work = std::max(max_work, n);
    }
  }
  // A multiple of 4: a row of per-anchor weights in the workspace starts 16-byte aligned
  // (decode_anchor_values_kernel reads four anchors a load).
  plan.max_anchors = (plan.max_anchors + 3) / 4 * 4;
  // The smallest row chunk (at most 16 rows: more spill) that holds every row, shrunk while
  // its shared memory (queries, per-anchor weights, key tile, angle tables) does not fit.
  // fits(anchors): sets maxrows and smem_bytes to the largest chunk that fits with `anchors`
  // weights per row in shared memory; false when not even 4 rows fit.
  auto fits = [&](int smem_anchors) {
    for (plan.maxrows = rows <= 4 ? 4 : rows <= 8 ? 8 : 16; plan.maxrows >= 4; plan.maxrows /= 2) {
      plan.smem_bytes = SplitSmem(D, plan.maxrows, smem_anchors).total;
      if (plan.smem_bytes <= smem_limit) return true;
    }
    plan.maxrows = 4;
    return false;
  };
  const auto resident_of = [&] {
    return std::max(1, resident ? resident(plan.maxrows, plan.smem_bytes)
                                : static_cast<int>(std::min<size_t>(2048 / kDecodeThreads,
                                                                    (228 * 1024) / (plan.smem_bytes + 1024))));
  };
  // Every anchor's weight in shared memory where it fits; a segment table's entries at a time
  // (format 3 with tables: every cache with more than 256 anchors) where all k do not fit, or
  // where that fits more blocks on a multiprocessor with as many rows (at 128K: one block with
  // k weights, two with 256), or where neither does, the workspace: shared memory no longer
  // depends on the anchor count.
  static_assert(kSegmentEntries == kTableEntries, "a segment's weights are its table's entries");
  bool tabled = true;  // every cache whose weights would not fit 256 a row has segment tables
  for (int32_t b = 0; b < batch; ++b) {
    const akv_cache &c = *caches[b];
    if (storage_of(c.meta.method) == Storage::kAnchor && c.geometry.anchors > kSegmentEntries)
      tabled = tabled && c.geometry.format == 3 && c.geometry.table_size != 0;
  }
  const bool shared = fits(plan.max_anchors);
  const int shared_rows = plan.maxrows, shared_resident = shared ? resident_of() : 0;
  const size_t shared_bytes = plan.smem_bytes;
  const bool segments = plan.max_anchors > kSegmentEntries && fits(kSegmentEntries) &&
                        (!shared || (tabled && plan.maxrows >= shared_rows && resident_of() > shared_resident));
  if (segments) {
    plan.weights = DecodePlan::Weights::kSegments;
    plan.smem_anchors = kSegmentEntries;
  } else if (shared) {
    plan.weights = DecodePlan::Weights::kShared;
    plan.smem_anchors = plan.max_anchors;
    plan.maxrows = shared_rows;
    plan.smem_bytes = shared_bytes;
  } else {
    plan.weights = DecodePlan::Weights::kWorkspace;
    plan.smem_anchors = 0;
    if (!fits(0))
      fail(AKV_ERR_UNSUPPORTED, "decode needs ", plan.smem_bytes, " bytes of shared memory per block (head_dim ", D,
           "); the device allows ", smem_limit);
  }
  plan.row_chunks = (rows + plan.maxrows - 1) / plan.maxrows;
  // Splits over the prompt: as many as keep the grid within one wave of resident blocks
  // (rounding up would leave a second, mostly idle wave), no more than tiles (nor
  // kMaxSplits). Depends only on the batch shape and prompt lengths, so the grid of
  // a captured decode stays valid as tokens are appended.
  plan.resident = resident_of();
  const int64_t per_request = static_cast<int64_t>(H) * plan.row_chunks;
  const int32_t launch_batch = std::min(batch, kMaxBatchPerLaunch);
  const int64_t target = static_cast<int64_t>(plan.resident) * std::max(sm_count, 1);
  const int64_t tiles = (max_work + kDecodeTile - 1) / kDecodeTile;
  const int64_t most = std::min<int64_t>(std::max<int64_t>(tiles, 1), kMaxSplits);
  plan.splits = static_cast<int>(std::clamp<int64_t>(target / (per_request * launch_batch), 1, most));
  plan.blocks = per_request * launch_batch * plan.splits;
  // sum_a w_a V_a: parts of 256 anchors, or smaller (down to one chunk of 64) while the
  // parts of every (request, head, row chunk) would not give each multiprocessor one and a
  // half blocks: a block walks its part's chunks one after another, latency-bound (about
  // 4,900 cycles a chunk by scripts/sass_count.py's merge_walk), so that a short batch with few
  // parts (batch 1: 8 heads x 4 parts at 815 anchors) waited on a few long blocks; at 128K x 1
  // (3,258 anchors) parts of 192 (136 blocks, one a multiprocessor) take 12.0 us by the walk,
  // of 128 (208 blocks) 9.6, of 64 (408) 10.9.
  const int64_t merge_blocks = per_request * launch_batch;
  const auto parts_of = [&](int per_part) { return (plan.max_anchors + per_part - 1) / per_part; };
  plan.anchors_per_part = kMergeMaxAnchorsPerPart;
  while (plan.anchors_per_part > kMergeAnchorChunk &&
         2 * merge_blocks * parts_of(plan.anchors_per_part) < 3 * static_cast<int64_t>(std::max(sm_count, 1)))
    plan.anchors_per_part -= kMergeAnchorChunk;
  plan.anchor_parts = parts_of(plan.anchors_per_part);
  plan.workspace_bytes = (static_cast<size_t>(plan.blocks) * plan.maxrows * (2 * D + 2 + plan.max_anchors) +
                          static_cast<size_t>(merge_blocks) * plan.anchor_parts * plan.maxrows * D +
                          (plan.scores ? static_cast<size_t>(merge_blocks) * plan.max_anchors * plan.maxrows : 0)) *
                         sizeof(float);
  return plan;
}

DecodeLaunch decode_launch(const DecodePlan &plan, const akv_shape &shape, int32_t q_len, akv_dtype dtype,
                           const void *queries, void *out, float *workspace) {
  DecodeLaunch p{};
  p.queries = queries;
  p.out = out;
  p.dtype = dtype;
  p.heads = shape.num_kv_heads;
  p.q_heads = shape.num_q_heads;
  p.q_len = q_len;
  p.rows = shape.num_q_heads / shape.num_kv_heads * q_len;
  p.row_chunks = plan.row_chunks;
  p.splits = plan.splits;
  p.max_anchors = plan.max_anchors;
  p.smem_anchors = plan.smem_anchors;
  p.rescale_slack = kRescaleSlack;
  const size_t per_block = static_cast<size_t>(plan.maxrows) * shape.head_dim;
  p.ws_o = workspace;
  p.ws_r = workspace + plan.blocks * per_block;
  p.ws_ml = workspace + 2 * plan.blocks * per_block;
  p.ws_w = p.ws_ml + plan.blocks * plan.maxrows * 2;
  p.anchor_parts = plan.anchor_parts;
  p.anchors_per_part = plan.anchors_per_part;
  p.ws_av = p.ws_w + plan.blocks * plan.maxrows * plan.max_anchors;
  const int64_t merge_blocks = plan.blocks / plan.splits;  // (request, head, row chunk)s of a launch
  p.scores = plan.scores ? p.ws_av + merge_blocks * plan.anchor_parts * plan.maxrows * shape.head_dim : nullptr;
  return p;
}

}  // namespace cuda
}  // namespace akv
