// Every codebook constant, for the CPU and the CUDA kernels (AKV_HD): what a stored code
// means must be the same float on both sides, compared in the same order.
#pragma once
#include <cmath>
#include <cstdint>
#include "core/host_device.hpp"

namespace akv {

// The residual codec (core/codec.hpp; the CUDA residual encoder and decode kernels): the
// 4-level Lloyd-Max quantizer for a unit Gaussian, levels -outer, -inner, inner, outer and
// the threshold between inner and outer, at four digits. These are the storage format's
// values; kLloydMax2 below is the same quantizer at six digits, a different float, and the
// two are not interchangeable without changing stored bytes.
constexpr float kLloydMaxInner = 0.4528f;
constexpr float kLloydMaxOuter = 1.5104f;
constexpr float kLloydMaxThreshold = 0.9816f;
constexpr float kLloydMaxLevels[4] = {-kLloydMaxOuter, -kLloydMaxInner, kLloydMaxInner, kLloydMaxOuter};

// Code of z = x / scale: 0 .. 3 for the levels above.
AKV_HD inline int lloyd_max_code(float z) {
  return z < 0.0f ? (z < -kLloydMaxThreshold ? 0 : 1) : (z < kLloydMaxThreshold ? 2 : 3);
}
// kLloydMaxLevels[code] without indexing an array (device code cannot read a host constexpr
// array at a run-time index).
AKV_HD inline float lloyd_max_level(int code) {
  return code < 2 ? (code == 0 ? -kLloydMaxOuter : -kLloydMaxInner) : (code == 2 ? kLloydMaxInner : kLloydMaxOuter);
}

// Storage format 3's one-byte coefficient codes (core/layout.hpp, docs/design.md §3.7): 0 is
// 0; otherwise bit 7 the sign and the low 7 bits m the magnitude scale * 2^((m - 127) /
// kGammaStepsPerOctave), m the nearest step (ties to even) clamped to 0..127. The CPU
// compression and the CUDA pass both code through this function.
constexpr int kGammaStepsPerOctave = 12;
AKV_HD inline uint8_t gamma_code(float gamma, float scale) {
  if (!(scale > 0.0f) || gamma == 0.0f || !(fabsf(gamma) <= 3.402823466e38f)) return 0;
  const double m = 127.0 + kGammaStepsPerOctave * log2(fabs(static_cast<double>(gamma)) / scale);
  const int mag = static_cast<int>(fmin(fmax(rint(m), 0.0), 127.0));
  if (gamma < 0.0f) return static_cast<uint8_t>(128 | mag);
  return static_cast<uint8_t>(mag);
}

// The quantized cache (core/quantizer.hpp): Lloyd-Max quantizers for a unit Gaussian at 2, 3
// and 4 bits, positive halves (the negative half mirrors): levels l_i = E[X | X in cell i],
// thresholds the midpoints. Computed once by Lloyd's iteration on the exact Gaussian
// integrals (scripts/lloyd_max.py); MSE per coordinate 0.1175 (2 bits), 0.03455 (3 bits),
// 0.009501 (4 bits). tests/core/baselines_internal_test.cpp (LloydMax)
// checks both optimality conditions.
constexpr float kLloydMax2[2] = {0.452780f, 1.510418f};
constexpr float kLloydMax3[4] = {0.245094f, 0.756005f, 1.343909f, 2.151946f};
constexpr float kLloydMax4[8] = {0.128395f, 0.388048f, 0.656759f, 0.942340f,
                                 1.256231f, 1.618046f, 2.069017f, 2.732590f};

// StreamingLLM's score of evictable token t (methods/eviction.hpp, kRecency): the first
// `sinks` tokens first, then the most recent; the same float in the CPU and CUDA passes.
AKV_HD inline float recency_score(int64_t t, int64_t sinks) { return t < sinks ? 3.0e38f : static_cast<float>(t); }

}  // namespace akv
