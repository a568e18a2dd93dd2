// A fixed pool of worker threads for the CPU backend. parallel_for splits [0, n) into
// contiguous chunks; the calling thread works too. One parallel_for runs at a time per pool.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace akv {

// The most threads a pool runs (akv_context_options.num_threads is refused above it).
constexpr int kMaxThreads = 1024;

class ThreadPool {
 public:
  // Total threads including the caller; <= 0 = hardware, capped at kMaxThreads. When the
  // system refuses a thread, the ones already started are stopped and joined and
  // akv::Error(AKV_ERR_OUT_OF_MEMORY) is thrown: nothing is left running or waiting.
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool &) = delete;
  ThreadPool &operator=(const ThreadPool &) = delete;

  int size() const { return static_cast<int>(workers_.size()) + 1; }
  // body(begin, end) over chunks of [0, n). Exceptions from any chunk are rethrown here.
  void parallel_for(int64_t n, const std::function<void(int64_t, int64_t)> &body);

 private:
  void worker_loop(int index);
  void stop_workers() noexcept;  // wakes, stops and joins every started worker

  std::vector<std::thread> workers_;
  std::mutex call_mutex_;  // serialises parallel_for calls on one pool
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  const std::function<void(int64_t, int64_t)> *body_ = nullptr;
  int64_t n_ = 0;
  uint64_t generation_ = 0;
  int pending_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
};

}  // namespace akv
