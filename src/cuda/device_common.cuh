// Scalar helpers shared by the CUDA kernels and their host emulation (AKV_SIMT_EMULATION):
// half/bfloat16 bits to and from float, bf16x2 packing and fma, the bf16 mma, exact RoPE
// angles, warp reductions.
#pragma once
#include <cstdint>
#include <cstring>
#include "anchorkv/anchorkv.h"

#ifdef AKV_SIMT_EMULATION
#include "core/dtype.hpp"
#include "cuda/simt_emulation.hpp"
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
// Static shared memory: AKV_STATIC_SHARED(float, tile, [32][33]). The emulation poisons it
// at each block start.
#define AKV_STATIC_SHARED(type, name, dims) __shared__ type name dims
#endif

namespace akv {
namespace cuda {

#ifdef AKV_SIMT_EMULATION
// CUDA's vector types, for the emulation's host compiler.
struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(8) float2 {
  float x, y;
};
struct alignas(8) uint2 {
  unsigned x, y;
};
#endif

constexpr unsigned kFullMask = 0xffffffffu;
constexpr float kLog2e = 1.4426950408889634f;

// A load of data no thread writes while the kernel runs (the compressed cache during a decode:
// appends commit in their own launches), through the read-only path (ld.global.nc). Beside the
// cache it tells ptxas that the address is global memory that no store of the kernel touches:
// a plain load through a pointer read from memory is generic, and ptxas keeps it in order with
// every shared-memory store (a generic address may be shared), so a warp's loads could not be
// issued together ahead of the stores between them.
template <class T>
__device__ __forceinline__ T load_ro(const T *p) {
#ifdef AKV_SIMT_EMULATION
  return *p;
#else
  return __ldg(p);
#endif
}

// A hint that the 128-byte line holding p be brought into L2 (prefetch.global.L2): no result,
// nothing waits on it. The emulation has no caches: a test's hook may check the address.
__device__ __forceinline__ void prefetch_l2(const void *p) {
#ifdef AKV_SIMT_EMULATION
  if (const auto &hook = ::simt::prefetch_hook()) hook(p);
#else
  asm volatile("prefetch.global.L2 [%0];" : : "l"(p));
#endif
}

// Programmatic dependent launch (sm_90): a kernel launched with the attribute
// cudaLaunchAttributeProgrammaticStreamSerialization may start while the kernel before it on
// its stream runs, once every block of that one has called launch_dependents() or exited;
// grid_dependency_wait() then waits until that kernel has completed and its writes are
// visible. Both do nothing in a kernel launched without the attribute, below sm_90 and in the
// emulation (which runs a launch's kernels one after another).
__device__ __forceinline__ void launch_dependents() {
#if !defined(AKV_SIMT_EMULATION) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" : : : "memory");
#endif
}
__device__ __forceinline__ void grid_dependency_wait() {
#if !defined(AKV_SIMT_EMULATION) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" : : : "memory");
#endif
}

// A barrier of COUNT threads (whole warps) on barrier ID (1-15; 0 is __syncthreads's).
template <int ID, int COUNT>
__device__ __forceinline__ void named_barrier() {
  static_assert(ID > 0 && ID < 16 && COUNT % 32 == 0, "a named barrier of whole warps");
#ifdef AKV_SIMT_EMULATION
  ::simt::named_barrier(ID, COUNT);
#else
  asm volatile("bar.sync %0, %1;" : : "n"(ID), "n"(COUNT) : "memory");
#endif
}

__device__ __forceinline__ float bits_to_float(uint16_t bits, bool bf16) {
#ifdef AKV_SIMT_EMULATION
  return bf16 ? bf16_to_float(bits) : fp16_to_float(bits);
#else
  return bf16 ? __uint_as_float(static_cast<uint32_t>(bits) << 16) : __half2float(__ushort_as_half(bits));
#endif
}

__device__ __forceinline__ uint16_t float_to_bits(float v, bool bf16) {
#ifdef AKV_SIMT_EMULATION
  return bf16 ? float_to_bf16(v) : float_to_fp16(v);
#else
  return bf16 ? __bfloat16_as_ushort(__float2bfloat16_rn(v)) : __half_as_ushort(__float2half_rn(v));
#endif
}

// Caller tensors, dtype as akv_dtype: 1 = f32, 2 = f16, 3 = bf16.
__device__ __forceinline__ float load_elem(const void *base, int dtype, int64_t i) {
  if (dtype == AKV_DTYPE_F32) return static_cast<const float *>(base)[i];
  return bits_to_float(static_cast<const uint16_t *>(base)[i], dtype == AKV_DTYPE_BF16);
}
__device__ __forceinline__ void store_elem(void *base, int dtype, int64_t i, float v) {
  if (dtype == AKV_DTYPE_F32)
    static_cast<float *>(base)[i] = v;
  else
    static_cast<uint16_t *>(base)[i] = float_to_bits(v, dtype == AKV_DTYPE_BF16);
}

// Two floats as bf16x2 (round to nearest even): `lo` in the low half, the element of lower
// index in an mma fragment.
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
#ifdef AKV_SIMT_EMULATION
  return static_cast<uint32_t>(float_to_bf16(lo)) | static_cast<uint32_t>(float_to_bf16(hi)) << 16;
#else
  uint32_t r;  // cvt packs its first source into the upper half
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
#endif
}

// The calling thread's lane, read anew at each use (volatile: the compiler neither keeps it
// nor what is computed from it in a register across a loop).
__device__ __forceinline__ int lane_id() {
#ifdef AKV_SIMT_EMULATION
  return static_cast<int>(threadIdx.x % 32);
#else
  int l;
  asm volatile("mov.u32 %0, %%laneid;" : "=r"(l));
  return l;
#endif
}

// Two floats as f16x2 (round to nearest even), `lo` in the low half.
__device__ __forceinline__ uint32_t pack_f16x2(float lo, float hi) {
#ifdef AKV_SIMT_EMULATION
  return static_cast<uint32_t>(float_to_fp16(lo)) | static_cast<uint32_t>(float_to_fp16(hi)) << 16;
#else
  uint32_t r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
#endif
}

// x0, x1 as bf16x2 `hi` plus the bf16x2 `lo` of what rounding left: hi + lo holds about 16
// significant bits, so three bf16 products (hi hi, hi lo, lo hi) give fp32-level accuracy.
__device__ __forceinline__ void split_bf16x2(float x0, float x1, uint32_t &hi, uint32_t &lo) {
  hi = pack_bf16x2(x0, x1);
  lo = pack_bf16x2(x0 - bits_to_float(static_cast<uint16_t>(hi), true),
                   x1 - bits_to_float(static_cast<uint16_t>(hi >> 16), true));
}

#ifdef AKV_SIMT_EMULATION
// The emulation of fma.rn.bf16x2 / fma.rn.f16x2: each 16-bit lane in float (the product of
// two 16-bit values is exact there), the sum rounded to float, then to the lane's format (a
// tie after the first rounding can differ from the device by an ulp).
inline uint32_t emulated_x2_fma(uint32_t a, uint32_t b, uint32_t c, bool bf16) {
  uint32_t r = 0;
  for (int half = 0; half < 2; ++half) {
    const auto lane = [half, bf16](uint32_t w) { return bits_to_float(static_cast<uint16_t>(w >> (16 * half)), bf16); };
    r |= static_cast<uint32_t>(float_to_bits(std::fmaf(lane(a), lane(b), lane(c)), bf16)) << (16 * half);
  }
  return r;
}
#endif

// a * b + c on two bf16 lanes at once, rounded once (fma.rn.bf16x2); bf16x2_fma(a, b,
// kBf16x2NegZero) is the product a * b.
constexpr uint32_t kBf16x2NegZero = 0x80008000u;
__device__ __forceinline__ uint32_t bf16x2_fma(uint32_t a, uint32_t b, uint32_t c) {
#ifdef AKV_SIMT_EMULATION
  return emulated_x2_fma(a, b, c, true);
#else
  uint32_t d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
#endif
}

// Two 16-bit lanes from two words: the low halves of a and b (a's in the low lane), or
// their high halves (one PRMT each).
__device__ __forceinline__ uint32_t low_halves(uint32_t a, uint32_t b) { return (a & 0xffffu) | (b << 16); }
__device__ __forceinline__ uint32_t high_halves(uint32_t a, uint32_t b) { return (a >> 16) | (b & 0xffff0000u); }

// a * b - c on two bf16 lanes at once, rounded once. From sm_90: mul.bf16x2 and sub.bf16x2
// without a rounding modifier, which ptxas contracts into one HFMA2 with its addend negated
// (PTX's fma takes no negated operand, and a neg.bf16x2 or a sign XOR before it costs an
// instruction more, which is what older targets, without those two, pay).
__device__ __forceinline__ uint32_t bf16x2_fms(uint32_t a, uint32_t b, uint32_t c) {
#ifdef AKV_SIMT_EMULATION
  return emulated_x2_fma(a, b, c ^ kBf16x2NegZero, true);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint32_t d;
  asm("{.reg .b32 t; mul.bf16x2 t, %1, %2; sub.bf16x2 %0, t, %3;}" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
#else
  return bf16x2_fma(a, b, c ^ kBf16x2NegZero);
#endif
}

// a * b + c on two fp16 lanes at once, rounded once (fma.rn.f16x2).
__device__ __forceinline__ uint32_t f16x2_fma(uint32_t a, uint32_t b, uint32_t c) {
#ifdef AKV_SIMT_EMULATION
  return emulated_x2_fma(a, b, c, false);
#else
  uint32_t d;
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
#endif
}

// Where pair c (bf16x2 word c of a row, c / 8 its k16 slab) is stored so that an mma B
// fragment's two words, pairs tq and tq + 4 of a slab, are adjacent: a slab's pairs in the
// order 0, 4, 1, 5, 2, 6, 3, 7. load_b_pair then reads both with one 8-byte load.
__device__ __forceinline__ int slab_word(int c) { return (c & ~7) | (c & 3) << 1 | (c >> 2 & 1); }
__device__ __forceinline__ void load_b_pair(uint32_t (&b)[2], const uint32_t *at) {
  const uint2 x = *reinterpret_cast<const uint2 *>(at);
  b[0] = x.x;
  b[1] = x.y;
}

// d += A B on the tensor cores: mma.m16n8k16, bf16 operands, f32 accumulation, one warp
// (fragment layouts: simt::mma_m16n8k16_bf16, which the emulation runs instead).
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#ifdef AKV_SIMT_EMULATION
  ::simt::mma_m16n8k16_bf16(d, a, b);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "the decode kernels need sm_80 or newer (bf16 mma.m16n8k16)"
#else
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// The same with f16 operands (mma.m16n8k16 .f32.f16.f16.f32).
__device__ __forceinline__ void mma_f16_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#ifdef AKV_SIMT_EMULATION
  ::simt::mma_m16n8k16_f16(d, a, b);
#else
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// Four 8 x 8 b16 matrices from shared memory as mma fragments (ldmatrix.x4): lane l gives the
// 16-byte-aligned address of row l % 8 of matrix l / 8, and receives in r[j] the elements
// 2 (l % 4) and 2 (l % 4) + 1 of row l / 4 of matrix j. The emulation gathers the same words
// through shuffles of the row addresses.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void *row) {
#ifdef AKV_SIMT_EMULATION
  const int lane = static_cast<int>(threadIdx.x & 31);
  for (int j = 0; j < 4; ++j)
    r[j] = static_cast<const uint32_t *>(__shfl_sync(kFullMask, row, 8 * j + lane / 4))[lane % 4];
#else
  const unsigned at = static_cast<unsigned>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(at));
#endif
}

