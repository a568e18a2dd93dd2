// Versioned, checksummed, backend-independent serialization of a cache (little-endian): the
// writer in core/serialize.cpp, the validating reader in core/deserialize.cpp.
//   "ANCHORKV" | u32 format | u32 flags | u64 total size | meta | arrays | suffix | u32 CRC-32
// The CRC covers every byte before it; it is checked right after the magic and the version.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>
#include "core/context.hpp"

namespace akv {

// 1: the first format. 2: adds pool_heads (int32, after next_position): AnchorKV's heads per
// residual-pooling group (version-1 data reads as one group of every head), and the compaction
// fields after the suffix (akv_cache_compact; version-1 data gets the method's defaults).
// 3: adds storage format (int32, after pool_heads): AnchorKV's layout, 2 or 3 (version-1 and -2
// data read as layout 2); layout 3 adds the sections "segment tables" and "gamma scales".
// 4: adds scored_min and follow_tokens (int32 each, after head_offset) to the compaction fields
// (older data reads both as 0, the selection it was compressed with).
// 5: adds the decode's logit penalties after storage format (u32 count, then that many f32:
// 0, or [H][2] for AnchorKV format 3) and logit_correction (double) after follow_tokens
// (older data: no penalties, logit_correction 0).
constexpr uint32_t kFormatVersion = 5;

uint32_t crc32(const uint8_t *data, size_t size, uint32_t crc = 0);

// The first 8 bytes of every serialized cache.
inline constexpr char kSerializedMagic[8] = {'A', 'N', 'C', 'H', 'O', 'R', 'K', 'V'};

// Section names, for serialized_fields() and the deserializer's messages.
inline constexpr const char *kAnchorSectionNames[kAnchorSectionCount] = {
    "anchor keys", "anchor values", "anchor tokens", "key anchor indices", "value anchor indices",
    "key gammas", "value gammas", "prefix positions", "key residual masks", "value residual masks",
    "key residual prefix counts", "value residual prefix counts", "key residual offsets",
    "value residual offsets", "key residual codes", "key residual scales", "value residual codes",
    "value residual scales", "value residual chunk positions", "segment tables", "gamma scales"};
inline constexpr const char *kQuantSectionNames[kQuantSectionCount] = {
    "quantized window keys", "quantized window values", "quantized key codes", "quantized key scales",
    "quantized key outlier indices", "quantized key outlier values", "quantized value codes",
    "quantized value scales"};

// Host copies of the cache's device-or-host buffers are passed in by the caller.
std::vector<uint8_t> serialize_cache(const akv_cache &cache, const uint8_t *data,
                                     const uint8_t *suffix_keys, const uint8_t *suffix_values);

// The byte count serialize_cache() would produce, without reading the cache's buffers (they
// may be device memory).
size_t serialized_size(const akv_cache &cache);

// Name, offset and size of every field serialize_cache() writes for this cache, in order, the
// CRC last (a count of n items and the n items are separate fields). For tests and the fuzz
// corpus tools, which damage one field at a time under a recomputed checksum.
struct SerializedField {
  std::string name;
  size_t offset = 0, bytes = 0;
};
std::vector<SerializedField> serialized_fields(const akv_cache &cache);

// Fails with `status` and the message "<why> a non-finite value in <array> (element i)" when an
// array of stored values (storage-dtype halves, bf16 gammas, fp32 scales) of `data`, laid out
// as `cache` says (host memory), holds NaN or Inf. The deserializer refuses such data, and
// compression refuses to produce it.
void require_finite_storage(const akv_cache &cache, const uint8_t *data, akv_status status, const char *why);

// Parses and validates everything decode, append, reconstruct and serialize trust (counts
// against the bytes left before any allocation, shapes, positions, indices, offsets, finite
// stored floats), so that data which passes the checksum but was crafted or damaged before
// it was checksummed is refused with AKV_ERR_CORRUPT_DATA instead of being read out of bounds;
// returns a cache whose buffers are host vectors in `data`, `suffix_keys`/`values`
// ([H][len][D], exactly sized); the caller uploads them.
struct ParsedCache {
  std::unique_ptr<akv_cache> cache;  // meta, geometry, layout, rope, codec, positions set
  std::vector<uint8_t> data;         // layout.total_bytes (AnchorKV) or footprint (dense)
  std::vector<uint8_t> suffix_keys, suffix_values;
};
ParsedCache deserialize_cache(const uint8_t *bytes, size_t size);

}  // namespace akv
