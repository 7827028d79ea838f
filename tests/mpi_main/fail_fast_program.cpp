// A deliberately failing MPI test, run by fail_fast_test.sh (never by the suite itself): rank 1
// fails an ASSERT before a collective that rank 0 enters, as a real test's rank might. Unless
// mpi_test_main.cpp ends the job, rank 0 waits in the barrier for ever.
#include <gtest/gtest.h>
#include <mpi.h>

TEST(FailFast, ARankThatFailsBeforeACollectiveEndsTheJob) {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  ASSERT_NE(rank, 1) << "rank 1's deliberate failure";
  MPI_Barrier(MPI_COMM_WORLD);
}
