// gtest main for tests that run under mpirun (one process per rank; also fine without mpirun).
//
// MPI is initialized here with MPI_THREAD_MULTIPLE, so MpiSessions the tests create find it
// initialized and leave finalizing to this main. Rank 0 prints gtest's usual output; the other
// ranks print only their failures, tagged with the rank. Every rank exits nonzero when any rank
// failed, so mpirun reports the failure whichever rank saw it; a fatal failure on any rank aborts
// the job at once, before the others hang in a collective it left.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdio>

namespace {

// Stands in for gtest's printer on ranks other than 0: silent unless something fails.
class RankFailurePrinter : public testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}

  void OnTestPartResult(const testing::TestPartResult& result) override {
    if (!result.failed()) return;
    std::fprintf(stderr, "[rank %d] %s:%d: Failure\n%s\n", rank_,
                 result.file_name() ? result.file_name() : "unknown file", result.line_number(),
                 result.message());
  }

  void OnTestEnd(const testing::TestInfo& info) override {
    if (info.result()->Failed())
      std::fprintf(stderr, "[rank %d] [  FAILED  ] %s.%s\n", rank_, info.test_suite_name(),
                   info.name());
  }

 private:
  int rank_;
};

// On every rank of a world larger than one: a fatal failure (a failed ASSERT, an exception) ends
// the test on this rank alone, while the others may wait in a collective it will never join, until
// meson's timeout. Aborting the job at once ends the run with the failure printed instead.
class AbortOnFatalFailure : public testing::EmptyTestEventListener {
 public:
  explicit AbortOnFatalFailure(int rank) : rank_(rank) {}

  void OnTestPartResult(const testing::TestPartResult& result) override {
    if (!result.fatally_failed()) return;
    std::fprintf(stderr, "[rank %d] a fatal failure: aborting every rank (the others may be waiting in a "
                 "collective this rank left)\n", rank_);
    std::fflush(stdout);
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 1);
  }

 private:
  int rank_;
};

}  // namespace

int main(int argc, char** argv) {
  int provided = MPI_THREAD_SINGLE;
  if (MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided) != MPI_SUCCESS) {
    std::fprintf(stderr, "MPI_Init_thread failed\n");
    return 1;
  }
  int rank = 0;
  int size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  // The tests would only report MpiSession's CommError; say it once, here, where it is clear.
  if (provided < MPI_THREAD_MULTIPLE && rank == 0)
    std::fprintf(stderr, "warning: this MPI provides thread level %d, not MPI_THREAD_MULTIPLE\n",
                 provided);

  testing::InitGoogleTest(&argc, argv);
  if (rank != 0) {
    testing::TestEventListeners& listeners = testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new RankFailurePrinter(rank));
  }
  // After the printers, so the failure is printed before the job ends.
  if (size > 1) testing::UnitTest::GetInstance()->listeners().Append(new AbortOnFatalFailure(rank));

  const int local_failed = RUN_ALL_TESTS() != 0 ? 1 : 0;
  int any_failed = local_failed;
  MPI_Allreduce(&local_failed, &any_failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (rank == 0 && any_failed && !local_failed)
    std::fprintf(stderr,
                 "[rank 0] all tests passed here, but a test failed on another rank "
                 "(see its [rank N] lines)\n");
  if (rank == 0 && size > 1)
    std::fprintf(stdout, "%d ranks: %s\n", size, any_failed ? "FAILED" : "all passed");
  MPI_Finalize();
  return any_failed;
}
