// EngineComms: which communicators a config gets (the host's ranks for hpZ and qgZ, the ranks of a
// place across hosts for qgZ on several hosts), the configs refused (unequal hosts, a backend that
// returns no communicator), and the bytes counted over all of them, per step. A stand-in
// communicator plays one rank of a world cut into hosts; nothing crosses a wire.
#include "engine/collectives/comm_levels.hpp"

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "silent_communicator.hpp"
#include "zest/device.hpp"
#include "zest/error.hpp"

namespace zest::engine {
namespace {

// Rank `rank` of a world whose rank r sits on host hosts[r] (silent: collectives move nothing, the
// host all-reduces leave the values as if every rank held this one's).
class StandIn final : public test::SilentCommunicator {
 public:
  StandIn(int rank, std::vector<int> hosts)
      : SilentCommunicator(rank, static_cast<int>(hosts.size()), "stand-in"), hosts_(std::move(hosts)) {}
  int host_of(int rank) const override { return hosts_[static_cast<std::size_t>(rank)]; }
  // This rank's host: its ranks, in order, on one host. Across: one rank per host.
  std::unique_ptr<Communicator> split_by_host() override {
    ++splits;
    if (refuse_splits) return nullptr;
    int mine = 0, ranks = 0;
    for (int r = 0; r < size(); ++r) {
      if (host_of(r) != host_of(rank())) continue;
      if (r == rank()) mine = ranks;
      ++ranks;
    }
    return std::make_unique<StandIn>(mine, std::vector<int>(static_cast<std::size_t>(ranks), 0));
  }
  std::unique_ptr<Communicator> split_across_hosts() override {
    ++splits;
    if (refuse_splits) return nullptr;
    std::vector<int> each_own;
    for (int r = 0; r < size(); ++r)
      if (host_of(r) != (r ? host_of(r - 1) : -1)) each_own.push_back(static_cast<int>(each_own.size()));
    return std::make_unique<StandIn>(host_of(rank()), std::move(each_own));
  }
  int splits = 0;
  bool refuse_splits = false;

 private:
  std::vector<int> hosts_;
};

Config stage3(SecondaryPartition secondary, QuantizeGrads grads) {
  Config c;
  c.stage = 3;
  c.partition.secondary = secondary;
  c.comm.quantize.grads = grads;
  return c;
}

std::string error_of(const Config& c, StandIn& world) {
  try {
    EngineComms comms(c, world, {}, "Engine");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(EngineComms, APlainConfigSplitsNothing) {
  StandIn world(1, {0, 0, 1, 1});
  EngineComms comms(stage3(SecondaryPartition::none, QuantizeGrads::none), world, {}, "Engine");
  EXPECT_EQ(comms.host(), nullptr);
  EXPECT_EQ(comms.across(), nullptr);
  EXPECT_EQ(comms.host_size(), 0);
  EXPECT_EQ(world.splits, 0);
  EXPECT_EQ(comms.world().size(), 4);
}

TEST(EngineComms, OneRankSplitsNothingWhateverTheConfig) {
  StandIn world(0, {0});
  EngineComms comms(stage3(SecondaryPartition::host, QuantizeGrads::int8), world, {}, "Engine");
  EXPECT_EQ(comms.host(), nullptr);
  EXPECT_EQ(world.splits, 0);
}

TEST(EngineComms, TheHostSecondaryGetsTheHostsRanksOnly) {
  StandIn world(3, {0, 0, 1, 1});
  EngineComms comms(stage3(SecondaryPartition::host, QuantizeGrads::none), world, {}, "Engine");
  ASSERT_NE(comms.host(), nullptr);
  EXPECT_EQ(comms.host()->size(), 2);
  EXPECT_EQ(comms.host()->rank(), 1);
  EXPECT_EQ(comms.host_size(), 2);
  EXPECT_EQ(comms.across(), nullptr);
}

TEST(EngineComms, QuantizedGradientsGetAPlaceAcrossHostsWhereThereAreSeveral) {
  StandIn two_hosts(2, {0, 0, 1, 1});
  EngineComms comms(stage3(SecondaryPartition::none, QuantizeGrads::int4), two_hosts, {}, "Engine");
  ASSERT_NE(comms.host(), nullptr);
  ASSERT_NE(comms.across(), nullptr);
  EXPECT_EQ(comms.across()->size(), 2);
  EXPECT_EQ(comms.across()->rank(), 1);

  StandIn one_host(2, {0, 0, 0, 0});
  EngineComms alone(stage3(SecondaryPartition::none, QuantizeGrads::int8), one_host, {}, "Engine");
  ASSERT_NE(alone.host(), nullptr);
  EXPECT_EQ(alone.host()->size(), 4);
  EXPECT_EQ(alone.across(), nullptr);
}

TEST(EngineComms, UnequalHostsAreRefusedNamingTheKeysToTurnOff) {
  StandIn world(0, {0, 0, 0, 1});
  const std::string both = error_of(stage3(SecondaryPartition::host, QuantizeGrads::int8), world);
  EXPECT_NE(both.find("host 0 has 3 and host 1 has 1"), std::string::npos) << both;
  EXPECT_NE(both.find("partition.secondary: none and comm.quantize.grads: none"), std::string::npos) << both;
  const std::string one = error_of(stage3(SecondaryPartition::host, QuantizeGrads::none), world);
  EXPECT_NE(one.find("or set partition.secondary: none"), std::string::npos) << one;
  EXPECT_EQ(one.find("comm.quantize"), std::string::npos) << one;
  EXPECT_EQ(world.splits, 0);
}

TEST(EngineComms, ABackendThatReturnsNoCommunicatorIsNamed) {
  StandIn world(0, {0, 0, 1, 1});
  world.refuse_splits = true;
  const std::string message = error_of(stage3(SecondaryPartition::host, QuantizeGrads::none), world);
  EXPECT_NE(message.find("the stand-in communicator's split_by_host returned nothing"), std::string::npos) << message;
}

TEST(EngineComms, SentCountsEveryLevelAndEachStepItsOwnShare) {
  auto device = make_cpu_device(std::size_t{1} << 20);
  auto stream = device->create_stream();
  StandIn world(0, {0, 0, 1, 1});
  EngineComms comms(stage3(SecondaryPartition::none, QuantizeGrads::int8), world, {}, "Engine");
  // All-gathers of 8 fp32: 32 bytes to each peer. World: one peer on this host, two across;
  // the host: one peer inside; across hosts: one peer, on another host.
  comms.world().all_gather(nullptr, nullptr, 8, DType::f32, *stream);
  comms.host()->all_gather(nullptr, nullptr, 8, DType::f32, *stream);
  comms.across()->all_gather(nullptr, nullptr, 8, DType::f32, *stream);
  EXPECT_EQ(comms.sent().inside(), 32u + 32u);
  EXPECT_EQ(comms.sent().across(), 64u + 32u);
  EXPECT_EQ(comms.last_step().total(), 0u);
  comms.end_step();
  EXPECT_EQ(comms.last_step().total(), 160u);
  comms.across()->all_gather(nullptr, nullptr, 2, DType::bf16, *stream);
  comms.end_step();
  EXPECT_EQ(comms.last_step().total(), 4u);
  EXPECT_EQ(comms.sent().total(), 164u);
}

}  // namespace
}  // namespace zest::engine
