// NvmeStore over several directories (one per drive) and several rings (io.threads): the bytes of
// each region land in every directory's file at the stripe the layout says (read back with plain
// pread), in the expected amounts; every ring takes a share of the requests; errors and checksum
// failures name the file they happened in; the same directory twice is refused.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "offload/nvme_store.hpp"
#include "runtime/watchdog.hpp"
#include "scratch_dir.hpp"
#include "zest/error.hpp"

namespace zest::offload {
namespace {

constexpr std::size_t kStripe = 16384;

NvmeStoreOptions striped_options(const std::vector<std::string>& directories, int threads, bool checksum = false) {
  NvmeStoreOptions options;
  options.directories = directories;
  options.rank = 1;
  options.io.block_size = kStripe;
  options.io.queue_depth = 3;
  options.io.threads = threads;
  options.io.checksum = checksum;
  return options;
}

// The bytes of [offset, offset + length) of the store's address space, gathered from the files
// with plain pread: stripe k in file k % D at (k / D) * stripe.
std::vector<unsigned char> read_striped(const std::vector<std::string>& files, std::size_t offset, std::size_t length) {
  std::vector<unsigned char> out;
  const std::size_t d = files.size();
  for (std::size_t at = offset; at < offset + length;) {
    const std::size_t k = at / kStripe;
    const std::size_t end = std::min(offset + length, (k + 1) * kStripe);
    const auto piece = test::pread_file(files[k % d], k / d * kStripe + (at - k * kStripe), end - at);
    if (piece.size() != end - at) return {};
    out.insert(out.end(), piece.begin(), piece.end());
    at = end;
  }
  return out;
}

std::size_t file_size(const std::string& path) {
  struct stat info {};
  return ::stat(path.c_str(), &info) == 0 ? static_cast<std::size_t>(info.st_size) : 0;
}

TEST(NvmeStriping, RegionsLandInEveryDirectoryAtTheirStripesInTheExpectedAmounts) {
  test::Watchdog watchdog;
  for (const std::size_t dirs : {2u, 3u}) {
    for (const int threads : {1, 2}) {
      std::vector<std::unique_ptr<test::ScratchDir>> scratch;
      std::vector<std::string> directories;
      for (std::size_t i = 0; i < dirs; ++i) {
        scratch.push_back(std::make_unique<test::ScratchDir>());
        directories.push_back(scratch.back()->path());
      }
      std::vector<std::string> files;
      {
        NvmeStore store(striped_options(directories, threads));
        files = store.paths();
        ASSERT_EQ(files.size(), dirs);
        for (std::size_t i = 0; i < dirs; ++i) {
          EXPECT_EQ(files[i].rfind(directories[i] + "/zest-", 0), 0u) << files[i];
          EXPECT_TRUE(files[i].ends_with("/zest-rank1.swap")) << files[i];
        }
        EXPECT_TRUE(store.direct());
        EXPECT_EQ(store.rings(), static_cast<std::size_t>(threads));
        // Odd sizes, so regions start and end inside stripes.
        const std::vector<std::size_t> sizes = {1, 5 * kStripe + 4097, 4096, 3 * kStripe, 100001, 7 * kStripe - 1};
        std::vector<RegionId> ids;
        std::vector<std::unique_ptr<test::PatternBuffer>> data, back;
        std::vector<IoHandle> handles;
        for (std::size_t i = 0; i < sizes.size(); ++i) {
          ids.push_back(store.allocate(std::string("r").append(std::to_string(i)), sizes[i]));
          data.push_back(
              std::make_unique<test::PatternBuffer>(store.region(ids[i]).padded_bytes, 7 + static_cast<unsigned>(i)));
          back.push_back(std::make_unique<test::PatternBuffer>(store.region(ids[i]).padded_bytes));
          back.back()->clear(0xEE);
          handles.push_back(store.write_async(ids[i], data[i]->data()));
        }
        for (IoHandle& h : handles) h.wait();
        store.flush();
        const std::size_t used = store.used_bytes();
        // Stripe k of the used space goes to file k % D: each file holds its stripes, back to back.
        std::vector<std::size_t> expected(dirs, 0);
        for (std::size_t k = 0; k * kStripe < used; ++k)
          expected[k % dirs] = k / dirs * kStripe + std::min(kStripe, used - k * kStripe);
        const std::vector<std::size_t> reserved = store.file_bytes();
        std::size_t total = 0;
        for (std::size_t f = 0; f < dirs; ++f) {
          EXPECT_EQ(reserved[f], expected[f]) << "file " << f;
          EXPECT_EQ(file_size(files[f]), expected[f]) << files[f];
          EXPECT_GE(expected[f], used / dirs - kStripe) << "the stripes are not spread evenly";
          total += reserved[f];
        }
        EXPECT_EQ(total, used) << "striping reserves no more than one directory would";
        const NvmeStore::Stats stats = store.stats();
        std::size_t moved = 0;
        for (std::size_t f = 0; f < dirs; ++f) {
          EXPECT_EQ(stats.bytes_per_file[f], expected[f]) << "bytes written to file " << f;
          moved += stats.bytes_per_file[f];
        }
        EXPECT_EQ(moved, used);
        EXPECT_LE(stats.max_in_flight, 3u);
        for (std::size_t i = 0; i < ids.size(); ++i) {
          const Region r = store.region(ids[i]);
          const auto on_disk = read_striped(files, r.offset, r.padded_bytes);
          ASSERT_EQ(on_disk.size(), r.padded_bytes);
          EXPECT_EQ(std::memcmp(on_disk.data(), data[i]->data(), r.padded_bytes), 0) << "region " << i;
        }
        for (std::size_t i = 0; i < ids.size(); ++i) handles[i] = store.read_async(ids[i], back[i]->data());
        for (IoHandle& h : handles) h.wait();
        for (std::size_t i = 0; i < ids.size(); ++i)
          EXPECT_EQ(std::memcmp(back[i]->data(), data[i]->data(), sizes[i]), 0) << "region " << i;
      }
      for (const std::string& f : files) EXPECT_NE(::access(f.c_str(), F_OK), 0) << f << " outlived its store";
    }
  }
}

// io.threads rings share one directory's requests (block by block), and two directories' by stripe:
// with as many rings as directories, each ring drives one directory's file.
TEST(NvmeStriping, EveryRingTakesItsShareOfTheRequests) {
  test::Watchdog watchdog;
  test::ScratchDir one;
  {
    NvmeStore store(striped_options({one.path()}, 2, true));
    const RegionId id = store.allocate("a", 64 * kStripe);
    test::PatternBuffer data(64 * kStripe, 3), back(64 * kStripe);
    store.write_async(id, data.data()).wait();
    store.read_async(id, back.data()).wait();
    EXPECT_EQ(std::memcmp(back.data(), data.data(), 64 * kStripe), 0);
    const NvmeStore::Stats stats = store.stats();
    ASSERT_EQ(stats.requests_per_ring.size(), 2u);
    EXPECT_EQ(stats.requests_per_ring[0], 64u);
    EXPECT_EQ(stats.requests_per_ring[1], 64u);
  }
  test::ScratchDir a, b;
  NvmeStore store(striped_options({a.path(), b.path()}, 2, true));
  const RegionId id = store.allocate("a", 40 * kStripe);
  test::PatternBuffer data(40 * kStripe, 4), back(40 * kStripe);
  store.write_async(id, data.data()).wait();
  store.read_async(id, back.data()).wait();
  EXPECT_EQ(std::memcmp(back.data(), data.data(), 40 * kStripe), 0);
  const NvmeStore::Stats stats = store.stats();
  EXPECT_EQ(stats.requests_per_ring[0], 40u);
  EXPECT_EQ(stats.requests_per_ring[1], 40u);
  EXPECT_EQ(stats.bytes_per_file[0], 40 * kStripe);
  EXPECT_EQ(stats.bytes_per_file[1], 40 * kStripe);
}

TEST(NvmeStriping, AFailedRequestNamesItsFileAndTheOffsetInIt) {
  test::Watchdog watchdog;
  test::ScratchDir a, b;
  NvmeStoreOptions options = striped_options({a.path(), b.path()}, 2);
  options.completion_hook = [](const IoRequestInfo& info, int result) {
    return info.write && info.file == 1 && info.offset == kStripe ? -EIO : result;
  };
  NvmeStore store(options);
  const RegionId id = store.allocate("a", 8 * kStripe);
  test::PatternBuffer data(8 * kStripe, 5);
  try {
    store.write_async(id, data.data()).wait();
    FAIL() << "the write succeeded";
  } catch (const IoError& error) {
    EXPECT_EQ(error.path(), store.paths()[1]);
    EXPECT_EQ(error.offset(), kStripe);
    EXPECT_EQ(error.error_number(), EIO);
  }
  EXPECT_FALSE(store.holds_data(id));
}

TEST(NvmeStriping, ChecksumsCatchABlockChangedInTheSecondDirectory) {
  test::Watchdog watchdog;
  test::ScratchDir a, b;
  NvmeStore store(striped_options({a.path(), b.path()}, 2, true));
  const RegionId id = store.allocate("a", 6 * kStripe);
  test::PatternBuffer data(6 * kStripe, 6), back(6 * kStripe);
  store.write_async(id, data.data()).wait();
  store.flush();
  const int fd = ::open(store.paths()[1].c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  const unsigned char poison = 0x42 ^ data.data()[kStripe + 10];
  ASSERT_EQ(::pwrite(fd, &poison, 1, 10), 1);
  ::fsync(fd);
  ::close(fd);
  try {
    store.read_async(id, back.data()).wait();
    FAIL() << "the changed block was not noticed";
  } catch (const IoError& error) {
    EXPECT_EQ(error.path(), store.paths()[1]);
    EXPECT_EQ(error.offset(), 0u);
    EXPECT_EQ(error.error_number(), EBADMSG);
  }
}

TEST(NvmeStriping, TheSameDirectoryTwiceOrNoneIsRefused) {
  test::ScratchDir a;
  try {
    NvmeStore store(striped_options({a.path(), a.path() + "/"}, 1));
    FAIL() << "the same directory was taken twice";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("same directory"), std::string::npos) << error.what();
  }
  // After a directory that cannot be looked at, the two names of one directory are still the ones named.
  try {
    NvmeStore store(striped_options({a.path() + "/missing", a.path(), a.path() + "/."}, 1));
    FAIL() << "the same directory was taken twice";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("'" + a.path() + "' and '" + a.path() + "/.' are the same directory"),
              std::string::npos)
        << error.what();
  }
  EXPECT_THROW(NvmeStore(striped_options({}, 1)), Error);
  EXPECT_THROW(NvmeStore(striped_options({a.path()}, 0)), Error);
}

// A full drive among several: reserving a region fails with ENOSPC naming that drive's file, and
// nothing is recorded. Root may mount a 1 MiB tmpfs here; elsewhere the test says it skips.
TEST(NvmeStriping, AFullDriveIsAnErrorNamingItsFile) {
  test::ScratchDir a, small;
  if (!small.mount("tmpfs", 0, "size=1m")) GTEST_SKIP() << "cannot mount a small tmpfs here: " << std::strerror(errno);
  NvmeStoreOptions options = striped_options({a.path(), small.path()}, 1);
  options.io.direct = false;  // tmpfs refuses O_DIRECT
  NvmeStore store(options);
  try {
    store.allocate("big", 8 << 20);
    FAIL() << "8 MiB fitted on a 1 MiB drive";
  } catch (const IoError& error) {
    EXPECT_EQ(error.path(), store.paths()[1]);
    EXPECT_EQ(error.error_number(), ENOSPC);
  }
  EXPECT_EQ(store.region_count(), 0u);
}

}  // namespace
}  // namespace zest::offload
