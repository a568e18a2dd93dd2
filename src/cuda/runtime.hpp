// The CUDA runtime as the rest of the library sees it. Implemented in runtime.cu when the
// build has the CUDA backend; otherwise every entry reports the backend as unavailable.
#pragma once
#include <cstddef>

namespace akv {
namespace cuda {

bool compiled();                       // built with the CUDA backend
int device_count();                    // 0 when no usable device (or not compiled)
void check_device(int device);         // throws AKV_ERR_BACKEND_UNAVAILABLE / AKV_ERR_BACKEND
void *device_malloc(int device, size_t bytes);  // throws AKV_ERR_OUT_OF_MEMORY
void device_free(int device, void *ptr) noexcept;

// Makes `device` current for a scope; the caller's current device is restored on exit.
// Throws AKV_ERR_BACKEND when the device cannot be made current.
class DeviceScope {
 public:
  explicit DeviceScope(int device);
  ~DeviceScope();
  DeviceScope(const DeviceScope &) = delete;
  DeviceScope &operator=(const DeviceScope &) = delete;

 private:
  int previous_ = -1;
};

}  // namespace cuda
}  // namespace akv
