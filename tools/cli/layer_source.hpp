// What `anchorkv eval` evaluates: per layer, the K/V of a prompt and the post-RoPE queries of
// the observation window and of held-out future positions, from the synthetic generator or
// from a safetensors file. Everything is held as fp32 on the host, already rounded to the
// input dtype, so the exact reference sees the very values the library receives.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "anchorkv/anchorkv.h"
#include "rope.hpp"

namespace akvcli {

struct EvalShape {
  int layers = 0;
  int64_t seq_len = 0;  // S
  int heads = 0;        // H (KV heads)
  int q_heads = 0;      // Hq
  int head_dim = 0;     // D
  int window = 0;       // W, observation-window queries per query head
  int future = 0;       // F, held-out queries per query head

  int group() const { return q_heads / heads; }
};

struct PositionConfig {
  RopeConfig rope;
  bool keys_post_rope = false;  // keys below carry RoPE already
  int64_t position_offset = 0;  // prompt token t sits at position offset + t
  double softmax_scale = 0.0;   // 0 = 1/sqrt(D)

  double scale(int head_dim) const {
    return softmax_scale > 0.0 ? softmax_scale : 1.0 / std::sqrt(static_cast<double>(head_dim));
  }
};

struct LayerTensors {
  std::vector<float> keys;      // [H][S][D], pre-RoPE unless keys_post_rope
  std::vector<float> values;    // [H][S][D]
  std::vector<float> q_window;  // [Hq][W][D], post-RoPE, positions S-W .. S-1
  std::vector<float> q_future;  // [Hq][F][D], post-RoPE, positions after the prompt
};

class LayerSource {
 public:
  virtual ~LayerSource() = default;
  virtual const EvalShape &shape() const = 0;
  virtual const PositionConfig &positions() const = 0;
  // dtype the prefill tensors are handed to the library in (values are already rounded to it).
  virtual akv_dtype input_dtype() const = 0;
  virtual std::string describe() const = 0;
  virtual LayerTensors load(int layer) = 0;
};

}  // namespace akvcli
