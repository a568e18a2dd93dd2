// What inference engines need beyond one contiguous layer (docs/engines.md, "Paged caches,
// head dims, model sizing, tensor parallelism"): compression straight from a paged cache,
// head_dim 80/96/112, the sizing of a whole model before prefill, and per-rank pooling when
// KV heads are split over tensor-parallel ranks.
#include "api/paged_util.hpp"

namespace {

using namespace akv_test;

akv_compress_options method_options(akv_method method, double theta) {
  akv_compress_options o;
  akv_compress_options_init_method(&o, method);
  o.retain_fraction = method == AKV_METHOD_QUANTIZED ? 1.0 : theta;
  return o;
}

// ---- 1. Compression from a paged cache ---------------------------------------------------------

struct PagedCase {
  akv_method method;
  bool paper;  // ANCHORKV: akv_compress_options_init_paper instead of the defaults
  akv_dtype dtype;
  int32_t block_size;
  bool head_major;
};

TEST(PagedPrefill, SerializesToTheSameBytesAsTheContiguousPrefill) {
  const PagedCase cases[] = {
      {AKV_METHOD_ANCHORKV, false, AKV_DTYPE_BF16, 16, false}, {AKV_METHOD_ANCHORKV, true, AKV_DTYPE_F32, 7, false},
      {AKV_METHOD_ANCHORKV, false, AKV_DTYPE_F16, 1, false},   {AKV_METHOD_ANCHORKV, false, AKV_DTYPE_BF16, 32, true},
      {AKV_METHOD_FULLKV, false, AKV_DTYPE_BF16, 16, false},   {AKV_METHOD_SNAPKV, false, AKV_DTYPE_F32, 5, false},
      {AKV_METHOD_ADAKV, false, AKV_DTYPE_BF16, 16, true},     {AKV_METHOD_QUANTIZED, false, AKV_DTYPE_BF16, 16, false},
  };
  const uint64_t seed = fresh_seed();
  AKV_TRACE_SEED(seed);
  Rng rng(seed);
  ContextPtr ctx = make_context(2);
  for (const PagedCase &c : cases) {
    SCOPED_TRACE(std::string("method ") + std::to_string(c.method) + (c.paper ? " (paper)" : "") + " dtype " +
                 dtype_name(c.dtype) + " block " + std::to_string(c.block_size) + (c.head_major ? " head-major" : ""));
    PrefillSpec spec;
    spec.seq_len = 300 + rng.uniform_int(0, 60);  // not a multiple of the block size, mostly
    spec.kv_heads = 3;
    spec.group = 2;
    spec.dtype = c.dtype;
    spec.window = c.method == AKV_METHOD_SNAPKV || c.method == AKV_METHOD_ADAKV ? 64 : 32;
    spec.explicit_positions = rng.uniform_int(0, 1) == 1;
    const PrefillData data = make_prefill(rng, spec);
    akv_compress_options o = method_options(c.method, 0.3);
    if (c.paper) {
      akv_compress_options_init_paper(&o);
      o.retain_fraction = 0.3;
    }
    o.window = spec.window;
    if (spec.explicit_positions) o.storage_format = 2;  // gapped positions (format 3 needs them consecutive)
    CachePtr contiguous = compress(ctx.get(), data, o);
    const PagedKV paged = make_paged(rng, data, c.block_size, c.head_major);
    const akv_prefill view = paged.view(data);
    akv_cache *raw = nullptr;
    ASSERT_EQ(akv_compress(ctx.get(), &view, &o, &raw, nullptr), AKV_OK) << akv_last_error_message();
    CachePtr from_pages(raw);
    EXPECT_TRUE(serialize(from_pages.get()) == serialize(contiguous.get()));
  }
}

// A paged prefill read with the wrong block (an id off by one) meets the NaN blocks: the check
// above can fail.
TEST(PagedPrefill, AWrongBlockIsRead) {
  const uint64_t seed = fresh_seed();
  AKV_TRACE_SEED(seed);
  Rng rng(seed);
  ContextPtr ctx = make_context(2);
  PrefillSpec spec;
  spec.seq_len = 200;
  spec.dtype = AKV_DTYPE_BF16;
  const PrefillData data = make_prefill(rng, spec);
  PagedKV paged = make_paged(rng, data, 16, false);
  std::vector<bool> used(paged.num_blocks, false);
  for (int32_t id : paged.table) used[id] = true;
  for (int32_t id = 0; id < paged.num_blocks; ++id)
    if (!used[id]) {
      paged.table[rng.uniform_int(0, static_cast<int64_t>(paged.table.size()) - 1)] = id;
      break;
    }
  const akv_prefill view = paged.view(data);
  const akv_compress_options o = method_options(AKV_METHOD_ANCHORKV, 0.3);
  akv_cache *raw = nullptr;
  EXPECT_EQ(akv_compress(ctx.get(), &view, &o, &raw, nullptr), AKV_ERR_NON_FINITE);
  EXPECT_EQ(raw, nullptr);
}

TEST(PagedPrefill, BadTablesAreRefusedWithAMessage) {
  const uint64_t seed = fresh_seed();
  AKV_TRACE_SEED(seed);
  Rng rng(seed);
  ContextPtr ctx = make_context(1);
  PrefillSpec spec;
  spec.seq_len = 100;
  const PrefillData data = make_prefill(rng, spec);
  const PagedKV paged = make_paged(rng, data, 16, false);
  const akv_compress_options o = method_options(AKV_METHOD_ANCHORKV, 0.5);
  std::vector<int32_t> table = paged.table;
  struct Bad {
    const char *name, *message;
    void (*damage)(akv_prefill &, std::vector<int32_t> &);
  };
  const Bad bad[] = {
      {"null table", "block_table is NULL", [](akv_prefill &p, std::vector<int32_t> &) { p.block_table = nullptr; }},
      {"zero block size", "block_size 0", [](akv_prefill &p, std::vector<int32_t> &) { p.block_size = 0; }},
      {"no blocks", "num_blocks 0", [](akv_prefill &p, std::vector<int32_t> &) { p.num_blocks = 0; }},
      {"negative stride", "kv_block_stride -1", [](akv_prefill &p, std::vector<int32_t> &) { p.kv_block_stride = -1; }},
      {"id too large", "is outside [0, num_blocks",
       [](akv_prefill &p, std::vector<int32_t> &t) {
         t.back() = p.num_blocks;
         p.block_table = t.data();
       }},
      {"negative id", "block_table[0] = -1",
       [](akv_prefill &p, std::vector<int32_t> &t) {
         t.front() = -1;
         p.block_table = t.data();
       }},
  };
  for (const Bad &b : bad) {
    SCOPED_TRACE(b.name);
    akv_prefill view = paged.view(data);
    table = paged.table;
    b.damage(view, table);
    akv_cache *raw = nullptr;
    EXPECT_EQ(akv_compress(ctx.get(), &view, &o, &raw, nullptr), AKV_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(raw, nullptr);
    EXPECT_NE(std::string(akv_last_error_message()).find(b.message), std::string::npos) << akv_last_error_message();
  }
}

// ---- 2. head_dim 80, 96, 112 ------------------------------------------------------------------

double mean_cosine(const std::vector<float> &a, const std::vector<double> &b, int rows, int D) {
  double sum = 0.0;
  for (int r = 0; r < rows; ++r) {
    double ab = 0.0, aa = 0.0, bb = 0.0;
    for (int d = 0; d < D; ++d) {
      const double x = a[static_cast<size_t>(r) * D + d], y = b[static_cast<size_t>(r) * D + d];
      ab += x * y, aa += x * x, bb += y * y;
    }
    sum += ab / std::sqrt(aa * bb);
  }
  return sum / rows;
}

// The codec pads these head dims to 128: the accounting charges D'/4 code bytes per residual
// (QUANTIZED: D'*bits/8 per token), the budget still holds, decode agrees with attention over
// the reconstructed cache, serialization keeps the codes, and the padded residuals help:
// with most tokens holding both residuals the output is clearly closer to the exact one than
// with a handful. Cosines averaged over 8 queries per head.
TEST(HeadDims, NonPowerOfTwoDimsArePaddedAndStayWithinBudget) {
  const uint64_t seed = fresh_seed();
  AKV_TRACE_SEED(seed);
  Rng rng(seed);
  ContextPtr ctx = make_context(2);
  for (akv_method method : {AKV_METHOD_ANCHORKV, AKV_METHOD_QUANTIZED}) {
    for (int D : {80, 96, 112}) {
      SCOPED_TRACE("method " + std::to_string(method) + " D=" + std::to_string(D));
      PrefillSpec spec;
      spec.seq_len = 600;
      spec.kv_heads = 2;
      spec.group = 2;
      spec.head_dim = D;
      spec.dtype = AKV_DTYPE_BF16;
      akv_compress_options o = method_options(method, 0.3);
      if (method == AKV_METHOD_ANCHORKV) {  // fixed anchors: the budget buys residuals only
        akv_compress_options_init_paper(&o);
        o.retain_fraction = 0.3;
        o.anchors = 64;
      }
      spec.window = o.window;
      const PrefillData data = make_prefill(rng, spec);
      const int Hq = data.q_heads();
      const AttentionShape shape{spec.kv_heads, Hq, D, spec.seq_len, 1};
      const double scale = effective_softmax_scale(o, D);
      CachePtr full = compress(ctx.get(), data, method_options(AKV_METHOD_FULLKV, 1.0));
      const Dense exact = reconstruct(full.get(), 1);
      std::vector<Tensor> queries;
      for (int draw = 0; draw < 8; ++draw)
        queries.push_back(make_tensor(nonzero_normal(rng, static_cast<size_t>(Hq) * D, 1.5), AKV_DTYPE_F32));
      // Mean cosine to the exact output over the queries; checks decode against the reconstruction.
      auto fidelity = [&](akv_cache *cache) {
        const Dense dense = reconstruct(cache, 1);
        double cosine = 0.0;
        for (const Tensor &q : queries) {
          const std::vector<float> out = decode(cache, q, 1);
          EXPECT_TRUE(all_near(out, reference_attention(dense.keys, dense.values, q.values, shape, scale), 2e-3, 2e-3));
          cosine += mean_cosine(out, reference_attention(exact.keys, exact.values, q.values, shape, scale), Hq, D);
        }
        return cosine / static_cast<double>(queries.size());
      };

      size_t predicted = 0;
      ASSERT_EQ(akv_compressed_size(&o, &data.shape, &predicted), AKV_OK) << akv_last_error_message();
      CachePtr cache = compress(ctx.get(), data, o);
      const akv_cache_stats st = cache_stats(cache.get());
      EXPECT_EQ(st.compressed_bytes, predicted);
      EXPECT_EQ(st.full_bytes, 4ull * spec.seq_len * spec.kv_heads * D);
      EXPECT_LE(st.compressed_bytes, static_cast<uint64_t>(std::floor(o.retain_fraction * st.full_bytes)));
      const double cosine = fidelity(cache.get());
      const std::vector<uint8_t> bytes = serialize(cache.get());
      CachePtr copy = deserialize(ctx.get(), bytes);
      EXPECT_TRUE(serialize(copy.get()) == bytes);
      EXPECT_TRUE(decode(copy.get(), queries[0], 1) == decode(cache.get(), queries[0], 1));
      const std::string name = std::string(method == AKV_METHOD_ANCHORKV ? "anchorkv" : "quantized") + "_D" +
                               std::to_string(D);
      note(name + "_cosine", cosine);
      if (method == AKV_METHOD_QUANTIZED) {
        EXPECT_GT(cosine, 0.93);
        continue;
      }
      EXPECT_EQ(st.compressed_bytes - st.base_bytes,
                static_cast<uint64_t>(st.key_residuals * (128 / 4 + 4) + st.value_residuals * (128 / 4 + 5)));
      const int64_t candidates = int64_t{spec.kv_heads} * (spec.seq_len - 64);  // non-anchor tokens
      EXPECT_GT(st.key_residuals, candidates / 2);
      EXPECT_GT(st.value_residuals, candidates / 2);
      akv_compress_options few = o;  // just above the anchors' bytes: a handful of residuals
      few.retain_fraction = workable_retain_fraction(data.shape, o.window, o.anchors, 0.002);
      CachePtr sparse = compress(ctx.get(), data, few);
      EXPECT_LT(cache_stats(sparse.get()).key_residuals, candidates / 4);
      const double sparse_cosine = fidelity(sparse.get());
      note(name + "_cosine_few_residuals", sparse_cosine);
      EXPECT_GT(cosine, sparse_cosine + 0.03);
    }
  }
}

// ---- 3. Sizing a whole model -----------------------------------------------------------------

// The model's bytes are the per-layer akv_compressed_size (PyramidKV's budgets differ by
// layer), and what compressing each layer really holds.
TEST(ModelSize, IsTheSumOfTheLayersCompressedBytes) {
  const uint64_t seed = fresh_seed();
  AKV_TRACE_SEED(seed);
  Rng rng(seed);
  ContextPtr ctx = make_context(2);
  const int32_t L = 4;
  for (akv_method method : {AKV_METHOD_ANCHORKV, AKV_METHOD_PYRAMIDKV, AKV_METHOD_QUANTIZED}) {
    SCOPED_TRACE("method " + std::to_string(method));
    PrefillSpec spec;
    spec.seq_len = 400 + rng.uniform_int(0, 200);
    spec.kv_heads = 2;
    spec.group = 2;
    akv_compress_options o = method_options(method, 0.25);
    spec.window = method == AKV_METHOD_QUANTIZED ? 32 : o.window;
    o.window = spec.window;
    std::vector<double> fractions(L);
    for (double &f : fractions) f = method == AKV_METHOD_QUANTIZED ? 1.0 : rng.uniform(0.2, 0.4);
    const PrefillData data = make_prefill(rng, spec);
    std::vector<size_t> layer_bytes(L, 0);
    size_t total = 0;
    ASSERT_EQ(akv_compressed_size_model(&o, &data.shape, L, fractions.data(), layer_bytes.data(), &total), AKV_OK)
        << akv_last_error_message();
    size_t sum = 0;
    for (int32_t l = 0; l < L; ++l) {
      akv_compress_options layer = o;
      layer.layer_index = l;
      layer.layer_count = L;
      layer.retain_fraction = fractions[l];
      size_t bytes = 0;
      ASSERT_EQ(akv_compressed_size(&layer, &data.shape, &bytes), AKV_OK);
      EXPECT_EQ(layer_bytes[l], bytes) << "layer " << l;
      CachePtr cache = compress(ctx.get(), data, layer);
      EXPECT_EQ(cache_stats(cache.get()).compressed_bytes, bytes) << "layer " << l;
      sum += bytes;
    }
    EXPECT_EQ(total, sum);
    if (method == AKV_METHOD_PYRAMIDKV) EXPECT_NE(layer_bytes.front(), layer_bytes.back());
    // Without per-layer fractions every layer takes options.retain_fraction.
    size_t uniform = 0;
    ASSERT_EQ(akv_compressed_size_model(&o, &data.shape, L, nullptr, nullptr, &uniform), AKV_OK);
    size_t one = 0;
    ASSERT_EQ(akv_compressed_size(&o, &data.shape, &one), AKV_OK);
    if (method != AKV_METHOD_PYRAMIDKV) EXPECT_EQ(uniform, one * L);
  }
}

TEST(ModelSize, BadInputIsRefusedWithAMessage) {
  akv_compress_options o = method_options(AKV_METHOD_ANCHORKV, 0.2);
  const akv_shape shape{4096, 8, 32, 128};
  size_t total = 0;
  EXPECT_EQ(akv_compressed_size_model(&o, &shape, 0, nullptr, nullptr, &total), AKV_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(akv_last_error_message()).find("num_layers 0"), std::string::npos);
  EXPECT_EQ(akv_compressed_size_model(&o, nullptr, 2, nullptr, nullptr, &total), AKV_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(akv_compressed_size_model(&o, &shape, 2, nullptr, nullptr, nullptr), AKV_ERR_INVALID_ARGUMENT);
  const double bad[3] = {0.2, 1.5, 0.2};
  EXPECT_EQ(akv_compressed_size_model(&o, &shape, 3, bad, nullptr, &total), AKV_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(akv_last_error_message()).find("retain_fractions[1]"), std::string::npos);
  const double tight[3] = {0.2, 0.2, 0.001};
  EXPECT_EQ(akv_compressed_size_model(&o, &shape, 3, tight, nullptr, &total), AKV_ERR_BUDGET);
  const std::string message = akv_last_error_message();
  EXPECT_NE(message.find("layer 2"), std::string::npos) << message;
  EXPECT_NE(message.find("smallest workable retain_fraction"), std::string::npos) << message;
}

// ---- 4. Tensor parallelism ----------------------------------------------------------------------

// The heads [first, first + count) of a prefill as a rank holds them (a view into the same
// tensors through the head strides, queries of the heads' GQA groups).
akv_prefill rank_view(const PrefillData &data, int first, int count) {
  akv_prefill p = data.view();
  const int64_t S = data.seq_len(), D = data.head_dim();
  const int G = data.q_heads() / data.kv_heads();
  const size_t es = dtype_size(data.dtype);
  p.shape.num_kv_heads = count;
  p.shape.num_q_heads = count * G;
  p.kv_head_stride = S * D;
  p.keys = data.keys.bytes.data() + static_cast<size_t>(first) * S * D * es;
  p.values = data.values.bytes.data() + static_cast<size_t>(first) * S * D * es;
  p.queries = data.queries.bytes.data() + static_cast<size_t>(first) * G * data.window * D * es;
  return p;
}

CachePtr compress_view(akv_context *ctx, const akv_prefill &p, const akv_compress_options &o) {
  akv_cache *raw = nullptr;
  ok(akv_compress(ctx, &p, &o, &raw, nullptr), "akv_compress");
  return CachePtr(raw);
}

// Two ranks of half the KV heads each decode exactly like the two halves of one call that
// pools per rank (pool_heads = H/2); the one call's cache serializes with its pooling group.
TEST(TensorParallel, HalfHeadCachesDecodeLikeOneCallPooledPerRank) {
  const uint64_t seed = fresh_seed();
  AKV_TRACE_SEED(seed);
  Rng rng(seed);
  ContextPtr ctx = make_context(2);
  for (bool paper : {false, true}) {
    SCOPED_TRACE(paper ? "paper options (seeded anchor sample)" : "default options");
    PrefillSpec spec;
    spec.seq_len = 600 + rng.uniform_int(0, 200);
    spec.kv_heads = 4;
    spec.group = 2;
    spec.dtype = AKV_DTYPE_BF16;
    const PrefillData data = make_prefill(rng, spec);
    akv_compress_options o;
    if (paper) akv_compress_options_init_paper(&o);
    else akv_compress_options_init(&o);
    o.retain_fraction = 0.25;
    o.anchors = 64;  // 32 anchors beyond the window: the sample is not empty
    o.seed = rng.next();
    akv_compress_options whole = o;
    whole.pool_heads = 2;
    CachePtr one_call = compress(ctx.get(), data, whole);
    CachePtr ranks[2];
    for (int r = 0; r < 2; ++r) {
      akv_compress_options rank = o;
      rank.head_offset = 2 * r;
      ranks[r] = compress_view(ctx.get(), rank_view(data, 2 * r, 2), rank);
    }
    const akv_cache_stats all = cache_stats(one_call.get()), r0 = cache_stats(ranks[0].get()),
                          r1 = cache_stats(ranks[1].get());
    EXPECT_EQ(all.key_residuals, r0.key_residuals + r1.key_residuals);
    EXPECT_EQ(all.value_residuals, r0.value_residuals + r1.value_residuals);
    EXPECT_EQ(r0.compressed_bytes, r1.compressed_bytes);
    EXPECT_LE(all.compressed_bytes, all.budget_bytes);
    size_t predicted = 0;
    ASSERT_EQ(akv_compressed_size(&whole, &data.shape, &predicted), AKV_OK);
    EXPECT_EQ(all.compressed_bytes, predicted);

    const int Hq = data.q_heads(), D = data.head_dim();
    const Tensor q = make_tensor(nonzero_normal(rng, static_cast<size_t>(Hq) * D, 1.5), AKV_DTYPE_F32);
    Tensor halves[2];
    for (int r = 0; r < 2; ++r)
      halves[r] = make_tensor(std::vector<float>(q.values.begin() + r * Hq / 2 * D, q.values.begin() + (r + 1) * Hq / 2 * D),
                              AKV_DTYPE_F32);
    const std::vector<float> joint = decode(one_call.get(), q, 1);
    std::vector<float> split = decode(ranks[0].get(), halves[0], 1);
    const std::vector<float> second = decode(ranks[1].get(), halves[1], 1);
    split.insert(split.end(), second.begin(), second.end());
    EXPECT_TRUE(all_near(split, joint, 1e-6, 1e-6));

    // The pooling group survives serialization (format 2).
    CachePtr copy = deserialize(ctx.get(), serialize(one_call.get()));
    EXPECT_TRUE(decode(copy.get(), q, 1) == joint);

    if (paper) {  // the seeded sample is keyed by the model-wide head: rank 1 needs its offset
      CachePtr unkeyed = compress_view(ctx.get(), rank_view(data, 2, 2), o);
      EXPECT_FALSE(all_near(decode(unkeyed.get(), halves[1], 1), second, 1e-6, 1e-6));
    }
  }
}

TEST(TensorParallel, BadPoolingIsRefusedWithAMessage) {
  const akv_shape shape{2048, 4, 8, 64};
  akv_compress_options o = method_options(AKV_METHOD_ANCHORKV, 0.2);
  size_t bytes = 0;
  o.pool_heads = 3;
  EXPECT_EQ(akv_compressed_size(&o, &shape, &bytes), AKV_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(akv_last_error_message()).find("must divide num_kv_heads 4"), std::string::npos);
  o.pool_heads = -1;
  EXPECT_EQ(akv_compressed_size(&o, &shape, &bytes), AKV_ERR_INVALID_ARGUMENT);
  o.pool_heads = 0;
  o.head_offset = -4;
  EXPECT_EQ(akv_compressed_size(&o, &shape, &bytes), AKV_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(akv_last_error_message()).find("head_offset -4"), std::string::npos);
  akv_compress_options snap = method_options(AKV_METHOD_ADAKV, 0.2);
  snap.pool_heads = 2;
  EXPECT_EQ(akv_compressed_size(&snap, &shape, &bytes), AKV_ERR_UNSUPPORTED);
  EXPECT_NE(std::string(akv_last_error_message()).find("AnchorKV only"), std::string::npos);
  snap.pool_heads = 4;  // one group of every head: what the method does anyway
  EXPECT_EQ(akv_compressed_size(&snap, &shape, &bytes), AKV_OK);
}

}  // namespace
