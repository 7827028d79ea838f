// SwapFile: the one file per rank that an NvmeStore keeps its regions in, opened O_DIRECT (no page
// cache, no double buffering) and preallocated range by range with fallocate so writes inside a
// step never run out of space or fragment. Falls back to buffered I/O only when the file system
// refuses O_DIRECT (at open, or on a first aligned write), and says so through `warn`.
#pragma once

#include <cstddef>
#include <functional>
#include <string>

namespace zest::offload {

class SwapFile {
 public:
  using Warn = std::function<void(const std::string&)>;

  // Creates (truncating) DIRECTORY/zest-rank<rank>.swap. Throws IoError for a missing or
  // unwritable directory or any other failure, naming the path and errno.
  SwapFile(const std::string& directory, int rank, bool want_direct, const Warn& warn);
  SwapFile(const SwapFile&) = delete;
  SwapFile& operator=(const SwapFile&) = delete;
  // Closes the file, and removes it unless keep() was asked for.
  ~SwapFile();

  int fd() const { return fd_; }
  const std::string& path() const { return path_; }
  bool direct() const { return direct_; }
  void keep() { keep_ = true; }

  // Reserves [offset, offset+length) on disk. Throws IoError (ENOSPC: the disk is full).
  void preallocate(std::size_t offset, std::size_t length);
  // fdatasync. Throws IoError.
  void sync();

 private:
  bool open_file(bool direct);
  bool direct_write_works();

  std::string path_;
  int fd_ = -1;
  bool direct_ = false;
  bool keep_ = false;
  bool sparse_ = false;  // the file system has no fallocate: ranges are reserved by ftruncate
  Warn warn_;
  std::size_t size_ = 0;
};

}  // namespace zest::offload
