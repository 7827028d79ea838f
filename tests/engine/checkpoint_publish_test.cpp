// A save's temporary directory against someone who can write the directory a checkpoint goes in
// (a shared checkpoint directory; a trainer running as root): whatever they put at zest's paths
// while a save runs receives no byte, and nothing is published through it. Each rank writes by
// name in the directory rank 0 created, held open; another rank opening that path refuses a link
// or another directory; publish refuses a temporary directory that was moved away.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <string>

#include "checkpoint/format.hpp"
#include "checkpoint/publish.hpp"
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
    EXPECT_NE(std::string(e.what()).find("is not the temporary directory rank 0 created"), std::string::npos) << e.what();
  }
  try {
    publish(made.dir, target);
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
    EXPECT_NE(std::string(e.what()).find("is not the temporary directory rank 0 created"), std::string::npos) << e.what();
  }
  // The one rank 0 holds is found wherever it went.
  EXPECT_NO_THROW(Directory(dir + "/moved"));
  EXPECT_EQ(Directory(dir + "/moved").identity(), made.dir.identity());
}

}  // namespace
}  // namespace zest::checkpoint
