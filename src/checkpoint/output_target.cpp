#include "checkpoint/output_target.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <filesystem>
#include <string>
#include <system_error>

#include <fmt/core.h>

#include "checkpoint/safetensors_header.hpp"
#include "zest/error.hpp"

namespace zest::checkpoint {
namespace {

namespace fs = std::filesystem;

[[noreturn]] void refuse(const std::string& out, const std::string& what_is_there, const std::string& to_do) {
  throw Error(fmt::format("consolidate: the output {} {}; zest never overwrites what it did not write: {}", out,
                          what_is_there, to_do));
}

// Whether the regular file at `path` begins as every safetensors file consolidate writes. Reads
// only those first bytes (it is opened non-blocking, though a regular file never blocks).
bool written_by_zest(const std::string& path) {
  const UniqueFd fd(::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC));
  if (!fd) return false;
  std::string head(sizeof(std::uint64_t) + kZestHeaderStart.size(), '\0');
  const ssize_t n = ::pread(fd.get(), head.data(), head.size(), 0);
  return n == static_cast<ssize_t>(head.size()) &&
         head.compare(sizeof(std::uint64_t), std::string::npos, kZestHeaderStart) == 0;
}

// Whether `inner` is `outer` or lies under it, both resolved (links, "..") as far as they exist.
bool inside(const fs::path& inner, const fs::path& outer) {
  std::error_code error;
  const fs::path a = fs::weakly_canonical(inner, error);
  if (error) return false;
  const fs::path b = fs::weakly_canonical(outer, error);
  if (error) return false;
  auto bi = b.begin();
  for (auto ai = a.begin(); bi != b.end(); ++ai, ++bi) {
    if (bi->empty()) continue;  // the trailing "" of a path ending in '/'
    if (ai == a.end() || *ai != *bi) return false;
  }
  return true;
}

}  // namespace

bool check_output_target(const std::string& out, const std::string& dir) {
  const std::string name = fs::path(out).filename().string();
  if (out.empty() || name.empty() || name == "." || name == "..")
    refuse(out.empty() ? "''" : out, "names no file (it is empty, '.', '..' or ends in '/')",
           "give the path of a new file, such as model.safetensors");
  if (inside(out, dir))
    refuse(out, std::string("is inside the checkpoint ").append(dir).append(" that it reads"),
           "write it outside the checkpoint's directory");
  struct stat info {};
  if (::lstat(out.c_str(), &info) != 0) {
    if (errno == ENOENT) return false;
    throw IoError("consolidate: cannot look at the output path", out, 0, 0, errno);
  }
  const auto kind = info.st_mode & S_IFMT;
  if (kind == S_IFLNK) refuse(out, "is a symbolic link", "give the path it points to, or a new file's path");
  if (kind == S_IFDIR)
    refuse(out, "is a directory", "give a file's path, such as " + (fs::path(out) / "model.safetensors").string());
  if (kind != S_IFREG)
    refuse(out,
           kind == S_IFIFO                      ? "is a FIFO"
           : kind == S_IFCHR || kind == S_IFBLK ? "is a device"
                                                : "is a special file",
           "give the path of a new file");
  if (!written_by_zest(out))
    refuse(out, "exists and is not a safetensors file written by zest",
           "remove it yourself or give the path of a new file");
  return true;
}

}  // namespace zest::checkpoint
