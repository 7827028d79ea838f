// GradBuckets alone, on the cpu device with the one-rank communicator (every reduction the
// identity), for stages 0-3 in fp32, bf16 and fp16, and at stages 2-3 with the gradient shard on
// the host (the whole optimizer offloaded): the gradients written for every group in backward order
// are, after flush(), exactly what reduced(g) (where the step reads) and grad_stats() give, element
// for element, padding zero; two micro-batches are summed (the first written in place, one rank
// having nothing to reduce), and the next step's first contribution overwrites instead of adding; a
// tensor or group not written is zero; the device memory is the plan's (grads, two buckets) and
// does not grow over steps; flush() refuses a group requested and not ready, and a third bucket is
// refused naming the remedy.
#include "engine/collectives/grad_buckets.hpp"

#include <gtest/gtest.h>

#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "engine/math/device_math.hpp"
#include "engine/plan/host_staging.hpp"
#include "engine/plan/layout.hpp"
#include "engine/plan/memory_plan.hpp"
#include "optim/adam_math.hpp"
#include "runtime/host/half.hpp"
#include "runtime/comm/local_communicator.hpp"
#include "zest/device.hpp"
#include "zest/error.hpp"

namespace zest::engine {
namespace {

// Padded segments of 64, 128, 128 (two tensors, the second at 64) and 256 elements; with buckets
// of 256 elements, backward (3, 2, 1, 0) puts group 3 in a bucket alone, groups 2 and 1 in one,
// and leaves group 0 in the open bucket until flush().
const std::vector<ParamSpec> kParams = {
    {"a", {10}, 0}, {"b", {100}, 1}, {"c1", {50}, 2}, {"c2", {3, 20}, 2}, {"d", {200}, 3}};
constexpr std::size_t kBucketElements = 256;
constexpr std::size_t kNone = static_cast<std::size_t>(-1);

// Small integers: exact in every dtype, and so are their sums.
float value(std::size_t tensor, std::size_t i, int micro) {
  return static_cast<float>(static_cast<int>((tensor * 7 + i * 3 + static_cast<std::size_t>(micro) * 5) % 17) - 8);
}

struct Case {
  int stage;
  DType dtype;
  bool host_shard;  // offload.optimizer cpu at stages 2-3: plan.grads_on_host
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << "stage " << c.stage << ' ' << dtype_name(c.dtype) << (c.host_shard ? " host shard" : "");
}

std::string name(const testing::TestParamInfo<Case>& info) {
  return "stage" + std::to_string(info.param.stage) + "_" + std::string(dtype_name(info.param.dtype)) +
         (info.param.host_shard ? "_host_shard" : "");
}

Config config_for(const Case& c, int micro_batches) {
  Config config;
  config.stage = c.stage;
  config.precision.dtype = c.dtype;
  config.buckets.reduce_bytes = kBucketElements * dtype_size(c.dtype);
  config.gradient_accumulation_steps = micro_batches;
  config.optimizer.threads = 1;
  if (c.host_shard) config.offload.optimizer.device = OffloadDevice::cpu;
  return config;
}

// What the Engine builds around its GradBuckets, for one rank.
struct Rig {
  Rig(const Case& c, int micro_batches)
      : config(config_for(c, micro_batches)),
        device(make_cpu_device(std::size_t{16} << 20)),
        stream(device->create_stream()),
        comm(make_local_communicator(*device)),
        math(make_cpu_device_math(optim::hyper_params_from(config.optimizer), 1)),
        layout(kParams, 1),
        plan(plan_memory(config, layout)),
        staging(*device, plan.engine, c.dtype),
        stats(device->allocate(sizeof(GradStatsScalars), MemoryCategory::buffers)),
        before(device->memory_stats()),
        buckets(grad_buckets_options(config), *device, *comm, *stream, *math, layout, plan.reduce, staging) {
    stream->synchronize();  // as the Engine's constructor: the zeroed buffers are ready
  }

  DType dtype() const { return config.precision.dtype; }

