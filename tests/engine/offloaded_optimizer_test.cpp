// OffloadedOptimizer and its UpdatesAhead alone, on the cpu device, one rank. What it proves:
// - a step's master weights, m and v equal a double-precision reference Adam (tests/optim) within
//   float rounding, for states in pinned memory and in an NVMe swap file, gradients read in place
//   (stage 2) or staged from the device (stage 1), fp32 and bf16; the parameters written out are
//   the master weights (fp32) or their nearest bf16; cpu and nvme agree bit for bit;
// - with the parameters going to a HostParamSink, each group is begun and ended once, in order;
// - its memory is the plan's (pinned and swap bytes);
// - with update_ahead, work ahead is kept when the step's arguments are those assumed, redone when
//   they differ, dropped by retract(), skip_step() and a visit of the states; in every case the
//   states equal those of the optimizer without update_ahead, bit for bit; without update_ahead
//   there are no updates ahead;
// - buffer_count below 2 is refused with an Error naming the setting.
#include "engine/optimizer/offloaded_optimizer.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "engine/plan/layout.hpp"
#include "engine/plan/memory_plan.hpp"
#include "engine/optimizer/optimizer_groups.hpp"
#include "offload/nvme_store.hpp"
#include "offload/scratch_dir.hpp"
#include "optim/adam_reference.hpp"
#include "runtime/host/half.hpp"
#include "zest/error.hpp"

namespace zest::engine {
namespace {

// Three groups; sub-groups of 128 parameters, so each group has several and the pipeline wraps
// around its three slots.
const std::vector<ParamSpec> kModel = {{"a", {300}, 0}, {"b", {5, 7}, 0}, {"c", {1000}, 1}, {"e", {700}, 2}};

struct Placement {
  OffloadDevice where = OffloadDevice::cpu;
  DType dtype = DType::f32;
  int stage = 2;
  bool update_ahead = false;
  int buffer_count = 3;
};

Config make_config(const Placement& s, const std::string& swap_dir) {
  Config c;
  c.stage = s.stage;
  c.precision.dtype = s.dtype;
  c.optimizer.lr = 1e-2;
  c.optimizer.weight_decay = 0.01;
  c.offload.optimizer.device = s.where;
  if (s.where == OffloadDevice::nvme) c.offload.optimizer.paths = {swap_dir};
  c.offload.optimizer.buffer_count = s.buffer_count;
  c.offload.sub_group_bytes = 12 * 128;
  c.offload.optimizer_update_ahead = s.update_ahead;
  return c;
}

// Values a bf16 holds exactly (so the reference sees what the kernel reads), different per step.
float grad_value(std::size_t i, int step) {
  return static_cast<float>(static_cast<int>((i * 37 + static_cast<std::size_t>(step) * 11) % 64) - 32) / 16.0f;
}

struct Rig {
  explicit Rig(const Placement& s)
      : setup(s),
        config(make_config(s, dir.path())),
        device(make_cpu_device(std::size_t{64} << 20)),
        layout(kModel, 1),
        plan(plan_memory(config, layout)),
        hyper(optimizer_group_values(config)),
        runs(hyper_runs(layout, 0, optimizer_groups_of(config, kModel), hyper)),
        states_options(engine::states_options(config, layout, 0)),
        n(layout.shard_numel()),
        grads(device->allocate(n * dtype_size(s.dtype), MemoryCategory::grads)),
        outs(device->allocate(n * dtype_size(s.dtype), MemoryCategory::params)),
        stream(device->create_stream()) {
    std::shared_ptr<offload::Store> store;
    if (s.where == OffloadDevice::nvme) {
      offload::NvmeStoreOptions options;
      options.directories = {dir.path()};
      store = std::make_shared<offload::NvmeStore>(std::move(options));
    }
    optimizer =
        std::make_unique<OffloadedOptimizer>(*device, plan.optimizer_offload, s.dtype, 1, store, runs, states_options);
    std::memset(outs.data(), 0, outs.bytes());  // compared before any step writes it
    init.resize(n);
    for (std::size_t i = 0; i < n; ++i) init[i] = 0.5f + 0.001f * static_cast<float>(i % 997);
    optimizer->write_master(0, init.data(), n);
  }

