// The deserializer trusts nothing it reads, even under a valid checksum (a buffer can be
// crafted, or damaged before it was checksummed): every count is checked against the bytes
// left before anything is allocated from it, and every field that decode, append,
// reconstruct or serialize relies on (shape, positions, counts, offsets, indices, stored
// floats) is validated. Each case below damages one field of a valid small cache, recomputes
// the CRC, and expects AKV_ERR_CORRUPT_DATA without a large allocation.
#include <gtest/gtest.h>

#include <cmath>
#include <algorithm>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "common/small_caches.hpp"
#include "core/context.hpp"
#include "core/serialize.hpp"

namespace {

using Bytes = std::vector<uint8_t>;

struct ContextOwner {
  akv_context *raw = nullptr;
  ContextOwner() {
    akv_context_options options;
    akv_context_options_init(&options);
    options.num_threads = 1;
    if (akv_context_create(&options, &raw) != AKV_OK) throw std::runtime_error(akv_last_error_message());
  }
  ~ContextOwner() { akv_context_destroy(raw); }
};

// Peak resident set since reset_peak_rss() (VmHWM), in KiB; -1 where /proc cannot tell.
bool reset_peak_rss() {
  std::ofstream clear("/proc/self/clear_refs");
  clear << "5";
  clear.flush();
  return static_cast<bool>(clear);
}
long status_kib(const char *key) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line))
    if (line.rfind(key, 0) == 0) return std::stol(line.substr(std::strlen(key)));
  return -1;
}

Bytes with_crc(Bytes bytes) {
  const uint32_t crc = akv::crc32(bytes.data(), bytes.size() - 4);
  std::memcpy(bytes.data() + bytes.size() - 4, &crc, 4);
  return bytes;
}

// Older serialized data: `bytes` (CRC place included) stamped with `version`, its total size
// and CRC recomputed.
Bytes as_version(Bytes bytes, uint32_t version) {
  const uint64_t total = bytes.size();
  std::memcpy(bytes.data() + 8, &version, 4);
  std::memcpy(bytes.data() + 16, &total, 8);
  return with_crc(bytes);
}

const akv::SerializedField *find_field(const std::vector<akv::SerializedField> &fields, const std::string &name) {
  for (const akv::SerializedField &f : fields)
    if (f.name == name) return &f;
  return nullptr;
}

template <typename T>
Bytes value_bytes(T value) {
  Bytes out(sizeof(T));
  std::memcpy(out.data(), &value, sizeof(T));
  return out;
}

constexpr size_t kLast = std::numeric_limits<size_t>::max();  // the field's last element

struct Damage {
  std::string label;
  std::string field;
  Bytes value;
  size_t at = 0;         // byte offset inside the field, or kLast
  std::string caches;    // prefix of the cache names it applies to; "" = all
};