  // One micro-batch's backward, last group first (but `skipped`): each tensor (but `unwritten`,
  // not even asked for) written where grad() says (the padding left alone), then its group handed over.
  void backward(int micro, int skipped = -1, std::size_t unwritten = kNone) {
    for (int g = layout.group_count() - 1; g >= 0; --g) {
      if (g == skipped) continue;
      EXPECT_FALSE(buckets.requested(g));
      const GroupPlace& group = layout.group(g);
      for (std::size_t t = group.first_tensor; t < group.end_tensor; ++t) {
        if (t == unwritten) continue;
        char* const at = buckets.grad(t);
        EXPECT_TRUE(buckets.requested(g));
        for (std::size_t i = 0; i < layout.tensor(t).numel; ++i) store_from_float(at, dtype(), i, value(t, i, micro));
      }
      buckets.ready(g);
    }
  }

  // After flush(): every group's reduced gradient (but `skipped`'s: zero) is the sum of micro-batches
  // `micros` (but `unwritten`'s in micro-batch `unwritten_in`: zero there), padding zero, and
  // grad_stats() their sum of squares.
  void expect_reduced(const std::vector<int>& micros, int skipped = -1, std::size_t unwritten = kNone,
                      int unwritten_in = -1) {
    buckets.grad_stats(stats.as<GradStatsScalars>());
    stream->synchronize();
    double sum_squares = 0;
    for (int g = 0; g < layout.group_count(); ++g) {
      const GroupPlace& group = layout.group(g);
      std::vector<float> expected(group.padded, 0.0F);
      for (std::size_t t = group.first_tensor; t < group.end_tensor; ++t)
        for (std::size_t i = 0; i < layout.tensor(t).numel; ++i)
          for (int m : micros)
            if (g != skipped && !(t == unwritten && m == unwritten_in))
              expected[layout.tensor(t).offset + i] += value(t, i, m);
      const char* const reduced = buckets.reduced(g);
      for (std::size_t i = 0; i < group.padded; ++i) {
        ASSERT_EQ(load_as_float(reduced, dtype(), i), expected[i]) << "group " << g << " element " << i;
        sum_squares += static_cast<double>(expected[i]) * expected[i];
      }
    }
    const auto* out = stats.as<GradStatsScalars>();
    EXPECT_EQ(out->nonfinite, 0);
    EXPECT_EQ(out->sum_squares, sum_squares);
  }