  void set_grads(int step) {
    for (std::size_t i = 0; i < n; ++i) store_from_float(grads.data(), setup.dtype, i, grad_value(i, step));
  }
  void set_group_grads(int g, int step) {
    const std::size_t first = layout.group(g).shard_offset;
    for (std::size_t i = first; i < first + layout.group(g).shard; ++i)
      store_from_float(grads.data(), setup.dtype, i, grad_value(i, step));
  }
  const char* grad_of(int g) const { return grads.as<char>() + layout.group(g).shard_offset * dtype_size(setup.dtype); }
  std::vector<StepGroup> step_groups(bool to_device) const {
    std::vector<StepGroup> groups;
    for (int g = 0; g < layout.group_count(); ++g)
      groups.push_back({grad_of(g), to_device ? outs.as<char>() + layout.group(g).shard_offset * dtype_size(setup.dtype)
                                              : nullptr});
    return groups;
  }
  void step(int t, const optim::AdamStepArgs& args) {
    set_grads(t);
    optimizer->step(step_groups(true), args, nullptr);
  }
  // Master, m and v of the whole range, one after the other.
  std::vector<float> states() {
    std::vector<float> all(3 * n);
    optimizer->visit_states(0, n, false, [&](float* master, float* m, float* v, std::size_t first, std::size_t k) {
      std::memcpy(all.data() + first, master, k * sizeof(float));
      std::memcpy(all.data() + n + first, m, k * sizeof(float));
      std::memcpy(all.data() + 2 * n + first, v, k * sizeof(float));
    });
    return all;
  }

  Placement setup;
  test::ScratchDir dir;
  Config config;
  std::unique_ptr<Device> device;
  Layout layout;
  MemoryPlan plan;
  std::vector<optim::AdamHyperParams> hyper;
  HyperRuns runs;
  StatesOptions states_options;
  std::size_t n;
  DeviceBuffer grads, outs;
  std::unique_ptr<Stream> stream;
  std::vector<float> init;
  std::unique_ptr<OffloadedOptimizer> optimizer;
};

const optim::AdamStepArgs kArgs[] = {{1, 0.5, 1.0}, {2, 0.5, 0.75}, {3, 0.25, 1.0}};

class OffloadedStep : public testing::TestWithParam<Placement> {};

TEST_P(OffloadedStep, EqualsTheReferenceAdam) {
  Rig rig(GetParam());
  ASSERT_GT(rig.optimizer->sub_group_count(), static_cast<std::size_t>(rig.layout.group_count()));
  optim::test::ReferenceAdam ref(optim::hyper_params_from(rig.config.optimizer), rig.init);
  for (int t = 1; t <= 3; ++t) {
    const optim::AdamStepArgs& args = kArgs[t - 1];
    rig.step(t, args);
    std::vector<float> g(rig.n);
    for (std::size_t i = 0; i < rig.n; ++i) g[i] = grad_value(i, t);
    ref.step(g, args.step, args.grad_scale, args.clip_coef);
  }
  const std::vector<float> states = rig.states();
  EXPECT_LE(optim::test::worst_ratio(states.data(), ref.p, 1e-6, 1e-6), 1.0);
  EXPECT_LE(optim::test::worst_ratio(states.data() + rig.n, ref.m, 1e-5, 1e-7), 1.0);
  EXPECT_LE(optim::test::worst_ratio(states.data() + 2 * rig.n, ref.v, 1e-5, 1e-9), 1.0);
  for (std::size_t i = 0; i < rig.n; ++i) {
    const float master = states[i], out = load_as_float(rig.outs.data(), GetParam().dtype, i);
    if (GetParam().dtype == DType::f32) {
      ASSERT_EQ(out, master) << i;
    } else {
      // The nearest bf16: a bf16 value (low 16 bits zero) within half a bf16 ulp (2^-8 relative).
      std::uint32_t bits;
      std::memcpy(&bits, &out, 4);
      ASSERT_EQ(bits & 0xffffu, 0u) << i;
      ASSERT_LE(std::fabs(out - master), std::fabs(master) * 0x1p-8f) << i;
    }
  }
  EXPECT_EQ(rig.optimizer->pinned_bytes(), rig.plan.optimizer_offload.pinned_bytes);
  EXPECT_EQ(rig.optimizer->nvme_bytes(), rig.plan.optimizer_offload.nvme_bytes);
  if (GetParam().where == OffloadDevice::nvme) {
    EXPECT_GT(rig.optimizer->nvme_bytes(), 0u);
  }
}

INSTANTIATE_TEST_SUITE_P(Placements, OffloadedStep,
                         testing::Values(Placement{OffloadDevice::cpu, DType::f32, 2},
                                         Placement{OffloadDevice::nvme, DType::f32, 2},
                                         Placement{OffloadDevice::cpu, DType::bf16, 1},
                                         Placement{OffloadDevice::nvme, DType::bf16, 1}));

TEST(OffloadedOptimizer, CpuAndNvmeStatesAreBitIdentical) {
  Rig cpu(Placement{OffloadDevice::cpu, DType::bf16, 2});
  Rig nvme(Placement{OffloadDevice::nvme, DType::bf16, 2});
  for (int t = 1; t <= 3; ++t) {
    cpu.step(t, kArgs[t - 1]);
    nvme.step(t, kArgs[t - 1]);
  }
  const std::vector<float> a = cpu.states(), b = nvme.states();
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(cpu.outs.data(), nvme.outs.data(), cpu.outs.bytes()), 0);
}

// Records what a sink sees: the order of begin/end calls and each group's buffer.
class RecordingSink final : public HostParamSink {
 public:
  explicit RecordingSink(const Rig& rig) : rig_(rig) {
    for (int g = 0; g < rig.layout.group_count(); ++g)
      buffers_.emplace_back(rig.layout.group(g).shard * dtype_size(rig.setup.dtype));
  }
  void* begin_update(int group) override {
    calls.push_back("begin " + std::to_string(group));
    return buffers_[static_cast<std::size_t>(group)].data();
  }
  void end_update(int group) override { calls.push_back("end " + std::to_string(group)); }
  // Group g's updated parameters at element i of its shard, as floats.
  float at(int g, std::size_t i) const {
    return load_as_float(buffers_[static_cast<std::size_t>(g)].data(), rig_.setup.dtype, i);
  }
  std::vector<std::string> calls;

