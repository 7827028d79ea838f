// The MPI communicator on the cpu device, run under mpirun with 1, 2 and 4 ranks. Every result is
// checked against values each rank computes on its own from the formula every rank used to fill
// its buffers; the inputs are multiples of 1/4 small enough that every partial sum is exact in
// fp16 and bf16, so the result does not depend on MPI's reduction order.
#include "runtime/comm/mpi_communicator.hpp"
#include "zest/mpi.hpp"

#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "runtime/host/half.hpp"
#include "runtime/comm/mpi_session.hpp"
#include "zest/communicator.hpp"
#include "zest/device.hpp"
#include "zest/error.hpp"

namespace zest {
namespace {

constexpr DType kDTypes[] = {DType::f32, DType::f16, DType::bf16};
constexpr ReduceOp kOps[] = {ReduceOp::sum, ReduceOp::max};
// Odd sizes: none, a single element, a few, and one large enough that MPI pipelines it.
constexpr std::size_t kMaxCount = 250007;
constexpr std::size_t kCounts[] = {0, 1, 7, kMaxCount};

// For the collectives whose full buffer is size() blocks: the large block shrinks with the ranks
// (staying odd) so the total stays near kMaxCount and the test stays fast under sanitizers.
std::array<std::size_t, 4> block_counts(int ranks) {
  return {0, 1, 7, (kMaxCount / static_cast<std::size_t>(ranks)) | 1};
}

// Element i of rank r's input: a multiple of 1/4 in [-4, 4], so sums over up to 16 ranks stay
// exact in bf16's 8 significant bits.
float input(int rank, std::size_t i) {
  return static_cast<float>(static_cast<int>((i * 7 + static_cast<std::size_t>(rank) * 13) % 33) -
                            16) *
         0.25f;
}

float reference(ReduceOp op, int ranks, std::size_t i) {
  float result = input(0, i);
  for (int r = 1; r < ranks; ++r)
    result = op == ReduceOp::sum ? result + input(r, i) : std::max(result, input(r, i));
  return result;
}

// Any value, exactly representable or not: all_gather and broadcast must move bits unchanged.
float payload(int rank, std::size_t i) {
  return static_cast<float>(rank * 1000003 + static_cast<int>(i % 100000)) * 0.37f - 5000.0f;
}

std::uint32_t encode(DType dtype, float value) {
  switch (dtype) {
    case DType::f32:
      return float_bits(value);
    case DType::f16:
      return float_to_fp16(value);
    case DType::bf16:
      return float_to_bf16(value);
  }
  return 0;
}

std::uint32_t load_bits(const void* data, DType dtype, std::size_t i) {
  if (dtype == DType::f32) return static_cast<const std::uint32_t*>(data)[i];
  return static_cast<const std::uint16_t*>(data)[i];
}


void store(void* data, DType dtype, std::size_t i, float value) {
  if (dtype == DType::f32)
    static_cast<float*>(data)[i] = value;
  else
    static_cast<std::uint16_t*>(data)[i] = static_cast<std::uint16_t>(encode(dtype, value));
}

template <class F>
void fill(void* data, DType dtype, std::size_t count, F f) {
  for (std::size_t i = 0; i < count; ++i) store(data, dtype, i, f(i));
}

std::byte* element(void* base, DType dtype, std::size_t i) {
  return static_cast<std::byte*>(base) + i * dtype_size(dtype);
}

// Compares bit patterns with the expected values rounded to dtype; names the first difference.
template <class F>
testing::AssertionResult holds(const void* data, DType dtype, std::size_t count, F expected) {
  std::size_t wrong = 0;
  std::size_t first = 0;
  for (std::size_t i = 0; i < count; ++i) {
    if (load_bits(data, dtype, i) != encode(dtype, expected(i))) {
      if (wrong++ == 0) first = i;
    }
  }
  if (wrong == 0) return testing::AssertionSuccess();
  std::ostringstream text;
  text << wrong << " of " << count << " " << dtype_name(dtype) << " elements differ; first at "
       << first << ": bits 0x" << std::hex << load_bits(data, dtype, first) << ", expected 0x"
       << encode(dtype, expected(first)) << std::dec << " (" << expected(first) << ")";
  return testing::AssertionFailure() << text.str();
}

std::string label(DType dtype, ReduceOp op, bool in_place, std::size_t count) {
  std::string text(dtype_name(dtype));
  text.append(op == ReduceOp::sum ? " sum" : " max")
      .append(in_place ? " in place" : " out of place");
  text.append(" count ").append(std::to_string(count));
  return text;
}

// Runs `enqueue` on a stream and returns the CommError message synchronize() rethrows ("" if none).
std::string comm_error_of(Stream& stream, const std::function<void()>& enqueue) {
  enqueue();
  try {
    stream.synchronize();
  } catch (const CommError& error) {
    return error.what();
  }
  return {};
}

// Opens once, from whichever side comes first.
class Gate {
 public:
  void open() {
    {
      std::lock_guard lock(mutex_);
      open_ = true;
    }
    changed_.notify_all();
  }
  bool wait_for(std::chrono::milliseconds timeout) {
    std::unique_lock lock(mutex_);
    return changed_.wait_for(lock, timeout, [&] { return open_; });
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  bool open_ = false;
};

class MpiCommunicatorTest : public testing::Test {
 protected:
  static void SetUpTestSuite() { session_ = new MpiSession(); }
  static void TearDownTestSuite() {
    delete session_;
    session_ = nullptr;
  }

  void SetUp() override {
    device_ = make_cpu_device(std::size_t{256} << 20);
    stream_ = device_->create_stream();
    comm_ = std::make_unique<MpiCommunicator>(session_->world(), *device_);
    rank_ = comm_->rank();
    size_ = comm_->size();
  }

