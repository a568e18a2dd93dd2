#include "core/thread_pool.hpp"

#include <algorithm>
#include <system_error>
#include "core/error.hpp"

namespace akv {

ThreadPool::ThreadPool(int threads) {
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  threads = std::min(threads, kMaxThreads);
  workers_.reserve(static_cast<size_t>(threads - 1));  // emplace_back below cannot reallocate
  // A std::thread that fails to start throws; the workers already running must be stopped
  // and joined before the members go (a joinable std::thread's destructor terminates, and
  // the condition variables must have no waiters when destroyed).
  try {
    for (int i = 1; i < threads; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
  } catch (const std::system_error &e) {
    const size_t started = workers_.size();
    stop_workers();
    fail(AKV_ERR_OUT_OF_MEMORY, "could not start CPU worker thread ", started + 1, " of ", threads - 1, " (", e.what(),
         "): the system refused it; ask for fewer num_threads");
  } catch (...) {
    stop_workers();
    throw;
  }
}

ThreadPool::~ThreadPool() { stop_workers(); }

void ThreadPool::stop_workers() noexcept {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto &t : workers_)
    if (t.joinable()) t.join();
}

static void run_chunk(const std::function<void(int64_t, int64_t)> &body, int64_t n, int chunks,
                      int index) {
  const int64_t begin = n * index / chunks, end = n * (index + 1) / chunks;
  if (begin < end) body(begin, end);
}

void ThreadPool::parallel_for(int64_t n, const std::function<void(int64_t, int64_t)> &body) {
  if (n <= 0) return;
  if (workers_.empty() || n == 1) {
    body(0, n);
    return;
  }
  std::lock_guard<std::mutex> call_lock(call_mutex_);
  const int chunks = size();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    body_ = &body;
    n_ = n;
    pending_ = chunks - 1;
    error_ = nullptr;
    ++generation_;
  }
  wake_.notify_all();
  std::exception_ptr mine;
  try {
    run_chunk(body, n, chunks, 0);
  } catch (...) {
    mine = std::current_exception();
  }
  std::unique_lock<std::mutex> lock(mutex_);
  done_.wait(lock, [this] { return pending_ == 0; });
  body_ = nullptr;
  if (mine) std::rethrow_exception(mine);
  if (error_) std::rethrow_exception(error_);
}

void ThreadPool::worker_loop(int index) {
  uint64_t seen = 0;
  for (;;) {
    const std::function<void(int64_t, int64_t)> *body;
    int64_t n;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      body = body_;
      n = n_;
    }
    std::exception_ptr err;
    try {
      run_chunk(*body, n, size(), index);
    } catch (...) {
      err = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (err && !error_) error_ = err;
      if (--pending_ == 0) done_.notify_all();
    }
  }
}

}  // namespace akv
