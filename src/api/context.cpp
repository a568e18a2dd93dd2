// The C ABI, part 1: version, contexts, option defaults (see api/compress.cpp and
// api/cache.cpp for the rest). Every function body runs in guard(), so no exception crosses the
// boundary, and nothing is modified before all validation has passed.
#include <cstring>
#include <memory>

#include "api/guard.hpp"
#include "api/validate.hpp"
#include "core/backend.hpp"
#include "core/context.hpp"
#include "core/options.hpp"

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
  if (o) *o = default_options();
}

AKV_API void akv_compress_options_init_paper(akv_compress_options *o) {
  if (o) *o = paper_options();
}

AKV_API void akv_compress_options_init_method(akv_compress_options *o, akv_method method) {
  if (o) *o = method_options(method);
}

AKV_API void akv_prefill_init(akv_prefill *p) {
  if (p) *p = default_prefill();
}

}  // extern "C"
