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

}  // namespace cuda
}  // namespace akv
#endif
