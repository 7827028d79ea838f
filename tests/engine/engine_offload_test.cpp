// The engine with its optimizer states (stages 1-3) and stage 3's parameter shards offloaded to
// pinned host memory (cpu) or an NVMe swap file (nvme), under mpirun with 1, 2 and 4 ranks: every
// mode must train to the reference Adam's values AND to exactly the bits of the same run without
// offload; the device must hold no optimizer states (and, with parameters offloaded, only the small
// resident groups' parameters); the host and NVMe bytes must be what the mode promises; and an I/O
// failure of the swap file must surface from step() naming the file and errno. With the whole
// optimizer offloaded at stages 2-3, the gradient shard lives on the host, not the device.
#include <gtest/gtest.h>
#include <mpi.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

#include "engine/plan/layout.hpp"
#include "engine/offload_training.hpp"
#include "engine/reference_training.hpp"
#include "offload/scratch_dir.hpp"
#include "runtime/comm/mpi_communicator.hpp"
#include "runtime/comm/mpi_session.hpp"
#include "zest/engine.hpp"
#include "zest/error.hpp"
#include "zest/estimate.hpp"

namespace zest {
namespace {

using namespace reference_training;

constexpr int kSteps = 12;
// 128 parameters per sub-group: every group's shard is cut into several, so the pipeline runs
// (and wraps around its buffers) within each group and across group boundaries.
constexpr std::size_t kSubGroupBytes = 12 * 128;

TrainedRun train(const Options& o, int steps = kSteps) { return train_on_cpu(o, steps); }

int test_rank() {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}

std::size_t file_bytes(const std::string& path) {
  struct stat info {};
  return ::stat(path.c_str(), &info) == 0 ? static_cast<std::size_t>(info.st_size) : 0;
}

int world_size() {
  int size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return size;
}

std::size_t shard_numel(int stage) {
  return engine::Layout(model(), stage == 0 ? 1 : world_size()).shard_numel();
}

std::string device_name(OffloadDevice d) {
  return d == OffloadDevice::none ? "none" : d == OffloadDevice::cpu ? "cpu" : "nvme";
}

struct Mode {
  int stage;
  OffloadDevice optimizer;
  OffloadDevice param;
};

std::string mode_name(const testing::TestParamInfo<Mode>& info) {
  return "stage" + std::to_string(info.param.stage) + "_optimizer_" + device_name(info.param.optimizer) + "_param_" +
         device_name(info.param.param);
}

class EveryOffloadMode : public testing::TestWithParam<Mode> {
 protected:
  Options options(const test::ScratchDir& dir) const {
    Options o;
    o.stage = GetParam().stage;
    o.offload_optimizer = GetParam().optimizer;
    o.offload_param = GetParam().param;
    o.nvme_path = dir.path();
    o.sub_group_bytes = kSubGroupBytes;
    return o;
  }
  static Options without_offload(Options o) {
    o.offload_optimizer = o.offload_param = OffloadDevice::none;
    return o;
  }
};

TEST_P(EveryOffloadMode, Fp32MatchesReferenceAndTheRunWithoutOffloadBitForBit) {
  test::ScratchDir dir;
  const Options o = options(dir);
  const TrainedRun got = train(o);
  EXPECT_LT(max_relative_error(got.params, train_reference(o, kSteps)), 1e-6);
  EXPECT_TRUE(identical(got.params, train(without_offload(o)).params));
}

TEST_P(EveryOffloadMode, AccumulationAndClippingMatchTheRunWithoutOffload) {
  test::ScratchDir dir;
  Options o = options(dir);
  o.accumulation = 2;
  o.clip = 0.05;
  const TrainedRun got = train(o);
  EXPECT_LT(max_relative_error(got.params, train_reference(o, kSteps)), 1e-6);
  EXPECT_TRUE(identical(got.params, train(without_offload(o)).params));
}

TEST_P(EveryOffloadMode, Fp16OverflowSkipsTheStepAsWithoutOffload) {
  test::ScratchDir dir;
  Options o = options(dir);
  o.dtype = DType::f16;
  o.overflow_at_step = 3;
  const TrainedRun got = train(o);
  EXPECT_EQ(got.stats.skipped_steps, 1);
  EXPECT_EQ(got.stats.loss_scale, 128.0);
  EXPECT_LT(max_relative_error(got.params, train_reference(o, kSteps)), 2e-3);
  EXPECT_TRUE(identical(got.params, train(without_offload(o)).params));
}

INSTANTIATE_TEST_SUITE_P(
    Modes, EveryOffloadMode,
    testing::Values(Mode{1, OffloadDevice::cpu, OffloadDevice::none}, Mode{1, OffloadDevice::nvme, OffloadDevice::none},
                    Mode{2, OffloadDevice::cpu, OffloadDevice::none}, Mode{2, OffloadDevice::nvme, OffloadDevice::none},
                    Mode{3, OffloadDevice::cpu, OffloadDevice::none}, Mode{3, OffloadDevice::nvme, OffloadDevice::none},
                    Mode{3, OffloadDevice::none, OffloadDevice::cpu}, Mode{3, OffloadDevice::none, OffloadDevice::nvme},
                    Mode{3, OffloadDevice::cpu, OffloadDevice::cpu}, Mode{3, OffloadDevice::nvme, OffloadDevice::nvme},
                    Mode{3, OffloadDevice::cpu, OffloadDevice::nvme}),
    mode_name);

// Partial offload (offload.optimizer.ratio): the first part of each rank's shard keeps its states on
// the device, the rest is offloaded, and the boundary cuts a group (and, at stage 3 with offloaded
// parameters, a group whose updates go to the host through both parts): the same bits as without
// offload, the device holding exactly the states of its part.
struct PartialMode {
  int stage;
  OffloadDevice optimizer;
  double ratio;
  OffloadDevice param = OffloadDevice::none;
};

std::string partial_mode_name(const testing::TestParamInfo<PartialMode>& info) {
  const PartialMode& m = info.param;
  return "stage" + std::to_string(m.stage) + "_optimizer_" + device_name(m.optimizer) + "_ratio_" +
         std::to_string(static_cast<int>(m.ratio * 100)) + "_param_" + device_name(m.param);
}

class PartialOffload : public testing::TestWithParam<PartialMode> {};

TEST_P(PartialOffload, MatchesTheRunWithoutOffloadBitForBit) {
  const PartialMode& m = GetParam();
  test::ScratchDir dir;
  Options o;
  o.stage = m.stage;
  o.offload_optimizer = m.optimizer;
  o.offload_param = m.param;
  o.offload_ratio = m.ratio;
  o.nvme_path = dir.path();
  o.sub_group_bytes = kSubGroupBytes;
  o.clip = 0.05;
  const TrainedRun got = train(o);
  Options none = o;
  none.offload_optimizer = none.offload_param = OffloadDevice::none;
  none.offload_ratio = 1;
  EXPECT_TRUE(identical(got.params, train(none).params));
  // The device holds the states of the first (1 - ratio) of the shard, rounded down to 64 elements.
  const std::size_t shard = shard_numel(m.stage);
  const std::size_t kept = static_cast<std::size_t>((1 - m.ratio) * static_cast<double>(shard)) / 64 * 64;
  ASSERT_GT(kept, 0u);
  EXPECT_EQ(got.stats.memory.peak_of(MemoryCategory::optimizer_states), 12 * kept);
  if (m.optimizer == OffloadDevice::nvme) EXPECT_GE(got.stats.nvme_bytes, 12 * (shard - kept));
  else EXPECT_GE(got.stats.offload_pinned_bytes, 12 * (shard - kept));
}

INSTANTIATE_TEST_SUITE_P(
    Ratios, PartialOffload,
    testing::Values(PartialMode{1, OffloadDevice::cpu, 0.25}, PartialMode{1, OffloadDevice::cpu, 0.5},
                    PartialMode{1, OffloadDevice::cpu, 0.75}, PartialMode{1, OffloadDevice::nvme, 0.25},
                    PartialMode{1, OffloadDevice::nvme, 0.5}, PartialMode{1, OffloadDevice::nvme, 0.75},
                    PartialMode{2, OffloadDevice::cpu, 0.25}, PartialMode{2, OffloadDevice::cpu, 0.5},
                    PartialMode{2, OffloadDevice::cpu, 0.75}, PartialMode{2, OffloadDevice::nvme, 0.25},
                    PartialMode{2, OffloadDevice::nvme, 0.5}, PartialMode{2, OffloadDevice::nvme, 0.75},
                    PartialMode{3, OffloadDevice::cpu, 0.25}, PartialMode{3, OffloadDevice::cpu, 0.5},
                    PartialMode{3, OffloadDevice::cpu, 0.75}, PartialMode{3, OffloadDevice::nvme, 0.25},
                    PartialMode{3, OffloadDevice::nvme, 0.5}, PartialMode{3, OffloadDevice::nvme, 0.75},
                    PartialMode{3, OffloadDevice::cpu, 0.5, OffloadDevice::cpu},
                    PartialMode{3, OffloadDevice::nvme, 0.5, OffloadDevice::nvme}),
    partial_mode_name);

// A ratio so small that 1 - ratio is 1 in double still offloads one aligned block of 64 elements.
TEST(PartialOffloadEdges, ATinyRatioOffloadsOneBlock) {
  Options o;
  o.stage = 2;
  o.offload_optimizer = OffloadDevice::cpu;
  o.offload_ratio = 1e-17;
  o.sub_group_bytes = kSubGroupBytes;
  const TrainedRun got = train(o);
  EXPECT_EQ(got.stats.memory.peak_of(MemoryCategory::optimizer_states), 12 * (shard_numel(2) - 64));
  o.offload_optimizer = OffloadDevice::none;
  o.offload_ratio = 1;
  EXPECT_TRUE(identical(got.params, train(o).params));
}

TEST(OffloadPipeline, TwoBuffersStillGiveTheSameBits) {
  test::ScratchDir dir;
  Options o;
  o.stage = 2;
  o.offload_optimizer = OffloadDevice::nvme;
  o.nvme_path = dir.path();
  o.sub_group_bytes = kSubGroupBytes;
  o.buffer_count = 2;
  const TrainedRun got = train(o);
  o.offload_optimizer = OffloadDevice::none;
  EXPECT_TRUE(identical(got.params, train(o).params));
}

// The swap striped over two directories (4 KiB stripes, so every sub-group's region lands in one
// or the other), with one and two I/O rings: the same bits as one directory, and both directories
// hold their half of the swap while the engine runs.
TEST(OffloadStriping, TwoDirectoriesGiveTheBitsOfOneAndHoldHalfTheSwapEach) {
  for (const int stage : {2, 3}) {
    for (const int threads : {1, 2}) {
      SCOPED_TRACE("stage " + std::to_string(stage) + ", io.threads " + std::to_string(threads));
      test::ScratchDir one, a, b;
      Options o;
      o.stage = stage;
      o.offload_optimizer = OffloadDevice::nvme;
      o.offload_param = stage == 3 ? OffloadDevice::nvme : OffloadDevice::none;
      o.sub_group_bytes = kSubGroupBytes;
      o.io_block = 4096;
      o.nvme_path = one.path();
      const TrainedRun single = train(o);
      o.nvme_dirs = {a.path(), b.path()};
      o.io_threads = threads;
      std::size_t in_a = 0, in_b = 0;
      const auto sizes = [&] {
        in_a = file_bytes(test::swap_file(a.path(), test_rank()));
        in_b = file_bytes(test::swap_file(b.path(), test_rank()));
      };
      MpiSession session;
      auto device = make_cpu_device(std::size_t{256} << 20);
      auto comm = make_mpi_communicator(session, *device);
      EngineStats stats;
      const auto striped = train_engine(o, kSteps, *device, *comm, &stats, sizes);
      EXPECT_TRUE(identical(striped, single.params)) << "striping changed the result";
      EXPECT_EQ(stats.nvme_bytes, single.stats.nvme_bytes);
      EXPECT_EQ(in_a + in_b, stats.nvme_bytes) << "the two files hold exactly the swap";
      // 4 KiB stripes alternate: the halves differ by at most one stripe.
      EXPECT_LE(in_a > in_b ? in_a - in_b : in_b - in_a, 4096u);
      EXPECT_GT(in_b, 0u);
    }
  }
}

// Two engines on one offload directory (two engines of one process, or two jobs started at
// once): the second is built and trained to the end while the first is between its steps, with
// another schedule. Each trains to its own single-run bits (before, the second's swap file took
// the first's name, truncated it and overwrote its states).
TEST(OffloadSharedDirectory, TwoEnginesOnOneDirectoryEachTrainToTheirOwnBits) {
  test::ScratchDir dir;
  Options first;
  first.stage = 2;
  first.offload_optimizer = OffloadDevice::nvme;
  first.offload_param = OffloadDevice::none;
  first.sub_group_bytes = kSubGroupBytes;
  first.nvme_path = dir.path();
  Options second = first;
  second.stage = 3;
  second.offload_param = OffloadDevice::nvme;
  second.lr_factor = [](int step) { return 1.0 / step; };
  const TrainedRun first_alone = train(first), second_alone = train(second);

  // Each engine with a device and a communicator of its own, as two jobs (or two engines of one
  // trainer) have: the first may still have collectives in flight on its own.
  MpiSession session;
  auto device = make_cpu_device(std::size_t{256} << 20), other_device = make_cpu_device(std::size_t{256} << 20);
  auto comm = make_mpi_communicator(session, *device), other_comm = make_mpi_communicator(session, *other_device);
  std::vector<std::vector<float>> second_beside;
  int steps_before = 0;
  const auto first_beside = train_engine(first, kSteps, *device, *comm, nullptr, {}, [&] {
    if (++steps_before == kSteps / 2) second_beside = train_engine(second, kSteps, *other_device, *other_comm);
  });
  EXPECT_TRUE(identical(first_beside, first_alone.params)) << "the second engine disturbed the first's states";
  EXPECT_TRUE(identical(second_beside, second_alone.params)) << "the second engine read the first's states";
}

TEST(OffloadMemory, CpuOptimizerKeepsNoStatesOnTheDeviceAndTwelveBytesPerParameterPinned) {
  Options o;
  o.stage = 2;
  o.offload_optimizer = OffloadDevice::cpu;
  o.sub_group_bytes = kSubGroupBytes;
  const TrainedRun got = train(o, 2);
  EXPECT_EQ(got.stats.memory.peak_of(MemoryCategory::optimizer_states), 0u);
  EXPECT_EQ(got.stats.nvme_bytes, 0u);
  const std::size_t states = 12 * shard_numel(2);
  // + the gradient shard, kept on the host (fp32), the buffer a second micro-batch's gradients
  // land in (one bucket's shard parts: here every group's) and the parameter staging.
  const std::size_t grads = 4 * shard_numel(2);
  EXPECT_EQ(got.pinned.peak_of(HostPurpose::grad_shards), 2 * grads);
  EXPECT_GE(got.stats.offload_pinned_bytes, states + 2 * grads);
  EXPECT_LE(got.stats.offload_pinned_bytes, states + 2 * grads + 4 * 512);
  EXPECT_GE(got.pinned.peak, got.stats.offload_pinned_bytes);

  // The same run without offload holds m and v on the device; the master weights are the fp32
  // parameters themselves.
  o.offload_optimizer = OffloadDevice::none;
  EXPECT_EQ(train(o, 2).stats.memory.peak_of(MemoryCategory::optimizer_states), 8 * shard_numel(2));
}

TEST(OffloadMemory, NvmeOptimizerKeepsStatesOnDiskAndOnlyItsBuffersOnTheHost) {
  test::ScratchDir dir;
  Options o;
  o.stage = 2;
  o.offload_optimizer = OffloadDevice::nvme;
  o.nvme_path = dir.path();
  o.sub_group_bytes = kSubGroupBytes;
  const TrainedRun got = train(o, 2);
  EXPECT_EQ(got.stats.memory.peak_of(MemoryCategory::optimizer_states), 0u);
  const std::size_t states = 12 * shard_numel(2);
  EXPECT_GE(got.stats.nvme_bytes, states);
  // buffer_count slots of one sub-group's states (4 KiB-aligned) plus its parameter staging:
  // bounded by the configuration, whatever the model's size; besides, the gradient shard (read in
  // place, so no gradient staging) and its landing buffer, which follow the shard.
  const std::size_t grads = got.pinned.peak_of(HostPurpose::grad_shards);
  EXPECT_EQ(grads, 2 * 4 * shard_numel(2));
  EXPECT_EQ(got.stats.offload_pinned_bytes - grads, 4u * (4096 + 512));
  EXPECT_GE(got.pinned.peak, got.stats.offload_pinned_bytes);
}

// NVMe offload holds host memory to its configured buffers (buffer_count sub-groups, and at stage 3
// one fetch buffer per gathered layer that stage3.max_live allows) and the gradient shard: a model
// four times deeper (same layer size) takes four times the swap, four times the gradient shard
// (grad_shards: the shard and one bucket's landing buffer, here the whole model's), and exactly the
// same pinned bytes for every other purpose, all of which are what zest::estimate_memory says; no
// states or parameter shards live in host memory.
TEST(OffloadMemory, NvmeHostMemoryIsItsConfiguredBuffersAndTheGradientShard) {
  for (const int stage : {2, 3}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    std::vector<HostMemoryStats> pinned;
    std::vector<std::size_t> nvme;
    for (const int layers : {4, 16}) {
      test::ScratchDir dir;
      Options o;
      o.stage = stage;
      o.offload_optimizer = OffloadDevice::nvme;
      o.offload_param = stage == 3 ? OffloadDevice::nvme : OffloadDevice::none;
      o.nvme_path = dir.path();
      o.sub_group_bytes = 12 * 512;
      o.max_live = 3 * 4096 * sizeof(float);  // stage 3: three gathered layers (and fetch buffers)
      o.specs = uniform_model(static_cast<std::size_t>(layers) * 4096, layers);
      const TrainedRun got = train(o, 2);
      const MemoryEstimate estimate = estimate_memory(make_config(o), o.specs, world_size());
      for (std::size_t p = 0; p < kHostPurposeCount; ++p)
        EXPECT_EQ(got.pinned.peak_by[p], estimate.pinned_by[p]) << host_purpose_name(static_cast<HostPurpose>(p));
      EXPECT_EQ(got.pinned.peak_of(HostPurpose::optimizer_states), 0u);
      EXPECT_EQ(got.pinned.peak_of(HostPurpose::param_shards), 0u);
      EXPECT_GT(got.pinned.peak_of(HostPurpose::optimizer_swap), 0u);
      if (stage == 3) {
        EXPECT_GT(got.pinned.peak_of(HostPurpose::param_swap), 0u);
      }
      pinned.push_back(got.pinned);
      nvme.push_back(got.stats.nvme_bytes);
    }
    const auto grads = static_cast<std::size_t>(HostPurpose::grad_shards);
    EXPECT_EQ(pinned[1].peak_by[grads], 4 * pinned[0].peak_by[grads]);
    EXPECT_EQ(pinned[1].peak - pinned[1].peak_by[grads], pinned[0].peak - pinned[0].peak_by[grads]);
    pinned[0].peak_by[grads] = pinned[1].peak_by[grads] = 0;
    EXPECT_EQ(pinned[0].peak_by, pinned[1].peak_by) << "host memory grew with the model";
    EXPECT_GE(nvme[1], 4 * nvme[0] - 4 * 4096) << "the swap did not grow with the model";
  }
}

TEST(OffloadMemory, OffloadedParametersLeaveOnlyResidentGroupsOnTheDevice) {
  for (const OffloadDevice where : {OffloadDevice::cpu, OffloadDevice::nvme}) {
    test::ScratchDir dir;
    Options o;
    o.stage = 3;
    o.offload_optimizer = where;
    o.offload_param = where;
    o.nvme_path = dir.path();
    o.sub_group_bytes = kSubGroupBytes;
    const TrainedRun got = train(o, 2);
    const engine::Layout layout(model(), world_size());
    std::size_t resident = 0, offloaded = 0;
    for (int g = 0; g < layout.group_count(); ++g) {
      const std::size_t bytes = layout.group(g).padded * sizeof(float);
      if (bytes <= make_config(o).stage3.persistence_threshold_bytes) resident += bytes;
      else offloaded += layout.group(g).shard * sizeof(float);
    }
    ASSERT_GT(resident, 0u);
    SCOPED_TRACE(device_name(where));
    EXPECT_EQ(got.stats.memory.peak_of(MemoryCategory::params), resident);
    EXPECT_EQ(got.stats.memory.peak_of(MemoryCategory::optimizer_states), 0u);
    if (where == OffloadDevice::nvme) EXPECT_GE(got.stats.nvme_bytes, 12 * shard_numel(3) + offloaded);
    else EXPECT_GE(got.stats.offload_pinned_bytes, 12 * shard_numel(3) + offloaded);
  }
}

// With the whole optimizer offloaded (stages 2 and 3), the accumulated gradient shard lives in
// pinned host memory: the device holds no gradient shard (its grads category is empty; its buffers,
// the reduce buckets among them, are those of the run without offload), the host holds the shard
// and one bucket's landing buffer, as zest::estimate_memory says, and training with two
// micro-batches (the second added on the host), clipping and an fp16 overflow step gives the bits
// of the run without offload. Small buckets (several per backward) and one bucket for every group.
class GradientsOnTheHost : public EveryOffloadMode {};

TEST_P(GradientsOnTheHost, TheDeviceKeepsOnlyTheBucketsAndTheBitsAreThoseWithoutOffload) {
  for (const std::size_t bucket : {std::size_t{0}, std::size_t{2048}}) {
    SCOPED_TRACE("buckets.reduce " + std::to_string(bucket));
    test::ScratchDir dir;
    Options o = options(dir);
    o.dtype = DType::f16;
    o.accumulation = 2;
    o.clip = 0.05;
    o.overflow_at_step = 3;
    o.reduce_bucket = bucket;
    const TrainedRun got = train(o);
    const TrainedRun none = train(without_offload(o));
    EXPECT_TRUE(identical(got.params, none.params));
    EXPECT_EQ(got.stats.skipped_steps, 1);
    EXPECT_EQ(none.stats.skipped_steps, 1);

    const std::size_t shard = 2 * shard_numel(o.stage);  // fp16
    EXPECT_EQ(got.stats.memory.peak_of(MemoryCategory::grads), 0u);
    EXPECT_EQ(none.stats.memory.peak_of(MemoryCategory::grads), shard) << "the shard that moved to the host";
    if (o.offload_param == OffloadDevice::none) {
      EXPECT_EQ(got.stats.memory.peak_of(MemoryCategory::buffers), none.stats.memory.peak_of(MemoryCategory::buffers));
    }
    const MemoryEstimate estimate = estimate_memory(make_config(o), specs_of(o), world_size());
    EXPECT_EQ(got.stats.memory.peak_of(MemoryCategory::buffers), estimate.device_of(MemoryCategory::buffers));
    EXPECT_EQ(got.pinned.peak_of(HostPurpose::grad_shards), estimate.pinned_of(HostPurpose::grad_shards));
    EXPECT_GT(got.pinned.peak_of(HostPurpose::grad_shards), shard) << "the shard and a landing buffer";
    EXPECT_EQ(none.pinned.peak_of(HostPurpose::grad_shards), 0u);
  }
}

INSTANTIATE_TEST_SUITE_P(
    WholeOptimizerOffloaded, GradientsOnTheHost,
    testing::Values(Mode{2, OffloadDevice::cpu, OffloadDevice::none}, Mode{2, OffloadDevice::nvme, OffloadDevice::none},
                    Mode{3, OffloadDevice::cpu, OffloadDevice::none}, Mode{3, OffloadDevice::nvme, OffloadDevice::none},
                    Mode{3, OffloadDevice::cpu, OffloadDevice::cpu}),
    mode_name);

// Where some optimizer states stay on the device (offload.optimizer.ratio < 1) or the gradients are
// kept in full (stage 1), the device's Adam or the full gradient needs them there: the device keeps
// the accumulated gradient, the host none.
TEST(GradientsOnTheHostEdges, PartialOffloadAndStageOneKeepTheGradientsOnTheDevice) {
  for (const int stage : {1, 2}) {
    Options o;
    o.stage = stage;
    o.offload_optimizer = OffloadDevice::cpu;
    o.offload_ratio = stage == 1 ? 1.0 : 0.5;
    o.sub_group_bytes = kSubGroupBytes;
    const TrainedRun got = train(o, 2);
    EXPECT_GT(got.stats.memory.peak_of(MemoryCategory::grads), 0u) << "stage " << stage;
    EXPECT_EQ(got.pinned.peak_of(HostPurpose::grad_shards), 0u) << "stage " << stage;
  }
}

// Every rank's swap file loses its data behind the engine's back (truncated): the next step's
// read fails on every rank, so every rank throws and none waits in a collective. The same with half
// the states on the device (offload.optimizer.ratio 0.5).
// offload.optimizer.ratio, and offload.optimizer.update_ahead: the reads ahead fail too, and step()'s
// own pipeline then reports the error.
struct ErrorCase {
  double ratio;
  bool update_ahead;
};

class OffloadErrors : public testing::TestWithParam<ErrorCase> {};

TEST_P(OffloadErrors, ALostSwapFileSurfacesFromStepWithPathAndErrno) {
  test::ScratchDir dir;
  MpiSession session;
  auto device = make_cpu_device(std::size_t{64} << 20);
  auto comm = make_mpi_communicator(session, *device);
  Options o;
  o.stage = 2;
  o.offload_optimizer = OffloadDevice::nvme;
  o.nvme_path = dir.path();
  o.sub_group_bytes = kSubGroupBytes;
  o.offload_ratio = GetParam().ratio;
  o.update_ahead = GetParam().update_ahead;
  Engine engine(make_config(o), *device, *comm, model());
  const std::string path = test::swap_file(dir.path(), comm->rank());
  ASSERT_EQ(::access(path.c_str(), F_OK), 0) << "no swap file of rank " << comm->rank() << " in " << dir.path();
  auto backward = [&] {
    for (int g = engine.group_count() - 1; g >= 0; --g) {
      auto lease = engine.acquire(g);
      for (std::size_t t = 0; t < engine.tensor_count(); ++t)
        if (engine.spec(t).group == g) static_cast<float*>(lease.grad(t).data)[0] = 1.0f;
      engine.grads_ready(g);
    }
  };
  backward();
  engine.step();  // a good step first
  // Before backward: with update_ahead, the updates ahead read (and write) the swap file during it.
  ASSERT_EQ(::truncate(path.c_str(), 0), 0) << std::strerror(errno);
  backward();
  try {
    engine.step();
    ADD_FAILURE() << "step() succeeded on a truncated swap file";
  } catch (const IoError& error) {
    const std::string what = error.what();
    EXPECT_NE(what.find(path), std::string::npos) << what;
    EXPECT_NE(what.find("errno " + std::to_string(ENODATA)), std::string::npos) << what;
    EXPECT_EQ(error.error_number(), ENODATA);
  }
  // The states are partly updated: the engine refuses to go on rather than train on them.
  backward();
  try {
    engine.step();
    ADD_FAILURE() << "step() went on after an I/O failure";
  } catch (const IoError&) {
    ADD_FAILURE() << "expected the unusable-engine Error, not another I/O attempt";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("earlier I/O failure"), std::string::npos) << error.what();
  }
}

INSTANTIATE_TEST_SUITE_P(AllOrHalfOffloaded, OffloadErrors,
                         testing::Values(ErrorCase{1.0, false}, ErrorCase{0.5, false}, ErrorCase{1.0, true}),
                         [](const testing::TestParamInfo<ErrorCase>& info) {
                           return std::string(info.param.ratio == 1.0 ? "all" : "half") +
                                  (info.param.update_ahead ? "_update_ahead" : "");
                         });

}  // namespace
}  // namespace zest
