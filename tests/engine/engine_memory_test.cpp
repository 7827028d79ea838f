// The engine's device memory against the ZeRO paper's formulas, under mpirun (1 and 4 ranks).
//
// With Ψ parameters in bf16 and mixed-precision Adam (fp32 master, m, v), per rank:
//   stage 0  params 2Ψ    grads 2Ψ    optimizer states 12Ψ    = 16Ψ
//   stage 1  params 2Ψ    grads 2Ψ    optimizer states 12Ψ/N  = 4Ψ + 12Ψ/N
//   stage 2  params 2Ψ    grads 2Ψ/N  optimizer states 12Ψ/N  = 2Ψ + 14Ψ/N
//   stage 3  params 2Ψ/N  grads 2Ψ/N  optimizer states 12Ψ/N  = 16Ψ/N
// Each category's peak must be at least its formula (padding only adds) and within 5% above it.
// Buffers are bounded by what the config allows (see buffer_bound). The model has ~2.1M parameters
// in odd-sized tensors, so padding is real but small.
#include "zest/engine.hpp"

#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "runtime/host/half.hpp"
#include "runtime/comm/mpi_communicator.hpp"
#include "runtime/comm/mpi_session.hpp"
#include "zest/error.hpp"

namespace zest {
namespace {

constexpr int kLargeGroups = 8;
constexpr std::size_t kSmallGroupNumel = 500;  // 1000 bytes in bf16; padded to 512 elements
constexpr double kTolerance = 1.05;

// Eight layers of odd-sized weight and bias, then one small group (a final norm).
std::vector<ParamSpec> model() {
  std::vector<ParamSpec> specs;
  for (int g = 0; g < kLargeGroups; ++g) {
    const std::size_t rows = 509 + 2 * static_cast<std::size_t>(g), cols = 503 + 4 * static_cast<std::size_t>(g);
    const std::string layer = std::string("layer").append(std::to_string(g));
    specs.push_back({std::string(layer).append(".weight"), {rows, cols}, g});
    specs.push_back({std::string(layer).append(".bias"), {cols}, g});
  }
  specs.push_back({"final_norm", {kSmallGroupNumel}, kLargeGroups});
  return specs;
}

std::size_t model_numel() {
  std::size_t n = 0;
  for (const ParamSpec& p : model()) n += p.numel();
  return n;
}

// Bytes of the largest group's parameters in bf16, plus 1% for its padding: an upper bound of the
// engine's largest segment.
std::size_t segment_bound() {
  std::map<int, std::size_t> group_numel;
  for (const ParamSpec& p : model()) group_numel[p.group] += p.numel();
  std::size_t largest = 0;
  for (const auto& [group, numel] : group_numel) largest = std::max(largest, numel);
  return 2 * largest * 101 / 100;
}

constexpr std::size_t kDeviceBudget = std::size_t{256} << 20;

Config memory_config(int stage, std::size_t budget) {
  Config c;
  c.stage = stage;
  c.device.memory = budget;
  c.precision.dtype = DType::bf16;
  c.precision.loss_scale.dynamic = false;
  c.optimizer.type = OptimizerType::adam;
  c.optimizer.lr = 0.01;
  c.optimizer.weight_decay = 0;
  c.optimizer.threads = 1;
  c.stage3.persistence_threshold_bytes = 512;  // below every group: none resident
  c.stage3.max_live_bytes = 3 * segment_bound();
  c.stage3.prefetch_bytes = 2 * segment_bound();
  // Reduce buckets of one layer, so the buffers stay two layers: with the default 25MiB each of the
  // two buckets would hold this small model's whole gradient.
  c.buckets.reduce_bytes = segment_bound();
  // Likewise the parameter all-gather's bucket: at most one layer (the default would hold the
  // whole model under stages 1-2).
  c.buckets.allgather_bytes = segment_bound();
  return c;
}

// What the config lets the engine hold in `buffers`: two gradient buckets of max(buckets.reduce,
// the largest segment); the all-gather bucket, at most buckets.allgather; under stage 3 the
// gathered-parameter buffers, at most max(max_live, two segments) (two is the engine's minimum);
// 256 bytes for step()'s scalars.
std::size_t buffer_bound(const Config& c) {
  std::size_t bound = 2 * std::max(c.buckets.reduce_bytes, segment_bound()) + c.buckets.allgather_bytes + 256;
  // Stages 1-3: a bucket of several groups is packed rank-major for its reduce-scatter.
  if (c.stage >= 1) bound += c.buckets.reduce_bytes;
  if (c.stage == 3) bound += std::max(c.stage3.max_live_bytes, 2 * segment_bound());
  return bound;
}

struct Formula {
  double params, grads, optimizer_states;
  double total() const { return params + grads + optimizer_states; }
};

Formula zero_formula(int stage, double psi, double ranks) {
  return {stage >= 3 ? 2 * psi / ranks : 2 * psi, stage >= 2 ? 2 * psi / ranks : 2 * psi,
          stage >= 1 ? 12 * psi / ranks : 12 * psi};
}

float initial(std::size_t tensor, std::size_t j) {
  return static_cast<float>(0.5 * std::cos(0.3 * static_cast<double>(tensor) + 0.001 * static_cast<double>(j)));
}
float target(std::size_t tensor, std::size_t j) {
  return static_cast<float>(0.5 * std::sin(0.7 * static_cast<double>(tensor) + 0.002 * static_cast<double>(j)));
}

// Least squares toward fixed targets, the global batch split evenly across ranks. Returns the loss
// 1/2 |p - t|^2 seen in each step's forward, then once more after the last step.
std::vector<double> train(Engine& engine, int steps, int ranks) {
  const std::vector<ParamSpec> specs = model();
  std::vector<std::vector<float>> targets(specs.size());
  for (std::size_t t = 0; t < specs.size(); ++t) {
    std::vector<float> values(specs[t].numel());
    targets[t].resize(specs[t].numel());
    for (std::size_t j = 0; j < values.size(); ++j) {
      values[j] = initial(t, j);
      targets[t][j] = target(t, j);
    }
    engine.set_param(t, values);
  }
  auto forward_loss = [&] {
    double loss = 0;
    for (int g = 0; g < engine.group_count(); ++g) {
      auto lease = engine.acquire(g);
      for (std::size_t t = 0; t < specs.size(); ++t) {
        if (specs[t].group != g) continue;
        const auto* p = static_cast<const std::uint16_t*>(lease.param(t).data);
        for (std::size_t j = 0; j < specs[t].numel(); ++j) {
          const double d = bf16_to_float(p[j]) - targets[t][j];
          loss += 0.5 * d * d;
        }
      }
    }
    return loss;
  };
  std::vector<double> losses;
  for (int step = 0; step < steps; ++step) {
    losses.push_back(forward_loss());
    for (int g = engine.group_count() - 1; g >= 0; --g) {
      auto lease = engine.acquire(g);
      for (std::size_t t = 0; t < specs.size(); ++t) {
        if (specs[t].group != g) continue;
        const auto* p = static_cast<const std::uint16_t*>(lease.param(t).data);
        auto* grad = static_cast<std::uint16_t*>(lease.grad(t).data);
        for (std::size_t j = 0; j < specs[t].numel(); ++j)
          grad[j] = float_to_bf16((bf16_to_float(p[j]) - targets[t][j]) / static_cast<float>(ranks));
      }
      engine.grads_ready(g);
    }
    EXPECT_FALSE(engine.step().skipped);
  }
  losses.push_back(forward_loss());
  return losses;
}

struct Measured {
  double psi = 0;           // parameters, without padding
  double ranks = 1;
  MemoryStats during;       // after training, the Engine alive
  MemoryStats after;        // once the Engine is destroyed
  std::vector<double> losses;
};

Measured measure(const Config& config, int steps) {
  MpiSession session;
  auto device = make_cpu_device(config.device.memory);
  auto comm = make_mpi_communicator(session, *device);
  Measured out;
  out.ranks = comm->size();
  {
    Engine engine(config, *device, *comm, model());
    out.psi = static_cast<double>(engine.numel());
    out.losses = train(engine, steps, comm->size());
    out.during = engine.stats().memory;
  }
  out.after = device->memory_stats();
  return out;
}

// Each stage is measured once (2 steps) and shared by the tests below; every rank runs the same
// tests in the same order, so the collective runs line up.
const Measured& measured(int stage) {
  static std::map<int, Measured> cache;
  auto it = cache.find(stage);
  if (it == cache.end()) it = cache.emplace(stage, measure(memory_config(stage, kDeviceBudget), 2)).first;
  return it->second;
}

std::size_t peak(const MemoryStats& m, MemoryCategory c) { return m.peak_of(c); }
std::size_t three_categories(const MemoryStats& m) {
  return peak(m, MemoryCategory::params) + peak(m, MemoryCategory::grads) + peak(m, MemoryCategory::optimizer_states);
}

void expect_near_formula(const char* what, std::size_t got, double formula) {
  EXPECT_GE(static_cast<double>(got), formula) << what << ": fewer bytes than the formula's " << formula;
  EXPECT_LE(static_cast<double>(got), formula * kTolerance) << what << ": more than 5% above the formula's " << formula;
}

TEST(EngineMemory, TheModelIsAFewMillionParameters) {
  EXPECT_GE(model_numel(), std::size_t{2} << 20);
  EXPECT_LE(model_numel(), std::size_t{4} << 20);
  EXPECT_EQ(measured(0).psi, static_cast<double>(model_numel()));
}

class EveryStage : public testing::TestWithParam<int> {};

TEST_P(EveryStage, PeakPerCategoryMatchesTheZeroFormulaWithin5Percent) {
  const int stage = GetParam();
  const Measured& m = measured(stage);
  const Formula f = zero_formula(stage, m.psi, m.ranks);
  expect_near_formula("params", peak(m.during, MemoryCategory::params), f.params);
  expect_near_formula("grads", peak(m.during, MemoryCategory::grads), f.grads);
  expect_near_formula("optimizer_states", peak(m.during, MemoryCategory::optimizer_states), f.optimizer_states);
  expect_near_formula("params+grads+optimizer_states", three_categories(m.during), f.total());
}

TEST_P(EveryStage, BuffersStayWithinWhatTheConfigAllows) {
  const int stage = GetParam();
  const Measured& m = measured(stage);
  const std::size_t buffers = peak(m.during, MemoryCategory::buffers);
  // Backward writes a whole group's gradients before grads_ready: at least the largest one is staged.
  EXPECT_GE(buffers, segment_bound() * 100 / 101);
  EXPECT_LE(buffers, buffer_bound(memory_config(stage, kDeviceBudget)));
  // The peak of the total is the four categories together, never more.
  EXPECT_GE(m.during.peak_total, three_categories(m.during));
  EXPECT_LE(m.during.peak_total, three_categories(m.during) + buffer_bound(memory_config(stage, kDeviceBudget)));
}

TEST_P(EveryStage, NothingIsAllocatedInsideAStep) {
  // Pools are allocated once: after two steps every category is at its peak, none went above.
  const Measured& m = measured(GetParam());
  for (std::size_t c = 0; c < kMemoryCategoryCount; ++c)
    EXPECT_EQ(m.during.current[c], m.during.peak[c]) << category_name(static_cast<MemoryCategory>(c));
  EXPECT_EQ(m.during.current_total, m.during.peak_total);
}

TEST_P(EveryStage, CountersReturnToZeroWhenTheEngineIsDestroyed) {
  const Measured& m = measured(GetParam());
  for (std::size_t c = 0; c < kMemoryCategoryCount; ++c)
    EXPECT_EQ(m.after.current[c], 0u) << category_name(static_cast<MemoryCategory>(c));
  EXPECT_EQ(m.after.current_total, 0u);
  EXPECT_GT(m.after.peak_total, 0u);  // the figures were there to come back from
}

TEST_P(EveryStage, TrainingActuallyRan) {
  const std::vector<double>& losses = measured(GetParam()).losses;
  ASSERT_EQ(losses.size(), 3u);
  EXPECT_LT(losses[1], losses[0]);
  EXPECT_LT(losses[2], losses[1]);
}

INSTANTIATE_TEST_SUITE_P(Stages, EveryStage, testing::Values(0, 1, 2, 3),
                         [](const testing::TestParamInfo<int>& info) { return "stage" + std::to_string(info.param); });

TEST(EngineMemory, StageToStage0RatiosAreTheFormulas) {
  const double ranks = measured(0).ranks;
  const double stage0 = static_cast<double>(three_categories(measured(0).during));
  const double want[] = {1.0, (4 + 12 / ranks) / 16, (2 + 14 / ranks) / 16, 1 / ranks};
  for (int stage = 1; stage <= 3; ++stage) {
    const double ratio = static_cast<double>(three_categories(measured(stage).during)) / stage0;
    EXPECT_NEAR(ratio / want[stage], 1.0, kTolerance - 1) << "stage " << stage << " / stage 0 = " << ratio
                                                         << ", formula " << want[stage];
  }
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank == 0) {  // the figures, for the record
    std::printf("%d ranks, psi %.0f: peak bytes per rank (MiB) and ratio to the formula\n", static_cast<int>(ranks),
                measured(0).psi);
    std::printf("stage      params       grads   opt_states     buffers  peak_total   p+g+o/formula  /stage0\n");
    for (int stage = 0; stage <= 3; ++stage) {
      const MemoryStats& m = measured(stage).during;
      const double mib = 1 << 20;
      std::printf("%5d  %10.3f  %10.3f  %11.3f  %10.3f  %10.3f  %14.4f  %7.4f\n", stage,
                  static_cast<double>(peak(m, MemoryCategory::params)) / mib,
                  static_cast<double>(peak(m, MemoryCategory::grads)) / mib,
                  static_cast<double>(peak(m, MemoryCategory::optimizer_states)) / mib,
                  static_cast<double>(peak(m, MemoryCategory::buffers)) / mib,
                  static_cast<double>(m.peak_total) / mib,
                  static_cast<double>(three_categories(m)) / zero_formula(stage, measured(0).psi, ranks).total(),
                  static_cast<double>(three_categories(m)) / stage0);
    }
  }
  if (ranks == 4) {
    EXPECT_NEAR(want[1], 0.4375, 1e-12);  // 7Ψ of 16Ψ
    EXPECT_NEAR(want[2], 0.34375, 1e-12);  // 5.5Ψ of 16Ψ
    EXPECT_NEAR(want[3], 0.25, 1e-12);  // 4Ψ of 16Ψ
  }
}

TEST(EngineMemory, Stage3CountsAResidentSmallGroupAsParams) {
  Config config = memory_config(3, kDeviceBudget);
  config.stage3.persistence_threshold_bytes = 4096;  // above the small group (1 KiB), below the rest
  const Measured& sharded = measured(3);             // threshold 512: no group resident
  const Measured resident = measure(config, 2);
  // The resident group's full segment comes on top of its shard; the rest is unchanged.
  const auto extra = static_cast<double>(peak(resident.during, MemoryCategory::params)) -
                     static_cast<double>(peak(sharded.during, MemoryCategory::params));
  expect_near_formula("resident small group", static_cast<std::size_t>(extra), 2.0 * kSmallGroupNumel);
  EXPECT_EQ(peak(resident.during, MemoryCategory::grads), peak(sharded.during, MemoryCategory::grads));
  EXPECT_EQ(peak(resident.during, MemoryCategory::optimizer_states),
            peak(sharded.during, MemoryCategory::optimizer_states));
  EXPECT_LE(peak(resident.during, MemoryCategory::buffers), peak(sharded.during, MemoryCategory::buffers));
  EXPECT_EQ(resident.after.current_total, 0u);
  EXPECT_LT(resident.losses.back(), resident.losses.front());
}

TEST(EngineMemory, AModelThatOnlyFitsUnderStage3FailsClearlyUnderStage0AndTrainsUnderStage3) {
  MpiSession session;
  int ranks = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  if (ranks < 2) GTEST_SKIP() << "with one rank stage 3 needs as much as stage 0";
  const double psi = static_cast<double>(model_numel());
  const double need3 = zero_formula(3, psi, ranks).total() * kTolerance +
                       static_cast<double>(buffer_bound(memory_config(3, kDeviceBudget)));
  const double need0 = zero_formula(0, psi, ranks).total();
  ASSERT_LT(need3, need0);
  const auto budget = static_cast<std::size_t>((need3 + need0) / 2);

  auto device = make_cpu_device(budget);
  auto comm = make_mpi_communicator(session, *device);
  try {
    Engine engine(memory_config(0, budget), *device, *comm, model());
    ADD_FAILURE() << "stage 0 fit in a budget of " << budget << " bytes for " << psi << " parameters";
  } catch (const OutOfDeviceMemory& e) {
    const std::string message = e.what();
    EXPECT_EQ(e.budget(), budget);
    EXPECT_NE(message.find(std::to_string(budget)), std::string::npos) << message;
    EXPECT_NE(message.find("budget"), std::string::npos) << message;
    // Under stage 0 Adam's fp32 states (12Ψ, one allocation: master, m and v side by side) are
    // what does not fit.
    EXPECT_NE(message.find("for optimizer_states"), std::string::npos) << message;
    EXPECT_NE(message.find("stage"), std::string::npos) << message;  // says what to do
    EXPECT_GE(static_cast<double>(e.requested()), 12 * psi);
  }
  // The failed construction gave back everything it had taken.
  EXPECT_EQ(device->memory_stats().current_total, 0u);
  EXPECT_LE(device->memory_stats().peak_total, budget);

  Config config = memory_config(3, budget);
  std::vector<double> losses;
  {
    Engine engine(config, *device, *comm, model());
    losses = train(engine, 3, ranks);
    EXPECT_LE(engine.stats().memory.peak_total, budget);
    EXPECT_EQ(engine.stats().steps, 3);
  }
  ASSERT_EQ(losses.size(), 4u);
  for (std::size_t i = 1; i < losses.size(); ++i) EXPECT_LT(losses[i], losses[i - 1]) << "after step " << i;
  EXPECT_LT(losses.back(), 0.95 * losses.front());
  EXPECT_EQ(device->memory_stats().current_total, 0u);
}

}  // namespace
}  // namespace zest

namespace zest {
namespace {

// Stage 3 with room for three gathered groups (max_live) holds only two leases, but in a different
// order than the previous step's: the groups prefetched for the old order must not use up the room.
TEST(EngineMemory, Stage3PrefetchDoesNotStarveALeaseWithinMaxLive) {
  MpiSession session;
  auto device = make_cpu_device(kDeviceBudget);
  auto comm = make_mpi_communicator(session, *device);
  Engine engine(memory_config(3, kDeviceBudget), *device, *comm, model());
  train(engine, 1, comm->size());  // records the order 0..8, 8..0
  auto first = engine.acquire(0);  // prefetches 1 and 2 into the other two buffers
  EXPECT_NO_THROW({ auto second = engine.acquire(5); }) << "two leases, three gathered buffers";
}

}  // namespace
}  // namespace zest
