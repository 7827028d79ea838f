// The NCCL communicator: every collective in every dtype and op, at odd sizes, against values
// computed here from each rank's known inputs; host scalars; a communicator over the program's own
// ncclComm_t. Runs as one rank (with or without MPI) or under mpirun with one rank per GPU; skips,
// saying so, where no GPU is visible or there are more ranks than GPUs on a host.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "runtime/host/half.hpp"
#include "runtime/comm/nccl_communicator.hpp"
#include "runtime/comm/world.hpp"
#include "zest/communicator.hpp"
#include "zest/device.hpp"
#include "zest/error.hpp"
#include "zest/nccl.hpp"

namespace zest {
namespace {

constexpr DType kDTypes[] = {DType::f32, DType::f16, DType::bf16};
constexpr std::size_t kCounts[] = {1, 1023, 65537};

// Small integers: every sum and max over up to 51 ranks is exact in bf16, so each result has one
// right answer whatever order NCCL reduces in.
float input(int rank, std::size_t index) {
  return static_cast<float>((static_cast<std::size_t>(rank) + index) % 5 + 1);
}

std::vector<unsigned char> encode(const std::vector<float>& values, DType dtype) {
  std::vector<unsigned char> bytes(values.size() * dtype_size(dtype));
  for (std::size_t i = 0; i < values.size(); ++i) store_from_float(bytes.data(), dtype, i, values[i]);
  return bytes;
}

std::vector<float> decode(const std::vector<unsigned char>& bytes, DType dtype) {
  std::vector<float> values(bytes.size() / dtype_size(dtype));
  for (std::size_t i = 0; i < values.size(); ++i) values[i] = load_as_float(bytes.data(), dtype, i);
  return values;
}

float reduce_inputs(ReduceOp op, int ranks, std::size_t index) {
  float result = op == ReduceOp::sum ? 0.0f : input(0, index);
  for (int r = 0; r < ranks; ++r) {
    result = op == ReduceOp::sum ? result + input(r, index) : std::max(result, input(r, index));
  }
  return result;
}

std::string label(const char* collective, DType dtype, std::size_t count) {
  return std::string(collective) + " " + std::string(dtype_name(dtype)) + " count " + std::to_string(count);
}

// One world, device and communicator for the whole suite: NCCL's bootstrap is the slow part.
class NcclCommunicatorTest : public testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!cuda_device_available()) {
      skip_reason_ = new std::string("no CUDA GPU: cudaGetDeviceCount finds none, so NCCL is not run");
      return;
    }
    world_ = make_world().release();
    int gpus = 0;
    if (cudaGetDeviceCount(&gpus) != cudaSuccess || world_->local_size() > gpus) {
      skip_reason_ = new std::string("no CUDA GPU for every rank: " +
                                     std::to_string(world_->local_size()) + " ranks on this host, " +
                                     std::to_string(gpus) + " GPUs; NCCL needs one GPU per rank");
      return;
    }
    try {
      device_ = make_cuda_device(world_->local_rank(), 0).release();
      comm_ = world_->make_nccl_communicator(*device_).release();
    } catch (const std::exception& error) {
      setup_error_ = new std::string(error.what());
    }
  }

  static void TearDownTestSuite() {
    delete comm_;
    delete device_;
    delete world_;
    delete skip_reason_;
    delete setup_error_;
    setup_error_ = nullptr;
    comm_ = nullptr;
    device_ = nullptr;
    world_ = nullptr;
    skip_reason_ = nullptr;
  }

  void SetUp() override {
    if (skip_reason_ != nullptr) GTEST_SKIP() << *skip_reason_;
    if (setup_error_ != nullptr) GTEST_FAIL() << "starting the communicator failed: " << *setup_error_;
    stream_ = device_->create_stream();
  }

  DeviceBuffer to_device(const std::vector<unsigned char>& bytes, std::size_t capacity) {
    DeviceBuffer buffer = device_->allocate(capacity, MemoryCategory::buffers);
    device_->memset_async(buffer.data(), 0xee, capacity, *stream_);
    device_->copy_async(buffer.data(), bytes.data(), bytes.size(), *stream_);
    stream_->synchronize();
    return buffer;
  }

  std::vector<unsigned char> to_host(const DeviceBuffer& buffer, std::size_t bytes) {
    std::vector<unsigned char> host(bytes);
    device_->copy_async(host.data(), buffer.data(), bytes, *stream_);
    stream_->synchronize();
    return host;
  }

  std::vector<float> my_inputs(std::size_t count) const {
    std::vector<float> values(count);
    for (std::size_t i = 0; i < count; ++i) values[i] = input(comm_->rank(), i);
    return values;
  }

  static std::string* skip_reason_;
  static std::string* setup_error_;
  static World* world_;
  static Device* device_;
  static Communicator* comm_;
  std::unique_ptr<Stream> stream_;
};

