// Version, status strings, NULL destroys and the thread-local last error.
#include <atomic>
#include <set>
#include <string>
#include <thread>

#include "api/api_test_util.hpp"
#include "api/raw_enums.h"

namespace akv_test {
namespace {

TEST(Version, LoadedLibraryMatchesHeader) {
  EXPECT_EQ(akv_version_number(), static_cast<unsigned>(AKV_VERSION_NUMBER));
  ASSERT_NE(akv_version_string(), nullptr);
  EXPECT_STREQ(akv_version_string(), AKV_VERSION_STRING);
  const std::string expected = std::to_string(AKV_VERSION_MAJOR) + "." + std::to_string(AKV_VERSION_MINOR) +
                               "." + std::to_string(AKV_VERSION_PATCH);
  EXPECT_EQ(std::string(akv_version_string()), expected);
  EXPECT_EQ(AKV_VERSION_NUMBER, AKV_VERSION_MAJOR * 10000 + AKV_VERSION_MINOR * 100 + AKV_VERSION_PATCH);
}

TEST(Status, PinnedValues) {
  // The enum is part of the ABI: bindings hard-code these numbers.
  EXPECT_EQ(AKV_OK, 0);
  EXPECT_EQ(AKV_ERR_INVALID_ARGUMENT, 1);
  EXPECT_EQ(AKV_ERR_UNSUPPORTED, 2);
  EXPECT_EQ(AKV_ERR_BUDGET, 3);
  EXPECT_EQ(AKV_ERR_NON_FINITE, 4);
  EXPECT_EQ(AKV_ERR_OUT_OF_MEMORY, 5);
  EXPECT_EQ(AKV_ERR_CORRUPT_DATA, 6);
  EXPECT_EQ(AKV_ERR_VERSION, 7);
  EXPECT_EQ(AKV_ERR_BACKEND_UNAVAILABLE, 8);
  EXPECT_EQ(AKV_ERR_BACKEND, 9);
  EXPECT_EQ(AKV_ERR_MISMATCH, 10);
  EXPECT_EQ(AKV_ERR_CAPACITY, 11);
  EXPECT_EQ(AKV_ERR_INTERNAL, 12);
}

TEST(Status, StringsAreNonNullAndDistinct) {
  std::set<std::string> seen;
  for (int value = AKV_OK; value <= AKV_ERR_INTERNAL; ++value) {
    const char *text = akv_status_string(static_cast<akv_status>(value));
    ASSERT_NE(text, nullptr) << "status " << value;
    EXPECT_GT(std::strlen(text), 0u) << "status " << value;
    EXPECT_TRUE(seen.insert(text).second) << "status " << value << " repeats \"" << text << "\"";
  }
  // Names say which status they are (the header promises "AKV_ERR_BUDGET: ...").
  EXPECT_TRUE(contains_case_insensitive(akv_status_string(AKV_ERR_BUDGET), "BUDGET"));
  EXPECT_TRUE(contains_case_insensitive(akv_status_string(AKV_ERR_CORRUPT_DATA), "CORRUPT"));
  // Out-of-range values still get a string, not NULL or a crash.
  for (int value : {-1, 13, 99, 1 << 20}) {
    const char *text = akv_test_status_string(value);  // out-of-range values come from C
    ASSERT_NE(text, nullptr) << "status " << value;
    EXPECT_EQ(seen.count(text), 0u) << "unknown status " << value << " reads as a known one: " << text;
  }
}

TEST(Handles, DestroyNullIsNoOp) {
  akv_context_destroy(nullptr);
  akv_cache_destroy(nullptr);
  SUCCEED();  // reaching this line is the test: no crash, no abort
}

TEST(Handles, ContextWithNullOptionsUsesCpuDefaults) {
  akv_context *context = nullptr;
  ASSERT_EQ(akv_context_create(nullptr, &context), AKV_OK) << akv_last_error_message();
  ASSERT_NE(context, nullptr);
  akv_context_destroy(context);
}

TEST(Options, InitFillsDocumentedDefaults) {
  akv_compress_options options;
  std::memset(&options, 0x5A, sizeof options);
  akv_compress_options_init(&options);
  EXPECT_EQ(options.struct_size, sizeof options);
  EXPECT_EQ(options.method, AKV_METHOD_ANCHORKV);
  EXPECT_DOUBLE_EQ(options.retain_fraction, 0.05);
  EXPECT_EQ(options.window, 32);
  EXPECT_EQ(options.anchors, 0);
  EXPECT_DOUBLE_EQ(options.scored_fraction, 0.3);  // the paper's 0.7 is in akv_compress_options_init_paper
  EXPECT_EQ(options.pool_kernel, 7);
  EXPECT_EQ(options.pool_type, AKV_POOL_AVG);
  EXPECT_EQ(options.residual_scale, AKV_SCALE_LEAST_SQUARES);
  EXPECT_EQ(options.seed, 42u);
  EXPECT_EQ(options.layer_index, 0);
  EXPECT_EQ(options.layer_count, 1);
  EXPECT_EQ(options.rope.style, AKV_ROPE_NEOX);
  EXPECT_EQ(options.rope.rotary_dim, 0);
  EXPECT_DOUBLE_EQ(options.rope.base, 10000.0);
  EXPECT_EQ(options.rope.inv_freq, nullptr);
  EXPECT_EQ(options.keys_post_rope, 0);
  EXPECT_EQ(options.softmax_scale, 0.0f);
  EXPECT_EQ(options.storage_dtype, AKV_DTYPE_AUTO);
  EXPECT_EQ(options.scored_min, 64);
  EXPECT_EQ(options.follow_tokens, 8);

  akv_context_options context_options;
  std::memset(&context_options, 0x5A, sizeof context_options);
  akv_context_options_init(&context_options);
  EXPECT_EQ(context_options.struct_size, sizeof context_options);
  EXPECT_EQ(context_options.backend, AKV_BACKEND_CPU);
  EXPECT_EQ(context_options.device, 0);
  EXPECT_EQ(context_options.num_threads, 0);
  EXPECT_EQ(context_options.allocator.alloc, nullptr);
  EXPECT_EQ(context_options.allocator.free, nullptr);

  akv_prefill prefill;
  std::memset(&prefill, 0x5A, sizeof prefill);
  akv_prefill_init(&prefill);
  EXPECT_EQ(prefill.struct_size, sizeof prefill);
  EXPECT_EQ(prefill.keys, nullptr);
  EXPECT_EQ(prefill.values, nullptr);
  EXPECT_EQ(prefill.queries, nullptr);
  EXPECT_EQ(prefill.positions, nullptr);
  EXPECT_EQ(prefill.kv_head_stride, 0);
  EXPECT_EQ(prefill.kv_token_stride, 0);
  EXPECT_EQ(prefill.q_head_stride, 0);
  EXPECT_EQ(prefill.q_token_stride, 0);
}

// A failure on one thread must not show up on another: the message is thread-local.
TEST(LastError, IsThreadLocal) {
  std::string message_a_before, message_a_after, message_b, fresh_thread_message;
  akv_status status_a = AKV_OK, status_b = AKV_OK;

  std::thread fresh([&] { fresh_thread_message = akv_last_error_message(); });
  fresh.join();
  EXPECT_EQ(fresh_thread_message, "") << "a thread that made no call has an error message";

  // This thread fails first with its own culprit; the other threads must not change it.
  akv_shape main_shape{256, 2, 2, 64};
  akv_compress_options main_options = anchorkv_options(0.5);
  ASSERT_EQ(akv_compressed_size(&main_options, &main_shape, nullptr), AKV_ERR_INVALID_ARGUMENT);
  const std::string main_message = akv_last_error_message();
  ASSERT_TRUE(contains_case_insensitive(main_message, "out_bytes")) << main_message;

  std::atomic<int> stage{0};
  std::thread thread_a([&] {
    akv_shape shape{-5, 2, 2, 64};  // bad seq_len
    akv_compress_options options = anchorkv_options(0.5);
    size_t bytes = 0;
    status_a = akv_compressed_size(&options, &shape, &bytes);
    message_a_before = akv_last_error_message();
    stage = 1;
    while (stage.load() != 2) std::this_thread::yield();
    message_a_after = akv_last_error_message();  // after thread B failed differently
  });
  std::thread thread_b([&] {
    while (stage.load() != 1) std::this_thread::yield();
    akv_shape shape{256, 2, 3, 64};  // Hq not a multiple of H
    akv_compress_options options = anchorkv_options(0.5);
    size_t bytes = 0;
    status_b = akv_compressed_size(&options, &shape, &bytes);
    message_b = akv_last_error_message();
    stage = 2;
  });
  thread_a.join();
  thread_b.join();

  EXPECT_EQ(status_a, AKV_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(status_b, AKV_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains_case_insensitive(message_a_before, "seq_len")) << message_a_before;
  EXPECT_TRUE(contains_case_insensitive(message_b, "num_q_heads")) << message_b;
  EXPECT_EQ(message_a_after, message_a_before) << "thread B's failure overwrote thread A's message";
  EXPECT_NE(message_a_before, message_b);
  EXPECT_EQ(std::string(akv_last_error_message()), main_message)
      << "another thread's failure changed this thread's message";
}

}  // namespace
}  // namespace akv_test
