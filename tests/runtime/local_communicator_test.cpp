// The local communicator (a world of one, builds without MPI): each collective over one rank is
// the identity, carried out as a copy on the caller's stream; misuse raises CommError as on the
// other backends.
#include "runtime/comm/local_communicator.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include "zest/error.hpp"

namespace zest {
namespace {

class LocalCommunicatorTest : public testing::Test {
 protected:
  std::unique_ptr<Device> device_ = make_cpu_device(1 << 20);
  std::unique_ptr<Communicator> comm_ = make_local_communicator(*device_);
  std::unique_ptr<Stream> stream_ = device_->create_stream();

  static std::vector<float> iota(std::size_t n, float first) {
    std::vector<float> values(n);
    std::iota(values.begin(), values.end(), first);
    return values;
  }
};

TEST_F(LocalCommunicatorTest, IsRankZeroOfOne) {
  EXPECT_EQ(comm_->rank(), 0);
  EXPECT_EQ(comm_->size(), 1);
  EXPECT_EQ(comm_->backend_name(), "local");
}

TEST_F(LocalCommunicatorTest, EveryCollectiveDeliversThisRanksDataOnTheStream) {
  const std::vector<float> send = iota(1001, 1.0f);
  std::vector<float> reduced(1001, -1.0f), scattered(1001, -1.0f), gathered(1001, -1.0f);
  comm_->all_reduce(send.data(), reduced.data(), send.size(), DType::f32, ReduceOp::sum, *stream_);
  comm_->reduce_scatter(send.data(), scattered.data(), send.size(), DType::f32, ReduceOp::max,
                        *stream_);
  comm_->all_gather(send.data(), gathered.data(), send.size(), DType::f32, *stream_);
  stream_->synchronize();
  EXPECT_EQ(reduced, send);
  EXPECT_EQ(scattered, send);
  EXPECT_EQ(gathered, send);
}

// The one block of an all-to-all is this rank's own: a copy. It has no in-place form, so any
// overlap, the same buffer included, is refused as on the other backends.
TEST_F(LocalCommunicatorTest, AllToAllCopiesTheOneBlockAndRefusesOverlap) {
  const std::vector<float> send = iota(257, -3.0f);
  std::vector<float> recv(257, -1.0f);
  comm_->all_to_all(send.data(), recv.data(), send.size(), DType::f32, *stream_);
  stream_->synchronize();
  EXPECT_EQ(recv, send);
  // 2-byte elements: the count is elements, not bytes.
  std::vector<std::uint16_t> half_send(9, 0x3c00), half_recv(9, 0);
  comm_->all_to_all(half_send.data(), half_recv.data(), 9, DType::bf16, *stream_);
  stream_->synchronize();
  EXPECT_EQ(half_recv, half_send);

  std::vector<float> buffer(64);
  try {
    comm_->all_to_all(buffer.data(), buffer.data(), 16, DType::f32, *stream_);
    ADD_FAILURE() << "all_to_all in place was accepted";
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find("all_to_all: send and recv overlap"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("pass separate buffers"), std::string::npos) << e.what();
  }
  EXPECT_THROW(comm_->all_to_all(buffer.data(), buffer.data() + 8, 16, DType::f32, *stream_), CommError);
  EXPECT_THROW(comm_->all_to_all(nullptr, buffer.data(), 16, DType::f32, *stream_), CommError);
  EXPECT_NO_THROW(comm_->all_to_all(nullptr, nullptr, 0, DType::f32, *stream_));
  stream_->synchronize();
}

TEST_F(LocalCommunicatorTest, InPlaceAndBroadcastLeaveTheBufferAsItIs) {
  std::vector<float> buffer = iota(64, 3.0f);
  const std::vector<float> before = buffer;
  comm_->all_reduce(buffer.data(), buffer.data(), buffer.size(), DType::f32, ReduceOp::sum, *stream_);
  comm_->broadcast(buffer.data(), buffer.size(), DType::f32, 0, *stream_);
  stream_->synchronize();
  EXPECT_EQ(buffer, before);
}

TEST_F(LocalCommunicatorTest, HostScalarsStayTheirOwnReduction) {
  std::vector<double> loss = {2.5, -1.0};
  std::vector<std::int64_t> tokens = {4096, 7};
  comm_->all_reduce_host(loss, ReduceOp::sum);
  comm_->all_reduce_host(tokens, ReduceOp::max);
  comm_->barrier();
  EXPECT_EQ(loss, (std::vector<double>{2.5, -1.0}));
  EXPECT_EQ(tokens, (std::vector<std::int64_t>{4096, 7}));
}

TEST_F(LocalCommunicatorTest, RejectsMisuseAsTheOtherBackendsDo) {
  std::vector<float> buffer(64);
  EXPECT_THROW(comm_->broadcast(buffer.data(), 16, DType::f32, 1, *stream_), CommError);
  EXPECT_THROW(comm_->all_reduce(nullptr, buffer.data(), 16, DType::f32, ReduceOp::sum, *stream_),
               CommError);
  // Overlapping but not the same buffer: not a valid in-place call.
  EXPECT_THROW(
      comm_->all_gather(buffer.data(), buffer.data() + 1, 16, DType::f32, *stream_), CommError);
  EXPECT_THROW(comm_->all_reduce_host(std::span<double>(static_cast<double*>(nullptr), 3),
                                      ReduceOp::sum),
               CommError);
  stream_->synchronize();
}

}  // namespace
}  // namespace zest
