// The engine on a GPU: the model and reference of reference_training.hpp on a cuda device with the
// NCCL communicator, one rank, every stage, so every piece of the CUDA step runs (accumulation,
// gradient statistics, the fused Adam, the pinned uploads and downloads, stage 3's gathers).
// Skips, saying so, where no GPU is present.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "engine/reference_training.hpp"
#include "runtime/world.hpp"
#include "zest/device.hpp"
#include "zest/engine.hpp"

namespace zest {
namespace {

using namespace reference_training;

constexpr int kSteps = 12;
constexpr std::size_t kBudget = std::size_t{256} << 20;

class CudaEveryStage : public testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    if (!cuda_device_available()) GTEST_SKIP() << "no CUDA GPU";
  }

  std::vector<std::vector<float>> train(const Options& o, EngineStats* stats = nullptr) {
    const std::unique_ptr<World> world = make_world();
    auto device = make_cuda_device(0, kBudget);
    auto comm = world->make_nccl_communicator(*device);
    return train_engine(o, kSteps, *device, *comm, stats);
  }
};

TEST_P(CudaEveryStage, Fp32MatchesReferenceAdamWithin1e6) {
  Options o;
  o.stage = GetParam();
  EXPECT_LT(max_relative_error(train(o), train_reference(o, kSteps)), 1e-6);
}

TEST_P(CudaEveryStage, AccumulationAndClippingMatchTheReference) {
  Options o;
  o.stage = GetParam();
  o.accumulation = 2;
  o.clip = 0.05;
  EXPECT_LT(max_relative_error(train(o), train_reference(o, kSteps)), 1e-6);
}

TEST_P(CudaEveryStage, Fp16OverflowSkipsTheStep) {
  Options o;
  o.stage = GetParam();
  o.dtype = DType::f16;
  o.overflow_at_step = 3;
  EngineStats stats;
  const auto got = train(o, &stats);
  EXPECT_EQ(stats.steps, kSteps);
  EXPECT_EQ(stats.skipped_steps, 1);
  EXPECT_EQ(stats.loss_scale, 128.0);
  EXPECT_LT(max_relative_error(got, train_reference(o, kSteps)), 2e-3);
}

INSTANTIATE_TEST_SUITE_P(Stages, CudaEveryStage, testing::Values(0, 1, 2, 3),
                         [](const testing::TestParamInfo<int>& info) { return "stage" + std::to_string(info.param); });

}  // namespace
}  // namespace zest