  void TearDown() override {
    try {
      stream_->synchronize();
    } catch (const Error&) {
      // Already reported by the test that queued the failing work.
    }
    comm_.reset();
    stream_.reset();
    device_.reset();
  }

  DeviceBuffer buffer(std::size_t elements) {
    return device_->allocate(std::max<std::size_t>(elements, 1) * 4, MemoryCategory::buffers);
  }

  static MpiSession* session_;
  std::unique_ptr<Device> device_;
  std::unique_ptr<Stream> stream_;
  std::unique_ptr<MpiCommunicator> comm_;
  int rank_ = 0;
  int size_ = 1;
};

MpiSession* MpiCommunicatorTest::session_ = nullptr;

TEST_F(MpiCommunicatorTest, SessionMatchesTheWorldAndOwnsADuplicate) {
  int world_rank = -1;
  int world_size = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world_size);
  EXPECT_EQ(session_->rank(), world_rank);
  EXPECT_EQ(session_->size(), world_size);
  EXPECT_EQ(comm_->rank(), world_rank);
  EXPECT_EQ(comm_->size(), world_size);
  EXPECT_EQ(comm_->backend_name(), "mpi");

  int comparison = MPI_IDENT;
  MPI_Comm_compare(session_->world(), MPI_COMM_WORLD, &comparison);
  EXPECT_EQ(comparison, MPI_CONGRUENT) << "world() must be a duplicate, not MPI_COMM_WORLD itself";
  MPI_Errhandler handler = MPI_ERRHANDLER_NULL;
  MPI_Comm_get_errhandler(session_->world(), &handler);
  EXPECT_EQ(handler, MPI_ERRORS_RETURN);
  MPI_Errhandler_free(&handler);

