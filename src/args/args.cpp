#include "args/args.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

#include <fmt/core.h>

#include "config/config_checks.hpp"
#include "config/config_names.hpp"
#include "config/size_parse.hpp"
#include "zest/config.hpp"

namespace zest::args {
namespace {

// "--flag: expected <what>, found '<text>'[: <why>]"
[[noreturn]] void refuse(std::string_view flag, std::string_view what, std::string_view text,
                         std::string_view why = {}) {
  std::string message = fmt::format("{}: expected {}, found '{}'", flag, what, text);
  if (!why.empty()) message.append(": ").append(why);
  throw UsageError(message);
}

// "from 1 to 1000000" / ">= 1" when hi is "no limit" for the type.
template <typename T>
std::string range_text(T lo, T hi, std::string (*text)(T)) {
  return fmt::format("from {} to {}", text(lo), text(hi));
}

std::string integer_text(long long value) { return std::to_string(value); }
std::string count_text(std::size_t value) { return std::to_string(value); }
std::string size_text(std::size_t value) { return format_size(value); }

// The whole of `text` as a finite double in plain decimal notation (from_chars: no hex, no
// leading spaces or '+'), or false.
bool finite_decimal(std::string_view text, double& value) {
  const auto result = std::from_chars(text.data(), text.data() + text.size(), value);
  return result.ec == std::errc() && result.ptr == text.data() + text.size() && std::isfinite(value);
}

std::string directory_of(const std::string& path) {
  const std::size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

void check_writable_directory(std::string_view flag, const std::string& directory,
                              const std::string& what) {
  struct stat info {};
  std::string message = fmt::format("{}: {} '{}'", flag, what, directory);
  if (::stat(directory.c_str(), &info) != 0) {
    const int error = errno;
    if (error == ENOENT) throw UsageError(message.append(" does not exist; create it first"));
    throw UsageError(message.append(" cannot be inspected: ").append(std::strerror(error)));
  }
  if (!S_ISDIR(info.st_mode)) throw UsageError(message.append(" is not a directory"));
  if (::access(directory.c_str(), W_OK | X_OK) != 0)
    throw UsageError(
        fmt::format("{} is not writable ({}); choose a directory this user can write", message, std::strerror(errno)));
}

}  // namespace

long long parse_integer(std::string_view flag, std::string_view text, long long lo, long long hi) {
  const std::string what = "a whole number " + range_text(lo, hi, integer_text);
  long long value = 0;
  const auto result = std::from_chars(text.data(), text.data() + text.size(), value);
  if (result.ec == std::errc::result_out_of_range) refuse(flag, what, text, "out of range");
  if (result.ec != std::errc() || result.ptr != text.data() + text.size()) refuse(flag, what, text);
  if (value < lo || value > hi) refuse(flag, what, text);
  return value;
}

double parse_number(std::string_view flag, std::string_view text, double lo, double hi) {
  const std::string what = fmt::format("a number from {} to {}", detail::number_text(lo), detail::number_text(hi));
  double value = 0;
  if (!finite_decimal(text, value) || value < lo || value > hi) refuse(flag, what, text);
  return value;
}

std::size_t parse_count(std::string_view flag, std::string_view text, std::size_t lo, std::size_t hi) {
  const std::string what =
      "a whole count " + range_text(lo, hi, count_text) + " (e.g. 4000000, 350M, 7B, 1.5e9)";
  std::string_view digits = text;
  double scale = 1;
  if (!digits.empty()) {
    switch (digits.back()) {
      case 'K': case 'k': scale = 1e3; break;
      case 'M': case 'm': scale = 1e6; break;
      case 'B': case 'b': case 'G': case 'g': scale = 1e9; break;
      case 'T': case 't': scale = 1e12; break;
      default: break;
    }
    if (scale != 1) digits.remove_suffix(1);
  }
  double number = 0;
  if (!finite_decimal(digits, number)) refuse(flag, what, text);
  const double value = number * scale;
  // Compared as doubles first: a value past 2^64 cannot be converted.
  if (value < static_cast<double>(lo) || value > static_cast<double>(hi)) refuse(flag, what, text);
  if (value != std::floor(value)) refuse(flag, what, text, "not a whole number");
  const auto count = static_cast<std::size_t>(value);
  if (count < lo || count > hi) refuse(flag, what, text);
  return count;
}

std::size_t parse_size(std::string_view flag, std::string_view text, std::size_t lo, std::size_t hi) {
  const std::string what = "a size " + range_text(lo, hi, size_text) + " (e.g. 4096, 512KiB, 1.5GiB)";
  std::size_t bytes = 0;
  std::string why;
  if (!detail::parse_size_into(text, bytes, why)) refuse(flag, what, text, why);
  if (bytes < lo || bytes > hi) refuse(flag, what, text);
  return bytes;
}

void check_distinct_outputs(std::initializer_list<std::pair<std::string_view, std::string>> outputs) {
  std::vector<std::pair<std::string_view, std::filesystem::path>> seen;
  for (const auto& [flag, path] : outputs) {
    if (path.empty()) continue;
    std::error_code ignored;  // a path that cannot be resolved is compared as written
    std::filesystem::path resolved = std::filesystem::weakly_canonical(path, ignored);
    if (resolved.empty()) resolved = path;
    resolved = resolved.lexically_normal();
    // "out/" is "out".
    if (!resolved.has_filename() && resolved.has_parent_path()) resolved = resolved.parent_path();
    for (const auto& [other_flag, other] : seen)
      if (other == resolved)
        throw UsageError(fmt::format("{} and {} name the same path '{}'; each output needs a path of its own",
                                     other_flag, flag, path));
    seen.emplace_back(flag, std::move(resolved));
  }
}

void check_output_file(std::string_view flag, const std::string& path) {
  std::string message = fmt::format("{}: '{}'", flag, path);
  if (path.empty()) throw UsageError(std::string(flag).append(": expected a file path, found ''"));
  struct stat info {};
  if (::stat(path.c_str(), &info) == 0) {
    if (S_ISDIR(info.st_mode))
      throw UsageError(message.append(" is a directory; give a file path"));
    if (!S_ISREG(info.st_mode))
      throw UsageError(message.append(" is not a regular file (a FIFO, device or socket); give a "
                                      "regular file path"));
    if (::access(path.c_str(), W_OK) != 0)
      throw UsageError(fmt::format("{} is not writable ({})", message, std::strerror(errno)));
    return;
  }
  if (errno != ENOENT)
    throw UsageError(message.append(" cannot be inspected: ").append(std::strerror(errno)));
  check_writable_directory(flag, directory_of(path), "the directory");
}

void check_output_directory(std::string_view flag, const std::string& path) {
  if (path.empty()) throw UsageError(std::string(flag).append(": expected a directory, found ''"));
  check_writable_directory(flag, path, "directory");
}

std::string_view value_of(int argc, char** argv, int& i) {
  if (i + 1 >= argc) throw UsageError(std::string(argv[i]).append(" needs a value"));
  return argv[++i];
}

std::string_view path_of(int argc, char** argv, int& i) {
  const std::string flag = argv[i];
  const std::string_view value = value_of(argc, argv, i);
  if (value.empty())
    throw UsageError(fmt::format("{0}: the path is empty (an unset variable?); give a path, or leave {0} out", flag));
  return value;
}

bool asks_for_help(int argc, char** argv) {
  for (int i = 0; i < argc; ++i)
    if (std::strcmp(argv[i], "--help") == 0 || std::strcmp(argv[i], "-h") == 0) return true;
  return false;
}

int print_usage(const char* usage) {
  std::fputs(usage, stdout);
  return 0;
}

StatesFormat parse_states_format(std::string_view flag, std::string_view text) {
  for (const auto& entry : detail::kStatesFormatNames)
    if (entry.name == text) return entry.value;
  throw UsageError(
      fmt::format("{}: expected {}, found '{}'", flag, detail::expected_choice(detail::kStatesFormatNames), text));
}

}  // namespace zest::args
