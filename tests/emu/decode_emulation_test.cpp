// The CUDA decode and append kernels, run on the CPU through the SIMT emulation
// (src/cuda/simt_emulation.hpp), against the CPU reference decode of the same cache. This is
// how the kernels' indexing, synchronisation and arithmetic are tested on machines without
// a GPU; tests/gpu runs the same comparisons on a device. Shapes stay small: every emulated
// CUDA thread is an OS thread.
#include <map>
#include <set>

#include "api/api_test_util.hpp"
#include "core/context.hpp"
#include "core/method_traits.hpp"
#include "cuda/head_dim.hpp"
#include "cuda/plan.hpp"
// Last: the emulation defines threadIdx, __shared__ and friends as macros.
#include "cuda/decode_kernels.cuh"

namespace {

using namespace akv_test;
namespace kc = akv::cuda;
using Weights = kc::DecodePlan::Weights;

// A cache's view in host memory, as the CUDA backend builds it in device memory.
struct HostView {
  std::vector<uint8_t> block;
  std::vector<uint16_t> suffix_keys, suffix_values;  // copies the append test writes into
  kc::CacheView *view() { return reinterpret_cast<kc::CacheView *>(block.data()); }

  explicit HostView(const akv_cache &c, bool copy_suffix = false) {
    kc::ViewAddresses at;
    at.data = c.data.data();  // the emulated device reads host memory
    if (akv::storage_of(c.meta.method) == akv::Storage::kAnchor && c.geometry.format == 3)
      at.host_anchor_tokens = c.section<int64_t>(akv::kAnchorTokens);
    at.suffix_keys = reinterpret_cast<uint16_t *>(c.suffix_keys.data());
    at.suffix_values = reinterpret_cast<uint16_t *>(c.suffix_values.data());
    if (copy_suffix) {
      const size_t n = c.suffix_keys.size() / 2;
      suffix_keys.assign(at.suffix_keys, at.suffix_keys + n);
      suffix_values.assign(at.suffix_values, at.suffix_values + n);
      at.suffix_keys = suffix_keys.data();
      at.suffix_values = suffix_values.data();
    }
    block.resize(kc::build_view_block(c, at).size());
    at.aux = block.data();
    const std::vector<uint8_t> bytes = kc::build_view_block(c, at);
    std::copy(bytes.begin(), bytes.end(), block.begin());
  }
};

// Emulated decodes that took decode_split_kernel<D, MAXROWS, true> (kc::fast_decode_path), those
// of them with GPT-J pairs (<D, MAXROWS, true, true>: kc::fast_decode_gptj), the launches of
// decode_scores_kernel (a cache without RoPE among them),
// and the L2 prefetches the split kernels issued.
int fast_launches = 0, gptj_launches = 0, scores_launches = 0;
int64_t prefetches = 0;

template <int D, int MAXROWS, bool FAST, bool GPTJ>
void launch_decode(const kc::DecodePlan &plan, const kc::DecodeLaunch &p, int32_t batch) {
  const kc::DecodeGrids g = kc::decode_grids(plan, p.heads, batch);
  auto grid = [](const kc::Grid3 &x) { return simt::dim3(x.x, x.y, x.z); };
  if (FAST && p.scores) {
    simt::launch(grid(g.scores), simt::dim3(kc::kDecodeThreads), 0, kc::decode_scores_kernel<D, MAXROWS>, p);
    ++scores_launches;
  }
  simt::launch(grid(g.split), simt::dim3(kc::kDecodeThreads), plan.smem_bytes, kc::decode_split_kernel<D, MAXROWS, FAST, GPTJ>, p);
  if (plan.anchor_parts > 0)
    simt::launch(grid(g.anchor_values), simt::dim3(kc::kDecodeThreads), 0, kc::decode_anchor_values_kernel<D, MAXROWS>, p);
  simt::launch(grid(g.merge), simt::dim3(kc::kDecodeThreads), 0, kc::decode_merge_kernel<D, MAXROWS>, p);
}

template <int D, bool FAST, bool GPTJ>
void launch_decode_rows(const kc::DecodePlan &plan, const kc::DecodeLaunch &p, int32_t batch) {
  switch (plan.maxrows) {
    case 4: return launch_decode<D, 4, FAST, GPTJ>(plan, p, batch);
    case 8: return launch_decode<D, 8, FAST, GPTJ>(plan, p, batch);
    default: return launch_decode<D, 16, FAST, GPTJ>(plan, p, batch);
  }
}

// Emulated GPU decode of a batch; queries and the result: bytes in `io` dtype.
// sm_count and resident (split blocks per multiprocessor) set the number of splits; smem:
// the shared memory a block may have (a device's 227 KB, or less, which shrinks the row chunk
// or moves the per-anchor weights out of it; weights: the expected choice).
// lse (optional): receives [batch][Hq][q_len], each row's log-sum-exp.
std::vector<uint8_t> emulated_decode(const std::vector<akv_cache *> &caches, const std::vector<uint8_t> &queries,
                                     akv_dtype io, int q_len, int sm_count, int resident, size_t smem,
                                     std::vector<float> *lse = nullptr, const Weights *weights = nullptr,
                                     float rescale_slack = kc::kRescaleSlack, int min_splits = 0) {
  const int32_t batch = static_cast<int32_t>(caches.size());
  const akv_shape &s = caches[0]->meta.shape;
  const kc::DecodePlan plan = kc::plan_decode(caches.data(), batch, q_len, sm_count, smem,
                                              [&](int, size_t) { return resident; });
  EXPECT_EQ(plan.resident, resident);
  if (weights) EXPECT_EQ(plan.weights, *weights) << "where the per-anchor weights are summed";
  EXPECT_GE(plan.splits, min_splits) << "splits of a (request, head, row chunk)";
  std::vector<HostView> views;
  views.reserve(caches.size());
  for (akv_cache *c : caches) views.emplace_back(*c);
  std::vector<uint8_t> out(queries.size(), 0xFF);  // NaN in every dtype
  std::vector<float> ws(plan.workspace_bytes / sizeof(float), std::numeric_limits<float>::quiet_NaN());
  kc::DecodeLaunch p = kc::decode_launch(plan, s, q_len, io, queries.data(), out.data(), ws.data());
  for (int32_t b = 0; b < batch; ++b) p.views[b] = views[b].view();
  p.rescale_slack = rescale_slack;
  if (lse) {
    lse->assign(static_cast<size_t>(batch) * s.num_q_heads * q_len, std::numeric_limits<float>::quiet_NaN());
    p.lse = lse->data();
  }
  const bool fast = kc::fast_decode_path(caches.data(), batch, io);  // as the CUDA backend chooses
  const bool gptj = fast && kc::fast_decode_gptj(caches.data());
  fast_launches += fast;
  gptj_launches += gptj;
  // The split kernel's L2 prefetches: each address's 128-byte line overlaps a cache's stored
  // arrays or its view block (format 3's tile words; a device allocation is 256-byte aligned,
  // host vectors are not).
  int64_t outside = 0;  // the fibers run on this thread
  simt::prefetch_hook() = [&](const void *at) {
    const auto x = reinterpret_cast<uintptr_t>(at);
    const auto overlaps = [x](const uint8_t *lo, size_t bytes) {
      return (x & ~uintptr_t{127}) < reinterpret_cast<uintptr_t>(lo + bytes) && (x | 127) >= reinterpret_cast<uintptr_t>(lo);
    };
    bool in = false;
    for (size_t b = 0; b < caches.size(); ++b)
      in = in || overlaps(caches[b]->data.data(), caches[b]->data.size()) || overlaps(views[b].block.data(), views[b].block.size());
    prefetches += 1;
    outside += !in;
  };
  kc::with_head_dim(s.head_dim, [&](auto d) {
    kc::with_split_path(fast, gptj, [&](auto f, auto g) {
      launch_decode_rows<decltype(d)::value, decltype(f)::value, decltype(g)::value>(plan, p, batch);
    });
  });
  simt::prefetch_hook() = nullptr;
  EXPECT_EQ(outside, 0) << "L2 prefetches outside the caches' arrays";
  return out;
}

struct Case {
  akv_method method;
  int64_t seq_len;
  int head_dim, group, q_len, appended;
  akv_rope_style rope;
  bool gapped_positions;
  int window = 0;      // 0: the method's default
  int rotary_dim = 0;  // 0: all of head_dim
  akv_dtype io = AKV_DTYPE_F32;
  int anchors = 0;     // 0: automatic
  double q_std = 1.5;  // the queries' spread (large: logits hundreds apart in base 2)
  float rescale_slack = kc::kRescaleSlack;  // 0: the reference max is raised at every rise
};

std::string describe(const Case &c) {
  return "method " + std::to_string(c.method) + " S=" + std::to_string(c.seq_len) + " D=" + std::to_string(c.head_dim) +
         " G=" + std::to_string(c.group) + " q_len=" + std::to_string(c.q_len) + " appended=" + std::to_string(c.appended) +
         " rope=" + std::to_string(c.rope) + (c.gapped_positions ? " gapped" : "") + " anchors=" + std::to_string(c.anchors);
}

// Builds a CPU cache for the case (compress + appends) with its own data.
CachePtr build_cache(akv_context *ctx, Rng &rng, const Case &c, int kv_heads) {
  akv_compress_options o;
  akv_compress_options_init_method(&o, c.method);
  o.rope.style = c.rope;
  o.rope.rotary_dim = c.rotary_dim;
  if (c.window) o.window = c.window;
  if (c.anchors) o.anchors = c.anchors;
  if (c.gapped_positions) o.storage_format = 2;  // format 3 needs consecutive positions
  PrefillSpec spec;
  spec.seq_len = c.seq_len;
  spec.kv_heads = kv_heads;
  spec.group = c.group;
  spec.head_dim = c.head_dim;
  spec.window = o.window;
  spec.explicit_positions = c.gapped_positions;
  const PrefillData data = make_prefill(rng, spec);
  if (c.method == AKV_METHOD_ANCHORKV) o.retain_fraction = workable_retain_fraction(data.shape, o.window, c.anchors, 0.12);
  if (c.method == AKV_METHOD_SNAPKV) o.retain_fraction = 0.3;
  CachePtr cache = compress(ctx, data, o);
  // logit_correction's penalties take a factor per head that may be 0 on random data: set
  // them here so that every format-3 case runs the penalty path on both decodes.
  if (cache->meta.storage_format == 3 && c.method == AKV_METHOD_ANCHORKV) {
    cache->meta.logit_penalty.resize(static_cast<size_t>(2) * kv_heads);
    for (float &p : cache->meta.logit_penalty) p = static_cast<float>(rng.uniform(0.05, 0.25));
  }
  if (c.appended) {
    const size_t n = static_cast<size_t>(kv_heads) * c.appended * c.head_dim;
    const std::vector<float> k = nonzero_normal(rng, n), v = nonzero_normal(rng, n);
    ok(akv_append(cache.get(), k.data(), v.data(), AKV_DTYPE_F32, c.appended, nullptr, nullptr), "akv_append");
  }
  return cache;
}

// weights: where the plan must sum the per-anchor weights.
// min_splits: the plan must split each (request, head, row chunk) at least that many ways.
void check_case(const Case &c, int batch, int sm_count, int resident = 2, size_t smem = 227 * 1024,
                Weights weights = Weights::kShared, int kv_heads = 2, int min_splits = 0) {
  const uint64_t seed = fresh_seed();
  AKV_TRACE_SEED(seed);
  SCOPED_TRACE(describe(c) + " batch " + std::to_string(batch) + " sm_count " + std::to_string(sm_count));
  Rng rng(seed);
  ContextPtr ctx = make_context(2);
  const int H = kv_heads;
  std::vector<CachePtr> owned;
  std::vector<akv_cache *> caches;
  for (int b = 0; b < batch; ++b) {
    Case cb = c;
    cb.seq_len = c.seq_len - 97 * b;  // mixed lengths
    owned.push_back(build_cache(ctx.get(), rng, cb, H));
    caches.push_back(owned.back().get());
  }
  const size_t per_request = static_cast<size_t>(H) * c.group * c.q_len * c.head_dim;
  const Tensor q = make_tensor(nonzero_normal(rng, per_request * batch, c.q_std), c.io);
  std::vector<uint8_t> expected_bytes = poisoned(q.count(), c.io);
  std::vector<float> expected_lse(static_cast<size_t>(batch) * H * c.group * c.q_len), got_lse;
  ok(akv_decode_batch_lse(ctx.get(), caches.data(), batch, q.data(), c.io, c.q_len, expected_bytes.data(),
                          expected_lse.data(), nullptr),
     "akv_decode_batch_lse");
  const std::vector<float> got =
      decode_bytes(emulated_decode(caches, q.bytes, c.io, c.q_len, sm_count, resident, smem, &got_lse, &weights,
                                   c.rescale_slack, min_splits),
                    c.io);
  const std::vector<float> expected = decode_bytes(expected_bytes, c.io);
  ASSERT_EQ(count_non_finite(got), 0u);
  // Same arithmetic up to summation order and the angle method (both accurate to ~1e-6);
  // a 16-bit output may round the other way. bf16 queries: the keys' side runs in bf16 (the
  // fast path's rotation in bf16x2, two roundings an element, and the contraction's
  // operands): logits off by a few 2^-9 of their size, which moves a peaked softmax's output by
  // up to ~0.03 here, and an element of a near-tied row now and then further: about 1 check in
  // 200 had one past 0.04 (up to 0.058; with the rotation in fp32 and one rounding the same
  // data gave 0.010 where it gave 0.053). So bf16 outputs are held to near_but_for_rounding:
  // within 0.1, at most 2% past 0.04, a mean error at most 0.005 (over 970 checks, 2026-12-06:
  // an element's error at most 1.45 x 0.04, a mean at most 0.06 x 0.04); a key residual's term
  // 10% off fails the mean (0.17-0.37 x 0.04 on 7 checks of 8) and a dropped one the cap
  // (0.3-0.9), as the same bounds do in tests/gpu. Logits' rounding grows with their size: the bounds (and the log-sum-exp's)
  // with the queries' spread.
  const double spread = std::max(1.0, c.q_std / 1.5);
  const double tol = (c.io == AKV_DTYPE_F32 ? 2e-4 : c.io == AKV_DTYPE_F16 ? 2e-3 : 4e-2) * spread;
  EXPECT_TRUE(decode_output_near(got, expected, c.io, tol));
  // The merge kernel's log-sum-exp (base-2 running max and sum) against the CPU's. With bf16
  // queries the keys' side runs in bf16: logits off by a few 2^-9 of their size, so the bound
  // is relative, 6e-3 (three units of 2^-9). It was 4e-3 (two), past which the tail went now
  // and then at LSE 10-15: a check's largest error over 25 runs 0.0026 (GPT-J) and 0.0032
  // (NeoX) at most, but 0.0055 once in CI (GPT-J, D 64, q_len 2) and 0.0050 once (NeoX, D 64,
  // q_len 1: AKV_TEST_SEED=15873861192233142087, on the CPU decode before and after its chunks
  // alike). Other dtypes keep fp32-level accuracy.
  const bool bf16_io = c.io == AKV_DTYPE_BF16;
  EXPECT_TRUE(all_near(got_lse, expected_lse, (bf16_io ? 1e-2 : 1e-4) * spread, (bf16_io ? 6e-3 : 1e-5) * spread))
      << "log-sum-exp";
}

TEST(EmulatedDecode, AnchorKvMatchesCpuAcrossShapes) {
  check_case({AKV_METHOD_ANCHORKV, 1100, 64, 1, 1, 0, AKV_ROPE_NEOX, false}, 1, 4, 2);
  check_case({AKV_METHOD_ANCHORKV, 1300, 128, 4, 1, 0, AKV_ROPE_NEOX, true}, 1, 8, 1);
}

TEST(EmulatedDecode, AnchorKvBatchWithAppendedTokensAndQueryBlocks) {
  check_case({AKV_METHOD_ANCHORKV, 900, 64, 4, 4, 5, AKV_ROPE_GPTJ, false}, 2, 4, 3);
  check_case({AKV_METHOD_ANCHORKV, 700, 128, 2, 4, 3, AKV_ROPE_NONE, false}, 2, 2, 2);
}

// Keys handed rotated with no RoPE (anchors fitted after the rotation, docs/design.md §4.6) at
// the size where the recipe is used: segment tables (k > 256), three rows a head, appended
// tokens. bf16 queries take the register-gather path, the tokens' logits their anchors' scores
// (decode_scores_kernel, lookup_scores) and the view's D / 2 pairs of zero frequency
// (build_view_block) for the queries and key residuals, at D 64 and 128, 4, 8 and 16 rows,
// with a window past a tile; f32 queries the generic kernel.
TEST(EmulatedDecode, NoRopeWithSegmentTables) {
  const int before = fast_launches, gptj_before = gptj_launches, scores_before = scores_launches;
  Case c{AKV_METHOD_ANCHORKV, 1600, 64, 3, 1, 2, AKV_ROPE_NONE, false};
  c.anchors = 300;
  c.io = AKV_DTYPE_BF16;
  check_case(c, 2, 4, 2);
  Case wide{AKV_METHOD_ANCHORKV, 1400, 128, 4, 2, 3, AKV_ROPE_NONE, false};
  wide.anchors = 320;
  wide.window = 100;
  wide.io = AKV_DTYPE_BF16;
  check_case(wide, 1, 4, 2);
  Case rows16{AKV_METHOD_ANCHORKV, 1200, 64, 8, 2, 2, AKV_ROPE_NONE, false};
  rows16.anchors = 300;
  rows16.io = AKV_DTYPE_BF16;
  check_case(rows16, 1, 4, 2);
  EXPECT_EQ(fast_launches - before, 3) << "bf16 queries on decode_split_kernel<D, MAXROWS, true>";
  EXPECT_EQ(gptj_launches - gptj_before, 0) << "NeoX's kernel, not GPT-J's";
  EXPECT_EQ(scores_launches - scores_before, 3) << "the anchors' scores looked up, not their rows gathered";
  c.io = AKV_DTYPE_F32;
  check_case(c, 1, 4, 2);
  EXPECT_EQ(fast_launches - before, 3) << "f32 queries on the generic kernel";
  EXPECT_EQ(scores_launches - scores_before, 3) << "and no scores";
}

// An appended suffix of 5 tiles over 2 splits: its tiles taken by the splits in turn (split
// 0 took them all, a straggler), each once; on both kernel paths.
TEST(EmulatedDecode, LongSuffixTilesSpreadOverSplits) {
  Case c{AKV_METHOD_ANCHORKV, 700, 64, 4, 1, 300, AKV_ROPE_NEOX, false};
  check_case(c, 1, 2, 2, 227 * 1024, Weights::kShared, 2, 2);
  c.io = AKV_DTYPE_BF16;  // the register-gather path
  check_case(c, 1, 2, 2, 227 * 1024, Weights::kShared, 2, 2);
}

// The merge kernels over many splits (a device's 132 multiprocessors, 4K tokens split about
// 60 ways): the splits' weights and rows in several batches (kMergeBatch), the split factors
// from both of a lane's splits (lane and lane + 32), and the merge's thread groups of 4 and 2
// dims at 4 and 8 rows.
TEST(EmulatedDecode, ManySplitsMergeInBatches) {
  check_case({AKV_METHOD_ANCHORKV, 4100, 128, 4, 1, 2, AKV_ROPE_NEOX, false}, 1, 132, 2, 227 * 1024, Weights::kShared,
             2, 40);
  Case rows8{AKV_METHOD_ANCHORKV, 3000, 64, 8, 1, 0, AKV_ROPE_NEOX, false};
  rows8.io = AKV_DTYPE_BF16;
  check_case(rows8, 1, 66, 2, 227 * 1024, Weights::kShared, 2, 30);
}

// A window of several tiles spread over many split blocks (a window tile counts as two prefix
// tiles' units, SplitBlock::split_unit): 15 prefix tiles and 5 window tiles, 25 units over 15
// splits, so that some blocks take only window tiles and one starts between a window tile's two
// units (each window tile taken once, by the block that holds its first unit).
TEST(EmulatedDecode, WindowTilesSpreadOverSplits) {
  Case c{AKV_METHOD_ANCHORKV, 1200, 64, 4, 1, 0, AKV_ROPE_NEOX, false};
  c.window = 300;
  check_case(c, 1, 132, 2, 227 * 1024, Weights::kShared, 2, 15);
  c.io = AKV_DTYPE_BF16;  // the register-gather path
  check_case(c, 1, 132, 2, 227 * 1024, Weights::kShared, 2, 15);
}

TEST(EmulatedDecode, ManyRowsUseSeveralRowChunks) {
  check_case({AKV_METHOD_ANCHORKV, 600, 64, 8, 5, 4, AKV_ROPE_NEOX, false}, 1, 2, 3);  // 40 rows
}

TEST(EmulatedDecode, WideHeadsLongWindowPartialRotaryAndHalfPrecisionIo) {
  // D=256; a window longer than a tile; RoPE on half the dimensions; bf16 and f16 I/O.
  Case wide{AKV_METHOD_ANCHORKV, 1500, 256, 2, 1, 0, AKV_ROPE_NEOX, false};
  wide.io = AKV_DTYPE_BF16;
  check_case(wide, 1, 4, 2);
  Case long_window{AKV_METHOD_ANCHORKV, 2000, 64, 4, 2, 3, AKV_ROPE_NEOX, true};
  long_window.window = 600;
  long_window.rotary_dim = 32;
  long_window.io = AKV_DTYPE_F16;
  check_case(long_window, 2, 3, 3);
  Case gptj_partial{AKV_METHOD_ANCHORKV, 900, 128, 1, 1, 0, AKV_ROPE_GPTJ, false};
  gptj_partial.rotary_dim = 64;
  check_case(gptj_partial, 1, 8, 1);
}

// bf16 queries over a bf16 format-3 cache with NeoX RoPE on every dimension: the split
// kernel's register-gather path (anchor rows gathered into mma fragments and rotated in bf16x2
// arithmetic, gamma on the logit, key residuals as logit terms), at D 64 and 128, 4, 8 and 16
// rows (one and two n8 tiles), a window longer than a tile, appended tokens and several
// query rows per head.
TEST(EmulatedDecode, Bf16QueriesTakeTheRegisterGatherPath) {
  const int before = fast_launches;
  const int64_t prefetched = prefetches;
  for (int D : {64, 128}) {
    Case c{AKV_METHOD_ANCHORKV, 1400, D, 4, 1, 0, AKV_ROPE_NEOX, false};
    c.io = AKV_DTYPE_BF16;
    check_case(c, 2, 4, 2);
  }
  Case rows16{AKV_METHOD_ANCHORKV, 1200, 128, 8, 2, 3, AKV_ROPE_NEOX, false};
  rows16.io = AKV_DTYPE_BF16;
  rows16.anchors = 600;
  check_case(rows16, 2, 4, 1);
  Case window{AKV_METHOD_ANCHORKV, 1500, 64, 1, 1, 0, AKV_ROPE_NEOX, false};
  window.window = 100;
  window.io = AKV_DTYPE_BF16;
  check_case(window, 1, 3, 2);
  EXPECT_EQ(fast_launches - before, 4) << "every case on decode_split_kernel<D, MAXROWS, true>";
  EXPECT_GT(prefetches - prefetched, 0) << "the staging warps' L2 prefetches";
}

// GPT-J pairs over every dimension take the same path: the queries and the key residuals' rows
// in quad order, the anchor rows' halves permuted as they are loaded (decode_split_kernel's
// gptj_position). D 64, 128 and 256; segment tables (600 anchors), several query rows and
// appended tokens, and the window past a tile. D 64 with q_len 1 and no appended tokens, as
// Bf16QueriesTakeTheRegisterGatherPath's: with 2 and 3 the log-sum-exp's bf16 error reached
// the then bound's tail for either pairing (25 runs each, 2026-12-06, the largest relative
// error of a check: GPT-J median 0.0004, 90th percentile 0.0016, most 0.0026; NeoX 0.0006,
// 0.0016, 0.0032; bound 0.004, which one GPT-J check in about 200 went past, at 0.0055; the
// bound is 0.006 now, check_case).
TEST(EmulatedDecode, GptjTakesTheRegisterGatherPath) {
  const int before = fast_launches, gptj_before = gptj_launches;
  for (int D : {64, 128, 256}) {
    Case c{AKV_METHOD_ANCHORKV, 1300, D, 4, D == 64 ? 1 : 2, D == 64 ? 0 : 3, AKV_ROPE_GPTJ, false};
    c.io = AKV_DTYPE_BF16;
    c.anchors = D == 128 ? 600 : 0;
    check_case(c, 2, 4, 2);
  }
  Case window{AKV_METHOD_ANCHORKV, 1500, 64, 1, 1, 0, AKV_ROPE_GPTJ, false};
  window.window = 100;
  window.io = AKV_DTYPE_BF16;
  check_case(window, 1, 3, 2);
  EXPECT_EQ(fast_launches - before, 4) << "every case on decode_split_kernel<D, MAXROWS, true>";
  EXPECT_EQ(gptj_launches - gptj_before, 4) << "every case on decode_split_kernel<D, MAXROWS, true, true>";
}

// Queries 40 times the usual spread: base-2 logits hundreds apart, so a later tile's max often
// passes a block's reference by more than fp32's exponent range (2^128) allows without a
// rescale, and by more than kRescaleSlack: the split kernel's rescale path against the CPU's
// exact softmax (a reference raised too late overflows to inf; not at all, the same).
TEST(EmulatedDecode, PeakedLogitsRescaleAcrossTiles) {
  Case peaked{AKV_METHOD_ANCHORKV, 1400, 64, 4, 1, 0, AKV_ROPE_NEOX, false};
  peaked.q_std = 60.0;
  check_case(peaked, 1, 4, 2);
  Case peaked128{AKV_METHOD_ANCHORKV, 1300, 128, 2, 2, 3, AKV_ROPE_GPTJ, false};
  peaked128.q_std = 60.0;
  check_case(peaked128, 2, 6, 1);
  // The register-gather path (bf16 queries, NeoX): first with no slack, so that every rise of
  // a row's max rescales what its earlier tiles summed while those sums are not about zero
  // (with 32 and peaked logits they are, and a missed rescale goes unseen); then peaked.
  Case fast{AKV_METHOD_ANCHORKV, 1400, 128, 4, 1, 0, AKV_ROPE_NEOX, false};
  fast.io = AKV_DTYPE_BF16;
  fast.rescale_slack = 0.0f;
  check_case(fast, 1, 4, 2);
  fast.q_std = 60.0;
  fast.rescale_slack = kc::kRescaleSlack;
  check_case(fast, 1, 4, 2);
}

// Many anchors per head (the old kernel split these into slices of shared memory; the tile
// now reads anchor rows as it needs them), GQA groups 1, 4 and 8, q_len 1 and 4, mixed
// batches with appended tokens, gapped positions (the exact-angle fallback of the RoPE table).
TEST(EmulatedDecode, ManyAnchorsGqaGroupsAndQueryLengths) {
  Case g8{AKV_METHOD_ANCHORKV, 1800, 64, 8, 1, 3, AKV_ROPE_NEOX, false};
  g8.anchors = 900;
  check_case(g8, 2, 4, 2);
  Case g1{AKV_METHOD_ANCHORKV, 1500, 128, 1, 4, 4, AKV_ROPE_GPTJ, true};
  g1.anchors = 800;
  g1.io = AKV_DTYPE_BF16;
  check_case(g1, 2, 6, 1);
  Case g4{AKV_METHOD_ANCHORKV, 1200, 64, 4, 4, 3, AKV_ROPE_NEOX, true};
  g4.anchors = 700;
  check_case(g4, 3, 4, 2);
}

// More anchors than shared memory holds with even 4 rows (about 9.2K anchors on a device;
// or fewer blocks fit a multiprocessor with them): storage format 3's are summed a segment
// table's 256 entries at a time in shared memory and added to the workspace when the segment
// ends (DecodePlan::Weights::kSegments); format 2's, or all where not even the 256 fit,
// directly in the workspace (kWorkspace). Shared memory then no longer depends on the anchor
// count. Here small shared-memory limits force them at 900 anchors (segments of 256 tokens:
// blocks of several, and blocks that start inside one).
TEST(EmulatedDecode, AnchorWeightsBySegmentOrInTheWorkspaceWhenSharedMemoryIsShort) {
  Case c{AKV_METHOD_ANCHORKV, 1800, 64, 4, 2, 3, AKV_ROPE_NEOX, false};  // 8 rows
  c.anchors = 900;
  const size_t segment_smem = kc::SplitSmem(64, 8, 0).total + 4096;
  ASSERT_GT(kc::SplitSmem(64, 4, 800).total, segment_smem) << "the weights must not fit at 4 rows";
  ASSERT_LE(kc::SplitSmem(64, 4, kc::kSegmentEntries).total, segment_smem) << "a segment's must";
  check_case(c, 2, 4, 2, segment_smem, Weights::kSegments);  // two row chunks of 4
  c.io = AKV_DTYPE_BF16;  // the register-gather path
  check_case(c, 2, 4, 2, segment_smem, Weights::kSegments);
  Case rises = c;  // every rise of a row's max rescales the segment's sums and the workspace's
  rises.rescale_slack = 0.0f;
  check_case(rises, 1, 3, 2, segment_smem, Weights::kSegments);
  Case format2 = c;  // no segment tables: the workspace, under the same plan
  format2.gapped_positions = true;
  check_case(format2, 2, 4, 2, segment_smem, Weights::kSegments);
  const size_t workspace_smem = kc::SplitSmem(64, 4, 0).total + 1024;
  check_case(c, 2, 4, 2, workspace_smem, Weights::kWorkspace);
  c.io = AKV_DTYPE_F32;
  check_case(c, 2, 4, 2, workspace_smem, Weights::kWorkspace);
  Case one_row{AKV_METHOD_ANCHORKV, 1300, 128, 1, 1, 0, AKV_ROPE_NEOX, true};  // a chunk of 4 with 1 row
  one_row.anchors = 700;
  check_case(one_row, 1, 8, 1, kc::SplitSmem(128, 4, 0).total, Weights::kWorkspace);
  Case one_row3 = one_row;  // format 3, at D 128
  one_row3.gapped_positions = false;
  check_case(one_row3, 1, 2, 1, kc::SplitSmem(128, 4, kc::kSegmentEntries).total, Weights::kSegments);
}

// With room for every weight, the plan still sums them a segment at a time where that fits
// more blocks on a multiprocessor (at 128K and default options: k 3258, one block with its
// weights, two with a table's), and only for caches with segment tables.
TEST(EmulatedDecode, PlanSumsWeightsBySegmentWhereThatFitsMoreBlocks) {
  const uint64_t seed = fresh_seed();
  AKV_TRACE_SEED(seed);
  Rng rng(seed);
  ContextPtr ctx = make_context(2);
  Case c{AKV_METHOD_ANCHORKV, 1300, 128, 4, 1, 0, AKV_ROPE_NEOX, false};
  c.anchors = 700;
  CachePtr tabled = build_cache(ctx.get(), rng, c, 2);
  c.gapped_positions = true;  // format 2: no tables
  CachePtr untabled = build_cache(ctx.get(), rng, c, 2);
  const size_t small = kc::SplitSmem(128, 4, kc::kSegmentEntries).total;
  const auto two_if_small = [&](int, size_t smem) { return smem <= small ? 2 : 1; };
  const akv_cache *one[] = {tabled.get()};
  kc::DecodePlan plan = kc::plan_decode(one, 1, 1, 8, 227 * 1024, two_if_small);
  EXPECT_EQ(plan.weights, Weights::kSegments);
  EXPECT_EQ(plan.smem_anchors, kc::kSegmentEntries);
  EXPECT_EQ(plan.resident, 2);
  EXPECT_EQ(plan.smem_bytes, small);
  plan = kc::plan_decode(one, 1, 1, 8, 227 * 1024, [](int, size_t) { return 2; });  // no block to gain
  EXPECT_EQ(plan.weights, Weights::kShared);
  EXPECT_EQ(plan.smem_anchors, 700);
  const akv_cache *both[] = {tabled.get(), untabled.get()};  // one cache would sum in the workspace
  plan = kc::plan_decode(both, 2, 1, 8, 227 * 1024, two_if_small);
  EXPECT_EQ(plan.weights, Weights::kShared);
  EXPECT_EQ(plan.resident, 1);
}

// A million prompt positions (one KV head, one query row, 300 anchors: format 3 with
// 4096-token segment tables): the kernels' offsets and counters hold at that length, and
// the result is the CPU decode's. The longest emulation test (about a minute).
TEST(EmulatedDecode, MillionPositions) {
  Case c{AKV_METHOD_ANCHORKV, 1 << 20, 64, 1, 1, 0, AKV_ROPE_NEOX, false};
  c.anchors = 300;
  check_case(c, 1, 64, 1, 227 * 1024, Weights::kShared, /*kv_heads=*/1);
}

// Storage format 3 is read as stored: the view block adds the coefficient units and two
// words per tile and head (besides the RoPE tables), not format 2's per-token arrays (8 + 4/H bytes per token and head,
// which it used to widen into it).
TEST(EmulatedDecode, FormatThreeViewStaysSmall) {
  const uint64_t seed = fresh_seed();
  AKV_TRACE_SEED(seed);
  Rng rng(seed);
  ContextPtr ctx = make_context(2);
  for (const int anchors : {0, 700}) {  // without and with segment tables
    Case c{AKV_METHOD_ANCHORKV, 8192, 64, 4, 1, 0, AKV_ROPE_NEOX, false};
    c.anchors = anchors;
    const CachePtr cache = build_cache(ctx.get(), rng, c, 2);
    ASSERT_EQ(cache->geometry.format, 3);
    const HostView view(*cache);
    const int64_t token_heads = cache->geometry.prefix * cache->geometry.heads;
    const int64_t rope_table = 8 * kc::kDecodeTile * (c.head_dim / 2);  // the tile's (cos, sin) table
    EXPECT_LT(view.block.size(), 4096 + rope_table + token_heads / 4) << "anchors " << anchors;
  }
}

// Shared-memory wavefronts of one warp's access: lanes in groups that move 128 bytes (32 lanes
// of 4-byte words, 16 of 8, 8 of 16), each group costing the most distinct words that any bank
// serves (the same word is a broadcast). bytes(lane) is the lane's first byte.
template <class F>
int wavefronts(int width, F bytes) {
  const int group = 128 / width;
  int total = 0;
  for (int g0 = 0; g0 < 32; g0 += group) {
    std::map<int, std::set<int64_t>> words;  // bank -> distinct words
    for (int lane = g0; lane < g0 + group; ++lane)
      for (int w = 0; w < width / 4; ++w) {
        const int64_t word = bytes(lane) / 4 + w;
        words[static_cast<int>(word % 32)].insert(word);
      }
    size_t most = 0;
    for (const auto &[bank, set] : words) most = std::max(most, set.size());
    total += static_cast<int>(most);
  }
  return total;
}

// The fast path's per-token shared-memory reads at their minimum wavefronts (their index
// expressions as in decode_kernels.cuh): the mma B fragments of the bf16 rotated queries
// (contract_gathered's 8-byte loads, the key residuals' 4-byte ones; lane g reads row g % 4,
// which unpadded rows put in the same banks) and the RoPE table's 16-byte entries (tokens u and
// u + 1 in each quarter warp).
// GPT-J's kernel stores the rotated queries and the key residuals' rows in quad order
// (gptj_position): one place a dim, and a lane's two quads (pairs d / 2 .. d / 2 + 3 of
// contract_gathered's dims d = 32 s + 8 tq) where the NeoX slab and its partner are read, so the
// reads below cover it.
template <int D>
void check_gptj_places() {
  using Block = kc::SplitBlock<D, 4, true, true>;
  std::set<int> places;
  for (int j = 0; j < D / 2; ++j) {
    places.insert(Block::gptj_position(j));
    places.insert(Block::gptj_position(j) + 2);
  }
  EXPECT_EQ(places.size(), static_cast<size_t>(D));
  EXPECT_EQ(*places.begin(), 0);
  EXPECT_EQ(*places.rbegin(), D - 1);
  for (int s = 0; s < D / 32; ++s)
    for (int tq = 0; tq < 4; ++tq) {
      const int m = (32 * s + 8 * tq) / 2;
      EXPECT_EQ(Block::gptj_position(m), 16 * s + 4 * tq);
      EXPECT_EQ(Block::gptj_position(m + 2), D / 2 + 16 * s + 4 * tq);
    }
}

TEST(EmulatedDecode, FastPathTablesReadWithoutBankConflicts) {
  check_gptj_places<64>();
  check_gptj_places<128>();
  check_gptj_places<256>();
  for (const int D : {64, 128, 256}) {
    SCOPED_TRACE(D);
    const int QS = kc::SplitSmem::qb_stride(D), TS = kc::SplitSmem::trig_stride(D), P = D / 2;
    for (int d0 = 0; d0 < P; d0 += 16) {  // contract_gathered's slab s: d = 16 s + 4 tq
      const auto qb = [&](int lane) { return 2 * (int64_t{(lane >> 2) & 3} * QS + d0 + 4 * (lane & 3)); };
      EXPECT_EQ(wavefronts(8, qb), 2) << "slab at " << d0;
      const auto cs = [&](int lane) { return 16 * (int64_t{lane >> 2} * TS + (d0 + 4 * (lane & 3)) / 4); };
      EXPECT_EQ(wavefronts(16, cs), 4) << "slab at " << d0;
    }
    for (int s16 = 0; s16 < D / 16; ++s16)  // key_residuals: word 8 s16 + tq (and + 4) of row g % 4
      for (const int plus : {0, 4}) {
        const auto qb = [&](int lane) { return 2 * (int64_t{(lane >> 2) & 3} * QS) + 4 * (8 * s16 + (lane & 3) + plus); };
        EXPECT_EQ(wavefronts(4, qb), 1) << "slab " << s16;
      }
  }
}

TEST(EmulatedDecode, DenseCachesMatchCpu) {
  check_case({AKV_METHOD_FULLKV, 700, 64, 4, 2, 3, AKV_ROPE_NEOX, false}, 2, 8, 2);
  check_case({AKV_METHOD_SNAPKV, 800, 128, 2, 1, 2, AKV_ROPE_NEOX, false}, 2, 4, 3);
}

// The rows of an emulated device append against the CPU cache's: values exactly, keys
// (rotated in float on both sides, then rounded to the storage dtype) within one rounding
// step of the row's largest element: an element near zero may round to another sign or
// exponent, so bit patterns are not compared (seed 3322598116004043129 under SIMT seed 3 had
// such a pair).
void expect_suffix_rows(HostView &hv, const akv_cache &cache, int rows, int H, int D) {
  const uint16_t *cpu_k = reinterpret_cast<const uint16_t *>(cache.suffix_keys.data());
  const uint16_t *cpu_v = reinterpret_cast<const uint16_t *>(cache.suffix_values.data());
  const akv_dtype storage = cache.meta.storage;
  size_t key_mismatch = 0, value_mismatch = 0;
  for (int h = 0; h < H; ++h)
    for (int i = 0; i < rows; ++i) {
      const size_t got = (static_cast<size_t>(h) * hv.view()->suffix_capacity + i) * D;
      const size_t want = (static_cast<size_t>(h) * cache.suffix_capacity + i) * D;
      float row_max = 0.0f;
      for (int d = 0; d < D; ++d) row_max = std::max(row_max, std::fabs(akv::half_to_float(cpu_k[want + d], storage)));
      for (int d = 0; d < D; ++d) {
        if (hv.suffix_values[got + d] != cpu_v[want + d]) ++value_mismatch;
        const float a = akv::half_to_float(hv.suffix_keys[got + d], storage);
        const float b = akv::half_to_float(cpu_k[want + d], storage);
        if (std::fabs(a - b) > row_max * 0x1p-8f) {
          ++key_mismatch;
          ADD_FAILURE() << "head " << h << " row " << i << " dim " << d << ": " << a << " vs " << b;
        }
      }
    }
  EXPECT_EQ(value_mismatch, 0u);
  EXPECT_EQ(key_mismatch, 0u);
}

// An append launch of n tokens [H][n][D] (f32) into the view, as cuda::append builds it;
// positions null: implicit (continued on the device).
kc::AppendLaunch append_launch(HostView &hv, const float *keys, const float *values, int n, const int32_t *positions) {
  kc::AppendLaunch a{};
  a.view = hv.view();
  a.keys = keys;
  a.values = values;
  a.dtype = AKV_DTYPE_F32;
  a.n_total = n;
  a.token0 = 0;
  a.n = n;
  a.implicit = positions ? 0 : 1;
  for (int i = 0; positions && i < n; ++i) a.positions[i] = positions[i];
  return a;
}

// The two kernels of one append launch, as the backend runs them.
void run_append(const kc::AppendLaunch &a, int heads) {
  simt::launch(simt::dim3(a.n, heads), simt::dim3(64), 0, kc::append_rows_kernel, a);
  simt::launch(simt::dim3(1), simt::dim3(1), 0, kc::append_commit_kernel, a);
}

// Append on the "device" writes the same rows as the CPU append, and the kernel-side length
// advances, so a decode captured before the append sees the new tokens.
TEST(EmulatedAppend, RowsAndLengthMatchCpu) {
  const uint64_t seed = fresh_seed();
  AKV_TRACE_SEED(seed);
  Rng rng(seed);
  for (akv_dtype storage : {AKV_DTYPE_BF16, AKV_DTYPE_F16}) {
    ContextPtr ctx = make_context(1);
    PrefillSpec spec;
    spec.seq_len = 300;
    spec.head_dim = 64;
    spec.dtype = storage;
    const PrefillData data = make_prefill(rng, spec);
    CachePtr cache = compress(ctx.get(), data, anchorkv_options(workable_retain_fraction(data.shape, 32, 0, 0.1)));
    ok(akv_cache_reserve(cache.get(), 16, nullptr), "akv_cache_reserve");
    HostView hv(*cache, /*copy_suffix=*/true);
    const int n = 5, H = 2, D = 64;
    const std::vector<float> k = nonzero_normal(rng, static_cast<size_t>(H) * n * D);
    const std::vector<float> v = nonzero_normal(rng, static_cast<size_t>(H) * n * D);
    std::vector<int32_t> pos = {400, 401, 405, 406, 410};
    ok(akv_append(cache.get(), k.data(), v.data(), AKV_DTYPE_F32, n, pos.data(), nullptr), "akv_append");
    run_append(append_launch(hv, k.data(), v.data(), n, pos.data()), H);
    EXPECT_EQ(hv.view()->suffix_len, n);
    EXPECT_EQ(hv.view()->next_position, 411);
    for (int i = 0; i < n; ++i) EXPECT_EQ(hv.view()->suffix_positions[i], pos[i]);
    expect_suffix_rows(hv, *cache, n, H, D);
  }
}

// A CUDA graph replays an append launch with the arguments it was captured with. Launched
// three times unchanged (the engine refilling the same key/value buffers in between), the
// tokens must land one after the other at consecutive positions read on the device, as
// three CPU appends without positions place them; and replays past the reserved capacity
// must be counted as dropped, never written, with the length stopping at the capacity.
TEST(EmulatedAppend, ReplayedLaunchContinuesFromTheDevicePosition) {
  const uint64_t seed = fresh_seed();
  AKV_TRACE_SEED(seed);
  Rng rng(seed);
  ContextPtr ctx = make_context(1);
  PrefillSpec spec;
  spec.seq_len = 300;
  spec.head_dim = 64;
  const PrefillData data = make_prefill(rng, spec);
  const int n = 5, H = 2, D = 64, replays = 3;
  for (int capacity : {16, 8}) {
    SCOPED_TRACE("capacity " + std::to_string(capacity));
    CachePtr cache = compress(ctx.get(), data, anchorkv_options(workable_retain_fraction(data.shape, 32, 0, 0.1)));
    CachePtr cpu = compress(ctx.get(), data, anchorkv_options(workable_retain_fraction(data.shape, 32, 0, 0.1)));
    ok(akv_cache_reserve(cache.get(), capacity, nullptr), "akv_cache_reserve");
    ASSERT_EQ(cache->suffix_capacity, capacity);
    HostView hv(*cache, /*copy_suffix=*/true);
    const int32_t first = hv.view()->next_position;
    std::vector<float> k(static_cast<size_t>(H) * n * D), v(k.size());
    kc::AppendLaunch a = append_launch(hv, k.data(), v.data(), n, nullptr);  // "captured" once
    std::fill(std::begin(a.positions), std::end(a.positions), -7);           // never read
    for (int r = 0; r < replays; ++r) {
      const std::vector<float> nk = nonzero_normal(rng, k.size()), nv = nonzero_normal(rng, v.size());
      std::copy(nk.begin(), nk.end(), k.begin());  // the same buffers, as a graph's inputs
      std::copy(nv.begin(), nv.end(), v.begin());
      run_append(a, H);
      ok(akv_append(cpu.get(), k.data(), v.data(), AKV_DTYPE_F32, n, nullptr, nullptr), "akv_append");
    }
    const int kept = std::min(capacity, n * replays);
    EXPECT_EQ(hv.view()->suffix_len, kept);
    EXPECT_EQ(hv.view()->dropped, n * replays - kept);
    EXPECT_EQ(hv.view()->next_position, first + n * replays);
    for (int i = 0; i < kept; ++i) EXPECT_EQ(hv.view()->suffix_positions[i], cpu->suffix_positions[i]) << "token " << i;
    expect_suffix_rows(hv, *cpu, kept, H, D);
  }
}

}  // namespace
