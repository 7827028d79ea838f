// The engine against a single-process reference Adam, under mpirun with 1, 2 and 4 ranks, for every
// stage: the model and reference of reference_training.hpp on the cpu device with the World's host
// communicator (MPI; in a build without MPI, one process and the local communicator). Every rank
// must end with parameters equal to the reference's.
#include "zest/engine.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "engine/reference_training.hpp"
#include "runtime/world.hpp"
#include "zest/error.hpp"

namespace zest {
namespace {

using namespace reference_training;

std::vector<std::vector<float>> train_with_engine(const Options& o, int steps, EngineStats* stats_out = nullptr) {
  const std::unique_ptr<World> world = make_world();
  auto device = make_cpu_device(std::size_t{256} << 20);
  auto comm = world->make_host_communicator(*device);
  return train_engine(o, steps, *device, *comm, stats_out);
}

constexpr int kSteps = 12;

class EveryStage : public testing::TestWithParam<int> {};

TEST_P(EveryStage, Fp32MatchesReferenceAdamWithin1e6) {
  Options o;
  o.stage = GetParam();
  const auto got = train_with_engine(o, kSteps);
  EXPECT_LT(max_relative_error(got, train_reference(o, kSteps)), 1e-6);
}

TEST_P(EveryStage, GradientAccumulationMatchesTheWholeBatch) {
  Options o;
  o.stage = GetParam();
  o.accumulation = 2;
  const auto got = train_with_engine(o, kSteps);
  EXPECT_LT(max_relative_error(got, train_reference(o, kSteps)), 1e-6);
}

TEST_P(EveryStage, ClippingUsesTheGlobalNormAcrossShards) {
  Options o;
  o.stage = GetParam();
  o.clip = 0.05;  // well below the gradient norm, so every step clips
  const auto got = train_with_engine(o, kSteps);
  EXPECT_LT(max_relative_error(got, train_reference(o, kSteps)), 1e-6);
}

TEST_P(EveryStage, Fp16OverflowOnOneRankSkipsTheStepOnEveryRank) {
  Options o;
  o.stage = GetParam();
  o.dtype = DType::f16;
  o.overflow_at_step = 3;
  EngineStats stats;
  const auto got = train_with_engine(o, kSteps, &stats);
  EXPECT_EQ(stats.steps, kSteps);
  EXPECT_EQ(stats.skipped_steps, 1);
  EXPECT_EQ(stats.loss_scale, 128.0);  // 2^8 halved once (hysteresis 1)
  // fp16 parameters and gradients: the reference in double agrees to fp16's precision.
  EXPECT_LT(max_relative_error(got, train_reference(o, kSteps)), 2e-3);
}

// Biases and the tiny group without weight decay and at another lr, in their own optimizer
// group; a warm-up then cosine decay set between steps through set_lr.
TEST_P(EveryStage, OptimizerParamGroupsAndAnLrScheduleMatchTheReference) {
  Options o;
  o.stage = GetParam();
  o.param_groups = {{{"b*", "bias"}, 0.02, std::nullopt, std::nullopt, std::nullopt, 0.0}};
  o.lr_factor = [](int step) { return step <= 2 ? step / 2.0 : 0.5 * (1 + std::cos(3.14159265358979 * (step - 2) / 10.0)); };
  const auto got = train_with_engine(o, 10);
  EXPECT_LT(max_relative_error(got, train_reference(o, 10)), 1e-6);
  // Without the groups the result differs: the test sees them.
  Options plain = o;
  plain.param_groups.clear();
  EXPECT_GT(max_relative_error(got, train_reference(plain, 10)), 1e-4);
}

INSTANTIATE_TEST_SUITE_P(Stages, EveryStage, testing::Values(0, 1, 2, 3),
                         [](const testing::TestParamInfo<int>& info) { return "stage" + std::to_string(info.param); });

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
