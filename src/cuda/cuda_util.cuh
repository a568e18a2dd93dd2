// Host-side helpers of the CUDA backend's .cu files: CUDA errors as statuses (and, from
// runtime.hpp, DeviceScope: the context's device for the duration of a call).
#pragma once
#include <cuda_runtime.h>

#include "core/error.hpp"
#include "cuda/runtime.hpp"  // DeviceScope

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

}  // namespace cuda
}  // namespace akv
