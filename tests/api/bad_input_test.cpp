// Bad input at every entry point, table-driven. Each case checks
//  - the status;
//  - that akv_last_error_message() is non-empty and names the culprit;
//  - that no cache was handed out, and that the context and caches used in the failed call
//    still work: every cache of the environment decodes to the same output bitwise, the
//    AnchorKV cache serializes to the same bytes, a compression still succeeds.
// Every status-returning entry point has cases (EveryEntryPointHasCases checks the list), and
// deserialization gets buffers whose checksum is valid but whose content is not.
#include <cstddef>
#include <functional>
#include <map>

#include "api/api_test_util.hpp"
#include "api/raw_enums.h"

#ifndef AKV_TEST_BUILT_WITH_CUDA
#define AKV_TEST_BUILT_WITH_CUDA 0
#endif

namespace akv_test {
namespace {

constexpr int kH = 2, kG = 2, kD = 64, kW = 32, kAppended = 2;
constexpr int64_t kS = 256;

// Valid handles and inputs; each case breaks exactly one thing.
struct Env {
  uint64_t seed = 0;
  ContextPtr context, other_context;
  PrefillData data, data72;
  akv_compress_options options{};
  CachePtr cache;                // AnchorKV, kAppended tokens appended
  CachePtr fullkv_cache;         // FullKV, nothing appended
  CachePtr other_shape_cache;    // H = 1
  CachePtr other_context_cache;  // same shape, other context
  Tensor append_keys, append_values;  // [H][kAppended][D], F32
  std::vector<int32_t> append_positions;
  Tensor query;                  // [Hq][1][D], F32
  std::vector<uint8_t> bytes;    // serialized `cache`
  std::vector<uint8_t> baseline_output;  // decode of `cache`
  std::vector<uint8_t> baseline_fullkv, baseline_other_shape, baseline_other_context;
  Tensor other_shape_query;      // [Hq][1][D] for other_shape_cache (same Hq and D)
  akv_cache_stats baseline_stats{};

  // Scratch the cases write into.
  akv_cache *out_cache = nullptr;
  std::vector<uint8_t> out, scratch;
  std::vector<int32_t> scratch_positions;

  void set_up() {
    seed = fresh_seed();
    Rng rng(seed);
    context = make_context();
    other_context = make_context();
    PrefillSpec spec;
    spec.seq_len = kS;
    spec.kv_heads = kH;
    spec.group = kG;
    spec.head_dim = kD;
    data = make_prefill(rng, spec);
    spec.head_dim = 72;  // not a multiple of 16: the codec refuses it (80, 96, 112 are padded)
    data72 = make_prefill(rng, spec);
    options = anchorkv_options(workable_retain_fraction(data.shape, kW, 0, 0.1), kW);
    cache = compress(context.get(), data, options);
    append_keys = make_tensor(llm_like_keys(rng, kH, kAppended, kD), AKV_DTYPE_F32);
    append_values = make_tensor(nonzero_normal(rng, static_cast<size_t>(kH) * kAppended * kD), AKV_DTYPE_F32);
    ok(akv_append(cache.get(), append_keys.data(), append_values.data(), AKV_DTYPE_F32, kAppended, nullptr, nullptr),
       "akv_append");
    fullkv_cache = compress(context.get(), data, fullkv_options());
    PrefillSpec one_head = spec;
    one_head.head_dim = kD;
    one_head.kv_heads = 1;
    one_head.group = kH * kG;  // same Hq, other H
    const PrefillData narrow = make_prefill(rng, one_head);
    other_shape_cache = compress(context.get(), narrow, fullkv_options());
    other_context_cache = compress(other_context.get(), data, fullkv_options());
    query = make_tensor(nonzero_normal(rng, static_cast<size_t>(kH) * kG * kD, 1.5), AKV_DTYPE_F32);
    baseline_output = decode_raw(cache.get(), query, 1);
    baseline_fullkv = decode_raw(fullkv_cache.get(), query, 1);
    other_shape_query = query;
    baseline_other_shape = decode_raw(other_shape_cache.get(), other_shape_query, 1);
    baseline_other_context = decode_raw(other_context_cache.get(), query, 1);
    baseline_stats = cache_stats(cache.get());
    bytes = serialize(cache.get());
    out = poisoned(static_cast<size_t>(kH) * kG * kD * 8, AKV_DTYPE_F32);
  }

  // A copy of `tensor` with one element replaced, kept alive in `scratch`.
  const void *with_value(const Tensor &tensor, size_t index, float value) {
    std::vector<float> values = tensor.values;
    values[index] = value;
    scratch = encode(values, tensor.dtype);
    return scratch.data();
  }

  // The serialized AnchorKV cache with `value` written at `offset` and the CRC-32 recomputed:
  // data that passes the checksum but was damaged (or crafted) before it was computed.
  template <typename T>
  akv_status deserialize_damaged(size_t offset, T value) {
    scratch = bytes;
    std::memcpy(scratch.data() + offset, &value, sizeof value);
    const uint32_t crc = crc32(scratch.data(), scratch.size() - 4);
    std::memcpy(scratch.data() + scratch.size() - 4, &crc, 4);
    return akv_cache_deserialize(context.get(), scratch.data(), scratch.size(), &out_cache, nullptr);
  }
  static uint32_t crc32(const uint8_t *data, size_t size) {
    uint32_t crc = ~0u;
    for (size_t i = 0; i < size; ++i) {
      crc ^= data[i];
      for (int k = 0; k < 8; ++k) crc = (crc & 1u) ? 0xedb88320u ^ (crc >> 1) : crc >> 1;
    }
    return ~crc;
  }
  // Offsets in the serialized format (src/core/serialize.cpp): a fixed header up to the
  // inv_freq count at 96, the table, then window, anchors, two residual counts and the window
  // start; the suffix (count, positions, keys, values of kAppended tokens) ends before the 92
  // bytes of compaction fields (serialization format 5) and the CRC.
  size_t window_position_offset() const {
    uint32_t frequencies;
    std::memcpy(&frequencies, bytes.data() + 96, 4);
    return 100 + 4 * static_cast<size_t>(frequencies) + 4 + 4 + 8 + 8;
  }
  size_t suffix_keys_offset() const { return bytes.size() - 4 - 92 - 2 * static_cast<size_t>(kH) * kAppended * kD * 2; }
  size_t suffix_count_offset() const { return suffix_keys_offset() - 4 * kAppended - 8; }

  akv_status compress_with(const std::function<void(akv_prefill &, akv_compress_options &)> &mutate) {
    akv_prefill prefill = data.view();
    akv_compress_options o = options;
    mutate(prefill, o);
    return akv_compress(context.get(), &prefill, &o, &out_cache, nullptr);
  }

  akv_status size_with(const std::function<void(akv_shape &, akv_compress_options &)> &mutate) {
    akv_shape shape = data.shape;
    akv_compress_options o = options;
    mutate(shape, o);
    size_t bytes_out = 0;
    return akv_compressed_size(&o, &shape, &bytes_out);
  }

  akv_status create_context_with(const std::function<void(akv_context_options &)> &mutate) {
    akv_context_options o;
    akv_context_options_init(&o);
    mutate(o);
    akv_context *created = nullptr;
    const akv_status status = akv_context_create(&o, &created);
    akv_context_destroy(created);  // only non-NULL if the library wrongly accepted
    return status;
  }

  akv_status append_with(akv_cache *target, const void *keys, const void *values, akv_dtype dtype, int32_t tokens,
                         const int32_t *positions) {
    return akv_append(target, keys, values, dtype, tokens, positions, nullptr);
  }

