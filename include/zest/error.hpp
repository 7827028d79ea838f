// Every failure zest reports is an exception derived from zest::Error. Each says what failed,
// with what, and what to do about it. Library code never exits or aborts.
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>
#include <vector>

namespace zest {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// One problem found in a config file; a ConfigError carries all of them, so a user fixes a file
// in one pass instead of one error per run.
struct ConfigProblem {
  std::string file;
  int line = 0;      // 1-based; 0 when the problem is about the file as a whole
  int column = 0;    // 1-based
  std::string key;   // dotted key path, e.g. "offload.optimizer.device"
  std::string message;

  // "file:line:col: key: message"
  std::string to_string() const;
};

class ConfigError : public Error {
 public:
  explicit ConfigError(std::vector<ConfigProblem> problems);
  const std::vector<ConfigProblem>& problems() const { return problems_; }

 private:
  std::vector<ConfigProblem> problems_;
};

// Raised when an allocation would take a device past its memory budget (CPU backend) or past what
// the GPU has (CUDA backend). The message names the budget, the request and the largest categories.
class OutOfDeviceMemory : public Error {
 public:
  OutOfDeviceMemory(const std::string& message, std::size_t requested, std::size_t budget);
  std::size_t requested() const { return requested_; }
  std::size_t budget() const { return budget_; }

 private:
  std::size_t requested_;
  std::size_t budget_;
};

class IoError : public Error {
 public:
  IoError(const std::string& what_failed, std::string path, std::size_t offset, std::size_t length,
          int error_number);
  const std::string& path() const { return path_; }
  std::size_t offset() const { return offset_; }
  std::size_t length() const { return length_; }
  int error_number() const { return errno_; }

 private:
  std::string path_;
  std::size_t offset_;
  std::size_t length_;
  int errno_;
};

class CommError : public Error {
 public:
  using Error::Error;
};

// A CUDA, NCCL or OS call failed in a way that none of the above describes.
class SystemError : public Error {
 public:
  using Error::Error;
};

}  // namespace zest
