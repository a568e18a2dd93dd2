// The context (backend, allocator, CPU workers) and the cache (one layer of one request).
// These are the definitions behind the opaque handles of the C API.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>
#include "anchorkv/anchorkv.h"
#include "core/backend.hpp"
#include "core/thread_pool.hpp"
#include "core/layout.hpp"
#include "core/rope.hpp"
#include "core/shape.hpp"
#include "core/codec.hpp"
#include "core/quantizer.hpp"


struct akv_context {
  akv_backend backend = AKV_BACKEND_CPU;
  int32_t device = 0;
  akv_allocator allocator{};  // resolved: never NULL functions once the backend is made
  std::unique_ptr<akv::ThreadPool> pool;
  // Last: destroyed first, while the allocator and the pool are still there.
  std::unique_ptr<akv::Backend> impl;

  akv_context();
  ~akv_context();
  // Allocation through the backend (the hooks, with a CUDA context's device current);
  // throws AKV_ERR_OUT_OF_MEMORY. Zero bytes gives nullptr.
  void *allocate(size_t bytes) { return impl->allocate(bytes); }
  void deallocate(void *ptr, size_t bytes) noexcept { impl->deallocate(ptr, bytes); }
};

namespace akv {

// Memory owned through a context's allocator (host for CPU, device for CUDA).
class Buffer {
 public:
  Buffer() = default;
  Buffer(akv_context *ctx, size_t bytes) : ctx_(ctx), bytes_(bytes), ptr_(ctx->allocate(bytes)) {}
  ~Buffer() { reset(); }
  Buffer(Buffer &&o) noexcept : ctx_(o.ctx_), bytes_(o.bytes_), ptr_(o.ptr_) {
    o.ptr_ = nullptr;
    o.bytes_ = 0;
  }
  Buffer &operator=(Buffer &&o) noexcept {
    if (this != &o) {
      reset();
      ctx_ = o.ctx_;
      bytes_ = o.bytes_;
      ptr_ = o.ptr_;
      o.ptr_ = nullptr;
      o.bytes_ = 0;
    }
    return *this;
  }
  Buffer(const Buffer &) = delete;
  Buffer &operator=(const Buffer &) = delete;
  void reset() noexcept {
    if (ptr_) ctx_->deallocate(ptr_, bytes_);
    ptr_ = nullptr;
    bytes_ = 0;
  }
  size_t size() const { return bytes_; }
  uint8_t *data() const { return static_cast<uint8_t *>(ptr_); }

 private:
  akv_context *ctx_ = nullptr;
  size_t bytes_ = 0;
  void *ptr_ = nullptr;
};

// Everything needed to interpret a cache's buffers; serialized in the header.
struct CacheMeta {
  akv_method method = AKV_METHOD_FULLKV;
  akv_shape shape{};
  akv_dtype storage = AKV_DTYPE_BF16;
  int32_t keys_post_rope = 0;
  float softmax_scale = 0.0f;
  double retain_fraction = 1.0;
  uint64_t seed = 42;
  int32_t layer_index = 0;
  int32_t layer_count = 1;
  akv_residual_scale residual_scale = AKV_SCALE_LEAST_SQUARES;
  akv_rope_style rope_style = AKV_ROPE_NONE;
  int32_t rotary_dim = 0;
  std::vector<float> inv_freq;   // rotary_dim/2 (resolved frequencies)
  // AnchorKV
  int32_t window = 0;
  int32_t anchors = 0;
  int64_t key_residuals = 0;
  int64_t value_residuals = 0;
  int64_t window_first_position = 0;  // the window's positions are consecutive from here
  int32_t pool_heads = 0;  // heads per residual-pooling group (format 2; H before, and H = one group)
  int32_t storage_format = 0;  // AnchorKV: 2 or 3 (core/layout.hpp); 0 for other methods
  // AnchorKV format 3, logit_correction > 0: [H][2] the decode's logit penalty per |q|^2 of a
  // reconstructed prompt token without, then with, a key residual (logit_correction times the
  // head's mean squared key error per dimension; docs/design.md §4.5). Empty: none.
  std::vector<float> logit_penalty;
  // Dense methods (FullKV, eviction, quantized): per-head kept token counts.
  std::vector<int64_t> dense_counts;
  // Quantized: bits per coordinate and exact outlier channels per key.
  int32_t quant_bits = 0;
  int32_t quant_outliers = 0;
};

}  // namespace akv

struct akv_cache {
  akv_context *context = nullptr;
  akv::CacheMeta meta;
  akv::Rope rope;              // built from meta
  akv::ResidualCodec codec;    // AnchorKV only
  akv::AnchorGeometry geometry;  // AnchorKV only
  akv::AnchorLayout layout;      // AnchorKV only

  // AnchorKV: one allocation holding every section of `layout`.
  // Dense methods: keys [sum counts][D] then values [sum counts][D], post-RoPE, storage dtype.
  akv::Buffer data;
  uint64_t footprint = 0;          // bytes charged by the byte accounting
  // Host-side positions of the dense prompt tokens (reconstruct only, decode never reads).
  std::vector<int32_t> dense_positions;
  // Eviction methods: prompt token index of every kept token, [sum counts] in storage order
  // (heads in turn, increasing within a head); empty = every token (FullKV, quantized).
  // Host metadata for reconstruct (present mask, de-rotation); decode never reads it, so it
  // is not part of the footprint.
  std::vector<int32_t> dense_tokens;
  // Quantized: layout and per-token codec.
  akv::QuantGeometry quant;
  akv::TokenQuantizer quantizer;

  // Appended tokens: keys (post-RoPE) and values [H][capacity][D], storage dtype.
  akv::Buffer suffix_keys, suffix_values;
  // CUDA: the kernels' CacheView and its tables (cuda/plan.hpp), in device memory.
  akv::Buffer device_view;
  int64_t suffix_len = 0;
  int64_t suffix_capacity = 0;
  std::vector<int32_t> suffix_positions;  // host
  int64_t next_position = 0;
  // CUDA: an append was captured in a graph, so the device may hold appended tokens that the
  // three fields above do not count yet (Backend::sync_appended).
  bool appended_on_device = false;

  // The options the cache was compressed with (rope.inv_freq cleared: meta.inv_freq holds the
  // table), retain_fraction the target theta: akv_cache_compact reuses them. A compacted
  // AnchorKV cache's own geometry may use less (meta.retain_fraction, see akv_cache_compact).
  akv_compress_options compress_options{};
  int64_t compactions = 0;
  // Automatic compaction (compress_options.compact_after > 0, CPU): the post-RoPE queries of
  // the last decoded tokens, [W][Hq][D] fp32, slot = token index % W; recent_tokens[slot] is
  // the token index held there (-1 none). Not serialized: the next W decodes refill it.
  std::vector<float> recent_queries;
  std::vector<int64_t> recent_tokens;

  template <typename T>
  T *section(int index) const {
    return reinterpret_cast<T *>(data.data() + layout.sections[index].offset);
  }
  template <typename T>
  T *quant_section(int index) const {
    return reinterpret_cast<T *>(data.data() + quant.offsets[index]);
  }
  int64_t total_tokens() const { return meta.shape.seq_len + suffix_len; }
  // Bookkeeping after n tokens were appended at `positions`.
  void record_appended(const int32_t *positions, int32_t n) {
    suffix_positions.insert(suffix_positions.end(), positions, positions + n);
    suffix_len += n;
    next_position = static_cast<int64_t>(positions[n - 1]) + 1;
  }
  uint64_t allocated_bytes() const {
    return data.size() + suffix_keys.size() + suffix_values.size() + device_view.size();
  }
};
