// The example trainer on a device whose memory the host may not read (as on cuda): it stages each
// group's parameters and gradients through host memory, and trains exactly as on the cpu device.
// The stand-in device is host memory that says it is not host-accessible, so this runs anywhere.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <memory>
#include <vector>

#include "runtime/local_communicator.hpp"
#include "trainer.hpp"
#include "zest/device.hpp"

namespace zest {
namespace {

// Host memory behind a device that claims otherwise; streams and copies are a cpu device's.
class OpaqueDevice final : public Device {
 public:
  OpaqueDevice() : Device(std::size_t{256} << 20), inner_(make_cpu_device(std::size_t{256} << 20)) {}

  DeviceType type() const override { return DeviceType::cpu; }
  std::string name() const override { return "opaque (test)"; }
  bool host_accessible() const override { return false; }
  std::unique_ptr<Stream> create_stream() override { return inner_->create_stream(); }
  std::unique_ptr<Event> create_event() override { return inner_->create_event(); }
  void copy_async(void* dst, const void* src, std::size_t bytes, Stream& stream) override {
    copies_.fetch_add(1, std::memory_order_relaxed);
    inner_->copy_async(dst, src, bytes, stream);
  }
  void memset_async(void* dst, int value, std::size_t bytes, Stream& stream) override {
    inner_->memset_async(dst, value, bytes, stream);
  }
  void synchronize() override { inner_->synchronize(); }
  long copies() const { return copies_.load(); }

 protected:
  void* allocate_bytes(std::size_t bytes) override { return std::aligned_alloc(256, round(bytes, 256)); }
  void free_bytes(void* data, std::size_t) noexcept override { std::free(data); }
  void* allocate_pinned_bytes(std::size_t bytes, bool& locked) override {
    locked = false;
    return std::aligned_alloc(4096, round(bytes, 4096));
  }
  void free_pinned_bytes(void* data, std::size_t) noexcept override { std::free(data); }

 private:
  static std::size_t round(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }
  std::unique_ptr<Device> inner_;
  std::atomic<long> copies_{0};
};

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
  OpaqueDevice opaque;
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
