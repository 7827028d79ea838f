// Quantized collectives (comm.quantize), under mpirun with 1, 2 and 4 ranks, on simulated hosts of
// 1, 2 or 4 ranks. What it proves:
// - QuantizedGather (qwZ) gives every rank every shard decoded from its int8 codes, bit for bit the
//   host quantizer's, and sends each peer only the codes;
// - QuantizedReduceScatter (qgZ) gives each rank the sum of its piece bit for bit as the two-level
//   algorithm does it on the host (int8 and int4, fp32 and bf16, a piece that ends in a partial
//   block), within the codec's error of the exact sum, sending peers on the host a piece per host
//   and peers on other hosts one piece;
// - the engine with both at stage 3 (and qgZ at stages 1 and 2) trains close to the reference
//   Adam (in the typical element), not equal to the exact run, and sends what estimate_wire_bytes
//   says: across hosts at most 0.3x plain stage 3's bytes, with the planned memory;
// - ranks that set either key differently are refused, naming it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "engine/math/device_math.hpp"
#include "engine/host_communicators.hpp"
#include "engine/plan/memory_plan.hpp"
#include "engine/collectives/quantized_collectives.hpp"
#include "engine/reference_training.hpp"
#include "optim/block_quant.hpp"
#include "runtime/comm/counting_communicator.hpp"
#include "runtime/host/half.hpp"
#include "runtime/comm/mpi_session.hpp"
#include "zest/estimate.hpp"