std::vector<Damage> damages() {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const float fnan = std::numeric_limits<float>::quiet_NaN(), finf = std::numeric_limits<float>::infinity();
  const int64_t i64max = std::numeric_limits<int64_t>::max();
  const int32_t i32max = std::numeric_limits<int32_t>::max(), i32min = std::numeric_limits<int32_t>::min();
  return {
      // Counts: checked against the bytes left before any allocation (issue 12, defect 1).
      {"suffix length 2^28", "suffix length", value_bytes<int64_t>(int64_t{1} << 28)},
      {"suffix length 2^31", "suffix length", value_bytes<int64_t>(int64_t{1} << 31)},
      {"suffix length -1", "suffix length", value_bytes<int64_t>(-1)},
      {"suffix length INT64_MAX", "suffix length", value_bytes<int64_t>(i64max)},
      {"inv_freq count 4096", "inv_freq count", value_bytes<uint32_t>(4096)},
      {"inv_freq count UINT32_MAX", "inv_freq count", value_bytes<uint32_t>(0xffffffffu)},
      {"dense positions count 2^31", "dense positions count", value_bytes<uint64_t>(uint64_t{1} << 31), 0, "fullkv"},
      {"dense positions count UINT64_MAX", "dense positions count", value_bytes<uint64_t>(~uint64_t{0}), 0, "snapkv"},
      {"kept token count 2^40", "kept token count", value_bytes<uint64_t>(uint64_t{1} << 40)},
      {"kept token count UINT64_MAX", "kept token count", value_bytes<uint64_t>(~uint64_t{0})},
      {"dense count 4096", "dense count", value_bytes<uint32_t>(4096)},
      // Format 2: AnchorKV's pooling group divides H; other methods store 0.
      {"pool_heads 0", "pool_heads", value_bytes<int32_t>(0), 0, "anchorkv"},
      {"pool_heads 3", "pool_heads", value_bytes<int32_t>(3), 0, "anchorkv"},
      {"pool_heads -2", "pool_heads", value_bytes<int32_t>(-2), 0, "anchorkv"},
      {"pool_heads set", "pool_heads", value_bytes<int32_t>(1), 0, "fullkv"},
      // Sizes derived from the shape: the arrays they imply must be there before allocation.
      {"seq_len 2^31-1", "seq_len", value_bytes<int64_t>(i32max)},
      {"seq_len 2^31", "seq_len", value_bytes<int64_t>(int64_t{1} << 31)},
      {"seq_len 0", "seq_len", value_bytes<int64_t>(0)},
      {"seq_len -1", "seq_len", value_bytes<int64_t>(-1)},
      {"num_kv_heads 4096", "num_kv_heads", value_bytes<int32_t>(4096)},
      {"num_kv_heads 0", "num_kv_heads", value_bytes<int32_t>(0)},
      {"num_q_heads 2^30", "num_q_heads", value_bytes<int32_t>(1 << 30)},
      {"head_dim odd", "head_dim", value_bytes<int32_t>(17)},
      {"head_dim 2048", "head_dim", value_bytes<int32_t>(2048)},
      // Positions decode and append compute with (defect 2).
      {"window_first_position INT64_MAX", "window_first_position", value_bytes<int64_t>(i64max)},
      {"window_first_position INT32_MAX", "window_first_position", value_bytes<int64_t>(i32max)},
      {"window_first_position -1", "window_first_position", value_bytes<int64_t>(-1)},
      {"next_position INT64_MAX", "next_position", value_bytes<int64_t>(i64max)},
      {"next_position INT32_MAX", "next_position", value_bytes<int64_t>(i32max)},
      {"next_position 0", "next_position", value_bytes<int64_t>(0)},
      {"prefix position negative", "prefix positions", value_bytes<int32_t>(-5)},
      {"dense position negative", "dense positions", value_bytes<int32_t>(-1)},
      {"suffix position below the prompt", "suffix positions", value_bytes<int32_t>(i32min)},
      {"suffix positions not increasing", "suffix positions", value_bytes<int32_t>(i32min), kLast},
      // Offsets and indices (already checked before issue 12; kept as a guard).
      {"key residual offsets total", "key residual offsets", value_bytes<uint32_t>(0xffffffffu), kLast},
      {"key anchor index beyond k", "key anchor indices", value_bytes<uint16_t>(0xffff), 0, "anchorkv_layout2"},
      // Storage format 3: a one-byte index beyond k (no tables), on an anchor token (token 0 is
      // a sink), table entries beyond k, code scales finite and >= 0; the format field itself.
      {"one-byte key anchor index beyond k", "key anchor indices", value_bytes<uint8_t>(0xff), kLast, "anchorkv_bf16"},
      {"value index on an anchor token", "value anchor indices", value_bytes<uint8_t>(1), 0, "anchorkv_bf16"},
      {"key code on an anchor token", "key gammas", value_bytes<uint8_t>(7), 0, "anchorkv_tables"},
      {"segment table entry beyond k", "segment tables", value_bytes<uint16_t>(0xffff), 0, "anchorkv_tables"},
      {"segment table entry k", "segment tables", value_bytes<uint16_t>(300), kLast, "anchorkv_tables"},
      {"gamma scale NaN", "gamma scales", value_bytes<float>(fnan), 0, "anchorkv"},
      {"gamma scale negative", "gamma scales", value_bytes<float>(-1.0f), kLast, "anchorkv"},
      {"storage format 4", "storage format", value_bytes<int32_t>(4), 0, "anchorkv"},
      {"storage format 0 on AnchorKV", "storage format", value_bytes<int32_t>(0), 0, "anchorkv"},
      {"storage format set without AnchorKV", "storage format", value_bytes<int32_t>(3), 0, "fullkv"},
      {"anchor token beyond the prefix", "anchor tokens", value_bytes<int64_t>(i64max), 0, "anchorkv"},
      {"anchor tokens not increasing", "anchor tokens", value_bytes<int64_t>(0), kLast, "anchorkv"},
      // Stored floats must be finite.
      {"anchor key Inf", "anchor keys", value_bytes<uint16_t>(0x7f80)},
      {"anchor value NaN", "anchor values", value_bytes<uint16_t>(0xffff), kLast},
      {"key gamma NaN", "key gammas", value_bytes<uint16_t>(0x7fc0), 0, "anchorkv_layout2"},
      {"value gamma -Inf", "value gammas", value_bytes<uint16_t>(0xff80), kLast, "anchorkv_layout2"},
      {"key residual scale NaN", "key residual scales", value_bytes<float>(fnan)},
      {"value residual scale Inf", "value residual scales", value_bytes<float>(finf), kLast},
      {"dense key Inf", "dense keys", value_bytes<uint16_t>(0x7f80)},
      {"dense value NaN", "dense values", value_bytes<uint16_t>(0xffff), kLast},
      {"suffix key Inf", "suffix keys", value_bytes<uint16_t>(0x7f80)},
      {"suffix value NaN", "suffix values", value_bytes<uint16_t>(0xffff), kLast},
      {"quantized window key Inf", "quantized window keys", value_bytes<uint16_t>(0x7f80)},
      {"quantized window value NaN", "quantized window values", value_bytes<uint16_t>(0xffff), kLast},
      {"quantized key scale NaN", "quantized key scales", value_bytes<float>(fnan)},
      {"quantized value scale -Inf", "quantized value scales", value_bytes<float>(-finf), kLast},
      {"quantized outlier value Inf", "quantized key outlier values", value_bytes<uint16_t>(0x7f80)},
      {"inv_freq NaN", "inv_freq", value_bytes<float>(fnan)},
      {"softmax_scale Inf", "softmax_scale", value_bytes<float>(finf)},
      {"retain_fraction NaN", "retain_fraction", value_bytes<double>(nan)},
      {"retain_fraction 0", "retain_fraction", value_bytes<double>(0.0)},
      {"retain_fraction 1.5", "retain_fraction", value_bytes<double>(1.5)},
      // Fields outside their domain (what compression can produce).
      {"flags set", "flags", value_bytes<uint32_t>(1)},
      {"keys_post_rope 2", "keys_post_rope", value_bytes<int32_t>(2)},
      {"layer_count 0", "layer_count", value_bytes<int32_t>(0)},
      {"layer_index -1", "layer_index", value_bytes<int32_t>(-1)},
      {"anchors 0 (AnchorKV stores k)", "anchors", value_bytes<int32_t>(0), 0, "anchorkv"},
      // Format 2: the compaction fields (akv_cache_compact).
      {"compactions -1", "compactions", value_bytes<int64_t>(-1)},
      {"compactions on a FullKV cache", "compactions", value_bytes<int64_t>(2), 0, "fullkv"},
      {"compact_after -1", "compact_after", value_bytes<int64_t>(-1)},
      {"compact_after 2^40", "compact_after", value_bytes<int64_t>(int64_t{1} << 40)},
      {"target retain_fraction NaN", "target retain_fraction", value_bytes<double>(nan)},
      {"target retain_fraction 1.5", "target retain_fraction", value_bytes<double>(1.5)},
      {"pool_kernel even", "pool_kernel", value_bytes<int32_t>(4)},
      {"pool_type 7", "pool_type", value_bytes<int32_t>(7)},
      {"anchor_share 2", "anchor_share", value_bytes<double>(2.0)},
      {"coverage_rounds 65", "coverage_rounds", value_bytes<int32_t>(65)},
      {"follow_tokens 65", "follow_tokens", value_bytes<int32_t>(65)},
      {"follow_tokens -1", "follow_tokens", value_bytes<int32_t>(-1)},
      {"scored_min -1", "scored_min", value_bytes<int32_t>(-1)},
      {"anchors set without AnchorKV", "anchors", value_bytes<int32_t>(3), 0, "fullkv"},
      {"key_residuals set without AnchorKV", "key_residuals", value_bytes<int64_t>(5), 0, "quantized"},
      {"window_first_position set without AnchorKV", "window_first_position", value_bytes<int64_t>(9), 0, "snapkv"},
      {"rope style none with a frequency table", "rope style", value_bytes<int32_t>(AKV_ROPE_NONE), 0, "fullkv_bf16"},
      {"quant_bits 5", "quant_bits", value_bytes<int32_t>(5)},
  };
}