std::string* NcclCommunicatorTest::skip_reason_ = nullptr;
std::string* NcclCommunicatorTest::setup_error_ = nullptr;
World* NcclCommunicatorTest::world_ = nullptr;
Device* NcclCommunicatorTest::device_ = nullptr;
Communicator* NcclCommunicatorTest::comm_ = nullptr;

TEST_F(NcclCommunicatorTest, KnowsItsPlaceInTheWorld) {
  EXPECT_EQ(comm_->rank(), world_->rank());
  EXPECT_EQ(comm_->size(), world_->size());
  EXPECT_EQ(comm_->backend_name(), "nccl");
}

TEST_F(NcclCommunicatorTest, AllReduceEveryDtypeAndOp) {
  const int ranks = comm_->size();
  for (const DType dtype : kDTypes) {
    for (const ReduceOp op : {ReduceOp::sum, ReduceOp::max}) {
      for (const std::size_t count : kCounts) {
        const std::size_t bytes = count * dtype_size(dtype);
        const DeviceBuffer send = to_device(encode(my_inputs(count), dtype), bytes);
        const DeviceBuffer recv = to_device({}, bytes);
        comm_->all_reduce(send.data(), recv.data(), count, dtype, op, *stream_);
        const auto got = decode(to_host(recv, bytes), dtype);
        for (std::size_t i = 0; i < count; ++i) {
          ASSERT_EQ(got[i], reduce_inputs(op, ranks, i))
              << label("all_reduce", dtype, count) << (op == ReduceOp::sum ? " sum" : " max") << " at " << i;
        }
      }
    }
  }
}

TEST_F(NcclCommunicatorTest, AllReduceInPlace) {
  const int ranks = comm_->size();
  for (const DType dtype : kDTypes) {
    const std::size_t count = 4099;
    const std::size_t bytes = count * dtype_size(dtype);
    const DeviceBuffer buffer = to_device(encode(my_inputs(count), dtype), bytes);
    comm_->all_reduce(buffer.data(), buffer.data(), count, dtype, ReduceOp::sum, *stream_);
    const auto got = decode(to_host(buffer, bytes), dtype);
    for (std::size_t i = 0; i < count; ++i) {
      ASSERT_EQ(got[i], reduce_inputs(ReduceOp::sum, ranks, i)) << label("in-place all_reduce", dtype, count);
    }
  }
}

TEST_F(NcclCommunicatorTest, ReduceScatterEveryDtypeAndOp) {
  const int ranks = comm_->size();
  const auto rank = static_cast<std::size_t>(comm_->rank());
  for (const DType dtype : kDTypes) {
    for (const ReduceOp op : {ReduceOp::sum, ReduceOp::max}) {
      for (const std::size_t recv_count : kCounts) {
        const std::size_t total = recv_count * static_cast<std::size_t>(ranks);
        const DeviceBuffer send = to_device(encode(my_inputs(total), dtype), total * dtype_size(dtype));
        // One element more than the result, which must stay untouched.
        const std::size_t recv_bytes = recv_count * dtype_size(dtype);
        const DeviceBuffer recv = to_device({}, recv_bytes + dtype_size(dtype));
        comm_->reduce_scatter(send.data(), recv.data(), recv_count, dtype, op, *stream_);
        const auto host = to_host(recv, recv_bytes + dtype_size(dtype));
        const auto got = decode(
            std::vector<unsigned char>(host.begin(), host.begin() + static_cast<std::ptrdiff_t>(recv_bytes)), dtype);
        for (std::size_t j = 0; j < recv_count; ++j) {
          ASSERT_EQ(got[j], reduce_inputs(op, ranks, rank * recv_count + j))
              << label("reduce_scatter", dtype, recv_count) << " at " << j;
        }
        EXPECT_EQ(host.back(), 0xee) << label("reduce_scatter", dtype, recv_count) << " wrote past its block";
      }
    }
  }
}

