// optimizer.states bf16 and int8 (docs/compact-states.md) through the whole engine, under mpirun
// with 1 and 2 ranks. What it proves:
//   - one process at stage 0 trains to exactly the bits of CpuAdam::step_compact run tensor by
//     tensor with the element indices of the design ((group << 40) + place in the segment), so the
//     engine passes the right states, scales, indices and seed;
//   - every placement of the states (the cpu device, pinned host, NVMe, a partial offload, updates
//     ahead of the step, optimizer parameter groups, several sub-groups per group) trains to the
//     bits of the run with the states on the device: blocks and rounding depend on no placement;
//   - the compact formats train close to fp32 states on this model, and the memory the engine
//     allocates for its states is the format's: 8 bytes per parameter for bf16, 6.125 for int8.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdint>
#include <string>
#include <vector>

#include "engine/plan/layout.hpp"
#include "engine/offload_training.hpp"
#include "engine/optimizer/optimizer_groups.hpp"
#include "engine/reference_training.hpp"
#include "offload/scratch_dir.hpp"
#include "optim/cpu_adam.hpp"
#include "optim/states_layout.hpp"
#include "runtime/host/half.hpp"
#include "zest/engine.hpp"

namespace zest {
namespace {

using namespace reference_training;

constexpr int kSteps = 10;

int world_size() {
  int size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return size;
}

// The compact forms: bf16 or int8 moments, with an fp32 master or a bf16 one (which runs with bf16
// parameters, as the config requires).
struct Form {
  StatesFormat states;
  DType master;
};

std::string form_name(const Form& f) {
  return std::string(states_format_name(f.states)) + (f.master == DType::bf16 ? "_bf16_master" : "");
}

const Form kForms[] = {{StatesFormat::bf16, DType::f32},
                       {StatesFormat::int8, DType::f32},
                       {StatesFormat::bf16, DType::bf16},
                       {StatesFormat::int8, DType::bf16}};

Options compact(Form form, int stage) {
  Options o;
  o.stage = stage;
  o.states = form.states;
  o.master = form.master;
  o.dtype = form.master == DType::bf16 ? DType::bf16 : DType::f32;
  o.seed = 12345;
  return o;
}

// The engine's training at one process, written out with the CPU Adam directly: each tensor's m
// and v in the format, its int8 blocks from the tensor's start (a multiple of 64 in its segment),
// its rounding index (group << 40) + its offset in the segment; the gradients computed from the
// parameters in the run's dtype and stored in it, as the trainer does.
std::vector<std::vector<float>> train_with_cpu_adam(const Options& o, int steps) {
  const Config config = make_config(o);
  const std::vector<ParamSpec> specs = model();
  const engine::Layout layout(specs, 1);
  const std::vector<optim::AdamHyperParams> hyper = engine::optimizer_group_values(config);
  const std::vector<int> group_of = engine::optimizer_groups_of(config, specs);
  const optim::StatesForm form{o.states, o.master};
  std::vector<std::vector<float>> p(specs.size());
  std::vector<std::vector<std::uint16_t>> p16(specs.size());  // a bf16 master
  std::vector<std::vector<char>> states(specs.size());
  for (std::size_t t = 0; t < specs.size(); ++t) {
    for (std::size_t j = 0; j < specs[t].numel(); ++j) {
      p[t].push_back(static_cast<float>(initial(t, j)));
      p16[t].push_back(float_to_bf16(p[t].back()));
    }
    states[t].assign(optim::StatesLayout::bytes(form, p[t].size()), 0);
  }
  optim::CpuAdam adam(hyper.front(), 1);
  for (int step = 1; step <= steps; ++step) {
    for (std::size_t t = 0; t < specs.size(); ++t) {
      const std::size_t n = p[t].size();
      std::vector<float> grad(n);
      std::vector<std::uint16_t> grad16(n);
      for (std::size_t j = 0; j < n; ++j) {
        const float param = o.master == DType::bf16 ? bf16_to_float(p16[t][j])
                            : o.dtype == DType::bf16 ? bf16_to_float(float_to_bf16(p[t][j]))
                                                     : p[t][j];
        grad[j] = static_cast<float>(partial_grad(param, step, 0, kExamples, t, j));
        grad16[j] = float_to_bf16(grad[j]);
      }
      const optim::ConstTensorSpan g = o.dtype == DType::bf16 ? optim::ConstTensorSpan{grad16.data(), DType::bf16, n}
                                                              : optim::ConstTensorSpan{grad.data(), DType::f32, n};
      const optim::StatesLayout place(form, n);
      const std::uint64_t index = (static_cast<std::uint64_t>(specs[t].group) << 40) + layout.tensor(t).offset;
      adam.set_hyper(hyper[static_cast<std::size_t>(group_of[t])]);
      const optim::CpuAdam::CompactRounding rounding{static_cast<std::uint64_t>(o.seed), index};
      if (o.master == DType::bf16)
        adam.step_compact(std::span<std::uint16_t>(p16[t]), place.moments(states[t].data(), 0, n), g, {step, 1.0, 1.0},
                          rounding);
      else
        adam.step_compact(p[t], place.moments(states[t].data(), 0, n), g, {step, 1.0, 1.0}, rounding);
    }
  }
  if (o.master == DType::bf16)
    for (std::size_t t = 0; t < specs.size(); ++t)
      for (std::size_t j = 0; j < p[t].size(); ++j) p[t][j] = bf16_to_float(p16[t][j]);
  return p;
}

class Format : public testing::TestWithParam<Form> {};

std::string format_name(const testing::TestParamInfo<Form>& info) { return form_name(info.param); }

TEST_P(Format, OneProcessTrainsToTheBitsOfTheCpuAdamTensorByTensor) {
  if (world_size() != 1) GTEST_SKIP() << "the direct CPU Adam is one process's training (np 1 runs it)";
  Options o = compact(GetParam(), 0);
  o.param_groups = {{{"b1", "bias"}, std::nullopt, std::nullopt, std::nullopt, std::nullopt, 0.0}};
  EXPECT_TRUE(identical(train_on_cpu(o, kSteps).params, train_with_cpu_adam(o, kSteps)));
}

TEST_P(Format, TrainsCloseToFp32States) {
  const Options o = compact(GetParam(), 2);
  Options fp32 = o;
  fp32.states = StatesFormat::f32;
  fp32.master = DType::f32;
  const auto want = train_reference(fp32, kSteps);
  // Adam's steps are lr-sized whatever the moments' precision; 10 steps at lr 0.01 move each
  // parameter by up to 0.1, and the compact moments change that by a few percent of it (a bf16
  // master and bf16 parameters add their own rounding, 2^-9 of a weight near 0.5).
  const double bound = o.master == DType::bf16 ? 1e-2 : 5e-3;
  const auto got = train_on_cpu(o, kSteps).params;
  EXPECT_LT(max_relative_error(got, want), bound);
  EXPECT_GT(max_relative_error(got, want), 1e-7) << "the states were not compact";
}

struct Placement {
  const char* name;
  int stage;
  OffloadDevice optimizer;
  double ratio = 1;
  bool update_ahead = false;
  OffloadDevice param = OffloadDevice::none;
};

class EveryPlacement : public testing::TestWithParam<std::tuple<Form, Placement>> {};

TEST_P(EveryPlacement, TrainsToTheBitsOfTheStatesOnTheDevice) {
  const auto& [format, where] = GetParam();
  test::ScratchDir dir;
  Options o = compact(format, where.stage);
  o.offload_optimizer = where.optimizer;
  o.offload_ratio = where.ratio;
  o.update_ahead = where.update_ahead;
  o.offload_param = where.param;
  o.nvme_path = dir.path();
  o.sub_group_bytes = 12 * 128;  // several sub-groups per group: 192 to 320 parameters of compact states each
  o.reduce_bucket = where.update_ahead ? 4 : 0;  // a bucket per group, handed over during backward
  o.param_groups = {{{"w2"}, 0.02, std::nullopt, 0.99, std::nullopt, 0.0}};
  const TrainedRun got = train_on_cpu(o, kSteps);
  Options on_device = o;
  on_device.offload_optimizer = on_device.offload_param = OffloadDevice::none;
  on_device.offload_ratio = 1;
  on_device.update_ahead = false;
  EXPECT_TRUE(identical(got.params, train_on_cpu(on_device, kSteps).params));
  if (where.update_ahead) {
    EXPECT_GT(got.stats.groups_updated_ahead, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Compact, EveryPlacement,
    testing::Combine(testing::ValuesIn(kForms),
                     testing::Values(Placement{"stage1_cpu", 1, OffloadDevice::cpu},
                                     Placement{"stage2_nvme", 2, OffloadDevice::nvme},
                                     Placement{"stage3_cpu_params_nvme", 3, OffloadDevice::cpu, 1, false,
                                               OffloadDevice::nvme},
                                     Placement{"stage2_cpu_ratio_half", 2, OffloadDevice::cpu, 0.5},
                                     Placement{"stage3_nvme_ratio_quarter", 3, OffloadDevice::nvme, 0.25},
                                     Placement{"stage2_cpu_update_ahead", 2, OffloadDevice::cpu, 1, true},
                                     Placement{"stage3_nvme_update_ahead", 3, OffloadDevice::nvme, 1, true})),
    [](const testing::TestParamInfo<std::tuple<Form, Placement>>& info) {
      return form_name(std::get<0>(info.param)) + "_" + std::get<1>(info.param).name;
    });

// On the device, an fp32 master is the fp32 parameters themselves (MemoryPlan::master_in_params):
// m and v alone take memory of their own there.
TEST_P(Format, TheStatesTakeTheFormatsBytesOnTheDeviceAndOffloaded) {
  const std::size_t shard = engine::Layout(model(), world_size()).shard_numel();
  const double moments = GetParam().states == StatesFormat::bf16 ? 4.0 : 2.125;
  const double per = (GetParam().master == DType::bf16 ? 2.0 : 4.0) + moments;
  Options o = compact(GetParam(), 2);
  const TrainedRun on_device = train_on_cpu(o, 1);
  EXPECT_EQ(static_cast<double>(on_device.stats.memory.peak_of(MemoryCategory::optimizer_states)),
            (GetParam().master == DType::bf16 ? per : moments) * static_cast<double>(shard));
  o.offload_optimizer = OffloadDevice::cpu;
  const TrainedRun offloaded = train_on_cpu(o, 1);
  EXPECT_EQ(offloaded.stats.memory.peak_of(MemoryCategory::optimizer_states), 0u);
  EXPECT_EQ(static_cast<double>(offloaded.pinned.peak_of(HostPurpose::optimizer_states)),
            per * static_cast<double>(shard));
}

INSTANTIATE_TEST_SUITE_P(Compact, Format, testing::ValuesIn(kForms), format_name);

}  // namespace
}  // namespace zest
