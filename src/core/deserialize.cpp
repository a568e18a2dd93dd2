// Reading a serialized cache back (core/serialize.hpp): every count, shape, position, index
// and offset is checked against the data before it is used or allocated from; stored floats
// are checked finite (require_finite_storage, which compression uses too).
#include "core/serialize.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include "core/error.hpp"
#include "core/method_traits.hpp"
#include "core/options.hpp"
#include "core/quantizer.hpp"
#include "core/shape.hpp"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "serialization assumes a little-endian host");

namespace akv {
namespace {

class Reader {
 public:
  Reader(const uint8_t *p, size_t n) : p_(p), n_(n) {}
  template <typename T>
  T get(const char *what) {
    T v;
    std::memcpy(&v, take(sizeof(T), what), sizeof(T));
    return v;
  }
  const uint8_t *take(size_t n, const char *what) {
    if (n > n_ - pos_) fail(AKV_ERR_CORRUPT_DATA, "serialized cache is truncated in ", what);
    const uint8_t *r = p_ + pos_;
    pos_ += n;
    return r;
  }
  // Fails unless `count` items of `size` bytes are left. Every count read from the data is
  // checked this way before anything is allocated from it.
  void need(uint64_t count, uint64_t size, const char *what) {
    if (count > remaining() / size)
      fail(AKV_ERR_CORRUPT_DATA, "serialized cache is truncated in ", what, ": ", count, " x ", size,
           " bytes announced, ", remaining(), " bytes left");
  }
  // `count` items of T, after need().
  template <typename T>
  std::vector<T> array(uint64_t count, const char *what) {
    need(count, sizeof(T), what);
    std::vector<T> v(static_cast<size_t>(count));
    if (count) std::memcpy(v.data(), take(count * sizeof(T), what), count * sizeof(T));
    return v;
  }
  // Copies n bytes into dst (which may be null when n is 0).
  void read_into(void *dst, size_t n, const char *what) {
    const uint8_t *src = take(n, what);
    if (n) std::memcpy(dst, src, n);
  }
  size_t remaining() const { return n_ - pos_; }

