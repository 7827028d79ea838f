// The Engine's public contracts. Every entry point checks what it is given: each misuse raises a zest::Error
// that says what was wrong, and leaves the engine usable. Runs under ASan/UBSan in the sanitizer
// build, where undefined behaviour would be reported instead.
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "runtime/comm/world.hpp"
#include "zest/config.hpp"
#include "zest/engine.hpp"
#include "zest/error.hpp"

namespace zest {
namespace {

std::vector<ParamSpec> model() { return {{"w", {4, 3}, 0}, {"b", {3}, 0}, {"head", {5}, 1}}; }

Config config() {
  Config c;
  c.stage = 3;
  c.device.memory = std::size_t{64} << 20;
  c.optimizer.param_groups = {{{"b"}, std::nullopt, std::nullopt, std::nullopt, std::nullopt, 0.0}};
  return c;
}

// `call` throws zest::Error whose message holds `words`.
template <class Call>
void expect_error(Call call, const std::string& words) {
  try {
    call();
    ADD_FAILURE() << "no error; expected one saying '" << words << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
  }
}

class EngineMisuse : public testing::Test {
 protected:
  std::unique_ptr<World> world_ = make_world();
  std::unique_ptr<Device> device_ = make_cpu_device(std::size_t{64} << 20);
  std::unique_ptr<Communicator> comm_ = world_->make_host_communicator(*device_);
  Engine engine_{config(), *device_, *comm_, model()};
};

TEST_F(EngineMisuse, ATensorIndexPastTheLastIsRefusedEverywhere) {
  std::vector<float> values(12);
  expect_error([&] { engine_.spec(3); }, "no tensor 3 (there are 3)");
  expect_error([&] { engine_.set_param(3, values); }, "no tensor 3");
  expect_error([&] { engine_.get_param(99, values); }, "no tensor 99");
  expect_error([&] { engine_.grad(3); }, "no tensor 3");
  expect_error([&] { engine_.optimizer_group_of(3); }, "no tensor 3");
  auto lease = engine_.acquire(0);
  expect_error([&] { lease.param(7); }, "no tensor 7");
  expect_error([&] { lease.grad(std::numeric_limits<std::size_t>::max()); }, "no tensor");
}

// Names a checkpoint's consolidation (safetensors) could not write are refused when the model is
// registered, not at the end of training.
TEST(EngineNames, NamesSafetensorsCannotHoldAreRefused) {
  const std::unique_ptr<World> world = make_world();
  const std::unique_ptr<Device> device = make_cpu_device(std::size_t{64} << 20);
  const std::unique_ptr<Communicator> comm = world->make_host_communicator(*device);
  for (const auto& [name, words] : std::vector<std::pair<std::string, std::string>>{
           {"caf\xe9", "is not UTF-8 text"}, {"__metadata__", "reserved key __metadata__"}})
    expect_error([&] { Engine(config(), *device, *comm, {{"w", {4}, 0}, {name, {3}, 1}}); }, words);
}

// What parsing the config warned of (a deprecated key) the engine prints once, on its rank 0, as
// "zest: warning: ..."; a config without warnings prints nothing.
TEST(EngineWarnings, AConfigsWarningsArePrintedOnceOnStderr) {
  const std::unique_ptr<World> world = make_world();
  const std::unique_ptr<Device> device = make_cpu_device(std::size_t{64} << 20);
  const std::unique_ptr<Communicator> comm = world->make_host_communicator(*device);
  const Config old_name = parse_config(
      "stage: 2\ndevice: {memory: 64MiB}\noffload:\n  optimizer: {device: cpu, overlap: true}\n", "run.yaml");
  ASSERT_EQ(old_name.warnings.size(), 1u);
  testing::internal::CaptureStderr();
  { Engine engine(old_name, *device, *comm, model()); }
  EXPECT_EQ(testing::internal::GetCapturedStderr(), "zest: warning: " + old_name.warnings[0] + "\n");
  testing::internal::CaptureStderr();
  { Engine engine(config(), *device, *comm, model()); }
  EXPECT_EQ(testing::internal::GetCapturedStderr(), "");
}

TEST_F(EngineMisuse, ValuesOfTheWrongSizeAreRefused) {
  std::vector<float> short_values(11), long_values(13);
  expect_error([&] { engine_.set_param(0, short_values); }, "tensor 'w' has 12 elements, given 11 values");
  expect_error([&] { engine_.get_param(0, long_values); }, "given 13 values");
  expect_error([&] { engine_.set_param(0, std::span<const float>()); }, "given 0 values");  // a null pointer
}

TEST_F(EngineMisuse, AMovedFromLeaseRefusesToHandOutPointers) {
  auto lease = engine_.acquire(0);
  auto moved = std::move(lease);
  expect_error([&] { lease.param(0); }, "moved from");  // NOLINT(bugprone-use-after-move): the point
  expect_error([&] { lease.grad(0); }, "moved from");
  EXPECT_NE(moved.param(0).data, nullptr);
}

TEST_F(EngineMisuse, ATensorOfAnotherGroupIsRefusedThroughALease) {
  auto lease = engine_.acquire(0);
  expect_error([&] { lease.param(2); }, "belongs to group 1, not to the leased group 0");
}

TEST_F(EngineMisuse, UnknownNamesAndGroupsAreRefused) {
  EXPECT_EQ(engine_.tensor_index("head"), 2u);
  expect_error([&] { engine_.tensor_index("tail"); }, "no tensor named 'tail'");
  expect_error([&] { engine_.acquire(2); }, "no group 2");
  expect_error([&] { engine_.grads_ready(-1); }, "no group -1");
  expect_error([&] { engine_.optimizer_group(2); }, "no optimizer group 2 (there are 2");
  expect_error([&] { engine_.set_lr(-1, 0.1); }, "no optimizer group -1");
}

TEST_F(EngineMisuse, OptimizerValuesNoStepCanUseAreRefusedAndNothingChanges) {
  const double lr = engine_.optimizer_group(1).lr;
  expect_error([&] { engine_.set_lr(1, -0.5); }, "needs lr > 0");
  expect_error([&] { engine_.set_lr(1, std::numeric_limits<double>::quiet_NaN()); }, "all finite");
  OptimizerGroupOptions o = engine_.optimizer_group(0);
  o.beta2 = 1.0;
  expect_error([&] { engine_.set_optimizer_group(0, o); }, "betas in [0, 1)");
  EXPECT_EQ(engine_.optimizer_group(1).lr, lr);
  EXPECT_EQ(engine_.optimizer_group(1).weight_decay, 0.0);  // the YAML/code group's value
  EXPECT_EQ(engine_.optimizer_group_of(1), 1);
  EXPECT_EQ(engine_.optimizer_group_of(0), 0);
}

TEST_F(EngineMisuse, TheTypedViewCarriesShapeAndType) {
  const TensorView grad = engine_.grad(0);  // no lease needed, also at stage 3
  EXPECT_EQ(grad.numel, 12u);
  EXPECT_EQ(grad.dtype, DType::f32);
  ASSERT_EQ(grad.shape.size(), 2u);
  EXPECT_EQ(grad.shape[0], 4u);
  engine_.grads_ready(0);
}

TEST(EngineMisuseAtConstruction, BadParameterListsAreRefused) {
  const std::unique_ptr<World> world = make_world();
  auto device = make_cpu_device(std::size_t{64} << 20);
  auto comm = world->make_host_communicator(*device);
  const std::size_t huge = std::size_t{1} << 40;
  expect_error([&] { Engine(config(), *device, *comm, {{"w", {huge, huge}, 0}}); }, "overflows");
  expect_error(
      [&] {
        Engine(config(), *device, *comm, {{"w", {3}, 0}, {"w", {3}, 0}});
      },
      "two parameters are named 'w'");
  expect_error([&] { Engine(config(), *device, *comm, {{"", {3}, 0}}); }, "name of parameter 0 is empty");
  // A checkpoint is lines of text: a name it could not hold is refused here, not at save.
  expect_error([&] { Engine(config(), *device, *comm, {{"a\nb", {3}, 0}}); }, "name of parameter 0 holds a newline");
  EXPECT_EQ(device->memory_stats().current_total, 0u);
}

}  // namespace
}  // namespace zest

namespace zest {
namespace {

TEST(EngineOptimizerGroups, ScheduledValuesAreSavedAndRestored) {
  const std::unique_ptr<World> world = make_world();
  auto device = make_cpu_device(std::size_t{64} << 20);
  auto comm = world->make_host_communicator(*device);
  const std::string dir = testing::TempDir() + "zest_api_ckpt_" + std::to_string(::getpid());
  {
    Engine engine(config(), *device, *comm, model());
    engine.set_lr(0, 0.125);
    engine.set_lr(1, 0.25);
    engine.save(dir);
  }
  Engine engine(config(), *device, *comm, model());
  EXPECT_EQ(engine.optimizer_group(0).lr, config().optimizer.lr);
  const LoadResult loaded = engine.load(dir);
  EXPECT_EQ(engine.optimizer_group(0).lr, 0.125);
  EXPECT_EQ(engine.optimizer_group(1).lr, 0.25);
  EXPECT_EQ(engine.optimizer_group(1).weight_decay, 0.0);
  EXPECT_TRUE(loaded.config_changes.empty());
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace zest