  Config config;
  std::unique_ptr<Device> device;
  std::unique_ptr<Stream> stream;
  std::unique_ptr<Communicator> comm;
  std::unique_ptr<DeviceMath> math;
  Layout layout;
  MemoryPlan plan;
  HostStaging staging;
  DeviceBuffer stats;
  MemoryStats before;  // without the buckets
  GradBuckets buckets;
};

class GradBucketsTest : public testing::TestWithParam<Case> {};

TEST_P(GradBucketsTest, EveryGroupLandsWhereTheStepReadsIt) {
  Rig rig(GetParam(), 1);
  ASSERT_EQ(rig.plan.reduce.grads_on_host, GetParam().host_shard);
  EXPECT_FALSE(rig.buckets.any_grad());
  rig.backward(0);
  rig.buckets.flush();
  EXPECT_TRUE(rig.buckets.any_grad());
  rig.expect_reduced({0});
}

TEST_P(GradBucketsTest, MicroBatchesAddUpAndTheNextStepStartsAfresh) {
  Rig rig(GetParam(), 2);
  rig.backward(0);
  rig.backward(1);
  rig.buckets.flush();
  rig.expect_reduced({0, 1});
  rig.buckets.end_step();
  EXPECT_FALSE(rig.buckets.any_grad());
  // Group 1 has no gradient this step: zero, not the last step's.
  rig.backward(2, 1);
  rig.backward(3, 1);
  rig.buckets.flush();
  rig.expect_reduced({2, 3}, 1);
}

// A tensor whose gradient is not asked for in a contribution adds zero: in the first (written in
// place in a world of one, over the last step's values) and in the second (a bucket).
TEST_P(GradBucketsTest, ATensorNotWrittenIsAZeroGradient) {
  Rig rig(GetParam(), 2);
  // Step 0 writes everything; step 1 leaves tensor 3 out of its first micro-batch, step 2 tensor 2
  // out of its second.
  for (int step = 0; step < 3; ++step) {
    const int first = 2 * step;
    const std::size_t unwritten = step == 0 ? kNone : step == 1 ? 3 : 2;
    const int unwritten_in = step == 1 ? first : first + 1;
    rig.backward(first, -1, unwritten_in == first ? unwritten : kNone);
    rig.backward(first + 1, -1, unwritten_in == first + 1 ? unwritten : kNone);
    rig.buckets.flush();
    rig.expect_reduced({first, first + 1}, -1, unwritten, unwritten_in);
    rig.buckets.end_step();
  }
}

// In a world of one, a step's first contribution is written where the step reads it (no bucket, no
// copy), later ones in a bucket; a host shard (written from device memory) always takes a bucket.
TEST_P(GradBucketsTest, AWorldOfOneWritesTheFirstContributionInPlace) {
  Rig rig(GetParam(), 2);
  const bool in_place = !GetParam().host_shard;
  for (int micro = 0; micro < 2; ++micro) {
    const char* const at = rig.buckets.grad(4);
    EXPECT_EQ(at == rig.buckets.reduced(3), in_place && micro == 0) << "micro-batch " << micro;
    rig.buckets.ready(3);
  }
  rig.stream->synchronize();
}

// On the cpu backend (and for a host shard) each group's statistics are taken at its last
// reduction of the step, while backward goes on: what the accumulated gradient holds after that
// does not change grad_stats(); a group whose last reduction has not come by step() (fewer
// micro-batches than configured) gets its statistics then.
TEST_P(GradBucketsTest, StatisticsAreTakenAtEachGroupsLastReduction) {
  for (int micro_batches : {1, 2}) {
    Rig rig(GetParam(), micro_batches);
    rig.backward(0);
    rig.stream->synchronize();
    // Group 3 (tensor 4, reduced before flush(): a bucket alone) is final (one micro-batch) or
    // not (two): the step's statistics read the values at its last reduction, or those at step().
    char* const group3 = const_cast<char*>(rig.buckets.reduced(3));
    for (std::size_t i = 0; i < rig.layout.tensor(4).numel; ++i) store_from_float(group3, rig.dtype(), i, 0.0F);
    rig.buckets.flush();
    rig.buckets.grad_stats(rig.stats.as<GradStatsScalars>());
    rig.stream->synchronize();
    double sum_squares = 0;
    for (std::size_t t = 0; t < (micro_batches == 1 ? 5u : 4u); ++t)
      for (std::size_t i = 0; i < rig.layout.tensor(t).numel; ++i) sum_squares += value(t, i, 0) * value(t, i, 0);
    EXPECT_EQ(rig.stats.as<GradStatsScalars>()->sum_squares, sum_squares) << micro_batches << " micro-batch(es)";
  }
}

TEST_P(GradBucketsTest, TheDeviceHoldsThePlannedMemoryAndNoMore) {
  Rig rig(GetParam(), 2);
  const MemoryStats built = rig.device->memory_stats();
  EXPECT_EQ(built.current_of(MemoryCategory::grads) - rig.before.current_of(MemoryCategory::grads),
            rig.plan.reduce.grads);
  EXPECT_EQ(built.current_of(MemoryCategory::buffers) - rig.before.current_of(MemoryCategory::buffers),
            ReducePlan::kStagingSlots * rig.plan.reduce.staging_slot);
  EXPECT_EQ(rig.plan.reduce.staging_slot, kBucketElements * dtype_size(rig.dtype()));
  EXPECT_EQ(rig.plan.reduce.grads, GetParam().host_shard ? 0 : rig.layout.full_numel() * dtype_size(rig.dtype()));
  EXPECT_EQ(rig.buckets.pinned_bytes(), rig.plan.reduce.host_grads + rig.plan.reduce.grad_landing);
  for (int step = 0; step < 3; ++step) {
    rig.backward(2 * step);
    rig.backward(2 * step + 1);
    rig.buckets.flush();
    rig.expect_reduced({2 * step, 2 * step + 1});
    rig.buckets.end_step();
  }
  rig.stream->synchronize();
  const MemoryStats after = rig.device->memory_stats();
  EXPECT_EQ(after.current, built.current);
  EXPECT_EQ(after.peak_total, built.current_total) << "a step allocated device memory";
}

INSTANTIATE_TEST_SUITE_P(GradBuckets, GradBucketsTest,
                         testing::Values(Case{0, DType::f32, false}, Case{1, DType::f32, false},
                                         Case{2, DType::f32, false}, Case{3, DType::f32, false},
                                         Case{0, DType::bf16, false}, Case{1, DType::bf16, false},
                                         Case{2, DType::bf16, false}, Case{3, DType::bf16, false},
                                         Case{0, DType::f16, false}, Case{3, DType::f16, false},
                                         Case{2, DType::f32, true}, Case{3, DType::f32, true},
                                         Case{2, DType::bf16, true}, Case{3, DType::bf16, true}),
                         name);

// The refusals GradBuckets makes itself (the Engine checks grads_ready's group before ready()).
TEST(GradBucketsRefusals, StepWithAGradientNotHandedOver) {
  for (int micro : {0, 1}) {  // written in place, then in a bucket
    Rig rig({2, DType::f32, false}, 2);
    if (micro == 1) rig.backward(0);
    rig.buckets.grad(4);
    rig.buckets.ready(3);
    rig.buckets.grad(1);
    try {
      rig.buckets.flush();
      ADD_FAILURE() << "flush() accepted group 1's gradient without ready(1), micro-batch " << micro;
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("the gradient of group 1 was requested but grads_ready(1) was not called"), std::string::npos)
          << what;
    }
    rig.stream->synchronize();
  }
}

// The second micro-batch's gradients take buckets (the first's are written in place in a world of one).
TEST(GradBucketsRefusals, AThirdBucketWhileTwoAreBeingWritten) {
  Rig rig({0, DType::f32, false}, 2);
  rig.backward(0);
  rig.buckets.grad(4);  // group 3 fills a bucket alone
  rig.buckets.grad(2);  // group 2
  rig.buckets.grad(1);  // group 1 fills the second with group 2
  try {
    rig.buckets.grad(0);
    ADD_FAILURE() << "group 0 got a third bucket of two";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("every gradient bucket buffer is in use (2 of them)"), std::string::npos) << what;
    EXPECT_NE(what.find("call grads_ready(group) once a group's gradients are written"), std::string::npos) << what;
  }
  // Handing group 3 over frees its bucket for group 0.
  rig.buckets.ready(3);
  EXPECT_NE(rig.buckets.grad(0), nullptr);
  rig.stream->synchronize();
}

// A bucket's life is idle -> filling -> sealed -> idle; any other move is zest's own bug, refused
// loudly instead of reducing a bucket twice or reusing one still being written.
TEST(BucketState, OnlyTheLifeCycleMovesAreTaken) {
  using S = BucketState;
  EXPECT_EQ(checked_move(S::idle, S::filling), S::filling);
  EXPECT_EQ(checked_move(S::filling, S::sealed), S::sealed);
  EXPECT_EQ(checked_move(S::sealed, S::idle), S::idle);
  for (const auto& [from, to] : {std::pair{S::idle, S::sealed}, std::pair{S::filling, S::idle},
                                 std::pair{S::sealed, S::filling}, std::pair{S::filling, S::filling}}) {
    try {
      checked_move(from, to);
      ADD_FAILURE() << static_cast<int>(from) << " -> " << static_cast<int>(to);
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("an internal error"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace zest::engine