class SerializeValidation : public ::testing::Test {
 protected:
  void SetUp() override { caches_ = akv_test::small_caches(context_.raw, 20240612); }
  akv_status load(const Bytes &bytes) {
    akv_cache *out = nullptr;
    const akv_status status = akv_cache_deserialize(context_.raw, bytes.data(), bytes.size(), &out, nullptr);
    akv_cache_destroy(out);
    return status;
  }
  ContextOwner context_;
  std::vector<akv_test::SmallCache> caches_;
};

// The field map (the damage table's coordinates) covers every byte, and every small cache
// deserializes and serializes back to the same bytes.
TEST_F(SerializeValidation, ValidCachesRoundTripAndFieldsCoverTheBytes) {
  for (const akv_test::SmallCache &small : caches_) {
    SCOPED_TRACE(small.name);
    const Bytes bytes = akv_test::serialized_bytes(small.cache.get());
    const std::vector<akv::SerializedField> fields = akv::serialized_fields(*small.cache);
    size_t at = 0;
    for (const akv::SerializedField &f : fields) {
      EXPECT_EQ(f.offset, at) << f.name;
      at = f.offset + f.bytes;
    }
    EXPECT_EQ(at, bytes.size());
    akv_cache *copy = nullptr;
    ASSERT_EQ(akv_cache_deserialize(context_.raw, bytes.data(), bytes.size(), &copy, nullptr), AKV_OK)
        << akv_last_error_message();
    EXPECT_TRUE(akv_test::serialized_bytes(copy) == bytes) << "re-serializing gives other bytes";
    akv_cache_destroy(copy);
  }
}

