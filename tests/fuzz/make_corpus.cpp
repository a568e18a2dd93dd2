// Writes the fuzz seed corpus: one serialized small cache per method and storage variant
// (tests/common/small_caches.hpp), named after it, into the first directory; with a second
// directory, also the reproductions of issue 12's deserializer defects there (valid CRC,
// one field damaged), which the regressions directory keeps.
//
//   anchorkv_make_fuzz_corpus tests/fuzz/corpus [tests/fuzz/regressions]
//
// Regenerate (and commit) the corpus when the serialized format or the caches compression
// produces change: ctest fuzz_corpus fails while a seed is no longer accepted as it is.
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <string>

#include "common/small_caches.hpp"
#include "core/context.hpp"
#include "core/serialize.hpp"

namespace {

bool write_file(const std::string &path, const std::vector<uint8_t> &bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char *>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  if (!out) std::fprintf(stderr, "cannot write %s\n", path.c_str());
  return static_cast<bool>(out);
}

// `bytes` with one field set to `value` and the CRC recomputed.
template <typename T>
std::vector<uint8_t> damaged(const akv_cache &cache, std::vector<uint8_t> bytes, const char *field, T value) {
  for (const akv::SerializedField &f : akv::serialized_fields(cache))
    if (f.name == field) {
      std::memcpy(bytes.data() + f.offset, &value, sizeof value);
      const uint32_t crc = akv::crc32(bytes.data(), bytes.size() - 4);
      std::memcpy(bytes.data() + bytes.size() - 4, &crc, 4);
      return bytes;
    }
  throw std::runtime_error(std::string("no field ") + field);
}

}  // namespace

int main(int argc, char **argv) {
  if (argc != 2 && argc != 3) {
    std::fprintf(stderr, "usage: anchorkv_make_fuzz_corpus CORPUS_DIR [REGRESSIONS_DIR]\n");
    return 2;
  }
  akv_context_options options;
  akv_context_options_init(&options);
  options.num_threads = 1;
  akv_context *context = nullptr;
  if (akv_context_create(&options, &context) != AKV_OK) return 1;
  size_t total = 0, count = 0;
  try {
    for (const akv_test::SmallCache &small : akv_test::small_caches(context, 20240612)) {
      const std::vector<uint8_t> bytes = akv_test::serialized_bytes(small.cache.get());
      if (!write_file(std::string(argv[1]) + "/" + small.name + ".bin", bytes)) return 1;
      total += bytes.size();
      ++count;
      if (argc == 3 && small.name == "anchorkv_bf16_neox_appended") {
        const std::string dir = argv[2];
        // Defect 1: the appended-token count set to 2^28 grew the RSS to 1 GB.
        if (!write_file(dir + "/issue12-suffix-count-2pow28.bin",
                        damaged<int64_t>(*small.cache, bytes, "suffix length", int64_t{1} << 28)) ||
            // Defect 2: a window start position of INT64_MAX was accepted; decode overflowed.
            !write_file(dir + "/issue12-window-position-int64max.bin",
                        damaged<int64_t>(*small.cache, bytes, "window_first_position",
                                         std::numeric_limits<int64_t>::max())))
          return 1;
      }
    }
  } catch (const std::exception &e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  akv_context_destroy(context);
  std::printf("wrote %zu caches, %zu bytes, into %s\n", count, total, argv[1]);
  return 0;
}