TEST_F(NcclCommunicatorTest, AllGatherEveryDtype) {
  const int ranks = comm_->size();
  for (const DType dtype : kDTypes) {
    for (const std::size_t send_count : kCounts) {
      const std::size_t total = send_count * static_cast<std::size_t>(ranks);
      const DeviceBuffer send = to_device(encode(my_inputs(send_count), dtype), send_count * dtype_size(dtype));
      const DeviceBuffer recv = to_device({}, total * dtype_size(dtype));
      comm_->all_gather(send.data(), recv.data(), send_count, dtype, *stream_);
      const auto got = decode(to_host(recv, total * dtype_size(dtype)), dtype);
      for (int from = 0; from < ranks; ++from) {
        for (std::size_t j = 0; j < send_count; ++j) {
          ASSERT_EQ(got[static_cast<std::size_t>(from) * send_count + j], input(from, j))
              << label("all_gather", dtype, send_count) << " block " << from << " at " << j;
        }
      }
    }
  }
}

TEST_F(NcclCommunicatorTest, AllGatherInPlace) {
  const int ranks = comm_->size();
  const auto rank = static_cast<std::size_t>(comm_->rank());
  const std::size_t send_count = 777;
  const DType dtype = DType::bf16;
  const std::size_t size = dtype_size(dtype);
  std::vector<float> full(send_count * static_cast<std::size_t>(ranks), -1.0f);
  for (std::size_t j = 0; j < send_count; ++j) full[rank * send_count + j] = input(comm_->rank(), j);
  const DeviceBuffer buffer = to_device(encode(full, dtype), full.size() * size);
  comm_->all_gather(buffer.as<unsigned char>() + rank * send_count * size, buffer.data(), send_count, dtype,
                    *stream_);
  const auto got = decode(to_host(buffer, full.size() * size), dtype);
  for (int from = 0; from < ranks; ++from) {
    for (std::size_t j = 0; j < send_count; ++j) {
      ASSERT_EQ(got[static_cast<std::size_t>(from) * send_count + j], input(from, j)) << "block " << from;
    }
  }
}

// Element j of the block rank `from` sends rank `to`: small integers (exact in bf16) that differ
// between the blocks of different senders to one rank.
float block_value(int from, int to, std::size_t j) {
  return static_cast<float>((static_cast<std::size_t>(from) * 3 + static_cast<std::size_t>(to) * 5 + j) % 11 + 1);
}

TEST_F(NcclCommunicatorTest, AllToAllEveryDtype) {
  const int ranks = comm_->size();
  const int me = comm_->rank();
  for (const DType dtype : kDTypes) {
    for (const std::size_t count : kCounts) {
      const std::size_t total = count * static_cast<std::size_t>(ranks);
      std::vector<float> blocks(total);
      for (std::size_t i = 0; i < total; ++i) blocks[i] = block_value(me, static_cast<int>(i / count), i % count);
      const DeviceBuffer send = to_device(encode(blocks, dtype), total * dtype_size(dtype));
      const DeviceBuffer recv = to_device({}, total * dtype_size(dtype));
      comm_->all_to_all(send.data(), recv.data(), count, dtype, *stream_);
      const auto got = decode(to_host(recv, total * dtype_size(dtype)), dtype);
      for (int from = 0; from < ranks; ++from) {
        for (std::size_t j = 0; j < count; ++j) {
          ASSERT_EQ(got[static_cast<std::size_t>(from) * count + j], block_value(from, me, j))
              << label("all_to_all", dtype, count) << " block " << from << " at " << j;
        }
      }
    }
  }
}

