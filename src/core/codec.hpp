// Residual codec (paper App. A.1): randomized Walsh-Hadamard rotation U = H diag(s)/sqrt(D),
// a per-token fp32 scale, the 4-level Lloyd-Max quantizer for N(0,1), 4 codes per byte.
#pragma once
#include <cstdint>
#include <vector>
#include "anchorkv/anchorkv.h"
#include "core/codebook.hpp"

namespace akv {

inline bool is_power_of_two(int64_t x) { return x > 0 && (x & (x - 1)) == 0; }

// The Hadamard rotation's length for a head_dim: the next power of two (80, 96, 112 -> 128).
// The residual codec and the quantizer pad a head with zeros to it and store that many codes.
inline int64_t padded_dim(int64_t head_dim) {
  int64_t n = 1;
  while (n < head_dim) n <<= 1;
  return n;
}
// head_dims the codec takes: a multiple of 16 in [16, 512] (powers of two unpadded).
inline bool codec_head_dim(int64_t head_dim) { return head_dim >= 16 && head_dim <= 512 && head_dim % 16 == 0; }

// In-place unnormalised fast Walsh-Hadamard transform of n (power of two) floats.
void fwht(float *x, int n);

class ResidualCodec {
 public:
  ResidualCodec() = default;
  ResidualCodec(uint64_t seed, int head_dim, akv_residual_scale mode);

  int head_dim() const { return dim_; }
  // Length of the rotated domain: head_dim padded with zeros to a power of two.
  int rotated_dim() const { return rdim_; }
  int code_bytes() const { return rdim_ / 4; }
  const std::vector<float> &signs() const { return signs_; }  // rotated_dim() signs

  // x -> U x in place. x holds rotated_dim() floats: the vector in the first head_dim (the
  // rest is zeroed here), the rotated vector in all of them on return.
  void rotate(float *x) const;
  // y (rotated_dim() floats) -> U^T y in place; the vector is the first head_dim of them.
  void unrotate(float *y) const;

  // Encode a residual (original domain, head_dim floats): writes code_bytes() bytes, returns
  // the scale.
  float encode(const float *residual, uint8_t *codes) const;
  // Rotated-domain reconstruction scale * level(code) into rotated_dim() floats.
  void decode_rotated(const uint8_t *codes, float scale, float *y) const;
  // Full reconstruction: residual holds rotated_dim() floats, the first head_dim are it.
  void decode(const uint8_t *codes, float scale, float *residual) const;

 private:
  int dim_ = 0, rdim_ = 0;
  akv_residual_scale mode_ = AKV_SCALE_LEAST_SQUARES;
  std::vector<float> signs_;
  std::vector<float> byte_levels_;  // [256][4]: the four levels a packed byte decodes to
};

}  // namespace akv
