// Built only without the CUDA backend (see src/CMakeLists.txt): CUDA contexts are reported
// as unavailable in this build.
#ifndef ANCHORKV_HAVE_CUDA
#include "core/error.hpp"
#include "cuda/runtime.hpp"

namespace akv {
namespace cuda {

bool compiled() { return false; }
int device_count() { return 0; }
void check_device(int) {
  fail(AKV_ERR_BACKEND_UNAVAILABLE, "the CUDA backend is not available in this build "
       "(configure with -DANCHORKV_CUDA=ON on a machine with the CUDA toolkit)");
}
void *device_malloc(int, size_t) { check_device(0); return nullptr; }
void device_free(int, void *) noexcept {}
DeviceScope::DeviceScope(int device) { check_device(device); }
DeviceScope::~DeviceScope() = default;

}  // namespace cuda
}  // namespace akv
#endif

#ifndef ANCHORKV_HAVE_CUDA
#include "cuda/backend.hpp"

namespace akv {
namespace cuda {

void copy(void *, const void *, size_t, void *, bool) { check_device(0); }
void copy_rows(void *, size_t, const void *, size_t, size_t, size_t, void *) { check_device(0); }
void synchronize(void *) { check_device(0); }
void upload_view(akv_cache &, void *) { check_device(0); }
void decode(akv_context &, akv_cache *const *, int32_t, const void *, akv_dtype, int32_t, void *, float *, void *) {
  check_device(0);
}
void append(akv_cache &, const void *, const void *, akv_dtype, int32_t, const int32_t *, void *) { check_device(0); }
bool capturing(void *) {
  check_device(0);
  return false;
}
AppendedOnDevice read_appended(akv_cache &, int64_t) {
  check_device(0);
  return {};
}
void *workspace(akv_context &, size_t, void *, int) {
  check_device(0);
  return nullptr;
}
std::unique_ptr<akv_cache> compress_anchorkv_cuda(const CompressRequest &, void *) {
  check_device(0);
  return nullptr;
}
std::unique_ptr<akv_cache> compress_fullkv_cuda(const CompressRequest &, void *) {
  check_device(0);
  return nullptr;
}
std::unique_ptr<akv_cache> compress_eviction_cuda(const CompressRequest &, void *) {
  check_device(0);
  return nullptr;
}

}  // namespace cuda
}  // namespace akv
#endif
