// Small valid caches of every method and storage variant, built through the public API: the
// seeds of the fuzz corpus (tests/fuzz/make_corpus.cpp) and the subjects of the deserializer's
// field-by-field validation test (tests/core/serialize_validation_test.cpp). Tiny shapes (D=16,
// S <= 96) keep a serialized cache at a few KB, so that a fuzzer mutates metadata, not bulk.
#pragma once

#include <anchorkv/anchorkv.h>

#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/random.hpp"

namespace akv_test {

struct SmallCache {
  std::string name;
  std::shared_ptr<akv_cache> cache;  // destroyed with akv_cache_destroy
};

struct SmallCacheSpec {
  std::string name;
  akv_method method = AKV_METHOD_FULLKV;
  int64_t seq_len = 48;
  int kv_heads = 2, group = 2, head_dim = 16, window = 8;
  akv_dtype dtype = AKV_DTYPE_F32;           // input dtype (F16 input: F16 storage)
  akv_dtype storage = AKV_DTYPE_AUTO;
  akv_rope_style rope = AKV_ROPE_NEOX;
  int rotary_dim = 0;
  bool inv_freq_table = false;
  bool gapped_positions = false;             // explicit positions with gaps (window consecutive)
  bool keys_post_rope = false;
  int appended = 0;                          // tokens appended after compression
  double retain_fraction = 0.0;              // 0: the smallest of 0.3, 0.4 .. 1.0 that fits
  int layer_index = 0, layer_count = 1;
  int quant_bits = 0, quant_outliers = 2;
  int storage_format = 0;                    // AnchorKV: 0 (= 3) or 2
  int anchors = 0;                           // AnchorKV: 0 = automatic
};

inline std::vector<SmallCacheSpec> small_cache_specs() {
  std::vector<SmallCacheSpec> specs;
  auto add = [&](SmallCacheSpec s) { specs.push_back(std::move(s)); };
  SmallCacheSpec s;
  s = {};
  s.name = "fullkv_bf16_neox_appended", s.appended = 2;
  add(s);
  s = {};
  s.name = "fullkv_f16_gptj_positions", s.dtype = AKV_DTYPE_F16, s.rope = AKV_ROPE_GPTJ, s.gapped_positions = true;
  add(s);
  s = {};
  s.name = "fullkv_norope_h1", s.rope = AKV_ROPE_NONE, s.kv_heads = 1, s.group = 4, s.seq_len = 20;
  add(s);
  s = {};
  s.name = "anchorkv_bf16_neox_appended", s.method = AKV_METHOD_ANCHORKV, s.seq_len = 96, s.appended = 2;
  add(s);
  s = {};
  s.name = "anchorkv_bf16_full_budget", s.method = AKV_METHOD_ANCHORKV, s.seq_len = 80, s.retain_fraction = 1.0;
  add(s);
  s = {};
  s.name = "anchorkv_layout2_f16_gptj_partial_invfreq", s.method = AKV_METHOD_ANCHORKV, s.seq_len = 96,
  s.dtype = AKV_DTYPE_F16, s.rope = AKV_ROPE_GPTJ, s.rotary_dim = 8, s.inv_freq_table = true,
  s.gapped_positions = true, s.appended = 1, s.storage_format = 2;  // gapped: the paper's layout
  add(s);
  s = {};  // storage format 3 with segment tables (k > 256), segments of 256 positions
  s.name = "anchorkv_tables", s.method = AKV_METHOD_ANCHORKV, s.seq_len = 560, s.kv_heads = 1,
  s.group = 1, s.anchors = 300, s.retain_fraction = 0.8;
  add(s);
  s = {};
  s.name = "anchorkv_layout2_neox_appended", s.method = AKV_METHOD_ANCHORKV, s.seq_len = 96, s.appended = 2,
  s.storage_format = 2;
  add(s);
  s = {};
  s.name = "anchorkv_norope_postrope_flag", s.method = AKV_METHOD_ANCHORKV, s.seq_len = 72,
  s.rope = AKV_ROPE_NONE, s.keys_post_rope = true, s.kv_heads = 1, s.group = 1, s.appended = 1;
  add(s);
  const akv_method evicting[] = {AKV_METHOD_SNAPKV, AKV_METHOD_PYRAMIDKV, AKV_METHOD_ADAKV, AKV_METHOD_ANDPRO};
  const char *evicting_names[] = {"snapkv", "pyramidkv", "adakv", "andpro"};
  for (int i = 0; i < 4; ++i) {
    s = {};
    s.name = std::string(evicting_names[i]) + "_appended", s.method = evicting[i], s.seq_len = 64,
    s.retain_fraction = 0.5, s.appended = 1, s.layer_index = 1, s.layer_count = 3;
    add(s);
  }
  s = {};
  s.name = "snapkv_f16_gptj", s.method = AKV_METHOD_SNAPKV, s.seq_len = 40, s.dtype = AKV_DTYPE_F16,
  s.rope = AKV_ROPE_GPTJ, s.retain_fraction = 0.6;
  add(s);
  for (int bits : {2, 3, 4}) {
    s = {};
    s.name = "quantized_" + std::to_string(bits) + "bit", s.method = AKV_METHOD_QUANTIZED, s.quant_bits = bits,
    s.retain_fraction = 1.0, s.appended = bits == 3 ? 1 : 0;
    add(s);
  }
  s = {};
  s.name = "quantized_f16_no_outliers", s.method = AKV_METHOD_QUANTIZED, s.dtype = AKV_DTYPE_F16, s.quant_bits = 3,
  s.quant_outliers = 0, s.retain_fraction = 1.0, s.gapped_positions = true;
  add(s);
  return specs;
}

namespace detail {

inline std::vector<uint8_t> to_input(const std::vector<float> &values, akv_dtype dtype) {
  std::vector<uint8_t> out(values.size() * (dtype == AKV_DTYPE_F32 ? 4 : 2));
  for (size_t i = 0; i < values.size(); ++i) {
    if (dtype == AKV_DTYPE_F32) {
      std::memcpy(&out[i * 4], &values[i], 4);
    } else {  // F16 by conversion through the compiler's _Float16 is not portable: do it by hand
      const float v = values[i];
      uint32_t bits;
      std::memcpy(&bits, &v, 4);
      const uint32_t sign = (bits >> 16) & 0x8000u;
      int32_t exponent = static_cast<int32_t>((bits >> 23) & 0xff) - 127 + 15;
      uint32_t mantissa = (bits >> 13) & 0x3ffu;  // truncation is fine for test data
      uint16_t half;
      if (exponent <= 0) half = static_cast<uint16_t>(sign);  // tiny: zero
      else if (exponent >= 31) half = static_cast<uint16_t>(sign | 0x7bffu);  // clamp to the largest finite
      else half = static_cast<uint16_t>(sign | (static_cast<uint32_t>(exponent) << 10) | mantissa);
      std::memcpy(&out[i * 2], &half, 2);
    }
  }
  return out;
}

}  // namespace detail

// Compresses (and appends to) one small cache; throws std::runtime_error with the library's
// message when a call fails.
inline std::shared_ptr<akv_cache> make_small_cache(akv_context *context, const SmallCacheSpec &spec, uint64_t seed) {
  Rng rng(seed);
  const int H = spec.kv_heads, Hq = spec.kv_heads * spec.group, D = spec.head_dim, W = spec.window;
  const int64_t S = spec.seq_len;
  const std::vector<uint8_t> keys = detail::to_input(llm_like_keys(rng, H, S, D), spec.dtype);
  const std::vector<uint8_t> values = detail::to_input(nonzero_normal(rng, static_cast<size_t>(H) * S * D), spec.dtype);
  const std::vector<uint8_t> queries =
      detail::to_input(nonzero_normal(rng, static_cast<size_t>(Hq) * W * D, 1.5), spec.dtype);
  std::vector<int32_t> positions = gapped_positions(rng, S, 5, 3);
  for (int64_t t = S - W; t < S; ++t) positions[t] = positions[t - 1] + 1;  // consecutive window
  std::vector<float> inv_freq;
  const int rotary = spec.rotary_dim ? spec.rotary_dim : D;
  for (int j = 0; j < rotary / 2; ++j) inv_freq.push_back(static_cast<float>(1.0 / (1.0 + 3.0 * j * j)));

  akv_prefill prefill;
  akv_prefill_init(&prefill);
  prefill.shape = {S, H, Hq, D};
  prefill.dtype = spec.dtype;
  prefill.keys = keys.data();
  prefill.values = values.data();
  prefill.queries = queries.data();
  prefill.positions = spec.gapped_positions ? positions.data() : nullptr;
  akv_compress_options options;
  akv_compress_options_init_method(&options, spec.method);
  options.window = W;
  options.storage_dtype = spec.storage;
  options.rope.style = spec.rope;
  options.rope.rotary_dim = spec.rotary_dim;
  options.rope.inv_freq = spec.inv_freq_table ? inv_freq.data() : nullptr;
  options.keys_post_rope = spec.keys_post_rope ? 1 : 0;
  options.layer_index = spec.layer_index;
  options.layer_count = spec.layer_count;
  options.quant_bits = spec.quant_bits;
  options.quant_outliers = spec.quant_outliers;
  options.storage_format = spec.storage_format;
  options.anchors = spec.anchors;
  options.seed = seed;
  akv_cache *raw = nullptr;
  akv_status status = AKV_ERR_BUDGET;
  const std::vector<double> fractions =
      spec.retain_fraction > 0.0 ? std::vector<double>{spec.retain_fraction}
                                 : std::vector<double>{0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0};
  for (double theta : fractions) {
    options.retain_fraction = theta;
    status = akv_compress(context, &prefill, &options, &raw, nullptr);
    if (status != AKV_ERR_BUDGET) break;
  }
  if (status != AKV_OK)
    throw std::runtime_error(spec.name + ": akv_compress: " + akv_status_string(status) + " | " +
                             akv_last_error_message());
  std::shared_ptr<akv_cache> cache(raw, akv_cache_destroy);
  if (spec.appended > 0) {
    const int n = spec.appended;
    const std::vector<uint8_t> k = detail::to_input(llm_like_keys(rng, H, n, D), spec.dtype);
    const std::vector<uint8_t> v = detail::to_input(nonzero_normal(rng, static_cast<size_t>(H) * n * D), spec.dtype);
    status = akv_append(cache.get(), k.data(), v.data(), spec.dtype, n, nullptr, nullptr);
    if (status != AKV_OK)
      throw std::runtime_error(spec.name + ": akv_append: " + akv_status_string(status) + " | " +
                               akv_last_error_message());
  }
  return cache;
}

inline std::vector<SmallCache> small_caches(akv_context *context, uint64_t seed) {
  std::vector<SmallCache> out;
  for (const SmallCacheSpec &spec : small_cache_specs()) out.push_back({spec.name, make_small_cache(context, spec, seed)});
  return out;
}

inline std::vector<uint8_t> serialized_bytes(const akv_cache *cache) {
  size_t size = 0;
  akv_status status = akv_cache_serialized_size(cache, &size);
  std::vector<uint8_t> bytes(size);
  if (status == AKV_OK) status = akv_cache_serialize(cache, bytes.data(), bytes.size(), nullptr, nullptr);
  if (status != AKV_OK) throw std::runtime_error(std::string("akv_cache_serialize: ") + akv_last_error_message());
  return bytes;
}

}  // namespace akv_test
