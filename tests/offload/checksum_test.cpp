#include "offload/checksum.hpp"

#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "scratch_dir.hpp"

namespace zest::offload {
namespace {

TEST(Crc32c, MatchesTheStandardCheckValue) {
  // The CRC-32C check value from RFC 3720 / the Castagnoli catalogue.
  const char* text = "123456789";
  EXPECT_EQ(crc32c(text, 9), 0xE3069283u);
  EXPECT_EQ(detail::crc32c_table(text, 9, 0), 0xE3069283u);
  // 32 bytes of zeros: RFC 3720 B.4.
  const std::vector<unsigned char> zeros(32, 0);
  EXPECT_EQ(crc32c(zeros.data(), zeros.size()), 0x8A9136AAu);
}

TEST(Crc32c, HardwareAndTableAgreeOnOddLengthsAndOffsets) {
  if (!detail::crc32c_hardware_available()) GTEST_SKIP() << "this CPU has no crc32 instruction";
  test::PatternBuffer data(10000, 7);
  for (std::size_t start : {0u, 1u, 3u, 7u}) {
    for (std::size_t length : {0u, 1u, 7u, 8u, 9u, 63u, 4096u, 9990u}) {
      EXPECT_EQ(detail::crc32c_hardware(data.data() + start, length, 0),
                detail::crc32c_table(data.data() + start, length, 0))
          << "start " << start << " length " << length;
    }
  }
}

TEST(Crc32c, DetectsASingleFlippedBit) {
  test::PatternBuffer data(4096, 1);
  const std::uint32_t before = crc32c(data.data(), data.bytes());
  data.data()[1234] ^= 0x10;
  EXPECT_NE(crc32c(data.data(), data.bytes()), before);
}

}  // namespace
}  // namespace zest::offload
