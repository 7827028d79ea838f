#include "checkpoint/publish.hpp"

#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <set>
#include <string>
#include <system_error>

#include "checkpoint/format.hpp"
#include "zest/checkpoint.hpp"
#include "zest/error.hpp"

namespace zest::checkpoint {
namespace {

namespace fs = std::filesystem;

constexpr const char* kWhat = "Engine::save";

[[noreturn]] void refuse(const std::string& target, const std::string& what_is_there) {
  throw Error(std::string(kWhat).append(": ").append(target).append(" ").append(what_is_there)
                  .append("; a save replaces only a zest checkpoint (or an empty directory), so that nothing of yours is "
                          "lost: save to another path, or move it away first"));
}

// What a save finds at its target: nothing, or a directory and the files the save may delete
// when it replaces it (a checkpoint's manifest and the files it lists; none for an empty
// directory). look_at refuses anything else.
struct Existing {
  bool exists = false;
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
  if (!S_ISDIR(info.st_mode)) refuse(target, S_ISREG(info.st_mode) ? "is a regular file, not a directory" : "is a special file, not a directory");
  Existing existing{true, {}};
  std::error_code error;
  fs::directory_iterator entries(target, error);
  if (error) throw IoError(std::string(kWhat).append(": cannot list the target"), target, 0, 0, error.value());
  std::set<std::string> present;
  for (const fs::directory_entry& entry : entries) present.insert(entry.path().filename().string());
  if (present.empty()) return existing;
  if (!present.count(kManifestName)) refuse(target, "is a directory that is not a zest checkpoint (it has no manifest)");
  Manifest manifest;
  try {
    manifest = read_manifest(target);
  } catch (const Error& e) {
    refuse(target, std::string("is not a checkpoint zest can read (").append(e.what()).append(")"));
  }
  existing.files.insert(kManifestName);
  for (const RankEntry& rank : manifest.ranks)
    for (const StateFile& file : rank.files) existing.files.insert(file.name);
  for (const std::string& name : present) {
    struct stat file {};
    const std::string path = join(target, name);
    if (!existing.files.count(name))
      refuse(target, std::string("is a zest checkpoint that also holds '").append(name).append("', which zest did not write"));
    if (::lstat(path.c_str(), &file) != 0 || !S_ISREG(file.st_mode))
      refuse(target, std::string("is a zest checkpoint whose '").append(name).append("' is not a regular file"));
  }
  return existing;
}

// Deletes, in the replaced checkpoint now at `old`, what look_at found (each file by name, never
// recursively), then the directory itself when that emptied it. Whatever else appeared there since
// stays: the new checkpoint is published, so nothing here fails the save.
void remove_replaced(const std::string& old, const Existing& existing) {
  for (const std::string& name : existing.files) ::unlink(join(old, name).c_str());
  ::rmdir(old.c_str());
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
    throw Error(std::string(kWhat).append(": '").append(dir)
                    .append("' names no directory a save can create (it is empty, '.', '..' or '/'); give a new "
                            "directory's path, such as ckpt/step-100"));
  return target;
}

void check_save_target(const std::string& target) { look_at(target); }

std::string temp_dir(const std::string& target, std::uint32_t token) {
  return std::string(target).append(".tmp-").append(std::to_string(token));
}

std::uint32_t create_temp_dir(const std::string& target, std::uint32_t first) {
  std::error_code error;
  fs::create_directories(parent_of(target), error);  // creates only what is missing
  if (error) throw IoError(std::string(kWhat).append(": cannot create the parent directory"), parent_of(target), 0, 0, error.value());
  // An exclusive mkdir: a path that exists (a crashed save's leftover, or anything of the user's)
  // is skipped, never reused or removed.
  for (std::uint32_t token = first, tries = 0; tries < 1000; ++token, ++tries) {
    const std::string path = temp_dir(target, token);
    if (::mkdir(path.c_str(), 0755) == 0) return token;
    if (errno != EEXIST) throw IoError(std::string(kWhat).append(": cannot create the directory"), path, 0, 0, errno);
  }
  throw IoError(std::string(kWhat).append(": 1000 temporary directories beside the target exist already (left by crashed "
                                          "saves?); remove them"), temp_dir(target, first), 0, 0, EEXIST);
}

void publish(const std::string& temp, const std::string& target) {
  const Existing existing = look_at(target);  // again: the target may have changed during the save
  if (!existing.exists) {
    rename_noreplace(temp, target, std::string(kWhat).append(": cannot rename the new checkpoint into place"));
  } else if (::renameat2(AT_FDCWD, temp.c_str(), AT_FDCWD, target.c_str(), RENAME_EXCHANGE) == 0) {
    remove_replaced(temp, existing);  // temp now names the previous checkpoint
  } else {
    // No atomic exchange here: the previous checkpoint moves aside onto an empty directory this
    // save creates (a rename may replace only an empty directory), then the new one takes its
    // name. A crash between the two leaves the previous one at the aside path.
    const std::string aside = std::string(target).append(".old-").append(temp.substr(temp.rfind(".tmp-") + 5));
    if (::mkdir(aside.c_str(), 0755) != 0)
      throw IoError(std::string(kWhat).append(": cannot create a directory to move the previous checkpoint to"), aside, 0, 0, errno);
    if (::rename(target.c_str(), aside.c_str()) != 0) {
      const int error = errno;
      ::rmdir(aside.c_str());
      throw IoError(std::string(kWhat).append(": cannot move the previous checkpoint aside"), target, 0, 0, error);
    }
    if (::rename(temp.c_str(), target.c_str()) != 0)
      throw IoError(std::string(kWhat).append(": cannot rename the new checkpoint into place (the previous one is at ")
                        .append(aside).append(")"), target, 0, 0, errno);
    remove_replaced(aside, existing);
  }
  fsync_directory(parent_of(target));
}

}  // namespace zest::checkpoint

namespace zest {

void check_checkpoint_target(const std::string& dir) { checkpoint::check_save_target(checkpoint::save_target(dir)); }

}  // namespace zest
