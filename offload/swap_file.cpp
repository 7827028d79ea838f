#include "offload/swap_file.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include <fmt/core.h>

#include "zest/error.hpp"

namespace zest::offload {
namespace {

constexpr std::size_t kProbeBytes = 4096;
constexpr const char* kPrefix = "zest-";
// Entries of the offload directory looked at for stale directories: bounded, so a directory with
// millions of entries costs a bounded time at start.
constexpr int kStaleScanLimit = 4096;

struct FreeDeleter {
  void operator()(void* p) const noexcept { std::free(p); }
};

// The host name, reduced to characters that are safe in a file name.
std::string host_name() {
  char buffer[256] = {};
  if (::gethostname(buffer, sizeof buffer - 1) != 0) return "host";
  std::string name;
  for (const char* c = buffer; *c && name.size() < 64; ++c)
    name += (std::isalnum(static_cast<unsigned char>(*c)) || *c == '.' || *c == '_') ? *c : '_';
  return name.empty() ? "host" : name;
}

std::string random_suffix() {
  static constexpr char kAlphabet[] = "abcdefghijklmnopqrstuvwxyz0123456789";
  std::random_device device;
  std::string suffix;
  for (int i = 0; i < 8; ++i) suffix += kAlphabet[device() % (sizeof kAlphabet - 1)];
  return suffix;
}

}  // namespace

SwapFile::SwapFile(const std::string& directory, int rank, bool want_direct, const Warn& warn)
    : warn_(warn) {
  try {
    make_own_directory(directory);
    name_ = "zest-rank" + std::to_string(rank) + ".swap";
    path_ = own_path_ + "/" + name_;
    if (want_direct && !open_file(true)) {
      warn_(std::string("zest: warning: ").append(path_).append(
          ": the file system refuses O_DIRECT; the NVMe store falls back to buffered I/O (through the "
          "page cache: slower, and it uses host memory). Put offload.*.path on a file system that "
          "supports O_DIRECT (ext4, xfs) for full speed."));
      open_file(false);
    } else if (!want_direct) {
      open_file(false);
    }
  } catch (...) {
    keep_ = false;
    close_fds();
    throw;
  }
  report_stale_directories(directory);
}

// The directory zest owns inside the shared one: a name no one has (mkdirat fails on anything that
// exists, a symlink included), opened without following a symlink, checked to be ours, locked. It
// is made under a hidden name and takes its zest- name only once locked, so another job's scan for
// stale directories (report_stale_directories) never sees it unlocked.
void SwapFile::make_own_directory(const std::string& directory) {
  parent_fd_ = ::open(directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (parent_fd_ < 0) {
    const int error = errno;
    if (error == ENOTDIR)
      throw IoError("the offload path is not a directory; point offload.*.path at a directory", directory, 0, 0, error);
    throw IoError(
        "the offload directory is missing or unreadable; create it or point offload.*.path at an existing directory",
        directory, 0, 0, error);
  }
  const std::string stem = std::string(kPrefix) + host_name() + "-" + std::to_string(::getpid()) + "-";
  std::string making;
  const auto refuse = [&](const char* what, const std::string& name, int error) {
    if (error == EACCES || error == EPERM || error == EROFS)
      throw IoError("cannot create zest's directory in the offload directory: it is not writable; choose a "
                    "writable directory for offload.*.path", directory, 0, 0, error);
    throw IoError(what, directory + "/" + name, 0, 0, error);
  };
  for (int attempt = 0; making.empty(); ++attempt) {
    const std::string name = "." + stem + random_suffix();
    if (::mkdirat(parent_fd_, name.c_str(), 0700) == 0) making = name;
    else if (errno != EEXIST || attempt >= 100)
      refuse("cannot create zest's directory in the offload directory", name, errno);
  }
  own_dir_fd_ = ::openat(parent_fd_, making.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (own_dir_fd_ < 0)
    throw IoError("cannot open the directory zest just created", directory + "/" + making, 0, 0, errno);
  struct stat info {};
  if (::fstat(own_dir_fd_, &info) != 0)
    throw IoError("cannot stat the directory zest just created", directory + "/" + making, 0, 0, errno);
  if (info.st_uid != ::geteuid() || (info.st_mode & 077) != 0)
    throw IoError("the directory zest just created is not this user's alone (someone replaced it?); zest does not "
                  "write there", directory + "/" + making, 0, 0, EPERM);
  // Held for the SwapFile's life: a later job tells a live directory from a stale one by it.
  if (::flock(own_dir_fd_, LOCK_EX | LOCK_NB) != 0)
    throw IoError("cannot lock the directory zest just created", directory + "/" + making, 0, 0, errno);
  for (int attempt = 0; own_name_.empty(); ++attempt) {
    const std::string name = stem + random_suffix();
    if (::renameat2(parent_fd_, making.c_str(), parent_fd_, name.c_str(), RENAME_NOREPLACE) == 0) own_name_ = name;
    else if (errno != EEXIST || attempt >= 100)
      refuse("cannot name zest's directory in the offload directory", name, errno);
  }
  own_path_ = directory + (directory.empty() || directory.back() == '/' ? "" : "/") + own_name_;
}

// Directories named like zest's, owned by this user, that no live process holds locked: left by a
// job that died (SIGKILL, a node crash). Reported, never removed.
void SwapFile::report_stale_directories(const std::string& directory) const {
  const int scan_fd = ::dup(parent_fd_);
  if (scan_fd < 0) return;
  DIR* dir = ::fdopendir(scan_fd);
  if (!dir) {
    ::close(scan_fd);
    return;
  }
  ::rewinddir(dir);
  std::vector<std::string> stale;
  int seen = 0;
  while (const dirent* entry = ::readdir(dir)) {
    if (++seen > kStaleScanLimit) break;
    const std::string name = entry->d_name;
    if (name.rfind(kPrefix, 0) != 0 || name == own_name_) continue;
    const int fd = ::openat(parent_fd_, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) continue;
    struct stat info {};
    // Unlocked and still there: a job that ends removes its directory before it lets go of the
    // lock, so one removed while this scan looked at it has no links left by the time it is free.
    if (::fstat(fd, &info) == 0 && info.st_uid == ::geteuid() && ::flock(fd, LOCK_SH | LOCK_NB) == 0 &&
        ::fstat(fd, &info) == 0 && info.st_nlink > 0)
      stale.push_back(name);
    ::close(fd);
  }
  ::closedir(dir);
  if (stale.empty()) return;
  std::string message = fmt::format(
      "zest: warning: {} holds {} swap director{} of jobs that are gone (no live process holds them):", directory,
      stale.size(), stale.size() == 1 ? "y" : "ies");
  for (std::size_t i = 0; i < stale.size() && i < 8; ++i) message += " " + stale[i];
  if (stale.size() > 8) message += " ...";
  warn_(
      fmt::format("{0}. zest leaves them alone. A running job holds a lock on its directory: "
                  "`flock -n {1}/NAME rm -r {1}/NAME` removes one only if no job holds it.",
                  message, directory));
}

// Opens (creates) the file inside zest's own directory. Returns false only when `direct` is
// refused by the file system; the file it may have created then is removed first (it is zest's).
bool SwapFile::open_file(bool direct) {
  const int flags = O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC | (direct ? O_DIRECT : 0);
  fd_ = ::openat(own_dir_fd_, name_.c_str(), flags, 0600);
  if (fd_ < 0) {
    const int error = errno;
    if (direct && error == EINVAL) {
      (void)::unlinkat(own_dir_fd_, name_.c_str(), 0);
      return false;
    }
    throw IoError("cannot create the swap file", path_, 0, 0, error);
  }
  direct_ = direct;
  if (direct && !direct_write_works()) {
    ::close(fd_);
    fd_ = -1;
    direct_ = false;
    (void)::unlinkat(own_dir_fd_, name_.c_str(), 0);
    return false;
  }
  return true;
}

// Some file systems accept O_DIRECT at open and refuse it on the first transfer (EINVAL); one
// aligned block written now finds out before any region depends on it.
bool SwapFile::direct_write_works() {
  std::unique_ptr<void, FreeDeleter> block(std::aligned_alloc(kProbeBytes, kProbeBytes));
  if (!block) throw Error("cannot allocate 4 KiB for the O_DIRECT probe of the swap file");
  std::memset(block.get(), 0, kProbeBytes);
  const ssize_t written = ::pwrite(fd_, block.get(), kProbeBytes, 0);
  if (written < 0 && errno == EINVAL) return false;
  if (written < 0) throw IoError("cannot write the swap file", path_, 0, kProbeBytes, errno);
  if (::ftruncate(fd_, 0) != 0) throw IoError("cannot truncate the swap file", path_, 0, 0, errno);
  return true;
}

SwapFile::~SwapFile() { close_fds(); }

// Removes what this SwapFile created, by name inside the directories it holds open (never by a
// path someone could have redirected): the file, then its directory, which rmdir leaves alone
// unless it is empty.
void SwapFile::close_fds() noexcept {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  if (own_dir_fd_ >= 0) {
    if (!keep_) {
      if (!name_.empty()) (void)::unlinkat(own_dir_fd_, name_.c_str(), 0);
      (void)::unlinkat(parent_fd_, own_name_.c_str(), AT_REMOVEDIR);
    }
    ::close(own_dir_fd_);
    own_dir_fd_ = -1;
  }
  if (parent_fd_ >= 0) ::close(parent_fd_);
  parent_fd_ = -1;
}

void SwapFile::preallocate(std::size_t offset, std::size_t length) {
  const auto off = static_cast<off_t>(offset);
  const auto len = static_cast<off_t>(length);
  if (!sparse_) {
    if (::fallocate(fd_, 0, off, len) == 0) {
      if (offset + length > size_) size_ = offset + length;
      return;
    }
    const int error = errno;
    if (error != EOPNOTSUPP)
      throw IoError(error == ENOSPC || error == EFBIG
                        ? "cannot reserve space in the swap file: the disk is full (or the file would exceed the size "
                          "limit); free space or point offload.*.path at a larger disk"
                        : "cannot reserve space in the swap file (fallocate)",
                    path_, offset, length, error);
    sparse_ = true;
    warn_(std::string("zest: warning: ")
              .append(path_)
              .append(": the file system has no fallocate; swap space is not reserved ahead, so a full disk shows up "
                      "as a failed write"));
  }
  if (offset + length > size_) {
    if (::ftruncate(fd_, off + len) != 0)
      throw IoError("cannot extend the swap file", path_, offset, length, errno);
    size_ = offset + length;
  }
}

void SwapFile::sync() {
  if (::fdatasync(fd_) != 0)
    throw IoError("fdatasync of the swap file failed: written data may not be on disk", path_, 0, size_, errno);
}

}  // namespace zest::offload
