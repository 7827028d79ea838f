// Files as zest opens them in directories other users and jobs share: an owning descriptor, and the
// whole of a regular file read without blocking or without bound. A FIFO would block an open()
// until a writer came, a device would never end (or act on being opened), and a file may grow
// while it is read; each is refused, not waited on or read.
//
// The readers report what stopped them as a value: each caller words the error for its own user
// (a config error with the file's position, a checkpoint's IoError with the remedy).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <utility>

namespace zest {

// An owned file descriptor, closed when it goes. Where a write's outcome depends on the close, call
// close() and look at its result.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) noexcept : fd_(fd) {}
  ~UniqueFd() { reset(); }
  UniqueFd(UniqueFd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    if (this != &other) {
      reset();
      fd_ = std::exchange(other.fd_, -1);
    }
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;

  int get() const noexcept { return fd_; }
  explicit operator bool() const noexcept { return fd_ >= 0; }
  // Closes now: 0, or the errno of a failed close (the descriptor is gone either way).
  int close() noexcept;
  void reset() noexcept { static_cast<void>(close()); }

 private:
  int fd_ = -1;
};

// What stopped an open or a read of a regular file.
struct FileProblem {
  enum class Kind {
    none,
    system,       // a call failed: `error` is its errno (a read's: `size` bytes in)
    not_regular,  // `file_kind` says what it is instead
    too_large,    // the file has `size` bytes, over the bound
    grew,         // it grew past the bound while it was read
  };
  Kind kind = Kind::none;
  int error = 0;
  const char* file_kind = "";
  std::uint64_t size = 0;
  explicit operator bool() const noexcept { return kind != Kind::none; }
};

// "a directory", "a FIFO", "a symbolic link", "a character device", "a block device", "a socket";
// "a regular file" for one.
const char* file_kind(mode_t mode);

// Opens `name` (relative to the directory descriptor `at`, or AT_FDCWD) for reading, only if it is
// a regular file: looked at before it is opened, opened non-blocking, looked at again. `follow`:
// whether a symbolic link at `name` is followed (a path a user gave) or refused (a name in a
// directory zest holds open). On failure returns an empty UniqueFd and sets `problem`.
UniqueFd open_regular(int at, const std::string& name, bool follow, FileProblem& problem);

// The whole of the regular file open at `fd`, at most `max_bytes` (its size checked first, and
// again as it is read). On failure sets `problem` (what was read is dropped).
std::string read_whole(int fd, std::uint64_t max_bytes, FileProblem& problem);

}  // namespace zest
