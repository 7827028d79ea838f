// The example trainer on a device whose memory the host may not read (as on cuda): it stages each
// group's parameters and gradients through host memory, and trains exactly as on the cpu device.
// The stand-in device is host memory that says it is not host-accessible, so this runs anywhere.
#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "opaque_device.hpp"
#include "runtime/comm/local_communicator.hpp"
#include "trainer.hpp"
#include "zest/device.hpp"

namespace zest {
namespace {

using test::OpaqueDevice;

constexpr int kSteps = 4;

std::vector<double> losses(Device& device, DType dtype, int stage) {
  Config config;
  config.stage = stage;
  config.precision.dtype = dtype;
  config.optimizer.threads = 1;
  train::TrainConfig train;
  train.model.context = 4;
  train.model.embed = 8;
  train.model.hidden = 32;
  train.global_batch = 16;
  const charlm::TextCorpus corpus = charlm::TextCorpus::load(train.text);
  const std::unique_ptr<Communicator> comm = make_local_communicator(device);
  train::Trainer trainer(config, train, corpus, device, *comm, 1);
  std::vector<double> result;
  for (int step = 1; step <= kSteps; ++step) result.push_back(trainer.step(step));
  return result;
}

class Staging : public testing::TestWithParam<std::tuple<DType, int>> {};

TEST_P(Staging, TrainsExactlyAsOnTheCpuDevice) {
  const auto [dtype, stage] = GetParam();
  const std::unique_ptr<Device> cpu = make_cpu_device(std::size_t{256} << 20);
  OpaqueDevice opaque(std::size_t{256} << 20);
  const std::vector<double> expected = losses(*cpu, dtype, stage);
  const std::vector<double> got = losses(opaque, dtype, stage);
  EXPECT_EQ(got, expected);
  EXPECT_LT(got.back(), got.front()) << "the loss did not fall: the gradients did not arrive";
  // Every group's parameters and gradients went through the staging copies, every step.
  EXPECT_GE(opaque.copies(), 2L * kSteps * 3);
}

INSTANTIATE_TEST_SUITE_P(DTypesAndStages, Staging,
                         testing::Combine(testing::Values(DType::f32, DType::bf16), testing::Values(0, 3)));

}  // namespace
}  // namespace zest
