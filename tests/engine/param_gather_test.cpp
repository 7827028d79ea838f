// ParamGather alone, on the cpu device and a world of one rank. What it proves:
// - set_tensor's values read back element for element from the full parameters (stages 0-2) or
//   through a lease of the group (stage 3), in fp32 and in bf16 rounded to nearest even;
// - stage 3: a non-resident group's full parameters exist only while it is leased (full() refuses
//   otherwise) or prefetched from the previous step's acquire order; a resident group's always do;
//   the gathered-parameter buffers are the plan's, allocated once (a lease allocates nothing);
// - a new shard (write_shard, or the step's write to shard_out followed by gather_all) is what the
//   next gather shows;
// - a lease beyond the gathered-parameter buffers raises zest::Error naming them and the remedy.
#include "engine/collectives/param_gather.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "engine/plan/host_staging.hpp"
#include "engine/plan/layout.hpp"
#include "engine/plan/memory_plan.hpp"
#include "runtime/host/half.hpp"
#include "runtime/comm/local_communicator.hpp"
#include "zest/device.hpp"
#include "zest/error.hpp"

namespace zest::engine {
namespace {

// Group 0: two tensors (1536 bytes in fp32, 768 in bf16); group 1: 1024 elements; group 2: small,
// so stage 3 keeps it resident (persistence threshold 512 bytes); group 3: 704 elements.
const std::vector<ParamSpec> kModel = {
    {"a", {300}, 0}, {"b", {5, 7}, 0}, {"c", {1000}, 1}, {"d", {10}, 2}, {"e", {700}, 3}};

// bf16 rounded to nearest, ties to even, written here apart from the engine's conversion.
float round_bf16(float f) {
  std::uint32_t bits;
  std::memcpy(&bits, &f, 4);
  bits = ((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16) << 16;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Values no bf16 holds exactly, and two exact ties (one rounds down to even, one up).
std::vector<float> values_for(std::size_t tensor, std::size_t n, float shift = 0.0f) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = shift + static_cast<float>(tensor + 1) + 0.0013f * static_cast<float>(i);
  v[0] = bits_float(0x3f808000u);  // halfway between 0x3f80 and 0x3f81: 0x3f80
  if (n > 1) v[1] = bits_float(0x3f818000u);  // halfway between 0x3f81 and 0x3f82: 0x3f82
  return v;
}

struct Rig {
  Rig(int stage, DType dtype, std::size_t prefetch_bytes = 0)
      : config(make_config(stage, dtype, prefetch_bytes)),
        device(make_cpu_device(std::size_t{64} << 20)),
        comm(make_local_communicator(*device)),
        stream(device->create_stream()),
        layout(kModel, 1),
        plan(plan_memory(config, layout)),
        staging(*device, plan.engine, dtype),
        params(param_gather_options(config), *device, *comm, *stream, layout, plan, staging, nullptr) {}

  // A prefetch may still be copying into the gathered buffers: it ends before they go, as the
  // Engine's destructor waits for its streams.
  ~Rig() { stream->synchronize(); }

  static Config make_config(int stage, DType dtype, std::size_t prefetch_bytes) {
    Config c;
    c.stage = stage;
    c.precision.dtype = dtype;
    c.stage3.persistence_threshold_bytes = 512;
    c.stage3.max_live_bytes = 0;  // the fewest gathered-parameter buffers: two
    c.stage3.prefetch_bytes = prefetch_bytes;
    return c;
  }

  // Tensor t's values in the full parameters (the cpu device's memory is the host's), as floats.
  std::vector<float> read_full(std::size_t t) {
    const TensorPlace& place = layout.tensor(t);
    const char* data = params.full(place.group);
    std::vector<float> out(place.numel);
    for (std::size_t i = 0; i < place.numel; ++i)
      out[i] = load_as_float(data, config.precision.dtype, place.offset + i);
    return out;
  }

  // Through a lease at stage 3, as the engine's Lease does.
  std::vector<float> read(std::size_t t) {
    const int g = layout.tensor(t).group;
    params.acquire(g);
    std::vector<float> out = read_full(t);
    params.release(g);
    return out;
  }

  std::vector<float> expected(const std::vector<float>& set) const {
    std::vector<float> out = set;
    if (config.precision.dtype == DType::bf16)
      for (float& v : out) v = round_bf16(v);
    return out;
  }

  Config config;
  std::unique_ptr<Device> device;
  std::unique_ptr<Communicator> comm;
  std::unique_ptr<Stream> stream;
  Layout layout;
  MemoryPlan plan;
  HostStaging staging;
  ParamGather params;
};

void expect_not_gathered(ParamGather& params, int g) {
  try {
    params.full(g);
    ADD_FAILURE() << "group " << g << "'s full parameters exist outside a lease";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("group " + std::to_string(g) + " is not gathered"), std::string::npos)
        << e.what();
  }
}

TEST(ParamGather, SetTensorReadsBackAtEveryStageInFp32AndBf16) {
  for (int stage : {0, 1, 2, 3})
    for (DType dtype : {DType::f32, DType::bf16}) {
      SCOPED_TRACE(testing::Message() << "stage " << stage << (dtype == DType::f32 ? " fp32" : " bf16"));
      Rig rig(stage, dtype);
      std::vector<std::vector<float>> set;
      for (std::size_t t = 0; t < rig.layout.tensor_count(); ++t) {
        set.push_back(values_for(t, rig.layout.tensor(t).numel));
        rig.params.set_tensor(t, set.back().data());
      }
      for (std::size_t t = 0; t < rig.layout.tensor_count(); ++t) {
        const std::vector<float> want = rig.expected(set[t]);
        const std::vector<float> got = stage == 3 ? rig.read(t) : rig.read_full(t);
        ASSERT_EQ(got.size(), want.size());
        for (std::size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], want[i]) << "tensor " << t << " element " << i;
      }
      if (dtype == DType::bf16) {  // the ties went to even
        const std::vector<float> a = stage == 3 ? rig.read(0) : rig.read_full(0);
        EXPECT_EQ(a[0], bits_float(0x3f800000u));
        EXPECT_EQ(a[1], bits_float(0x3f820000u));
      }
    }
}

TEST(ParamGather, Stage3GroupIsGatheredOnlyWhileLeased) {
  Rig rig(3, DType::f32);
  ASSERT_EQ(rig.plan.gather.gathered_count, 2u);
  ASSERT_GT(rig.plan.params.resident[2], 0u);
  ASSERT_EQ(rig.plan.params.resident[1], 0u);
  const std::vector<float> c = values_for(2, 1000);
  rig.params.set_tensor(2, c.data());
  const MemoryStats before = rig.device->memory_stats();

  EXPECT_FALSE(rig.params.any_leased());
  expect_not_gathered(rig.params, 1);
  EXPECT_NO_THROW(rig.params.full(2));  // resident: always there

  rig.params.acquire(1);
  EXPECT_TRUE(rig.params.any_leased());
  EXPECT_EQ(rig.read_full(2), c);
  rig.params.acquire(1);  // a second lease of the same group is counted...
  rig.params.release(1);
  EXPECT_TRUE(rig.params.any_leased());  // ...so one release keeps it gathered
  EXPECT_EQ(rig.read_full(2), c);
  rig.params.release(1);
  EXPECT_FALSE(rig.params.any_leased());
  expect_not_gathered(rig.params, 1);

  // The gathered buffers are allocated once, with the plan's sizes: a lease takes one, allocates none.
  const MemoryStats after = rig.device->memory_stats();
  EXPECT_EQ(after.current_of(MemoryCategory::buffers), before.current_of(MemoryCategory::buffers));
  EXPECT_EQ(after.current_of(MemoryCategory::params), before.current_of(MemoryCategory::params));
  EXPECT_EQ(after.peak_of(MemoryCategory::buffers), before.current_of(MemoryCategory::buffers));
  EXPECT_EQ(before.current_of(MemoryCategory::buffers),
            rig.plan.gather.gathered_count * (rig.plan.gather.gathered_slot + rig.plan.gather.gathered_shard) +
                rig.plan.gather.gather_bucket);
}

TEST(ParamGather, Stage3LeasesBeyondTheGatheredBuffersAreRefused) {
  Rig rig(3, DType::f32);
  rig.params.acquire(0);
  rig.params.acquire(1);
  try {
    rig.params.acquire(3);
    ADD_FAILURE() << "a third group was gathered with two gathered-parameter buffers";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("every gathered-parameter buffer is in use (2 of them)"), std::string::npos) << what;
    EXPECT_NE(what.find("stage3.max_live"), std::string::npos) << what;
  }
  expect_not_gathered(rig.params, 3);
  EXPECT_NO_THROW(rig.params.full(0));  // the leases held stay
  EXPECT_NO_THROW(rig.params.full(1));
  rig.params.acquire(2);  // resident: needs no buffer
  rig.params.release(2);
  rig.params.release(0);
  rig.params.acquire(3);  // a buffer went back: now it fits
  EXPECT_NO_THROW(rig.params.full(3));
  rig.params.release(3);
  rig.params.release(1);
  EXPECT_FALSE(rig.params.any_leased());
}

