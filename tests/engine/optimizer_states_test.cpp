// DeviceOptimizerStates and SplitOptimizerStates alone, on the cpu device, one rank, and the step's
// arguments (step_args.hpp). What it proves:
// - device states: a step's master weights, m and v equal a double-precision reference Adam; the
//   parameters written to the device are the master weights (fp32 states alone on the device: the
//   parameters are the master, stepped in place); visit_states reads what it wrote back;
//   with the parameters going to a HostParamSink (stage 3 offloaded parameters), each group is
//   begun and ended once and holds its updated part;
// - compact states on a device the host cannot read (a stand-in: host memory that says so) pass
//   through the staging in whole blocks: writes, steps, reads and visits give the same values as on
//   the cpu device, where they are visited in place;
// - split states: the part below the boundary on the device, the rest offloaded, stepped at once:
//   the whole shard equals the reference, master weights read across the boundary are whole, and
//   the group the boundary cuts is begun once and ended once, after both parts wrote it;
// - the step's arguments: the step counts from the steps taken, the gradient scale is 1 / loss
//   scale, clipping applies only above max_norm; the assumed arguments equal the step's exactly when
//   nothing clips, and differ when the step clips.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "engine/math/device_math.hpp"
#include "engine/optimizer/device_optimizer_states.hpp"
#include "engine/plan/host_staging.hpp"
#include "engine/plan/layout.hpp"
#include "engine/plan/memory_plan.hpp"
#include "engine/optimizer/offloaded_optimizer.hpp"
#include "engine/optimizer/optimizer_groups.hpp"
#include "engine/optimizer/split_optimizer_states.hpp"
#include "engine/plan/step_args.hpp"
#include "opaque_device.hpp"
#include "optim/adam_reference.hpp"
#include "optim/states_layout.hpp"
#include "zest/error.hpp"

namespace zest::engine {
namespace {

using test::OpaqueDevice;

const std::vector<ParamSpec> kModel = {{"a", {300}, 0}, {"b", {5, 7}, 0}, {"c", {1000}, 1}, {"e", {700}, 2}};

float grad_value(std::size_t i) { return static_cast<float>(static_cast<int>((i * 37) % 64) - 32) / 16.0f; }

// Records the sink's calls and keeps each group's shard (fp32).
class RecordingSink final : public HostParamSink {
 public:
  explicit RecordingSink(const Layout& layout) {
    for (int g = 0; g < layout.group_count(); ++g) shards.emplace_back(layout.group(g).shard, -1.0f);
  }
  void* begin_update(int group) override {
    calls.push_back("begin " + std::to_string(group));
    return shards[static_cast<std::size_t>(group)].data();
  }
  void end_update(int group) override { calls.push_back("end " + std::to_string(group)); }
  std::vector<std::string> calls;
  std::vector<std::vector<float>> shards;
};

// `ratio` < 1: split states (cpu offload of the rest); `sink`: stage 3 with offloaded parameters,
// so the updated parameters go to a HostParamSink; `form`: optimizer.states and optimizer.master;
// `on`: the device (null: a cpu device).
struct Rig {
  Rig(double ratio, bool sink, optim::StatesForm form = {}, std::unique_ptr<Device> on = nullptr)
      : config(make_config(ratio, sink, form)),
        device(on ? std::move(on) : make_cpu_device(std::size_t{64} << 20)),
        stream(device->create_stream()),
        layout(kModel, 1),
        plan(plan_memory(config, layout)),
        hyper(optimizer_group_values(config)),
        runs(hyper_runs(layout, 0, optimizer_groups_of(config, kModel), hyper)),
        states_options(engine::states_options(config, layout, 0)),
        math(make_device_math(*device, hyper.front(), 1, static_cast<std::size_t>(layout.group_count()) + runs.size())),
        staging(*device, plan.engine, DType::f32),
        n(layout.shard_numel()),
        grads(device->allocate(n * sizeof(float), MemoryCategory::grads)),
        outs(device->allocate(n * sizeof(float), MemoryCategory::params)) {
    std::vector<float*> params_shards;  // states on the device alone, an fp32 master: it is `outs`
    if (plan.device_states.master_in_params)
      for (int g = 0; g < layout.group_count(); ++g)
        params_shards.push_back(outs.as<float>() + layout.group(g).shard_offset);
    auto on_device = std::make_unique<DeviceOptimizerStates>(*device, *stream, *math, layout, plan, DType::f32, staging,
                                                             runs, states_options, std::move(params_shards));
    if (ratio < 1) {
      auto offloaded = std::make_unique<OffloadedOptimizer>(*device, plan.optimizer_offload, DType::f32, 1,
                                                            nullptr, runs, states_options);
      states = std::make_unique<SplitOptimizerStates>(layout, *stream, std::move(on_device), std::move(offloaded),
                                                      plan.device_states.range.end);
    } else {
      states = std::move(on_device);
    }
    init.resize(n);
    for (std::size_t i = 0; i < n; ++i) init[i] = 0.5f + 0.001f * static_cast<float>(i % 997);
    states->write_master(0, init.data(), n);
    for (std::size_t i = 0; i < n; ++i) grads.as<float>()[i] = grad_value(i);
  }
  ~Rig() { stream->synchronize(); }

