// parse_size and format_size: exact byte counts (computed here by hand, not by the code under
// test), every refusal with a message that says why, and format -> parse round trips.
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "zest/config.hpp"

namespace zest {
namespace {

// The message parse_size throws for `text`, or a failure if it accepts it.
std::string refusal(const std::string& text) {
  try {
    const std::size_t bytes = parse_size(text);
    ADD_FAILURE() << "parse_size('" << text << "') accepted it as " << bytes << " bytes";
  } catch (const std::invalid_argument& error) {
    return error.what();
  }
  return {};
}

TEST(ParseSize, BinaryUnitsArePowersOf1024) {
  EXPECT_EQ(parse_size("1B"), 1u);
  EXPECT_EQ(parse_size("512KiB"), 524288u);
  EXPECT_EQ(parse_size("25MiB"), 26214400u);
  EXPECT_EQ(parse_size("2GiB"), 2147483648u);
  EXPECT_EQ(parse_size("3TiB"), 3298534883328u);
}

TEST(ParseSize, DecimalUnitsArePowersOf1000) {
  EXPECT_EQ(parse_size("1KB"), 1000u);
  EXPECT_EQ(parse_size("1kB"), 1000u);
  EXPECT_EQ(parse_size("1MB"), 1000000u);
  EXPECT_EQ(parse_size("1GB"), 1000000000u);
  EXPECT_EQ(parse_size("2TB"), 2000000000000u);
}

TEST(ParseSize, BareNumbersAreBytes) {
  EXPECT_EQ(parse_size("4096"), 4096u);
  EXPECT_EQ(parse_size("0"), 0u);
  EXPECT_EQ(parse_size("+8"), 8u);
  EXPECT_EQ(parse_size("18446744073709551615"), std::numeric_limits<std::size_t>::max());
}

TEST(ParseSize, FractionsThatComeToWholeBytes) {
  EXPECT_EQ(parse_size("1.5GiB"), 1610612736u);
  EXPECT_EQ(parse_size("0.5KiB"), 512u);
  EXPECT_EQ(parse_size("1.25MB"), 1250000u);
  EXPECT_EQ(parse_size("2.0B"), 2u);
  EXPECT_EQ(parse_size(".5MiB"), 524288u);
  // Trailing zeros beyond what a uint64 could scale must not matter.
  EXPECT_EQ(parse_size("1.50000000000000000000000000GiB"), 1610612736u);
}

TEST(ParseSize, SpacesAroundAndBeforeTheUnit) {
  EXPECT_EQ(parse_size(" 25 MiB "), 26214400u);
}

TEST(ParseSize, RefusesNegatives) {
  EXPECT_NE(refusal("-1").find("cannot be negative"), std::string::npos);
  EXPECT_NE(refusal("-25MiB").find("cannot be negative"), std::string::npos);
}

TEST(ParseSize, RefusesFractionsOfAByte) {
  EXPECT_NE(refusal("0.1KiB").find("not a whole number of bytes"), std::string::npos);
  EXPECT_NE(refusal("1.5").find("not a whole number of bytes"), std::string::npos);
  EXPECT_NE(refusal("1.0000000000000000001GiB").find("not a whole number of bytes"),
            std::string::npos);
}

TEST(ParseSize, RefusesOverflow) {
  EXPECT_NE(refusal("18446744073709551616").find("too large"), std::string::npos);
  EXPECT_NE(refusal("16777216TiB").find("too large"), std::string::npos);  // 2^64 exactly
  // 2^64 reached only by adding the fraction: 18446744073709551616 bytes.
  EXPECT_NE(refusal("18446744.073709551616TB").find("too large"), std::string::npos);
  EXPECT_EQ(parse_size("18446744.073709551615TB"), std::numeric_limits<std::size_t>::max());
  EXPECT_EQ(parse_size("16777215TiB"), std::uint64_t{16777215} << 40);
}

TEST(ParseSize, UnknownUnitsNameTheUnitsThatExist) {
  const std::string message = refusal("25XB");
  EXPECT_NE(message.find("'25XB' is not a size"), std::string::npos) << message;
  EXPECT_NE(message.find("unknown unit 'XB'"), std::string::npos) << message;
  for (const char* unit : {"B,", "KiB", "MiB", "GiB", "TiB", "kB", "KB", "MB", "GB", "TB"})
    EXPECT_NE(message.find(unit), std::string::npos) << unit << " missing from: " << message;
  EXPECT_NE(message.find("e.g."), std::string::npos) << message;
}

TEST(ParseSize, WrongCaseSuggestsTheUnit) {
  EXPECT_NE(refusal("25mib").find("did you mean 'MiB'"), std::string::npos);
  EXPECT_NE(refusal("1gb").find("did you mean 'GB'"), std::string::npos);
}

TEST(ParseSize, SingleLetterUnitsAreAmbiguous) {
  const std::string message = refusal("64K");
  EXPECT_NE(message.find("ambiguous"), std::string::npos) << message;
  EXPECT_NE(message.find("KiB"), std::string::npos) << message;
  EXPECT_NE(refusal("2G").find("write GiB for powers of 1024 or GB"), std::string::npos);
}

TEST(ParseSize, RefusesWhatIsNotANumber) {
  EXPECT_NE(refusal("").find("empty"), std::string::npos);
  EXPECT_NE(refusal("MiB").find("does not start with a number"), std::string::npos);
  EXPECT_NE(refusal("lots").find("does not start with a number"), std::string::npos);
  EXPECT_NE(refusal("1e6").find("unknown unit 'e6'"), std::string::npos);
  EXPECT_NE(refusal("0x100").find("unknown unit 'x100'"), std::string::npos);
  EXPECT_NE(refusal("1.2.3MiB").find("unknown unit '.3MiB'"), std::string::npos);
}

TEST(FormatSize, ExactBinaryUnits) {
  EXPECT_EQ(format_size(26214400), "25MiB");
  EXPECT_EQ(format_size(std::size_t{2} << 30), "2GiB");
  EXPECT_EQ(format_size(std::size_t{3} << 40), "3TiB");
  EXPECT_EQ(format_size(std::size_t{1} << 50), "1024TiB");
  EXPECT_EQ(format_size(65536), "64KiB");
  EXPECT_EQ(format_size(std::size_t{3} << 29), "1536MiB");  // 1.5GiB is not a whole GiB
}

TEST(FormatSize, BytesWhereNoBinaryUnitDivides) {
  EXPECT_EQ(format_size(0), "0B");
  EXPECT_EQ(format_size(1), "1B");
  EXPECT_EQ(format_size(1000), "1000B");
  EXPECT_EQ(format_size(4097), "4097B");
  EXPECT_EQ(format_size(1536), "1536B");  // 1.5KiB: not a whole KiB
  EXPECT_EQ(format_size(1000000000), "1000000000B");
}

TEST(FormatSize, ParsesBackToTheSameBytes) {
  std::vector<std::size_t> values = {0, 1, 1023, 1024, 1025, 4096, 1000000, 26214400,
                                     std::numeric_limits<std::size_t>::max()};
  for (int shift = 0; shift < 64; ++shift) {
    values.push_back(std::size_t{1} << shift);
    values.push_back((std::size_t{1} << shift) * 3 / 2);
  }
  for (const std::size_t bytes : values)
    EXPECT_EQ(parse_size(format_size(bytes)), bytes) << format_size(bytes);
}

}  // namespace
}  // namespace zest
