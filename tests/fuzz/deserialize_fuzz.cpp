// Fuzz target: akv_cache_deserialize, then every call on whatever it accepts.
//
// Each input is tried twice: as given (the checks in front of the checksum), and with its
// size field and CRC-32 recomputed, so that mutations reach the field validation behind the
// checksum (a buffer can be crafted, or damaged before it was checksummed). An accepted cache
// must then survive stats, head stats, decode (q_len 1, and 2 when a token is appended),
// decode_batch, reconstruct, serialize (the bytes must come back identical), append, reserve,
// and a second serialize/deserialize round trip. Findings abort with a message: a sanitizer
// report, a status the call must not return, or bytes that do not round-trip.
//
// Built with libFuzzer (clang -fsanitize=fuzzer, scripts/fuzz.sh) or with the seeded
// mutation driver in standalone_driver.cpp (any compiler; ctest fuzz_corpus).
#include <anchorkv/anchorkv.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

[[noreturn]] void finding(const char *what, akv_status status) {
  std::fprintf(stderr, "FUZZ FINDING: %s (status %s, message \"%s\")\n", what, akv_status_string(status),
               akv_last_error_message());
  std::abort();
}

#define FUZZ_REQUIRE(condition, what, status) \
  do {                                        \
    if (!(condition)) finding(what, status);  \
  } while (0)

uint32_t crc32(const uint8_t *data, size_t size) {
  static uint32_t table[256];
  static bool ready = false;
  if (!ready) {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1u) ? 0xedb88320u ^ (c >> 1) : c >> 1;
      table[i] = c;
    }
    ready = true;
  }
  uint32_t crc = ~0u;
  for (size_t i = 0; i < size; ++i) crc = table[(crc ^ data[i]) & 0xffu] ^ (crc >> 8);
  return ~crc;
}

akv_context *context() {
  static akv_context *shared = [] {
    akv_context_options options;
    akv_context_options_init(&options);
    options.num_threads = 1;  // deterministic and cheap; the thread pool has its own tests
    akv_context *c = nullptr;
    if (akv_context_create(&options, &c) != AKV_OK) finding("akv_context_create", AKV_ERR_INTERNAL);
    return c;
  }();
  return shared;
}

// Bounded work per input: decode and reconstruct of a cache whose work would be large are
// skipped, not failed. Decode costs about Hq x tokens x D (AnchorKV: a coefficient table of
// k x G x D per KV head), so a header announcing 65536 query heads over a small cache is a
// legitimate request that would take seconds and hundreds of MB per input.
constexpr uint64_t kMaxElements = uint64_t{1} << 22;

std::vector<float> values(uint64_t count, uint32_t salt, float scale) {
  std::vector<float> out(count);
  uint32_t x = 0x9e3779b9u ^ salt;
  for (float &v : out) {
    x ^= x << 13, x ^= x >> 17, x ^= x << 5;
    v = scale * (static_cast<float>(x >> 8) / 16777216.0f - 0.5f);
  }
  return out;
}

std::vector<uint8_t> serialize(const akv_cache *cache) {
  size_t size = 0;
  akv_status status = akv_cache_serialized_size(cache, &size);
  FUZZ_REQUIRE(status == AKV_OK, "akv_cache_serialized_size on an accepted cache", status);
  std::vector<uint8_t> bytes(size);
  size_t written = 0;
  status = akv_cache_serialize(cache, bytes.data(), bytes.size(), &written, nullptr);
  FUZZ_REQUIRE(status == AKV_OK && written == size, "akv_cache_serialize on an accepted cache", status);
  if (size > 0) {  // one byte short must be refused, not written past
    status = akv_cache_serialize(cache, bytes.data(), size - 1, &written, nullptr);
    FUZZ_REQUIRE(status == AKV_ERR_CAPACITY, "akv_cache_serialize into a short buffer", status);
  }
  return bytes;
}

