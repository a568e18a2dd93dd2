// Writing a serialized cache (core/serialize.hpp): the field list in format order, through
// the writer, the byte counter or the field recorder; the CRC-32.
#include "core/serialize.hpp"

#include <array>
#include <cstdint>
#include <cstring>
#include <vector>
#include "core/method_traits.hpp"
#include "core/quantizer.hpp"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "serialization assumes a little-endian host");

namespace akv {
namespace {

// Sinks for write_cache(): each field arrives as field(name, pointer, bytes).
class Writer {
 public:
  void field(const char *, const void *p, size_t n) {
    if (n == 0) return;  // p may be null then
    const uint8_t *b = static_cast<const uint8_t *>(p);
    out.insert(out.end(), b, b + n);
  }
  std::vector<uint8_t> out;
};

// Counts bytes without reading them (serialized_size: the buffers may be device memory).
class Counter {
 public:
  void field(const char *, const void *, size_t n) { size += n; }
  size_t size = 0;
};

// Names and places every field (serialized_fields: tests and the fuzzer's corpus tools).
class Recorder {
 public:
  void field(const char *name, const void *, size_t n) {
    fields.push_back({name, offset, n});
    offset += n;
  }
  std::vector<SerializedField> fields;
  size_t offset = 0;
};

// CRC-32 (IEEE, reflected) tables for slicing-by-8: t[0] is the byte-at-a-time table, t[k]
// advances a byte's contribution by k more zero bytes.
using CrcTables = std::array<std::array<uint32_t, 256>, 8>;
CrcTables make_crc_tables() {
  CrcTables t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1u) ? 0xedb88320u ^ (c >> 1) : c >> 1;
    t[0][i] = c;
  }
  for (int k = 1; k < 8; ++k)
    for (uint32_t i = 0; i < 256; ++i) t[k][i] = (t[k - 1][i] >> 8) ^ t[0][t[k - 1][i] & 0xffu];
  return t;
}

uint32_t load_le32(const uint8_t *p) {
  return static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 | static_cast<uint32_t>(p[2]) << 16 |
         static_cast<uint32_t>(p[3]) << 24;
}

}  // namespace

