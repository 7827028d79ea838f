// Gradient buckets (buckets.reduce) and the parameter all-gather's bucket (buckets.allgather),
// under mpirun with 1, 2 and 4 ranks: consecutive small groups share one reduce collective, and
// after the step one all-gather; every stage still equals the reference Adam, and the buckets take
// exactly the memory the plan (and `zest estimate`) says.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "engine/host_communicators.hpp"
#include "engine/reference_training.hpp"
#include "runtime/comm/mpi_session.hpp"
#include "zest/engine.hpp"
#include "zest/error.hpp"
#include "zest/estimate.hpp"

namespace zest {
namespace {

using namespace reference_training;

using test_hosts::Forwarding;
using test_hosts::SimulatedHosts;

// Counts the reductions (all-reduce and reduce-scatter) and the all-gathers.
class CountingCommunicator final : public Forwarding {
 public:
  using Forwarding::Forwarding;

  // Reductions since the last call.
  int take_reductions() { return std::exchange(reductions_, 0); }
  // All-gathers since the last call.
  int take_gathers() { return std::exchange(gathers_, 0); }

  void all_reduce(const void* send, void* recv, std::size_t count, DType dtype, ReduceOp op, Stream& stream) override {
    ++reductions_;
    Forwarding::all_reduce(send, recv, count, dtype, op, stream);
  }
  void reduce_scatter(const void* send, void* recv, std::size_t recv_count, DType dtype, ReduceOp op,
                      Stream& stream) override {
    ++reductions_;
    Forwarding::reduce_scatter(send, recv, recv_count, dtype, op, stream);
  }
  void all_gather(const void* send, void* recv, std::size_t send_count, DType dtype, Stream& stream) override {
    ++gathers_;
    Forwarding::all_gather(send, recv, send_count, dtype, stream);
  }

