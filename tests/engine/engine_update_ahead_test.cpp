// offload.optimizer.update_ahead under mpirun with 1, 2 and 4 ranks: the offloaded states of each
// group are updated while backward goes on, assuming the step neither overflows nor clips, and
// step() keeps or redoes that work. Whatever happens — a clean step, a forced overflow, forced
// clipping, a learning rate changed after backward, a micro-batch more than
// gradient_accumulation_steps — the parameters are the bits of the same run without update_ahead,
// and EngineStats says which work was kept and which redone, so a test that never updated ahead
// would fail.
#include <gtest/gtest.h>
#include <mpi.h>

#include <sys/stat.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <ostream>
#include <string>
#include <vector>

#include "engine/plan/layout.hpp"
#include "engine/offload_training.hpp"
#include "engine/reference_training.hpp"
#include "engine/shared_dir.hpp"
#include "offload/scratch_dir.hpp"
#include "runtime/comm/mpi_communicator.hpp"
#include "runtime/comm/mpi_session.hpp"
#include "zest/engine.hpp"
#include "zest/error.hpp"
#include "zest/estimate.hpp"

namespace zest {
namespace {

using namespace reference_training;

constexpr int kSteps = 6;
// The test model's groups (reference_training::model()).
constexpr std::int64_t kGroups = 4;

TrainedRun train(const Options& o, int steps = kSteps) { return train_on_cpu(o, steps); }

struct Mode {
  int stage;
  OffloadDevice optimizer;
  OffloadDevice param;
  DType dtype;
};

std::string name_of(OffloadDevice d) {
  return d == OffloadDevice::none ? "none" : d == OffloadDevice::cpu ? "cpu" : "nvme";
}

std::string mode_name(const testing::TestParamInfo<Mode>& info) {
  const Mode& m = info.param;
  return "stage" + std::to_string(m.stage) + "_optimizer_" + name_of(m.optimizer) + "_param_" + name_of(m.param) + "_" +
         std::string(dtype_name(m.dtype));
}

void PrintTo(const Mode& m, std::ostream* os) { *os << mode_name(testing::TestParamInfo<Mode>(m, 0)); }

class UpdateAhead : public testing::TestWithParam<Mode> {
 protected:
  // One group per reduce bucket, so each group's gradient is final (and handed over) during
  // backward; sub-groups of 128 parameters, so the pipeline wraps around its slots in a group.
  Options options(const test::ScratchDir& dir) const {
    Options o;
    o.stage = GetParam().stage;
    o.offload_optimizer = GetParam().optimizer;
    o.offload_param = GetParam().param;
    o.dtype = GetParam().dtype;
    o.nvme_path = dir.path();
    o.sub_group_bytes = 12 * 128;
    o.reduce_bucket = 4;
    o.update_ahead = true;
    return o;
  }
  // The same run without update_ahead.
  static std::vector<std::vector<float>> without(Options o, int steps = kSteps) {
    o.update_ahead = false;
    return train(o, steps).params;
  }
};

TEST_P(UpdateAhead, EveryGroupIsUpdatedDuringBackwardAndTheBitsAreThoseWithout) {
  test::ScratchDir dir;
  const Options o = options(dir);
  const TrainedRun got = train(o);
  EXPECT_TRUE(identical(got.params, without(o)));
  EXPECT_EQ(got.stats.groups_updated_ahead, kSteps * kGroups);
  EXPECT_EQ(got.stats.groups_redone, 0);
}

TEST_P(UpdateAhead, OneBucketForAllGroupsIsUpdatedAheadOnlyInsideStepAndStillMatches) {
  test::ScratchDir dir;
  Options o = options(dir);
  o.reduce_bucket = 0;  // the default 25MiB: the whole model reduced by step()'s flush
  const TrainedRun got = train(o);
  EXPECT_TRUE(identical(got.params, without(o)));
  EXPECT_EQ(got.stats.groups_updated_ahead, kSteps * kGroups);
}

TEST_P(UpdateAhead, ForcedClippingRedoesEveryGroupAndMatches) {
  test::ScratchDir dir;
  Options o = options(dir);
  o.clip = 0.05;  // below every step's gradient norm
  const TrainedRun got = train(o);
  EXPECT_TRUE(identical(got.params, without(o)));
  EXPECT_EQ(got.stats.groups_updated_ahead, 0);
  EXPECT_EQ(got.stats.groups_redone, kSteps * kGroups);
}

// An Inf gradient skips the step in every dtype (fp16 also halves its loss scale).
TEST_P(UpdateAhead, ForcedOverflowDropsTheStepsWorkAndMatches) {
  test::ScratchDir dir;
  Options o = options(dir);
  o.overflow_at_step = 3;
  const TrainedRun got = train(o);
  EXPECT_EQ(got.stats.skipped_steps, 1);
  EXPECT_TRUE(identical(got.params, without(o)));
  // Every other step keeps all of its groups; the overflowing one drops what was updated ahead by
  // the time its statistics were known (the Inf is in group 0's gradient, reduced last).
  EXPECT_EQ(got.stats.groups_updated_ahead, (kSteps - 1) * kGroups);
  EXPECT_LE(got.stats.groups_redone, kGroups);
}

TEST_P(UpdateAhead, AccumulatedMicroBatchesAreUpdatedAheadInTheLastOneAndMatch) {
  test::ScratchDir dir;
  Options o = options(dir);
  o.accumulation = 2;
  o.clip = 1e6;  // on, never reached
  const TrainedRun got = train(o);
  EXPECT_TRUE(identical(got.params, without(o)));
  EXPECT_EQ(got.stats.groups_updated_ahead, kSteps * kGroups);
}

// The trainer runs two micro-batches where the config says one: each group is handed over after
// the first, and its second reduction retracts it before changing the gradient.
TEST_P(UpdateAhead, AMicroBatchBeyondTheConfiguredCountRetractsTheGroupAndMatches) {
  test::ScratchDir dir;
  Options o = options(dir);
  o.accumulation = 2;
  o.config_accumulation = 1;
  const TrainedRun got = train(o);
  EXPECT_TRUE(identical(got.params, without(o)));
  EXPECT_EQ(got.stats.groups_updated_ahead, 0);
}

// A schedule sets the learning rate after backward, before step(): the updates ahead assumed the
// previous one (except the first step's factor, the same as the initial lr).
TEST_P(UpdateAhead, ALearningRateChangedAfterBackwardIsRedoneAndMatches) {
  test::ScratchDir dir;
  Options o = options(dir);
  o.lr_factor = [](int step) { return 1.0 / step; };
  const TrainedRun got = train(o);
  EXPECT_TRUE(identical(got.params, without(o)));
  EXPECT_EQ(got.stats.groups_updated_ahead, kGroups);  // step 1: factor 1, the lr unchanged
  EXPECT_EQ(got.stats.groups_redone, (kSteps - 1) * kGroups);
}

INSTANTIATE_TEST_SUITE_P(
    Modes, UpdateAhead,
    testing::Values(Mode{2, OffloadDevice::cpu, OffloadDevice::none, DType::f32},
                    Mode{2, OffloadDevice::nvme, OffloadDevice::none, DType::f32},
                    Mode{2, OffloadDevice::nvme, OffloadDevice::none, DType::bf16},
                    Mode{2, OffloadDevice::cpu, OffloadDevice::none, DType::f16},
                    Mode{3, OffloadDevice::nvme, OffloadDevice::none, DType::f16},
                    Mode{3, OffloadDevice::cpu, OffloadDevice::cpu, DType::bf16},
                    Mode{3, OffloadDevice::nvme, OffloadDevice::nvme, DType::f32}),
    mode_name);

// A small trainer of its own (the checkpoint test needs the engines): every group's gradient is a
// function of the step, the tensor and the element, handed over in backward order.
void backward(Engine& engine, int step) {
  for (int g = engine.group_count() - 1; g >= 0; --g) {
    auto lease = engine.acquire(g);
    for (std::size_t t = 0; t < engine.tensor_count(); ++t) {
      if (engine.spec(t).group != g) continue;
      auto* grad = static_cast<float*>(lease.grad(t).data);
      for (std::size_t j = 0; j < engine.spec(t).numel(); ++j)
        grad[j] = 0.01f * static_cast<float>(
                              std::sin(0.3 * step + 0.7 * static_cast<double>(t) + 0.01 * static_cast<double>(j)));
    }
    engine.grads_ready(g);
  }
}

std::string file_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// A checkpoint holds the committed states wherever the current copy is (a region of either pair,
// or either pinned array): the state files of the engine that updates ahead are the plain
// engine's byte for byte, and either checkpoint resumes in either engine to the same bits.
class UpdateAheadCheckpoints : public testing::TestWithParam<OffloadDevice> {};

TEST_P(UpdateAheadCheckpoints, SaveTheCommittedStatesAndResumeEitherWay) {
  test::ScratchDir swap;    // this rank's
  test::SharedDir saved;    // every rank's checkpoint
  MpiSession session;
  auto device = make_cpu_device(std::size_t{256} << 20);
  auto comm = make_mpi_communicator(session, *device);
  Options o;
  o.stage = 2;
  o.offload_optimizer = GetParam();
  o.sub_group_bytes = 12 * 128;
  o.reduce_bucket = 4;
  const std::string plain_swap = swap.path() + "/plain", ahead_swap = swap.path() + "/ahead";
  ASSERT_EQ(::mkdir(plain_swap.c_str(), 0700), 0);
  ASSERT_EQ(::mkdir(ahead_swap.c_str(), 0700), 0);
  const auto config = [&](bool update_ahead) {
    Options with = o;
    with.update_ahead = update_ahead;
    with.nvme_path = update_ahead ? ahead_swap : plain_swap;
    return make_config(with);
  };
  const std::string plain_dir = saved.path() + "/plain", ahead_dir = saved.path() + "/ahead";
  {
    Engine plain(config(false), *device, *comm, model());
    Engine ahead(config(true), *device, *comm, model());
    for (int step = 1; step <= 3; ++step) {
      backward(plain, step);
      plain.step();
      backward(ahead, step);
      ahead.step();
    }
    EXPECT_EQ(ahead.stats().groups_updated_ahead, 3 * kGroups);
    plain.save(plain_dir);
    ahead.save(ahead_dir);
  }
  for (const char* state : {"master", "m", "v"}) {
    const std::string name = "/rank" + std::to_string(comm->rank()) + "." + state + ".bin";
    EXPECT_EQ(file_text(plain_dir + name), file_text(ahead_dir + name)) << name;
  }
  // Resume: each checkpoint into the other kind of engine, two more steps, the same bits.
  std::vector<std::vector<std::vector<float>>> results;
  for (const bool update_ahead : {false, true}) {
    Engine engine(config(update_ahead), *device, *comm, model());
    engine.load(update_ahead ? plain_dir : ahead_dir);
    for (int step = 4; step <= 5; ++step) {
      backward(engine, step);
      engine.step();
    }
    results.push_back(params_of(engine));
  }
  EXPECT_TRUE(identical(results[0], results[1]));
}

INSTANTIATE_TEST_SUITE_P(CpuAndNvme, UpdateAheadCheckpoints, testing::Values(OffloadDevice::cpu, OffloadDevice::nvme),
                         [](const testing::TestParamInfo<OffloadDevice>& info) { return name_of(info.param); });

// The second copy of the states and the updated parameters are in the plan, the estimate and
// what the engine holds: cpu pins 12 more bytes per parameter of the shard, nvme doubles the swap.
TEST(UpdateAheadMemory, TheSecondCopyIsCountedWhereItLives) {
  test::ScratchDir dir;
  for (const OffloadDevice where : {OffloadDevice::cpu, OffloadDevice::nvme}) {
    SCOPED_TRACE(name_of(where));
    Options o;
    o.stage = 2;
    o.offload_optimizer = where;
    o.nvme_path = dir.path();
    o.dtype = DType::bf16;
    const TrainedRun plain = train(o, 1);
    o.update_ahead = true;
    const TrainedRun ahead = train(o, 1);
    int ranks = 1;
    MPI_Comm_size(MPI_COMM_WORLD, &ranks);
    const MemoryEstimate estimate = estimate_memory(make_config(o), specs_of(o), ranks);
    EXPECT_EQ(ahead.stats.nvme_bytes, estimate.nvme);
    EXPECT_EQ(ahead.stats.nvme_bytes, 2 * plain.stats.nvme_bytes);
    const std::size_t extra = ahead.stats.offload_pinned_bytes - plain.stats.offload_pinned_bytes;
    const std::size_t shard = engine::Layout(specs_of(o), ranks).shard_numel();
    // The updated parameters (bf16) of the shard, and for cpu the states again; both rounded up a
    // little (padding, slot alignment).
    const std::size_t expected = 2 * shard + (where == OffloadDevice::cpu ? 12 * shard : 0);
    EXPECT_GE(extra, expected);
    EXPECT_LT(extra, expected + 4096 + 14 * 64 * 5);
  }
}

}  // namespace
}  // namespace zest
