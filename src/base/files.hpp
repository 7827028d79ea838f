// Files as zest opens them in directories other users and jobs share: an owning descriptor, the
// whole of a regular file read without blocking or without bound, a directory held open, and
// durable writes that never replace what zest did not create. A FIFO would block an open() until a
// writer came, a device would never end (or act on being opened), and a file may grow while it is
// read; each is refused, not waited on or read.
//
// The readers report what stopped them as a value: each caller words the error for its own user
// (a config error with the file's position, a checkpoint's IoError with the remedy). The rest
// throws IoError naming the path, the operation and errno.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace zest {

// An owned file descriptor, closed when it goes. Where a write's outcome depends on the close, call
// close() and look at its result.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) noexcept : fd_(fd) {}
  ~UniqueFd() { reset(); }
  UniqueFd(UniqueFd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    if (this != &other) {
      reset();
      fd_ = std::exchange(other.fd_, -1);
    }
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;

  int get() const noexcept { return fd_; }
  explicit operator bool() const noexcept { return fd_ >= 0; }
  // Closes now: 0, or the errno of a failed close (the descriptor is gone either way).
  int close() noexcept;
  void reset() noexcept { static_cast<void>(close()); }
  // Gives the descriptor up to a new owner (fdopendir's stream); this one no longer closes it.
  [[nodiscard]] int release() noexcept { return std::exchange(fd_, -1); }

 private:
  int fd_ = -1;
};

// What stopped an open or a read of a regular file.
struct FileProblem {
  enum class Kind {
    none,
    system,       // a call failed: `error` is its errno (a read's: `size` bytes in)
    not_regular,  // `file_kind` says what it is instead
    too_large,    // the file has `size` bytes, over the bound
    grew,         // it grew past the bound while it was read
  };
  Kind kind = Kind::none;
  int error = 0;
  const char* file_kind = "";
  std::uint64_t size = 0;
  explicit operator bool() const noexcept { return kind != Kind::none; }
};

// "a directory", "a FIFO", "a symbolic link", "a character device", "a block device", "a socket";
// "a regular file" for one.
const char* file_kind(mode_t mode);

// Opens `name` (relative to the directory descriptor `at`, or AT_FDCWD) for reading, only if it is
// a regular file: looked at before it is opened, opened non-blocking, looked at again. `follow`:
// whether a symbolic link at `name` is followed (a path a user gave) or refused (a name in a
// directory zest holds open). On failure returns an empty UniqueFd and sets `problem`.
UniqueFd open_regular(int at, const std::string& name, bool follow, FileProblem& problem);

// The whole of the regular file open at `fd`, at most `max_bytes` (its size checked first, and
// again as it is read). On failure sets `problem` (what was read is dropped).
std::string read_whole(int fd, std::uint64_t max_bytes, FileProblem& problem);

std::string join_path(const std::string& dir, const std::string& name);  // dir/name

// A file's identity (st_dev, st_ino): what a name is checked against before zest acts on it again.
struct FileIdentity {
  std::uint64_t device = 0, inode = 0;
  friend bool operator==(const FileIdentity&, const FileIdentity&) = default;
};
FileIdentity identity_of(const UniqueFd& fd, const std::string& path);  // throws IoError
// Whether `path` names the file `id` itself (a symbolic link there is not followed).
bool path_names(const std::string& path, const FileIdentity& id);

// A directory held open. Files are created in it, read from it and removed from it by name
// relative to this handle, so that whatever anyone who can write its parent puts at its path
// meanwhile (another directory, a symbolic link) changes nothing zest writes, reads or deletes.
class Directory {
 public:
  // Opens the directory at `path`; a symbolic link there is refused (O_NOFOLLOW).
  explicit Directory(std::string path);
  Directory(Directory&& other) noexcept = default;
  Directory& operator=(Directory&&) = delete;
  Directory(const Directory&) = delete;
  Directory& operator=(const Directory&) = delete;

  int fd() const { return fd_.get(); }
  const std::string& path() const { return path_; }  // as opened, for messages
  std::string path_of(const std::string& name) const { return join_path(path_, name); }
  FileIdentity identity() const { return identity_; }
  unsigned owner() const { return owner_; }  // uid
  std::vector<std::string> names() const;    // its entries but "." and ".."
  void sync() const;                         // fsync

 private:
  std::string path_;
  UniqueFd fd_;
  FileIdentity identity_;
  unsigned owner_ = 0;
};

// Creates `name` relative to `at` (a directory descriptor, or AT_FDCWD) for writing, exclusively
// and without following a link (O_EXCL | O_NOFOLLOW): an existing file, whoever made it, is an
// IoError (EEXIST), never overwritten or written through. `path` names it in errors.
UniqueFd create_exclusive(int at, const std::string& name, const std::string& path);
// Writes all of `data` at the descriptor's position (short writes and EINTR resumed); `written`
// is how far into the file it starts, for the error.
void write_all(const UniqueFd& fd, const std::string& path, const void* data, std::size_t bytes,
               std::uint64_t written = 0);
// fsync, then close: a write is durable only if both succeed.
void sync_and_close(UniqueFd& fd, const std::string& path, std::uint64_t bytes);
// create_exclusive, write_all, sync_and_close.
void write_file_synced(const std::string& path, const void* data, std::size_t bytes);
void write_file_synced(const Directory& dir, const std::string& name, const void* data, std::size_t bytes);
// Reads exactly `bytes` at `offset` (a file that ends first is an IoError: truncated).
void read_at(int fd, const std::string& path, void* data, std::size_t bytes, std::uint64_t offset);
// Makes the directory's entries (a file created or renamed in it) durable.
void fsync_directory(const std::string& path);
// Renames `from` to `to` unless `to` exists (then IoError, EEXIST): whatever appeared there is
// kept. Where the file system lacks RENAME_NOREPLACE, a file is linked then unlinked, and a
// directory renamed (a rename cannot replace a file or a non-empty directory with one).
void rename_noreplace(const std::string& from, const std::string& to, const std::string& what);

}  // namespace zest
