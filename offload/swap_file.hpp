// SwapFile: the one file per rank that an NvmeStore keeps its regions in, opened O_DIRECT (no page
// cache, no double buffering) and preallocated range by range with fallocate so writes inside a
// step never run out of space or fragment. Falls back to buffered I/O only when the file system
// refuses O_DIRECT (at open, or on a first aligned write), and says so through `warn`.
//
// The offload directory is shared ground (other users, other jobs, other engines of this
// process): the file lives in a directory of its own that the SwapFile creates inside it,
// DIRECTORY/zest-<host>-<pid>-<random>/zest-rank<rank>.swap. That directory is made exclusively
// (mkdirat: never one that exists, never through a symlink), mode 0700, and held locked (flock)
// for the SwapFile's life; the file is created with O_EXCL | O_NOFOLLOW inside it. So no file that
// zest did not create is opened, truncated or removed, and two engines never share a file. At
// the end the SwapFile removes its file and then its directory only if it is empty. Directories of
// earlier jobs that no live process holds are reported through `warn` (never removed: whoever ran
// that job decides).
#pragma once

#include <cstddef>
#include <functional>
#include <string>

namespace zest::offload {

class SwapFile {
 public:
  using Warn = std::function<void(const std::string&)>;

  // Creates this rank's private directory and file in `directory`. Throws IoError for a missing or
  // unwritable directory or any other failure, naming the path and errno.
  SwapFile(const std::string& directory, int rank, bool want_direct, const Warn& warn);
  SwapFile(const SwapFile&) = delete;
  SwapFile& operator=(const SwapFile&) = delete;
  // Closes the file, and removes it and its directory unless keep() was asked for.
  ~SwapFile();

  int fd() const { return fd_; }
  const std::string& path() const { return path_; }           // the file
  const std::string& directory() const { return own_path_; }  // its private directory
  bool direct() const { return direct_; }
  void keep() { keep_ = true; }

  // Reserves [offset, offset+length) on disk. Throws IoError (ENOSPC: the disk is full).
  void preallocate(std::size_t offset, std::size_t length);
  // fdatasync. Throws IoError.
  void sync();

 private:
  void make_own_directory(const std::string& directory);
  void report_stale_directories(const std::string& directory) const;
  bool open_file(bool direct);
  bool direct_write_works();
  void close_fds() noexcept;

  std::string name_;      // of the file, inside own_dir_fd_
  std::string own_name_;  // of the private directory, inside parent_fd_
  std::string own_path_;
  std::string path_;
  int parent_fd_ = -1;   // the configured directory
  int own_dir_fd_ = -1;  // the private directory, flock'ed while open
  int fd_ = -1;
  bool direct_ = false;
  bool keep_ = false;
  bool sparse_ = false;  // the file system has no fallocate: ranges are reserved by ftruncate
  Warn warn_;
  std::size_t size_ = 0;
};

}  // namespace zest::offload