  // mpirun here starts every rank on this one host, ranks in order.
  EXPECT_EQ(session_->local_size(), world_size);
  EXPECT_EQ(session_->local_rank(), world_rank);
}

TEST_F(MpiCommunicatorTest, SessionLeavesAProgramInitializedMpiRunning) {
  { MpiSession nested; }  // main() initialized MPI, so this session must not finalize it
  int finalized = 1;
  MPI_Finalized(&finalized);
  EXPECT_EQ(finalized, 0);
  int value = 1;
  int total = 0;
  EXPECT_EQ(MPI_Allreduce(&value, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD), MPI_SUCCESS);
  EXPECT_EQ(total, size_);
}

TEST_F(MpiCommunicatorTest, FactoryBuildsTheMpiBackend) {
  std::unique_ptr<Communicator> comm = make_mpi_communicator(*session_, *device_);
  EXPECT_EQ(comm->backend_name(), "mpi");
  EXPECT_EQ(comm->size(), size_);
}

// Every rank of a test job shares one host (mpirun on this machine): host 0, as the session's local
// ranks say. A rank outside the communicator is a CommError naming the range. (Two hosts:
// tests/examples/multihost_test.sh sees the bytes zest-train sends split between them.)
TEST_F(MpiCommunicatorTest, HostOfEveryRankIsThisHost) {
  EXPECT_EQ(session_->local_size(), size_);
  for (int r = 0; r < size_; ++r) EXPECT_EQ(comm_->host_of(r), 0) << "rank " << r;
  try {
    comm_->host_of(size_);
    ADD_FAILURE() << "host_of(size()) did not throw";
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find("0 to size() - 1"), std::string::npos) << e.what();
  }
}

TEST_F(MpiCommunicatorTest, AllReduceEveryDTypeAndOp) {
  DeviceBuffer send = buffer(kMaxCount);
  DeviceBuffer recv = buffer(kMaxCount);
  for (DType dtype : kDTypes)
    for (ReduceOp op : kOps)
      for (bool in_place : {false, true})
        for (std::size_t count : kCounts) {
          SCOPED_TRACE(label(dtype, op, in_place, count));
          fill(send.data(), dtype, count, [&](std::size_t i) { return input(rank_, i); });
          std::memset(recv.data(), 0xab, count * dtype_size(dtype));
          void* out = in_place ? send.data() : recv.data();
          comm_->all_reduce(send.data(), out, count, dtype, op, *stream_);
          stream_->synchronize();
          EXPECT_TRUE(
              holds(out, dtype, count, [&](std::size_t i) { return reference(op, size_, i); }));
          if (!in_place) {
            EXPECT_TRUE(holds(send.data(), dtype, count, [&](std::size_t i) {
              return input(rank_, i);
            })) << "send must be left as it was";
          }
        }
}

TEST_F(MpiCommunicatorTest, ReduceScatterEveryDTypeAndOp) {
  const auto ranks = static_cast<std::size_t>(size_);
  const auto me = static_cast<std::size_t>(rank_);
  DeviceBuffer send = buffer(kMaxCount * ranks);
  DeviceBuffer recv = buffer(kMaxCount);
  for (DType dtype : kDTypes)
    for (ReduceOp op : kOps)
      for (bool in_place : {false, true})
        for (std::size_t count : block_counts(size_)) {
          SCOPED_TRACE(label(dtype, op, in_place, count));
          fill(send.data(), dtype, count * ranks, [&](std::size_t i) { return input(rank_, i); });
          std::memset(recv.data(), 0xab, count * dtype_size(dtype));
          void* out = in_place ? element(send.data(), dtype, me * count) : recv.data();
          comm_->reduce_scatter(send.data(), out, count, dtype, op, *stream_);
          stream_->synchronize();
          // Block `rank` of the element-wise reduction over ranks.
          EXPECT_TRUE(holds(out, dtype, count,
                            [&](std::size_t i) { return reference(op, size_, me * count + i); }));
        }
}

TEST_F(MpiCommunicatorTest, AllGatherEveryDType) {
  const auto ranks = static_cast<std::size_t>(size_);
  const auto me = static_cast<std::size_t>(rank_);
  DeviceBuffer send = buffer(kMaxCount);
  DeviceBuffer recv = buffer(kMaxCount * ranks);
  for (DType dtype : kDTypes)
    for (bool in_place : {false, true})
      for (std::size_t count : block_counts(size_)) {
        SCOPED_TRACE(label(dtype, ReduceOp::sum, in_place, count));
        std::memset(recv.data(), 0xab, count * ranks * dtype_size(dtype));
        void* own = in_place ? element(recv.data(), dtype, me * count) : send.data();
        fill(own, dtype, count, [&](std::size_t i) { return payload(rank_, i); });
        comm_->all_gather(own, recv.data(), count, dtype, *stream_);
        stream_->synchronize();
        EXPECT_TRUE(holds(recv.data(), dtype, count * ranks, [&](std::size_t i) {
          return payload(static_cast<int>(i / count), i % count);
        }));
      }
}

// Element i of the block rank `from` sends rank `to`: distinct for every (from, to) pair and
// exact in fp16 and bf16 up to 4 ranks, so a block delivered to the wrong rank shows.
float block_value(int from, int to, int ranks, std::size_t i) {
  return static_cast<float>((from * ranks + to) * 16 + static_cast<int>(i % 16));
}

// Fills `send` with this rank's blocks for every rank, all_to_all's it through `comm`, and checks
// that block r of recv is the one rank r sent here and that send is left as it was.
testing::AssertionResult exchanges(Communicator& comm, Stream& stream, void* send, void* recv,
                                   std::size_t count, DType dtype) {
  const int ranks = comm.size();
  const int me = comm.rank();
  const auto total = static_cast<std::size_t>(ranks) * count;
  const auto sent = [&](std::size_t i) { return block_value(me, static_cast<int>(i / count), ranks, i % count); };
  fill(send, dtype, total, sent);
  std::memset(recv, 0xab, total * dtype_size(dtype));
  comm.all_to_all(send, recv, count, dtype, stream);
  stream.synchronize();
  testing::AssertionResult received = holds(recv, dtype, total, [&](std::size_t i) {
    return block_value(static_cast<int>(i / count), me, ranks, i % count);
  });
  if (!received) return received << " (recv)";
  testing::AssertionResult kept = holds(send, dtype, total, sent);
  if (!kept) return kept << " (send must be left as it was)";
  return testing::AssertionSuccess();
}

TEST_F(MpiCommunicatorTest, AllToAllEveryDType) {
  const auto ranks = static_cast<std::size_t>(size_);
  DeviceBuffer send = buffer(kMaxCount * ranks);
  DeviceBuffer recv = buffer(kMaxCount * ranks);
  for (DType dtype : kDTypes)
    for (std::size_t count : block_counts(size_)) {
      SCOPED_TRACE(label(dtype, ReduceOp::sum, false, count));
      const std::uint64_t before = comm_->mpi_calls_issued();
      EXPECT_TRUE(exchanges(*comm_, *stream_, send.data(), recv.data(), count, dtype));
      EXPECT_EQ(comm_->mpi_calls_issued() - before, count == 0 ? 0u : 1u) << "one MPI_Ialltoall within the limit";
    }
}

// Blocks past the chunk limit (3 elements here) go peer to peer in pieces: a receive and a send per
// peer per piece, and this rank's own block copied. At the limit it is still one MPI_Ialltoall.
TEST_F(MpiCommunicatorTest, AllToAllPastTheChunkLimitGoesPeerToPeerInPieces) {
  MpiCommunicator chunked(session_->world(), *device_, 3);
  const auto ranks = static_cast<std::size_t>(size_);
  DeviceBuffer send = buffer(10 * ranks);
  DeviceBuffer recv = buffer(10 * ranks);
  for (DType dtype : {DType::f32, DType::bf16})
    for (std::size_t count : {std::size_t{3}, std::size_t{9}, std::size_t{10}}) {
      SCOPED_TRACE(label(dtype, ReduceOp::sum, false, count));
      const std::uint64_t pieces = (count + 2) / 3;
      const std::uint64_t before = chunked.mpi_calls_issued();
      EXPECT_TRUE(exchanges(chunked, *stream_, send.data(), recv.data(), count, dtype));
      const std::uint64_t want = count <= 3 ? 1 : pieces * 2 * (ranks - 1);
      EXPECT_EQ(chunked.mpi_calls_issued() - before, want);
    }
}

// A count that differs between ranks, or one rank issuing another collective, is a CommError on
// every rank before any data moves; the ranks stay in step and the next all_to_all works.
TEST_F(MpiCommunicatorTest, MismatchedAllToAllIsAnErrorOnEveryRank) {
  if (size_ == 1) GTEST_SKIP() << "needs two ranks to disagree";
  const auto ranks = static_cast<std::size_t>(size_);
  DeviceBuffer send = buffer(9 * ranks);
  DeviceBuffer recv = buffer(9 * ranks);
  const std::size_t count = rank_ == size_ - 1 ? 9 : 8;
  std::string error = comm_error_of(*stream_, [&] {
    comm_->all_to_all(send.data(), recv.data(), count, DType::f32, *stream_);
  });
  EXPECT_NE(error.find("all_to_all: ranks disagree on count: min 8, max 9"), std::string::npos) << error;
  EXPECT_NE(error.find("pad in the caller"), std::string::npos) << error;

  error = comm_error_of(*stream_, [&] {
    if (rank_ == 0)
      comm_->all_to_all(send.data(), recv.data(), 4, DType::f32, *stream_);
    else
      comm_->all_gather(send.data(), recv.data(), 4, DType::f32, *stream_);
  });
  EXPECT_NE(error.find("ranks disagree on the collective: all_gather on some ranks, all_to_all on others"),
            std::string::npos)
      << error;

  error = comm_error_of(*stream_, [&] {
    comm_->all_to_all(send.data(), recv.data(), 4, rank_ == 0 ? DType::bf16 : DType::f16, *stream_);
  });
  EXPECT_NE(error.find("all_to_all: ranks disagree on dtype"), std::string::npos) << error;

  EXPECT_TRUE(exchanges(*comm_, *stream_, send.data(), recv.data(), 9, DType::f32));
}

// Overlapping buffers (the same one included: an all-to-all has no in-place form) and null
// buffers on one rank fail that rank with its reason and every other rank naming it.
TEST_F(MpiCommunicatorTest, AllToAllWithBadArgumentsOnOneRankFailsEveryRank) {
  const auto ranks = static_cast<std::size_t>(size_);
  DeviceBuffer data = buffer(16 * ranks + 8);
  DeviceBuffer other = buffer(16 * ranks);
  const int bad = size_ - 1;
  const std::string others = "all_to_all: rank " + std::to_string(bad) +
                             " passed invalid arguments (its own error says which); no rank moved data";
  for (const std::size_t shift : {std::size_t{0}, std::size_t{5}}) {
    SCOPED_TRACE("recv = send + " + std::to_string(shift) + " elements");
    const std::string error = comm_error_of(*stream_, [&] {
      float* send = data.as<float>();
      float* recv = rank_ == bad ? send + shift : other.as<float>();
      comm_->all_to_all(send, recv, 16, DType::f32, *stream_);
    });
    if (rank_ == bad) {
      EXPECT_NE(error.find("all_to_all: send and recv overlap"), std::string::npos) << error;
      EXPECT_NE(error.find("pass separate buffers"), std::string::npos) << error;
    } else {
      EXPECT_EQ(error, others);
    }
  }
  const std::string error = comm_error_of(*stream_, [&] {
    comm_->all_to_all(rank_ == bad ? nullptr : data.data(), other.data(), 1, DType::bf16, *stream_);
  });
  if (rank_ == bad)
    EXPECT_NE(error.find("all_to_all: a buffer is null while count is 1"), std::string::npos) << error;
  else
    EXPECT_EQ(error, others);
  // Count 0 needs no buffers and moves nothing.
  const std::uint64_t before = comm_->mpi_calls_issued();
  comm_->all_to_all(nullptr, nullptr, 0, DType::f16, *stream_);
  EXPECT_NO_THROW(stream_->synchronize());
  EXPECT_EQ(comm_->mpi_calls_issued(), before);
}

// Every rank of a test job is on this one host (see HostOfEveryRankIsThisHost): split_by_host
// spans them all, in the same order, and split_across_hosts gives each rank a communicator of its
// own (the one host's rank at its place), which works. (Two hosts: tests/examples/multihost_test.sh.)
TEST_F(MpiCommunicatorTest, SplitsOnOneHostSpanItAndGiveEachRankItsOwnAcross) {
  std::unique_ptr<Communicator> host = comm_->split_by_host();
  EXPECT_EQ(host->size(), size_);
  EXPECT_EQ(host->rank(), rank_);
  std::unique_ptr<Communicator> across = comm_->split_across_hosts();
  EXPECT_EQ(across->backend_name(), "mpi");
  EXPECT_EQ(across->size(), 1);
  EXPECT_EQ(across->rank(), 0);
  EXPECT_EQ(across->host_of(0), 0);
  DeviceBuffer send = buffer(5);
  DeviceBuffer recv = buffer(5);
  EXPECT_TRUE(exchanges(*across, *stream_, send.data(), recv.data(), 5, DType::f16));
  std::vector<std::int64_t> one = {rank_ + 1};
  across->all_reduce_host(one, ReduceOp::sum);
  EXPECT_EQ(one[0], rank_ + 1) << "the across-hosts communicator reached another rank";
  host->barrier();
}

TEST_F(MpiCommunicatorTest, BroadcastFromEveryRootEveryDType) {
  DeviceBuffer data = buffer(kMaxCount);
  for (DType dtype : kDTypes)
    for (int root = size_ - 1; root >= 0; --root)  // the last rank first: a nonzero root
      for (std::size_t count : kCounts) {
        SCOPED_TRACE(label(dtype, ReduceOp::sum, true, count) + " root " + std::to_string(root));
        if (rank_ == root)
          fill(data.data(), dtype, count, [&](std::size_t i) { return payload(root, i); });
        else
          std::memset(data.data(), 0xab, count * dtype_size(dtype));
        comm_->broadcast(data.data(), count, dtype, root, *stream_);
        stream_->synchronize();
        EXPECT_TRUE(
            holds(data.data(), dtype, count, [&](std::size_t i) { return payload(root, i); }));
      }
}

TEST_F(MpiCommunicatorTest, Fp16AndBf16ReductionsPropagateInfAndNaN) {
  DeviceBuffer data = buffer(4);
  for (DType dtype : {DType::f16, DType::bf16})
    for (ReduceOp op : kOps) {
      SCOPED_TRACE(label(dtype, op, true, 4));
      const float inf = std::numeric_limits<float>::infinity();
      const float nan = std::numeric_limits<float>::quiet_NaN();
      // Element 0: +Inf on the last rank; 1: NaN on rank 0; 2: 65504 (fp16's max) on every rank.
      fill(data.data(), dtype, 4, [&](std::size_t i) {
        if (i == 0) return rank_ == size_ - 1 ? inf : 1.0f;
        if (i == 1) return rank_ == 0 ? nan : 2.0f;
        if (i == 2) return 65504.0f;
        return -3.0f;
      });
      comm_->all_reduce(data.data(), data.data(), 4, dtype, op, *stream_);
      stream_->synchronize();
      float decoded[4];
      for (std::size_t i = 0; i < 4; ++i) decoded[i] = load_as_float(data.data(), dtype, i);
      EXPECT_EQ(decoded[0], inf);
      EXPECT_TRUE(std::isnan(decoded[1]));
      if (op == ReduceOp::max || size_ == 1) {
        EXPECT_EQ(encode(dtype, decoded[2]), encode(dtype, 65504.0f));
      } else if (dtype == DType::f16) {
        EXPECT_EQ(decoded[2], inf) << "a sum past fp16's range rounds to Inf, as on a GPU";
      }
      EXPECT_EQ(decoded[3], op == ReduceOp::sum ? -3.0f * static_cast<float>(size_) : -3.0f);
    }
}

TEST_F(MpiCommunicatorTest, CollectivesQueuedWithoutSyncRunInStreamOrder) {
  constexpr std::size_t kCount = 7;
  DeviceBuffer data = buffer(kCount);
  DeviceBuffer gathered = buffer(kCount * static_cast<std::size_t>(size_));
  float* v = data.as<float>();
  float* g = gathered.as<float>();
  std::fill_n(v, kCount, static_cast<float>(rank_ + 1));

  // The same chain, simulated on the host for every rank: each step reads the previous one's
  // result, so any reordering changes the final values.
  std::vector<double> model(static_cast<std::size_t>(size_));
  for (int r = 0; r < size_; ++r) model[static_cast<std::size_t>(r)] = r + 1;
  const int me = rank_;
  for (int step = 0; step < 6; ++step) {
    const int root = step % size_;
    comm_->all_reduce(v, v, kCount, DType::f32, ReduceOp::sum, *stream_);
    stream_->host_task([v, me] {
      for (std::size_t i = 0; i < kCount; ++i) v[i] -= static_cast<float>(me);
    });
    comm_->broadcast(v, kCount, DType::f32, root, *stream_);
    comm_->all_gather(v, g, kCount, DType::f32, *stream_);
    stream_->host_task([v, g, me, ranks = size_] {
      for (std::size_t i = 0; i < kCount; ++i) {
        float blocks = 0;
        for (int r = 0; r < ranks; ++r) blocks += g[static_cast<std::size_t>(r) * kCount + i];
        v[i] = blocks / static_cast<float>(ranks) + static_cast<float>(me + 1);
      }
    });

    double sum = 0;
    for (double x : model) sum += x;
    const double broadcasted = sum - root;  // rank root's value after subtracting its rank
    for (int r = 0; r < size_; ++r) model[static_cast<std::size_t>(r)] = broadcasted + r + 1;
  }
  stream_->synchronize();
  EXPECT_TRUE(holds(v, DType::f32, kCount, [&](std::size_t) {
    return static_cast<float>(model[static_cast<std::size_t>(rank_)]);
  }));
}

TEST_F(MpiCommunicatorTest, CallerIsNotBlockedWhileTheStreamIsBusy) {
  constexpr std::size_t kCount = 1000;
  DeviceBuffer data = buffer(kCount);
  float* v = data.as<float>();
  std::fill_n(v, kCount, static_cast<float>(rank_ + 1));

  Gate gate;
  // Opens the gate anyway after a while, so a blocking enqueue fails the test instead of hanging.
  std::thread watchdog([&] {
    if (!gate.wait_for(std::chrono::seconds(5))) gate.open();
  });
  stream_->host_task([&gate] { gate.wait_for(std::chrono::seconds(60)); });

  const auto start = std::chrono::steady_clock::now();
  comm_->all_reduce(v, v, kCount, DType::f32, ReduceOp::sum, *stream_);
  comm_->broadcast(v, kCount, DType::f32, 0, *stream_);
  const auto enqueue_time = std::chrono::steady_clock::now() - start;
  // The stream is held at the gate, so nothing may have run yet.
  const bool untouched =
      std::all_of(v, v + kCount, [&](float x) { return x == static_cast<float>(rank_ + 1); });
  gate.open();
  watchdog.join();
  stream_->synchronize();

  EXPECT_LT(enqueue_time, std::chrono::seconds(1)) << "enqueueing a collective blocked the caller";
  EXPECT_TRUE(untouched) << "the collective ran before the stream reached it";
  const float total = static_cast<float>(size_ * (size_ + 1) / 2);
  EXPECT_TRUE(holds(v, DType::f32, kCount, [&](std::size_t) { return total; }));
}

TEST_F(MpiCommunicatorTest, BarrierWaitsForTheSlowestRank) {
  if (size_ == 1) GTEST_SKIP() << "a barrier of one rank has no one to wait for";
  MPI_Barrier(MPI_COMM_WORLD);  // line the ranks up
  const auto start = std::chrono::steady_clock::now();
  if (rank_ == 0) std::this_thread::sleep_for(std::chrono::milliseconds(300));
  comm_->barrier();
  const auto waited = std::chrono::steady_clock::now() - start;
  EXPECT_GE(waited, std::chrono::milliseconds(150)) << "barrier returned before rank 0 arrived";
}

// barrier() neither waits for stream work nor shares the collectives' matching order: rank 0's
// collective reaches MPI only after its barrier, the other ranks' before theirs, and both complete.
// (Open MPI happens to tolerate the interleaving on one communicator; stricter MPIs need the
// separate one.)
TEST_F(MpiCommunicatorTest, BarrierWhileACollectiveIsInFlight) {
  constexpr std::size_t kCount = 7;
  DeviceBuffer data = buffer(kCount);
  float* v = data.as<float>();
  std::fill_n(v, kCount, static_cast<float>(rank_ + 1));
  Gate gate;
  if (rank_ == 0) stream_->host_task([&gate] { gate.wait_for(std::chrono::seconds(30)); });
  comm_->all_reduce(v, v, kCount, DType::f32, ReduceOp::sum, *stream_);
  if (rank_ != 0) std::this_thread::sleep_for(std::chrono::milliseconds(50));  // let it reach MPI
  comm_->barrier();
  gate.open();
  stream_->synchronize();
  const float total = static_cast<float>(size_ * (size_ + 1) / 2);
  EXPECT_TRUE(holds(v, DType::f32, kCount, [&](std::size_t) { return total; }));
}

TEST_F(MpiCommunicatorTest, MismatchedCountIsAnErrorOnEveryRank) {
  if (size_ == 1) GTEST_SKIP() << "needs two ranks to disagree";
  DeviceBuffer data = buffer(1024);
  const std::size_t count = rank_ == size_ - 1 ? 1024 : 1000;
  const std::string error = comm_error_of(*stream_, [&] {
    comm_->all_reduce(data.data(), data.data(), count, DType::f32, ReduceOp::sum, *stream_);
  });
  EXPECT_NE(error.find("all_reduce: ranks disagree on count: min 1000, max 1024"),
            std::string::npos)
      << error;
  EXPECT_NE(error.find("pad in the caller"), std::string::npos) << error;

  // Nothing moved and every rank failed the same call, so the ranks are still in step.
  fill(data.data(), DType::f32, 7, [&](std::size_t i) { return input(rank_, i); });
  comm_->all_reduce(data.data(), data.data(), 7, DType::f32, ReduceOp::max, *stream_);
  stream_->synchronize();
  EXPECT_TRUE(holds(data.data(), DType::f32, 7,
                    [&](std::size_t i) { return reference(ReduceOp::max, size_, i); }));
}

TEST_F(MpiCommunicatorTest, MismatchedDTypeOpRootAndCollectiveAreErrorsOnEveryRank) {
  if (size_ == 1) GTEST_SKIP() << "needs two ranks to disagree";
  const auto ranks = static_cast<std::size_t>(size_);
  DeviceBuffer send = buffer(16 * ranks);
  DeviceBuffer recv = buffer(16 * ranks);

  std::string error = comm_error_of(*stream_, [&] {
    comm_->reduce_scatter(send.data(), recv.data(), 16, rank_ == 0 ? DType::f32 : DType::bf16,
                          ReduceOp::sum, *stream_);
  });
  EXPECT_NE(
      error.find("reduce_scatter: ranks disagree on dtype: fp32 on some ranks, bf16 on others"),
      std::string::npos)
      << error;

  error = comm_error_of(*stream_, [&] {
    comm_->all_reduce(send.data(), recv.data(), 16, DType::f16,
                      rank_ == 0 ? ReduceOp::max : ReduceOp::sum, *stream_);
  });
  EXPECT_NE(
      error.find("all_reduce: ranks disagree on the reduce op: sum on some ranks, max on others"),
      std::string::npos)
      << error;

  error = comm_error_of(
      *stream_, [&] { comm_->broadcast(send.data(), 16, DType::f32, rank_ % 2, *stream_); });
  EXPECT_NE(error.find("broadcast: ranks disagree on root: min 0, max 1"), std::string::npos)
      << error;

  error = comm_error_of(*stream_, [&] {
    if (rank_ == 0)
      comm_->all_gather(send.data(), recv.data(), 16, DType::f32, *stream_);
    else
      comm_->broadcast(send.data(), 16, DType::f32, 0, *stream_);
  });
  EXPECT_NE(
      error.find("ranks disagree on the collective: all_gather on some ranks, broadcast on others"),
      std::string::npos)
      << error;
  EXPECT_EQ(error.rfind(rank_ == 0 ? "all_gather: " : "broadcast: ", 0), 0u) << error;
}

TEST_F(MpiCommunicatorTest, InvalidArgumentsOnOneRankFailEveryRank) {
  DeviceBuffer data = buffer(16);
  const int root = rank_ == 0 ? size_ + 5 : 0;
  const std::string error = comm_error_of(
      *stream_, [&] { comm_->broadcast(data.data(), 16, DType::f32, root, *stream_); });
  if (rank_ == 0) {
    const std::string expected = "broadcast: root " + std::to_string(size_ + 5) +
                                 " is not a rank (the communicator has " + std::to_string(size_) +
                                 " ranks)";
    EXPECT_EQ(error, expected);
  } else {
    EXPECT_EQ(error,
              "broadcast: rank 0 passed invalid arguments (its own error says which); no rank "
              "moved data");
  }

  const std::string overlap_error = comm_error_of(*stream_, [&] {
    comm_->all_reduce(data.as<float>(), data.as<float>() + 1, 8, DType::f32, ReduceOp::sum,
                      *stream_);
  });
  EXPECT_NE(overlap_error.find("all_reduce: send and recv overlap"), std::string::npos)
      << overlap_error;

  const std::string null_error = comm_error_of(
      *stream_, [&] { comm_->all_gather(nullptr, data.data(), 1, DType::f32, *stream_); });
  EXPECT_NE(null_error.find("all_gather: a buffer is null while count is 1"), std::string::npos)
      << null_error;
}

// A rank whose stream failed before a collective (one of its own tasks threw) still reaches the
// collective's agreement, so every rank raises instead of waiting for it forever; later
// collectives stay in step, and once the error is reported the communicator works again.
TEST_F(MpiCommunicatorTest, AStreamFailedOnOneRankFailsItsCollectivesOnEveryRank) {
  DeviceBuffer data = buffer(16);
  const int failing = size_ - 1;
  if (rank_ == failing) stream_->host_task([] { throw Error("the trainer's own task failed"); });
  comm_->all_reduce(data.data(), data.data(), 16, DType::f32, ReduceOp::sum, *stream_);
  comm_->all_gather(data.as<float>() + rank_, data.data(), 1, DType::f32, *stream_);
  try {
    stream_->synchronize();
    ADD_FAILURE() << "no error after a failed task";
  } catch (const Error& e) {
    const std::string expected = rank_ == failing
                                     ? std::string("the trainer's own task failed")
                                     : "all_reduce: rank " + std::to_string(failing) +
                                           "'s stream failed before this collective (its own error "
                                           "says why); no rank moved data";
    EXPECT_EQ(std::string(e.what()), expected);
  }
  std::vector<float> ones(16, 1.0f);
  std::memcpy(data.data(), ones.data(), 16 * sizeof(float));
  comm_->all_reduce(data.data(), data.data(), 16, DType::f32, ReduceOp::sum, *stream_);
  stream_->synchronize();
  EXPECT_EQ(data.as<float>()[15], static_cast<float>(size_));
}

TEST_F(MpiCommunicatorTest, CountZeroMovesNothing) {
  const std::uint64_t before = comm_->mpi_calls_issued();
  comm_->all_reduce(nullptr, nullptr, 0, DType::f32, ReduceOp::sum, *stream_);
  comm_->reduce_scatter(nullptr, nullptr, 0, DType::f16, ReduceOp::max, *stream_);
  comm_->all_gather(nullptr, nullptr, 0, DType::bf16, *stream_);
  comm_->broadcast(nullptr, 0, DType::f32, size_ - 1, *stream_);
  EXPECT_NO_THROW(stream_->synchronize());
  EXPECT_EQ(comm_->mpi_calls_issued(), before);
}

// MPI counts are int; past INT_MAX elements the communicator splits. A limit of 3 elements
// exercises the same code on small buffers.
TEST_F(MpiCommunicatorTest, LargeCountsAreSplitIntoIntSizedPieces) {
  MpiCommunicator chunked(session_->world(), *device_, 3);
  const auto ranks = static_cast<std::size_t>(size_);
  const auto me = static_cast<std::size_t>(rank_);
  DeviceBuffer send = buffer(10 * ranks);
  DeviceBuffer recv = buffer(10 * ranks);

  for (DType dtype : {DType::f32, DType::bf16})
    for (bool in_place : {false, true})
      for (std::size_t count : {std::size_t{9}, std::size_t{10}}) {
        SCOPED_TRACE(label(dtype, ReduceOp::sum, in_place, count));
        const std::uint64_t pieces = (count + 2) / 3;

        std::uint64_t before = chunked.mpi_calls_issued();
        fill(send.data(), dtype, count, [&](std::size_t i) { return input(rank_, i); });
        void* out = in_place ? send.data() : recv.data();
        chunked.all_reduce(send.data(), out, count, dtype, ReduceOp::sum, *stream_);
        stream_->synchronize();
        EXPECT_TRUE(holds(out, dtype, count,
                          [&](std::size_t i) { return reference(ReduceOp::sum, size_, i); }));
        EXPECT_EQ(chunked.mpi_calls_issued() - before, pieces);

        before = chunked.mpi_calls_issued();
        fill(send.data(), dtype, count * ranks, [&](std::size_t i) { return input(rank_, i); });
        out = in_place ? element(send.data(), dtype, me * count) : recv.data();
        chunked.reduce_scatter(send.data(), out, count, dtype, ReduceOp::sum, *stream_);
        stream_->synchronize();
        EXPECT_TRUE(holds(out, dtype, count, [&](std::size_t i) {
          return reference(ReduceOp::sum, size_, me * count + i);
        }));
        EXPECT_EQ(chunked.mpi_calls_issued() - before, pieces * ranks);

        before = chunked.mpi_calls_issued();
        std::memset(recv.data(), 0xab, count * ranks * dtype_size(dtype));
        void* own = in_place ? element(recv.data(), dtype, me * count) : send.data();
        fill(own, dtype, count, [&](std::size_t i) { return payload(rank_, i); });
        chunked.all_gather(own, recv.data(), count, dtype, *stream_);
        stream_->synchronize();
        EXPECT_TRUE(holds(recv.data(), dtype, count * ranks, [&](std::size_t i) {
          return payload(static_cast<int>(i / count), i % count);
        }));
        EXPECT_EQ(chunked.mpi_calls_issued() - before, pieces * ranks);

        before = chunked.mpi_calls_issued();
        const int root = size_ - 1;
        if (rank_ == root)
          fill(send.data(), dtype, count, [&](std::size_t i) { return payload(root, i); });
        else
          std::memset(send.data(), 0xab, count * dtype_size(dtype));
        chunked.broadcast(send.data(), count, dtype, root, *stream_);
        stream_->synchronize();
        EXPECT_TRUE(
            holds(send.data(), dtype, count, [&](std::size_t i) { return payload(root, i); }));
        EXPECT_EQ(chunked.mpi_calls_issued() - before, pieces);
      }

  // Within the limit, each collective is a single MPI call.
  const std::uint64_t before = comm_->mpi_calls_issued();
  comm_->all_reduce(send.data(), recv.data(), 10, DType::f32, ReduceOp::sum, *stream_);
  comm_->reduce_scatter(send.data(), recv.data(), 10 / ranks, DType::f32, ReduceOp::sum, *stream_);
  comm_->all_gather(send.data(), recv.data(), 1, DType::f32, *stream_);
  comm_->broadcast(send.data(), 10, DType::f32, 0, *stream_);
  stream_->synchronize();
  EXPECT_EQ(comm_->mpi_calls_issued() - before, 4u);
}

// Stands in for a GPU: memory the host cannot touch. Only what the constructor asks is real.
class NotHostAccessibleDevice final : public Device {
 public:
  NotHostAccessibleDevice() : Device(0) {}
  DeviceType type() const override { return DeviceType::cuda; }
  std::string name() const override { return "cuda:0 (stand-in)"; }
  bool host_accessible() const override { return false; }
  std::unique_ptr<Stream> create_stream() override { return nullptr; }
  std::unique_ptr<Event> create_event() override { return nullptr; }
  void copy_async(void*, const void*, std::size_t, Stream&) override {}
  void memset_async(void*, int, std::size_t, Stream&) override {}
  void synchronize() override {}

