#include "runtime/comm/mpi_session.hpp"

#include <string>

#include <fmt/core.h>

#include "runtime/comm/mpi_check.hpp"
#include "zest/error.hpp"

namespace zest {
namespace {

const char* thread_level_name(int level) {
  switch (level) {
    case MPI_THREAD_SINGLE:
      return "MPI_THREAD_SINGLE";
    case MPI_THREAD_FUNNELED:
      return "MPI_THREAD_FUNNELED";
    case MPI_THREAD_SERIALIZED:
      return "MPI_THREAD_SERIALIZED";
    case MPI_THREAD_MULTIPLE:
      return "MPI_THREAD_MULTIPLE";
    default:
      return "an unknown thread level";
  }
}

// The ranks sharing this host's memory; only needed long enough to count them.
struct LocalComm {
  MPI_Comm comm = MPI_COMM_NULL;
  LocalComm() = default;
  LocalComm(const LocalComm&) = delete;
  LocalComm& operator=(const LocalComm&) = delete;
  ~LocalComm() {
    if (comm != MPI_COMM_NULL) MPI_Comm_free(&comm);
  }
};

}  // namespace

std::vector<int> host_numbers(MPI_Comm comm) {
  int rank = 0, size = 0;
  ZEST_MPI_CHECK(MPI_Comm_rank(comm, &rank));
  ZEST_MPI_CHECK(MPI_Comm_size(comm, &size));
  LocalComm local;
  ZEST_MPI_CHECK(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &local.comm));
  int lowest = rank;  // of this host's ranks: names the host
  ZEST_MPI_CHECK(MPI_Allreduce(&rank, &lowest, 1, MPI_INT, MPI_MIN, local.comm));
  std::vector<int> lowest_of(static_cast<std::size_t>(size));
  ZEST_MPI_CHECK(MPI_Allgather(&lowest, 1, MPI_INT, lowest_of.data(), 1, MPI_INT, comm));
  // A host's lowest rank is the first of its ranks met in rank order: number the hosts as met.
  std::vector<int> host_of_lowest(static_cast<std::size_t>(size), -1), hosts(static_cast<std::size_t>(size));
  int next = 0;
  for (std::size_t r = 0; r < hosts.size(); ++r) {
    int& host = host_of_lowest[static_cast<std::size_t>(lowest_of[r])];
    if (host < 0) host = next++;
    hosts[r] = host;
  }
  return hosts;
}

MpiSession::MpiSession() {
  int finalized = 0;
  ZEST_MPI_CHECK(MPI_Finalized(&finalized));
  if (finalized)
    throw CommError(
        "MPI has already been finalized in this process and cannot be initialized again; keep one "
        "zest::Runtime (one MpiSession) alive for as long as zest is used");

  int initialized = 0;
  ZEST_MPI_CHECK(MPI_Initialized(&initialized));
  int provided = MPI_THREAD_SINGLE;
  if (initialized) {
    ZEST_MPI_CHECK(MPI_Query_thread(&provided));
  } else {
    ZEST_MPI_CHECK(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided));
    initialized_here_ = true;
  }

  try {
    // Stream worker threads issue collectives while the host thread runs, so anything less than
    // MPI_THREAD_MULTIPLE would be undefined behaviour rather than a slowdown.
    if (provided < MPI_THREAD_MULTIPLE) {
      throw CommError(fmt::format(
          "MPI provides {} but zest needs MPI_THREAD_MULTIPLE (its streams issue collectives from worker threads): {}",
          thread_level_name(provided),
          initialized_here_ ? "use an MPI built with thread support (Open MPI: "
                              "--enable-mpi-thread-multiple; MPICH: --enable-threads=multiple)"
                            : "initialize MPI with MPI_Init_thread(..., MPI_THREAD_MULTIPLE, ...) "
                              "or let zest initialize it"));
    }

    ZEST_MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &world_));
    ZEST_MPI_CHECK(MPI_Comm_set_errhandler(world_, MPI_ERRORS_RETURN));
    ZEST_MPI_CHECK(MPI_Comm_rank(world_, &rank_));
    ZEST_MPI_CHECK(MPI_Comm_size(world_, &size_));

    LocalComm local;
    ZEST_MPI_CHECK(
        MPI_Comm_split_type(world_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &local.comm));
    ZEST_MPI_CHECK(MPI_Comm_rank(local.comm, &local_rank_));
    ZEST_MPI_CHECK(MPI_Comm_size(local.comm, &local_size_));
  } catch (...) {
    if (world_ != MPI_COMM_NULL) MPI_Comm_free(&world_);
    if (initialized_here_) MPI_Finalize();
    throw;
  }
}

// Errors are ignored here: a destructor cannot report them, and MPI_ERRORS_RETURN keeps them from
// aborting the job.
MpiSession::~MpiSession() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  if (world_ != MPI_COMM_NULL) MPI_Comm_free(&world_);
  if (initialized_here_) MPI_Finalize();
}

}  // namespace zest
