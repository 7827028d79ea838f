// Test helpers: a scratch directory (optionally a fresh mount of a small or odd file system), an
// aligned buffer with a known pattern, and plain pread of a file for checking what is on disk.
#pragma once

#include <dirent.h>
#include <fcntl.h>
#include <stdlib.h>
#include <sys/mount.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

namespace zest::test {

// The swap file a rank's NvmeStore keeps in `dir`: DIR/zest-<host>-<pid>-<random>/zest-rank<R>.swap
// (each store makes a directory of its own). Empty when there is none, or more than one.
inline std::string swap_file(const std::string& dir, int rank) {
  const std::string name = "zest-rank" + std::to_string(rank) + ".swap";
  std::string found;
  int count = 0;
  if (DIR* listing = ::opendir(dir.c_str())) {
    while (const dirent* entry = ::readdir(listing)) {
      const std::string sub = entry->d_name;
      if (sub.rfind("zest-", 0) != 0) continue;
      const std::string path = dir + "/" + sub + "/" + name;
      if (::access(path.c_str(), F_OK) == 0) {
        found = path;
        ++count;
      }
    }
    ::closedir(listing);
  }
  return count == 1 ? found : std::string();
}

class ScratchDir {
 public:
  // A new directory under `parent` (/tmp is the disk here; see the tests for why).
  explicit ScratchDir(const std::string& parent = "/tmp") {
    std::string pattern = parent + "/zest-offload-test-XXXXXX";
    std::vector<char> buffer(pattern.begin(), pattern.end());
    buffer.push_back('\0');
    if (::mkdtemp(buffer.data()) == nullptr) std::abort();
    path_ = buffer.data();
  }
  // Mounts `fstype` with `options` on the directory. False (errno set) when that is not allowed.
  bool mount(const char* fstype, unsigned long flags, const char* options) {
    if (::mount(fstype, path_.c_str(), fstype, flags, options) != 0) return false;
    mounted_ = true;
    return true;
  }
  ~ScratchDir() {
    if (mounted_) ::umount2(path_.c_str(), MNT_DETACH);
    std::string command = "rm -rf '" + path_ + "'";
    if (std::system(command.c_str()) != 0) {
      // Nothing to do: a leftover directory in /tmp is harmless.
    }
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  bool mounted_ = false;
};

struct FreeDeleter {
  void operator()(void* p) const noexcept { std::free(p); }
};

// 4 KiB-aligned bytes filled from `seed` (every byte depends on its position and the seed).
class PatternBuffer {
 public:
  explicit PatternBuffer(std::size_t bytes, unsigned seed = 0)
      : bytes_(bytes), data_(static_cast<unsigned char*>(std::aligned_alloc(4096, round(bytes)))) {
    fill(seed);
  }
  void fill(unsigned seed) {
    std::uint32_t x = seed * 2654435761u + 12345u;
    for (std::size_t i = 0; i < bytes_; ++i) {
      x = x * 1664525u + 1013904223u;
      data_.get()[i] = static_cast<unsigned char>(x >> 24);
    }
  }
  void clear(unsigned char value = 0) { std::memset(data_.get(), value, bytes_); }
  unsigned char* data() const { return data_.get(); }
  std::size_t bytes() const { return bytes_; }

 private:
  static std::size_t round(std::size_t bytes) { return (bytes + 4095) / 4096 * 4096; }
  std::size_t bytes_;
  std::unique_ptr<unsigned char, FreeDeleter> data_;
};

// The bytes at [offset, offset+length) of `path`, read with plain pread (no O_DIRECT, no store).
inline std::vector<unsigned char> pread_file(const std::string& path, std::size_t offset, std::size_t length) {
  std::vector<unsigned char> out(length);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return {};
  std::size_t done = 0;
  while (done < length) {
    const ssize_t n = ::pread(fd, out.data() + done, length - done, static_cast<off_t>(offset + done));
    if (n <= 0) break;
    done += static_cast<std::size_t>(n);
  }
  ::close(fd);
  out.resize(done);
  return out;
}

}  // namespace zest::test
