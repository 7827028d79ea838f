// The process's place in the MPI world. Initializes MPI with MPI_THREAD_MULTIPLE (stream worker
// threads issue collectives while the host thread runs) unless the program already did, and then
// finalizes only what it initialized. Without mpirun it is a world of one.
#pragma once

#include <mpi.h>

#include <vector>

namespace zest {

// The host of each rank of `comm` (collective over it): ranks that share memory (MPI_Comm_split_type
// MPI_COMM_TYPE_SHARED) are one host, numbered from 0 in the order of each host's lowest rank.
std::vector<int> host_numbers(MPI_Comm comm);

class MpiSession {
 public:
  MpiSession();
  ~MpiSession();
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  int local_rank() const { return local_rank_; }  // rank among the ranks on this host
  int local_size() const { return local_size_; }
  // A duplicate of MPI_COMM_WORLD owned by zest, with MPI_ERRORS_RETURN, so zest's traffic never
  // matches the program's own and MPI failures become CommError instead of aborting the job.
  MPI_Comm world() const { return world_; }

 private:
  bool initialized_here_ = false;
  MPI_Comm world_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
  int local_rank_ = 0;
  int local_size_ = 1;
};

}  // namespace zest