void decode_all(akv_cache *cache, const akv_cache_stats &stats, uint32_t salt) {
  const uint64_t Hq = static_cast<uint64_t>(stats.shape.num_q_heads), D = static_cast<uint64_t>(stats.shape.head_dim);
  const uint64_t tokens = static_cast<uint64_t>(stats.shape.seq_len + stats.appended_tokens);
  if (Hq * (tokens + 2) * D > kMaxElements) return;
  const int q_len = stats.appended_tokens >= 1 ? 2 : 1;
  const std::vector<float> queries = values(Hq * q_len * D, salt, 2.0f);
  std::vector<float> out(Hq * q_len * D, std::nanf(""));
  akv_status status = akv_decode(cache, queries.data(), AKV_DTYPE_F32, q_len, out.data(), nullptr);
  FUZZ_REQUIRE(status == AKV_OK, "akv_decode on an accepted cache", status);
  // One query per request, the same cache twice: the batched path.
  akv_cache *batch[2] = {cache, cache};
  std::vector<float> batch_queries = values(2 * Hq * D, salt + 1, 2.0f), batch_out(2 * Hq * D);
  status = akv_decode_batch(context(), batch, 2, batch_queries.data(), AKV_DTYPE_F32, 1, batch_out.data(), nullptr);
  FUZZ_REQUIRE(status == AKV_OK, "akv_decode_batch on an accepted cache", status);
  // bf16 queries and outputs.
  std::vector<uint16_t> half_queries(Hq * D, 0x3f80), half_out(Hq * D);
  status = akv_decode(cache, half_queries.data(), AKV_DTYPE_BF16, 1, half_out.data(), nullptr);
  FUZZ_REQUIRE(status == AKV_OK, "akv_decode (bf16) on an accepted cache", status);
}

void reconstruct(const akv_cache *cache, const akv_cache_stats &stats) {
  const uint64_t H = static_cast<uint64_t>(stats.shape.num_kv_heads), D = static_cast<uint64_t>(stats.shape.head_dim);
  const uint64_t tokens = static_cast<uint64_t>(stats.shape.seq_len + stats.appended_tokens);
  if (H * tokens * D > kMaxElements) return;
  std::vector<float> keys(H * tokens * D), vals(H * tokens * D);
  std::vector<uint8_t> present(H * tokens);
  for (int rotated : {0, 1}) {
    const akv_status status =
        akv_cache_reconstruct(cache, AKV_DTYPE_F32, rotated, keys.data(), vals.data(), present.data(), nullptr);
    FUZZ_REQUIRE(status == AKV_OK, "akv_cache_reconstruct on an accepted cache", status);
  }
}

