#include "offload/swap_file.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "zest/error.hpp"

namespace zest::offload {
namespace {

constexpr std::size_t kProbeBytes = 4096;

struct FreeDeleter {
  void operator()(void* p) const noexcept { std::free(p); }
};

}  // namespace

SwapFile::SwapFile(const std::string& directory, int rank, bool want_direct, const Warn& warn)
    : warn_(warn) {
  path_ = directory;
  if (!path_.empty() && path_.back() != '/') path_.append("/");
  path_.append("zest-rank").append(std::to_string(rank)).append(".swap");

  struct stat info {};
  if (::stat(directory.c_str(), &info) != 0)
    throw IoError("the offload directory is missing; create it or point offload.*.path at an existing directory",
                  directory, 0, 0, errno);
  if (!S_ISDIR(info.st_mode))
    throw IoError("the offload path is not a directory; point offload.*.path at a directory", directory, 0, 0, ENOTDIR);

  if (want_direct && !open_file(true)) {
    warn_(std::string("zest: warning: ").append(path_).append(
        ": the file system refuses O_DIRECT; the NVMe store falls back to buffered I/O (through the "
        "page cache: slower, and it uses host memory). Put offload.*.path on a file system that "
        "supports O_DIRECT (ext4, xfs) for full speed."));
    open_file(false);
  } else if (!want_direct) {
    open_file(false);
  }
}

// Opens the file. Returns false only when `direct` is refused by the file system.
bool SwapFile::open_file(bool direct) {
  const int flags = O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC | (direct ? O_DIRECT : 0);
  fd_ = ::open(path_.c_str(), flags, 0600);
  if (fd_ < 0) {
    const int error = errno;
    if (direct && error == EINVAL) return false;
    if (error == EACCES || error == EPERM || error == EROFS)
      throw IoError("cannot create the swap file: the offload directory is not writable; choose a writable directory for offload.*.path",
                    path_, 0, 0, error);
    throw IoError("cannot create the swap file", path_, 0, 0, error);
  }
  direct_ = direct;
  if (direct && !direct_write_works()) {
    ::close(fd_);
    fd_ = -1;
    direct_ = false;
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

SwapFile::~SwapFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!keep_) (void)::unlink(path_.c_str());
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
                        ? "cannot reserve space in the swap file: the disk is full (or the file would exceed the size limit); free space or point offload.*.path at a larger disk"
                        : "cannot reserve space in the swap file (fallocate)",
                    path_, offset, length, error);
    sparse_ = true;
    warn_(std::string("zest: warning: ").append(path_).append(
        ": the file system has no fallocate; swap space is not reserved ahead, so a full disk shows up as a failed write"));
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
