#include "core/context.hpp"

#include <cstdlib>
#include <optional>
#include "core/error.hpp"
#include "core/thread_pool.hpp"
#include "cuda/runtime.hpp"

akv_context::akv_context() = default;
akv_context::~akv_context() {
  for (auto &entry : workspaces) deallocate(entry.second.ptr, entry.second.bytes);
}

// CUDA: the hooks run with the context's device current (a torch-style allocator places
// memory on the current device), and the caller's current device is left as it was.
void *akv_context::allocate(size_t bytes) {
  if (bytes == 0) return nullptr;
  std::optional<akv::cuda::DeviceScope> scope;
  if (backend == AKV_BACKEND_CUDA) scope.emplace(device);
  void *p = allocator.alloc(allocator.user_data, bytes);
  if (!p) akv::fail(AKV_ERR_OUT_OF_MEMORY, "the allocator returned NULL for ", bytes, " bytes");
  return p;
}

void akv_context::deallocate(void *ptr, size_t bytes) noexcept {
  if (!ptr) return;
  std::optional<akv::cuda::DeviceScope> scope;
  if (backend == AKV_BACKEND_CUDA) try {
      scope.emplace(device);
    } catch (...) {  // free from the current device rather than leak
    }
  allocator.free(allocator.user_data, ptr, bytes);
}
