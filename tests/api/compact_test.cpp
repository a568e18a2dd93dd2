// akv_cache_compact and the automatic policy (compact_after): the budget contract after
// compaction, fidelity against a one-shot compression at the same length, the old prompt's
// representation kept, serialization of compacted caches, bad input leaving the cache as it
// was, and the policy doing what the explicit call does.
#include "api/api_test_util.hpp"

namespace akv_test {
namespace {

// One sequence of T = S + L tokens: the prompt is compressed at S, the rest appended.
struct Generation {
  PrefillData full;        // all T tokens (its queries: the last W positions of T)
  PrefillData prompt;      // the first S tokens (its queries: fresh, positions S-W..S-1)
  std::vector<float> appended_keys, appended_values;  // [H][L][D], pre-RoPE
  int64_t S = 0, L = 0;
};

std::vector<float> rows(const std::vector<float> &x, int H, int64_t T, int D, int64_t from, int64_t count) {
  std::vector<float> out(static_cast<size_t>(H) * count * D);
  for (int h = 0; h < H; ++h)
    std::copy_n(&x[(h * T + from) * D], count * D, &out[h * count * D]);
  return out;
}

Generation make_generation(uint64_t seed, int64_t S, int64_t L, int H = 2, int G = 2, int D = 64) {
  Rng rng(seed);
  Generation g;
  g.S = S;
  g.L = L;
  PrefillSpec spec;
  spec.seq_len = S + L;
  spec.kv_heads = H;
  spec.group = G;
  spec.head_dim = D;
  g.full = make_prefill(rng, spec);
  const int64_t T = S + L;
  g.prompt = g.full;
  g.prompt.shape.seq_len = S;
  g.prompt.positions.resize(S);
  g.prompt.keys = make_tensor(rows(g.full.keys.values, H, T, D, 0, S), AKV_DTYPE_F32);
  g.prompt.values = make_tensor(rows(g.full.values.values, H, T, D, 0, S), AKV_DTYPE_F32);
  g.prompt.queries = make_tensor(nonzero_normal(rng, static_cast<size_t>(H) * G * spec.window * D, 1.5), AKV_DTYPE_F32);
  g.appended_keys = rows(g.full.keys.values, H, T, D, S, L);
  g.appended_values = rows(g.full.values.values, H, T, D, S, L);
  return g;
}

akv_compress_options defaults(double theta) {
  akv_compress_options o;
  akv_compress_options_init(&o);
  o.retain_fraction = theta;
  return o;
}

void append_all(akv_cache *cache, const Generation &g) {
  ok(akv_append(cache, g.appended_keys.data(), g.appended_values.data(), AKV_DTYPE_F32, static_cast<int32_t>(g.L),
                nullptr, nullptr),
     "akv_append");
}

// Mean cosine between a cache's decode and the exact (FullKV) decode of held-out queries.
double fidelity(akv_cache *cache, akv_cache *exact, const Tensor &probes, int Hq, int D) {
  const std::vector<float> a = decode(cache, probes, 1), b = decode(exact, probes, 1);
  double sum = 0.0;
  for (int r = 0; r < Hq; ++r) {
    double ab = 0, aa = 0, bb = 0;
    for (int d = 0; d < D; ++d) {
      ab += static_cast<double>(a[r * D + d]) * b[r * D + d];
      aa += static_cast<double>(a[r * D + d]) * a[r * D + d];
      bb += static_cast<double>(b[r * D + d]) * b[r * D + d];
    }
    sum += ab / std::sqrt(aa * bb);
  }
  return sum / Hq;
}

TEST(Compact, FoldsTheSuffixWithinTheBudgetOfTheTotalLength) {
  AKV_TRACE_SEED(71);
  const Generation g = make_generation(71, 1024, 512);
  ContextPtr ctx = make_context(2);
  const akv_compress_options o = defaults(0.15);
  CachePtr cache = compress(ctx.get(), g.prompt, o);
  append_all(cache.get(), g);
  const akv_cache_stats before = cache_stats(cache.get());
  ASSERT_EQ(before.appended_tokens, 512);
  ok(akv_cache_compact(cache.get(), g.full.queries.data(), AKV_DTYPE_F32, 0, nullptr), "akv_cache_compact");
  const akv_cache_stats s = cache_stats(cache.get());
  const int64_t T = 1536;
  const uint64_t full = 4ull * T * 2 * 64;
  EXPECT_EQ(s.shape.seq_len, T);
  EXPECT_EQ(s.appended_tokens, 0);
  EXPECT_EQ(s.compactions, 1);
  EXPECT_EQ(s.full_bytes, full);
  EXPECT_LE(s.compressed_bytes, static_cast<uint64_t>(std::floor(0.15 * full)));
  EXPECT_GT(s.compressed_bytes, before.compressed_bytes);  // the budget grew with T: it is spent
  EXPECT_GE(s.anchors, before.anchors);
  // The new window is the last W appended tokens, exact (bf16 of the input).
  const Dense d = reconstruct(cache.get(), 0);
  ASSERT_EQ(d.tokens, T);
  for (int h = 0; h < 2; ++h)
    for (int64_t t = T - 32; t < T; ++t)
      for (int i = 0; i < 64; ++i)
        ASSERT_NEAR(d.key_row(h, t)[i], g.full.keys_pre_rope[(h * T + t) * 64 + i],
                    1e-2 * (1 + std::fabs(g.full.keys_pre_rope[(h * T + t) * 64 + i])));
}

TEST(Compact, KeepsTheOldPromptsRepresentation) {
  AKV_TRACE_SEED(72);
  const Generation g = make_generation(72, 1024, 256);
  ContextPtr ctx = make_context(2);
  CachePtr cache = compress(ctx.get(), g.prompt, defaults(0.15));
  append_all(cache.get(), g);
  const int anchors_before = cache_stats(cache.get()).anchors;
  const Dense before = reconstruct(cache.get(), 0);
  ok(akv_cache_compact(cache.get(), g.full.queries.data(), AKV_DTYPE_F32, 0, nullptr), "akv_cache_compact");
  const int anchors_after = cache_stats(cache.get()).anchors;
  ASSERT_GE(anchors_after, anchors_before);
  const Dense after = reconstruct(cache.get(), 0);
  // The old anchors (the prompt tokens stored exactly: keys and values equal to the input in
  // bf16, the window included) keep the new non-window slots the appended tokens' share
  // leaves; the other old tokens move only where a residual is dropped or added.
  const int64_t T = g.S + g.L;
  auto exact = [&](const Dense &d, int h, int64_t t) {
    for (int i = 0; i < 64; ++i) {
      const float want = g.full.keys_pre_rope[(h * T + t) * 64 + i], got = d.key_row(h, t)[i];
      if (std::fabs(got - want) > 1e-2f * (1.0f + std::fabs(want))) return false;
      if (d.value_row(h, t)[i] != round_to_dtype(g.full.values.values[(h * T + t) * 64 + i], AKV_DTYPE_BF16))
        return false;
    }
    return true;
  };
  int64_t exact_before = 0, still_exact = 0;
  double moved = 0.0, size = 0.0;
  for (int h = 0; h < 2; ++h)
    for (int64_t t = 0; t < g.S; ++t) {
      if (exact(before, h, t)) {
        ++exact_before;
        still_exact += exact(after, h, t);
      }
      for (int i = 0; i < 64; ++i) {
        const double x = before.key_row(h, t)[i], y = after.key_row(h, t)[i];
        moved += (x - y) * (x - y);
        size += x * x;
      }
    }
  EXPECT_GE(exact_before, 2 * anchors_before);  // the anchors and the window, both heads
  // The appended tokens get their share of the non-window slots (their fraction of T - W),
  // the old anchors the rest.
  const int64_t free_slots = anchors_after - 32;
  const int64_t share = std::llround(free_slots * static_cast<double>(g.L - 32) / (T - 32));
  EXPECT_GE(still_exact, std::min<int64_t>(exact_before, 2 * (free_slots - share)));
  note("old_tokens_moved_energy", moved / size);
  EXPECT_LT(moved / size, 0.15);
}

TEST(Compact, FidelityMatchesAOneShotCompressionAtTheSameLength) {
  AKV_TRACE_SEED(73);
  const Generation g = make_generation(73, 1536, 512);
  ContextPtr ctx = make_context(2);
  const double theta = 0.15;
  CachePtr compacted = compress(ctx.get(), g.prompt, defaults(theta));
  append_all(compacted.get(), g);
  CachePtr dense_suffix = compress(ctx.get(), g.prompt, defaults(theta));
  append_all(dense_suffix.get(), g);
  ok(akv_cache_compact(compacted.get(), g.full.queries.data(), AKV_DTYPE_F32, 0, nullptr), "akv_cache_compact");
  CachePtr one_shot = compress(ctx.get(), g.full, defaults(theta));
  CachePtr exact = compress(ctx.get(), g.full, fullkv_options());
  // Probes that look at one token each (its exact post-RoPE key, scaled to logit 8), anywhere
  // in the sequence: a query the window did not single out.
  const Dense keys = reconstruct(exact.get(), 1);
  Rng rng(731);
  const int Hq = 4, D = 64;
  const int64_t T = g.S + g.L;
  double f_compacted = 0, f_one_shot = 0, f_dense = 0;
  const int probes = 48;
  for (int i = 0; i < probes; ++i) {
    std::vector<float> probe(static_cast<size_t>(Hq) * D);
    for (int hq = 0; hq < Hq; ++hq) {
      const float *k = keys.key_row(hq / 2, rng.uniform_int(0, T - 1));
      double n2 = 0;
      for (int d = 0; d < D; ++d) n2 += static_cast<double>(k[d]) * k[d];
      for (int d = 0; d < D; ++d) probe[hq * D + d] = static_cast<float>(8.0 * std::sqrt(D) / n2 * k[d]);
    }
    const Tensor q = make_tensor(probe, AKV_DTYPE_F32);
    f_compacted += fidelity(compacted.get(), exact.get(), q, Hq, D) / probes;
    f_one_shot += fidelity(one_shot.get(), exact.get(), q, Hq, D) / probes;
    f_dense += fidelity(dense_suffix.get(), exact.get(), q, Hq, D) / probes;
  }
  note("compacted_mean_cos", f_compacted);
  note("one_shot_mean_cos", f_one_shot);
  note("dense_suffix_mean_cos", f_dense);
  // Same length, same budget: compaction loses at most a little to compressing in one go
  // (these single-token probes are hard at 15%). Measured over generation seeds 73-78 with
  // the defaults of 0.3 (follow_tokens 8, scored_min 64): one-shot minus compacted 0.018,
  // 0.021, 0.018, 0.000, 0.026, 0.007; with neither option 0.008, 0.023, 0.007, -0.021, 0.020,
  // 0.041 (the 0.01 bound this test had passed only at seed 73).
  EXPECT_GT(f_compacted, f_one_shot - 0.03);
  EXPECT_LT(cache_stats(compacted.get()).compressed_bytes, cache_stats(dense_suffix.get()).compressed_bytes +
                                                               cache_stats(dense_suffix.get()).appended_bytes);
}

TEST(Compact, HeadroomKeepsEveryStepWithinTheta) {
  AKV_TRACE_SEED(74);
  const int64_t n = 128;
  const Generation g = make_generation(74, 2048, 64 + n);
  ContextPtr ctx = make_context(2);
  const double theta = 0.2;
  CachePtr cache = compress(ctx.get(), g.prompt, defaults(theta));
  ok(akv_append(cache.get(), g.appended_keys.data(), g.appended_values.data(), AKV_DTYPE_F32, 64, nullptr, nullptr),
     "akv_append");
  // The queries of the last W tokens of the 2048 + 64 now cached.
  const PrefillData at = [&] {
    Rng rng(741);
    PrefillData p = g.full;
    p.queries = make_tensor(nonzero_normal(rng, static_cast<size_t>(4) * 32 * 64, 1.5), AKV_DTYPE_F32);
    return p;
  }();
  ok(akv_cache_compact(cache.get(), at.queries.data(), AKV_DTYPE_F32, n, nullptr), "akv_cache_compact");
  // Append the next n tokens one by one: compressed + dense stays within theta of M_full.
  std::vector<float> k(2 * 64), v(2 * 64);
  for (int64_t i = 0; i < n; ++i) {
    for (int h = 0; h < 2; ++h) {
      std::copy_n(&g.appended_keys[(h * (64 + n) + 64 + i) * 64], 64, &k[h * 64]);
      std::copy_n(&g.appended_values[(h * (64 + n) + 64 + i) * 64], 64, &v[h * 64]);
    }
    ok(akv_append(cache.get(), k.data(), v.data(), AKV_DTYPE_F32, 1, nullptr, nullptr), "akv_append");
    const akv_cache_stats s = cache_stats(cache.get());
    const uint64_t total_tokens = s.shape.seq_len + s.appended_tokens;
    ASSERT_LE(static_cast<double>(s.compressed_bytes + s.appended_bytes), theta * 4.0 * total_tokens * 2 * 64)
        << "after " << i + 1 << " appended tokens";
  }
  // Headroom the budget cannot pay for is refused, and the cache stays as it was.
  const akv_cache_stats s = cache_stats(cache.get());
  CachePtr small = compress(ctx.get(), g.prompt, defaults(theta));
  append_all(small.get(), g);
  EXPECT_EQ(akv_cache_compact(small.get(), at.queries.data(), AKV_DTYPE_F32, 1 << 20, nullptr), AKV_ERR_BUDGET);
  EXPECT_TRUE(contains_case_insensitive(akv_last_error_message(), "headroom"));
  EXPECT_EQ(cache_stats(small.get()).appended_tokens, 64 + n);
  EXPECT_EQ(s.compactions, 1);
}

TEST(Compact, SerializesAndCompactsAgain) {
  AKV_TRACE_SEED(75);
  const Generation g = make_generation(75, 1024, 512);
  ContextPtr ctx = make_context(2);
  CachePtr cache = compress(ctx.get(), g.prompt, defaults(0.15));
  append_all(cache.get(), g);
  ok(akv_cache_compact(cache.get(), g.full.queries.data(), AKV_DTYPE_F32, 0, nullptr), "akv_cache_compact");
  // Append 64 more, round-trip, and compare decodes and a second compaction on both.
  Rng rng(751);
  const std::vector<float> k = nonzero_normal(rng, 2 * 64 * 64), v = nonzero_normal(rng, 2 * 64 * 64);
  ok(akv_append(cache.get(), k.data(), v.data(), AKV_DTYPE_F32, 64, nullptr, nullptr), "akv_append");
  CachePtr copy = deserialize(ctx.get(), serialize(cache.get()));
  EXPECT_EQ(cache_stats(copy.get()).compactions, 1);
  EXPECT_EQ(cache_stats(copy.get()).shape.seq_len, 1536);
  const Tensor q = make_tensor(nonzero_normal(rng, 4 * 64, 1.5), AKV_DTYPE_F32);
  EXPECT_EQ(decode(cache.get(), q, 1), decode(copy.get(), q, 1));
  const Tensor window = make_tensor(nonzero_normal(rng, 4 * 32 * 64, 1.5), AKV_DTYPE_F32);
  ok(akv_cache_compact(cache.get(), window.data(), AKV_DTYPE_F32, 0, nullptr), "akv_cache_compact");
  ok(akv_cache_compact(copy.get(), window.data(), AKV_DTYPE_F32, 0, nullptr), "akv_cache_compact (copy)");
  EXPECT_EQ(cache_stats(copy.get()).compactions, 2);
  EXPECT_EQ(cache_stats(copy.get()).shape.seq_len, 1600);
  EXPECT_EQ(serialize(cache.get()), serialize(copy.get()));
  EXPECT_EQ(decode(cache.get(), q, 1), decode(copy.get(), q, 1));
}

TEST(Compact, BadInputLeavesTheCacheAsItWas) {
  const Generation g = make_generation(76, 512, 40);
  ContextPtr ctx = make_context(2);
  CachePtr cache = compress(ctx.get(), g.prompt, defaults(0.3));
  const void *q = g.full.queries.data();
  EXPECT_EQ(akv_cache_compact(nullptr, q, AKV_DTYPE_F32, 0, nullptr), AKV_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(akv_cache_compact(cache.get(), nullptr, AKV_DTYPE_F32, 0, nullptr), AKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains_case_insensitive(akv_last_error_message(), "queries"));
  // Fewer appended tokens than the window.
  ok(akv_append(cache.get(), g.appended_keys.data(), g.appended_values.data(), AKV_DTYPE_F32, 40, nullptr, nullptr),
     "akv_append");
  CachePtr few = compress(ctx.get(), g.prompt, defaults(0.3));
  const std::vector<float> k = rows(g.appended_keys, 2, 40, 64, 0, 8), v = rows(g.appended_values, 2, 40, 64, 0, 8);
  ok(akv_append(few.get(), k.data(), v.data(), AKV_DTYPE_F32, 8, nullptr, nullptr), "akv_append");
  EXPECT_EQ(akv_cache_compact(few.get(), q, AKV_DTYPE_F32, 0, nullptr), AKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains_case_insensitive(akv_last_error_message(), "window"));
  EXPECT_EQ(akv_cache_compact(cache.get(), q, AKV_DTYPE_F32, -1, nullptr), AKV_ERR_INVALID_ARGUMENT);
  // Non-finite queries, an invalid dtype.
  std::vector<float> bad = g.full.queries.values;
  bad[17] = std::numeric_limits<float>::quiet_NaN();
  const std::vector<uint8_t> before = serialize(cache.get());
  EXPECT_EQ(akv_cache_compact(cache.get(), bad.data(), AKV_DTYPE_F32, 0, nullptr), AKV_ERR_NON_FINITE);
  EXPECT_EQ(akv_cache_compact(cache.get(), q, static_cast<akv_dtype>(9), 0, nullptr), AKV_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(serialize(cache.get()), before);
  // Gaps in the positions of the would-be window.
  CachePtr gapped = compress(ctx.get(), g.prompt, defaults(0.3));
  std::vector<int32_t> pos(40);
  for (int i = 0; i < 40; ++i) pos[i] = 600 + 2 * i;
  ok(akv_append(gapped.get(), g.appended_keys.data(), g.appended_values.data(), AKV_DTYPE_F32, 40, pos.data(), nullptr),
     "akv_append");
  EXPECT_EQ(akv_cache_compact(gapped.get(), q, AKV_DTYPE_F32, 0, nullptr), AKV_ERR_UNSUPPORTED);
  EXPECT_EQ(cache_stats(gapped.get()).appended_tokens, 40);
  // Methods without a decode-time variant.
  akv_compress_options ada;
  akv_compress_options_init_method(&ada, AKV_METHOD_ADAKV);
  ada.retain_fraction = 0.3;
  ada.window = 32;
  CachePtr evicting = compress(ctx.get(), g.prompt, ada);
  ok(akv_append(evicting.get(), g.appended_keys.data(), g.appended_values.data(), AKV_DTYPE_F32, 40, nullptr, nullptr),
     "akv_append");
  EXPECT_EQ(akv_cache_compact(evicting.get(), q, AKV_DTYPE_F32, 0, nullptr), AKV_ERR_UNSUPPORTED);
  EXPECT_TRUE(contains_case_insensitive(akv_last_error_message(), "AdaKV"));
  // The cache that refused everything still compacts.
  ok(akv_cache_compact(cache.get(), q, AKV_DTYPE_F32, 0, nullptr), "akv_cache_compact");
  EXPECT_EQ(cache_stats(cache.get()).shape.seq_len, 552);
  // The policy option is validated.
  akv_compress_options o = defaults(0.3);
  o.compact_after = -5;
  const akv_prefill p = g.prompt.view();
  akv_cache *out = nullptr;
  EXPECT_EQ(akv_compress(ctx.get(), &p, &o, &out, nullptr), AKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains_case_insensitive(akv_last_error_message(), "compact_after"));
}

// The decode-time variant of eviction: the budget of T, only tokens that were kept (or
// appended) and exactly as they were, the window kept.
TEST(Compact, EvictionReevictsAtTheBudgetOfTheTotalLength) {
  AKV_TRACE_SEED(78);
  const Generation g = make_generation(78, 1024, 512);
  ContextPtr ctx = make_context(2);
  for (akv_method method : {AKV_METHOD_SNAPKV, AKV_METHOD_PYRAMIDKV, AKV_METHOD_ANDPRO}) {
    SCOPED_TRACE(static_cast<int>(method));
    akv_compress_options o;
    akv_compress_options_init_method(&o, method);
    o.retain_fraction = 0.2;
    o.window = 32;
    CachePtr cache = compress(ctx.get(), g.prompt, o);
    append_all(cache.get(), g);
    const Dense before = reconstruct(cache.get(), 1);
    ok(akv_cache_compact(cache.get(), g.full.queries.data(), AKV_DTYPE_F32, 0, nullptr), "akv_cache_compact");
    const akv_cache_stats s = cache_stats(cache.get());
    const int64_t T = 1536;
    EXPECT_EQ(s.shape.seq_len, T);
    EXPECT_EQ(s.appended_tokens, 0);
    EXPECT_EQ(s.compactions, 1);
    EXPECT_EQ(s.compressed_bytes, 4ull * 64 * 2 * static_cast<uint64_t>(std::floor(0.2 * T)));  // 2 heads x B
    const Dense after = reconstruct(cache.get(), 1);
    int64_t kept_suffix = 0;
    for (int h = 0; h < 2; ++h)
      for (int64_t t = 0; t < T; ++t) {
        if (t >= T - 32) ASSERT_TRUE(after.present[h * T + t]) << "window token " << t;
        if (!after.present[h * T + t]) continue;
        ASSERT_TRUE(before.present[h * T + t]) << "token " << t << " of head " << h << " came back";
        kept_suffix += t >= 1024;
        for (int i = 0; i < 64; ++i) {
          ASSERT_EQ(after.key_row(h, t)[i], before.key_row(h, t)[i]);
          ASSERT_EQ(after.value_row(h, t)[i], before.value_row(h, t)[i]);
        }
      }
    EXPECT_GT(kept_suffix, 2 * 32);  // appended tokens compete with the prompt's
    CachePtr copy = deserialize(ctx.get(), serialize(cache.get()));
    EXPECT_EQ(cache_stats(copy.get()).compactions, 1);
  }
}

uint32_t crc32_of(const uint8_t *p, size_t n) {
  uint32_t crc = ~0u;
  for (size_t i = 0; i < n; ++i) {
    crc ^= p[i];
    for (int k = 0; k < 8; ++k) crc = (crc & 1u) ? 0xedb88320u ^ (crc >> 1) : crc >> 1;
  }
  return ~crc;
}

// Format 1 (before compaction) still reads: the same cache, in storage format 2, without what
// serialization formats 2 to 5 added (the 4-byte pool_heads, the 4-byte storage format and the
// 4-byte logit penalty count, 0 in storage format 2, after next_position; the 92 bytes of
// compaction fields before the CRC), version 1, its size and CRC patched.
TEST(Compact, FormatOneStillReads) {
  const Generation g = make_generation(79, 512, 40);
  ContextPtr ctx = make_context(2);
  akv_compress_options options = defaults(0.3);
  options.storage_format = 2;
  CachePtr cache = compress(ctx.get(), g.prompt, options);
  append_all(cache.get(), g);
  std::vector<uint8_t> bytes = serialize(cache.get());
  uint32_t version;
  std::memcpy(&version, &bytes[8], 4);
  ASSERT_EQ(version, 5u);
  bytes.erase(bytes.end() - 4 - 92, bytes.end());  // the compaction fields and the CRC
  uint32_t frequencies;  // the header runs to the inv_freq count at 96, then the table, then
  std::memcpy(&frequencies, &bytes[96], 4);  // window, anchors, two residual counts, positions
  const size_t pool_heads = 100 + 4 * static_cast<size_t>(frequencies) + 4 + 4 + 8 + 8 + 8 + 8;
  bytes.erase(bytes.begin() + pool_heads, bytes.begin() + pool_heads + 12);
  version = 1;
  std::memcpy(&bytes[8], &version, 4);
  const uint64_t total = bytes.size() + 4;
  std::memcpy(&bytes[16], &total, 8);
  const uint32_t crc = crc32_of(bytes.data(), bytes.size());
  bytes.insert(bytes.end(), reinterpret_cast<const uint8_t *>(&crc), reinterpret_cast<const uint8_t *>(&crc) + 4);
  CachePtr old = deserialize(ctx.get(), bytes);
  const Tensor q = make_tensor(nonzero_normal(*std::make_unique<Rng>(791), 4 * 64, 1.5), AKV_DTYPE_F32);
  EXPECT_EQ(decode(old.get(), q, 1), decode(cache.get(), q, 1));
  EXPECT_EQ(cache_stats(old.get()).compactions, 0);
  // It compacts with the AnchorKV defaults and the fields format 1 has.
  ok(akv_cache_compact(old.get(), g.full.queries.data(), AKV_DTYPE_F32, 0, nullptr), "akv_cache_compact");
  EXPECT_EQ(cache_stats(old.get()).shape.seq_len, 552);
}

// The policy compacts when the suffix exceeds compact_after tokens, with the recorded queries
// of the last W tokens, exactly as the explicit call with headroom compact_after would.
TEST(Compact, PolicyDoesWhatTheExplicitCallDoes) {
  AKV_TRACE_SEED(77);
  const int64_t n = 96, steps = 300;
  const Generation g = make_generation(77, 1024, steps);
  ContextPtr ctx = make_context(2);
  akv_compress_options o = defaults(0.25);
  o.compact_after = n;
  CachePtr automatic = compress(ctx.get(), g.prompt, o);
  CachePtr manual = compress(ctx.get(), g.prompt, defaults(0.25));
  Rng rng(771);
  const int Hq = 4, D = 64, W = 32;
  std::vector<std::vector<float>> recent;  // [step] -> [Hq][D]
  std::vector<float> k(2 * D), v(2 * D);
  int64_t compactions = 0;
  for (int64_t i = 0; i < steps; ++i) {
    for (int h = 0; h < 2; ++h) {
      std::copy_n(&g.appended_keys[(h * steps + i) * D], D, &k[h * D]);
      std::copy_n(&g.appended_values[(h * steps + i) * D], D, &v[h * D]);
    }
    for (akv_cache *c : {automatic.get(), manual.get()})
      ok(akv_append(c, k.data(), v.data(), AKV_DTYPE_F32, 1, nullptr, nullptr), "akv_append");
    const Tensor q = make_tensor(nonzero_normal(rng, static_cast<size_t>(Hq) * D, 1.5), AKV_DTYPE_F32);
    recent.push_back(q.values);
    ASSERT_EQ(decode(automatic.get(), q, 1), decode(manual.get(), q, 1)) << "step " << i;
    const akv_cache_stats m = cache_stats(manual.get());
    if (m.appended_tokens > n) {  // what the policy does after this decode
      std::vector<float> window(static_cast<size_t>(Hq) * W * D);
      for (int hq = 0; hq < Hq; ++hq)
        for (int w = 0; w < W; ++w)
          std::copy_n(&recent[recent.size() - W + w][hq * D], D, &window[(hq * W + w) * D]);
      ok(akv_cache_compact(manual.get(), window.data(), AKV_DTYPE_F32, n, nullptr), "akv_cache_compact");
      ++compactions;
    }
    const akv_cache_stats a = cache_stats(automatic.get());
    ASSERT_EQ(a.compactions, compactions) << "step " << i;
    if (compactions > 0)
      ASSERT_LE(static_cast<double>(a.compressed_bytes + a.appended_bytes),
                0.25 * 4.0 * (a.shape.seq_len + a.appended_tokens) * 2 * D)
          << "step " << i;
  }
  EXPECT_GE(compactions, 2);
}

}  // namespace
}  // namespace akv_test
