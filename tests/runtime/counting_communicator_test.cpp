// CountingCommunicator: every call reaches the communicator it wraps, and the bytes it counts are
// the pairwise model's (zest/communicator.hpp), split by Communicator::host_of. A stand-in
// communicator plays rank 1 of 4 on two hosts ({0, 1} and {2, 3}) and records what it was asked.
#include "runtime/comm/counting_communicator.hpp"

#include <gtest/gtest.h>

#include <array>
#include <cstdint>
#include <memory>
#include <vector>

#include "silent_communicator.hpp"
#include "zest/device.hpp"
#include "zest/error.hpp"

namespace zest {
namespace {

// Rank 1 of 4 on two hosts; records each collective's count.
class TwoHosts final : public test::SilentCommunicator {
 public:
  TwoHosts() : SilentCommunicator(1, 4, "two hosts") {}
  int host_of(int rank) const override { return rank / 2; }
  void all_reduce(const void*, void*, std::size_t count, DType, ReduceOp, Stream&) override { calls.push_back(count); }
  void reduce_scatter(const void*, void*, std::size_t count, DType, ReduceOp, Stream&) override {
    calls.push_back(count);
  }
  void all_gather(const void*, void*, std::size_t count, DType, Stream&) override { calls.push_back(count); }
  void all_to_all(const void*, void*, std::size_t count, DType, Stream&) override { calls.push_back(count); }
  void broadcast(void*, std::size_t count, DType, int, Stream&) override { calls.push_back(count); }
  void all_reduce_host(std::span<double> values, ReduceOp) override { calls.push_back(values.size()); }
  void all_reduce_host(std::span<std::int64_t> values, ReduceOp) override { calls.push_back(values.size()); }
  // Records the split; the caller gets no communicator (none is needed to see the forwarding).
  std::unique_ptr<Communicator> split_across_hosts() override {
    ++splits_across;
    return nullptr;
  }
  std::vector<std::size_t> calls;
  int splits_across = 0;
};

std::uint64_t inside(const WireBytes& w, Collective c) { return w.inside_host[static_cast<std::size_t>(c)]; }
std::uint64_t across(const WireBytes& w, Collective c) { return w.across_hosts[static_cast<std::size_t>(c)]; }

TEST(CountingCommunicator, CountsWhatEachRankSendsInsideAndAcrossHosts) {
  auto device = make_cpu_device(std::size_t{1} << 20);
  auto stream = device->create_stream();
  TwoHosts inner;
  CountingCommunicator comm(inner);
  EXPECT_EQ(comm.host_of(3), 1);
  EXPECT_EQ(comm.size(), 4);

  // Reduce-scatter of 100 fp32 per rank: 400 bytes to each peer; one peer on this host, two across.
  comm.reduce_scatter(nullptr, nullptr, 100, DType::f32, ReduceOp::sum, *stream);
  // All-gather of 10 bf16: 20 bytes to each peer.
  comm.all_gather(nullptr, nullptr, 10, DType::bf16, *stream);
  // All-reduce of 10 fp32: blocks of 3, 3, 2, 2 elements. Rank 1 sends peer r block r and its own
  // (3): rank 0 (this host) 3 + 3, ranks 2 and 3 (across) 2 + 3 each.
  comm.all_reduce(nullptr, nullptr, 10, DType::f32, ReduceOp::sum, *stream);
  // A broadcast from another root sends nothing; from this rank, its buffer to every peer.
  comm.broadcast(nullptr, 5, DType::f32, 0, *stream);
  comm.broadcast(nullptr, 5, DType::f32, 1, *stream);
  // Host scalars count as an all-reduce: 2 int64 (blocks 1, 1, 0, 0).
  std::array<std::int64_t, 2> values{};
  comm.all_reduce_host(values, ReduceOp::sum);
  // All-to-all of 6 fp16 per block: 12 bytes to each peer, its own block to none.
  comm.all_to_all(nullptr, nullptr, 6, DType::f16, *stream);

  EXPECT_EQ(inner.calls, (std::vector<std::size_t>{100, 10, 10, 5, 5, 2, 6}));
  const WireBytes w = comm.sent();
  EXPECT_EQ(inside(w, Collective::reduce_scatter), 400u);
  EXPECT_EQ(across(w, Collective::reduce_scatter), 800u);
  EXPECT_EQ(inside(w, Collective::all_gather), 20u);
  EXPECT_EQ(across(w, Collective::all_gather), 40u);
  EXPECT_EQ(inside(w, Collective::all_reduce), (3u + 3u) * 4 + (1u + 1u) * 8);
  EXPECT_EQ(across(w, Collective::all_reduce), 2 * (2u + 3u) * 4 + 2 * (0u + 1u) * 8);
  EXPECT_EQ(inside(w, Collective::broadcast), 20u);
  EXPECT_EQ(across(w, Collective::broadcast), 40u);
  EXPECT_EQ(inside(w, Collective::all_to_all), 12u);
  EXPECT_EQ(across(w, Collective::all_to_all), 24u);
  EXPECT_EQ(w.total(), w.inside() + w.across());
  EXPECT_EQ(w.of(Collective::reduce_scatter), 1200u);
  const WireBytes later = comm.sent();
  EXPECT_EQ((later - w).total(), 0u);
}

// The splits reach the inner communicator and move no bytes of this one's.
TEST(CountingCommunicator, ForwardsTheSplitAcrossHostsUncounted) {
  TwoHosts inner;
  CountingCommunicator comm(inner);
  EXPECT_EQ(comm.split_across_hosts(), nullptr);
  EXPECT_EQ(inner.splits_across, 1);
  EXPECT_EQ(comm.sent().total(), 0u);
  EXPECT_TRUE(inner.calls.empty());
}

}  // namespace
}  // namespace zest
