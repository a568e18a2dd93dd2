// The TurboQuant-style quantized cache (docs/design.md §5, paper App. B.5): every prompt token is kept;
// the last W exactly, the others rotated by the residual codec's seeded Hadamard transform
// U = H diag(s)/sqrt(D) and coded at b bits per coordinate:
//  - keys (post-RoPE): the quant_outliers largest-|x| channels are kept exactly (storage
//    dtype, with their channel index) and zeroed; the rest is rotated, scaled by one fp32 per
//    token (RMS, then least-squares refit) and coded with the 2^b-level Lloyd-Max quantizer
//    for N(0,1), which matches the near-Gaussian marginals the rotation produces;
//  - values: the same without outliers (rotation, fp32 scale, Lloyd-Max codes). TurboQuant
//    applies its MSE-optimal scalar quantizer to every vector; per-token uniform min/max
//    codes (KIVI style, used by some reproductions) measure worse: relative squared error
//    0.251 / 0.046 / 0.010 at 2 / 3 / 4 bits on Gaussian vectors at D=128 against
//    0.115 / 0.034 / 0.0092 for Lloyd-Max with the least-squares scale, and they cost an
//    extra fp32 per token.
// Everything here depends only on the shape and the options, so the footprint is exact
// before any data is seen; the layout is backend-free (the CUDA backend reads the same bytes).
#pragma once
#include <array>
#include <cstdint>
#include <vector>
#include "anchorkv/anchorkv.h"
#include "core/codebook.hpp"
#include "core/codec.hpp"

namespace akv {

// The 2^bits levels in increasing order (kLloydMax2/3/4, core/codebook.hpp) (code c -> levels[c]).
std::vector<float> lloyd_max_levels(int bits);

// The arrays of a quantized cache, in storage order (64-byte aligned in one allocation).
enum QuantSection : int {
  kQuantWindowKeys = 0,  // [H][W][D] storage dtype, post-RoPE (exact recent tokens)
  kQuantWindowValues,    // [H][W][D]
  kQuantKeyCodes,        // [H][P][D'*b/8] packed b-bit codes, little-endian bit order (D' = D
                         // padded to a power of two)
  kQuantKeyScales,       // [H][P] f32
  kQuantKeyOutlierIndex, // [H][P][n_out] u8 (u16 when D > 256)
  kQuantKeyOutlierValue, // [H][P][n_out] storage dtype, exact channel values
  kQuantValueCodes,      // [H][P][D'*b/8]
  kQuantValueScales,     // [H][P] f32
  kQuantSectionCount
};

struct QuantGeometry {
  int64_t seq_len = 0;  // S
  int64_t prefix = 0;   // P = S - W, quantized tokens
  int32_t heads = 0, q_heads = 0, dim = 0;
  int32_t window = 0;   // W (exact), min(options.window, S)
  int32_t bits = 0;     // b
  int32_t outliers = 0; // n_out
  int32_t index_bytes = 1;
  uint64_t full_bytes = 0, budget_bytes = 0, footprint = 0;
  std::array<uint64_t, kQuantSectionCount> bytes{}, offsets{};
  uint64_t total_bytes = 0;  // allocation: footprint plus alignment padding

  // Codes of the rotated domain: dim padded to a power of two (the Hadamard rotation's length).
  int64_t code_bytes() const { return padded_dim(dim) * bits / 8; }
  int64_t key_bytes_per_token() const { return code_bytes() + 4 + outliers * (2 + index_bytes); }
  int64_t value_bytes_per_token() const { return code_bytes() + 4; }
};

// Footprint of a fixed bit width (no budget check).
QuantGeometry quant_geometry_for_bits(const akv_shape &shape, int32_t window, int32_t bits, int32_t outliers);
// Validates options and shape; picks the bits (quant_bits, or the most that fit when 0) and
// fails with AKV_ERR_BUDGET, naming the smallest workable retain_fraction, when they do not fit.
QuantGeometry quant_geometry(const akv_compress_options &options, const akv_shape &shape);

// b-bit little-endian bit packing of n codes.
void pack_codes(const uint8_t *codes, int n, int bits, uint8_t *out);
void unpack_codes(const uint8_t *packed, int n, int bits, uint8_t *codes);

// Per-token coding of one head's tokens, shared by compression, decode and reconstruction.
class TokenQuantizer {
 public:
  TokenQuantizer() = default;
  TokenQuantizer(uint64_t seed, int head_dim, int bits, int outliers);

  const ResidualCodec &rotation() const { return rotation_; }
  int bits() const { return bits_; }
  const std::vector<float> &key_levels() const { return levels_; }

  // key (post-RoPE) -> codes and scale of the remainder, and the outlier channels: their
  // indices (increasing) and values as given (the caller stores them in its dtype). The coded
  // remainder is the key with those channels zeroed.
  void encode_key(const float *key, uint8_t *packed, float *scale, int32_t *outlier_index,
                  float *outlier_value) const;
  // value -> codes and scale (no outliers).
  void encode_value(const float *value, uint8_t *packed, float *scale) const;
  // Rotated-domain reconstruction scale * levels (no outliers, no inverse rotation) into
  // rotation().rotated_dim() floats.
  void decode_rotated(const uint8_t *packed, float scale, float *y) const;

 private:
  int dim_ = 0, rdim_ = 0, bits_ = 0, outliers_ = 0;
  ResidualCodec rotation_;
  std::vector<float> levels_;      // 2^bits Lloyd-Max levels, increasing
  std::vector<float> thresholds_;  // 2^bits - 1 midpoints
  // y (rotated, clobbered) -> packed codes; returns the least-squares scale.
  float code_rotated(float *y, uint8_t *packed) const;
};

}  // namespace akv
