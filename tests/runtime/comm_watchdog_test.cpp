// The collective watchdog (comm.timeout), under mpirun with 2 and 4 ranks: a rank that skips a
// collective or issues one more than the others makes every rank blocked in one raise CommError
// naming the collective, its number and the ranks behind, within the timeout and a bounded grace,
// instead of hanging. (Without the watchdog these tests hang until meson's timeout fails them.)
// A rank that dies is tested with a real engine in tests/engine/watchdog_kill_test.sh.
#include <gtest/gtest.h>
#include <mpi.h>

#include <chrono>
#include <memory>
#include <set>
#include <sstream>
#include <string>

#include "runtime/comm/mpi_communicator.hpp"
#include "runtime/comm/mpi_session.hpp"
#include "zest/error.hpp"

namespace zest {
namespace {

using Clock = std::chrono::steady_clock;

// Long enough that this file's healthy collectives (a few floats, nothing computed between them)
// never reach it on a loaded 2-core machine; short, since each case that times out waits for it.
constexpr auto kTimeout = std::chrono::seconds(2);
// The watchdog waits at most min(max(timeout, 1 s), 5 s) for answers; the rest is scheduling.
constexpr auto kLatest = kTimeout + std::chrono::seconds(2) + std::chrono::seconds(15);

class CommWatchdogTest : public testing::Test {
 protected:
  static void SetUpTestSuite() { session_ = new MpiSession(); }
  static void TearDownTestSuite() {
    delete session_;
    session_ = nullptr;
  }

  void SetUp() override {
    if (session_->size() < 2) GTEST_SKIP() << "needs 2 or more ranks (run under mpirun -np 2, 4)";
    device_ = make_cpu_device(std::size_t{64} << 20);
    stream_ = device_->create_stream();
    comm_ = std::make_unique<MpiCommunicator>(session_->world(), *device_,
                                              MpiCommunicator::kMaxChunkElements, kTimeout);
    rank_ = comm_->rank();
    size_ = comm_->size();
    buffer_ = device_->allocate(64, MemoryCategory::buffers);
  }

  void TearDown() override {
    if (!comm_) return;
    // Every rank is done with the test before any communicator goes: a rank still waiting asks
    // the others' watchdogs where they are.
    MPI_Barrier(MPI_COMM_WORLD);
    try {
      stream_->synchronize();
    } catch (const Error&) {
    }
    buffer_ = {};
    comm_.reset();
    stream_.reset();
    device_.reset();
  }

  void all_reduce() {
    comm_->all_reduce(buffer_.data(), buffer_.data(), 4, DType::f32, ReduceOp::sum, *stream_);
  }

  // Runs `blocked` and returns the CommError it raised ("" when it returned), checking it came
  // after the timeout and not much later.
  template <class F>
  std::string error_of(F&& blocked) {
    const auto start = Clock::now();
    try {
      blocked();
    } catch (const CommError& error) {
      const auto took = Clock::now() - start;
      EXPECT_GE(took, kTimeout - std::chrono::milliseconds(100)) << error.what();
      EXPECT_LE(took, kLatest) << error.what();
      return error.what();
    }
    return {};
  }

  static void expect_has(const std::string& text, const std::string& fragment) {
    EXPECT_NE(text.find(fragment), std::string::npos) << "'" << fragment << "' missing from: " << text;
  }

  // The ranks the report names with `state`, whichever way it grouped them ("rank 2: <state>",
  // "ranks 1, 3: <state>"): ranks in one state are grouped by where they wait, and whether a
  // rank has given up on its own wait yet depends on scheduling.
  static std::set<int> ranks_named(const std::string& text, const std::string& state) {
    std::set<int> ranks;
    for (std::size_t at = text.find(": " + state); at != std::string::npos;
         at = text.find(": " + state, at + 1)) {
      const std::size_t begin = text.rfind("rank", at);
      std::istringstream list(text.substr(begin, at - begin));
      std::string word;
      list >> word;  // "rank" or "ranks"
      for (int rank = 0; list >> rank;) {
        ranks.insert(rank);
        list.ignore(1);  // ','
      }
    }
    return ranks;
  }

