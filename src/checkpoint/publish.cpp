#include "checkpoint/publish.hpp"

#include <fcntl.h>
#include <stdio.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <optional>
#include <set>
#include <string>
#include <system_error>
#include <vector>

#include <fmt/core.h>

#include "checkpoint/format.hpp"
#include "offload/checksum.hpp"
#include "zest/checkpoint.hpp"
#include "zest/error.hpp"

namespace zest::checkpoint {
namespace {

namespace fs = std::filesystem;

constexpr const char* kWhat = "Engine::save";

[[noreturn]] void refuse(const std::string& target, const std::string& what_is_there) {
  throw Error(
      fmt::format("{}: {} {}; a save replaces only a zest checkpoint (or an empty directory), so that nothing of yours "
                  "is lost: save to another path, or move it away first",
                  kWhat, target, what_is_there));
}

// What a save finds at its target: nothing, or the directory, held open, and the files the save
// may delete when it replaces it (a checkpoint's manifest and the files it lists; none for an
// empty directory). look_at refuses anything else.
struct Existing {
  std::optional<Directory> dir;
  std::set<std::string> files;
};

Existing look_at(const std::string& target) {
  struct stat info {};
  if (::lstat(target.c_str(), &info) != 0) {
    if (errno == ENOENT) return {};
    throw IoError(std::string(kWhat).append(": cannot look at the target"), target, 0, 0, errno);
  }
  // A link is the user's: replacing the link's name would drop it, and what it points to is not
  // the path the save was given.
  if (S_ISLNK(info.st_mode)) refuse(target, "is a symbolic link (give the directory it points to)");
  if (!S_ISDIR(info.st_mode))
    refuse(target, S_ISREG(info.st_mode) ? "is a regular file, not a directory" : "is a special file, not a directory");
  // From here on through a handle: what is checked is what is later replaced and deleted from.
  Existing existing{Directory(target), {}};
  const Directory& dir = *existing.dir;
  const std::vector<std::string> present = dir.names();
  if (present.empty()) return existing;
  if (std::find(present.begin(), present.end(), kManifestName) == present.end())
    refuse(target, "is a directory that is not a zest checkpoint (it has no manifest)");
  Manifest manifest;
  try {
    manifest = read_manifest(dir);
  } catch (const Error& e) {
    refuse(target, std::string("is not a checkpoint zest can read (").append(e.what()).append(")"));
  }
  existing.files.insert(kManifestName);
  for (const RankEntry& rank : manifest.ranks)
    for (const StateFile& file : rank.files) existing.files.insert(file.name);
  for (const std::string& name : present) {
    struct stat file {};
    if (!existing.files.count(name))
      refuse(target,
             std::string("is a zest checkpoint that also holds '").append(name).append("', which zest did not write"));
    if (::fstatat(dir.fd(), name.c_str(), &file, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(file.st_mode))
      refuse(target, std::string("is a zest checkpoint whose '").append(name).append("' is not a regular file"));
  }
  return existing;
}

// After the renames of a publish: `new_at` must name the new checkpoint and `old_at` (when there
// was one) the replaced one. Else someone moved a directory in or out at one of the paths while
// the save ran, and nothing is deleted: Error says where each is.
void check_moved(const Directory& temp, const std::string& new_at, const Existing& existing,
                 const std::string& old_at) {
  if (path_names(new_at, temp.identity()) && (!existing.dir || path_names(old_at, existing.dir->identity()))) return;
  throw Error(
      fmt::format("{}: a directory was moved to or from {}{} while the save ran (by someone who can write its parent), "
                  "so what is at {} may not be this save's checkpoint; nothing was deleted: look at both paths",
                  kWhat, new_at, existing.dir ? std::string(" or ").append(old_at) : std::string(), new_at));
}

// Deletes, in the replaced checkpoint (the directory look_at checked, now at `now_at`), what
// look_at found (each file by name, never recursively), then the directory itself when that
// emptied it. Whatever else appeared there since stays: the new checkpoint is published, so
// nothing here fails the save.
void remove_replaced(const Existing& existing, const std::string& now_at) {
  for (const std::string& name : existing.files) ::unlinkat(existing.dir->fd(), name.c_str(), 0);
  if (path_names(now_at, existing.dir->identity())) ::rmdir(now_at.c_str());  // only an empty one
}

std::string parent_of(const std::string& path) {
  const fs::path parent = fs::path(path).parent_path();
  return parent.empty() ? std::string(".") : parent.string();
}

}  // namespace

std::string save_target(const std::string& dir) {
  std::string target = fs::path(dir).lexically_normal().string();
  while (target.size() > 1 && target.back() == '/') target.pop_back();  // "ckpt/" is "ckpt"
  const std::string name = fs::path(target).filename().string();
  if (name.empty() || name == "." || name == ".." || target == "/")
    throw Error(
        fmt::format("{}: '{}' names no directory a save can create (it is empty, '.', '..' or '/'); give a new "
                    "directory's path, such as ckpt/step-100",
                    kWhat, dir));
  return target;
}

void check_save_target(const std::string& target) { look_at(target); }

std::string temp_dir(const std::string& target, std::uint32_t token) {
  return fmt::format("{}.tmp-{}", target, token);
}

TempDir create_temp_dir(const std::string& target, std::uint32_t first) {
  std::error_code error;
  fs::create_directories(parent_of(target), error);  // creates only what is missing
  if (error)
    throw IoError(std::string(kWhat).append(": cannot create the parent directory"), parent_of(target), 0, 0,
                  error.value());
  // An exclusive mkdir: a path that exists (a crashed save's leftover, or anything of the user's)
  // is skipped, never reused or removed.
  for (std::uint32_t token = first, tries = 0; tries < 1000; ++token, ++tries) {
    const std::string path = temp_dir(target, token);
    if (::mkdir(path.c_str(), 0755) != 0) {
      if (errno == EEXIST) continue;
      throw IoError(std::string(kWhat).append(": cannot create the directory"), path, 0, 0, errno);
    }
    TempDir made{token, Directory(path)};
    // Between the mkdir and the open, another directory may have taken the path: refused unless
    // what was opened is an empty directory of this user (only root could have made another).
    if (made.dir.owner() != ::geteuid() || !made.dir.names().empty())
      throw Error(
          fmt::format("{}: the directory {} it created was replaced by another before it was opened (someone who can "
                      "write its parent moved it); save again, or to a directory only you can write",
                      kWhat, path));
    // Held while the save runs (the handle lives as long as the save), so a cleanup of crashed
    // saves' leftovers can tell a live one: `flock -n DIR.tmp-N rm -r DIR.tmp-N` skips it.
    if (::flock(made.dir.fd(), LOCK_EX | LOCK_NB) != 0)
      throw IoError(std::string(kWhat).append(": cannot lock the temporary directory it created"), path, 0, 0, errno);
    return made;
  }
  throw IoError(
      std::string(kWhat).append(": 1000 temporary directories beside the target exist already (left by crashed "
                                "saves?); remove them"),
      temp_dir(target, first), 0, 0, EEXIST);
}

Directory open_temp_dir(const std::string& path, std::uint64_t inode) {
  const auto refuse = [&] {
    throw Error(
        fmt::format("{}: {} is not the temporary directory rank 0 created (the ranks do not share one file system "
                    "there, or someone who can write its parent put something else at its path); save to a directory "
                    "every rank sees, that only you can write",
                    kWhat, path));
  };
  try {
    Directory dir(path);
    if (dir.identity().inode != inode || dir.owner() != ::geteuid()) refuse();
    return dir;
  } catch (const IoError& e) {
    if (e.error_number() == ENOTDIR || e.error_number() == ELOOP) refuse();  // a link, or a file
    throw;
  }
}

std::vector<std::string> check_saved_files(const Directory& dir, std::span<const StateFile> files,
                                           std::uint64_t chunk_bytes, bool checksums) {
  std::vector<std::string> problems;
  std::vector<char> chunk;
  for (const StateFile& file : files) {
    const std::string path = dir.path_of(file.name);
    const UniqueFd fd(::openat(dir.fd(), file.name.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC));
    if (!fd) {
      problems.push_back(
          path + (errno == ENOENT ? ": missing" : std::string(": cannot be opened (") + std::strerror(errno) + ")"));
      continue;
    }
    struct stat info {};
    if (::fstat(fd.get(), &info) != 0 || !S_ISREG(info.st_mode)) {
      problems.push_back(path + ": not a regular file");
    } else if (static_cast<std::uint64_t>(info.st_size) != file.bytes) {
      problems.push_back(fmt::format("{}: {} bytes, the manifest says {}", path, info.st_size, file.bytes));
    } else if (checksums) {
      chunk.resize(static_cast<std::size_t>(chunk_bytes));
      for (std::size_t c = 0; c < file.chunk_crcs.size(); ++c) {
        const std::uint64_t at = c * chunk_bytes;
        const auto length = static_cast<std::size_t>(std::min<std::uint64_t>(chunk_bytes, file.bytes - at));
        const ssize_t got = ::pread(fd.get(), chunk.data(), length, static_cast<off_t>(at));
        if (got != static_cast<ssize_t>(length) || offload::crc32c(chunk.data(), length) != file.chunk_crcs[c]) {
          problems.push_back(
              fmt::format("{}: chunk {} at byte {} {}", path, c, at,
                          got == static_cast<ssize_t>(length) ? "does not match its checksum" : "cannot be read back"));
          break;
        }
      }
    }
  }
  return problems;
}

void publish(const Directory& temp, const std::string& target, std::span<const StateFile> files) {
  if (!path_names(temp.path(), temp.identity()))
    throw Error(
        fmt::format("{}: the temporary directory {} was moved away while the save ran (by someone who can write its "
                    "parent); the new checkpoint is where it was moved to, and nothing was published: save again, to a "
                    "directory only you can write",
                    kWhat, temp.path()));
  const Existing existing = look_at(target);  // again: the target may have changed during the save
  if (!existing.dir) {
    rename_noreplace(temp.path(), target, std::string(kWhat).append(": cannot rename the new checkpoint into place"));
    check_moved(temp, target, existing, temp.path());
    if (const auto problems = check_saved_files(temp, files, 0, false); !problems.empty())
      throw Error(
          fmt::format("{}: the new checkpoint at {} lost a file as it was published ({}; removed by someone while the "
                      "save ran?): it is damaged; save again",
                      kWhat, target, problems.front()));
  } else if (::renameat2(AT_FDCWD, temp.path().c_str(), AT_FDCWD, target.c_str(), RENAME_EXCHANGE) == 0) {
    check_moved(temp, target, existing, temp.path());  // temp's path now names the previous checkpoint
    if (const auto problems = check_saved_files(temp, files, 0, false); !problems.empty()) {
      // Put the previous checkpoint back, the new one aside, and say where both are.
      const bool back = ::renameat2(AT_FDCWD, temp.path().c_str(), AT_FDCWD, target.c_str(), RENAME_EXCHANGE) == 0;
      throw Error(fmt::format(
          "{}: the new checkpoint lost a file as it was published ({}; removed by someone while the save ran?): {}; "
          "nothing was deleted: save again",
          kWhat, problems.front(),
          back ? fmt::format("the previous checkpoint is back at {}, the damaged new one at {}", target, temp.path())
               : fmt::format("the damaged new one is at {} and the previous checkpoint at {}", target, temp.path())));
    }
    remove_replaced(existing, temp.path());
  } else {
    // No atomic exchange here: the previous checkpoint moves aside onto an empty directory this
    // save creates (a rename may replace only an empty directory), then the new one takes its
    // name. A crash between the two leaves the previous one at the aside path.
    const std::string aside =
        std::string(target).append(".old-").append(temp.path().substr(temp.path().rfind(".tmp-") + 5));
    if (::mkdir(aside.c_str(), 0755) != 0)
      throw IoError(std::string(kWhat).append(": cannot create a directory to move the previous checkpoint to"), aside,
                    0, 0, errno);
    if (::rename(target.c_str(), aside.c_str()) != 0) {
      const int error = errno;
      ::rmdir(aside.c_str());
      throw IoError(std::string(kWhat).append(": cannot move the previous checkpoint aside"), target, 0, 0, error);
    }
    if (::rename(temp.path().c_str(), target.c_str()) != 0)
      throw IoError(
          fmt::format("{}: cannot rename the new checkpoint into place (the previous one is at {})", kWhat, aside),
          target, 0, 0, errno);
    check_moved(temp, target, existing, aside);
    if (const auto problems = check_saved_files(temp, files, 0, false); !problems.empty())
      throw Error(fmt::format(
          "{}: the new checkpoint at {} lost a file as it was published ({}; removed by someone while the save ran?); "
          "the previous checkpoint is at {} and nothing was deleted: move it back, or save again",
          kWhat, target, problems.front(), aside));
    remove_replaced(existing, aside);
  }
  fsync_directory(parent_of(target));
}

}  // namespace zest::checkpoint

namespace zest {

void check_checkpoint_target(const std::string& dir) { checkpoint::check_save_target(checkpoint::save_target(dir)); }

}  // namespace zest