// cos and sin of position * inv_freq, accurate for large positions: the product and the
// reduction to whole turns are done in double, the final sincos in float as sincospif of
// x in [-1, 1] (angle pi x), whose reduction is exact, so that no call falls into sincosf's
// slow path for large arguments and its local-memory table.
__device__ __forceinline__ void rope_angle(int64_t position, float inv_freq, float *c, float *s) {
  const double kInvTwoPi = 0.15915494309189535;
  double turns = static_cast<double>(position) * static_cast<double>(inv_freq) * kInvTwoPi;
  turns -= rint(turns);
  const float x = static_cast<float>(2.0 * turns);
#ifdef AKV_SIMT_EMULATION
  const double kPi = 3.141592653589793;
  *c = static_cast<float>(std::cos(kPi * x));
  *s = static_cast<float>(std::sin(kPi * x));
#else
  sincospif(x, s, c);
#endif
}

// 2^x in one MUFU.EX2 (ex2.approx.ftz: about 2 ulp; results below 2^-126 flush to zero, and
// -inf gives 0), for softmax weights in [0, 1]: exp2f's denormal handling around the MUFU
// costs six more instructions an element and matters nowhere a probability is summed.
__device__ __forceinline__ float fast_exp2(float x) {
#ifdef AKV_SIMT_EMULATION
  const float r = std::exp2(x);
  return r < 1.17549435e-38f ? 0.0f : r;
#else
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
#endif
}

