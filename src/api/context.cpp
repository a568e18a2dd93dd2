// The C ABI, part 1: version, contexts, option defaults (see api/compress.cpp and
// api/cache.cpp for the rest). Every function body runs in guard(), so no exception crosses the
// boundary, and nothing is modified before all validation has passed.
#include <cstring>
#include <memory>

#include "api/guard.hpp"
#include "api/validate.hpp"
#include "core/backend.hpp"
#include "core/context.hpp"

using namespace akv;

extern "C" {

AKV_API unsigned akv_version_number(void) { return AKV_VERSION_NUMBER; }
AKV_API const char *akv_version_string(void) { return AKV_VERSION_STRING; }

AKV_API void akv_context_options_init(akv_context_options *o) {
  if (!o) return;
  std::memset(o, 0, sizeof *o);
  o->struct_size = sizeof *o;
  o->backend = AKV_BACKEND_CPU;
}

AKV_API akv_status akv_context_create(const akv_context_options *options, akv_context **out) {
  return guard(__func__, [&] {
    check_not_null(out, "out_context");
    akv_context_options defaults;
    akv_context_options_init(&defaults);
    const akv_context_options o = versioned_copy(options, defaults, "options");
    check_enum(raw_enum(o.backend), AKV_BACKEND_CPU, AKV_BACKEND_CUDA, "backend");
    if ((o.allocator.alloc == nullptr) != (o.allocator.free == nullptr))
      fail(AKV_ERR_INVALID_ARGUMENT, "allocator: set both alloc and free, or neither");
    if (o.num_threads < 0 || o.num_threads > kMaxThreads)
      fail(AKV_ERR_INVALID_ARGUMENT, "num_threads ", o.num_threads, " must be in [0, ", kMaxThreads,
           "] (0 = every hardware thread)");
    auto ctx = std::make_unique<akv_context>();
    ctx->backend = o.backend;
    ctx->device = o.device;
    ctx->allocator = o.allocator;  // none: the backend's default
    ctx->impl = o.backend == AKV_BACKEND_CUDA ? make_cuda_backend(*ctx) : make_cpu_backend(*ctx);
    ctx->pool = std::make_unique<ThreadPool>(o.num_threads);
    *out = ctx.release();
  });
}

AKV_API void akv_context_destroy(akv_context *context) { delete context; }

AKV_API void akv_compress_options_init(akv_compress_options *o) {
  if (!o) return;
  std::memset(o, 0, sizeof *o);
  o->struct_size = sizeof *o;
  o->method = AKV_METHOD_ANCHORKV;
  o->retain_fraction = 0.05;
  o->window = 32;
  o->anchors = 0;
  o->scored_fraction = 0.3;
  o->pool_kernel = 7;
  o->pool_type = AKV_POOL_AVG;
  o->residual_scale = AKV_SCALE_LEAST_SQUARES;
  o->seed = 42;
  o->layer_index = 0;
  o->layer_count = 1;
  o->rope.style = AKV_ROPE_NEOX;
  o->rope.rotary_dim = 0;
  o->rope.base = 10000.0;
  o->rope.inv_freq = nullptr;
  o->keys_post_rope = 0;
  o->softmax_scale = 0.0f;
  o->storage_dtype = AKV_DTYPE_AUTO;
  o->adakv_alpha = 0.2;
  o->quant_bits = 0;
  o->quant_outliers = 4;
  o->pyramid_beta = 20;
  o->andpro_chunk = 4;
  o->sink_tokens = 4;
  o->fill_budget = 1;
  o->anchor_share = 0.7;
  o->guard_fraction = 0.75;
  o->coverage_rounds = 4;
}

AKV_API void akv_compress_options_init_paper(akv_compress_options *o) {
  if (!o) return;
  akv_compress_options_init(o);
  o->scored_fraction = 0.7;
  o->sink_tokens = 0;
  o->fill_budget = 0;
  o->anchor_share = 0.0;
  o->guard_fraction = 0.0;
  o->coverage_rounds = 0;
}

AKV_API void akv_compress_options_init_method(akv_compress_options *o, akv_method method) {
  if (!o) return;
  akv_compress_options_init(o);
  o->method = method;
  switch (method) {
    case AKV_METHOD_SNAPKV:
    case AKV_METHOD_PYRAMIDKV:
    case AKV_METHOD_ADAKV:  // KVPress defaults (paper App. B.4)
      o->window = 64;
      o->pool_kernel = 5;
      o->pool_type = AKV_POOL_AVG;
      break;
    case AKV_METHOD_ANDPRO:  // the authors' setup (rebuttal: window 32, chunks of 4)
      o->window = 32;
      o->pool_kernel = 7;
      o->pool_type = AKV_POOL_MAX;
      o->andpro_chunk = 4;
      break;
    case AKV_METHOD_QUANTIZED:  // the paper's TurboQuant reproduction (App. B.5): b=3, k=4
      o->window = 128;
      o->quant_bits = 3;
      o->quant_outliers = 4;
      o->retain_fraction = 1.0;
      break;
    default:
      break;
  }
}

AKV_API void akv_prefill_init(akv_prefill *p) {
  if (!p) return;
  std::memset(p, 0, sizeof *p);
  p->struct_size = sizeof *p;
  p->dtype = AKV_DTYPE_BF16;
}

}  // extern "C"
