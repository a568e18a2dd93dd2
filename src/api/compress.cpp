// The C ABI, part 2: sizes and compression (see api/context.cpp).
#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "api/guard.hpp"
#include "api/validate.hpp"
#include "core/backend.hpp"
#include "core/context.hpp"
#include "core/shape.hpp"
#include "methods/methods.hpp"

using namespace akv;

extern "C" {

AKV_API akv_status akv_compressed_size(const akv_compress_options *options, const akv_shape *shape,
                                       size_t *out_bytes) {
  return guard(__func__, [&] {
    check_not_null(shape, "shape");
    check_not_null(out_bytes, "out_bytes");
    const akv_compress_options o = resolve_options(options);
    check_shape(*shape, AKV_ERR_INVALID_ARGUMENT, AKV_ERR_UNSUPPORTED, "shape.");
    *out_bytes = static_cast<size_t>(compressed_footprint(o, *shape));
  });
}

AKV_API akv_status akv_compressed_size_model(const akv_compress_options *options, const akv_shape *shape,
                                             int32_t num_layers, const double *retain_fractions,
                                             size_t *out_layer_bytes, size_t *out_total_bytes) {
  return guard(__func__, [&] {
    check_not_null(shape, "shape");
    check_not_null(out_total_bytes, "out_total_bytes");
    if (num_layers < 1) fail(AKV_ERR_INVALID_ARGUMENT, "num_layers ", num_layers, " must be at least 1");
    akv_compress_options o = resolve_options(options);
    check_shape(*shape, AKV_ERR_INVALID_ARGUMENT, AKV_ERR_UNSUPPORTED, "shape.");
    std::vector<size_t> bytes(num_layers);
    size_t total = 0;
    for (int32_t l = 0; l < num_layers; ++l) {
      o.layer_index = l;
      o.layer_count = num_layers;
      if (retain_fractions) {
        o.retain_fraction = retain_fractions[l];
        if (!std::isfinite(o.retain_fraction) || o.retain_fraction <= 0.0 || o.retain_fraction > 1.0)
          fail(AKV_ERR_INVALID_ARGUMENT, "retain_fractions[", l, "] = ", o.retain_fraction, " must be in (0, 1]");
      }
      try {
        bytes[l] = static_cast<size_t>(compressed_footprint(o, *shape));
      } catch (const Error &e) {
        fail(e.status(), "layer ", l, ": ", e.what());
      }
      if (bytes[l] > SIZE_MAX - total) fail(AKV_ERR_INVALID_ARGUMENT, "the model's compressed size overflows size_t");
      total += bytes[l];
    }
    if (out_layer_bytes) std::copy(bytes.begin(), bytes.end(), out_layer_bytes);
    *out_total_bytes = total;
  });
}

AKV_API akv_status akv_compress(akv_context *context, const akv_prefill *prefill,
                                const akv_compress_options *options, akv_cache **out_cache, void *stream) {
  return guard(__func__, [&] {
    check_not_null(context, "context");
    check_not_null(prefill, "prefill");
    check_not_null(out_cache, "out_cache");
    akv_prefill defaults;
    akv_prefill_init(&defaults);
    const akv_prefill p = versioned_copy(prefill, defaults, "prefill");
    const akv_compress_options o = resolve_options(options);
    check_shape(p.shape, AKV_ERR_INVALID_ARGUMENT, AKV_ERR_UNSUPPORTED, "shape.");
    check_input_dtype(p.dtype, "prefill.dtype");
    check_not_null(p.keys, "prefill.keys");
    check_not_null(p.values, "prefill.values");
    if (p.kv_head_stride < 0 || p.kv_token_stride < 0 || p.q_head_stride < 0 || p.q_token_stride < 0)
      fail(AKV_ERR_INVALID_ARGUMENT, "prefill strides must be >= 0 (0 = contiguous)");
    if ((p.kv_token_stride && p.kv_token_stride < p.shape.head_dim) || (p.q_token_stride && p.q_token_stride < p.shape.head_dim))
      fail(AKV_ERR_INVALID_ARGUMENT, "prefill token strides must be at least head_dim ", p.shape.head_dim);
    if (p.block_table || p.block_size || p.num_blocks || p.kv_block_stride) validate_paged(p);
    const MethodPlan plan = plan_method(o, p.shape);  // the method's checks, before reading data
    if (p.positions) {
      for (int64_t t = 1; t < p.shape.seq_len; ++t)
        if (p.positions[t] <= p.positions[t - 1])
          fail(AKV_ERR_INVALID_ARGUMENT, "prefill.positions are not strictly increasing at index ", t, " (",
               p.positions[t - 1], " then ", p.positions[t], ")");
      if (p.positions[0] < 0) fail(AKV_ERR_INVALID_ARGUMENT, "prefill.positions[0] ", p.positions[0], " is negative");
    }
    context->impl->check_compress(o, p.shape);
    const CompressRequest req{context, &p, &o, &plan};
    std::unique_ptr<akv_cache> cache = context->impl->compress(req, stream);
    *out_cache = cache.release();
  });
}

}  // extern "C"