  static Config make_config(double ratio, bool sink, optim::StatesForm form) {
    Config c;
    c.stage = sink ? 3 : 2;
    c.optimizer.lr = 1e-2;
    c.optimizer.weight_decay = 0.01;
    c.optimizer.states = form.moments;
    c.optimizer.master = form.master;
    c.optimizer.seed = 7;
    if (sink) c.offload.param.device = OffloadDevice::cpu;
    if (ratio < 1) {
      c.offload.optimizer.device = OffloadDevice::cpu;
      c.offload.optimizer_ratio = ratio;
      c.offload.sub_group_bytes = 12 * 128;
    }
    return c;
  }

  // One step with `args`, its parameters to the device or to `sink`; then the reference's.
  void step(const optim::AdamStepArgs& args, HostParamSink* sink) {
    std::vector<StepGroup> groups;
    for (int g = 0; g < layout.group_count(); ++g)
      groups.push_back({grads.as<char>() + layout.group(g).shard_offset * sizeof(float),
                        sink ? nullptr : outs.as<char>() + layout.group(g).shard_offset * sizeof(float)});
    states->step(groups, args, sink);
    stream->synchronize();
  }
  std::vector<float> master() {
    std::vector<float> values(n);
    states->read_master(0, values.data(), n);
    return values;
  }

