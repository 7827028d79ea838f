// NvmeStore errors: each one an IoError naming the path, offset, length and errno, from real
// file systems where this machine lets a test make one (a read-only or 1 MiB tmpfs, a ramfs that
// refuses O_DIRECT: root may mount them), else from the completion hook (EIO, ENOSPC on a write).
#include <fcntl.h>
#include <sys/mount.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <string>
#include <vector>

#include "offload/nvme_store.hpp"
#include "runtime/watchdog.hpp"
#include "scratch_dir.hpp"
#include "zest/error.hpp"

namespace zest::offload {
namespace {

NvmeStoreOptions options_for(const std::string& directory, bool checksum = false) {
  NvmeStoreOptions options;
  options.directories = {directory};
  options.io.block_size = 1 << 14;
  options.io.queue_depth = 4;
  options.io.checksum = checksum;
  return options;
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

TEST(NvmeStoreErrors, MissingDirectoryNamesItAndTheErrno) {
  test::ScratchDir dir;
  const std::string missing = dir.path() + "/not-there";
  try {
    NvmeStore store(options_for(missing));
    FAIL() << "a store opened in a missing directory";
  } catch (const IoError& error) {
    EXPECT_EQ(error.path(), missing);
    EXPECT_EQ(error.error_number(), ENOENT);
    EXPECT_TRUE(contains(error.what(), missing)) << error.what();
    EXPECT_TRUE(contains(error.what(), "missing")) << error.what();
  }
}

TEST(NvmeStoreErrors, UnwritableDirectoryNamesTheFileAndTheErrno) {
  test::ScratchDir dir;
  if (::geteuid() != 0) {
    ASSERT_EQ(::chmod(dir.path().c_str(), 0500), 0);
  } else if (!dir.mount("tmpfs", MS_RDONLY, "size=1m")) {
    GTEST_SKIP() << "running as root, and mounting a read-only tmpfs is not allowed here ("
                 << std::strerror(errno) << "): no directory root cannot write to";
  }
  try {
    NvmeStore store(options_for(dir.path()));
    FAIL() << "a store opened in an unwritable directory";
  } catch (const IoError& error) {
    EXPECT_EQ(error.path(), dir.path());  // zest's own directory cannot be made there
    EXPECT_TRUE(error.error_number() == EROFS || error.error_number() == EACCES) << error.error_number();
    EXPECT_TRUE(contains(error.what(), "not writable")) << error.what();
  }
}

TEST(NvmeStoreErrors, FullDiskIsReportedWhenTheRegionIsReservedNotMidStep) {
  test::ScratchDir dir;
  if (!dir.mount("tmpfs", 0, "size=1m"))
    GTEST_SKIP() << "mounting a 1 MiB tmpfs is not allowed here (" << std::strerror(errno) << ")";
  NvmeStore store(options_for(dir.path()));
  store.allocate("fits", 512 * 1024);
  try {
    store.allocate("too-big", 4 << 20);
    FAIL() << "4 MiB reserved on a 1 MiB file system";
  } catch (const IoError& error) {
    EXPECT_EQ(error.error_number(), ENOSPC);
    EXPECT_EQ(error.path(), store.path());
    EXPECT_EQ(error.offset(), 512u * 1024);
    EXPECT_EQ(error.length(), 4u << 20);
    EXPECT_TRUE(contains(error.what(), "disk is full")) << error.what();
  }
  EXPECT_EQ(store.region_count(), 1u) << "the failed region was recorded";
}

// A write the device fails (ENOSPC on a thin-provisioned disk, EIO) must not pass for data on
// disk: wait() throws, the region holds no data, a read of it is refused.
TEST(NvmeStoreErrors, FailedWriteIsNeverTakenForDataOnDisk) {
  test::Watchdog watchdog;
  for (int injected : {EIO, ENOSPC}) {
    test::ScratchDir dir;
    NvmeStoreOptions options = options_for(dir.path());
    std::atomic<std::size_t> fail_at{~std::size_t{0}};
    options.completion_hook = [&](const IoRequestInfo& info, int result) {
      return info.write && info.offset == fail_at.load() ? -injected : result;
    };
    NvmeStore store(options);
    const RegionId good = store.allocate("good", 1 << 16);
    const RegionId bad = store.allocate("bad", 1 << 16);
    test::PatternBuffer data(1 << 16, 1);
    store.write_async(good, data.data()).wait();
    fail_at = store.region(bad).offset + (1 << 14) * 2;  // its third block
    try {
      store.write_async(bad, data.data()).wait();
      FAIL() << "an injected errno " << injected << " passed";
    } catch (const IoError& error) {
      EXPECT_EQ(error.error_number(), injected);
      EXPECT_EQ(error.path(), store.path());
      EXPECT_EQ(error.offset(), fail_at.load());
      EXPECT_EQ(error.length(), 1u << 14);
      EXPECT_TRUE(contains(error.what(), "write to the swap file failed")) << error.what();
    }
    EXPECT_FALSE(store.holds_data(bad));
    EXPECT_TRUE(store.holds_data(good));
    try {
      store.read_async(bad, data.data()).wait();
      FAIL() << "a region whose write failed was read";
    } catch (const IoError& error) {
      EXPECT_EQ(error.error_number(), ENODATA);
      EXPECT_TRUE(contains(error.what(), "holds no data")) << error.what();
    }
    store.flush();  // the failure was seen through wait(): nothing left to report
  }
}

TEST(NvmeStoreErrors, FailureNobodyWaitedForIsRaisedByFlush) {
  test::Watchdog watchdog;
  test::ScratchDir dir;
  NvmeStoreOptions options = options_for(dir.path());
  options.completion_hook = [](const IoRequestInfo& info, int result) { return info.write ? -EIO : result; };
  NvmeStore store(options);
  const RegionId id = store.allocate("r", 4096);
  test::PatternBuffer data(4096, 1);
  { IoHandle dropped = store.write_async(id, data.data()); }  // the destructor waits, nobody looks
  try {
    store.flush();
    FAIL() << "flush passed over a failed write";
  } catch (const IoError& error) {
    EXPECT_EQ(error.error_number(), EIO);
  }
  EXPECT_NO_THROW(store.flush()) << "reported once";
}

// A file cut short behind the store's back: the kernel's read of the block returns only the bytes
// before the end (a real short read, which the store resubmits for the rest), then 0, which is an
// error rather than a retry forever.
TEST(NvmeStoreErrors, ShortFileIsAnErrorNotAnEndlessRetry) {
  test::Watchdog watchdog;
  test::ScratchDir dir;
  NvmeStore store(options_for(dir.path()));
  store.allocate("before", 4096);
  const RegionId id = store.allocate("r", 1 << 14);  // one block
  const Region region = store.region(id);
  test::PatternBuffer data(1 << 14, 1);
  store.write_async(id, data.data()).wait();
  const int fd = ::open(store.path().c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, static_cast<off_t>(region.offset + 8192)), 0);  // half the block
  ::close(fd);
  const std::size_t resubmitted = store.stats().resubmitted;
  try {
    store.read_async(id, data.data()).wait();
    FAIL() << "a read past the end of the file passed";
  } catch (const IoError& error) {
    EXPECT_EQ(error.error_number(), ENODATA);
    EXPECT_EQ(error.path(), store.path());
    EXPECT_EQ(error.offset(), region.offset + 8192) << "the rest after the short read";
    EXPECT_EQ(error.length(), 8192u);
    EXPECT_TRUE(contains(error.what(), "shorter than the region")) << error.what();
  }
  EXPECT_EQ(store.stats().resubmitted, resubmitted + 1) << "the kernel's short read was resubmitted once";
}

TEST(NvmeStoreErrors, ChecksumCatchesABitFlippedOnDisk) {
  test::Watchdog watchdog;
  for (bool checksum : {true, false}) {
    test::ScratchDir dir;
    NvmeStore store(options_for(dir.path(), checksum));
    store.allocate("before", 4096);
    const RegionId id = store.allocate("r", 3 << 14);
    const Region region = store.region(id);
    test::PatternBuffer data(region.padded_bytes, 4), back(region.padded_bytes, 0);
    store.write_async(id, data.data()).wait();
    store.flush();
    // Corrupt one byte in block 1 behind the store's back.
    const std::size_t where = region.offset + (1 << 14) + 77;
    const int fd = ::open(store.path().c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    unsigned char byte = 0;
    ASSERT_EQ(::pread(fd, &byte, 1, static_cast<off_t>(where)), 1);
    byte ^= 0x01;
    ASSERT_EQ(::pwrite(fd, &byte, 1, static_cast<off_t>(where)), 1);
    ASSERT_EQ(::fsync(fd), 0);
    ::close(fd);
    if (checksum) {
      try {
        store.read_async(id, back.data()).wait();
        FAIL() << "a corrupted block was read back without complaint";
      } catch (const IoError& error) {
        EXPECT_EQ(error.error_number(), EBADMSG);
        EXPECT_EQ(error.offset(), region.offset + (1 << 14)) << "names the corrupted block";
        EXPECT_EQ(error.length(), 1u << 14);
        EXPECT_TRUE(contains(error.what(), "checksum mismatch")) << error.what();
        EXPECT_TRUE(contains(error.what(), "'r'")) << error.what();
      }
    } else {
      // Without the checksum the flip goes through: what the checksum above is for.
      store.read_async(id, back.data()).wait();
      EXPECT_EQ(back.data()[(1 << 14) + 77], data.data()[(1 << 14) + 77] ^ 0x01);
    }
  }
}

// tmpfs takes O_DIRECT since Linux 6.6; ramfs still refuses it (EINVAL at open), so the test
// mounts a ramfs, or uses /dev/shm on kernels where tmpfs refuses.
TEST(NvmeStoreErrors, RefusedO_DirectFallsBackToBufferedIoAndSaysSoOnce) {
  test::Watchdog watchdog;
  std::unique_ptr<test::ScratchDir> dir;
  auto ramfs = std::make_unique<test::ScratchDir>();
  if (ramfs->mount("ramfs", 0, "")) {
    dir = std::move(ramfs);
  } else {
    ramfs.reset();
    auto shm = std::make_unique<test::ScratchDir>("/dev/shm");
    const std::string probe = shm->path() + "/probe";
    const int fd = ::open(probe.c_str(), O_CREAT | O_RDWR | O_DIRECT, 0600);
    if (fd >= 0) {
      ::close(fd);
      GTEST_SKIP() << "no file system here refuses O_DIRECT: mounting ramfs is not allowed and "
                      "/dev/shm (tmpfs) accepts O_DIRECT on this kernel";
    }
    dir = std::move(shm);
  }
  NvmeStoreOptions options = options_for(dir->path());
  std::vector<std::string> warnings;
  options.warn = [&](const std::string& message) { warnings.push_back(message); };
  NvmeStore store(options);
  EXPECT_FALSE(store.direct());
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_TRUE(contains(warnings[0], store.path())) << warnings[0];
  EXPECT_TRUE(contains(warnings[0], "refuses O_DIRECT")) << warnings[0];
  EXPECT_TRUE(contains(warnings[0], "buffered")) << warnings[0];
  const RegionId id = store.allocate("r", 40000);
  const Region region = store.region(id);
  test::PatternBuffer data(region.padded_bytes, 8), back(region.padded_bytes, 0);
  store.write_async(id, data.data()).wait();
  store.read_async(id, back.data()).wait();
  store.flush();
  EXPECT_EQ(std::memcmp(back.data(), data.data(), region.padded_bytes), 0);
  const auto on_disk = test::pread_file(store.path(), region.offset, region.padded_bytes);
  ASSERT_EQ(on_disk.size(), region.padded_bytes);
  EXPECT_EQ(std::memcmp(on_disk.data(), data.data(), region.padded_bytes), 0);
  EXPECT_LE(warnings.size(), 2u);  // ramfs has no fallocate either: at most one more line, once
  for (std::size_t i = 1; i < warnings.size(); ++i) EXPECT_TRUE(contains(warnings[i], "fallocate")) << warnings[i];
}

}  // namespace
}  // namespace zest::offload
