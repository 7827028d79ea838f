// NvmeStore: what it writes is on disk (read back with plain pread), regions of odd sizes round
// trip, the kernel never holds more than queue_depth requests, short transfers are resubmitted.
// Files go to /tmp, which is the machine's disk (ext4) here, not a tmpfs.
#include "offload/nvme_store.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "runtime/watchdog.hpp"
#include "scratch_dir.hpp"
#include "zest/error.hpp"

namespace zest::offload {
namespace {

NvmeStoreOptions options_for(const test::ScratchDir& dir, std::size_t block_size, int queue_depth) {
  NvmeStoreOptions options;
  options.directories = {dir.path()};
  options.rank = 3;
  options.io.block_size = block_size;
  options.io.queue_depth = queue_depth;
  return options;
}

// Whether `path` is DIRECTORY/zest-<host>-<pid>-<random>/NAME: a file in zest's own directory.
bool in_own_directory(const std::string& path, const std::string& directory, const std::string& name) {
  const std::string prefix = directory + "/zest-";
  const std::string suffix = "/" + name;
  return path.rfind(prefix, 0) == 0 && path.size() > prefix.size() + suffix.size() &&
         path.compare(path.size() - suffix.size(), suffix.size(), suffix) == 0 &&
         path.find('/', prefix.size()) == path.size() - suffix.size();
}

std::vector<std::string> entries(const std::string& directory) {
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(directory)) names.push_back(entry.path().filename());
  std::sort(names.begin(), names.end());
  return names;
}

void write_file(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

bool equal_prefix(const unsigned char* a, const unsigned char* b, std::size_t bytes) {
  return std::memcmp(a, b, bytes) == 0;
}

TEST(NvmeStore, OneO_DirectFilePerRankThatIsRemovedAtTheEnd) {
  test::ScratchDir dir;
  std::string path;
  {
    NvmeStore store(options_for(dir, 1 << 16, 4));
    path = store.path();
    EXPECT_TRUE(in_own_directory(path, dir.path(), "zest-rank3.swap")) << path;
    EXPECT_TRUE(store.direct()) << "/tmp is ext4 here, which takes O_DIRECT";
    EXPECT_EQ(::access(path.c_str(), F_OK), 0);
  }
  EXPECT_NE(::access(path.c_str(), F_OK), 0) << "the swap file outlived its store";
  EXPECT_TRUE(entries(dir.path()).empty()) << "zest's directory outlived its store";
}

// The offload directory is shared ground: a hostile user who can write it plants symlinks and
// files under every name zest ever used there; zest opens, truncates and removes none of them.
TEST(NvmeStore, PlantedSymlinksAndForeignFilesInTheDirectoryAreNeverTouched) {
  test::ScratchDir dir, elsewhere;
  const std::string victim = elsewhere.path() + "/precious";
  write_file(victim, "precious data");
  write_file(dir.path() + "/zest-rank3.swap", "a user's file");  // the name zest used to take
  ASSERT_EQ(::symlink(victim.c_str(), (dir.path() + "/zest-rank3.swap.link").c_str()), 0);
  ASSERT_EQ(::symlink(elsewhere.path().c_str(), (dir.path() + "/zest-vm-1-planted").c_str()), 0);
  std::string path;
  {
    NvmeStore store(options_for(dir, 1 << 16, 4));
    path = store.path();
    const RegionId id = store.allocate("a", 1 << 20);
    test::PatternBuffer data(store.region(id).padded_bytes, 7);
    store.write_async(id, data.data()).wait();
    store.flush();
  }
  EXPECT_EQ(read_file(victim), "precious data");
  EXPECT_EQ(read_file(dir.path() + "/zest-rank3.swap"), "a user's file");
  EXPECT_EQ(entries(elsewhere.path()), std::vector<std::string>{"precious"});
  EXPECT_EQ(entries(dir.path()),
            (std::vector<std::string>{"zest-rank3.swap", "zest-rank3.swap.link", "zest-vm-1-planted"}));
}

// Two stores on one directory and rank (two engines of one process, or two jobs started at once)
// each get files of their own: what one writes, the other never reads.
TEST(NvmeStore, TwoStoresOnOneDirectoryAndRankKeepTheirOwnFiles) {
  test::Watchdog watchdog;
  test::ScratchDir dir;
  NvmeStore first(options_for(dir, 1 << 16, 4)), second(options_for(dir, 1 << 16, 4));
  EXPECT_NE(first.path(), second.path());
  const RegionId a = first.allocate("states", 1 << 20), b = second.allocate("states", 1 << 20);
  const std::size_t bytes = first.region(a).padded_bytes;
  test::PatternBuffer ones(bytes, 1), twos(bytes, 2), back_one(bytes, 0), back_two(bytes, 0);
  first.write_async(a, ones.data()).wait();
  second.write_async(b, twos.data()).wait();
  first.read_async(a, back_one.data()).wait();
  second.read_async(b, back_two.data()).wait();
  EXPECT_TRUE(equal_prefix(back_one.data(), ones.data(), bytes));
  EXPECT_TRUE(equal_prefix(back_two.data(), twos.data(), bytes));
}

// A directory left by a job that died (no process holds its lock) is reported by name and left
// alone; a live store's directory is not called stale.
TEST(NvmeStore, StaleDirectoriesOfDeadJobsAreReportedAndLeftAlone) {
  test::ScratchDir dir;
  ASSERT_EQ(::mkdir((dir.path() + "/zest-otherhost-12345-deadbeef").c_str(), 0700), 0);
  write_file(dir.path() + "/zest-otherhost-12345-deadbeef/zest-rank0.swap", "old states");
  std::vector<std::string> warnings;
  NvmeStoreOptions options = options_for(dir, 1 << 16, 4);
  options.warn = [&](const std::string& message) { warnings.push_back(message); };
  NvmeStore live(options_for(dir, 1 << 16, 4));
  {
    NvmeStore store(options);
    ASSERT_EQ(warnings.size(), 1u);
    EXPECT_NE(warnings[0].find("zest-otherhost-12345-deadbeef"), std::string::npos) << warnings[0];
    EXPECT_EQ(warnings[0].find(live.path().substr(dir.path().size() + 1, 20)), std::string::npos)
        << "a live store's directory was called stale: " << warnings[0];
  }
  EXPECT_EQ(read_file(dir.path() + "/zest-otherhost-12345-deadbeef/zest-rank0.swap"), "old states");
}

// Jobs starting together on one directory (issue 34 item 4): a starting store's scan for stale
// directories never lands between another's mkdir and its lock, so none fails to lock its own
// directory and none calls a live one stale. Threads stand in for processes (flock conflicts
// between open files, not processes). Before, the scan's shared lock did: 68 of 170 jobs warned.
TEST(NvmeStore, StoresStartingTogetherNeitherFailNorCallEachOtherStale) {
  test::Watchdog watchdog;
  test::ScratchDir dir;
  std::mutex mutex;
  std::vector<std::string> problems;
  std::vector<std::thread> starters;
  for (int t = 0; t < 8; ++t)
    starters.emplace_back([&] {
      for (int i = 0; i < 150; ++i) {
        NvmeStoreOptions options = options_for(dir, 1 << 16, 1);
        options.warn = [&](const std::string& message) {
          const std::lock_guard lock(mutex);
          problems.push_back(message);
        };
        try {
          NvmeStore store(options);
        } catch (const std::exception& e) {
          const std::lock_guard lock(mutex);
          problems.push_back(e.what());
        }
      }
    });
  for (std::thread& t : starters) t.join();
  EXPECT_TRUE(problems.empty()) << problems.size() << " problems, the first: " << problems.front();
  EXPECT_TRUE(entries(dir.path()).empty()) << "a store left its directory behind";
}

TEST(NvmeStore, AllocatedRegionsArePreallocatedOnDisk) {
  test::ScratchDir dir;
  NvmeStore store(options_for(dir, 1 << 16, 4));
  store.allocate("a", 100000);
  store.allocate("b", 5000);
  struct stat info {};
  ASSERT_EQ(::stat(store.path().c_str(), &info), 0);
  EXPECT_EQ(static_cast<std::size_t>(info.st_size), store.used_bytes());
  // fallocate reserves blocks: the file is not sparse.
  EXPECT_GE(static_cast<std::size_t>(info.st_blocks) * 512, store.used_bytes());
}

TEST(NvmeStore, WrittenBytesAreOnDiskAtTheRegionsOffset) {
  test::Watchdog watchdog;
  test::ScratchDir dir;
  NvmeStore store(options_for(dir, 1 << 16, 4));
  store.allocate("first", 4096);
  const RegionId id = store.allocate("second", 300000);  // 5 blocks of 64 KiB, the last partial
  const Region region = store.region(id);
  ASSERT_EQ(region.offset, 4096u);
  ASSERT_EQ(region.padded_bytes, 303104u);  // 300000 rounded up to 4 KiB
  test::PatternBuffer data(region.padded_bytes, 42);
  store.write_async(id, data.data()).wait();
  store.flush();
  const auto on_disk = test::pread_file(store.path(), region.offset, region.padded_bytes);
  ASSERT_EQ(on_disk.size(), region.padded_bytes);
  EXPECT_TRUE(equal_prefix(on_disk.data(), data.data(), region.padded_bytes));
  EXPECT_TRUE(store.holds_data(id));
}

// Regions of odd sizes: each is padded up to a 4 KiB multiple (the O_DIRECT unit), so a transfer
// moves padded_bytes from an aligned buffer that large; the caller's bytes come back unchanged.
TEST(NvmeStore, ManyOddSizedRegionsRoundTrip) {
  test::Watchdog watchdog;
  for (bool checksum : {false, true}) {
    test::ScratchDir dir;
    NvmeStoreOptions options = options_for(dir, 1 << 14, 3);
    options.io.checksum = checksum;
    NvmeStore store(options);
    const std::vector<std::size_t> sizes = {1, 7, 4095, 4096, 4097, 12345, 16384, 16385, 65536 - 3, 100001, 3, 49153};
    std::vector<RegionId> ids;
    std::vector<std::unique_ptr<test::PatternBuffer>> out, in;
    std::size_t expected_offset = 0;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      ids.push_back(store.allocate(std::string("region").append(std::to_string(i)), sizes[i]));
      const Region r = store.region(ids.back());
      EXPECT_EQ(r.offset, expected_offset);
      EXPECT_EQ(r.padded_bytes % 4096, 0u);
      EXPECT_GE(r.padded_bytes, sizes[i]);
      EXPECT_LT(r.padded_bytes - sizes[i], 4096u);
      expected_offset += r.padded_bytes;
      out.push_back(std::make_unique<test::PatternBuffer>(r.padded_bytes, 100 + static_cast<unsigned>(i)));
      in.push_back(std::make_unique<test::PatternBuffer>(r.padded_bytes, 0));
      in.back()->clear(0xEE);
    }
    std::vector<IoHandle> writes;
    for (std::size_t i = 0; i < ids.size(); ++i) writes.push_back(store.write_async(ids[i], out[i]->data()));
    for (auto& handle : writes) handle.wait();
    std::vector<IoHandle> reads;
    for (std::size_t i = ids.size(); i-- > 0;) reads.push_back(store.read_async(ids[i], in[i]->data()));
    for (auto& handle : reads) handle.wait();
    for (std::size_t i = 0; i < ids.size(); ++i) {
      EXPECT_TRUE(equal_prefix(in[i]->data(), out[i]->data(), sizes[i])) << "region " << i << " checksum " << checksum;
      const auto on_disk = test::pread_file(store.path(), store.region(ids[i]).offset, sizes[i]);
      EXPECT_TRUE(equal_prefix(on_disk.data(), out[i]->data(), sizes[i])) << "region " << i;
    }
    EXPECT_EQ(store.find("region5"), ids[5]);
  }
}

TEST(NvmeStore, NeverMoreThanQueueDepthRequestsInTheKernelAndTheQueueFills) {
  test::Watchdog watchdog;
  test::ScratchDir dir;
  NvmeStore store(options_for(dir, 4096, 3));
  const RegionId a = store.allocate("a", 64 * 4096);
  const RegionId b = store.allocate("b", 32 * 4096);
  test::PatternBuffer da(64 * 4096, 1), db(32 * 4096, 2);
  IoHandle ha = store.write_async(a, da.data());
  IoHandle hb = store.write_async(b, db.data());
  ha.wait();
  hb.wait();
  const NvmeStore::Stats stats = store.stats();
  EXPECT_EQ(stats.requests, 96u) << "one request per 4 KiB block";
  EXPECT_LE(stats.max_in_flight, 3u);
  EXPECT_EQ(stats.max_in_flight, 3u) << "the queue never filled: requests went one at a time";
}

// The hook shortens the kernel's results (as a device may: a short count with no error); the
// store must send the rest again and end with every byte in place.
TEST(NvmeStore, ShortWritesAndReadsAreResubmittedForTheRest) {
  test::Watchdog watchdog;
  test::ScratchDir dir;
  NvmeStoreOptions options = options_for(dir, 1 << 16, 4);
  std::atomic<int> shortened{0};
  options.completion_hook = [&](const IoRequestInfo& info, int result) {
    // Halve every full-length result over 4 KiB (keeping 4 KiB multiples, as O_DIRECT does), and
    // interrupt a few: each piece then goes again until done.
    if (result > 4096 && static_cast<std::size_t>(result) == info.length) {
      ++shortened;
      return static_cast<int>(info.length / 2 / 4096 * 4096);
    }
    if (result == 4096 && shortened % 5 == 0) {
      ++shortened;
      return -EINTR;
    }
    return result;
  };
  NvmeStore store(options);
  const RegionId id = store.allocate("r", 200000);
  const Region region = store.region(id);
  test::PatternBuffer out(region.padded_bytes, 9), in(region.padded_bytes, 0);
  store.write_async(id, out.data()).wait();
  const std::size_t after_write = store.stats().resubmitted;
  EXPECT_GT(after_write, 4u);
  const auto on_disk = test::pread_file(store.path(), region.offset, region.padded_bytes);
  ASSERT_EQ(on_disk.size(), region.padded_bytes);
  EXPECT_TRUE(equal_prefix(on_disk.data(), out.data(), region.padded_bytes));
  store.read_async(id, in.data()).wait();
  EXPECT_GT(store.stats().resubmitted, after_write);
  EXPECT_TRUE(equal_prefix(in.data(), out.data(), region.padded_bytes));
}

TEST(NvmeStore, RegisteredBuffersUseFixedRequests) {
  test::Watchdog watchdog;
  test::ScratchDir dir;
  NvmeStore store(options_for(dir, 1 << 16, 4));
  const RegionId id = store.allocate("r", 150000);
  const Region region = store.region(id);
  test::PatternBuffer out(region.padded_bytes, 5), in(region.padded_bytes, 0), other(region.padded_bytes, 0);
  store.register_buffers({{out.data(), out.bytes()}, {in.data(), in.bytes()}});
  store.write_async(id, out.data()).wait();
  store.read_async(id, in.data()).wait();
  EXPECT_EQ(store.stats().fixed_buffer_requests, 6u) << "3 blocks written, 3 read, all from registered buffers";
  store.read_async(id, other.data()).wait();  // an unregistered buffer works too, without them
  EXPECT_EQ(store.stats().fixed_buffer_requests, 6u);
  EXPECT_TRUE(equal_prefix(in.data(), out.data(), region.padded_bytes));
  EXPECT_TRUE(equal_prefix(other.data(), out.data(), region.padded_bytes));
}

TEST(NvmeStore, ReadyTurnsTrueAndMisuseIsRefused) {
  test::Watchdog watchdog;
  test::ScratchDir dir;
  NvmeStoreOptions options = options_for(dir, 4096, 2);
  std::atomic<bool> release{false};
  options.completion_hook = [&](const IoRequestInfo&, int result) {
    while (!release.load()) std::this_thread::sleep_for(std::chrono::microseconds(100));
    return result;
  };
  NvmeStore store(options);
  const RegionId id = store.allocate("r", 8192);
  test::PatternBuffer data(8192, 3);
  IoHandle handle = store.write_async(id, data.data());
  EXPECT_FALSE(handle.ready());
  try {
    store.read_async(id, data.data());
    ADD_FAILURE() << "a read of a region under a running write was accepted";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("while another transfer of it is running"), std::string::npos)
        << error.what();
  }
  EXPECT_THROW(store.write_async(id, data.data() + 1), Error);  // not aligned
  EXPECT_THROW(store.allocate("r", 10), Error);                 // name taken
  EXPECT_THROW(store.find("nope"), Error);
  release = true;
  handle.wait();
  EXPECT_TRUE(handle.ready());
}

TEST(NvmeStore, InvalidIoSettingsAreRefused) {
  test::ScratchDir dir;
  EXPECT_THROW(NvmeStore(options_for(dir, 1000, 4)), Error);
  EXPECT_THROW(NvmeStore(options_for(dir, 4096, 0)), Error);
}

}  // namespace
}  // namespace zest::offload