// Everything a caller may do with a cache the library handed out.
void exercise(akv_cache *cache, const uint8_t *bytes, size_t size, uint32_t salt) {
  akv_cache_stats stats;
  std::memset(&stats, 0, sizeof stats);
  stats.struct_size = sizeof stats;
  akv_status status = akv_cache_stats_get(cache, &stats);
  FUZZ_REQUIRE(status == AKV_OK, "akv_cache_stats_get on an accepted cache", status);
  FUZZ_REQUIRE(stats.shape.seq_len > 0 && stats.shape.num_kv_heads > 0 && stats.shape.head_dim > 0 &&
                   stats.shape.num_q_heads % stats.shape.num_kv_heads == 0,
               "the stats of an accepted cache show an impossible shape", status);
  std::vector<akv_head_stats> heads(static_cast<size_t>(stats.shape.num_kv_heads));
  status = akv_cache_head_stats(cache, heads.data());
  FUZZ_REQUIRE(status == AKV_OK, "akv_cache_head_stats on an accepted cache", status);

  // What was accepted is what serializes back, byte for byte; an older format version is
  // written back in today's (and must then round-trip, checked below after an append).
  const std::vector<uint8_t> again = serialize(cache);
  uint32_t given_version = 0, written_version = 0;
  std::memcpy(&given_version, bytes + 8, 4);  // accepted, so the header is there
  FUZZ_REQUIRE(again.size() >= 12, "a serialized cache shorter than its header", AKV_OK);
  std::memcpy(&written_version, again.data() + 8, 4);
  if (given_version == written_version)
    FUZZ_REQUIRE(again.size() == size && std::memcmp(again.data(), bytes, size) == 0,
                 "an accepted buffer does not serialize back to the same bytes", AKV_OK);
  else
    FUZZ_REQUIRE(given_version < written_version, "an accepted buffer of a newer format version", AKV_OK);

  decode_all(cache, stats, salt);
  reconstruct(cache, stats);

  // Append one token (positions continue from the cache's last one; past int32 is refused).
  const uint64_t H = static_cast<uint64_t>(stats.shape.num_kv_heads), D = static_cast<uint64_t>(stats.shape.head_dim);
  if (H * D * 2 <= kMaxElements) {
    const std::vector<float> k = values(H * D, salt + 2, 1.0f), v = values(H * D, salt + 3, 1.0f);
    status = akv_append(cache, k.data(), v.data(), AKV_DTYPE_F32, 1, nullptr, nullptr);
    FUZZ_REQUIRE(status == AKV_OK || status == AKV_ERR_INVALID_ARGUMENT, "akv_append on an accepted cache", status);
    if (status == AKV_OK) {
      status = akv_cache_stats_get(cache, &stats);
      FUZZ_REQUIRE(status == AKV_OK && stats.appended_tokens >= 1, "stats after akv_append", status);
      decode_all(cache, stats, salt + 4);
    }
  }
  status = akv_cache_reserve(cache, stats.appended_tokens + 3, nullptr);
  FUZZ_REQUIRE(status == AKV_OK, "akv_cache_reserve on an accepted cache", status);

  // A cache the library holds always round-trips.
  const std::vector<uint8_t> appended = serialize(cache);
  akv_cache *copy = nullptr;
  status = akv_cache_deserialize(context(), appended.data(), appended.size(), &copy, nullptr);
  FUZZ_REQUIRE(status == AKV_OK && copy != nullptr, "the library's own bytes do not deserialize", status);
  FUZZ_REQUIRE(serialize(copy) == appended, "the library's own bytes do not round-trip", AKV_OK);
  akv_cache_destroy(copy);
}

void try_bytes(const uint8_t *bytes, size_t size, uint32_t salt) {
  akv_cache *cache = nullptr;
  const akv_status status = akv_cache_deserialize(context(), bytes, size, &cache, nullptr);
  if (status != AKV_OK) {
    FUZZ_REQUIRE(status == AKV_ERR_CORRUPT_DATA || status == AKV_ERR_VERSION,
                 "akv_cache_deserialize failed with a status other than CORRUPT_DATA or VERSION", status);
    FUZZ_REQUIRE(cache == nullptr, "a failed akv_cache_deserialize handed out a cache", status);
    FUZZ_REQUIRE(akv_last_error_message()[0] != '\0', "a failed akv_cache_deserialize left no message", status);
    return;
  }
  FUZZ_REQUIRE(cache != nullptr, "akv_cache_deserialize returned OK and no cache", status);
  exercise(cache, bytes, size, salt);
  akv_cache_destroy(cache);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static const uint8_t empty = 0;
  if (size == 0) data = &empty;  // the library refuses a NULL buffer before looking at the size
  const uint32_t salt = crc32(data, size < 64 ? size : 64);
  try_bytes(data, size, salt);
  if (size >= 28) {  // header: magic 8, version 4, flags 4, total size 8; CRC-32 last
    std::vector<uint8_t> fixed(data, data + size);
    const uint64_t total = size;
    std::memcpy(fixed.data() + 16, &total, 8);
    const uint32_t crc = crc32(fixed.data(), size - 4);
    std::memcpy(fixed.data() + size - 4, &crc, 4);
    if (std::memcmp(fixed.data(), data, size) != 0) try_bytes(fixed.data(), size, salt);
  }
  return 0;
}
