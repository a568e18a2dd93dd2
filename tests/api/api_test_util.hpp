// Helpers for the black-box API tests: RAII handles, dtype-tagged host tensors, prefill data,
// poisoned calls that return what the library wrote, and tolerance comparisons.
#pragma once

#include <anchorkv/anchorkv.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/attention.hpp"
#include "common/budget.hpp"
#include "common/half.hpp"
#include "common/random.hpp"
#include "common/rope.hpp"

// Every test that draws random data names its seed in the failure output.
#define AKV_TRACE_SEED(seed) SCOPED_TRACE(::akv_test::seed_note(seed))

namespace akv_test {

// Throws with the status name and the library's message: gtest reports the text as the
// failure of the test body. Used for calls that are not what the test is about.
inline void ok(akv_status status, const std::string &what) {
  if (status != AKV_OK)
    throw std::runtime_error(what + " failed: " + akv_status_string(status) + " | " +
                             akv_last_error_message());
}

struct ContextDeleter {
  void operator()(akv_context *context) const { akv_context_destroy(context); }
};
struct CacheDeleter {
  void operator()(akv_cache *cache) const { akv_cache_destroy(cache); }
};
using ContextPtr = std::unique_ptr<akv_context, ContextDeleter>;
using CachePtr = std::unique_ptr<akv_cache, CacheDeleter>;

inline ContextPtr make_context(int num_threads = 0, const akv_allocator *allocator = nullptr) {
  akv_context_options options;
  akv_context_options_init(&options);
  options.backend = AKV_BACKEND_CPU;
  options.num_threads = num_threads;
  if (allocator) options.allocator = *allocator;
  akv_context *context = nullptr;
  ok(akv_context_create(&options, &context), "akv_context_create");
  return ContextPtr(context);
}

// ---- dtypes -------------------------------------------------------------------------------

inline const char *dtype_name(akv_dtype dtype) {
  switch (dtype) {
    case AKV_DTYPE_F32: return "F32";
    case AKV_DTYPE_F16: return "F16";
    case AKV_DTYPE_BF16: return "BF16";
    default: return "AUTO";
  }
}

inline size_t dtype_size(akv_dtype dtype) { return dtype == AKV_DTYPE_F32 ? 4 : 2; }

inline float round_to_dtype(float value, akv_dtype dtype) {
  switch (dtype) {
    case AKV_DTYPE_F16: return round_to_fp16(value);
    case AKV_DTYPE_BF16: return round_to_bf16(value);
    default: return value;
  }
}

inline std::vector<uint8_t> encode(const std::vector<float> &values, akv_dtype dtype) {
  std::vector<uint8_t> bytes(values.size() * dtype_size(dtype));
  for (size_t i = 0; i < values.size(); ++i) {
    if (dtype == AKV_DTYPE_F32) {
      std::memcpy(&bytes[i * 4], &values[i], 4);
    } else {
      const uint16_t half = dtype == AKV_DTYPE_F16 ? float_to_fp16(values[i]) : float_to_bf16(values[i]);
      std::memcpy(&bytes[i * 2], &half, 2);
    }
  }
  return bytes;
}

inline std::vector<float> decode_bytes(const std::vector<uint8_t> &bytes, akv_dtype dtype) {
  const size_t count = bytes.size() / dtype_size(dtype);
  std::vector<float> values(count);
  for (size_t i = 0; i < count; ++i) {
    if (dtype == AKV_DTYPE_F32) {
      std::memcpy(&values[i], &bytes[i * 4], 4);
    } else {
      uint16_t half;
      std::memcpy(&half, &bytes[i * 2], 2);
      values[i] = dtype == AKV_DTYPE_F16 ? fp16_to_float(half) : bf16_to_float(half);
    }
  }
  return values;
}

// Output buffers are filled with NaN before every call, so an element the library forgets to
// write shows up as non-finite.
inline std::vector<uint8_t> poisoned(size_t count, akv_dtype dtype) {
  return encode(std::vector<float>(count, std::numeric_limits<float>::quiet_NaN()), dtype);
}

inline size_t count_non_finite(const std::vector<float> &values) {
  return static_cast<size_t>(std::count_if(values.begin(), values.end(),
                                           [](float v) { return !std::isfinite(v); }));
}

// A host tensor as handed to the library: `values` are exactly representable in `dtype`.
struct Tensor {
  akv_dtype dtype = AKV_DTYPE_F32;
  std::vector<float> values;
  std::vector<uint8_t> bytes;
  const void *data() const { return bytes.data(); }
  size_t count() const { return values.size(); }
};

inline Tensor make_tensor(const std::vector<float> &values, akv_dtype dtype) {
  Tensor tensor;
  tensor.dtype = dtype;
  tensor.bytes = encode(values, dtype);
  tensor.values = decode_bytes(tensor.bytes, dtype);
  return tensor;
}

// ---- RoPE options <-> reference ------------------------------------------------------------

inline RopeReference rope_reference(const akv_rope &rope) {
  RopeReference ref;
  ref.style = rope.style == AKV_ROPE_NONE ? RopeStyle::None
              : rope.style == AKV_ROPE_GPTJ ? RopeStyle::GptJ
                                            : RopeStyle::NeoX;
  ref.rotary_dim = rope.rotary_dim;
  ref.base = rope.base;
  return ref;
}

// ---- prefill data --------------------------------------------------------------------------

struct PrefillSpec {
  int64_t seq_len = 256;
  int kv_heads = 2;
  int group = 1;  // G = Hq / H
  int head_dim = 64;
  int window = 32;
  akv_dtype dtype = AKV_DTYPE_F32;
  bool explicit_positions = false;  // gapped, offset positions instead of NULL (0..S-1)
  // AnchorKV stores the window by its first position (the paper's layout has no per-token
  // position for it), so it requires consecutive window positions; FullKV does not.
  bool gaps_in_window = false;
  double query_scale = 1.5;
};

struct PrefillData {
  akv_shape shape{};
  int window = 32;
  akv_dtype dtype = AKV_DTYPE_F32;
  std::vector<float> keys_pre_rope;  // float master of the keys before RoPE
  Tensor keys;                       // as handed over: pre-RoPE, or post-RoPE if rotated
  Tensor values;
  Tensor queries;                    // [Hq][W][D], post-RoPE by definition
  std::vector<int32_t> positions;    // always filled; passed only if explicit_positions
  bool explicit_positions = false;

