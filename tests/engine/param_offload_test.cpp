// ParamOffload alone, on the cpu device. What it proves, for shards in pinned memory and in an NVMe
// swap file, fp32 and bf16:
// - what write() sets is what fetch() brings into a device buffer, part of a shard included;
// - a step's update (begin_update, end_update, finish_updates) is what the next fetch brings, for
//   several groups in a row (the two update buffers take turns);
// - nvme: the bytes are in the swap file at the group's region; a small (resident) group has none;
// - its memory is the plan's (pinned and swap bytes);
// - nvme: a failed write surfaces from finish_updates as IoError, and every later call is refused
//   with an Error saying the parameters are unusable.
#include "engine/optimizer/param_offload.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "engine/plan/layout.hpp"
#include "engine/plan/memory_plan.hpp"
#include "offload/nvme_store.hpp"
#include "offload/scratch_dir.hpp"
#include "runtime/host/half.hpp"
#include "zest/error.hpp"

namespace zest::engine {
namespace {

// Group 2 is small enough to stay resident (persistence threshold 512 bytes).
const std::vector<ParamSpec> kModel = {
    {"a", {300}, 0}, {"b", {5, 7}, 0}, {"c", {1000}, 1}, {"d", {10}, 2}, {"e", {700}, 3}};

struct Rig {
  Rig(OffloadDevice where, DType d, std::function<int(const offload::IoRequestInfo&, int)> hook = {})
      : dtype(d), device(make_cpu_device(std::size_t{64} << 20)), stream(device->create_stream()), layout(kModel, 1) {
    Config c;
    c.stage = 3;
    c.precision.dtype = dtype;
    c.stage3.persistence_threshold_bytes = 512;
    c.offload.param.device = where;
    if (where == OffloadDevice::nvme) c.offload.param.paths = {dir.path()};
    plan = plan_memory(c, layout);
    if (where == OffloadDevice::nvme) {
      offload::NvmeStoreOptions options;
      options.directories = {dir.path()};
      options.completion_hook = std::move(hook);
      store = std::make_shared<offload::NvmeStore>(std::move(options));
    }
    params = std::make_unique<ParamOffload>(*device, layout, plan.param_offload, dtype, store);
    shard = device->allocate(layout.shard_numel() * dtype_size(dtype), MemoryCategory::params);
  }
  ~Rig() { stream->synchronize(); }

  // Distinct values per group and `seed`, exact in bf16.
  std::vector<char> values(int g, std::size_t count, int seed) const {
    std::vector<char> bytes(count * dtype_size(dtype));
    for (std::size_t i = 0; i < count; ++i)
      store_from_float(bytes.data(), dtype, i, static_cast<float>(g * 100 + seed) + static_cast<float>(i % 64) / 8.0f);
    return bytes;
  }
  std::size_t shard_bytes(int g) const { return layout.group(g).shard * dtype_size(dtype); }
  // The group's shard as fetch() brings it to the device.
  std::vector<char> fetched(int g) {
    params->fetch(g, shard.data(), 0, *stream);
    stream->synchronize();
    return std::vector<char>(shard.as<char>(), shard.as<char>() + shard_bytes(g));
  }
  // nvme: the group's shard in the swap file.
  std::vector<char> on_disk(int g) const {
    const std::vector<unsigned char> bytes = test::pread_file(
        store->path(), store->region(store->find("param.group." + std::to_string(g))).offset, shard_bytes(g));
    return std::vector<char>(bytes.begin(), bytes.end());
  }

  DType dtype;
  test::ScratchDir dir;
  std::unique_ptr<Device> device;
  std::unique_ptr<Stream> stream;
  Layout layout;
  MemoryPlan plan;
  std::shared_ptr<offload::NvmeStore> store;
  std::unique_ptr<ParamOffload> params;
  DeviceBuffer shard;
};

struct Case {
  OffloadDevice where;
  DType dtype;
};

class ParamOffloadRoundTrip : public testing::TestWithParam<Case> {};

TEST_P(ParamOffloadRoundTrip, WrittenAndUpdatedShardsAreWhatFetchBrings) {
  Rig rig(GetParam().where, GetParam().dtype);
  const bool nvme = GetParam().where == OffloadDevice::nvme;
  ASSERT_FALSE(rig.params->offloaded(2));
  EXPECT_EQ(rig.params->pinned_bytes(), rig.plan.param_offload.pinned_bytes);
  EXPECT_EQ(rig.params->nvme_bytes(), rig.plan.param_offload.nvme_bytes);
  if (nvme) {
    EXPECT_THROW(rig.store->find("param.group.2"), Error);
  }
  const int groups[] = {0, 1, 3};
  for (const int g : groups) {
    ASSERT_TRUE(rig.params->offloaded(g));
    const std::vector<char> set = rig.values(g, rig.layout.group(g).shard, 1);
    rig.params->write(g, 0, set.data(), rig.layout.group(g).shard);
    // Part of the shard: elements [5, 15).
    const std::vector<char> part = rig.values(g, 10, 7);
    rig.params->write(g, 5, part.data(), 10);
    std::vector<char> want = set;
    std::memcpy(want.data() + 5 * dtype_size(rig.dtype), part.data(), part.size());
    EXPECT_EQ(rig.fetched(g), want) << "group " << g;
    if (nvme) {
      EXPECT_EQ(rig.on_disk(g), want) << "group " << g;
    }
  }
  // A step's updates, one group after another.
  for (const int g : groups) {
    const std::vector<char> updated = rig.values(g, rig.layout.group(g).shard, 3);
    std::memcpy(rig.params->begin_update(g), updated.data(), updated.size());
    rig.params->end_update(g);
  }
  rig.params->finish_updates();
  for (const int g : groups) {
    const std::vector<char> updated = rig.values(g, rig.layout.group(g).shard, 3);
    EXPECT_EQ(rig.fetched(g), updated) << "group " << g;
    if (nvme) {
      EXPECT_EQ(rig.on_disk(g), updated) << "group " << g;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Placements, ParamOffloadRoundTrip,
                         testing::Values(Case{OffloadDevice::cpu, DType::f32}, Case{OffloadDevice::cpu, DType::bf16},
                                         Case{OffloadDevice::nvme, DType::f32},
                                         Case{OffloadDevice::nvme, DType::bf16}));

TEST(ParamOffload, AFailedWriteMakesItUnusable) {
  std::atomic<bool> fail{false};
  Rig rig(OffloadDevice::nvme, DType::f32,
          [&](const offload::IoRequestInfo& info, int result) { return info.write && fail.load() ? -EIO : result; });
  fail = true;
  std::memset(rig.params->begin_update(0), 1, rig.shard_bytes(0));
  rig.params->end_update(0);
  try {
    rig.params->finish_updates();
    FAIL() << "the failed write passed";
  } catch (const IoError& e) {
    EXPECT_EQ(e.error_number(), EIO);
  }
  try {
    rig.params->fetch(1, rig.shard.data(), 0, *rig.stream);
    FAIL() << "a fetch after the failure passed";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("offloaded parameters: unusable after an earlier I/O failure"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace zest::engine
