// The exact shard collectives pass each call to the communicator as it is (the counts, the working
// dtype, a sum), so that a part holding a ShardGather or ShardReduceScatter sends what it sent
// when it called the communicator itself. A stand-in communicator records the calls.
#include "engine/collectives/shard_collectives.hpp"

#include <gtest/gtest.h>

#include <string>
#include <type_traits>
#include <vector>

#include "engine/collectives/quantized_collectives.hpp"
#include "silent_communicator.hpp"

namespace zest::engine {
namespace {

static_assert(std::is_base_of_v<ShardGather, QuantizedGather>);
static_assert(std::is_base_of_v<ShardReduceScatter, QuantizedReduceScatter>);

struct Call {
  std::string kind;
  const void* send = nullptr;
  void* recv = nullptr;
  std::size_t count = 0;
  DType dtype = DType::f32;
  ReduceOp op = ReduceOp::sum;
  bool operator==(const Call&) const = default;
};

// Rank 1 of 4; records each device collective.
class Recording final : public test::SilentCommunicator {
 public:
  Recording() : SilentCommunicator(1, 4, "recording") {}
  void all_reduce(const void*, void*, std::size_t, DType, ReduceOp, Stream&) override {
    calls.push_back(Call{"other"});
  }
  void reduce_scatter(const void* send, void* recv, std::size_t count, DType dtype, ReduceOp op, Stream&) override {
    calls.push_back({"reduce_scatter", send, recv, count, dtype, op});
  }
  void all_gather(const void* send, void* recv, std::size_t count, DType dtype, Stream&) override {
    calls.push_back({"all_gather", send, recv, count, dtype, ReduceOp::sum});
  }
  void all_to_all(const void*, void*, std::size_t, DType, Stream&) override { calls.push_back(Call{"other"}); }
  void broadcast(void*, std::size_t, DType, int, Stream&) override { calls.push_back(Call{"other"}); }
  std::vector<Call> calls;
};

TEST(ShardCollectives, TheExactOnesAreTheCommunicatorsCollectivesInTheWorkingDtype) {
  auto device = make_cpu_device(std::size_t{1} << 20);
  auto stream = device->create_stream();
  Recording comm;
  char buffer[64];
  ExactGather gather(comm, DType::bf16);
  ExactReduceScatter reduce_scatter(comm, DType::f16);
  ShardGather& any_gather = gather;
  ShardReduceScatter& any_reduce_scatter = reduce_scatter;
  any_gather.all_gather(buffer + 8, buffer, 4, *stream);
  any_reduce_scatter.reduce_scatter(buffer, buffer + 16, 8, *stream);
  const std::vector<Call> expected = {{"all_gather", buffer + 8, buffer, 4, DType::bf16, ReduceOp::sum},
                                      {"reduce_scatter", buffer, buffer + 16, 8, DType::f16, ReduceOp::sum}};
  EXPECT_EQ(comm.calls, expected);
}

}  // namespace
}  // namespace zest::engine