  Config config;
  std::unique_ptr<Device> device;
  std::unique_ptr<Stream> stream;
  Layout layout;
  MemoryPlan plan;
  std::vector<optim::AdamHyperParams> hyper;
  HyperRuns runs;
  StatesOptions states_options;
  std::unique_ptr<DeviceMath> math;
  HostStaging staging;
  std::size_t n;
  DeviceBuffer grads, outs;
  std::vector<float> init;
  std::unique_ptr<OptimizerStates> states;
};

// Steps twice and checks master, m and v against the reference.
void expect_reference(Rig& rig) {
  optim::test::ReferenceAdam ref(optim::hyper_params_from(rig.config.optimizer), rig.init);
  std::vector<float> g(rig.n);
  for (std::size_t i = 0; i < rig.n; ++i) g[i] = grad_value(i);
  const optim::AdamStepArgs args[] = {{1, 0.5, 1.0}, {2, 0.5, 0.75}};
  for (const optim::AdamStepArgs& a : args) {
    rig.step(a, nullptr);
    ref.step(g, a.step, a.grad_scale, a.clip_coef);
  }
  std::vector<float> states(3 * rig.n);
  rig.states->visit_states(0, rig.n, false, [&](float* master, float* m, float* v, std::size_t first, std::size_t k) {
    std::memcpy(states.data() + first, master, k * sizeof(float));
    std::memcpy(states.data() + rig.n + first, m, k * sizeof(float));
    std::memcpy(states.data() + 2 * rig.n + first, v, k * sizeof(float));
  });
  EXPECT_LE(optim::test::worst_ratio(states.data(), ref.p, 1e-6, 1e-6), 1.0);
  EXPECT_LE(optim::test::worst_ratio(states.data() + rig.n, ref.m, 1e-5, 1e-7), 1.0);
  EXPECT_LE(optim::test::worst_ratio(states.data() + 2 * rig.n, ref.v, 1e-5, 1e-9), 1.0);
  EXPECT_EQ(std::memcmp(rig.outs.data(), states.data(), rig.n * sizeof(float)), 0);
  EXPECT_EQ(rig.master(), std::vector<float>(states.begin(), states.begin() + static_cast<std::ptrdiff_t>(rig.n)));
}

TEST(DeviceOptimizerStates, StepEqualsTheReferenceAdam) {
  Rig rig(1.0, false);
  expect_reference(rig);
}

// fp32 states on the device alone: the master weights are the parameters' memory (8 bytes of
// states per parameter), written by write_master and stepped in place, so a write to the
// parameters between steps is what the next step starts from, as with torch's AdamW.
TEST(DeviceOptimizerStates, AMasterInTheParametersIsTheirMemory) {
  Rig rig(1.0, false);
  ASSERT_TRUE(rig.plan.device_states.master_in_params);
  EXPECT_EQ(rig.plan.device_states.bytes, 2 * rig.n * sizeof(float));
  EXPECT_EQ(std::memcmp(rig.outs.data(), rig.init.data(), rig.n * sizeof(float)), 0);
  for (std::size_t i = 0; i < rig.n; i += 3) rig.outs.as<float>()[i] = rig.init[i] = -2.0f * rig.init[i];
  expect_reference(rig);
}

// With compact moments too: the fp32 master is the parameters (m and v alone in the states'
// buffer), read, visited and stepped there, on the cpu device and through the staging.
TEST(DeviceOptimizerStates, ACompactStatesMasterInTheParametersIsTheirMemory) {
  for (const StatesFormat format : {StatesFormat::bf16, StatesFormat::int8}) {
    SCOPED_TRACE(states_format_name(format));
    const optim::StatesForm form{format, DType::f32};
    Rig cpu(1.0, false, form);
    Rig opaque(1.0, false, form, std::make_unique<OpaqueDevice>(std::size_t{64} << 20));
    for (Rig* rig : {&cpu, &opaque}) {
      ASSERT_TRUE(rig->plan.device_states.master_in_params);
      EXPECT_EQ(rig->plan.device_states.bytes, optim::StatesLayout::bytes(form, rig->n) - rig->n * sizeof(float));
      const auto params = [rig] { return std::vector<float>(rig->outs.as<float>(), rig->outs.as<float>() + rig->n); };
      EXPECT_EQ(params(), rig->init);
      rig->step({1, 0.5, 1.0}, nullptr);
      EXPECT_NE(params(), rig->init);  // stepped in place
      rig->outs.as<float>()[700] = 42.0f;
      EXPECT_EQ(rig->master(), params());
      std::vector<float> seen(rig->n);
      rig->states->visit_states(0, rig->n, false, [&](float* master, float*, float*, std::size_t first, std::size_t k) {
        std::memcpy(seen.data() + first, master, k * sizeof(float));
      });
      EXPECT_EQ(seen, params());
    }
  }
}

TEST(DeviceOptimizerStates, VisitWritesBackWhatItLeaves) {
  Rig rig(1.0, false);
  rig.states->visit_states(10, 500, true, [](float*, float* m, float*, std::size_t first, std::size_t k) {
    for (std::size_t i = 0; i < k; ++i) m[i] = static_cast<float>(first + i);
  });
  std::vector<float> seen;
  rig.states->visit_states(0, rig.n, false, [&](float*, float* m, float*, std::size_t, std::size_t k) {
    seen.insert(seen.end(), m, m + k);
  });
  ASSERT_EQ(seen.size(), rig.n);
  for (std::size_t i = 0; i < rig.n; ++i)
    ASSERT_EQ(seen[i], i >= 10 && i < 510 ? static_cast<float>(i - 10) : 0.0f) << i;
}

TEST(DeviceOptimizerStates, ParametersGoToTheSinkOnceAGroup) {
  Rig rig(1.0, true);
  RecordingSink sink(rig.layout);
  rig.step({1, 0.5, 1.0}, &sink);
  EXPECT_EQ(sink.calls, (std::vector<std::string>{"begin 0", "end 0", "begin 1", "end 1", "begin 2", "end 2"}));
  const std::vector<float> master = rig.master();
  for (int g = 0; g < rig.layout.group_count(); ++g)
    for (std::size_t i = 0; i < rig.layout.group(g).shard; ++i)
      ASSERT_EQ(sink.shards[static_cast<std::size_t>(g)][i], master[rig.layout.group(g).shard_offset + i]) << g;
}

// Misuse raises an Error naming it instead of reading or writing outside the states.
TEST(DeviceOptimizerStates, RangesOutsideTheStatesAreRefused) {
  Rig rig(1.0, false);
  std::vector<float> values(8);
  EXPECT_THROW(rig.states->read_master(rig.n - 4, values.data(), 8), Error);
  EXPECT_THROW(rig.states->write_master(rig.n + 1, values.data(), 0), Error);
}

// Every state of [offset, offset + count), widened: master, then m, then v.
std::vector<float> all_states(OptimizerStates& states, std::size_t offset, std::size_t count) {
  std::vector<float> values(3 * count);
  states.visit_states(offset, count, false, [&](float* master, float* m, float* v, std::size_t first, std::size_t k) {
    std::memcpy(values.data() + first, master, k * sizeof(float));
    std::memcpy(values.data() + count + first, m, k * sizeof(float));
    std::memcpy(values.data() + 2 * count + first, v, k * sizeof(float));
  });
  return values;
}

TEST(DeviceOptimizerStates, CompactStatesTheHostCannotReadPassThroughTheStagingUnchanged) {
  for (const StatesFormat format : {StatesFormat::bf16, StatesFormat::int8}) {
    SCOPED_TRACE(states_format_name(format));
    const optim::StatesForm form{format, DType::f32};
    Rig cpu(1.0, false, form);
    Rig opaque(1.0, false, form, std::make_unique<OpaqueDevice>(std::size_t{64} << 20));
    // The shard is several chunks of the staging, whose size is not a multiple of a block.
    ASSERT_GT(opaque.n, 2 * opaque.staging.elements());
    ASSERT_NE(opaque.staging.elements() % optim::kInt8Block, 0u);
    for (const optim::AdamStepArgs& a : {optim::AdamStepArgs{1, 0.5, 1.0}, optim::AdamStepArgs{2, 0.5, 0.75}}) {
      cpu.step(a, nullptr);
      opaque.step(a, nullptr);
    }
    const std::vector<float> want = all_states(*cpu.states, 0, cpu.n);
    EXPECT_EQ(all_states(*opaque.states, 0, opaque.n), want);
    EXPECT_EQ(opaque.master(), cpu.master());
    EXPECT_NE(std::vector<float>(want.begin(), want.begin() + static_cast<std::ptrdiff_t>(cpu.n)), cpu.init);
    // A range that starts and ends inside blocks: written back, with its blocks narrowed whole.
    for (Rig* rig : {&cpu, &opaque})
      rig->states->visit_states(10, 1500, true, [](float* master, float* m, float*, std::size_t first, std::size_t k) {
        for (std::size_t i = 0; i < k; ++i) {
          master[i] = static_cast<float>(first + i);
          m[i] *= 0.5f;
        }
      });
    EXPECT_EQ(all_states(*opaque.states, 0, opaque.n), all_states(*cpu.states, 0, cpu.n));
    EXPECT_EQ(all_states(*opaque.states, 5, 700), all_states(*cpu.states, 5, 700));
  }
}

TEST(CompactStatesLayout, PiecesAreVisitedInsideThemAndInt8InWholeBlocks) {
  for (const optim::StatesForm form : {optim::StatesForm{StatesFormat::bf16, DType::f32},
                                       optim::StatesForm{StatesFormat::int8, DType::bf16}}) {
    const optim::StatesLayout layout(form, 128);
    std::vector<char> piece(layout.bytes());
    std::vector<float> scratch;
    std::size_t visited = 0;
    const auto count = [&](float*, float*, float*, std::size_t, std::size_t n) { visited += n; };
    visit_laid_out(layout, piece.data(), 64, 64, 0, false, count, scratch);
    EXPECT_EQ(visited, 64u);
    EXPECT_THROW(visit_laid_out(layout, piece.data(), 64, 65, 0, false, count, scratch), Error);
    EXPECT_THROW(visit_laid_out(layout, piece.data(), 129, 0, 0, false, count, scratch), Error);
    if (form.moments == StatesFormat::int8) {
      EXPECT_NO_THROW(layout.moments(piece.data(), 64, 64));
      EXPECT_THROW(layout.moments(piece.data(), 32, 64), Error);  // half a block
    }
  }
}

TEST(SplitOptimizerStates, StepEqualsTheReferenceAdamOnBothSides) {
  Rig rig(0.5, false);
  ASSERT_GT(rig.plan.device_states.range.count(), 0u);
  ASSERT_LT(rig.plan.device_states.range.end, rig.n);
  expect_reference(rig);
}

TEST(SplitOptimizerStates, TheCutGroupIsBegunAndEndedOnce) {
  Rig rig(0.5, true);
  const std::size_t boundary = rig.plan.device_states.range.end;
  int cut = -1;
  for (int g = 0; g < rig.layout.group_count(); ++g)
    if (rig.layout.group(g).shard_offset < boundary &&
        boundary < rig.layout.group(g).shard_offset + rig.layout.group(g).shard)
      cut = g;
  ASSERT_GE(cut, 0) << "the boundary " << boundary << " cuts no group; change the model";
  // Begun by the device part; its end is held back until the offloaded part, which steps after the
  // device part, ends it too.
  RecordingSink sink(rig.layout);
  rig.step({1, 0.5, 1.0}, &sink);
  EXPECT_EQ(std::count(sink.calls.begin(), sink.calls.end(), "begin " + std::to_string(cut)), 1);
  EXPECT_EQ(std::count(sink.calls.begin(), sink.calls.end(), "end " + std::to_string(cut)), 1);
  const std::vector<float> master = rig.master();
  const auto& place = rig.layout.group(cut);
  for (std::size_t i = 0; i < place.shard; ++i)
    ASSERT_EQ(sink.shards[static_cast<std::size_t>(cut)][i], master[place.shard_offset + i]) << i;
}

TEST(StepArgs, CountStepsScaleAndClip) {
  const optim::AdamStepArgs args = adam_step_args(4, 1024.0, 3.0, 1.5);
  EXPECT_EQ(args.step, 5);
  EXPECT_EQ(args.grad_scale, 1.0 / 1024.0);
  EXPECT_EQ(args.clip_coef, 1.5 / (3.0 + 1e-6));
  EXPECT_EQ(adam_step_args(4, 1024.0, 1.0, 1.5).clip_coef, 1.0);  // under max_norm
  EXPECT_EQ(adam_step_args(4, 1024.0, 3.0, 0.0).clip_coef, 1.0);  // no clipping configured
}

TEST(StepArgs, AssumedEqualTheStepsExactlyWhenNothingClips) {
  EXPECT_EQ(assumed_step_args(6, 65536.0), adam_step_args(6, 65536.0, 0.9, 1.0));
  EXPECT_EQ(assumed_step_args(6, 65536.0), adam_step_args(6, 65536.0, 5.0, 0.0));
  EXPECT_FALSE(assumed_step_args(6, 65536.0) == adam_step_args(6, 65536.0, 5.0, 1.0));
  EXPECT_FALSE(assumed_step_args(6, 65536.0) == adam_step_args(7, 65536.0, 0.9, 1.0));
}

}  // namespace
}  // namespace zest::engine
