// Bit-exact float <-> bf16 / fp16 conversion for tests (round to nearest even, the rounding
// every engine and the IEEE default use). Independent of the library: tests use these to say
// what "stored exactly in bf16/fp16" means.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace akv_test {

inline uint32_t float_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}

inline float bits_float(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

inline uint16_t float_to_bf16(float value) {
  const uint32_t bits = float_bits(value);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((bits >> 16) | 0x0040u);  // quiet NaN
  const uint32_t rounding_bias = 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding_bias) >> 16);
}

inline float bf16_to_float(uint16_t value) { return bits_float(static_cast<uint32_t>(value) << 16); }

inline uint16_t float_to_fp16(float value) {
  const uint32_t bits = float_bits(value);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const uint32_t magnitude = bits & 0x7FFFFFFFu;
  if (magnitude >= 0x7F800000u)  // Inf or NaN
    return static_cast<uint16_t>(sign | (magnitude > 0x7F800000u ? 0x7E00u : 0x7C00u));
  if (magnitude >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // >= 65520 -> Inf
  if (magnitude < 0x38800000u) {
    // Subnormal half: value / 2^-24, rounded to nearest even. The product is exact in float.
    const float scaled = bits_float(magnitude) * 16777216.0f;
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(scaled)));
  }
  const uint32_t rounded = magnitude + 0xFFFu + ((magnitude >> 13) & 1u);
  return static_cast<uint16_t>(sign | ((rounded - 0x38000000u) >> 13));
}

inline float fp16_to_float(uint16_t value) {
  const uint32_t sign = static_cast<uint32_t>(value & 0x8000u) << 16;
  const uint32_t exponent = (value >> 10) & 0x1Fu;
  const uint32_t mantissa = value & 0x3FFu;
  if (exponent == 0) {
    const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 31) return bits_float(sign | 0x7F800000u | (mantissa << 13));
  return bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

inline float round_to_bf16(float value) { return bf16_to_float(float_to_bf16(value)); }
inline float round_to_fp16(float value) { return fp16_to_float(float_to_fp16(value)); }

}  // namespace akv_test