  static MpiSession* session_;
  std::unique_ptr<Device> device_;
  std::unique_ptr<Stream> stream_;
  std::unique_ptr<MpiCommunicator> comm_;
  DeviceBuffer buffer_;
  int rank_ = 0;
  int size_ = 1;
};

MpiSession* CommWatchdogTest::session_ = nullptr;

// The last rank skips the second of three all_reduces: the others block in #3 and raise, naming
// it as behind; it then waits in a barrier the others never reach (their communicator is
// unusable) and raises too.
TEST_F(CommWatchdogTest, ARankThatSkipsACollectiveIsNamedOnEveryRank) {
  const int skipper = size_ - 1;
  for (int i = 1; i <= 3; ++i)
    if (rank_ != skipper || i != 2) all_reduce();
  const std::string error = error_of([&] { stream_->synchronize(); });
  if (rank_ != skipper) {
    expect_has(error, "all_reduce #3 on rank " + std::to_string(rank_));
    expect_has(error, "not complete after 2 s (comm.timeout)");
    expect_has(error, "rank " + std::to_string(skipper) + ": not in a collective, after 2: behind");
    if (size_ > 2) expect_has(error, "blocked in all_reduce #3 as well");
    expect_has(error, "end the process");
    // Unusable now: the pending collective could match a later one.
    try {
      comm_->barrier();
      ADD_FAILURE() << "barrier after a timeout did not throw";
    } catch (const CommError& again) {
      expect_has(again.what(), "barrier: not started, this communicator is unusable");
    }
  } else {
    EXPECT_EQ(error, "");
    const std::string barrier_error = error_of([&] { comm_->barrier(); });
    expect_has(barrier_error, "barrier #1 on rank " + std::to_string(skipper));
    expect_has(barrier_error, "not in a barrier, after 0: behind");
  }
}

// Rank 0 issues a third all_reduce the others do not; they wait in a barrier meanwhile. Rank 0
// raises naming the others as behind and where they wait; they raise from the barrier.
TEST_F(CommWatchdogTest, ARankThatIssuesOneMoreIsNamedOnEveryRank) {
  for (int i = 1; i <= (rank_ == 0 ? 3 : 2); ++i) all_reduce();
  std::string error;
  if (rank_ == 0) {
    error = error_of([&] { stream_->synchronize(); });
    expect_has(error, "all_reduce #3 on rank 0: not complete after 2 s");
    std::set<int> others;
    for (int rank = 1; rank < size_; ++rank) others.insert(rank);
    EXPECT_EQ(ranks_named(error, "not in a collective, after 2: behind"), others) << error;
    // Where they wait: still in the barrier, or given up on it when both time out together.
    expect_has(error, "barrier #1");
  } else {
    stream_->synchronize();  // its two collectives completed
    error = error_of([&] { comm_->barrier(); });
    expect_has(error, "barrier #1 on rank " + std::to_string(rank_) + ": not complete after 2 s");
    expect_has(error, "rank 0: not in a barrier, after 0: behind");
    expect_has(error, "all_reduce #3");
  }
}

// The agreement before every collective cannot see a skipped collective when the next one has the
// same shape; a mismatch of shape is still reported at once, long before the timeout.
TEST_F(CommWatchdogTest, AMismatchIsStillReportedAtOnce) {
  if (rank_ == 0)
    comm_->all_gather(buffer_.data(), buffer_.data(), 1, DType::f32, *stream_);
  else
    all_reduce();
  const auto start = Clock::now();
  EXPECT_THROW(stream_->synchronize(), CommError);
  EXPECT_LT(Clock::now() - start, kTimeout);
  // The communicator stays usable after a mismatch.
  all_reduce();
  EXPECT_NO_THROW(stream_->synchronize());
}

// A communicator split from this one (split_by_host: every rank here) keeps the timeout but runs no
// responder of its own (the world's one polls MPI for the process): the last rank skips an
// all_reduce on it, and the others raise after the timeout without asking where it is.
TEST_F(CommWatchdogTest, ASplitCommunicatorStillTimesOutWithoutQueryingItsPeers) {
  std::unique_ptr<Communicator> host = comm_->split_by_host();
  ASSERT_EQ(host->size(), size_);
  const int skipper = size_ - 1;
  if (rank_ != skipper) {
    host->all_reduce(buffer_.data(), buffer_.data(), 4, DType::f32, ReduceOp::sum, *stream_);
    const std::string error = error_of([&] { stream_->synchronize(); });
    expect_has(error, "all_reduce #1 on rank " + std::to_string(rank_) + ": not complete after 2 s");
    expect_has(error, "split from another");
    EXPECT_EQ(error.find("behind"), std::string::npos) << error;
  }
  // The timed-out collective cannot be cancelled and may still refer to the split's buffers: the
  // split stays alive for the process, as a program would end after such an error.
  static_cast<void>(host.release());
  MPI_Barrier(MPI_COMM_WORLD);
  // The world's communicator and its watchdog are unaffected.
  all_reduce();
  EXPECT_NO_THROW(stream_->synchronize());
}

TEST(CommWatchdog, ANegativeTimeoutIsRefused) {
  MpiSession session;
  auto device = make_cpu_device(std::size_t{1} << 20);
  EXPECT_THROW(MpiCommunicator(session.world(), *device, MpiCommunicator::kMaxChunkElements,
                               std::chrono::milliseconds(-1)),
               CommError);
}

}  // namespace
}  // namespace zest
