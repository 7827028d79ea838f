// Engine::set_compute_stream: the engine orders its own streams after the trainer's stream with
// events, where the trainer's device work runs asynchronously to the host (torch's current CUDA
// stream). Proven here on the cpu device, whose streams are worker threads: the trainer's "kernels"
// are host tasks on a stream of the same device that start late (a sleep), so an engine that did
// not wait for them would reduce gradients not written yet, overwrite a gathered buffer still being
// read, or update parameters still being read. Each case fails when its wait is removed from
// engine.cpp (State::after_compute at grads_ready, at a stage-3 lease's end, at step()). Runs
// under mpirun at 1 and 2 ranks, and under ThreadSanitizer, which would also report the race.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "runtime/comm/world.hpp"
#include "zest/engine.hpp"
#include "zest/error.hpp"

namespace zest {
namespace {

using namespace std::chrono_literals;

// Long enough that the engine's next work on its own stream would run first without the wait.
constexpr auto kLateBy = 150ms;

std::vector<ParamSpec> model() { return {{"a.w", {64}, 0}, {"a.b", {8}, 0}, {"b.w", {64}, 1}, {"c.w", {32}, 2}}; }

std::vector<float> values_of(const ParamSpec& spec, float base) {
  std::vector<float> v(spec.numel());
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = base + 0.01f * static_cast<float>(i);
  return v;
}

class ComputeStream : public testing::Test {
 protected:
  Config config(int stage) const {
    Config c;
    c.stage = stage;
    c.device.memory = std::size_t{64} << 20;
    c.optimizer.lr = 0.1;
    c.stage3.persistence_threshold_bytes = 0;  // every group gathered into a pool buffer
    c.stage3.prefetch_bytes = 0;               // and only when acquired
    return c;
  }

  // An engine over this rank's device with every parameter set, and the trainer's stream.
  std::unique_ptr<Engine> engine(int stage) {
    auto e = std::make_unique<Engine>(config(stage), *device_, *comm_, model());
    for (std::size_t t = 0; t < e->tensor_count(); ++t)
      e->set_param(t, values_of(e->spec(t), static_cast<float>(t + 1)));
    e->set_compute_stream(compute_.get());
    return e;
  }

  std::unique_ptr<World> world_ = make_world();
  std::unique_ptr<Device> device_ = make_cpu_device(std::size_t{64} << 20);
  std::unique_ptr<Communicator> comm_ = world_->make_host_communicator(*device_);
  std::unique_ptr<Stream> compute_ = device_->create_stream();
};

// Every rank writes gradient 1 into every element, late, on the compute stream: the step sees the
// sum over ranks, so the norm is sqrt(numel) * ranks exactly, where reading early would give 0.
TEST_F(ComputeStream, GradientsWrittenLateOnTheTrainersStreamAreReduced) {
  for (const int stage : {0, 2, 3}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    auto e = engine(stage);
    std::size_t numel = 0;
    for (int g = e->group_count() - 1; g >= 0; --g) {
      for (std::size_t t = 0; t < e->tensor_count(); ++t) {
        if (e->spec(t).group != g) continue;
        const TensorView grad = e->grad(t);
        numel += grad.numel;
        compute_->host_task([grad] {
          std::this_thread::sleep_for(kLateBy / 4);
          std::fill(grad.as<float>(), grad.as<float>() + grad.numel, 1.0f);
        });
      }
      e->grads_ready(g);
    }
    const StepResult result = e->step();
    compute_->synchronize();
    EXPECT_FALSE(result.skipped);
    EXPECT_DOUBLE_EQ(result.grad_norm, std::sqrt(static_cast<double>(numel)) * comm_->size());
  }
}

// Stage 3: the trainer still reads group 0's gathered parameters on its stream when the lease ends;
// the next gather (group 1, into the same pool buffer: the first free one) must wait for that read.
TEST_F(ComputeStream, AGatheredBufferIsReusedOnlyAfterTheTrainersReads) {
  auto e = engine(3);
  const std::vector<float> expected = values_of(e->spec(0), 1.0f);
  std::vector<float> read(expected.size());
  void* first_buffer = nullptr;
  {
    const Engine::GroupLease lease = e->acquire(0);
    const TensorView w = lease.param(0);
    first_buffer = w.data;
    compute_->host_task([w, &read] {
      std::this_thread::sleep_for(kLateBy);
      std::memcpy(read.data(), w.data, read.size() * sizeof(float));
    });
  }
  const Engine::GroupLease next = e->acquire(1);
  ASSERT_EQ(next.param(2).data, first_buffer) << "the test needs group 1 gathered into group 0's buffer";
  compute_->synchronize();
  EXPECT_EQ(read, expected);
}

// step() rewrites the parameters (stage 0: in place): it must wait for the trainer's last reads.
TEST_F(ComputeStream, TheStepWaitsForTheTrainersReadsOfTheParameters) {
  auto e = engine(0);
  const std::vector<float> before = values_of(e->spec(0), 1.0f);
  std::vector<float> read(before.size());
  const Engine::GroupLease lease = e->acquire(0);
  const TensorView w = lease.param(0);
  for (int g = e->group_count() - 1; g >= 0; --g) {
    for (std::size_t t = 0; t < e->tensor_count(); ++t) {
      if (e->spec(t).group != g) continue;
      const TensorView grad = e->grad(t);
      std::fill(grad.as<float>(), grad.as<float>() + grad.numel, 1.0f);
    }
    e->grads_ready(g);
  }
  compute_->host_task([w, &read] {
    std::this_thread::sleep_for(kLateBy);
    std::memcpy(read.data(), w.data, read.size() * sizeof(float));
  });
  e->step();
  compute_->synchronize();
  EXPECT_EQ(read, before);
  EXPECT_NE(std::memcmp(w.data, before.data(), before.size() * sizeof(float)), 0) << "the step changed nothing";
}

TEST_F(ComputeStream, TheCpuDeviceHasNoNativeStreamToBorrow) {
  int native = 0;
  try {
    device_->borrow_stream(&native);
    ADD_FAILURE() << "borrow_stream on the cpu device did not throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no native streams"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace zest
