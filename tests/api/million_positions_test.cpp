// A million prompt positions on the CPU backend: compression (format 3 with segment tables),
// decode against exact attention over the reconstructed cache, appends, and a serialization
// round trip. Nothing in the layout, the accounting or the decode may overflow at this length.
#include "api/api_test_util.hpp"
#include "common/attention.hpp"

namespace {

using namespace akv_test;

TEST(SlowMillionPositions, CompressDecodeAppendAndSerialize) {
  const uint64_t seed = fresh_seed();
  AKV_TRACE_SEED(seed);
  Rng rng(seed);
  PrefillSpec spec;
  spec.seq_len = int64_t{1} << 20;
  spec.kv_heads = 1;
  spec.group = 2;
  spec.head_dim = 64;
  const PrefillData data = make_prefill(rng, spec);
  akv_compress_options o = anchorkv_options(0.05);
  o.storage_format = 3;
  o.anchors = 300;  // segment tables (k > 256) without the default's S x k compression cost
  const ContextPtr ctx = make_context(2);
  const CachePtr cache = compress(ctx.get(), data, o);
  const akv_cache_stats st = cache_stats(cache.get());
  EXPECT_EQ(st.storage_format, 3);
  EXPECT_GT(st.segment_tokens, 0) << "meant to run with segment tables";
  size_t predicted = 0;
  ok(akv_compressed_size(&o, &data.shape, &predicted), "akv_compressed_size");
  EXPECT_EQ(st.compressed_bytes, predicted);

  const int H = 1, Hq = 2, D = 64, appended = 3;
  const std::vector<float> k = llm_like_keys(rng, H, appended, D), v = nonzero_normal(rng, size_t{H} * appended * D);
  ok(akv_append(cache.get(), k.data(), v.data(), AKV_DTYPE_F32, appended, nullptr, nullptr), "akv_append");
  const Tensor q = make_tensor(nonzero_normal(rng, size_t{Hq} * D, 1.5), AKV_DTYPE_F32);
  const std::vector<float> got = decode(cache.get(), q, 1);
  const Dense rotated = reconstruct(cache.get(), 1);
  const AttentionShape shape{H, Hq, D, spec.seq_len + appended, 1};
  const std::vector<double> want =
      reference_attention(rotated.keys, rotated.values, q.values, shape, effective_softmax_scale(o, D));
  EXPECT_TRUE(all_near(got, want, 2e-5, 1e-4));

  const CachePtr back = deserialize(ctx.get(), serialize(cache.get()));
  EXPECT_EQ(decode(back.get(), q, 1), got) << "the round trip decodes bit for bit";
}

}  // namespace