// Issue 12, defect 1, as reported: the appended-token count of an AnchorKV cache with two
// appended tokens set to 2^28 under a recomputed CRC grew the peak RSS to 1 GB before
// AKV_ERR_CORRUPT_DATA came back.
TEST_F(SerializeValidation, SuffixCountIsCheckedBeforeAllocating) {
  const akv_test::SmallCache &small = caches_[3];
  ASSERT_EQ(small.name, "anchorkv_bf16_neox_appended");
  Bytes bytes = akv_test::serialized_bytes(small.cache.get());
  const std::vector<akv::SerializedField> fields = akv::serialized_fields(*small.cache);
  const akv::SerializedField *count = find_field(fields, "suffix length");
  ASSERT_NE(count, nullptr);
  const int64_t huge = int64_t{1} << 28;
  std::memcpy(bytes.data() + count->offset, &huge, 8);
  bytes = with_crc(bytes);
  const bool can_measure = reset_peak_rss();
  const long before = status_kib("VmRSS:");
  EXPECT_EQ(load(bytes), AKV_ERR_CORRUPT_DATA) << akv_last_error_message();
  const long peak = status_kib("VmHWM:");
  if (can_measure && before > 0 && peak > 0)
    EXPECT_LT(peak - before, 64 * 1024) << "peak RSS grew by " << (peak - before) / 1024 << " MiB";
}

