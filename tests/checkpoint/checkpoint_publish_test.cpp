// A save's temporary directory against someone who can write the directory a checkpoint goes in
// (a shared checkpoint directory; a trainer running as root): whatever they put at zest's paths
// while a save runs receives no byte, and nothing is published through it. Each rank writes by
// name in the directory rank 0 created, held open; another rank opening that path refuses a link
// or another directory; publish refuses a temporary directory that was moved away.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <stdlib.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "checkpoint/format.hpp"
#include "checkpoint/publish.hpp"
#include "checkpoint/synthetic_checkpoint.hpp"
#include "zest/checkpoint.hpp"
#include "zest/error.hpp"

namespace zest::checkpoint {
namespace {

namespace fs = std::filesystem;

class SaveTempDir : public testing::Test {
 protected:
  void SetUp() override {
    char name[] = "/tmp/zest-publish-test-XXXXXX";
    ASSERT_NE(::mkdtemp(name), nullptr);
    dir = name;
    target = dir + "/ckpt";
    ASSERT_TRUE(fs::create_directory(dir + "/victim"));
  }
  void TearDown() override { fs::remove_all(dir); }

  // The neighbour's move: the directory at `path` goes to `to`, and `put` (a symlink to the
  // victim's directory, or a directory of its own) takes its path.
  void swap_out(const std::string& path, const std::string& to, bool symlink) {
    ASSERT_EQ(::rename(path.c_str(), to.c_str()), 0);
    if (symlink) ASSERT_EQ(::symlink((dir + "/victim").c_str(), path.c_str()), 0);
    else ASSERT_EQ(::mkdir(path.c_str(), 0755), 0);
  }

  std::string dir, target;
};

TEST_F(SaveTempDir, IsNeverAPathThatExisted) {
  ASSERT_TRUE(fs::create_directory(temp_dir(target, 7)));
  const TempDir made = create_temp_dir(target, 7);
  EXPECT_EQ(made.token, 8u);
  EXPECT_EQ(made.dir.path(), target + ".tmp-8");
  EXPECT_TRUE(fs::is_empty(temp_dir(target, 7)));
}

// A cleanup of crashed saves (`flock -n DIR.tmp-N rm -r DIR.tmp-N`) finds a live save's
// directory locked, and a dead one's free.
TEST_F(SaveTempDir, IsLockedWhileTheSaveHoldsIt) {
  const auto lockable = [](const std::string& path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY);
    const bool free = fd >= 0 && ::flock(fd, LOCK_EX | LOCK_NB) == 0;
    if (fd >= 0) ::close(fd);
    return free;
  };
  std::string path;
  {
    const TempDir made = create_temp_dir(target, 1);
    path = made.dir.path();
    EXPECT_FALSE(lockable(path));
  }
  EXPECT_TRUE(lockable(path));
}

TEST_F(SaveTempDir, FilesGoWhereItWasCreatedWhenASymlinkTakesItsPath) {
  const TempDir made = create_temp_dir(target, 1);
  swap_out(made.dir.path(), dir + "/moved", true);
  const char manifest[] = "manifest text";
  write_file_synced(made.dir, kManifestName, manifest, sizeof manifest);
  FileWriter writer(made.dir, state_file_name(0, StateKind::master));
  writer.append("state", 5);
  writer.finish();
  made.dir.sync();
  EXPECT_TRUE(fs::is_empty(dir + "/victim")) << "a file was written through the planted link";
  EXPECT_EQ(fs::file_size(dir + "/moved/" + kManifestName), sizeof manifest);
  EXPECT_EQ(fs::file_size(dir + "/moved/" + state_file_name(0, StateKind::master)), 5u);

  // Another rank opening the path refuses the link; publish refuses to put it in place.
  try {
    open_temp_dir(made.dir.path(), made.dir.identity().inode);
    ADD_FAILURE() << "another rank opened the planted link";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("is not the temporary directory rank 0 created"), std::string::npos)
        << e.what();
  }
  try {
    publish(made.dir, target, {});
    ADD_FAILURE() << "published through the planted link";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("was moved away while the save ran"), std::string::npos) << e.what();
  }
  struct stat info {};
  EXPECT_NE(::lstat(target.c_str(), &info), 0) << "something was published at the target";
  EXPECT_TRUE(fs::is_empty(dir + "/victim"));
}