 private:
  const Rig& rig_;
  std::vector<std::vector<char>> buffers_;
};

TEST(OffloadedOptimizer, ParametersGoToTheSinkOnceAGroup) {
  for (const OffloadDevice where : {OffloadDevice::cpu, OffloadDevice::nvme}) {
    Rig rig(Placement{where, DType::f32, 2});
    RecordingSink sink(rig);
    rig.set_grads(1);
    rig.optimizer->step(rig.step_groups(false), kArgs[0], &sink);
    EXPECT_EQ(sink.calls, (std::vector<std::string>{"begin 0", "end 0", "begin 1", "end 1", "begin 2", "end 2"}));
    std::vector<float> master(rig.n);
    rig.optimizer->read_master(0, master.data(), rig.n);
    for (int g = 0; g < rig.layout.group_count(); ++g)
      for (std::size_t i = 0; i < rig.layout.group(g).shard; ++i)
        ASSERT_EQ(sink.at(g, i), master[rig.layout.group(g).shard_offset + i]) << "group " << g << " element " << i;
  }
}

TEST(OffloadedOptimizer, RefusesFewerThanTwoBuffers) {
  Placement s;
  s.buffer_count = 1;
  try {
    Rig rig(s);
    FAIL() << "an optimizer with one buffer was built";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("offload.optimizer.buffer_count must be at least 2"), std::string::npos)
        << e.what();
  }
}

TEST(OffloadedOptimizer, NoUpdatesAheadWithoutUpdateAhead) {
  Rig rig(Placement{});
  EXPECT_EQ(rig.optimizer->updates_ahead(), nullptr);
}

// update_ahead: each case against the same optimizer without it, given the same gradients.
class WithUpdatesAhead : public testing::TestWithParam<OffloadDevice> {
 protected:
  WithUpdatesAhead()
      : plain(Placement{GetParam(), DType::bf16, 2, false}), ahead(Placement{GetParam(), DType::bf16, 2, true}) {}