TEST_F(NcclCommunicatorTest, AllToAllRefusesOverlappingBuffers) {
  const DeviceBuffer buffer = to_device({}, 64 * static_cast<std::size_t>(comm_->size()) + 64);
  try {
    comm_->all_to_all(buffer.data(), buffer.as<unsigned char>() + 4, 16, DType::f32, *stream_);
    FAIL() << "no CommError";
  } catch (const CommError& error) {
    EXPECT_NE(std::string(error.what()).find("pass separate buffers"), std::string::npos) << error.what();
  }
}

// Every rank of a test run here is on one host: across hosts, each rank is alone.
TEST_F(NcclCommunicatorTest, SplitAcrossHostsOnOneHostIsEachRankAlone) {
  const std::unique_ptr<Communicator> across = comm_->split_across_hosts();
  EXPECT_EQ(across->size(), 1);
  EXPECT_EQ(across->rank(), 0);
  std::vector<std::int64_t> value = {comm_->rank() + 1};
  across->all_reduce_host(value, ReduceOp::sum);
  EXPECT_EQ(value[0], comm_->rank() + 1);
}

TEST_F(NcclCommunicatorTest, BroadcastEveryDtypeFromTheLastRank) {
  const int root = comm_->size() - 1;
  for (const DType dtype : kDTypes) {
    for (const std::size_t count : kCounts) {
      const std::size_t bytes = count * dtype_size(dtype);
      const DeviceBuffer buffer = to_device(encode(my_inputs(count), dtype), bytes);
      comm_->broadcast(buffer.data(), count, dtype, root, *stream_);
      const auto got = decode(to_host(buffer, bytes), dtype);
      for (std::size_t i = 0; i < count; ++i) {
        ASSERT_EQ(got[i], input(root, i)) << label("broadcast", dtype, count) << " at " << i;
      }
    }
  }
}

TEST_F(NcclCommunicatorTest, CollectivesAreOrderedOnTheGivenStream) {
  // all_reduce then all_reduce again on its own result, no synchronization between: the second
  // must see the first's output (sum of sums = size * sum).
  const int ranks = comm_->size();
  const std::size_t count = 100001;
  const DeviceBuffer buffer = to_device(encode(my_inputs(count), DType::f32), count * 4);
  comm_->all_reduce(buffer.data(), buffer.data(), count, DType::f32, ReduceOp::sum, *stream_);
  comm_->all_reduce(buffer.data(), buffer.data(), count, DType::f32, ReduceOp::sum, *stream_);
  const auto got = decode(to_host(buffer, count * 4), DType::f32);
  for (std::size_t i = 0; i < count; ++i) {
    ASSERT_EQ(got[i], static_cast<float>(ranks) * reduce_inputs(ReduceOp::sum, ranks, i)) << i;
  }
}

TEST_F(NcclCommunicatorTest, BarrierHoldsEveryRankUntilAllArrive) {
  comm_->barrier();
  const auto start = std::chrono::steady_clock::now();
  if (comm_->rank() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(200));
  comm_->barrier();
  const auto waited = std::chrono::steady_clock::now() - start;
  if (comm_->size() > 1) {
    EXPECT_GE(waited, std::chrono::milliseconds(150));
  }
}

TEST_F(NcclCommunicatorTest, RejectsABadRootAndACpuStream) {
  const DeviceBuffer buffer = to_device({}, 64);
  try {
    comm_->broadcast(buffer.data(), 16, DType::f32, comm_->size(), *stream_);
    FAIL() << "no CommError";
  } catch (const CommError& error) {
    EXPECT_NE(std::string(error.what()).find("root " + std::to_string(comm_->size())), std::string::npos)
        << error.what();
  }
  auto cpu = make_cpu_device(1 << 20);
  auto cpu_stream = cpu->create_stream();
  EXPECT_THROW(comm_->all_reduce(buffer.data(), buffer.data(), 16, DType::f32, ReduceOp::sum, *cpu_stream),
               CommError);
}

