#include "core/context.hpp"

#include <cstdlib>
#include "core/error.hpp"
#include "cpu/thread_pool.hpp"

akv_context::akv_context() = default;
akv_context::~akv_context() {
  for (auto &entry : workspaces) deallocate(entry.second.ptr, entry.second.bytes);
}

void *akv_context::allocate(size_t bytes) {
  if (bytes == 0) return nullptr;
  void *p = allocator.alloc(allocator.user_data, bytes);
  if (!p) akv::fail(AKV_ERR_OUT_OF_MEMORY, "the allocator returned NULL for ", bytes, " bytes");
  return p;
}

void akv_context::deallocate(void *ptr, size_t bytes) noexcept {
  if (ptr) allocator.free(allocator.user_data, ptr, bytes);
}
