// base/files.hpp: the owning descriptor closes what it owns once; a regular file is read whole
// within its bound; everything else (a directory, a FIFO, a device, a link where links are refused,
// a file over the bound or growing past it) is reported, without blocking and without reading it.
// Writes create their file or fail: nothing existing, a link included, is overwritten or written
// through; a rename never replaces what appeared at its target; a directory held open lists and
// writes where it was opened, whatever is moved to its path since.
#include "base/files.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "zest/error.hpp"

namespace zest {
namespace {

namespace fs = std::filesystem;

bool open_fd(int fd) { return ::fcntl(fd, F_GETFD) != -1; }

class Files : public testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (fs::temp_directory_path() / "zest-files-test-XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    dir = pattern;
    std::ofstream(dir + "/text") << "twelve bytes";
  }
  void TearDown() override { fs::remove_all(dir); }
  std::string dir;
};

TEST(UniqueFd, ClosesWhatItOwnsOnceAndHandsItOn) {
  int raw = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  ASSERT_GE(raw, 0);
  {
    UniqueFd owner(raw);
    UniqueFd moved = std::move(owner);
    EXPECT_FALSE(owner);
    EXPECT_EQ(moved.get(), raw);
    EXPECT_TRUE(open_fd(raw));
  }
  EXPECT_FALSE(open_fd(raw));

  UniqueFd closing(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  raw = closing.get();
  EXPECT_EQ(closing.close(), 0);
  EXPECT_FALSE(open_fd(raw));
  EXPECT_EQ(closing.close(), 0);  // nothing left to close

  UniqueFd replaced(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  raw = replaced.get();
  replaced = UniqueFd(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  EXPECT_FALSE(open_fd(raw));  // the one it held before
  EXPECT_TRUE(open_fd(replaced.get()));
}

TEST_F(Files, ARegularFileIsReadWholeWithinItsBound) {
  FileProblem problem;
  UniqueFd fd = open_regular(AT_FDCWD, dir + "/text", true, problem);
  ASSERT_TRUE(fd);
  EXPECT_FALSE(problem);
  EXPECT_EQ(read_whole(fd.get(), 12, problem), "twelve bytes");
  EXPECT_FALSE(problem);

  fd = open_regular(AT_FDCWD, dir + "/text", true, problem);
  EXPECT_EQ(read_whole(fd.get(), 11, problem), "");
  EXPECT_EQ(problem.kind, FileProblem::Kind::too_large);
  EXPECT_EQ(problem.size, 12u);
}

// /proc files say they hold 0 bytes and then hold more: the bound holds as they are read.
TEST_F(Files, AFileThatGrowsPastTheBoundIsNotReadOn) {
  FileProblem problem;
  UniqueFd fd = open_regular(AT_FDCWD, "/proc/self/status", true, problem);
  ASSERT_TRUE(fd);
  EXPECT_EQ(read_whole(fd.get(), 16, problem), "");
  EXPECT_EQ(problem.kind, FileProblem::Kind::grew);
}

TEST_F(Files, WhatIsNotARegularFileIsNamedAndNotOpened) {
  ASSERT_EQ(::mkfifo((dir + "/fifo").c_str(), 0600), 0);
  fs::create_symlink(dir + "/text", dir + "/link");
  fs::create_directory(dir + "/sub");
  const struct {
    std::string path;
    bool follow;
    const char* kind;
  } cases[] = {
      {dir + "/fifo", true, "a FIFO"},  // opening it would block until a writer came
      {"/dev/zero", true, "a character device"},
      {dir + "/sub", true, "a directory"},
      {dir + "/link", false, "a symbolic link"},
  };
  for (const auto& c : cases) {
    FileProblem problem;
    EXPECT_FALSE(open_regular(AT_FDCWD, c.path, c.follow, problem)) << c.path;
    EXPECT_EQ(problem.kind, FileProblem::Kind::not_regular) << c.path;
    EXPECT_STREQ(problem.file_kind, c.kind) << c.path;
  }
  // Followed where the caller says a link is a user's path.
  FileProblem problem;
  EXPECT_TRUE(open_regular(AT_FDCWD, dir + "/link", true, problem));
  EXPECT_FALSE(problem);
}

TEST_F(Files, ANameInAnOpenDirectoryAndAMissingOne) {
  UniqueFd at(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  ASSERT_TRUE(at);
  FileProblem problem;
  EXPECT_TRUE(open_regular(at.get(), "text", false, problem));
  EXPECT_FALSE(open_regular(at.get(), "missing", false, problem));
  EXPECT_EQ(problem.kind, FileProblem::Kind::system);
  EXPECT_EQ(problem.error, ENOENT);
}

std::string text_of(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// The errno of the IoError `write` throws (0: none thrown).
template <typename F>
int io_errno(F write) {
  try {
    write();
  } catch (const IoError& e) {
    return e.error_number();
  }
  return 0;
}

TEST_F(Files, ASyncedWriteCreatesItsFileOrFailsLeavingWhatWasThere) {
  write_file_synced(dir + "/new", "abc", 3);
  EXPECT_EQ(text_of(dir + "/new"), "abc");
  EXPECT_EQ(io_errno([&] { write_file_synced(dir + "/text", "x", 1); }), EEXIST);
  EXPECT_EQ(text_of(dir + "/text"), "twelve bytes");
  // A link is not written through, wherever it points (here to a file that does not exist yet).
  fs::create_symlink(dir + "/elsewhere", dir + "/link");
  EXPECT_EQ(io_errno([&] { write_file_synced(dir + "/link", "x", 1); }), EEXIST);
  EXPECT_FALSE(fs::exists(dir + "/elsewhere"));
}

TEST_F(Files, ARenameNeverReplacesItsTarget) {
  write_file_synced(dir + "/from", "new", 3);
  EXPECT_EQ(io_errno([&] { rename_noreplace(dir + "/from", dir + "/text", "renaming"); }), EEXIST);
  EXPECT_EQ(text_of(dir + "/text"), "twelve bytes");
  EXPECT_EQ(text_of(dir + "/from"), "new");
  rename_noreplace(dir + "/from", dir + "/to", "renaming");
  EXPECT_EQ(text_of(dir + "/to"), "new");
  EXPECT_FALSE(fs::exists(dir + "/from"));
  // A directory too, onto an empty directory that appeared at the target.
  fs::create_directory(dir + "/d");
  fs::create_directory(dir + "/empty");
  EXPECT_EQ(io_errno([&] { rename_noreplace(dir + "/d", dir + "/empty", "renaming"); }), EEXIST);
  EXPECT_NO_THROW(fsync_directory(dir));
}

TEST_F(Files, ADirectoryHeldOpenStaysTheOneOpened) {
  fs::create_directory(dir + "/held");
  Directory held(dir + "/held");
  write_file_synced(held, "a", "1", 1);
  const FileIdentity original = held.identity();
  // Someone moves it away and puts a link to elsewhere at its path: zest still writes into it.
  fs::rename(dir + "/held", dir + "/moved");
  fs::create_directory(dir + "/other");
  fs::create_directory_symlink(dir + "/other", dir + "/held");
  write_file_synced(held, "b", "2", 1);
  EXPECT_EQ(text_of(dir + "/moved/b"), "2");
  EXPECT_FALSE(fs::exists(dir + "/other/b"));
  std::vector<std::string> names = held.names();
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"a", "b"}));
  EXPECT_TRUE(path_names(dir + "/moved", original));
  EXPECT_FALSE(path_names(dir + "/held", original));  // the link is not followed
  EXPECT_NO_THROW(held.sync());
  // Opening a link as a directory is refused.
  EXPECT_EQ(io_errno([&] { Directory refused(dir + "/held"); }), ENOTDIR);
}

TEST_F(Files, AReadAtAnOffsetIsExactOrNamesTheTruncation) {
  UniqueFd fd(::open((dir + "/text").c_str(), O_RDONLY | O_CLOEXEC));
  char out[5] = {};
  read_at(fd.get(), dir + "/text", out, 5, 7);
  EXPECT_EQ(std::string(out, 5), "bytes");
  EXPECT_EQ(io_errno([&] { read_at(fd.get(), dir + "/text", out, 5, 8); }), EIO);
}

}  // namespace
}  // namespace zest