  akv_status decode_batch_with(std::vector<akv_cache *> caches, int32_t batch, int32_t q_len,
                               akv_context *ctx = nullptr, int dtype = AKV_DTYPE_F32) {
    std::vector<float> queries;
    for (int i = 0; i < static_cast<int>(caches.size()) * q_len; ++i)
      queries.insert(queries.end(), query.values.begin(), query.values.end());
    // Queries laid out [batch][Hq][q_len][D]: content does not matter for these cases.
    scratch = encode(queries, AKV_DTYPE_F32);
    out = poisoned(queries.size(), AKV_DTYPE_F32);
    return akv_test_decode_batch(ctx ? ctx : context.get(), caches.data(), batch, scratch.data(), dtype, q_len,
                                 out.data());
  }
};

struct BadCase {
  std::string name;
  akv_status expected;
  std::vector<std::string> culprits;  // the message must contain one (case-insensitive)
  std::function<akv_status(Env &)> call;
  std::vector<akv_status> also_accepted = {};
};

using Prefill = akv_prefill;
using Options = akv_compress_options;

std::vector<BadCase> bad_cases() {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  std::vector<BadCase> cases = {
      // ---- context ----
      {"ContextCreate_NullOut", AKV_ERR_INVALID_ARGUMENT, {"out_context"},
       [](Env &) {
         akv_context_options o;
         akv_context_options_init(&o);
         return akv_context_create(&o, nullptr);
       }},
      {"ContextCreate_StructSizeZero", AKV_ERR_INVALID_ARGUMENT, {"struct_size"},
       [](Env &e) { return e.create_context_with([](akv_context_options &o) { o.struct_size = 0; }); }},
      {"ContextCreate_StructSizeTooLarge", AKV_ERR_INVALID_ARGUMENT, {"struct_size"},
       [](Env &e) { return e.create_context_with([](akv_context_options &o) { o.struct_size = sizeof o + 64; }); }},
      {"ContextCreate_UnknownBackend", AKV_ERR_INVALID_ARGUMENT, {"backend"},
       [](Env &e) { return e.create_context_with([](akv_context_options &o) { akv_test_set_backend(&o, 7); }); }},
      {"ContextCreate_AllocatorHalfSet", AKV_ERR_INVALID_ARGUMENT, {"allocator", "free"},
       [](Env &e) {
         return e.create_context_with([](akv_context_options &o) {
           o.allocator.alloc = [](void *, size_t bytes) { return std::aligned_alloc(256, (bytes + 255) / 256 * 256); };
         });
       }},
      {"ContextCreate_NegativeThreads", AKV_ERR_INVALID_ARGUMENT, {"num_threads"},
       [](Env &e) { return e.create_context_with([](akv_context_options &o) { o.num_threads = -1; }); }},
      {"ContextCreate_MillionThreads", AKV_ERR_INVALID_ARGUMENT, {"num_threads"},
       [](Env &e) { return e.create_context_with([](akv_context_options &o) { o.num_threads = 1000000; }); }},

      // ---- akv_compressed_size ----
      {"Size_NullShape", AKV_ERR_INVALID_ARGUMENT, {"shape"},
       [](Env &e) {
         size_t b = 0;
         return akv_compressed_size(&e.options, nullptr, &b);
       }},
      {"Size_NullOutBytes", AKV_ERR_INVALID_ARGUMENT, {"out_bytes"},
       [](Env &e) { return akv_compressed_size(&e.options, &e.data.shape, nullptr); }},
      {"Size_OptionsStructSizeZero", AKV_ERR_INVALID_ARGUMENT, {"struct_size"},
       [](Env &e) { return e.size_with([](akv_shape &, Options &o) { o.struct_size = 0; }); }},
      {"Size_SeqLenZero", AKV_ERR_INVALID_ARGUMENT, {"seq_len"},
       [](Env &e) { return e.size_with([](akv_shape &s, Options &) { s.seq_len = 0; }); }},
      {"Size_SeqLenNegative", AKV_ERR_INVALID_ARGUMENT, {"seq_len"},
       [](Env &e) { return e.size_with([](akv_shape &s, Options &) { s.seq_len = -256; }); }},
      {"Size_KvHeadsZero", AKV_ERR_INVALID_ARGUMENT, {"num_kv_heads"},
       [](Env &e) { return e.size_with([](akv_shape &s, Options &) { s.num_kv_heads = 0; }); }},
      {"Size_HeadDim72", AKV_ERR_UNSUPPORTED, {"head_dim"},
       [](Env &e) { return e.size_with([](akv_shape &s, Options &) { s.head_dim = 72; }); }},
      {"Size_QHeadsNotMultiple", AKV_ERR_INVALID_ARGUMENT, {"num_q_heads"},
       [](Env &e) { return e.size_with([](akv_shape &s, Options &) { s.num_q_heads = 3; }); }},
      {"Size_RetainZero", AKV_ERR_INVALID_ARGUMENT, {"retain_fraction"},
       [](Env &e) { return e.size_with([](akv_shape &, Options &o) { o.retain_fraction = 0.0; }); }},
      {"Size_RetainNaN", AKV_ERR_INVALID_ARGUMENT, {"retain_fraction"},
       [](Env &e) { return e.size_with([](akv_shape &, Options &o) { o.retain_fraction = std::nan(""); }); }},
      {"Size_BudgetTooSmall", AKV_ERR_BUDGET, {"retain_fraction"},
       [](Env &e) { return e.size_with([](akv_shape &, Options &o) { o.retain_fraction = 0.01; }); }},
      {"Size_KvHeadsAbove4096", AKV_ERR_UNSUPPORTED, {"num_kv_heads"},
       [](Env &e) { return e.size_with([](akv_shape &s, Options &) { s.num_kv_heads = s.num_q_heads = 8192; }); }},
      {"Size_QHeadsAbove65536", AKV_ERR_UNSUPPORTED, {"num_q_heads"},
       [](Env &e) { return e.size_with([](akv_shape &s, Options &) { s.num_q_heads = 2 * 65536; }); }},
      {"Size_SeqLenBeyondInt32", AKV_ERR_UNSUPPORTED, {"seq_len"},
       [](Env &e) { return e.size_with([](akv_shape &s, Options &) { s.seq_len = int64_t{1} << 31; }); }},
      {"Size_FullKvHeadDimAbove1024", AKV_ERR_UNSUPPORTED, {"head_dim"},
       [](Env &e) {
         return e.size_with([](akv_shape &s, Options &o) { s.head_dim = 2048, o.method = AKV_METHOD_FULLKV; });
       }},
      {"Size_EvictionBudgetBelowWindow", AKV_ERR_BUDGET, {"retain_fraction"},
       [](Env &e) {
         return e.size_with([](akv_shape &, Options &o) { o.method = AKV_METHOD_SNAPKV, o.retain_fraction = 0.05; });
       }},
      {"Size_QuantBitsFive", AKV_ERR_INVALID_ARGUMENT, {"quant_bits"},
       [](Env &e) {
         return e.size_with([](akv_shape &, Options &o) { o.method = AKV_METHOD_QUANTIZED, o.quant_bits = 5; });
       }},
      {"Size_QuantizedBudgetTooSmall", AKV_ERR_BUDGET, {"retain_fraction"},
       [](Env &e) {
         return e.size_with([](akv_shape &, Options &o) { o.method = AKV_METHOD_QUANTIZED, o.retain_fraction = 0.05; });
       }},

      // ---- akv_compress: pointers ----
      {"Compress_NullContext", AKV_ERR_INVALID_ARGUMENT, {"context"},
       [](Env &e) {
         const akv_prefill p = e.data.view();
         return akv_compress(nullptr, &p, &e.options, &e.out_cache, nullptr);
       }},
      {"Compress_NullPrefill", AKV_ERR_INVALID_ARGUMENT, {"prefill"},
       [](Env &e) { return akv_compress(e.context.get(), nullptr, &e.options, &e.out_cache, nullptr); }},
      {"Compress_NullOutCache", AKV_ERR_INVALID_ARGUMENT, {"out_cache"},
       [](Env &e) {
         const akv_prefill p = e.data.view();
         return akv_compress(e.context.get(), &p, &e.options, nullptr, nullptr);
       }},
      {"Compress_NullKeys", AKV_ERR_INVALID_ARGUMENT, {"keys"},
       [](Env &e) { return e.compress_with([](Prefill &p, Options &) { p.keys = nullptr; }); }},
      {"Compress_NullValues", AKV_ERR_INVALID_ARGUMENT, {"values"},
       [](Env &e) { return e.compress_with([](Prefill &p, Options &) { p.values = nullptr; }); }},
      {"Compress_NullQueries", AKV_ERR_INVALID_ARGUMENT, {"queries"},
       [](Env &e) { return e.compress_with([](Prefill &p, Options &) { p.queries = nullptr; }); }},
      // ---- akv_compress: shape ----
      {"Compress_SeqLenZero", AKV_ERR_INVALID_ARGUMENT, {"seq_len"},
       [](Env &e) { return e.compress_with([](Prefill &p, Options &) { p.shape.seq_len = 0; }); }},
      {"Compress_SeqLenNegative", AKV_ERR_INVALID_ARGUMENT, {"seq_len"},
       [](Env &e) { return e.compress_with([](Prefill &p, Options &) { p.shape.seq_len = -1; }); }},
      {"Compress_KvHeadsZero", AKV_ERR_INVALID_ARGUMENT, {"num_kv_heads"},
       [](Env &e) { return e.compress_with([](Prefill &p, Options &) { p.shape.num_kv_heads = 0; }); }},
      {"Compress_KvHeadsNegative", AKV_ERR_INVALID_ARGUMENT, {"num_kv_heads"},
       [](Env &e) { return e.compress_with([](Prefill &p, Options &) { p.shape.num_kv_heads = -2; }); }},
      {"Compress_QHeadsZero", AKV_ERR_INVALID_ARGUMENT, {"num_q_heads"},
       [](Env &e) { return e.compress_with([](Prefill &p, Options &) { p.shape.num_q_heads = 0; }); }},
      {"Compress_QHeadsNegative", AKV_ERR_INVALID_ARGUMENT, {"num_q_heads"},
       [](Env &e) { return e.compress_with([](Prefill &p, Options &) { p.shape.num_q_heads = -4; }); }},
      {"Compress_QHeadsNotMultiple", AKV_ERR_INVALID_ARGUMENT, {"num_q_heads"},
       [](Env &e) { return e.compress_with([](Prefill &p, Options &) { p.shape.num_q_heads = 3; }); }},
      {"Compress_HeadDimZero", AKV_ERR_INVALID_ARGUMENT, {"head_dim"},
       [](Env &e) { return e.compress_with([](Prefill &p, Options &) { p.shape.head_dim = 0; }); }},
      {"Compress_HeadDimNegative", AKV_ERR_INVALID_ARGUMENT, {"head_dim"},
       [](Env &e) { return e.compress_with([](Prefill &p, Options &) { p.shape.head_dim = -64; }); }},
      {"Compress_HeadDim72", AKV_ERR_UNSUPPORTED, {"head_dim"},
       [](Env &e) {
         const akv_prefill p = e.data72.view();
         akv_compress_options o = e.options;
         o.retain_fraction = 0.5;
         return akv_compress(e.context.get(), &p, &o, &e.out_cache, nullptr);
       }},
      // ---- akv_compress: options ----
      {"Compress_RetainZero", AKV_ERR_INVALID_ARGUMENT, {"retain_fraction"},
       [](Env &e) { return e.compress_with([](Prefill &, Options &o) { o.retain_fraction = 0.0; }); }},
      {"Compress_RetainNegative", AKV_ERR_INVALID_ARGUMENT, {"retain_fraction"},
       [](Env &e) { return e.compress_with([](Prefill &, Options &o) { o.retain_fraction = -0.1; }); }},
      {"Compress_RetainAboveOne", AKV_ERR_INVALID_ARGUMENT, {"retain_fraction"},
       [](Env &e) { return e.compress_with([](Prefill &, Options &o) { o.retain_fraction = 1.5; }); }},
      {"Compress_RetainNaN", AKV_ERR_INVALID_ARGUMENT, {"retain_fraction"},
       [](Env &e) { return e.compress_with([](Prefill &, Options &o) { o.retain_fraction = std::nan(""); }); }},
      {"Compress_BudgetTooSmall", AKV_ERR_BUDGET, {"retain_fraction"},
       [](Env &e) { return e.compress_with([](Prefill &, Options &o) { o.retain_fraction = 0.01; }); }},
      {"Compress_OptionsStructSizeZero", AKV_ERR_INVALID_ARGUMENT, {"struct_size"},
       [](Env &e) { return e.compress_with([](Prefill &, Options &o) { o.struct_size = 0; }); }},
      {"Compress_OptionsStructSizeTooLarge", AKV_ERR_INVALID_ARGUMENT, {"struct_size"},
       [](Env &e) { return e.compress_with([](Prefill &, Options &o) { o.struct_size = sizeof o + 8; }); }},
      {"Compress_PrefillStructSizeZero", AKV_ERR_INVALID_ARGUMENT, {"struct_size"},
       [](Env &e) { return e.compress_with([](Prefill &p, Options &) { p.struct_size = 0; }); }},
      {"Compress_PrefillStructSizeTooLarge", AKV_ERR_INVALID_ARGUMENT, {"struct_size"},
       [](Env &e) { return e.compress_with([](Prefill &p, Options &) { p.struct_size = sizeof p + 8; }); }},
      {"Compress_WindowZero", AKV_ERR_INVALID_ARGUMENT, {"window"},
       [](Env &e) { return e.compress_with([](Prefill &, Options &o) { o.window = 0; }); }},
      {"Compress_WindowNegative", AKV_ERR_INVALID_ARGUMENT, {"window"},
       [](Env &e) { return e.compress_with([](Prefill &, Options &o) { o.window = -32; }); }},
      {"Compress_AnchorsBelowWindow", AKV_ERR_INVALID_ARGUMENT, {"anchors"},
       [](Env &e) { return e.compress_with([](Prefill &, Options &o) { o.anchors = kW - 10; }); }},
      {"Compress_ScoredFractionAboveOne", AKV_ERR_INVALID_ARGUMENT, {"scored_fraction"},
       [](Env &e) { return e.compress_with([](Prefill &, Options &o) { o.scored_fraction = 1.5; }); }},
      {"Compress_PoolKernelEven", AKV_ERR_INVALID_ARGUMENT, {"pool_kernel"},
       [](Env &e) { return e.compress_with([](Prefill &, Options &o) { o.pool_kernel = 6; }); }},
      {"Compress_PoolKernelZero", AKV_ERR_INVALID_ARGUMENT, {"pool_kernel"},
       [](Env &e) { return e.compress_with([](Prefill &, Options &o) { o.pool_kernel = 0; }); }},
      {"Compress_FollowTokensAbove64", AKV_ERR_INVALID_ARGUMENT, {"follow_tokens", "64"},
       [](Env &e) { return e.compress_with([](Prefill &, Options &o) { o.follow_tokens = 65; }); }},
      {"Compress_FollowTokensNegative", AKV_ERR_INVALID_ARGUMENT, {"follow_tokens"},
       [](Env &e) { return e.compress_with([](Prefill &, Options &o) { o.follow_tokens = -1; }); }},
      {"Compress_ScoredMinNegative", AKV_ERR_INVALID_ARGUMENT, {"scored_min"},
       [](Env &e) { return e.compress_with([](Prefill &, Options &o) { o.scored_min = -3; }); }},
      {"Compress_UnknownMethod", AKV_ERR_INVALID_ARGUMENT, {"method"},
       [](Env &e) { return e.compress_with([](Prefill &, Options &o) { akv_test_set_method(&o, 99); }); }},
      {"Compress_UnknownRopeStyle", AKV_ERR_INVALID_ARGUMENT, {"rope", "style"},
       [](Env &e) { return e.compress_with([](Prefill &, Options &o) { akv_test_set_rope_style(&o, 9); }); }},
      {"Compress_RotaryDimOdd", AKV_ERR_INVALID_ARGUMENT, {"rotary_dim"},
       [](Env &e) { return e.compress_with([](Prefill &, Options &o) { o.rope.rotary_dim = 33; }); }},
      {"Compress_RotaryDimAboveHeadDim", AKV_ERR_INVALID_ARGUMENT, {"rotary_dim"},
       [](Env &e) { return e.compress_with([](Prefill &, Options &o) { o.rope.rotary_dim = 2 * kD; }); }},
      {"Compress_SoftmaxScaleNaN", AKV_ERR_INVALID_ARGUMENT, {"softmax_scale"},
       [](Env &e) { return e.compress_with([](Prefill &, Options &o) { o.softmax_scale = std::nanf(""); }); }},
      {"Compress_StorageDtypeF32", AKV_ERR_INVALID_ARGUMENT, {"storage_dtype"},
       [](Env &e) { return e.compress_with([](Prefill &, Options &o) { o.storage_dtype = AKV_DTYPE_F32; }); },
       {AKV_ERR_UNSUPPORTED}},
      {"Compress_LayerIndexNegative", AKV_ERR_INVALID_ARGUMENT, {"layer_index"},
       [](Env &e) { return e.compress_with([](Prefill &, Options &o) { o.layer_index = -1; }); }},
      {"Compress_LayerIndexBeyondCount", AKV_ERR_INVALID_ARGUMENT, {"layer_index", "layer_count"},
       [](Env &e) { return e.compress_with([](Prefill &, Options &o) { o.layer_index = 3, o.layer_count = 3; }); }},
      {"Compress_LayerCountZero", AKV_ERR_INVALID_ARGUMENT, {"layer_count"},
       [](Env &e) { return e.compress_with([](Prefill &, Options &o) { o.layer_count = 0; }); }},
      // ---- akv_compress: data ----
      {"Compress_NaNInKeys", AKV_ERR_NON_FINITE, {"keys"},
       [nan](Env &e) {
         const void *keys = e.with_value(e.data.keys, e.data.keys.count() / 3 + 5, nan);
         return e.compress_with([keys](Prefill &p, Options &) { p.keys = keys; });
       }},
      {"Compress_InfInValues", AKV_ERR_NON_FINITE, {"values"},
       [inf](Env &e) {
         const void *values = e.with_value(e.data.values, e.data.values.count() - 1, inf);
         return e.compress_with([values](Prefill &p, Options &) { p.values = values; });
       }},
      {"Compress_NegInfInKeysLastHead", AKV_ERR_NON_FINITE, {"keys"},
       [inf](Env &e) {
         const void *keys = e.with_value(e.data.keys, e.data.keys.count() - 7, -inf);
         return e.compress_with([keys](Prefill &p, Options &) { p.keys = keys; });
       }},
      {"Compress_NaNInQueries", AKV_ERR_NON_FINITE, {"queries"},
       [nan](Env &e) {
         const void *queries = e.with_value(e.data.queries, 17, nan);
         return e.compress_with([queries](Prefill &p, Options &) { p.queries = queries; });
       }},
      {"Compress_PositionsRepeated", AKV_ERR_INVALID_ARGUMENT, {"positions"},
       [](Env &e) {
         e.scratch_positions = default_positions(kS);
         e.scratch_positions[100] = e.scratch_positions[99];
         const int32_t *positions = e.scratch_positions.data();
         return e.compress_with([positions](Prefill &p, Options &) { p.positions = positions; });
       }},
      {"Compress_PositionsDecreasing", AKV_ERR_INVALID_ARGUMENT, {"positions"},
       [](Env &e) {
         e.scratch_positions = default_positions(kS, 1000);
         e.scratch_positions[kS - 1] = 3;
         const int32_t *positions = e.scratch_positions.data();
         return e.compress_with([positions](Prefill &p, Options &) { p.positions = positions; });
       }},
      // The paper's layout keeps no per-token position for the window (library decision,
      // not yet in the header): a gap inside it is refused.
      {"Compress_AnchorKvGapsInsideWindow", AKV_ERR_UNSUPPORTED, {"positions"},
       [](Env &e) {
         e.scratch_positions = default_positions(kS);
         for (int64_t t = kS - 5; t < kS; ++t) e.scratch_positions[t] += 3;
         const int32_t *positions = e.scratch_positions.data();
         return e.compress_with([positions](Prefill &p, Options &) { p.positions = positions; });
       }},
      {"Compress_Dtype77", AKV_ERR_INVALID_ARGUMENT, {"dtype"},
       [](Env &e) { return e.compress_with([](Prefill &p, Options &) { akv_test_set_prefill_dtype(&p, 77); }); }},
      {"Compress_DtypeAuto", AKV_ERR_INVALID_ARGUMENT, {"dtype"},
       [](Env &e) { return e.compress_with([](Prefill &p, Options &) { p.dtype = AKV_DTYPE_AUTO; }); }},
      {"Compress_NegativeStride", AKV_ERR_INVALID_ARGUMENT, {"stride"},
       [](Env &e) { return e.compress_with([](Prefill &p, Options &) { p.kv_token_stride = -kD; }); }},
      {"Compress_TokenStrideBelowHeadDim", AKV_ERR_INVALID_ARGUMENT, {"stride"},
       [](Env &e) { return e.compress_with([](Prefill &p, Options &) { p.kv_token_stride = kD - 1; }); }},
      {"Compress_InvFreqNaN", AKV_ERR_NON_FINITE, {"inv_freq"},
       [](Env &e) {
         static std::vector<float> table;
         table.assign(kD / 2, 1e-3f);
         table[5] = std::numeric_limits<float>::quiet_NaN();
         return e.compress_with([](Prefill &, Options &o) { o.rope.inv_freq = table.data(); });
       }},
      {"Compress_RopeBaseOne", AKV_ERR_INVALID_ARGUMENT, {"base"},
       [](Env &e) { return e.compress_with([](Prefill &, Options &o) { o.rope.base = 1.0; }); }},
      {"Compress_EvictionWindowNotBelowSeqLen", AKV_ERR_INVALID_ARGUMENT, {"window", "seq_len"},
       [](Env &e) {
         return e.compress_with([](Prefill &, Options &o) { o.method = AKV_METHOD_SNAPKV, o.window = kS, o.retain_fraction = 1.0; });
       }},
      {"Compress_EvictionNullQueries", AKV_ERR_INVALID_ARGUMENT, {"queries"},
       [](Env &e) {
         return e.compress_with([](Prefill &p, Options &o) { p.queries = nullptr, o.method = AKV_METHOD_ADAKV, o.retain_fraction = 0.5; });
       }},
      {"Compress_AdaKvAlphaAboveOne", AKV_ERR_INVALID_ARGUMENT, {"adakv_alpha"},
       [](Env &e) {
         return e.compress_with([](Prefill &, Options &o) { o.method = AKV_METHOD_ADAKV, o.retain_fraction = 0.5, o.adakv_alpha = 1.5; });
       }},
      {"Compress_PyramidBetaZero", AKV_ERR_INVALID_ARGUMENT, {"pyramid_beta"},
       [](Env &e) {
         return e.compress_with([](Prefill &, Options &o) { o.method = AKV_METHOD_PYRAMIDKV, o.retain_fraction = 0.5, o.pyramid_beta = 0; });
       }},
      {"Compress_AndProChunkZero", AKV_ERR_INVALID_ARGUMENT, {"andpro_chunk"},
       [](Env &e) {
         return e.compress_with([](Prefill &, Options &o) { o.method = AKV_METHOD_ANDPRO, o.retain_fraction = 0.5, o.andpro_chunk = 0; });
       }},
      // Finite inputs that the storage dtype cannot hold: refused rather than stored as Inf
      // (a cache holding Inf decodes to NaN and does not deserialize).
      {"Compress_ValueOverflowsF16Storage", AKV_ERR_NON_FINITE, {"non-finite", "overflow"},
       [](Env &e) {
         const void *values = e.with_value(e.data.values, 77, 1.0e5f);
         return e.compress_with([values](Prefill &p, Options &o) {
           p.values = values, o.method = AKV_METHOD_FULLKV, o.retain_fraction = 1.0, o.storage_dtype = AKV_DTYPE_F16;
         });
       }},
      {"Compress_QuantOutliersTooMany", AKV_ERR_INVALID_ARGUMENT, {"quant_outliers"},
       [](Env &e) {
         return e.compress_with([](Prefill &, Options &o) {
           o.method = AKV_METHOD_QUANTIZED, o.retain_fraction = 1.0, o.quant_outliers = kD;
         });
       }},

      // ---- akv_cache_reserve / akv_append ----
      {"Reserve_NullCache", AKV_ERR_INVALID_ARGUMENT, {"cache"},
       [](Env &) { return akv_cache_reserve(nullptr, 10, nullptr); }},
      {"Reserve_Negative", AKV_ERR_INVALID_ARGUMENT, {"tokens"},
       [](Env &e) { return akv_cache_reserve(e.cache.get(), -1, nullptr); }},
      {"Reserve_BeyondInt32", AKV_ERR_INVALID_ARGUMENT, {"tokens", "int32"},
       [](Env &e) { return akv_cache_reserve(e.cache.get(), int64_t{1} << 31, nullptr); }},
      {"Append_NullCache", AKV_ERR_INVALID_ARGUMENT, {"cache"},
       [](Env &e) { return e.append_with(nullptr, e.append_keys.data(), e.append_values.data(), AKV_DTYPE_F32, kAppended, nullptr); }},
      {"Append_NullKeys", AKV_ERR_INVALID_ARGUMENT, {"keys"},
       [](Env &e) { return e.append_with(e.cache.get(), nullptr, e.append_values.data(), AKV_DTYPE_F32, kAppended, nullptr); }},
      {"Append_NullValues", AKV_ERR_INVALID_ARGUMENT, {"values"},
       [](Env &e) { return e.append_with(e.cache.get(), e.append_keys.data(), nullptr, AKV_DTYPE_F32, kAppended, nullptr); }},
      {"Append_ZeroTokens", AKV_ERR_INVALID_ARGUMENT, {"num_tokens"},
       [](Env &e) { return e.append_with(e.cache.get(), e.append_keys.data(), e.append_values.data(), AKV_DTYPE_F32, 0, nullptr); }},
      {"Append_NegativeTokens", AKV_ERR_INVALID_ARGUMENT, {"num_tokens"},
       [](Env &e) { return e.append_with(e.cache.get(), e.append_keys.data(), e.append_values.data(), AKV_DTYPE_F32, -3, nullptr); }},
      {"Append_Dtype77", AKV_ERR_INVALID_ARGUMENT, {"dtype"},
       [](Env &e) {
         return akv_test_append(e.cache.get(), e.append_keys.data(), e.append_values.data(), 77, kAppended, nullptr);
       }},
      {"Append_DtypeAuto", AKV_ERR_INVALID_ARGUMENT, {"dtype"},
       [](Env &e) { return e.append_with(e.cache.get(), e.append_keys.data(), e.append_values.data(), AKV_DTYPE_AUTO, kAppended, nullptr); }},
      {"Append_ValueOverflowsBf16Storage", AKV_ERR_NON_FINITE, {"values", "overflow"},
       [](Env &e) {
         const void *values = e.with_value(e.append_values, 5, std::numeric_limits<float>::max());
         return e.append_with(e.cache.get(), e.append_keys.data(), values, AKV_DTYPE_F32, kAppended, nullptr);
       }},
      {"Append_PositionsRepeated", AKV_ERR_INVALID_ARGUMENT, {"positions"},
       [](Env &e) {
         e.scratch_positions = {5000, 5000};
         return e.append_with(e.cache.get(), e.append_keys.data(), e.append_values.data(), AKV_DTYPE_F32, kAppended,
                              e.scratch_positions.data());
       }},
      {"Append_PositionsNotAboveCache", AKV_ERR_INVALID_ARGUMENT, {"positions"},
       [](Env &e) {
         e.scratch_positions = {10, 11};  // the prompt already holds positions 0..255 and more
         return e.append_with(e.cache.get(), e.append_keys.data(), e.append_values.data(), AKV_DTYPE_F32, kAppended,
                              e.scratch_positions.data());
       }},

      // ---- akv_decode ----
      {"Decode_NullCache", AKV_ERR_INVALID_ARGUMENT, {"cache"},
       [](Env &e) { return akv_decode(nullptr, e.query.data(), AKV_DTYPE_F32, 1, e.out.data(), nullptr); }},
      {"Decode_NullQueries", AKV_ERR_INVALID_ARGUMENT, {"queries"},
       [](Env &e) { return akv_decode(e.cache.get(), nullptr, AKV_DTYPE_F32, 1, e.out.data(), nullptr); }},
      {"Decode_NullOut", AKV_ERR_INVALID_ARGUMENT, {"out"},
       [](Env &e) { return akv_decode(e.cache.get(), e.query.data(), AKV_DTYPE_F32, 1, nullptr, nullptr); }},
      {"Decode_QLenZero", AKV_ERR_INVALID_ARGUMENT, {"q_len"},
       [](Env &e) { return akv_decode(e.cache.get(), e.query.data(), AKV_DTYPE_F32, 0, e.out.data(), nullptr); }},
      {"Decode_QLenNegative", AKV_ERR_INVALID_ARGUMENT, {"q_len"},
       [](Env &e) { return akv_decode(e.cache.get(), e.query.data(), AKV_DTYPE_F32, -1, e.out.data(), nullptr); }},
      {"Decode_QLenBeyondAppended", AKV_ERR_INVALID_ARGUMENT, {"q_len"},
       [](Env &e) {
         e.scratch = encode(std::vector<float>(e.query.count() * (kAppended + 2), 0.5f), AKV_DTYPE_F32);
         return akv_decode(e.cache.get(), e.scratch.data(), AKV_DTYPE_F32, kAppended + 2, e.out.data(), nullptr);
       }},
      {"Decode_Dtype77", AKV_ERR_INVALID_ARGUMENT, {"dtype"},
       [](Env &e) { return akv_test_decode(e.cache.get(), e.query.data(), 77, 1, e.out.data()); }},
      {"Decode_DtypeAuto", AKV_ERR_INVALID_ARGUMENT, {"dtype"},
       [](Env &e) { return akv_decode(e.cache.get(), e.query.data(), AKV_DTYPE_AUTO, 1, e.out.data(), nullptr); }},

      // ---- akv_decode_batch ----
      {"Batch_NullContext", AKV_ERR_INVALID_ARGUMENT, {"context"},
       [](Env &e) {
         akv_cache *caches[] = {e.cache.get()};
         return akv_decode_batch(nullptr, caches, 1, e.query.data(), AKV_DTYPE_F32, 1, e.out.data(), nullptr);
       }},
      {"Batch_NullCaches", AKV_ERR_INVALID_ARGUMENT, {"caches"},
       [](Env &e) { return akv_decode_batch(e.context.get(), nullptr, 1, e.query.data(), AKV_DTYPE_F32, 1, e.out.data(), nullptr); }},
      {"Batch_Zero", AKV_ERR_INVALID_ARGUMENT, {"batch"},
       [](Env &e) { return e.decode_batch_with({e.cache.get()}, 0, 1); }},
      {"Batch_Negative", AKV_ERR_INVALID_ARGUMENT, {"batch"},
       [](Env &e) { return e.decode_batch_with({e.cache.get()}, -2, 1); }},
      {"Batch_NullEntry", AKV_ERR_INVALID_ARGUMENT, {"caches", "cache"},
       [](Env &e) { return e.decode_batch_with({e.cache.get(), nullptr}, 2, 1); }},
      {"Batch_NullQueries", AKV_ERR_INVALID_ARGUMENT, {"queries"},
       [](Env &e) {
         akv_cache *caches[] = {e.cache.get()};
         return akv_decode_batch(e.context.get(), caches, 1, nullptr, AKV_DTYPE_F32, 1, e.out.data(), nullptr);
       }},
      {"Batch_NullOut", AKV_ERR_INVALID_ARGUMENT, {"out"},
       [](Env &e) {
         akv_cache *caches[] = {e.cache.get()};
         return akv_decode_batch(e.context.get(), caches, 1, e.query.data(), AKV_DTYPE_F32, 1, nullptr, nullptr);
       }},
      {"Batch_MismatchedShapes", AKV_ERR_MISMATCH, {"cache", "head", "shape"},
       [](Env &e) { return e.decode_batch_with({e.cache.get(), e.other_shape_cache.get()}, 2, 1); }},
      {"Batch_CacheOfAnotherContext", AKV_ERR_MISMATCH, {"context"},
       [](Env &e) { return e.decode_batch_with({e.cache.get(), e.other_context_cache.get()}, 2, 1); }},
      {"Batch_QLenBeyondAppended", AKV_ERR_INVALID_ARGUMENT, {"q_len"},
       [](Env &e) { return e.decode_batch_with({e.cache.get(), e.fullkv_cache.get()}, 2, 2); }},
      {"Batch_Dtype77", AKV_ERR_INVALID_ARGUMENT, {"dtype"},
       [](Env &e) { return e.decode_batch_with({e.cache.get()}, 1, 1, nullptr, 77); }},

      // ---- akv_decode_lse, akv_decode_batch_lse: the same checks as without lse ----
      {"DecodeLse_NullCache", AKV_ERR_INVALID_ARGUMENT, {"cache"},
       [](Env &e) {
         float lse[8];
         return akv_decode_lse(nullptr, e.query.data(), AKV_DTYPE_F32, 1, e.out.data(), lse, nullptr);
       }},
      {"DecodeLse_NullOut", AKV_ERR_INVALID_ARGUMENT, {"out"},
       [](Env &e) {
         float lse[8];
         return akv_decode_lse(e.cache.get(), e.query.data(), AKV_DTYPE_F32, 1, nullptr, lse, nullptr);
       }},
      {"DecodeLse_QLenZero", AKV_ERR_INVALID_ARGUMENT, {"q_len"},
       [](Env &e) {
         float lse[8];
         return akv_decode_lse(e.cache.get(), e.query.data(), AKV_DTYPE_F32, 0, e.out.data(), lse, nullptr);
       }},
      {"BatchLse_NullContext", AKV_ERR_INVALID_ARGUMENT, {"context"},
       [](Env &e) {
         akv_cache *caches[] = {e.cache.get()};
         float lse[8];
         return akv_decode_batch_lse(nullptr, caches, 1, e.query.data(), AKV_DTYPE_F32, 1, e.out.data(), lse, nullptr);
       }},
      {"BatchLse_CacheOfAnotherContext", AKV_ERR_MISMATCH, {"context"},
       [](Env &e) {
         akv_cache *caches[] = {e.cache.get(), e.other_context_cache.get()};
         float lse[16];
         e.scratch = encode(std::vector<float>(e.query.count() * 2, 0.5f), AKV_DTYPE_F32);
         e.out = poisoned(e.query.count() * 2, AKV_DTYPE_F32);
         return akv_decode_batch_lse(e.context.get(), caches, 2, e.scratch.data(), AKV_DTYPE_F32, 1, e.out.data(), lse,
                                     nullptr);
       }},

      // ---- inspection ----
      {"Stats_NullCache", AKV_ERR_INVALID_ARGUMENT, {"cache"},
       [](Env &) {
         akv_cache_stats s;
         s.struct_size = sizeof s;
         return akv_cache_stats_get(nullptr, &s);
       }},
      {"Stats_NullOut", AKV_ERR_INVALID_ARGUMENT, {"out_stats"},
       [](Env &e) { return akv_cache_stats_get(e.cache.get(), nullptr); }},
      {"Stats_StructSizeZero", AKV_ERR_INVALID_ARGUMENT, {"struct_size"},
       [](Env &e) {
         akv_cache_stats s;
         s.struct_size = 0;
         return akv_cache_stats_get(e.cache.get(), &s);
       }},
      {"Stats_StructSizeTooLarge", AKV_ERR_INVALID_ARGUMENT, {"struct_size"},
       [](Env &e) {
         akv_cache_stats s[2];
         s[0].struct_size = sizeof(akv_cache_stats) + 16;
         return akv_cache_stats_get(e.cache.get(), &s[0]);
       }},
      {"HeadStats_NullCache", AKV_ERR_INVALID_ARGUMENT, {"cache"},
       [](Env &) {
         akv_head_stats h[kH];
         return akv_cache_head_stats(nullptr, h);
       }},
      {"HeadStats_NullOut", AKV_ERR_INVALID_ARGUMENT, {"out_heads"},
       [](Env &e) { return akv_cache_head_stats(e.cache.get(), nullptr); }},
      {"Reconstruct_NullCache", AKV_ERR_INVALID_ARGUMENT, {"cache"},
       [](Env &e) {
         e.scratch.assign(static_cast<size_t>(kH) * (kS + kAppended) * kD * 8, 0);
         return akv_cache_reconstruct(nullptr, AKV_DTYPE_F32, 1, e.scratch.data(), e.scratch.data() + e.scratch.size() / 2,
                                      nullptr, nullptr);
       }},
      {"Reconstruct_NullKeys", AKV_ERR_INVALID_ARGUMENT, {"keys"},
       [](Env &e) {
         e.scratch.assign(static_cast<size_t>(kH) * (kS + kAppended) * kD * 4, 0);
         return akv_cache_reconstruct(e.cache.get(), AKV_DTYPE_F32, 1, nullptr, e.scratch.data(), nullptr, nullptr);
       }},
      {"Reconstruct_NullValues", AKV_ERR_INVALID_ARGUMENT, {"values"},
       [](Env &e) {
         e.scratch.assign(static_cast<size_t>(kH) * (kS + kAppended) * kD * 4, 0);
         return akv_cache_reconstruct(e.cache.get(), AKV_DTYPE_F32, 1, e.scratch.data(), nullptr, nullptr, nullptr);
       }},
      {"Reconstruct_Dtype77", AKV_ERR_INVALID_ARGUMENT, {"dtype"},
       [](Env &e) {
         e.scratch.assign(static_cast<size_t>(kH) * (kS + kAppended) * kD * 8, 0);
         return akv_test_reconstruct(e.cache.get(), 77, 1, e.scratch.data(), e.scratch.data() + e.scratch.size() / 2);
       }},
      {"Reconstruct_DtypeAuto", AKV_ERR_INVALID_ARGUMENT, {"dtype"},
       [](Env &e) {
         e.scratch.assign(static_cast<size_t>(kH) * (kS + kAppended) * kD * 8, 0);
         return akv_cache_reconstruct(e.cache.get(), AKV_DTYPE_AUTO, 1, e.scratch.data(),
                                      e.scratch.data() + e.scratch.size() / 2, nullptr, nullptr);
       }},
      {"LogitPenalty_NullCache", AKV_ERR_INVALID_ARGUMENT, {"cache"},
       [](Env &e) {
         e.scratch.assign(static_cast<size_t>(kH) * (kS + kAppended) * 4, 0);
         return akv_cache_logit_penalty(nullptr, reinterpret_cast<float *>(e.scratch.data()), nullptr);
       }},
      {"LogitPenalty_NullOut", AKV_ERR_INVALID_ARGUMENT, {"out"},
       [](Env &e) { return akv_cache_logit_penalty(e.cache.get(), nullptr, nullptr); }},

      // ---- serialization ----
      {"SerializedSize_NullCache", AKV_ERR_INVALID_ARGUMENT, {"cache"},
       [](Env &) {
         size_t b = 0;
         return akv_cache_serialized_size(nullptr, &b);
       }},
      {"SerializedSize_NullOut", AKV_ERR_INVALID_ARGUMENT, {"out_bytes"},
       [](Env &e) { return akv_cache_serialized_size(e.cache.get(), nullptr); }},
      {"Serialize_NullCache", AKV_ERR_INVALID_ARGUMENT, {"cache"},
       [](Env &e) {
         e.scratch.assign(e.bytes.size(), 0);
         size_t w = 0;
         return akv_cache_serialize(nullptr, e.scratch.data(), e.scratch.size(), &w, nullptr);
       }},
      {"Serialize_NullBuffer", AKV_ERR_INVALID_ARGUMENT, {"buffer"},
       [](Env &e) {
         size_t w = 0;
         return akv_cache_serialize(e.cache.get(), nullptr, e.bytes.size(), &w, nullptr);
       }},
      {"Serialize_CapacityTooSmall", AKV_ERR_CAPACITY, {"capacity"},
       [](Env &e) {
         e.scratch.assign(e.bytes.size(), 0);
         size_t w = 0;
         return akv_cache_serialize(e.cache.get(), e.scratch.data(), e.bytes.size() - 1, &w, nullptr);
       }},
      {"Deserialize_NullContext", AKV_ERR_INVALID_ARGUMENT, {"context"},
       [](Env &e) { return akv_cache_deserialize(nullptr, e.bytes.data(), e.bytes.size(), &e.out_cache, nullptr); }},
      {"Deserialize_NullBuffer", AKV_ERR_INVALID_ARGUMENT, {"buffer"},
       [](Env &e) { return akv_cache_deserialize(e.context.get(), nullptr, e.bytes.size(), &e.out_cache, nullptr); }},
      {"Deserialize_NullOutCache", AKV_ERR_INVALID_ARGUMENT, {"out_cache"},
       [](Env &e) { return akv_cache_deserialize(e.context.get(), e.bytes.data(), e.bytes.size(), nullptr, nullptr); }},
      {"Deserialize_Truncated", AKV_ERR_CORRUPT_DATA, {"truncat", "bytes"},
       [](Env &e) {
         return akv_cache_deserialize(e.context.get(), e.bytes.data(), e.bytes.size() - 1, &e.out_cache, nullptr);
       }},
      {"Deserialize_ChecksumMismatch", AKV_ERR_CORRUPT_DATA, {"checksum"},
       [](Env &e) {
         e.scratch = e.bytes;
         e.scratch[e.scratch.size() / 2] ^= 0x10;
         return akv_cache_deserialize(e.context.get(), e.scratch.data(), e.scratch.size(), &e.out_cache, nullptr);
       }},
      {"Deserialize_FutureVersion", AKV_ERR_VERSION, {"version"},
       [](Env &e) { return e.deserialize_damaged<uint32_t>(8, 99); }},
      // Issue 12, defect 1: a count announcing 2^28 appended tokens (valid CRC) made the
      // library allocate 1 GB before noticing the buffer was too short.
      {"Deserialize_SuffixCount2Pow28", AKV_ERR_CORRUPT_DATA, {"suffix"},
       [](Env &e) { return e.deserialize_damaged<int64_t>(e.suffix_count_offset(), int64_t{1} << 28); }},
      // Defect 2: a window start of INT64_MAX was accepted and decode overflowed.
      {"Deserialize_WindowPositionInt64Max", AKV_ERR_CORRUPT_DATA, {"window_first_position"},
       [](Env &e) {
         return e.deserialize_damaged<int64_t>(e.window_position_offset(), std::numeric_limits<int64_t>::max());
       }},
      {"Deserialize_NonFiniteAppendedKey", AKV_ERR_CORRUPT_DATA, {"non-finite"},
       [](Env &e) { return e.deserialize_damaged<uint16_t>(e.suffix_keys_offset(), 0x7f80); }},
      {"Deserialize_UnknownFlags", AKV_ERR_CORRUPT_DATA, {"flags"},
       [](Env &e) { return e.deserialize_damaged<uint32_t>(12, 1); }},
      {"Deserialize_Garbage", AKV_ERR_CORRUPT_DATA, {"magic", "checksum", "corrupt", "truncat", "serialized"},
       [](Env &e) {
         Rng rng(e.seed ^ 0xBAD);
         e.scratch.resize(e.bytes.size());
         for (uint8_t &b : e.scratch) b = static_cast<uint8_t>(rng.next());
         return akv_cache_deserialize(e.context.get(), e.scratch.data(), e.scratch.size(), &e.out_cache, nullptr);
       }},
  };
#if !AKV_TEST_BUILT_WITH_CUDA
  cases.push_back({"ContextCreate_CudaInCpuOnlyBuild", AKV_ERR_BACKEND_UNAVAILABLE, {"cuda"},
                   [](Env &e) { return e.create_context_with([](akv_context_options &o) { o.backend = AKV_BACKEND_CUDA; }); }});
#endif
  return cases;
}

class BadInput : public ::testing::TestWithParam<BadCase> {};

TEST_P(BadInput, FailsWithStatusAndMessageAndLeavesHandlesUsable) {
  const BadCase &c = GetParam();
  Env env;
  env.set_up();
  AKV_TRACE_SEED(env.seed);

  const akv_status status = c.call(env);
  const std::string message = akv_last_error_message();
  const bool status_ok = status == c.expected ||
                         std::find(c.also_accepted.begin(), c.also_accepted.end(), status) != c.also_accepted.end();
  EXPECT_TRUE(status_ok) << "expected " << akv_status_string(c.expected) << ", got " << akv_status_string(status)
                         << " | message: \"" << message << "\"";
  EXPECT_FALSE(message.empty()) << "no error message";
  const bool names_culprit = std::any_of(c.culprits.begin(), c.culprits.end(),
                                         [&](const std::string &word) { return contains_case_insensitive(message, word); });
  std::string culprit_list;
  for (const std::string &word : c.culprits) culprit_list += "\"" + word + "\" ";
  EXPECT_TRUE(names_culprit) << "message \"" << message << "\" names none of " << culprit_list;
  EXPECT_EQ(env.out_cache, nullptr) << "a failed call handed out a cache";
  akv_cache_destroy(env.out_cache);
  env.out_cache = nullptr;

  // The handles survived: same decode output, same stats, and the context still compresses.
  EXPECT_TRUE(decode_raw(env.cache.get(), env.query, 1) == env.baseline_output) << "the cache changed";
  EXPECT_TRUE(decode_raw(env.fullkv_cache.get(), env.query, 1) == env.baseline_fullkv) << "the FullKV cache changed";
  EXPECT_TRUE(decode_raw(env.other_shape_cache.get(), env.other_shape_query, 1) == env.baseline_other_shape)
      << "the H=1 cache changed";
  EXPECT_TRUE(decode_raw(env.other_context_cache.get(), env.query, 1) == env.baseline_other_context)
      << "the cache of the other context changed";
  const akv_cache_stats after = cache_stats(env.cache.get());
  EXPECT_EQ(after.appended_tokens, env.baseline_stats.appended_tokens);
  EXPECT_EQ(after.compressed_bytes, env.baseline_stats.compressed_bytes);
  EXPECT_TRUE(serialize(env.cache.get()) == env.bytes) << "the cache's serialized bytes changed";
  const CachePtr fresh = compress(env.context.get(), env.data, env.options);
  EXPECT_NE(fresh, nullptr);
}

INSTANTIATE_TEST_SUITE_P(EveryEntryPoint, BadInput, ::testing::ValuesIn(bad_cases()),
                         [](const ::testing::TestParamInfo<BadCase> &info) { return info.param.name; });

// The table covers every entry point that returns a status: each has cases under its prefix.
TEST(BadInputTable, EveryEntryPointHasCases) {
  const std::map<std::string, std::string> prefixes = {
      {"akv_context_create", "ContextCreate_"}, {"akv_compressed_size", "Size_"},
      {"akv_compress", "Compress_"},             {"akv_cache_reserve", "Reserve_"},
      {"akv_append", "Append_"},                 {"akv_decode", "Decode_"},
      {"akv_decode_batch", "Batch_"},            {"akv_cache_stats_get", "Stats_"},
      {"akv_decode_lse", "DecodeLse_"},          {"akv_decode_batch_lse", "BatchLse_"},
      {"akv_cache_head_stats", "HeadStats_"},    {"akv_cache_reconstruct", "Reconstruct_"},
      {"akv_cache_logit_penalty", "LogitPenalty_"},
      {"akv_cache_serialized_size", "SerializedSize_"}, {"akv_cache_serialize", "Serialize_"},
      {"akv_cache_deserialize", "Deserialize_"}};
  const std::vector<BadCase> cases = bad_cases();
  for (const auto &[function, prefix] : prefixes) {
    const auto count = std::count_if(cases.begin(), cases.end(),
                                     [&](const BadCase &c) { return c.name.rfind(prefix, 0) == 0; });
    EXPECT_GE(count, 2) << function << " has " << count << " bad-input cases (" << prefix << "*)";
  }
}

// The calls without a status take NULL (and any status value) without effect on the handles.
TEST(BadInputTable, VoidEntryPointsTakeNull) {
  Env env;
  env.set_up();
  AKV_TRACE_SEED(env.seed);
  akv_context_options_init(nullptr);
  akv_compress_options_init(nullptr);
  akv_compress_options_init_method(nullptr, AKV_METHOD_SNAPKV);
  akv_prefill_init(nullptr);
  akv_context_destroy(nullptr);
  akv_cache_destroy(nullptr);
  EXPECT_NE(akv_status_string(static_cast<akv_status>(-3)), nullptr);
  EXPECT_NE(akv_last_error_message(), nullptr);
  EXPECT_TRUE(decode_raw(env.cache.get(), env.query, 1) == env.baseline_output);
  EXPECT_TRUE(serialize(env.cache.get()) == env.bytes);
}

// ---- cases that do not fit the table --------------------------------------------------------

TEST(Backend, CudaContextWhereUnavailable) {
  akv_context_options options;
  akv_context_options_init(&options);
  options.backend = AKV_BACKEND_CUDA;
  akv_context *context = nullptr;
  const akv_status status = akv_context_create(&options, &context);
  if (AKV_TEST_BUILT_WITH_CUDA && status == AKV_OK) {
    akv_context_destroy(context);
    GTEST_SKIP() << "CUDA backend built and a device is present";
  }
  EXPECT_EQ(status, AKV_ERR_BACKEND_UNAVAILABLE) << akv_status_string(status) << " | " << akv_last_error_message();
  EXPECT_EQ(context, nullptr);
  EXPECT_TRUE(contains_case_insensitive(akv_last_error_message(), "cuda")) << akv_last_error_message();
}

// NaN in appended tokens or decode queries: the header only pins NON_FINITE for K/V/Q in
// general. Whatever the library does, it must not corrupt the cache: a rejected append leaves
// it unchanged.
TEST(NonFinite, AppendOrDecodeWithNaNLeavesCacheUsable) {
  Env env;
  env.set_up();
  AKV_TRACE_SEED(env.seed);
  const void *bad_keys = env.with_value(env.append_keys, 3, std::numeric_limits<float>::quiet_NaN());
  const std::vector<uint8_t> keys(static_cast<const uint8_t *>(bad_keys), static_cast<const uint8_t *>(bad_keys) + env.scratch.size());
  const akv_status append_status =
      akv_append(env.cache.get(), keys.data(), env.append_values.data(), AKV_DTYPE_F32, kAppended, nullptr, nullptr);
  EXPECT_TRUE(append_status == AKV_OK || append_status == AKV_ERR_NON_FINITE) << akv_status_string(append_status);
  if (append_status == AKV_ERR_NON_FINITE) {
    EXPECT_TRUE(contains_case_insensitive(akv_last_error_message(), "keys")) << akv_last_error_message();
    EXPECT_TRUE(decode_raw(env.cache.get(), env.query, 1) == env.baseline_output);
    EXPECT_EQ(cache_stats(env.cache.get()).appended_tokens, kAppended);
  }
  const void *bad_query = env.with_value(env.query, 0, std::numeric_limits<float>::quiet_NaN());
  std::vector<uint8_t> out = poisoned(env.query.count(), AKV_DTYPE_F32);
  const akv_status decode_status = akv_decode(env.fullkv_cache.get(), bad_query, AKV_DTYPE_F32, 1, out.data(), nullptr);
  EXPECT_TRUE(decode_status == AKV_OK || decode_status == AKV_ERR_NON_FINITE) << akv_status_string(decode_status);
  // The FullKV cache still decodes finite outputs from a finite query.
  EXPECT_EQ(count_non_finite(decode(env.fullkv_cache.get(), env.query, 1)), 0u);
}

// "A struct from an older header (smaller struct_size) is accepted; fields it lacks take their
// defaults": options cut before storage_dtype ignore a garbage storage_dtype; stats cut short
// are not written past their struct_size.
TEST(StructSize, OlderSmallerStructsAreAccepted) {
  Env env;
  env.set_up();
  AKV_TRACE_SEED(env.seed);
  akv_compress_options older = env.options;
  older.struct_size = offsetof(akv_compress_options, storage_dtype);
  akv_test_set_storage_dtype(&older, 77);  // beyond struct_size: must be ignored
  const akv_prefill prefill = env.data.view();
  akv_cache *cache = nullptr;
  ASSERT_EQ(akv_compress(env.context.get(), &prefill, &older, &cache, nullptr), AKV_OK) << akv_last_error_message();
  const CachePtr owned(cache);
  // What the library does: every field from storage_dtype on takes akv_compress_options_init's value.
  akv_compress_options completed = env.options, defaults;
  akv_compress_options_init(&defaults);
  const size_t cut = offsetof(akv_compress_options, storage_dtype);
  std::memcpy(reinterpret_cast<char *>(&completed) + cut, reinterpret_cast<const char *>(&defaults) + cut,
              sizeof completed - cut);
  const CachePtr current = compress(env.context.get(), env.data, completed);
  EXPECT_TRUE(serialize(owned.get()) == serialize(current.get())) << "the missing fields did not take their defaults";

  akv_cache_stats stats;
  std::memset(&stats, 0x77, sizeof stats);
  stats.struct_size = offsetof(akv_cache_stats, allocated_bytes);
  ASSERT_EQ(akv_cache_stats_get(env.cache.get(), &stats), AKV_OK) << akv_last_error_message();
  const uint8_t *tail = reinterpret_cast<const uint8_t *>(&stats) + offsetof(akv_cache_stats, allocated_bytes);
  EXPECT_TRUE(std::all_of(tail, reinterpret_cast<const uint8_t *>(&stats + 1), [](uint8_t b) { return b == 0x77; }))
      << "akv_cache_stats_get wrote past struct_size";
  EXPECT_EQ(stats.compressed_bytes, env.baseline_stats.compressed_bytes);
}

}  // namespace
}  // namespace akv_test