 private:
  int reductions_ = 0;
  int gathers_ = 0;
};

constexpr int kGroups = 24;
constexpr int kSteps = 4;

// Many small one-tensor groups of different sizes (150 to 1001 elements).
std::vector<ParamSpec> small_groups() {
  std::vector<ParamSpec> specs;
  for (int g = 0; g < kGroups; ++g)
    specs.push_back({std::string("layer").append(std::to_string(g)), {150 + 37 * static_cast<std::size_t>(g)}, g});
  return specs;
}

std::size_t round_up(std::size_t n, std::size_t multiple) { return (n + multiple - 1) / multiple * multiple; }

// A one-tensor group's segment: 64-element aligned, split into equal 64-aligned shards.
std::size_t padded(const ParamSpec& spec, int partitions) {
  return round_up(spec.numel(), 64 * static_cast<std::size_t>(partitions));
}

// The buckets one backward pass fills: groups in backward order, each appended to the current
// bucket while the bucket's elements stay within buckets.reduce; a larger group fills one alone.
int expected_buckets(const std::vector<ParamSpec>& specs, std::size_t reduce_bytes, int partitions) {
  const std::size_t capacity = reduce_bytes / sizeof(float);
  int buckets = 0;
  std::size_t used = capacity;  // no bucket open
  for (auto it = specs.rbegin(); it != specs.rend(); ++it) {
    const std::size_t need = padded(*it, partitions);
    if (used + need > capacity) {
      ++buckets;
      used = 0;
    }
    used += need;
  }
  return buckets;
}

struct Case {
  int stage;
  std::size_t reduce_bytes;
  const char* name;
};

class Coalescing : public testing::TestWithParam<Case> {};

// Per step: one reduction per bucket (plus step()'s all-reduce of the overflow flag and the norm
// where gradients are sharded), and the parameters of the reference Adam.
TEST_P(Coalescing, OneReductionPerBucketAndTheReferenceParameters) {
  const Case& k = GetParam();
  Options o;
  o.stage = k.stage;
  o.specs = small_groups();
  o.reduce_bucket = k.reduce_bytes;
  MpiSession session;
  auto device = make_cpu_device(std::size_t{256} << 20);
  auto real = make_mpi_communicator(session, *device);
  CountingCommunicator comm(*real);
  std::vector<int> per_step;
  EngineStats stats;
  const auto got = train_engine(o, kSteps, *device, comm, &stats, [&] { per_step.push_back(comm.take_reductions()); });
  EXPECT_LT(max_relative_error(got, train_reference(o, kSteps)), 1e-6);

  const int ranks = comm.size(), partitions = k.stage == 0 ? 1 : ranks;
  const int buckets = expected_buckets(o.specs, k.reduce_bytes, partitions);
  if (k.reduce_bytes == 4) {
    EXPECT_EQ(buckets, kGroups);  // a bucket per group
  } else if (k.reduce_bytes == 8192) {
    EXPECT_GT(buckets, 2);
    EXPECT_LT(buckets, kGroups / 2);
  } else {
    EXPECT_EQ(buckets, 1);  // every group in one
  }
  if (ranks == 1) return;  // one rank reduces nothing: the count says nothing
  const int scalars = partitions > 1 ? 1 : 0;
  ASSERT_EQ(per_step.size(), static_cast<std::size_t>(kSteps));
  for (int step = 0; step < kSteps; ++step)
    EXPECT_EQ(per_step[static_cast<std::size_t>(step)], buckets + scalars) << "step " << step + 1;
}

INSTANTIATE_TEST_SUITE_P(StagesAndBucketSizes, Coalescing,
                         testing::Values(Case{0, 4, "stage0_one_group_each"}, Case{0, 8192, "stage0_8KiB"},
                                         Case{0, 25u << 20, "stage0_25MiB"}, Case{1, 4, "stage1_one_group_each"},
                                         Case{1, 8192, "stage1_8KiB"}, Case{1, 25u << 20, "stage1_25MiB"},
                                         Case{2, 4, "stage2_one_group_each"}, Case{2, 8192, "stage2_8KiB"},
                                         Case{2, 25u << 20, "stage2_25MiB"}, Case{3, 4, "stage3_one_group_each"},
                                         Case{3, 8192, "stage3_8KiB"}, Case{3, 25u << 20, "stage3_25MiB"}),
                         [](const testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

// Accumulated micro-batches: a group's second micro-batch lands in the same bucket as its first
// (large buckets) or in a bucket of its own (one group each); both sum to the whole batch.
TEST(Buckets, AccumulationAcrossMicroBatchesInEveryBucketSize) {
  for (int stage : {0, 2, 3}) {
    for (std::size_t reduce : {std::size_t{4}, std::size_t{8192}, std::size_t{25} << 20}) {
      Options o;
      o.stage = stage;
      o.specs = small_groups();
      o.reduce_bucket = reduce;
      o.accumulation = 2;
      MpiSession session;
      auto device = make_cpu_device(std::size_t{256} << 20);
      auto comm = make_mpi_communicator(session, *device);
      const auto got = train_engine(o, kSteps, *device, *comm);
      EXPECT_LT(max_relative_error(got, train_reference(o, kSteps)), 1e-6) << "stage " << stage << " reduce " << reduce;
    }
  }
}

// The two buckets are the plan's size, max(buckets.reduce, the largest group), and nothing else
// is allocated: after training and get_param every category's peak equals the estimate.
TEST(Buckets, MemoryIsThePlannedBucketSize) {
  const std::vector<ParamSpec> specs = small_groups();
  for (int stage : {1, 2, 3}) {
    MpiSession session;
    auto device = make_cpu_device(std::size_t{256} << 20);
    auto comm = make_mpi_communicator(session, *device);
    std::size_t buffers[2] = {};
    const std::size_t reduce[2] = {4, 8192};
    for (int i = 0; i < 2; ++i) {
      Options o;
      o.stage = stage;
      o.specs = specs;
      o.reduce_bucket = reduce[i];
      const Config config = make_config(o);
      const MemoryEstimate want = estimate_memory(config, specs, comm->size());
      EngineStats stats;
      train_engine(o, 2, *device, *comm, &stats);
      for (std::size_t c = 0; c < kMemoryCategoryCount; ++c)
        EXPECT_EQ(stats.memory.peak[c], want.device[c]) << category_name(static_cast<MemoryCategory>(c));
      EXPECT_EQ(stats.memory.peak_total, want.device_total);
      buffers[i] = stats.memory.peak_of(MemoryCategory::buffers);
      EXPECT_EQ(device->memory_stats().current_total, 0u);
    }
    // From one group per bucket (the largest, 1001 elements padded) to 8 KiB buckets: two buckets
    // of 2048 fp32 elements instead of the largest group's, and on several ranks the pack a
    // multi-group bucket is reduce-scattered from (8 KiB).
    const std::size_t largest = padded(specs.back(), comm->size());
    const std::size_t pack = comm->size() > 1 ? 8192 : 0;
    EXPECT_EQ(buffers[1] - buffers[0], 2 * (std::max<std::size_t>(2048, largest) - largest) * sizeof(float) + pack)
        << "stage " << stage;
  }
}

// The runs of groups one step all-gathers, as the engine's plan must form them: the groups whose
// full parameters the step rebuilds (stages 1-2: every group; stage 3: those resident under
// reference_training's 1 KiB persistence threshold) in layout order, each appended to the current
// run while the run's gathered bytes (every rank's shards: the padded segments) stay within
// buckets.allgather; a larger group is a run alone.
struct GatherRuns {
  int gathered_groups = 0;
  int runs = 0;
  std::size_t largest_shared = 0;  // bytes of the largest run of several groups: the gather bucket
};

GatherRuns expected_gather_runs(const std::vector<ParamSpec>& specs, int stage, std::size_t allgather_bytes,
                                int partitions) {
  GatherRuns result;
  std::size_t used = 0;
  int in_run = 0;
  for (const ParamSpec& spec : specs) {
    const std::size_t need = padded(spec, partitions) * sizeof(float);
    if (stage == 3 && need > 1024) continue;  // gathered when a lease asks for it, not by step()
    ++result.gathered_groups;
    if (result.runs == 0 || used + need > allgather_bytes) {
      ++result.runs;
      used = 0;
      in_run = 0;
    }
    used += need;
    if (++in_run > 1) result.largest_shared = std::max(result.largest_shared, used);
  }
  return result;
}

struct GatherCase {
  int stage;
  std::size_t allgather_bytes;
  const char* name;
};

class GatherCoalescing : public testing::TestWithParam<GatherCase> {};

// Per step (inside step() only: stage 3's leases gather their groups themselves): one all-gather
// per run, none with one rank; the parameters of the reference Adam; and the gather bucket is the
// largest run of several groups, exactly as the estimate says.
TEST_P(GatherCoalescing, OneAllGatherPerRunAndTheReferenceParameters) {
  const GatherCase& k = GetParam();
  Options o;
  o.stage = k.stage;
  o.specs = small_groups();
  o.allgather_bucket = k.allgather_bytes;
  MpiSession session;
  auto device = make_cpu_device(std::size_t{256} << 20);
  auto real = make_mpi_communicator(session, *device);
  CountingCommunicator comm(*real);
  std::vector<int> per_step;
  EngineStats stats;
  const auto got = train_engine(o, kSteps, *device, comm, &stats, [&] { per_step.push_back(comm.take_gathers()); },
                                [&] { comm.take_gathers(); });
  EXPECT_LT(max_relative_error(got, train_reference(o, kSteps)), 1e-6);
  // Bit for bit the run that gathers one group per collective: the bucket only moves bytes (the
  // gradients, hence the weights, depend on the gathered parameters).
  Options unbucketed_options = o;
  unbucketed_options.allgather_bucket = 4;
  EXPECT_EQ(got, train_engine(unbucketed_options, kSteps, *device, comm));

  const int ranks = comm.size();
  const MemoryEstimate want = estimate_memory(make_config(o), o.specs, ranks);
  for (std::size_t c = 0; c < kMemoryCategoryCount; ++c)
    EXPECT_EQ(stats.memory.peak[c], want.device[c]) << category_name(static_cast<MemoryCategory>(c));
  const MemoryEstimate unbucketed = estimate_memory(make_config(unbucketed_options), o.specs, ranks);
  const GatherRuns runs = expected_gather_runs(o.specs, k.stage, k.allgather_bytes, ranks);
  ASSERT_EQ(per_step.size(), static_cast<std::size_t>(kSteps));
  if (ranks == 1) {  // one partition: nothing to gather, no bucket
    for (int step = 0; step < kSteps; ++step)
      EXPECT_EQ(per_step[static_cast<std::size_t>(step)], 0) << "step " << step + 1;
    EXPECT_EQ(want.device_of(MemoryCategory::buffers), unbucketed.device_of(MemoryCategory::buffers));
    return;
  }
  EXPECT_EQ(want.device_of(MemoryCategory::buffers) - unbucketed.device_of(MemoryCategory::buffers),
            runs.largest_shared);
  if (k.allgather_bytes == 4) {
    EXPECT_EQ(runs.runs, runs.gathered_groups);  // one per group
    EXPECT_EQ(runs.largest_shared, 0u);
  } else if (k.allgather_bytes < (std::size_t{1} << 20)) {
    EXPECT_GT(runs.runs, 1);
    EXPECT_LT(runs.runs, runs.gathered_groups);
  } else {
    EXPECT_EQ(runs.runs, 1);  // every gathered group in one
  }
  if (k.stage == 3) {
    EXPECT_EQ(runs.gathered_groups, 3);  // the three 256-element groups are resident
  }
  for (int step = 0; step < kSteps; ++step)
    EXPECT_EQ(per_step[static_cast<std::size_t>(step)], runs.runs) << "step " << step + 1;
}

// Middle sizes that split the gathered groups into several runs: stage 3 gathers only its three
// resident groups (3 KiB at 2 or 4 ranks), so its middle size is smaller.
INSTANTIATE_TEST_SUITE_P(
    StagesAndBucketSizes, GatherCoalescing,
    testing::Values(GatherCase{1, 4, "stage1_one_group_each"}, GatherCase{1, 8192, "stage1_8KiB"},
                    GatherCase{1, 25u << 20, "stage1_25MiB"}, GatherCase{2, 4, "stage2_one_group_each"},
                    GatherCase{2, 8192, "stage2_8KiB"}, GatherCase{2, 25u << 20, "stage2_25MiB"},
                    GatherCase{3, 4, "stage3_one_group_each"}, GatherCase{3, 2048, "stage3_2KiB"},
                    GatherCase{3, 25u << 20, "stage3_25MiB"}),
    [](const testing::TestParamInfo<GatherCase>& info) { return std::string(info.param.name); });

TEST(Buckets, TrainerErrorsNameTheGroupAndWhatToDo) {
  MpiSession session;
  auto device = make_cpu_device(std::size_t{64} << 20);
  auto comm = make_mpi_communicator(session, *device);
  Options o;
  o.specs = small_groups();
  o.reduce_bucket = 4;  // one group per bucket: two buckets hold two groups
  Engine engine(make_config(o), *device, *comm, o.specs);
  {
    auto a = engine.acquire(5), b = engine.acquire(4), c = engine.acquire(3);
    a.grad(5);
    b.grad(4);
    if (comm->size() == 1) {
      // One rank writes a step's first gradients where the step reads them: no bucket to run out of.
      c.grad(3);
      engine.grads_ready(3);
    } else {
      try {
        c.grad(3);
        ADD_FAILURE() << "a third group's gradient with two buckets in use";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("call grads_ready(group)"), std::string::npos) << e.what();
      }
    }
    engine.grads_ready(5);
    try {
      engine.grads_ready(5);
      ADD_FAILURE() << "grads_ready twice";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("since its last grads_ready"), std::string::npos) << e.what();
    }
  }
  try {
    engine.step();  // group 4's gradient was asked for and never handed over
    ADD_FAILURE() << "step() with a gradient still being written";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("grads_ready(4) was not called"), std::string::npos) << e.what();
  }
  engine.grads_ready(4);
  EXPECT_FALSE(engine.step().skipped);
}

// Bytes on the wire (EngineStats::wire_last_step), 128 equal groups of 1024 elements (no padding
// at 2 or 4 ranks) in 16 KiB reduce buckets of 4 groups each: every stage's reductions and gathers
// send what estimate_wire_bytes says, by collective, and that is ZeRO's count within 1%: 2Ψ (n-1)/n
// at stages 0-2 (stages 1-2 reduce-scatter their multi-group buckets: an all-reduce would be 3Ψ),
// 3Ψ (n-1)/n at stage 3 (forward and backward gathers; the gathered pool of two saves at most two
// of its 256 gathers). One host here: nothing crosses hosts (tests/examples/multihost_test.sh
// counts across two).
TEST(WireBytes, EveryStageSendsZerosByteCount) {
  constexpr int kWireGroups = 128;
  constexpr std::size_t kGroupElements = 1024;
  std::vector<ParamSpec> specs;
  for (int g = 0; g < kWireGroups; ++g) specs.push_back({"layer" + std::to_string(g), {kGroupElements}, g});
  for (int stage : {0, 1, 2, 3}) {
    Options o;
    o.stage = stage;
    o.specs = specs;
    o.reduce_bucket = 4 * kGroupElements * sizeof(float);
    o.max_live = 1;  // stage 3: the pool's least, two groups
    MpiSession session;
    auto device = make_cpu_device(std::size_t{256} << 20);
    auto real = make_mpi_communicator(session, *device);
    CountingCommunicator comm(*real);
    const int n = comm.size();
    int gathers = 0;  // the last step's all-gathers (from the end of the step before)
    EngineStats stats;
    const auto got = train_engine(o, 2, *device, comm, &stats, [&] { gathers = comm.take_gathers(); });
    EXPECT_LT(max_relative_error(got, train_reference(o, 2)), 1e-6) << "stage " << stage;
    const WireEstimate want = estimate_wire_bytes(make_config(o), specs, n, n);
    const WireBytes& sent = stats.wire_last_step;
    const std::uint64_t peers = static_cast<std::uint64_t>(n - 1);
    const std::uint64_t shard = kGroupElements * sizeof(float) / static_cast<std::uint64_t>(n);
    EXPECT_EQ(sent.across(), 0u) << "stage " << stage;
    if (stage == 0) {
      // Uneven all-reduce blocks (a bucket of 4096 elements over n ranks) round differently.
      EXPECT_NEAR(static_cast<double>(sent.of(Collective::all_reduce)), static_cast<double>(want.reduce),
                  4.0 * static_cast<double>(kWireGroups * peers)) << "stage 0";
      EXPECT_EQ(sent.of(Collective::reduce_scatter) + sent.of(Collective::all_gather), 0u) << "stage 0";
    } else {
      EXPECT_EQ(sent.of(Collective::reduce_scatter), want.reduce) << "stage " << stage;
      // Only step()'s two floats are all-reduced.
      EXPECT_LE(sent.of(Collective::all_reduce), 2 * sizeof(float) * peers) << "stage " << stage;
      if (stage < 3) {
        EXPECT_EQ(sent.of(Collective::all_gather), want.gather) << "stage " << stage;
      } else if (n > 1) {
        EXPECT_EQ(sent.of(Collective::all_gather), static_cast<std::uint64_t>(gathers) * shard * peers);
        EXPECT_LE(gathers, 2 * kWireGroups);
        EXPECT_GE(gathers, 2 * kWireGroups - 2);
        EXPECT_LE(sent.of(Collective::all_gather), want.gather);
      }
    }
    if (n == 1) {
      EXPECT_EQ(sent.total(), 0u);
      continue;
    }
    const double zero = static_cast<double>(want.zero_formula);
    EXPECT_NEAR(static_cast<double>(sent.total()), zero, 0.01 * zero) << "stage " << stage;
  }
}

// partition.secondary: host (hpZ) on hosts of two ranks (np2: one host; np4: two), stage 3 with a
// pool of two so backward gathers again, 2 micro-batches: the same parameters as plain stage 3 to
// the bit; the secondary copy (half of every gathered group per rank) is the planned memory; only a
// step's first gather of each group crosses hosts, so the bytes across hosts are exactly the
// estimate's, fewer than plain stage 3's, and the host's gathers go inside.
TEST(HierarchicalPartition, SameBitsFewerBytesAcrossHostsThePlannedMemory) {
  MpiSession session;
  auto device = make_cpu_device(std::size_t{256} << 20);
  auto world = make_mpi_communicator(session, *device);
  SimulatedHosts comm(*world, *device);
  const int n = comm.size();
  if (n % 2 != 0) GTEST_SKIP() << "hosts of two ranks need an even rank count; this run has " << n;
  std::vector<ParamSpec> specs;
  for (int g = 0; g < 32; ++g)
    specs.push_back({"layer" + std::to_string(g), {512 + 64 * static_cast<std::size_t>(g % 3)}, g});
  Options o;
  o.stage = 3;
  o.specs = specs;
  o.max_live = 1;
  o.accumulation = 2;
  EngineStats plain_stats, hpz_stats;
  const auto plain = train_engine(o, 2, *device, comm, &plain_stats);
  o.secondary_host = true;
  const auto hpz = train_engine(o, 2, *device, comm, &hpz_stats);
  EXPECT_EQ(hpz, plain) << "partition.secondary: host changed the parameters";
  EXPECT_LT(max_relative_error(hpz, train_reference(o, 2)), 1e-6);

  const Config config = make_config(o);
  const MemoryEstimate want = estimate_memory(config, specs, n, 2);
  EXPECT_EQ(hpz_stats.memory.peak_of(MemoryCategory::params), want.device_of(MemoryCategory::params));
  std::size_t secondary = 0;  // half of every gathered (non-resident) group
  for (const ParamSpec& s : specs)
    if (padded(s, n) * sizeof(float) > config.stage3.persistence_threshold_bytes)
      secondary += padded(s, n) / 2 * sizeof(float);
  EXPECT_GT(secondary, 0u);
  EXPECT_EQ(hpz_stats.memory.peak_of(MemoryCategory::params) - plain_stats.memory.peak_of(MemoryCategory::params),
            secondary);

  const WireEstimate wire = estimate_wire_bytes(config, specs, n, 2);
  const WireBytes& h = hpz_stats.wire_last_step;
  const WireBytes& p = plain_stats.wire_last_step;
  // Exactly the estimate's, but for step()'s all-reduce of two floats.
  EXPECT_LE(h.across(), wire.across + 16 * static_cast<std::uint64_t>(n)) << "across hosts";
  EXPECT_GE(h.across(), wire.across) << "across hosts";
  EXPECT_EQ(h.of(Collective::reduce_scatter), p.of(Collective::reduce_scatter));
  if (n > 2) {
    EXPECT_LT(h.across(), p.across());
  }
  EXPECT_GT(h.inside(), 0u);
  EXPECT_LE(h.total(), wire.total() + 16 * static_cast<std::uint64_t>(n));
}

// partition.secondary: host refused, saying why, on every rank: hosts of unequal rank counts (1
// and 3 at np4), and a config that sets it on some ranks only (np2, np4).
TEST(HierarchicalPartition, UnequalHostsAndDisagreeingRanksAreErrors) {
  MpiSession session;
  auto device = make_cpu_device(std::size_t{64} << 20);
  Options o;
  o.stage = 3;
  o.specs = small_groups();
  o.secondary_host = true;
  if (session.size() == 4) {
    auto world = make_mpi_communicator(session, *device);
    SimulatedHosts uneven(*world, *device, 2, true);
    try {
      Engine engine(make_config(o), *device, uneven, o.specs);
      ADD_FAILURE() << "hosts of 1 and 3 ranks were accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("host 0 has 1 and host 1 has 3"), std::string::npos) << e.what();
    }
  }
  if (session.size() < 2) GTEST_SKIP() << "ranks can disagree only with two or more; this run has " << session.size();
  auto world = make_mpi_communicator(session, *device);
  SimulatedHosts comm(*world, *device);
  o.secondary_host = comm.rank() == 0;
  try {
    Engine engine(make_config(o), *device, comm, o.specs);
    ADD_FAILURE() << "partition.secondary on rank 0 only was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("give every rank the same config"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace zest
