// The engine against a single-process reference Adam, for every stage, on every backend: one table
// of cases, each run on the cpu device with the World's host communicator (under mpirun with 1, 2
// and 4 ranks; without MPI one process) and on a cuda device with NCCL (a world of one; skipped,
// saying so, without a GPU or with several ranks), as ggml's test-backend-ops runs each backend
// against one reference. Every rank must end with parameters equal to the reference's.
//
// Floating-point policy the tolerances rest on: the reference is double precision; each backend
// computes in fp32 with its own rounding. The CPU kernels are built with -ffp-contract=off (every
// ISA variant bit-identical, src/optim/meson.build); nvcc contracts a*b+c into FMA by default, so
// cuda and cpu may differ by an ulp per operation. Equal results are asserted only within one
// backend (ranks, stages, offload: engine_offload_test); across backends, 1e-6 relative to the
// double reference in fp32 (about 8 ulp of the parameters after 12 steps), 2e-3 in fp16. Compact
// states are the exception: their CUDA kernels are built without contraction, so a cuda run
// equals the cpu device's bit for bit (CompactStatesOnCuda).
#include "zest/engine.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "engine/reference_training.hpp"
#include "runtime/comm/world.hpp"
#include "zest/error.hpp"

namespace zest {
namespace {

using namespace reference_training;

enum class Backend { cpu, cuda };

std::vector<std::vector<float>> train_with_engine(const Options& o, int steps, EngineStats* stats_out = nullptr,
                                                  Backend backend = Backend::cpu) {
  const std::unique_ptr<World> world = make_world();
  const std::size_t budget = std::size_t{256} << 20;
  if (backend == Backend::cuda) {
    auto device = make_cuda_device(0, budget);
    auto comm = world->make_nccl_communicator(*device);
    return train_engine(o, steps, *device, *comm, stats_out);
  }
  auto device = make_cpu_device(budget);
  auto comm = world->make_host_communicator(*device);
  return train_engine(o, steps, *device, *comm, stats_out);
}

constexpr int kSteps = 12;

class EveryStage : public testing::TestWithParam<std::tuple<Backend, int>> {
 protected:
  void SetUp() override {
    if (backend() != Backend::cuda) return;
    if (!cuda_device_available()) GTEST_SKIP() << "no CUDA GPU: the cuda cases run where one is present";
    if (make_world()->size() > 1) GTEST_SKIP() << "the cuda cases run in a world of one (one GPU per rank)";
  }
  Backend backend() const { return std::get<0>(GetParam()); }
  int stage() const { return std::get<1>(GetParam()); }
  Options options() const {
    Options o;
    o.stage = stage();
    return o;
  }
  std::vector<std::vector<float>> train(const Options& o, int steps = kSteps, EngineStats* stats = nullptr) const {
    return train_with_engine(o, steps, stats, backend());
  }
};

TEST_P(EveryStage, Fp32MatchesReferenceAdamWithin1e6) {
  const Options o = options();
  const auto got = train(o);
  EXPECT_LT(max_relative_error(got, train_reference(o, kSteps)), 1e-6);
}

TEST_P(EveryStage, GradientAccumulationMatchesTheWholeBatch) {
  Options o = options();
  o.accumulation = 2;
  const auto got = train(o);
  EXPECT_LT(max_relative_error(got, train_reference(o, kSteps)), 1e-6);
}

TEST_P(EveryStage, ClippingUsesTheGlobalNormAcrossShards) {
  Options o = options();
  o.clip = 0.05;  // well below the gradient norm, so every step clips
  const auto got = train(o);
  EXPECT_LT(max_relative_error(got, train_reference(o, kSteps)), 1e-6);
}

TEST_P(EveryStage, Fp16OverflowOnOneRankSkipsTheStepOnEveryRank) {
  Options o = options();
  o.dtype = DType::f16;
  o.overflow_at_step = 3;
  EngineStats stats;
  const auto got = train(o, kSteps, &stats);
  EXPECT_EQ(stats.steps, kSteps);
  EXPECT_EQ(stats.skipped_steps, 1);
  EXPECT_EQ(stats.loss_scale, 128.0);  // 2^8 halved once (hysteresis 1)
  // fp16 parameters and gradients: the reference in double agrees to fp16's precision.
  EXPECT_LT(max_relative_error(got, train_reference(o, kSteps)), 2e-3);
}

// Biases and the tiny group without weight decay and at another lr, in their own optimizer
// group; a warm-up then cosine decay set between steps through set_lr.
TEST_P(EveryStage, OptimizerParamGroupsAndAnLrScheduleMatchTheReference) {
  Options o = options();
  o.param_groups = {{{"b*", "bias"}, 0.02, std::nullopt, std::nullopt, std::nullopt, 0.0}};
  o.lr_factor = [](int step) {
    return step <= 2 ? step / 2.0 : 0.5 * (1 + std::cos(3.14159265358979 * (step - 2) / 10.0));
  };
  const auto got = train(o, 10);
  EXPECT_LT(max_relative_error(got, train_reference(o, 10)), 1e-6);
  // Without the groups the result differs: the test sees them.
  Options plain = o;
  plain.param_groups.clear();
  EXPECT_GT(max_relative_error(got, train_reference(plain, 10)), 1e-4);
}

// The offloaded step on each backend: the optimizer's states in pinned host memory (stages 1-3),
// and at stage 3 the parameters too, with real host-device copies on cuda.
TEST_P(EveryStage, OffloadedToTheHostMatchesTheReference) {
  if (stage() == 0) GTEST_SKIP() << "stage 0 keeps full optimizer states on the device: no offload";
  Options o = options();
  o.offload_optimizer = OffloadDevice::cpu;
  if (stage() == 3) o.offload_param = OffloadDevice::cpu;
  o.sub_group_bytes = 12 * 1024;  // several sub-groups per group
  EXPECT_LT(max_relative_error(train(o), train_reference(o, kSteps)), 1e-6);
}

// The offloaded step updated ahead during backward (offload.optimizer.update_ahead, stages 2-3) on
// each backend: the host gradient shard handed to the update thread from the comm stream (a CUDA
// host function on cuda), the parameters committed through real copies; clipping every step
// exercises the redo.
TEST_P(EveryStage, UpdatedAheadDuringBackwardMatchesTheReference) {
  if (stage() < 2) GTEST_SKIP() << "update_ahead needs the gradient shard on the host: stages 2-3";
  Options o = options();
  o.offload_optimizer = OffloadDevice::cpu;
  o.update_ahead = true;
  o.reduce_bucket = 4;  // a group per bucket: updated during backward
  o.sub_group_bytes = 12 * 1024;
  EngineStats stats;
  EXPECT_LT(max_relative_error(train(o, kSteps, &stats), train_reference(o, kSteps)), 1e-6);
  EXPECT_GT(stats.groups_updated_ahead, 0);
  o.clip = 0.05;
  EXPECT_LT(max_relative_error(train(o, kSteps, &stats), train_reference(o, kSteps)), 1e-6);
  EXPECT_GT(stats.groups_redone, 0);
}

INSTANTIATE_TEST_SUITE_P(Backends, EveryStage,
                         testing::Combine(testing::Values(Backend::cpu, Backend::cuda), testing::Values(0, 1, 2, 3)),
                         [](const testing::TestParamInfo<std::tuple<Backend, int>>& info) {
                           return std::string(std::get<0>(info.param) == Backend::cpu ? "cpu" : "cuda") + "_stage" +
                                  std::to_string(std::get<1>(info.param));
                         });

// Compact states (optimizer.states bf16 and int8) kept on a cuda device: CudaDeviceMath's compact
// kernels (built without FMA contraction) give the CPU Adam's bits, and the staged host access to
// the states (set_param, get_param) their values, so the cuda run equals the cpu device's bit for
// bit; at ratio 0.5 half the states are the CPU Adam's, offloaded.
struct CompactCase {
  const char* name;
  StatesFormat states;
  DType dtype;  // of the parameters
  int stage;
  double ratio = 1;  // offload.optimizer.ratio (to the host)
};

class CompactStatesOnCuda : public testing::TestWithParam<CompactCase> {
 protected:
  void SetUp() override {
    if (!cuda_device_available()) GTEST_SKIP() << "no CUDA GPU: the compact kernels run where one is present";
    if (make_world()->size() > 1) GTEST_SKIP() << "the cuda cases run in a world of one (one GPU per rank)";
  }
  Options options() const {
    const CompactCase& c = GetParam();
    Options o;
    o.stage = c.stage;
    o.states = c.states;
    o.dtype = c.dtype;
    o.seed = 12345;
    if (c.ratio < 1) {
      o.offload_optimizer = OffloadDevice::cpu;
      o.offload_ratio = c.ratio;
    }
    // Two optimizer groups: a run of shards per group, one launch each.
    o.param_groups = {{{"w2"}, 0.02, std::nullopt, 0.99, std::nullopt, 0.0}};
    return o;
  }
};

bool identical(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t t = 0; t < a.size(); ++t)
    if (a[t].size() != b[t].size() || std::memcmp(a[t].data(), b[t].data(), a[t].size() * sizeof(float)) != 0)
      return false;
  return true;
}

TEST_P(CompactStatesOnCuda, TrainToTheBitsOfTheCpuDevice) {
  const Options o = options();
  const auto cuda = train_with_engine(o, kSteps, nullptr, Backend::cuda);
  EXPECT_TRUE(identical(cuda, train_with_engine(o, kSteps, nullptr, Backend::cpu)));
  Options fp32 = o;
  fp32.states = StatesFormat::f32;
  EXPECT_GT(max_relative_error(cuda, train_reference(fp32, kSteps)), 1e-7) << "the states were not compact";
}

INSTANTIATE_TEST_SUITE_P(
    Compact, CompactStatesOnCuda,
    testing::Values(CompactCase{"bf16_states_fp32_params_stage0", StatesFormat::bf16, DType::f32, 0},
                    CompactCase{"int8_states_fp32_params_stage0", StatesFormat::int8, DType::f32, 0},
                    CompactCase{"bf16_states_bf16_params_stage0", StatesFormat::bf16, DType::bf16, 0},
                    CompactCase{"int8_states_bf16_params_stage0", StatesFormat::int8, DType::bf16, 0},
                    CompactCase{"bf16_states_fp32_params_stage3", StatesFormat::bf16, DType::f32, 3},
                    CompactCase{"int8_states_bf16_params_stage3", StatesFormat::int8, DType::bf16, 3},
                    CompactCase{"int8_states_fp32_params_stage2_ratio_half", StatesFormat::int8, DType::f32, 2, 0.5},
                    CompactCase{"bf16_states_bf16_params_stage2_ratio_half", StatesFormat::bf16, DType::bf16, 2, 0.5}),
    [](const testing::TestParamInfo<CompactCase>& info) { return std::string(info.param.name); });

// The CUDA kernels keep an fp32 master: a bf16 one on the device is refused, naming the key.
TEST(CompactStatesOnCudaRefused, ABf16MasterOnTheDevice) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA GPU: the cuda device is not made here";
  if (make_world()->size() > 1) GTEST_SKIP() << "the cuda cases run in a world of one (one GPU per rank)";
  Options o;
  o.states = StatesFormat::int8;
  o.master = DType::bf16;
  o.dtype = DType::bf16;
  const std::unique_ptr<World> world = make_world();
  auto device = make_cuda_device(0, std::size_t{256} << 20);
  auto comm = world->make_nccl_communicator(*device);
  try {
    Engine engine(make_config(o), *device, *comm, model());
    ADD_FAILURE() << "a bf16 master on a cuda device was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("optimizer.master: fp32"), std::string::npos) << e.what();
  }
}

TEST(Stage3, TrainsWithOnlyTwoGroupsLiveAtOnce) {
  Options o;
  o.stage = 3;
  o.max_live = 1;  // the minimum: two gathered-parameter buffers
  const auto got = train_with_engine(o, kSteps);
  EXPECT_LT(max_relative_error(got, train_reference(o, kSteps)), 1e-6);
}

TEST(Engine, RefusesATensorOfAnotherGroupThroughALease) {
  const std::unique_ptr<World> world = make_world();
  auto device = make_cpu_device(std::size_t{64} << 20);
  auto comm = world->make_host_communicator(*device);
  Engine engine(make_config(Options{}), *device, *comm, model());
  auto lease = engine.acquire(1);
  EXPECT_THROW(lease.param(0), Error);
  EXPECT_THROW(lease.grad(3), Error);
  EXPECT_THROW(engine.acquire(99), Error);
  EXPECT_THROW(engine.grads_ready(2), Error);  // no gradient was written for it
}

}  // namespace
}  // namespace zest