 protected:
  void* allocate_bytes(std::size_t) override { return nullptr; }
  void free_bytes(void*, std::size_t) noexcept override {}
  void* allocate_pinned_bytes(std::size_t, bool&) override { return nullptr; }
  void free_pinned_bytes(void*, std::size_t) noexcept override {}
};

TEST_F(MpiCommunicatorTest, DeviceTheHostCannotReadIsRejected) {
  NotHostAccessibleDevice gpu;
  try {
    make_mpi_communicator(*session_, gpu);
    FAIL() << "expected CommError";
  } catch (const CommError& error) {
    const std::string message = error.what();
    EXPECT_NE(message.find("needs the cpu device"), std::string::npos) << message;
    EXPECT_NE(message.find("cuda:0 (stand-in)"), std::string::npos) << message;
    EXPECT_NE(message.find("nccl"), std::string::npos) << message;
  }
}

TEST_F(MpiCommunicatorTest, ChunkLimitOutsideIntRangeIsRejected) {
  EXPECT_THROW(MpiCommunicator(session_->world(), *device_, 0), CommError);
  EXPECT_THROW(MpiCommunicator(session_->world(), *device_, MpiCommunicator::kMaxChunkElements + 1),
               CommError);
}

// The trainer's host scalars (a loss, token counts): reduced in place, no stream, no device buffer.
TEST_F(MpiCommunicatorTest, HostScalarsAreReducedAcrossRanks) {
  std::vector<double> loss = {0.5 * (rank_ + 1), -1.0 * rank_};
  std::vector<std::int64_t> tokens = {1000 + rank_, std::int64_t{1} << 40};
  comm_->all_reduce_host(loss, ReduceOp::sum);
  comm_->all_reduce_host(tokens, ReduceOp::max);
  EXPECT_DOUBLE_EQ(loss[0], 0.25 * size_ * (size_ + 1));
  EXPECT_DOUBLE_EQ(loss[1], -0.5 * size_ * (size_ - 1));
  EXPECT_EQ(tokens[0], 1000 + size_ - 1);
  EXPECT_EQ(tokens[1], std::int64_t{1} << 40);
  // Past the chunk limit too: in pieces of 3.
  MpiCommunicator small(session_->world(), *device_, 3);
  std::vector<std::int64_t> many(10, rank_ + 1);
  small.all_reduce_host(many, ReduceOp::sum);
  for (const std::int64_t v : many) EXPECT_EQ(v, static_cast<std::int64_t>(size_) * (size_ + 1) / 2);
}

TEST_F(MpiCommunicatorTest, MismatchedHostScalarsAreAnErrorOnEveryRank) {
  std::vector<double> values(rank_ == 0 ? 2 : 3, 1.0);
  if (size_ == 1) GTEST_SKIP() << "needs 2 ranks to disagree";
  try {
    comm_->all_reduce_host(values, ReduceOp::sum);
    FAIL() << "no CommError";
  } catch (const CommError& error) {
    EXPECT_NE(std::string(error.what()).find("disagree on count"), std::string::npos) << error.what();
  }
  // Still usable afterwards.
  std::vector<std::int64_t> one = {1};
  comm_->all_reduce_host(one, ReduceOp::sum);
  EXPECT_EQ(one[0], size_);
}

// zest/mpi.hpp: a communicator over the program's own sub-communicator spans only its ranks.
TEST_F(MpiCommunicatorTest, ACommunicatorOverASplitOfTheWorldSpansOnlyItsRanks) {
  const int color = rank_ % 2;
  MPI_Comm half = MPI_COMM_NULL;
  ASSERT_EQ(MPI_Comm_split(MPI_COMM_WORLD, color, rank_, &half), MPI_SUCCESS);
  std::unique_ptr<Communicator> sub = make_communicator(half, *device_);
  MPI_Comm_free(&half);  // zest keeps its own duplicate
  const int expected_size = (size_ + 1 - color) / 2;
  EXPECT_EQ(sub->size(), expected_size);
  EXPECT_EQ(sub->rank(), rank_ / 2);
  // Sum of the world ranks of this half: color, color + 2, ...
  std::int64_t expected = 0;
  for (int r = color; r < size_; r += 2) expected += r;
  DeviceBuffer value = device_->allocate(sizeof(float), MemoryCategory::buffers);
  *value.as<float>() = static_cast<float>(rank_);
  sub->all_reduce(value.data(), value.data(), 1, DType::f32, ReduceOp::sum, *stream_);
  stream_->synchronize();
  EXPECT_EQ(*value.as<float>(), static_cast<float>(expected));
  std::vector<std::int64_t> host = {rank_};
  sub->all_reduce_host(host, ReduceOp::sum);
  EXPECT_EQ(host[0], expected);
  sub->barrier();
}

TEST_F(MpiCommunicatorTest, ACommunicatorOverMpiCommNullIsRefused) {
  try {
    static_cast<void>(make_communicator(MPI_COMM_NULL, *device_));
    FAIL() << "no CommError";
  } catch (const CommError& error) {
    EXPECT_NE(std::string(error.what()).find("MPI_COMM_NULL"), std::string::npos) << error.what();
  }
}

}  // namespace
}  // namespace zest