// Issue 12, defect 2, as reported: a window start position of INT64_MAX was accepted and
// akv_decode then overflowed a signed 64-bit position.
TEST_F(SerializeValidation, WindowPositionBeyondInt32IsCorrupt) {
  const akv_test::SmallCache &small = caches_[3];
  Bytes bytes = akv_test::serialized_bytes(small.cache.get());
  const std::vector<akv::SerializedField> fields = akv::serialized_fields(*small.cache);
  const akv::SerializedField *field = find_field(fields, "window_first_position");
  ASSERT_NE(field, nullptr);
  const int64_t position = std::numeric_limits<int64_t>::max();
  std::memcpy(bytes.data() + field->offset, &position, 8);
  EXPECT_EQ(load(with_crc(bytes)), AKV_ERR_CORRUPT_DATA) << akv_last_error_message();
}

TEST_F(SerializeValidation, EveryDamagedFieldIsCorruptWithoutALargeAllocation) {
  const bool can_measure = reset_peak_rss();
  std::vector<std::string> failures;
  for (const Damage &damage : damages()) {
    int applied = 0;
    for (const akv_test::SmallCache &small : caches_) {
      if (small.name.rfind(damage.caches, 0) != 0) continue;
      const std::vector<akv::SerializedField> fields = akv::serialized_fields(*small.cache);
      const akv::SerializedField *field = find_field(fields, damage.field);
      if (!field || field->bytes < damage.value.size()) continue;
      Bytes bytes = akv_test::serialized_bytes(small.cache.get());
      const size_t at = damage.at == kLast ? field->bytes - damage.value.size() : damage.at;
      if (std::memcmp(bytes.data() + field->offset + at, damage.value.data(), damage.value.size()) == 0) continue;
      std::memcpy(bytes.data() + field->offset + at, damage.value.data(), damage.value.size());
      bytes = with_crc(bytes);
      ++applied;
      reset_peak_rss();
      const long before = status_kib("VmRSS:");
      const akv_status status = load(bytes);
      const long peak = status_kib("VmHWM:");
      std::ostringstream what;
      what << small.name << ", " << damage.label << ": ";
      if (status != AKV_ERR_CORRUPT_DATA)
        failures.push_back(what.str() + akv_status_string(status) +
                           (status == AKV_OK ? std::string(" (accepted)") : std::string(" (") + akv_last_error_message() + ")"));
      if (can_measure && before > 0 && peak - before > 64 * 1024)
        failures.push_back(what.str() + "peak RSS grew by " + std::to_string((peak - before) / 1024) + " MiB");
    }
    EXPECT_GT(applied, 0) << "no small cache has a field \"" << damage.field << "\" for " << damage.label;
  }
  std::ostringstream list;
  for (const std::string &f : failures) list << "\n  " << f;
  EXPECT_TRUE(failures.empty()) << failures.size() << " damaged buffers were not refused cleanly:" << list.str();
}

}  // namespace

