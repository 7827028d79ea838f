// Sizes in configs: "25MiB", "1.5GiB", "1GB", "4096". Binary (KiB..TiB) and decimal (kB..TB)
// units are both accepted because users copy sizes from both worlds; a bare K/M/G is refused
// because it is ambiguous between the two. Fractions are exact decimal arithmetic, so "1.5GiB"
// is exactly 1610612736 bytes and "0.1KiB" (102.4 bytes) is refused rather than rounded.
#include <array>
#include <cctype>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <string_view>

#include <fmt/core.h>

#include "config/size_parse.hpp"
#include "zest/config.hpp"

namespace zest {
namespace detail {
namespace {

struct SizeUnit {
  std::string_view name;
  std::uint64_t bytes;
};

constexpr std::uint64_t kKi = 1024;
constexpr std::uint64_t kK = 1000;

constexpr std::array<SizeUnit, 10> kUnits{{
    {"B", 1},
    {"KiB", kKi},
    {"MiB", kKi * kKi},
    {"GiB", kKi * kKi * kKi},
    {"TiB", kKi * kKi * kKi * kKi},
    {"kB", kK},
    {"KB", kK},
    {"MB", kK * kK},
    {"GB", kK * kK * kK},
    {"TB", kK * kK * kK * kK},
}};

// 10^18 < 2^64; more fraction digits than this cannot matter for a whole number of bytes unless
// they are trailing zeros, which are stripped first.
constexpr std::size_t kMaxFractionDigits = 18;

// 128-bit arithmetic keeps fraction * unit exact; __extension__ silences -Wpedantic about it.
__extension__ typedef unsigned __int128 u128;

bool iequals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (std::tolower(static_cast<unsigned char>(a[i])) !=
        std::tolower(static_cast<unsigned char>(b[i])))
      return false;
  return true;
}

std::string_view trim(std::string_view text) {
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.front())))
    text.remove_prefix(1);
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back())))
    text.remove_suffix(1);
  return text;
}

std::string unknown_unit(std::string_view unit) {
  std::string why = "unknown unit '";
  why.append(unit).append("'");
  if (unit.size() == 1 && std::string_view("kKmMgGtT").find(unit[0]) != std::string_view::npos) {
    const char letter = static_cast<char>(std::toupper(static_cast<unsigned char>(unit[0])));
    why.append(fmt::format(" (ambiguous: write {}iB for powers of 1024 or {}B for powers of 1000)", letter,
                           letter == 'K' ? 'k' : letter));
  } else {
    for (const SizeUnit& known : kUnits) {
      if (iequals(known.name, unit)) {
        why.append(" (units are case-sensitive: did you mean '").append(known.name).append("'?)");
        break;
      }
    }
  }
  return why.append("; units are ").append(kSizeUnitsHelp);
}

}  // namespace

const char* const kSizeUnitsHelp =
    "B, KiB, MiB, GiB, TiB (powers of 1024) and kB or KB, MB, GB, TB (powers of 1000)";

bool parse_size_into(std::string_view text, std::size_t& bytes, std::string& why) {
  text = trim(text);
  if (text.empty()) {
    why = "it is empty";
    return false;
  }
  if (text.front() == '-') {
    why = "sizes cannot be negative";
    return false;
  }
  if (text.front() == '+') text.remove_prefix(1);

  std::size_t pos = 0;
  std::uint64_t whole = 0;
  std::size_t whole_digits = 0;
  while (pos < text.size() && std::isdigit(static_cast<unsigned char>(text[pos]))) {
    const std::uint64_t digit = static_cast<std::uint64_t>(text[pos] - '0');
    if (__builtin_mul_overflow(whole, std::uint64_t{10}, &whole) ||
        __builtin_add_overflow(whole, digit, &whole)) {
      why = "it is too large (more than 2^64 - 1 bytes)";
      return false;
    }
    ++pos;
    ++whole_digits;
  }
  std::string_view fraction;
  if (pos < text.size() && text[pos] == '.') {
    const std::size_t start = ++pos;
    while (pos < text.size() && std::isdigit(static_cast<unsigned char>(text[pos]))) ++pos;
    fraction = text.substr(start, pos - start);
  }
  if (whole_digits == 0 && fraction.empty()) {
    why = "it does not start with a number";
    return false;
  }
  while (!fraction.empty() && fraction.back() == '0') fraction.remove_suffix(1);

  const std::string_view unit = trim(text.substr(pos));
  std::uint64_t multiplier = 0;
  if (unit.empty()) {
    multiplier = 1;
  } else {
    for (const SizeUnit& known : kUnits)
      if (known.name == unit) multiplier = known.bytes;
  }
  if (multiplier == 0) {
    why = unknown_unit(unit);
    return false;
  }

  std::uint64_t total = 0;
  if (__builtin_mul_overflow(whole, multiplier, &total)) {
    why = "it is too large (more than 2^64 - 1 bytes)";
    return false;
  }
  if (!fraction.empty()) {
    if (fraction.size() > kMaxFractionDigits) {
      why = "it is not a whole number of bytes";
      return false;
    }
    u128 numerator = 0;
    u128 denominator = 1;
    for (char c : fraction) {
      numerator = numerator * 10 + static_cast<unsigned>(c - '0');
      denominator *= 10;
    }
    const u128 scaled = numerator * multiplier;
    if (scaled % denominator != 0) {
      why = "it is not a whole number of bytes";
      return false;
    }
    if (__builtin_add_overflow(total, static_cast<std::uint64_t>(scaled / denominator), &total)) {
      why = "it is too large (more than 2^64 - 1 bytes)";
      return false;
    }
  }
  if (total > std::numeric_limits<std::size_t>::max()) {
    why = "it is too large for this machine's size_t";
    return false;
  }
  bytes = static_cast<std::size_t>(total);
  return true;
}

}  // namespace detail

std::size_t parse_size(const std::string& text) {
  std::size_t bytes = 0;
  std::string why;
  if (!detail::parse_size_into(text, bytes, why)) {
    std::string message = fmt::format(
        "'{}' is not a size: {}. A size is a number of bytes with an optional unit, e.g. 4096, 512KiB, 25MiB, "
        "1.5GiB, 1GB",
        text, why);
    throw std::invalid_argument(message);
  }
  return bytes;
}

std::string format_size(std::size_t bytes) {
  static constexpr std::array<std::string_view, 4> kBinary{"TiB", "GiB", "MiB", "KiB"};
  if (bytes != 0) {
    for (std::size_t i = 0; i < kBinary.size(); ++i) {
      const std::size_t unit = std::size_t{1} << (10 * (kBinary.size() - i));
      if (bytes % unit == 0) {
        std::string text = std::to_string(bytes / unit);
        return text.append(kBinary[i]);
      }
    }
  }
  return std::to_string(bytes).append("B");
}

}  // namespace zest
