// The CUDA pass's candidate searches on the eval's synthetic data (the `anchorkv eval`
// generator, tools/cli/synthetic.cpp), through the SIMT emulation, with profiling on: the share
// of tokens a coverage round's search leaves alone and the candidates it rescores per token
// searched, which scripts/predict_compress.py takes as SKIP_SHARE and RESCORED (a device run
// with ANCHORKV_COMPRESS_PROFILE=1 prints the same counts on the stage line). Profiling must
// not change the cache.
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/context.hpp"
#include "methods/methods.hpp"
#include "synthetic.hpp"  // tools/cli

// Last: the emulation defines threadIdx, __shared__ and friends as macros.
#include "cuda/compress_pipeline.hpp"
#include "emu/emulated_device.hpp"

namespace {

namespace kc = akv::cuda;

struct Pass {
  std::unique_ptr<akv_cache> cache;
  uint32_t counts[4];
};

Pass emulated_compress(akv_context *ctx, const akv_prefill &prefill, const akv_compress_options &o, bool profiling) {
  const akv::MethodPlan plan = akv::plan_method(o, prefill.shape);
  const akv::CompressRequest req{ctx, &prefill, &o, &plan};
  Pass run{akv::new_cache(req), {}};
  const std::vector<int32_t> positions = akv::prepare_anchor_cache(prefill, plan.anchor, o, *run.cache);
  run.cache->data = akv::Buffer(ctx, run.cache->layout.total_bytes);
  const akv::AnchorGeometry &g = run.cache->geometry;
  kc::CompressScratch measure;
  std::vector<uint8_t> scratch(measure.carve(nullptr, g.seq_len, g.prefix, g.heads, g.dim, g.group() * g.window,
                                             g.anchors, run.cache->rope.enabled() ? run.cache->rope.pairs() : 0) +
                                   256,
                               0xA5);
  uint8_t *base = reinterpret_cast<uint8_t *>((reinterpret_cast<uintptr_t>(scratch.data()) + 255) / 256 * 256);
  akv_test::EmulatedDevice dev;
  dev.profiling = profiling;
  kc::compress_anchorkv(dev, prefill, o, *run.cache, positions, run.cache->data.data(), base);
  std::memcpy(run.counts, dev.search_counts, sizeof run.counts);
  return run;
}

TEST(EmulatedSearchShares, OnSyntheticEvalData) {
  for (int64_t S : {int64_t{32768}}) {
    SCOPED_TRACE("S=" + std::to_string(S));
    akvcli::SyntheticConfig config;
    config.shape.layers = 1;
    config.shape.seq_len = S;
    config.shape.heads = 1;
    config.shape.q_heads = 4;
    config.shape.head_dim = 128;
    config.shape.window = 32;
    config.dtype = AKV_DTYPE_BF16;
    akvcli::SyntheticSource source(config);
    const akvcli::LayerTensors t = source.load(0);
    std::vector<uint16_t> keys, values, queries;
    for (const auto &[from, to] : {std::pair{&t.keys, &keys}, {&t.values, &values}, {&t.q_window, &queries}})
      for (float x : *from) to->push_back(akv::float_to_bf16(x));

    akv_context *raw = nullptr;
    akv_context_options co;
    akv_context_options_init(&co);
    co.num_threads = 2;
    ASSERT_EQ(akv_context_create(&co, &raw), AKV_OK);
    std::unique_ptr<akv_context, decltype(&akv_context_destroy)> ctx(raw, akv_context_destroy);
    akv_prefill p;
    akv_prefill_init(&p);
    p.shape.seq_len = S;
    p.shape.num_kv_heads = 1;
    p.shape.num_q_heads = 4;
    p.shape.head_dim = 128;
    p.dtype = AKV_DTYPE_BF16;
    p.keys = keys.data();
    p.values = values.data();
    p.queries = queries.data();
    akv_compress_options o;
    akv_compress_options_init(&o);  // the defaults: format 3, 16 coverage rounds
    o.retain_fraction = 0.05;       // 20x

    const Pass counted = emulated_compress(ctx.get(), p, o, true);
    const Pass plain = emulated_compress(ctx.get(), p, o, false);
    ASSERT_EQ(counted.cache->data.size(), plain.cache->data.size());
    EXPECT_EQ(std::memcmp(counted.cache->data.data(), plain.cache->data.data(), plain.cache->data.size()), 0)
        << "profiling changed the cache";
    const uint32_t *c = counted.counts;
    const akv::AnchorGeometry &g = counted.cache->geometry;
    // Every prefix token is searched once a side and round (each had a best from the first
    // absorb: the window's tokens are every token's candidates).
    EXPECT_EQ(c[0], 2u * o.coverage_rounds * g.prefix);
    EXPECT_LE(c[1], c[0]);
    EXPECT_LE(c[3], c[0] - c[1]);
    const double searched = c[0] - c[1];
    std::printf("S=%lld k=%d: rounds' searches: %.3f of %u tokens left alone; per token searched %.2f candidates "
                "rescored, %.3f full scans\n",
                static_cast<long long>(S), g.anchors, c[1] / static_cast<double>(c[0]), c[0],
                searched > 0 ? c[2] / searched : 0.0, searched > 0 ? c[3] / searched : 0.0);
    RecordProperty("left_alone_S" + std::to_string(S), std::to_string(c[1] / static_cast<double>(c[0])));
    RecordProperty("rescored_per_searched_S" + std::to_string(S), std::to_string(searched > 0 ? c[2] / searched : 0.0));
  }
}

}  // namespace