// Slicing-by-8: eight independent table lookups per 8 bytes instead of a chain of eight
// (about 4.5x the byte-at-a-time loop; deserializing a long cache checks every byte).
uint32_t crc32(const uint8_t *data, size_t size, uint32_t crc) {
  static const CrcTables t = make_crc_tables();
  crc = ~crc;
  size_t i = 0;
  for (; i + 8 <= size; i += 8) {
    const uint32_t lo = load_le32(data + i) ^ crc, hi = load_le32(data + i + 4);
    crc = t[7][lo & 0xffu] ^ t[6][(lo >> 8) & 0xffu] ^ t[5][(lo >> 16) & 0xffu] ^ t[4][lo >> 24] ^
          t[3][hi & 0xffu] ^ t[2][(hi >> 8) & 0xffu] ^ t[1][(hi >> 16) & 0xffu] ^ t[0][hi >> 24];
  }
  for (; i < size; ++i) crc = t[0][(crc ^ data[i]) & 0xffu] ^ (crc >> 8);
  return ~crc;
}
namespace {

// One fixed-size field through a Writer, Counter or Recorder.
template <typename T, class W>
void put(W &w, const char *name, const T &v) {
  w.field(name, &v, sizeof(T));
}

// Everything before the CRC, in format order, through a Writer, a Counter or a Recorder.
template <class W>
void write_cache(W &w, const akv_cache &c, const uint8_t *data, const uint8_t *sk, const uint8_t *sv) {
  const CacheMeta &m = c.meta;
  w.field("magic", kSerializedMagic, 8);
  put<uint32_t>(w, "format version", kFormatVersion);
  put<uint32_t>(w, "flags", 0);
  put<uint64_t>(w, "total size", 0);  // patched by serialize_cache
  put<int32_t>(w, "method", m.method);
  put<int64_t>(w, "seq_len", m.shape.seq_len);
  put<int32_t>(w, "num_kv_heads", m.shape.num_kv_heads);
  put<int32_t>(w, "num_q_heads", m.shape.num_q_heads);
  put<int32_t>(w, "head_dim", m.shape.head_dim);
  put<int32_t>(w, "storage dtype", m.storage);
  put<int32_t>(w, "keys_post_rope", m.keys_post_rope);
  put<float>(w, "softmax_scale", m.softmax_scale);
  put<double>(w, "retain_fraction", m.retain_fraction);
  put<uint64_t>(w, "seed", m.seed);
  put<int32_t>(w, "layer_index", m.layer_index);
  put<int32_t>(w, "layer_count", m.layer_count);
  put<int32_t>(w, "residual_scale", m.residual_scale);
  put<int32_t>(w, "rope style", m.rope_style);
  put<int32_t>(w, "rotary_dim", m.rotary_dim);
  put<uint32_t>(w, "inv_freq count", static_cast<uint32_t>(m.inv_freq.size()));
  w.field("inv_freq", m.inv_freq.data(), m.inv_freq.size() * sizeof(float));
  put<int32_t>(w, "window", m.window);
  put<int32_t>(w, "anchors", m.anchors);
  put<int64_t>(w, "key_residuals", m.key_residuals);
  put<int64_t>(w, "value_residuals", m.value_residuals);
  put<int64_t>(w, "window_first_position", m.window_first_position);
  put<int64_t>(w, "next_position", c.next_position);
  put<int32_t>(w, "pool_heads", m.pool_heads);
  put<int32_t>(w, "storage format", m.storage_format);
  put<uint32_t>(w, "logit penalty count", static_cast<uint32_t>(m.logit_penalty.size()));
  w.field("logit penalties", m.logit_penalty.data(), m.logit_penalty.size() * sizeof(float));
  put<uint32_t>(w, "dense count", static_cast<uint32_t>(m.dense_counts.size()));
  for (int64_t n : m.dense_counts) put<int64_t>(w, "dense counts", n);
  put<uint64_t>(w, "dense positions count", c.dense_positions.size());
  w.field("dense positions", c.dense_positions.data(), c.dense_positions.size() * sizeof(int32_t));
  // Method-specific parameters (FullKV and AnchorKV have none): the eviction methods' kept
  // token indices [sum counts], the quantizer's bits and outlier count.
  if (method_traits(m.method).evicting) {
    put<uint64_t>(w, "kept token count", c.dense_tokens.size());
    w.field("kept tokens", c.dense_tokens.data(), c.dense_tokens.size() * sizeof(int32_t));
  } else if (storage_of(m.method) == Storage::kQuantized) {
    put<int32_t>(w, "quant_bits", m.quant_bits);
    put<int32_t>(w, "quant_outliers", m.quant_outliers);
  }
  if (storage_of(m.method) == Storage::kAnchor) {
    for (int i = 0; i < kAnchorSectionCount; ++i)
      w.field(kAnchorSectionNames[i], data + c.layout.sections[i].offset, c.layout.sections[i].bytes);
  } else if (storage_of(m.method) == Storage::kQuantized) {
    for (int i = 0; i < kQuantSectionCount; ++i) w.field(kQuantSectionNames[i], data + c.quant.offsets[i], c.quant.bytes[i]);
  } else {  // keys then values, [sum counts][D] each
    w.field("dense keys", data, c.footprint / 2);
    w.field("dense values", data ? data + c.footprint / 2 : data, c.footprint / 2);
  }
  const int64_t H = m.shape.num_kv_heads, D = m.shape.head_dim;
  put<int64_t>(w, "suffix length", c.suffix_len);
  w.field("suffix positions", c.suffix_positions.data(), c.suffix_len * sizeof(int32_t));
  const size_t row = static_cast<size_t>(D) * 2;
  for (const uint8_t *src : {sk, sv})
    for (int64_t h = 0; h < H; ++h)
      w.field(src == sk ? "suffix keys" : "suffix values", src ? src + h * c.suffix_capacity * row : src,
              c.suffix_len * row);
  // Format 2: compaction (akv_cache_compact) — the count, and the options a later compaction
  // reuses (the target retain_fraction: a compacted cache's own one, in the meta, may be lower).
  const akv_compress_options &o = c.compress_options;
  put<int64_t>(w, "compactions", c.compactions);
  put<int64_t>(w, "compact_after", o.compact_after);
  put<double>(w, "target retain_fraction", o.retain_fraction);
  put<int32_t>(w, "requested anchors", o.anchors);
  put<double>(w, "scored_fraction", o.scored_fraction);
  put<int32_t>(w, "pool_kernel", o.pool_kernel);
  put<int32_t>(w, "pool_type", o.pool_type);
  put<int32_t>(w, "sink_tokens", o.sink_tokens);
  put<int32_t>(w, "fill_budget", o.fill_budget);
  put<double>(w, "anchor_share", o.anchor_share);
  put<double>(w, "guard_fraction", o.guard_fraction);
  put<int32_t>(w, "coverage_rounds", o.coverage_rounds);
  put<int32_t>(w, "head_offset", o.head_offset);
  put<int32_t>(w, "scored_min", o.scored_min);
  put<int32_t>(w, "follow_tokens", o.follow_tokens);
  put<double>(w, "logit_correction", o.logit_correction);
}

}  // namespace

size_t serialized_size(const akv_cache &c) {
  Counter w;
  write_cache(w, c, c.data.data(), c.suffix_keys.data(), c.suffix_values.data());  // never read
  return w.size + sizeof(uint32_t);  // and the CRC
}

std::vector<SerializedField> serialized_fields(const akv_cache &c) {
  Recorder w;
  write_cache(w, c, c.data.data(), c.suffix_keys.data(), c.suffix_values.data());  // never read
  w.field("crc", nullptr, sizeof(uint32_t));
  return std::move(w.fields);
}

std::vector<uint8_t> serialize_cache(const akv_cache &c, const uint8_t *data, const uint8_t *sk,
                                     const uint8_t *sv) {
  Writer w;
  write_cache(w, c, data, sk, sv);
  const uint64_t total = w.out.size() + 4;
  std::memcpy(w.out.data() + 16, &total, 8);
  const uint32_t crc = crc32(w.out.data(), w.out.size());
  put<uint32_t>(w, "crc", crc);
  return std::move(w.out);
}

}  // namespace akv