// Needs no GPU: the check comes before NCCL is touched.
TEST(NcclCommunicator, RefusesACpuDevice) {
  const std::unique_ptr<World> world = make_world();
  auto cpu = make_cpu_device(1 << 20);
  try {
    static_cast<void>(world->make_nccl_communicator(*cpu));
    FAIL() << "no CommError";
  } catch (const CommError& error) {
    EXPECT_NE(std::string(error.what()).find("needs a cuda device"), std::string::npos) << error.what();
  }
}

// The trainer's host scalars, more of them than the 1 KiB scratch holds at once (pieces).
TEST_F(NcclCommunicatorTest, HostScalarsAreReducedAcrossRanks) {
  const int n = comm_->size();
  const int r = comm_->rank();
  std::vector<double> loss(300);
  std::vector<std::int64_t> tokens(300);
  for (std::size_t i = 0; i < loss.size(); ++i) {
    loss[i] = 0.5 * (r + 1) + static_cast<double>(i);
    tokens[i] = (std::int64_t{1} << 40) + r + static_cast<std::int64_t>(i);
  }
  comm_->all_reduce_host(loss, ReduceOp::sum);
  comm_->all_reduce_host(tokens, ReduceOp::max);
  for (std::size_t i = 0; i < loss.size(); ++i) {
    ASSERT_DOUBLE_EQ(loss[i], 0.25 * n * (n + 1) + static_cast<double>(n) * static_cast<double>(i)) << i;
    ASSERT_EQ(tokens[i], (std::int64_t{1} << 40) + n - 1 + static_cast<std::int64_t>(i)) << i;
  }
}

// zest/nccl.hpp: zest runs on the program's own NCCL communicator and leaves it to the program.
TEST_F(NcclCommunicatorTest, ACommunicatorOverTheProgramsNcclCommLeavesItToTheProgram) {
  if (comm_->size() != 1) GTEST_SKIP() << "makes its own one-rank ncclComm_t: run as one rank";
  int ordinal = 0;
  ASSERT_EQ(cudaGetDevice(&ordinal), cudaSuccess);
  ncclComm_t own = nullptr;
  ASSERT_EQ(ncclCommInitAll(&own, 1, &ordinal), ncclSuccess);
  {
    std::unique_ptr<Communicator> wrapped = make_communicator(own, *device_);
    EXPECT_EQ(wrapped->rank(), 0);
    EXPECT_EQ(wrapped->size(), 1);
    const DeviceBuffer buffer = to_device(encode(my_inputs(1000), DType::f32), 4000);
    wrapped->all_reduce(buffer.data(), buffer.data(), 1000, DType::f32, ReduceOp::sum, *stream_);
    EXPECT_EQ(decode(to_host(buffer, 4000), DType::f32), my_inputs(1000));
    std::vector<double> x = {1.5};
    wrapped->all_reduce_host(x, ReduceOp::sum);
    EXPECT_EQ(x[0], 1.5);
  }
  // Still the program's, and alive: usable after zest's communicator is gone.
  int count = 0;
  EXPECT_EQ(ncclCommCount(own, &count), ncclSuccess);
  EXPECT_EQ(count, 1);
  EXPECT_EQ(ncclCommDestroy(own), ncclSuccess);
}

// Needs no GPU: the null check comes first.
TEST(NcclCommunicator, ANullNcclCommIsRefused) {
  auto cpu = make_cpu_device(1 << 20);
  try {
    static_cast<void>(make_communicator(static_cast<ncclComm_t>(nullptr), *cpu));
    FAIL() << "no CommError";
  } catch (const CommError& error) {
    EXPECT_NE(std::string(error.what()).find("null"), std::string::npos) << error.what();
  }
}

}  // namespace
}  // namespace zest
