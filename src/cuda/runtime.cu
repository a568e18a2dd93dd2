// CUDA backend runtime glue: device discovery and default device allocation.
// Compression and decode kernels arrive with the CUDA backend issues; until then a CUDA
// context can be created and allocates on its device, and other calls answer
// AKV_ERR_UNSUPPORTED.
#include <cuda_runtime.h>

#include "core/error.hpp"
#include "cuda/runtime.hpp"

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
  void *p = nullptr;
  cudaError_t err = cudaSetDevice(device);
  if (err == cudaSuccess) err = cudaMalloc(&p, bytes);
  if (err != cudaSuccess) {
    cudaGetLastError();
    fail(AKV_ERR_OUT_OF_MEMORY, "cudaMalloc of ", bytes, " bytes failed: ", cudaGetErrorString(err));
  }
  return p;
}

void device_free(int device, void *ptr) noexcept {
  if (!ptr) return;
  cudaSetDevice(device);
  cudaFree(ptr);
}

}  // namespace cuda
}  // namespace akv
