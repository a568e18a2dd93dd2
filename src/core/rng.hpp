// Counter-based randomness: a pure function of (seed, stream, counter), so the CPU and CUDA
// backends draw identical values without sharing generator state. Usable from the CUDA
// kernels (AKV_HD), which draw the anchor sample with the same hash_keys.
#pragma once
#include <cstdint>
#include "core/host_device.hpp"

namespace akv {

AKV_HD inline uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Hash of up to four keys, used as "the random number for this (seed, layer, head, t)".
AKV_HD inline uint64_t hash_keys(uint64_t a, uint64_t b, uint64_t c = 0, uint64_t d = 0) {
  uint64_t h = splitmix64(a ^ 0x6a09e667f3bcc909ull);
  h = splitmix64(h ^ b);
  h = splitmix64(h ^ c);
  return splitmix64(h ^ d);
}

// Streams keep independent uses of one seed apart.
enum : uint64_t { kStreamAnchorSample = 1, kStreamHadamardSigns = 2 };

}  // namespace akv
