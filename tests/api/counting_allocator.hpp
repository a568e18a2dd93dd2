// An allocator hook that counts what the library holds through akv_allocator, checks that
// free() gets back the size that was requested, and can refuse allocations on demand.
#pragma once

#include <anchorkv/anchorkv.h>

#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <unordered_map>

namespace akv_test {

class CountingAllocator {
 public:
  akv_allocator hooks() { return akv_allocator{&CountingAllocator::allocate, &CountingAllocator::release, this}; }

  // Allocation number `n` (0-based, counted from now) and every later one return NULL.
  void fail_from(long n) {
    std::lock_guard<std::mutex> lock(mutex_);
    fail_from_ = n;
    calls_since_arm_ = 0;
  }
  uint64_t live_bytes() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return live_bytes_;
  }
  size_t live_blocks() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return blocks_.size();
  }
  size_t bad_frees() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return bad_frees_;
  }
  size_t allocations() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return allocations_;
  }
  size_t refused() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return refused_;
  }

 private:
  static void *allocate(void *self_ptr, size_t bytes) {
    auto *self = static_cast<CountingAllocator *>(self_ptr);
    std::lock_guard<std::mutex> lock(self->mutex_);
    if (self->fail_from_ >= 0 && self->calls_since_arm_++ >= self->fail_from_) {
      ++self->refused_;
      return nullptr;
    }
    const size_t rounded = ((bytes == 0 ? 1 : bytes) + 255) / 256 * 256;
    void *block = std::aligned_alloc(256, rounded);
    if (block == nullptr) return nullptr;
    ++self->allocations_;
    self->blocks_[block] = bytes;
    self->live_bytes_ += bytes;
    return block;
  }
  static void release(void *self_ptr, void *block, size_t bytes) {
    auto *self = static_cast<CountingAllocator *>(self_ptr);
    std::lock_guard<std::mutex> lock(self->mutex_);
    if (block == nullptr) return;
    const auto found = self->blocks_.find(block);
    if (found == self->blocks_.end() || found->second != bytes) {
      ++self->bad_frees_;  // unknown pointer, double free, or the wrong size passed back
      if (found == self->blocks_.end()) return;
    }
    self->live_bytes_ -= found->second;
    self->blocks_.erase(found);
    std::free(block);
  }

  mutable std::mutex mutex_;
  std::unordered_map<void *, size_t> blocks_;
  uint64_t live_bytes_ = 0;
  size_t bad_frees_ = 0, refused_ = 0, allocations_ = 0;
  long fail_from_ = -1, calls_since_arm_ = 0;
};

}  // namespace akv_test
