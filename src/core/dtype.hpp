// Scalar formats: fp32, IEEE fp16 and bf16, with round-to-nearest-even conversions.
#pragma once
#include <cstdint>
#include <cstring>
#include <cstddef>
#include <cmath>
#include "anchorkv/anchorkv.h"

namespace akv {

inline float bf16_to_float(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline float fp16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while ((mant & 0x400u) == 0) {
        mant <<= 1;
        --exp;
      }
      mant &= 0x3ffu;
      bits = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t float_to_fp16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;         // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00u;        // overflow (incl. rounding) -> Inf
  if (abs < 0x38800000u) {  // fp16 subnormal or zero: scaling by 2^24 is exact in float
    float mag;
    std::memcpy(&mag, &abs, 4);
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(std::nearbyint(mag * 16777216.0f)));
  }
  uint32_t value = abs - 0x38000000u;  // rebias exponent 127 -> 15
  value += 0xfffu + ((value >> 13) & 1u);
  return static_cast<uint16_t>(sign | (value >> 13));
}

inline size_t dtype_size(akv_dtype t) {
  switch (t) {
    case AKV_DTYPE_F32: return 4;
    case AKV_DTYPE_F16:
    case AKV_DTYPE_BF16: return 2;
    default: return 0;
  }
}

inline const char *dtype_name(akv_dtype t) {
  switch (t) {
    case AKV_DTYPE_AUTO: return "auto";
    case AKV_DTYPE_F32: return "f32";
    case AKV_DTYPE_F16: return "f16";
    case AKV_DTYPE_BF16: return "bf16";
    default: return "unknown";
  }
}

// Read element i of a buffer of the given dtype as float.
inline float load_as_float(const void *base, akv_dtype t, size_t i) {
  switch (t) {
    case AKV_DTYPE_F32: return static_cast<const float *>(base)[i];
    case AKV_DTYPE_F16: return fp16_to_float(static_cast<const uint16_t *>(base)[i]);
    default: return bf16_to_float(static_cast<const uint16_t *>(base)[i]);
  }
}

inline void store_from_float(void *base, akv_dtype t, size_t i, float v) {
  switch (t) {
    case AKV_DTYPE_F32: static_cast<float *>(base)[i] = v; break;
    case AKV_DTYPE_F16: static_cast<uint16_t *>(base)[i] = float_to_fp16(v); break;
    default: static_cast<uint16_t *>(base)[i] = float_to_bf16(v); break;
  }
}

// 16-bit storage format (bf16 or fp16) <-> float.
inline float half_to_float(uint16_t h, akv_dtype storage) {
  return storage == AKV_DTYPE_F16 ? fp16_to_float(h) : bf16_to_float(h);
}
inline uint16_t float_to_half(float f, akv_dtype storage) {
  return storage == AKV_DTYPE_F16 ? float_to_fp16(f) : float_to_bf16(f);
}

// Round a float through the storage format (what storing then loading gives).
inline float round_to_storage(float f, akv_dtype storage) {
  return half_to_float(float_to_half(f, storage), storage);
}

}  // namespace akv
