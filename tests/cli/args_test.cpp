// The one parser of command-line values: each kind refuses negative, NaN, infinite, out-of-range
// values and trailing garbage with a message naming the flag, the range and the text; output paths
// are refused when they cannot be written, before any work.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <functional>
#include <string>

#include "args/args.hpp"

namespace zest::args {
namespace {

// The UsageError's text, or a note that nothing was thrown.
std::string refusal(const std::function<void()>& parse) {
  try {
    parse();
  } catch (const UsageError& error) {
    return error.what();
  }
  return "accepted";
}

TEST(ParseCount, AcceptsPlainSuffixedAndExponentCounts) {
  EXPECT_EQ(parse_count("--params", "4000000", 1, 1'000'000'000'000), 4'000'000u);
  EXPECT_EQ(parse_count("--params", "350M", 1, 1'000'000'000'000), 350'000'000u);
  EXPECT_EQ(parse_count("--params", "7B", 1, 1'000'000'000'000), 7'000'000'000u);
  EXPECT_EQ(parse_count("--params", "1.5e9", 1, 1'000'000'000'000), 1'500'000'000u);
  EXPECT_EQ(parse_count("--params", "2k", 1, 1'000'000'000'000), 2000u);
}

TEST(ParseCount, RefusesWhatOnceSpunOrPrintedOnlyStod) {
  const std::string range = "--params: expected a whole count from 1000 to 1000000000 (e.g. 4000000, 350M, 7B, 1.5e9)";
  for (const char* text : {"-5", "1e19", "nan", "inf", "-inf", "abc", "", "5x", "0x10", " 5", "1e3.5", "999"})
    EXPECT_EQ(refusal([&] { parse_count("--params", text, 1000, 1'000'000'000); }),
              range + ", found '" + text + "'")
        << text;
  EXPECT_EQ(refusal([&] { parse_count("--params", "1500.5", 1000, 1'000'000'000); }),
            range + ", found '1500.5': not a whole number");
}

TEST(ParseInteger, RangeSignAndGarbage) {
  EXPECT_EQ(parse_integer("--steps", "3", 0, 10), 3);
  EXPECT_EQ(parse_integer("--offset", "-3", -5, 5), -3);
  const std::string steps = "--steps: expected a whole number from 0 to 1000000000, found ";
  EXPECT_EQ(refusal([] { parse_integer("--steps", "-1", 0, 1'000'000'000); }), steps + "'-1'");
  EXPECT_EQ(refusal([] { parse_integer("--steps", "2.5", 0, 1'000'000'000); }), steps + "'2.5'");
  EXPECT_EQ(refusal([] { parse_integer("--steps", "+3", 0, 1'000'000'000); }), steps + "'+3'");
  EXPECT_EQ(refusal([] { parse_integer("--steps", "99999999999999999999", 0, 1'000'000'000); }),
            steps + "'99999999999999999999': out of range");
}

TEST(ParseNumber, FiniteAndInRange) {
  EXPECT_EQ(parse_number("--size", "0.5", 0.001, 16384), 0.5);
  EXPECT_EQ(parse_number("--size", "1e2", 0.001, 16384), 100.0);
  for (const char* text : {"1e30", "0", "-1", "nan", "inf", "4GiB", ""})
    EXPECT_EQ(refusal([&] { parse_number("--size", text, 0.001, 16384); }),
              std::string("--size: expected a number from 0.001 to 16384, found '") + text + "'")
        << text;
}

TEST(ParseSize, UnitsRangeAndTheSizeParsersReason) {
  EXPECT_EQ(parse_size("--device-memory", "64MiB", 16 << 20, std::size_t{1} << 40), std::size_t{64} << 20);
  const std::string range = "--device-memory: expected a size from 16MiB to 1TiB (e.g. 4096, 512KiB, 1.5GiB)";
  EXPECT_EQ(refusal([&] { parse_size("--device-memory", "1KiB", 16 << 20, std::size_t{1} << 40); }),
            range + ", found '1KiB'");
  EXPECT_EQ(refusal([&] { parse_size("--device-memory", "-1GiB", 16 << 20, std::size_t{1} << 40); }),
            range + ", found '-1GiB': sizes cannot be negative");
  EXPECT_NE(refusal([&] { parse_size("--device-memory", "2GB extra", 16 << 20, std::size_t{1} << 40); })
                .find("unknown unit 'GB extra'"),
            std::string::npos);
}

TEST(ValueOf, AFlagWithoutItsValue) {
  char flag[] = "--steps";
  char* argv[] = {flag};
  int i = 0;
  EXPECT_EQ(refusal([&] { value_of(1, argv, i); }), "--steps needs a value");
}

// `--save ''` (an unset variable) named the flag nowhere on main: zest-train saved nothing, exit 0.
TEST(PathOf, AnEmptyPathIsRefusedByItsFlag) {
  char flag[] = "--save", empty[] = "", dir[] = "ckpt";
  char* argv[] = {flag, empty, flag, dir};
  int i = 0;
  EXPECT_EQ(refusal([&] { path_of(2, argv, i); }),
            "--save: the path is empty (an unset variable?); give a path, or leave --save out");
  i = 2;
  EXPECT_EQ(path_of(4, argv, i), "ckpt");
  EXPECT_EQ(i, 3);
  i = 0;
  EXPECT_EQ(refusal([&] { path_of(1, argv, i); }), "--save needs a value");
}

class Scratch : public testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/zest-args-test-XXXXXX";
    ASSERT_NE(::mkdtemp(pattern), nullptr);
    dir_ = pattern;
  }
  void TearDown() override {
    ::chmod(dir_.c_str(), 0700);
    ASSERT_EQ(std::system(("rm -rf '" + dir_ + "'").c_str()), 0);
  }
  std::string dir_;
};

TEST_F(Scratch, OutputFileIsCheckedBeforeWork) {
  EXPECT_NO_THROW(check_output_file("--json", dir_ + "/new.json"));
  EXPECT_EQ(refusal([] { check_output_file("--json", "/nonexistent/x"); }),
            "--json: the directory '/nonexistent' does not exist; create it first");
  EXPECT_EQ(refusal([&] { check_output_file("--chart", dir_); }),
            "--chart: '" + dir_ + "' is a directory; give a file path");
  EXPECT_EQ(refusal([] { check_output_file("--csv", "/dev/null"); }),
            "--csv: '/dev/null' is not a regular file (a FIFO, device or socket); give a regular file path");
  const std::string fifo = dir_ + "/fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_NE(refusal([&] { check_output_file("--json", fifo); }).find("is not a regular file"), std::string::npos);
  if (::geteuid() != 0) {  // root writes anywhere
    ::chmod(dir_.c_str(), 0500);
    EXPECT_NE(refusal([&] { check_output_file("--json", dir_ + "/x.json"); }).find("is not writable"),
              std::string::npos);
  }
}

TEST_F(Scratch, OutputDirectories) {
  EXPECT_NO_THROW(check_output_directory("--path", dir_));
  EXPECT_EQ(refusal([&] { check_output_directory("--path", dir_ + "/missing"); }),
            "--path: directory '" + dir_ + "/missing' does not exist; create it first");
}

}  // namespace
}  // namespace zest::args
