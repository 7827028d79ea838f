#include "zest/error.hpp"

#include <cstring>
#include <string>
#include <utility>

#include <fmt/core.h>

namespace zest {
namespace {

std::string join_problems(const std::vector<ConfigProblem>& problems) {
  std::string text;
  for (const ConfigProblem& problem : problems) {
    if (!text.empty()) text += '\n';
    text += problem.to_string();
  }
  return text;
}

}  // namespace

std::string ConfigProblem::to_string() const {
  // Appends one piece at a time: GCC 12 at -O3 reports a false -Wrestrict on chained operator+.
  std::string text = file;
  if (line > 0) {
    text += fmt::format(":{}:{}", line, column);
  }
  // A Config built in code has no file: its problems start at the key.
  if (!text.empty()) text.append(": ");
  if (!key.empty()) text.append(key).append(": ");
  return text.append(message);
}

ConfigError::ConfigError(std::vector<ConfigProblem> problems)
    : Error(join_problems(problems)), problems_(std::move(problems)) {}

OutOfDeviceMemory::OutOfDeviceMemory(const std::string& message, std::size_t requested,
                                     std::size_t budget)
    : Error(message), requested_(requested), budget_(budget) {}

IoError::IoError(const std::string& what_failed, std::string path, std::size_t offset,
                 std::size_t length, int error_number)
    : Error(fmt::format("{}: {} at offset {}, length {}: {} (errno {})", what_failed, path, offset, length,
                        std::strerror(error_number), error_number)),
      path_(std::move(path)),
      offset_(offset),
      length_(length),
      errno_(error_number) {}

}  // namespace zest
