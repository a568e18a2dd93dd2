// Serialization (SPEC 3, header "Serialization"): round trips are bitwise, compression is
// deterministic for a seed, and damaged or future data is rejected with the right status.
#include <set>

#include "api/api_test_util.hpp"

namespace akv_test {
namespace {

struct Fixture {
  PrefillData data;
  akv_compress_options options{};
};

Fixture make_fixture(Rng &rng, akv_method method, akv_dtype dtype, int64_t S = 300) {
  Fixture f;
  PrefillSpec spec;
  spec.seq_len = S;
  spec.kv_heads = 2;
  spec.group = 2;
  spec.head_dim = 64;
  spec.dtype = dtype;
  spec.explicit_positions = true;
  f.data = make_prefill(rng, spec);
  f.options = method == AKV_METHOD_FULLKV ? fullkv_options()
                                          : anchorkv_options(workable_retain_fraction(f.data.shape, 32, 0, 0.05));
  f.options.rope.style = AKV_ROPE_GPTJ;
  return f;
}

void append_tokens(akv_cache *cache, Rng &rng, akv_dtype dtype, int tokens, int32_t first_position) {
  const Tensor keys = make_tensor(llm_like_keys(rng, 2, tokens, 64), dtype);
  const Tensor values = make_tensor(nonzero_normal(rng, 2ull * tokens * 64), dtype);
  const std::vector<int32_t> positions = gapped_positions(rng, tokens, first_position, 3);
  ok(akv_append(cache, keys.data(), values.data(), dtype, tokens, positions.data(), nullptr), "akv_append");
}

void expect_same_stats(const akv_cache_stats &a, const akv_cache_stats &b) {
  EXPECT_EQ(a.method, b.method);
  EXPECT_EQ(a.shape.seq_len, b.shape.seq_len);
  EXPECT_EQ(a.shape.num_kv_heads, b.shape.num_kv_heads);
  EXPECT_EQ(a.shape.num_q_heads, b.shape.num_q_heads);
  EXPECT_EQ(a.shape.head_dim, b.shape.head_dim);
  EXPECT_EQ(a.storage_dtype, b.storage_dtype);
  EXPECT_EQ(a.window, b.window);
  EXPECT_EQ(a.anchors, b.anchors);
  EXPECT_EQ(a.appended_tokens, b.appended_tokens);
  EXPECT_EQ(a.full_bytes, b.full_bytes);
  EXPECT_EQ(a.budget_bytes, b.budget_bytes);
  EXPECT_EQ(a.base_bytes, b.base_bytes);
  EXPECT_EQ(a.compressed_bytes, b.compressed_bytes);
  EXPECT_EQ(a.appended_bytes, b.appended_bytes);
  EXPECT_EQ(a.key_residuals, b.key_residuals);
  EXPECT_EQ(a.value_residuals, b.value_residuals);
}

class SerializationRoundTrip : public ::testing::TestWithParam<std::tuple<akv_method, akv_dtype>> {};

TEST_P(SerializationRoundTrip, DeserializedCacheDecodesBitwiseIdentical) {
  const akv_method method = std::get<0>(GetParam());
  const akv_dtype dtype = std::get<1>(GetParam());
  const uint64_t seed = fresh_seed();
  AKV_TRACE_SEED(seed);
  Rng rng(seed);
  const Fixture f = make_fixture(rng, method, dtype);
  const ContextPtr context = make_context();
  const CachePtr original = compress(context.get(), f.data, f.options);
  append_tokens(original.get(), rng, dtype, 3, f.data.positions.back() + 2);
  const std::vector<uint8_t> bytes = serialize(original.get());

  const ContextPtr other_context = make_context(1);
  for (akv_context *target : {context.get(), other_context.get()}) {
    SCOPED_TRACE(target == context.get() ? "same context" : "another context");
    const CachePtr copy = deserialize(target, bytes);
    expect_same_stats(cache_stats(original.get()), cache_stats(copy.get()));
    for (int rotated : {0, 1}) {
      const Dense a = reconstruct(original.get(), rotated), b = reconstruct(copy.get(), rotated);
      EXPECT_TRUE(a.keys == b.keys && a.values == b.values && a.present == b.present)
          << "reconstruct(rotated=" << rotated << ") differs after the round trip";
    }
    for (int q_len : {1, 3}) {
      const Tensor queries = make_tensor(nonzero_normal(rng, 4ull * q_len * 64, 1.5), dtype);
      EXPECT_TRUE(decode_raw(original.get(), queries, q_len) == decode_raw(copy.get(), queries, q_len))
          << "decode differs after the round trip, q_len " << q_len;
    }
    EXPECT_TRUE(serialize(copy.get()) == bytes) << "re-serializing the copy gives other bytes";
  }

  // Both go on identically after more tokens.
  const CachePtr copy = deserialize(context.get(), bytes);
  const uint64_t append_seed = rng.next();
  Rng rng_a(append_seed), rng_b(append_seed);
  const int32_t next = f.data.positions.back() + 100;
  append_tokens(original.get(), rng_a, dtype, 2, next);
  append_tokens(copy.get(), rng_b, dtype, 2, next);
  const Tensor queries = make_tensor(nonzero_normal(rng, 4ull * 2 * 64, 1.5), dtype);
  EXPECT_TRUE(decode_raw(original.get(), queries, 2) == decode_raw(copy.get(), queries, 2));
}

INSTANTIATE_TEST_SUITE_P(Methods, SerializationRoundTrip,
                         ::testing::Combine(::testing::Values(AKV_METHOD_ANCHORKV, AKV_METHOD_FULLKV),
                                            ::testing::Values(AKV_DTYPE_F32, AKV_DTYPE_F16, AKV_DTYPE_BF16)),
                         [](const ::testing::TestParamInfo<std::tuple<akv_method, akv_dtype>> &info) {
                           return std::string(std::get<0>(info.param) == AKV_METHOD_FULLKV ? "FullKV_" : "AnchorKV_") +
                                  dtype_name(std::get<1>(info.param));
                         });

TEST(SerializationDeterminism, SameInputsAndSeedGiveIdenticalBytes) {
  const uint64_t seed = fresh_seed();
  AKV_TRACE_SEED(seed);
  Rng rng(seed);
  const Fixture f = make_fixture(rng, AKV_METHOD_ANCHORKV, AKV_DTYPE_F32, 700);
  const ContextPtr context = make_context();
  const std::vector<uint8_t> first = serialize(compress(context.get(), f.data, f.options).get());
  const std::vector<uint8_t> second = serialize(compress(context.get(), f.data, f.options).get());
  EXPECT_TRUE(first == second) << "two compressions of the same inputs differ";
  const ContextPtr fresh = make_context();
  EXPECT_TRUE(serialize(compress(fresh.get(), f.data, f.options).get()) == first) << "a fresh context differs";
}

TEST(SerializationDeterminism, BytesDoNotDependOnTheThreadCount) {
  const uint64_t seed = fresh_seed();
  AKV_TRACE_SEED(seed);
  Rng rng(seed);
  const Fixture f = make_fixture(rng, AKV_METHOD_ANCHORKV, AKV_DTYPE_BF16, 1100);
  const ContextPtr one = make_context(1), two = make_context(2), three = make_context(3);
  const std::vector<uint8_t> reference = serialize(compress(one.get(), f.data, f.options).get());
  EXPECT_TRUE(serialize(compress(two.get(), f.data, f.options).get()) == reference) << "2 threads differ from 1";
  EXPECT_TRUE(serialize(compress(three.get(), f.data, f.options).get()) == reference) << "3 threads differ from 1";
}

TEST(SerializationDeterminism, DifferentSeedsGiveDifferentCaches) {
  const uint64_t seed = fresh_seed();
  AKV_TRACE_SEED(seed);
  Rng rng(seed);
  Fixture f = make_fixture(rng, AKV_METHOD_ANCHORKV, AKV_DTYPE_F32, 700);
  f.options.anchors = 64;  // k - W = 32 slots, ~10 sampled: anchors depend on the seed
  f.options.retain_fraction = workable_retain_fraction(f.data.shape, 32, 64, 0.05);
  const ContextPtr context = make_context();
  f.options.seed = 42;
  const CachePtr a = compress(context.get(), f.data, f.options);
  f.options.seed = 4242;
  const CachePtr b = compress(context.get(), f.data, f.options);
  EXPECT_FALSE(serialize(a.get()) == serialize(b.get()));
  const Dense ra = reconstruct(a.get(), 0), rb = reconstruct(b.get(), 0);
  // Not just a stored seed: the represented cache differs.
  EXPECT_FALSE(ra.keys == rb.keys && ra.values == rb.values) << "the seed changed no reconstructed value";
}

// ---- damaged data ---------------------------------------------------------------------------

class DamagedData : public ::testing::Test {
 protected:
  void SetUp() override {
    seed_ = fresh_seed();
    Rng rng(seed_);
    const Fixture f = make_fixture(rng, AKV_METHOD_ANCHORKV, AKV_DTYPE_BF16, 200);
    context_ = make_context();
    cache_ = compress(context_.get(), f.data, f.options);
    append_tokens(cache_.get(), rng, AKV_DTYPE_BF16, 2, f.data.positions.back() + 1);
    bytes_ = serialize(cache_.get());
    probe_ = make_tensor(nonzero_normal(rng, 4 * 64, 1.5), AKV_DTYPE_F32);
    reference_output_ = decode_raw(cache_.get(), probe_, 1);
  }

