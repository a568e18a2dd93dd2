// CPU worker threads of a context (issue 12, defect 3): num_threads has an upper bound, and a
// thread the system refuses gives AKV_ERR_OUT_OF_MEMORY instead of aborting the process
// ("terminate called without an active exception") or hanging in pthread_cond_destroy.
#include <pthread.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <string>

#include "api/api_test_util.hpp"

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define AKV_TEST_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define AKV_TEST_SANITIZED 1
#endif
#endif
#ifndef AKV_TEST_SANITIZED
#define AKV_TEST_SANITIZED 0
#endif

namespace akv_test {
namespace {

akv_status create_with_threads(int32_t threads, akv_context **out) {
  akv_context_options options;
  akv_context_options_init(&options);
  options.num_threads = threads;
  return akv_context_create(&options, out);
}

TEST(ContextThreads, CountAboveTheBoundIsRefused) {
  for (int32_t threads : {1025, 1000000, INT32_MAX}) {
    akv_context *context = nullptr;
    EXPECT_EQ(create_with_threads(threads, &context), AKV_ERR_INVALID_ARGUMENT) << threads;
    EXPECT_EQ(context, nullptr);
    EXPECT_TRUE(contains_case_insensitive(akv_last_error_message(), "num_threads")) << akv_last_error_message();
    akv_context_destroy(context);
  }
}

TEST(ContextThreads, SmallCountsWork) {
  for (int32_t threads : {1, 3, 64}) {
    akv_context *context = nullptr;
    ASSERT_EQ(create_with_threads(threads, &context), AKV_OK) << threads << ": " << akv_last_error_message();
    akv_context_destroy(context);
  }
}

// AnchorKV's compression runs heads side by side when there are at least as many heads as
// threads, and one head at a time over every thread otherwise: the cache is the same bytes
// with any thread count (storage formats 3 and 2, 4 KV heads: 1 and 5 threads one head at a
// time, 2, 3 and 4 side by side).
TEST(ContextThreads, CompressionGivesTheSameCacheWithAnyThreadCount) {
  const uint64_t seed = fresh_seed();
  AKV_TRACE_SEED(seed);
  Rng rng(seed);
  PrefillSpec spec;
  spec.seq_len = 3000;
  spec.kv_heads = 4;
  spec.group = 2;
  spec.head_dim = 64;
  const PrefillData data = make_prefill(rng, spec);
  for (int format : {3, 2}) {
    akv_compress_options o;
    akv_compress_options_init(&o);
    o.storage_format = format;
    o.retain_fraction = 0.1;
    std::vector<uint8_t> first;
    for (int threads : {1, 2, 3, 4, 5}) {
      ContextPtr context = make_context(threads);
      CachePtr cache = compress(context.get(), data, o);
      const std::vector<uint8_t> bytes = serialize(cache.get());
      if (threads == 1) first = bytes;
      else EXPECT_TRUE(bytes == first) << "format " << format << ", " << threads << " threads";
    }
  }
}

// The AnchorKV decode splits every head's prefix into fixed chunks and shares the chunks and
// heads out over the context's threads, or whole heads where there are enough of them: its
// output and log-sum-exp are the same bytes with any thread count and either way. A prefix of
// three chunks, 3 KV heads, 3 appended tokens, q_len 2, decoded alone (1 thread: whole heads;
// 2, 3 and 5: chunks) and in a batch of two (2 and 3 threads: whole heads; 5: chunks).
TEST(ContextThreads, DecodeGivesTheSameOutputWithAnyThreadCount) {
  const uint64_t seed = fresh_seed();
  AKV_TRACE_SEED(seed);
  Rng rng(seed);
  PrefillSpec spec;
  spec.seq_len = 9000;
  spec.kv_heads = 3;
  spec.group = 3;
  spec.head_dim = 64;
  const PrefillData data = make_prefill(rng, spec);
  const int q_len = 2;
  const size_t n_out = static_cast<size_t>(9) * q_len * 64, n_lse = static_cast<size_t>(9) * q_len;
  const std::vector<float> q = nonzero_normal(rng, 2 * n_out, 1.5);
  const Tensor queries = make_tensor(std::vector<float>(q.begin(), q.begin() + n_out), AKV_DTYPE_F32);
  const Tensor both = make_tensor(q, AKV_DTYPE_F32);  // the batch's: queries, then others
  const Tensor keys = make_tensor(llm_like_keys(rng, 3, 3, 64), AKV_DTYPE_F32);  // 3 appended tokens
  const Tensor values = make_tensor(nonzero_normal(rng, static_cast<size_t>(3) * 3 * 64), AKV_DTYPE_F32);
  for (int format : {3, 2}) {
    akv_compress_options o;
    akv_compress_options_init(&o);
    o.storage_format = format;
    o.retain_fraction = 0.1;
    std::vector<uint8_t> first, first_batch;
    std::vector<float> first_lse, first_batch_lse;
    for (int threads : {1, 2, 3, 5}) {
      ContextPtr context = make_context(threads);
      CachePtr caches[3];
      for (CachePtr &cache : caches) {
        cache = compress(context.get(), data, o);
        ok(akv_append(cache.get(), keys.data(), values.data(), AKV_DTYPE_F32, 3, nullptr, nullptr), "akv_append");
      }
      std::vector<uint8_t> out = poisoned(n_out, AKV_DTYPE_F32), out_batch = poisoned(2 * n_out, AKV_DTYPE_F32);
      std::vector<float> lse(n_lse, std::nanf("")), lse_batch(2 * n_lse, std::nanf(""));
      ok(akv_decode_lse(caches[0].get(), queries.data(), AKV_DTYPE_F32, q_len, out.data(), lse.data(), nullptr),
         "decode");
      akv_cache *pair[2] = {caches[1].get(), caches[2].get()};
      ok(akv_decode_batch_lse(context.get(), pair, 2, both.data(), AKV_DTYPE_F32, q_len, out_batch.data(),
                              lse_batch.data(), nullptr),
         "batch decode");
      // The batch's first request is the single decode.
      EXPECT_EQ(std::memcmp(out_batch.data(), out.data(), out.size()), 0) << "format " << format << ", " << threads;
      EXPECT_EQ(std::memcmp(lse_batch.data(), lse.data(), lse.size() * sizeof(float)), 0)
          << "format " << format << ", " << threads << " threads";
      if (threads == 1) {
        EXPECT_EQ(count_non_finite(decode_bytes(out_batch, AKV_DTYPE_F32)), 0u);
        EXPECT_EQ(count_non_finite(lse_batch), 0u);
        first_batch = out_batch;
        first_batch_lse = lse_batch;
      } else {
        EXPECT_TRUE(out_batch == first_batch) << "format " << format << ", " << threads << " threads";
        EXPECT_EQ(std::memcmp(lse_batch.data(), first_batch_lse.data(), lse_batch.size() * sizeof(float)), 0)
            << "format " << format << ", " << threads << " threads";
      }
    }
  }
}

long vm_size_bytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line))
    if (line.rfind("VmSize:", 0) == 0) return std::stol(line.substr(7)) * 1024;
  return -1;
}

