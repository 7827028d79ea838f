// The memory plan's sub-group sizes in closed form (what `zest estimate` uses, SubGroups::
// sizes_only) are those of the listed sub-groups the engine builds its pipeline from, and the plan
// of an estimate holds no per-sub-group entry however many sub-groups there are (issue 21: a
// 10^12-parameter estimate at sub_group 1 aborted with bad_alloc).
#include "engine/plan/memory_plan.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "zest/error.hpp"
#include "zest/estimate.hpp"

namespace zest::engine {
namespace {

Config offload_config(OffloadDevice device, double ratio, bool update_ahead, std::size_t sub_group_bytes) {
  Config c;
  c.stage = 2;
  c.precision.dtype = DType::bf16;
  c.offload.optimizer.device = device;
  c.offload.optimizer_ratio = ratio;
  c.offload.optimizer_update_ahead = update_ahead;
  c.offload.sub_group_bytes = sub_group_bytes;
  return c;
}

TEST(MemoryPlan, ClosedFormSubGroupSizesAreThoseOfTheListedSubGroups) {
  const std::vector<ParamSpec> model = {{"a", {1000}, 0}, {"b", {77, 13}, 1}, {"c", {5}, 2}, {"d", {4096}, 3}};
  for (int partitions : {1, 2, 3}) {
    const Layout layout(model, partitions);
    for (OffloadDevice device : {OffloadDevice::cpu, OffloadDevice::nvme})
      for (double ratio : {1.0, 0.5})
        for (bool update_ahead : {false, true})
          for (std::size_t sub_group : {std::size_t{768}, std::size_t{12 * 128}, std::size_t{12 * 1000},
                                        std::size_t{256} << 20}) {
            if (update_ahead && ratio != 1.0) continue;
            SCOPED_TRACE(testing::Message()
                         << "partitions " << partitions << " nvme " << (device == OffloadDevice::nvme) << " ratio "
                         << ratio << " update_ahead " << update_ahead << " sub_group " << sub_group);
            const Config c = offload_config(device, ratio, update_ahead, sub_group);
            const MemoryPlan listed = plan_memory(c, layout, SubGroups::listed);
            const MemoryPlan sizes = plan_memory(c, layout, SubGroups::sizes_only);
            const OptimizerOffloadPlan& l = listed.optimizer_offload;
            const OptimizerOffloadPlan& s = sizes.optimizer_offload;
            EXPECT_TRUE(s.sub_groups.empty());
            ASSERT_EQ(l.sub_groups.size(), l.sub_group_count);
            EXPECT_EQ(s.sub_group_count, l.sub_group_count);
            std::size_t largest = 0, nvme = 0;
            for (const SubGroupPlace& sub : l.sub_groups) {
              largest = std::max(largest, sub.count);
              nvme += (3 * sub.count * sizeof(float) + kNvmeAlignment - 1) / kNvmeAlignment * kNvmeAlignment;
            }
            if (device != OffloadDevice::nvme) nvme = 0;
            if (update_ahead) nvme *= 2;
            EXPECT_EQ(l.largest, largest);
            EXPECT_EQ(s.largest, largest);
            EXPECT_EQ(l.nvme_bytes, nvme);
            EXPECT_EQ(s.nvme_bytes, nvme);
            EXPECT_EQ(s.pinned_bytes, l.pinned_bytes);
            EXPECT_EQ(sizes.device_total, listed.device_total);
            EXPECT_EQ(sizes.pinned_total, listed.pinned_total);
            EXPECT_EQ(sizes.nvme_total, listed.nvme_total);
          }
  }
}

// 10^15 parameters at the smallest sub-group: ~10^13 sub-groups, sized without listing one.
TEST(MemoryPlan, AnEstimateAtTheSmallestSubGroupListsNothing) {
  const Config c = offload_config(OffloadDevice::nvme, 1.0, false, 768);
  const Layout layout(uniform_model(std::size_t{1'000'000'000'000'000}, 32), 1);
  const MemoryPlan p = plan_memory(c, layout, SubGroups::sizes_only);
  EXPECT_TRUE(p.optimizer_offload.sub_groups.empty());
  EXPECT_GE(p.optimizer_offload.sub_group_count, std::size_t{1'000'000'000'000'000} / 64);
  EXPECT_EQ(p.optimizer_offload.largest, 64u);
}

// A layout whose elements (each group padded for its partitions) would not leave room for the
// byte counts derived from it is an error naming the cause, never a wrapped size.
// The master weights are the parameters' own memory only where both are fp32 on the device: fp32
// parameters and master, nothing offloaded; the device then holds m and v alone (fp32: 8 bytes per
// parameter; bf16: 4; int8: 2 and a scale per 64 for each).
TEST(MemoryPlan, TheMasterIsTheParametersOnlyWhereBothAreFp32OnTheDevice) {
  const Layout layout({{"a", {1000}, 0}, {"b", {77, 13}, 1}}, 2);
  const auto plan = [&](auto change) {
    Config c;
    change(c);
    return plan_memory(c, layout);
  };
  for (int stage = 0; stage <= 3; ++stage) {
    const MemoryPlan p = plan([&](Config& c) { c.stage = stage; });
    EXPECT_TRUE(p.device_states.master_in_params) << stage;
    EXPECT_EQ(p.device_states.bytes, 8 * layout.shard_numel()) << stage;
  }
  const std::size_t n = layout.shard_numel();
  EXPECT_EQ(plan([](Config& c) { c.optimizer.states = StatesFormat::bf16; }).device_states.bytes, 4 * n);
  EXPECT_EQ(plan([](Config& c) { c.optimizer.states = StatesFormat::int8; }).device_states.bytes,
            2 * n + 2 * n / 64 * 4);
  const MemoryPlan apart[] = {
      plan([](Config& c) { c.precision.dtype = DType::bf16; }),
      plan([](Config& c) {
        c.precision.dtype = DType::bf16;
        c.optimizer.states = StatesFormat::int8;
        c.optimizer.master = DType::bf16;
      }),
      plan([](Config& c) { c.offload.optimizer.device = OffloadDevice::cpu; }),
      plan([](Config& c) {
        c.stage = 3;
        c.offload.param.device = OffloadDevice::cpu;
      }),
  };
  for (const MemoryPlan& p : apart) EXPECT_FALSE(p.device_states.master_in_params);
  EXPECT_EQ(apart[0].device_states.bytes, 12 * n);
  EXPECT_EQ(apart[1].device_states.bytes, 4 * n + 2 * n / 64 * 4);
  EXPECT_EQ(apart[3].device_states.bytes, 12 * n);
}

TEST(Layout, ElementsPastTheLimitAreRefused) {
  std::vector<ParamSpec> model;
  for (int g = 0; g < 8; ++g)
    model.push_back({std::string("g").append(std::to_string(g)), {std::size_t{1} << 55}, g});
  try {
    const Layout layout(model, 1 << 20);
    FAIL() << "a layout of " << layout.full_numel() << " elements";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("use fewer ranks"), std::string::npos) << error.what();
  }
}

}  // namespace
}  // namespace zest::engine