// A value's bits as another type of the same size (a register move on the device).
template <typename To, typename From>
__device__ __forceinline__ To bits_as(From v) {
  static_assert(sizeof(To) == sizeof(From), "the same size");
  To r;
  std::memcpy(&r, &v, sizeof r);
  return r;
}
// A float's bits and back.
__device__ __forceinline__ uint32_t float_as_bits(float f) { return bits_as<uint32_t>(f); }
__device__ __forceinline__ float bits_as_float(uint32_t u) { return bits_as<float>(u); }

// The eight 16-bit values (bf16, else f16) of a 16-byte chunk as floats, the lower half of each
// word first.
__device__ __forceinline__ void unpack8(const uint4 &chunk, bool bf16, float (&x)[8]) {
  const uint32_t words[4] = {chunk.x, chunk.y, chunk.z, chunk.w};
  for (int e = 0; e < 8; ++e) x[e] = bits_to_float(static_cast<uint16_t>(words[e / 2] >> (16 * (e % 2))), bf16);
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(kFullMask, v, m);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int m = 16; m > 0; m >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, m));
  return v;
}

// An unnormalised Walsh-Hadamard transform of a lane's N values (in-lane stages).
template <int N>
__device__ __forceinline__ void lane_fwht(float (&x)[N]) {
  for (int len = 1; len < N; len <<= 1)
    for (int e = 0; e < N; ++e)
      if (!(e & len)) {
        const float u = x[e], v = x[e + len];
        x[e] = u + v;
        x[e + len] = u - v;
      }
}

// Unnormalised Walsh-Hadamard transform of D = 32 * EPL values spread over a warp, lane l
// holding values l*EPL .. l*EPL+EPL-1: the in-lane stages, then the stages across lanes
// (partner lane = lane ^ lm), the butterflies of core/codec.cpp's fwht in the same order.
template <int EPL>
__device__ __forceinline__ void warp_fwht(float (&x)[EPL], int lane) {
  lane_fwht(x);
  for (int lm = 1; lm < 32; lm <<= 1)
    for (int e = 0; e < EPL; ++e) {
      const float other = __shfl_xor_sync(kFullMask, x[e], lm);
      x[e] = (lane & lm) ? other - x[e] : x[e] + other;
    }
}

}  // namespace cuda
}  // namespace akv
