// zest::estimate_memory against real engines, under mpirun (1 and 4 ranks): for every stage and
// offload mode, odd tensor sizes, resident and gathered stage-3 groups, several sub-groups and a
// tensor larger than the set_param staging, an Engine is built and trained for two steps; its
// device peaks by category, its total peak, the pinned host memory (by purpose) and the NVMe swap file (its
// size on disk too) must EQUAL the estimate, byte for byte (with the whole optimizer offloaded at
// stages 2-3, the gradient shard is counted on the host, not the device). The estimate of a large
// model is also checked against the ZeRO paper's per-rank formulas, which it may exceed only by
// padding and buffers.
#include <gtest/gtest.h>
#include <mpi.h>
#include <sys/stat.h>

#include <cstdint>
#include <string>
#include <vector>

#include "engine/plan/memory_plan.hpp"
#include "offload/nvme_store.hpp"
#include "offload/scratch_dir.hpp"
#include "runtime/comm/mpi_communicator.hpp"
#include "runtime/comm/mpi_session.hpp"
#include "zest/engine.hpp"
#include "zest/error.hpp"
#include "zest/estimate.hpp"

namespace zest {
namespace {

int world_size() {
  int size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return size;
}

// Odd sizes, two tensors in most groups, a tiny group (resident under stage 3's threshold) between
// large ones.
std::vector<ParamSpec> odd_model() {
  return {{"embed", {331, 7}, 0}, {"w1", {97, 13}, 1}, {"b1", {13}, 1}, {"norm", {5}, 2},
          {"w2", {2049}, 3},      {"w3", {61, 29}, 4}, {"b3", {29}, 4}};
}

// One tensor larger than the set_param staging (kStagingElements), so the staging is clamped.
std::vector<ParamSpec> large_tensor_model() {
  return {{"big", {engine::kStagingElements + 77}, 0}, {"small", {1001}, 1}};
}

struct Case {
  std::string name;
  int stage;
  DType dtype;
  OffloadDevice optimizer = OffloadDevice::none;
  OffloadDevice param = OffloadDevice::none;
  std::size_t max_live = std::size_t{1} << 30;  // stage 3
  bool large_tensor = false;
  double ratio = 1;  // offload.optimizer.ratio
  bool update_ahead = false;  // offload.optimizer.update_ahead
};

std::string case_name(const testing::TestParamInfo<Case>& info) { return info.param.name; }

Config make_config(const Case& k, const std::string& nvme_dir) {
  Config c;
  c.stage = k.stage;
  c.device.memory = std::size_t{256} << 20;
  c.precision.dtype = k.dtype;
  c.precision.loss_scale.dynamic = false;
  c.optimizer.threads = 1;
  c.stage3.persistence_threshold_bytes = 1024;  // the 5-element "norm" group stays resident
  c.stage3.prefetch_bytes = 1 << 20;
  c.stage3.max_live_bytes = k.max_live;
  c.offload.optimizer.device = k.optimizer;
  c.offload.param.device = k.param;
  c.offload.optimizer_ratio = k.ratio;
  c.offload.optimizer_update_ahead = k.update_ahead;
  if (k.optimizer == OffloadDevice::nvme) c.offload.optimizer.paths = {nvme_dir};
  if (k.param == OffloadDevice::nvme) c.offload.param.paths = {nvme_dir};
  c.offload.sub_group_bytes = 12 * 256;  // several sub-groups per group
  c.offload.optimizer.buffer_count = 3;
  return c;
}

std::vector<ParamSpec> specs_of(const Case& k) { return k.large_tensor ? large_tensor_model() : odd_model(); }

// Two steps: forward (stage 3 gathers), backward writing every gradient, step.
void train(Engine& engine, const std::vector<ParamSpec>& specs) {
  for (std::size_t t = 0; t < specs.size(); ++t) {
    std::vector<float> values(specs[t].numel(), 0.25f);
    engine.set_param(t, values);
  }
  for (int step = 0; step < 2; ++step) {
    for (int g = 0; g < engine.group_count(); ++g) auto forward = engine.acquire(g);
    for (int g = engine.group_count() - 1; g >= 0; --g) {
      auto lease = engine.acquire(g);
      for (std::size_t t = 0; t < specs.size(); ++t) {
        if (specs[t].group != g) continue;
        auto* grad = static_cast<unsigned char*>(lease.grad(t).data);
        const std::size_t bytes = specs[t].numel() * dtype_size(engine.dtype());
        for (std::size_t b = 0; b < bytes; ++b) grad[b] = 0;  // zero is a valid gradient in every dtype
      }
      engine.grads_ready(g);
    }
    EXPECT_FALSE(engine.step().skipped);
  }
}

class EstimateEqualsEngine : public testing::TestWithParam<Case> {};

TEST_P(EstimateEqualsEngine, DevicePinnedAndNvmeBytes) {
  const Case& k = GetParam();
  test::ScratchDir dir;
  const Config config = make_config(k, dir.path());
  const std::vector<ParamSpec> specs = specs_of(k);
  MpiSession session;
  auto device = make_cpu_device(config.device.memory);
  auto comm = make_mpi_communicator(session, *device);
  const MemoryEstimate want = estimate_memory(config, specs, comm->size());
  {
    Engine engine(config, *device, *comm, specs);
    train(engine, specs);
    const EngineStats stats = engine.stats();
    for (std::size_t c = 0; c < kMemoryCategoryCount; ++c)
      EXPECT_EQ(stats.memory.peak[c], want.device[c]) << category_name(static_cast<MemoryCategory>(c));
    EXPECT_EQ(stats.memory.peak_total, want.device_total);
    EXPECT_EQ(device->pinned_stats().peak, want.pinned);
    std::size_t by_purpose = 0;
    for (std::size_t p = 0; p < kHostPurposeCount; ++p) {
      EXPECT_EQ(device->pinned_stats().peak_by[p], want.pinned_by[p]) << host_purpose_name(static_cast<HostPurpose>(p));
      by_purpose += want.pinned_by[p];
    }
    EXPECT_EQ(by_purpose, want.pinned);
    EXPECT_EQ(stats.nvme_bytes, want.nvme);
    if (k.optimizer == OffloadDevice::nvme || k.param == OffloadDevice::nvme) {
      EXPECT_GT(want.nvme, 0u);
      struct stat st {};
      const std::string swap = test::swap_file(dir.path(), comm->rank());
      ASSERT_EQ(::stat(swap.c_str(), &st), 0) << swap;
      EXPECT_EQ(static_cast<std::size_t>(st.st_size), want.nvme) << swap;
    } else {
      EXPECT_EQ(want.nvme, 0u);
    }
    // What the mode promises: nothing of what it offloads stays on the device.
    if (k.optimizer != OffloadDevice::none && k.ratio == 1)
      EXPECT_EQ(want.device_of(MemoryCategory::optimizer_states), 0u);
    else EXPECT_GT(want.device_of(MemoryCategory::optimizer_states), 0u);
    // The whole optimizer offloaded at stages 2-3: the gradient shard is on the host, not the device.
    const bool grads_on_host = k.optimizer != OffloadDevice::none && k.ratio == 1 && k.stage >= 2;
    EXPECT_EQ(want.device_of(MemoryCategory::grads) == 0, grads_on_host);
    EXPECT_EQ(want.pinned_of(HostPurpose::grad_shards) > 0, grads_on_host);
  }
  EXPECT_EQ(device->memory_stats().current_total, 0u);
}

INSTANTIATE_TEST_SUITE_P(
    EveryStageAndOffload, EstimateEqualsEngine,
    testing::Values(Case{"stage0_bf16", 0, DType::bf16}, Case{"stage1_fp16", 1, DType::f16},
                    Case{"stage2_fp32", 2, DType::f32}, Case{"stage3_bf16", 3, DType::bf16},
                    // Two gathered buffers: the minimum, below what max_live would hold.
                    Case{"stage3_bf16_min_live", 3, DType::bf16, OffloadDevice::none, OffloadDevice::none, 1},
                    Case{"stage1_optimizer_cpu", 1, DType::bf16, OffloadDevice::cpu},
                    Case{"stage2_optimizer_nvme", 2, DType::bf16, OffloadDevice::nvme},
                    Case{"stage2_fp32_optimizer_cpu", 2, DType::f32, OffloadDevice::cpu},
                    Case{"stage3_optimizer_cpu", 3, DType::bf16, OffloadDevice::cpu},
                    Case{"stage3_optimizer_cpu_param_cpu", 3, DType::bf16, OffloadDevice::cpu, OffloadDevice::cpu},
                    Case{"stage3_optimizer_nvme_param_nvme", 3, DType::f16, OffloadDevice::nvme, OffloadDevice::nvme},
                    Case{"stage3_param_nvme", 3, DType::bf16, OffloadDevice::none, OffloadDevice::nvme, 1},
                    Case{"stage3_param_cpu_fp32", 3, DType::f32, OffloadDevice::none, OffloadDevice::cpu},
                    Case{"stage2_large_tensor", 2, DType::bf16, OffloadDevice::none, OffloadDevice::none,
                         std::size_t{1} << 30, true},
                    // Partial offload: states on the device, in pinned memory and on NVMe at once.
                    Case{"stage2_optimizer_cpu_ratio_half", 2, DType::bf16, OffloadDevice::cpu, OffloadDevice::none,
                         std::size_t{1} << 30, false, 0.5},
                    Case{"stage1_fp32_optimizer_nvme_ratio_half", 1, DType::f32, OffloadDevice::nvme,
                         OffloadDevice::none, std::size_t{1} << 30, false, 0.5},
                    Case{"stage3_optimizer_nvme_param_nvme_ratio_half", 3, DType::f16, OffloadDevice::nvme,
                         OffloadDevice::nvme, std::size_t{1} << 30, false, 0.5},
                    // update_ahead: a second copy of the states (pinned or on NVMe), the updated parameters pinned.
                    Case{"stage2_optimizer_cpu_update_ahead", 2, DType::bf16, OffloadDevice::cpu, OffloadDevice::none,
                         std::size_t{1} << 30, false, 1, true},
                    Case{"stage3_fp32_optimizer_nvme_param_cpu_update_ahead", 3, DType::f32, OffloadDevice::nvme,
                         OffloadDevice::cpu, std::size_t{1} << 30, false, 1, true}),
    case_name);

// The plan's NVMe alignment is the store's: the padding it predicts is the padding on disk.
TEST(Estimate, NvmeAlignmentIsTheStores) {
  test::ScratchDir dir;
  offload::NvmeStoreOptions options;
  options.directories = {dir.path()};
  options.rank = 1000 + world_size();  // not a file an engine test of this run uses
  offload::NvmeStore store(options);
  EXPECT_EQ(store.alignment(), engine::kNvmeAlignment);
}

// Per rank, bf16, mixed-precision Adam: the ZeRO paper's params/grads/optimizer states, from the
// formulas alone. The estimate adds only padding (64-element alignment per rank and group: far
// below 1% here) and, in buffers, the two gradient staging buffers of one layer (plus stage 3's
// gathered layers).
TEST(Estimate, LargeModelFollowsZeroFormulas) {
  const std::size_t psi = 1'000'000'007;
  const int layers = 20, ranks = 8;
  const double p = static_cast<double>(psi), n = ranks, layer_bytes = 2.0 * p / layers;
  for (int stage = 0; stage <= 3; ++stage) {
    Config c;
    c.stage = stage;
    c.precision.dtype = DType::bf16;
    c.stage3.max_live_bytes = std::size_t{1} << 30;  // 10 layers of 100 MB
    const MemoryEstimate e = estimate_memory(c, uniform_model(psi, layers), ranks);
    EXPECT_EQ(e.numel, psi);
    const double params = stage >= 3 ? 2 * p / n : 2 * p;
    const double grads = stage >= 2 ? 2 * p / n : 2 * p;
    const double states = stage >= 1 ? 12 * p / n : 12 * p;
    const double gathered = stage == 3 ? 10 * layer_bytes : 0;
    const std::pair<MemoryCategory, double> expected[] = {{MemoryCategory::params, params},
                                                          {MemoryCategory::grads, grads},
                                                          {MemoryCategory::optimizer_states, states},
                                                          {MemoryCategory::buffers, 2 * layer_bytes + gathered}};
    for (const auto& [category, formula] : expected) {
      const double got = static_cast<double>(e.device_of(category));
      EXPECT_GE(got, formula) << "stage " << stage << " " << category_name(category);
      EXPECT_LE(got, formula * 1.001) << "stage " << stage << " " << category_name(category);
    }
  }
}

TEST(Estimate, OptimizerOffloadMovesTwelveBytesPerParameterToHostOrNvme) {
  const std::size_t psi = 10'000'000'000;
  Config c;
  c.stage = 2;
  c.offload.optimizer.device = OffloadDevice::cpu;
  const MemoryEstimate host = estimate_memory(c, uniform_model(psi, 10), 4);
  EXPECT_EQ(host.device_of(MemoryCategory::optimizer_states), 0u);
  EXPECT_GE(host.pinned, 12 * psi / 4);
  EXPECT_EQ(host.nvme, 0u);
  c.offload.optimizer.device = OffloadDevice::nvme;
  const MemoryEstimate nvme = estimate_memory(c, uniform_model(psi, 10), 4);
  EXPECT_GE(nvme.nvme, 12 * psi / 4);
  EXPECT_LE(static_cast<double>(nvme.nvme), 12.0 * psi / 4 * 1.001);
  // Only buffer_count sub-groups (256 MiB each by default) stay on the host, plus the staging.
  EXPECT_LT(nvme.pinned, host.pinned / 2);
}

TEST(Estimate, UniformModelSplitsTheCountEvenly) {
  const std::vector<ParamSpec> specs = uniform_model(10, 4);
  ASSERT_EQ(specs.size(), 4u);
  std::size_t total = 0;
  for (std::size_t g = 0; g < specs.size(); ++g) {
    EXPECT_EQ(specs[g].group, static_cast<int>(g));
    total += specs[g].numel();
  }
  EXPECT_EQ(total, 10u);
  EXPECT_EQ(specs[0].numel(), 3u);
  EXPECT_EQ(specs[3].numel(), 2u);
}

TEST(Estimate, RejectsBadInput) {
  try {
    uniform_model(3, 4);
    FAIL() << "no error for fewer parameters than layers";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("3 parameters cannot fill 4 layers"), std::string::npos) << e.what();
  }
  EXPECT_THROW(uniform_model(10, 0), Error);
  try {
    estimate_memory(Config{}, uniform_model(10, 1), 0);
    FAIL() << "no error for 0 ranks";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("ranks must be at least 1, got 0"), std::string::npos) << e.what();
  }
  EXPECT_THROW(estimate_memory(Config{}, {}, 1), Error);
}

}  // namespace
}  // namespace zest
