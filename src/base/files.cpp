#include "base/files.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>  // renameat2, RENAME_NOREPLACE
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>

#include "zest/error.hpp"

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

std::string join_path(const std::string& dir, const std::string& name) {
  return (std::filesystem::path(dir) / name).string();
}

namespace {

FileIdentity identity_from(const struct stat& info) {
  return {static_cast<std::uint64_t>(info.st_dev), static_cast<std::uint64_t>(info.st_ino)};
}

struct stat stat_of(const UniqueFd& fd, const std::string& path, const char* what) {
  struct stat info {};
  if (::fstat(fd.get(), &info) != 0) throw IoError(what, path, 0, 0, errno);
  return info;
}

}  // namespace

FileIdentity identity_of(const UniqueFd& fd, const std::string& path) {
  return identity_from(stat_of(fd, path, "cannot look at"));
}

bool path_names(const std::string& path, const FileIdentity& id) {
  struct stat info {};
  return ::lstat(path.c_str(), &info) == 0 && identity_from(info) == id;
}

Directory::Directory(std::string path)
    : path_(std::move(path)), fd_(::open(path_.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)) {
  if (!fd_) throw IoError("cannot open the directory", path_, 0, 0, errno);
  const struct stat info = stat_of(fd_, path_, "cannot look at the directory");
  identity_ = identity_from(info);
  owner_ = info.st_uid;
}

std::vector<std::string> Directory::names() const {
  // A stream of its own (fdopendir takes the descriptor it is given, on success), reading from the
  // start.
  UniqueFd copy(::openat(fd_.get(), ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  DIR* stream = copy ? ::fdopendir(copy.get()) : nullptr;
  if (!stream) throw IoError("cannot list the directory", path_, 0, 0, errno);
  static_cast<void>(copy.release());  // the stream's now: closedir closes it
  std::vector<std::string> names;
  while (const dirent* entry = ::readdir(stream)) {
    const std::string name = entry->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  ::closedir(stream);
  return names;
}

void Directory::sync() const {
  if (::fsync(fd_.get()) != 0) throw IoError("cannot fsync the directory", path_, 0, 0, errno);
}

UniqueFd create_exclusive(int at, const std::string& name, const std::string& path) {
  UniqueFd fd(::openat(at, name.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644));
  if (!fd) throw IoError("cannot create", path, 0, 0, errno);
  return fd;
}

void write_all(const UniqueFd& fd, const std::string& path, const void* data, std::size_t bytes,
               std::uint64_t written) {
  const char* in = static_cast<const char*>(data);
  for (std::size_t done = 0; done < bytes;) {
    const ssize_t n = ::write(fd.get(), in + done, bytes - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw IoError("cannot write", path, written + done, bytes - done, errno);
    done += static_cast<std::size_t>(n);
  }
}

void sync_and_close(UniqueFd& fd, const std::string& path, std::uint64_t bytes) {
  if (::fsync(fd.get()) != 0) throw IoError("cannot fsync", path, 0, bytes, errno);
  if (const int error = fd.close()) throw IoError("cannot close", path, 0, bytes, error);
}

void write_file_synced(const std::string& path, const void* data, std::size_t bytes) {
  UniqueFd fd = create_exclusive(AT_FDCWD, path, path);
  write_all(fd, path, data, bytes);
  sync_and_close(fd, path, bytes);
}

void write_file_synced(const Directory& dir, const std::string& name, const void* data, std::size_t bytes) {
  const std::string path = dir.path_of(name);
  UniqueFd fd = create_exclusive(dir.fd(), name, path);
  write_all(fd, path, data, bytes);
  sync_and_close(fd, path, bytes);
}

void read_at(int fd, const std::string& path, void* data, std::size_t bytes, std::uint64_t offset) {
  char* out = static_cast<char*>(data);
  std::size_t done = 0;
  while (done < bytes) {
    const ssize_t n = ::pread(fd, out + done, bytes - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw IoError("cannot read", path, offset + done, bytes - done, errno);
    if (n == 0) throw IoError("file ends early (truncated)", path, offset + done, bytes - done, EIO);
    done += static_cast<std::size_t>(n);
  }
}

void fsync_directory(const std::string& path) {
  const UniqueFd fd(::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!fd) throw IoError("cannot open the directory", path, 0, 0, errno);
  if (::fsync(fd.get()) != 0) throw IoError("cannot fsync the directory", path, 0, 0, errno);
}

void rename_noreplace(const std::string& from, const std::string& to, const std::string& what) {
  if (::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_NOREPLACE) == 0) return;
  if (errno == EINVAL) {
    struct stat info {};
    if (::stat(from.c_str(), &info) == 0 && S_ISDIR(info.st_mode)) {
      if (::rename(from.c_str(), to.c_str()) == 0) return;
    } else if (::link(from.c_str(), to.c_str()) == 0) {
      ::unlink(from.c_str());
      return;
    }
  }
  throw IoError(what, to, 0, 0, errno);
}

}  // namespace zest
