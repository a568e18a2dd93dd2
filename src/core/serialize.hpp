// Versioned, checksummed, backend-independent serialization of a cache (little-endian).
//   "ANCHORKV" | u32 format | u32 flags | u64 total size | meta | arrays | suffix | u32 CRC-32
// The CRC covers every byte before it; it is checked right after the magic and the version.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>
#include "core/context.hpp"

namespace akv {

constexpr uint32_t kFormatVersion = 1;

uint32_t crc32(const uint8_t *data, size_t size, uint32_t crc = 0);

// Host copies of the cache's device-or-host buffers are passed in by the caller.
std::vector<uint8_t> serialize_cache(const akv_cache &cache, const uint8_t *data,
                                     const uint8_t *suffix_keys, const uint8_t *suffix_values);

// The byte count serialize_cache() would produce, without reading the cache's buffers (they
// may be device memory).
size_t serialized_size(const akv_cache &cache);

// Parses and validates; returns a cache whose buffers are host vectors in `host_data`,
// `host_suffix_keys`/`values` ([H][len][D], exactly sized); the caller uploads them.
struct ParsedCache {
  std::unique_ptr<akv_cache> cache;  // meta, geometry, layout, rope, codec, positions set
  std::vector<uint8_t> data;         // layout.total_bytes (AnchorKV) or footprint (dense)
  std::vector<uint8_t> suffix_keys, suffix_values;
};
ParsedCache deserialize_cache(const uint8_t *bytes, size_t size);

}  // namespace akv