  // Deserializes `data`; returns the status, checking the failure contract on the way.
  akv_status try_deserialize(const std::vector<uint8_t> &data, const std::string &what) {
    akv_cache *cache = nullptr;
    const void *pointer = data.empty() ? static_cast<const void *>(bytes_.data()) : data.data();
    const akv_status status = akv_cache_deserialize(context_.get(), pointer, data.size(), &cache, nullptr);
    if (status == AKV_OK) {
      akv_cache_destroy(cache);
      return status;
    }
    EXPECT_EQ(cache, nullptr) << what << ": a failed deserialize handed out a cache";
    EXPECT_STRNE(akv_last_error_message(), "") << what;
    return status;
  }

  void TearDown() override {
    if (!cache_) return;  // SetUp failed and said why
    // The context and the original cache are untouched by all the failures.
    EXPECT_TRUE(decode_raw(cache_.get(), probe_, 1) == reference_output_);
    EXPECT_NE(deserialize(context_.get(), bytes_), nullptr);
  }

  uint64_t seed_ = 0;
  ContextPtr context_;
  CachePtr cache_;
  std::vector<uint8_t> bytes_;
  Tensor probe_;
  std::vector<uint8_t> reference_output_;
};

TEST_F(DamagedData, EveryTruncationIsCorrupt) {
  AKV_TRACE_SEED(seed_);
  Rng rng(seed_ ^ 0x5151);
  std::set<size_t> lengths;
  for (size_t n = 0; n < std::min<size_t>(bytes_.size(), 97); ++n) lengths.insert(n);
  for (int i = 0; i < 60; ++i) lengths.insert(static_cast<size_t>(rng.uniform_int(0, static_cast<int64_t>(bytes_.size()) - 1)));
  for (size_t back = 1; back <= 9 && back <= bytes_.size(); ++back) lengths.insert(bytes_.size() - back);
  std::vector<std::string> failures;
  for (size_t n : lengths) {
    const std::vector<uint8_t> prefix(bytes_.begin(), bytes_.begin() + n);
    const akv_status status = try_deserialize(prefix, "prefix of " + std::to_string(n) + " bytes");
    const bool accepted = status == AKV_ERR_CORRUPT_DATA || (n == 0 && status == AKV_ERR_INVALID_ARGUMENT);
    if (!accepted) failures.push_back(std::to_string(n) + " bytes -> " + akv_status_string(status));
  }
  EXPECT_TRUE(failures.empty()) << failures.size() << " of " << lengths.size() << " truncations (of "
                                << bytes_.size() << " bytes) not rejected as corrupt, e.g. " << failures.front();
}

TEST_F(DamagedData, BitFlipsAreCorrupt) {
  AKV_TRACE_SEED(seed_);
  Rng rng(seed_ ^ 0xF11F);
  std::set<size_t> offsets;
  for (size_t o = 0; o < std::min<size_t>(bytes_.size(), 64); ++o) offsets.insert(o);
  for (int i = 0; i < 80; ++i) offsets.insert(static_cast<size_t>(rng.uniform_int(0, static_cast<int64_t>(bytes_.size()) - 1)));
  for (size_t back = 1; back <= 8; ++back) offsets.insert(bytes_.size() - back);
  std::vector<std::string> failures;
  for (size_t offset : offsets) {
    std::vector<uint8_t> damaged = bytes_;
    const int bit = static_cast<int>(rng.uniform_int(0, 7));
    damaged[offset] ^= static_cast<uint8_t>(1u << bit);
    const akv_status status = try_deserialize(damaged, "bit " + std::to_string(bit) + " of byte " + std::to_string(offset));
    // A flip inside the format version field may legitimately read as a newer format.
    const bool accepted = status == AKV_ERR_CORRUPT_DATA || (offset < 64 && status == AKV_ERR_VERSION);
    if (!accepted)
      failures.push_back("byte " + std::to_string(offset) + " bit " + std::to_string(bit) + " -> " + akv_status_string(status));
  }
  EXPECT_TRUE(failures.empty()) << failures.size() << " of " << offsets.size() << " bit flips not rejected, e.g. "
                                << (failures.empty() ? "" : failures.front());
}

// The format version is somewhere in the header; raising it (any byte of it) must give
// AKV_ERR_VERSION, checked before the checksum a future format may compute differently.
TEST_F(DamagedData, FutureFormatVersionIsRejected) {
  AKV_TRACE_SEED(seed_);
  int version_errors = 0;
  std::string version_message;
  for (size_t offset = 0; offset < std::min<size_t>(bytes_.size(), 32); ++offset)
    for (uint8_t value : {static_cast<uint8_t>(bytes_[offset] + 1), static_cast<uint8_t>(0x7F)}) {
      if (value == bytes_[offset]) continue;
      std::vector<uint8_t> future = bytes_;
      future[offset] = value;
      const akv_status status = try_deserialize(future, "byte " + std::to_string(offset) + " set to " + std::to_string(value));
      EXPECT_TRUE(status == AKV_ERR_CORRUPT_DATA || status == AKV_ERR_VERSION)
          << "byte " << offset << " = " << int(value) << ": " << akv_status_string(status);
      if (status == AKV_ERR_VERSION) {
        ++version_errors;
        version_message = akv_last_error_message();
      }
    }
  EXPECT_GT(version_errors, 0) << "no header change reads as a newer format version";
  if (version_errors > 0) {
    EXPECT_TRUE(contains_case_insensitive(version_message, "version")) << version_message;
  }
}

}  // namespace
}  // namespace akv_test
