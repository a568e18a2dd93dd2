// The serialization checksum: the slicing-by-8 CRC-32 equals the bitwise definition (IEEE,
// reflected, as zlib) for every length and alignment, and chains across calls.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "core/serialize.hpp"

namespace {

uint32_t bitwise_crc32(const uint8_t *data, size_t size, uint32_t crc = 0) {
  crc = ~crc;
  for (size_t i = 0; i < size; ++i) {
    crc ^= data[i];
    for (int k = 0; k < 8; ++k) crc = (crc & 1u) ? 0xedb88320u ^ (crc >> 1) : crc >> 1;
  }
  return ~crc;
}

TEST(Crc32, KnownValue) {
  const char *check = "123456789";
  EXPECT_EQ(akv::crc32(reinterpret_cast<const uint8_t *>(check), std::strlen(check)), 0xCBF43926u);
  EXPECT_EQ(akv::crc32(nullptr, 0), 0u);
}

TEST(Crc32, EqualsTheBitwiseDefinitionAtEveryLengthAndAlignment) {
  std::mt19937 rng(7);
  std::vector<uint8_t> bytes(4096 + 16);
  for (uint8_t &b : bytes) b = static_cast<uint8_t>(rng());
  for (size_t offset = 0; offset < 8; ++offset)
    for (size_t size : {0, 1, 7, 8, 9, 15, 16, 17, 63, 64, 65, 1000, 4096}) {
      const uint8_t *p = bytes.data() + offset;
      ASSERT_EQ(akv::crc32(p, size), bitwise_crc32(p, size)) << "offset " << offset << " size " << size;
      // Chained: the CRC of a prefix continued over the rest.
      const size_t cut = size / 3;
      ASSERT_EQ(akv::crc32(p + cut, size - cut, akv::crc32(p, cut)), bitwise_crc32(p, size));
    }
}

}  // namespace