TEST(ParamGather, Stage3PrefetchesTheNextGroupsOfThePreviousOrder) {
  Rig rig(3, DType::f32, std::size_t{1} << 20);
  const std::vector<float> c = values_for(2, 1000), e = values_for(4, 700);
  rig.params.set_tensor(2, c.data());
  rig.params.set_tensor(4, e.data());
  for (int g : {0, 1, 3}) {  // step 1 records the order; nothing before it to prefetch from
    rig.params.acquire(g);
    rig.params.release(g);
  }
  expect_not_gathered(rig.params, 1);
  rig.params.end_step();

  rig.params.acquire(0);  // fills the other buffer with group 1, next in the order
  rig.stream->synchronize();  // a prefetch is not waited for until its lease: wait here to read it
  EXPECT_EQ(rig.read_full(2), c) << "group 1 was not prefetched";
  expect_not_gathered(rig.params, 3);  // no buffer left for it
  rig.params.release(0);
  rig.params.acquire(1);  // prefetched already; group 3 goes into the buffer group 0 gave back
  rig.stream->synchronize();
  EXPECT_EQ(rig.read_full(4), e) << "group 3 was not prefetched";
  rig.params.release(1);
  rig.params.acquire(3);
  EXPECT_EQ(rig.read_full(4), e);
  rig.params.release(3);
  rig.params.end_step();

  Rig quiet(3, DType::f32, 0);  // prefetch_bytes 0: nothing gathered ahead
  for (int g : {0, 1, 3}) {
    quiet.params.acquire(g);
    quiet.params.release(g);
  }
  quiet.params.end_step();
  quiet.params.acquire(0);
  expect_not_gathered(quiet.params, 1);
  quiet.params.release(0);
}