TEST_F(SaveTempDir, AnotherDirectoryAtItsPathIsRefusedByTheOtherRanks) {
  const TempDir made = create_temp_dir(target, 1);
  swap_out(made.dir.path(), dir + "/moved", false);
  try {
    open_temp_dir(made.dir.path(), made.dir.identity().inode);
    ADD_FAILURE() << "another rank opened the directory put in its place";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("is not the temporary directory rank 0 created"), std::string::npos)
        << e.what();
  }
  // The one rank 0 holds is found wherever it went.
  EXPECT_NO_THROW(Directory(dir + "/moved"));
  EXPECT_EQ(Directory(dir + "/moved").identity(), made.dir.identity());
}

// Publish only what was verified (issue 34 item 1): a file someone removes from the temporary
// directory while a save runs (README's advice of old: `rm -rf ck.tmp-*`) is found before the
// previous checkpoint's files are deleted; that checkpoint goes back to the target and the error
// says where both are. Scripted: the new checkpoint is complete, then a file goes, then publish.
class PublishVerified : public SaveTempDir {
 protected:
  // A complete checkpoint in `made` (a copy of one written at `from`), and the files its manifest lists.
  std::vector<StateFile> fill(const TempDir& made, const std::string& from) {
    std::vector<StateFile> files;
    const Manifest m = read_manifest(from);
    for (const RankEntry& r : m.ranks) files.insert(files.end(), r.files.begin(), r.files.end());
    for (const auto& entry : fs::directory_iterator(from))
      fs::copy_file(entry.path(), made.dir.path_of(entry.path().filename().string()));
    return files;
  }
  const std::vector<ParamSpec> specs{{"w", {300}, 0}, {"b", {7}, 1}};
};

TEST_F(PublishVerified, AFileRemovedBeforeTheRenameKeepsThePreviousCheckpoint) {
  synthetic_checkpoint::write(target, specs, 2, 64);
  synthetic_checkpoint::write(dir + "/next", specs, 2, 64);
  const std::vector<std::string> before = zest::verify_checkpoint(target);
  ASSERT_TRUE(before.empty());
  const TempDir made = create_temp_dir(target, 1);
  const std::vector<StateFile> files = fill(made, dir + "/next");
  EXPECT_TRUE(check_saved_files(made.dir, files, 64, true).empty());
  fs::remove(made.dir.path_of(files[1].name));  // the race: gone after the ranks checked their files
  try {
    publish(made.dir, target, files);
    ADD_FAILURE() << "a checkpoint missing a file was published";
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find(files[1].name + ": missing"), std::string::npos) << message;
    EXPECT_NE(message.find("the previous checkpoint is back at " + target), std::string::npos) << message;
    EXPECT_NE(message.find("the damaged new one at " + made.dir.path()), std::string::npos) << message;
  }
  EXPECT_TRUE(zest::verify_checkpoint(target).empty()) << "the previous checkpoint was damaged or removed";
  EXPECT_TRUE(fs::exists(made.dir.path_of(kManifestName))) << "the new checkpoint's files were deleted";
}

TEST_F(PublishVerified, ChecksNameEveryFileMissingShortOrChanged) {
  synthetic_checkpoint::write(dir + "/next", specs, 1, 64);
  const TempDir made = create_temp_dir(target, 1);
  const std::vector<StateFile> files = fill(made, dir + "/next");
  ASSERT_EQ(files.size(), 3u);
  fs::remove(made.dir.path_of(files[0].name));
  fs::resize_file(made.dir.path_of(files[1].name), files[1].bytes - 1);
  {
    std::fstream changed(made.dir.path_of(files[2].name), std::ios::in | std::ios::out | std::ios::binary);
    changed.seekp(70);
    changed.put('\x5a');
  }
  const std::vector<std::string> sizes = check_saved_files(made.dir, files, 64, false);
  ASSERT_EQ(sizes.size(), 2u);
  EXPECT_NE(sizes[0].find(": missing"), std::string::npos) << sizes[0];
  EXPECT_NE(sizes[1].find("bytes, the manifest says"), std::string::npos) << sizes[1];
  const std::vector<std::string> all = check_saved_files(made.dir, files, 64, true);
  ASSERT_EQ(all.size(), 3u);
  EXPECT_NE(all[2].find("chunk 1 at byte 64 does not match its checksum"), std::string::npos) << all[2];
}

}  // namespace
}  // namespace zest::checkpoint
