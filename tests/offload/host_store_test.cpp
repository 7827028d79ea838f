#include "offload/host_store.hpp"

#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <vector>

#include "runtime/watchdog.hpp"
#include "scratch_dir.hpp"
#include "zest/error.hpp"

namespace zest::offload {
namespace {

TEST(HostStore, OddSizedRegionsRoundTripAndArePinnedMemoryCounted) {
  test::Watchdog watchdog;
  auto device = make_cpu_device(std::size_t{64} << 20);
  const std::vector<std::size_t> sizes = {1, 4095, 4097, 70001};
  {
    HostStore store(*device, IoConfig{});
    std::vector<RegionId> ids;
    std::vector<std::unique_ptr<test::PatternBuffer>> out, in;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      ids.push_back(store.allocate(std::string("r").append(std::to_string(i)), sizes[i]));
      const Region region = store.region(ids.back());
      out.push_back(std::make_unique<test::PatternBuffer>(region.padded_bytes, 20 + static_cast<unsigned>(i)));
      in.push_back(std::make_unique<test::PatternBuffer>(region.padded_bytes, 0));
    }
    EXPECT_EQ(device->pinned_stats().current, store.used_bytes());
    EXPECT_EQ(store.used_bytes(), 4096u + 4096 + 8192 + 73728);
    std::vector<IoHandle> handles;
    for (std::size_t i = 0; i < ids.size(); ++i) handles.push_back(store.write_async(ids[i], out[i]->data()));
    for (auto& h : handles) h.wait();
    for (std::size_t i = 0; i < ids.size(); ++i) {
      EXPECT_EQ(std::memcmp(store.region_data(ids[i]), out[i]->data(), sizes[i]), 0);
      store.read_async(ids[i], in[i]->data()).wait();
      EXPECT_EQ(std::memcmp(in[i]->data(), out[i]->data(), sizes[i]), 0) << "region " << i;
    }
  }
  EXPECT_EQ(device->pinned_stats().current, 0u);
}

TEST(HostStore, ReadingARegionNeverWrittenIsAnIoError) {
  auto device = make_cpu_device(std::size_t{64} << 20);
  HostStore store(*device, IoConfig{});
  const RegionId id = store.allocate("empty", 100);
  test::PatternBuffer buffer(4096, 0);
  try {
    store.read_async(id, buffer.data()).wait();
    FAIL() << "read of an unwritten region passed";
  } catch (const IoError& error) {
    EXPECT_EQ(error.error_number(), ENODATA);
    EXPECT_EQ(error.path(), "pinned host memory");
  }
}

TEST(HostStore, ChecksumCatchesCorruptedHostCopy) {
  test::Watchdog watchdog;
  auto device = make_cpu_device(std::size_t{64} << 20);
  IoConfig io;
  io.checksum = true;
  HostStore store(*device, io);
  const RegionId id = store.allocate("r", 10000);
  test::PatternBuffer data(12288, 5), back(12288, 0);
  store.write_async(id, data.data()).wait();
  store.read_async(id, back.data()).wait();
  EXPECT_EQ(std::memcmp(back.data(), data.data(), 10000), 0);
  static_cast<unsigned char*>(const_cast<void*>(store.region_data(id)))[5000] ^= 0x80;
  try {
    store.read_async(id, back.data()).wait();
    FAIL() << "corruption passed the checksum";
  } catch (const IoError& error) {
    EXPECT_EQ(error.error_number(), EBADMSG);
    EXPECT_NE(std::string(error.what()).find("checksum mismatch"), std::string::npos) << error.what();
  }
}

}  // namespace
}  // namespace zest::offload
