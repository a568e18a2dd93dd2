// Host-side helpers of the CUDA backend's .cu files: CUDA errors as statuses, and the
// context's device for the duration of a call.
#pragma once
#include <cuda_runtime.h>

#include "core/error.hpp"

namespace akv {
namespace cuda {

// Throws AKV_ERR_BACKEND naming the call; a non-sticky error is cleared so that the context
// stays usable.
inline void check(cudaError_t err, const char *what) {
  if (err != cudaSuccess) {
    cudaGetLastError();
    fail(AKV_ERR_BACKEND, what, " failed: ", cudaGetErrorString(err));
  }
}

// Makes `device` current; the caller's current device is restored on scope exit.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) check(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceScope() { cudaSetDevice(previous_); }
  DeviceScope(const DeviceScope &) = delete;
  DeviceScope &operator=(const DeviceScope &) = delete;

 private:
  int previous_ = 0;
};

}  // namespace cuda
}  // namespace akv