namespace {

// `current` without the named fields (each present), as an older format wrote it; each field
// listed in `zeroed` instead keeps its place with zero bytes.
Bytes without_fields(const Bytes &current, const std::vector<akv::SerializedField> &fields,
                     const std::vector<std::string> &dropped, const std::vector<std::string> &zeroed = {}) {
  Bytes out;
  size_t at = 0;
  for (const akv::SerializedField &f : fields) {
    const bool drop = std::find(dropped.begin(), dropped.end(), f.name) != dropped.end();
    const bool zero = std::find(zeroed.begin(), zeroed.end(), f.name) != zeroed.end();
    if (!drop && !zero) continue;
    out.insert(out.end(), current.begin() + at, current.begin() + f.offset);
    if (zero) out.insert(out.end(), f.bytes, 0);
    at = f.offset + f.bytes;
  }
  out.insert(out.end(), current.begin() + at, current.end());
  return out;
}

// Format 1 still loads: the same cache without what formats 2 to 5 added (pool_heads, the
// storage format and the logit penalties after next_position, the compaction fields before
// the CRC), version 1. It reads back as one pooling group of every head, storage format 2,
// and serializes to today's bytes up to the compaction fields (those take the method's
// defaults, as format 1 did not store the compression options). Caches in storage format 3
// have no older form.
TEST(SerializeFormat, VersionOneDataStillLoads) {
  ContextOwner context;
  int checked = 0;
  for (const akv_test::SmallCache &small : akv_test::small_caches(context.raw, 20261130)) {
    if (small.cache->meta.storage_format == 3) continue;
    SCOPED_TRACE(small.name);
    ++checked;
    const Bytes current = akv_test::serialized_bytes(small.cache.get());
    const std::vector<akv::SerializedField> fields = akv::serialized_fields(*small.cache);
    const akv::SerializedField *compaction = find_field(fields, "compactions");
    ASSERT_NE(compaction, nullptr);
    Bytes old(current.begin(), current.begin() + compaction->offset);
    old.resize(old.size() + 4);  // the CRC's place
    old = as_version(without_fields(old, fields, {"pool_heads", "storage format", "logit penalty count", "logit penalties"}), 1);
    akv_cache *loaded = nullptr;
    ASSERT_EQ(akv_cache_deserialize(context.raw, old.data(), old.size(), &loaded, nullptr), AKV_OK)
        << akv_last_error_message();
    EXPECT_EQ(loaded->meta.pool_heads, small.cache->meta.pool_heads);
    EXPECT_EQ(loaded->compress_options.logit_correction, 0.0);
    const Bytes again = akv_test::serialized_bytes(loaded);
    ASSERT_EQ(again.size(), current.size());
    EXPECT_TRUE(std::equal(current.begin(), current.begin() + compaction->offset, again.begin()));
    akv_cache_destroy(loaded);
  }
  EXPECT_GE(checked, 10);
}

// Formats 2 to 4 still load: without the storage format field (format 2; it reads as storage
// format 2), without scored_min and follow_tokens (formats 2 and 3; they read as 0, the
// selection those caches were compressed with), and without the logit penalties and
// logit_correction (formats 2 to 4; no penalties, logit_correction 0: those caches decode over
// their reconstruction as it is). They serialize back to today's bytes with those values.
TEST(SerializeFormat, VersionTwoToFourDataStillLoad) {
  ContextOwner context;
  for (const uint32_t version : {2u, 3u, 4u}) {
    int checked = 0;
    for (const akv_test::SmallCache &small : akv_test::small_caches(context.raw, 20261201)) {
      if (version == 2 && small.cache->meta.storage_format == 3) continue;
      SCOPED_TRACE(small.name + " as version " + std::to_string(version));
      ++checked;
      const Bytes current = akv_test::serialized_bytes(small.cache.get());
      const std::vector<akv::SerializedField> fields = akv::serialized_fields(*small.cache);
      std::vector<std::string> dropped = {"logit penalty count", "logit penalties", "logit_correction"};
      if (version < 4) dropped.insert(dropped.end(), {"scored_min", "follow_tokens"});
      if (version < 3) dropped.push_back("storage format");
      const Bytes old = as_version(without_fields(current, fields, dropped), version);
      akv_cache *loaded = nullptr;
      ASSERT_EQ(akv_cache_deserialize(context.raw, old.data(), old.size(), &loaded, nullptr), AKV_OK)
          << akv_last_error_message();
      if (version < 4) {
        EXPECT_EQ(loaded->compress_options.scored_min, 0);
        EXPECT_EQ(loaded->compress_options.follow_tokens, 0);
      } else {
        EXPECT_EQ(loaded->compress_options.scored_min, small.cache->compress_options.scored_min);
      }
      EXPECT_TRUE(loaded->meta.logit_penalty.empty());
      EXPECT_EQ(loaded->compress_options.logit_correction, 0.0);
      // Today's bytes with no penalties (count 0) and the fields older data lacks as zeros.
      std::vector<std::string> zeroed = {"logit penalty count", "logit_correction"};
      if (version < 4) zeroed.insert(zeroed.end(), {"scored_min", "follow_tokens"});
      Bytes expected = without_fields(current, fields, {"logit penalties"}, zeroed);
      const uint64_t total = expected.size();
      std::memcpy(expected.data() + 16, &total, 8);
      EXPECT_TRUE(akv_test::serialized_bytes(loaded) == with_crc(expected));
      akv_cache_destroy(loaded);
    }
    EXPECT_GE(checked, 10);
  }
}

}  // namespace
