#include "api/validate.hpp"

#include "core/dtype.hpp"
#include "core/method_traits.hpp"
#include "core/options.hpp"
#include "core/shape.hpp"

namespace akv {

void check_enum(int32_t value, int32_t first, int32_t last, const char *name) {
  if (value < first || value > last) fail(AKV_ERR_INVALID_ARGUMENT, name, " ", value, " is not a known value");
}

std::string dtype_label(int32_t v) {
  if (v >= AKV_DTYPE_AUTO && v <= AKV_DTYPE_BF16) return dtype_name(static_cast<akv_dtype>(v));
  return "value " + std::to_string(v);
}

void check_input_dtype(const akv_dtype &t, const char *name) {
  const int32_t v = raw_enum(t);
  if (v != AKV_DTYPE_F32 && v != AKV_DTYPE_F16 && v != AKV_DTYPE_BF16)
    fail(AKV_ERR_INVALID_ARGUMENT, name, " ", dtype_label(v), " is not f32, f16 or bf16");
}

void validate_decode(const akv_cache *c, int32_t q_len) {
  if (q_len < 1) fail(AKV_ERR_INVALID_ARGUMENT, "q_len ", q_len, " must be at least 1");
  if (q_len - 1 > c->suffix_len)
    fail(AKV_ERR_INVALID_ARGUMENT, "q_len ", q_len, " needs at least ", q_len - 1,
         " appended tokens (the new queries' own keys), but the cache has ", c->suffix_len);
}

akv_compress_options resolve_options(const akv_compress_options *options) {
  akv_compress_options defaults;
  akv_compress_options_init(&defaults);
  akv_compress_options o = versioned_copy(options, defaults, "options");
  // Every enum field first, as integers (see raw_enum).
  if (!find_method_traits(raw_enum(o.method)))
    fail(AKV_ERR_INVALID_ARGUMENT, "method ", raw_enum(o.method), " is not a known value");
  check_enum(raw_enum(o.pool_type), AKV_POOL_AVG, AKV_POOL_MAX, "pool_type");
  check_enum(raw_enum(o.residual_scale), AKV_SCALE_LEAST_SQUARES, AKV_SCALE_ABSMAX, "residual_scale");
  check_enum(raw_enum(o.rope.style), AKV_ROPE_NONE, AKV_ROPE_GPTJ, "rope.style");
  const int32_t storage = raw_enum(o.storage_dtype);
  if (storage != AKV_DTYPE_AUTO && storage != AKV_DTYPE_BF16 && storage != AKV_DTYPE_F16)
    fail(AKV_ERR_INVALID_ARGUMENT, "storage_dtype ", dtype_label(storage), " must be auto, f16 or bf16");
  check_option_ranges(o, AKV_ERR_INVALID_ARGUMENT, "");
  return o;
}

void validate_paged(const akv_prefill &p) {
  if (!p.block_table)
    fail(AKV_ERR_INVALID_ARGUMENT, "prefill.block_table is NULL but block_size, num_blocks or kv_block_stride is set"
         " (a paged prefill needs its block table)");
  if (p.block_size < 1) fail(AKV_ERR_INVALID_ARGUMENT, "prefill.block_size ", p.block_size, " must be at least 1 (paged prefill)");
  if (p.num_blocks < 1) fail(AKV_ERR_INVALID_ARGUMENT, "prefill.num_blocks ", p.num_blocks, " must be at least 1 (paged prefill)");
  if (p.kv_block_stride < 0) fail(AKV_ERR_INVALID_ARGUMENT, "prefill.kv_block_stride ", p.kv_block_stride, " must be >= 0");
  const int64_t blocks = (p.shape.seq_len + p.block_size - 1) / p.block_size;
  for (int64_t i = 0; i < blocks; ++i)
    if (p.block_table[i] < 0 || p.block_table[i] >= p.num_blocks)
      fail(AKV_ERR_INVALID_ARGUMENT, "prefill.block_table[", i, "] = ", p.block_table[i], " is outside [0, num_blocks=",
           p.num_blocks, ")");
}

}  // namespace akv