  // Hands every group's gradient of step t over, assuming `assumed`, and waits until the thread has
  // it (the stream runs the hand-over).
  void hand_over_all(int t, const optim::AdamStepArgs& assumed) {
    ahead.set_grads(t);
    for (int g = 0; g < ahead.layout.group_count(); ++g)
      ahead.optimizer->updates_ahead()->hand_over(g, ahead.grad_of(g), assumed, *ahead.stream);
    ahead.stream->synchronize();
  }
  void expect_same_states() {
    const std::vector<float> a = plain.states(), b = ahead.states();
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0);
    EXPECT_EQ(std::memcmp(plain.outs.data(), ahead.outs.data(), plain.outs.bytes()), 0);
  }
  AheadCounts counts() const { return ahead.optimizer->updates_ahead()->counts(); }

  Rig plain, ahead;
};

TEST_P(WithUpdatesAhead, KeptWhenTheStepIsAsAssumed) {
  ASSERT_NE(ahead.optimizer->updates_ahead(), nullptr);
  for (int t = 1; t <= 2; ++t) {
    const optim::AdamStepArgs args{t, 0.5, 1.0};
    hand_over_all(t, args);
    ahead.optimizer->step(ahead.step_groups(true), args, nullptr);
    plain.step(t, args);
  }
  EXPECT_EQ(counts().kept, 6);
  EXPECT_EQ(counts().redone, 0);
  expect_same_states();
}

TEST_P(WithUpdatesAhead, RedoneWhenTheStepClips) {
  const optim::AdamStepArgs assumed{1, 0.5, 1.0}, clipped{1, 0.5, 0.75};
  hand_over_all(1, assumed);
  ahead.optimizer->step(ahead.step_groups(true), clipped, nullptr);
  plain.step(1, clipped);
  EXPECT_EQ(counts().kept, 0);
  EXPECT_EQ(counts().redone, 3);
  expect_same_states();
}

TEST_P(WithUpdatesAhead, RetractedGroupIsUpdatedByTheStepFromItsNewGradient) {
  const optim::AdamStepArgs args{1, 0.5, 1.0};
  hand_over_all(1, args);
  ahead.optimizer->updates_ahead()->retract(1, *ahead.stream);
  ahead.stream->synchronize();
  // Group 1's gradient changes after the retraction (a micro-batch too many); the others stay.
  for (Rig* rig : {&plain, &ahead}) {
    rig->set_grads(1);
    rig->set_group_grads(1, 2);
  }
  ahead.optimizer->step(ahead.step_groups(true), args, nullptr);
  plain.optimizer->step(plain.step_groups(true), args, nullptr);
  EXPECT_EQ(counts().kept, 2);
  EXPECT_EQ(counts().redone, 0);  // group 1's work was cancelled, not done
  expect_same_states();
}

TEST_P(WithUpdatesAhead, SkippedStepAndVisitDropTheWork) {
  const optim::AdamStepArgs args{1, 0.5, 1.0};
  hand_over_all(1, args);
  ahead.optimizer->updates_ahead()->finish();  // every group updated ahead, so the skip drops all three
  ahead.optimizer->updates_ahead()->skip_step();
  EXPECT_EQ(counts().redone, 3);
  EXPECT_EQ(counts().kept, 0);
  expect_same_states();  // nothing stepped on either side: the current copy was not written ahead
  hand_over_all(1, args);
  std::vector<float> master(ahead.n);
  ahead.optimizer->read_master(0, master.data(), ahead.n);  // a visit drops the work too
  ahead.optimizer->step(ahead.step_groups(true), args, nullptr);
  plain.step(1, args);
  EXPECT_EQ(counts().kept, 0);
  expect_same_states();
}

INSTANTIATE_TEST_SUITE_P(CpuAndNvme, WithUpdatesAhead, testing::Values(OffloadDevice::cpu, OffloadDevice::nvme),
                         [](const testing::TestParamInfo<OffloadDevice>& info) {
                           return std::string(info.param == OffloadDevice::cpu ? "cpu" : "nvme");
                         });

}  // namespace
}  // namespace zest::engine
