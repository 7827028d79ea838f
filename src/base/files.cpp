#include "base/files.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

namespace zest {

int UniqueFd::close() noexcept {
  if (fd_ < 0) return 0;
  // Linux releases the descriptor even when close fails (EINTR included): never retried.
  const int rc = ::close(std::exchange(fd_, -1));
  return rc == 0 ? 0 : errno;
}

const char* file_kind(mode_t mode) {
  if (S_ISREG(mode)) return "a regular file";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISLNK(mode)) return "a symbolic link";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "a special file";
}

namespace {

bool refused(const struct stat& info, FileProblem& problem) {
  if (S_ISREG(info.st_mode)) return false;
  problem = {FileProblem::Kind::not_regular, 0, file_kind(info.st_mode), 0};
  return true;
}

FileProblem system_problem(int error) { return {FileProblem::Kind::system, error, "", 0}; }

}  // namespace

UniqueFd open_regular(int at, const std::string& name, bool follow, FileProblem& problem) {
  problem = {};
  // Looked at before it is opened: opening a FIFO blocks until a writer comes, and opening some
  // devices acts.
  struct stat info {};
  if (::fstatat(at, name.c_str(), &info, follow ? 0 : AT_SYMLINK_NOFOLLOW) != 0) {
    problem = system_problem(errno);
    return {};
  }
  if (refused(info, problem)) return {};
  // O_NONBLOCK: should the name have become a FIFO since, the open does not wait.
  UniqueFd fd(::openat(at, name.c_str(), O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC | (follow ? 0 : O_NOFOLLOW)));
  if (!fd) {
    problem = system_problem(errno);
    return {};
  }
  if (::fstat(fd.get(), &info) != 0) {
    problem = system_problem(errno);
    return {};
  }
  if (refused(info, problem)) return {};
  return fd;
}

std::string read_whole(int fd, std::uint64_t max_bytes, FileProblem& problem) {
  problem = {};
  struct stat info {};
  if (::fstat(fd, &info) != 0) {
    problem = system_problem(errno);
    return {};
  }
  if (static_cast<std::uint64_t>(info.st_size) > max_bytes) {
    problem = {FileProblem::Kind::too_large, 0, "", static_cast<std::uint64_t>(info.st_size)};
    return {};
  }
  std::string text;
  char buffer[1 << 14];
  for (;;) {
    const ssize_t n = ::read(fd, buffer, sizeof buffer);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      problem = {FileProblem::Kind::system, errno, "", text.size()};  // size: where the read failed
      return {};
    }
    if (n == 0) return text;
    // A file that grows while it is read stays bounded too.
    if (text.size() + static_cast<std::size_t>(n) > max_bytes) {
      problem = {FileProblem::Kind::grew, 0, "", text.size() + static_cast<std::size_t>(n)};
      return {};
    }
    text.append(buffer, static_cast<std::size_t>(n));
  }
}

}  // namespace zest
