// CUDA backend runtime glue: device discovery, the current device for a scope, and default
// device allocation.
#include <cuda_runtime.h>

#include "cuda/cuda_util.cuh"

namespace akv {
namespace cuda {

bool compiled() { return true; }

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error
    return 0;
  }
  return n;
}

void check_device(int device) {
  const int n = device_count();
  require(n > 0, AKV_ERR_BACKEND_UNAVAILABLE, "no CUDA device is available");
  require(device >= 0 && device < n, AKV_ERR_INVALID_ARGUMENT, "device ", device, " is not in [0, ", n, ")");
}

void *device_malloc(int device, size_t bytes) {
  DeviceScope scope(device);
  void *p = nullptr;
  const cudaError_t err = cudaMalloc(&p, bytes);
  if (err != cudaSuccess) {
    cudaGetLastError();
    fail(AKV_ERR_OUT_OF_MEMORY, "cudaMalloc of ", bytes, " bytes failed: ", cudaGetErrorString(err));
  }
  return p;
}

void device_free(int device, void *ptr) noexcept {
  if (!ptr) return;
  try {
    DeviceScope scope(device);
    cudaFree(ptr);
  } catch (...) {
    cudaFree(ptr);  // the device could not be made current: free from the current one
  }
}

DeviceScope::DeviceScope(int device) {
  check(cudaGetDevice(&previous_), "cudaGetDevice");
  if (previous_ != device) check(cudaSetDevice(device), "cudaSetDevice");
}
DeviceScope::~DeviceScope() { cudaSetDevice(previous_); }

}  // namespace cuda
}  // namespace akv