// In a child process whose address space leaves room for a few 8 MiB thread stacks only,
// a context with 256 threads fails cleanly (status, message, nothing left running) and a
// small context still works afterwards. The child has 60 s before SIGALRM counts as a hang.
TEST(ContextThreads, RefusedThreadGivesOutOfMemory) {
  if (AKV_TEST_SANITIZED) GTEST_SKIP() << "address-space limits do not mix with sanitizer shadow memory";
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    alarm(60);
    pthread_attr_t attr;  // std::thread takes the default attributes: 8 MiB stacks
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 8u << 20);
    pthread_setattr_default_np(&attr);
    const long used = vm_size_bytes();
    if (used <= 0) _exit(10);
    rlimit limit{};
    getrlimit(RLIMIT_AS, &limit);
    const rlimit saved = limit;
    limit.rlim_cur = static_cast<rlim_t>(used) + (48u << 20);
    if (setrlimit(RLIMIT_AS, &limit) != 0) _exit(11);
    akv_context *context = nullptr;
    const akv_status status = create_with_threads(256, &context);
    const std::string message = akv_last_error_message();
    if (status == AKV_OK) _exit(12);  // the limit did not bite
    if (status != AKV_ERR_OUT_OF_MEMORY || context != nullptr) _exit(13);
    if (message.find("thread") == std::string::npos) _exit(14);
    setrlimit(RLIMIT_AS, &saved);
    if (create_with_threads(2, &context) != AKV_OK) _exit(15);
    akv_context_destroy(context);
    _exit(0);
  }
  int wstatus = 0;
  ASSERT_EQ(waitpid(child, &wstatus, 0), child);
  ASSERT_FALSE(WIFSIGNALED(wstatus)) << "the child died of signal " << WTERMSIG(wstatus)
                                     << (WTERMSIG(wstatus) == SIGALRM ? " (hung)" : " (aborted)");
  ASSERT_TRUE(WIFEXITED(wstatus));
  const int code = WEXITSTATUS(wstatus);
  EXPECT_EQ(code, 0) << "child exit code " << code
                     << " (10/11: could not set the limit, 12: 256 threads started under it, 13: wrong status, "
                        "14: message does not name the thread, 15: no context afterwards)";
}

}  // namespace
}  // namespace akv_test
