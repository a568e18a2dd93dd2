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

class ThreadPool {
 public:
  explicit ThreadPool(int threads);  // total threads including the caller; <= 0 = hardware
  ~ThreadPool();
  ThreadPool(const ThreadPool &) = delete;
  ThreadPool &operator=(const ThreadPool &) = delete;

  int size() const { return static_cast<int>(workers_.size()) + 1; }
  // body(begin, end) over chunks of [0, n). Exceptions from any chunk are rethrown here.
  void parallel_for(int64_t n, const std::function<void(int64_t, int64_t)> &body);

 private:
  void worker_loop(int index);

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
