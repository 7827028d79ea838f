// Ranks that disagree (issue 34 item 3): an Engine whose ranks were given different settings that
// decide their collectives or their update, or different models, fails at construction on every
// rank within seconds, naming the key and two ranks' values, where it used to hang until
// comm.timeout (stage, buckets) or train silently, each rank updating its shard its own way (lr,
// clipping, states, seed, master). Settings that shape only a rank's own resources may differ.
// Runs under mpirun at 1 and 2 ranks (the disagreements need 2; the key list is checked at any).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "engine/plan/shared_settings.hpp"
#include "runtime/comm/world.hpp"
#include "zest/engine.hpp"
#include "zest/error.hpp"

namespace zest {
namespace {

std::vector<ParamSpec> model() { return {{"a.w", {16, 4}, 0}, {"a.b", {4}, 0}, {"b.w", {4, 4}, 1}}; }

Config base() {
  Config c;
  c.stage = 2;
  c.device.memory = std::size_t{64} << 20;
  c.optimizer.threads = 1;
  return c;
}

bool has_key(const std::vector<SharedValue>& shared, const std::string& key) {
  for (const SharedValue& v : shared)
    if (v.key == key) return true;
  return false;
}

TEST(SharedSettings, EveryKeyButARanksOwnResourcesIsShared) {
  const std::vector<SharedValue> shared = engine::settings_ranks_share(base(), model());
  for (const char* key : {"stage", "device.type", "buckets.reduce", "buckets.allgather", "stage3.prefetch",
                          "stage3.max_live", "partition.secondary", "comm.quantize.params", "comm.quantize.grads",
                          "optimizer.lr", "optimizer.betas", "optimizer.param_groups", "optimizer.states",
                          "optimizer.master", "optimizer.seed", "precision.dtype", "precision.loss_scale.dynamic",
                          "gradient_clipping", "gradient_accumulation_steps", "offload.optimizer.device",
                          "offload.optimizer.ratio", "offload.param.device"})
    EXPECT_TRUE(has_key(shared, key)) << key;
  for (const char* key : {"device.memory", "comm.timeout", "optimizer.threads", "offload.optimizer.path",
                          "offload.sub_group", "io.threads", "io.block_size"})
    EXPECT_FALSE(has_key(shared, key)) << key;
  EXPECT_TRUE(has_key(shared, "the model (its parameters' names, shapes and groups)"));
}

class RanksThatDisagree : public testing::Test {
 protected:
  void SetUp() override {
    if (world_->size() < 2) GTEST_SKIP() << "ranks can disagree only with two or more; this run has " << world_->size();
  }

  // Builds an engine with rank 1's config (or model) changed by `change`: every rank must throw,
  // within seconds, an Error naming `key`; rank 0's text `ours` and rank 1's `theirs` in it.
  void expect_refused(const std::string& key, const std::function<void(Config&, std::vector<ParamSpec>&)>& change,
                      const std::string& ours, const std::string& theirs) {
    SCOPED_TRACE(key);
    Config c = base();
    std::vector<ParamSpec> params = model();
    if (world_->rank() == 1) change(c, params);
    const auto start = std::chrono::steady_clock::now();
    try {
      Engine engine(c, *device_, *comm_, params);
      ADD_FAILURE() << key << " set differently on rank 1 was accepted";
    } catch (const Error& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find(key + " differs between ranks"), std::string::npos) << message;
      EXPECT_NE(message.find("rank 0 has '" + ours), std::string::npos) << message;
      EXPECT_NE(message.find("rank 1 has '" + theirs), std::string::npos) << message;
    }
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  }

  std::unique_ptr<World> world_ = make_world();
  std::unique_ptr<Device> device_ = make_cpu_device(std::size_t{64} << 20);
  // A hang (a disagreement not caught) ends in seconds here, as a CommError the test reports.
  std::unique_ptr<Communicator> comm_ = world_->make_host_communicator(*device_, std::chrono::seconds(20));
};

TEST_F(RanksThatDisagree, OnWhatDecidesTheirCollectives) {
  expect_refused("stage", [](Config& c, auto&) { c.stage = 3; }, "2", "3");
  expect_refused("buckets.reduce", [](Config& c, auto&) { c.buckets.reduce_bytes = std::size_t{1} << 20; }, "25MiB",
                 "1MiB");
  expect_refused("the model (its parameters' names, shapes and groups)",
                 [](Config&, std::vector<ParamSpec>& p) { p[2].shape = {4, 5}; }, "3 tensors, 84 elements",
                 "3 tensors, 88 elements");
}

TEST_F(RanksThatDisagree, OnWhatDecidesTheirUpdate) {
  expect_refused("optimizer.lr", [](Config& c, auto&) { c.optimizer.lr = 2e-3; }, "0.001", "0.002");
  expect_refused("gradient_clipping", [](Config& c, auto&) { c.gradient_clipping = 1.0; }, "0", "1");
  expect_refused("optimizer.states", [](Config& c, auto&) { c.optimizer.states = StatesFormat::int8; }, "fp32",
                 "int8");
  expect_refused("optimizer.seed", [](Config& c, auto&) { c.optimizer.seed = 5; }, "0", "5");
}

TEST_F(RanksThatDisagree, OnlyOnWhatTheyShare) {
  Config c = base();
  if (world_->rank() == 1) {
    c.optimizer.threads = 2;
    c.device.memory = std::size_t{96} << 20;
    c.comm.timeout = std::chrono::seconds(30);
  }
  EXPECT_NO_THROW(Engine(c, *device_, *comm_, model()));
}

// What changes after construction (set_optimizer_group: a scheduler, a warm-up) is each rank's,
// documented so: every rank updates its own shard with its own values, unchecked, since a check
// would cost a collective in every step. Here rank 1's learning rate is ten times rank 0's, and
// each half of the tensor (each rank's shard, stage 2) moves by its own rank's rate.
TEST_F(RanksThatDisagree, HyperParametersSetAfterConstructionAreEachRanks) {
  if (world_->size() != 2) GTEST_SKIP() << "the halves are the shards of two ranks; this run has " << world_->size();
  Config c = base();
  c.optimizer.weight_decay = 0.0;
  c.optimizer.lr = 1e-3;
  Engine engine(c, *device_, *comm_, {{"w", {256}, 0}});
  engine.set_param(0, std::vector<float>(256, 1.0f));
  if (world_->rank() == 1) engine.set_lr(0, 1e-2);
  const TensorView grad = engine.grad(0);
  std::fill(grad.as<float>(), grad.as<float>() + grad.numel, 1.0f);
  engine.grads_ready(0);
  engine.step();
  std::vector<float> after(256);
  engine.get_param(0, after);
  // Adam's first step moves each element by lr against its gradient's sign.
  EXPECT_NEAR(after[0], 1.0f - 1e-3f, 1e-6f);
  EXPECT_NEAR(after[255], 1.0f - 1e-2f, 1e-6f);
}

}  // namespace
}  // namespace zest