 private:
  const uint8_t *p_;
  size_t n_;
  size_t pos_ = 0;
};

void corrupt_unless(bool ok, const char *what) {
  if (!ok) fail(AKV_ERR_CORRUPT_DATA, "serialized cache is inconsistent: ", what);
}

}  // namespace

namespace {

// Index of the first non-finite value among `bytes` of halves (dtype) or fp32, or -1. Blocks
// are scanned branch-free (vectorised: a FullKV cache is all values), then searched when hit.
template <typename Word>
int64_t first_with_exponent(const uint8_t *p, uint64_t count, Word exponent) {
  constexpr uint64_t kBlock = 4096;
  for (uint64_t begin = 0; begin < count; begin += kBlock) {
    const uint64_t end = std::min(count, begin + kBlock);
    unsigned hit = 0;
    for (uint64_t i = begin; i < end; ++i) {
      Word w;
      std::memcpy(&w, p + i * sizeof(Word), sizeof(Word));
      hit |= (w & exponent) == exponent;  // exponent all ones: Inf or NaN
    }
    if (!hit) continue;
    for (uint64_t i = begin; i < end; ++i) {
      Word w;
      std::memcpy(&w, p + i * sizeof(Word), sizeof(Word));
      if ((w & exponent) == exponent) return static_cast<int64_t>(i);
    }
  }
  return -1;
}

int64_t first_non_finite(const uint8_t *p, uint64_t bytes, akv_dtype dtype) {
  if (dtype == AKV_DTYPE_F32) return first_with_exponent<uint32_t>(p, bytes / 4, 0x7f800000u);
  return first_with_exponent<uint16_t>(p, bytes / 2, dtype == AKV_DTYPE_F16 ? uint16_t{0x7c00} : uint16_t{0x7f80});
}

void require_finite(const uint8_t *p, uint64_t bytes, akv_dtype dtype, const char *what, akv_status status,
                    const char *why) {
  const int64_t at = first_non_finite(p, bytes, dtype);
  if (at >= 0) fail(status, why, " a non-finite value in ", what, " (element ", at, ")");
}

}  // namespace

void require_finite_storage(const akv_cache &c, const uint8_t *data, akv_status status, const char *why) {
  const CacheMeta &m = c.meta;
  if (storage_of(m.method) == Storage::kAnchor) {
    auto check = [&](int i, akv_dtype dtype) {
      require_finite(data + c.layout.sections[i].offset, c.layout.sections[i].bytes, dtype, kAnchorSectionNames[i],
                     status, why);
    };
    for (int i : {kAnchorKeys, kAnchorValues}) check(i, m.storage);
    if (c.geometry.format == 2)
      for (int i : {kKeyGamma, kValueGamma}) check(i, AKV_DTYPE_BF16);
    else
      check(kGammaScales, AKV_DTYPE_F32);
    for (int i : {kKeyScales, kValueScales}) check(i, AKV_DTYPE_F32);
  } else if (storage_of(m.method) == Storage::kQuantized) {
    auto check = [&](int i, akv_dtype dtype) {
      require_finite(data + c.quant.offsets[i], c.quant.bytes[i], dtype, kQuantSectionNames[i], status, why);
    };
    for (int i : {kQuantWindowKeys, kQuantWindowValues, kQuantKeyOutlierValue}) check(i, m.storage);
    for (int i : {kQuantKeyScales, kQuantValueScales}) check(i, AKV_DTYPE_F32);
  } else {
    require_finite(data, c.footprint, m.storage, "dense keys and values", status, why);
  }
}

namespace {

// Positions are strictly increasing and above `after` (the last position before them).
void require_increasing(const int32_t *p, uint64_t n, int64_t after, const char *what) {
  int64_t previous = after;
  for (uint64_t i = 0; i < n; ++i) {
    if (p[i] <= previous)
      fail(AKV_ERR_CORRUPT_DATA, "serialized cache is inconsistent: ", what, "[", i, "] = ", p[i],
           " does not follow ", previous);
    previous = p[i];
  }
}

// Stored values are read as they are by decode, append and reconstruct: compression and
// append refuse to store NaN or Inf, so one in serialized data is damage.
constexpr const char *kHoldsNonFinite = "serialized cache holds";

}  // namespace

ParsedCache deserialize_cache(const uint8_t *bytes, size_t size) {
  require(size >= 28, AKV_ERR_CORRUPT_DATA, "serialized cache is truncated: ", size,
          " bytes is shorter than the header");
  require(std::memcmp(bytes, kSerializedMagic, 8) == 0, AKV_ERR_CORRUPT_DATA,
          "serialized cache does not start with the ANCHORKV magic");
  // The version comes before the checksum: a newer format may checksum differently.
  uint32_t version;
  std::memcpy(&version, bytes + 8, 4);
  require(version >= 1, AKV_ERR_CORRUPT_DATA, "serialized cache has format version 0 (corrupted)");
  require(version <= kFormatVersion, AKV_ERR_VERSION, "serialized cache format version ", version,
          " is newer than this library reads (", kFormatVersion, "): upgrade anchorkv, or the data is corrupted");
  uint64_t total;
  std::memcpy(&total, bytes + 16, 8);
  require(total == size, AKV_ERR_CORRUPT_DATA, "serialized cache is ", size, " bytes but its header says ",
          total, " (truncated or padded)");
  uint32_t stored_crc;
  std::memcpy(&stored_crc, bytes + size - 4, 4);
  require(crc32(bytes, size - 4) == stored_crc, AKV_ERR_CORRUPT_DATA,
          "serialized cache checksum mismatch (data corrupted)");
  // From here on the checksum only says the bytes are what was written: every field is still
  // checked, and every count against the bytes left before anything is allocated from it.
  Reader r(bytes + 8, size - 12);  // version: 1, or 2 with the compaction fields
  r.get<uint32_t>("format version");
  const uint32_t flags = r.get<uint32_t>("flags");
  require(flags == 0, AKV_ERR_CORRUPT_DATA, "serialized cache has unknown flags ", flags);
  r.get<uint64_t>("size");

  ParsedCache out;
  out.cache = std::make_unique<akv_cache>();
  akv_cache &c = *out.cache;
  CacheMeta &m = c.meta;
  // Enum fields are range-checked as integers before they become enums.
  auto enum_field = [&](const char *what, int32_t first, int32_t last) {
    const int32_t v = r.get<int32_t>(what);
    if (v < first || v > last) fail(AKV_ERR_CORRUPT_DATA, "serialized cache has an unknown ", what, " ", v);
    return v;
  };
  const int32_t method = r.get<int32_t>("method");
  if (!find_method_traits(method)) fail(AKV_ERR_CORRUPT_DATA, "serialized cache has an unknown method ", method);
  m.method = static_cast<akv_method>(method);
  m.shape.seq_len = r.get<int64_t>("seq_len");
  m.shape.num_kv_heads = r.get<int32_t>("num_kv_heads");
  m.shape.num_q_heads = r.get<int32_t>("num_q_heads");
  m.shape.head_dim = r.get<int32_t>("head_dim");
  m.storage = static_cast<akv_dtype>(enum_field("storage dtype", AKV_DTYPE_F16, AKV_DTYPE_BF16));
  m.keys_post_rope = r.get<int32_t>("keys_post_rope");
  m.softmax_scale = r.get<float>("softmax_scale");
  m.retain_fraction = r.get<double>("retain_fraction");
  m.seed = r.get<uint64_t>("seed");
  m.layer_index = r.get<int32_t>("layer_index");
  m.layer_count = r.get<int32_t>("layer_count");
  m.residual_scale = static_cast<akv_residual_scale>(enum_field("residual_scale", AKV_SCALE_LEAST_SQUARES, AKV_SCALE_ABSMAX));
  m.rope_style = static_cast<akv_rope_style>(enum_field("rope style", AKV_ROPE_NONE, AKV_ROPE_GPTJ));
  m.rotary_dim = r.get<int32_t>("rotary_dim");
  const uint32_t nfreq = r.get<uint32_t>("inv_freq count");
  m.inv_freq = r.array<float>(nfreq, "inv_freq");
  m.window = r.get<int32_t>("window");
  m.anchors = r.get<int32_t>("anchors");
  m.key_residuals = r.get<int64_t>("key_residuals");
  m.value_residuals = r.get<int64_t>("value_residuals");
  m.window_first_position = r.get<int64_t>("window_first_position");
  c.next_position = r.get<int64_t>("next_position");
  const Storage kind = storage_of(m.method);
  const bool pooled = kind == Storage::kAnchor;
  m.pool_heads = version >= 2 ? r.get<int32_t>("pool_heads") : pooled ? m.shape.num_kv_heads : 0;
  m.storage_format = version >= 3 ? r.get<int32_t>("storage format") : pooled ? 2 : 0;
  if (version >= 5) {
    const uint32_t n = r.get<uint32_t>("logit penalty count");
    corrupt_unless(n == 0 || (pooled && m.storage_format == 3 && int64_t{n} == 2 * int64_t{m.shape.num_kv_heads}),
                   "logit penalty count");
    m.logit_penalty = r.array<float>(n, "logit penalties");
    for (float v : m.logit_penalty) corrupt_unless(std::isfinite(v) && v >= 0.0f, "logit penalties");
  }

  // What akv_compress accepts and stores (the same shape rule, api/validate.cpp resolve_options).
  const akv_shape &s = m.shape;
  check_shape(s, AKV_ERR_CORRUPT_DATA, AKV_ERR_CORRUPT_DATA, "serialized cache has shape.");
  corrupt_unless(m.keys_post_rope == 0 || m.keys_post_rope == 1, "keys_post_rope");
  corrupt_unless(std::isfinite(m.softmax_scale) && m.softmax_scale > 0, "softmax_scale");
  corrupt_unless(std::isfinite(m.retain_fraction) && m.retain_fraction > 0.0 && m.retain_fraction <= 1.0,
                 "retain_fraction");
  corrupt_unless(m.layer_count >= 1 && m.layer_index >= 0 && m.layer_index < m.layer_count, "layer_index");
  corrupt_unless(m.window >= 1, "window");
  // The rope as compression resolved it: no table without rotation, rotary_dim/2 frequencies
  // with it (the Rope constructor checks rotary_dim against head_dim and the values).
  if (m.rope_style == AKV_ROPE_NONE)
    corrupt_unless(nfreq == 0 && m.rotary_dim == 0, "rope: frequencies stored without a rotation");
  else
    corrupt_unless(nfreq >= 1 && static_cast<int64_t>(nfreq) * 2 == m.rotary_dim, "rope: rotary_dim and frequency count");
  akv_rope rope_cfg{m.rope_style, m.rotary_dim, 10000.0, m.inv_freq.empty() ? nullptr : m.inv_freq.data()};
  try {
    c.rope = Rope(rope_cfg, s.head_dim);
  } catch (const Error &e) {
    fail(AKV_ERR_CORRUPT_DATA, "serialized cache has an invalid rope: ", e.what());
  }
  const bool anchor = kind == Storage::kAnchor;
  if (!anchor)  // compression sets these for AnchorKV only
    corrupt_unless(m.anchors == 0 && m.key_residuals == 0 && m.value_residuals == 0 && m.window_first_position == 0 &&
                       m.pool_heads == 0 && m.storage_format == 0,
                   "AnchorKV fields set for another method");

  const uint32_t nheads = r.get<uint32_t>("dense count");
  corrupt_unless(nheads == (anchor ? 0u : static_cast<uint32_t>(s.num_kv_heads)), "dense head count");
  const bool evicting = method_traits(m.method).evicting;
  corrupt_unless(!evicting || m.window < s.seq_len, "eviction window");
  r.need(nheads, sizeof(int64_t), "dense counts");
  for (uint32_t h = 0; h < nheads; ++h) {
    const int64_t n = r.get<int64_t>("dense counts");
    // Only the eviction methods drop tokens; they always keep the window.
    corrupt_unless(evicting ? n >= m.window && n <= s.seq_len : n == s.seq_len, "dense counts");
    m.dense_counts.push_back(n);
  }
  const uint64_t npos = r.get<uint64_t>("dense positions count");
  corrupt_unless(npos == (nheads ? static_cast<uint64_t>(s.seq_len) : 0u), "dense positions count");
  c.dense_positions = r.array<int32_t>(npos, "dense positions");
  require_increasing(c.dense_positions.data(), npos, -1, "dense positions");
  if (evicting) {
    int64_t kept = 0;
    for (int64_t n : m.dense_counts) kept += n;
    const uint64_t ntok = r.get<uint64_t>("kept token count");
    corrupt_unless(ntok == static_cast<uint64_t>(kept), "kept token count");
    c.dense_tokens = r.array<int32_t>(ntok, "kept tokens");
    // Per head: strictly increasing token indices inside the prompt, ending with the window.
    int64_t at = 0;
    for (int64_t n : m.dense_counts) {
      for (int64_t i = 0; i < n; ++i) {
        const int32_t t = c.dense_tokens[at + i];
        corrupt_unless(t >= 0 && t < s.seq_len && (i == 0 || t > c.dense_tokens[at + i - 1]), "kept token indices");
      }
      corrupt_unless(c.dense_tokens[at + n - 1] == s.seq_len - 1, "kept tokens miss the window");
      at += n;
    }
  } else if (storage_of(m.method) == Storage::kQuantized) {
    m.quant_bits = r.get<int32_t>("quant_bits");
    m.quant_outliers = r.get<int32_t>("quant_outliers");
    corrupt_unless(m.quant_bits >= 2 && m.quant_bits <= 4, "quant_bits");
    corrupt_unless(m.quant_outliers >= 0 && m.quant_outliers <= std::min(32, s.head_dim / 2), "quant_outliers");
    corrupt_unless(m.window <= s.seq_len, "quantized window");
    corrupt_unless(codec_head_dim(s.head_dim), "quantized head_dim");
  }

  const int64_t H = s.num_kv_heads, D = s.head_dim;
  int64_t last_prompt_position = 0;  // the prompt's last position: appended ones come after it
  if (anchor) {
    // Compression stores the anchor count it used (explicit k): the geometry follows from it.
    corrupt_unless(m.anchors >= m.window, "anchors");
    akv_compress_options o{};
    o.struct_size = sizeof o;
    o.retain_fraction = m.retain_fraction;
    o.window = m.window;
    o.anchors = m.anchors;
    corrupt_unless(m.pool_heads >= 1 && m.pool_heads <= s.num_kv_heads && s.num_kv_heads % m.pool_heads == 0,
                   "pool_heads");
    o.pool_heads = m.pool_heads;
    corrupt_unless(m.storage_format == 2 || m.storage_format == 3, "storage format");
    o.storage_format = m.storage_format;
    try {
      c.geometry = anchor_geometry(o, s);
    } catch (const Error &e) {
      fail(AKV_ERR_CORRUPT_DATA, "serialized cache has invalid compression parameters: ", e.what());
    }
    const AnchorGeometry &g = c.geometry;
    corrupt_unless(g.anchors == m.anchors, "anchor count does not match the byte accounting");
    corrupt_unless(g.key_residuals == m.key_residuals && g.value_residuals == m.value_residuals,
                   "residual counts do not match the byte accounting");
    c.layout = anchor_layout(g);
    c.codec = ResidualCodec(m.seed, g.dim, m.residual_scale);
    c.footprint = g.footprint;
    uint64_t stored = 0;
    for (const Section &sec : c.layout.sections) stored += sec.bytes;
    r.need(stored, 1, "AnchorKV arrays");
    out.data.assign(c.layout.total_bytes, 0);
    for (int i = 0; i < kAnchorSectionCount; ++i)
      r.read_into(out.data.data() + c.layout.sections[i].offset, c.layout.sections[i].bytes, kAnchorSectionNames[i]);
    // Validate everything decode indexes with, so a crafted file cannot read out of bounds.
    auto sec = [&](int i) { return out.data.data() + c.layout.sections[i].offset; };
    require_finite_storage(c, out.data.data(), AKV_ERR_CORRUPT_DATA, kHoldsNonFinite);
    const int64_t P = g.prefix, words = g.words, k = g.anchors;
    const int idx_sections[2] = {kKeyIndex, kValueIndex}, mask_sections[2] = {kKeyMask, kValueMask};
    const int prefix_sections[2] = {kKeyPrefix, kValuePrefix}, off_sections[2] = {kKeyOffsets, kValueOffsets};
    const int64_t totals[2] = {g.key_residuals, g.value_residuals};
    // Anchor tokens: per head strictly increasing prefix indices (decode and compaction index
    // with them).
    const int64_t *anchor_tokens = reinterpret_cast<const int64_t *>(sec(kAnchorTokens));
    const int64_t free_anchors = k - g.window;
    for (int64_t h = 0; h < H; ++h)
      for (int64_t a = 0; a < free_anchors; ++a) {
        const int64_t t = anchor_tokens[h * free_anchors + a];
        corrupt_unless(t >= 0 && t < P && (a == 0 || t > anchor_tokens[h * free_anchors + a - 1]), "anchor tokens");
      }
    const int gamma_sections[2] = {kKeyGamma, kValueGamma};
    for (int side = 0; side < 2; ++side) {
      if (g.format == 2) {
        const uint16_t *idx = reinterpret_cast<const uint16_t *>(sec(idx_sections[side]));
        for (int64_t i = 0; i < H * P; ++i) corrupt_unless(idx[i] < k, "anchor index out of range");
      } else {
        // One-byte indices name an entry of the segment's table (k <= 256: an anchor), whose
        // ids are anchors; anchor tokens carry index 0 and coefficient code 0 (they are exact).
        const uint8_t *idx = sec(idx_sections[side]);
        const uint8_t *code = sec(gamma_sections[side]);
        if (g.table_size == 0)
          for (int64_t i = 0; i < H * P; ++i) corrupt_unless(idx[i] < k, "anchor index out of range");
        for (int64_t h = 0; h < H; ++h)
          for (int64_t a = 0; a < free_anchors; ++a) {
            const int64_t t = anchor_tokens[h * free_anchors + a];
            corrupt_unless(idx[h * P + t] == 0 && code[h * P + t] == 0, "anchor token with an anchor index");
          }
      }
      const uint64_t *mask = reinterpret_cast<const uint64_t *>(sec(mask_sections[side]));
      const uint32_t *prefix = reinterpret_cast<const uint32_t *>(sec(prefix_sections[side]));
      const uint32_t *off = reinterpret_cast<const uint32_t *>(sec(off_sections[side]));
      uint64_t running = 0;  // 64-bit: a sum that wraps in 32 bits must not match
      for (int64_t h = 0; h < H; ++h) {
        corrupt_unless(off[h] == running, "residual offsets");
        uint64_t count = 0;
        for (int64_t wd = 0; wd < words; ++wd) {
          corrupt_unless(prefix[h * words + wd] == count, "residual prefix counts");
          uint64_t bits = mask[h * words + wd];
          if (wd == words - 1 && P % 64) corrupt_unless((bits >> (P % 64)) == 0, "residual mask beyond P");
          count += static_cast<uint64_t>(__builtin_popcountll(bits));
        }
        running += count;
      }
      corrupt_unless(off[H] == running && running == static_cast<uint64_t>(totals[side]), "residual totals");
    }
    const uint64_t *vmask = reinterpret_cast<const uint64_t *>(sec(kValueMask));
    const uint32_t *vprefix = reinterpret_cast<const uint32_t *>(sec(kValuePrefix));
    const uint32_t *voff = reinterpret_cast<const uint32_t *>(sec(kValueOffsets));
    const uint8_t *chunk = sec(kValueChunkPos);
    for (int64_t h = 0; h < H; ++h)
      for (int64_t wd = 0; wd < words; ++wd) {
        uint64_t bits = vmask[h * words + wd];
        uint32_t slot = voff[h] + vprefix[h * words + wd];
        while (bits) {
          corrupt_unless(chunk[slot++] == __builtin_ctzll(bits), "value residual positions");
          bits &= bits - 1;
        }
      }
    if (g.format == 3) {
      const uint16_t *tables = reinterpret_cast<const uint16_t *>(sec(kSegmentTables));
      const uint64_t entries = c.layout.sections[kSegmentTables].bytes / 2;
      for (uint64_t i = 0; i < entries; ++i) corrupt_unless(tables[i] < k, "segment table entry out of range");
      const float *scales = reinterpret_cast<const float *>(sec(kGammaScales));
      for (int64_t i = 0; i < H * g.segments * 2; ++i)
        corrupt_unless(std::isfinite(scales[i]) && scales[i] >= 0.0f, "coefficient scale");
    }
    // Prefix positions, then the window's W consecutive positions from window_first_position:
    // decode rotates with them, so all of them must be int32 and increasing. Format 3 stores
    // none: the prompt's positions run consecutively to the window's.
    int64_t last_prefix = m.window_first_position - 1;
    if (g.format == 2) {
      const int32_t *pos = reinterpret_cast<const int32_t *>(sec(kPositions));
      require_increasing(pos, static_cast<uint64_t>(P), -1, "prefix positions");
      last_prefix = pos[P - 1];
    } else {
      require(m.window_first_position >= P, AKV_ERR_CORRUPT_DATA, "serialized cache has window_first_position ",
              m.window_first_position, ": the implicit prefix positions would be negative");
    }
    require(m.window_first_position > last_prefix && m.window_first_position <= int64_t{INT32_MAX} - (m.window - 1),
            AKV_ERR_CORRUPT_DATA, "serialized cache has window_first_position ", m.window_first_position,
            ": the window must follow the prefix (last position ", last_prefix, ") and end within int32");
    last_prompt_position = m.window_first_position + m.window - 1;
  } else if (storage_of(m.method) == Storage::kQuantized) {
    c.quant = quant_geometry_for_bits(s, m.window, m.quant_bits, m.quant_outliers);
    c.quant.budget_bytes = static_cast<uint64_t>(std::floor(m.retain_fraction * static_cast<double>(c.quant.full_bytes)));
    c.quantizer = TokenQuantizer(m.seed, s.head_dim, m.quant_bits, m.quant_outliers);
    c.footprint = c.quant.footprint;
    r.need(c.quant.footprint, 1, "quantized arrays");  // the sections' bytes, without padding
    out.data.assign(c.quant.total_bytes, 0);
    for (int i = 0; i < kQuantSectionCount; ++i)
      r.read_into(out.data.data() + c.quant.offsets[i], c.quant.bytes[i], kQuantSectionNames[i]);
    auto sec = [&](int i) { return out.data.data() + c.quant.offsets[i]; };
    require_finite_storage(c, out.data.data(), AKV_ERR_CORRUPT_DATA, kHoldsNonFinite);
    // Decode indexes query channels by the outlier indices.
    const uint64_t outliers = static_cast<uint64_t>(H) * c.quant.prefix * m.quant_outliers;
    const uint8_t *idx = sec(kQuantKeyOutlierIndex);
    for (uint64_t i = 0; i < outliers; ++i) {
      uint32_t channel = idx[i * c.quant.index_bytes];
      if (c.quant.index_bytes == 2) channel |= static_cast<uint32_t>(idx[i * 2 + 1]) << 8;
      corrupt_unless(channel < static_cast<uint32_t>(D), "outlier channel index");
    }
    last_prompt_position = c.dense_positions.back();
  } else {
    int64_t kept = 0;
    for (int64_t n : m.dense_counts) kept += n;
    c.footprint = 4ull * kept * D;
    r.need(c.footprint, 1, "dense arrays");
    out.data.resize(c.footprint);
    r.read_into(out.data.data(), c.footprint, "dense arrays");
    require_finite_storage(c, out.data.data(), AKV_ERR_CORRUPT_DATA, kHoldsNonFinite);
    last_prompt_position = c.dense_positions.back();
  }
  const int64_t len = r.get<int64_t>("suffix length");
  corrupt_unless(len >= 0 && len <= INT32_MAX, "suffix length");
  c.suffix_positions = r.array<int32_t>(static_cast<uint64_t>(len), "suffix positions");
  require_increasing(c.suffix_positions.data(), static_cast<uint64_t>(len), last_prompt_position, "suffix positions");
  const uint64_t row = static_cast<uint64_t>(D) * 2;
  r.need(static_cast<uint64_t>(len), 2 * H * row, "suffix keys and values");
  const size_t suffix_bytes = static_cast<size_t>(H * len) * row;
  const uint8_t *ks = r.take(suffix_bytes, "suffix keys");
  out.suffix_keys.assign(ks, ks + suffix_bytes);
  const uint8_t *vs = r.take(suffix_bytes, "suffix values");
  out.suffix_values.assign(vs, vs + suffix_bytes);
  require_finite(ks, suffix_bytes, m.storage, "suffix keys", AKV_ERR_CORRUPT_DATA, kHoldsNonFinite);
  require_finite(vs, suffix_bytes, m.storage, "suffix values", AKV_ERR_CORRUPT_DATA, kHoldsNonFinite);
  // The options compaction reuses: format 2 stores them, format 1 caches get the method's
  // defaults (and the fields every format stores in the meta).
  akv_compress_options &o = c.compress_options;
  o = method_options(m.method);
  o.retain_fraction = m.retain_fraction;
  if (version >= 2) {
    c.compactions = r.get<int64_t>("compactions");
    o.compact_after = r.get<int64_t>("compact_after");
    o.retain_fraction = r.get<double>("target retain_fraction");
    o.anchors = r.get<int32_t>("requested anchors");
    o.scored_fraction = r.get<double>("scored_fraction");
    o.pool_kernel = r.get<int32_t>("pool_kernel");
    o.pool_type = static_cast<akv_pool_type>(enum_field("pool_type", AKV_POOL_AVG, AKV_POOL_MAX));
    o.sink_tokens = r.get<int32_t>("sink_tokens");
    o.fill_budget = r.get<int32_t>("fill_budget");
    o.anchor_share = r.get<double>("anchor_share");
    o.guard_fraction = r.get<double>("guard_fraction");
    o.coverage_rounds = r.get<int32_t>("coverage_rounds");
    o.head_offset = r.get<int32_t>("head_offset");
    if (version >= 4) {  // older caches were compressed without them: 0
      o.scored_min = r.get<int32_t>("scored_min");
      o.follow_tokens = r.get<int32_t>("follow_tokens");
    } else {
      o.scored_min = o.follow_tokens = 0;
    }
    if (version >= 5) o.logit_correction = r.get<double>("logit_correction");
    const bool foldable = compactable(m.method);
    corrupt_unless(c.compactions >= 0 && (c.compactions == 0 || foldable), "compactions");
    corrupt_unless(o.retain_fraction >= m.retain_fraction, "target retain_fraction");
    corrupt_unless(o.anchors >= 0 && o.anchors <= 65536, "requested anchors");
  }
  if (version < 5) o.logit_correction = 0.0;  // decoded over the reconstruction as it is
  o.pool_heads = m.pool_heads;  // a compaction pools as the compression did
  o.storage_format = m.storage_format;
  o.window = m.window;
  o.seed = m.seed;
  o.layer_index = m.layer_index;
  o.layer_count = m.layer_count;
  o.residual_scale = m.residual_scale;
  o.storage_dtype = m.storage;
  o.keys_post_rope = m.keys_post_rope;
  o.softmax_scale = m.softmax_scale;
  o.rope.style = m.rope_style;
  o.rope.rotary_dim = m.rotary_dim;
  o.quant_bits = m.quant_bits;
  o.quant_outliers = m.quant_outliers;
  check_option_ranges(o, AKV_ERR_CORRUPT_DATA, "serialized cache is inconsistent: ");  // what akv_compress accepts
  // Appending continues from next_position: one past the last stored position, or further on
  // where a device cache dropped tokens appended past its reservation (their positions stay
  // taken, so that later tokens keep the engine's positions); below INT32_MAX either way.
  const int64_t last = len ? c.suffix_positions.back() : last_prompt_position;
  require(c.next_position == last + 1 || (c.next_position > last && c.next_position < std::numeric_limits<int32_t>::max()),
          AKV_ERR_CORRUPT_DATA, "serialized cache has next_position ", c.next_position, " but its last position is ", last);
  corrupt_unless(r.remaining() == 0, "trailing bytes");
  return out;
}

}  // namespace akv