TEST(ParamGather, Stage3GatherShowsANewShard) {
  for (DType dtype : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype == DType::f32 ? "fp32" : "bf16");
    Rig rig(3, dtype);
    const std::vector<float> old_c = values_for(2, 1000), new_c = values_for(2, 1000, 10.0f);
    rig.params.set_tensor(2, old_c.data());
    EXPECT_EQ(rig.read(2), rig.expected(old_c));
    // One rank: the shard is the whole segment, and tensor c starts it.
    rig.params.write_shard(1, 0, new_c.data(), new_c.size());
    EXPECT_EQ(rig.read(2), rig.expected(new_c));
  }
}

TEST(ParamGather, TheStepsShardWritesShowAfterGatherAll) {
  // As Engine::step does: the optimizer writes the updated shard at shard_out(g), then gather_all.
  for (int stage : {2, 3}) {
    SCOPED_TRACE(testing::Message() << "stage " << stage);
    Rig rig(stage, DType::f32);
    const std::vector<float> d = values_for(3, 10), c = values_for(2, 1000);
    const std::vector<float> new_d = values_for(3, 10, 5.0f), new_c = values_for(2, 1000, 5.0f);
    rig.params.set_tensor(3, d.data());
    rig.params.set_tensor(2, c.data());
    std::memcpy(rig.params.shard_out(2) + 4 * rig.layout.tensor(3).offset, new_d.data(), 4 * new_d.size());
    std::memcpy(rig.params.shard_out(1) + 4 * rig.layout.tensor(2).offset, new_c.data(), 4 * new_c.size());
    if (stage == 3) {
      EXPECT_EQ(rig.read_full(3), d) << "the resident copy changed before gather_all";
    }
    rig.params.gather_all();
    EXPECT_EQ(stage == 3 ? rig.read(3) : rig.read_full(3), new_d);  // resident at stage 3
    EXPECT_EQ(stage == 3 ? rig.read(2) : rig.read_full(2), new_c);  // gathered at the next lease
  }
}

TEST(ParamGather, AReleaseWithoutALeaseChangesNothing) {
  Rig rig(3, DType::f32);
  rig.params.acquire(1);
  rig.params.release(1);
  rig.params.release(1);
  rig.params.acquire(1);
  EXPECT_TRUE(rig.params.any_leased()) << "a release without a lease hid the next lease";
  rig.params.release(1);
}

// A group prefetched in a step but not leased in it (the trainer left the recorded order) holds a
// copy of the old parameters; the step's new shard must replace it, not be hidden by it.
TEST(ParamGather, Stage3APrefetchedCopyDoesNotOutliveTheStep) {
  Rig rig(3, DType::f32, std::size_t{1} << 20);
  const std::vector<float> c = values_for(2, 1000), new_c = values_for(2, 1000, 5.0f);
  rig.params.set_tensor(2, c.data());
  for (int g : {0, 1, 3}) {  // the recorded order
    rig.params.acquire(g);
    rig.params.release(g);
  }
  rig.params.end_step();
  rig.params.acquire(0);  // prefetches group 1, which this step then never leases
  rig.params.release(0);
  rig.params.end_step();
  rig.stream->synchronize();
  std::memcpy(rig.params.shard_out(1) + 4 * rig.layout.tensor(2).offset, new_c.data(), 4 * new_c.size());
  rig.params.gather_all();
  EXPECT_EQ(rig.read(2), new_c) << "the lease found the stale prefetched copy";
}

}  // namespace
}  // namespace zest::engine