  akv_prefill view() const {
    akv_prefill prefill;
    akv_prefill_init(&prefill);
    prefill.shape = shape;
    prefill.dtype = dtype;
    prefill.keys = keys.data();
    prefill.values = values.data();
    prefill.queries = queries.data();
    prefill.positions = explicit_positions ? positions.data() : nullptr;
    return prefill;
  }
  int kv_heads() const { return shape.num_kv_heads; }
  int q_heads() const { return shape.num_q_heads; }
  int head_dim() const { return shape.head_dim; }
  int64_t seq_len() const { return shape.seq_len; }
};

// Explicit positions as an engine produces them: an offset (left padding), gaps in the
// prompt, and consecutive positions in the last `window` tokens unless gaps_in_window.
inline std::vector<int32_t> engine_positions(Rng &rng, int64_t count, int window, bool gaps_in_window) {
  std::vector<int32_t> positions = gapped_positions(rng, count, 7, 3);
  if (!gaps_in_window)
    for (int64_t i = std::max<int64_t>(1, count - window); i < count; ++i) positions[i] = positions[i - 1] + 1;
  return positions;
}

// post_rope: when given, the keys handed over carry that rotation (keys_post_rope = 1).
inline PrefillData make_prefill(Rng &rng, const PrefillSpec &spec,
                                const RopeReference *post_rope = nullptr) {
  PrefillData data;
  data.shape.seq_len = spec.seq_len;
  data.shape.num_kv_heads = spec.kv_heads;
  data.shape.num_q_heads = spec.kv_heads * spec.group;
  data.shape.head_dim = spec.head_dim;
  data.window = spec.window;
  data.dtype = spec.dtype;
  data.explicit_positions = spec.explicit_positions;
  data.positions = spec.explicit_positions ? engine_positions(rng, spec.seq_len, spec.window, spec.gaps_in_window)
                                           : default_positions(spec.seq_len);
  data.keys_pre_rope = llm_like_keys(rng, spec.kv_heads, spec.seq_len, spec.head_dim);
  std::vector<float> handed_keys = data.keys_pre_rope;
  if (post_rope) {
    const std::vector<double> rotated =
        post_rope->apply(data.keys_pre_rope, spec.kv_heads, spec.seq_len, spec.head_dim, data.positions);
    handed_keys.assign(rotated.begin(), rotated.end());
  }
  data.keys = make_tensor(handed_keys, spec.dtype);
  data.values = make_tensor(
      nonzero_normal(rng, static_cast<size_t>(spec.kv_heads) * spec.seq_len * spec.head_dim), spec.dtype);
  data.queries = make_tensor(
      nonzero_normal(rng, static_cast<size_t>(data.shape.num_q_heads) * spec.window * spec.head_dim,
                     spec.query_scale),
      spec.dtype);
  return data;
}

// ---- options -------------------------------------------------------------------------------

// AnchorKV as its paper sets it up (akv_compress_options_init_paper): the accounting of
// common/budget.hpp and the selection rules the representation tests check. Tests of the
// additions beyond the paper start from akv_compress_options_init.
inline akv_compress_options anchorkv_options(double retain_fraction, int window = 32, int anchors = 0) {
  akv_compress_options options;
  akv_compress_options_init_paper(&options);
  options.method = AKV_METHOD_ANCHORKV;
  options.retain_fraction = retain_fraction;
  options.window = window;
  options.anchors = anchors;
  return options;
}

inline akv_compress_options fullkv_options(int window = 32) {
  akv_compress_options options;
  akv_compress_options_init(&options);
  options.method = AKV_METHOD_FULLKV;
  options.retain_fraction = 1.0;
  options.window = window;
  return options;
}

// A retained fraction comfortably above the minimum for this shape (small S needs a lot:
// the window alone is W/S of the layer).
inline double workable_retain_fraction(const akv_shape &shape, int window, int anchors, double margin) {
  const AnchorBudget b = anchorkv_budget(shape.seq_len, shape.num_kv_heads, shape.head_dim, window, anchors, 1.0);
  return std::min(1.0, b.min_retain_fraction + margin);
}

// ---- calls ---------------------------------------------------------------------------------

inline CachePtr compress(akv_context *context, const PrefillData &data, const akv_compress_options &options) {
  const akv_prefill prefill = data.view();
  akv_cache *cache = nullptr;
  ok(akv_compress(context, &prefill, &options, &cache, nullptr), "akv_compress");
  if (cache == nullptr) throw std::runtime_error("akv_compress returned AKV_OK and a NULL cache");
  return CachePtr(cache);
}

inline akv_cache_stats cache_stats(const akv_cache *cache) {
  akv_cache_stats stats;
  std::memset(&stats, 0xA5, sizeof stats);  // poison: every field must be written
  stats.struct_size = sizeof stats;
  ok(akv_cache_stats_get(cache, &stats), "akv_cache_stats_get");
  return stats;
}

inline std::vector<akv_head_stats> head_stats(const akv_cache *cache, int kv_heads) {
  std::vector<akv_head_stats> heads(static_cast<size_t>(kv_heads));
  std::memset(heads.data(), 0xA5, heads.size() * sizeof(akv_head_stats));
  ok(akv_cache_head_stats(cache, heads.data()), "akv_cache_head_stats");
  return heads;
}

struct Dense {
  int kv_heads = 0, head_dim = 0;
  int64_t tokens = 0;
  std::vector<float> keys, values;  // [H][T][D]
  std::vector<uint8_t> present;     // [H][T]
  const float *key_row(int h, int64_t t) const { return &keys[(static_cast<size_t>(h) * tokens + t) * head_dim]; }
  const float *value_row(int h, int64_t t) const { return &values[(static_cast<size_t>(h) * tokens + t) * head_dim]; }
};

// akv_cache_reconstruct into poisoned buffers; fails the test if an element stays NaN.
inline Dense reconstruct(const akv_cache *cache, int rotated, akv_dtype dtype = AKV_DTYPE_F32) {
  const akv_cache_stats stats = cache_stats(cache);
  Dense dense;
  dense.kv_heads = stats.shape.num_kv_heads;
  dense.head_dim = stats.shape.head_dim;
  dense.tokens = stats.shape.seq_len + stats.appended_tokens;
  const size_t count = static_cast<size_t>(dense.kv_heads) * dense.tokens * dense.head_dim;
  std::vector<uint8_t> keys = poisoned(count, dtype), values = poisoned(count, dtype);
  dense.present.assign(static_cast<size_t>(dense.kv_heads) * dense.tokens, 0xCD);
  ok(akv_cache_reconstruct(cache, dtype, rotated, keys.data(), values.data(), dense.present.data(), nullptr),
     "akv_cache_reconstruct");
  dense.keys = decode_bytes(keys, dtype);
  dense.values = decode_bytes(values, dtype);
  if (count_non_finite(dense.keys) || count_non_finite(dense.values))
    throw std::runtime_error("akv_cache_reconstruct left non-finite (unwritten) elements");
  return dense;
}

// akv_cache_logit_penalty into a poisoned buffer, as reference_attention's logit_penalty
// ([H][T], T as reconstruct()).
inline std::vector<double> logit_penalties(const akv_cache *cache) {
  const akv_cache_stats stats = cache_stats(cache);
  const size_t count = static_cast<size_t>(stats.shape.num_kv_heads) * (stats.shape.seq_len + stats.appended_tokens);
  std::vector<float> out(count, std::numeric_limits<float>::quiet_NaN());
  ok(akv_cache_logit_penalty(cache, out.data(), nullptr), "akv_cache_logit_penalty");
  if (count_non_finite(out)) throw std::runtime_error("akv_cache_logit_penalty left non-finite (unwritten) elements");
  return std::vector<double>(out.begin(), out.end());
}

// akv_decode into a poisoned buffer; returns the raw output bytes (for bitwise comparisons).
inline std::vector<uint8_t> decode_raw(akv_cache *cache, const Tensor &queries, int q_len) {
  std::vector<uint8_t> out = poisoned(queries.count(), queries.dtype);
  ok(akv_decode(cache, queries.data(), queries.dtype, q_len, out.data(), nullptr), "akv_decode");
  return out;
}

inline std::vector<float> decode(akv_cache *cache, const Tensor &queries, int q_len) {
  std::vector<float> out = decode_bytes(decode_raw(cache, queries, q_len), queries.dtype);
  if (count_non_finite(out)) throw std::runtime_error("akv_decode left non-finite (unwritten) output elements");
  return out;
}

inline std::vector<uint8_t> serialize(const akv_cache *cache) {
  size_t size = 0;
  ok(akv_cache_serialized_size(cache, &size), "akv_cache_serialized_size");
  std::vector<uint8_t> buffer(size, 0xEE);
  size_t written = 0;
  ok(akv_cache_serialize(cache, buffer.data(), buffer.size(), &written, nullptr), "akv_cache_serialize");
  if (written != size)
    throw std::runtime_error("akv_cache_serialize wrote " + std::to_string(written) +
                             " bytes, akv_cache_serialized_size said " + std::to_string(size));
  return buffer;
}

inline CachePtr deserialize(akv_context *context, const std::vector<uint8_t> &bytes) {
  akv_cache *cache = nullptr;
  ok(akv_cache_deserialize(context, bytes.data(), bytes.size(), &cache, nullptr), "akv_cache_deserialize");
  return CachePtr(cache);
}

inline double effective_softmax_scale(const akv_compress_options &options, int head_dim) {
  return options.softmax_scale != 0.0f ? static_cast<double>(options.softmax_scale)
                                       : 1.0 / std::sqrt(static_cast<double>(head_dim));
}

// ---- comparisons ---------------------------------------------------------------------------

// |actual - expected| <= abs_tol + rel_tol*|expected| everywhere; reports the worst element.
template <typename E>
::testing::AssertionResult all_near(const std::vector<float> &actual, const std::vector<E> &expected,
                                    double abs_tol, double rel_tol) {
  if (actual.size() != expected.size())
    return ::testing::AssertionFailure() << "size " << actual.size() << " != " << expected.size();
  size_t worst = 0, failures = 0;
  double worst_excess = -INFINITY;
  for (size_t i = 0; i < actual.size(); ++i) {
    const double e = static_cast<double>(expected[i]);
    const double error = std::fabs(static_cast<double>(actual[i]) - e);
    const double excess = std::isfinite(actual[i]) ? error - (abs_tol + rel_tol * std::fabs(e)) : INFINITY;
    if (excess > 0) ++failures;
    if (excess > worst_excess) worst_excess = excess, worst = i;
  }
  if (failures == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << failures << " of " << actual.size() << " elements out of tolerance (abs " << abs_tol
         << ", rel " << rel_tol << "); worst at index " << worst << ": actual " << actual[worst]
         << ", expected " << static_cast<double>(expected[worst]);
}

// The same comparison for an output whose arithmetic rounds to 16 bits somewhere inside (bf16
// operands of a logit): rounding noise moves an element of a near-tied softmax row now and then
// past `tol` (about 1 check in 200 of the bf16 decode emulation, 2026-12-06, up to 1.5 tol), a
// defect moves whole rows or many elements. So: every element within `cap`, at most `outliers`
// (a fraction) of them past `tol`, and a mean error of at most `mean_tol` (a defect that moves
// every element a little).
template <typename E>
::testing::AssertionResult near_but_for_rounding(const std::vector<float> &actual, const std::vector<E> &expected,
                                                 double tol, double cap, double outliers, double mean_tol) {
  if (::testing::AssertionResult capped = all_near(actual, expected, cap, cap); !capped) return capped;
  size_t past = 0;
  double sum = 0.0;
  for (size_t i = 0; i < actual.size(); ++i) {
    const double e = static_cast<double>(expected[i]), error = std::fabs(static_cast<double>(actual[i]) - e);
    past += error > tol + tol * std::fabs(e);
    sum += error;
  }
  const double mean = actual.empty() ? 0.0 : sum / static_cast<double>(actual.size());
  if (mean > mean_tol)
    return ::testing::AssertionFailure() << "mean error " << mean << " > " << mean_tol << " over " << actual.size()
                                         << " elements";
  if (static_cast<double>(past) <= outliers * static_cast<double>(actual.size())) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << all_near(actual, expected, tol, tol).message() << " (at most "
                                       << outliers * 100 << "% may be, within " << cap << ")";
}

// A decode output against the CPU's at `tol` (the dtype's bound): every element within it, or
// for bf16 outputs near_but_for_rounding's bounds (2.5 tol, 2% past tol, mean tol / 8), the
// same in tests/emu and tests/gpu.
template <typename E>
::testing::AssertionResult decode_output_near(const std::vector<float> &actual, const std::vector<E> &expected,
                                              akv_dtype dtype, double tol) {
  if (dtype == AKV_DTYPE_BF16) return near_but_for_rounding(actual, expected, tol, 2.5 * tol, 0.02, 0.125 * tol);
  return all_near(actual, expected, tol, tol);
}

// A measured quantity: recorded in the gtest XML report, printed when AKV_TEST_VERBOSE is set.
inline void note(const std::string &key, double value) {
  ::testing::Test::RecordProperty(key, std::to_string(value));
  if (const char *verbose = std::getenv("AKV_TEST_VERBOSE"); verbose && *verbose)
    std::printf("  [measured] %s = %.6g\n", key.c_str(), value);
}

// Largest |actual - expected| divided by `scale`.
template <typename E>
double max_error(const std::vector<float> &actual, const std::vector<E> &expected, double scale) {
  double worst = 0.0;
  for (size_t i = 0; i < actual.size() && i < expected.size(); ++i)
    worst = std::max(worst, std::fabs(static_cast<double>(actual[i]) - static_cast<double>(expected[i])));
  return worst / scale;
}

inline bool contains_case_insensitive(const std::string &haystack, const std::string &needle) {
  auto lower = [](std::string s) {
    std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
    return s;
  };
  return lower(haystack).find(lower(needle)) != std::string::npos;
}

// Every decimal number written in a message ("0.0514", "5.14e-02", "3387336").
inline std::vector<double> numbers_in(const std::string &text) {
  std::vector<double> numbers;
  const char *p = text.c_str();
  while (*p) {
    if (std::isdigit(static_cast<unsigned char>(*p)) || (*p == '.' && std::isdigit(static_cast<unsigned char>(p[1])))) {
      char *end = nullptr;
      const double value = std::strtod(p, &end);
      if (end != p) {
        numbers.push_back(value);
        p = end;
        continue;
      }
    }
    ++p;
  }
  return numbers;
}

}  // namespace akv_test