namespace zest {
namespace {

using engine::GatherPlan;
using engine::ReducePlan;
using optim::QuantBits;
using optim::quantized_bytes;
using test_hosts::SimulatedHosts;

constexpr std::size_t kPiece = 300;  // a full block and a partial one

// Element i of rank r's buffer: every block's largest value differs, and so do the ranks'.
float value(int r, std::size_t i) {
  return std::sin(0.37f * static_cast<float>(i) + 1.1f * static_cast<float>(r)) *
             (1.0f + 0.5f * static_cast<float>(r)) +
         0.01f * static_cast<float>(i % 7);
}

std::vector<std::byte> fill(int r, std::size_t count, DType dtype, std::size_t first = 0) {
  std::vector<std::byte> out(count * dtype_size(dtype));
  for (std::size_t i = 0; i < count; ++i) store_from_float(out.data(), dtype, i, value(r, first + i));
  return out;
}

// The host's codec (the cpu device math's, bit for bit on every backend).
struct HostCodec {
  optim::BlockQuantizer quantizer{1};
  std::vector<std::byte> codes;
  // values, as `dtype`, encoded and decoded to fp32.
  std::vector<float> round_trip(const void* values, DType dtype, std::size_t count, QuantBits bits) {
    codes.resize(quantized_bytes(bits, count));
    quantizer.quantize(optim::ConstTensorSpan{values, dtype, count}, bits, codes);
    std::vector<float> out(count);
    quantizer.dequantize(codes, bits, optim::TensorSpan{out.data(), DType::f32, count});
    return out;
  }
};

struct Rig {
  MpiSession session;
  std::unique_ptr<Device> device = make_cpu_device(std::size_t{64} << 20);
  std::unique_ptr<Communicator> world = make_mpi_communicator(session, *device);
  std::unique_ptr<Stream> stream = device->create_stream();
  std::unique_ptr<engine::DeviceMath> math = engine::make_cpu_device_math({}, 1);
};

TEST(QuantizedGather, EveryRankGetsEveryShardDecodedFromItsCodes) {
  Rig rig;
  const int n = rig.world->size(), me = rig.world->rank();
  for (DType dtype : {DType::f32, DType::bf16}) {
    CountingCommunicator comm(*rig.world);
    GatherPlan plan;
    plan.quant_gather_codes = static_cast<std::size_t>(n) * quantized_bytes(QuantBits::int8, kPiece);
    engine::QuantizedGather gather(*rig.device, comm, *rig.math, plan, dtype);
    const std::size_t bytes = kPiece * dtype_size(dtype);
    std::vector<std::byte> full(static_cast<std::size_t>(n) * bytes);
    const std::vector<std::byte> own = fill(me, kPiece, dtype);
    std::memcpy(full.data() + static_cast<std::size_t>(me) * bytes, own.data(), bytes);  // in place
    gather.all_gather(full.data() + static_cast<std::size_t>(me) * bytes, full.data(), kPiece, *rig.stream);
    rig.stream->synchronize();
    HostCodec codec;
    for (int r = 0; r < n; ++r) {
      const std::vector<std::byte> shard = fill(r, kPiece, dtype);
      const std::vector<float> want = codec.round_trip(shard.data(), dtype, kPiece, QuantBits::int8);
      for (std::size_t i = 0; i < kPiece; ++i) {
        const float got = load_as_float(full.data() + static_cast<std::size_t>(r) * bytes, dtype, i);
        std::vector<std::byte> rounded(dtype_size(dtype));
        store_from_float(rounded.data(), dtype, 0, want[i]);
        ASSERT_EQ(got, load_as_float(rounded.data(), dtype, 0))
            << dtype_name(dtype) << " rank " << r << " element " << i;
      }
    }
    const WireBytes sent = comm.sent();
    EXPECT_EQ(sent.total(), static_cast<std::uint64_t>(n - 1) * quantized_bytes(QuantBits::int8, kPiece));
    EXPECT_EQ(sent.total(), sent.of(Collective::all_gather));
  }
}

// What rank `target` receives from the two-level algorithm on hosts of `per_host`, written out on
// the host: each host's sum of the target's piece over its ranks (decoded codes, in place order),
// then the sum of those sums' decoded codes over hosts (in host order).
std::vector<float> two_level_sum(int ranks, int per_host, int target, DType dtype, QuantBits bits) {
  HostCodec codec;
  const int hosts = ranks / per_host;
  std::vector<float> total(kPiece, 0.0f);
  for (int k = 0; k < hosts; ++k) {
    std::vector<float> host_sum(kPiece, 0.0f);
    for (int j = 0; j < per_host; ++j) {
      const std::vector<std::byte> piece =
          fill(k * per_host + j, kPiece, dtype, static_cast<std::size_t>(target) * kPiece);
      const std::vector<float> decoded = codec.round_trip(piece.data(), dtype, kPiece, bits);
      for (std::size_t i = 0; i < kPiece; ++i) host_sum[i] += decoded[i];
    }
    if (hosts == 1) return host_sum;
    const std::vector<float> decoded = codec.round_trip(host_sum.data(), DType::f32, kPiece, bits);
    for (std::size_t i = 0; i < kPiece; ++i) total[i] += decoded[i];
  }
  return total;
}

TEST(QuantizedReduceScatter, TheTwoLevelSumBitForBitOnEveryHostShape) {
  Rig rig;
  const int n = rig.world->size(), me = rig.world->rank();
  for (int per_host : {1, 2, 4}) {
    if (n % per_host != 0) continue;
    SimulatedHosts hosts(*rig.world, *rig.device, per_host);
    auto across_inner = hosts.split_across_hosts();
    CountingCommunicator across(*across_inner);
    auto host_inner = hosts.split_by_host();
    CountingCommunicator host_counted(*host_inner);
    const int host_count = n / per_host;
    for (QuantBits bits : {QuantBits::int8, QuantBits::int4})
      for (DType dtype : {DType::f32, DType::bf16}) {
        ReducePlan plan;
        plan.quant_reduce_piece = kPiece;
        plan.quant_reduce_codes = static_cast<std::size_t>(n) * quantized_bytes(bits, kPiece);
        plan.quant_reduce_sums = static_cast<std::size_t>(host_count) * kPiece * sizeof(float);
        engine::QuantizedReduceScatter reduce(*rig.device, hosts, host_counted, host_count > 1 ? &across : nullptr,
                                              *rig.math, plan, bits, dtype);
        const WireBytes before = host_counted.sent() + across.sent();
        const std::vector<std::byte> send = fill(me, static_cast<std::size_t>(n) * kPiece, dtype);
        std::vector<std::byte> recv(kPiece * dtype_size(dtype));
        reduce.reduce_scatter(send.data(), recv.data(), kPiece, *rig.stream);
        rig.stream->synchronize();
        const std::vector<float> want = two_level_sum(n, per_host, me, dtype, bits);
        const float qmax = static_cast<float>(optim::quant_max(bits));
        for (std::size_t i = 0; i < kPiece; ++i) {
          std::vector<std::byte> rounded(dtype_size(dtype));
          store_from_float(rounded.data(), dtype, 0, want[i]);
          ASSERT_EQ(load_as_float(recv.data(), dtype, i), load_as_float(rounded.data(), dtype, 0))
              << "hosts of " << per_host << ", int" << static_cast<int>(bits) << ", " << dtype_name(dtype)
              << ", element " << i;
          double exact = 0, largest = 0;
          for (int r = 0; r < n; ++r) {
            exact += value(r, static_cast<std::size_t>(me) * kPiece + i);
            largest =
                std::max(largest, std::fabs(static_cast<double>(value(r, static_cast<std::size_t>(me) * kPiece + i))));
          }
          // Each value within half a step of its block's scale (at most 2.6 / qmax here), twice.
          EXPECT_NEAR(load_as_float(recv.data(), dtype, i), exact, 2.0 * n * 2.6 / qmax + 0.02 * std::fabs(exact))
              << "element " << i;
        }
        const WireBytes sent = (host_counted.sent() + across.sent()) - before;
        const std::uint64_t codes = quantized_bytes(bits, kPiece);
        EXPECT_EQ(sent.inside(), static_cast<std::uint64_t>((per_host - 1) * host_count) * codes);
        EXPECT_EQ(sent.across(), static_cast<std::uint64_t>(host_count - 1) * codes);
        EXPECT_EQ(sent.total(), sent.of(Collective::all_to_all));
      }
  }
}

using namespace reference_training;

// Many one-tensor groups of 512 to 640 elements (shards of partial blocks at 4 ranks).
std::vector<ParamSpec> layers() {
  std::vector<ParamSpec> specs;
  for (int g = 0; g < 32; ++g)
    specs.push_back({"layer" + std::to_string(g), {512 + 64 * static_cast<std::size_t>(g % 3)}, g});
  return specs;
}

// The root mean square of (got - want) / max(1, |want|) over every element. Adam moves an element
// whose gradient is under its block's quantization step by up to lr a step in a direction the codes
// decide, so the largest error says little; the typical one says whether the reduction is right.
double rms_relative_error(const std::vector<std::vector<float>>& got, const std::vector<std::vector<double>>& want) {
  double sum = 0;
  std::size_t count = 0;
  for (std::size_t t = 0; t < want.size(); ++t)
    for (std::size_t j = 0; j < want[t].size(); ++j) {
      const double e = (got[t][j] - want[t][j]) / std::max(1.0, std::fabs(want[t][j]));
      sum += e * e;
      ++count;
    }
  return std::sqrt(sum / static_cast<double>(count));
}

struct Trained {
  std::vector<std::vector<float>> params;
  EngineStats stats;
};

Trained train(Options o, Communicator& comm, Device& device) {
  Trained run;
  run.params = train_engine(o, 3, device, comm, &run.stats);
  return run;
}

// Stage 3 on hosts of two (one host at np2, two at np4), 2 micro-batches, one group per reduction
// (buckets.reduce below two groups) so every piece is one group's shard: qwZ + qgZ (int8) with and
// without hpZ against plain stage 3 and the reference.
TEST(QuantizedEngine, Stage3TrainsNearTheReferenceAndSendsTheEstimatedBytes) {
  MpiSession session;
  auto device = make_cpu_device(std::size_t{256} << 20);
  auto world = make_mpi_communicator(session, *device);
  const int n = world->size();
  const int per_host = n % 2 == 0 ? 2 : 1;
  SimulatedHosts comm(*world, *device, per_host);
  Options o;
  o.stage = 3;
  o.specs = layers();
  o.max_live = 1;
  o.accumulation = 2;
  o.reduce_bucket = 600 * sizeof(float);
  const Trained plain = train(o, comm, *device);
  o.quantize_params = QuantizeParams::int8;
  o.quantize_grads = QuantizeGrads::int8;
  for (bool secondary : {false, true}) {
    o.secondary_host = secondary;
    const Trained q = train(o, comm, *device);
    const auto reference = train_reference(o, 3);
    EXPECT_LT(rms_relative_error(q.params, reference), 2e-3) << "secondary " << secondary;
    if (n > 1) {
      EXPECT_NE(q.params, plain.params) << "the quantized run equals the exact one: nothing was quantized";
    }
    const Config config = make_config(o);
    const WireEstimate want = estimate_wire_bytes(config, o.specs, n, per_host);
    const WireBytes& sent = q.stats.wire_last_step;
    const auto floats = 2 * sizeof(float) * static_cast<std::uint64_t>(n);  // step()'s all-reduce
    EXPECT_GE(sent.across(), want.across) << "secondary " << secondary;
    EXPECT_LE(sent.across(), want.across + floats) << "secondary " << secondary;
    EXPECT_GE(sent.total(), want.total()) << "secondary " << secondary;
    EXPECT_LE(sent.total(), want.total() + floats) << "secondary " << secondary;
    if (n == 4) {
      EXPECT_LE(static_cast<double>(sent.across()), 0.3 * static_cast<double>(plain.stats.wire_last_step.across()))
          << "secondary " << secondary;
    }
    const MemoryEstimate memory = estimate_memory(config, o.specs, n, per_host);
    EXPECT_EQ(q.stats.memory.peak_of(MemoryCategory::buffers), memory.device_of(MemoryCategory::buffers));
  }
}

// qgZ at stages 1 and 2 with buckets of many groups (pieces of several shards), int4 and int8.
TEST(QuantizedEngine, Stages1And2ReduceQuantizedInBuckets) {
  MpiSession session;
  auto device = make_cpu_device(std::size_t{256} << 20);
  auto world = make_mpi_communicator(session, *device);
  const int n = world->size();
  SimulatedHosts comm(*world, *device, n % 2 == 0 ? 2 : 1);
  for (int stage : {1, 2})
    for (QuantizeGrads grads : {QuantizeGrads::int8, QuantizeGrads::int4}) {
      Options o;
      o.stage = stage;
      o.specs = layers();
      o.quantize_grads = grads;
      const Trained q = train(o, comm, *device);
      const auto want = train_reference(o, 3);
      EXPECT_LT(rms_relative_error(q.params, want), grads == QuantizeGrads::int8 ? 2e-3 : 1e-2) << "stage " << stage;
      if (n > 1) {
        EXPECT_GT(q.stats.wire_last_step.of(Collective::all_to_all), 0u);
      }
      EXPECT_EQ(q.stats.wire_last_step.of(Collective::reduce_scatter), 0u);
    }
}

// Ranks that disagree on either key (their collectives would differ in size) are refused on every
// rank, naming the key, before anything is split or sent.
TEST(QuantizedEngine, RanksThatDisagreeAreRefusedNamingTheKey) {
  MpiSession session;
  if (session.size() < 2) GTEST_SKIP() << "ranks can disagree only with two or more; this run has " << session.size();
  auto device = make_cpu_device(std::size_t{64} << 20);
  auto world = make_mpi_communicator(session, *device);
  SimulatedHosts comm(*world, *device, session.size() % 2 == 0 ? 2 : 1);
  for (const char* key : {"comm.quantize.params", "comm.quantize.grads"}) {
    Options o;
    o.stage = 3;
    o.specs = layers();
    const bool first = comm.rank() == 0;
    if (std::string(key) == "comm.quantize.params")
      o.quantize_params = first ? QuantizeParams::int8 : QuantizeParams::none;
    else o.quantize_grads = first ? QuantizeGrads::int4 : QuantizeGrads::int8;
    try {
      Engine engine(make_config(o), *device, comm, o.specs);
      ADD_FAILURE() << key << " set differently on rank 0 was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(std::string(key) + " differs between ranks"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace zest
